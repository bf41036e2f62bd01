"""Security on the real stack: authentication, tenant isolation through the API and through
the commands topic (signatures), deactivation, and the proxy's SSRF guard."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from base.settings import Settings
from proxy.app import ProxyApp
from streams.client import CommandClient, ResultWatcher
from streams.partitioner import partition_for
from tests.integration.commands_topic import commands_of, result_of
from tests.integration.test_proxy_delivery import (
    Receiver,
    create_topics,
    fast_settings,
    produce,
    proxies,  # noqa: F401  (fixture)
    read_topic,
    receiver,  # noqa: F401  (fixture)
    start_proxy,
)
from topics.catalog import catalog
from topics.signing import sign_headers

pytestmark = pytest.mark.integration


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def uid(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def two(api_server: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    out = []
    for name in ("alice", "mallory"):
        st, body = api_server.call(
            "POST", "/v1/tenants", key=api_server.admin_key, body={"tenant": uid(name)}
        )
        assert st == 201
        out.append(body)
    return out[0], out[1]


def _create(api_server: Any, acct: dict[str, Any], sid: str) -> None:
    st, res = api_server.call(
        "POST",
        "/v1/schedules",
        key=acct["api_key"],
        body={
            "schedule_id": sid,
            "due": now_ms() + 3_600_000,
            "callback": {"type": "http", "url": "https://h.example/x"},
        },
    )
    assert st == 201, res


def test_authentication_is_required(api_server: Any, two: Any) -> None:
    alice, _ = two
    assert api_server.call("GET", "/v1/schedules/x")[0] == 401
    st, body = api_server.call("GET", "/v1/schedules/x", key="tsk_0000000000000000_" + "a" * 43)
    assert st == 401 and body["error"]["code"] == "unauthenticated"
    assert api_server.call("GET", "/v1/schedules/x", key="garbage")[0] == 401
    # Tenant keys cannot use admin endpoints; the admin key cannot act as a tenant.
    st, body = api_server.call("GET", "/v1/tenants", key=alice["api_key"])
    assert st == 403 and body["error"]["code"] == "admin_required"
    st, body = api_server.call(
        "POST", "/v1/tenants", key=alice["api_key"], body={"tenant": uid("x")}
    )
    assert st == 403
    st, body = api_server.call("GET", "/v1/schedules/x", key=api_server.admin_key)
    assert st == 403 and body["error"]["code"] == "tenant_key_required"
    # X-Api-Key works like the bearer header.
    st, _ = api_server.call(
        "GET", f"/v1/tenants/{alice['tenant']}", headers={"X-Api-Key": alice["api_key"]}
    )
    assert st == 200


def test_a_tenant_cannot_touch_another_tenants_schedules_via_the_api(
    api_server: Any, two: Any
) -> None:
    alice, mallory = two
    sid = uid("secret")
    _create(api_server, alice, sid)
    mk = mallory["api_key"]
    assert api_server.call("GET", f"/v1/schedules/{sid}", key=mk)[0] == 404
    st, res = api_server.call("DELETE", f"/v1/schedules/{sid}", key=mk)
    assert st == 404 and res["code"] == "not_found"
    st, res = api_server.call(
        "PATCH", f"/v1/schedules/{sid}", key=mk, body={"due": now_ms() + 60_000}
    )
    assert st == 404
    lo, hi = now_ms(), now_ms() + 7_200_000
    st, page = api_server.call("GET", f"/v1/schedules?from={lo}&to={hi}", key=mk)
    assert st == 200 and sid not in [s["schedule_id"] for s in page["schedules"]]
    st, res = api_server.call("POST", "/v1/bulk/cancel", key=mk, body={"from": lo, "to": hi})
    assert st == 200 and res["matched"] == 0
    # Another tenant's record is not readable either.
    assert api_server.call("GET", f"/v1/tenants/{alice['tenant']}", key=mk)[0] == 404
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=alice["api_key"])
    assert view["status"] == "scheduled"


def test_a_tenant_cannot_forge_commands_on_the_topic(api_server: Any, two: Any) -> None:
    alice, mallory = two
    sid = uid("victim")
    _create(api_server, alice, sid)
    settings: Settings = api_server.settings
    cancel = orjson.dumps({"type": "cancel", "tenant": alice["tenant"], "schedule_id": sid})
    key = sid.encode()
    client, results = CommandClient(settings), ResultWatcher(settings)
    try:
        # 1. unsigned, 2. signed with mallory's key, 3. alice's key, signed an hour before
        # the broker appended it
        client.send_raw(key, cancel)
        client.send_raw(
            key,
            cancel,
            headers=sign_headers(
                mallory["signing_key"], signed_at_ms=now_ms(), key=key, value=cancel
            ),
        )
        client.send_raw(
            key,
            cancel,
            headers=sign_headers(
                alice["signing_key"], signed_at_ms=now_ms() - 3_600_000, key=key, value=cancel
            ),
        )
        client.flush()
        seen: list[Any] = []
        deadline = time.monotonic() + 60
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += [r for r in results.poll() if r.schedule_id == sid]
        assert [str(r.code) for r in seen] == ["bad_signature"] * 2 + ["stale_command"], seen
        # The real owner's signed cancel works (the signature scheme is not just a wall).
        client.send_raw(
            key,
            cancel,
            headers=sign_headers(
                alice["signing_key"], signed_at_ms=now_ms(), key=key, value=cancel
            ),
        )
        client.flush()
        got = results.wait_for([sid], timeout_s=60)
        assert str(got[sid].code) == "ok"
    finally:
        results.close()


def test_a_reply_another_producer_provokes_does_not_answer_an_api_call(
    api_server: Any, two: Any
) -> None:
    """Mallory reads the API's request id series off the commands topic and, while the
    worker is paused, produces a command of her own (validly signed, her tenant) carrying
    the next request id, just before alice's conflicting create through the API. The worker
    answers hers first, echoing that request id with "ok"; alice must still get her own
    answer, 409 conflict, not 201."""
    alice, mallory = two
    settings: Settings = api_server.settings
    worker = api_server.worker
    assert worker is not None and worker.proc is not None
    sid = uid("taken")
    _create(api_server, alice, sid)
    series, n = orjson.loads(commands_of(settings, sid)[-1].value())["request_id"].rsplit("-", 1)
    key = sid.encode()
    forged = orjson.dumps(
        {
            "type": "create",
            "tenant": mallory["tenant"],
            "schedule_id": sid,
            "request_id": f"{series}-{int(n) + 1}",
            "due": now_ms() + 3_600_000,
            "callback": {"type": "http", "url": "https://h.example/x"},
        }
    )
    spec = catalog(settings.topics).commands
    tp = TopicPartition(spec.name, partition_for(key, spec.partitions))
    watch = Consumer({**settings.kafka.librdkafka(), "group.id": uid("watch")})
    client = CommandClient(settings)
    answer: dict[str, Any] = {}

    def conflicting_create() -> None:
        answer["http"] = api_server.call(
            "POST",
            "/v1/schedules",
            key=alice["api_key"],
            body={
                "schedule_id": sid,
                "due": now_ms() + 7_200_000,
                "callback": {"type": "http", "url": "https://h.example/x"},
            },
            timeout_s=90,
        )

    call = threading.Thread(target=conflicting_create)
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    try:
        client.send_raw(
            key,
            forged,
            headers=sign_headers(
                mallory["signing_key"], signed_at_ms=now_ms(), key=key, value=forged
            ),
        )
        client.flush()
        _, after_forged = watch.get_watermark_offsets(tp, timeout=10)
        call.start()
        deadline = time.monotonic() + 30  # until alice's command is behind mallory's
        while watch.get_watermark_offsets(tp, timeout=10)[1] <= after_forged:
            assert time.monotonic() < deadline, "the API's command never reached Kafka"
            time.sleep(0.05)
    finally:
        os.killpg(worker.proc.pid, signal.SIGCONT)
        watch.close()
    call.join(90)
    status, body = answer["http"]
    assert (status, body["code"]) == (409, "conflict"), (status, body)
    # Mallory's command itself was applied to her own tenant; it answered nobody's call.
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=mallory["api_key"])
    assert st == 200 and view["status"] == "scheduled"


def test_a_signed_update_replayed_later_is_refused(api_server: Any, two: Any) -> None:
    """An update alice signed ten minutes ago, produced again now with its record timestamp
    set to match its signature: the broker's append time is what counts, so it is stale and
    the schedule keeps its due time."""
    alice, _ = two
    settings: Settings = api_server.settings
    sid = uid("late")
    _create(api_server, alice, sid)
    st, before = api_server.call("GET", f"/v1/schedules/{sid}", key=alice["api_key"])
    key = sid.encode()
    signed_at = now_ms() - 600_000
    update = orjson.dumps(
        {
            "type": "update",
            "tenant": alice["tenant"],
            "schedule_id": sid,
            "due": now_ms() + 7_200_000,
        }
    )
    spec = catalog(settings.topics).commands
    producer = Producer(settings.kafka.librdkafka())
    results = ResultWatcher(settings)
    try:
        delivered: list[Any] = []
        producer.produce(
            spec.name,
            key=key,
            value=update,
            timestamp=signed_at,
            partition=partition_for(key, spec.partitions),
            headers=sign_headers(
                alice["signing_key"], signed_at_ms=signed_at, key=key, value=update
            ),
            on_delivery=lambda err, msg: delivered.append(msg),
        )
        producer.flush(30)
        assert delivered and delivered[0].error() is None
        result = result_of(results, sid, delivered[0].offset())
        assert str(result.code) == "stale_command", result
    finally:
        results.close()
    st, after = api_server.call("GET", f"/v1/schedules/{sid}", key=alice["api_key"])
    assert st == 200 and after["due_ms"] == before["due_ms"]


def test_a_signed_update_copied_within_the_window_cannot_revert_a_later_one(
    api_server: Any, two: Any
) -> None:
    """Alice moves a schedule twice through the API; a copy of her first update (value and
    headers exactly as on the topic) produced right after does not move it back."""
    alice, _ = two
    settings: Settings = api_server.settings
    sid = uid("moved")
    _create(api_server, alice, sid)
    first_due, second_due = now_ms() + 7_200_000, now_ms() + 10_800_000
    for due in (first_due, second_due):
        st, res = api_server.call(
            "PATCH", f"/v1/schedules/{sid}", key=alice["api_key"], body={"due": due}
        )
        assert st == 200, res
    captured = next(
        m for m in commands_of(settings, sid) if orjson.loads(m.value()).get("due") == first_due
    )
    client, results = CommandClient(settings), ResultWatcher(settings)
    try:
        client.send_raw(captured.key(), captured.value(), headers=captured.headers())
        client.flush()
        copy = commands_of(settings, sid)[-1]
        assert copy.value() == captured.value() and copy.offset() > captured.offset()
        result = result_of(results, sid, copy.offset())
        assert str(result.code) == "replayed_command", result
    finally:
        results.close()
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=alice["api_key"])
    assert st == 200 and view["due_ms"] == second_due


def test_deactivated_tenant_is_refused_everywhere(api_server: Any) -> None:
    admin = api_server.admin_key
    st, t = api_server.call("POST", "/v1/tenants", key=admin, body={"tenant": uid("gone")})
    assert st == 201
    st, _ = api_server.call(
        "PATCH", f"/v1/tenants/{t['tenant']}", key=admin, body={"active": False}
    )
    assert st == 200
    st, body = api_server.call("GET", "/v1/schedules/x", key=t["api_key"])
    assert st == 403 and body["error"]["code"] == "inactive_tenant"
    # The worker picks the change up from its short-lived cache, without a restart.
    settings: Settings = api_server.settings
    client, results = CommandClient(settings), ResultWatcher(settings)
    try:
        code = None
        deadline = time.monotonic() + 60
        while code != "inactive_tenant" and time.monotonic() < deadline:
            sid = uid("late")
            body_ = orjson.dumps(
                {
                    "type": "create",
                    "tenant": t["tenant"],
                    "schedule_id": sid,
                    "due": now_ms() + 60_000,
                    "callback": {"type": "http", "url": "https://h.example/x"},
                }
            )
            client.send_raw(
                sid.encode(),
                body_,
                headers=sign_headers(
                    t["signing_key"], signed_at_ms=now_ms(), key=sid.encode(), value=body_
                ),
            )
            client.flush()
            got = results.wait_for([sid], timeout_s=30)
            code = str(got[sid].code) if sid in got else None
            time.sleep(0.5)
        assert code == "inactive_tenant"
    finally:
        results.close()


def test_proxy_refuses_internal_targets(
    real_stack: Settings,
    receiver: Receiver,  # noqa: F811
    proxies: list[ProxyApp],  # noqa: F811
) -> None:
    """SSRF: loopback, metadata, private and a name resolving to loopback are refused (and
    dead-lettered at once); the receiver on 127.0.0.1 is never called."""
    fires, dlq, deliveries = (f"ssrf-{n}-{uuid.uuid4().hex[:8]}" for n in ("fires", "dlq", "out"))
    create_topics(real_stack, [fires, dlq, deliveries])
    targets = {
        "loopback": f"http://127.0.0.1:{receiver.port}/hook",
        "metadata": "http://169.254.169.254/latest/meta-data/",
        "private": "http://10.0.0.1/x",
        "v6loop": f"http://[::1]:{receiver.port}/hook",
        "localhost": f"http://localhost:{receiver.port}/hook",
    }

    def trigger(sid: str, url: str) -> bytes:
        return orjson.dumps(
            {
                "trigger_id": f"t-{sid}",
                "schedule_id": sid,
                "tenant": "acme",
                "due_ms": 1_700_000_000_000,
                "emitted_ms": 1_700_000_000_001,
                "attempt": 1,
                "order_key": sid,
                "payload": {"n": sid},
                "callback": {"type": "http", "url": url, "timeout_s": 5},
            }
        )

    produce(real_stack, fires, [(s.encode(), trigger(s, u), None) for s, u in targets.items()])
    ps = fast_settings(
        mode="fires",
        source_topic=fires,
        endpoint_url="",
        dead_letter_topic=dlq,
        deliveries_topic=deliveries,
        allow_private_targets=False,
    )
    start_proxy(real_stack, ps, proxies)
    outcomes = read_topic(real_stack, deliveries, expect=len(targets), timeout_s=60)
    docs = {orjson.loads(m.value())["schedule_id"]: orjson.loads(m.value()) for m in outcomes}
    assert set(docs) == set(targets)
    for sid, doc in docs.items():
        assert doc["outcome"] == "dead_lettered", (sid, doc)
        assert "refuse" in doc["reason"], (sid, doc["reason"])
    assert receiver.hits == []

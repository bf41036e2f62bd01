"""The REST API on the real stack: every native endpoint, through a real worker.

No timing assertions: waits poll for an outcome with a generous deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from base.settings import REPO_ROOT
from tests.integration.conftest import until

pytestmark = pytest.mark.integration


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def uid(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def acct(api_server: Any) -> dict[str, Any]:
    """A tenant registered through the API, with its keys."""
    status, body = api_server.call(
        "POST", "/v1/tenants", key=api_server.admin_key, body={"tenant": uid("t")}
    )
    assert status == 201, body
    return body  # type: ignore[no-any-return]


def create_body(due_ms: int, **extra: Any) -> dict[str, Any]:
    return {
        "due": due_ms,
        "payload": {"hello": "world"},
        "callback": {"type": "http", "url": "https://receiver.example/hook"},
        **extra,
    }


def test_health_ready_and_openapi(api_server: Any) -> None:
    assert api_server.call("GET", "/healthz")[0] == 200
    status, body = api_server.call("GET", "/readyz")
    assert status == 200 and body["checks"] == {"kafka": True, "cassandra": True}
    status, doc = api_server.call("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {
        "/v1/schedules",
        "/v1/schedules/{schedule_id}",
        "/v1/tenants",
        "/v1/bulk/cancel",
        "/v1/bulk/refire",
    } <= set(doc["paths"])


def test_schedule_lifecycle(api_server: Any, acct: dict[str, Any]) -> None:
    key, sid = acct["api_key"], uid()
    due = now_ms() + 3_600_000
    status, res = api_server.call(
        "POST", "/v1/schedules", key=key, body=create_body(due, schedule_id=sid)
    )
    assert status == 201 and res["code"] == "ok" and res["schedule_id"] == sid, res
    # The same create again is an idempotent duplicate; different content a conflict.
    status, res = api_server.call(
        "POST", "/v1/schedules", key=key, body=create_body(due, schedule_id=sid)
    )
    assert status == 200 and res["code"] == "duplicate"
    status, res = api_server.call(
        "POST", "/v1/schedules", key=key, body=create_body(due + 1, schedule_id=sid)
    )
    assert status == 409 and res["code"] == "conflict"

    status, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert status == 200 and view["status"] == "scheduled" and view["due_ms"] == due
    assert view["payload"] == {"hello": "world"}
    # The conflicting create is in the history (a refused command of this schedule); the
    # duplicate is a replay, answered but not recorded again.
    assert [h["event"] for h in view["history"]] == ["created", "command_refused"]

    status, res = api_server.call(
        "PATCH", f"/v1/schedules/{sid}", key=key, body={"payload": {"v": 2}}
    )
    assert status == 200 and res["code"] == "ok"
    new_due = due + 86_400_000
    status, res = api_server.call(
        "POST", f"/v1/schedules/{sid}/reschedule", key=key, body={"due": new_due}
    )
    assert status == 200 and res["code"] == "ok"
    status, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert view["due_ms"] == new_due and view["payload"] == {"v": 2}

    # Listed under the new due time only.
    def listed(lo: int, hi: int) -> list[str]:
        st, page = api_server.call("GET", f"/v1/schedules?from={lo}&to={hi}", key=key)
        assert st == 200, page
        return [s["schedule_id"] for s in page["schedules"]]

    assert sid in listed(new_due - 1000, new_due + 1000)
    assert sid not in listed(due - 1000, due + 1000)

    status, res = api_server.call("DELETE", f"/v1/schedules/{sid}", key=key)
    assert status == 200 and res["code"] == "ok"
    status, res = api_server.call("DELETE", f"/v1/schedules/{sid}", key=key)
    assert status == 200 and res["code"] == "already_cancelled"
    status, res = api_server.call("PATCH", f"/v1/schedules/{sid}", key=key, body={"due": due})
    assert status == 409 and res["code"] == "already_cancelled"
    status, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert view["status"] == "cancelled"
    events = [h["event"] for h in view["history"]]
    # The cancel is the last change; the PATCH refused after it is recorded as such.
    assert [e for e in events if e != "command_refused"][-1] == "cancelled", events
    assert "command_refused" in events[events.index("cancelled") :], events
    _st, page = api_server.call(
        "GET", f"/v1/schedules?from={new_due - 1000}&to={new_due + 1000}&status=scheduled", key=key
    )
    assert sid not in [s["schedule_id"] for s in page["schedules"]]


def test_async_create_answers_202(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]
    status, res = api_server.call(
        "POST", "/v1/schedules?mode=async", key=key, body=create_body(now_ms() + 3_600_000)
    )
    assert status == 202 and res["status"] == "pending"
    sid = res["schedule_id"]
    until(
        lambda: api_server.call("GET", f"/v1/schedules/{sid}", key=key)[0] == 200,
        what="the async create to be applied",
    )


def test_unknown_schedule_is_404(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]
    status, body = api_server.call("GET", "/v1/schedules/nope", key=key)
    assert status == 404 and body["error"]["code"] == "not_found"
    status, res = api_server.call("DELETE", "/v1/schedules/nope", key=key)
    assert status == 404 and res["code"] == "not_found"


def test_pagination_and_status_filter(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]
    base = now_ms() + 7 * 86_400_000
    sids = [uid("p") for _ in range(5)]
    for i, sid in enumerate(sids):
        st, _ = api_server.call(
            "POST", "/v1/schedules", key=key, body=create_body(base + i * 1000, schedule_id=sid)
        )
        assert st == 201
    api_server.call("DELETE", f"/v1/schedules/{sids[2]}", key=key)
    seen: list[str] = []
    cursor = None
    while True:
        q = f"/v1/schedules?from={base}&to={base + 10_000}&limit=2&status=scheduled"
        st, page = api_server.call("GET", q + (f"&cursor={cursor}" if cursor else ""), key=key)
        assert st == 200 and len(page["schedules"]) <= 2
        seen += [s["schedule_id"] for s in page["schedules"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == [sids[0], sids[1], sids[3], sids[4]]


def test_fire_history_and_bulk_refire(api_server: Any, acct: dict[str, Any]) -> None:
    from streams.client import FireWatcher

    key, sid = acct["api_key"], uid("f")
    due = now_ms() + 1500
    st, _ = api_server.call(
        "POST",
        "/v1/schedules",
        key=key,
        body={
            "schedule_id": sid,
            "due": due,
            "payload": {"n": 1},
            "callback": {"type": "kafka", "topic": "api-test-sink"},
        },
    )
    assert st == 201
    view = until(
        lambda: (
            (v := api_server.call("GET", f"/v1/schedules/{sid}", key=key)[1])
            and v["status"] == "fired"
            and v
        ),
        what="the schedule to fire",
    )
    assert "fired" in [h["event"] for h in view["history"]]

    fires = FireWatcher(api_server.settings)
    try:
        st, res = api_server.call(
            "POST",
            "/v1/bulk/refire",
            key=key,
            body={"from": due - 1, "to": due + 1, "status": ["fired"]},
        )
        assert st == 200 and res["refired"] == 1, res
        deadline = time.monotonic() + 30
        again = []
        while not again and time.monotonic() < deadline:
            again = [t for t, _ in fires.poll(0.5) if t.schedule_id == sid]
        assert again and again[0].attempt == 2
    finally:
        fires.close()
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert "refired" in [h["event"] for h in view["history"]]


def test_bulk_cancel(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]
    base = now_ms() + 20 * 86_400_000
    sids = [uid("b") for _ in range(3)]
    for i, sid in enumerate(sids):
        assert (
            api_server.call(
                "POST", "/v1/schedules", key=key, body=create_body(base + i, schedule_id=sid)
            )[0]
            == 201
        )
    st, res = api_server.call(
        "POST", "/v1/bulk/cancel", key=key, body={"from": base, "to": base + 10}
    )
    assert st == 200 and res["matched"] == 3 and res["cancelled"] == 3, res
    for sid in sids:
        assert api_server.call("GET", f"/v1/schedules/{sid}", key=key)[1]["status"] == "cancelled"


def test_tenant_admin_endpoints(api_server: Any, acct: dict[str, Any]) -> None:
    admin = api_server.admin_key
    name = acct["tenant"]
    st, body = api_server.call("POST", "/v1/tenants", key=admin, body={"tenant": name})
    assert st == 409 and body["error"]["code"] == "tenant_exists"
    st, body = api_server.call("GET", "/v1/tenants", key=admin)
    assert st == 200 and name in [t["tenant"] for t in body["tenants"]]
    st, body = api_server.call("GET", f"/v1/tenants/{name}", key=acct["api_key"])
    assert st == 200 and body["signed_commands"] is True and body["active"] is True
    st, body = api_server.call(
        "PATCH", f"/v1/tenants/{name}", key=admin, body={"config": {"max_horizon_s": 10**8}}
    )
    assert st == 200 and body["config"]["max_horizon_s"] == 10**8
    st, body = api_server.call(
        "PATCH", f"/v1/tenants/{name}", key=admin, body={"config": {"create_quota_per_s": "lots"}}
    )
    assert st == 400 and body["error"]["code"] == "invalid_config"
    assert "create_quota_per_s" in body["error"]["message"]
    st, key = api_server.call("POST", f"/v1/tenants/{name}/keys", key=admin)
    assert st == 201 and key["api_key"].startswith("tsk_")
    st, keys = api_server.call("GET", f"/v1/tenants/{name}/keys", key=admin)
    assert key["key_id"] in [k["key_id"] for k in keys["keys"]]
    assert api_server.call("GET", "/v1/schedules/x", key=key["api_key"])[0] == 404
    st, _ = api_server.call("DELETE", f"/v1/tenants/{name}/keys/{key['key_id']}", key=admin)
    assert st == 200
    st, body = api_server.call("GET", "/v1/schedules/x", key=key["api_key"])
    assert st == 401


def test_tenant_policy_rejections(api_server: Any) -> None:
    admin = api_server.admin_key
    st, t = api_server.call(
        "POST",
        "/v1/tenants",
        key=admin,
        body={
            "tenant": uid("pol"),
            "config": {
                "allowed_callback_hosts": ["*.example.com"],
                "max_horizon_s": 3600,
                "max_payload_bytes": 100,
            },
        },
    )
    assert st == 201, t
    key = t["api_key"]

    def post(body: dict[str, Any]) -> tuple[int, Any]:
        return api_server.call("POST", "/v1/schedules", key=key, body=body)  # type: ignore[no-any-return]

    soon = now_ms() + 60_000
    st, r = post({"due": soon, "callback": {"type": "http", "url": "https://evil.test/x"}})
    assert st == 422 and r["code"] == "callback_not_allowed"
    st, r = post({"due": soon, "callback": {"type": "http", "url": "https://a.example.com/x"}})
    assert st == 201, r
    st, r = post(
        {
            "due": now_ms() + 7_200_000,
            "callback": {"type": "http", "url": "https://a.example.com/x"},
        }
    )
    assert st == 422 and r["code"] == "beyond_horizon"
    st, r = post(
        {
            "due": soon,
            "payload": "x" * 200,
            "callback": {"type": "http", "url": "https://a.example.com/x"},
        }
    )
    assert st == 413 and r["code"] == "payload_too_large"
    prefix = api_server.settings.topics.prefix
    st, r = post({"due": soon, "callback": {"type": "kafka", "topic": f"{prefix}commands"}})
    assert st == 422 and r["code"] == "callback_not_allowed"


def test_quota_rejects_and_partition_keeps_flowing(api_server: Any, acct: dict[str, Any]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    admin = api_server.admin_key
    st, t = api_server.call(
        "POST",
        "/v1/tenants",
        key=admin,
        body={"tenant": uid("q"), "config": {"create_quota_per_s": 1}},
    )
    assert st == 201
    due = now_ms() + 3_600_000

    def one(i: int) -> tuple[int, Any]:
        return api_server.call(
            "POST",
            "/v1/schedules",
            key=t["api_key"],  # type: ignore[no-any-return]
            body=create_body(due, schedule_id=f"q{i}"),
        )

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    codes = [r["code"] for _, r in answers]
    assert "quota_exceeded" in codes and "ok" in codes, codes
    assert all(st == 429 for st, r in answers if r["code"] == "quota_exceeded")
    # Other tenants on the same partitions are unaffected.
    st, r = api_server.call("POST", "/v1/schedules", key=acct["api_key"], body=create_body(due))
    assert st == 201, r


def test_malformed_and_oversize_requests(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]

    def err(status: int, body: Any) -> str:
        assert isinstance(body, dict), body
        return str(body.get("error", {}).get("code") or body.get("code"))

    st, b = api_server.call("POST", "/v1/schedules", key=key, raw=b"{not json")
    assert st == 400 and err(st, b) == "malformed_json"
    st, b = api_server.call("POST", "/v1/schedules", key=key, raw=b"[1]")
    assert st == 400 and err(st, b) == "not_an_object"
    st, b = api_server.call("POST", "/v1/schedules", key=key, body={"due": now_ms() + 60_000})
    assert st == 400 and err(st, b) == "missing_field" and "callback" in b["error"]["message"]
    st, b = api_server.call(
        "POST", "/v1/schedules", key=key, body={**create_body(now_ms() + 60_000), "tenant": "other"}
    )
    assert st == 400 and "set by the API" in b["error"]["message"]
    st, b = api_server.call(
        "POST", "/v1/schedules", key=key, body={**create_body(now_ms() + 60_000), "paylod": 1}
    )
    assert st == 400 and "paylod" in b["error"]["message"]
    st, b = api_server.call(
        "POST", "/v1/schedules", key=key, body=create_body("2030-01-01T10:00:00")
    )
    assert st == 400 and err(st, b) == "invalid_due"
    st, b = api_server.call(
        "POST",
        "/v1/schedules",
        key=key,
        body={"due": now_ms() + 60_000, "callback": {"type": "http", "url": "ftp://x/y"}},
    )
    assert st == 400 and err(st, b) == "invalid_url"
    big = {
        "due": now_ms() + 60_000,
        "payload_b64": "A" * 90_000,
        "callback": {"type": "http", "url": "https://h.example/x"},
    }
    st, b = api_server.call("POST", "/v1/schedules", key=key, body=big)
    assert st == 413 and err(st, b) == "payload_too_large"
    st, b = api_server.call("POST", "/v1/schedules", key=key, raw=b" " * 400_000)
    assert st == 413 and err(st, b) == "body_too_large"
    st, b = api_server.call("GET", "/v1/schedules?from=yesterday&to=1", key=key)
    assert st == 400 and "from" in b["error"]["message"]
    st, b = api_server.call("GET", "/v1/schedules?from=1&to=2&limit=0", key=key)
    assert st == 400 and "limit" in b["error"]["message"]
    st, b = api_server.call("GET", "/v1/schedules?from=1&to=2&cursor=zzz", key=key)
    assert st == 400 and "cursor" in b["error"]["message"]
    st, b = api_server.call("GET", "/v1/nothing-here", key=key)
    assert st == 404 and err(st, b) == "no_route"
    st, b = api_server.call("PUT", "/v1/schedules", key=key, body={})
    assert st == 405
    headers = {"X-Big": "x" * 20_000}
    st, _ = api_server.call("GET", "/healthz", headers=headers)
    assert st in (400, 431)


def cli_runner(api_server: Any) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs ``tocsin ARGS...`` as a subprocess on the API server's deployment."""
    import os

    env = dict(
        os.environ,
        TOCSIN_TOPIC_PREFIX=api_server.settings.topics.prefix,
        TOCSIN_CASSANDRA_KEYSPACE=api_server.settings.cassandra.keyspace,
        TOCSIN_COMMAND_PARTITIONS=str(api_server.settings.topics.command_partitions),
        TOCSIN_FIRE_PARTITIONS=str(api_server.settings.topics.fire_partitions),
        TOCSIN_LOG_LEVEL="WARNING",
    )

    def tocsin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tocsin.cli", *args],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return tocsin


def test_cli_tenant_and_schedule_commands(api_server: Any) -> None:
    tocsin = cli_runner(api_server)
    name = uid("cli")
    out = tocsin("tenant", "register", name, "--json", "--create-quota", "100")
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["api_key"].startswith("tsk_") and created["signing_key"].startswith("tss_")
    assert tocsin("tenant", "register", name).returncode == 1
    out = tocsin("tenant", "list", "--json")
    assert name in [r["tenant"] for r in json.loads(out.stdout)]
    due = now_ms() + 3_600_000
    out = tocsin(
        "schedule",
        "create",
        name,
        "c1",
        "--due",
        str(due),
        "--url",
        "https://h.example/x",
        "--payload",
        '{"a": 1}',
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "accepted" in out.stdout
    out = tocsin("schedule", "list", name, "--from", str(due - 1), "--to", str(due + 1), "--json")
    assert out.returncode == 0 and [r["schedule_id"] for r in json.loads(out.stdout)] == ["c1"]
    out = tocsin("schedule", "get", name, "c1", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "scheduled"
    assert tocsin("schedule", "get", name, "missing").returncode == 3
    out = tocsin("schedule", "cancel", name, "missing")
    assert out.returncode == 4 and "not_found" in out.stdout
    assert tocsin("schedule", "cancel", name, "c1").returncode == 0
    assert tocsin("schedule", "list", name, "--from", "garbage", "--to", "1").returncode == 2

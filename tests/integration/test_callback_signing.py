"""Signed callbacks on the real stack: a fires-mode proxy on Kafka delivers to a local HTTP
receiver that checks ``Tocsin-Signature`` with the Python example of docs/proxy.md, run as
written. During a rotation a receiver holding the old secret and one holding the new both
verify; once the old secret is retired (the file rewritten while the proxy runs) the old
one no longer does; a tenant without a secret is delivered unsigned."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from base.settings import Settings
from proxy.app import ProxyApp
from proxy.callback_signing import RELOAD_CHECK_S, SIGNATURE_HEADER, write_secrets_file
from tests.integration.test_proxy_delivery import (
    Hit,
    Receiver,
    create_topics,
    fast_settings,
    produce,
    proxies,
    read_topic,
    receiver,
    start_proxy,
    uid,
)
from tests.unit.test_callback_signing import documented_verify

pytestmark = pytest.mark.integration
__all__ = ["proxies", "receiver"]  # fixtures, imported for pytest to find

NEW = "tcs_new_secret_for_the_integration_test_0001"
OLD = "tcs_old_secret_for_the_integration_test_0002"
# A receiver that cannot verify answers 7xx, so the proxy dead-letters at once.
REFUSED = 700


def test_receivers_verify_the_proxy_signature_through_a_rotation(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp], tmp_path: Path
) -> None:
    fires = f"{stack.topics.prefix}fires-{uid()}"
    deliveries = f"{stack.topics.prefix}deliveries-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [fires, deliveries, dlq])
    secrets = tmp_path / "callback-secrets.json"
    write_secrets_file(secrets, {"acme": [NEW, OLD]})
    verify = documented_verify()
    held = {"/old": OLD, "/new": NEW}  # each receiver holds one secret

    def behave(hit: Hit, n: int) -> Any:
        header = hit.headers.get(SIGNATURE_HEADER)
        if hit.headers["Tocsin-Tenant"] != "acme":
            return 200
        ok = header is not None and verify(header, hit.headers["Tocsin-Trigger-Id"], hit.body,
                                           held[hit.path])  # fmt: skip
        return 200 if ok else REFUSED

    receiver.behave = behave
    base = f"http://127.0.0.1:{receiver.port}"

    def trigger(sid: str, tenant: str, path: str) -> tuple[bytes, bytes, None]:
        doc = {
            "trigger_id": f"t-{sid}",
            "schedule_id": sid,
            "tenant": tenant,
            "due_ms": 1_700_000_000_000,
            "emitted_ms": 1_700_000_000_005,
            "attempt": 1,
            "order_key": sid,
            "payload": {"n": sid, "text": "é"},
            "callback": {"type": "http", "url": base + path, "method": "POST", "timeout_s": 5},
        }
        return (sid.encode(), orjson.dumps(doc), None)

    produce(
        stack,
        fires,
        [
            trigger("s1", "acme", "/old"),
            trigger("s2", "acme", "/new"),
            trigger("s3", "globex", "/new"),
        ],
    )
    ps = fast_settings(
        mode="fires",
        source_topic=fires,
        endpoint_url="",
        dead_letter_topic=dlq,
        deliveries_topic=deliveries,
        signing_secrets_file=str(secrets),
    )
    start_proxy(stack, ps, proxies)

    def outcomes(expect: int) -> dict[str, dict[str, Any]]:
        got = read_topic(stack, deliveries, expect=expect, timeout_s=60)
        return {orjson.loads(m.value())["schedule_id"]: orjson.loads(m.value()) for m in got}

    first = outcomes(3)
    assert {sid: doc["outcome"] for sid, doc in first.items()} == {
        "s1": "delivered",
        "s2": "delivered",
        "s3": "delivered",
    }
    by_schedule = {h.headers["Tocsin-Schedule-Id"]: h for h in receiver.hits}
    assert by_schedule["s1"].headers[SIGNATURE_HEADER].count("v1=") == 2
    assert SIGNATURE_HEADER not in by_schedule["s3"].headers  # no secret: unsigned

    # Retire the old secret while the proxy runs; it looks at the file again at most
    # RELOAD_CHECK_S after its last look, so a trigger sent later is signed with NEW only.
    write_secrets_file(secrets, {"acme": [NEW]})
    time.sleep(RELOAD_CHECK_S + 0.2)
    produce(stack, fires, [trigger("s4", "acme", "/old"), trigger("s5", "acme", "/new")])
    second = outcomes(5)
    assert second["s4"]["outcome"] == "dead_lettered" and second["s4"]["status_code"] == REFUSED
    assert second["s5"]["outcome"] == "delivered"
    hits = {h.headers["Tocsin-Schedule-Id"]: h for h in receiver.hits}
    assert hits["s5"].headers[SIGNATURE_HEADER].count("v1=") == 1


def test_a_required_signature_dead_letters_a_tenant_without_a_secret(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp], tmp_path: Path
) -> None:
    fires = f"{stack.topics.prefix}fires-{uid()}"
    deliveries = f"{stack.topics.prefix}deliveries-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [fires, deliveries, dlq])
    secrets = tmp_path / "callback-secrets.json"
    write_secrets_file(secrets, {"acme": [NEW]})
    url = f"http://127.0.0.1:{receiver.port}/hook"
    records = []
    for sid, tenant in (("r1", "globex"), ("r2", "acme")):
        doc = {
            "trigger_id": f"t-{sid}",
            "schedule_id": sid,
            "tenant": tenant,
            "due_ms": 1_700_000_000_000,
            "emitted_ms": 1_700_000_000_005,
            "attempt": 1,
            "order_key": sid,
            "payload": {"n": sid},
            "callback": {"type": "http", "url": url, "timeout_s": 5},
        }
        records.append((sid.encode(), orjson.dumps(doc), None))
    produce(stack, fires, records)
    ps = fast_settings(
        mode="fires",
        source_topic=fires,
        endpoint_url="",
        dead_letter_topic=dlq,
        deliveries_topic=deliveries,
        signing_secrets_file=str(secrets),
        require_signature=True,
    )
    start_proxy(stack, ps, proxies)
    got = read_topic(stack, deliveries, expect=2, timeout_s=60)
    outcomes = {orjson.loads(m.value())["schedule_id"]: orjson.loads(m.value()) for m in got}
    assert outcomes["r1"]["outcome"] == "dead_lettered"
    assert outcomes["r2"]["outcome"] == "delivered"
    (dead,) = read_topic(stack, dlq, expect=1)
    record = orjson.loads(dead.value())
    assert record["tenant"] == "globex" and record["status_code"] is None
    assert record["reason"].startswith("unsigned: no delivery secret for tenant 'globex'")
    assert NEW not in dead.value().decode()  # no secret in a dead letter
    assert [h.headers["Tocsin-Tenant"] for h in receiver.hits] == ["acme"]

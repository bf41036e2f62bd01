"""Creates answered at Kafka's acknowledgement (topics.admission) on the real stack: an API
and a worker holding the admission key, in a deployment of their own.

No timing assertions: waits poll for an outcome with a generous deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from base.settings import Settings
from tests.integration.conftest import (
    ApiServer,
    WorkerProcess,
    _env_for,
    _ports,
    isolated_stack,
    running_api,
    until,
)

pytestmark = pytest.mark.integration

ADMISSION_KEY = "it-1:" + "s" * 40


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Deployment(ApiServer):
    """The API server of this module, with its worker's environment to restart it."""

    worker_env: dict[str, str]
    worker_log: Path


@pytest.fixture(scope="module")
def admitted(
    real_stack: Settings, tenant: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("admission")
    with isolated_stack(real_stack, "adm") as settings:
        env = _env_for(settings, next(_ports), next(_ports))
        env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"
        env["TOCSIN_ADMISSION_KEY"] = ADMISSION_KEY
        with running_api(settings, tenant, env, logs, make=Deployment) as dep:
            dep.worker_env = env
            dep.worker_log = logs / "worker.log"
            yield dep


def register(dep: Deployment, **config: Any) -> dict[str, Any]:
    st, t = dep.call(
        "POST", "/v1/tenants", key=dep.admin_key, body={"tenant": uid("a"), "config": config}
    )
    assert st == 201, t
    return t  # type: ignore[no-any-return]


def kafka_create(due_ms: int, **extra: Any) -> dict[str, Any]:
    return {
        "due": due_ms,
        "payload": {"n": 1},
        "callback": {"type": "kafka", "topic": "admission-test-sink"},
        **extra,
    }


def fired(dep: Deployment, key: str, sid: str) -> Any:
    return until(
        lambda: (
            (v := dep.call("GET", f"/v1/schedules/{sid}", key=key)[1])
            and isinstance(v, dict)
            and v.get("status") == "fired"
            and v
        ),
        timeout_s=90,
        what=f"schedule {sid} to fire",
    )


def test_an_early_201_is_stored_and_fires(admitted: Deployment) -> None:
    t = register(admitted)
    due = now_ms() + 1500
    st, r = admitted.call("POST", "/v1/schedules", key=t["api_key"], body=kafka_create(due))
    assert st == 201 and r["code"] == "ok" and r["message"].startswith("admitted"), r
    view = fired(admitted, t["api_key"], r["schedule_id"])
    assert [h["event"] for h in view["history"]][:1] == ["created"]
    # A client's own id still waits for the worker's answer (stored when answered).
    sid = uid("own")
    st, r = admitted.call(
        "POST", "/v1/schedules", key=t["api_key"], body=kafka_create(due, schedule_id=sid)
    )
    assert st == 201 and r["message"] == "scheduled", r


def test_a_cancel_right_after_an_early_201_applies_to_it(admitted: Deployment) -> None:
    t = register(admitted)
    st, r = admitted.call(
        "POST", "/v1/schedules", key=t["api_key"], body=kafka_create(now_ms() + 600_000)
    )
    assert st == 201, r
    sid = r["schedule_id"]
    st, c = admitted.call("DELETE", f"/v1/schedules/{sid}", key=t["api_key"])
    assert st == 200 and c["code"] == "ok", c  # not not_found: ordered after the create
    st, v = admitted.call("GET", f"/v1/schedules/{sid}", key=t["api_key"])
    assert st == 200 and v["status"] == "cancelled", v


def test_a_tenant_deactivated_after_its_201_still_gets_it_fired(admitted: Deployment) -> None:
    t = register(admitted)
    # No worker reads the commands topic: the 201 comes from Kafka alone.
    admitted.worker.kill()
    st, r = admitted.call(
        "POST", "/v1/schedules", key=t["api_key"], body=kafka_create(now_ms() + 2000)
    )
    assert st == 201, r
    st, _ = admitted.call(
        "PATCH", f"/v1/tenants/{t['tenant']}", key=admitted.admin_key, body={"active": False}
    )
    assert st == 200
    # The worker comes back to a deactivated tenant and an admitted create of it.
    admitted.worker = WorkerProcess(
        admitted.settings, admitted.worker_env, admitted.worker_log
    ).start()
    # The tenant cannot read it while deactivated: read the store.
    assert until(
        lambda: stored_status(admitted.settings, t["tenant"], r["schedule_id"]) == "fired",
        timeout_s=90,
        what="the admitted create of a deactivated tenant to fire",
    )


def stored_status(settings: Settings, tenant: str, sid: str) -> str | None:
    from api.views import effective_state
    from streams.store import Store

    async def read() -> str | None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            row = await store.get_schedule(tenant, sid)
            return None if row is None else str(effective_state(row))
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_forged_stamp_produced_by_a_tenant_is_decided_in_full(admitted: Deployment) -> None:
    from streams.client import CommandClient, ResultWatcher
    from topics.admission import AdmissionKey, stamp
    from topics.codec import encode_command
    from topics.models import CreateCommand, HttpCallback
    from topics.signing import sign_headers

    t = register(admitted, allowed_callback_hosts=["allowed.example"])
    sid = uid("forged")
    command = CreateCommand(
        tenant=t["tenant"],
        schedule_id=sid,
        due_ms=now_ms() + 600_000,
        callback=HttpCallback(url="https://not-allowed.example/x"),
        misfire_tolerance_s=60,
    )
    key, value = sid.encode(), encode_command(command)
    headers = sign_headers(t["signing_key"], signed_at_ms=now_ms(), key=key, value=value)
    # The tenant guesses the key id and makes up a secret.
    forged = AdmissionKey("it-1", "f" * 40)
    headers.append(stamp(forged, admitted_at_ms=now_ms(), record_key=key, value=value))
    client, results = CommandClient(admitted.settings), ResultWatcher(admitted.settings)
    try:
        client.send_raw(key, value, headers=headers)
        client.flush()
        got = results.wait_for([sid], timeout_s=90)
    finally:
        results.close()
    assert str(got[sid].code) == "callback_not_allowed"

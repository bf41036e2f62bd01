"""Recurring schedules on the real stack with a real worker: runs fire as one-shot triggers
with stable per-run ids; cancel stops future runs; an update applies to runs not fired yet.

No timing assertions: only what fired, with which ids and content, relative to the
moment (``at_ms`` of the result) the worker applied each command.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import orjson

from base.settings import Settings
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.recurring import parse_run_id
from streams.recurring_store import schedule_runs
from tests.integration.conftest import wait_worker_ready
from topics.ids import trigger_id
from topics.models import (
    CancelCommand,
    CreateCommand,
    HttpCallback,
    PayloadType,
    Recurrence,
    UpdateCommand,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def runs_of(fires: FireWatcher, sid: str, until: Any, timeout_s: float) -> dict[int, list[Any]]:
    """nominal ms -> triggers of that run, until ``until(runs)`` holds or the timeout."""
    runs: dict[int, list[Any]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(runs):
        for trig, _ in fires.poll(0.5):
            parsed = parse_run_id(trig.schedule_id)
            if parsed is not None and parsed[0] == sid:
                runs.setdefault(parsed[1], []).append(trig)
    return runs


def rate(sid: str, tenant: str, start_ms: int, payload: dict[str, Any]) -> CreateCommand:
    return CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        request_id=f"r-{sid}",
        payload=orjson.dumps(payload),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=2, start_ms=start_ms),
    )


def test_rate_schedule_fires_runs_with_stable_ids_and_cancel_stops_them(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("rec")
    wait_worker_ready(real_stack, tenant)
    client, results, fires = (
        CommandClient(real_stack),
        ResultWatcher(real_stack),
        FireWatcher(real_stack),
    )
    sid = f"every2-{uuid.uuid4().hex[:8]}"
    start = (now_ms() // 1000 + 3) * 1000
    client.send(rate(sid, tenant, start, {"n": 1}))
    client.flush()
    created = results.wait_for([sid], 30)[sid]
    assert created.code == "ok", created.message

    runs = runs_of(fires, sid, lambda r: len(r) >= 4, timeout_s=60)
    assert len(runs) >= 4, f"only {sorted(runs)} fired"
    for nominal, triggers in runs.items():
        assert (nominal - start) % 2000 == 0 and nominal >= start
        for trig in triggers:
            run = f"{sid}@{nominal}"
            # One stable trigger id per run: the uuid5 of its run id and due time.
            assert trig.schedule_id == run and trig.due_ms == nominal
            assert trig.trigger_id == trigger_id(tenant, run, nominal)
            assert trig.emitted_ms >= trig.due_ms
            assert trig.order_key == sid
            assert orjson.loads(trig.payload) == {"n": 1}
    assert len({t[0].trigger_id for t in runs.values()}) == len(runs)

    # History: past runs with their state, and the next runs computed from the rule.
    history = asyncio.run(_history(real_stack, tenant, sid))
    assert history is not None
    fired_past = [r for r in history["past"] if r["state"] == "fired"]
    assert fired_past, history["past"]
    assert {r["run_id"] for r in fired_past} <= {f"{sid}@{n}" for n in range(start, now_ms(), 2000)}
    nxt = [r["nominal_ms"] for r in history["next"]]
    assert len(nxt) == 5 and all(b - a == 2000 for a, b in itertools.pairwise(nxt))

    client.send(CancelCommand(tenant=tenant, schedule_id=sid, request_id="cx"))
    client.flush()
    cancelled = results.wait_for([sid], 30)[sid]
    assert cancelled.code == "ok", cancelled.message
    # Drain for a while: no run whose nominal time is after the cancel was applied fires.
    later = runs_of(fires, sid, lambda r: False, timeout_s=8)
    assert all(nominal <= cancelled.at_ms for nominal in later), (sorted(later), cancelled.at_ms)
    fires.close()
    results.close()


async def _history(settings: Settings, tenant: str, sid: str) -> Any:
    from streams.store import Store

    store = Store(settings.cassandra)
    await store.connect()
    try:
        return await schedule_runs(store, tenant, sid, now_ms=now_ms(), past=20, upcoming=5)
    finally:
        await store.close()


def test_an_update_applies_to_runs_not_yet_fired(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("rec-upd")
    wait_worker_ready(real_stack, tenant)
    client, results, fires = (
        CommandClient(real_stack),
        ResultWatcher(real_stack),
        FireWatcher(real_stack),
    )
    sid = f"upd-{uuid.uuid4().hex[:8]}"
    start = (now_ms() // 1000 + 3) * 1000
    client.send(rate(sid, tenant, start, {"v": 1}))
    client.flush()
    assert results.wait_for([sid], 30)[sid].code == "ok"
    first = runs_of(fires, sid, lambda r: len(r) >= 1, timeout_s=40)
    assert first, "no run fired"

    client.send(
        UpdateCommand(
            tenant=tenant,
            schedule_id=sid,
            payload=orjson.dumps({"v": 2}),
            payload_type=PayloadType.JSON,
        )
    )
    client.flush()
    updated = results.wait_for([sid], 30)[sid]
    assert updated.code == "ok", updated.message

    def enough(r: dict[int, list[Any]]) -> bool:
        return sum(1 for n in r if n > updated.at_ms) >= 3

    runs = runs_of(fires, sid, enough, timeout_s=40)
    runs.update({n: first[n] + runs.get(n, []) for n in first})
    assert enough(runs), sorted(runs)
    for nominal, triggers in runs.items():
        want = {"v": 2} if nominal > updated.at_ms else {"v": 1}
        for trig in triggers:
            assert orjson.loads(trig.payload) == want, (nominal, updated.at_ms)
    # Same run, same id: the runs keep their schedule's series and ids across the update.
    assert all((n - start) % 2000 == 0 for n in runs)

    client.send(CancelCommand(tenant=tenant, schedule_id=sid))
    client.flush()
    assert results.wait_for([sid], 30)[sid].code == "ok"
    fires.close()
    results.close()

"""Review of fbd9410 (a revoked partition's ticker suspended, resumed when the next
generation gives the partition back): the ticker's in-memory view after a resume must
match what the command agent persisted while it was suspended. The real ticker, command
processor and ``streams.app.Ownership``, with the shared fake store and fake sinks."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

from base.settings import Settings
from streams.app import Worker
from tests.unit.rebalance_rig import DUE, MOVED_TO, Rig, hourly, reschedule
from tests.unit.test_fault_properties import NOW
from tests.unit.test_streams_isolation import record
from tests.unit.test_streams_ticker import row


async def test_a_schedule_moved_later_while_suspended_does_not_fire_at_its_old_time(
    rig: Rig,
) -> None:
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    ticker = await rig.holding(create)
    assert ticker.timeline.get("acme", "moved") is not None  # held in memory

    # Generation 1 ends: the partition is revoked (the consumer still lists it).
    await rig.ownership.revoked({partition}, 1)
    # A command batch running meanwhile (begun, or retrying, after the revocation)
    # reschedules it an hour later. It cannot be answered without a ticker, so it is
    # retried; generation 2 gives the partition back before the retry.
    rig.on_retry.append(rig.ownership.assigned({partition}, 2))
    move = reschedule("moved", 2, MOVED_TO)
    assert await rig.processor.process_until_answered([move]) == []
    assert rig.tickers[partition] is ticker  # resumed, not restarted
    assert rig.codes() == ["ok", "ok"]
    assert rig.store.schedules[("acme", "moved")].due_ms == MOVED_TO

    # The old due time passes: nothing of "moved" may fire now, an hour early.
    await rig.wake_at(ticker, DUE + 1_000, until=lambda: "moved" in rig.fires.ids)
    assert "moved" not in rig.fires.ids


async def test_control_the_same_move_with_a_fresh_ticker_does_not_fire_early(rig: Rig) -> None:
    """The same sequence when the partition comes back in a later generation (a fresh
    ticker reads the buckets): passes, so the test above fails for the resume alone."""
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    ticker = await rig.holding(create)
    await rig.ownership.revoked({partition}, 1)
    rig.on_retry.append(rig.ownership.assigned({partition}, 3))
    assert await rig.processor.process_until_answered([reschedule("moved", 2, MOVED_TO)]) == []
    fresh = rig.tickers[partition]
    assert fresh is not ticker
    await asyncio.wait_for(fresh.ready.wait(), 5)
    await rig.wake_at(fresh, DUE + 1_000, until=lambda: "moved" in rig.fires.ids)
    assert "moved" not in rig.fires.ids


def withdrawn_fired(rig: Rig) -> list[str]:
    """Runs of "r" sent that the update at NOW + 2 s withdrew (nominal time after it)."""
    return [sid for sid in rig.fires.ids if sid.startswith("r@") and int(sid[2:]) > NOW + 2_000]


async def test_runs_withdrawn_by_an_update_while_suspended_do_not_fire_after_resume(
    rig: Rig,
) -> None:
    ticker = await rig.holding_every_10s()
    partition = ticker.partition
    assert len(ticker.timeline) > 0

    rig.now[0] = NOW + 2_000
    await rig.ownership.revoked({partition}, 1)
    # Moved to once an hour while the partition is revoked: answered without a ticker.
    assert await rig.processor.process_until_answered([hourly(2)]) == []
    assert rig.codes() == ["ok"]
    await rig.ownership.assigned({partition}, 2)
    assert rig.tickers[partition] is ticker  # resumed

    # The old recurrence's next run time passes: no run of "r" is due for an hour now.
    await rig.wake_at(ticker, NOW + 10_500, until=lambda: withdrawn_fired(rig))
    assert withdrawn_fired(rig) == []


async def test_control_the_same_update_with_a_fresh_ticker_fires_no_old_run(rig: Rig) -> None:
    """The same sequence with the partition back in a later generation (a fresh ticker
    reads the buckets the update cleared): passes."""
    ticker = await rig.holding_every_10s()
    partition = ticker.partition
    rig.now[0] = NOW + 2_000
    await rig.ownership.revoked({partition}, 1)
    assert await rig.processor.process_until_answered([hourly(2)]) == []
    await rig.ownership.assigned({partition}, 3)
    fresh = rig.tickers[partition]
    assert fresh is not ticker
    await asyncio.wait_for(fresh.ready.wait(), 5)
    await rig.wake_at(fresh, NOW + 10_500, until=lambda: withdrawn_fired(rig))
    assert withdrawn_fired(rig) == []


async def test_a_ticker_suspended_before_reading_its_checkpoint_resumes_cleanly(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    gate = asyncio.Event()
    rig.store.hold("get_checkpoint", gate)  # Cassandra slow: the first read does not answer
    ticker = rig.new_ticker(0)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ticker.fired_before_ms is None
    await ticker.suspend(0.0)  # revoked in G
    gate.set()
    caplog.clear()
    ticker.resume()  # given back in G + 1
    pending = ticker.hand_over(row("s", NOW + 30_000))  # a command's hand-over
    try:
        for _ in range(10):
            await asyncio.sleep(0)
        waiting = [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "").endswith("_hand_over_once_read")
        ]
        crashed = [r for r in caplog.records if r.getMessage() == "task failed; restarting it"]
        assert len(waiting) <= 1  # one hand-over waits for the checkpoint, not a chain
        assert crashed == []
    finally:
        if pending is not None:
            pending.cancel()
        await ticker.stop(timeout_s=0.0)


async def test_a_seek_slower_than_the_request_timeout_still_resumes_the_streams(
    tmp_path: Path,
) -> None:
    settings = Settings.from_env(
        {
            "TOCSIN_STATE_DIR": str(tmp_path),
            "TOCSIN_INLINE_HANDOVER": "0",
            "TOCSIN_SESSION_TIMEOUT_S": "0.05",
            "TOCSIN_WORKER_KAFKA_REQUEST_TIMEOUT_S": "0.05",
        }
    )
    app: Any = Worker(settings).app
    assert list(app.tables) == []  # no tables: recovery only resumes the streams
    consumer = app.consumer
    stalled = asyncio.Event()  # the coordinator answers after the request timeout

    async def perform_seek() -> None:
        await stalled.wait()

    tp = TP(Worker(settings).catalog.commands.name, 0)
    consumer.assignment = lambda: {tp}
    consumer.resume_partitions = lambda tps: None
    consumer.resume_flow = lambda: None
    consumer.perform_seek = perform_seek
    app.flow_control.suspend()  # as Faust's on_partitions_revoked leaves it
    recovery = app.tables.recovery
    with contextlib.suppress(Exception):
        await recovery._resume_streams(generation_id=app.consumer_generation_id)
    stalled.set()
    assert app.flow_control.is_active()

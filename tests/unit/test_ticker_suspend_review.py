"""Review of fbd9410 (a revoked partition's ticker suspended, resumed when the next
generation gives the partition back): the ticker's in-memory view after a resume must
match what the command agent persisted while it was suspended. The real ticker, command
processor and ``streams.app.Ownership``, with the shared fake store and fake sinks."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

from base.settings import Settings
from streams.app import Ownership, Worker
from streams.commands import CommandProcessor, RawCommand
from streams.decisions import decide, parent_commits, plan_extension
from streams.model import BucketRow, ScheduleRow
from streams.partitioner import partition_for
from streams.ticker import PartitionTicker, TickerConfig
from tests.unit.test_fault_properties import NOW, PARTITIONS, SECRET, FakeSink, FakeStore
from tests.unit.test_streams_handover import HeldSinkById
from tests.unit.test_streams_isolation import record
from tests.unit.test_streams_pause import At
from tests.unit.test_streams_ticker import row
from topics.codec import decode_result, encode_command
from topics.models import CreateCommand, HttpCallback, PayloadType, Recurrence, UpdateCommand
from topics.signing import sign_headers
from topics.validation import Limits

DUE = NOW + 30_000  # inside the loaded window (held in memory by the ticker)
MOVED_TO = NOW + 3_600_000  # beyond the ticker's offer window: its minute is not loaded


def reschedule(sid: str, offset: int, due_ms: int) -> RawCommand:
    """A signed update moving ``sid`` to ``due_ms`` (same partition as ``record(sid)``)."""
    base = record(sid, offset)
    value = encode_command(UpdateCommand(tenant="acme", schedule_id=sid, due_ms=due_ms))
    return replace(
        base,
        value=value,
        headers=sign_headers(SECRET, signed_at_ms=NOW, key=base.key, value=value),
    )


class Rig:
    """One worker's tickers (Ownership) and command processor sharing one fake store, the
    consumer's assignment still listing the partition between revocation and assignment
    (aiokafka keeps it until the join completes: streams.app's ``assigned``)."""

    def __init__(self) -> None:
        self.now = [NOW]
        self.store = FakeStore()
        self.store.checkpoint_ms = NOW - 1_000
        self.fires = HeldSinkById()
        self.results = FakeSink()
        self.tickers: dict[int, PartitionTicker] = {}
        self.ownership = Ownership(tickers=self.tickers, start=self._new, release_wait_s=0.0)
        self.on_retry: list[Any] = []  # coroutines run at the processor's next back-off
        self.processor = CommandProcessor(
            store=self.store,
            sink=self.results,
            tickers=self.tickers,
            results_topic="t.command-results",
            partitions=PARTITIONS,
            limits=Limits(),
            clock_ms=lambda: self.now[0],
            assigned=lambda partition: True,
            sleep=self._sleep,
        )
        self.processor.unwithdrawn = self.ownership.unwithdrawn  # as the worker wires it

    def _new(self, partition: int) -> PartitionTicker:
        ticker = PartitionTicker(
            partition,
            store=self.store,
            sink=self.fires,
            config=TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0),
            clock_ms=lambda: self.now[0],
        )
        ticker.start()
        return ticker

    async def _sleep(self, seconds: float) -> None:
        while self.on_retry:
            await self.on_retry.pop(0)
        await asyncio.sleep(0)

    def codes(self) -> list[str]:
        return [str(decode_result(v).code) for _, _, v in self.results.sent]

    async def close(self) -> None:
        going = [*self.tickers.values(), *self.ownership.suspended.values()]
        self.tickers.clear()
        self.ownership.suspended.clear()
        await asyncio.gather(*(t.stop(timeout_s=0.0) for t in going))


@pytest.fixture
async def rig() -> Any:
    r = Rig()
    yield r
    await r.close()


async def test_a_schedule_moved_later_while_suspended_does_not_fire_at_its_old_time(
    rig: Rig,
) -> None:
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    await rig.ownership.assigned({partition}, 1)
    ticker = rig.tickers[partition]
    await asyncio.wait_for(ticker.ready.wait(), 5)
    assert await rig.processor.process_until_answered([create]) == []
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
    rig.now[0] = DUE + 1_000
    ticker._wake.set()
    for _ in range(50):
        if "moved" in rig.fires.ids:
            break
        await asyncio.sleep(0.01)
    assert "moved" not in rig.fires.ids


async def test_control_the_same_move_with_a_fresh_ticker_does_not_fire_early(rig: Rig) -> None:
    """The same sequence when the partition comes back in a later generation (a fresh
    ticker reads the buckets): passes, so the test above fails for the resume alone."""
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    await rig.ownership.assigned({partition}, 1)
    ticker = rig.tickers[partition]
    await asyncio.wait_for(ticker.ready.wait(), 5)
    assert await rig.processor.process_until_answered([create]) == []
    await rig.ownership.revoked({partition}, 1)
    rig.on_retry.append(rig.ownership.assigned({partition}, 3))
    assert await rig.processor.process_until_answered([reschedule("moved", 2, MOVED_TO)]) == []
    fresh = rig.tickers[partition]
    assert fresh is not ticker
    await asyncio.wait_for(fresh.ready.wait(), 5)
    rig.now[0] = DUE + 1_000
    fresh._wake.set()
    for _ in range(50):
        if "moved" in rig.fires.ids:
            break
        await asyncio.sleep(0.01)
    assert "moved" not in rig.fires.ids


def every_10s(partition: int) -> tuple[ScheduleRow, list[BucketRow]]:
    """Tenant acme's recurring parent "r", every 10 s from NOW, and its runs written up to
    NOW + 600 s (as its materialiser leaves them)."""
    create = CreateCommand(
        tenant="acme",
        schedule_id="r",
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://h.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=10, start_ms=NOW),
    )
    at = At(1, timestamp_ms=NOW, partition=partition)
    d = decide(create, None, at, now_ms=NOW, shards=1, default_tolerance_s=3600, firing=False)
    assert d.change is not None
    ext = plan_extension(
        [d.change.row], now_ms=NOW, horizon_ms=600_000, shards=1, max_runs=500, late_budget=500
    )
    [(row, _)] = parent_commits(ext.steps, now_ms=NOW, horizon_ms=600_000)
    return row, [r for s in ext.steps for r in s.runs]


def withdrawn_fired(rig: Rig) -> list[str]:
    """Runs of "r" sent that the update at NOW + 2 s withdrew (nominal time after it)."""
    return [sid for sid in rig.fires.ids if sid.startswith("r@") and int(sid[2:]) > NOW + 2_000]


def hourly(offset: int) -> RawCommand:
    """A signed update of "r" to once an hour."""
    key = b"r"
    value = encode_command(
        UpdateCommand(
            tenant="acme", schedule_id="r", recurrence=Recurrence(every_s=3600, start_ms=NOW)
        )
    )
    return replace(
        record("r", offset),
        key=key,
        value=value,
        partition=partition_for(key, PARTITIONS),
        headers=sign_headers(SECRET, signed_at_ms=NOW, key=key, value=value),
    )


async def test_runs_withdrawn_by_an_update_while_suspended_do_not_fire_after_resume(
    rig: Rig,
) -> None:
    partition = partition_for(b"r", PARTITIONS)
    parent, runs = every_10s(partition)
    rig.store.schedules[("acme", "r")] = parent
    await rig.store.write_runs(runs, now_ms=NOW)
    await rig.ownership.assigned({partition}, 1)
    ticker = rig.tickers[partition]
    await asyncio.wait_for(ticker.ready.wait(), 5)
    for run in runs:
        if run.due_ms > NOW + 1_000:
            ticker.hand_over(run)  # the materialiser's hand-over (1. in its step)
    assert len(ticker.timeline) > 0

    rig.now[0] = NOW + 2_000
    await rig.ownership.revoked({partition}, 1)
    # Moved to once an hour while the partition is revoked: answered without a ticker.
    assert await rig.processor.process_until_answered([hourly(2)]) == []
    assert rig.codes() == ["ok"]
    await rig.ownership.assigned({partition}, 2)
    assert rig.tickers[partition] is ticker  # resumed

    # The old recurrence's next run time passes: no run of "r" is due for an hour now.
    rig.now[0] = NOW + 10_500
    ticker._wake.set()
    for _ in range(50):
        if withdrawn_fired(rig):
            break
        await asyncio.sleep(0.01)
    assert withdrawn_fired(rig) == []


async def test_control_the_same_update_with_a_fresh_ticker_fires_no_old_run(rig: Rig) -> None:
    """The same sequence with the partition back in a later generation (a fresh ticker
    reads the buckets the update cleared): passes."""
    partition = partition_for(b"r", PARTITIONS)
    parent, runs = every_10s(partition)
    rig.store.schedules[("acme", "r")] = parent
    await rig.store.write_runs(runs, now_ms=NOW)
    await rig.ownership.assigned({partition}, 1)
    ticker = rig.tickers[partition]
    await asyncio.wait_for(ticker.ready.wait(), 5)
    for run in runs:
        if run.due_ms > NOW + 1_000:
            ticker.hand_over(run)
    rig.now[0] = NOW + 2_000
    await rig.ownership.revoked({partition}, 1)
    assert await rig.processor.process_until_answered([hourly(2)]) == []
    await rig.ownership.assigned({partition}, 3)
    fresh = rig.tickers[partition]
    assert fresh is not ticker
    await asyncio.wait_for(fresh.ready.wait(), 5)
    rig.now[0] = NOW + 10_500
    fresh._wake.set()
    for _ in range(50):
        if withdrawn_fired(rig):
            break
        await asyncio.sleep(0.01)
    assert withdrawn_fired(rig) == []


async def test_a_ticker_suspended_before_reading_its_checkpoint_resumes_cleanly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [NOW]
    store = FakeStore()
    store.checkpoint_ms = NOW - 1_000
    gate = asyncio.Event()
    store.hold("get_checkpoint", gate)  # Cassandra slow: the first read does not answer
    ticker = PartitionTicker(
        0,
        store=store,
        sink=HeldSinkById(),
        config=TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0),
        clock_ms=lambda: now[0],
    )
    ticker.start()
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

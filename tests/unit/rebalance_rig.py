"""One worker's tickers across consumer-group rebalances, for the unit tests of a suspended
partition's ticker (test_ticker_suspend_review, test_ownership_resume): the real ticker,
command processor and ``streams.app.Ownership`` over the shared fake store and fake sinks,
and the commands and schedules those tests move and update."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest

from streams.app import Ownership
from streams.commands import CommandProcessor, RawCommand
from streams.decisions import decide, parent_commits, plan_extension
from streams.model import BucketRow, ScheduleRow
from streams.partitioner import partition_for
from streams.ticker import PartitionTicker, TickerConfig
from tests.unit.test_fault_properties import NOW, PARTITIONS, SECRET, FakeSink, FakeStore
from tests.unit.test_streams_handover import HeldSinkById
from tests.unit.test_streams_isolation import record
from tests.unit.test_streams_pause import At
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
        self.ownership = Ownership(tickers=self.tickers, start=self.new_ticker, release_wait_s=0.0)
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

    def new_ticker(self, partition: int) -> PartitionTicker:
        """A started ticker of ``partition`` over the rig's store, sink and clock."""
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

    async def holding(self, create: RawCommand) -> PartitionTicker:
        """The ticker of ``create``'s partition, assigned here in generation 1 and ready,
        with ``create`` answered."""
        await self.ownership.assigned({create.partition}, 1)
        ticker = self.tickers[create.partition]
        await asyncio.wait_for(ticker.ready.wait(), 5)
        assert await self.processor.process_until_answered([create]) == []
        return ticker

    async def holding_every_10s(self) -> PartitionTicker:
        """The ticker of "r"'s partition (``every_10s``), assigned here in generation 1 and
        ready, holding the runs due after NOW + 1 s (its materialiser's hand-over)."""
        partition = partition_for(b"r", PARTITIONS)
        parent, runs = every_10s(partition)
        self.store.schedules[("acme", "r")] = parent
        await self.store.write_runs(runs, now_ms=NOW)
        await self.ownership.assigned({partition}, 1)
        ticker = self.tickers[partition]
        await asyncio.wait_for(ticker.ready.wait(), 5)
        for run in runs:
            if run.due_ms > NOW + 1_000:
                ticker.hand_over(run)  # the materialiser's hand-over (1. in its step)
        return ticker

    async def wake_at(
        self, ticker: PartitionTicker, now_ms: int, until: Callable[[], object]
    ) -> None:
        """Move the clock to ``now_ms`` and wake ``ticker``; give it up to 0.5 s, less if
        ``until`` comes true (what it fires is then the test's to check)."""
        self.now[0] = now_ms
        ticker._wake.set()
        for _ in range(50):
            if until():
                break
            await asyncio.sleep(0.01)

    def codes(self) -> list[str]:
        return [str(decode_result(v).code) for _, _, v in self.results.sent]

    async def close(self) -> None:
        going = [*self.tickers.values(), *self.ownership.suspended.values()]
        self.tickers.clear()
        self.ownership.suspended.clear()
        await asyncio.gather(*(t.stop(timeout_s=0.0) for t in going))


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig()
    yield r
    await r.close()

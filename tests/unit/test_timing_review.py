"""Review of the worker timing changes of issue 21 (0d5640b, 3da3300, aba6364): holes found,
each a test that failed on the code it was written against. Time is a fake clock; what is
asserted is what is emitted and written, never how long anything took."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from cassandra.query import UNSET_VALUE

from base.settings import CassandraSettings, KafkaSettings
from streams import emitter as emitter_module
from streams.deliveries import record_outcomes
from streams.emitter import Emitter
from streams.model import Stmt
from streams.store import Store
from streams.tenants import TenantConfig
from streams.ticker import PartitionTicker, TickerConfig
from tests.fakes import FakeStore
from tests.unit.test_emitter_poll import FakeProducer
from tests.unit.test_streams_ticker import FakeSink, row, running, settle
from tests.unit.test_ticker_idle import MINUTE, PRELOAD_MS, M, entry, idle_ticker, until
from topics.models import DeliveryOutcome


async def test_a_trigger_acked_but_unrecorded_at_a_write_is_passed_by_the_next_write() -> None:
    """A checkpoint written while a trigger is acknowledged but not yet recorded stays below
    it, yet counted it as fired: once it is recorded and the partition idle, the next write
    of the same minute was skipped ('nothing fired since'), so the stored checkpoint stayed
    below a trigger fired and recorded, and a successor fired it again."""
    now = [M + 10_000]
    ticker, store, sink = idle_ticker(now)
    fired = row("fired", M + 9_000)
    await store.write_buckets(put=[fired], now_ms=M)
    ticker._hold(fired)
    ticker.timeline.pop_due(now[0], limit=10)
    ticker._dispatch(entry(fired), now[0])
    sink.sent[0][1].set_result((0, 0))  # acknowledged; its record still to be written
    await settle()
    await ticker._write_checkpoint()
    assert store.checkpoint_ms == fired.due_ms  # held below it, as it must be
    marker = asyncio.create_task(ticker._mark_loop())
    await until(lambda: not ticker._inflight)
    assert store.fired == ["fired"]
    now[0] += 1_000
    await ticker._write_checkpoint()
    marker.cancel()
    # SIGKILL now: the successor starts from the stored checkpoint.
    successor_sink = FakeSink()
    successor = await running(
        PartitionTicker(
            0,
            store=store,
            sink=successor_sink,
            config=TickerConfig(fire_topic="fires", owner="b", preload_ahead_ms=PRELOAD_MS),
            clock_ms=lambda: now[0],
        )
    )
    await settle()
    assert successor_sink.sent == []
    assert store.checkpoint_ms is not None and store.checkpoint_ms > fired.due_ms
    await successor.stop(0)


async def test_after_a_fire_the_idle_loop_writes_the_checkpoint_before_its_long_sleep() -> None:
    """A trigger fires just before the preload point; once it is recorded the ticker holds
    nothing. The turn that starts the next minute's read came within a second of the last
    checkpoint write, so it wrote none, and the loop then slept until the next minute's
    read: the stored checkpoint stayed below the fired trigger for a minute (a successor
    re-fires it), where it used to pass it within about a second."""
    now = [M + 49_500]
    store, sink = FakeStore(checkpoint_ms=M + 49_000), FakeSink()
    fired = row("fired", M + 49_600)
    await store.write_buckets(put=[fired], now_ms=M)
    ticker = await running(
        PartitionTicker(
            0,
            store=store,
            sink=sink,
            config=TickerConfig(fire_topic="fires", owner="a", preload_ahead_ms=PRELOAD_MS),
            clock_ms=lambda: now[0],
        )
    )
    await until(lambda: ticker.asleep_until_ms == fired.due_ms)
    now[0] = fired.due_ms
    await until(lambda: bool(sink.sent))
    sink.sent[0][1].set_result((0, 0))
    await until(lambda: store.fired == ["fired"] and not ticker._inflight)
    assert store.checkpoint_ms is not None and store.checkpoint_ms <= fired.due_ms
    # The preload point: the next minute is read (empty), nothing is held any more.
    now[0] = M + MINUTE - PRELOAD_MS
    await until(lambda: store.count("read_bucket") == 2 and not ticker._loading())
    await until(lambda: ticker.asleep_until_ms is not None)
    # More than a checkpoint interval later the stored checkpoint has passed the trigger.
    now[0] += 1_500
    await until(lambda: (store.checkpoint_ms or 0) > fired.due_ms)
    await ticker.stop(0)


class BatchTimestamps:
    """Cassandra's reconciliation for ``record_delivery`` updates: every statement of one
    batch carries the batch's timestamp unless it has its own (``USING TIMESTAMP``); of two
    writes to one cell the later timestamp wins and, at equal timestamps, the greater
    value."""

    def __init__(self) -> None:
        self.ts = 0
        self.cells: dict[tuple[str, str, str], tuple[int, Any]] = {}

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None:
        self.ts += 1
        for stmt_name, params in statements:
            if stmt_name != "record_delivery":
                continue
            _ttl, own_ts, *values, tenant, schedule_id = params
            ts = self.ts if own_ts is UNSET_VALUE else own_ts
            for column, value in zip(("outcome", "status", "attempts", "at"), values, strict=True):
                if value is UNSET_VALUE:
                    continue
                key = (tenant, schedule_id, column)
                if key not in self.cells or (ts, value) > self.cells[key]:
                    self.cells[key] = (ts, value)

    def row(self, tenant: str, schedule_id: str) -> dict[str, Any]:
        return {
            c: self.cells[(tenant, schedule_id, c)][1]
            for c in ("outcome", "status", "attempts", "at")
        }


class Tenants:
    def peek(self, tenant: str) -> TenantConfig | None:
        return TenantConfig()

    async def config(self, tenant: str) -> TenantConfig:
        return TenantConfig()


def outcome(kind: DeliveryOutcome, status: int, attempts: int, at_ms: int) -> dict[str, Any]:
    at = "delivered_ms" if kind == DeliveryOutcome.DELIVERED else "dead_lettered_ms"
    return {
        "outcome": str(kind),
        "tenant": "acme",
        "schedule_id": "every-minute",
        "trigger_id": f"t{at_ms}",
        "due_ms": at_ms - 100,
        "attempts": attempts,
        "status_code": status,
        at: at_ms,
    }


async def test_two_outcomes_of_one_schedule_in_one_batch_leave_the_later_one() -> None:
    """A recurring schedule's run delivered and its next run dead-lettered, read in one
    batch of the deliveries topic (a backlog): their status updates went into one unlogged
    batch, so one timestamp, and Cassandra kept the greater value of each cell: 'delivered'
    with the dead letter's status 500 and 5 attempts, a status no outcome had. One by one
    (before 0d5640b) the later outcome's request came later and won whole."""
    store = Store(CassandraSettings(), commit_group_size=16)
    cassandra = BatchTimestamps()
    store.run_together = cassandra.run_together  # type: ignore[method-assign]
    first = outcome(DeliveryOutcome.DELIVERED, 200, 1, 60_000)
    later = outcome(DeliveryOutcome.DEAD_LETTERED, 500, 5, 120_000)
    await record_outcomes(store, Tenants(), [first, later])
    assert cassandra.row("acme", "every-minute") == {
        "outcome": DeliveryOutcome.DEAD_LETTERED,
        "status": 500,
        "attempts": 5,
        "at": 120_000,
    }


async def test_the_delivery_report_thread_outlives_a_failed_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka's poll re-raises what a Python callback of its raised (its logger's, for
    one). The thread that serves the delivery reports ended on it, silently, and from then
    on no send's future was settled: every trigger stayed in flight, holding its ticker's
    checkpoint, for good."""
    made: list[FakeProducer] = []

    def make(config: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(config))
        return made[-1]

    monkeypatch.setattr(emitter_module, "Producer", make)
    emitter = Emitter(KafkaSettings())
    producer = made[0]
    real_poll, failures = producer.poll, [RuntimeError("a callback raised")]

    def poll(timeout: float) -> int:
        if failures:
            raise failures.pop()
        return real_poll(timeout)

    producer.poll = poll  # type: ignore[method-assign]
    emitter.start()
    sent = emitter.send("fires", key=b"k", value=b"v")
    assert await asyncio.wait_for(sent, 5) == (0, 0)
    await emitter.close()

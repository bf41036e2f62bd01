"""Which tickers ``streams.app.Ownership`` resumes after a rebalance, and what a command
sees meanwhile: a resumed ticker must hold what the store holds (the fixes for the review
of fbd9410 in tests/unit/test_ticker_suspend_review.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

from faust.types import TP

from base.settings import Settings
from streams.app import Worker, commands_assigned
from streams.ticker import PartitionTicker
from tests.unit.rebalance_rig import DUE, MOVED_TO, Rig, reschedule
from tests.unit.test_fault_properties import PARTITIONS
from tests.unit.test_streams_isolation import record


async def test_a_ticker_suspended_before_reading_its_checkpoint_is_replaced_not_resumed(
    rig: Rig,
) -> None:
    gate = asyncio.Event()
    rig.store.hold("get_checkpoint", gate)  # Cassandra slow at the ticker's start
    await rig.ownership.assigned({0}, 1)
    first = rig.tickers[0]
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.fired_before_ms is None  # its checkpoint read has not answered
    await rig.ownership.revoked({0}, 1)
    gate.set()
    await rig.ownership.assigned({0}, 2)  # the next generation: would be a resume
    fresh = rig.tickers[0]
    assert fresh is not first
    assert rig.ownership.suspended == {}
    await asyncio.wait_for(fresh.ready.wait(), 5)
    assert fresh.begun


def every_partition(rig: Rig) -> None:
    """The rig's command processor asks the worker's rule (``commands_assigned``), with a
    consumer that lists every partition throughout (aiokafka keeps the assignment until the
    rejoin completes)."""
    assignment = {TP("commands", p) for p in range(PARTITIONS)}
    rig.processor.assigned = commands_assigned(lambda: assignment, "commands", rig.ownership)


async def test_a_command_of_a_suspended_partition_is_left_and_replayed_on_the_resumed_ticker(
    rig: Rig,
) -> None:
    """The rule: a suspended partition does not count as assigned, so its commands are left
    unanswered (not applied, not committed) and replayed once it is back; the resumed
    ticker withdraws what they replace as a running ticker does."""
    every_partition(rig)
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    ticker = await rig.holding(create)

    await rig.ownership.revoked({partition}, 1)
    move = reschedule("moved", 2, MOVED_TO)
    # Left at once (bounded: without the rule it is retried until a ticker runs).
    assert await asyncio.wait_for(rig.processor.process_until_answered([move]), 5) == [move]
    assert rig.codes() == ["ok"]
    assert rig.store.schedules[("acme", "moved")].due_ms == DUE  # not applied
    assert rig.ownership.owed == {}

    await rig.ownership.assigned({partition}, 2)
    assert rig.tickers[partition] is ticker  # resumed
    # Faust seeks the partition back to its committed offset: the command comes again.
    assert await rig.processor.process_until_answered([move]) == []
    assert rig.codes() == ["ok", "ok"]
    assert rig.store.schedules[("acme", "moved")].due_ms == MOVED_TO

    await rig.wake_at(ticker, DUE + 1_000, until=lambda: "moved" in rig.fires.ids)
    assert "moved" not in rig.fires.ids


async def test_withdrawals_owed_to_a_partition_are_paid_to_a_fresh_ticker_before_it_loads(
    rig: Rig,
) -> None:
    """The belt when the partition comes back in a later generation (a fresh ticker): the
    command's write has not landed when the fresh ticker reads the bucket, so the read
    brings the old version; the withdrawal owed refuses it."""
    create = record("moved", 1, due_ms=DUE)
    partition = create.partition
    ticker = await rig.holding(create)
    await rig.ownership.revoked({partition}, 1)

    landed = asyncio.Event()
    rig.store.hold("apply_schedule_changes", landed)  # the move's write is slow
    move = asyncio.ensure_future(
        rig.processor.process_until_answered([reschedule("moved", 2, MOVED_TO)])
    )
    for _ in range(10):
        await asyncio.sleep(0)
    assert not move.done()
    assert list(rig.ownership.owed) == [partition]
    await rig.ownership.assigned({partition}, 3)  # a later generation: fresh
    fresh = rig.tickers[partition]
    assert fresh is not ticker
    await asyncio.wait_for(fresh.ready.wait(), 5)  # read the old row of "moved"
    landed.set()
    assert await asyncio.wait_for(move, 5) == []
    assert rig.store.schedules[("acme", "moved")].due_ms == MOVED_TO

    await rig.wake_at(fresh, DUE + 1_000, until=lambda: "moved" in rig.fires.ids)
    assert "moved" not in rig.fires.ids


async def test_the_worker_counts_a_suspended_partition_as_not_assigned(tmp_path: Path) -> None:
    settings = Settings.from_env({"TOCSIN_STATE_DIR": str(tmp_path)})
    worker = Worker(settings)
    topic = worker.catalog.commands.name
    worker.app.consumer.assignment = lambda: {TP(topic, 0), TP(topic, 1)}
    assert worker.processor.assigned is not None
    assert worker.processor.assigned(0) and worker.processor.assigned(1)
    worker.ownership.suspended[0] = cast(PartitionTicker, object())
    assert not worker.processor.assigned(0)
    assert worker.processor.assigned(1)
    assert worker.processor.unwithdrawn == worker.ownership.unwithdrawn

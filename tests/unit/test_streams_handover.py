"""The hand-over of a written schedule from the command agent to its partition's ticker: a
command is answered (and so its offset committed) before its trigger is in Kafka only if a
successor starting from any checkpoint this ticker has read or written would still read
its bucket row (fake store and sinks; the ticker is the real one)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from streams.commands import CommandProcessor
from streams.ticker import PartitionTicker, TickerConfig
from tests.unit.test_fault_properties import NOW, PARTITIONS, FakeSink, FakeStore
from tests.unit.test_streams_isolation import record
from tests.unit.test_streams_ticker import FakeSink as HeldSink
from tests.unit.test_streams_ticker import FakeStore as TickerStore
from tests.unit.test_streams_ticker import StoredCheckpoint, row, running, settle
from topics.codec import decode_result, decode_trigger
from topics.validation import Limits


class HeldSinkById(HeldSink):
    """Also keeps the schedule id of each trigger sent (its key is the order key)."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        self.ids.append(decode_trigger(value).schedule_id)
        return super().send(topic, key=key, value=value, headers=headers)

    def ack(self, schedule_id: str) -> None:
        self.sent[self.ids.index(schedule_id)][1].set_result((0, 0))


def ticker_for(
    partition: int, now: list[int], store: Any = None
) -> tuple[PartitionTicker, HeldSinkById]:
    fires = HeldSinkById()  # the test decides when Kafka acknowledges a trigger
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = PartitionTicker(
        partition, store=store or TickerStore(), sink=fires, config=config, clock_ms=lambda: now[0]
    )
    return ticker, fires


def processor(
    store: Any, ticker: PartitionTicker, now: list[int]
) -> tuple[CommandProcessor, FakeSink]:
    results = FakeSink()
    return CommandProcessor(
        store=store,
        sink=results,
        tickers={ticker.partition: ticker},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: now[0],
    ), results


def codes(results: FakeSink) -> list[str]:
    return [str(decode_result(v).code) for _, _, v in results.sent]


async def until(check: Any) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_a_create_falling_due_during_its_commit_is_answered_once_kafka_has_it() -> None:
    # Due 50 ms after the batch started; the commit took 200 ms, and meanwhile the ticker
    # wrote its checkpoint at its own "now". A successor would start past the row, so the
    # answer (and the offset commit after it) must wait for Kafka's acknowledgement.
    now = [NOW]
    msg = record("soon", 1, due_ms=NOW + 50)
    ticker, fires = ticker_for(msg.partition, now, StoredCheckpoint(NOW - 1_000))
    await running(ticker)

    class SlowCommit(FakeStore):
        async def apply_schedule_changes(self, changes: Any, *, before_commit: Any = None) -> None:
            await super().apply_schedule_changes(changes, before_commit=before_commit)
            now[0] += 200
            await ticker._write_checkpoint(force=True)

    proc, results = processor(SlowCommit(), ticker, now)
    batch = asyncio.create_task(proc.process_batch([msg]))
    await until(lambda: batch.done() or fires.sent)
    await settle()
    assert results.sent == [] and not batch.done()  # not answered before the ack
    assert ticker.fired_before_ms is not None and ticker.fired_before_ms > NOW + 50
    assert [k for k, _ in fires.sent] == [b"soon"]  # emitted at once: it is due
    fires.sent[0][1].set_result((0, 0))
    await asyncio.wait_for(batch, 1)
    assert codes(results) == ["ok"]
    await ticker.stop(timeout_s=0.5)


async def test_a_checkpoint_ahead_of_this_clock_is_written_back_below_a_new_row() -> None:
    # The previous owner's clock ran fast: the checkpoint it left is 40-100 s ahead of this
    # worker's clock. A create due 10 s before it (by this clock: 30-90 s ahead) is below
    # it. It is answered after one checkpoint write puts the stored checkpoint back below it
    # (a successor then reads its bucket), not when it fires; it still fires at its due
    # second by this clock, and no checkpoint passes it before it is recorded. A row the
    # previous owner fired (between the two, in a minute read later) is not fired again.
    now = [NOW]
    minute = NOW - NOW % 60_000 + 60_000  # the next minute by this clock
    ahead = minute + 40_000  # 40 to 100 s ahead of this clock
    due = minute + 30_000
    msg = record("skewed", 1, due_ms=due)
    already = replace(row("fired-before", minute + 35_000), partition=msg.partition)

    class AheadCheckpoint(TickerStore):
        async def get_checkpoint(self, partition: int) -> int | None:
            return ahead

        async def read_bucket(self, partition: int, minute_ms: int, shards: int) -> list[Any]:
            return [already] if already.minute_ms == minute_ms else []

    store = AheadCheckpoint()
    ticker, fires = ticker_for(msg.partition, now, store)
    proc, results = processor(FakeStore(), ticker, now)
    # Handed over before the ticker has even read the checkpoint (just assigned).
    batch = asyncio.create_task(proc.process_batch([msg]))
    await asyncio.sleep(0.05)
    assert not batch.done() and results.sent == []
    ticker.start()
    await asyncio.wait_for(batch, 1)
    assert codes(results) == ["ok"] and fires.sent == []  # answered before any fire
    since = len(store.checkpoints) - 1  # the write the answer waited for, and later ones
    assert store.checkpoints[since] <= due
    while now[0] < minute + 36_000:  # the clock runs on past both rows' due times
        now[0] += 1_000
        ticker._wake.set()
        await asyncio.sleep(0.01)
        assert max(store.checkpoints[since:]) <= due  # the trigger is not acknowledged yet
    await until(lambda: len(fires.sent) == 1)
    assert fires.ids == ["skewed"]  # at its due time, and not the row already fired
    fires.sent[0][1].set_result((0, 0))
    await until(lambda: not ticker.is_firing("acme", "skewed"))
    await ticker.stop(timeout_s=0.5)
    assert fires.ids == ["skewed"]


async def test_a_create_above_the_checkpoint_is_answered_at_once_and_holds_it() -> None:
    now = [NOW]
    msg = record("later", 1, due_ms=NOW + 5_000)
    ticker, fires = ticker_for(msg.partition, now)
    ticker.fired_before_ms = NOW - 1_000
    proc, results = processor(FakeStore(), ticker, now)
    await asyncio.wait_for(proc.process_batch([msg]), 1)
    assert codes(results) == ["ok"] and fires.sent == []
    assert ticker.timeline.get("acme", "later") is not None
    assert ticker.checkpoint_candidate(NOW + 4_000) <= NOW + 5_000


async def test_a_release_before_the_ack_fails_the_hand_over_retriably() -> None:
    now = [NOW]
    ticker, fires = ticker_for(0, now)
    ticker.fired_before_ms = NOW + 2_000
    pending = ticker.hand_over(row("x", NOW + 1_000))
    assert pending is not None
    await ticker.stop(timeout_s=0.05)
    try:
        await asyncio.wait_for(pending, 1)
    except Exception as exc:
        assert getattr(exc, "retriable", False), exc
    else:
        raise AssertionError("answered although the trigger was never acknowledged")
    assert fires.sent == []


async def test_a_row_superseded_in_the_same_batch_is_not_fired() -> None:
    # A create and its cancel in one batch: the cancel's withdraw comes first, so the
    # create's hand-over finds the tombstone and neither fires nor waits.
    now = [NOW]
    ticker, fires = ticker_for(0, now)
    ticker.fired_before_ms = NOW + 2_000
    ticker.withdraw("t", "gone", version=2)
    pending = ticker.hand_over(row("gone", NOW - 500))
    assert pending is not None
    await asyncio.wait_for(pending, 1)
    assert fires.sent == []


async def test_a_hand_over_cut_short_by_a_revocation_is_left_to_the_new_owner() -> None:
    # The row is due already, so its command waits for Kafka; then the
    # partition is revoked (the ticker stops and leaves the map). The retry must neither
    # answer the command (the new owner's bucket read starts past the row) nor treat the
    # missing ticker as "nothing to wait for": while the consumer still holds the
    # partition it waits; once it no longer does, the command is left unanswered (and
    # reported so, for its offset not to be committed) for the new owner to replay.
    now = [NOW]
    msg = record("revoked", 1, due_ms=NOW)
    ticker, fires = ticker_for(msg.partition, now)
    ticker.fired_before_ms = NOW + 2_000
    tickers = {ticker.partition: ticker}
    owned = {msg.partition}
    results = FakeSink()
    slept: list[float] = []

    async def sleep(delay_s: float) -> None:
        slept.append(delay_s)
        if len(slept) == 2:  # the consumer group has given the partition away by now
            owned.clear()
        await asyncio.sleep(0)

    proc = CommandProcessor(
        store=FakeStore(),
        sink=results,
        tickers=tickers,
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: now[0],
        sleep=sleep,
        assigned=owned.__contains__,
    )
    answering = asyncio.create_task(proc.process_until_answered([msg]))
    await until(lambda: ticker._awaited)
    del tickers[ticker.partition]  # what the worker's revocation does, then stops it
    await ticker.stop(timeout_s=0.05)
    left = await asyncio.wait_for(answering, 1)
    assert results.sent == []  # never answered "ok" on this worker
    assert left == [msg]
    assert len(slept) >= 2  # retried while the partition was still assigned here
    assert fires.sent == []

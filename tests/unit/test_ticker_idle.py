"""An idle ticker (nothing held, in flight or deferred): its loop sleeps until the next
minute's read unless something wakes it, and its checkpoint is written once a minute, not
once a second, without a successor ever missing a trigger or firing one twice because of
it. Time is a fake clock; what is asserted is when the loop plans to wake and what it
emits and writes, never how long anything took."""

from __future__ import annotations

import asyncio

from streams.model import BucketRow
from streams.ticker import PartitionTicker, TickerConfig
from streams.timeline import Entry
from tests.fakes import FakeStore
from tests.fakes import until_true as until
from tests.unit.test_streams_ticker import FakeSink, row, running, settle

MINUTE = 60_000
M = 28_333_333 * MINUTE  # a minute's start (about 2023-11-14)
PRELOAD_MS = 10_000


def config() -> TickerConfig:
    return TickerConfig(fire_topic="fires", owner="test", preload_ahead_ms=PRELOAD_MS)


def ticker_on(store: FakeStore, sink: FakeSink, now: list[int]) -> PartitionTicker:
    return PartitionTicker(0, store=store, sink=sink, config=config(), clock_ms=lambda: now[0])


def entry(r: BucketRow) -> Entry[BucketRow]:
    return Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r)


async def stop(*tickers: PartitionTicker) -> None:
    for ticker in tickers:
        await ticker.stop(0)


async def test_an_idle_ticker_sleeps_until_its_next_read_and_a_new_schedule_wakes_it() -> None:
    now = [M + 5_000]
    store, sink = FakeStore(checkpoint_ms=M + 4_000), FakeSink()
    ticker = await running(ticker_on(store, sink, now))
    # Minute M is loaded; M + 60 s is read 10 s before it starts. Nothing before then but
    # a look at the wall clock every preload lead (tests/unit/test_timing_holes.py).
    await until(lambda: ticker.asleep_until_ms is not None)
    assert ticker.asleep_until_ms == now[0] + PRELOAD_MS
    # A schedule created due 50 ms from now, in this minute (loaded): handed over, it
    # wakes the loop, which now sleeps until the row's due time, and fires it then.
    due = row("soon", now[0] + 50)
    assert ticker.hand_over(due) is None  # held: its command may be answered now
    await until(lambda: ticker.asleep_until_ms == due.due_ms)
    assert sink.sent == []
    now[0] = due.due_ms
    await until(lambda: bool(sink.sent))
    assert [k for k, _ in sink.sent] == [b"soon"]
    # In flight: the loop re-checks every second again (acknowledgement, checkpoint).
    await until(lambda: ticker.asleep_until_ms is not None)
    assert ticker.asleep_until_ms is not None and ticker.asleep_until_ms <= now[0] + 1_000
    await stop(ticker)


async def test_a_ticker_resumed_after_its_preload_point_reads_the_next_minute_at_once() -> None:
    now = [M + 5_000]
    store, sink = FakeStore(checkpoint_ms=M + 4_000), FakeSink()
    ticker = await running(ticker_on(store, sink, now))
    await until(lambda: ticker.asleep_until_ms == now[0] + PRELOAD_MS)
    await ticker.suspend(0)
    # Suspended past the preload point: resumed, it reads the next minute at once.
    now[0] = M + MINUTE - PRELOAD_MS + 1
    ticker.resume()
    await until(lambda: store.count("read_bucket") == 2)
    await until(lambda: ticker.asleep_until_ms == now[0] + PRELOAD_MS)
    await stop(ticker)


def idle_ticker(now: list[int]) -> tuple[PartitionTicker, FakeStore, FakeSink]:
    """A ticker as ``_begin`` and two loads leave it: checkpoint M + 1 s read (so stored),
    minutes M and M + 60 s loaded, nothing held."""
    store, sink = FakeStore(checkpoint_ms=M + 1_000), FakeSink()
    ticker = ticker_on(store, sink, now)
    ticker.fired_before_ms = ticker._written_checkpoint = M + 1_000
    ticker._next_minute_ms = M + 2 * MINUTE
    ticker.timeline.mark_loaded(M + 2 * MINUTE)
    return ticker, store, sink


async def test_an_idle_checkpoint_is_written_once_a_minute() -> None:
    now = [M + 2_000]
    ticker, store, _ = idle_ticker(now)
    for second in range(2, 60):
        now[0] = M + second * 1_000
        await ticker._write_checkpoint()
    # The stored M + 1 s stays: a successor reads minute M from it either way.
    assert store.checkpoints == []
    assert ticker.fired_before_ms == M + 59_001
    now[0] = M + MINUTE + 3_000
    await ticker._write_checkpoint()
    assert store.checkpoints == [M + MINUTE + 3_001]
    # A forced write (suspension, a write-back) is never skipped.
    now[0] += 1_000
    await ticker._write_checkpoint(force=True)
    assert store.checkpoints[-1] == M + MINUTE + 4_001


async def test_after_a_fire_the_checkpoint_is_written_again_within_the_minute() -> None:
    """Skipping the write after a fire would let a successor start below it and fire it
    again: the stored checkpoint must pass every trigger fired, as it did every second."""
    now = [M + 10_000]
    ticker, store, sink = idle_ticker(now)
    marker = asyncio.create_task(ticker._mark_loop())
    r = row("fired", M + 9_000)
    ticker._hold(r)
    await ticker._write_checkpoint()  # held: written as before (below the row)
    assert store.checkpoints == [M + 9_000]
    ticker.timeline.pop_due(now[0], limit=10)
    ticker._dispatch(entry(r), now[0])
    sink.sent[0][1].set_result((0, 0))
    await until(lambda: not ticker._inflight)
    assert store.fired == ["fired"]
    now[0] += 1_000
    await ticker._write_checkpoint()
    assert store.checkpoints[-1] == M + 11_001
    # Idle again, and nothing fired since that write: skipped until the next minute.
    now[0] += 1_000
    await ticker._write_checkpoint()
    assert store.checkpoints[-1] == M + 11_001
    marker.cancel()


async def test_a_successor_of_a_ticker_that_skipped_its_writes_fires_every_row() -> None:
    """An idle ticker crashes (nothing written at the end) after skipping its checkpoint
    writes for most of a minute; a row was created meanwhile, due later in that minute.
    Its successor starts from the stored checkpoint, reads the minute and fires it."""
    now = [M + 1_000]
    store, sink = FakeStore(checkpoint_ms=M + 500), FakeSink()
    first = await running(ticker_on(store, sink, now))
    for s in range(2, 50):
        now[0] = M + s * 1_000
        await first._write_checkpoint()
    assert store.checkpoint_ms == M + 500  # skipped: idle all along, same minute
    late = row("late", M + 55_000)
    await store.write_buckets(put=[late], now_ms=now[0])
    assert first.hand_over(late) is None  # held, its command answered
    await settle()
    # SIGKILL: the loop and marker end without a word, no checkpoint is written.
    for task in (first._task, first._marker, first._loader, first._checkpointer):
        if task is not None:
            task.cancel()
    await settle()
    assert store.checkpoint_ms == M + 500
    second_sink = FakeSink()
    now[0] = late.due_ms  # (the successor starts as the row falls due)
    second = await running(ticker_on(store, second_sink, now))
    await until(lambda: bool(second_sink.sent))
    assert [k for k, _ in second_sink.sent] == [b"late"]
    await stop(second)

"""The ticker's bookkeeping with fake edges: what it emits, and where its checkpoint may go."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streams.ticker import PartitionTicker, TickerConfig
from streams.timeline import Entry
from tests.fakes import FakeStore
from tests.fakes import bucket_row as row


class FakeSink:
    """Holds every send's future so a test decides when Kafka acknowledges."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes | None, asyncio.Future[Any]]] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append((key, fut))
        return fut


def make(now: list[int], linger_s: float = 0.0) -> tuple[PartitionTicker, FakeStore, FakeSink]:
    store, sink = FakeStore(), FakeSink()
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=linger_s)
    ticker = PartitionTicker(0, store=store, sink=sink, config=config, clock_ms=lambda: now[0])
    ticker.fired_before_ms = 0
    return ticker, store, sink


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class StoredCheckpoint(FakeStore):
    """The shared fake with ``checkpoint_ms`` stored (positional, for the tests built on it)."""

    def __init__(self, checkpoint_ms: int) -> None:
        super().__init__(checkpoint_ms=checkpoint_ms)


async def running(ticker: PartitionTicker) -> PartitionTicker:
    """Start the ticker and wait until it has loaded its buckets up to its clock: a
    handed-over row goes out through its loop, in due order with the loaded ones."""
    ticker.start()
    await asyncio.wait_for(ticker.ready.wait(), 5)
    return ticker


async def test_checkpoint_never_passes_an_unacknowledged_trigger() -> None:
    now = [100_000]
    ticker, store, sink = make(now)
    marker = asyncio.create_task(ticker._mark_loop())
    early, late = row("early", 90_000), row("late", 95_000)
    for r in (early, late):
        ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    assert [k for k, _ in sink.sent] == [b"early", b"late"]
    sink.sent[1][1].set_result((0, 1))  # only the later one is acknowledged
    await settle()
    assert ticker.checkpoint_candidate(now[0]) == 90_000
    sink.sent[0][1].set_result((0, 0))
    await settle()
    assert sorted(store.fired) == ["early", "late"]
    assert ticker.checkpoint_candidate(now[0]) == now[0] + 1
    marker.cancel()


async def test_fired_marks_trickling_in_are_recorded_in_one_request() -> None:
    now = [100_000]
    ticker, store, sink = make(now, linger_s=0.05)
    marker = asyncio.create_task(ticker._mark_loop())
    for i in range(3):  # acknowledged one by one, like jittered runs through a minute
        r = row(f"r{i}", 90_000 + i)
        ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
        sink.sent[-1][1].set_result((0, i))
        await settle()
    assert store.fired == []  # still lingering: not checkpointable yet
    assert ticker.checkpoint_candidate(now[0]) == 90_000
    await asyncio.sleep(0.1)
    assert store.mark_requests == [3] and store.fired == ["r0", "r1", "r2"]
    assert ticker.checkpoint_candidate(now[0]) == now[0] + 1
    marker.cancel()


async def test_failed_ack_keeps_the_trigger_in_flight() -> None:
    now = [100_000]
    ticker, store, sink = make(now)
    r = row("x", 99_000)
    ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    sink.sent[0][1].set_exception(RuntimeError("broker gone"))
    await settle()
    assert store.fired == []
    assert ticker.is_firing("t", "x")
    assert ticker.checkpoint_candidate(now[0]) == 99_000


async def test_beyond_tolerance_is_recorded_missed_not_emitted() -> None:
    now = [1_000_000]
    ticker, store, sink = make(now)
    r = row("stale", 1_000_000 - 61_000, tolerance_s=60)
    ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    await settle()
    assert sink.sent == []
    assert store.missed == ["stale"]
    assert not ticker.is_firing("t", "stale")


async def test_offers_are_kept_only_near_the_loaded_horizon() -> None:
    now = [1_000_000]
    ticker, _, _ = make(now)
    ticker.offer(row("soon", now[0] + 5_000))
    ticker.offer(row("far", now[0] + 3_600_000))
    assert ticker.timeline.get("t", "soon") is not None
    assert ticker.timeline.get("t", "far") is None
    ticker.withdraw("t", "soon", version=2)
    assert ticker.timeline.get("t", "soon") is None


@pytest.mark.parametrize("late_ms", [0, 1, 59_999])
async def test_fire_now_waits_for_kafka(late_ms: int) -> None:
    now = [1_000_000]
    sink = FakeSink()
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = await running(
        PartitionTicker(
            0, store=StoredCheckpoint(0), sink=sink, config=config, clock_ms=lambda: now[0]
        )
    )
    task = asyncio.create_task(ticker.fire_now(row("late", now[0] - late_ms)))
    for _ in range(100):
        await asyncio.sleep(0.005)
        if sink.sent:
            break
    await settle()
    assert not task.done() and len(sink.sent) == 1
    sink.sent[0][1].set_result((0, 0))
    await asyncio.wait_for(task, 1)
    await ticker.stop(timeout_s=0.5)


async def test_a_slow_bucket_read_does_not_hold_up_what_is_loaded() -> None:
    # The next minute is read 10 s ahead while this minute's triggers still fire: the read
    # runs beside the loop, so a trigger due meanwhile is emitted before the read returns.
    now = [120_000 - 8_000]  # within the preload window of minute 120,000
    sink = FakeSink()
    gate = asyncio.Event()

    store = FakeStore(checkpoint_ms=60_000)
    store.bucket_rows.update({r.key: r for r in (row("now", 113_000), row("next", 120_500))})
    store.hold("read_bucket", gate, when=lambda call: call.args[1] == 120_000)

    def reads() -> list[int]:
        return [call.args[1] for call in store.calls_of("read_bucket")]

    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = PartitionTicker(0, store=store, sink=sink, config=config, clock_ms=lambda: now[0])
    ticker.start()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if reads() == [60_000, 120_000]:
            break
    assert reads() == [60_000, 120_000] and [k for k, _ in sink.sent] == []
    now[0] = 113_000
    ticker._wake.set()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if sink.sent:
            break
    assert [k for k, _ in sink.sent] == [b"now"]  # while the read still waits
    assert ticker.checkpoint_candidate(now[0]) <= 113_000
    gate.set()
    now[0] = 120_500
    ticker._wake.set()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if len(sink.sent) == 2:
            break
    assert [k for k, _ in sink.sent] == [b"now", b"next"]
    await ticker.stop(timeout_s=0.1)


async def test_no_checkpoint_passes_a_first_read_still_running() -> None:
    # Stopped (a rebalance) while its first bucket read waits: the final checkpoint stays
    # at the start, not at "now" (which would skip every trigger of the unread minutes).
    now = [200_000]
    gate = asyncio.Event()

    store = FakeStore(checkpoint_ms=150_000)
    store.bucket_rows[row("unread", 170_000).key] = row("unread", 170_000)
    store.hold("read_bucket", gate)
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = PartitionTicker(
        0, store=store, sink=FakeSink(), config=config, clock_ms=lambda: now[0]
    )
    ticker.start()
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert ticker.checkpoint_candidate(now[0]) <= 150_000
    await ticker.stop(timeout_s=0.1)
    assert all(c <= 150_000 for c in store.checkpoints)  # (none written: nothing new)


async def test_a_marker_restart_keeps_the_group_it_was_recording() -> None:
    # The marker fails unexpectedly after taking a group off the queue (here the store
    # raising a bug, not an outage): its supervised restart must still record that group,
    # or those triggers stay in flight for good, pinning the checkpoint below them.
    now = [100_000]
    ticker, store, sink = make(now)

    class Broken(Exception):
        pass

    store.inject("mark_fired_many", Broken("unexpected"))
    r = row("grouped", 90_000)
    ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    sink.sent[0][1].set_result((0, 0))
    await settle()
    with pytest.raises(Broken):
        await asyncio.wait_for(ticker._mark_loop(), 1)
    marker = asyncio.create_task(ticker._mark_loop())  # what the supervisor does next
    for _ in range(50):
        if store.fired:
            break
        await asyncio.sleep(0.005)
    assert store.fired == ["grouped"]
    assert not ticker.is_firing("t", "grouped")
    assert ticker.checkpoint_candidate(now[0]) == now[0] + 1
    marker.cancel()

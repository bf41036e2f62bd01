"""The ticker across a Cassandra outage: a StoreError from reading the checkpoint,
a bucket or writing the checkpoint is retried; the ticker neither dies nor skips a minute."""

from __future__ import annotations

import asyncio
from typing import Any

from streams.model import BucketRow
from streams.ticker import PartitionTicker, TickerConfig
from tests.fakes import FakeStore
from tests.unit.test_streams_ticker import row as ticker_row
from tests.unit.test_streams_ticker import running

NOW = 1_800_000_030_000  # 30 s into a minute


def row(sid: str, due_ms: int) -> BucketRow:
    return ticker_row(sid, due_ms, tolerance_s=3600)


def flaky(rows: list[BucketRow]) -> FakeStore:
    """The shared fake, down (every call fails) until told otherwise, holding ``rows``."""
    store = FakeStore(checkpoint_ms=NOW - 20_000, bucket_rows={r.key: r for r in rows})
    store.down = True
    return store


class Sink:
    def __init__(self) -> None:
        self.sent: list[bytes | None] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        self.sent.append(key)
        return fut


async def test_ticker_waits_out_a_store_outage_then_fires_and_checkpoints() -> None:
    store, sink = flaky([row("due-before", NOW - 5_000), row("due-later", NOW + 700)]), Sink()
    now = [NOW]
    ticker = PartitionTicker(
        0,
        store=store,
        sink=sink,
        config=TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0),
        clock_ms=lambda: now[0],
    )
    ticker.start()
    await asyncio.sleep(1.5)  # Cassandra down: the checkpoint cannot even be read
    assert store.failures >= 1 and not sink.sent
    assert ticker._task is not None and not ticker._task.done()  # alive, waiting

    store.down = False
    await asyncio.sleep(1.5)
    assert sink.sent == [b"due-before"]

    store.down = True  # down again mid-run: loaded rows still fire on time
    now[0] = NOW + 61_000  # the next minute is due to be read, and fails
    await asyncio.sleep(1.5)
    assert sink.sent == [b"due-before", b"due-later"]
    assert ticker._task is not None and not ticker._task.done()

    store.down = False
    now[0] += 2_000  # (the checkpoint is written at most once a second of this clock)
    await asyncio.sleep(2.5)
    assert sorted(store.fired) == ["due-before", "due-later"]
    assert store.checkpoints and store.checkpoints[-1] >= NOW + 700  # past due-before
    await ticker.stop(timeout_s=2)


class FailOnceSink(Sink):
    """The first send fails as a broker restart does (delivery timed out)."""

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self.sent:
            fut.set_exception(RuntimeError("Local: Message timed out"))
        else:
            fut.set_result(None)
        self.sent.append(key)
        return fut


async def test_fire_now_waits_for_the_retry_instead_of_raising() -> None:
    """A late create's trigger whose first send fails: fire_now returns (so the command is
    answered) only once the ticker's own retry is acknowledged and recorded."""
    store, sink = flaky([]), FailOnceSink()
    store.down = False
    ticker = PartitionTicker(
        0,
        store=store,
        sink=sink,
        config=TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0),
        clock_ms=lambda: NOW,
    )
    await running(ticker)
    await asyncio.wait_for(ticker.fire_now(row("late", NOW - 90_000)), timeout=10)
    assert sink.sent == [b"late", b"late"] and store.fired == ["late"]
    assert not ticker.is_firing("t", "late")
    await ticker.stop(timeout_s=0.5)

"""A minute's bucket rows are held in slices, the loop running between them: what is due
meanwhile is not held up by a big minute's load, and a cancel told between slices is kept."""

from __future__ import annotations

import asyncio

from streams import ticker as ticker_module
from streams.ticker import PartitionTicker, TickerConfig
from tests.fakes import FakeStore
from tests.fakes import bucket_row as row

NOW = 1_000_000  # minute 960,000; the next minute starts at 1,020,000
NEXT_MINUTE = 1_020_000


class _Sink:
    def send(self, topic: str, **kwargs: object) -> asyncio.Future[object]:
        return asyncio.get_running_loop().create_future()


async def test_a_big_minute_is_held_in_slices_and_a_cancel_between_them_is_kept() -> None:
    count = 3 * ticker_module._HOLD_SLICE
    store = FakeStore()
    store._write_buckets([row(f"s{i}", NEXT_MINUTE + i) for i in range(count)], [])
    config = TickerConfig(fire_topic="fires", owner="test", preload_ahead_ms=30_000)
    ticker = PartitionTicker(0, store=store, sink=_Sink(), config=config, clock_ms=lambda: NOW)
    ticker.fired_before_ms = NOW
    ticker._next_minute_ms = NEXT_MINUTE
    ticker.timeline.mark_loaded(NEXT_MINUTE)
    load = asyncio.create_task(ticker._load_due_buckets())
    for _ in range(100):  # until the first slice is held
        await asyncio.sleep(0)
        if len(ticker.timeline):
            break
    # One slice held, the minute not counted as loaded: the loop had a turn in between.
    assert len(ticker.timeline) == ticker_module._HOLD_SLICE
    assert not ticker.timeline.covers(NEXT_MINUTE)
    late = f"s{count - 1}"  # in the last slice, not held yet
    early = "s0"  # held already
    ticker.withdraw("t", late, version=2)
    ticker.withdraw("t", early, version=2)
    await asyncio.wait_for(load, 5)
    assert ticker.timeline.covers(NEXT_MINUTE + 59_999)
    assert ticker.timeline.get("t", late) is None
    assert ticker.timeline.get("t", early) is None
    assert len(ticker.timeline) == count - 2

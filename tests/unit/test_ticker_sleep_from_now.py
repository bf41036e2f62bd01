"""The ticker's sleep is measured from when it starts, not from the clock read before the
turn's emission: a turn that emits for a while must not sleep past the next due time by
that while. Time is a fake clock that each send moves on (the emission's CPU time); what
is asserted is the wake-up the loop plans, never how long anything took."""

from __future__ import annotations

import asyncio
from typing import Any

from streams.ticker import Alarm
from tests.fakes import FakeStore
from tests.fakes import until_true as until
from tests.unit.test_streams_ticker import FakeSink, row, running
from tests.unit.test_ticker_idle import M, ticker_on

SEND_MS = 20  # the fake clock's move per send


class SlowSink(FakeSink):
    """Each send takes ``SEND_MS`` of the (fake) wall clock."""

    def __init__(self, now: list[int]) -> None:
        super().__init__()
        self.now = now

    def send(self, topic: str, **kwargs: Any) -> asyncio.Future[Any]:
        self.now[0] += SEND_MS
        return super().send(topic, **kwargs)


class RecordingAlarm(Alarm):
    """The ticker's alarm, noting for each sleep the clock and the wall time it ends at."""

    def __init__(self, now: list[int], sink: FakeSink) -> None:
        super().__init__()
        self.now = now
        self.sink = sink
        self.sleeps: list[tuple[int, int]] = []  # (sends so far, wall ms the sleep ends at)

    async def wait(self, timeout_s: float) -> None:
        self.sleeps.append((len(self.sink.sent), self.now[0] + round(timeout_s * 1000)))
        await super().wait(timeout_s)


async def test_a_turn_that_emits_does_not_sleep_past_the_next_due_time() -> None:
    now = [M + 5_000]
    store = FakeStore(checkpoint_ms=M + 4_000)
    sink = SlowSink(now)
    ticker = ticker_on(store, sink, now)
    alarm = ticker._wake = RecordingAlarm(now, sink)
    await running(ticker)
    first, second = row("first", now[0] + 50), row("second", now[0] + 60)
    assert ticker.hand_over(first) is None and ticker.hand_over(second) is None
    await until(lambda: ticker.asleep_until_ms == first.due_ms)
    now[0] = first.due_ms
    ticker._wake.set()
    await until(lambda: len(sink.sent) == 2)
    # Sending "first" took the clock 10 ms past "second"'s due time: no sleep may end
    # after it while "second" waits.
    late = [wake for sent, wake in alarm.sleeps if sent == 1 and wake > second.due_ms]
    assert late == []
    await ticker.stop(0)

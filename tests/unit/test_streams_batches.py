"""The agents' batching (streams.batches) on a real Faust stream over an in-memory channel:
no timer while nothing is buffered, batches closed where Faust's windows end, events acked
as Faust's ``take_events`` acks them. Time is a fake clock; what is asserted is the
waits the loop asks for and the order of events, never how long anything took."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import faust
import pytest
from faust.types import EventT

from streams import batches
from streams.batches import window_end_s


class Waits:
    """Records each ``wait_for_stopped`` the loop makes (what and with which timeout) and
    lets it through to the stream's own."""

    def __init__(self, stream: faust.Stream[Any]) -> None:
        self.timeouts: list[float | None] = []
        real = stream.wait_for_stopped

        async def wait_for_stopped(*coros: Any, **kwargs: Any) -> bool:
            self.timeouts.append(kwargs.get("timeout"))
            return await real(*coros, **kwargs)

        stream.wait_for_stopped = wait_for_stopped  # type: ignore[method-assign]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def a_stream() -> tuple[faust.App, faust.ChannelT[Any], faust.Stream[Any]]:
    app = faust.App(
        "test-batches",
        broker="kafka://127.0.0.1:1",
        web_enabled=False,
        loop=asyncio.get_running_loop(),
    )
    app.flow_control.resume()  # a worker's consumer does this once it is assigned
    channel = app.channel()
    return app, channel, cast("faust.Stream[Any]", app.stream(channel))


async def finish(app: faust.App, *tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await app.stop()
    # The stream's iterator made the app's consumer, whose thread has its own event loop
    # (never started here): closed, or the test run ends with a ResourceWarning.
    consumer = app._consumer
    if consumer is not None:
        consumer._thread.thread_loop.close()  # type: ignore[attr-defined]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


class Got:
    """The batches taken, in order; ``until(n)`` waits until there are ``n``."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self._changed = asyncio.Condition()

    async def add(self, events: Sequence[EventT[Any]]) -> None:
        async with self._changed:
            self.batches.append([e.value for e in events])
            self._changed.notify_all()

    async def until(self, n: int) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.batches) >= n), 5)


async def collect(agen: AsyncIterator[Sequence[EventT[Any]]], got: Got) -> None:
    async for events in agen:
        await got.add(events)


@pytest.mark.parametrize(
    ("now", "end"),
    [
        (10.0, 10.5),  # at the anchor: the first window
        (10.25, 10.5),
        (10.5, 11.0),  # at a window's very end: the next one (Faust's wait was re-armed)
        (32.75, 33.0),  # after 45 windows expired empty
        (9.0, 10.5),  # (a clock before the anchor)
    ],
)
def test_the_window_is_the_one_fausts_loop_would_be_in(now: float, end: float) -> None:
    assert window_end_s(10.0, now, 0.5) == end


async def test_nothing_buffered_arms_no_timer_and_a_late_event_closes_with_its_window() -> None:
    app, channel, stream = await a_stream()
    waits, clock = Waits(stream), Clock()
    got = Got()
    task = asyncio.ensure_future(collect(batches.take_events(stream, 10, 0.1, clock=clock), got))
    for _ in range(5):
        await settle()
    # Idle: one wait, with no timeout (Faust's loop re-arms a 0.1 s one forever).
    assert waits.timeouts == [None]
    # 2.25 s later (22 windows expired in Faust's loop) a record comes: it waits for the
    # end of the 23rd window, 2.3 s after the start, so 0.05 s.
    clock.now += 2.25
    await channel.send(value="a")
    await settle()
    assert waits.timeouts[1] == pytest.approx(0.05)
    await got.until(1)
    assert got.batches == [["a"]]
    await finish(app, task)


async def test_under_load_each_batch_closes_at_its_window_from_the_last_batchs_end() -> None:
    app, channel, stream = await a_stream()
    waits, clock = Waits(stream), Clock()  # the generator starts at 1,000 s
    got = Got()

    async def consume() -> None:
        # Windows of 100 s (on the fake clock), batches closed by a full buffer of two, so
        # that what is checked is the window each batch would have closed at.
        async for events in batches.take_events(stream, 2, 100.0, clock=clock):
            await got.add(events)
            clock.now = 1_550.0  # this batch is done at 1,550 s

    task = asyncio.ensure_future(consume())
    await settle()
    clock.now = 1_030.0
    await channel.send(value=1)
    await channel.send(value=2)
    await got.until(1)
    await settle()
    clock.now = 1_553.0
    await channel.send(value=3)
    await channel.send(value=4)
    await got.until(2)
    # The first batch's window ends 100 s after the start; the second's 100 s after the
    # first batch was done, as in Faust's loop (whose next wait begins then): 97 s after
    # its first record, not a fresh 100 s, nor 47 s (windows counted from the start).
    assert [t for t in waits.timeouts if t is not None] == [
        pytest.approx(70.0),
        pytest.approx(97.0),
    ]
    assert got.batches == [[1, 2], [3, 4]]
    await finish(app, task)


async def test_a_full_buffer_closes_the_batch_at_once_and_holds_the_rest() -> None:
    app, channel, stream = await a_stream()
    clock = Clock()
    got = Got()
    # A window of an hour: only a full buffer can close a batch.
    task = asyncio.ensure_future(collect(batches.take_events(stream, 3, 3_600.0, clock=clock), got))
    await settle()
    for value in range(7):
        await channel.send(value=value)
    await got.until(2)
    assert got.batches == [[0, 1, 2], [3, 4, 5]]
    await finish(app, task)


async def test_events_are_acked_in_order_after_their_batch_was_handled() -> None:
    app, channel, stream = await a_stream()
    clock = Clock()
    order: list[str] = []
    real_ack = stream.ack

    async def ack(event: EventT[Any]) -> bool:
        order.append(f"ack {event.value!s}")
        return await real_ack(event)

    stream.ack = ack  # type: ignore[method-assign]
    assert stream.enable_acks
    agen = batches.take_events(stream, 2, 3_600.0, clock=clock)

    async def consume() -> None:
        async for events in agen:
            # Faust's own acking is off while batches are taken: the loop acks.
            assert not stream.enable_acks
            order.append(f"handled {[e.value for e in events]!r}")
            await asyncio.sleep(0)
            order.append("done")
            if len(events) == 2 and events[-1].value == "d":
                break

    task = asyncio.ensure_future(consume())
    await settle()
    for value in ("a", "b", "c", "d"):
        await channel.send(value=value)
    await asyncio.wait_for(task, 5)
    assert order == ["handled ['a', 'b']", "done", "ack a", "ack b", "handled ['c', 'd']", "done"]
    # Abandoning the generator acks its last batch and gives the stream back as it was.
    await agen.aclose()
    assert order[-2:] == ["ack c", "ack d"]
    assert stream.enable_acks
    assert not stream._processors
    await finish(app)


async def test_a_stopped_stream_ends_the_idle_wait() -> None:
    app, _channel, stream = await a_stream()
    got = Got()
    await stream.maybe_start()
    task = asyncio.ensure_future(collect(batches.take_events(stream, 10, 0.02, clock=Clock()), got))
    await settle()
    await stream.stop()
    await asyncio.wait_for(task, 5)
    assert got.batches == []
    await finish(app)


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="within_s"):
        batches.take_events(None, 1, 0)  # type: ignore[arg-type]


async def test_a_record_seen_after_its_window_ended_closes_the_batch_at_once() -> None:
    """Under load the loop may get to a buffered record only after the window it came in
    has ended: Faust's timer would have closed the batch at that window's end, so it
    closes now, not at the end of the window this loop happens to run in."""
    app, channel, stream = await a_stream()
    waits = Waits(stream)
    # Start at 1,000 s; the record is buffered at 1,099 s (window ends at 1,100 s); the loop
    # looks at 1,130 s.
    times = iter([1_000.0, 1_099.0])
    last = [1_130.0]

    def clock() -> float:
        return next(times, last[0])

    got = Got()
    task = asyncio.ensure_future(collect(batches.take_events(stream, 10, 100.0, clock=clock), got))
    await settle()
    await channel.send(value="a")
    await got.until(1)
    assert [t for t in waits.timeouts if t is not None] == [0.0]
    assert got.batches == [["a"]]
    await finish(app, task)

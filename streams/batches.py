"""Batches of a Faust stream's events, with no timer armed while nothing is buffered.

Faust's ``Stream.take_events(max_, within)`` waits for its buffer to fill with a timeout of
``within``, and, the buffer still empty when it expires, waits again: an agent with nothing
to read wakes every ``within`` seconds forever, each time creating and cancelling the three
tasks of mode's ``Service.wait_first``. With the command agent's 20 ms window and the
delivery agent's 50 ms one, that was about 70 of an idle worker's wake-ups a second
(BENCHMARKS.md, "Idle worker"), at about 0.2 ms of CPU each.

``take_events`` below is Faust's loop (faust-streaming 0.15.3, pinned in constraints.txt)
with one change: while the buffer is empty it waits for the first event with no timeout,
then waits for the buffer to fill until the end of the window Faust's loop would be in at
that moment. Faust's windows are laid end to end from the end of the last batch (each
wait starts when the previous one ends), so that end is the first multiple of ``within``
after the first event, counted from the end of the last batch. A batch therefore closes
when Faust's would have (when full, or at that window's end) and holds the same events,
so batches and latency under load are unchanged.

Everything else is Faust's, kept as it is: the events are buffered by a processor of the
stream, which is consumed passively; the stream's own acking is disabled while the
generator runs, and each event of a batch is acked, in order, once the code consuming the
batch has returned (or raised, or abandoned the generator), so an offset is committed only
after its batch was handled; the buffer never holds more than ``max_`` events (a full
buffer holds the stream until the batch is consumed); and the generator is registered with
the stream, whose stop closes it (Faust's ``_tracks_buffer_agen``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar, cast

import faust
from faust.types import ChannelT, EventT
from mode.utils.aiter import aiter
from mode.utils.futures import notify
from mode.utils.locks import Event

T = TypeVar("T")


def window_end_s(anchor_s: float, now_s: float, within_s: float) -> float:
    """The end of the window Faust's loop would be in at ``now_s``: its windows of
    ``within_s`` are laid end to end from ``anchor_s`` (the end of the last batch); an event
    at a window's very end falls in the next one, as a wait that has just expired would be
    re-armed before it is seen."""
    if now_s < anchor_s:  # (the clock is monotonic; kept total for any input)
        return anchor_s + within_s
    return anchor_s + (math.floor((now_s - anchor_s) / within_s) + 1) * within_s


def take_events(
    stream: faust.Stream[T],
    max_: int,
    within_s: float,
    *,
    clock: Callable[[], float] | None = None,
) -> AsyncGenerator[Sequence[EventT[T]], None]:
    """Batches of at most ``max_`` events of ``stream``, each closed when full or at the end
    of its ``within_s`` window (see the module doc); ``clock``: monotonic seconds (the
    event loop's time by default)."""
    if within_s <= 0:
        raise ValueError(f"within_s must be positive, got {within_s}")
    agen = _take_events(stream, max_, within_s, clock)
    # As Faust's buffering generators are: the stream's stop closes one left open.
    stream._active_agens.add(agen)
    return agen


async def _take_events(
    stream: faust.Stream[T],
    max_: int,
    within_s: float,
    clock: Callable[[], float] | None,
) -> AsyncGenerator[Sequence[EventT[T]], None]:
    now = clock if clock is not None else asyncio.get_running_loop().time
    buffer: list[T] = []
    events: list[EventT[T]] = []
    buffer_full = Event()
    buffer_started = Event()  # the first event of a batch is in the buffer
    buffer_consumed = Event()
    stream_enable_acks = stream.enable_acks
    buffer_consuming: asyncio.Future[None] | None = None
    # When the batch's first event was buffered: its window is the one Faust's loop was in
    # then, however late this loop gets to run (under load, often after that window ended).
    started_at = 0.0
    channel_it = aiter(stream.channel)

    async def add_to_buffer(value: T) -> T:
        try:
            # Set while a batch is being consumed: nothing is added to it meanwhile.
            nonlocal buffer_consuming
            if buffer_consuming is not None:
                try:
                    await buffer_consuming
                finally:
                    buffer_consuming = None
            nonlocal started_at
            started_at = started_at if buffer else now()
            buffer.append(value)
            event = stream.current_event
            if event is None:
                raise RuntimeError("Take buffer found current_event is None")
            events.append(event)
            buffer_started.set()
            if len(buffer) >= max_:
                buffer_full.set()
                # Never more than max_ events: hold the stream until this batch is consumed.
                buffer_consumed.clear()
                await stream.wait(buffer_consumed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            stream.log.exception("Error adding to take buffer: %r", exc)
            await stream.crash(exc)
        return value

    # The events are acked below, each once its batch is consumed.
    stream.enable_acks = False
    stream.add_processor(add_to_buffer)
    stream._enable_passive(cast("ChannelT[T]", channel_it))
    anchor = now()  # Faust's first window starts here
    try:
        while not stream.should_stop:
            if not buffer:
                buffer_started.clear()
                # No timer while nothing is buffered: Faust's windows would expire empty.
                await stream.wait_for_stopped(buffer_started)
                if not buffer:
                    continue  # stopped (or crashed): the loop's condition ends it
            timeout = window_end_s(anchor, started_at, within_s) - now()
            await stream.wait_for_stopped(buffer_full, timeout=max(0.0, timeout))
            if buffer:
                # Nothing is added to the buffer while it is read.
                buffer_consuming = asyncio.get_running_loop().create_future()
                try:
                    yield list(events)
                finally:
                    buffer.clear()
                    for event in events:
                        await stream.ack(event)
                    events.clear()
                    # Adding may go on.
                    notify(buffer_consuming)
                    buffer_full.clear()
                    buffer_consumed.set()
                    anchor = now()  # Faust's next window starts when the batch is done
    finally:
        stream.enable_acks = stream_enable_acks
        stream._processors.remove(add_to_buffer)

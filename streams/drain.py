"""A cheaper hand-over of each fetched record from Faust's consumer to its streams.

Faust's drain loop (``faust.transport.consumer.Consumer._drain_messages``) hands every
record to the streams with ``await self.wait_first(callback(message),
self.suspend_flow.wait())``: the delivery races a rebalance's flow suspension (and the
consumer stopping or crashing). mode's ``wait_first`` wraps each of those four waits in a
task and runs ``asyncio.wait`` over them, per record, although the delivery nearly
always completes at once (the stream buffer has room; nothing to wait for). Measured on
the command path (BENCHMARKS.md), this one call was about a seventh of the worker's CPU.

``install(consumer)`` gives that consumer a ``wait_first`` that first runs the delivery
until its first suspension, inline. If the delivery finishes there, nothing was waited
for and nothing could have raced it (no other code ran in between); the suspension waiter
is closed unstarted, exactly as ``wait_first`` would have cancelled it. If the delivery
does suspend (a full buffer, flow control), its remainder goes through the original
``wait_first`` with the same race as before. Both are counted in
``tocsin_consumer_handovers_total{path="inline"|"waited"}``. When the flow is already suspended, the
consumer stopped or crashed, or the call has any other shape, the original runs as is.
The drain loop ignores what ``wait_first`` returns and only relies on it returning or
raising the delivery's exception, which both paths do.

This reaches into Faust's consumer (an instance attribute shadowing a mode ``Service``
method that only the drain loop calls on the consumer) and is checked against the pinned
faust-streaming 0.15.3 and mode-streaming versions (constraints.txt); the integration
test ``test_worker_uses_the_fast_record_hand_over`` fails if either stops using it.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Generator
from typing import Any

from mode.services import WaitResults

from streams import metrics


class _Resume:
    """Continue a coroutine that already ran up to its first suspension (it yielded
    ``yielded``) under whichever task awaits this: a trampoline, as ``yield from``."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation included: the coroutine decides
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _finish(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _Resume(coro, yielded)


def install(consumer: Any) -> None:
    """Give Faust's ``consumer`` the inline hand-over (idempotent)."""
    if getattr(consumer, "_tocsin_fast_drain", False):
        return
    original = consumer.wait_first
    suspended = consumer.suspend_flow.is_set
    stopped = consumer._stopped.is_set
    crashed = consumer._crashed.is_set
    inline = metrics.CONSUMER_HANDOVERS.labels("inline").inc
    waited = metrics.CONSUMER_HANDOVERS.labels("waited").inc

    # (The signature is mode's Service.wait_first, which this shadows.)
    async def wait_first(*coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109
        if (
            len(coros) != 2
            or timeout is not None
            or not inspect.iscoroutine(coros[0])
            or not inspect.iscoroutine(coros[1])
            or suspended()
            or stopped()
            or crashed()
        ):
            return await original(*coros, timeout=timeout)
        delivery, suspension = coros
        try:
            yielded = delivery.send(None)
        except StopIteration as stop:
            suspension.close()
            inline()
            return WaitResults([delivery], [stop.value], False)
        except BaseException:
            suspension.close()
            raise
        waited()
        # (wait_first starts _finish's task before anything can cancel it, so the half-run
        # delivery is always resumed, and closed or finished by it.)
        return await original(_finish(delivery, yielded), suspension)

    consumer.wait_first = wait_first
    consumer._tocsin_fast_drain = True

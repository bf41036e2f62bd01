"""streams.drain: the inline hand-over that replaces Faust's per-record ``wait_first``.

Run against a real mode ``Service`` (the base of Faust's consumer, which provides the
original ``wait_first`` and the stopped/crashed events) with the consumer's
``suspend_flow`` event, driven the way Faust's drain loop calls it:
``await consumer.wait_first(callback(message), consumer.suspend_flow.wait())``.
"""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest
from mode import Service
from mode.utils.locks import Event

from streams import drain, metrics


def consumer() -> Any:
    c = Service()
    c.suspend_flow = Event()  # type: ignore[attr-defined]
    drain.install(c)
    return c


def count(path: str) -> float:
    return metrics.CONSUMER_HANDOVERS.labels(path)._value.get()  # type: ignore[no-any-return]


async def test_a_delivery_that_completes_at_once_runs_inline() -> None:
    c = consumer()
    seen: list[int] = []

    async def deliver(n: int) -> None:
        seen.append(n)

    inline, waited = count("inline"), count("waited")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail
        for n in range(3):
            await c.wait_first(deliver(n), c.suspend_flow.wait())
        gc.collect()
    assert seen == [0, 1, 2]
    assert count("inline") - inline == 3
    assert count("waited") == waited


async def test_a_delivery_that_suspends_finishes_through_the_original_race() -> None:
    c = consumer()
    room = asyncio.get_running_loop().create_future()
    done: list[str] = []

    async def deliver() -> str:
        await room  # a full buffer
        done.append("put")
        return "put"

    waited = count("waited")
    task = asyncio.ensure_future(c.wait_first(deliver(), c.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    assert not task.done() and done == []
    room.set_result(None)
    result = await asyncio.wait_for(task, 2)
    assert done == ["put"]
    assert result.results == ["put"] and not result.stopped
    assert count("waited") - waited == 1


async def test_a_flow_suspension_ends_a_waiting_delivery_and_cancels_it() -> None:
    c = consumer()
    cancelled: list[bool] = []

    async def deliver() -> None:
        try:
            await asyncio.get_running_loop().create_future()  # never room
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    task = asyncio.ensure_future(c.wait_first(deliver(), c.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    c.suspend_flow.set()  # a rebalance starts
    await asyncio.wait_for(task, 2)
    await asyncio.sleep(0)
    assert cancelled == [True]


async def test_errors_reach_the_drain_loop_on_both_paths() -> None:
    c = consumer()

    async def fails_at_once() -> None:
        raise ValueError("bad record")

    async def fails_later() -> None:
        await asyncio.sleep(0.001)
        raise KeyError("later")

    with pytest.raises(ValueError, match="bad record"):
        await c.wait_first(fails_at_once(), c.suspend_flow.wait())
    with pytest.raises(KeyError):
        await c.wait_first(fails_later(), c.suspend_flow.wait())


async def test_an_already_suspended_flow_takes_the_original_path() -> None:
    c = consumer()
    c.suspend_flow.set()
    inline, waited = count("inline"), count("waited")

    async def deliver() -> None:
        await asyncio.get_running_loop().create_future()

    # The original race: the suspension has already won, so the call returns at once.
    await asyncio.wait_for(c.wait_first(deliver(), c.suspend_flow.wait()), 2)
    assert (count("inline"), count("waited")) == (inline, waited)


async def test_cancelling_the_drain_loop_cancels_the_delivery() -> None:
    c = consumer()
    cancelled: list[bool] = []

    async def deliver() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    task = asyncio.ensure_future(c.wait_first(deliver(), c.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert cancelled == [True]


async def test_install_is_idempotent() -> None:
    c = consumer()
    first = c.wait_first
    drain.install(c)
    assert c.wait_first is first


async def test_other_calls_keep_the_original_wait_first() -> None:
    """mode's Service.wait() reaches wait_first with one awaitable and often a timeout
    (Faust's consumer waits for its flow to resume that way): those keep the original
    behaviour, timeout included, and are not counted as hand-overs."""
    c = consumer()
    resumed = Event()
    inline, waited = count("inline"), count("waited")
    result = await c.wait(resumed, timeout=0.05)  # nothing sets it: times out
    assert result.result is None and result.stopped is True  # (mode reports a timeout so)
    resumed.set()
    result = await c.wait(resumed, timeout=1)
    assert result.result is True and result.stopped is False
    assert (count("inline"), count("waited")) == (inline, waited)


async def test_a_stopped_consumer_takes_the_original_path() -> None:
    c = consumer()
    c._stopped.set()
    ran: list[bool] = []

    async def deliver() -> None:
        ran.append(True)

    inline = count("inline")
    result = await asyncio.wait_for(c.wait_first(deliver(), c.suspend_flow.wait()), 2)
    assert result.stopped is True  # the original reports the stop
    assert count("inline") == inline

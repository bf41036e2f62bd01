"""The ticker's wake-up (``streams.ticker.Alarm``): an event whose wait also ends at a
timeout, as ``asyncio.wait_for`` on ``Event.wait`` did, without a task per wait."""

from __future__ import annotations

import asyncio

from streams.ticker import Alarm


async def test_a_set_alarm_does_not_wait() -> None:
    alarm = Alarm()
    alarm.set()
    await asyncio.wait_for(alarm.wait(3600), 5)
    assert alarm.is_set()


async def test_set_ends_a_wait_and_stays_set_until_cleared() -> None:
    alarm = Alarm()
    waiting = asyncio.ensure_future(alarm.wait(3600))
    await asyncio.sleep(0)
    assert not waiting.done()
    alarm.set()
    await asyncio.wait_for(waiting, 5)
    assert alarm.is_set()
    alarm.clear()
    assert not alarm.is_set()


async def test_the_timeout_ends_a_wait_without_setting_it() -> None:
    alarm = Alarm()
    await asyncio.wait_for(alarm.wait(0.01), 5)
    assert not alarm.is_set()


async def test_a_cancelled_wait_leaves_the_next_one_working() -> None:
    alarm = Alarm()
    waiting = asyncio.ensure_future(alarm.wait(3600))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert waiting.cancelled()
    alarm.set()  # no waiter left: nothing to wake, no error
    alarm.clear()
    again = asyncio.ensure_future(alarm.wait(3600))
    await asyncio.sleep(0)
    alarm.set()
    await asyncio.wait_for(again, 5)

"""No task dies silently: a failing loop is restarted, one that keeps failing turns health
red, and a trigger the broker refuses for good stops pinning its ticker (no servers)."""

from __future__ import annotations

import asyncio
from typing import Any

from base.errors import KafkaError
from base.health import Health
from base.supervise import supervise
from streams.timeline import Entry
from tests.unit.test_streams_ticker import make, row, settle


def test_a_failing_loop_is_restarted_with_backoff_and_health_stays_green() -> None:
    runs, slept, health = [], [], Health()

    async def body() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")

    async def sleep(s: float) -> None:
        slept.append(s)

    asyncio.run(supervise("ticker-0", body, health=health, sleep=sleep, clock=lambda: 0.0))
    assert len(runs) == 3 and slept == [1.0, 2.0]
    assert health.live() == (True, "ok")


def test_a_loop_that_keeps_failing_turns_health_red_and_recovers_after_a_long_run() -> None:
    health, clock = Health(), [0.0]
    runs: list[int] = []

    async def body() -> None:
        runs.append(1)
        if len(runs) == 7:
            clock[0] += 120.0  # this run lasted two minutes before failing
        if len(runs) < 8:
            raise RuntimeError("store gone")

    seen: list[bool] = []

    async def sleep(s: float) -> None:
        seen.append(health.live()[0])

    asyncio.run(supervise("ticker-3", body, health=health, sleep=sleep, clock=lambda: clock[0]))
    # failures 1-4 green, 5 and 6 red; the 7th ran long (the count restarts): green again.
    assert seen == [True, True, True, True, False, False, True]
    assert health.live()[0]


async def test_a_trigger_the_broker_refuses_for_good_is_recorded_and_released() -> None:
    now = [100_000]
    ticker, store, sink = make(now)

    def refuse(topic: str, **kw: Any) -> asyncio.Future[Any]:
        raise KafkaError("cannot produce to fires: MSG_SIZE_TOO_LARGE", retriable=False)

    sink.send = refuse  # type: ignore[method-assign]
    big = row("big", 90_000)
    ticker._dispatch(Entry(big.due_ms, big.tenant, big.schedule_id, big.version, big), now[0])
    await settle()
    assert store.missed == ["big"]
    assert ticker._inflight == {}
    assert ticker.checkpoint_candidate(now[0]) == now[0] + 1

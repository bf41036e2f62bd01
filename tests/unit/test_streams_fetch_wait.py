"""streams.fetch_wait: each fetch's wait and minimum follow how the last fetch ended."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from base.settings import Settings
from streams import metrics
from streams.fetch_wait import FetchMode, FetchWaits, install, pace


def rounds(mode: str) -> float:
    counter: Any = metrics.CONSUMER_FETCH_ROUNDS.labels(mode)
    return float(counter._value.get())


class Assignment:
    """aiokafka's assignment as the fetcher reads it: its partitions and their states."""

    def __init__(self, paused: dict[str, bool]) -> None:
        self.paused = paused

    @property
    def tps(self) -> list[str]:
        return list(self.paused)

    def state_value(self, tp: str) -> SimpleNamespace:
        return SimpleNamespace(paused=self.paused[tp])


class Fetcher:
    """The two private methods of aiokafka's fetcher that ``install`` wraps: one builds the
    fetch requests from the attributes it reads, one ends a fetch (True: records came)."""

    def __init__(self) -> None:
        self._fetch_max_wait_ms = 1500
        self._fetch_min_bytes = 1
        self.built: list[tuple[int, int]] = []
        self.next_fetch_brings = False

    def _get_actions_per_node(self, assignment: Assignment) -> tuple[list[Any], ...]:
        self.built.append((self._fetch_max_wait_ms, self._fetch_min_bytes))
        return ([("node-1", "request")], {}, 0.2, False, [])

    async def _proc_fetch_request(self, assignment: Any, node_id: Any, request: Any) -> bool:
        return self.next_fetch_brings


def one_round(fetcher: Fetcher, assignment: Assignment, brings: bool) -> tuple[int, int]:
    """Build a fetch, then end it with or without records; returns the pair it asked for."""
    fetcher._get_actions_per_node(assignment)
    fetcher.next_fetch_brings = brings
    asyncio.run(fetcher._proc_fetch_request(assignment, "node-1", "request"))
    return fetcher.built[-1]


def test_an_empty_fetch_makes_the_next_one_idle_and_records_make_it_busy_again() -> None:
    fetcher, flowing = Fetcher(), Assignment({"commands-0": False, "deliveries-0": False})
    assert install(fetcher, FetchWaits(20, 16384, 500))
    assert one_round(fetcher, flowing, brings=False) == (20, 16384)  # first: busy
    assert one_round(fetcher, flowing, brings=False) == (500, 1)  # after an empty one
    assert one_round(fetcher, flowing, brings=True) == (500, 1)  # still idle, records came
    assert one_round(fetcher, flowing, brings=False) == (20, 16384)  # so busy again
    assert one_round(fetcher, flowing, brings=False) == (500, 1)


def test_a_paused_partition_keeps_fetches_busy() -> None:
    fetcher = Fetcher()
    install(fetcher, FetchWaits(20, 16384, 500))
    paused = Assignment({"commands-0": True, "deliveries-0": False})
    one_round(fetcher, paused, brings=False)
    assert one_round(fetcher, paused, brings=False) == (20, 16384)
    resumed = Assignment({"commands-0": False, "deliveries-0": False})
    assert one_round(fetcher, resumed, brings=False) == (500, 1)


def test_a_failed_or_cancelled_fetch_counts_as_empty() -> None:
    fetcher = Fetcher()

    async def failing(assignment: Any, node_id: Any, request: Any) -> bool:
        raise asyncio.CancelledError

    fetcher._proc_fetch_request = failing  # type: ignore[method-assign]
    waits = FetchWaits(20, 16384, 500)
    install(fetcher, waits)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(fetcher._proc_fetch_request(Assignment({}), "node-1", "request"))
    assert waits.mode(any_paused=False) is FetchMode.IDLE


def test_an_idle_wait_not_above_the_busy_one_keeps_every_fetch_busy() -> None:
    fetcher, flowing = Fetcher(), Assignment({"commands-0": False})
    install(fetcher, FetchWaits(20, 16384, 20))
    one_round(fetcher, flowing, brings=False)
    assert one_round(fetcher, flowing, brings=False) == (20, 16384)


def test_rounds_are_counted_by_mode() -> None:
    fetcher, flowing = Fetcher(), Assignment({"commands-0": False})
    install(fetcher, FetchWaits(20, 16384, 500))
    busy, idle = rounds("busy"), rounds("idle")
    one_round(fetcher, flowing, brings=False)
    one_round(fetcher, flowing, brings=False)
    one_round(fetcher, flowing, brings=False)
    assert (rounds("busy") - busy, rounds("idle") - idle) == (1, 2)


def test_installing_again_replaces_the_pairs_without_wrapping_twice() -> None:
    fetcher, flowing = Fetcher(), Assignment({"commands-0": False})
    install(fetcher, FetchWaits(20, 16384, 500))
    wrapped = fetcher._get_actions_per_node
    assert install(fetcher, FetchWaits(30, 1024, 800))
    assert fetcher._get_actions_per_node is wrapped
    one_round(fetcher, flowing, brings=False)
    assert one_round(fetcher, flowing, brings=False) == (800, 1)
    one_round(fetcher, flowing, brings=True)
    assert fetcher.built[-1] == (800, 1)
    assert one_round(fetcher, flowing, brings=False) == (30, 1024)


def test_a_minimum_below_one_byte_is_one() -> None:
    assert FetchWaits(20, 0, 500).pair(FetchMode.BUSY) == (20, 1)


def test_a_fetcher_without_the_private_methods_is_left_alone() -> None:
    fetcher = SimpleNamespace(_fetch_max_wait_ms=1500, _fetch_min_bytes=1)
    assert not install(fetcher, FetchWaits(20, 16384, 500))
    assert vars(fetcher) == {"_fetch_max_wait_ms": 1500, "_fetch_min_bytes": 1}


def test_pace_finds_the_fetcher_of_fausts_consumer_thread() -> None:
    fetcher = Fetcher()
    consumer = SimpleNamespace(_thread=SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher)))
    assert pace(consumer, busy_wait_ms=20, busy_min_bytes=16384, idle_wait_ms=500)
    assert not pace(SimpleNamespace(), busy_wait_ms=20, busy_min_bytes=16384, idle_wait_ms=500)


def test_the_idle_wait_is_read_from_the_environment() -> None:
    assert Settings.from_env({}).scheduler.consumer_fetch_idle_wait_ms == 500
    env = {"TOCSIN_CONSUMER_FETCH_IDLE_WAIT_MS": "0"}
    assert Settings.from_env(env).scheduler.consumer_fetch_idle_wait_ms == 0

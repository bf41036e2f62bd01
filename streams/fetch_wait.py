"""The worker consumer's fetch wait: short while records flow, long while nothing does.

A fetch asks the broker for records with a minimum (``fetch_min_bytes``) and a wait
(``fetch_max_wait_ms``): the broker answers once the minimum has gathered or the wait has
passed. The worker batches commands by asking for 16 KiB within 20 ms (settings:
consumer_fetch_min_bytes, consumer_fetch_max_wait_ms), so a busy commands topic reaches
it in fuller, fewer rounds. With nothing arriving, the same settings cost a round every
20 ms: 50 empty fetches a second that the worker (aiokafka's fetcher, Faust's consumer
thread) and Kafka pay for nothing.

``FetchWaits`` chooses each fetch's pair instead, from how the last one ended:

- busy (the configured minimum and wait) after a fetch that brought records, and while any
  partition is paused;
- idle (one byte, ``idle_wait_ms``) after a fetch that brought none: the broker holds the
  fetch until the first record arrives, which it returns at once, so a lone command
  arriving at an idle worker waits less than in a busy round, not more; the fetch after it
  is busy again and batches what follows.

Paused partitions keep the busy pair because aiokafka sends one fetch per broker at a time:
a partition resumed while an idle fetch without it is held at the broker waits for that
fetch to end. Pauses follow records (a full stream buffer) or a rebalance (which cancels the
fetch), so an idle fetch almost never holds one; this makes it never.

``install`` wraps the two private methods of aiokafka's fetcher that build each fetch and
end each fetch (instance attributes shadowing the class's, which only the fetcher's own
routine calls), checked against the pinned aiokafka (constraints.txt); rounds are counted
in ``tocsin_consumer_fetch_rounds_total{mode}``, which the integration test reads back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from streams import metrics

log = logging.getLogger("tocsin.worker")


class FetchMode(StrEnum):
    BUSY = "busy"
    IDLE = "idle"


@dataclass
class FetchWaits:
    """Which (fetch_max_wait_ms, fetch_min_bytes) the next fetch asks for."""

    busy_wait_ms: int
    busy_min_bytes: int
    idle_wait_ms: int
    last_brought_records: bool = True  # (the first fetch after an assignment is busy)

    def ended(self, brought_records: bool) -> None:
        """A fetch ended: with records or without (empty, failed or cancelled)."""
        self.last_brought_records = brought_records

    def mode(self, any_paused: bool) -> FetchMode:
        if self.idle_wait_ms <= self.busy_wait_ms or self.last_brought_records or any_paused:
            return FetchMode.BUSY
        return FetchMode.IDLE

    def pair(self, mode: FetchMode) -> tuple[int, int]:
        if mode is FetchMode.IDLE:
            return self.idle_wait_ms, 1
        return self.busy_wait_ms, max(1, self.busy_min_bytes)


def _any_paused(assignment: Any) -> bool:
    tps: Iterable[Any] = assignment.tps
    return any(assignment.state_value(tp).paused for tp in tps)


def pace(consumer: Any, *, busy_wait_ms: int, busy_min_bytes: int, idle_wait_ms: int) -> bool:
    """``install`` on the fetcher of Faust's aiokafka ``consumer`` (its consumer thread's
    AIOKafkaConsumer); False, logged, if it is not where the pinned Faust keeps it."""
    waits = FetchWaits(busy_wait_ms, busy_min_bytes, idle_wait_ms)
    try:
        fetcher = consumer._thread._consumer._fetcher
    except AttributeError as exc:
        log.warning("cannot pace the consumer's fetches", extra={"error": repr(exc)})
        return False
    return install(fetcher, waits)


def install(fetcher: Any, waits: FetchWaits) -> bool:
    """Make aiokafka's ``fetcher`` choose each fetch's wait and minimum with ``waits``
    (idempotent: a later call only replaces the pairs). False, logged, if the fetcher does
    not have the private methods this relies on (an aiokafka upgrade moved them)."""
    current = getattr(fetcher, "_tocsin_fetch_waits", None)
    if isinstance(current, FetchWaits):
        current.busy_wait_ms = waits.busy_wait_ms
        current.busy_min_bytes = waits.busy_min_bytes
        current.idle_wait_ms = waits.idle_wait_ms
        return True
    needed = ("_get_actions_per_node", "_proc_fetch_request", "_fetch_max_wait_ms")
    missing = [name for name in (*needed, "_fetch_min_bytes") if not hasattr(fetcher, name)]
    if missing:
        log.warning("cannot pace the consumer's fetches", extra={"missing": ", ".join(missing)})
        return False
    plan = fetcher._get_actions_per_node
    fetch = fetcher._proc_fetch_request
    rounds = {mode: metrics.CONSUMER_FETCH_ROUNDS.labels(mode.value).inc for mode in FetchMode}

    def get_actions_per_node(assignment: Any) -> Any:
        # The fetcher reads both attributes for each request it builds here.
        mode = waits.mode(_any_paused(assignment))
        fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes = waits.pair(mode)
        actions = plan(assignment)
        for _ in actions[0]:  # the fetch requests it built, one per broker
            rounds[mode]()
        return actions

    async def proc_fetch_request(assignment: Any, node_id: Any, request: Any) -> Any:
        brought: Any = False
        try:
            brought = await fetch(assignment, node_id, request)
        finally:
            waits.ended(bool(brought))
        return brought

    fetcher._get_actions_per_node = get_actions_per_node
    fetcher._proc_fetch_request = proc_fetch_request
    fetcher._tocsin_fetch_waits = waits
    return True

"""streams.coordinator_watch: a worker whose group coordinator moves away from a hung broker
leaves it at once, keeping its member id and generation, instead of at its request timeout."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import (  # type: ignore[import-untyped]
    IncompatibleBrokerVersion,
    KafkaConnectionError,
    NodeNotReadyError,
    RequestTimedOutError,
)
from prometheus_client import REGISTRY

from base.health import Health
from streams.coordinator_watch import (
    CoordinatorWatch,
    TickFailure,
    ask_order,
    gone_nodes,
    metadata_stale,
    moved,
    ready_to_switch,
    tick_failure,
    unanswered,
)

COORDINATION = 1


class FakeConn:
    """An aiokafka connection: ``close`` fails what waits on it, as aiokafka's does."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.closed = False
        self.waiting: list[asyncio.Future[Any]] = []
        self.log = log

    def connected(self) -> bool:
        return not self.closed

    def close(self, reason: object = None) -> None:
        if self.log is not None and not self.closed:
            self.log.append("close")
        self.closed = True
        for fut in self.waiting:
            if not fut.done():
                fut.set_exception(ConnectionError("closed"))


class FakeClient:
    """The part of aiokafka's client the watch uses. ``answers``: what each node says
    coordinates the group (absent: the node hangs); ``heartbeats``: the error code each
    node gives a heartbeat (absent: it hangs)."""

    def __init__(self, brokers: list[int], answers: dict[int, int], heartbeats: dict[int, int]):
        self.cluster = SimpleNamespace(
            brokers=lambda: [SimpleNamespace(nodeId=n) for n in self.brokers],
            update_metadata=self._update_metadata,
            _last_successful_refresh_ms=time.time() * 1000,
        )
        self._metadata_max_age_ms = 1000
        self.events: list[str] = []
        self.brokers = brokers
        self.answers = answers
        self.heartbeats = heartbeats
        self._conns: dict[tuple[int, int], FakeConn] = {}
        self.asked: list[tuple[int, str]] = []

    def _update_metadata(self, metadata: Any) -> None:
        self.brokers = list(metadata.brokers)
        self.cluster._last_successful_refresh_ms = time.time() * 1000
        self.events.append(f"metadata {self.brokers}")

    async def coordinator_lookup(self, coordinator_type: object, key: object) -> str:
        return "stock lookup"

    def in_flight(self, node: int, group: int = COORDINATION) -> asyncio.Future[Any]:
        """A request already waiting on ``node`` (a heartbeat to a hung coordinator)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._conns.setdefault((node, group), FakeConn(self.events)).waiting.append(fut)
        return fut

    async def send(self, node: int, request: Any, *, group: int = 0) -> Any:
        kind = type(request).__name__
        self.asked.append((node, kind))
        if kind == "MetadataRequest":  # the live brokers: those a node answers for
            return SimpleNamespace(brokers=sorted(set(self.answers) | set(self.heartbeats)))
        table = self.answers if kind == "FindCoordinatorRequest" else self.heartbeats
        if node not in table:
            await self.in_flight(node, group)  # never answered
        code = table[node]
        if kind == "FindCoordinatorRequest":
            return SimpleNamespace(error_code=0, coordinator_id=code)
        return SimpleNamespace(error_code=code)


class FakeCoordinator:
    def __init__(self, current: int | None) -> None:
        self.group_id = "scheduler"
        self.coordinator_id = current
        self.generation = 7
        self.member_id = "member-1"

    def coordinator_dead(self) -> None:
        self.coordinator_id = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_of(
    client: FakeClient, coordinator: FakeCoordinator, clock: Clock | None = None
) -> CoordinatorWatch:
    consumer = SimpleNamespace(_client=client, _coordinator=coordinator)
    watch = CoordinatorWatch(consumer, interval_s=1.0, ask_timeout_s=0.05, clock=clock or Clock())
    watch.install_lookup()
    return watch


def test_only_an_answer_naming_another_node_moves_the_coordinator() -> None:
    assert moved(3, 2)
    assert not moved(3, 3)
    assert not moved(None, 2)  # aiokafka is looking itself
    assert not moved(3, None)  # nobody answered


def test_a_node_still_loading_or_not_coordinating_is_not_moved_to() -> None:
    assert [c for c in (0, 14, 15, 16, 22, 25, 27) if ready_to_switch(c)] == [0, 22, 25, 27]


def test_the_current_coordinator_is_never_asked_and_the_first_asked_rotates() -> None:
    assert ask_order([1, 2, 3], 3, 0) == [1, 2]
    assert ask_order([1, 2, 3], 3, 1) == [2, 1]
    assert ask_order([3], 3, 0) == []
    assert ask_order([1, 2, 3], None, 2) == [3, 1, 2]


def test_connections_to_brokers_the_metadata_no_longer_lists_are_the_gone_ones() -> None:
    assert gone_nodes([1, 2, 3, "bootstrap"], [1, 2]) == {3}
    assert gone_nodes([1, 2, 3], []) == set()  # no metadata yet: nothing is gone


async def test_a_moved_coordinator_fails_what_waits_on_the_old_one_and_lookup_finds_new() -> None:
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    coordinator = FakeCoordinator(current=3)
    watch = watch_of(client, coordinator)
    heartbeat = client.in_flight(3)  # to the hung coordinator

    await watch.tick()

    assert heartbeat.done() and heartbeat.exception() is not None
    assert client._conns[(3, COORDINATION)].closed
    assert coordinator.coordinator_id is None  # aiokafka looks it up again...
    assert await client.coordinator_lookup(0, "scheduler") == 2  # ...and finds the new one
    assert await client.coordinator_lookup(0, "other-group") == "stock lookup"
    # Same member and generation: the new coordinator was heartbeated as the member.
    assert (2, "HeartbeatRequest") in client.asked
    assert coordinator.generation == 7 and coordinator.member_id == "member-1"
    assert all(node != 3 for node, _ in client.asked)
    assert watch.switches == 1
    # The metadata the fetcher and the client's re-read go on is the live node's, read
    # before the closes send them there: the hung broker is no longer listed.
    assert client.events[:2] == ["metadata [1, 2]", "close"]


async def test_a_new_coordinator_still_loading_the_group_is_not_moved_to() -> None:
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 14})
    coordinator = FakeCoordinator(current=3)
    watch = watch_of(client, coordinator)
    heartbeat = client.in_flight(3)

    await watch.tick()

    assert not heartbeat.done()
    assert coordinator.coordinator_id == 3
    assert await client.coordinator_lookup(0, "scheduler") == "stock lookup"


async def test_the_same_answer_leaves_the_coordinator_alone() -> None:
    client = FakeClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    coordinator = FakeCoordinator(current=3)
    watch = watch_of(client, coordinator)
    heartbeat = client.in_flight(3)

    await watch.tick()

    assert not heartbeat.done() and coordinator.coordinator_id == 3
    assert watch.switches == 0


async def test_a_hung_broker_asked_is_passed_over_for_the_next() -> None:
    client = FakeClient([1, 2, 3], answers={2: 2}, heartbeats={2: 0})  # node 1 hangs
    coordinator = FakeCoordinator(current=3)
    watch = watch_of(client, coordinator)
    heartbeat = client.in_flight(3)

    await watch.tick()  # node 1 first, unanswered, then node 2

    assert (1, "FindCoordinatorRequest") in client.asked
    assert watch.switches == 1 and heartbeat.exception() is not None


async def test_the_answer_handed_to_the_lookup_goes_stale() -> None:
    clock = Clock()
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    watch = watch_of(client, FakeCoordinator(current=3), clock)
    await watch.tick()
    assert await client.coordinator_lookup(0, "scheduler") == 2

    clock.now += 10
    assert await client.coordinator_lookup(0, "scheduler") == "stock lookup"


async def test_a_broker_the_metadata_dropped_has_its_connections_closed() -> None:
    client = FakeClient([1, 2], answers={1: 2, 2: 2}, heartbeats={})
    watch = watch_of(client, FakeCoordinator(current=2))
    fetch = client.in_flight(3, group=0)  # a fetch from a hung leader, since fenced

    await watch.tick()

    assert fetch.done() and fetch.exception() is not None
    assert client._conns[(3, 0)].closed


def test_metadata_unrefreshed_for_three_periods_is_stale() -> None:
    assert not metadata_stale(now_ms=10_000, refreshed_ms=7_000, max_age_ms=1000)
    assert metadata_stale(now_ms=10_001, refreshed_ms=7_000, max_age_ms=1000)


async def test_metadata_stuck_on_a_hung_broker_is_read_from_a_live_one() -> None:
    """The client's own re-read waits on the hung broker (node 3, leading partitions, not
    coordinating): the watch reads the metadata from the broker that answered it, which no
    longer lists the fenced node, and the fetch waiting there fails at once."""
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={})
    client.cluster._last_successful_refresh_ms = time.time() * 1000 - 20_000
    watch = watch_of(client, FakeCoordinator(current=2))
    fetch = client.in_flight(3, group=0)

    await watch.tick()

    assert (1, "MetadataRequest") in client.asked
    assert fetch.done() and fetch.exception() is not None


async def test_fresh_metadata_is_not_read_again() -> None:
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={})
    watch = watch_of(client, FakeCoordinator(current=2))

    await watch.tick()

    assert [kind for _, kind in client.asked] == ["FindCoordinatorRequest"]


class FoundMeanwhileClient(FakeClient):
    """While the watch reads the new node's metadata, aiokafka's own request to the old
    node fails and its lookup (handed the watch's answer) finds the new coordinator."""

    coordinator: FakeCoordinator

    async def send(self, node: int, request: Any, *, group: int = 0) -> Any:
        resp = await super().send(node, request, group=group)
        if type(request).__name__ == "MetadataRequest":
            self.coordinator.coordinator_dead()
            self.coordinator.coordinator_id = await self.coordinator_lookup(0, "scheduler")
        return resp


async def test_a_coordinator_aiokafka_found_meanwhile_is_not_marked_dead() -> None:
    """Marked dead, a JoinGroup or SyncGroup under way at the new coordinator would be
    given up (aiokafka sends the SyncGroup to coordinator_id, None then) and the group
    would go through another rebalance round."""
    client = FoundMeanwhileClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    coordinator = FakeCoordinator(current=3)
    client.coordinator = coordinator
    watch = watch_of(client, coordinator)

    await watch.tick()

    assert watch.switches == 1
    assert coordinator.coordinator_id == 2


async def test_a_watch_stopped_before_the_consumer_thread_ran_it_does_not_run() -> None:
    """The worker stopping right after the first assignment: stop() reaches the consumer
    thread's loop before the watch's coroutine has begun there."""
    thread_loop = asyncio.new_event_loop()
    client = FakeClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    consumer = SimpleNamespace(_client=client, _coordinator=FakeCoordinator(current=3))
    watch = CoordinatorWatch(consumer, interval_s=60.0, ask_timeout_s=0.05)
    assert watch.start(thread_loop)
    watch.stop()

    def turn(coro: Any) -> None:
        thread = threading.Thread(target=thread_loop.run_until_complete, args=(coro,))
        thread.start()
        thread.join()

    turn(asyncio.sleep(0.01))  # the loop turns: the watch starts, or the stop lands first
    try:
        assert watch._running is None or watch._running.done()
    finally:

        async def cancel_all() -> None:
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        turn(cancel_all())
        thread_loop.close()


async def test_on_a_single_broker_the_watch_sends_nothing_and_closes_nothing() -> None:
    """The local stack: the only broker is the coordinator, never asked, and it is listed,
    so nothing is gone; even with metadata the client has not refreshed for a while."""
    client = FakeClient([1], answers={1: 1}, heartbeats={1: 0})
    client.cluster._last_successful_refresh_ms = time.time() * 1000 - 20_000
    coordinator = FakeCoordinator(current=1)
    watch = watch_of(client, coordinator)
    heartbeat = client.in_flight(1)
    fetch = client.in_flight(1, group=0)

    await watch.tick()
    coordinator.coordinator_id = None  # aiokafka looking it up: only the gone check runs
    await watch.tick()

    assert client.asked == []
    assert not heartbeat.done() and not fetch.done()
    assert watch.switches == 0


class BrokenClient(FakeClient):
    """A client whose ``send`` fails with a programming error (a TypeError, as an aiokafka
    past the pinned version changing a private signature would) for one kind of request."""

    broken: str

    async def send(self, node: int, request: Any, *, group: int = 0) -> Any:
        if type(request).__name__ == self.broken:
            raise TypeError("send() got an unexpected keyword argument 'group'")
        return await super().send(node, request, group=group)


@pytest.mark.parametrize(
    "broken", ["FindCoordinatorRequest", "HeartbeatRequest", "MetadataRequest"]
)
async def test_an_error_that_is_not_a_kafka_one_is_not_taken_for_a_retriable_one(
    broken: str,
) -> None:
    """Taken for an unanswered request, it left the watch asking in vain every second with
    nothing logged; raised, the watch's loop logs it."""
    client = BrokenClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    client.broken = broken
    watch = watch_of(client, FakeCoordinator(current=3))

    with pytest.raises(TypeError):
        await watch.tick()


def test_only_retriable_failures_of_a_request_are_asked_again() -> None:
    assert unanswered(KafkaConnectionError()) and unanswered(NodeNotReadyError())
    assert unanswered(RequestTimedOutError()) and unanswered(TimeoutError())
    assert unanswered(ConnectionResetError())
    assert not unanswered(IncompatibleBrokerVersion())  # the broker cannot take it
    assert not unanswered(TypeError("send() got an unexpected keyword argument"))


async def test_the_answer_is_no_longer_handed_out_once_aiokafka_is_on_that_node() -> None:
    """A lookup after aiokafka took the new coordinator means that node failed too (it said
    "not the coordinator": the group moved again). Handed the same answer, aiokafka went
    back to it until the answer went stale (3 intervals), failing a heartbeat or commit
    there each time, instead of asking a broker."""
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    coordinator = FakeCoordinator(current=3)
    watch = watch_of(client, coordinator)
    await watch.tick()
    coordinator.coordinator_id = await client.coordinator_lookup(0, "scheduler")
    assert coordinator.coordinator_id == 2
    await watch.tick()  # aiokafka on the new node: nothing moves

    coordinator.coordinator_dead()  # "not the coordinator" from node 2
    assert await client.coordinator_lookup(0, "scheduler") == "stock lookup"


async def test_a_stop_landing_with_an_answer_still_stops_the_watch() -> None:
    """The stop's cancellation reaches the watch in the loop turn in which the broker's
    answer completes its request: Python 3.11's asyncio.wait_for then returns the answer
    and drops the cancellation, and the watch ran on after its consumer had stopped."""
    thread_loop = asyncio.new_event_loop()
    asked = threading.Event()

    class HeldClient(FakeClient):
        held: asyncio.Future[Any] | None = None

        async def send(self, node: int, request: Any, *, group: int = 0) -> Any:
            if type(request).__name__ == "FindCoordinatorRequest" and self.held is None:
                self.held = asyncio.get_running_loop().create_future()
                asked.set()
                return await self.held
            return await super().send(node, request, group=group)

    client = HeldClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    consumer = SimpleNamespace(_client=client, _coordinator=FakeCoordinator(current=3))
    watch = CoordinatorWatch(consumer, interval_s=0.01, ask_timeout_s=60.0)
    thread = threading.Thread(target=thread_loop.run_forever)
    thread.start()
    try:
        assert watch.start(thread_loop)
        assert asked.wait(10)

        def answer_and_stop() -> None:  # in one loop turn, as stop() does on the thread
            assert client.held is not None
            client.held.set_result(SimpleNamespace(error_code=0, coordinator_id=3))
            watch._cancel_on_thread()

        thread_loop.call_soon_threadsafe(answer_and_stop)
        for _ in range(1000):  # a bound, not a timing: it ends at once when stopped
            if watch._running is not None and watch._running.done():
                break
            await asyncio.sleep(0.01)
        assert watch._running is not None and watch._running.done()
    finally:

        async def cancel_all() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(cancel_all(), thread_loop))
        thread_loop.call_soon_threadsafe(thread_loop.stop)
        thread.join()
        thread_loop.close()


# --- what the watch exports: its moves, closes, re-reads and failures as metrics, and its
# death as the process's health ---------------------------------------------------------


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_switch_is_counted_with_the_metadata_read_before_it() -> None:
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    watch = watch_of(client, FakeCoordinator(current=3))
    switches = sample("tocsin_coordinator_watch_switches_total")
    reads = sample("tocsin_coordinator_watch_metadata_reads_total", reason="switch")

    await watch.tick()

    assert sample("tocsin_coordinator_watch_switches_total") == switches + 1
    assert sample("tocsin_coordinator_watch_metadata_reads_total", reason="switch") == reads + 1


async def test_no_move_counts_no_switch() -> None:
    client = FakeClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    watch = watch_of(client, FakeCoordinator(current=3))
    switches = sample("tocsin_coordinator_watch_switches_total")

    await watch.tick()

    assert sample("tocsin_coordinator_watch_switches_total") == switches


async def test_a_broker_gone_from_the_metadata_is_counted_when_its_connections_close() -> None:
    client = FakeClient([1, 2], answers={1: 2, 2: 2}, heartbeats={})
    watch = watch_of(client, FakeCoordinator(current=2))
    client.in_flight(3, group=0)
    closes = sample("tocsin_coordinator_watch_gone_closes_total")

    await watch.tick()
    await watch.tick()  # closed already: not counted again

    assert sample("tocsin_coordinator_watch_gone_closes_total") == closes + 1


async def test_a_stale_metadata_read_from_a_live_broker_is_counted() -> None:
    client = FakeClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={})
    client.cluster._last_successful_refresh_ms = time.time() * 1000 - 20_000
    watch = watch_of(client, FakeCoordinator(current=2))
    reads = sample("tocsin_coordinator_watch_metadata_reads_total", reason="stale")

    await watch.tick()

    assert sample("tocsin_coordinator_watch_metadata_reads_total", reason="stale") == reads + 1


async def test_a_tick_that_no_broker_answered_is_counted_as_failed() -> None:
    client = FakeClient([1, 2, 3], answers={}, heartbeats={})  # nodes 1 and 2 hang
    watch = watch_of(client, FakeCoordinator(current=3))
    failed = sample("tocsin_coordinator_watch_failed_ticks_total", error="unanswered")

    await watch.tick()

    assert sample("tocsin_coordinator_watch_failed_ticks_total", error="unanswered") == failed + 1


def test_a_tick_failure_is_classed_into_a_fixed_set() -> None:
    assert tick_failure(IncompatibleBrokerVersion()) == TickFailure.KAFKA
    assert tick_failure(NodeNotReadyError()) == TickFailure.KAFKA_RETRIABLE
    assert tick_failure(ConnectionResetError()) == TickFailure.CONNECTION
    assert tick_failure(TimeoutError()) == TickFailure.CONNECTION
    assert tick_failure(TypeError("unexpected keyword")) == TickFailure.OTHER
    assert tick_failure(KeyError("whatever a new aiokafka raises")) == TickFailure.OTHER


async def test_a_tick_that_raised_is_counted_by_its_error_class() -> None:
    client = BrokenClient([1, 2, 3], answers={1: 2, 2: 2}, heartbeats={2: 0})
    client.broken = "FindCoordinatorRequest"
    consumer = SimpleNamespace(_client=client, _coordinator=FakeCoordinator(current=3))
    watch = CoordinatorWatch(consumer, interval_s=0.001, ask_timeout_s=0.05)
    failed = sample("tocsin_coordinator_watch_failed_ticks_total", error="other")
    run = asyncio.ensure_future(watch._install_and_run())
    try:
        for _ in range(1000):  # a bound, not a timing: the first tick fails
            if sample("tocsin_coordinator_watch_failed_ticks_total", error="other") > failed:
                break
            await asyncio.sleep(0.001)
        assert sample("tocsin_coordinator_watch_failed_ticks_total", error="other") > failed
        assert not run.done()  # a failed tick does not end the watch
    finally:
        watch._cancel_on_thread()
        with contextlib.suppress(asyncio.CancelledError):
            await run


async def test_a_watch_that_dies_fails_the_process_health() -> None:
    """The watch's coroutine ends with an error (here its lookup cannot be installed: the
    consumer's coordinator lacks the group id an aiokafka past the pinned one may drop):
    the worker is left on the stock behaviour, and nothing but a line in a log said so."""
    thread_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=thread_loop.run_forever)
    thread.start()
    health = Health()
    client = FakeClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    consumer = SimpleNamespace(_client=client, _coordinator=SimpleNamespace(coordinator_id=3))
    watch = CoordinatorWatch(consumer, interval_s=60.0, ask_timeout_s=0.05, health=health)
    try:
        assert watch.start(thread_loop)
        for _ in range(1000):  # a bound, not a timing: it dies at once
            if not health.live()[0]:
                break
            await asyncio.sleep(0.01)
        live, why = health.live()
        assert not live and "coordinator watch" in why
    finally:
        watch.stop()
        thread_loop.call_soon_threadsafe(thread_loop.stop)
        thread.join()
        thread_loop.close()


async def test_a_watch_stopped_leaves_the_health_alone() -> None:
    thread_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=thread_loop.run_forever)
    thread.start()
    health = Health()
    client = FakeClient([1, 2, 3], answers={1: 3, 2: 3}, heartbeats={})
    consumer = SimpleNamespace(_client=client, _coordinator=FakeCoordinator(current=3))
    watch = CoordinatorWatch(consumer, interval_s=0.01, ask_timeout_s=0.05, health=health)
    try:
        assert watch.start(thread_loop)
        task = watch._task
        assert task is not None
        for _ in range(1000):  # a bound: until the watch runs on the thread's loop
            if watch._running is not None:
                break
            await asyncio.sleep(0.01)
        watch.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert health.live() == (True, "ok")
    finally:
        thread_loop.call_soon_threadsafe(thread_loop.stop)
        thread.join()
        thread_loop.close()

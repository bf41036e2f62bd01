"""The worker's group coordinator, followed when it moves without an error.

aiokafka looks for its group's coordinator only after a request to it fails. A hung broker
(a stopped process, a frozen VM) keeps its connections open and answers nothing, so a
worker whose coordinator hangs learns nothing until its heartbeat's request timeout (15 s,
``TOCSIN_WORKER_KAFKA_REQUEST_TIMEOUT_S``, which Faust keeps at or above the session
timeout). By then the new coordinator, which loaded the group when the hung broker was
fenced, has expired the member: the group rebalances, or a worker whose reconnection also
hangs keeps firing beside the one that took its partitions.

``CoordinatorWatch`` does for the worker what librdkafka's ``coordinator.query.interval.ms``
does for the proxy: every ``interval_s`` it asks a live broker (never the one it is
heartbeating, which may be the hung one) which node coordinates the group. When the answer
is another node, it first heartbeats that node with the member's id and generation; if the
node answers as the group's coordinator (any answer but "not the coordinator":
``NOT_READY_CODES``), it closes the consumer's connections to the old node, so the
heartbeat and commit waiting there fail at once, and aiokafka's own retry finds the new
node through the answer the watch hands it (``coordinator_lookup`` is asked the watch
first: the stock lookup asks a random broker, possibly the hung one). The member carries
on with the same id and generation: no rebalance.

It runs on the loop of Faust's consumer thread, which owns the aiokafka consumer
(``start`` is called from the worker's loop and hands it there). It relies on aiokafka
0.14's private ``_client``, ``_coordinator`` and ``_conns`` (constraints.txt pins it);
``start`` logs and does nothing if they are not there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from aiokafka.client import ConnectionGroup, CoordinationType  # type: ignore[import-untyped]
from aiokafka.conn import CloseReason  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped]
from aiokafka.protocol.coordination import (  # type: ignore[import-untyped]
    FindCoordinatorRequest,
)
from aiokafka.protocol.group import HeartbeatRequest  # type: ignore[import-untyped]
from aiokafka.protocol.metadata import MetadataRequest  # type: ignore[import-untyped]

from base.supervise import HealthSink
from streams import metrics

log = logging.getLogger("tocsin.worker")
# The health component a dead watch fails (``/healthz`` answers 503).
HEALTH_COMPONENT = "coordinator watch"

# Kafka error codes of a heartbeat to the node that now says it coordinates the group,
# after which the consumer must not move there yet: it is not, or no longer, the
# coordinator (COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR), or loading the group
# (COORDINATOR_LOAD_IN_PROGRESS, which Kafka's group coordinators do not give a heartbeat:
# they answer it with no error while loading, so the consumer may move to a coordinator
# still loading the group, where its commits and joins are refused as loading and retried
# by aiokafka). Any other answer: no error or a rebalance in progress keeps the member, and
# an unknown member or stale generation is for the consumer to handle there (it rejoins).
NOT_READY_CODES = frozenset({14, 15, 16})
# How long an answer stays the one handed to aiokafka's coordinator lookup: a few
# intervals, so a lookup soon after the switch uses it, and a stale one is never used.
HINT_TTL_INTERVALS = 3


def moved(current: int | None, answer: int | None) -> bool:
    """Whether the consumer must leave its coordinator: a live broker names another node.
    With no coordinator (aiokafka is looking for one itself) or no answer, nothing moves."""
    return current is not None and answer is not None and answer != current


def ready_to_switch(error_code: int) -> bool:
    """Whether a heartbeat's answer shows that the node holds the group (``NOT_READY_CODES``)."""
    return error_code not in NOT_READY_CODES


def ask_order(brokers: Iterable[int], coordinator: int | None, turn: int) -> list[int]:
    """The brokers to ask which node coordinates the group, in order: every known broker
    but the current coordinator (a hung one would hold the question until the request
    timeout), starting one further along each turn so that a hung one is not always first."""
    nodes = sorted({b for b in brokers if b != coordinator})
    if not nodes:
        return []
    k = turn % len(nodes)
    return nodes[k:] + nodes[:k]


def gone_nodes(connected: Iterable[object], brokers: Iterable[int]) -> set[int]:
    """The nodes the client holds connections to that the cluster's metadata no longer
    lists (KRaft leaves a fenced broker out): a request waiting on such a node, a fetch
    from a hung leader say, is failed at once and re-planned on the new leaders. With no
    brokers listed (no metadata yet), none."""
    known = set(brokers)
    if not known:
        return set()
    return {n for n in connected if isinstance(n, int) and n not in known}


class TickFailure(StrEnum):
    """Why a tick of the watch could not do its work (the label of
    ``tocsin_coordinator_watch_failed_ticks_total``: a fixed set, whatever is raised)."""

    UNANSWERED = "unanswered"  # no broker asked said which node coordinates the group
    KAFKA = "kafka"  # a Kafka error that is not retriable (a request the broker refuses)
    KAFKA_RETRIABLE = "kafka_retriable"  # a retriable one that reached the loop
    CONNECTION = "connection"  # a timeout or socket error that reached the loop
    OTHER = "other"  # anything else: a programming error, an aiokafka past the pinned one


def tick_failure(exc: BaseException) -> TickFailure:
    """The class of an error that ended a tick."""
    if isinstance(exc, KafkaError):
        return TickFailure.KAFKA_RETRIABLE if exc.retriable else TickFailure.KAFKA
    if isinstance(exc, TimeoutError | OSError):
        return TickFailure.CONNECTION
    return TickFailure.OTHER


def follow(
    faust_consumer: Any, *, interval_s: float, health: HealthSink | None = None
) -> CoordinatorWatch | None:
    """A started ``CoordinatorWatch`` on the aiokafka consumer of Faust's ``faust_consumer``
    (its consumer thread's), run on that thread's loop; None, logged, if the consumer is
    not where the pinned Faust keeps it or has not started."""
    try:
        thread = faust_consumer._thread
        consumer, loop = thread._consumer, thread.thread_loop
    except AttributeError as exc:
        log.warning("cannot follow the group coordinator", extra={"error": repr(exc)})
        return None
    if consumer is None or loop is None:
        return None
    watch = CoordinatorWatch(
        consumer, interval_s=interval_s, ask_timeout_s=interval_s, health=health
    )
    if not watch.start(loop):
        return None
    log.info("following the group coordinator", extra={"interval_s": interval_s})
    return watch


def unanswered(exc: BaseException) -> bool:
    """Whether a request's failure is one to ask again after (retriable): no answer in time,
    a connection refused or broken, a node not (yet) in the metadata. Anything else (a
    request the broker cannot take, a programming error such as an aiokafka past the pinned
    version changing a private signature) is raised to the watch's loop, which logs it."""
    if isinstance(exc, KafkaError):
        return bool(exc.retriable)
    return isinstance(exc, TimeoutError | OSError)


def metadata_stale(now_ms: float, refreshed_ms: float, max_age_ms: float) -> bool:
    """Whether the client's metadata has gone unrefreshed for three of its refresh periods:
    its re-read is waiting on a hung broker (aiokafka asks the brokers one at a time and
    gives each the request timeout, 15 s), so it neither sees the hung leader's partitions
    move nor stops fetching from it."""
    return now_ms - refreshed_ms > 3 * max_age_ms


class CoordinatorWatch:
    """Follows the group coordinator of one aiokafka consumer (see the module's text)."""

    def __init__(
        self,
        consumer: Any,
        *,
        interval_s: float,
        ask_timeout_s: float,
        clock: Any = time.monotonic,
        health: HealthSink | None = None,
    ) -> None:
        self._consumer = consumer
        self._health = health
        self._interval_s = interval_s
        self._ask_timeout_s = ask_timeout_s
        self._clock = clock
        self._turn = 0
        self._hint: tuple[int, float] | None = None  # (node, until) for the lookup
        self._task: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.switches = 0

    # --- set-up, from the worker's loop -------------------------------------------------

    def start(self, thread_loop: asyncio.AbstractEventLoop) -> bool:
        """Run the watch on ``thread_loop`` (the loop of the consumer's thread). False,
        logged, if the consumer lacks what this relies on."""
        missing = [
            name
            for obj, name in (
                (self._consumer, "_client"),
                (self._consumer, "_coordinator"),
            )
            if not hasattr(obj, name)
        ]
        client = getattr(self._consumer, "_client", None)
        needed = ("_conns", "_metadata_max_age_ms", "cluster", "coordinator_lookup", "send")
        missing += [n for n in needed if not hasattr(client, n)]
        if missing:
            log.warning(
                "cannot follow the group coordinator", extra={"missing": ", ".join(missing)}
            )
            return False
        if self._task is not None:
            return True
        self._loop = thread_loop
        self._task = asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._install_and_run(), thread_loop)
        )
        self._task.add_done_callback(self._ended)
        return True

    def _ended(self, task: asyncio.Future[None]) -> None:
        """The watch's coroutine has ended: by its stop (cancelled, or returned once
        stopped), or it died, which leaves the worker on the stock behaviour (its
        coordinator followed only at the request timeout), so the process is failed."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None and self._stopped:
            return
        why = repr(exc) if exc is not None else "it ended without a stop"
        log.error("group coordinator watch died", exc_info=exc, extra={"error": why})
        if self._health is not None:
            self._health.fail(HEALTH_COMPONENT, f"the group coordinator watch died: {why}")

    def stop(self) -> None:
        """End the watch for good: a watch once stopped does not run again (``_stopped``),
        so the worker builds one per consumer and stops it only at shutdown."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the thread's loop already ended
                loop.call_soon_threadsafe(self._cancel_on_thread)
        self._task = None

    # --- on the consumer's thread -------------------------------------------------------

    _running: asyncio.Task[None] | None = None
    # Set by a stop that reached the thread's loop before the coroutine began there
    # (nothing to cancel yet): the coroutine then does not begin.
    _stopped = False

    def _cancel_on_thread(self) -> None:
        self._stopped = True
        if self._running is not None:
            self._running.cancel()

    async def _install_and_run(self) -> None:
        if self._stopped:
            return
        self._running = asyncio.current_task()
        self.install_lookup()
        # Checked as well as cancelled: Python 3.11's asyncio.wait_for drops a cancellation
        # that arrives in the loop turn in which the request it waits on completes.
        while not self._stopped:
            await asyncio.sleep(self._interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a watch that dies would leave the stock behaviour
                metrics.COORDINATOR_WATCH_FAILURES.labels(tick_failure(exc)).inc()
                log.warning("group coordinator watch failed", extra={"error": repr(exc)})

    def install_lookup(self) -> None:
        """Make the consumer's coordinator lookup use the watch's answer while it is fresh."""
        client = self._consumer._client
        if getattr(client, "_tocsin_coordinator_watch", None) is self:
            return
        stock = client.coordinator_lookup
        group_id = self._consumer._coordinator.group_id

        async def coordinator_lookup(coordinator_type: Any, coordinator_key: Any) -> Any:
            hint = self.hint()
            if hint is not None and coordinator_key == group_id:
                return hint
            return await stock(coordinator_type, coordinator_key)

        client.coordinator_lookup = coordinator_lookup
        client._tocsin_coordinator_watch = self

    def hint(self) -> int | None:
        if self._hint is None:
            return None
        node, until = self._hint
        if self._clock() > until:
            self._hint = None
            return None
        return node

    async def tick(self) -> None:
        coordinator = self._consumer._coordinator
        client = self._consumer._client
        current: int | None = getattr(coordinator, "coordinator_id", None)
        if current is None:
            self._close_gone(client)
            return  # no group, or aiokafka is looking for its coordinator itself
        if self._hint is not None and self._hint[0] == current:
            # aiokafka is on the answer: a lookup after this means that node failed too,
            # and the stock lookup asks a broker where the answer would send it back.
            self._hint = None
        nodes = ask_order([b.nodeId for b in client.cluster.brokers()], current, self._turn)
        self._turn += 1
        answer, responder = await self._ask(client, coordinator.group_id, nodes)
        if nodes and responder is None:
            metrics.COORDINATOR_WATCH_FAILURES.labels(TickFailure.UNANSWERED).inc()
        if responder is not None and metadata_stale(
            time.time() * 1000,
            client.cluster._last_successful_refresh_ms,
            client._metadata_max_age_ms,
        ):
            log.warning("re-reading the metadata from a live broker", extra={"node": responder})
            await self._refresh_metadata(client, responder, reason="stale")
        self._close_gone(client)
        if not moved(current, answer) or coordinator.coordinator_id != current:
            return
        assert answer is not None
        code = await self._probe(client, coordinator, answer)
        if code is None or not ready_to_switch(code) or coordinator.coordinator_id != current:
            return
        self._hint = (answer, self._clock() + HINT_TTL_INTERVALS * self._interval_s)
        self.switches += 1
        metrics.COORDINATOR_SWITCHES.inc()
        log.warning(
            "group coordinator moved: leaving the old one",
            extra={"group": coordinator.group_id, "old": current, "new": answer, "probe": code},
        )
        await self._refresh_metadata(client, answer, reason="switch")
        self._close_node(client, current)
        # Also when nothing was in flight there: the next heartbeat must not reconnect to
        # the old node. The lookup that follows gets the answer above. Not when aiokafka
        # has left the old node itself during the metadata read: the coordinator it found
        # may be in the middle of a join, which marking it dead would abandon.
        if coordinator.coordinator_id == current:
            coordinator.coordinator_dead()

    def _close_gone(self, client: Any) -> None:
        brokers = [b.nodeId for b in client.cluster.brokers()]
        connected = [key[0] for key, conn in client._conns.items() if conn.connected()]
        for node in gone_nodes(connected, brokers):
            log.warning(
                "closing the connections to a broker the metadata no longer lists",
                extra={"node": node},
            )
            metrics.COORDINATOR_GONE_CLOSES.inc()
            self._close_node(client, node)

    async def _ask(
        self, client: Any, group_id: str, nodes: list[int]
    ) -> tuple[int | None, int | None]:
        """Which node coordinates the group, and which node said so (live), asking
        ``nodes`` in turn; (None, None) if none answered."""
        for node in nodes:
            try:
                resp = await asyncio.wait_for(
                    client.send(
                        node,
                        FindCoordinatorRequest(group_id, CoordinationType.GROUP),
                        group=ConnectionGroup.COORDINATION,
                    ),
                    self._ask_timeout_s,
                )
            except Exception as exc:  # unanswered, refused or disconnected: the next node
                if not unanswered(exc):
                    raise
                continue
            if resp.error_code == 0:
                node_id: int = resp.coordinator_id
                return node_id, node
        return None, None

    async def _probe(self, client: Any, coordinator: Any, node: int) -> int | None:
        if coordinator.member_id == "":  # not a member yet: nothing to keep
            return 0
        request = HeartbeatRequest(
            coordinator.group_id, coordinator.generation, coordinator.member_id
        )
        try:
            resp = await asyncio.wait_for(
                client.send(node, request, group=ConnectionGroup.COORDINATION),
                self._ask_timeout_s,
            )
        except Exception as exc:  # unanswered or disconnected: asked again next turn
            if not unanswered(exc):
                raise
            return None
        code: int = resp.error_code
        return code

    async def _refresh_metadata(self, client: Any, node: int, *, reason: str) -> None:
        """The cluster's metadata read from ``node`` (live: it just answered), before the old
        coordinator's connections are closed. The closes make the fetcher re-plan and the
        client re-read metadata at once; on the metadata from before the fencing, both went
        back to the hung broker (it still led partitions and was listed), where a new
        connection waits out the request timeout (15 s) and holds the client's connection
        lock meanwhile. Read here, it no longer lists the fenced broker nor leaders on it
        (KRaft leaves fenced brokers out of metadata). Also when the client's own re-read is
        stuck on a hung broker (``metadata_stale``)."""
        topics = getattr(client, "_topics", None)
        request = MetadataRequest(list(topics) if topics else None)
        try:
            resp = await asyncio.wait_for(
                client.send(node, request, group=ConnectionGroup.COORDINATION),
                self._ask_timeout_s,
            )
        except Exception as exc:  # unanswered: the client's own re-read follows the closes
            if not unanswered(exc):
                raise
            return
        if resp.brokers:
            client.cluster.update_metadata(resp)
            metrics.COORDINATOR_METADATA_READS.labels(reason).inc()

    @staticmethod
    def _close_node(client: Any, node: int) -> None:
        """Close every connection of the consumer's client to ``node``: what waits there
        fails now (a heartbeat or commit is retried at the new coordinator, a fetch or a
        metadata request on another broker) instead of at its request timeout."""
        for key, conn in list(client._conns.items()):
            if key[0] == node:
                conn.close(reason=CloseReason.CONNECTION_BROKEN)

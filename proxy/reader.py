"""The reader thread: the proxy's only Kafka consumer, which only polls.

It turns polled records into envelopes, pushes them into the bounded pending queue and,
while the queue is over its high-water mark, pauses the partitions that hold pending
messages (one holding none is still read, so no partition is left unread behind another's;
everything resumes under the low-water mark, ``flow_plan``). It never waits on a
receiver, so however slow the endpoints are, it polls well within ``max.poll.interval.ms``
and slow receivers never cause rebalances. With every partition paused it keeps polling:
that serves heartbeats and rebalance callbacks and fetches nothing.

Rebalance callbacks run on this thread (inside ``consume``). On revoke it stops new
attempts for the partitions, waits (bounded) for running attempts to finish, commits what
is done and drops the rest: a rebalance can duplicate a message, never lose one.

Auto-commit is off and offsets only ever go up to the contiguous done prefix. Every call
on the consumer happens on this thread: confluent-kafka serialises calls on one consumer,
and a consumer polled in a tight loop starves other threads' calls (a commit from another
thread was seen to wait forever). So the committer thread only *asks* for a commit
(``request_commit``) and this thread sends it, asynchronously, between polls.

A reader either subscribes to its topics (its consumer group assigns it partitions), or,
with ``subscribe=False``, *follows*: it joins no group and reads exactly the partitions
another thread hands it with ``follow`` (the retry lane follows the main lane's assignment,
proxy.app). A followed partition starts from the group's committed offset and is revoked
like a subscribed one (running attempts finish within ``revoke_timeout_s``, what is done
is committed, the rest dropped), between polls on this thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import cast

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, Message, TopicPartition
from confluent_kafka import KafkaError as RdKafkaError

from base.errors import KafkaError
from base.settings import KafkaConfig
from proxy.envelope import Envelope, KafkaHeaders
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer

log = logging.getLogger("tocsin.proxy")

BATCH = 500
# How long one turn of the poll loop waits when no record is there: the idle tick at which
# stop, partition changes and commit requests are seen. A record that arrives ends the wait.
IDLE_WAIT_S = 0.1
# How often the consumer asks a broker which one coordinates its group (librdkafka's
# coordinator.query.interval.ms, stock 10 minutes). librdkafka gives a heartbeat the whole
# session timeout to be answered, so a member whose coordinator hangs (a stopped broker
# keeps its connections open) learns nothing until its session has run out; it then loses
# its partitions and rejoins under a fresh member id, and the group's new coordinator holds
# that rejoin until the abandoned id has expired too, a second session timeout. Asked
# every second, the member finds the new coordinator within a second of the controller
# fencing the hung broker, moves its heartbeats there and keeps its membership. One small
# request a second per consumer.
COORDINATOR_QUERY_INTERVAL_MS = 1000
# How often, at most, the consumer re-reads the leaders of its partitions (librdkafka's
# topic.metadata.refresh.interval.ms, for every other client TOCSIN_KAFKA_METADATA_REFRESH_MS,
# 5 s). A fetch sent to a hung leader is never answered, so only this tells the consumer
# that the controller has moved the partition: a hung broker's fires were read up to one
# interval after its fencing. One small request a second per consumer.
METADATA_REFRESH_MS = 1000
# Heartbeats per session timeout. A session runs from the last answered heartbeat, so the
# more often they go, the more of it is left when a coordinator stops answering, for the
# member to find the next one in.
HEARTBEATS_PER_SESSION = 10

TP = tuple[str, int]


@dataclass(slots=True)
class _Change:
    """A change of a following reader's partitions, applied on its thread."""

    add: list[TP]
    remove: list[TP]
    commit: bool  # on removal: commit what is done (False: the partitions were lost)
    applied: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """What the reader does to its partitions after a turn of the poll loop."""

    pause: frozenset[TP] = frozenset()
    resume: frozenset[TP] = frozenset()


def flow_plan(
    *, want_paused: bool, assigned: Iterable[TP], holding: set[TP], paused: set[TP]
) -> FlowPlan:
    """The pause/resume decision. While the pending queue wants the reader to stop
    (``OrderQueue.should_pause``, with its hysteresis), the partitions that hold pending
    messages are paused and the ones that hold none are read: pausing those frees no
    memory, and would leave whatever they carry unread for as long as other partitions
    hold the bound (a failing tenant's messages, say). Pausing drops what was fetched
    for a partition and not yet consumed, and after a resume the same partition's fetch
    tends to come first again, so a reader that paused everything at the bound could read
    one partition only, turn after turn. Under the low-water mark, everything is read.
    What is held stays within the bound plus one read per partition."""
    target = {tp for tp in assigned if tp in holding} if want_paused else set()
    return FlowPlan(pause=frozenset(target - paused), resume=frozenset(paused - target))


def read_ready(consumer: Consumer, batch: int, wait_s: float) -> list[Message]:
    """Up to ``batch`` records, returned as soon as there is one.

    librdkafka's ``consume(n, timeout)`` returns only once it holds n records or the timeout
    has passed, so under a steady trickle every call would wait out the whole timeout, and
    every delivery with it. What is already fetched is taken without waiting; with nothing
    there, the wait is for a single record, and whatever came with it is taken after it."""
    msgs = consumer.consume(num_messages=batch, timeout=0)
    if msgs or batch <= 1:
        return msgs
    msgs = consumer.consume(num_messages=1, timeout=wait_s)
    if msgs:
        msgs += consumer.consume(num_messages=batch - 1, timeout=0)
    return msgs


def consumer_config(kafka_conf: KafkaConfig, s: ProxySettings) -> KafkaConfig:
    conf = dict(kafka_conf)
    conf.update(
        {
            "group.id": s.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "max.poll.interval.ms": int(s.max_poll_interval_s * 1000),
            "session.timeout.ms": int(s.session_timeout_s * 1000),
            "heartbeat.interval.ms": max(
                100, int(s.session_timeout_s * 1000 / HEARTBEATS_PER_SESSION)
            ),
            "coordinator.query.interval.ms": COORDINATOR_QUERY_INTERVAL_MS,
            "topic.metadata.refresh.interval.ms": min(
                METADATA_REFRESH_MS,
                int(conf.get("topic.metadata.refresh.interval.ms", METADATA_REFRESH_MS)),
            ),
            # librdkafka prefetches on its own; keep that buffer small next to our bound so the
            # process's memory is governed by max_pending_bytes, not by the client library.
            "queued.max.messages.kbytes": max(1024, min(4096, s.max_pending_bytes // 16384)),
            "fetch.wait.max.ms": 100,
        }
    )
    return conf


class Reader:
    def __init__(
        self,
        *,
        kafka_conf: KafkaConfig,
        settings: ProxySettings,
        topics: list[str],
        state: SharedState,
        writer: Writer,
        outbox: Outbox,
        metrics: ProxyMetrics,
        prepare: Callable[[Envelope], None],
        commit: Callable[[Consumer, dict[tuple[str, int], int]], None],
        name: str = "proxy-reader",
        subscribe: bool = True,
        on_assigned: Callable[[list[TP]], None] | None = None,
        on_revoked: Callable[[list[TP], bool], None] | None = None,
    ) -> None:
        self._s = settings
        self._topics = topics
        self._state = state
        self._writer = writer
        self._outbox = outbox
        self._metrics = metrics
        self._prepare = prepare
        self._commit = commit
        self.subscribe = subscribe
        # Settable until ``start``. The hooks are told (on this thread, inside the rebalance
        # callback) which partitions came or went, so a follower can move with this reader
        # before it fetches them or once it let them go.
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self._changes: list[_Change] = []
        self._changes_lock = threading.Lock()
        self._changes_closed = False
        self._conf = consumer_config(kafka_conf, settings)
        self._conf["on_commit"] = self._on_commit
        self._commit_requested = threading.Event()
        self.consumer: Consumer | None = None
        self._stop = threading.Event()
        self.stopped_reading = threading.Event()
        self._may_close = threading.Event()
        self.closed = threading.Event()
        self._paused = False  # the pending queue's wish, for the log
        self._paused_tps: set[TP] = set()
        self.assignment: set[tuple[str, int]] = set()
        self.paused_partitions = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        try:
            self.consumer = Consumer(self._conf)
        except KafkaException as exc:
            raise KafkaError(f"cannot create the proxy consumer: {exc}") from exc
        if self.subscribe:
            self.consumer.subscribe(
                self._topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
        self._thread.start()

    def follow(
        self,
        *,
        add: Iterable[TP] = (),
        remove: Iterable[TP] = (),
        commit: bool = True,
        timeout_s: float,
    ) -> bool:
        """Thread-safe, for a reader with ``subscribe=False``: read ``add`` too, stop reading
        ``remove``; waits until this reader's thread has done it (False after ``timeout_s``).
        A reader no longer polling takes no change (its close commits what is done)."""
        change = _Change(add=list(add), remove=list(remove), commit=commit)
        with self._changes_lock:
            if self._changes_closed:
                return True
            self._changes.append(change)
        if change.applied.wait(timeout_s):
            return True
        log.warning(
            "partition change not applied in time",
            extra={
                "reader": self._thread.name,
                "add": sorted(change.add),
                "remove": sorted(change.remove),
                "timeout_s": timeout_s,
            },
        )
        return False

    def request_commit(self) -> None:
        """Thread-safe: commit the done positions at the next turn of the poll loop."""
        self._commit_requested.set()

    def stop_reading(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float) -> None:
        """After the writer drained: final revoke-commit and leave the group."""
        self._may_close.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the poll loop -----------------------------------------------------------------

    def _run(self) -> None:
        consumer = self.consumer
        assert consumer is not None
        try:
            while not self._stop.is_set():
                self._apply_changes(consumer)
                msgs = read_ready(consumer, BATCH, IDLE_WAIT_S)
                if msgs:
                    self._ingest(msgs)
                self._backpressure(consumer)
                if self._commit_requested.is_set():
                    self._commit_requested.clear()
                    self._commit_async(consumer)
        except BaseException as exc:
            self.error = exc
            log.exception("proxy reader failed")
        finally:
            with self._changes_lock:
                self._changes_closed = True
                left, self._changes = self._changes, []
            for change in left:
                change.applied.set()
            self.stopped_reading.set()
        # Shutdown: the app drains the writer, then lets us close. close() runs the revoke
        # callback on this thread, which commits what is done.
        self._may_close.wait()
        try:
            with self._state.commit_lock:
                positions = self._state.to_commit()
                if positions:
                    self._commit(consumer, positions)
            consumer.close()
        except Exception:
            log.warning("consumer close failed", exc_info=True)
        self.closed.set()

    def _apply_changes(self, consumer: Consumer) -> None:
        with self._changes_lock:
            changes, self._changes = self._changes, []
        try:
            for change in changes:
                gone = [TopicPartition(t, p) for t, p in change.remove if (t, p) in self.assignment]
                if gone:
                    self._revoke(consumer, gone, commit=change.commit)
                    consumer.incremental_unassign(gone)
                came = [
                    TopicPartition(t, p)
                    for t, p in dict.fromkeys(change.add)
                    if (t, p) not in self.assignment
                ]
                # Tracked before the consumer fetches them; no offset given, so each starts
                # from the group's committed offset (auto.offset.reset without one).
                self._on_assign(consumer, came)
                if came:
                    consumer.incremental_assign(came)
                change.applied.set()
        finally:
            # A failure stops this reader (``error``); nobody may wait for it meanwhile.
            for change in changes:
                change.applied.set()

    def _ingest(self, msgs: list[Message]) -> None:
        now = time.monotonic()
        envs: list[Envelope] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != RdKafkaError._PARTITION_EOF:
                    log.warning("consume error", extra={"error": str(err)})
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            if topic is None or partition is None or offset is None:
                continue  # a consumed record without an error always has all three
            ts_type, ts = m.timestamp()
            env = Envelope(
                topic=topic,
                partition=partition,
                offset=offset,
                key=m.key(),
                value=m.value(),
                # A consumed record's headers are (name, bytes) pairs, never a dict.
                headers=cast(KafkaHeaders, m.headers() or ()),
                read_s=now,
                timestamp_ms=ts if ts_type else None,
            )
            self._prepare(env)
            envs.append(env)
        if envs and self._state.push(envs):
            self._writer.notify()

    def _commit_async(self, consumer: Consumer) -> None:
        with self._state.commit_lock:
            positions = self._state.to_commit()
        if not positions:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items()]
        try:
            consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            self._metrics.commits.labels("failed").inc()
            log.warning("offset commit failed; will retry", extra={"error": str(exc)})

    def _on_commit(self, err: RdKafkaError | None, partitions: list[TopicPartition]) -> None:
        """Result of an asynchronous commit (served on this thread by ``consume``)."""
        if err is not None:
            self._metrics.commits.labels("failed").inc()
            log.warning("offset commit failed; will retry", extra={"error": str(err)})
        done = {
            (p.topic, p.partition): p.offset
            for p in partitions
            if p.error is None and p.offset >= 0
        }
        if done:
            self._state.mark_committed(done)
            self._metrics.commits.labels("ok").inc()

    def _backpressure(self, consumer: Consumer) -> None:
        want = self._state.should_pause()
        if not want and not self._paused_tps:
            return
        holding = self._state.holding(self.assignment) if want else set()
        plan = flow_plan(
            want_paused=want, assigned=self.assignment, holding=holding, paused=self._paused_tps
        )
        if plan.pause:
            consumer.pause([TopicPartition(t, p) for t, p in sorted(plan.pause)])
            self._paused_tps.update(plan.pause)
        if plan.resume:
            consumer.resume([TopicPartition(t, p) for t, p in sorted(plan.resume)])
            self._paused_tps.difference_update(plan.resume)
        if want != self._paused:
            self._paused = want
            log.info(
                "pending queue full, pausing the partitions holding it"
                if want
                else "pending queue drained, resuming",
                extra={"partitions": len(self._paused_tps if want else plan.resume)},
            )
        self.paused_partitions = len(self._paused_tps)
        self._metrics.paused.set(self.paused_partitions)

    # ---- rebalance callbacks (on this thread) ------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        tps = [(p.topic, p.partition) for p in partitions]
        self._state.assign(tps)
        self._writer.assigned(set(tps))
        self.assignment.update(tps)
        self._metrics.rebalances.labels("assigned").inc(len(tps))
        if tps:
            log.info("partitions assigned", extra={"partitions": sorted(tps)})
        if self.on_assigned is not None:
            self.on_assigned(tps)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._revoke(consumer, partitions, commit=True)
        if self.on_revoked is not None:
            self.on_revoked([(p.topic, p.partition) for p in partitions], True)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost means another member may already own them: committing now could move the
        # new owner's offsets backwards, so drop without committing.
        self._revoke(consumer, partitions, commit=False)
        if self.on_revoked is not None:
            self.on_revoked([(p.topic, p.partition) for p in partitions], False)

    def _revoke(
        self, consumer: Consumer, partitions: list[TopicPartition], *, commit: bool
    ) -> None:
        tps = {(p.topic, p.partition) for p in partitions}
        if not tps:
            return
        dropped = self._state.begin_revoke(tps)
        self._writer.freeze(tps)
        deadline = time.monotonic() + self._s.revoke_timeout_s
        while self._state.attempting(tps) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Records of messages that just finished must be acknowledged before we commit
        # past them.
        self._outbox.flush(max(0.0, deadline - time.monotonic()) + 1.0)
        with self._state.commit_lock:
            positions, leftovers = self._state.end_revoke(tps)
            if commit and positions:
                self._commit(consumer, positions)
        for tp in tps:
            self.assignment.discard(tp)
            self._paused_tps.discard(tp)
            with contextlib.suppress(KeyError):  # no gauge yet for this partition
                self._metrics.commit_lag.remove(tp[0], str(tp[1]))
        self._metrics.rebalances.labels("revoked" if commit else "lost").inc(len(tps))
        log.info(
            "partitions revoked",
            extra={
                "partitions": sorted(tps),
                "committed": {f"{t}[{p}]": o for (t, p), o in positions.items()},
                "dropped_waiting": dropped,
                "abandoned_in_flight": len(leftovers),
                "lost": not commit,
            },
        )


def commit_positions(
    consumer: Consumer, positions: dict[tuple[str, int], int], metrics: ProxyMetrics
) -> bool:
    """Synchronously commit ``positions``; False (and logged) if Kafka refused."""
    offsets = [TopicPartition(t, p, o) for (t, p), o in positions.items() if o != OFFSET_INVALID]
    if not offsets:
        return True
    try:
        consumer.commit(offsets=offsets, asynchronous=False)
    except KafkaException as exc:
        metrics.commits.labels("failed").inc()
        log.warning("offset commit failed; will retry", extra={"error": str(exc)})
        return False
    metrics.commits.labels("ok").inc()
    return True

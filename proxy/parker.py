"""The writers' side of parking (``proxy.parking`` holds the pure parts and the why).

A ``Parker`` belongs to one lane's writer and decides when one of its messages is parked:
in the main lane a message still failing after ``park_after_s``, one of a tenant over its
pending share, and one behind a parked message of its key; in the retry lane every failure,
after waiting for each parked message's not-before time. Parking produces the message to the
retry topic and releases it; its offset is done only once Kafka acknowledges the record, so
a crash before that reads it again. Both lanes' parkers share one ``ParkingLot`` (the retry
topic, the per-key lines) behind its lock, since the retry lane's writer finishes what the
main lane's parked. Nothing here blocks: produces are non-blocking and the acknowledgement
arrives on the producer's thread.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from base.clock import now_ms
from proxy.deadletter import dead_letter_record, failure_times_ms
from proxy.envelope import Envelope, TopicPartition
from proxy.metrics import ProxyMetrics
from proxy.outbox import OutRecord, RecordSink
from proxy.parking import (
    MAX_PARKED_BYTES,
    Lines,
    Parked,
    RetryLayout,
    encode_header,
    park_headers,
)
from proxy.settings import ProxySettings
from proxy.state import SharedState

log = logging.getLogger("tocsin.proxy")


class Lane(enum.Enum):
    MAIN = "main"  # the source topics
    RETRY = "retry"  # the retry topic: parked messages


class ParkReason(enum.Enum):
    RETRYING = "retrying"  # still failing after park_after_s (or any failure, retry lane)
    TENANT_SHARE = "tenant_share"  # its tenant holds its share of the pending bounds
    BEHIND = "behind"  # an earlier message of its key is parked: it keeps its place
    # its host's rate limit or open circuit breaker would hold it in memory too long
    HOST_WAIT = "host_wait"


class Step(enum.Enum):
    """What happens to a message the writer is about to attempt."""

    ATTEMPT = "attempt"  # attempt it now
    PARKED = "parked"  # handed to the retry topic: it left the writer
    WAIT = "wait"  # wait in memory (``BeforeAttempt.wait_s``), then come back


@dataclass(frozen=True, slots=True)
class BeforeAttempt:
    step: Step
    wait_s: float = 0.0


ATTEMPT = BeforeAttempt(Step.ATTEMPT)
PARKED = BeforeAttempt(Step.PARKED)


@dataclass
class ParkingLot:
    """What both lanes' writers share: the retry topic and the lines, behind one lock."""

    topic: str
    lines: Lines = field(default_factory=Lines)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Why Kafka refused the retry topic itself (no right to write it, or gone): parking is
    # then off for both lanes and failing messages stay in memory until a restart.
    refused: str | None = None
    # The retry-topic partitions this proxy's retry lane owns. A line waits only on records
    # sitting on one of them: a record on another is finished by another proxy, unseen here,
    # so a line kept for it would never empty.
    retry_owned: set[int] = field(default_factory=set)
    # False until the retry lane's first assignment: before it (the group is still forming
    # at start) nobody knows who owns what, so lines are kept and judged then.
    retry_known: bool = False
    # Co-partitioning: a record parked from a source partition goes to the retries
    # partition the layout names, which the retry lane of that partition's owner reads.
    # None: Kafka's partitioner places it by key (the retries topic has too few partitions).
    layout: RetryLayout | None = None


def parked_size(env: Envelope) -> int:
    """The bytes a parked record of ``env`` carries before its retry header."""
    return (
        len(env.key or b"")
        + len(env.value or b"")
        + sum(len(k) + len(v or b"") for k, v in env.headers)
    )


class Parker:
    def __init__(
        self,
        *,
        lot: ParkingLot,
        lane: Lane,
        state: SharedState,
        settings: ProxySettings,
        metrics: ProxyMetrics,
        outbox: RecordSink,
        dead_letter_topic: str,
        wake: Callable[[], None],
        hand_back: Callable[[Envelope, float], None],
    ) -> None:
        """``wake`` (thread-safe) is called once a parked record is acknowledged: its key's
        next message may go. ``hand_back(env, not_before_s)`` (thread-safe) takes back a
        message whose park the retry topic refused: it waits in memory instead."""
        self.lot = lot
        self.lane = lane
        self._state = state
        self._s = settings
        self._metrics = metrics
        self._outbox = outbox
        self._dlq_topic = dead_letter_topic
        self._wake = wake
        self._hand_back = hand_back

    # ---- when to park ----------------------------------------------------------------

    def before_attempt(self, env: Envelope, now_s: float, *, tenant_busy: bool) -> BeforeAttempt:
        """Park ``env`` (behind its key's line, or for its tenant's share), let it wait for
        its not-before time, or let it be attempted. ``tenant_busy``: its tenant has every
        writer it may use busy."""
        lot = self.lot
        key = env.line_key
        with lot.lock:
            if key is None:
                behind = False
            elif self.lane is Lane.RETRY:
                behind = env.park_id is not None and not lot.lines.is_head(key, env.park_id)
            else:
                behind = lot.lines.has_line(key)
        if behind:
            not_before = env.not_before_s if env.not_before_s is not None else now_s
            if self.park(env, ParkReason.BEHIND, max(now_s, not_before)):
                return PARKED
            return BeforeAttempt(Step.WAIT, self._s.retry_base_delay_s or 0.2)  # its line moves
        if env.not_before_s is not None and env.not_before_s > now_s:
            return BeforeAttempt(Step.WAIT, env.not_before_s - now_s)
        if (
            self.lane is Lane.MAIN
            and self._over_share(env, before_attempt=True, tenant_busy=tenant_busy)
            and self.park(env, ParkReason.TENANT_SHARE, now_s)
        ):
            return PARKED
        return ATTEMPT

    def should_park(self, env: Envelope, now_s: float) -> bool:
        """After a failure: park ``env`` rather than retry it in memory?"""
        if self.lane is Lane.RETRY:
            return True  # the retry lane holds no failing message in memory
        first = env.attempt_state.first_failure_s
        if first is not None and now_s - first >= self._s.park_after_s:
            return True
        return self._over_share(env, before_attempt=False, tenant_busy=False)

    def after_failure(self, env: Envelope, now_s: float, retry_after_s: float) -> bool:
        """Park a failed ``env`` if it should leave memory; False: it retries in memory."""
        return self.should_park(env, now_s) and self.park(
            env, ParkReason.RETRYING, now_s + retry_after_s
        )

    def crowding(self, env: Envelope) -> bool:
        """``env`` is about to wait in memory for its host: park it for its tenant's share
        instead? (Main lane only, and only while the bounds are under pressure.)"""
        return self.lane is Lane.MAIN and self._over_share(
            env, before_attempt=False, tenant_busy=False
        )

    def _over_share(self, env: Envelope, *, before_attempt: bool, tenant_busy: bool) -> bool:
        """Park ``env`` for its tenant's pending share? Only while the bounds are under
        pressure (parking a healthy deployment's own traffic would only cost Kafka writes),
        and before an attempt only a message that already failed or whose tenant has every
        writer it may use busy (it would wait in memory either way)."""
        tenant = env.tenant
        if tenant is None or not self._state.over_share(tenant, self._s.tenant_pending_share):
            return False
        if before_attempt and env.attempt_state.failures == 0 and not tenant_busy:
            return False
        return self._state.under_pressure()

    # ---- parking -----------------------------------------------------------------------

    def park(self, env: Envelope, reason: ParkReason, not_before_s: float) -> bool:
        """Produce ``env`` to the retry topic and release it; its offset is done once Kafka
        acknowledges. False (nothing done) when it is too large to park or parking is off."""
        lot = self.lot
        if parked_size(env) > MAX_PARKED_BYTES or lot.refused is not None:
            return False
        park_id = uuid.uuid4().hex
        self._join_line(env, park_id)
        unpark = functools.partial(self._leave_line, env, park_id)

        def refused(err: object) -> None:
            # The retry topic refused, not this record: the message is still pending here
            # (released only on the acknowledgement), so it goes back to waiting in memory.
            self._parking_refused(str(err))
            unpark()
            self._hand_back(env, not_before_s)

        def parked() -> None:
            self._state.release(env)
            self._state.offset_done(env)
            self._wake()  # (the producer's thread) its key's next message may go now

        record = self._parked_record(
            env, park_id, not_before_s, on_fallback=unpark, on_topic_refused=refused
        )
        self._metrics.parked.labels(reason.value).inc()
        log.debug("message parked", extra={"record": repr(env), "reason": reason.value})
        if env.cancelled:
            self._state.release(env)
            unpark()
            return True
        # Its key stays blocked until Kafka has the record: its line already exists, so the
        # next message of the key is parked behind it once it is released.
        self._outbox.send_all([record], parked)
        return True

    def finished(self, env: Envelope) -> None:
        """A parked message reached its outcome: the next one of its key may go."""
        key = env.line_key
        if key is not None and env.park_id is not None:
            with self.lot.lock:
                self.lot.lines.finish(key, env.park_id)

    def _join_line(self, env: Envelope, park_id: str) -> None:
        """Put ``park_id`` in its key's line: in its old place if it was parked before."""
        key, lines = env.line_key, self.lot.lines
        if key is None:
            return
        with self.lot.lock:
            if env.park_id is not None and lines.holds(key, env.park_id):
                lines.replace(key, env.park_id, park_id)
                evicted = 0
            else:
                evicted = lines.append(key, park_id)
        if evicted:
            self._metrics.lines_evicted.inc(evicted)

    def _leave_line(self, env: Envelope, park_id: str) -> None:
        key = env.line_key
        if key is not None:
            with self.lot.lock:
                self.lot.lines.finish(key, park_id)

    def _parked_record(
        self,
        env: Envelope,
        park_id: str,
        not_before_s: float,
        *,
        on_fallback: Callable[[], None],
        on_topic_refused: Callable[[object], None],
    ) -> OutRecord:
        """The retry-topic record of ``env``, with its dead letter as the fallback should
        Kafka refuse the record itself for good."""
        lot = self.lot
        now, wall_ms = time.monotonic(), now_ms()
        header = encode_header(
            Parked(
                park_id=park_id,
                origin=env.source,
                state=env.attempt_state,
                not_before_ms=wall_ms + max(0, int((not_before_s - now) * 1000)),
            ),
            now_s=now,
            now_ms=wall_ms,
        )
        st = env.attempt_state
        first_ms, last_ms = failure_times_ms(st, now, wall_ms)
        dead_letter = dead_letter_record(
            env,
            reason=f"could not be parked in {lot.topic} (refused for good); last: "
            f"{st.last_error or 'no attempt yet'}",
            status=st.last_status,
            now_ms=wall_ms,
            group_id=self._s.group_id,
            first_failure_ms=first_ms,
            last_failure_ms=last_ms,
            coordinates_only=True,
        )
        origin = env.source
        return OutRecord(
            lot.topic,
            env.key,
            env.value or b"",
            headers=park_headers(env.headers, header),
            fallback=OutRecord(self._dlq_topic, env.key, dead_letter),
            on_fallback=on_fallback,
            on_written=functools.partial(self._placed, env),
            on_topic_refused=on_topic_refused,
            partition=None
            if lot.layout is None
            else lot.layout.retry_partition(origin.topic, origin.partition),
        )

    def _placed(self, env: Envelope, retry_partition: int) -> None:
        """Kafka has the parked record on ``retry_partition`` (on the producer's thread)."""
        lot, key = self.lot, env.line_key
        if key is None:
            return
        with lot.lock:
            owned = retry_partition in lot.retry_owned or not lot.retry_known
            if owned:
                lot.lines.placed(key, retry_partition)
            elif lot.lines.has_line(key):
                lot.lines.forget(key)
            else:
                return
        if not owned:
            # Another proxy's retry lane finishes it: its key's later messages cannot
            # wait for an outcome this proxy never sees.
            self._metrics.lines_evicted.inc()
            log.info(
                "parked on a retry partition another proxy owns; its key's order "
                "across parking is not kept",
                extra={"record": repr(env), "retry_partition": retry_partition},
            )

    def _parking_refused(self, reason: str) -> None:
        """Kafka refused the retry topic itself (on the producer's thread): parking is off."""
        lot = self.lot
        with lot.lock:
            first = lot.refused is None
            lot.refused = lot.refused or reason
        self._metrics.records_refused.labels(lot.topic).inc()
        if first:
            self._metrics.parking.set(0)
            log.error(
                "retry topic refused: parking is off, failing messages stay in memory "
                "until the proxy restarts; grant this proxy write access to the topic "
                "or create it ('tocsin setup')",
                extra={"topic": lot.topic, "error": reason},
            )

    # ---- rebalances --------------------------------------------------------------------

    def assigned(self, tps: set[TopicPartition]) -> None:
        """The lane's reader was assigned ``tps``. The retry lane's first assignment tells
        which lines wait on records another proxy finishes: those are dropped."""
        lot = self.lot
        if self.lane is not Lane.RETRY:
            return
        dropped = 0
        with lot.lock:
            lot.retry_owned.update(p for t, p in tps if t == lot.topic)
            if not lot.retry_known:
                lot.retry_known = True
                others = lot.lines.placed_partitions() - lot.retry_owned
                dropped = lot.lines.drop_retry_partitions(others)
        if dropped:
            self._metrics.lines_evicted.inc(dropped)

    def revoked(self, tps: set[TopicPartition]) -> None:
        """The lane's reader loses ``tps``: drop the lines that waited on them.

        A revoked partition's messages are read again by their new owner, which knows
        nothing of these lines; keeping them would hold later messages back for ever. The
        retry lane drops only the lines on its revoked retry-topic partitions: the others
        still wait on records this proxy finishes (the main lane's order).
        """
        lot = self.lot
        with lot.lock:
            if self.lane is Lane.RETRY:
                revoked = {p for t, p in tps if t == lot.topic}
                lot.retry_owned.difference_update(revoked)
                lot.lines.drop_retry_partitions(revoked)
            else:
                for topic, partition in tps:
                    lot.lines.drop_partition(topic, partition)

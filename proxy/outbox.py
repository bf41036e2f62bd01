"""The proxy's producer: dead letters, delivery outcomes and Kafka callbacks.

A record the proxy must write (a dead letter, an outcome) is re-produced until Kafka
acknowledges it, and only then is the source message's offset marked done: a crash before
the acknowledgement re-delivers the source message rather than losing the record.
Callbacks run on whichever thread polls or flushes the producer (the committer thread,
or the reader during a revoke), so the per-group counters take a lock. Never blocks on the
network except in ``flush``.

A record Kafka refuses for good (too large for the producer or the topic, not authorised,
invalid) is never produced again: its ``fallback`` (a smaller form of the same record) is
written instead, and without one, or when that is refused too, the refusal is logged and
counted and the record counts as written, so the source offset moves on and nothing stalls
behind it. A record with ``on_topic_refused`` (a parked message) is different: a refusal of
its topic (not authorised, no such topic) says nothing about the record, only about the
deployment, so it is handed back through that callback, neither written, nor replaced by
its fallback, nor counted done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from confluent_kafka import KafkaError as RdKafkaError
from confluent_kafka import KafkaException, Message, Producer

from base.errors import KafkaError
from base.settings import KafkaConfig
from proxy.metrics import ProxyMetrics

log = logging.getLogger("tocsin.proxy")

Headers = Sequence[tuple[str, str | bytes | None]]
# The delivery report: Kafka's error (None: acknowledged) and the record as written.
Ack = Callable[[RdKafkaError | None, Message], None]

PRODUCER_MAX_BYTES = 2_200_000

# How often the records nobody waits for (``OutRecord.later``: delivery outcomes, dead
# letters, attempt records) are produced, together, from the committer's thread. Only the
# commit (every commit_interval_s) and the scheduler's history wait for them, so a few
# produce requests a second can carry them all: produced one by one from the writer's loop
# at 1,000 deliveries/s, the 5 ms linger sent about 200 produce requests a second, and each
# acknowledgement woke the committer's thread (about 500 wake-ups a second). Parked messages
# and Kafka callbacks are produced at once (a park after whatever is held).
DEFER_S = 0.05
# Record groups held for the next round at most; past it a group is produced at once, after
# those held (their order kept), on the caller's thread, which then waits on a full producer
# queue as it always did: a committer thread that stopped draining cannot grow memory.
MAX_DEFERRED = 10_000
# How long a wait for room in the producer's full local queue serves callbacks at a time.
ROOM_WAIT_S = 0.05

# Producing these again can never succeed: the record, not the moment, is the problem.
PERMANENT_PRODUCE_ERRORS = frozenset(
    {
        RdKafkaError.MSG_SIZE_TOO_LARGE,
        RdKafkaError.RECORD_LIST_TOO_LARGE,
        RdKafkaError.INVALID_RECORD,
        RdKafkaError.TOPIC_AUTHORIZATION_FAILED,
        RdKafkaError._INVALID_ARG,
    }
)


def refused_for_good(err: object) -> bool:
    """True when a produce error (a librdkafka KafkaError) is not worth retrying."""
    return isinstance(err, RdKafkaError) and err.code() in PERMANENT_PRODUCE_ERRORS


# The topic, not the record, is the problem: no right to write it, or it does not exist.
TOPIC_REFUSALS = frozenset(
    {
        RdKafkaError.TOPIC_AUTHORIZATION_FAILED,
        RdKafkaError._UNKNOWN_TOPIC,
        RdKafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)


def topic_refused(err: object) -> bool:
    """True when a produce error refuses the record's topic rather than the record."""
    return isinstance(err, RdKafkaError) and err.code() in TOPIC_REFUSALS


@dataclass(frozen=True, slots=True)
class OutRecord:
    """A record the proxy must write; ``fallback`` is written instead if Kafka refuses it
    for good (a smaller form of it, or, for a parked message, its dead letter)."""

    topic: str
    key: bytes | None
    value: bytes
    fallback: OutRecord | None = None
    headers: Headers | None = None
    on_fallback: Callable[[], None] | None = None  # called when the fallback is written
    # Called with the partition Kafka acknowledged the record on.
    on_written: Callable[[int], None] | None = None
    # Called (instead of any fallback) when Kafka refuses the record's topic; the record
    # then never counts as written.
    on_topic_refused: Callable[[object], None] | None = None
    # The partition to write to; None: the producer's partitioner (by key).
    partition: int | None = None
    # Nobody waits for it but the commit: it may be held until the next round of
    # ``Outbox.send_deferred`` (at most ``DEFER_S`` or so).
    later: bool = False


class RecordSink(Protocol):
    """What a writer of the proxy's own records needs of the outbox: produce them all, and
    ``done`` once Kafka has each (see ``Outbox.send_all``)."""

    def send_all(self, records: Sequence[OutRecord], done: Callable[[], None]) -> None: ...


class Outbox:
    def __init__(self, kafka_conf: KafkaConfig, metrics: ProxyMetrics | None = None) -> None:
        conf = dict(kafka_conf)
        conf.update(
            {
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 5,
                # Give up a single produce after 30 s and produce again ourselves, so a long
                # Kafka outage shows up in the logs instead of silently piling up.
                "message.timeout.ms": 30_000,
                # A parked message is a whole source record plus its retry header: room for any
                # record Kafka's default 1 MiB limit admits (the retries topic allows 2 MiB).
                "message.max.bytes": PRODUCER_MAX_BYTES,
            }
        )
        try:
            self.producer = Producer(conf)
        except KafkaException as exc:
            raise KafkaError(f"cannot create the proxy producer: {exc}") from exc
        self.closed = False
        self.metrics = metrics
        # What a flush's timeout is measured with.
        self.monotonic: Callable[[], float] = time.monotonic
        # Groups of ``later`` records and their ``done``, in the order they were given.
        self._deferred: list[_Held] = []
        # Produced before them, in order: records a delivery callback produces again (or
        # replaces by their fallback) that found the producer's local queue full or others
        # of their kind waiting. A round produces each while it is still first here, so a
        # callback on another thread meanwhile sees it and queues behind it.
        self._again: deque[_Held] = deque()
        self._deferred_lock = threading.Lock()
        # Held while anything is produced from ``_deferred`` and while a group that may
        # not wait is produced after it, so that nothing overtakes a held record; a flush
        # on another thread waits for it, at most its timeout. Reentrant: a delivery
        # callback served while the caller's thread waits for room may park a message.
        self._sending = threading.RLock()

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: Headers | None,
        on_delivery: Ack,
        partition: int | None = None,
    ) -> None:
        """One produce attempt; ``on_delivery(err, msg)`` reports the outcome. Waits for room
        while the producer's local queue is full."""
        while True:
            try:
                self.produce_once(topic, key, value, headers, on_delivery, partition)
                return
            except BufferError:
                # The local queue is full: serve callbacks to make room, then try again.
                self.producer.poll(ROOM_WAIT_S)

    def produce_once(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: Headers | None,
        on_delivery: Ack,
        partition: int | None = None,
    ) -> None:
        """``produce`` without the wait: raises ``BufferError`` when the local queue is full."""
        hdrs = list(headers) if headers else None
        if partition is None:
            self.producer.produce(
                topic, value=value, key=key, headers=hdrs, on_delivery=on_delivery
            )
        else:
            self.producer.produce(
                topic,
                value=value,
                key=key,
                headers=hdrs,
                on_delivery=on_delivery,
                partition=partition,
            )

    def send_all(self, records: Sequence[OutRecord], done: Callable[[], None]) -> None:
        """Produce every record (retrying transient failures for ever); call ``done`` once
        each is acknowledged or refused for good (see the module docstring). A group of
        ``later`` records only is held for the next ``send_deferred``; any other group is
        produced at once, after everything held, so that nothing given later reaches Kafka
        before a held record (a key's records on a topic stay in order)."""
        if records and all(rec.later for rec in records):
            with self._deferred_lock:
                if len(self._deferred) < MAX_DEFERRED:
                    self._deferred.append((records, done))
                    return
        with self._sending:
            while not self._round():
                self.producer.poll(ROOM_WAIT_S)
            countdown = _Countdown(len(records), done)
            for rec in records:
                _Sending(self, rec, countdown).produce(block=True)

    def send_deferred(self) -> None:
        """A round: produce the held ``later`` records in the order they came, until the
        producer's local queue is full; what finds no room stays held, first (thread-safe;
        never waits for Kafka: the committer's thread calls it every ``DEFER_S``, and a
        round elsewhere or a flush has it skipped)."""
        if self._sending.acquire(blocking=False):
            try:
                self._round()
            finally:
                self._sending.release()

    def _round(self) -> bool:
        """Produce what is held, in order, until the local queue is full; True: all of it
        (``_sending`` held). What finds no room goes back first in its list, where
        ``MAX_DEFERRED`` still counts it."""
        if not self._produce_again():
            return False
        with self._deferred_lock:
            held, self._deferred = self._deferred, []
        for i, (records, done) in enumerate(held):
            countdown = done if isinstance(done, _Countdown) else _Countdown(len(records), done)
            for j, rec in enumerate(records):
                no_room = _Sending(self, rec, countdown).produce(block=False)
                if no_room is not None:
                    rest: list[_Held] = [((no_room, *records[j + 1 :]), countdown)]
                    rest += held[i + 1 :]
                    with self._deferred_lock:
                        self._deferred[:0] = rest
                    return False
            # Produced again meanwhile (their first produce came before these groups).
            if self._again and not self._produce_again():
                with self._deferred_lock:
                    self._deferred[:0] = held[i + 1 :]
                return False
        return True

    def _produce_again(self) -> bool:
        """Produce ``_again`` in order, each record taken out only once produced; False: the
        local queue is full."""
        while True:
            with self._deferred_lock:
                if not self._again:
                    return True
                records, done = self._again[0]
            countdown = done if isinstance(done, _Countdown) else _Countdown(len(records), done)
            for j, rec in enumerate(records):
                no_room = _Sending(self, rec, countdown).produce(block=False)
                if no_room is not None:
                    with self._deferred_lock:
                        self._again[0] = ((no_room, *records[j + 1 :]), countdown)
                    return False
            with self._deferred_lock:
                self._again.popleft()

    def again(self, rec: OutRecord, countdown: _Countdown) -> None:
        """Produce ``rec`` again, or its fallback, from a delivery callback: at once if
        nothing produced again waits before it, else (and when the local queue is full:
        a callback never waits) held, after those, ahead of everything else held."""
        if not self._again:
            no_room = _Sending(self, rec, countdown).produce(block=False)
            if no_room is None:
                return
            rec = no_room
        with self._deferred_lock:
            self._again.append(((rec,), countdown))

    def held_records(self) -> int:
        with self._deferred_lock:
            return sum(len(records) for records, _ in [*self._again, *self._deferred])

    def poll(self, timeout_s: float) -> None:
        self.producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        """Produce what is held, then wait for acknowledgements: ``timeout_s`` at most in
        all, whatever Kafka does (a revoke or a stop must end; a message whose records are
        not acknowledged is read again, its offset never done). Returns how many records
        are neither acknowledged nor refused: unacknowledged or still held."""
        deadline = self.monotonic() + timeout_s
        while True:
            left_s = deadline - self.monotonic()
            if not self._sending.acquire(timeout=max(left_s, 0.0)):
                break  # a caller waiting for room holds it
            try:
                sent = self._round()
            finally:
                self._sending.release()
            left_s = deadline - self.monotonic()
            if sent or left_s <= 0:
                break
            self.producer.poll(min(ROOM_WAIT_S, left_s))
        unacknowledged = int(self.producer.flush(max(deadline - self.monotonic(), 0.0)))
        return unacknowledged + self.held_records()

    def close(self, timeout_s: float) -> None:
        left = self.flush(timeout_s)
        self.closed = True
        if left:
            log.warning(
                "proxy producer closed with unacknowledged records", extra={"records": left}
            )


class _Countdown:
    """Calls ``done`` once ``left`` records are finished (on any producer thread)."""

    def __init__(self, left: int, done: Callable[[], None]) -> None:
        self._left = left
        self._done = done
        self._lock = threading.Lock()

    def finished_one(self) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0
        if finished:
            self._done()


# A held group: records and the ``done`` of the group, or the rest of a group a round has
# started (or one record a delivery callback produces again) and the group's countdown.
_Held = tuple[Sequence[OutRecord], Callable[[], None] | _Countdown]


class _Sending:
    """One record on its way: produced again after a transient failure, handed back on a
    refusal of its topic, replaced by its fallback (or dropped) when refused for good."""

    def __init__(self, outbox: Outbox, rec: OutRecord, countdown: _Countdown) -> None:
        self._outbox = outbox
        self._rec = rec
        self._countdown = countdown

    def produce(self, *, block: bool) -> OutRecord | None:
        """Produce the record, or what replaces it if Kafka refuses it at once. Without
        ``block`` a full local queue is not waited out: the record that found it full (this
        one or its fallback) is returned, for the caller to hold; None: produced or settled."""
        rec = self._rec
        try:
            if block:
                self._outbox.produce(
                    rec.topic, rec.key, rec.value, rec.headers, self._ack, rec.partition
                )
            else:
                self._outbox.produce_once(
                    rec.topic, rec.key, rec.value, rec.headers, self._ack, rec.partition
                )
        except BufferError:
            return rec
        except KafkaException as exc:
            refused, fallback = self._refusal(exc.args[0] if exc.args else None)
            if not refused:
                raise
            if fallback is not None:
                return _Sending(self._outbox, fallback, self._countdown).produce(block=block)
        return None

    def _ack(self, err: RdKafkaError | None, msg: Message) -> None:
        # On whichever thread polls the producer, maybe inside a wait for room: never waits.
        rec = self._rec
        if err is None:
            if rec.on_written is not None:
                partition = msg.partition()
                if partition is not None:  # always set on an acknowledged record
                    rec.on_written(partition)
            self._countdown.finished_one()
            return
        refused, again = self._refusal(err)
        if not refused:
            if self._outbox.closed:
                return
            log.warning(
                "proxy record not acknowledged, producing again",
                extra={"topic": rec.topic, "error": str(err)},
            )
            again = rec
        if again is not None:
            self._outbox.again(again, self._countdown)

    def _refusal(self, err: object) -> tuple[bool, OutRecord | None]:
        """Carry out a refusal of the record's topic or of the record itself: (False, None)
        when ``err`` is neither (worth producing again), else (True, the fallback to produce
        in its place, if any)."""
        rec = self._rec
        if rec.on_topic_refused is not None and topic_refused(err):
            rec.on_topic_refused(err)
            return True, None
        if refused_for_good(err):
            return True, self._refused_for_good(err)
        return False, None

    def _refused_for_good(self, err: object) -> OutRecord | None:
        rec = self._rec
        if rec.fallback is not None:
            log.warning(
                "proxy record refused for good; writing its fallback",
                extra={
                    "topic": rec.topic,
                    "error": str(err),
                    "bytes": len(rec.value),
                    "fallback_topic": rec.fallback.topic,
                },
            )
            if rec.on_fallback is not None:
                rec.on_fallback()
            return rec.fallback
        metrics = self._outbox.metrics
        if metrics is not None:
            metrics.records_refused.labels(rec.topic).inc()
        log.error(
            "proxy record refused for good and dropped",
            extra={"topic": rec.topic, "error": str(err), "bytes": len(rec.value)},
        )
        self._countdown.finished_one()
        return None

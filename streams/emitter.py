"""The worker's Kafka producer edge: librdkafka (confluent-kafka) bridged into asyncio.

``send`` returns an asyncio future resolved when the broker has acknowledged the record
(acks=all, idempotent producer, so retries never duplicate or reorder within a partition).
The ticker advances its checkpoint only past acknowledged triggers, so this future is the
durability boundary. A background thread serves delivery callbacks; it must never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from typing import Any, TypedDict

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaException, Message, Producer
from confluent_kafka import KafkaError as KafkaCode

from base.errors import KafkaError
from base.settings import KafkaSettings

log = logging.getLogger("tocsin.emitter")

# Where the broker stored an acknowledged record: (partition, offset).
Position = tuple[int | None, int | None]
# The same and when: the broker's append time (epoch ms) when the topic's timestamps are
# the broker's (LogAppendTime), else None (the producer's time proves nothing).
Appended = tuple[int | None, int | None, int | None]
# One delivery report waiting for the event loop: the record's future, its topic, and
# the error or the position.
_Report = tuple[asyncio.Future[Any], str, KafkaCode | Position | Appended]


class _Partition(TypedDict, total=False):
    partition: int  # absent: the producer's partitioner chooses


class Emitter:
    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        client_id: str = "tocsin-worker",
        linger_ms: int = 1,
        compression: str = "lz4",
        poll_s: float = 0.2,
        idle_wait_s: float = 5.0,
        gather_s: float = 0.0,
    ) -> None:
        self._producer = Producer(
            {
                **kafka.librdkafka(),
                # Shorter than the consumers': a produce in flight to a hung leader holds
                # its partition until this (base/settings.py, docs/operations.md).
                "socket.timeout.ms": kafka.producer_socket_timeout_ms,
                "client.id": client_id,
                "enable.idempotence": True,
                "acks": "all",
                # The ticker produces a due set in one turn of its loop, so a burst is
                # queued at once and goes out in large batches (and while a request is in
                # flight, what follows gathers behind it). The linger only holds a lone
                # fire: 1 ms lets the partitions due in the same ms share one request,
                # where 5 ms held each fire 5 ms for nothing at 1,000 fires/s.
                "linger.ms": linger_ms,
                "batch.num.messages": 10000,
                # Any codec is readable by every consumer here (aiokafka reads lz4/zstd/
                # snappy through cramjam); small latency-bound records gain nothing from one.
                "compression.type": compression,
                "queue.buffering.max.messages": 500000,
                "queue.buffering.max.kbytes": 512 * 1024,
                "message.timeout.ms": 120000,
            }
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="emitter-poll", daemon=True)
        self._started = False
        self._reports: deque[_Report] = deque()
        # librdkafka's poll returns as soon as a delivery report is queued, so its timeout
        # adds no latency to an acknowledgement; it bounds how long ``close`` waits for the
        # thread. (confluent-kafka splits a longer poll into 200 ms waits anyway.)
        self._poll_s = poll_s
        # With nothing queued, in flight or reported, no report can come before the next
        # send, so the thread waits for that send (or ``close``) instead of polling: an idle
        # worker's producers do not wake at all. librdkafka's own log lines (served by
        # poll, since they go through our logger) wait at most ``idle_wait_s`` meanwhile.
        self._sent = threading.Event()
        self._idle_wait_s = idle_wait_s
        # After a poll that served reports, the thread waits this long and serves what came
        # meanwhile before handing them all to the event loop at once. Records sent one at a
        # time (a fire per due millisecond) are acknowledged one at a time, and each
        # hand-over is a write to the loop's wake-up pipe, a wake-up of the loop and a
        # handle: a few acknowledgements per hand-over instead of one. 0: hand over at once
        # (sends whose acknowledgement a caller waits for).
        self._gather_s = gather_s

    def start(self) -> None:
        if not self._started:
            self._loop = asyncio.get_running_loop()
            self._thread.start()
            self._started = True

    def _serve(self) -> None:
        producer, sent = self._producer, self._sent
        while not self._stop.is_set():
            # len(): messages queued or in flight plus reports and log lines not served.
            if len(producer) == 0:
                sent.wait(self._idle_wait_s)
                # A send between the wake-up and this clear is not lost: the loop checks
                # len() again before it waits.
                sent.clear()
                if len(producer) == 0:
                    continue
            try:
                producer.poll(self._poll_s)
                if self._gather_s > 0 and self._reports and not self._stop.wait(self._gather_s):
                    producer.poll(0)
            except Exception:
                # poll re-raises what a Python callback raised (our logger's, say); the
                # reports left are served by the next poll. Ended here, this thread would
                # settle no send's future again: every trigger would stay in flight.
                log.exception("serving librdkafka's callbacks failed; polling on")
                self._stop.wait(self._poll_s)
            self._hand_over()

    def _hand_over(self) -> None:
        # One wake-up of the event loop per poll round, not one per record: a burst second
        # acknowledges tens of thousands of triggers.
        if self._reports and self._loop is not None:
            batch = []
            # ``close`` hands over too, maybe while this thread does: pop until empty.
            with contextlib.suppress(IndexError):
                while True:
                    batch.append(self._reports.popleft())
            if batch:
                with contextlib.suppress(RuntimeError):  # loop closed at shutdown
                    self._loop.call_soon_threadsafe(_settle_all, batch)

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
        partition: int | None = None,
    ) -> asyncio.Future[Position]:
        """Queue one record; the future resolves on the broker's ack or fails with KafkaError.

        ``partition``: an explicit partition; None lets the producer's partitioner choose."""
        loop = self._loop
        if loop is None:
            raise KafkaError("Emitter.start() was not called")
        fut: asyncio.Future[Position] = loop.create_future()
        reports = self._reports

        def on_delivery(err: KafkaCode | None, msg: Message[bytes, bytes]) -> None:
            # Runs on whichever thread polls librdkafka; deque.append is thread-safe.
            reports.append((fut, topic, err if err else (msg.partition(), msg.offset())))

        self._produce(topic, key, value, headers, partition, on_delivery)
        return fut

    def send_appended(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
        partition: int | None = None,
    ) -> asyncio.Future[Appended]:
        """``send``, resolving to where and when the broker appended the record."""
        loop = self._loop
        if loop is None:
            raise KafkaError("Emitter.start() was not called")
        fut: asyncio.Future[Appended] = loop.create_future()
        reports = self._reports

        def on_delivery(err: KafkaCode | None, msg: Message[bytes, bytes]) -> None:
            if err:
                reports.append((fut, topic, err))
                return
            kind, at_ms = msg.timestamp()
            at = at_ms if kind == TIMESTAMP_LOG_APPEND_TIME else None
            reports.append((fut, topic, (msg.partition(), msg.offset(), at)))

        self._produce(topic, key, value, headers, partition, on_delivery)
        return fut

    def _produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None,
        partition: int | None,
        on_delivery: Any,
    ) -> None:
        extra: _Partition = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(
                    topic,
                    key=key,
                    value=value,
                    headers=headers,  # type: ignore[arg-type]
                    on_delivery=on_delivery,
                    **extra,
                )
                if not self._sent.is_set():
                    self._sent.set()  # the poll thread may be waiting idle
                return
            except BufferError:
                # Local queue full: let the poll thread drain it (rare; sized for bursts).
                self._producer.poll(0.01)
            except KafkaException as exc:
                raise KafkaError(
                    f"cannot produce to {topic}: {exc}", retriable=produce_retriable(exc.args[0])
                ) from exc

    async def flush(self, timeout_s: float = 30.0) -> int:
        left = await asyncio.to_thread(self._producer.flush, timeout_s)
        # The reports flush served (on its own thread) are handed over here: the poll
        # thread, finding nothing left to serve, may be waiting idle.
        self._hand_over()
        return left

    async def close(self, timeout_s: float = 30.0) -> None:
        if self._started:
            await self.flush(timeout_s)
        self._stop.set()
        self._sent.set()
        if self._started:
            # Off the loop: the thread may be inside a poll of up to ``poll_s``.
            await asyncio.to_thread(self._thread.join, self._poll_s + 1)
            self._hand_over()


# What no retry can fix: the record itself is refused (too large, malformed). Every other
# produce failure (timeouts, brokers down, leaders moving, a full queue) is the cluster's
# state, which retrying with backoff outlives; librdkafka's own retriable() flag is False
# for message timeouts, which are exactly that.
_PERMANENT = frozenset(
    {
        KafkaCode.MSG_SIZE_TOO_LARGE,
        KafkaCode.INVALID_MSG,
        KafkaCode.INVALID_MSG_SIZE,
        KafkaCode.INVALID_RECORD,
    }
)


def produce_retriable(err: object) -> bool:
    """Whether a produce error (a confluent_kafka.KafkaError) may succeed if tried again."""
    code = err.code() if hasattr(err, "code") else None
    return code not in _PERMANENT


def _settle_all(batch: list[_Report]) -> None:
    """On the event loop: resolve the futures of one poll round's delivery reports."""
    for fut, topic, outcome in batch:
        if fut.done():
            continue
        if isinstance(outcome, tuple):
            fut.set_result(outcome)
        else:
            fut.set_exception(
                KafkaError(
                    f"delivery to {topic} failed: {outcome}", retriable=produce_retriable(outcome)
                )
            )

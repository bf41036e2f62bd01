"""The worker's Kafka producer edge: librdkafka (confluent-kafka) bridged into asyncio.

``send`` returns an asyncio future resolved when the broker has acknowledged the record
(acks=all, idempotent producer, so retries never duplicate or reorder within a partition).
The ticker advances its checkpoint only past acknowledged triggers, so this future is the
durability boundary. A background thread serves delivery callbacks; it must never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import TypedDict

from confluent_kafka import KafkaError as KafkaCode
from confluent_kafka import KafkaException, Message, Producer

from base.errors import KafkaError
from base.settings import KafkaSettings

# Where the broker stored an acknowledged record: (partition, offset).
Position = tuple[int | None, int | None]
# One delivery report waiting for the event loop: the record's future, its topic, and
# the error or the position.
_Report = tuple[asyncio.Future[Position], str, KafkaCode | Position]


class _Partition(TypedDict, total=False):
    partition: int  # absent: the producer's partitioner chooses


class Emitter:
    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        client_id: str = "tocsin-worker",
        linger_ms: int = 5,
        compression: str = "lz4",
    ) -> None:
        self._producer = Producer(
            {
                **kafka.librdkafka(),
                "client.id": client_id,
                "enable.idempotence": True,
                "acks": "all",
                # A few ms of linger turns a burst second into large batches.
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

    def start(self) -> None:
        if not self._started:
            self._loop = asyncio.get_running_loop()
            self._thread.start()
            self._started = True

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.05)
            self._hand_over()

    def _hand_over(self) -> None:
        # One wake-up of the event loop per poll round, not one per record: a burst second
        # acknowledges tens of thousands of triggers.
        if self._reports and self._loop is not None:
            batch = []
            while self._reports:
                batch.append(self._reports.popleft())
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
                return fut
            except BufferError:
                # Local queue full: let the poll thread drain it (rare; sized for bursts).
                self._producer.poll(0.01)
            except KafkaException as exc:
                raise KafkaError(
                    f"cannot produce to {topic}: {exc}", retriable=produce_retriable(exc.args[0])
                ) from exc

    async def flush(self, timeout_s: float = 30.0) -> int:
        return await asyncio.to_thread(self._producer.flush, timeout_s)

    async def close(self, timeout_s: float = 30.0) -> None:
        if self._started:
            await self.flush(timeout_s)
        self._stop.set()
        if self._started:
            self._thread.join(timeout=5)
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

"""The Kafka sender: a trigger whose callback is a Kafka topic has its payload produced there.

The verdict is Kafka's, reported as it came (``proxy.retry.KafkaResult``): acknowledged,
failed (broker down, throttled: may clear), refused (can never succeed as configured), or
no verdict within ``ack_timeout_s``. A Kafka callback may not write into the proxy's own
topics (dead letters, outcomes, retries): that would let a tenant forge a parked message or
a dead letter, so it is refused without a produce.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message

from proxy.envelope import Envelope
from proxy.outbox import Ack, Headers
from proxy.retry import KafkaResult, KafkaVerdict

# A Kafka callback that can never succeed as configured is dead-lettered at once (like a
# 7xx); anything else (broker down, timeouts, throttling) is retried like a 5xx.
PERMANENT_KAFKA_ERRORS = frozenset(
    {
        KafkaError._UNKNOWN_TOPIC,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.MSG_SIZE_TOO_LARGE,
    }
)

DEFAULT_ACK_TIMEOUT_S = 60.0


class Producing(Protocol):
    """What the sender needs of a producer (``proxy.outbox.Outbox``): one non-blocking
    produce whose ``on_delivery`` runs later, on the thread that polls the producer."""

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: Headers | None,
        on_delivery: Ack,
        partition: int | None = None,
    ) -> None: ...


def kafka_failure(topic: str, err: object) -> KafkaResult:
    """Kafka's error on a callback's produce (a ``KafkaError``, or whatever a
    ``KafkaException`` carried), refused for good or worth another try."""
    if isinstance(err, KafkaError) and err.code() in PERMANENT_KAFKA_ERRORS:
        return KafkaResult(
            verdict=KafkaVerdict.REFUSED,
            detail=f"kafka callback to {topic!r} cannot succeed: {err}",
        )
    return KafkaResult(
        verdict=KafkaVerdict.FAILED, detail=f"kafka callback to {topic!r} failed: {err}"
    )


class KafkaSender:
    def __init__(
        self,
        producer: Producing,
        *,
        own_topics: frozenset[str],
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
    ) -> None:
        self._producer = producer
        self._own_topics = own_topics
        self._ack_timeout_s = ack_timeout_s

    async def send(self, env: Envelope) -> KafkaResult:
        target, trig = env.kafka_target, env.trigger
        if target is None or trig is None:
            raise RuntimeError(f"{env!r} has no Kafka callback")
        if target.topic in self._own_topics:
            return KafkaResult(
                verdict=KafkaVerdict.REFUSED,
                detail=f"kafka callback to the proxy's own topic {target.topic!r}",
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[KafkaError | None] = loop.create_future()

        def resolve(err: KafkaError | None) -> None:
            if not fut.done():
                fut.set_result(err)

        def ack(err: KafkaError | None, _msg: Message) -> None:
            # A closed loop (shutdown) drops the ack: the message is redelivered later.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(resolve, err)

        headers: list[tuple[str, str | bytes | None]] = [
            ("tocsin-trigger-id", trig.trigger_id),
            ("tocsin-schedule-id", trig.schedule_id),
            ("tocsin-tenant", trig.tenant),
            ("tocsin-due-ms", str(trig.due_ms)),
        ]
        if trig.traceparent is not None:
            # The schedule's trace context goes on with the record, as on the fires topic.
            headers.append(("traceparent", trig.traceparent))
            if trig.tracestate:
                headers.append(("tracestate", trig.tracestate))
        key = None if target.key is None else target.key.encode()
        try:
            self._producer.produce(target.topic, key, trig.payload, headers, ack)
        except KafkaException as exc:
            return kafka_failure(target.topic, exc.args[0] if exc.args else None)
        try:
            err = await asyncio.wait_for(fut, timeout=self._ack_timeout_s)
        except TimeoutError:
            return KafkaResult(
                verdict=KafkaVerdict.UNACKNOWLEDGED,
                detail=f"kafka callback not acknowledged within {self._ack_timeout_s:g}s",
            )
        if err is None:
            return KafkaResult(verdict=KafkaVerdict.ACKED)
        return kafka_failure(target.topic, err)

"""The Kafka sender against a fake producer: what it produces for a Kafka callback and
how it reports Kafka's verdict (acked, failed, refused, none in time)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from proxy.envelope import Envelope, prepare_fire
from proxy.kafka_sender import KafkaSender
from proxy.outbox import Ack, Headers
from proxy.retry import KafkaResult, KafkaVerdict
from topics.codec import decode_trigger


@dataclass
class Produced:
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, str | bytes | None]]


@dataclass
class FakeProducer:
    """Answers each produce with ``ack_error`` (None: acknowledged), from another thread
    as librdkafka does; ``raises`` fails the produce call itself; ``silent`` never acks."""

    ack_error: KafkaError | None = None
    raises: KafkaError | None = None
    silent: bool = False
    produced: list[Produced] = field(default_factory=list)

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: Headers | None,
        on_delivery: Ack,
        partition: int | None = None,
    ) -> None:
        if self.raises is not None:
            raise KafkaException(self.raises)
        self.produced.append(Produced(topic, key, value, list(headers or [])))
        if not self.silent:
            msg = Message(topic=topic, partition=0)
            threading.Timer(0.01, on_delivery, args=(self.ack_error, msg)).start()


def kafka_envelope(topic: str = "sink", key: str | None = "kk") -> Envelope:
    doc = {
        "trigger_id": "t1",
        "schedule_id": "s1",
        "tenant": "acme",
        "due_ms": 5,
        "emitted_ms": 6,
        "attempt": 1,
        "order_key": "s1",
        "payload": {"n": 1},
        "callback": {"type": "kafka", "topic": topic, "key": key},
    }
    e = Envelope(
        topic="fires",
        partition=0,
        offset=0,
        key=b"s1",
        value=orjson.dumps(doc),
        headers=[],
        timestamp_ms=None,
        read_s=0.0,
    )
    prepare_fire(e, decode_trigger)
    assert e.kafka_target is not None
    return e


def sender(producer: FakeProducer, ack_timeout_s: float = 5.0) -> KafkaSender:
    return KafkaSender(
        producer, own_topics=frozenset({"dlq", "out", "retries"}), ack_timeout_s=ack_timeout_s
    )


async def test_an_acknowledged_produce_is_acked_with_the_payload_key_and_headers() -> None:
    producer = FakeProducer()
    result = await sender(producer).send(kafka_envelope())
    assert result == KafkaResult(verdict=KafkaVerdict.ACKED)
    (p,) = producer.produced
    assert (p.topic, p.key, orjson.loads(p.value)) == ("sink", b"kk", {"n": 1})
    assert dict(p.headers) == {
        "tocsin-trigger-id": "t1",
        "tocsin-schedule-id": "s1",
        "tocsin-tenant": "acme",
        "tocsin-due-ms": "5",
    }


async def test_a_keyless_callback_is_produced_without_a_key() -> None:
    producer = FakeProducer()
    await sender(producer).send(kafka_envelope(key=None))
    assert producer.produced[0].key is None


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError.MSG_SIZE_TOO_LARGE,
    ],
)
async def test_an_error_that_cannot_clear_is_refused(code: int) -> None:
    result = await sender(FakeProducer(ack_error=KafkaError(code))).send(kafka_envelope())
    assert result.verdict is KafkaVerdict.REFUSED and "cannot succeed" in result.detail


async def test_an_error_that_may_clear_is_failed() -> None:
    producer = FakeProducer(ack_error=KafkaError(KafkaError._MSG_TIMED_OUT))
    result = await sender(producer).send(kafka_envelope())
    assert result.verdict is KafkaVerdict.FAILED and "'sink' failed" in result.detail


async def test_a_produce_call_that_raises_is_judged_by_its_error() -> None:
    refused = FakeProducer(raises=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    assert (await sender(refused).send(kafka_envelope())).verdict is KafkaVerdict.REFUSED
    failed = FakeProducer(raises=KafkaError(KafkaError._TRANSPORT))
    assert (await sender(failed).send(kafka_envelope())).verdict is KafkaVerdict.FAILED


async def test_no_acknowledgement_in_time_is_unacknowledged() -> None:
    result = await sender(FakeProducer(silent=True), ack_timeout_s=0.05).send(kafka_envelope())
    assert result == KafkaResult(
        verdict=KafkaVerdict.UNACKNOWLEDGED, detail="kafka callback not acknowledged within 0.05s"
    )


@pytest.mark.parametrize("topic", ["retries", "dlq", "out"])
async def test_a_callback_into_the_proxys_own_topics_is_refused_unproduced(topic: str) -> None:
    producer = FakeProducer()
    result = await sender(producer).send(kafka_envelope(topic=topic))
    assert result.verdict is KafkaVerdict.REFUSED and "own topic" in result.detail
    assert producer.produced == []

"""Dead letters that can always be written, and records Kafka refuses for good."""

from __future__ import annotations

import base64
from typing import Any

import orjson
from confluent_kafka import KafkaError as RdKafkaError
from confluent_kafka import KafkaException

from proxy.deadletter import MAX_RECORD_BYTES, dead_letter_record
from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox, OutRecord


def big_env(value_bytes: int, header_bytes: int = 10) -> Envelope:
    e = Envelope(
        topic="src",
        partition=3,
        offset=42,
        key=b"k",
        value=b"v" * value_bytes,
        headers=[("h", b"x" * header_bytes)],
        timestamp_ms=1,
        read_s=0.0,
    )
    prepare_generic(e, url="http://h/p", timeout_s=1)
    return e


def record(e: Envelope, **kw: Any) -> bytes:
    return dead_letter_record(
        e,
        reason="HTTP 700: no",
        status=700,
        first_failure_ms=1,
        last_failure_ms=2,
        now_ms=3,
        group_id="g",
        **kw,
    )


def test_a_730_kb_record_makes_a_dead_letter_under_the_limit_with_its_coordinates() -> None:
    data = record(big_env(730_000))
    assert len(data) <= MAX_RECORD_BYTES
    doc = orjson.loads(data)
    o = doc["original"]
    assert (o["topic"], o["partition"], o["offset"]) == ("src", 3, 42)
    assert o["value_b64"] is None and "value_b64" in doc["omitted"]
    assert o["key_b64"] == base64.b64encode(b"k").decode()  # only what had to go went
    assert doc["reason"] == "HTTP 700: no"


def test_huge_headers_are_left_out_too_and_small_records_are_whole() -> None:
    data = record(big_env(10, header_bytes=800_000))
    doc = orjson.loads(data)
    assert len(data) <= MAX_RECORD_BYTES and doc["original"]["headers"] == []
    small = orjson.loads(record(big_env(10)))
    assert "omitted" not in small and small["original"]["value_b64"] is not None


def test_coordinates_only_form() -> None:
    doc = orjson.loads(record(big_env(10), coordinates_only=True))
    o = doc["original"]
    assert o["value_b64"] is None and o["key_b64"] is None and o["headers"] == []
    assert o["offset"] == 42 and "omitted" in doc


class FakeProducer:
    """Records produce calls; the test answers each with an acknowledgement."""

    def __init__(self, refuse_over: int | None = None) -> None:
        self.calls: list[tuple[str, bytes, Any]] = []
        self.refuse_over = refuse_over

    def produce(
        self, topic: str, *, value: bytes, key: Any, headers: Any, on_delivery: Any
    ) -> None:
        if self.refuse_over is not None and len(value) > self.refuse_over:
            # what librdkafka raises for a record over message.max.bytes
            raise KafkaException(RdKafkaError(RdKafkaError.MSG_SIZE_TOO_LARGE))
        self.calls.append((topic, value, on_delivery))


def outbox(producer: FakeProducer, metrics: ProxyMetrics | None = None) -> Outbox:
    ob = Outbox({"bootstrap.servers": "127.0.0.1:1"}, metrics)
    ob.producer = producer  # type: ignore[assignment]
    return ob


def test_a_record_the_broker_refuses_as_too_large_is_replaced_by_its_fallback() -> None:
    fake = FakeProducer()
    done: list[int] = []
    small = OutRecord("dlq", b"k", b"SMALL")
    outbox(fake).send_all([OutRecord("dlq", b"k", b"FULL", fallback=small)], lambda: done.append(1))
    _, value, ack = fake.calls[0]
    assert value == b"FULL"
    ack(RdKafkaError(RdKafkaError.MSG_SIZE_TOO_LARGE), None)
    assert [v for _, v, _ in fake.calls] == [b"FULL", b"SMALL"]  # not FULL again for ever
    assert not done
    fake.calls[1][2](None, None)
    assert done == [1]


def test_a_record_refused_for_good_without_fallback_is_dropped_counted_and_done() -> None:
    fake, metrics = FakeProducer(refuse_over=100), ProxyMetrics()
    done: list[int] = []
    outbox(fake, metrics).send_all(
        [OutRecord("dlq", None, b"x" * 200), OutRecord("out", None, b"ok")], lambda: done.append(1)
    )
    assert [t for t, _, _ in fake.calls] == ["out"]  # the refused one raised, did not stall
    fake.calls[0][2](None, None)
    assert done == [1]
    assert (
        metrics.registry.get_sample_value("tocsin_proxy_records_refused_total", {"topic": "dlq"})
        == 1
    )


def test_transient_failures_are_still_produced_again() -> None:
    fake = FakeProducer()
    done: list[int] = []
    small = OutRecord("dlq", None, b"s")
    outbox(fake).send_all([OutRecord("dlq", None, b"v", fallback=small)], lambda: done.append(1))
    fake.calls[0][2](RdKafkaError(RdKafkaError._MSG_TIMED_OUT), None)
    assert [v for _, v, _ in fake.calls] == [b"v", b"v"] and not done

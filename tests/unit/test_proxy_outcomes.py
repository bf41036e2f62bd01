"""Outcome publishing with a fake outbox: which records a final outcome writes, and that the
message's offset is done only once Kafka has every one of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import orjson

from proxy.envelope import Envelope
from proxy.metrics import ProxyMetrics
from proxy.outbox import OutRecord
from proxy.outcomes import OutcomePublisher
from proxy.retry import DeadLetter, Done
from tests.unit.test_proxy_writer import fire, generic


class HoldingOutbox:
    """Keeps what it is given; ``acknowledge`` plays Kafka's acknowledgement."""

    def __init__(self) -> None:
        self.records: list[OutRecord] = []
        self.waiting: list[Callable[[], None]] = []

    def send_all(self, records: Sequence[OutRecord], done: Callable[[], None]) -> None:
        self.records.extend(records)
        self.waiting.append(done)

    def acknowledge(self) -> None:
        for done in self.waiting:
            done()
        self.waiting.clear()


class Offsets:
    def __init__(self) -> None:
        self.done: list[Envelope] = []

    def offset_done(self, env: Envelope) -> None:
        self.done.append(env)


def publisher(
    deliveries_topic: str | None = "out",
) -> tuple[OutcomePublisher, HoldingOutbox, Offsets, ProxyMetrics]:
    outbox, offsets, metrics = HoldingOutbox(), Offsets(), ProxyMetrics()
    pub = OutcomePublisher(
        outbox=outbox,
        offsets=offsets,
        metrics=metrics,
        dead_letter_topic="dlq",
        deliveries_topic=deliveries_topic,
        group_id="g",
    )
    return pub, outbox, offsets, metrics


def test_a_delivered_trigger_writes_its_outcome_and_is_done_once_kafka_has_it() -> None:
    pub, outbox, offsets, metrics = publisher()
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    pub.publish(env, Done(status=204), "2xx", time.monotonic())
    (rec,) = outbox.records
    doc = orjson.loads(rec.value)
    assert rec.topic == "out" and rec.key == b"s0"
    assert (doc["outcome"], doc["status_code"], doc["reason"]) == ("delivered", 204, None)
    assert offsets.done == []  # not before the acknowledgement
    outbox.acknowledge()
    assert offsets.done == [env]
    sample = metrics.registry.get_sample_value
    assert sample("tocsin_proxy_deliveries_total", {"outcome": "delivered", "status_class": "2xx"})
    assert sample("tocsin_proxy_delivery_seconds_count") == 1


def test_a_dead_lettered_trigger_writes_its_dead_letter_and_its_outcome() -> None:
    pub, outbox, offsets, metrics = publisher()
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    pub.publish(env, DeadLetter(reason="HTTP 700: bad sku", status=700), "7xx", time.monotonic())
    dlq, out = outbox.records
    letter = orjson.loads(dlq.value)
    assert dlq.topic == "dlq" and dlq.key == env.key
    assert (letter["reason"], letter["status_code"], letter["proxy_group"]) == (
        "HTTP 700: bad sku",
        700,
        "g",
    )
    assert letter["original"]["offset"] == 0 and "omitted" not in letter
    # Should Kafka refuse the whole dead letter, its coordinates-only form is written.
    assert dlq.fallback is not None
    assert "value_b64" in orjson.loads(dlq.fallback.value)["omitted"]
    assert orjson.loads(out.value)["outcome"] == "dead_lettered"
    outbox.acknowledge()
    assert offsets.done == [env]
    assert metrics.registry.get_sample_value("tocsin_proxy_dead_letters_total", {"kind": "7xx"})


def test_a_dead_letter_after_timeouts_counts_as_a_poison_pill() -> None:
    pub, _outbox, _offsets, metrics = publisher(deliveries_topic=None)
    pub.publish(generic(0), DeadLetter(reason="poison pill: 3 timeouts"), "timeout", 0.0)
    sample = metrics.registry.get_sample_value
    assert sample("tocsin_proxy_dead_letters_total", {"kind": "poison"}) == 1
    assert sample("tocsin_proxy_dead_letters_total", {"kind": "timeout"}) is None


def test_a_delivered_message_with_nothing_to_write_is_done_at_once() -> None:
    pub, outbox, offsets, _metrics = publisher()
    env = generic(0)  # not a trigger: no delivery outcome
    pub.publish(env, Done(status=200), "2xx", time.monotonic())
    assert outbox.records == [] and outbox.waiting == []
    assert offsets.done == [env]


def test_without_a_deliveries_topic_only_the_dead_letter_is_written() -> None:
    pub, outbox, offsets, _metrics = publisher(deliveries_topic=None)
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    pub.publish(env, DeadLetter(reason="HTTP 700: x", status=700), "7xx", time.monotonic())
    assert [r.topic for r in outbox.records] == ["dlq"]
    outbox.acknowledge()
    assert offsets.done == [env]

"""The proxy's outbox on the real librdkafka: a flush with Kafka unreachable and the local
queue full returns by its timeout, and on the real Kafka a park the broker refuses leaves its
dead letter after the dead letter its key already had held.

Kafka down is a bootstrap address nobody listens on: the shared single-node stack cannot
be stopped, and a relay in front of it would be bypassed (clients connect to the address the
broker advertises). So "Kafka was up, then went down" is the unit tests' (FakeKafkaProducer)."""

from __future__ import annotations

import socket
import threading

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from base.settings import Settings
from proxy.outbox import Outbox, OutRecord
from tests.integration.test_proxy_delivery import read_topic, uid

pytestmark = pytest.mark.integration


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_flush_with_kafka_unreachable_and_the_local_queue_full_returns() -> None:
    ob = Outbox(
        {
            "bootstrap.servers": f"127.0.0.1:{closed_port()}",
            "queue.buffering.max.messages": 5,
            "log_level": 0,
        }
    )
    try:
        for i in range(5):
            ob.send_all([OutRecord("out", b"k", b"%d" % i)], lambda: None)
        ob.send_all([OutRecord("out", b"k", b"held", later=True)], lambda: None)
        left: list[int] = []
        flushing = threading.Thread(target=lambda: left.append(ob.flush(2.0)), daemon=True)
        flushing.start()
        flushing.join(60)  # flush(2.0) must have ended long before; the old code never did
        assert not flushing.is_alive(), "flush(2.0) still waiting for room after 60 s"
        assert left == [6]  # five unacknowledged, one still held
    finally:
        ob.closed = True


def test_a_refused_parks_dead_letter_follows_its_keys_held_dead_letter(stack: Settings) -> None:
    retries, dlq = f"h3-retries-{uid()}", f"h3-dlq-{uid()}"
    admin = AdminClient(stack.kafka.librdkafka())
    futures = admin.create_topics(
        [
            # The broker refuses the park itself (larger than the topic allows), for good.
            NewTopic(retries, 1, 1, config={"max.message.bytes": "1024"}),
            NewTopic(dlq, 1, 1),
        ]
    )
    for fut in futures.values():
        fut.result(timeout=30)
    ob = Outbox(stack.kafka.librdkafka())
    done: list[str] = []
    ob.send_all([OutRecord(dlq, b"k", b"first dead letter", later=True)], lambda: done.append("1"))
    refused = threading.Event()
    park = OutRecord(
        retries,
        b"k",
        b"x" * 4096,
        fallback=OutRecord(dlq, b"k", b"second, coordinates"),
        on_fallback=refused.set,
    )
    ob.send_all([park], lambda: done.append("2"))
    # The broker's refusal comes back before the committer's next round (50 ms) would
    # produce the held dead letter: poll for it first, as the committer's thread does.
    for _ in range(300):
        if refused.is_set():
            break
        ob.poll(0.1)
    assert refused.is_set()
    assert ob.flush(30) == 0
    assert sorted(done) == ["1", "2"]
    got = read_topic(stack, dlq, expect=2)
    assert [m.value() for m in got] == [b"first dead letter", b"second, coordinates"]

"""CommandClient's edges without servers: the signing-key cache when Cassandra cannot be
reached (the store address points at a closed port), and produce errors classified."""

from __future__ import annotations

from dataclasses import replace

import pytest
from confluent_kafka import KafkaError as RdKafkaError
from confluent_kafka import KafkaException

from base.errors import KafkaError, StoreError
from base.settings import Settings
from streams.client import SIGNING_KEY_REFRESH_S, CommandClient


def client_without_cassandra() -> CommandClient:
    base = Settings.from_env({})
    return CommandClient(replace(base, cassandra=replace(base.cassandra, port=1)))


def test_an_expired_key_is_kept_when_the_refresh_cannot_reach_cassandra() -> None:
    client = client_without_cassandra()
    # Read long ago: due for a refresh, which fails; sending goes on with the cached key.
    client._signing_keys["acme"] = (-2 * SIGNING_KEY_REFRESH_S, "cached-secret")
    assert client.signing_key_of("acme") == "cached-secret"
    # ...and the failed refresh is not retried on every command (it counts as a read).
    assert client._signing_keys["acme"][0] > 0


def test_without_a_cached_key_the_failure_is_raised() -> None:
    client = client_without_cassandra()
    with pytest.raises(StoreError, match="Unable to connect") as caught:
        client.signing_key_of("acme")
    assert caught.value.retriable


class RefusingProducer:
    """A producer that refuses the first ``refusals`` produces with ``code``."""

    def __init__(self, code: int, refusals: int) -> None:
        self.code, self.refusals, self.calls, self.polls = code, refusals, 0, 0

    def produce(self, topic: str, **_: object) -> None:
        self.calls += 1
        if self.calls <= self.refusals:
            raise KafkaException(RdKafkaError(self.code))

    def poll(self, timeout_s: float) -> int:
        self.polls += 1
        return 0


def test_a_topic_unknown_while_a_broker_catches_up_is_tried_again() -> None:
    client = client_without_cassandra()
    producer = RefusingProducer(RdKafkaError._UNKNOWN_TOPIC, refusals=2)
    client.producer = producer  # type: ignore[assignment]
    client.send_raw(b"k", b"v")
    assert producer.calls == 3 and producer.polls == 2


def test_a_refusal_that_cannot_pass_is_a_classified_error_at_once() -> None:
    client = client_without_cassandra()
    producer = RefusingProducer(RdKafkaError.MSG_SIZE_TOO_LARGE, refusals=5)
    client.producer = producer  # type: ignore[assignment]
    with pytest.raises(KafkaError) as caught:
        client.send_raw(b"k", b"v")
    assert not caught.value.retriable and producer.calls == 1

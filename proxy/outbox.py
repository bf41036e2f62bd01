"""The proxy's producer: dead letters, delivery outcomes and Kafka callbacks.

A record the proxy must write (a dead letter, an outcome) is re-produced until Kafka
acknowledges it, and only then is the source message's offset marked done: a crash before
the acknowledgement re-delivers the source message rather than losing the record.
Callbacks run on whichever thread polls or flushes the producer (the committer thread,
or the reader during a revoke), so the per-group counters take a lock. Never blocks on the
network except in ``flush``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaException, Producer

from tocsin.errors import KafkaError

log = logging.getLogger("tocsin.proxy")

Headers = list[tuple[str, str | bytes | None]]
Ack = Callable[[Any, Any], None]


class Outbox:
    def __init__(self, kafka_conf: dict[str, Any]) -> None:
        conf = dict(kafka_conf)
        conf.update({
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            # Give up a single produce after 30 s and produce again ourselves, so a long
            # Kafka outage shows up in the logs instead of silently piling up.
            "message.timeout.ms": 30_000,
        })
        try:
            self.producer = Producer(conf)
        except KafkaException as exc:
            raise KafkaError(f"cannot create the proxy producer: {exc}") from exc
        self._lock = threading.Lock()
        self.closed = False

    def produce(self, topic: str, key: bytes | None, value: bytes, headers: Headers | None,
                on_delivery: Ack) -> None:
        """One produce attempt; ``on_delivery(err, msg)`` reports the outcome."""
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers or None,
                                      on_delivery=on_delivery)
                return
            except BufferError:
                # The local queue is full: serve callbacks to make room, then try again.
                self.producer.poll(0.05)

    def send_all(self, records: Sequence[tuple[str, bytes | None, bytes]],
                 done: Callable[[], None]) -> None:
        """Produce every record (retrying failures for ever); call ``done`` once all acked."""
        left = [len(records)]

        def make_ack(topic: str, key: bytes | None, value: bytes) -> Ack:
            def ack(err: Any, _msg: Any) -> None:
                if err is not None:
                    if self.closed:
                        return
                    log.warning("proxy record not acknowledged, producing again",
                                extra={"topic": topic, "error": str(err)})
                    self.produce(topic, key, value, None, ack)
                    return
                with self._lock:
                    left[0] -= 1
                    finished = left[0] == 0
                if finished:
                    done()
            return ack

        for topic, key, value in records:
            self.produce(topic, key, value, None, make_ack(topic, key, value))

    def poll(self, timeout_s: float) -> None:
        self.producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        """Wait for acknowledgements; returns how many records are still unacknowledged."""
        return int(self.producer.flush(timeout_s))

    def close(self, timeout_s: float) -> None:
        left = self.flush(timeout_s)
        self.closed = True
        if left:
            log.warning("proxy producer closed with unacknowledged records",
                        extra={"records": left})

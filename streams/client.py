"""A small synchronous client of the scheduler's topics, for the CLI, demo, tests and benches.

Commands are produced with Kafka's default (murmur2) partitioner, as the wire contract
requires, and results are read back from the command-results topic starting at the high
watermarks taken before sending, so no answer is missed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence

from confluent_kafka import OFFSET_END, Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka import KafkaError as RdKafkaError

from base.clock import now_ms
from base.errors import KafkaError, StoreError
from base.settings import Settings
from topics.catalog import catalog
from topics.codec import decode_result, decode_trigger, encode_command
from topics.models import Command, CommandResult, Trigger
from topics.signing import sign_headers

log = logging.getLogger("tocsin.client")

# How long CommandClient trusts a signing key it read: each read opens a Cassandra
# connection, so not per command; a rotation reaches it within this time.
SIGNING_KEY_REFRESH_S = 60.0
# How long a command whose produce the client refuses for a passing reason (a restarted
# broker that does not know the topic yet, no broker reachable) is tried again before the
# error is raised, and the longest pause between tries.
PRODUCE_RETRY_S = 30.0
PRODUCE_BACKOFF_MAX_S = 1.0
# librdkafka's local errors that pass on their own although ``retriable()`` says no: while a
# restarted broker catches up it may answer that an existing topic is unknown.
_PASSING = frozenset(
    {RdKafkaError._UNKNOWN_TOPIC, RdKafkaError._TRANSPORT, RdKafkaError._ALL_BROKERS_DOWN}
)


def produce_error_is_retriable(err: RdKafkaError) -> bool:
    """Whether a produce refused with ``err`` may succeed if tried again."""
    return bool(err.retriable()) or err.code() in _PASSING


class CommandClient:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = catalog(settings.topics)
        # tenant -> (read at, monotonic s; its current signing key)
        self._signing_keys: dict[str, tuple[float, str | None]] = {}
        self.producer = Producer(
            {
                **settings.kafka.librdkafka(),
                "partitioner": "murmur2_random",  # Java's default: the contract's partitioner
                "enable.idempotence": True,
                "linger.ms": 5,
                "queue.buffering.max.messages": 1_000_000,
            }
        )

    def send(self, command: Command, *, signing_key: str | None = None) -> None:
        """Produce a command signed with the tenant's key (topics.signing): ``signing_key``
        if given, else the tenant's current key read from the store (again after
        ``SIGNING_KEY_REFRESH_S``, so a rotation is picked up while the previous key is still
        valid) - this client is an operator's tool (CLI, demo, tests, benchmarks) with
        access to Cassandra; services sign with the key they were given."""
        key, value = command.schedule_id.encode(), encode_command(command)
        secret = signing_key or self.signing_key_of(command.tenant)
        headers = (
            sign_headers(secret, signed_at_ms=now_ms(), key=key, value=value) if secret else None
        )
        self.send_raw(key, value, headers=headers)

    def signing_key_of(self, tenant: str) -> str | None:
        """The tenant's current signing key (cached for ``SIGNING_KEY_REFRESH_S``)."""
        cached = self._signing_keys.get(tenant)
        now = time.monotonic()
        if cached is None or now - cached[0] >= SIGNING_KEY_REFRESH_S:
            # Imported here: only a process that signs loads cassandra-driver (slow to import).
            from base.cassandra import make_cluster

            cluster = make_cluster(self.settings.cassandra)
            try:
                row = (
                    cluster.connect()
                    .execute(
                        f"SELECT signing_secret FROM {self.settings.cassandra.keyspace}.tenants "
                        "WHERE tenant = %s",
                        (tenant,),
                    )
                    .one()
                )
            except Exception as exc:
                if cached is None:
                    raise StoreError(
                        f"could not read the signing key of tenant {tenant!r}: {exc}"
                    ) from exc
                # Cassandra unreachable at a refresh: keep signing with the key we have (the
                # workers accept it through a rotation's grace period) rather than stop
                # sending - commands need only Kafka.
                log.warning(
                    "could not refresh the signing key; using the cached one",
                    extra={"tenant": tenant},
                )
                self._signing_keys[tenant] = (now, cached[1])
                return cached[1]
            finally:
                cluster.shutdown()
            cached = (now, row.signing_secret if row is not None else None)
            self._signing_keys[tenant] = cached
        return cached[1]

    def send_raw(
        self,
        key: bytes | None,
        value: bytes,
        *,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> None:
        kafka_headers: list[tuple[str, str | bytes | None]] | None = (
            None if headers is None else list(headers)
        )
        deadline = time.monotonic() + PRODUCE_RETRY_S
        backoff_s = 0.05
        while True:
            try:
                self.producer.produce(
                    self.topics.commands.name, key=key, value=value, headers=kafka_headers
                )
                return
            except BufferError:
                self.producer.poll(0.05)
            except KafkaException as exc:
                err: RdKafkaError = exc.args[0]
                retriable = produce_error_is_retriable(err)
                if not retriable or time.monotonic() >= deadline:
                    raise KafkaError(
                        f"command not produced: {err.str()}", retriable=retriable
                    ) from exc
                log.warning("produce refused; trying again", extra={"error": err.str()})
                self.producer.poll(backoff_s)
                backoff_s = min(backoff_s * 2, PRODUCE_BACKOFF_MAX_S)

    def flush(self, timeout_s: float = 30.0) -> None:
        left = self.producer.flush(timeout_s)
        if left:
            raise KafkaError(f"{left} commands not delivered within {timeout_s}s")


class _TopicTail:
    """Reads a topic from its current end (watermarks taken at construction)."""

    def __init__(self, settings: Settings, topic: str, *, from_start: bool = False) -> None:
        self.consumer = Consumer(
            {
                **settings.kafka.librdkafka(),
                "group.id": f"tocsin-tail-{time.time_ns()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 50,
            }
        )
        meta = self.consumer.list_topics(topic, timeout=10)
        partitions = sorted(meta.topics[topic].partitions)
        assignment = []
        for p in partitions:
            low, high = self._watermarks(TopicPartition(topic, p))
            if from_start:
                assignment.append(TopicPartition(topic, p, low))
            else:
                assignment.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
        self.consumer.assign(assignment)

    def _watermarks(self, tp: TopicPartition, timeout_s: float = 30.0) -> tuple[int, int]:
        # A topic created a moment ago answers "not leader" for a little while: retry that.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                low, high = self.consumer.get_watermark_offsets(tp, timeout=10)
                return int(low), int(high)
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    raise KafkaError(f"cannot read offsets of {tp.topic}: {exc}") from exc
                time.sleep(0.2)

    def poll_values(self, timeout_s: float = 0.5, max_messages: int = 5000) -> list[bytes]:
        msgs = self.consumer.consume(max_messages, timeout_s)
        return [v for m in msgs if m.error() is None and (v := m.value()) is not None]

    def close(self) -> None:
        self.consumer.close()


class ResultWatcher(_TopicTail):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, catalog(settings.topics).command_results.name)

    def poll(self, timeout_s: float = 0.5) -> list[CommandResult]:
        return [decode_result(v) for v in self.poll_values(timeout_s)]

    def wait_for(
        self, schedule_ids: Iterable[str], timeout_s: float = 60.0
    ) -> dict[str, CommandResult]:
        """The latest result per schedule id, for each id in ``schedule_ids``."""
        want = set(schedule_ids)
        got: dict[str, CommandResult] = {}
        deadline = time.monotonic() + timeout_s
        while want - set(got) and time.monotonic() < deadline:
            for r in self.poll():
                if r.schedule_id in want:
                    got[r.schedule_id] = r
        return got


class FireWatcher(_TopicTail):
    def __init__(self, settings: Settings, *, from_start: bool = False) -> None:
        super().__init__(settings, catalog(settings.topics).fires.name, from_start=from_start)

    def poll(self, timeout_s: float = 0.5) -> Iterator[tuple[Trigger, int]]:
        """Triggers with their receive time (epoch ms)."""
        for value in self.poll_values(timeout_s):
            yield decode_trigger(value), now_ms()

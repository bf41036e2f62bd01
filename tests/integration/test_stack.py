"""The local stack is real: consumer groups, transactions, prepared statements and LWTs."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from base.cassandra import make_cluster
from base.errors import TopicMismatchError
from base.settings import Settings
from schema.migrate import load_migrations, migrate
from tocsin.topic_admin import ensure_topics
from topics.catalog import TopicSpec, catalog


def _new_topic(settings: Settings, partitions: int = 2) -> str:
    name = f"{settings.topics.prefix}stack-{uuid.uuid4().hex[:6]}"
    admin = AdminClient(settings.kafka.librdkafka())
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(timeout=30)
    return name


def _consume(consumer: Consumer, want: int, timeout_s: float = 30.0) -> list[bytes]:
    import time

    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is None or msg.error():
            continue
        got.append(msg.value())
    return got


def test_consumer_group_commits_offsets(topics: Settings) -> None:
    topic = _new_topic(topics)
    producer = Producer(topics.kafka.librdkafka())
    for i in range(20):
        producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=i % 2)
    assert producer.flush(30) == 0

    group = f"{topics.topics.prefix}group-{uuid.uuid4().hex[:6]}"
    conf = {
        **topics.kafka.librdkafka(),
        "group.id": group,
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
    }
    consumer = Consumer(conf)
    consumer.subscribe([topic])
    values = _consume(consumer, 20)
    assert sorted(values) == sorted(f"v{i}".encode() for i in range(20))
    consumer.commit(asynchronous=False)
    consumer.close()

    # A new member of the same group starts from the committed offsets: nothing is re-read.
    check = Consumer(conf)
    committed = check.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)
    assert [tp.offset for tp in committed] == [10, 10]
    check.close()


def test_transactional_produce_and_read_committed(topics: Settings) -> None:
    topic = _new_topic(topics, partitions=1)
    producer = Producer(
        {**topics.kafka.librdkafka(), "transactional.id": f"tx-{uuid.uuid4().hex[:6]}"}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"aborted")
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"committed")
    producer.commit_transaction(30)

    consumer = Consumer(
        {
            **topics.kafka.librdkafka(),
            "group.id": f"g-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    assert _consume(consumer, 1, timeout_s=20) == [b"committed"]
    # Nothing else becomes visible: the aborted record is filtered out.
    assert _consume(consumer, 1, timeout_s=3) == []
    consumer.close()


def test_catalog_create_is_idempotent_and_verifies_partitions(topics: Settings) -> None:
    specs = catalog(topics.topics).all()
    again = ensure_topics(topics.kafka, specs)
    assert set(again.values()) == {"ok"}
    wrong = TopicSpec(
        name=specs[0].name,
        partitions=specs[0].partitions + 1,
        replication_factor=1,
        key="k",
        value="v",
    )
    with pytest.raises(TopicMismatchError, match="partitions"):
        ensure_topics(topics.kafka, [wrong])


def test_cassandra_prepared_statement_and_lwt(keyspace: Settings) -> None:
    cluster = make_cluster(keyspace.cassandra)
    try:
        session = cluster.connect(keyspace.cassandra.keyspace)
        session.execute("CREATE TABLE IF NOT EXISTS stack_probe (id text PRIMARY KEY, v int)")
        insert = session.prepare("INSERT INTO stack_probe (id, v) VALUES (?, ?)")
        session.execute(insert, ("a", 1))
        select = session.prepare("SELECT v FROM stack_probe WHERE id = ?")
        assert session.execute(select, ("a",)).one().v == 1

        lwt = session.prepare("INSERT INTO stack_probe (id, v) VALUES (?, ?) IF NOT EXISTS")
        first = session.execute(lwt, ("b", 2)).one()
        second = session.execute(lwt, ("b", 3)).one()
        assert first.applied is True
        assert second.applied is False and second.v == 2
        cas = session.execute("UPDATE stack_probe SET v = 5 WHERE id = 'b' IF v = 2").one()
        assert cas.applied is True
        assert session.execute(select, ("b",)).one().v == 5
    finally:
        cluster.shutdown()


def test_migrations_are_idempotent(keyspace: Settings) -> None:
    assert migrate(keyspace.cassandra) == []
    versions = [m.version for m in load_migrations(keyspace=keyspace.cassandra.keyspace)]
    assert versions == sorted(versions) and versions[0] == 1


def test_setup_makes_an_existing_commands_topic_stamp_broker_time(topics: Settings) -> None:
    """A commands topic created before its timestamps had to be the broker's (CreateTime) is
    altered to LogAppendTime by ensure_topics (so by `tocsin setup`), and only that entry."""
    from confluent_kafka.admin import ConfigResource, ResourceType

    spec = catalog(topics.topics).commands
    old = TopicSpec(
        name=f"{spec.name}-old-{uuid.uuid4().hex[:6]}",
        partitions=1,
        replication_factor=1,
        key="k",
        value="v",
        config={**spec.config},
        enforced=spec.enforced,
    )
    admin = AdminClient(topics.kafka.librdkafka())
    created = admin.create_topics(
        [
            NewTopic(
                old.name, num_partitions=1, replication_factor=1, config={"retention.ms": "1234567"}
            )
        ]
    )
    created[old.name].result(30)

    def config() -> dict[str, str]:
        res = ConfigResource(ResourceType.TOPIC, old.name)
        entries = admin.describe_configs([res])[res].result(30)
        return {k: v.value for k, v in entries.items()}

    try:
        assert config()["message.timestamp.type"] == "CreateTime"
        assert ensure_topics(topics.kafka, [old]) == {old.name: "altered"}
        after = config()
        assert after["message.timestamp.type"] == "LogAppendTime"
        assert after["retention.ms"] == "1234567"  # retention is the operator's
        assert ensure_topics(topics.kafka, [old]) == {old.name: "ok"}
    finally:
        admin.delete_topics([old.name])[old.name].result(30)

"""streams.store against the real local Cassandra (127.0.0.1:9042), in a keyspace of its own.

Also holds the cross-check of streams.partitioner against a real librdkafka producer (it
needs Kafka, and the bucket partition of a schedule is only right if both agree).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from base.errors import StoreError
from base.settings import CassandraSettings, KafkaSettings
from streams.buckets import BUCKET_MS, minute_ms
from streams.model import BucketRow, ScheduleRow
from streams.partitioner import partition_for
from streams.store import Store

pytestmark = pytest.mark.integration

CQL = Path(__file__).resolve().parents[2] / "schema" / "cql" / "001_initial.cql"
KEYSPACE = f"test_store_{uuid.uuid4().hex[:8]}"
# A minute start an hour ahead: rows get TTLs from the real clock (due - now + retention),
# so bucket rows due in the past would expire within a second.
T0 = (int(time.time() * 1000) // BUCKET_MS + 60) * BUCKET_MS


def _unavailable(what: str, exc: BaseException) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} unavailable in CI: {exc}")
    pytest.skip(f"{what} unavailable: {exc}")


def _schema_statements(keyspace: str) -> list[str]:
    """Every migration (001, 002 tenants, 003 ...) with ${keyspace} substituted: the Store
    prepares statements on the tables of all of them."""
    from schema.migrate import load_migrations

    return [s for m in load_migrations(keyspace=keyspace) for s in m.statements]


@pytest.fixture(scope="module")
def cql_session() -> Iterator[Any]:
    """A raw driver session on the test keyspace (for DDL and checks such as TTL())."""
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile
    from cassandra.policies import RoundRobinPolicy

    profile = ExecutionProfile(load_balancing_policy=RoundRobinPolicy())
    cluster = Cluster(
        ["127.0.0.1"],
        port=9042,
        protocol_version=5,
        connect_timeout=5,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
    )
    try:
        session = cluster.connect()
        session.execute("SELECT release_version FROM system.local")
    except Exception as exc:
        cluster.shutdown()
        _unavailable("cassandra", exc)
    session.execute(
        f"CREATE KEYSPACE {KEYSPACE} WITH replication = "
        "{'class': 'SimpleStrategy', 'replication_factor': 1}",
        timeout=60,
    )
    for stmt in _schema_statements(KEYSPACE):
        session.execute(stmt, timeout=60)
    yield session
    session.execute(f"DROP KEYSPACE IF EXISTS {KEYSPACE}", timeout=60)
    cluster.shutdown()


@pytest.fixture(scope="module")
async def store(cql_session: Any) -> AsyncIterator[Store]:
    s = Store(CassandraSettings(keyspace=KEYSPACE), retention_s=3600, fetch_size=5000)
    await s.connect()
    yield s
    await s.close()


def now_ms() -> int:
    return int(time.time() * 1000)


def schedule(sid: str, due_ms: int, **overrides: Any) -> ScheduleRow:
    row = ScheduleRow(
        tenant="acme",
        schedule_id=sid,
        partition=partition_for(sid, 8),
        state="scheduled",
        due_ms=due_ms,
        version=1,
        created_ms=due_ms - 60_000,
        updated_ms=due_ms - 60_000,
        order_key="customer-7",
        payload=b'{"n": 1}',
        payload_type="json",
        callback='{"type": "kafka", "topic": "out"}',
        misfire_tolerance_s=3600,
        applied_offset=17,
        last_code="accepted",
    )
    return dataclasses.replace(row, **overrides)


async def test_schedule_round_trip(store: Store) -> None:
    due = now_ms() + 120_000
    row = schedule("round-trip", due)
    assert await store.get_schedule("acme", "round-trip") is None
    await store.put_schedule(row, now_ms=now_ms())
    got = await store.get_schedule("acme", "round-trip")
    assert got is not None
    assert ScheduleRow(**got) == row  # every column, Nones included
    # A later upsert with None fields leaves those cells alone (UNSET, no tombstones).
    await store.put_schedule(
        dataclasses.replace(row, version=2, payload=None, last_code=None), now_ms=now_ms()
    )
    again = await store.get_schedule("acme", "round-trip")
    assert again is not None
    assert (again["version"], again["payload"], again["last_code"]) == (2, row.payload, "accepted")


async def test_ttls_are_applied(store: Store, cql_session: Any) -> None:
    now = now_ms()
    due = now + 600_000  # 10 minutes ahead, retention 3600 s
    row = schedule("ttl", due)
    bucket = BucketRow.for_schedule(row, shards=1)
    await store.put_schedule(row, now_ms=now)
    await store.put_bucket_row(bucket, now_ms=now)
    await store.record_event("acme", "ttl", "created", at_ms=now, detail="d", due_ms=due)
    await store.mark_fired("acme", "ttl", "trig", fired_ms=now, due_ms=due)
    k = bucket.key

    def ttl_of(cql: str, *params: Any) -> int:
        value = cql_session.execute(cql, params).one()[0]
        assert value is not None, cql
        return int(value)

    until_due = 600 + 3600  # due + retention
    schedule_payload = ttl_of(
        f"SELECT TTL(payload) FROM {KEYSPACE}.schedules WHERE tenant=%s AND schedule_id=%s",
        "acme",
        "ttl",
    )
    bucket_payload = ttl_of(
        f"SELECT TTL(payload) FROM {KEYSPACE}.buckets WHERE partition=%s AND minute_ms=%s "
        "AND shard=%s AND due_ms=%s AND tenant=%s AND schedule_id=%s",
        k.partition,
        k.minute_ms,
        k.shard,
        k.due_ms,
        k.tenant,
        k.schedule_id,
    )
    event_detail = ttl_of(
        f"SELECT TTL(detail) FROM {KEYSPACE}.schedule_events WHERE tenant=%s "
        "AND schedule_id=%s AND at_ms=%s AND event=%s",
        "acme",
        "ttl",
        now,
        "created",
    )
    fired_state = ttl_of(
        f"SELECT TTL(state) FROM {KEYSPACE}.schedules WHERE tenant=%s AND schedule_id=%s",
        "acme",
        "ttl",
    )
    assert until_due - 60 < schedule_payload <= until_due
    assert until_due - 60 < bucket_payload <= until_due
    assert 3600 - 60 < event_detail <= 3600  # history: retention from the event
    assert 3600 - 60 < fired_state <= 3600  # a finished schedule: retention from the fire


async def test_bucket_read_is_one_paged_query_in_due_order(store: Store) -> None:
    minute = T0 + 7 * BUCKET_MS
    rng = random.Random(3)
    dues = [minute + rng.randrange(BUCKET_MS) for _ in range(23)] + [minute, minute + 59_999]
    now = now_ms()
    rows = [
        BucketRow.for_schedule(schedule(f"b-{i}", due, partition=2), shards=1)
        for i, due in enumerate(dues)
    ]
    await asyncio.gather(*(store.put_bucket_row(r, now_ms=now) for r in rows))
    # A row of the next minute and one of another partition must not leak in.
    await store.put_bucket_row(
        BucketRow.for_schedule(schedule("next", minute + BUCKET_MS, partition=2), shards=1),
        now_ms=now,
    )
    await store.put_bucket_row(
        BucketRow.for_schedule(schedule("other", minute + 5, partition=3), shards=1),
        now_ms=now,
    )

    reads, pages = store.bucket_reads, store.bucket_pages
    got = await store.read_bucket(2, minute, 1, fetch_size=4)
    assert store.bucket_reads - reads == 1  # one query for the (partition, minute, shard)...
    assert store.bucket_pages - pages == 7  # ...fetched in ceil(25 / 4) pages
    assert [(r.due_ms, r.schedule_id) for r in got] == sorted(
        (r.due_ms, r.schedule_id) for r in rows
    )
    assert got[0] == min(rows, key=lambda r: (r.due_ms, r.schedule_id))

    # Catch-up inside a minute: only rows due at or after the checkpoint.
    cut = sorted(dues)[10]
    tail = await store.read_bucket(2, minute, 1, from_due_ms=cut)
    assert [r.due_ms for r in tail] == sorted(d for d in dues if d >= cut)

    await store.delete_bucket_row(got[0].key)
    after = await store.read_bucket(2, minute, 1)
    assert len(after) == len(rows) - 1
    assert got[0].key not in {r.key for r in after}


async def test_sharded_bucket_reads_each_shard_once_and_merges(store: Store) -> None:
    minute = T0 + 20 * BUCKET_MS
    shards = 3
    now = now_ms()
    rows = [
        BucketRow.for_schedule(schedule(f"s-{i}", minute + 997 * i, partition=1), shards=shards)
        for i in range(40)
    ]
    assert {r.shard for r in rows} == {0, 1, 2}
    await asyncio.gather(*(store.put_bucket_row(r, now_ms=now) for r in rows))
    reads = store.bucket_reads
    seen: list[tuple[float, int]] = []
    store._bucket_read_hook = lambda seconds, n: seen.append((seconds, n))
    try:
        got = await store.read_bucket(1, minute, shards, fetch_size=5)
    finally:
        store._bucket_read_hook = None
    assert store.bucket_reads - reads == shards
    assert [r.schedule_id for r in got] == [f"s-{i}" for i in range(40)]
    assert sum(n for _, n in seen) == 40 and len(seen) == shards


async def test_apply_schedule_change_create_reschedule_cancel(store: Store) -> None:
    now = now_ms()
    sid, shards = "lifecycle", 2
    due1, due2 = now + 300_000, now + 900_000

    def bucket_ids(rows: list[BucketRow]) -> list[str]:
        return [r.schedule_id for r in rows if r.schedule_id == sid]

    created = schedule(sid, due1)
    b1 = BucketRow.for_schedule(created, shards=shards)
    await store.apply_schedule_change(
        created, new_bucket=b1, old_bucket=None, now_ms=now, event="created"
    )
    assert bucket_ids(await store.read_bucket(created.partition, minute_ms(due1), shards)) == [sid]

    moved = dataclasses.replace(created, due_ms=due2, version=2, updated_ms=now + 1)
    b2 = BucketRow.for_schedule(moved, shards=shards)
    await store.apply_schedule_change(
        moved, new_bucket=b2, old_bucket=b1.key, now_ms=now + 1, event="rescheduled"
    )
    assert bucket_ids(await store.read_bucket(created.partition, minute_ms(due1), shards)) == []
    [new_row] = await store.read_bucket(created.partition, minute_ms(due2), shards)
    assert (new_row.version, new_row.due_ms) == (2, due2)

    # Same key (payload-only update): upsert in place, the row is not deleted.
    edited = dataclasses.replace(moved, version=3, payload=b"new")
    b3 = BucketRow.for_schedule(edited, shards=shards)
    assert b3.key == b2.key
    await store.apply_schedule_change(edited, new_bucket=b3, old_bucket=b2.key, now_ms=now + 2)
    [same] = await store.read_bucket(created.partition, minute_ms(due2), shards)
    assert (same.version, same.payload) == (3, b"new")

    cancelled = dataclasses.replace(edited, state="cancelled", version=4, updated_ms=now + 3)
    await store.apply_schedule_change(
        cancelled, new_bucket=None, old_bucket=b3.key, now_ms=now + 3, event="cancelled"
    )
    assert await store.read_bucket(created.partition, minute_ms(due2), shards) == []
    got = await store.get_schedule("acme", sid)
    assert got is not None and (got["state"], got["version"]) == ("cancelled", 4)
    events = await store.list_events("acme", sid)
    assert [(e["event"], e["at_ms"]) for e in events] == [
        ("created", now),
        ("rescheduled", now + 1),
        ("cancelled", now + 3),
    ]
    assert events[0]["due_ms"] == due1


async def test_checkpoint(store: Store) -> None:
    assert await store.get_checkpoint(6) is None
    await store.set_checkpoint(6, T0, "worker-a", now_ms=now_ms())
    assert await store.get_checkpoint(6) == T0
    await store.set_checkpoint(6, T0 + 1000, "worker-b", now_ms=now_ms())
    assert await store.get_checkpoint(6) == T0 + 1000


async def test_mark_fired_missed_and_events(store: Store) -> None:
    now = now_ms()
    await store.put_schedule(schedule("fire-me", now), now_ms=now)
    assert await store.mark_fired("acme", "fire-me", "trig-1", fired_ms=now + 5, due_ms=now)
    got = await store.get_schedule("acme", "fire-me")
    assert got is not None
    assert (got["state"], got["fired_ms"], got["trigger_id"]) == ("fired", now + 5, "trig-1")

    await store.put_schedule(schedule("miss-me", now - 7_200_000), now_ms=now)
    await store.mark_missed(
        "acme", "miss-me", "trig-2", missed_ms=now, due_ms=now - 7_200_000, detail="late 2h"
    )
    got = await store.get_schedule("acme", "miss-me")
    assert got is not None
    assert (got["state"], got["fired_ms"]) == ("missed", None)
    [event] = await store.list_events("acme", "miss-me")
    assert (event["event"], event["trigger_id"], event["detail"]) == ("missed", "trig-2", "late 2h")

    # Conditional form: applied only when the version still matches.
    await store.put_schedule(schedule("lwt", now, version=5), now_ms=now)
    assert not await store.mark_fired(
        "acme", "lwt", "t-old", fired_ms=now, due_ms=now, if_version=4
    )
    got = await store.get_schedule("acme", "lwt")
    assert got is not None and got["state"] == "scheduled"
    assert await store.mark_fired(
        "acme", "lwt", "t-new", fired_ms=now + 1, due_ms=now, if_version=5
    )
    got = await store.get_schedule("acme", "lwt")
    assert got is not None and (got["state"], got["trigger_id"]) == ("fired", "t-new")


async def test_mark_fired_many_groups_marks_and_records_each(cql_session: Any) -> None:
    from streams.model import FiredMark

    s = Store(CassandraSettings(keyspace=KEYSPACE), retention_s=3600, commit_group_size=4)
    await s.connect()
    try:
        now = now_ms()
        ids = [f"many-{i}" for i in range(11)]  # 3 groups of 4, 4 and 3 marks
        for sid in ids:
            await s.put_schedule(schedule(sid, now), now_ms=now)
        marks = [FiredMark("acme", sid, f"trig-{sid}", now + i, now) for i, sid in enumerate(ids)]
        assert await s.mark_fired_many(marks) == [None] * len(ids)
        for i, sid in enumerate(ids):
            got = await s.get_schedule("acme", sid)
            assert got is not None
            assert (got["state"], got["fired_ms"], got["trigger_id"]) == (
                "fired",
                now + i,
                f"trig-{sid}",
            )
            [event] = await s.list_events("acme", sid)
            assert (event["event"], event["trigger_id"], event["due_ms"]) == (
                "fired",
                f"trig-{sid}",
                now,
            )
    finally:
        await s.close()


async def test_record_delivery(store: Store) -> None:
    now = now_ms()
    await store.put_schedule(schedule("deliver", now), now_ms=now)
    await store.record_delivery(
        "acme", "deliver", outcome="delivered", status_code=204, attempts=2, at_ms=now + 9
    )
    got = await store.get_schedule("acme", "deliver")
    assert got is not None
    assert (got["delivery_outcome"], got["delivery_status_code"], got["delivery_attempts"]) == (
        "delivered",
        204,
        2,
    )
    assert [e["event"] for e in await store.list_events("acme", "deliver")] == ["delivered"]


async def test_record_deliveries_many_groups_outcomes_and_records_each(cql_session: Any) -> None:
    from streams.model import DeliveryMark
    from topics.models import DeliveryOutcome

    s = Store(CassandraSettings(keyspace=KEYSPACE), retention_s=3600, commit_group_size=4)
    await s.connect()
    try:
        now = now_ms()
        ids = [f"delivered-{i}" for i in range(10)]  # 3 groups of 4, 4 and 2 outcomes
        for sid in ids:
            await s.put_schedule(schedule(sid, now), now_ms=now)
        marks = [
            DeliveryMark(
                tenant="acme",
                schedule_id=sid,
                outcome=DeliveryOutcome.DEAD_LETTERED if i == 3 else DeliveryOutcome.DELIVERED,
                status_code=None if i == 3 else 200 + i,
                attempts=i + 1,
                at_ms=now + i,
                trigger_id=f"trig-{sid}",
                due_ms=now,
                detail=f"detail {i}",
            )
            for i, sid in enumerate(ids)
        ]
        assert await s.record_deliveries_many(marks) == [None] * len(ids)
        for i, sid in enumerate(ids):
            got = await s.get_schedule("acme", sid)
            assert got is not None
            outcome = "dead_lettered" if i == 3 else "delivered"
            status = None if i == 3 else 200 + i
            assert (
                got["delivery_outcome"],
                got["delivery_status_code"],
                got["delivery_attempts"],
            ) == (outcome, status, i + 1)
            [event] = await s.list_events("acme", sid)
            assert (event["event"], event["trigger_id"], event["due_ms"], event["detail"]) == (
                outcome,
                f"trig-{sid}",
                now,
                f"detail {i}",
            )
    finally:
        await s.close()


async def test_tenants(store: Store) -> None:
    assert await store.get_tenant("nobody") is None
    await store.put_tenant("acme", active=True, created_ms=T0, config='{"max": 1}')
    await store.put_tenant("globex", active=False, created_ms=T0 + 1)
    got = await store.get_tenant("acme")
    assert got == {
        "tenant": "acme",
        "active": True,
        "created_ms": T0,
        "config": '{"max": 1}',
        "signing_secret": None,
        "updated_ms": None,
        "previous_signing_secret": None,
        "previous_signing_expires_ms": None,
        "retired_signing_secret": None,
        "signing_rotated_ms": None,
    }
    names = {t["tenant"] for t in await store.list_tenants()}
    assert {"acme", "globex"} <= names


async def test_signing_key_rotation_is_conditional(store: Store) -> None:
    await store.put_tenant("rotor", active=True, created_ms=T0, signing_secret="k1")
    assert await store.rotate_signing_key(
        "rotor",
        expected_current="k1",
        new_secret="k2",
        previous_expires_ms=None,
        retired=None,
        now_ms=T0,
    )
    # A second rotation that read the key before the first one applied loses, no key lost.
    assert not await store.rotate_signing_key(
        "rotor",
        expected_current="k1",
        new_secret="k3",
        previous_expires_ms=None,
        retired=None,
        now_ms=T0,
    )
    got = await store.get_tenant("rotor")
    assert got is not None
    assert (got["signing_secret"], got["previous_signing_secret"]) == ("k2", "k1")
    assert not await store.retire_previous_signing_key("rotor", previous="k0", at_ms=T0)
    assert await store.retire_previous_signing_key("rotor", previous="k1", at_ms=T0 + 5)
    got = await store.get_tenant("rotor")
    assert got is not None and got["previous_signing_expires_ms"] == T0 + 5


async def test_many_concurrent_writes_under_a_small_cap(cql_session: Any) -> None:
    s = Store(CassandraSettings(keyspace=KEYSPACE), max_in_flight=4)
    await s.connect()
    try:
        now = now_ms()
        minute = T0 + 40 * BUCKET_MS
        rows = [
            BucketRow.for_schedule(schedule(f"c-{i}", minute + i, partition=4), shards=1)
            for i in range(300)
        ]
        await asyncio.gather(*(s.put_bucket_row(r, now_ms=now) for r in rows))
        assert len(await s.read_bucket(4, minute, 1)) == 300
    finally:
        await s.close()


async def test_errors_are_store_errors(cql_session: Any) -> None:
    # A keyspace without the tables: preparing fails, and retrying cannot help.
    missing = Store(CassandraSettings(keyspace="tocsin_no_such_keyspace"))
    with pytest.raises(StoreError) as info:
        await missing.connect()
    assert not info.value.retriable
    # Nobody listening: NoHostAvailable, which is worth retrying.
    nowhere = Store(CassandraSettings(port=1, request_timeout_s=2.0))
    with pytest.raises(StoreError) as info:
        await nowhere.connect()
    assert info.value.retriable


def test_partitioner_matches_a_real_murmur2_random_producer() -> None:
    """Produce keyed records with librdkafka's murmur2_random partitioner and compare the
    partition each landed on with streams.partitioner."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    kafka = KafkaSettings()
    admin = AdminClient(kafka.librdkafka())
    topic = f"test.{uuid.uuid4().hex[:8]}.partitioner"
    partitions = 12
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=30)
    except KafkaException as exc:
        _unavailable("kafka", exc)
    try:
        producer = Producer({**kafka.librdkafka(), "partitioner": "murmur2_random"})
        landed: dict[str, int] = {}

        def on_delivery(err: Any, msg: Any) -> None:
            assert err is None, err
            landed[msg.key().decode()] = msg.partition()

        keys = [f"sched-{i}" for i in range(200)] + ["", "a", "ab", "abc", "ordér-42", "x" * 300]
        for key in keys:
            producer.produce(topic, key=key.encode(), value=b"v", on_delivery=on_delivery)
        assert producer.flush(30) == 0
        assert landed == {key: partition_for(key, partitions) for key in keys}
        assert len(set(landed.values())) == partitions
    finally:
        admin.delete_topics([topic], operation_timeout=30)[topic].result(timeout=30)


async def test_write_buckets_batches_per_bucket_and_chunks(cql_session: Any) -> None:
    # A tiny byte budget forces several chunks per bucket partition.
    s = Store(CassandraSettings(keyspace=KEYSPACE), max_batch_bytes=2_000)
    await s.connect()
    try:
        now = now_ms()
        minute = T0 + 50 * BUCKET_MS
        rows = [
            BucketRow.for_schedule(
                schedule(f"w-{i}", minute + (i % 3) * BUCKET_MS + i, partition=5), shards=2
            )
            for i in range(90)
        ]
        await s.write_buckets(put=rows, now_ms=now)
        for m in range(3):
            got = await s.read_bucket(5, minute + m * BUCKET_MS, 2)
            assert sorted(r.schedule_id for r in got) == sorted(
                r.schedule_id for r in rows if r.minute_ms == minute + m * BUCKET_MS
            )
        gone = rows[::2]
        await s.write_buckets(delete=[r.key for r in gone], now_ms=now)
        left = [r for m in range(3) for r in await s.read_bucket(5, minute + m * BUCKET_MS, 2)]
        assert {r.schedule_id for r in left} == {r.schedule_id for r in rows[1::2]}
    finally:
        await s.close()


@pytest.fixture(params=[1, 10], ids=["per-schedule", "grouped"])
async def bulk_store(request: pytest.FixtureRequest, cql_session: Any) -> AsyncIterator[Store]:
    s = Store(CassandraSettings(keyspace=KEYSPACE), commit_group_size=request.param)
    await s.connect()
    yield s
    await s.close()


async def test_apply_schedule_changes_in_bulk_keeps_per_schedule_order(bulk_store: Store) -> None:
    from streams.model import ScheduleChange

    store = bulk_store
    now = now_ms()
    partition = 7 + store.commit_group_size  # separate buckets per parametrization
    due = now + 400_000
    changes = []
    for i in range(30):
        row = schedule(f"bulk{partition}-{i}", due + i, partition=partition)
        changes.append(
            ScheduleChange(
                row=row,
                new_bucket=BucketRow.for_schedule(row, shards=1),
                old_bucket=None,
                now_ms=now,
                event="created",
            )
        )
    # The same command batch also cancels bulk-0, then re-creates it one minute later.
    first = changes[0]
    cancelled = dataclasses.replace(first.row, state="cancelled", version=2)
    recreated = dataclasses.replace(first.row, version=3, due_ms=due + BUCKET_MS)
    changes.append(
        ScheduleChange(
            row=cancelled,
            new_bucket=None,
            old_bucket=first.new_bucket.key if first.new_bucket else None,
            now_ms=now + 1,
            event="cancelled",
        )
    )
    changes.append(
        ScheduleChange(
            row=recreated,
            new_bucket=BucketRow.for_schedule(recreated, shards=1),
            old_bucket=None,
            now_ms=now + 2,
            event="created",
        )
    )
    await store.apply_schedule_changes(changes)
    in_minute = await store.read_bucket(partition, minute_ms(due), 1)
    next_minute = await store.read_bucket(partition, minute_ms(due + BUCKET_MS), 1)
    all_ids = {r.schedule_id for r in in_minute + next_minute if r.due_ms >= due}
    assert all_ids == {f"bulk{partition}-{i}" for i in range(30)}
    [again] = [r for r in in_minute + next_minute if r.schedule_id == f"bulk{partition}-0"]
    assert (again.version, again.due_ms) == (3, due + BUCKET_MS)
    got = await store.get_schedule("acme", f"bulk{partition}-0")
    assert got is not None and (got["version"], got["state"]) == (3, "scheduled")
    events = await store.list_events("acme", f"bulk{partition}-0")
    assert [e["event"] for e in events] == ["created", "cancelled", "created"]
    assert [e["event"] for e in await store.list_events("acme", f"bulk{partition}-7")] == [
        "created"
    ]


async def test_changes_of_different_record_times_share_their_bucket_batch(
    cql_session: Any,
) -> None:
    """Commands arriving one by one (through the API) carry as many record timestamps as
    commands; their bucket rows still go one batch per bucket partition, each row with the
    TTL of its own time."""
    from streams.model import ScheduleChange

    store = Store(CassandraSettings(keyspace=KEYSPACE))
    await store.connect()
    requests: list[str] = []
    execute = store._execute

    async def counting(statement: Any, name: str) -> list[dict[str, Any]]:
        requests.append(name)
        return await execute(statement, name)

    store._execute = counting  # type: ignore[method-assign]
    try:
        now = now_ms()
        partition, due = 30, T0 + 70 * BUCKET_MS
        changes = []
        for i in range(40):
            row = schedule(f"times-{i}", due, partition=partition)
            changes.append(
                ScheduleChange(
                    row=row,
                    new_bucket=BucketRow.for_schedule(row, shards=1),
                    old_bucket=None,
                    now_ms=now - 1000 * i,
                    event="created",  # 40 different record times
                )
            )
        await store.apply_schedule_changes(changes)
        # One bucket partition: one bucket request (the rest are schedule-row commits).
        assert requests.count("write_buckets") + requests.count("put_bucket") == 1, requests
        got = await store.read_bucket(partition, minute_ms(due), 1)
        assert {r.schedule_id for r in got} == {f"times-{i}" for i in range(40)}
        ttls = {
            r.schedule_id: r.ttl
            for r in cql_session.execute(
                f"SELECT schedule_id, TTL(version) AS ttl FROM {KEYSPACE}.buckets "
                "WHERE partition = %s AND minute_ms = %s AND shard = 0",
                (partition, minute_ms(due)),
            )
        }
        # Row i was "written 1000*i ms earlier" for the same due time, so it must live i
        # seconds longer than row 0: each row's TTL counts from its own record time.
        for i in range(1, 40):
            assert ttls[f"times-{i}"] - ttls["times-0"] == i, (i, ttls)
    finally:
        await store.close()


async def test_before_commit_is_durable_before_any_schedule_row(cql_session: Any) -> None:
    """The command agent's listing index rides along with the bucket step: it must be done
    before the commit point, and its failure must leave no schedule row."""
    from streams.model import ScheduleChange

    store = Store(CassandraSettings(keyspace=KEYSPACE))
    await store.connect()
    try:

        def change(sid: str) -> ScheduleChange:
            row = schedule(sid, T0 + 80 * BUCKET_MS, partition=31)
            return ScheduleChange(
                row=row,
                new_bucket=BucketRow.for_schedule(row, shards=1),
                old_bucket=None,
                now_ms=now_ms(),
                event="created",
            )

        seen_during: list[object] = []

        async def slow_index() -> None:
            await asyncio.sleep(0.5)  # however long it takes, the commit waits for it
            seen_during.append(await store.get_schedule("acme", "before-1"))

        await store.apply_schedule_changes([change("before-1")], before_commit=slow_index)
        assert seen_during == [None]
        assert await store.get_schedule("acme", "before-1") is not None

        async def failing_index() -> None:
            raise StoreError("index write failed", retriable=True)

        with pytest.raises(StoreError):
            await store.apply_schedule_changes([change("before-2")], before_commit=failing_index)
        assert await store.get_schedule("acme", "before-2") is None
    finally:
        await store.close()


async def test_recurring_due_queue_on_real_cassandra(store: Store) -> None:
    """The materialiser's due queue (migration 007): range reads within a minute partition,
    deleting read minutes, the reader's saved position, the first-start scan of keyed
    parents (a filtering scan, no index) and reading parents back by id."""
    from streams.decisions import DueEntry, materialize_key
    from streams.recurring import NEVER_MS
    from streams.recurring_store import RecurringStore

    rs = RecurringStore(store)
    part = 5
    minute = (now_ms() // 60_000 + 1) * 60_000
    await rs.put_due(
        [
            DueEntry(part, minute + 10, "acme", "b"),
            DueEntry(part, minute + 5, "acme", "a"),
            DueEntry(part, minute + 59_999, "acme", "c"),
            DueEntry(part, minute + 60_000, "acme", "next-minute"),
        ]
    )
    assert await rs.read_due(part, minute, minute - 1, minute + 10) == [
        ("acme", "a"),
        ("acme", "b"),
    ]
    assert await rs.read_due(part, minute, minute + 10, minute + 59_999) == [("acme", "c")]
    assert await rs.read_due(part, minute + 60_000, minute, minute + 120_000) == [
        ("acme", "next-minute")
    ]
    await rs.drop_due(part, [minute])
    assert await rs.read_due(part, minute, 0, minute + 60_000) == []
    assert await rs.get_cursor(part) is None
    await rs.set_cursor(part, minute, minute + 10, now_ms())
    assert await rs.get_cursor(part) == (minute, minute + 10)

    # Parents keyed before the queue existed are found by the first-start scan.
    keyed = [
        schedule(
            f"keyed-{i}",
            minute,
            recurrence='{"every_s": 60}',
            materialize_key=materialize_key(partition_for(f"keyed-{i}", 8), minute - 1000),
        )
        for i in range(20)
    ]
    target = keyed[0].partition
    # Done with (cancelled, or every run written): no key, never found.
    never = schedule(
        "keyed-never",
        minute,
        partition=target,
        recurrence='{"every_s": 60}',
        materialize_key=materialize_key(target, NEVER_MS),
    )
    for row in [*keyed, never]:
        await store.put_schedule(row, now_ms=now_ms())
    found = {r.schedule_id for r in await rs.keyed_parents(target)}
    assert found == {r.schedule_id for r in keyed if r.partition == target}
    back = await rs.get_parents(target, [("acme", s) for s in sorted(found)])
    assert [r.schedule_id for r in back] == sorted(found)
    # Another partition's parent, or none at all, is not returned.
    other = next(r for r in keyed if r.partition != target)
    assert await rs.get_parents(target, [("acme", other.schedule_id), ("acme", "no-such")]) == []


async def test_commit_groups_of_large_rows_stay_under_the_stock_batch_limit(
    cql_session: Any,
) -> None:
    """16 schedules of 32 KiB payload in one call: grouped 16 per batch they would be 512 KiB,
    ten times Cassandra's stock batch_size_fail_threshold (the local stack runs with it)."""
    from streams.model import ScheduleChange

    s = Store(CassandraSettings(keyspace=KEYSPACE), commit_group_size=16)
    await s.connect()
    try:
        now = now_ms()
        partition = 40
        changes = []
        for i in range(16):
            row = schedule(
                f"large-{i}", now + 500_000 + i, partition=partition, payload=b"x" * (32 * 1024)
            )
            changes.append(
                ScheduleChange(
                    row=row,
                    new_bucket=BucketRow.for_schedule(row, shards=1),
                    old_bucket=None,
                    now_ms=now,
                    event="created",
                )
            )
        # A row over the limit on its own is written alone (a single-partition batch).
        huge = schedule("huge-0", now + 500_000, partition=partition, payload=b"y" * 60_000)
        changes.append(
            ScheduleChange(
                row=huge,
                new_bucket=BucketRow.for_schedule(huge, shards=1),
                old_bucket=None,
                now_ms=now,
                event="created",
            )
        )
        await s.apply_schedule_changes(changes)
        for change in changes:
            got = await s.get_schedule("acme", change.row.schedule_id)
            assert got is not None and got["payload"] == change.row.payload
    finally:
        await s.close()


def _mark(sid: str, kind: str, at_ms: int, code: int, trigger: str) -> Any:
    """The store's record of a proxy outcome, ordered by its own time as the worker orders
    it (streams.deliveries)."""
    from streams.deliveries import outcome_order_us
    from streams.model import DeliveryMark
    from topics.models import DeliveryOutcome

    return DeliveryMark(
        tenant="acme",
        schedule_id=sid,
        outcome=DeliveryOutcome(kind),
        status_code=code,
        attempts=1,
        at_ms=at_ms,
        trigger_id=trigger,
        due_ms=at_ms - 100,
        order_us=outcome_order_us(at_ms, kind, code, 1, trigger, now_ms=now_ms()),
    )


def _delivery(row: dict[str, Any] | None) -> tuple[Any, ...]:
    assert row is not None
    return (row["delivery_outcome"], row["delivery_status_code"], row["delivery_ms"])


async def test_an_older_outcome_written_after_a_newer_one_does_not_replace_it(
    store: Store,
) -> None:
    """A revoked worker's write of a schedule's older outcome, retried through a Cassandra
    failure, lands after the next owner's write of the newer one: alone and grouped."""
    now = now_ms()
    newer = _mark("late-older", "delivered", now, 200, "t2")
    older = _mark("late-older", "dead_lettered", now - 60_000, 503, "t1")
    await store.put_schedule(schedule("late-older", now - 120_000), now_ms=now)

    assert await store.record_deliveries_many([newer]) == [None]
    await store.record_delivery(
        "acme",
        "late-older",
        outcome=older.outcome,
        status_code=older.status_code,
        attempts=older.attempts,
        at_ms=older.at_ms,
        order_us=older.order_us,
    )
    assert _delivery(await store.get_schedule("acme", "late-older")) == ("delivered", 200, now)
    assert await store.record_deliveries_many([older]) == [None]
    assert _delivery(await store.get_schedule("acme", "late-older")) == ("delivered", 200, now)
    # Both are in the history (the older written twice: one event); the status is the later.
    events = [e["event"] for e in await store.list_events("acme", "late-older")]
    assert sorted(events) == ["dead_lettered", "delivered"]


async def test_a_whole_row_written_after_an_outcome_does_not_put_back_the_one_it_read(
    store: Store,
) -> None:
    """A command (or the materialiser) reads the row, a newer outcome is recorded, then the
    row read is written back whole: the outcome it copied does not replace the newer."""
    now = now_ms()
    await store.put_schedule(schedule("stale-copy", now - 120_000), now_ms=now)
    assert await store.record_deliveries_many(
        [_mark("stale-copy", "dead_lettered", now - 60_000, 503, "t1")]
    ) == [None]
    read = await store.get_schedule("acme", "stale-copy")
    assert read is not None and read["delivery_outcome"] == "dead_lettered"

    assert await store.record_deliveries_many(
        [_mark("stale-copy", "delivered", now, 200, "t2")]
    ) == [None]
    await store.put_schedule(ScheduleRow(**{**read, "version": 2}), now_ms=now_ms())

    got = await store.get_schedule("acme", "stale-copy")
    assert got is not None and got["version"] == 2
    assert _delivery(got) == ("delivered", 200, now)


async def test_a_later_outcome_without_a_status_code_does_not_show_an_older_ones(
    store: Store,
) -> None:
    """A dead letter with no HTTP response (timeouts, refused connections: no status code)
    after a delivered run, or before an older delivered outcome that lands later: the
    status is the dead letter's, with no status code, never the delivered run's 200."""
    now = now_ms()
    await store.put_schedule(schedule("no-code", now - 120_000), now_ms=now)
    await store.put_schedule(schedule("no-code-late", now - 120_000), now_ms=now)
    delivered = _mark("no-code", "delivered", now - 60_000, 200, "t1")
    dead = dataclasses.replace(_mark("no-code", "dead_lettered", now, 0, "t2"), status_code=None)

    assert await store.record_deliveries_many([delivered]) == [None]
    assert await store.record_deliveries_many([dead]) == [None]
    assert _delivery(await store.get_schedule("acme", "no-code")) == ("dead_lettered", None, now)

    assert await store.record_deliveries_many(
        [dataclasses.replace(dead, schedule_id="no-code-late")]
    ) == [None]
    assert await store.record_deliveries_many(
        [dataclasses.replace(delivered, schedule_id="no-code-late")]
    ) == [None]
    got = await store.get_schedule("acme", "no-code-late")
    assert _delivery(got) == ("dead_lettered", None, now)


async def test_delivery_cells_outliving_their_row_are_no_schedule(store: Store) -> None:
    """A schedule's delivery cells live a retention from the outcome, its other cells a
    retention from its fire: an outcome after the fire (retries) leaves, once the rest
    expired, a row holding only them. Read as a schedule (state None), a create of that id
    was refused ``conflict`` ("already exists (state None)"), a GET showed it. Here the
    outcome is written with no row, which leaves the same cells."""
    from streams.store import load_schedule_rows

    now = now_ms()
    assert await store.record_deliveries_many(
        [_mark("expired-row", "dead_lettered", now, 503, "t1")]
    ) == [None]
    assert await store.get_schedule("acme", "expired-row") is None
    assert await store.get_schedules("acme", ["expired-row"]) == {}
    assert await load_schedule_rows(store, [("acme", "expired-row")]) == {}


async def test_a_schedule_created_again_does_not_show_its_predecessors_outcome(
    store: Store,
) -> None:
    """A schedule created under the id of an expired one whose delivery cells outlive it
    (the test above): the new schedule has had no delivery, whatever those cells say."""
    now = now_ms()
    assert await store.record_deliveries_many(
        [_mark("again", "dead_lettered", now - 600_000, 503, "t-old")]
    ) == [None]
    fresh = dataclasses.replace(schedule("again", now + 60_000), created_ms=now, updated_ms=now)
    await store.put_schedule(fresh, now_ms=now)
    got = await store.get_schedule("acme", "again")
    assert got is not None and got["state"] == "scheduled"
    assert _delivery(got) == (None, None, None)
    assert _delivery((await store.get_schedules("acme", ["again"]))["again"]) == (None, None, None)

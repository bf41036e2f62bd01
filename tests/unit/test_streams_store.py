"""The pure parts of streams.store: error translation, row mapping, TTL choice, settings
checks. (Cassandra round trips are in tests/integration/test_store.py.)"""

from __future__ import annotations

import pytest
from cassandra import InvalidRequest, OperationTimedOut, Unavailable, WriteTimeout
from cassandra.cluster import NoHostAvailable

from base.errors import StoreError
from base.settings import CassandraSettings
from streams.buckets import BucketKey, shard_of
from streams.cql import translate_error
from streams.model import BucketRow, ScheduleRow
from streams.store import Store

T0 = 1_763_744_400_000


@pytest.mark.parametrize(
    ("exc", "retriable"),
    [
        (OperationTimedOut("slow"), True),
        (NoHostAvailable("none", {}), True),
        (Unavailable("down"), True),
        (WriteTimeout("late", write_type=0), True),
        (InvalidRequest("bad cql"), False),
        (ValueError("bug"), False),
    ],
)
def test_translate_error(exc: Exception, retriable: bool) -> None:
    err = translate_error(exc, "put_bucket")
    assert isinstance(err, StoreError)
    assert err.retriable is retriable
    assert "put_bucket" in str(err)


def schedule(**overrides: object) -> ScheduleRow:
    values: dict[str, object] = {
        "tenant": "acme",
        "schedule_id": "order-42",
        "partition": 5,
        "state": "scheduled",
        "due_ms": T0 + 61_500,
        "version": 3,
        "created_ms": T0,
        "updated_ms": T0,
        "order_key": "customer-7",
        "payload": b"{}",
        "payload_type": "json",
        "callback": '{"type":"kafka","topic":"t"}',
        "misfire_tolerance_s": 60,
    }
    values.update(overrides)
    return ScheduleRow(**values)  # type: ignore[arg-type]


def test_bucket_row_for_schedule_copies_what_a_fire_needs() -> None:
    row = BucketRow.for_schedule(schedule(), shards=4)
    assert row.key == BucketKey.of(
        partition=5, due_ms=T0 + 61_500, tenant="acme", schedule_id="order-42", shards=4
    )
    assert row.shard == shard_of("acme", "order-42", 4)
    assert (row.version, row.order_key, row.payload, row.misfire_tolerance_s) == (
        3,
        "customer-7",
        b"{}",
        60,
    )


def test_schedule_ttl_depends_on_state() -> None:
    store = Store(CassandraSettings(), retention_s=5000)
    assert store.schedule_ttl_s(schedule(), T0) == 62 + 5000  # due + retention, rounded up
    for state in ("cancelled", "fired", "missed"):
        assert store.schedule_ttl_s(schedule(state=state), T0) == 5000


@pytest.mark.parametrize("keyspace", ["tocsin; DROP", "1abc", "", "a-b"])
def test_keyspace_must_be_an_identifier(keyspace: str) -> None:
    with pytest.raises(StoreError) as info:
        Store(CassandraSettings(keyspace=keyspace))
    assert not info.value.retriable


async def test_unconnected_store_raises_store_error() -> None:
    store = Store(CassandraSettings())
    with pytest.raises(StoreError):
        await store.get_schedule("t", "s")

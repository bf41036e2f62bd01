"""One keyspace, one deployment (streams.binding): the rule, and its edge with a fake store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from base.errors import ConfigError, StoreError
from base.settings import Settings
from streams.binding import Deployment, bind_keyspace, binding_conflict, deployment_of
from streams.buckets import BUCKET_MS
from tests.fakes import FakeStore

MINE = Deployment(topic_prefix="tocsin.", command_partitions=8)


def test_the_same_deployment_may_run() -> None:
    assert binding_conflict(MINE, MINE, "tocsin") is None


def test_another_prefix_is_refused_and_named() -> None:
    bound = Deployment(topic_prefix="tocsin2.", command_partitions=8)
    why = binding_conflict(bound, MINE, "tocsin")
    assert why is not None
    assert "'tocsin2.'" in why and "'tocsin.'" in why and "'tocsin'" in why
    assert "TOCSIN_CASSANDRA_KEYSPACE" in why


def test_another_partition_count_is_refused() -> None:
    bound = Deployment(topic_prefix="tocsin.", command_partitions=4)
    why = binding_conflict(bound, MINE, "tocsin")
    assert why is not None and "4 commands partitions, not 8" in why


def test_deployment_of_settings() -> None:
    s = Settings.from_env({"TOCSIN_TOPIC_PREFIX": "x.", "TOCSIN_COMMAND_PARTITIONS": "3"})
    assert deployment_of(s) == Deployment(topic_prefix="x.", command_partitions=3)


def failing(times: int, *, retriable: bool = True) -> FakeStore:
    """The fake whose first ``times`` binds fail."""
    store = FakeStore()
    error = StoreError("cassandra unavailable", retriable=retriable)
    store.inject("bind_deployment", error, times=times)
    return store


async def test_an_unbound_keyspace_is_bound_to_the_first_deployment() -> None:
    store = FakeStore()
    await bind_keyspace(store, MINE, "tocsin", owner="w1", now_ms=1)
    assert store.deployment == MINE
    await bind_keyspace(store, MINE, "tocsin", owner="w2", now_ms=2)  # its peers may run
    other = Deployment(topic_prefix="tocsin2.", command_partitions=8)
    with pytest.raises(ConfigError, match=r"belongs to topic prefix 'tocsin\.'"):
        await bind_keyspace(store, other, "tocsin", owner="w3", now_ms=3)
    assert store.deployment == MINE  # the refused one changed nothing


async def test_an_unavailable_store_is_waited_for_a_broken_one_is_not() -> None:
    store = failing(2)
    await bind_keyspace(store, MINE, "tocsin", owner="w", now_ms=1, retry_s=0)
    assert store.count("bind_deployment") == 3 and store.deployment == MINE
    broken = failing(1, retriable=False)  # e.g. migration 004 not applied
    with pytest.raises(StoreError):
        await bind_keyspace(broken, MINE, "tocsin", owner="w", now_ms=1, retry_s=0)
    assert broken.deployment is None


async def test_a_keyspace_bound_with_another_bucket_width_is_refused() -> None:
    # Its buckets hold rows floored to 30 s: this worker would read them at the wrong
    # instants (every other bucket is one nobody wrote).
    store = FakeStore(deployment=replace(MINE, bucket_ms=30_000))
    with pytest.raises(ConfigError, match="30000 ms buckets, not 60000"):
        await bind_keyspace(store, MINE, "tocsin", owner="w", now_ms=1)


def test_a_binding_row_without_a_width_reads_as_the_60_s_width() -> None:
    old = {"topic_prefix": "tocsin.", "command_partitions": 8}
    assert Deployment.from_row(old) == Deployment(
        topic_prefix="tocsin.", command_partitions=8, bucket_ms=60_000
    )
    assert Deployment.from_row({**old, "bucket_ms": 30_000}).bucket_ms == 30_000


def test_deployment_of_settings_records_the_bucket_width() -> None:
    assert deployment_of(Settings.from_env({})).bucket_ms == BUCKET_MS

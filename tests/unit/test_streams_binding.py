"""One keyspace, one deployment (streams.binding): the rule, and its edge with a fake store."""

from __future__ import annotations

import pytest

from base.errors import ConfigError, StoreError
from base.settings import Settings
from streams.binding import Deployment, bind_keyspace, binding_conflict, deployment_of

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


class FakeStore:
    """``deployment`` row semantics: the first bind wins (IF NOT EXISTS)."""

    def __init__(self, bound: Deployment | None = None, failures: int = 0,
                 retriable: bool = True) -> None:
        self.bound = bound
        self.failures = failures
        self.retriable = retriable
        self.calls = 0

    async def connect(self) -> None:
        pass

    async def bind_deployment(self, deployment: Deployment, *, owner: str,
                              now_ms: int) -> Deployment:
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise StoreError("cassandra unavailable", retriable=self.retriable)
        if self.bound is None:
            self.bound = deployment
        return self.bound


async def test_an_unbound_keyspace_is_bound_to_the_first_deployment() -> None:
    store = FakeStore()
    await bind_keyspace(store, MINE, "tocsin", owner="w1", now_ms=1)
    assert store.bound == MINE
    await bind_keyspace(store, MINE, "tocsin", owner="w2", now_ms=2)  # its peers may run
    other = Deployment(topic_prefix="tocsin2.", command_partitions=8)
    with pytest.raises(ConfigError, match=r"belongs to topic prefix 'tocsin\.'"):
        await bind_keyspace(store, other, "tocsin", owner="w3", now_ms=3)
    assert store.bound == MINE  # the refused one changed nothing


async def test_an_unavailable_store_is_waited_for_a_broken_one_is_not() -> None:
    store = FakeStore(failures=2)
    await bind_keyspace(store, MINE, "tocsin", owner="w", now_ms=1, retry_s=0)
    assert store.calls == 3 and store.bound == MINE
    broken = FakeStore(failures=1, retriable=False)  # e.g. migration 004 not applied
    with pytest.raises(StoreError):
        await bind_keyspace(broken, MINE, "tocsin", owner="w", now_ms=1, retry_s=0)
    assert broken.bound is None

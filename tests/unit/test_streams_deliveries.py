"""Delivery outcomes across Cassandra failures: waited out, never dropped (no servers)."""

from __future__ import annotations

import asyncio
from typing import Any

from base.errors import StoreError
from streams.deliveries import parse_outcome, record_outcome
from streams.tenants import TenantConfig
from tests.fakes import FakeStore

OUTCOME = {
    "outcome": "dead_lettered",
    "tenant": "acme",
    "schedule_id": "s1",
    "trigger_id": "t1",
    "dead_lettered_ms": 5,
    "attempts": 3,
    "reason": "HTTP 503",
}


class Tenants:
    def peek(self, tenant: str) -> TenantConfig | None:
        return TenantConfig()

    async def config(self, tenant: str) -> TenantConfig:
        return TenantConfig()


def failing(errors: list[StoreError]) -> FakeStore:
    """The fake whose next deliveries fail with ``errors``, in order."""
    store = FakeStore()
    for error in errors:
        store.inject("record_delivery", error)
    return store


def recorded(store: FakeStore) -> list[tuple[str, str]]:
    return [(d["schedule_id"], d["outcome"]) for d in store.deliveries]


def record(store: FakeStore, outcome: dict[str, Any]) -> tuple[bool, list[float]]:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    return asyncio.run(record_outcome(store, Tenants(), outcome, sleep=sleep)), slept


def test_an_outcome_is_recorded_once_cassandra_is_back() -> None:
    store = failing([StoreError("NoHostAvailable", retriable=True)] * 3)
    done, slept = record(store, OUTCOME)
    assert done and recorded(store) == [("s1", "dead_lettered")]
    assert slept == [0.5, 1.0, 2.0]


def test_an_outcome_refused_for_good_is_dropped_alone() -> None:
    store = failing([StoreError("InvalidRequest", retriable=False)])
    done, slept = record(store, OUTCOME)
    assert not done and recorded(store) == [] and slept == []


def test_not_an_outcome() -> None:
    assert parse_outcome(b"{nope") is None
    assert parse_outcome(b'{"outcome": "delivered", "tenant": 1, "schedule_id": "s"}') is None
    assert parse_outcome(b'{"outcome": "delivered", "tenant": "a", "schedule_id": "s"}')
    done, _ = record(failing([]), {**OUTCOME, "attempts": "many"})
    assert not done

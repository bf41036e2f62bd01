"""A batch of delivery outcomes is recorded in a few store requests, and nothing of a group
whose request failed is lost (no servers)."""

from __future__ import annotations

import asyncio
from typing import Any

from base.errors import StoreError
from streams.deliveries import record_outcomes
from streams.tenants import TenantConfig
from tests.fakes import FakeStore


class Tenants:
    def peek(self, tenant: str) -> TenantConfig | None:
        return TenantConfig()

    async def config(self, tenant: str) -> TenantConfig:
        return TenantConfig()


def delivered(i: int) -> dict[str, Any]:
    return {
        "outcome": "delivered",
        "tenant": "acme",
        "schedule_id": f"s{i}",
        "trigger_id": f"t{i}",
        "delivered_ms": 1_000 + i,
        "due_ms": 900 + i,
        "attempts": 1,
        "status_code": 200,
    }


def run(store: FakeStore, outcomes: list[dict[str, Any]]) -> list[float]:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    asyncio.run(record_outcomes(store, Tenants(), outcomes, sleep=sleep))
    return slept


def test_outcomes_share_requests_up_to_the_group_size() -> None:
    store = FakeStore(commit_group_size=16)
    run(store, [delivered(i) for i in range(40)])
    assert store.delivery_requests == [16, 16, 8]
    assert store.count("record_delivery") == 3  # one request each, not one per outcome
    assert sorted(d["schedule_id"] for d in store.deliveries) == sorted(f"s{i}" for i in range(40))
    assert [e["event"] for e in store.events] == ["delivered"] * 40
    assert store.events[0]["trigger_id"] == "t0" and store.events[0]["due_ms"] == 900


def test_a_failed_group_is_recorded_one_by_one() -> None:
    store = FakeStore(commit_group_size=16)
    store.inject("record_delivery", StoreError("timed out", retriable=True))
    slept = run(store, [delivered(i) for i in range(20)])
    # The first group's request failed: its 16 went alone, none lost or recorded twice.
    assert sorted(d["schedule_id"] for d in store.deliveries) == sorted(f"s{i}" for i in range(20))
    assert slept == []


def test_attempt_records_and_unusable_outcomes_go_alone() -> None:
    store = FakeStore(commit_group_size=16)
    attempt = {
        "kind": "attempt",
        "tenant": "acme",
        "schedule_id": "s9",
        "trigger_id": "t9",
        "emit_attempt": 1,
        "attempt": 1,
        "at_ms": 5,
        "backoff_ms": 100,
        "result": "HTTP 503",
    }
    unusable = {"outcome": "delivered", "tenant": "acme", "schedule_id": "s8", "attempts": "x"}
    run(store, [delivered(0), attempt, unusable])
    assert store.delivery_requests == [1]
    assert [d["schedule_id"] for d in store.deliveries] == ["s0"]
    assert [e["event"] for e in store.events] == ["delivered", "attempt_failed"]

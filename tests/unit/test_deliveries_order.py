"""Two final outcomes of one schedule in one batch of the deliveries topic: the later one is
the schedule's delivery status however the earlier one was recorded (no servers)."""

from __future__ import annotations

import asyncio
from typing import Any

from base.errors import StoreError
from streams.deliveries import record_outcomes
from streams.tenants import TenantConfig
from tests.fakes import FakeStore


class FlakyTenants:
    """The tenant lookup fails (a Cassandra read timing out) for the calls numbered in
    ``failing`` (from 1), and answers otherwise."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.calls = 0

    def peek(self, tenant: str) -> TenantConfig | None:
        return None

    async def config(self, tenant: str) -> TenantConfig:
        self.calls += 1
        if self.calls in self.failing:
            raise StoreError("tenant read timed out", retriable=True)
        return TenantConfig()


def outcome(kind: str, at_ms: int) -> dict[str, Any]:
    return {
        "outcome": kind,
        "tenant": "acme",
        "schedule_id": "s1",
        "trigger_id": f"t{at_ms}",
        "delivered_ms": at_ms,
        "due_ms": at_ms - 100,
        "attempts": 1,
        "status_code": 200 if kind == "delivered" else 700,
    }


def last_outcome(failing: set[int]) -> str:
    store = FakeStore(commit_group_size=16)
    # A recurring schedule's two runs, the first dead-lettered, the second delivered, in
    # the order the proxy wrote them.
    batch = [outcome("dead_lettered", 1_000), outcome("delivered", 2_000)]

    async def sleep(s: float) -> None:
        await asyncio.sleep(0)

    asyncio.run(record_outcomes(store, FlakyTenants(failing), batch, sleep=sleep))
    assert sorted(d["at_ms"] for d in store.deliveries) == [1_000, 2_000]
    return str(store.deliveries[-1]["outcome"])


def test_the_earlier_outcome_going_alone_does_not_overwrite_the_later() -> None:
    # The first outcome's tenant lookup fails: it is recorded alone, after the batch's
    # grouped writes, and its row write must not land after the second's.
    assert last_outcome({1}) == "delivered"


def test_outcomes_going_alone_are_recorded_in_order() -> None:
    # Both lookups fail in the batch pass; the first outcome's retry fails once more, so
    # recorded concurrently the second would land first.
    assert last_outcome({1, 2, 3}) == "delivered"


def test_with_no_failure_the_later_outcome_is_last() -> None:
    assert last_outcome(set()) == "delivered"

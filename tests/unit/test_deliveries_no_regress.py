"""A schedule's delivery status never goes back to an older outcome, whoever writes it and
in whatever order the writes land (no servers: the shared FakeStore keeps each delivery
cell with the greater write timestamp, as Cassandra does)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from base.errors import StoreError
from streams.deliveries import record_outcomes
from streams.tenants import TenantConfig
from tests.fakes import FakeStore

T0 = 1_795_000_000_000  # an outcome's time (ms), the proxy's clock


class Tenants:
    def peek(self, tenant: str) -> TenantConfig | None:
        return None

    async def config(self, tenant: str) -> TenantConfig:
        return TenantConfig()


def outcome(kind: str, at_ms: int, trigger: str) -> dict[str, Any]:
    return {
        "outcome": kind,
        "tenant": "acme",
        "schedule_id": "s1",
        "trigger_id": trigger,
        f"{kind}_ms": at_ms,
        "due_ms": at_ms - 100,
        "attempts": 1 if kind == "delivered" else 5,
        "status_code": 200 if kind == "delivered" else 503,
    }


@pytest.mark.xfail(strict=True, reason="H2: an older outcome written last becomes the status")
async def test_a_revoked_workers_late_write_of_an_older_outcome_does_not_become_the_status() -> (
    None
):
    """Worker A handles a deliveries batch after its partition was revoked (Faust's
    ``stream_wait_empty=False``) and waits out a Cassandra failure; meanwhile worker B, the
    partition's next owner, records the schedule's next outcome. A's write lands last."""
    store = FakeStore(commit_group_size=16)
    # A's grouped request, then its one-by-one retry, time out.
    store.inject("record_delivery", StoreError("timed out", retriable=True), times=2)
    retrying, resume = asyncio.Event(), asyncio.Event()

    async def a_sleep(s: float) -> None:
        retrying.set()
        await resume.wait()

    older = outcome("dead_lettered", T0, "t1")
    a = asyncio.ensure_future(record_outcomes(store, Tenants(), [older], sleep=a_sleep))
    await retrying.wait()
    await record_outcomes(store, Tenants(), [outcome("delivered", T0 + 60_000, "t2")])
    resume.set()
    await a

    assert [d["at_ms"] for d in store.deliveries] == [T0 + 60_000, T0]  # A's landed last
    assert store.delivery_status("acme", "s1") == {
        "delivery_outcome": "delivered",
        "delivery_status_code": 200,
        "delivery_attempts": 1,
        "delivery_ms": T0 + 60_000,
    }


@pytest.mark.xfail(strict=True, reason="H2: an older outcome written last becomes the status")
async def test_outcomes_recorded_newest_first_leave_the_newest() -> None:
    """The same with one worker: a batch holding only the older outcome recorded after the
    batch of the newer (a redelivered record, a batch read again after a restart)."""
    store = FakeStore(commit_group_size=16)
    await record_outcomes(store, Tenants(), [outcome("delivered", T0 + 60_000, "t2")])
    await record_outcomes(store, Tenants(), [outcome("dead_lettered", T0, "t1")])

    assert store.delivery_status("acme", "s1")["delivery_outcome"] == "delivered"
    assert store.delivery_status("acme", "s1")["delivery_ms"] == T0 + 60_000


async def test_outcomes_recorded_in_order_leave_the_last() -> None:
    store = FakeStore(commit_group_size=16)
    await record_outcomes(store, Tenants(), [outcome("dead_lettered", T0, "t1")])
    await record_outcomes(store, Tenants(), [outcome("delivered", T0 + 60_000, "t2")])

    assert store.delivery_status("acme", "s1")["delivery_ms"] == T0 + 60_000

"""A schedule's delivery status never goes back to an older outcome, whoever writes it and
in whatever order the writes land (no servers: the shared FakeStore keeps each delivery
cell with the greater write timestamp, as Cassandra does)."""

from __future__ import annotations

import asyncio
from typing import Any

from base.errors import StoreError
from base.settings import CassandraSettings
from streams.deliveries import MAX_OUTCOME_AHEAD_MS, outcome_order_us, record_outcomes
from streams.fire_store import DELIVERY_COLUMNS
from streams.model import ScheduleRow
from streams.store import Store
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


def test_an_outcome_is_ordered_by_its_own_time() -> None:
    def order(at_ms: int, kind: str = "delivered", trigger: str = "t1") -> int | None:
        return outcome_order_us(at_ms, kind, 200, 1, trigger, now_ms=T0)

    earlier, later = order(T0 - 1), order(T0)
    assert earlier is not None and later is not None and earlier < later
    assert later // 1000 == T0  # the microseconds only part outcomes of one millisecond
    assert order(T0) == order(T0)  # the same outcome twice: the same write
    assert order(T0, "dead_lettered") != order(T0)  # two of one ms: one wins whole
    assert order(T0, trigger="t2") != order(T0)


def test_an_outcome_without_a_time_or_dated_far_ahead_is_written_at_its_write() -> None:
    assert outcome_order_us(0, "delivered", 200, 1, "t1", now_ms=T0) is None
    ahead = T0 + MAX_OUTCOME_AHEAD_MS
    assert outcome_order_us(ahead, "delivered", 200, 1, "t1", now_ms=T0) is not None
    assert outcome_order_us(ahead + 1, "delivered", 200, 1, "t1", now_ms=T0) is None


def test_a_write_of_the_whole_row_leaves_the_delivery_outcome_alone() -> None:
    """A command or the materialiser writes a row it read before; copied at the time of its
    write, an outcome read then replaced one recorded meanwhile."""
    store = Store(CassandraSettings(), retention_s=7 * 86_400)
    row = ScheduleRow(
        tenant="acme",
        schedule_id="s1",
        partition=0,
        state="fired",
        due_ms=T0,
        version=1,
        created_ms=T0,
        updated_ms=T0,
        delivery_outcome="dead_lettered",
        delivery_status_code=503,
        delivery_attempts=5,
        delivery_ms=T0,
    )
    name, values = store.put_schedule_stmt(row, T0)
    cql = store.CQL[name]
    columns = cql[cql.index("(") + 1 : cql.index(")")].split(", ")
    assert not DELIVERY_COLUMNS & set(columns)
    assert len(values) == len(columns) + 1  # and the TTL
    assert "dead_lettered" not in values and 503 not in values

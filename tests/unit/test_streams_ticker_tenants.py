"""The ticker with tenants: fair emission within a due second, fire quotas that defer (and
never lose, nor turn into misses), the checkpoint below deferred triggers, and per-tenant
retention handed to the store. Fake edges, controlled clock."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from streams.model import BucketRow
from streams.tenants import TenantConfig
from streams.ticker import PartitionTicker, TickerConfig
from streams.timeline import Entry
from tests.unit.test_streams_ticker import FakeSink, FakeStore, settle

T = 1_000_000


class FakeTenants:
    def __init__(self, configs: dict[str, TenantConfig]) -> None:
        self.configs = configs
        self.reads: list[str] = []

    def peek(self, tenant: str) -> TenantConfig | None:
        return self.configs.get(tenant)

    async def config(self, tenant: str) -> TenantConfig:
        self.reads.append(tenant)
        return self.configs.get(tenant, TenantConfig())


def row(tenant: str, sid: str, due_ms: int = T, tolerance_s: int = 1) -> BucketRow:
    return BucketRow(
        partition=0,
        minute_ms=due_ms - due_ms % 60_000,
        shard=0,
        due_ms=due_ms,
        tenant=tenant,
        schedule_id=sid,
        version=1,
        order_key=sid,
        payload=b"{}",
        payload_type="json",
        callback='{"type":"http","url":"https://h/cb"}',
        misfire_tolerance_s=tolerance_s,
    )


def make(
    now: list[int], configs: dict[str, TenantConfig], *, emit_slice: int = 2_000
) -> tuple[PartitionTicker, FakeStore, FakeSink, FakeTenants]:
    store, sink, tenants = FakeStore(), FakeSink(), FakeTenants(configs)
    ticker = PartitionTicker(
        0,
        store=store,
        sink=sink,
        tenants=tenants,
        clock_ms=lambda: now[0],
        config=TickerConfig(
            fire_topic="fires", owner="test", emit_slice=emit_slice, mark_linger_s=0.0
        ),
    )
    ticker.fired_before_ms = 0
    return ticker, store, sink, tenants


def load(ticker: PartitionTicker, rows: list[BucketRow]) -> None:
    for r in rows:
        ticker.timeline.add(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r))
    ticker.timeline.mark_loaded(T + 60_000)


async def tick(ticker: PartitionTicker, now: int, limit: int | None = None) -> int:
    await ticker._admit_due(now)
    return ticker._emit_ready(now, limit=limit)


def ack_all(sink: FakeSink) -> None:
    for _, fut in sink.sent:
        if not fut.done():
            fut.set_result((0, 0))


def throttled(tenant: str) -> float:
    return REGISTRY.get_sample_value("tocsin_fires_throttled_total", {"tenant": tenant}) or 0.0


async def test_a_burst_does_not_delay_another_tenants_trigger_of_the_same_second() -> None:
    now = [T]
    ticker, _, sink, _ = make(now, {}, emit_slice=10)
    # Stored (and timeline) order puts every one of "aaa"'s 500 rows before "bbb"'s one.
    load(ticker, [row("aaa", f"a{i:03}") for i in range(500)] + [row("bbb", "b")])
    await tick(ticker, T, limit=10)
    first = [key for key, _ in sink.sent]
    assert len(first) == 10 and b"b" in first  # in the first slice, not after 500 of aaa's


async def test_fire_quota_defers_without_missing_and_the_checkpoint_waits() -> None:
    now = [T]
    marker = None
    ticker, store, sink, _ = make(now, {"aaa": TenantConfig(fire_quota_per_min=60)})
    before = throttled("aaa")
    marker = asyncio.create_task(ticker._mark_loop())
    try:
        # 65 due now with a 1 s misfire tolerance; the quota lets 60 out at once, then 1/s.
        load(ticker, [row("aaa", f"a{i:02}") for i in range(65)] + [row("bbb", "b")])
        assert await tick(ticker, T) == 61
        ack_all(sink)
        await settle()
        assert ticker.checkpoint_candidate(T) == T  # deferred ones are due at T, unfired
        now[0] = T + 5_000  # far beyond their 1 s tolerance: still fired, not missed
        assert await tick(ticker, now[0]) == 5
        ack_all(sink)
        await settle()
        assert store.missed == []
        assert len(store.fired) == 66 and len(set(store.fired)) == 66
        assert throttled("aaa") - before == 5
        assert ticker.checkpoint_candidate(now[0]) == now[0] + 1
    finally:
        marker.cancel()


async def test_a_trigger_late_before_it_reaches_the_queue_is_still_missed() -> None:
    now = [T + 10_000]  # e.g. the worker was down: 10 s late with a 1 s tolerance
    ticker, store, sink, _ = make(now, {"aaa": TenantConfig(fire_quota_per_min=60)})
    load(ticker, [row("aaa", "late")])
    await tick(ticker, now[0])
    await settle()
    assert sink.sent == [] and store.missed == ["late"]


async def test_a_deferred_trigger_can_still_be_cancelled() -> None:
    now = [T]
    ticker, _, sink, _ = make(now, {"aaa": TenantConfig(fire_quota_per_min=1)})
    load(ticker, [row("aaa", "first"), row("aaa", "second")])
    await tick(ticker, T)
    assert [k for k, _ in sink.sent] == [b"first"]
    ticker.withdraw("aaa", "second", version=2)  # the command agent cancelled it
    ack_all(sink)
    await tick(ticker, T + 120_000)
    assert [k for k, _ in sink.sent] == [b"first"]
    assert ticker.pacer.earliest_due_ms() is None


async def test_an_unknown_tenant_is_read_before_its_first_fire() -> None:
    now = [T]
    configs: dict[str, TenantConfig] = {}
    ticker, _, sink, tenants = make(now, configs)

    class Cold(FakeTenants):
        async def config(self, tenant: str) -> TenantConfig:
            configs[tenant] = TenantConfig(fire_quota_per_min=1)  # now cached
            return await super().config(tenant)

    ticker.tenants = cold = Cold(configs)
    load(ticker, [row("aaa", f"a{i}") for i in range(3)])
    await tick(ticker, T)
    assert cold.reads == ["aaa"]
    assert len(sink.sent) == 1  # paced from its first fire on
    assert tenants.reads == []


async def test_tenant_retention_is_passed_to_the_fire_and_miss_records() -> None:
    now = [T]
    ticker, store, sink, _ = make(now, {"aaa": TenantConfig(retention_s=77)})
    marker = asyncio.create_task(ticker._mark_loop())
    try:
        load(ticker, [row("aaa", "a"), row("bbb", "b"), row("aaa", "old", due_ms=T - 5_000)])
        await tick(ticker, T)
        ack_all(sink)
        await settle()
        assert store.missed == ["old"]
        assert store.retention == {"a": 77, "b": None, "old": 77}  # None: the global retention
    finally:
        marker.cancel()


async def test_an_unreadable_tenant_does_not_stop_emission() -> None:
    """Cassandra down and a tenant never read: its triggers still go (unpaced)."""
    now = [T]

    class Down(FakeTenants):
        async def config(self, tenant: str) -> TenantConfig:
            await asyncio.sleep(3600)  # a read that hangs until the driver's timeout
            raise AssertionError("unreachable")

    store, sink = FakeStore(), FakeSink()
    ticker = PartitionTicker(
        0,
        store=store,
        sink=sink,
        tenants=Down({}),
        clock_ms=lambda: now[0],
        config=TickerConfig(
            fire_topic="fires", owner="test", tenant_read_timeout_ms=20, mark_linger_s=0.0
        ),
    )
    ticker.fired_before_ms = 0
    load(ticker, [row("aaa", f"a{i}") for i in range(3)])
    await asyncio.wait_for(tick(ticker, T), 5)
    assert len(sink.sent) == 3

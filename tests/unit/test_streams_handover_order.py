"""A handed-over row that is already due keeps due order with its order key's other triggers:
it goes out only after the earlier-due rows of its key, whether those are still being read
from the bucket (a fresh ticker after a rebalance) or wait in the fair queue for their
tenant's fire quota (fake store and sink; the ticker is the real one)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from streams.model import BucketRow
from streams.tenants import TenantConfig
from streams.ticker import PartitionTicker, TickerConfig
from tests.unit.test_streams_handover import HeldSinkById, until
from tests.unit.test_streams_ticker import StoredCheckpoint, row
from tests.unit.test_streams_ticker_tenants import FakeTenants

M = 1_800_000_000_000  # a minute's start


def keyed(sid: str, due_ms: int, order_key: str = "K") -> BucketRow:
    return replace(row(sid, due_ms), order_key=order_key)


class SlowBuckets(StoredCheckpoint):
    """Minute ``M``'s bucket holds ``rows``; its read returns once ``gate`` is set."""

    def __init__(self, checkpoint_ms: int, rows: list[BucketRow]) -> None:
        super().__init__(checkpoint_ms)
        self.rows = rows
        self.gate = asyncio.Event()
        self.reads: list[int] = []

    async def read_bucket(self, partition: int, minute_ms: int, shards: int) -> list[BucketRow]:
        self.reads.append(minute_ms)
        await self.gate.wait()
        return [r for r in self.rows if r.minute_ms == minute_ms]


def ticker_with(
    store: StoredCheckpoint, now: list[int], tenants: FakeTenants | None = None
) -> tuple[PartitionTicker, HeldSinkById]:
    fires = HeldSinkById()  # the test decides when Kafka acknowledges a trigger
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = PartitionTicker(
        0, store=store, sink=fires, config=config, clock_ms=lambda: now[0], tenants=tenants
    )
    return ticker, fires


async def test_a_late_create_waits_for_the_bucket_read_of_its_minute() -> None:
    # After a rebalance the new ticker has read its checkpoint (5 s into the minute) but
    # its read of the minute's bucket is slow. A create of key K due at 11 s, sent during a
    # broker outage, is handed over at 30 s: it must not reach the fire topic before the
    # bucket's rows of K due at 10 s, nor after the one due at 12 s.
    now = [M + 30_000]
    store = SlowBuckets(M + 5_000, [keyed("a", M + 10_000), keyed("b", M + 12_000)])
    ticker, fires = ticker_with(store, now)
    ticker.start()
    await until(lambda: ticker.fired_before_ms is not None and store.reads == [M])
    pending = ticker.hand_over(keyed("c", M + 11_000))
    assert pending is not None  # due already: its command waits for Kafka
    await asyncio.sleep(0.02)
    store.gate.set()
    await until(lambda: len(fires.ids) == 3)
    assert fires.ids == ["a", "c", "b"]
    for sid in ("a", "b"):
        fires.ack(sid)
    await asyncio.sleep(0.01)
    assert not pending.done()  # answered only once Kafka has its own trigger
    fires.ack("c")
    await asyncio.wait_for(pending, 1)
    await ticker.stop(timeout_s=0.5)


async def test_a_late_create_does_not_overtake_its_keys_trigger_deferred_by_the_quota() -> None:
    # Tenant t may fire once a minute: "z" (another key) takes the token, so "a" of key K,
    # due at 10 s, waits in the fair queue. A late create of K due at 11 s must go out after
    # it - paced behind it - not straight to the fire topic.
    now = [M + 30_000]
    store = SlowBuckets(M + 5_000, [keyed("z", M + 9_000, "Z"), keyed("a", M + 10_000)])
    store.gate.set()
    tenants = FakeTenants({"t": TenantConfig(fire_quota_per_min=1)})
    ticker, fires = ticker_with(store, now, tenants)
    ticker.start()
    await until(lambda: fires.ids == ["z"] and len(ticker.pacer) == 1)
    pending = ticker.hand_over(keyed("c", M + 11_000))
    assert pending is not None
    await asyncio.sleep(0.05)
    assert fires.ids == ["z"]  # not ahead of "a"
    for fired in (2, 3):  # a token a minute: "a", then "c"
        now[0] += 60_000
        ticker._wake.set()
        await until(lambda: len(fires.ids) == fired)  # noqa: B023 (awaited right here)
    assert fires.ids == ["z", "a", "c"]
    assert not pending.done()
    fires.ack("c")
    await asyncio.wait_for(pending, 1)
    assert ticker.missed == 0  # the wait in the queue is not lateness
    await ticker.stop(timeout_s=0.5)

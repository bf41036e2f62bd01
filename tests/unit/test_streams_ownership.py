"""The worker's tickers across consumer-group rebalances (streams.app): a partition this
worker keeps through a rebalance keeps its ticker and what it has loaded, and nothing is
emitted while it is revoked. Driven through the Faust app's own rebalance signals, with the
shared fake store and a fake Kafka sink."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from faust.types import TP

import streams.app as worker_app
from base.errors import ConfigError
from base.settings import Settings
from streams.materializer import PartitionMaterializer
from streams.ticker import PartitionTicker, TickerConfig
from streams.timeline import Entry
from tests.fakes import FakeStore
from tests.unit.test_streams_ticker import FakeSink, row

T0 = 1_800_000_000_000  # a minute boundary: the row below is due inside one bucket


class Rig:
    """A worker whose edges are fakes, its rebalances told through Faust's signals."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = [T0 + 1_000]
        settings = Settings.from_env({"TOCSIN_STATE_DIR": str(tmp), "TOCSIN_INLINE_HANDOVER": "0"})
        self.worker = worker_app.Worker(settings)
        self.store = FakeStore(checkpoint_ms=T0)
        self.sink = FakeSink()
        w: Any = self.worker
        w.store, w.emitter, w._started = self.store, self.sink, True
        w.clock_ms = lambda: self.now[0]
        w.processor.tenants = None  # no fire quotas: nothing to read
        # Recurring schedules are not part of this: no materialiser runs.
        monkeypatch.setattr(PartitionMaterializer, "start", lambda self: None)
        # This member's generation as aiokafka would hold it at a revocation.
        self.member_generation: int | None = None
        monkeypatch.setattr(
            worker_app, "member_generation", lambda app: self.member_generation, raising=False
        )
        self.topic = self.worker.catalog.commands.name
        self.store._write_buckets([row("due-later", T0 + 8_000)], [])

    async def assign(self, partitions: set[int], generation: int) -> None:
        self.member_generation = generation
        app: Any = self.worker.app
        app.consumer_generation_id = generation
        await app.on_partitions_assigned.send({TP(self.topic, p) for p in partitions})

    async def revoke(self, partitions: set[int]) -> None:
        app: Any = self.worker.app
        await app.on_partitions_revoked.send({TP(self.topic, p) for p in partitions})

    async def ready(self, partition: int) -> PartitionTicker:
        ticker = self.worker.tickers[partition]
        await asyncio.wait_for(ticker.ready.wait(), 5)
        return ticker

    async def sent_soon(self, count: int) -> None:
        for _ in range(200):
            if len(self.sink.sent) >= count:
                return
            await asyncio.sleep(0.01)

    def checkpoints_of(self, partition: int) -> int:
        return sum(1 for c in self.store.calls_of("set_checkpoint") if c.args[0] == partition)

    async def close(self) -> None:
        await self.revoke(set(self.worker.tickers))
        await self.assign(set(), 99)


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    r = Rig(tmp_path, monkeypatch)
    yield r
    await r.close()


async def test_a_partition_assigned_back_in_the_next_generation_keeps_its_ticker(
    rig: Rig,
) -> None:
    await rig.assign({0}, generation=1)
    ticker = await rig.ready(0)
    await rig.revoke({0})
    rig.now[0] = T0 + 9_000  # the loaded row falls due while the partition is revoked
    await asyncio.sleep(0.1)
    assert rig.sink.sent == []  # another worker may have been given the partition
    await rig.assign({0}, generation=2)
    await rig.sent_soon(1)
    # The same ticker, its loaded state kept: no checkpoint or bucket read again.
    assert rig.worker.tickers[0] is ticker
    assert rig.store.count("get_checkpoint") == 1
    assert [k for k, _ in rig.sink.sent] == [b"due-later"]


async def test_a_later_generation_starts_afresh_from_the_checkpoint(rig: Rig) -> None:
    await rig.assign({0}, generation=1)
    ticker = await rig.ready(0)
    await rig.revoke({0})
    rig.now[0] = T0 + 9_000
    # Generation 2 went by without this member: someone else may have owned the partition.
    await rig.assign({0}, generation=3)
    fresh = await rig.ready(0)
    await rig.sent_soon(1)
    assert fresh is not ticker and rig.store.count("get_checkpoint") == 2
    await asyncio.sleep(0.05)
    assert [k for k, _ in rig.sink.sent] == [b"due-later"]  # once, by the fresh ticker


async def test_a_membership_lost_before_the_revocation_starts_afresh(rig: Rig) -> None:
    await rig.assign({0}, generation=1)
    ticker = await rig.ready(0)
    rig.member_generation = -1  # the coordinator no longer knew this member
    await rig.revoke({0})
    await rig.assign({0}, generation=2)
    assert await rig.ready(0) is not ticker
    assert rig.store.count("get_checkpoint") == 2


async def test_a_partition_given_to_another_worker_is_neither_fired_nor_checkpointed(
    rig: Rig,
) -> None:
    await rig.assign({0}, generation=1)
    await rig.ready(0)
    await rig.revoke({0})
    written = rig.checkpoints_of(0)
    await rig.assign({1}, generation=2)
    rig.now[0] = T0 + 9_000
    await asyncio.sleep(0.1)
    assert 0 not in rig.worker.tickers and not rig.worker.ownership.suspended
    assert all(k != b"due-later" for k, _ in rig.sink.sent)
    assert rig.checkpoints_of(0) == written


async def test_a_send_failed_while_suspended_goes_out_again_on_resume() -> None:
    now = [T0 + 1_000]
    store, sink = FakeStore(checkpoint_ms=T0), FakeSink()
    ticker = PartitionTicker(
        0,
        store=store,
        sink=sink,
        config=TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0),
        clock_ms=lambda: now[0],
    )
    ticker.start()
    await asyncio.wait_for(ticker.ready.wait(), 5)
    r = row("x", T0 + 500)
    ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    await ticker.suspend(wait_s=0.0)  # in flight, not acknowledged
    sink.sent[0][1].set_exception(RuntimeError("broker gone"))
    await asyncio.sleep(0.05)
    assert len(sink.sent) == 1  # nothing sent while suspended
    assert ticker.checkpoint_candidate(now[0]) <= r.due_ms
    ticker.resume()
    assert [k for k, _ in sink.sent] == [b"x", b"x"]
    sink.sent[1][1].set_result((0, 0))
    await ticker.stop(timeout_s=1.0)
    assert store.fired == ["x"]


def test_a_request_timeout_below_the_session_timeout_is_refused(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {
            "TOCSIN_STATE_DIR": str(tmp_path),
            "TOCSIN_SESSION_TIMEOUT_S": "10",
            "TOCSIN_WORKER_KAFKA_REQUEST_TIMEOUT_S": "5",
        }
    )
    with pytest.raises(ConfigError, match="REQUEST_TIMEOUT"):
        worker_app.Worker(settings)

"""Holes left open by the review of issue 21's worker timing changes (aba6364, 9f05aaf,
3da3300, a9b09e6). Time is a fake clock; what is asserted is what a loop plans, emits and
writes, never how long anything took."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from faust.types import EventT

from base.errors import ConfigError, StoreError
from base.settings import SchedulerSettings, Settings
from streams import materializer as materializer_module
from streams.app import Worker
from streams.materializer import MaterializerConfig, PartitionMaterializer
from tests.fakes import FakeStore
from tests.unit.test_materializer_idle import NOW, P
from tests.unit.test_streams_materializer import FakeTicker
from tests.unit.test_streams_ticker import FakeSink, row, running
from tests.unit.test_ticker_idle import PRELOAD_MS, M, entry, idle_ticker, ticker_on, until
from tests.unit.test_timing_review import Tenants


async def test_an_idle_tickers_sleep_is_capped_so_a_wall_clock_jump_is_seen() -> None:
    """A VM pause stops the monotonic clock, not the wall clock. An idle ticker asleep
    until the next minute's preload point (up to 50 s of monotonic time) read that minute
    up to 50 s after the pause ended, and rows due meanwhile with a small misfire
    tolerance were recorded missed. Its sleep is at most the preload lead."""
    now = [M + 5_000]
    store, sink = FakeStore(checkpoint_ms=M + 4_000), FakeSink()
    ticker = await running(ticker_on(store, sink, now))
    await until(lambda: ticker.asleep_until_ms is not None)
    assert ticker.asleep_until_ms is not None
    assert ticker.asleep_until_ms <= now[0] + PRELOAD_MS
    await ticker.stop(0)


async def test_a_materialisers_sleep_is_re_derived_from_the_wall_clock_at_least_every_10_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The materialiser sleeps until its next entry or its minute's end, up to a minute of
    monotonic time: after a pause the entries falling due were read up to a minute late.
    Its monotonic sleeps are at most 10 s, the wall clock read again after each."""
    now = [NOW + 5_000]
    store = FakeStore()
    asked: list[float] = []
    real_wait_for = asyncio.wait_for

    async def wait_for(aw: Awaitable[Any], timeout: float | None) -> Any:  # noqa: ASYNC109
        asked.append(timeout or 0.0)
        return await real_wait_for(aw, 0.001)

    monkeypatch.setattr(materializer_module.asyncio, "wait_for", wait_for)
    m = PartitionMaterializer(
        P, store=store, ticker=FakeTicker(), config=MaterializerConfig(), clock_ms=lambda: now[0]
    )
    m.start()
    await until(lambda: len(asked) >= 3)
    await m.stop()
    assert max(asked) <= 10.001
    assert store.count("read_due") == 1  # re-checking the clock is no pass


def test_a_recurring_horizon_too_short_for_the_materialisers_sleep_is_refused() -> None:
    """An entry another worker writes into this partition's due queue (a rebalance) is read
    at the latest at the minute's end, up to a minute late; a parent is extended when its
    runs reach a quarter horizon ahead at the earliest, so a horizon of 120 s let its next
    run fall due unwritten."""
    settings = Settings(scheduler=SchedulerSettings(recurring_horizon_s=120.0))
    with pytest.raises(ConfigError, match="TOCSIN_RECURRING_HORIZON_S"):
        Worker(settings)


async def test_the_idle_write_skip_is_sound_across_a_supervised_restart() -> None:
    """``_begin`` (a supervised restart of the loop) re-reads the stored checkpoint but keeps
    the counts the idle write skip compares. A trigger recorded before the restart, the
    stored checkpoint still below it: the write before the minute is read again matches
    the stored value and takes the count as passed, but the read holds the row again (at
    least once), so nothing is skipped until it is recorded again and a write passes it;
    then the idle writes of the minute stop."""
    now = [M + 10_000]
    ticker, store, sink = idle_ticker(now)
    marker = asyncio.create_task(ticker._mark_loop())
    fired = row("fired", M + 9_000)
    await store.write_buckets(put=[fired], now_ms=M)
    for attempt in range(2):
        if attempt:  # the loop failed before any write and was restarted: M + 1 s read back
            await ticker._begin()
            await ticker._write_checkpoint()  # (before the read: stays at M + 1 s)
            await ticker._load_due_buckets()
            assert not ticker._holds_nothing()  # the row again: no write is skipped
        else:
            ticker._hold(fired)
        ticker.timeline.pop_due(now[0], limit=10)
        ticker._dispatch(entry(fired), now[0])
        sink.sent[-1][1].set_result((0, 0))
        await until(lambda: not ticker._inflight)
        assert store.checkpoints == []
    now[0] += 1_000
    await ticker._write_checkpoint()
    assert store.checkpoint_ms is not None and store.checkpoint_ms > fired.due_ms
    written = list(store.checkpoints)
    for _ in range(5):
        now[0] += 1_000
        await ticker._write_checkpoint()
    assert store.checkpoints == written
    marker.cancel()


class OutcomeStore:
    """``record_deliveries_many`` failing with ``failures`` in turn, then recording."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.recorded: list[str] = []

    async def record_deliveries_many(self, marks: Sequence[Any]) -> list[None]:
        if self.failures:
            raise self.failures.pop(0)
        self.recorded.extend(m.schedule_id for m in marks)
        return [None] * len(marks)

    async def close(self) -> None:  # (the worker's shutdown closes its store)
        return None


def delivered(schedule_id: str) -> bytes:
    return json.dumps(
        {
            "outcome": "delivered",
            "tenant": "acme",
            "schedule_id": schedule_id,
            "trigger_id": f"t-{schedule_id}",
            "due_ms": 1_000,
            "attempts": 1,
            "status_code": 200,
            "delivered_ms": 1_100,
        }
    ).encode()


async def run_delivery_agent(
    tmp_path: Path,
    store: OutcomeStore,
    values: Sequence[bytes],
    agent_name: str = "deliveries",
    setup: Callable[[Worker], None] = lambda worker: None,
) -> tuple[Worker, dict[bytes, bool], asyncio.Future[None]]:
    """The worker's delivery agent (or another) on a real Faust stream over an in-memory
    channel; for each event acked, whether it reached the consumer's commit bookkeeping (a
    message already marked acked never does: its offset is never committed)."""
    worker = Worker(Settings.from_env({"TOCSIN_STATE_DIR": str(tmp_path)}))

    async def started() -> None:
        return None

    async def no_wait(_s: float) -> None:
        await asyncio.sleep(0)

    worker._ensure_started = started  # type: ignore[method-assign]
    worker.store = store  # type: ignore[assignment]
    worker.processor.tenants = Tenants()  # type: ignore[assignment]
    setup(worker)
    retried: Any = worker  # (its backoff's sleep)
    retried.batch_retry_sleep = no_wait
    app: Any = worker.app
    app.flow_control.resume()
    channel = app.channel()
    stream = app.stream(channel)
    committed: dict[bytes, bool] = {}
    real_ack = stream.ack

    async def ack(event: EventT[Any]) -> bool:
        committed[event.value] = not event.message.acked
        return bool(await real_ack(event))

    stream.ack = ack
    agent = asyncio.ensure_future(app.agents[agent_name].fun(stream))
    for _ in range(20):
        await asyncio.sleep(0)
    for value in values:
        await channel.send(value=value)
    return worker, committed, agent


async def stop_agent(worker: Worker, agent: asyncio.Future[None]) -> None:
    agent.cancel()
    await asyncio.gather(agent, return_exceptions=True)
    app: Any = worker.app
    await app.stop()
    consumer = app._consumer
    if consumer is not None:
        consumer._thread.thread_loop.close()


async def test_a_delivery_batch_whose_recording_fails_is_never_committed(
    tmp_path: Path,
) -> None:
    """An unexpected error recording a batch of outcomes escaped the delivery agent: Faust
    restarted the agent, and the batch's generator, closed, acked its events (ack on
    exit): their offsets were committed and the outcomes lost, silently. The batch is
    now kept out of the commit (replayed at the next start), logged, and the worker
    marked dead (/healthz 503) so that it is restarted; the agent goes on."""
    store = OutcomeStore(RuntimeError("a defect"))
    worker, committed, agent = await run_delivery_agent(tmp_path, store, [delivered("a")])
    await until(lambda: bool(committed) or agent.done())
    assert not agent.done()  # the agent goes on
    assert committed == {delivered("a"): False}
    live, why = worker.health.live()
    assert not live and "deliveries" in why
    await stop_agent(worker, agent)


async def test_a_delivery_batch_is_retried_through_a_retriable_error(tmp_path: Path) -> None:
    """A retriable error (Cassandra unavailable for a moment) that escaped the recording
    lost the batch as above; it is retried with backoff and then committed as usual."""
    store = OutcomeStore(StoreError("timeout"), StoreError("timeout"))
    worker, committed, agent = await run_delivery_agent(tmp_path, store, [delivered("b")])
    await until(lambda: bool(committed) or agent.done())
    assert not agent.done()
    assert store.recorded == ["b"]
    assert committed == {delivered("b"): True}
    assert worker.health.live()[0]
    await stop_agent(worker, agent)


async def test_a_command_batch_whose_processing_raises_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``process_until_answered`` raises nothing but cancellation by design; were anything
    to escape it (a defect), the command agent lost its batch as the delivery agent did:
    commands never answered and their offsets committed. Kept out of the commit too."""

    async def defect(batch: Sequence[Any]) -> list[Any]:
        raise RuntimeError("a defect")

    def run(worker: Worker) -> None:
        monkeypatch.setattr(worker.processor, "process_until_answered", defect)

    worker, committed, agent = await run_delivery_agent(
        tmp_path, OutcomeStore(), [b"not a command"], agent_name="commands", setup=run
    )
    await until(lambda: bool(committed) or agent.done())
    assert not agent.done()
    assert committed == {b"not a command": False}
    assert not worker.health.live()[0]
    await stop_agent(worker, agent)

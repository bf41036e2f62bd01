"""Per-key order across a failed send: a trigger whose produce failed is re-sent a second
later, and its order key's later triggers of this partition wait until Kafka has the
re-sent one, so they cannot reach the fire topic ahead of it. Fake edges, controlled
clock (the re-send's one second is real)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from base.errors import KafkaError, StoreError
from streams.model import BucketRow
from streams.ticker import PartitionTicker
from tests.fakes import FakeStore, until_true
from tests.unit.test_streams_ticker import FakeSink, settle
from tests.unit.test_streams_ticker_tenants import load, make, row, tick

T = 1_000_000


def keyed(sid: str, due_ms: int, order_key: str, *, tolerance_s: int = 60) -> BucketRow:
    return dataclasses.replace(row("t", sid, due_ms, tolerance_s), order_key=order_key)


def sent_keys(sink: FakeSink) -> list[bytes | None]:
    return [key for key, _ in sink.sent]


def acknowledge(sink: FakeSink, i: int) -> None:
    sink.sent[i][1].set_result((0, i))


def fail(sink: FakeSink, i: int) -> None:
    sink.sent[i][1].set_exception(RuntimeError("Local: Message timed out"))


def started(now: list[int]) -> tuple[PartitionTicker, FakeStore, FakeSink]:
    ticker, store, sink, _ = make(now, {})
    return ticker, store, sink


async def test_a_key_waits_for_its_failed_trigger_to_be_re_sent_and_acknowledged() -> None:
    now = [T]
    ticker, _, sink = started(now)
    load(ticker, [keyed("x", T, "k"), keyed("y", T + 500, "k"), keyed("z", T + 500, "other")])
    await tick(ticker, T)
    assert sent_keys(sink) == [b"k"]
    fail(sink, 0)  # x: re-sent a second later
    await settle()
    now[0] = T + 500
    await tick(ticker, now[0])
    # y waits behind x; z, of another key, does not.
    assert sent_keys(sink) == [b"k", b"other"]
    await until_true(lambda: len(sink.sent) == 3)  # x re-sent
    now[0] = T + 1_600
    await tick(ticker, now[0])
    assert len(sink.sent) == 3  # y still waits: Kafka does not have x yet
    assert ticker.checkpoint_candidate(now[0]) <= T
    acknowledge(sink, 2)
    await settle()
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"k", b"other", b"k", b"k"]  # y, after x


async def test_a_trigger_waiting_behind_a_failed_one_can_still_be_cancelled() -> None:
    now = [T]
    ticker, _, sink = started(now)
    load(ticker, [keyed("x", T, "k"), keyed("y", T + 500, "k")])
    await tick(ticker, T)
    fail(sink, 0)
    await settle()
    now[0] = T + 500
    await tick(ticker, now[0])
    assert ticker.may_emit("t", "y", T + 500)  # waiting, not emitted
    ticker.withdraw("t", "y", version=2)  # the command agent cancelled it
    await until_true(lambda: len(sink.sent) == 2)  # x re-sent
    acknowledge(sink, 1)
    await settle()
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"k", b"k"]  # x twice, y never


async def test_a_trigger_whose_miss_cannot_be_recorded_holds_nothing_back() -> None:
    # Cassandra down: a trigger beyond its tolerance is retried until its miss is recorded,
    # but nothing of it was sent, so its key's later triggers go on firing meanwhile.
    now = [T]
    ticker, store, sink = started(now)
    store.inject("mark_missed", StoreError("cassandra down"), times=None)
    load(ticker, [keyed("late", T - 5_000, "k", tolerance_s=1), keyed("y", T + 500, "k")])
    await tick(ticker, T)
    await settle()
    assert sent_keys(sink) == [] and store.missed == []
    now[0] = T + 500
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"k"]
    acknowledge(sink, 0)
    await settle()


class RefusingSink(FakeSink):
    """Refuses its first send before queueing it (librdkafka's local queue full)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[bytes | None] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        if not self.refused:
            self.refused.append(key)
            raise KafkaError("Local: Queue full", retriable=True)
        return super().send(topic, key=key, value=value, headers=headers)


async def test_a_send_refused_mid_slice_holds_its_keys_triggers_taken_with_it() -> None:
    now = [T]
    ticker, _, _ = started(now)
    sink = ticker.sink = RefusingSink()
    load(ticker, [keyed("x", T, "k"), keyed("y", T, "k"), keyed("z", T, "other")])
    await tick(ticker, T)  # x, y and z taken in one slice; x refused
    assert sink.refused == [b"k"] and sent_keys(sink) == [b"other"]  # y waits
    await until_true(lambda: len(sink.sent) == 2)  # x re-sent
    acknowledge(sink, 1)
    await settle()
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"other", b"k", b"k"]  # x, then y


async def test_a_trigger_a_command_waits_for_also_waits_behind_its_keys_failed_one() -> None:
    now = [T]
    ticker, _, sink = started(now)
    load(ticker, [keyed("x", T, "k"), keyed("y", T + 500, "k")])
    await tick(ticker, T)
    fail(sink, 0)
    await settle()
    # y's create is waiting for its trigger's acknowledgement (it skips the fair queue
    # when nothing of its key is queued there): it still waits behind x.
    ticker._awaited[("t", "y", T + 500)] = [asyncio.get_running_loop().create_future()]
    now[0] = T + 500
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"k"]
    await until_true(lambda: len(sink.sent) == 2)  # x re-sent
    acknowledge(sink, 1)
    await settle()
    await tick(ticker, now[0])
    assert sent_keys(sink) == [b"k", b"k", b"k"]  # x, x, then y

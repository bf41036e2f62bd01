"""The one trigger-from-row builder (streams.model.trigger_for)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streams.model import BucketRow, ScheduleRow, ScheduleState, trigger_for
from streams.ticker import PartitionTicker, TickerConfig
from streams.timeline import Entry
from tests.fakes import FakeStore
from tests.unit.test_streams_ticker import FakeSink, row, settle
from topics.ids import trigger_id
from topics.models import HttpCallback, PayloadType


def test_a_bucket_row_and_its_schedule_row_give_the_same_trigger() -> None:
    bucket = row("s1", 120_000)
    schedule = ScheduleRow(
        tenant="t",
        schedule_id="s1",
        partition=0,
        state=ScheduleState.SCHEDULED,
        due_ms=120_000,
        version=1,
        created_ms=0,
        updated_ms=0,
        order_key="s1",
        payload=b"{}",
        payload_type="json",
        callback='{"type":"http","url":"https://h/cb"}',
    )
    fired = trigger_for(bucket, emitted_ms=120_005)
    assert fired == trigger_for(schedule, emitted_ms=120_005)
    assert fired.trigger_id == trigger_id("t", "s1", 120_000)
    assert fired.payload_type == PayloadType.JSON and fired.attempt == 1
    assert fired.callback == HttpCallback(url="https://h/cb")
    again = trigger_for(schedule, emitted_ms=130_000, attempt=3)
    assert again.trigger_id == fired.trigger_id and again.attempt == 3


def test_defaults_of_a_bare_row() -> None:
    bare = replace(row("s2", 60_000), order_key=None, payload=None, payload_type=None)
    fired = trigger_for(bare, emitted_ms=60_000, trigger_id="given")
    assert (fired.order_key, fired.payload, fired.payload_type) == ("s2", b"", PayloadType.BYTES)
    assert fired.trigger_id == "given"


def test_a_row_without_a_callback_is_refused() -> None:
    with pytest.raises(ValueError, match="no callback"):
        trigger_for(replace(row("s3", 60_000), callback=None), emitted_ms=60_000)


async def test_the_ticker_records_a_row_it_cannot_build_as_missed() -> None:
    store, sink = FakeStore(), FakeSink()
    config = TickerConfig(fire_topic="fires", owner="test", mark_linger_s=0.0)
    ticker = PartitionTicker(0, store=store, sink=sink, config=config, clock_ms=lambda: 90_000)
    broken: BucketRow = replace(row("broken", 90_000), callback=None)
    assert ticker._dispatch(_entry(broken), 90_000) is None
    for _ in range(20):
        await settle()
        if store.missed:
            break
    assert store.missed == ["broken"] and sink.sent == []


def _entry(r: BucketRow) -> Entry[BucketRow]:
    return Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r)

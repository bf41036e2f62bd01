"""Backfill: the decision (``streams.decisions.decide_backfill``, pure), the command's
decoding, and the path through the real command agent and ticker on the fake store: the
runs of a past window fire, paced, under the run ids and trigger ids of their own
emissions."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from base.errors import CommandRejected
from streams.backfill_stops import BackfillStops, Stop
from streams.buckets import minute_ms
from streams.commands import CommandProcessor
from streams.decisions import (
    BACKFILL_LEAD_MS,
    BACKFILL_MAX_RUNS,
    BACKFILL_RUNS_PER_S,
    run_bucket,
)
from streams.model import ScheduleEvent, ScheduleRow, ScheduleState, trigger_for, trigger_id_of
from streams.partitioner import partition_for
from streams.recurring import jitter_ms, past_occurrences, run_id
from streams.ticker import PartitionTicker
from tests.unit.test_fault_properties import NOW as NOW_WALL
from tests.unit.test_fault_properties import PARTITIONS
from tests.unit.test_fault_properties import FakeStore as AcmeStore
from tests.unit.test_streams_handover import HeldSinkById, codes, processor, ticker_for, until
from tests.unit.test_streams_pause import (
    CB,
    NOW,
    apply,
    command_record,
    one_shot,
    parent,
    pause,
    turn,
)
from tests.unit.test_streams_ticker import settle
from topics.codec import decode_result, decode_trigger, encode_command
from topics.ids import trigger_id
from topics.models import (
    BackfillCommand,
    CancelCommand,
    CreateCommand,
    PauseCommand,
    PayloadType,
    Recurrence,
    ResumeCommand,
)
from topics.validation import Limits, decode_command


def recurring(rec: Recurrence) -> ScheduleRow:
    """A recurring parent created at NOW (its runs not written yet: a backfill does not
    look at them)."""
    create = CreateCommand(
        tenant="t",
        schedule_id="r",
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=rec,
    )
    d = apply(create, None, 1)
    assert d.change is not None
    return d.change.row


def backfill(from_ms: int, to_ms: int, sid: str = "r") -> BackfillCommand:
    return BackfillCommand(tenant="t", schedule_id=sid, from_ms=from_ms, to_ms=to_ms)


def test_a_backfill_writes_the_past_runs_of_its_window_under_their_own_ids() -> None:
    # Every 10 s from NOW; at NOW + 60.5 s the window [NOW, NOW + 60 s) holds 6 past runs.
    now = NOW + 60_500
    d = apply(backfill(NOW, NOW + 60_000), parent(), 5, now_ms=now)
    assert str(d.code) == "ok" and d.change is not None
    runs = d.change.bucket_puts
    assert runs == d.hand_over_runs and len(runs) == 6
    nominals = [NOW + 10_000 * i for i in range(6)]
    assert [r.schedule_id for r in runs] == [run_id("r", n) for n in nominals]
    # Fired from a second after the decision, paced: 1000 / BACKFILL_RUNS_PER_S ms apart.
    step = 1000 // BACKFILL_RUNS_PER_S
    assert [r.due_ms for r in runs] == [now + BACKFILL_LEAD_MS + i * step for i in range(6)]
    for nominal, run in zip(nominals, runs, strict=True):
        # The trigger is the run's own emission: same trigger id, same due time.
        own = run_bucket(parent(), nominal, nominal, 60, 1)
        assert trigger_id_of(run) == trigger_id_of(own) == trigger_id("t", run.schedule_id, nominal)
        trig = trigger_for(run, emitted_ms=run.due_ms, trigger_id=trigger_id_of(run))
        assert trig.due_ms == nominal and trig.schedule_id == run.schedule_id
    # The schedule row is left as it is; the history gets one event with the count.
    assert not d.change.write_row and d.change.event == ScheduleEvent.BACKFILLED
    assert d.change.event_detail is not None and "backfilled 6 runs" in d.change.event_detail


def test_a_window_reaching_past_now_takes_only_the_runs_due_before_now() -> None:
    now = NOW + 25_000
    d = apply(backfill(NOW - 3_600_000, NOW + 3_600_000), parent(), 5, now_ms=now)
    assert d.change is not None
    # start=NOW bounds the series below; NOW + 30 s is not due yet.
    assert [r.schedule_id for r in d.change.bucket_puts] == [
        run_id("r", NOW + i * 10_000) for i in range(3)
    ]


def test_a_rate_series_keeps_its_phase_before_the_schedule_was_created() -> None:
    # Every 60 s without start, created at NOW: its runs are NOW + 60 s + k * 60 s; a
    # backfill of the five minutes before takes the same phase back in time.
    row = recurring(Recurrence(every_s=60))
    d = apply(backfill(NOW - 300_000, NOW), row, 5, now_ms=NOW + 1)
    assert d.change is not None
    assert [r.run_due_ms for r in d.change.bucket_puts] == [
        NOW - 300_000 + 60_000 * i for i in range(5)
    ]


def test_a_cron_series_backfills_from_the_window_start_and_jitter_is_the_runs_own() -> None:
    rec = Recurrence(cron="0 * * * * *", jitter_s=30)
    row = recurring(rec)
    start = NOW - NOW % 60_000 - 300_000
    d = apply(backfill(start, start + 300_000), row, 5, now_ms=NOW + 1)
    assert d.change is not None
    runs = d.change.bucket_puts
    assert [r.schedule_id for r in runs] == [run_id("r", start + 60_000 * i) for i in range(5)]
    for i, run in enumerate(runs):
        nominal = start + 60_000 * i
        assert run.run_due_ms == nominal + jitter_ms("t", run.schedule_id, 30)


def test_a_backfill_is_bounded_per_command_and_says_where_to_go_on() -> None:
    row = recurring(Recurrence(every_s=1, start_ms=NOW - 86_400_000))
    d = apply(backfill(NOW - 86_400_000, NOW), row, 5, now_ms=NOW)
    assert d.change is not None
    runs = d.change.bucket_puts
    assert len(runs) == BACKFILL_MAX_RUNS
    fire_times = [r.due_ms for r in runs]
    assert fire_times == sorted(set(fire_times))  # distinct, in nominal order
    last = NOW + BACKFILL_LEAD_MS + (BACKFILL_MAX_RUNS - 1) * 1000 // BACKFILL_RUNS_PER_S
    assert fire_times[-1] == last
    assert "truncated at 10000 runs" in d.text
    assert "again from 2027-01-14T10:46:40.000Z" in d.text  # NOW - 1 day + 10,000 s


@pytest.mark.parametrize(
    ("existing", "window", "code"),
    [
        ("one-shot", (NOW - 60_000, NOW), "not_recurring"),
        ("recurring", (NOW + 1, NOW + 60_000), "window_in_future"),
        ("recurring", (NOW, NOW + 60_000), "window_in_future"),
        ("cancelled", (NOW - 60_000, NOW), "already_cancelled"),
        ("missing", (NOW - 60_000, NOW), "not_found"),
    ],
)
def test_what_a_backfill_refuses(existing: str, window: tuple[int, int], code: str) -> None:
    row = {
        "one-shot": one_shot(),
        "recurring": parent(),
        "cancelled": None,
        "missing": None,
    }[existing]
    if existing == "cancelled":
        cancelled = apply(CancelCommand(tenant="t", schedule_id="r"), parent(), 2)
        assert cancelled.change is not None
        row = cancelled.change.row
    sid = "s" if existing == "one-shot" else "r"
    with pytest.raises(CommandRejected) as caught:
        apply(backfill(*window, sid=sid), row, 5, now_ms=NOW)
    assert caught.value.code == code


def test_a_paused_schedule_may_be_backfilled_and_stays_paused() -> None:
    paused = apply(pause("r"), parent(), 2, now_ms=NOW + 25_000)
    assert paused.change is not None
    d = apply(backfill(NOW, NOW + 25_000), paused.change.row, 3, now_ms=NOW + 30_000)
    assert d.change is not None and len(d.change.bucket_puts) == 3
    assert not d.change.write_row and d.change.row.state == ScheduleState.PAUSED


def test_past_occurrences_keep_an_explicit_start_and_end() -> None:
    rec = Recurrence(every_s=10, start_ms=NOW, end_ms=NOW + 30_000)
    assert list(past_occurrences(rec, NOW - 60_000, anchor_ms=NOW)) == [
        NOW,
        NOW + 10_000,
        NOW + 20_000,
        NOW + 30_000,
    ]


def test_the_backfill_command_decodes_from_iso_or_epoch_ms_and_refuses_an_empty_window() -> None:
    raw = (
        b'{"type":"backfill","tenant":"t","schedule_id":"r",'
        b'"from":"2026-11-25T12:00:00Z","to":1795608300000}'
    )
    cmd = decode_command(raw, key=b"r", now_ms=NOW, limits=Limits())
    assert cmd == backfill(1_795_608_000_000, 1_795_608_300_000)
    assert decode_command(encode_command(cmd), key=b"r", now_ms=NOW, limits=Limits()) == cmd
    with pytest.raises(CommandRejected) as caught:
        decode_command(
            b'{"type":"backfill","tenant":"t","schedule_id":"r","from":5,"to":5}',
            key=b"r",
            now_ms=NOW,
            limits=Limits(),
        )
    assert caught.value.code == "invalid_field"
    with pytest.raises(CommandRejected) as missing:
        decode_command(
            b'{"type":"backfill","tenant":"t","schedule_id":"r","from":5}',
            key=b"r",
            now_ms=NOW,
            limits=Limits(),
        )
    assert missing.value.code == "missing_field"


# -- through the command agent and the ticker ----------------------------------------------


class TriggerSink(HeldSinkById):
    """Also keeps each trigger sent, decoded."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[bytes] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        self.values.append(value)
        return super().send(topic, key=key, value=value, headers=headers)


async def test_a_backfill_fires_through_the_ticker_paced_with_the_runs_own_ids() -> None:
    sid = "every-minute"
    partition = partition_for(sid.encode(), PARTITIONS)
    now = [NOW_WALL]
    create = CreateCommand(
        tenant="acme",
        schedule_id=sid,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=60),
    )
    store = AcmeStore()
    ticker, _ = ticker_for(partition, now)
    fires = TriggerSink()
    ticker.sink = fires
    ticker.fired_before_ms = now[0] - 1_000
    ticker._checkpoint_read.set()
    ticker.timeline.mark_loaded(now[0] + 3_600_000)
    proc, results = processor(store, ticker, now)
    await asyncio.wait_for(proc.process_batch([command_record(create, 1, partition, now[0])]), 1)
    order = command_record(
        BackfillCommand(tenant="acme", schedule_id=sid, from_ms=now[0] - 300_000, to_ms=now[0]),
        2,
        partition,
        now[0],
    )
    await asyncio.wait_for(proc.process_batch([order]), 1)
    assert codes(results) == ["ok", "ok"]
    answer = decode_result(results.sent[-1][2])
    assert answer.message.startswith("backfilled 5 runs")
    # Durable: the rows are stored, due from a second on, before anything fired.
    stored = sorted(
        (r for r in store.bucket_rows.values() if r.schedule_id.startswith(sid + "@")),
        key=lambda r: r.due_ms,
    )
    assert len(stored) == 5 and fires.values == []
    # Nothing is due at the decision; each turn of the clock lets out what is due by then.
    await turn(ticker, now[0])
    assert fires.values == []
    now[0] += BACKFILL_LEAD_MS
    await turn(ticker, now[0])
    assert len(fires.values) == 1
    now[0] += 10_000
    await turn(ticker, now[0])
    triggers = [decode_trigger(v) for v in fires.values]
    nominals = [NOW_WALL + 60_000 - 360_000 + 60_000 * i for i in range(5)]
    assert [t.schedule_id for t in triggers] == [run_id(sid, n) for n in nominals]
    assert [t.due_ms for t in triggers] == nominals
    assert [t.trigger_id for t in triggers] == [
        trigger_id("acme", run_id(sid, n), n) for n in nominals
    ]
    events = [e for e in store.events if e["schedule_id"] == sid]
    assert events[-1]["event"] == ScheduleEvent.BACKFILLED
    await ticker.stop(timeout_s=0.5)


# -- a pause or cancel stops a backfill's runs not emitted yet -----------------------------

SID = "every-minute"
PART = partition_for(SID.encode(), PARTITIONS)


def minutely() -> CreateCommand:
    return CreateCommand(
        tenant="acme",
        schedule_id=SID,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=60),
    )


def backfilled_ticker(
    store: AcmeStore, now: list[int], *, loaded: bool = True
) -> tuple[PartitionTicker, TriggerSink]:
    """A ticker on ``store`` whose checkpoint is read; ``loaded``: every minute of the
    next hour counts as read (a hand-over keeps the rows in memory)."""
    ticker, _ = ticker_for(PART, now, store=store)
    fires = TriggerSink()
    ticker.sink = fires
    ticker.fired_before_ms = now[0] - 1_000
    ticker._load_floor_ms = now[0] - 1_000
    ticker._next_minute_ms = minute_ms(now[0])
    ticker._checkpoint_read.set()
    if loaded:
        ticker.timeline.mark_loaded(now[0] + 3_600_000)
    return ticker, fires


def backfilled_ids(fires: TriggerSink) -> list[str]:
    return [t.schedule_id for t in map(decode_trigger, fires.values) if "@" in t.schedule_id]


async def send(proc: CommandProcessor, command: Any, offset: int, at_ms: int) -> None:
    await asyncio.wait_for(proc.process_batch([command_record(command, offset, PART, at_ms)]), 1)


def ten_minutes_back(now_ms: int) -> BackfillCommand:
    return BackfillCommand(tenant="acme", schedule_id=SID, from_ms=now_ms - 600_000, to_ms=now_ms)


@pytest.mark.parametrize(
    ("stopping", "event", "why"),
    [
        (PauseCommand, ScheduleEvent.SKIPPED_PAUSED, "paused"),
        (CancelCommand, ScheduleEvent.SKIPPED, "cancelled"),
    ],
)
async def test_a_pause_or_cancel_stops_the_backfilled_runs_the_ticker_holds(
    stopping: Any, event: ScheduleEvent, why: str
) -> None:
    # Ten runs handed to the ticker (their minutes are loaded); two fire, then the schedule
    # is paused (or cancelled): none of the other eight fires once that is answered, and
    # the eight are recorded in the schedule's history.
    now = [NOW_WALL]
    store = AcmeStore()
    ticker, fires = backfilled_ticker(store, now)
    proc, results = processor(store, ticker, now)
    await send(proc, minutely(), 1, now[0])
    await send(proc, ten_minutes_back(now[0]), 2, now[0])
    start = now[0]
    now[0] = start + BACKFILL_LEAD_MS + 1_000 // BACKFILL_RUNS_PER_S
    await turn(ticker, now[0])
    assert len(backfilled_ids(fires)) == 2
    await send(proc, stopping(tenant="acme", schedule_id=SID), 3, now[0])
    assert codes(results) == ["ok", "ok", "ok"]
    for step in range(1, 40):
        now[0] = start + step * 1_000
        await turn(ticker, now[0])
    assert len(backfilled_ids(fires)) == 2
    await until(lambda: any(e["event"] == event for e in store.events))
    skipped = [e for e in store.events if e["schedule_id"] == SID and e["event"] == event]
    assert len(skipped) == 1 and skipped[0]["detail"].startswith("8 backfilled runs not fired")
    assert skipped[0]["detail"].endswith(f"the schedule was {why}")
    assert store.schedules[("acme", SID)].backfill_stop_version == 2  # the stop's version
    await ticker.stop(timeout_s=0.5)


async def test_a_successor_drops_the_rows_of_a_paused_backfill_also_after_a_resume() -> None:
    # The rows are stored; the worker that paused the schedule is gone (a crash or a
    # rebalance) and its successor reads their minutes from the store: it drops them, and
    # so does one reading them after a resume (the stopped runs do not come back).
    now = [NOW_WALL]
    store = AcmeStore()
    first, fires = backfilled_ticker(store, now)
    proc, _ = processor(store, first, now)
    await send(proc, minutely(), 1, now[0])
    await send(proc, ten_minutes_back(now[0]), 2, now[0])
    await send(proc, PauseCommand(tenant="acme", schedule_id=SID), 3, now[0])
    await first.stop(timeout_s=0.5)
    stored = [r for r in store.bucket_rows.values() if r.run_due_ms is not None]
    assert len(stored) == 10
    for resumed in (False, True):
        if resumed:
            await send(proc, ResumeCommand(tenant="acme", schedule_id=SID), 4, now[0])
        successor, fires = backfilled_ticker(store, now, loaded=False)
        await successor._load_due_buckets()
        assert successor.timeline.get("acme", stored[0].schedule_id) is None
        for step in range(1, 20):
            await turn(successor, now[0] + step * 1_000)
        assert backfilled_ids(fires) == []
        await successor.stop(timeout_s=0.5)
    await until(lambda: any(e["event"] == ScheduleEvent.SKIPPED_PAUSED for e in store.events))


async def test_a_backfill_after_the_pause_fires_while_paused_and_after_a_successor_loads_it() -> (
    None
):
    # Backfilled while paused (an explicit request): its rows carry the paused version, not
    # below the stop, so they fire - also from a successor reading them from the store.
    now = [NOW_WALL]
    store = AcmeStore()
    first, _ = backfilled_ticker(store, now)
    proc, results = processor(store, first, now)
    await send(proc, minutely(), 1, now[0])
    await send(proc, PauseCommand(tenant="acme", schedule_id=SID), 2, now[0])
    await send(proc, ten_minutes_back(now[0]), 3, now[0])
    assert codes(results) == ["ok", "ok", "ok"]
    await first.stop(timeout_s=0.5)
    successor, fires = backfilled_ticker(store, now, loaded=False)
    await successor._load_due_buckets()
    for step in range(1, 20):
        await turn(successor, now[0] + step * 1_000)
    assert len(backfilled_ids(fires)) == 10
    await successor.stop(timeout_s=0.5)


async def test_a_backfill_and_a_pause_in_one_batch_fire_nothing() -> None:
    now = [NOW_WALL]
    store = AcmeStore()
    ticker, fires = backfilled_ticker(store, now)
    proc, results = processor(store, ticker, now)
    await send(proc, minutely(), 1, now[0])
    batch = [
        command_record(ten_minutes_back(now[0]), 2, PART, now[0]),
        command_record(PauseCommand(tenant="acme", schedule_id=SID), 3, PART, now[0]),
    ]
    await asyncio.wait_for(proc.process_batch(batch), 1)
    assert codes(results) == ["ok", "ok", "ok"]
    for step in range(1, 20):
        await turn(ticker, now[0] + step * 1_000)
    assert backfilled_ids(fires) == []
    await ticker.stop(timeout_s=0.5)


async def test_a_pause_takes_out_backfilled_runs_deferred_by_the_tenants_fire_quota() -> None:
    # Due and waiting in the fair queue (not emitted): taken out by the pause too.
    now = [NOW_WALL]
    store = AcmeStore()
    ticker, fires = backfilled_ticker(store, now)
    proc, _ = processor(store, ticker, now)
    await send(proc, minutely(), 1, now[0])
    await send(proc, ten_minutes_back(now[0]), 2, now[0])
    now[0] += 5_000
    await ticker._admit_due(now[0])  # all ten due: in the fair queue, none emitted yet
    assert len(ticker.pacer) == 10 and fires.values == []
    await send(proc, PauseCommand(tenant="acme", schedule_id=SID), 3, now[0])
    assert len(ticker.pacer) == 0
    await turn(ticker, now[0] + 1_000)
    assert backfilled_ids(fires) == []
    await ticker.stop(timeout_s=0.5)


def test_stops_told_are_bounded_by_count_and_age() -> None:
    stops = BackfillStops(ttl_ms=1_000, max_stops=3)
    for i in range(5):
        stops.stop("t", f"p{i}", Stop(2, False), now_ms=NOW)
    assert len(stops) == 3
    row = replace(
        run_bucket(recurring(Recurrence(every_s=60)), NOW - 60_000, NOW + 1_000, 60, 1),
        schedule_id="p4@1",
        run_due_ms=NOW - 60_000,
        version=1,
    )
    assert stops.stop_of(row, NOW) == Stop(2, False)
    assert stops.stop_of(replace(row, version=2), NOW) is None  # backfilled after it
    assert stops.stop_of(row, NOW + 1_000) is None  # expired: the stored stop rules
    stops.stop("t", "p5", Stop(2, False), now_ms=NOW + 1_000)
    assert len(stops) == 1


async def test_runs_taken_out_ahead_of_their_minute_are_recorded_once_when_it_is_read() -> None:
    # Handed over ahead of their minute's read (held in memory), taken out by the pause,
    # then read with their minute: dropped again, but recorded once.
    minute = minute_ms(NOW_WALL) + 60_000
    now = [minute - 500]
    store = AcmeStore()
    ticker, fires = backfilled_ticker(store, now, loaded=False)
    ticker.timeline.mark_loaded(minute)
    proc, _ = processor(store, ticker, now)
    await send(proc, minutely(), 1, now[0])
    await send(proc, ten_minutes_back(now[0]), 2, now[0])
    assert len(ticker.timeline) == 10
    await send(proc, PauseCommand(tenant="acme", schedule_id=SID), 3, now[0])
    assert len(ticker.timeline) == 0
    ticker._next_minute_ms = minute
    await ticker._load_due_buckets()
    await turn(ticker, minute + 5_000)
    assert backfilled_ids(fires) == []
    await until(lambda: any(e["event"] == ScheduleEvent.SKIPPED_PAUSED for e in store.events))
    await settle()
    details = [e["detail"] for e in store.events if e["event"] == ScheduleEvent.SKIPPED_PAUSED]
    assert sum(int(d.split()[0]) for d in details if "backfilled" in d) == 10
    await ticker.stop(timeout_s=0.5)

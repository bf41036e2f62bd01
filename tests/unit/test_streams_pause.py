"""Pause, resume and trigger-now: the decisions (``streams.decisions``, pure) and the race
with the ticker (the real ``PartitionTicker`` and ``CommandProcessor`` on the shared fake
store): nothing the ticker holds fires once a pause is answered."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client import REGISTRY

from base.errors import CommandRejected, KafkaError
from streams import metrics
from streams.commands import CommandProcessor, RawCommand
from streams.decisions import (
    Decision,
    decide,
    index_changes,
    materialize_key,
    parent_commits,
    plan_extension,
)
from streams.model import (
    BucketRow,
    ManualRun,
    ScheduleEvent,
    ScheduleRow,
    ScheduleState,
    trigger_for,
    trigger_id_of,
)
from streams.partitioner import partition_for
from streams.recurring import NEVER_MS, run_id
from streams.ticker import PartitionTicker
from tests.unit.test_fault_properties import NOW as NOW_WALL
from tests.unit.test_fault_properties import PARTITIONS, SECRET
from tests.unit.test_fault_properties import FakeSink as ResultSink
from tests.unit.test_fault_properties import FakeStore as AcmeStore
from tests.unit.test_streams_handover import (
    HeldSinkById,
    codes,
    processor,
    ticker_for,
    until,
)
from tests.unit.test_streams_isolation import record
from tests.unit.test_streams_ticker import StoredCheckpoint, running, settle
from topics.codec import decode_result, decode_trigger, encode_command, encode_trigger
from topics.ids import trigger_id
from topics.models import (
    CancelCommand,
    Command,
    CreateCommand,
    HttpCallback,
    PauseCommand,
    PayloadType,
    Recurrence,
    ResumeCommand,
    TriggerCommand,
    UpdateCommand,
)
from topics.signing import TimestampType, sign_headers
from topics.validation import Limits

NOW = 1_800_000_000_000
CB = HttpCallback(url="https://h.example/cb")


class At:
    """Where and when a command was read (``decisions.CommandAt``)."""

    def __init__(self, offset: int, timestamp_ms: int = NOW, partition: int = 3) -> None:
        self.partition = partition
        self.offset = offset
        self.timestamp_ms = timestamp_ms


def one_shot(due_ms: int = NOW + 60_000, tolerance_s: int = 60) -> ScheduleRow:
    create = CreateCommand(
        tenant="t",
        schedule_id="s",
        due_ms=due_ms,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=tolerance_s,
    )
    d = decide(create, None, At(1), now_ms=NOW, shards=1, default_tolerance_s=3600, firing=False)
    assert d.change is not None
    return d.change.row


def apply(
    command: Command,
    existing: ScheduleRow | None,
    offset: int,
    *,
    now_ms: int = NOW,
    firing: bool = False,
    unemitted: object = None,
) -> Decision:
    return decide(
        command,
        existing,
        At(offset, timestamp_ms=now_ms),
        now_ms=now_ms,
        shards=1,
        default_tolerance_s=3600,
        firing=firing,
        unemitted=unemitted,  # type: ignore[arg-type]
    )


def pause(sid: str = "s") -> PauseCommand:
    return PauseCommand(tenant="t", schedule_id=sid)


def resume(sid: str = "s") -> ResumeCommand:
    return ResumeCommand(tenant="t", schedule_id=sid)


def trigger(sid: str = "s") -> TriggerCommand:
    return TriggerCommand(tenant="t", schedule_id=sid)


# -- one-shot schedules --------------------------------------------------------------------


def test_pausing_a_one_shot_deletes_its_bucket_row_and_withdraws_its_version() -> None:
    row = one_shot()
    d = apply(pause(), row, 2)
    assert d.change is not None and str(d.code) == "ok"
    assert d.change.row.state == ScheduleState.PAUSED and d.change.row.version == 2
    assert d.change.new_bucket is None
    assert d.change.old_bucket == BucketRow.for_schedule(row, shards=1).key
    assert d.change.event == ScheduleEvent.PAUSED
    assert d.withdraw_version == 2 and d.hand_over is None


def test_pausing_again_is_a_duplicate_and_resuming_a_running_one_too() -> None:
    paused = apply(pause(), one_shot(), 2).change
    assert paused is not None
    again = apply(pause(), paused.row, 3)
    assert (str(again.code), again.change) == ("duplicate", None)
    running_one = apply(resume(), one_shot(), 3)
    assert (str(running_one.code), running_one.change) == ("duplicate", None)


@pytest.mark.parametrize(
    ("state", "firing", "code"),
    [
        (ScheduleState.SCHEDULED, True, "already_fired"),  # its trigger is out already
        (ScheduleState.FIRED, False, "already_fired"),
        (ScheduleState.MISSED, False, "already_fired"),
        (ScheduleState.CANCELLED, False, "already_cancelled"),
    ],
)
def test_a_schedule_that_fired_or_was_cancelled_cannot_be_paused(
    state: ScheduleState, firing: bool, code: str
) -> None:
    with pytest.raises(CommandRejected) as caught:
        apply(pause(), replace(one_shot(), state=state), 2, firing=firing)
    assert caught.value.code == code


def test_resuming_before_the_due_time_writes_the_bucket_row_again() -> None:
    paused = apply(pause(), one_shot(), 2).change
    assert paused is not None
    d = apply(resume(), paused.row, 3, now_ms=NOW + 1_000)
    assert d.change is not None and d.change.row.state == ScheduleState.SCHEDULED
    assert d.change.new_bucket is not None and d.change.new_bucket.due_ms == NOW + 60_000
    assert d.change.new_bucket.version == 3  # above the pause's tombstone in the ticker
    assert d.hand_over == d.change.row and d.change.event == ScheduleEvent.RESUMED


def test_resuming_after_the_due_time_within_tolerance_fires_late() -> None:
    paused = apply(pause(), one_shot(tolerance_s=60), 2).change
    assert paused is not None
    d = apply(resume(), paused.row, 3, now_ms=NOW + 60_000 + 30_000)
    assert d.change is not None and d.change.row.state == ScheduleState.SCHEDULED
    assert d.hand_over is not None  # the ticker fires it at once, 30 s late
    assert "late" in d.text


def test_resuming_beyond_the_tolerance_records_it_missed() -> None:
    paused = apply(pause(), one_shot(tolerance_s=60), 2).change
    assert paused is not None
    d = apply(resume(), paused.row, 3, now_ms=NOW + 60_000 + 61_000)
    assert d.change is not None and str(d.code) == "ok"
    row = d.change.row
    assert row.state == ScheduleState.MISSED and d.hand_over is None
    assert row.trigger_id == trigger_id("t", "s", NOW + 60_000)
    assert d.change.new_bucket is None
    assert [n.event for n in d.change.notes] == [ScheduleEvent.MISSED]
    assert "while paused" in (d.change.notes[0].detail or "")


def test_updating_a_paused_one_shot_keeps_it_paused_and_moves_its_listing_entry() -> None:
    paused = apply(pause(), one_shot(), 2).change
    assert paused is not None
    d = apply(UpdateCommand(tenant="t", schedule_id="s", due_ms=NOW + 120_000), paused.row, 3)
    assert d.change is not None and d.change.row.state == ScheduleState.PAUSED
    assert d.change.new_bucket is None and d.hand_over is None
    assert index_changes([d.change]) == (
        [("t", "s", NOW + 120_000)],
        [("t", "s", NOW + 60_000)],
    )


def test_a_paused_one_shot_can_be_cancelled() -> None:
    paused = apply(pause(), one_shot(), 2).change
    assert paused is not None
    d = apply(CancelCommand(tenant="t", schedule_id="s"), paused.row, 3)
    assert d.change is not None and d.change.row.state == ScheduleState.CANCELLED


# -- trigger now ---------------------------------------------------------------------------


def test_trigger_now_fires_an_extra_run_with_an_id_of_its_own() -> None:
    row = one_shot()
    d = apply(trigger(), row, 7, now_ms=NOW + 5)
    run = d.fire_now
    assert isinstance(run, ManualRun) and str(d.code) == "ok"
    assert run.due_ms == NOW + 5 and run.schedule_id != "s" and "@now-" in run.schedule_id
    assert (run.payload, run.callback, run.order_key) == (row.payload, row.callback, "s")
    # Not the nominal trigger's id, nor the id a schedule named like the run would get.
    assert trigger_id_of(run) != trigger_id("t", "s", row.due_ms)
    assert trigger_id_of(run) != trigger_id("t", run.schedule_id, run.due_ms)
    assert trigger_id_of(run) != trigger_id("t", "s", run.due_ms)
    # The schedule row is not written (the ticker may be recording its own fire), only
    # the history event.
    assert d.change is not None and not d.change.write_row and d.change.event is None
    assert [n.event for n in d.change.notes] == [ScheduleEvent.TRIGGERED]
    assert d.change.notes[0].trigger_id == trigger_id_of(run)


def test_trigger_now_ids_are_stable_per_command_and_distinct_between_commands() -> None:
    row = one_shot()
    first = apply(trigger(), row, 7).fire_now
    replayed = apply(trigger(), replace(row, applied_offset=9), 7).fire_now  # a replay
    other = apply(trigger(), row, 8).fire_now
    assert first is not None and replayed is not None and other is not None
    assert trigger_id_of(first) == trigger_id_of(replayed)
    assert trigger_id_of(first) != trigger_id_of(other)


def test_a_paused_schedule_can_be_triggered_and_stays_paused() -> None:
    paused = apply(pause(), one_shot(), 2).change
    assert paused is not None
    d = apply(trigger(), paused.row, 3)
    assert d.fire_now is not None and d.change is not None and not d.change.write_row


def test_a_cancelled_or_missing_schedule_cannot_be_triggered() -> None:
    with pytest.raises(CommandRejected) as caught:
        apply(trigger(), replace(one_shot(), state=ScheduleState.CANCELLED), 3)
    assert caught.value.code == "already_cancelled"
    with pytest.raises(CommandRejected) as caught:
        apply(trigger(), None, 3)
    assert caught.value.code == "not_found"


# -- recurring schedules -------------------------------------------------------------------

EVERY_10S = Recurrence(every_s=10, start_ms=NOW)


def parent(rec: Recurrence = EVERY_10S) -> ScheduleRow:
    """A recurring parent created at NOW, its runs written up to NOW + 600 s."""
    create = CreateCommand(
        tenant="t",
        schedule_id="r",
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=rec,
    )
    d = decide(create, None, At(1), now_ms=NOW, shards=1, default_tolerance_s=3600, firing=False)
    assert d.change is not None
    ext = plan_extension(
        [d.change.row], now_ms=NOW, horizon_ms=600_000, shards=1, max_runs=500, late_budget=500
    )
    [(row, _)] = parent_commits(ext.steps, now_ms=NOW, horizon_ms=600_000)
    assert row.materialized_until_ms == NOW + 600_000 and row.run_count == 60
    return row


class TickerHolding:
    """An ``Unemitted`` whose ticker still holds the runs due from ``earliest`` on (loaded
    and waiting: its loop lags behind the clock)."""

    def __init__(self, earliest: int) -> None:
        self.earliest = earliest

    def earliest_unemitted_ms(self, now_ms: int) -> int:
        return self.earliest

    def may_emit(self, tenant: str, schedule_id: str, due_ms: int) -> bool:
        return due_ms >= self.earliest


def test_pausing_a_recurring_schedule_withdraws_every_run_not_emitted_yet() -> None:
    # At NOW + 25 s the runs of NOW, +10 s were emitted; the one of +20 s is due but still
    # waits in the ticker: it is withdrawn with every later one (a cancel would leave it).
    now = NOW + 25_000
    d = apply(pause("r"), parent(), 2, now_ms=now, unemitted=TickerHolding(NOW + 20_000))
    assert d.change is not None and str(d.code) == "ok"
    row = d.change.row
    withdrawn = {sid for _, sid, _ in d.withdraw_runs}
    assert run_id("r", NOW + 20_000) in withdrawn and run_id("r", NOW + 10_000) not in withdrawn
    assert len(withdrawn) == 58 and len(d.change.run_deletes) == 58
    assert row.state == ScheduleState.PAUSED and row.run_count == 2
    assert row.materialized_until_ms == NOW + 20_000
    assert row.materialize_key == materialize_key(row.partition, NEVER_MS)
    cancelled = apply(CancelCommand(tenant="t", schedule_id="r"), parent(), 2, now_ms=now)
    assert run_id("r", NOW + 20_000) not in {sid for _, sid, _ in cancelled.withdraw_runs}


def test_the_materialiser_writes_no_runs_of_a_paused_schedule() -> None:
    d = apply(pause("r"), parent(), 2, now_ms=NOW + 25_000)
    assert d.change is not None
    ext = plan_extension(
        [d.change.row],
        now_ms=NOW + 700_000,
        horizon_ms=600_000,
        shards=1,
        max_runs=500,
        late_budget=500,
    )
    assert ext.steps == [] and len(ext.retired) == 1


def test_resuming_a_recurring_schedule_records_the_skipped_runs_and_goes_on_at_the_next() -> None:
    paused = apply(pause("r"), parent(), 2, now_ms=NOW + 25_000).change
    assert paused is not None  # runs from NOW + 30 s on were withdrawn
    d = apply(resume("r"), paused.row, 3, now_ms=NOW + 1_000_000)
    assert d.change is not None and str(d.code) == "ok"
    row = d.change.row
    assert row.state == ScheduleState.SCHEDULED and d.change.event == ScheduleEvent.RESUMED
    assert row.materialized_until_ms == NOW + 1_010_000  # the first run after the resume
    assert row.run_count == 3 + 98  # the skipped runs count towards max_runs
    [note] = d.change.notes
    assert note.event == ScheduleEvent.SKIPPED_PAUSED
    assert note.detail is not None and note.detail.startswith("98 runs from")
    ext = plan_extension(
        [row], now_ms=NOW + 1_000_000, horizon_ms=600_000, shards=1, max_runs=500, late_budget=0
    )
    [step] = ext.steps
    assert step.runs[0].due_ms == NOW + 1_010_000  # nothing of the pause fires late


def test_a_pause_longer_than_the_runs_left_completes_the_schedule() -> None:
    rec = Recurrence(every_s=10, start_ms=NOW, max_runs=70)
    paused = apply(pause("r"), parent(rec), 2, now_ms=NOW + 25_000).change
    assert paused is not None
    d = apply(resume("r"), paused.row, 3, now_ms=NOW + 1_000_000)
    assert d.change is not None
    assert d.change.row.materialized_until_ms == NEVER_MS and d.change.row.run_count == 70


def test_resume_and_pause_of_recurring_schedules_are_idempotent() -> None:
    running_one = apply(resume("r"), parent(), 2)
    assert (str(running_one.code), running_one.change) == ("duplicate", None)
    paused = apply(pause("r"), parent(), 2, now_ms=NOW + 25_000).change
    assert paused is not None
    again = apply(pause("r"), paused.row, 3)
    assert (str(again.code), again.change) == ("duplicate", None)


# -- the race with the ticker (real ticker, command agent on the fake store) ---------------


def command_record(command: Command, offset: int, partition: int, at_ms: int) -> RawCommand:
    value = encode_command(command)
    key = command.schedule_id.encode()
    return RawCommand(
        partition=partition,
        offset=offset,
        key=key,
        value=value,
        timestamp_ms=at_ms,
        headers=sign_headers(SECRET, signed_at_ms=at_ms, key=key, value=value),
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )


def lagging_ticker(partition: int, now: list[int]) -> tuple[PartitionTicker, HeldSinkById]:
    """A ticker whose checkpoint is read and whose minutes up to an hour ahead are loaded,
    but whose loop does not run until the test turns it (``turn``): it lags behind the
    clock, as a busy one does."""
    ticker, fires = ticker_for(partition, now)
    ticker.fired_before_ms = now[0] - 1_000
    ticker._checkpoint_read.set()
    ticker.timeline.mark_loaded(now[0] + 3_600_000)
    return ticker, fires


async def turn(ticker: PartitionTicker, now: int) -> None:
    """One round of the ticker's loop: admit what is due, emit what the queue lets out."""
    await ticker._admit_due(now)
    ticker._emit_ready(now)
    await settle()


@pytest.mark.parametrize("paused", [True, False])
async def test_a_due_one_shot_loaded_in_the_ticker_does_not_fire_after_the_pause(
    paused: bool,
) -> None:
    # Due, and waiting in the ticker's timeline while its loop lags: once the pause is
    # answered "ok" it must never be emitted. (Without the pause it fires at that turn.)
    create = record("due-now", 1, due_ms=NOW_WALL + 5_000)
    now = [NOW_WALL]
    ticker, fires = lagging_ticker(create.partition, now)
    proc, results = processor(AcmeStore(), ticker, now)
    await asyncio.wait_for(proc.process_batch([create]), 1)
    assert ticker.timeline.get("acme", "due-now") is not None
    now[0] = NOW_WALL + 5_000  # due now; the loop has not taken it
    if paused:
        pausing = command_record(
            PauseCommand(tenant="acme", schedule_id="due-now"), 2, create.partition, now[0]
        )
        await asyncio.wait_for(proc.process_batch([pausing]), 1)
        assert codes(results) == ["ok", "ok"]
    await turn(ticker, now[0])
    assert len(fires.sent) == (0 if paused else 1)


@pytest.mark.parametrize("command", [PauseCommand, CancelCommand])
async def test_a_due_recurring_run_loaded_in_the_ticker_does_not_fire_after_the_pause(
    command: type[PauseCommand] | type[CancelCommand],
) -> None:
    # A run due at this very moment, loaded and waiting in the timeline while the ticker
    # lags: a cancel lets it fire (documented), a pause must not.
    sid = "every-10s"
    partition = partition_for(sid.encode(), PARTITIONS)
    now = [NOW_WALL]
    create = CreateCommand(
        tenant="acme",
        schedule_id=sid,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=10, start_ms=NOW_WALL + 10_000),
    )
    store = AcmeStore()
    ticker, fires = lagging_ticker(partition, now)
    proc, results = processor(store, ticker, now)
    await asyncio.wait_for(proc.process_batch([command_record(create, 1, partition, now[0])]), 1)
    ext = plan_extension(
        [store.schedules[("acme", sid)]],
        now_ms=now[0],
        horizon_ms=60_000,
        shards=1,
        max_runs=500,
        late_budget=500,
    )
    [(written, _)] = parent_commits(ext.steps, now_ms=now[0], horizon_ms=60_000)
    store.schedules[("acme", sid)] = written
    for run in ext.steps[0].runs:  # what the materialiser writes and hands over
        ticker.offer(run)
    now[0] = ext.steps[0].runs[0].due_ms  # the first run is due; the loop has not run
    stop = command_record(command(tenant="acme", schedule_id=sid), 2, partition, now[0])
    await asyncio.wait_for(proc.process_batch([stop]), 1)
    assert codes(results) == ["ok", "ok"]
    for _ in range(3):
        await turn(ticker, now[0])
        now[0] += 10_000
    assert len(fires.sent) == (0 if command is PauseCommand else 1)


async def test_trigger_now_is_answered_once_kafka_has_its_run() -> None:
    create = record("manual", 1)
    now = [create.timestamp_ms]
    store = AcmeStore()
    ticker, fires = ticker_for(create.partition, now, StoredCheckpoint(now[0] - 1_000))
    await running(ticker)
    proc, results = processor(store, ticker, now)
    await asyncio.wait_for(proc.process_batch([create]), 1)
    fire = command_record(
        TriggerCommand(tenant="acme", schedule_id="manual"), 2, create.partition, now[0]
    )
    batch = asyncio.create_task(proc.process_batch([fire]))
    await until(lambda: len(fires.sent) == 1)
    assert len(results.sent) == 1 and not batch.done()  # waits for the acknowledgement
    fires.sent[0][1].set_result((0, 0))
    await asyncio.wait_for(batch, 1)
    answer = decode_result(results.sent[-1][2])
    assert str(answer.code) == "ok" and answer.message.startswith("triggered")
    [run_sid] = fires.ids
    assert run_sid.startswith("manual@now-")
    stored = store.schedules[("acme", "manual")]
    assert stored.state == ScheduleState.SCHEDULED  # its own fire is still to come
    events = [e for e in store.events if e["schedule_id"] == "manual"]
    assert [e["event"] for e in events][-1] == ScheduleEvent.TRIGGERED
    assert events[-1]["trigger_id"] not in (None, trigger_id("acme", "manual", stored.due_ms))
    await ticker.stop(timeout_s=0.5)


def test_the_trigger_a_manual_run_emits_carries_its_own_id() -> None:
    d = apply(trigger(), one_shot(), 7)
    assert d.fire_now is not None
    trig = trigger_for(d.fire_now, emitted_ms=NOW, trigger_id=trigger_id_of(d.fire_now))
    assert decode_trigger(encode_trigger(trig)).trigger_id == trigger_id_of(d.fire_now)


async def test_a_pause_waits_while_its_partition_has_no_ticker_here() -> None:
    # Assigned here as far as the consumer knows, but its ticker stopped (a rebalance under
    # way): what may still fire is unknown, so the pause is retried, not answered.
    create = record("no-ticker", 1)
    proc = CommandProcessor(
        store=AcmeStore(),
        sink=HeldSinkById(),
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: create.timestamp_ms,
        assigned=lambda partition: True,
    )
    pausing = command_record(
        PauseCommand(tenant="acme", schedule_id="no-ticker"),
        2,
        create.partition,
        create.timestamp_ms,
    )
    with pytest.raises(KafkaError) as caught:
        await proc.process_batch([pausing])
    assert caught.value.retriable


async def test_a_resume_counts_the_runs_it_skipped_and_a_miss_it_records() -> None:
    t0 = NOW_WALL
    now = [t0]
    label = metrics.tenant_label("acme")
    skipped = {"tenant": label, "reason": "paused"}
    missed = {"tenant": label, "cause": "tolerance"}

    def count(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = count("tocsin_runs_skipped_by_tenant_total", skipped)
    missed_before = count("tocsin_triggers_missed_by_tenant_total", missed)
    proc = CommandProcessor(
        store=AcmeStore(),
        sink=ResultSink(),
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: now[0],
    )
    every = CreateCommand(
        tenant="acme",
        schedule_id="counted",
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=10, start_ms=t0 + 10_000),
    )
    once = record("counted-once", 1, due_ms=t0 + 5_000)
    p_every = partition_for(b"counted", PARTITIONS)

    async def send(command: Command, offset: int, partition: int) -> None:
        await proc.process_batch([command_record(command, offset, partition, now[0])])

    await send(every, 1, p_every)
    await proc.process_batch([once])
    await send(PauseCommand(tenant="acme", schedule_id="counted"), 2, p_every)
    await send(PauseCommand(tenant="acme", schedule_id="counted-once"), 2, once.partition)
    now[0] = t0 + 100_000  # runs from t0 + 10 s to t0 + 100 s fell in the pause
    await send(ResumeCommand(tenant="acme", schedule_id="counted"), 3, p_every)
    await send(ResumeCommand(tenant="acme", schedule_id="counted-once"), 3, once.partition)
    assert count("tocsin_runs_skipped_by_tenant_total", skipped) - before == 10
    assert count("tocsin_triggers_missed_by_tenant_total", missed) - missed_before == 1


def test_a_one_shot_resumed_later_than_its_retention_keeps_its_row_while_it_fires() -> None:
    """A pause may outlast the retention; a resume within a long misfire tolerance fires
    it late, and its row must outlive that fire by the retention (TTL 1 s would drop the
    payload and callback before the fire is recorded, leaving a row with its state only)."""
    from base.settings import CassandraSettings
    from streams.store import Store

    store = Store(CassandraSettings(), retention_s=1000)
    paused = apply(pause(), one_shot(tolerance_s=10 * 86_400), 2).change
    assert paused is not None
    assert store.schedule_ttl_s(paused.row, NOW) == 0  # paused: no TTL
    later = NOW + 60_000 + 5 * 86_400_000  # five days late, retention 1000 s
    d = apply(resume(), paused.row, 3, now_ms=later)
    assert d.change is not None and d.change.row.state == ScheduleState.SCHEDULED
    assert store.schedule_ttl_s(d.change.row, later) >= 1000


class EmittingOne(TickerHolding):
    """The ticker holds the runs from ``earliest`` on, but the one due at ``emitting`` is
    out already (handed to Kafka, not yet recorded as fired)."""

    def __init__(self, earliest: int, emitting: int) -> None:
        super().__init__(earliest)
        self.emitting = emitting

    def may_emit(self, tenant: str, schedule_id: str, due_ms: int) -> bool:
        return due_ms != self.emitting and super().may_emit(tenant, schedule_id, due_ms)


def test_a_run_already_emitted_is_neither_withdrawn_nor_uncounted_by_a_pause() -> None:
    now = NOW + 25_000
    holding = EmittingOne(NOW + 20_000, emitting=NOW + 20_000)
    d = apply(pause("r"), parent(), 2, now_ms=now, unemitted=holding)
    assert d.change is not None
    withdrawn = {sid for _, sid, _ in d.withdraw_runs}
    assert run_id("r", NOW + 20_000) not in withdrawn and run_id("r", NOW + 30_000) in withdrawn
    assert len(withdrawn) == 57 and d.change.row.run_count == 3  # it counts towards max_runs
    assert d.change.row.materialized_until_ms == NOW + 30_000  # skipped runs count from here


async def test_a_run_deferred_by_its_tenants_fire_quota_is_still_to_be_emitted() -> None:
    # Loaded and out of the timeline, but waiting in the fair queue for its tenant's fire
    # quota: a pause must withdraw it, as it withdraws one still in the timeline.
    from streams.timeline import Entry

    now = [NOW_WALL]
    ticker, _ = lagging_ticker(0, now)
    row = BucketRow.for_schedule(replace(one_shot(), due_ms=NOW_WALL - 1_000), shards=1)
    ticker.pacer.push(Entry(row.due_ms, row.tenant, row.schedule_id, row.version, row), now[0])
    assert ticker.timeline.get(row.tenant, row.schedule_id) is None
    assert ticker.may_emit(row.tenant, row.schedule_id, row.due_ms)
    ticker.pacer.remove(row.tenant, row.schedule_id)
    assert not ticker.may_emit(row.tenant, row.schedule_id, row.due_ms)  # emitted, settled


async def test_a_pause_waits_until_its_tickers_checkpoint_is_read() -> None:
    # A ticker just handed the partition has not read its checkpoint: it can only say
    # "anything an hour back may still come", so a pause decided now would withdraw the
    # runs the previous owner fired in that hour (deleting their history, taking them off
    # run_count, and reporting them skipped at the resume). It is retried until it knows.
    sid = "every-10s-new-owner"
    partition = partition_for(sid.encode(), PARTITIONS)
    now = [NOW_WALL]
    ticker, _ = ticker_for(partition, now)
    assert ticker.fired_before_ms is None
    store = AcmeStore()
    proc, results = processor(store, ticker, now)
    create = CreateCommand(
        tenant="acme",
        schedule_id=sid,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=10, start_ms=NOW_WALL - 3_000_000),
    )
    await asyncio.wait_for(proc.process_batch([command_record(create, 1, partition, now[0])]), 1)
    pausing = command_record(PauseCommand(tenant="acme", schedule_id=sid), 2, partition, now[0])
    with pytest.raises(KafkaError) as caught:
        await proc.process_batch([pausing])
    assert caught.value.retriable and codes(results) == ["ok"]
    ticker.fired_before_ms = now[0] - 1_000
    ticker._checkpoint_read.set()
    await asyncio.wait_for(proc.process_batch([pausing]), 1)
    assert codes(results) == ["ok", "ok"]


async def test_a_trigger_command_read_late_still_fires() -> None:
    # Its run is due when the broker appended the command; read a minute later (a lagging
    # consumer, a restart) it was still asked for explicitly: fired, never recorded missed.
    create = record("manual-late", 1)
    now = [create.timestamp_ms]
    ticker, fires = ticker_for(create.partition, now, StoredCheckpoint(now[0] - 1_000))
    await running(ticker)
    proc, results = processor(AcmeStore(), ticker, now)
    await asyncio.wait_for(proc.process_batch([create]), 1)
    fire = command_record(
        TriggerCommand(tenant="acme", schedule_id="manual-late"), 2, create.partition, now[0]
    )
    now[0] += 60_000
    batch = asyncio.create_task(proc.process_batch([fire]))
    await until(lambda: len(fires.sent) == 1)
    fires.sent[0][1].set_result((0, 0))
    await asyncio.wait_for(batch, 1)
    assert str(decode_result(results.sent[-1][2]).code) == "ok"
    assert ticker.missed == 0
    await ticker.stop(timeout_s=0.5)

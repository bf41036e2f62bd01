"""Recurring schedules in the scheduler: command decisions (pure) and one materialiser step
against in-memory fakes."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from base.errors import CommandRejected
from streams.commands import RawCommand
from streams.decisions import (
    KEY_SPAN,
    DueEntry,
    decide,
    decide_recurring,
    due_entries,
    materialize_key,
)
from streams.materializer import MaterializerConfig, PartitionMaterializer
from streams.model import BucketRow, ScheduleRow
from streams.recurring import NEVER_MS, extend_at
from tests.fakes import FakeStore
from topics.codes import Code
from topics.models import (
    CancelCommand,
    CreateCommand,
    HttpCallback,
    PayloadType,
    Recurrence,
    UpdateCommand,
)
from topics.recurrence import normalize_cron

NOW = 1_800_000_000_000  # a whole minute
H = 600_000


def create(rec: Recurrence, sid: str = "rep") -> CreateCommand:
    return CreateCommand(
        tenant="t",
        schedule_id=sid,
        payload=b'{"a":1}',
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://h.example/cb"),
        misfire_tolerance_s=60,
        recurrence=rec,
    )


def decided(command: Any, existing: ScheduleRow | None, offset: int = 10) -> Any:
    return decide_recurring(
        command,
        existing,
        partition=3,
        offset=offset,
        timestamp_ms=NOW,
        now_ms=NOW,
        shards=1,
        horizon_ms=H,
    )


EVERY_MINUTE = Recurrence(cron=normalize_cron("* * * * *"))


def test_a_create_registers_the_parent_for_immediate_extension() -> None:
    d = decided(create(EVERY_MINUTE), None)
    row = d.change.row
    assert d.code == Code.OK and d.change.new_bucket is None and d.change.old_bucket is None
    assert row.recurrence is not None and row.anchor_ms == NOW and row.partition == 3
    assert row.materialized_until_ms == NOW and row.run_count == 0 and row.due_ms == NOW
    assert row.materialize_key == materialize_key(3, extend_at(NOW, H, "rep"))
    assert 3 * KEY_SPAN <= row.materialize_key <= 3 * KEY_SPAN + NOW
    assert decided(create(EVERY_MINUTE), row).code == Code.DUPLICATE
    with pytest.raises(CommandRejected) as caught:
        decided(create(Recurrence(cron=normalize_cron("*/2 * * * *"))), row)
    assert caught.value.code == Code.CONFLICT


def test_a_create_without_any_run_left_is_rejected() -> None:
    rec = Recurrence(every_s=60, start_ms=NOW - 3_600_000, end_ms=NOW - 60_000)
    with pytest.raises(CommandRejected) as caught:
        decided(create(rec), None)
    assert caught.value.code == Code.INVALID_FIELD


def materialised(rec: Recurrence = EVERY_MINUTE, runs: int = 10) -> ScheduleRow:
    row = decided(create(rec), None).change.row
    return replace(row, materialized_until_ms=NOW + runs * 60_000, run_count=runs)


def test_cancel_removes_every_pending_run() -> None:
    parent = materialised()
    d = decided(CancelCommand(tenant="t", schedule_id="rep"), parent, offset=11)
    row = d.change.row
    assert row.state == "cancelled" and row.version == 2
    assert row.materialize_key == materialize_key(3, NEVER_MS)
    # NOW itself is due (may be firing): runs +1 .. +9 min are removed.
    assert [k.schedule_id for k in d.change.run_deletes] == [
        f"rep@{NOW + i * 60_000}" for i in range(1, 10)
    ]
    deletes = d.change.run_deletes
    assert all(k.partition == 3 and k.due_ms == int(k.schedule_id[4:]) for k in deletes)
    assert [w[1] for w in d.withdraw] == [k.schedule_id for k in d.change.run_deletes]
    assert len(d.change.commit_with) == 9  # their history rows
    with pytest.raises(CommandRejected) as caught:
        decided(CancelCommand(tenant="t", schedule_id="rep"), row, offset=12)
    assert caught.value.code == Code.ALREADY_CANCELLED


def test_an_update_applies_to_runs_not_fired_yet() -> None:
    parent = materialised()
    new = Recurrence(cron=normalize_cron("*/2 * * * *"))
    d = decided(UpdateCommand(tenant="t", schedule_id="rep", recurrence=new), parent, 11)
    row = d.change.row
    assert row.version == 2 and row.anchor_ms == NOW
    assert len(d.change.run_deletes) == 9
    assert row.run_count == 1  # the run at NOW stays
    assert row.materialized_until_ms == NOW + 120_000  # the next */2 run from now on
    assert {w[2] for w in d.withdraw} == {1}  # the old version's rows are refused
    # A payload-only update keeps the series and rewrites the pending runs.
    p = decided(
        UpdateCommand(tenant="t", schedule_id="rep", payload=b"x", payload_type=PayloadType.BYTES),
        parent,
        11,
    )
    assert p.change.row.payload == b"x" and p.change.row.anchor_ms == parent.anchor_ms
    assert p.change.row.materialized_until_ms == NOW + 60_000  # rewritten from the next one
    assert p.change.row.run_count == 1
    with pytest.raises(CommandRejected) as caught:
        decided(UpdateCommand(tenant="t", schedule_id="rep", due_ms=NOW + 5000), parent, 11)
    assert caught.value.code == Code.INVALID_FIELD


def test_the_command_agent_routes_recurring_commands_and_never_hands_a_parent_over() -> None:
    msg = RawCommand(partition=3, offset=10, key=b"rep", value=b"", timestamp_ms=NOW)
    kw = {"now_ms": NOW, "shards": 1, "default_tolerance_s": 3600, "firing": False}
    d = decide(create(EVERY_MINUTE), None, msg, **kw)
    assert d.change is not None and d.change.row.recurrence is not None and d.hand_over is None
    replay = decide(create(EVERY_MINUTE), d.change.row, msg, **kw)
    assert replay.hand_over is None and replay.change is None
    one_shot = replace(d.change.row, recurrence=None, applied_offset=1)
    with pytest.raises(CommandRejected) as caught:
        decide(
            UpdateCommand(tenant="t", schedule_id="rep", recurrence=EVERY_MINUTE),
            one_shot,
            replace(msg, offset=11),
            **kw,
        )
    assert caught.value.code == Code.INVALID_FIELD


def fake(rows: list[ScheduleRow]) -> FakeStore:
    """The shared fake holding ``rows`` (tenant t), its keyed parents those keyed below
    never."""
    return FakeStore(
        schedules={(r.tenant, r.schedule_id): r for r in rows},
        never_key=lambda partition: materialize_key(partition, NEVER_MS),
    )


def parent_of(store: FakeStore, sid: str) -> ScheduleRow:
    return store.schedules[("t", sid)]


def runs_of(store: FakeStore) -> dict[str, BucketRow]:
    """The bucket rows written, by run id."""
    return {key.schedule_id: row for key, row in store.bucket_rows.items()}


class FakeTicker:
    def __init__(self) -> None:
        self.offered: list[BucketRow] = []
        self.fired: list[BucketRow] = []

    def hand_over(self, row: BucketRow) -> asyncio.Future[None] | None:
        self.offered.append(row)
        return None

    async def fire_now(self, row: BucketRow) -> None:
        self.fired.append(row)


async def test_a_step_writes_runs_ahead_fires_missed_ones_and_commits() -> None:
    fresh = decided(create(EVERY_MINUTE, "a"), None).change.row
    # "b" was down for five minutes with fire_all.
    rec_b = Recurrence(cron=normalize_cron("* * * * *"), misfire="fire_all")  # type: ignore[arg-type]
    behind = replace(
        decided(create(rec_b, "b"), None).change.row,
        materialized_until_ms=NOW - 300_000,
        anchor_ms=NOW - 3_600_000,
    )
    store, ticker = fake([fresh, behind]), FakeTicker()
    m = PartitionMaterializer(
        3, store=store, ticker=ticker, config=MaterializerConfig(horizon_ms=H, catchup_per_s=1e6)
    )
    assert await m.tick(NOW) is False
    assert {r.schedule_id for r in ticker.fired} == {f"b@{NOW - i * 60_000}" for i in range(6)} | {
        f"a@{NOW}"
    }
    assert {r.schedule_id for r in ticker.offered} >= {f"a@{NOW + 60_000}"}
    assert len(runs_of(store)) == 10 + 15
    a = parent_of(store, "a")
    assert a.materialized_until_ms == NOW + H and a.run_count == 10
    assert a.materialize_key == materialize_key(3, extend_at(NOW + H, H, "a"))
    # Nothing is due any more until half a horizon later; a repeat writes the same rows.
    before = runs_of(store)
    assert await m.tick(NOW + 1000) is False and runs_of(store) == before
    await m.tick(NOW + H // 2)
    assert parent_of(store, "a").materialized_until_ms == NOW + H + H // 2


async def test_a_run_below_the_tickers_checkpoint_is_acknowledged_before_the_commit() -> None:
    # The step started at NOW, but the ticker's clock and checkpoint are a minute on (the
    # step was slow, or a previous owner's clock ran ahead): the run due at NOW + 60 s is
    # below the checkpoint, so a successor would never read its bucket row. The parent's
    # new state (which says the run is written) waits for Kafka's acknowledgement of it.
    from tests.unit.test_streams_handover import ticker_for, until
    from tests.unit.test_streams_ticker import StoredCheckpoint, running

    clock = [NOW + 61_000]
    ticker, fires = ticker_for(3, clock, StoredCheckpoint(NOW + 61_001))
    await running(ticker)
    command = replace(create(EVERY_MINUTE, "a"), misfire_tolerance_s=3600)
    store = fake([decided(command, None).change.row])
    m = PartitionMaterializer(
        3, store=store, ticker=ticker, config=MaterializerConfig(horizon_ms=H, catchup_per_s=1e6)
    )
    behind = f"a@{NOW + 60_000}"
    step = asyncio.create_task(m.tick(NOW))
    await until(lambda: f"a@{NOW}" in fires.ids)
    fires.ack(f"a@{NOW}")  # the late run, fired by the catch-up, is acknowledged
    await until(lambda: step.done() or behind in fires.ids)
    for _ in range(10):
        await asyncio.sleep(0)
    assert store.commits == 0 and not step.done()
    fires.ack(behind)
    await asyncio.wait_for(step, 1)
    assert store.commits == 1
    assert ticker.timeline.get("t", f"a@{NOW + 120_000}") is not None  # above: held
    await ticker.stop(timeout_s=0.5)


async def test_catch_up_under_the_lock_is_bounded_per_step() -> None:
    # Five schedules were down five minutes with fire_all: 6 past-due runs each. At 2
    # catch-up fires/s a step may take 4 of them, so each step handles one schedule and
    # says there is more; the lock is free between steps (commands get through), and in the
    # end every missed run fired exactly once.
    rec = Recurrence(cron=normalize_cron("* * * * *"), misfire="fire_all")  # type: ignore[arg-type]
    behind = [
        replace(
            decided(create(rec, f"p{i}"), None).change.row,
            materialized_until_ms=NOW - 300_000,
            anchor_ms=NOW - 3_600_000,
        )
        for i in range(5)
    ]
    store, ticker = fake(behind), FakeTicker()
    m = PartitionMaterializer(
        3, store=store, ticker=ticker, config=MaterializerConfig(horizon_ms=H, catchup_per_s=2)
    )

    class Instant:
        async def take(self) -> None:
            return None

    m._pacer = Instant()  # type: ignore[assignment]
    steps = []
    while True:
        before = len(ticker.fired)
        more = await m.tick(NOW)
        assert not m.lock.locked()
        steps.append(len(ticker.fired) - before)
        if not more:
            break
    assert steps[:5] == [6, 6, 6, 6, 6] and sum(steps) == 30
    assert sorted(r.schedule_id for r in ticker.fired) == sorted(
        f"p{i}@{NOW - k * 60_000}" for i in range(5) for k in range(6)
    )


async def test_runs_of_a_schedule_whose_max_runs_are_all_written_answer_at_once() -> None:
    # Rate 2 s, max_runs 3, all three written (until = NEVER): the next-runs view must not
    # walk the (endless) expression to find what was counted but not run yet.
    from streams.recurring_store import schedule_runs
    from topics.codec import recurrence_to_json

    rec = Recurrence(every_s=2, max_runs=3)
    parent = replace(
        decided(create(rec, "three"), None).change.row,
        materialized_until_ms=NEVER_MS,
        run_count=3,
        recurrence=recurrence_to_json(rec),
    )

    got = await asyncio.wait_for(
        schedule_runs(fake([parent]), "t", "three", now_ms=NOW + 3_000, past=0, upcoming=5), 5
    )
    assert got is not None
    # Runs at NOW+2 s (past), NOW+4 s and NOW+6 s (written, not run yet): two still to come.
    assert [r["nominal_ms"] for r in got["next"]] == [NOW + 4_000, NOW + 6_000]


async def test_the_due_queue_finds_each_parent_at_its_key_time_and_drops_stale_entries() -> None:
    # First start on a keyspace: one scan queues the parents keyed so far; from then on the
    # reader only reads the due queue forward, minute by minute.
    parent = decided(create(EVERY_MINUTE, "q"), None).change.row
    store, ticker = fake([parent]), FakeTicker()
    m = PartitionMaterializer(
        3, store=store, ticker=ticker, config=MaterializerConfig(horizon_ms=H)
    )
    assert await m.tick(NOW) is False
    first_key = parent_of(store, "q").materialize_key
    assert first_key is not None and store.count("keyed_parents") == 1
    at = first_key - 3 * KEY_SPAN
    assert store.queued() == {"q"} and parent_of(store, "q").materialized_until_ms == NOW + H
    # A stale entry (a key the parent no longer has) is read and dropped, not extended.
    await store.put_due([DueEntry(3, NOW + 30_000, "t", "q")])
    commits = store.commits
    assert await m.tick(NOW + 31_000) is False
    assert store.commits == commits
    # Its real key time comes: extended once, found by reading, not by scanning again.
    await m.tick(at)
    assert store.commits == commits + 1 and store.count("keyed_parents") == 1
    assert parent_of(store, "q").materialized_until_ms > NOW + H
    # Minutes read to their end are deleted (after the grace) and the position saved.
    await m.tick(at + 60_000 + 20_000)
    assert all(slot >= at - at % 60_000 for _, slot in store.due)
    assert store.cursor is not None and store.cursor[1] == at + 80_000
    # A restarted reader resumes there: no scan, and the next key is still found.
    again = PartitionMaterializer(
        3, store=store, ticker=FakeTicker(), config=MaterializerConfig(horizon_ms=H)
    )
    next_key = parent_of(store, "q").materialize_key
    assert next_key is not None
    await again.tick(next_key - 3 * KEY_SPAN)
    assert store.count("keyed_parents") == 1 and store.commits == commits + 2


async def test_a_command_entry_for_a_time_already_read_goes_after_the_reader() -> None:
    store, ticker = fake([]), FakeTicker()
    m = PartitionMaterializer(
        3, store=store, ticker=ticker, config=MaterializerConfig(horizon_ms=H)
    )
    await m.tick(NOW)  # read up to NOW
    row = decided(create(EVERY_MINUTE, "late"), None).change.row
    past = replace(row, materialize_key=materialize_key(3, NOW - 5_000))
    entries = due_entries([past], {3: m}, NOW)
    assert [e.due_ms for e in entries] == [NOW + 1]  # not NOW - 5000: the reader is past it
    # Without a local reader the entry keeps its time; a key of NEVER gets none.
    assert [e.due_ms for e in due_entries([past], {}, NOW)] == [NOW - 5_000]
    never = replace(row, materialize_key=materialize_key(3, NEVER_MS))
    assert due_entries([never], {3: m}, NOW) == []
    # The command's notify gets it extended in the next pass, before its entry is read.
    store.schedules[("t", "late")] = past
    await store.put_due(entries)
    await m.tick(NOW)
    assert store.commits == 0
    m.notify("t", "late")
    await m.tick(NOW)
    assert store.commits == 1
    assert (parent_of(store, "late").materialized_until_ms or 0) > (past.materialized_until_ms or 0)


async def test_a_failed_step_keeps_its_entries_and_the_saved_position() -> None:
    # Cassandra fails while the parents read from the queue are extended: they are tried
    # again in the next step, and the saved position never passes them meanwhile.
    parent = decided(create(EVERY_MINUTE, "f"), None).change.row
    store = fake([parent])
    m = PartitionMaterializer(
        3, store=store, ticker=FakeTicker(), config=MaterializerConfig(horizon_ms=H)
    )
    await m.tick(NOW)
    key = parent_of(store, "f").materialize_key
    assert key is not None
    at = key - 3 * KEY_SPAN
    saved = store.cursor
    commits = store.commits
    store.inject("commit", RuntimeError("cassandra gone"))
    with pytest.raises(RuntimeError):
        await m.tick(at + 61_000)
    assert store.cursor == saved and store.commits == commits
    assert await m.tick(at + 62_000) is False
    assert store.commits == commits + 1
    assert store.cursor is not None and store.cursor[1] == at + 62_000


async def test_a_big_batch_of_new_parents_is_extended_a_bounded_step_at_a_time() -> None:
    store = fake([])
    config = MaterializerConfig(horizon_ms=H, parents_per_step=2)
    m = PartitionMaterializer(3, store=store, ticker=FakeTicker(), config=config)
    await m.tick(NOW)
    for i in range(5):
        store.schedules[("t", f"n{i}")] = decided(create(EVERY_MINUTE, f"n{i}"), None).change.row
        m.notify("t", f"n{i}")
    steps = []
    while True:
        before = store.commits
        more = await m.tick(NOW)
        steps.append(store.commits - before)
        if not more:
            break
    assert steps == [2, 2, 1]

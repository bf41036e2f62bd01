"""Signed commands applied at most once and in their signer's order, across restarts.

A tenant-signed command copied off the commands topic and produced again within the
signature window gets a new offset and the broker's new time, so neither the offset the
schedule row records nor freshness refuses it; the in-memory ``SeenSignatures`` does only
while its worker has read the original. A worker restarted (or a partition moved to
another worker) starts past the original's committed offset, so the copy must be refused
by what the schedule row remembers: the signed time of the last command applied to it.

Each "restart" here is a new ``CommandProcessor`` (empty memory) on the same fake store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import orjson

from streams.commands import CommandProcessor, RawCommand
from streams.decisions import MAX_SIGNED_IN_ONE_MS, Unrowed, entries, with_unrowed
from streams.model import ScheduleChange, ScheduleRow, ScheduleState
from streams.partitioner import partition_for
from tests.unit.test_fault_properties import NOW, PARTITIONS, SECRET, FakeSink, FakeStore
from topics.codec import encode_command
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
from topics.signing import SIGNED_MAC_BYTES, TimestampType, sign_headers
from topics.validation import Limits

SID = "order-1"
KEY = SID.encode()
PARTITION = partition_for(KEY, PARTITIONS)
DUE = NOW + 3_600_000


def _create(sid: str = SID) -> CreateCommand:
    return CreateCommand(
        tenant="acme",
        schedule_id=sid,
        due_ms=DUE,
        payload=b'{"v":0}',
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://h.example/cb"),
        misfire_tolerance_s=60,
    )


def _update(version: int) -> UpdateCommand:
    return UpdateCommand(
        tenant="acme",
        schedule_id=SID,
        payload=orjson.dumps({"v": version}),
        payload_type=PayloadType.JSON,
    )


def _signed(command: Command, offset: int, signed_at: int) -> RawCommand:
    """The record a tenant produced, signed at ``signed_at`` and appended 5 ms later."""
    value = encode_command(command)
    key = command.schedule_id.encode()
    return RawCommand(
        partition=partition_for(key, PARTITIONS),
        offset=offset,
        key=key,
        value=value,
        timestamp_ms=signed_at + 5,
        headers=sign_headers(SECRET, signed_at_ms=signed_at, key=key, value=value),
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )


def _copy(record: RawCommand, offset: int) -> RawCommand:
    """``record`` produced again: a new offset and the broker's time of the copy."""
    return replace(record, offset=offset, timestamp_ms=NOW)


class Worker:
    """A worker's command agent on ``store``; a new one has forgotten every signature."""

    def __init__(self, store: FakeStore) -> None:
        self.sink = FakeSink()
        self.processor = CommandProcessor(
            store=store,
            sink=self.sink,
            tickers={},
            results_topic="t.command-results",
            partitions=PARTITIONS,
            limits=Limits(max_payload_bytes=64 * 1024),
            clock_ms=lambda: NOW,
        )

    def process(self, *records: RawCommand) -> list[dict[str, Any]]:
        before = len(self.sink.sent)
        asyncio.run(self.processor.process_batch(list(records)))
        return [orjson.loads(value) for _, _, value in self.sink.sent[before:]]


def _codes(results: list[dict[str, Any]]) -> list[str]:
    return [r["code"] for r in results]


T0 = NOW - 60_000  # the tenant's first command, a minute ago


def test_a_copied_resume_after_a_restart_does_not_undo_a_later_pause() -> None:
    store = FakeStore()
    resume = _signed(ResumeCommand(tenant="acme", schedule_id=SID), 3, T0 + 2_000)
    first = Worker(store).process(
        _signed(_create(), 1, T0),
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000),
        resume,
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 4, T0 + 3_000),
    )
    assert _codes(first) == ["ok"] * 4
    assert store.schedules[("acme", SID)].state == ScheduleState.PAUSED

    [answer] = Worker(store).process(_copy(resume, 5))
    assert (answer["code"], answer["offset"], answer["status"]) == (
        "replayed_command",
        5,
        "rejected",
    )
    assert store.schedules[("acme", SID)].state == ScheduleState.PAUSED


def test_a_copied_update_after_a_restart_does_not_overwrite_a_later_one() -> None:
    store = FakeStore()
    older = _signed(_update(1), 2, T0 + 1_000)
    first = Worker(store).process(
        _signed(_create(), 1, T0), older, _signed(_update(2), 3, T0 + 2_000)
    )
    assert _codes(first) == ["ok"] * 3
    row = store.schedules[("acme", SID)]

    [answer] = Worker(store).process(_copy(older, 4))
    assert answer["code"] == "replayed_command"
    assert store.schedules[("acme", SID)] == row  # payload {"v":2}, version and offset kept


def test_a_copy_of_the_last_command_is_refused_by_another_worker() -> None:
    """No later command to compare with: the copy carries the very signed time the row
    recorded, which a new command can never have (it is refused the same way)."""
    store = FakeStore()
    cancel = _signed(CancelCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000)
    Worker(store).process(_signed(_create(), 1, T0), cancel)
    row = store.schedules[("acme", SID)]
    assert row.state == ScheduleState.CANCELLED

    [answer] = Worker(store).process(_copy(cancel, 3))
    assert answer["code"] == "replayed_command"
    assert store.schedules[("acme", SID)] == row


def test_a_command_signed_before_the_last_applied_one_is_refused_in_the_same_batch() -> None:
    """The signer's order, not the topic's: an update signed longer before the pause
    already applied than signers' clocks differ (a copy, or a command held back and
    produced late) is not applied after it."""
    store = FakeStore()
    held_back = _signed(_update(1), 3, T0 + 1_000)
    results = Worker(store).process(
        _signed(_create(), 1, T0),
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000 + FAR_MS),
        replace(held_back, timestamp_ms=T0 + 1_010 + FAR_MS),
    )
    assert _codes(results) == ["ok", "ok", "replayed_command"]
    assert store.schedules[("acme", SID)].payload == b'{"v":0}'


def test_a_copied_create_after_a_restart_is_refused_as_a_replay() -> None:
    """The create path had no hole (a copy finds the row and is answered ``duplicate``,
    nothing applied); with the signed time recorded it is named for what it is."""
    store = FakeStore()
    create = _signed(_create(), 1, T0)
    Worker(store).process(create)
    row = store.schedules[("acme", SID)]

    [answer] = Worker(store).process(_copy(create, 2))
    assert answer["code"] == "replayed_command"
    assert store.schedules[("acme", SID)] == row


def test_the_same_record_read_again_after_a_crash_is_answered_as_before() -> None:
    """A crash replay (the same offset: its Kafka offset was not committed) is not a copy:
    it is answered with its outcome, not refused."""
    store = FakeStore()
    pause = _signed(PauseCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000)
    Worker(store).process(_signed(_create(), 1, T0), pause)

    [answer] = Worker(store).process(pause)
    assert answer["code"] == "ok"
    assert store.schedules[("acme", SID)].state == ScheduleState.PAUSED


def test_commands_signed_in_order_all_apply_after_a_restart() -> None:
    store = FakeStore()
    Worker(store).process(_signed(_create(), 1, T0), _signed(_update(1), 2, T0 + 1_000))
    [answer] = Worker(store).process(_signed(_update(2), 3, T0 + 2_000))
    assert answer["code"] == "ok"
    assert store.schedules[("acme", SID)].payload == b'{"v":2}'


def test_commands_signed_in_one_millisecond_all_apply_and_none_twice() -> None:
    """Two commands of one schedule signed in the same millisecond (a fast producer) are
    both applied; a copy of either, even of the first after the second, is not."""
    store = FakeStore()
    pause = _signed(PauseCommand(tenant="acme", schedule_id=SID), 2, T0)
    update = _signed(_update(1), 3, T0)
    first = Worker(store).process(_signed(_create(), 1, T0), pause, update)
    assert _codes(first) == ["ok", "ok", "ok"]
    row = store.schedules[("acme", SID)]
    assert (row.state, row.payload) == (ScheduleState.PAUSED, b'{"v":1}')

    again = Worker(store).process(_copy(pause, 4), _copy(update, 5))
    assert _codes(again) == ["replayed_command", "replayed_command"]
    assert store.schedules[("acme", SID)] == row


def test_the_signatures_kept_for_one_millisecond_are_bounded() -> None:
    store = FakeStore()
    updates = [_signed(_update(v), 1 + v, T0) for v in range(1, MAX_SIGNED_IN_ONE_MS + 2)]
    results = Worker(store).process(_signed(_create(), 1, T0 - 1), *updates)
    assert _codes(results) == ["ok"] * (MAX_SIGNED_IN_ONE_MS + 1) + ["replayed_command"]
    row = store.schedules[("acme", SID)]
    assert len(row.signed_macs or b"") == MAX_SIGNED_IN_ONE_MS * SIGNED_MAC_BYTES
    # Signed a millisecond later, the next is applied and the oldest kept one dropped.
    [later] = Worker(store).process(_signed(_update(99), 40, T0 + 1))
    assert later["code"] == "ok"
    row = store.schedules[("acme", SID)]
    window = entries(row.signed_at_ms, row.signed_macs)
    assert [t for t, _ in window] == [T0] * (MAX_SIGNED_IN_ONE_MS - 1) + [T0 + 1]


def test_a_copied_trigger_after_a_later_command_is_refused() -> None:
    """A trigger writes no row, so only a later command applied to the schedule refuses
    its copy (docs/wire-contract.md: a copy of the last command being a trigger fires)."""
    store = FakeStore()
    trigger = _signed(TriggerCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000)
    first = Worker(store).process(
        _signed(_create(), 1, T0),
        trigger,
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 3, T0 + 1_000 + FAR_MS),
    )
    assert _codes(first) == ["ok"] * 3
    [answer] = Worker(store).process(_copy(trigger, 4))
    assert answer["code"] == "replayed_command"


def test_an_unsigned_tenants_commands_are_not_ordered() -> None:
    """Where unsigned commands are allowed (TOCSIN_REQUIRE_SIGNED_COMMANDS=false, a tenant
    without a key) there is no signer to order by: nothing is recorded or refused."""
    store = FakeStore()
    store.tenants["acme"] = {"tenant": "acme", "active": True, "config": "{}"}
    worker = Worker(store)
    worker.processor.require_signed = False
    unsigned = [
        replace(_signed(c, i, T0), headers=())
        for i, c in enumerate((_create(), _update(1), _update(2)), start=1)
    ]
    assert _codes(worker.process(*unsigned)) == ["ok"] * 3
    assert store.schedules[("acme", SID)].signed_at_ms is None


def test_a_copied_resume_of_a_recurring_schedule_after_a_restart_is_refused() -> None:
    """Recurring schedules are decided apart (decisions.decide_recurring): the same rule."""
    store = FakeStore()
    recurring = replace(_create(), recurrence=Recurrence(every_s=60))
    resume = _signed(ResumeCommand(tenant="acme", schedule_id=SID), 3, T0 + 2_000)
    first = Worker(store).process(
        _signed(recurring, 1, T0),
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000),
        resume,
        _signed(PauseCommand(tenant="acme", schedule_id=SID), 4, T0 + 3_000),
    )
    assert _codes(first) == ["ok"] * 4
    row = store.schedules[("acme", SID)]
    assert row.state == ScheduleState.PAUSED and row.recurrence is not None

    [answer] = Worker(store).process(_copy(resume, 5))
    assert answer["code"] == "replayed_command"
    assert store.schedules[("acme", SID)] == row


class UnrowedStore(FakeStore):
    """The fake with ``signed_without_row`` (streams.signed_store): its two statements
    answered from a dict, and the statements a change commits with its row run."""

    def __init__(self) -> None:
        super().__init__()
        self.unrowed: dict[tuple[str, str], dict[str, Any]] = {}
        self.statements["signed_get"] = self._get
        self.statements["signed_put"] = self._put

    def _get(self, params: Sequence[Any]) -> list[dict[str, Any]]:
        tenant, ids = params
        return [r for (t, sid), r in self.unrowed.items() if t == tenant and sid in ids]

    def _put(self, params: Sequence[Any]) -> list[dict[str, Any]]:
        tenant, sid, at, macs, offset, _ttl = params
        self.unrowed[(tenant, sid)] = {
            "schedule_id": sid,
            "signed_at_ms": at,
            "signed_macs": macs,
            "applied_offset": offset,
        }
        return []

    async def apply_schedule_changes(
        self,
        changes: Sequence[ScheduleChange],
        *,
        before_commit: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        await super().apply_schedule_changes(changes, before_commit=before_commit)
        for change in changes:
            for name, params in change.commit_with:
                handler = self.statements.get(name)
                if handler is not None:
                    handler(params)


def test_a_copied_trigger_after_a_restart_is_refused_with_no_later_command() -> None:
    """A trigger writes no row: its signature is recorded in ``signed_without_row``, so a
    copy is refused by another worker even when nothing else changed the schedule, and the
    same record read again after a crash still fires (its run's ids are the same)."""
    store = UnrowedStore()
    trigger = _signed(TriggerCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_000)
    assert _codes(Worker(store).process(_signed(_create(), 1, T0), trigger)) == ["ok", "ok"]
    assert store.unrowed[("acme", SID)]["applied_offset"] == 2

    [copy] = Worker(store).process(_copy(trigger, 3))
    assert copy["code"] == "replayed_command"
    [again] = Worker(store).process(trigger)  # a crash replay: the same offset
    assert again["code"] == "ok"
    record = store.unrowed[("acme", SID)]
    kept = [m for _, m in entries(record["signed_at_ms"], record["signed_macs"])]
    assert len(kept) == len(set(kept)) == 2  # the create's (from the row) and the trigger's
    # A later trigger applies; a command signed before it does not.
    later = _signed(TriggerCommand(tenant="acme", schedule_id=SID), 4, T0 + 2_000)
    assert _codes(Worker(store).process(later, _copy(trigger, 5))) == ["ok", "replayed_command"]


def test_a_row_and_a_trigger_record_of_one_millisecond_count_each_signature_once() -> None:
    """A trigger's record holds the row's signatures of its millisecond as well, so the
    order check's view of the two keeps each once (the bound counts commands, not copies)."""
    a, b = bytes(16), bytes(range(16))
    row = ScheduleRow(
        tenant="acme",
        schedule_id=SID,
        partition=PARTITION,
        state=ScheduleState.SCHEDULED,
        due_ms=DUE,
        version=2,
        created_ms=T0,
        updated_ms=T0,
        applied_offset=7,
        signed_at_ms=T0,
        signed_macs=a,
    )
    judged = with_unrowed(row, Unrowed(T0, a + b, 9))
    assert judged is not None
    assert (judged.signed_macs, judged.applied_offset) == (a + b, 9)


# Signers' clocks differ (two API replicas, two producer hosts of one tenant): order is
# judged with a tolerance (TOCSIN_SIGNED_ORDER_SKEW_MS, 2,000 ms by default). These
# figures stay well inside it (1 ms) or well outside it (60 s).
FAR_MS = 60_000


def test_a_pause_signed_by_a_skewed_signer_just_before_the_applied_update_applies() -> None:
    """An update and a pause of one schedule sent 1 ms apart to two API replicas: the
    pause's replica clock is 1 ms behind, so it is signed before the update that applied."""
    store = FakeStore()
    Worker(store).process(_signed(_create(), 1, T0))
    update = _signed(_update(1), 2, T0 + 1_001)
    pause = _signed(PauseCommand(tenant="acme", schedule_id=SID), 3, T0 + 1_000)
    results = Worker(store).process(update, replace(pause, timestamp_ms=T0 + 1_010))
    assert _codes(results) == ["ok", "ok"]
    row = store.schedules[("acme", SID)]
    assert (row.state, row.payload) == (ScheduleState.PAUSED, b'{"v":1}')


def test_a_copy_of_any_command_applied_inside_the_skew_window_is_refused() -> None:
    store = FakeStore()
    Worker(store).process(_signed(_create(), 1, T0))
    update = _signed(_update(1), 2, T0 + 1_001)
    pause = _signed(PauseCommand(tenant="acme", schedule_id=SID), 3, T0 + 1_000)
    Worker(store).process(update, replace(pause, timestamp_ms=T0 + 1_010))
    row = store.schedules[("acme", SID)]

    again = Worker(store).process(_copy(update, 4), _copy(pause, 5))
    assert _codes(again) == ["replayed_command", "replayed_command"]
    assert store.schedules[("acme", SID)] == row


def test_a_copy_of_a_command_older_than_the_skew_window_is_refused() -> None:
    store = FakeStore()
    older = _signed(_update(1), 2, T0 + 1_000)
    first = Worker(store).process(
        _signed(_create(), 1, T0), older, _signed(_update(2), 3, T0 + 1_000 + FAR_MS)
    )
    assert _codes(first) == ["ok"] * 3
    row = store.schedules[("acme", SID)]

    [answer] = Worker(store).process(_copy(older, 4))
    assert answer["code"] == "replayed_command"
    assert store.schedules[("acme", SID)] == row


def test_with_more_commands_in_the_window_than_kept_a_dropped_ones_copy_is_refused() -> None:
    """Commands 1 ms apart, more than MAX_SIGNED_IN_ONE_MS of them: the oldest prefixes are
    dropped and the floor rises to the oldest kept, so a copy of a dropped one is refused
    by time (and a copy of a kept one by its prefix)."""
    store = FakeStore()
    updates = [_signed(_update(v), 1 + v, T0 + v) for v in range(1, MAX_SIGNED_IN_ONE_MS + 4)]
    results = Worker(store).process(_signed(_create(), 1, T0), *updates)
    assert _codes(results) == ["ok"] * (MAX_SIGNED_IN_ONE_MS + 4)
    row = store.schedules[("acme", SID)]

    again = Worker(store).process(_copy(updates[0], 100), _copy(updates[-2], 101))
    assert _codes(again) == ["replayed_command", "replayed_command"]
    assert store.schedules[("acme", SID)] == row


def test_triggers_from_skewed_signers_both_fire_and_neither_copy_does() -> None:
    """Triggers write no row: their record (signed_without_row) keeps the same window."""
    store = UnrowedStore()
    Worker(store).process(_signed(_create(), 1, T0))
    later = _signed(TriggerCommand(tenant="acme", schedule_id=SID), 2, T0 + 1_001)
    skewed = _signed(TriggerCommand(tenant="acme", schedule_id=SID), 3, T0 + 1_000)
    assert _codes(Worker(store).process(later, replace(skewed, timestamp_ms=T0 + 1_010))) == [
        "ok",
        "ok",
    ]
    again = Worker(store).process(_copy(later, 4), _copy(skewed, 5))
    assert _codes(again) == ["replayed_command", "replayed_command"]


def test_no_tolerance_orders_by_signed_time_alone_and_a_negative_one_is_none() -> None:
    """TOCSIN_SIGNED_ORDER_SKEW_MS=0 is the strictest order (the skewed pause refused); a
    negative value is taken as 0 rather than keeping no signature at all."""
    for skew_ms in (0, -5):
        store = FakeStore()
        worker = Worker(store)
        worker.processor = CommandProcessor(
            store=store,
            sink=worker.sink,
            tickers={},
            results_topic="t.command-results",
            partitions=PARTITIONS,
            limits=Limits(max_payload_bytes=64 * 1024),
            clock_ms=lambda: NOW,
            signed_order_skew_ms=skew_ms,
        )
        update = _signed(_update(1), 2, T0 + 1_001)
        pause = _signed(PauseCommand(tenant="acme", schedule_id=SID), 3, T0 + 1_000)
        results = worker.process(_signed(_create(), 1, T0), update, pause, _copy(update, 4))
        assert _codes(results) == ["ok", "ok", "replayed_command", "replayed_command"]

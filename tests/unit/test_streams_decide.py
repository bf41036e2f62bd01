"""``streams.decisions.decide`` as a table: every state-dependent outcome of a command."""

from __future__ import annotations

from dataclasses import replace

import pytest

from base.errors import CommandRejected
from streams.commands import RawCommand
from streams.decisions import decide
from streams.model import ScheduleRow
from topics.models import (
    CancelCommand,
    Command,
    CreateCommand,
    HttpCallback,
    PayloadType,
    UpdateCommand,
)

NOW = 1_800_000_000_000
CB = HttpCallback(url="https://h.example/cb")


def msg(offset: int) -> RawCommand:
    return RawCommand(partition=3, offset=offset, key=b"s", value=b"", timestamp_ms=NOW)


def create(due_ms: int = NOW + 60_000, payload: bytes = b"{}") -> CreateCommand:
    return CreateCommand(
        tenant="t",
        schedule_id="s",
        due_ms=due_ms,
        payload=payload,
        payload_type=PayloadType.JSON,
        callback=CB,
        misfire_tolerance_s=60,
    )


def run(
    command: Command, existing: ScheduleRow | None, offset: int = 10, firing: bool = False
) -> tuple[str, ScheduleRow | None]:
    d = decide(
        command,
        existing,
        msg(offset),
        now_ms=NOW,
        shards=1,
        default_tolerance_s=3600,
        firing=firing,
    )
    return str(d.code), d.change.row if d.change else None


def stored(**kw: object) -> ScheduleRow:
    _, row = run(create(), None, offset=5)
    assert row is not None
    return replace(row, **kw)  # type: ignore[arg-type]


def test_create_new_schedule() -> None:
    code, row = run(create(), None)
    assert code == "ok" and row is not None
    assert (row.state, row.version, row.partition, row.applied_offset) == ("scheduled", 1, 3, 10)


def test_identical_create_is_a_duplicate_and_changes_nothing() -> None:
    assert run(create(), stored()) == ("duplicate", None)


def test_create_with_other_content_is_a_conflict() -> None:
    with pytest.raises(CommandRejected) as exc:
        run(create(payload=b'{"x":1}'), stored())
    assert exc.value.code == "conflict"


def test_replayed_command_answers_its_recorded_code_without_a_change() -> None:
    row = stored(applied_offset=10, last_code="ok")
    assert run(CancelCommand(tenant="t", schedule_id="s"), row, offset=10) == ("ok", None)
    assert run(CancelCommand(tenant="t", schedule_id="s"), row, offset=7) == ("ok", None)


def test_reschedule_bumps_the_version_and_moves_the_bucket() -> None:
    d = decide(
        UpdateCommand(tenant="t", schedule_id="s", due_ms=NOW + 120_000),
        stored(),
        msg(10),
        now_ms=NOW,
        shards=1,
        default_tolerance_s=3600,
        firing=False,
    )
    assert str(d.code) == "ok" and d.change is not None
    assert d.change.row.version == 2 and d.change.row.due_ms == NOW + 120_000
    assert d.change.old_bucket is not None and d.change.new_bucket is not None
    assert d.change.old_bucket.due_ms == NOW + 60_000
    assert d.withdraw_version == 1  # stale rows of version 1 must not fire


def test_cancel_removes_the_bucket_row() -> None:
    d = decide(
        CancelCommand(tenant="t", schedule_id="s"),
        stored(),
        msg(10),
        now_ms=NOW,
        shards=1,
        default_tolerance_s=3600,
        firing=False,
    )
    assert d.change is not None and d.change.row.state == "cancelled"
    assert d.change.new_bucket is None and d.change.old_bucket is not None
    assert d.hand_over is None


@pytest.mark.parametrize(
    ("existing", "firing", "code"),
    [
        (None, False, "not_found"),
        ("cancelled", False, "already_cancelled"),
        ("fired", False, "already_fired"),
        ("missed", False, "already_fired"),
        ("scheduled", True, "already_fired"),  # emitted, not yet recorded
    ],
)
def test_changes_to_finished_or_missing_schedules_are_rejected(
    existing: str | None, firing: bool, code: str
) -> None:
    row = None if existing is None else stored(state=existing)
    for command in (
        CancelCommand(tenant="t", schedule_id="s"),
        UpdateCommand(tenant="t", schedule_id="s", due_ms=NOW + 1000),
    ):
        with pytest.raises(CommandRejected) as exc:
            run(command, row, firing=firing)
        assert exc.value.code == code


def test_reschedule_into_the_past_beyond_tolerance_is_rejected() -> None:
    with pytest.raises(CommandRejected) as exc:
        run(UpdateCommand(tenant="t", schedule_id="s", due_ms=NOW - 61_000), stored())
    assert exc.value.code == "due_in_past"

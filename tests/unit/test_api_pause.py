"""Bulk pause and resume (api.service): which schedules a request selects (state, id
prefix, due window, recurring ones whatever their times, the per-request limit), and that
one refused row is reported while the others proceed. The request body's checks
(api.views.parse_bulk_scope)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from api.service import toggle_targets
from api.views import ApiError, parse_bulk_scope
from base.errors import KafkaError
from streams.model import ScheduleState
from tests.unit.test_api_bulk import DUE_MS, TENANT, FakeBridge, service, store_with
from topics.codes import Code


def with_recurring(state: ScheduleState) -> object:
    """The bulk tests' store (one-shots a, b, c due at DUE_MS + n) and the recurring
    schedule "a-cron" (no listing-index entry, like every recurring parent)."""
    store = store_with(state)
    parent = replace(
        store.schedules[(TENANT, "a")],
        schedule_id="a-cron",
        recurrence='{"every_s":60}',
        due_ms=DUE_MS + 10**9,
    )
    store.schedules[(TENANT, "a-cron")] = parent
    store.recurring_index.setdefault(TENANT, {})["a-cron"] = 0
    return store


def targets(store: object, state: ScheduleState, **kw: object) -> tuple[list[str], bool]:
    scope: dict[str, object] = {"from_ms": DUE_MS, "to_ms": DUE_MS + 10, **kw}
    rows, more = asyncio.run(toggle_targets(store, TENANT, state, **scope))  # type: ignore[arg-type]
    return [str(r["schedule_id"]) for r in rows], more


def test_bulk_selection_takes_the_state_the_action_changes() -> None:
    assert targets(with_recurring(ScheduleState.SCHEDULED), ScheduleState.SCHEDULED) == (
        ["a", "b", "c", "a-cron"],
        False,
    )
    assert targets(with_recurring(ScheduleState.SCHEDULED), ScheduleState.PAUSED) == ([], False)
    assert targets(with_recurring(ScheduleState.PAUSED), ScheduleState.PAUSED)[0] == [
        "a",
        "b",
        "c",
        "a-cron",
    ]


def test_bulk_selection_by_prefix_window_and_limit() -> None:
    store = with_recurring(ScheduleState.SCHEDULED)
    running = ScheduleState.SCHEDULED
    assert targets(store, running, id_prefix="a") == (["a", "a-cron"], False)
    # The window bounds one-shots only; a recurring schedule has no one due time.
    assert targets(store, running, to_ms=DUE_MS + 1) == (["a", "a-cron"], False)
    assert targets(store, running, limit=2) == (["a", "b"], True)
    assert targets(store, running, limit=3) == (["a", "b", "c"], True)


def test_bulk_pause_reports_the_row_kafka_refused_and_pauses_the_others() -> None:
    store = with_recurring(ScheduleState.SCHEDULED)
    bridge = FakeBridge(refuse={"b": KafkaError("message too large", retriable=False)})
    answer = asyncio.run(
        service(store, bridge).bulk_toggle(  # type: ignore[arg-type]
            TENANT, "pause", DUE_MS, DUE_MS + 10
        )
    )
    assert sorted(bridge.commands) == ["a", "a-cron", "c"]
    assert (answer["matched"], answer["paused"], answer["codes"]) == (4, 3, {Code.OK: 3})
    assert answer["failed"] == [
        {"schedule_id": "b", "code": "failed", "message": "message too large", "retriable": False}
    ]


def test_bulk_scope_defaults_and_refusals() -> None:
    now = 1_800_000_000_000
    year = 365 * 86_400_000
    assert parse_bulk_scope({}, now_ms=now, default_span_ms=year) == (
        now - 86_400_000,
        now + year,
        "",
    )
    assert parse_bulk_scope(
        {"from": now, "to": now + 5, "id_prefix": "x-"}, now_ms=now, default_span_ms=year
    ) == (now, now + 5, "x-")
    for bad in ({"status": "paused"}, {"id_prefix": 3}, {"from": now, "to": now}):
        with pytest.raises(ApiError) as caught:
            parse_bulk_scope(bad, now_ms=now, default_span_ms=year)
        assert caught.value.status == 400


def test_bulk_selection_keeps_only_the_ids_it_sends_commands_for() -> None:
    """Up to 10,000 rows are selected per request: holding each row whole would hold up
    to 10,000 payloads (64 KiB each by default) for the whole request."""
    store = with_recurring(ScheduleState.SCHEDULED)
    scope: dict[str, object] = {"from_ms": DUE_MS, "to_ms": DUE_MS + 10}
    rows, _ = asyncio.run(toggle_targets(store, TENANT, ScheduleState.SCHEDULED, **scope))  # type: ignore[arg-type]
    assert len(rows) == 4
    assert all(set(r) == {"schedule_id"} for r in rows)

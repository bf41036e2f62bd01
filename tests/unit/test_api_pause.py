"""Bulk pause and resume (api.service): which schedules a request selects (state, id
prefix, due window, recurring ones whatever their times, the per-request limit), and that
one refused row is reported while the others proceed. The request body's checks
(api.views.parse_bulk_scope)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from api import service as api_service
from api.service import toggle_targets
from api.views import ApiError, parse_bulk_scope
from base.errors import KafkaError
from streams.model import ScheduleState
from tests.fakes import FakeStore
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
    rows, stopped_at = asyncio.run(toggle_targets(store, TENANT, state, **scope))  # type: ignore[arg-type]
    return [str(r["schedule_id"]) for r in rows], stopped_at is not None


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


class CountingStore(FakeStore):
    """Counts the index rows and recurring ids it hands out."""

    rows_read = 0

    async def read_index(self, *args: Any, **kwargs: Any) -> list[tuple[int, str]]:
        page = await super().read_index(*args, **kwargs)
        self.rows_read += len(page)
        return page

    async def list_recurring(self, tenant: str) -> list[str]:
        ids = await super().list_recurring(tenant)
        self.rows_read += len(ids)
        return ids

    async def list_recurring_page(self, tenant: str, *, after: str, limit: int) -> list[str]:
        ids = await super().list_recurring_page(tenant, after=after, limit=limit)
        self.rows_read += len(ids)
        return ids


def mixed_store() -> CountingStore:
    """60 one-shots due at DUE_MS + n (every third one paused) and 15 recurring ones
    (every third one paused): 40 + 10 scheduled to select."""
    store = CountingStore()
    store.tenants[TENANT] = {"tenant": TENANT, "active": True}
    base = store_with(ScheduleState.SCHEDULED).schedules[(TENANT, "a")]  # type: ignore[attr-defined]
    for n in range(60):
        state = ScheduleState.PAUSED if n % 3 == 0 else ScheduleState.SCHEDULED
        sid = f"o{n:03d}"
        store.schedules[(TENANT, sid)] = replace(
            base, schedule_id=sid, due_ms=DUE_MS + n, state=state
        )
        store.index.setdefault(TENANT, set()).add((DUE_MS + n, sid))
    for n in range(15):
        state = ScheduleState.PAUSED if n % 3 == 0 else ScheduleState.SCHEDULED
        sid = f"r{n:03d}"
        store.schedules[(TENANT, sid)] = replace(
            base, schedule_id=sid, recurrence='{"every_s":60}', due_ms=DUE_MS + 10**9, state=state
        )
        store.recurring_index.setdefault(TENANT, {})[sid] = 0
    return store


def test_bulk_selection_reads_at_most_the_scan_bound_and_goes_on_from_its_cursor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request reads at most MAX_BULK_SCAN_ROWS index rows, whatever it selects; the
    cursor it answers goes on from there, through the index then the recurring ones,
    with no schedule missed or selected twice."""
    monkeypatch.setattr(api_service, "MAX_BULK_SCAN_ROWS", 20, raising=False)
    monkeypatch.setattr(api_service, "_SCAN_PAGE", 7, raising=False)
    store = mixed_store()
    scope: dict[str, Any] = {"from_ms": DUE_MS, "to_ms": DUE_MS + 1000}
    picked: list[str] = []
    cursor = None
    requests = 0
    while True:
        store.rows_read = 0
        more = {"cursor": cursor} if requests else {}
        rows, cursor = asyncio.run(
            toggle_targets(store, TENANT, ScheduleState.SCHEDULED, **scope, **more)  # type: ignore[arg-type]
        )
        requests += 1
        assert store.rows_read <= 20
        picked += [str(r["schedule_id"]) for r in rows]
        if cursor is None:
            break
        assert requests < 10
    expected = [f"o{n:03d}" for n in range(60) if n % 3] + [f"r{n:03d}" for n in range(15) if n % 3]
    assert picked == expected
    assert requests == 4  # 75 rows, 20 a request


def test_bulk_selection_stops_at_its_limit_and_goes_on_after_the_last_selected() -> None:
    store = mixed_store()
    scope = {"from_ms": DUE_MS, "to_ms": DUE_MS + 1000, "limit": 25}
    rows, cursor = asyncio.run(toggle_targets(store, TENANT, ScheduleState.SCHEDULED, **scope))  # type: ignore[arg-type]
    first = [str(r["schedule_id"]) for r in rows]
    assert len(first) == 25 and cursor is not None
    # It stopped at its 25th selection (one-shot o037), before the recurring ones.
    assert first[-1] == "o037"
    assert store.calls_of("list_recurring_page") == []
    rows, cursor = asyncio.run(
        toggle_targets(store, TENANT, ScheduleState.SCHEDULED, cursor=cursor, **scope)  # type: ignore[arg-type]
    )
    second = [str(r["schedule_id"]) for r in rows]
    assert cursor is not None  # its limit reached again: the last recurring one
    rows, cursor = asyncio.run(
        toggle_targets(store, TENANT, ScheduleState.SCHEDULED, cursor=cursor, **scope)  # type: ignore[arg-type]
    )
    assert (rows, cursor) == ([], None)
    assert first + second == [f"o{n:03d}" for n in range(60) if n % 3] + [
        f"r{n:03d}" for n in range(15) if n % 3
    ]


def test_bulk_pause_answers_a_next_cursor_the_next_request_takes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(api_service, "MAX_BULK_SCAN_ROWS", 50, raising=False)
    store = mixed_store()
    bridge = FakeBridge()
    svc = service(store, bridge)
    first = asyncio.run(svc.bulk_toggle(TENANT, "pause", DUE_MS, DUE_MS + 1000))  # type: ignore[arg-type]
    assert first["truncated"] is True and isinstance(first["next_cursor"], str)
    second = asyncio.run(
        svc.bulk_toggle(TENANT, "pause", DUE_MS, DUE_MS + 1000, "", first["next_cursor"])  # type: ignore[arg-type]
    )
    assert (second["truncated"], second["next_cursor"]) == (False, None)
    assert first["matched"] + second["matched"] == 50  # type: ignore[operator]
    assert len(bridge.commands) == len(set(bridge.commands)) == 50
    with pytest.raises(ApiError) as caught:
        asyncio.run(svc.bulk_toggle(TENANT, "pause", DUE_MS, DUE_MS + 1000, "", "nonsense"))  # type: ignore[arg-type]
    assert caught.value.status == 400

"""The reads behind recurring schedules in the REST API, the CLI and the go-scheduler
facade: a parent's status and runs, and the parents of a listing window (the pure parts
are in ``api.recurring``). ``store`` is a connected ``streams.store.Store``, typed by the
narrowest port (streams.ports) each read needs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from api import recurring
from api.recurring import Key
from api.views import ApiError
from streams.decisions import ScheduleRuns
from streams.model import ScheduleState
from streams.ports import CqlRow, IndexReader, MaterializerStore, StatementRunner
from streams.recurring import NEVER_MS, parse_run_id
from streams.recurring_store import RecurringStore, schedule_runs

# One listing page reads the newest run of at most this many finished parents at once.
_CONCURRENCY = 64
_STATEMENTS = {
    # The oldest written run of a parent in a window (recurring_runs is newest first).
    "api_first_run_between": "SELECT nominal_ms FROM {keyspace}.recurring_runs "
    "WHERE tenant = ? AND schedule_id = ? AND nominal_ms >= ? AND nominal_ms < ? "
    "ORDER BY nominal_ms ASC LIMIT 1",
}


class RecurringReads(MaterializerStore, IndexReader, Protocol):
    """What a listing's recurring reads call: a tenant's recurring index, the parents' rows
    and their run history."""


class ParentView(Protocol):
    """How a listing shows a recurring parent (``api.recurring.parent_brief`` by default)."""

    def __call__(
        self, row: CqlRow, *, status: str, position_ms: int, next_ms: int | None
    ) -> dict[str, object]: ...


class OneShotLister(Protocol):
    """A page of one-shot schedule rows in a window (``Service.list_schedules``)."""

    async def __call__(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        statuses: frozenset[str] | None,
        limit: int,
        after: Key | None,
    ) -> tuple[list[CqlRow], Key | None]: ...


async def first_written_run(
    store: StatementRunner, tenant: str, schedule_id: str, from_ms: int, to_ms: int
) -> int | None:
    """Nominal time of the oldest run written for a parent in ``[from_ms, to_ms)``."""
    if not store.has_statements(_STATEMENTS):
        await store.prepare_statements(_STATEMENTS)
    rows = await store.run("api_first_run_between", (tenant, schedule_id, from_ms, to_ms))
    return int(rows[0]["nominal_ms"]) if rows else None


async def newest_run(
    store: MaterializerStore, tenant: str, schedule_id: str
) -> tuple[int, int] | None:
    """(nominal_ms, due_ms) of the newest run written for a parent, or None."""
    rows = await RecurringStore(store).past_runs(tenant, schedule_id, NEVER_MS + 1, 1)
    return (int(rows[0]["nominal_ms"]), int(rows[0]["due_ms"])) if rows else None


async def parent_state(
    store: MaterializerStore, row: CqlRow, *, now_ms: int
) -> tuple[ScheduleState, int | None, int | None]:
    """(status, next run ms, newest written run's nominal ms once none is left to write)."""
    last = (
        await newest_run(store, row["tenant"], row["schedule_id"])
        if recurring.runs_out(row)
        else None
    )
    return _state(row, last, now_ms)


def _state(
    row: CqlRow, last: tuple[int, int] | None, now_ms: int
) -> tuple[ScheduleState, int | None, int | None]:
    status = recurring.parent_status(
        row, now_ms=now_ms, last_due_ms=None if last is None else last[1]
    )
    rec = recurring.recurrence_of(row)
    last_nominal = None if last is None else last[0]
    nxt = (
        recurring.next_run(row, rec, now_ms=now_ms, last_nominal_ms=last_nominal)
        if status == ScheduleState.SCHEDULED
        else None
    )
    return status, nxt, last_nominal


async def _newest_runs(
    store: MaterializerStore, rows: list[CqlRow]
) -> list[tuple[int, int] | None]:
    """The newest written run of each parent that has none left to write (None for the
    others), at most ``_CONCURRENCY`` reads at once."""
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(row: CqlRow) -> tuple[int, int] | None:
        if not recurring.runs_out(row):
            return None
        async with sem:
            return await newest_run(store, row["tenant"], row["schedule_id"])

    return list(await asyncio.gather(*(one(r) for r in rows)))


ParentState = tuple[ScheduleState, int | None, int | None, int | None]


async def _states(
    store: MaterializerStore,
    rows: list[CqlRow],
    *,
    now_ms: int,
    window: tuple[int, int] | None = None,
) -> list[ParentState]:
    """(status, next run, newest written nominal, first run in ``window``) of each parent.
    Evaluating thousands of rules (croniter) is CPU work: it runs in a thread, so one
    tenant's large listing does not hold the API's event loop from everyone else's
    requests (the thread yields the interpreter lock every switch interval)."""
    lasts = await _newest_runs(store, rows)

    def evaluate() -> list[ParentState]:
        out = []
        for row, last in zip(rows, lasts, strict=True):
            status, nxt, last_nominal = _state(row, last, now_ms)
            at = None
            if window is not None:
                at = recurring.window_run(
                    row,
                    recurring.recurrence_of(row),
                    from_ms=window[0],
                    to_ms=window[1],
                    last_nominal_ms=last_nominal,
                )
            out.append((status, nxt, last_nominal, at))
        return out

    return await asyncio.to_thread(evaluate)


async def runs(
    store: MaterializerStore,
    tenant: str,
    schedule_id: str,
    *,
    now_ms: int,
    past: int,
    upcoming: int,
    before_ms: int | None = None,
    after_ms: int | None = None,
) -> ScheduleRuns | None:
    """Past runs (newest first; nominal time before ``before_ms``, default now) with their
    state, and the next ``upcoming`` runs (after ``after_ms`` when later than now); None if
    there is no such recurring schedule."""
    row = await store.get_schedule(tenant, schedule_id)
    if row is None or not recurring.is_parent(row):
        return None
    split = now_ms if before_ms is None else min(before_ms, now_ms)
    # Past runs with their state from the materialiser's history; the next runs are
    # computed here (api.recurring.upcoming: bounded, also once every run is written).
    got = await schedule_runs(store, tenant, schedule_id, now_ms=split, past=past, upcoming=0)
    if got is None:
        return None
    last = await newest_run(store, tenant, schedule_id) if recurring.runs_out(row) else None
    got["next"] = recurring.upcoming(
        row,
        recurring.recurrence_of(row),
        now_ms=now_ms,
        n=upcoming,
        after_ms=after_ms,
        last_nominal_ms=None if last is None else last[0],
    )
    return got


def _brief(row: CqlRow, *, status: str, position_ms: int, next_ms: int | None) -> dict[str, object]:
    return recurring.parent_brief(row, status=status, position_ms=position_ms, next_ms=next_ms)


async def parents_in_window(
    store: RecurringReads,
    tenant: str,
    *,
    from_ms: int,
    to_ms: int,
    statuses: frozenset[str] | None,
    after: Key | None,
    now_ms: int,
    view: ParentView = _brief,
) -> list[tuple[Key, dict[str, object]]]:
    """The tenant's recurring schedules with a run in ``[from_ms, to_ms)`` (and a status in
    ``statuses``), keyed by (first run in the window, id), after ``after``, in key order;
    each with its listing view (``view(row, status=, position_ms=, next_ms=)``, default
    ``api.recurring.parent_brief``)."""
    if statuses is not None and not statuses & set(recurring.PARENT_STATUSES):
        return []
    ids = await store.list_recurring(tenant)
    if not ids:
        return []
    rows = [r for r in (await store.get_schedules(tenant, ids)).values() if recurring.is_parent(r)]
    states = await _states(store, rows, now_ms=now_ms, window=(from_ms, to_ms))
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(
        row: CqlRow, status: str, nxt: int | None, at: int | None
    ) -> tuple[Key, dict[str, object]] | None:
        if statuses is not None and status not in statuses:
            return None
        changed = recurring.rule_changed_ms(row)
        if changed is not None and from_ms < changed:
            # Runs of an earlier rule (before the update that changed it): the history.
            async with sem:
                old = await first_written_run(
                    store, row["tenant"], row["schedule_id"], from_ms, min(to_ms, changed)
                )
            at = old if at is None or (old is not None and old < at) else at
        if at is None:
            return None
        key = (at, str(row["schedule_id"]))
        if after is not None and key <= after:
            return None
        return key, view(row, status=status, position_ms=at, next_ms=nxt)

    found = await asyncio.gather(
        *(one(row, status, nxt, at) for row, (status, nxt, _, at) in zip(rows, states, strict=True))
    )
    return sorted((f for f in found if f is not None), key=lambda item: item[0])


async def list_page(
    store: RecurringReads,
    list_one_shots: OneShotLister,
    brief: Callable[[CqlRow], dict[str, object]],
    tenant: str,
    *,
    from_ms: int,
    to_ms: int,
    statuses: frozenset[str] | None,
    limit: int,
    after: Key | None,
    now_ms: int,
    parent_view: ParentView = _brief,
) -> tuple[list[dict[str, object]], Key | None]:
    """A listing page of one-shot schedules (``list_one_shots``, e.g.
    ``Service.list_schedules``; ``brief`` turns its rows into views) and recurring parents,
    merged in key order, and the cursor after it (None at the end)."""
    # "completed" is a parent's status only; the others apply to both kinds.
    one_statuses = None if statuses is None else statuses - {ScheduleState.COMPLETED}
    if one_statuses is not None and not one_statuses:
        rows: list[CqlRow] = []
        cursor: Key | None = None
    else:
        rows, cursor = await list_one_shots(
            tenant, from_ms=from_ms, to_ms=to_ms, statuses=one_statuses, limit=limit, after=after
        )
    parents = await parents_in_window(
        store,
        tenant,
        from_ms=from_ms,
        to_ms=to_ms,
        statuses=statuses,
        after=after,
        now_ms=now_ms,
        view=parent_view,
    )
    one_shots = [((int(r["due_ms"]), str(r["schedule_id"])), brief(r)) for r in rows]
    return recurring.merge_page(one_shots, cursor, parents, limit)


async def tenant_parents(
    store: RecurringReads, tenant: str, *, now_ms: int
) -> list[tuple[CqlRow, ScheduleState, int | None]]:
    """Every recurring schedule of the tenant still stored: (row, status, next run ms)."""
    ids = await store.list_recurring(tenant)
    rows = await store.get_schedules(tenant, ids) if ids else {}
    parents = [r for r in rows.values() if recurring.is_parent(r)]
    states = await _states(store, parents, now_ms=now_ms)
    return [(row, status, nxt) for row, (status, nxt, _, _) in zip(parents, states, strict=True)]


async def schedule_json(
    store: MaterializerStore,
    row: CqlRow,
    events: list[CqlRow],
    *,
    now_ms: int,
    past: int,
    upcoming: int,
) -> dict[str, Any]:
    """``GET /v1/schedules/{id}`` of a recurring parent (with its newest ``past`` and next
    ``upcoming`` runs), or of one of its runs (``<parent>@<nominal_ms>``)."""
    if recurring.is_parent(row):
        status, nxt, _ = await parent_state(store, row, now_ms=now_ms)
        got = await runs(
            store, row["tenant"], row["schedule_id"], now_ms=now_ms, past=past, upcoming=upcoming
        )
        return recurring.parent_view(row, events, status=status, next_ms=nxt, runs=got)
    parsed = parse_run_id(str(row["schedule_id"]))
    if parsed is None:
        raise ApiError(404, "not_found", f"no schedule {row['schedule_id']!r}")
    return recurring.run_row_view(row, events, parent_id=parsed[0], nominal_ms=parsed[1])


def runs_json(got: ScheduleRuns) -> dict[str, object]:
    """The answer of ``GET /v1/schedules/{id}/runs`` from ``runs``."""
    return {
        "schedule_id": got["schedule_id"],
        "tenant": got["tenant"],
        "recurrence": recurring.recurrence_json(got["recurrence"]),
        "runs_written": got.get("run_count"),
        "past": [recurring.run_view(r) for r in got["past"]],
        "next": [recurring.run_view(r) for r in got["next"]],
    }

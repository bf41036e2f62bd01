"""Recurring schedules in the REST API, the CLI and the go-scheduler facade (pure): the
status of a parent, which parents a listing window holds and where, and their JSON views.
No I/O and no clock (``now_ms`` is passed in); the reads are in ``api.recurring_io``.

A recurring schedule is listed *once per listing*, at its first nominal run time inside the
window ``[from, to)``: "what runs in this window" includes it when it has a run there.
Runs are computed from its current recurrence, from when that recurrence was set (its
create, or the update that last changed it) until it was cancelled or ran out (``end``,
``max_runs``); runs of an earlier rule come from the run history (``api.recurring_io``).
Its individual runs are not listed; ``GET /v1/schedules/{id}/runs`` is their history. See
docs/api.md ("Listing").
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, TypeVar

import orjson

from api.views import callback_view, delivery_view, event_view, payload_view, settings_view
from streams.decisions import Run, ScheduleRuns
from streams.model import ScheduleState
from streams.ports import CqlRow
from streams.recurring import NEVER_MS, jitter_ms, next_runs, occurrences, run_id, series_start
from topics.codec import recurrence_from_json
from topics.ids import format_iso_ms, trigger_id
from topics.models import Recurrence

# A recurring parent's statuses: runs to come, cancelled, or none left (end / max_runs).
PARENT_STATUSES = (
    ScheduleState.SCHEDULED,
    ScheduleState.PAUSED,
    ScheduleState.CANCELLED,
    ScheduleState.COMPLETED,
)
# Counting the runs between the materialised part and a window (for max_runs) stops here;
# beyond it the window check assumes the schedule still runs (docs/api.md).
MAX_COUNTED_RUNS = 100_000

Key = tuple[int, str]  # (position ms, schedule id): the listing order and cursor
T = TypeVar("T")


def is_parent(row: CqlRow) -> bool:
    return row.get("recurrence") is not None


def recurrence_of(row: CqlRow) -> Recurrence:
    return _parse(str(row["recurrence"]))


@functools.lru_cache(maxsize=4096)
def _parse(text: str) -> Recurrence:
    # A listing evaluates every parent of a tenant on every page; many share a rule.
    return recurrence_from_json(text)


def _first_at(rec: Recurrence, lo_ms: int, anchor_ms: int) -> int:
    """The first occurrence at or after ``lo_ms`` (already past the series start)."""
    if rec.cron is not None:
        return _first_cron(rec, lo_ms)
    return next(occurrences(rec, lo_ms, anchor_ms=anchor_ms), NEVER_MS)


@functools.lru_cache(maxsize=65_536)
def _first_cron(rec: Recurrence, lo_ms: int) -> int:
    # A cron's occurrences do not depend on its anchor once lo is past the series start,
    # so schedules sharing a rule share this within a listing page (same window, same now):
    # building croniter's parser dominates the cost of a listing.
    return next(occurrences(rec, lo_ms, anchor_ms=lo_ms), NEVER_MS)


def _begin(rec: Recurrence, anchor_ms: int, at_ms: int) -> int:
    """Where to look for runs at or after ``at_ms``: runs start at the first occurrence at
    or after both the series start and the moment the rule was set (``first_run``)."""
    return max(at_ms, series_start(rec, anchor_ms), anchor_ms)


def _anchor(row: CqlRow) -> int:
    return int(row.get("anchor_ms") or row.get("created_ms") or 0)


def _state(row: CqlRow) -> str:
    """The stored state (a row without one is scheduled)."""
    return str(row.get("state") or ScheduleState.SCHEDULED)


def _until(row: CqlRow) -> int:
    return int(row.get("materialized_until_ms") or 0)


def rule_changed_ms(row: CqlRow) -> int | None:
    """When an update last replaced the recurrence (its runs before that followed an
    earlier rule), or None if the rule is the create's."""
    anchor, created = row.get("anchor_ms"), row.get("created_ms")
    return int(anchor) if anchor is not None and created is not None and anchor > created else None


def runs_out(row: CqlRow) -> bool:
    """Every run of the schedule has been written ahead (or dropped): none is left to
    compute. Its last runs may still be waiting for their time (``parent_status``)."""
    return _until(row) >= NEVER_MS


def parent_status(row: CqlRow, *, now_ms: int, last_due_ms: int | None) -> ScheduleState:
    """scheduled | paused | cancelled | completed. ``last_due_ms``: due time of the newest
    written run (only needed once ``runs_out``): the schedule completes when that one is
    due."""
    state = _state(row)
    if state in (ScheduleState.CANCELLED, ScheduleState.PAUSED):
        return ScheduleState(state)
    if state != ScheduleState.SCHEDULED:
        return ScheduleState.COMPLETED  # a state the materialiser never writes: finished
    if runs_out(row) and (last_due_ms is None or last_due_ms <= now_ms):
        return ScheduleState.COMPLETED
    return ScheduleState.SCHEDULED


def _counted_before(row: CqlRow, rec: Recurrence, at_ms: int) -> int:
    """Runs of the series before ``at_ms`` (for ``max_runs``), from the parent's run count
    (the runs before ``materialized_until_ms``). Bounded work: at most the run count, or
    ``MAX_COUNTED_RUNS`` occurrences after the materialised part."""
    count = int(row.get("run_count") or 0)
    until = _until(row)
    anchor = _anchor(row)
    if until > at_ms:
        # Runs in [at, until) are in the count: take them off (until is at most a horizon
        # ahead; callers handle runs_out, where it is the end of time).
        for nominal in occurrences(rec, at_ms, anchor_ms=anchor):
            if nominal >= until or count <= 0:
                break
            count -= 1
    elif until < at_ms:
        for nominal in itertools.islice(
            occurrences(rec, until, anchor_ms=anchor), MAX_COUNTED_RUNS
        ):
            if nominal >= at_ms:
                break
            count += 1
    return count


def upcoming(
    row: CqlRow,
    rec: Recurrence,
    *,
    now_ms: int,
    n: int,
    after_ms: int | None = None,
    last_nominal_ms: int | None = None,
) -> list[Run]:
    """The next ``n`` runs of a scheduled parent from ``now_ms`` (or from ``after_ms`` when
    later: paging), honouring ``end`` and ``max_runs``: run id, nominal and due time (with
    jitter) and trigger id, as ``streams.recurring_store.schedule_runs`` reports them. Once
    every run is written (``runs_out``) they are those up to ``last_nominal_ms``, the newest
    written run."""
    if n <= 0 or _state(row) != ScheduleState.SCHEDULED:
        return []
    anchor = _anchor(row)
    at = _begin(rec, anchor, now_ms if after_ms is None else max(now_ms, after_ms))
    tenant, sid = str(row["tenant"]), str(row["schedule_id"])
    if runs_out(row):
        last = -1 if last_nominal_ms is None else last_nominal_ms
        ahead = itertools.takewhile(lambda t: t <= last, occurrences(rec, at, anchor_ms=anchor))
        nominals = list(itertools.islice(ahead, n))
    else:
        # Counting runs only matters for max_runs (it costs an enumeration).
        counted = 0 if rec.max_runs is None else _counted_before(row, rec, at)
        nominals = next_runs(rec, at, n, anchor_ms=anchor, counted=counted)
    out: list[Run] = []
    for nominal in nominals:
        rid = run_id(sid, nominal)
        due = nominal + jitter_ms(tenant, rid, rec.jitter_s)
        out.append(
            Run(run_id=rid, nominal_ms=nominal, due_ms=due, trigger_id=trigger_id(tenant, rid, due))
        )
    return out


def next_run(
    row: CqlRow, rec: Recurrence, *, now_ms: int, last_nominal_ms: int | None = None
) -> int | None:
    """Nominal time of the next run after ``now_ms`` of a scheduled parent, or None
    (``last_nominal_ms`` as for ``upcoming``)."""
    if _state(row) != ScheduleState.SCHEDULED:
        return None
    if rec.max_runs is None and not runs_out(row):
        at = _first_at(rec, _begin(rec, _anchor(row), now_ms), _anchor(row))
        return at if at < NEVER_MS else None
    found = upcoming(row, rec, now_ms=now_ms, n=1, last_nominal_ms=last_nominal_ms)
    return int(found[0]["nominal_ms"]) if found else None


def window_run(
    row: CqlRow,
    rec: Recurrence,
    *,
    from_ms: int,
    to_ms: int,
    last_nominal_ms: int | None = None,
) -> int | None:
    """Nominal time of the parent's first run in ``[from_ms, to_ms)``, or None.

    The series starts at the first run after its recurrence was set (``anchor_ms``) and
    stops at a cancel (``updated_ms`` of a cancelled row), at ``end``, at ``max_runs``, and
    - once every run is written (``runs_out``) - at ``last_nominal_ms``, the newest written
    run.
    """
    anchor = _anchor(row)
    lo = _begin(rec, anchor, from_ms)
    hi = to_ms
    if _state(row) == ScheduleState.CANCELLED and row.get("updated_ms") is not None:
        hi = min(hi, int(row["updated_ms"]) + 1)
    if runs_out(row):
        if last_nominal_ms is None:
            return None
        hi = min(hi, last_nominal_ms + 1)
    if lo >= hi:
        return None
    at = _first_at(rec, lo, anchor)
    if at >= hi:
        return None
    until = _until(row)
    if rec.max_runs is not None and at >= until:
        left = rec.max_runs - int(row.get("run_count") or 0)
        ahead = itertools.islice(occurrences(rec, until, anchor_ms=anchor), MAX_COUNTED_RUNS)
        # Runs from the materialised part up to the window's first run: is any left?
        used = sum(1 for _ in itertools.takewhile(lambda nominal: nominal < at, ahead))
        if used < MAX_COUNTED_RUNS and used >= left:
            return None
    return at


def recurrence_view(row: CqlRow) -> dict[str, object]:
    """The stored recurrence in its wire form (times as epoch ms), as a create sends it."""
    return recurrence_json(row["recurrence"])


def recurrence_json(text: str) -> dict[str, object]:
    """A stored recurrence's JSON text in its wire form."""
    value: dict[str, object] = orjson.loads(text)
    return value


def _iso(ms: int | None) -> str | None:
    return None if ms is None or not 0 <= ms <= NEVER_MS else format_iso_ms(ms)


def parent_brief(
    row: CqlRow, *, status: str, position_ms: int, next_ms: int | None
) -> dict[str, object]:
    """A parent in a listing: ``due`` is its first run in the window (its position)."""
    return {
        "schedule_id": row["schedule_id"],
        "tenant": row["tenant"],
        "status": status,
        "recurring": True,
        "due": _iso(position_ms),
        "due_ms": position_ms,
        "next_run": _iso(next_ms),
        "next_run_ms": next_ms,
        "delivery": None,
    }


def run_view(run: Run) -> dict[str, object]:
    """One run from ``streams.recurring_store.schedule_runs`` with readable times."""
    out: dict[str, object] = dict(run)
    out["nominal"] = _iso(int(run["nominal_ms"]))
    out["due"] = _iso(int(run["due_ms"]))
    if "state" in run:
        out["status"] = out.pop("state")
    return out


def parent_view(
    row: CqlRow,
    events: Sequence[CqlRow],
    *,
    status: str,
    next_ms: int | None,
    runs: ScheduleRuns | None,
) -> dict[str, object]:
    """The full JSON of a recurring schedule (``GET /v1/schedules/{id}``): ``due`` is its
    next run (null when none is left); ``runs`` its newest past and its next runs."""
    view: dict[str, object] = {
        "schedule_id": row["schedule_id"],
        "tenant": row["tenant"],
        "status": status,
        "recurring": True,
        "recurrence": recurrence_view(row),
        "due": _iso(next_ms),
        "due_ms": next_ms,
        "next_run": _iso(next_ms),
        "next_run_ms": next_ms,
        "delivery": None,
        **settings_view(row),
        "runs_written": row.get("run_count"),
        "callback": callback_view(row),
    }
    view.update(payload_view(row))
    view["runs"] = {
        "past": [run_view(r) for r in runs["past"]] if runs else [],
        "next": [run_view(r) for r in runs["next"]] if runs else [],
    }
    view["history"] = [event_view(e) for e in events]
    return view


def run_row_view(
    row: CqlRow, events: Sequence[CqlRow], *, parent_id: str, nominal_ms: int
) -> dict[str, Any]:
    """``GET /v1/schedules/<parent>@<nominal_ms>``: a run of a recurring schedule. Its row
    exists once it fired or was missed (the ticker writes state, time and trigger id)."""
    due = next((e.get("due_ms") for e in events if e.get("due_ms") is not None), None)
    view: dict[str, Any] = {
        "schedule_id": row["schedule_id"],
        "tenant": row["tenant"],
        "status": _state(row),
        "recurring_run": True,
        "parent_schedule_id": parent_id,
        "nominal": _iso(nominal_ms),
        "nominal_ms": nominal_ms,
        "due": _iso(None if due is None else int(due)),
        "due_ms": due,
        "fired_ms": row.get("fired_ms"),
        "trigger_id": row.get("trigger_id"),
        "delivery": delivery_view(row),
    }
    view["history"] = [event_view(e) for e in events]
    return view


def merge_page(
    one_shots: Sequence[tuple[Key, T]],
    one_shot_cursor: Key | None,
    parents: Sequence[tuple[Key, T]],
    limit: int,
) -> tuple[list[T], Key | None]:
    """One page of a listing from its two sources, in key order, and the cursor after it.

    ``one_shots``: the one-shot listing's page (keys after the request's cursor) and its own
    cursor (None: that source is exhausted; otherwise it has not looked past that key);
    ``parents``: every listed parent after the request's cursor. Parents beyond the one-shot
    cursor wait for the next page, so no one-shot between is ever skipped.
    """
    bound = one_shot_cursor
    pool = list(one_shots) + [p for p in parents if bound is None or p[0] <= bound]
    pool.sort(key=lambda item: item[0])
    page = pool[:limit]
    if len(pool) > limit:
        return [v for _, v in page], page[-1][0]
    # Everything up to the bound is on this page; with no bound, everything at all.
    return [v for _, v in page], bound


__all__ = [
    "PARENT_STATUSES",
    "is_parent",
    "merge_page",
    "next_run",
    "parent_brief",
    "parent_status",
    "parent_view",
    "recurrence_json",
    "recurrence_of",
    "recurrence_view",
    "rule_changed_ms",
    "run_row_view",
    "run_view",
    "runs_out",
    "upcoming",
    "window_run",
]

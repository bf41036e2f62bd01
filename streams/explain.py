""" "Why didn't it fire?": one schedule's recorded history put together in time order, with a
plain-language reason for where it stands now (``tocsin schedule explain``,
``GET /v1/schedules/{id}/explain``).

Pure: the rows come in (the schedule's row, its ``schedule_events``, and for a recurring
schedule its newest runs with theirs), the explanation goes out. The reads are
``streams.explain_io``.

Events are read by name, generically: an event this module has no words for (one added
later, e.g. a pause) still appears in the timeline with its name and detail, and a
``paused``/``resumed`` pair is recognised by name wherever it is recorded.

What is not recorded anywhere, and so is never shown, is listed in ``NOT_RECORDED`` and
returned with every explanation, so an empty timeline is never mistaken for "nothing
happened".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from base.text import printable
from streams.model import ScheduleEvent, ScheduleState
from topics.ids import format_iso_ms
from topics.models import DeliveryOutcome

Row = Mapping[str, Any]

# Events by name, not by enum member: pause and resume are recorded by another part of
# the scheduler, and their names are all this view needs.
PAUSED = "paused"
RESUMED = "resumed"
SKIPPED_PAUSED = "skipped_paused"
# Recorded from the proxy's attempt records (streams.deliveries) and refused commands
# (streams.refusals).
ATTEMPT_FAILED = "attempt_failed"
ATTEMPT_HELD = "attempt_held"
COMMAND_REFUSED = "command_refused"
# How the proxy samples attempt records and the worker bounds them (proxy.attempts,
# streams.deliveries): said when a trigger failed more often than its history shows.
ATTEMPTS_SAMPLING = (
    "the proxy reports failed attempts 1-8, then attempts 16, 32, 64, ..., and a host's "
    "hold when its wait crosses a power of two seconds since the first failure; at most 20 "
    "are kept per emission"
)
BREAKER_METRIC = "tocsin_proxy_breaker_open{tenant,host,state}"
_FAILED_COUNT = re.compile(r"; (\d+) failed")
_EMISSIONS = frozenset({ScheduleEvent.FIRED, ScheduleEvent.REFIRED})
# A scheduled trigger this far past its due time has been waiting for a worker, not just in
# flight (as streams.status.OVERDUE_AFTER_MS).
OVERDUE_AFTER_MS = 10_000
# Fired this late with a fire quota set: the quota may have held it back.
QUOTA_SUSPECT_MS = 1_000

NOT_RECORDED = (
    "commands refused before their tenant was proven (unknown tenant, bad signature, "
    "undecodable) or for a schedule that does not exist: they are answered on the results "
    "topic only; refusals of an existing schedule are recorded, at most 5 a minute each",
    "every failed delivery attempt one by one once a trigger has failed often: "
    + ATTEMPTS_SAMPLING
    + "; the final outcome still counts them all",
    "the live state of the endpoint host's circuit breaker: it lives in the delivery "
    f"proxy's memory, published as {BREAKER_METRIC} on the proxy's metrics; the history "
    "shows only waits a breaker imposed and dead letters of kind circuit_open",
    "whether the tenant's fire quota deferred a trigger: deferrals are counted per tenant "
    "(tocsin_fires_throttled_total), not recorded per trigger; such waits do not count "
    "against the misfire tolerance",
    "anything older than the tenant's retention, which expires history and runs",
)


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """One run of a recurring schedule: its ``recurring_runs`` row, the ``schedules`` row of
    its run id (None when none was written) and the run id's history."""

    run_id: str
    nominal_ms: int
    due_ms: int
    row: Row | None
    events: Sequence[Row] = ()
    older_events: bool = False


@dataclass(frozen=True, kw_only=True)
class Facts:
    """Everything recorded about one schedule, as read."""

    row: Row
    events: Sequence[Row]
    now_ms: int
    default_tolerance_s: int
    fire_quota_per_min: int = 0
    # Recurring: its newest runs, newest first; ``runs_limit`` how many were asked for.
    runs: Sequence[RunFacts] = ()
    runs_limit: int = 0
    # Only the newest ``events_limit`` events of each history are read; ``older_events``:
    # the schedule's own history has older ones (a run's says so in its RunFacts).
    events_limit: int = 0
    older_events: bool = False


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One line of the timeline."""

    at_ms: int
    event: str
    schedule_id: str
    text: str
    trigger_id: str | None = None
    due_ms: int | None = None
    detail: str | None = None
    lateness_ms: int | None = None
    attempt: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "at": _iso(self.at_ms),
            "at_ms": self.at_ms,
            "event": self.event,
            "schedule_id": self.schedule_id,
            "trigger_id": self.trigger_id,
            "due_ms": self.due_ms,
            "lateness_ms": self.lateness_ms,
            "emit_attempt": self.attempt,
            "detail": self.detail,
            "text": self.text,
        }


@dataclass(frozen=True, kw_only=True)
class Explanation:
    tenant: str
    schedule_id: str
    kind: str  # one_shot | recurring
    state: str
    reason: str
    entries: list[Entry]
    notes: list[str] = field(default_factory=list)
    runs_shown: int = 0
    older_events: bool = False  # some history older than what is shown exists

    def to_json(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "schedule_id": self.schedule_id,
            "kind": self.kind,
            "state": self.state,
            "reason": self.reason,
            "timeline": [e.to_json() for e in self.entries],
            "notes": list(self.notes),
            "runs_shown": self.runs_shown,
            "older_events": self.older_events,
            "not_recorded": list(NOT_RECORDED),
        }


def explain(facts: Facts) -> Explanation:
    """The timeline and the reason for the schedule's present state."""
    row = facts.row
    sid = str(row["schedule_id"])
    entries = timeline(sid, facts.events, tolerance_s=_tolerance_s(row, facts))
    recurring = row.get("recurrence") is not None
    for run in facts.runs:
        entries.extend(
            timeline(run.run_id, run.events, tolerance_s=_tolerance_s(run.row or row, facts))
        )
    entries.sort(key=lambda e: (e.at_ms, e.schedule_id, e.event))
    notes: list[str] = []
    if recurring:
        reason = _recurring_reason(facts)
        if facts.runs_limit and len(facts.runs) >= facts.runs_limit:
            notes.append(f"only the newest {facts.runs_limit} runs are shown")
    else:
        reason = _one_shot_reason(facts, notes)
    notes += _attempt_notes(entries)
    cut = [sid] if facts.older_events else []
    cut += [run.run_id for run in facts.runs if run.older_events]
    if cut:
        notes.append(
            f"only the newest {facts.events_limit or '?'} events of each history are shown; "
            f"older ones exist for {', '.join(cut)}"
        )
    return Explanation(
        tenant=str(row["tenant"]),
        schedule_id=sid,
        kind="recurring" if recurring else "one_shot",
        state=str(row.get("state") or ""),
        reason=reason,
        entries=entries,
        notes=notes,
        runs_shown=len(facts.runs),
        older_events=bool(cut),
    )


def timeline(schedule_id: str, events: Sequence[Row], *, tolerance_s: int) -> list[Entry]:
    """One schedule id's history as entries, oldest first; every event appears, known or
    not. Emission attempts are numbered in order (a re-fire is the next attempt)."""
    out: list[Entry] = []
    attempt = 0
    due_before: int | None = None
    for e in sorted(events, key=lambda e: (int(e["at_ms"]), str(e["event"]))):
        name = str(e["event"])
        at = int(e["at_ms"])
        due = _opt_int(e.get("due_ms"))
        detail = e.get("detail")
        lateness = None
        if name in _EMISSIONS:
            attempt += 1
        if name in _EMISSIONS or name == ScheduleEvent.MISSED:
            lateness = None if due is None else at - due
        text = describe(
            name,
            due_ms=due,
            due_before_ms=due_before,
            detail=detail,
            lateness_ms=lateness,
            attempt=attempt,
            tolerance_s=tolerance_s,
        )
        if name in (ScheduleEvent.CREATED, ScheduleEvent.UPDATED) and due is not None:
            due_before = due
        out.append(
            Entry(
                at_ms=at,
                event=name,
                schedule_id=schedule_id,
                text=text,
                trigger_id=e.get("trigger_id"),
                due_ms=due,
                detail=detail,
                lateness_ms=lateness,
                attempt=attempt if name in _EMISSIONS else None,
            )
        )
    return out


def describe(
    name: str,
    *,
    due_ms: int | None,
    due_before_ms: int | None,
    detail: str | None,
    lateness_ms: int | None,
    attempt: int,
    tolerance_s: int,
) -> str:
    """One event in words."""
    due = _iso(due_ms) if due_ms is not None else "?"
    if name == ScheduleEvent.CREATED:
        return f"created, due {due}"
    if name == ScheduleEvent.UPDATED:
        if due_before_ms is not None and due_ms is not None and due_before_ms != due_ms:
            return f"rescheduled from {_iso(due_before_ms)} to {due}"
        return f"updated, due {due}"
    if name in _EMISSIONS:
        again = " again (re-fire)" if name == ScheduleEvent.REFIRED else ""
        return f"emitted{again}, attempt {attempt}, {_late(lateness_ms)} after due {due}"
    if name == ScheduleEvent.MISSED:
        return _missed_text(due, detail, lateness_ms, tolerance_s)
    if name == ScheduleEvent.DELIVERED:
        return "delivered" + (f": {detail}" if detail else "")
    if name == ScheduleEvent.DEAD_LETTERED:
        return "dead-lettered" + (f": {detail}" if detail else "")
    if name == ScheduleEvent.SKIPPED:
        return "runs skipped" + (f": {detail}" if detail else "")
    if name == SKIPPED_PAUSED:
        return "runs skipped while paused" + (f": {detail}" if detail else "")
    if name in (ATTEMPT_FAILED, ATTEMPT_HELD, COMMAND_REFUSED):
        return detail or name.replace("_", " ")
    words = name.replace("_", " ")
    return words + (f": {detail}" if detail else "")


def _missed_text(due: str, detail: str | None, lateness_ms: int | None, tolerance_s: int) -> str:
    if detail and not detail.startswith("late by"):
        return f"missed (due {due}): {detail}"
    return (
        f"missed: due {due}, reached by a worker only {_late(lateness_ms)} later, "
        f"beyond its misfire tolerance of {tolerance_s} s"
    )


# -- the reason for the present state -------------------------------------------------------


def _one_shot_reason(facts: Facts, notes: list[str]) -> str:
    row = facts.row
    state = str(row.get("state") or "")
    due = _opt_int(row.get("due_ms"))
    last = _last(facts.events)
    if state == ScheduleState.CANCELLED:
        at = _iso(last["at_ms"]) if last is not None else "?"
        return f"cancelled at {at}: it will not fire"
    if state == ScheduleState.MISSED:
        missed = _last(facts.events, {ScheduleEvent.MISSED})
        if missed is None:
            return "missed (its history has expired)"
        return _missed_text(
            _iso(due) if due is not None else "?",
            missed.get("detail"),
            None if due is None else int(missed["at_ms"]) - due,
            _tolerance_s(row, facts),
        )
    if state == ScheduleState.FIRED:
        return _fired_reason(facts, notes)
    if state in (ScheduleState.SCHEDULED, PAUSED):
        return _waiting_reason(facts)
    tail = f" (last event: {last['event']} at {_iso(last['at_ms'])})" if last else ""
    return f"{state or 'unknown state'}{tail}"


def _fired_reason(facts: Facts, notes: list[str]) -> str:
    row = facts.row
    due = _opt_int(row.get("due_ms"))
    fired = _opt_int(row.get("fired_ms"))
    late = None if fired is None or due is None else fired - due
    head = f"fired at {_iso(fired) if fired is not None else '?'}, {_late(late)} after due"
    if (
        facts.fire_quota_per_min
        and late is not None
        and late > QUOTA_SUSPECT_MS
        and _tolerance_s(row, facts) * 1000 >= late
    ):
        notes.append(
            f"the tenant has a fire quota of {facts.fire_quota_per_min}/min: a late emission "
            "may have waited for it (not recorded per trigger)"
        )
    return f"{head}; {_delivery_words(row, facts.events)}"


def _delivery_words(row: Row, events: Sequence[Row]) -> str:
    outcome = row.get("delivery_outcome")
    attempts = row.get("delivery_attempts")
    status = row.get("delivery_status_code")
    if outcome == DeliveryOutcome.DELIVERED:
        code = f" with status {status}" if status is not None else ""
        return f"delivered{code} after {attempts or '?'} attempt(s)"
    if outcome == DeliveryOutcome.DEAD_LETTERED:
        dead = _last(events, {ScheduleEvent.DEAD_LETTERED})
        why = f": {dead['detail']}" if dead is not None and dead.get("detail") else ""
        return f"dead-lettered after {attempts or '?'} attempt(s){why}"
    return (
        "no delivery outcome recorded: the proxy is still trying (it retries failing "
        "callbacks, up to a day by default), or a consumer reads the fire topic directly"
    )


def _waiting_reason(facts: Facts) -> str:
    row = facts.row
    due = _opt_int(row.get("due_ms"))
    pause = _last(facts.events, {PAUSED, RESUMED})
    if row.get("state") == PAUSED or (pause is not None and pause["event"] == PAUSED):
        since = f" since {_iso(pause['at_ms'])}" if pause is not None else ""
        return (
            f"paused{since}: it does not fire until resumed; resumed after its due time, "
            "its misfire tolerance decides between firing late and missed"
        )
    if due is None:
        return "scheduled"
    if due > facts.now_ms:
        return f"scheduled: due {_iso(due)}, in {_span(due - facts.now_ms)}"
    behind = facts.now_ms - due
    if behind < OVERDUE_AFTER_MS:
        return f"due {_iso(due)}: being emitted now"
    tolerance_s = _tolerance_s(row, facts)
    return (
        f"overdue: due {_iso(due)}, {_span(behind)} ago, and no worker has emitted it yet "
        f"(is a worker running for commands partition {row.get('partition')}?); it fires "
        f"when one gets to it within its misfire tolerance of {tolerance_s} s, else it is "
        "recorded as missed"
    )


def _recurring_reason(facts: Facts) -> str:
    row = facts.row
    state = str(row.get("state") or "")
    counts: dict[str, int] = {}
    for run in facts.runs:
        run_row = run.row or {}
        key = str(run_row.get("delivery_outcome") or run_row.get("state") or "scheduled")
        counts[key] = counts.get(key, 0) + 1
    pause = _last(facts.events, {PAUSED, RESUMED})
    if state == PAUSED or (pause is not None and pause["event"] == PAUSED):
        since = f" since {_iso(pause['at_ms'])}" if pause is not None else ""
        head = f"recurring, paused{since}: its runs are skipped"
    else:
        head = f"recurring, {state or 'unknown state'}"
    if not facts.runs:
        return f"{head}; no run written yet"
    newest = facts.runs[0]
    run_row = dict(newest.row or {"state": ScheduleState.SCHEDULED})
    run_row.setdefault("schedule_id", newest.run_id)
    run_row.setdefault("due_ms", newest.due_ms)
    run_row.setdefault("partition", row.get("partition"))
    if run_row.get("misfire_tolerance_s") is None:
        run_row["misfire_tolerance_s"] = row.get("misfire_tolerance_s")
    latest = _one_shot_reason(
        Facts(
            row=run_row,
            events=newest.events,
            now_ms=facts.now_ms,
            default_tolerance_s=facts.default_tolerance_s,
            fire_quota_per_min=facts.fire_quota_per_min,
        ),
        [],
    )
    tally = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    return f"{head}; newest {len(facts.runs)} run(s): {tally}; newest run {newest.run_id}: {latest}"


# -- delivery attempts and the host's breaker ------------------------------------------------


def _attempt_notes(entries: Sequence[Entry]) -> list[str]:
    """What the attempt entries leave out (a trigger's failed attempts beyond those shown)
    and what they say of the endpoint host's circuit breaker."""
    shown: dict[str, int] = {}
    failed: dict[str, int] = {}
    breaker: list[Entry] = []
    for e in entries:
        tid = e.trigger_id or e.schedule_id
        if e.event == ATTEMPT_FAILED:
            shown[tid] = shown.get(tid, 0) + 1
        elif e.event in (ScheduleEvent.DELIVERED, ScheduleEvent.DEAD_LETTERED) and e.detail:
            found = _FAILED_COUNT.search(e.detail)
            if found:
                failed[tid] = int(found.group(1))
        if _by_breaker(e):
            breaker.append(e)
    notes = [
        f"trigger {tid}: {n} failed attempt(s), {shown.get(tid, 0)} shown one by one "
        f"({ATTEMPTS_SAMPLING})"
        for tid, n in failed.items()
        if n > shown.get(tid, 0)
    ]
    if breaker:
        last = breaker[-1]
        notes.append(
            f"its endpoint host's circuit breaker was open {len(breaker)} time(s) in this "
            f"history, last at {_iso(last.at_ms)} ({last.event}); the live state is in the "
            f"proxy's metrics, {BREAKER_METRIC}"
        )
    return notes


def _by_breaker(e: Entry) -> bool:
    detail = e.detail or ""
    if e.event == ATTEMPT_HELD:
        return "circuit breaker" in detail
    return e.event == ScheduleEvent.DEAD_LETTERED and "circuit breaker open" in detail


# -- helpers -------------------------------------------------------------------------------


def _last(events: Sequence[Row], names: frozenset[str] | set[str] | None = None) -> Row | None:
    found = None
    for e in sorted(events, key=lambda e: (int(e["at_ms"]), str(e["event"]))):
        if names is None or e["event"] in names:
            found = e
    return found


def _tolerance_s(row: Row, facts: Facts) -> int:
    value = row.get("misfire_tolerance_s")
    return facts.default_tolerance_s if value is None else int(value)


def _opt_int(value: object) -> int | None:
    return None if value is None else int(str(value))


def _iso(ms: object) -> str:
    try:
        return format_iso_ms(int(str(ms)))
    except ValueError:
        return str(ms)


def _late(ms: int | None) -> str:
    if ms is None:
        return "?"
    return f"{ms} ms" if abs(ms) < 10_000 else _span(ms)


def _span(ms: int) -> str:
    s = ms / 1000
    if abs(s) < 120:
        return f"{s:g} s"
    if abs(s) < 7200:
        return f"{round(s / 60, 1):g} min"
    return f"{round(s / 3600, 1):g} h"


def render(ex: Explanation) -> str:
    """The explanation for a terminal: the reason, then the timeline."""
    out = [
        f"{ex.kind.replace('_', '-')} schedule {ex.schedule_id!r} of tenant {ex.tenant!r}",
        f"state   {ex.state}",
        f"why     {ex.reason}",
    ]
    out += [f"note    {n}" for n in ex.notes]
    out.append("")
    if not ex.entries:
        out.append("(no history recorded)")
    width = max((len(e.event) for e in ex.entries), default=0)
    for e in ex.entries:
        who = f" [{e.schedule_id}]" if e.schedule_id != ex.schedule_id else ""
        out.append(f"{_iso(e.at_ms)}  {e.event.ljust(width)}  {e.text}{who}")
    out.append("")
    out.append("not recorded, so not shown:")
    out += [f"  - {n}" for n in NOT_RECORDED]
    return "\n".join(printable(line) for line in out) + "\n"

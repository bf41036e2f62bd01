"""The time math of recurring schedules: which nominal instants a recurrence yields.

A recurrence (``topics.models.Recurrence``) is either a cron expression evaluated in an
IANA time zone, or a fixed rate. This module turns it into nominal run times (UTC epoch
ms), applies the per-schedule DST policy, spreads runs over the jitter window
deterministically from their run id, and plans one step of materialisation (which runs
to write ahead as one-shot bucket rows, which misfired runs to drop). Pure: no I/O except
reading the pinned ``tzdata`` package, no clock (``now_ms`` is always passed in).

Cron: the six fields (seconds first, see ``topics.recurrence.normalize_cron``) are matched
against *local wall time* with croniter on naive datetimes, so croniter never sees a time
zone; each matching wall time is then mapped to UTC here:

* a wall time that occurs once maps to its instant;
* a wall time inside a DST gap (it does not exist: 02:30 on the spring-forward night in
  New York) is dropped (``nonexistent=skip``) or moved forward by the length of the gap
  (``shift_forward``: 02:30 -> 03:30 in New York, 02:15 -> 02:45 on Lord Howe Island);
* a wall time inside a DST overlap (it occurs twice: 01:30 on the fall-back night) fires
  at its first occurrence (``ambiguous=once``) or at both (``twice``).

Day of month and day of week combine as in Vixie cron: when both are restricted (neither
starts with ``*``) a day matching either runs, otherwise both must match; with
``day_match=all`` both must always match (go-scheduler's reading: ``0 9 1-7 * mon`` is the
first Monday of the month).

Rate (``every_s``): runs at ``start + k * every_s`` for k >= 0, elapsed time in UTC, so time
zones and DST do not apply. Without ``start`` the series starts one interval after the
create (or the update that set the recurrence) was applied.

Instants are deduplicated: two wall times mapping to the same instant (a shifted run
landing on a regular one) are one run. A run's id is ``<schedule_id>@<nominal_ms>`` and
its due time ``nominal + jitter``, so recomputation always gives the same rows.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from importlib import resources
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, croniter

from topics.ids import MAX_EPOCH_MS
from topics.models import Ambiguous, DayMatch, Misfire, Nonexistent, Recurrence

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
# "Nothing left to run": the end of the representable range (see topics.ids).
NEVER_MS = MAX_EPOCH_MS
# misfire_tolerance_s of a run that must fire however late it is (a Cassandra int).
MAX_TOLERANCE_S = 2**31 - 1
# UTC offsets lie within -12:00..+14:00; used to bound wall time <-> instant searches.
_MAX_OFFSET_MS = 14 * HOUR_MS
_EPOCH = datetime(1970, 1, 1)
_MS = timedelta(milliseconds=1)


# -- zones and wall time --------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def zone(name: str) -> ZoneInfo:
    """The zone from the pinned ``tzdata`` package, never the host's tz database."""
    node = resources.files("tzdata").joinpath("zoneinfo")
    for part in name.split("/"):
        node = node.joinpath(part)
    with node.open("rb") as handle:
        return ZoneInfo.from_file(handle, key=name)


def _naive_ms(wall: datetime) -> int:
    """ "Local epoch ms" of a naive wall time (its instant if the zone were UTC)."""
    return (wall - _EPOCH) // _MS


def _naive(local_ms: int) -> datetime:
    return _EPOCH + timedelta(milliseconds=local_ms)


def _offset_ms(tz: ZoneInfo, utc_ms: int) -> int:
    instant = datetime.fromtimestamp(utc_ms / 1000, tz=UTC)
    offset = tz.utcoffset(instant.astimezone(tz))
    return 0 if offset is None else offset // _MS


def wall_instants(wall: datetime, tz: ZoneInfo, rec: Recurrence) -> list[int]:
    """UTC epoch ms of a naive local wall time under the recurrence's DST policy.

    PEP 495: ``fold=0`` takes the offset before a transition, ``fold=1`` the one after. In
    an overlap fold 0 is the earlier instant; in a gap fold 0 is the later one (the wall
    time pushed forward by the gap).
    """
    first = _aware_ms(wall.replace(tzinfo=tz, fold=0))
    second = _aware_ms(wall.replace(tzinfo=tz, fold=1))
    if first == second:
        return [first]
    if first < second:  # overlap: the wall time occurs twice
        return [first, second] if rec.ambiguous is Ambiguous.TWICE else [first]
    # gap: the wall time does not exist
    return [first] if rec.nonexistent is Nonexistent.SHIFT_FORWARD else []


def _aware_ms(moment: datetime) -> int:
    offset = moment.utcoffset()
    local = _naive_ms(moment.replace(tzinfo=None))
    return local - (0 if offset is None else offset // _MS)


# -- occurrences ----------------------------------------------------------------------------


def series_start(rec: Recurrence, anchor_ms: int) -> int:
    """The first instant the series may run at: ``start``, else derived from the anchor
    (when the create or update that set the recurrence was applied)."""
    if rec.start_ms is not None:
        return rec.start_ms
    if rec.every_s is not None:
        return anchor_ms + rec.every_s * 1000
    return anchor_ms


def first_run(rec: Recurrence, applied_ms: int) -> int:
    """Nominal time of the first run of a recurrence set (by a create or an update) at
    ``applied_ms``: occurrences before that moment are not runs. ``NEVER_MS`` if none."""
    begin = max(series_start(rec, applied_ms), applied_ms)
    return next(occurrences(rec, begin, anchor_ms=applied_ms), NEVER_MS)


def occurrences(rec: Recurrence, from_ms: int, *, anchor_ms: int) -> Iterator[int]:
    """Nominal instants (UTC epoch ms) >= ``from_ms`` in increasing order, without
    duplicates, up to ``end`` (inclusive); ``max_runs`` is the caller's business."""
    start = series_start(rec, anchor_ms)
    lo = max(from_ms, start)
    end = NEVER_MS if rec.end_ms is None else min(rec.end_ms, NEVER_MS)
    if rec.every_s is not None:
        every = rec.every_s * 1000
        k = max(0, -(-(lo - start) // every))
        at = start + k * every
        while at <= end:
            yield at
            at += every
        return
    assert rec.cron is not None
    # Cron instants are whole seconds: round up so that nearby callers share cache entries.
    at = -(-lo // 1000) * 1000
    key = _cron_key(rec)
    while at <= end:
        chunk = _cron_chunk(key, at)
        for instant in chunk:
            if instant > end:
                return
            yield instant
        if len(chunk) < _CHUNK_RUNS:
            return
        at = chunk[-1] + 1


# Cron occurrences depend only on the expression, the zone and the DST policies, so
# schedules sharing them (100,000 ``* * * * *`` schedules) share one computation: croniter
# costs tens of microseconds per occurrence, which dominated the worker's CPU before.
_CHUNK_RUNS = 16


def _cron_key(rec: Recurrence) -> Recurrence:
    # Only the fields the instants do not depend on are reset, so a field added to
    # Recurrence later is part of the key unless it is listed here.
    return replace(
        rec, start_ms=None, end_ms=None, max_runs=None, jitter_s=0, misfire=Misfire.FIRE_LATEST
    )


@functools.lru_cache(maxsize=16_384)
def _cron_chunk(key: Recurrence, lo: int) -> tuple[int, ...]:
    """The next (up to) ``_CHUNK_RUNS`` instants >= ``lo`` of ``key``'s expression."""
    out = []
    for instant in _cron_occurrences(key, lo, NEVER_MS):
        out.append(instant)
        if len(out) >= _CHUNK_RUNS:
            break
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _CronSpec:
    """A cron expression as croniter reads it, with the zone it is evaluated in."""

    tz: ZoneInfo
    expr: str
    day_or: bool
    fixed: bool  # UTC: wall time is the instant


@dataclass(slots=True)
class _Window:
    """One day-long window ``[lo, hi)`` of a cron walk, and what the walk saw in it."""

    lo: int
    hi: int
    wall_hi: int = 0
    first_wall: int | None = None
    found: bool = False
    finished: bool = False  # nothing left before the end (of the walk, or of time)


def _cron_spec(rec: Recurrence) -> _CronSpec:
    fields = rec.cron.split(" ") if rec.cron else []
    # Vixie cron: both day fields restricted -> either matches; otherwise both must (and
    # always both with day_match all).
    day_or = (
        rec.day_match is DayMatch.ANY
        and not fields[3].startswith("*")
        and not fields[5].startswith("*")
    )
    # croniter wants the seconds field last.
    expr = " ".join([*fields[1:], fields[0]])
    return _CronSpec(zone(rec.time_zone), expr, day_or, rec.time_zone in ("UTC", "Etc/UTC"))


def _cron_occurrences(rec: Recurrence, lo: int, end: int) -> Iterator[int]:
    spec = _cron_spec(rec)
    last = lo - 1
    while lo <= end:
        window = _Window(lo, min(lo + DAY_MS, end + 1))
        for instant in _window_occurrences(spec, rec, window, last, end):
            last = instant
            yield instant
        if window.finished:
            return
        first = window.first_wall
        if not window.found and first is not None and first > window.wall_hi:
            # A sparse expression: jump to just before the next matching wall time.
            lo = max(window.hi, first - _MAX_OFFSET_MS - HOUR_MS)
        else:
            lo = window.hi


def _window_occurrences(
    spec: _CronSpec, rec: Recurrence, window: _Window, last: int, end: int
) -> Iterator[int]:
    """The instants after ``last`` of one window, in order; marks ``window`` finished when
    none is left at all."""
    low_off, high_off = _offsets(spec, window.lo, window.hi)
    window.wall_hi = window.hi + high_off
    # Instants come out of wall order only near a transition: buffer them until no
    # later wall time can map before them (instant >= wall - highest offset).
    buffer: list[int] = []
    for wall, wall_ms in _walls(spec, window.lo + low_off):
        if window.first_wall is None:
            window.first_wall = wall_ms
        if wall is not None and wall_ms <= window.wall_hi:
            _push(buffer, _wall_candidates(spec, rec, wall, wall_ms), window, last)
        flush = wall_ms > window.wall_hi
        for instant in _release(buffer, wall_ms - high_off, flush, last):
            if instant > end:
                window.finished = True
                return
            window.found = True
            last = instant
            yield instant
        if wall is None:
            window.finished = True
            return
        if flush:
            return


def _offsets(spec: _CronSpec, lo: int, hi: int) -> tuple[int, int]:
    """The lowest and highest UTC offset in force around ``[lo, hi)``."""
    if spec.fixed:
        return 0, 0
    # Every offset in force around the window, sampled hourly (a window is a day).
    samples = [_offset_ms(spec.tz, t) for t in range(lo - HOUR_MS, hi + 2 * HOUR_MS, HOUR_MS)]
    return min(samples), max(samples)


def _walls(spec: _CronSpec, wall_lo: int) -> Iterator[tuple[datetime | None, int]]:
    """Matching wall times from ``wall_lo`` on (naive, with their local epoch ms); ends
    with ``(None, beyond any wall time)`` when croniter finds no match left."""
    begin = _naive(wall_lo) - timedelta(seconds=1)
    it = croniter(spec.expr, begin, day_or=spec.day_or, max_years_between_matches=50)
    while True:
        try:
            wall = it.get_next(datetime)
        except (CroniterBadDateError, OverflowError, ValueError):
            yield None, NEVER_MS + _MAX_OFFSET_MS  # no match left before the end of time
            return
        yield wall, _naive_ms(wall)


def _wall_candidates(spec: _CronSpec, rec: Recurrence, wall: datetime, wall_ms: int) -> list[int]:
    return [wall_ms] if spec.fixed else wall_instants(wall, spec.tz, rec)


def _push(buffer: list[int], instants: list[int], window: _Window, last: int) -> None:
    for instant in instants:
        if window.lo <= instant < window.hi and instant > last:
            heapq.heappush(buffer, instant)


def _release(buffer: list[int], safe: int, flush: bool, last: int) -> Iterator[int]:
    """Pop the buffered instants no later wall time can precede (all of them on ``flush``),
    skipping those at or before ``last``."""
    while buffer and (buffer[0] <= safe or flush):
        instant = heapq.heappop(buffer)
        if instant > last:
            last = instant
            yield instant


def next_runs(
    rec: Recurrence,
    after_ms: int,
    n: int,
    *,
    anchor_ms: int,
    counted: int | None = None,
) -> list[int]:
    """The next ``n`` nominal run times >= ``after_ms``, honouring ``end`` and ``max_runs``.

    ``counted``: how many occurrences lie before ``after_ms`` (for ``max_runs``); computed
    by enumerating from the series start when not given.
    """
    if n <= 0:
        return []
    limit = rec.max_runs
    if limit is not None and counted is None:
        counted = 0
        for at in occurrences(rec, series_start(rec, anchor_ms), anchor_ms=anchor_ms):
            if at >= after_ms or counted >= limit:
                break
            counted += 1
    out: list[int] = []
    for at in occurrences(rec, after_ms, anchor_ms=anchor_ms):
        if len(out) >= n or (limit is not None and (counted or 0) + len(out) >= limit):
            break
        out.append(at)
    return out


# -- runs -----------------------------------------------------------------------------------


def past_occurrences(rec: Recurrence, from_ms: int, *, anchor_ms: int) -> Iterator[int]:
    """Nominal instants >= ``from_ms`` the series has, also before it was created: a
    backfill's runs. An explicit ``start`` and ``end`` still bound it; without ``start``
    a cron series is unbounded below and a rate series keeps its phase (the instants
    ``series_start + k * every_s`` for any whole k, negative too)."""
    if rec.start_ms is None:
        start = from_ms  # cron: every matching instant from the window's start
        if rec.every_s is not None:
            start = series_start(rec, anchor_ms)
            every = rec.every_s * 1000
            start -= max(0, start - from_ms) // every * every
        rec = replace(rec, start_ms=start)
    return occurrences(rec, from_ms, anchor_ms=anchor_ms)


def run_id(schedule_id: str, nominal_ms: int) -> str:
    """The schedule id of one run: stable, so its trigger id is stable too."""
    return f"{schedule_id}@{nominal_ms}"


def parse_run_id(value: str) -> tuple[str, int] | None:
    """(parent schedule id, nominal ms) of a run id, or None if it is not one."""
    parent, sep, nominal = value.rpartition("@")
    if not sep or not parent or not nominal.isdigit():
        return None
    return parent, int(nominal)


def jitter_ms(tenant: str, run: str, jitter_s: int) -> int:
    """Offset of a run inside its window ``[0, jitter_s)`` seconds, from its run id alone
    (blake2b, so every worker and every restart agree)."""
    if jitter_s <= 0:
        return 0
    digest = hashlib.blake2b(f"{tenant}/{run}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (jitter_s * 1000)


def run_tolerance_s(
    rec: Recurrence, tolerance_s: int, due_ms: int, next_nominal_ms: int | None
) -> int:
    """The misfire tolerance written on a run's bucket row, encoding the misfire policy
    for the ticker (which fires a row late only within its tolerance):

    * fire_all: any lateness;
    * skip: the schedule's ``misfire_tolerance_s``;
    * fire_latest: that, or longer while the next run is not due yet - so after an outage
      only the latest missed run still fires.
    """
    if rec.misfire is Misfire.FIRE_ALL or (
        rec.misfire is Misfire.FIRE_LATEST and next_nominal_ms is None
    ):
        return MAX_TOLERANCE_S
    if rec.misfire is Misfire.SKIP or next_nominal_ms is None:
        return tolerance_s
    return min(MAX_TOLERANCE_S, max(tolerance_s, -(-(next_nominal_ms - due_ms) // 1000)))


@dataclass(frozen=True, slots=True)
class PlannedRun:
    nominal_ms: int
    due_ms: int
    run_id: str
    misfire_tolerance_s: int


@dataclass(frozen=True, slots=True)
class Plan:
    """One step of materialisation. ``until_ms``: nominal time of the first occurrence not
    handled yet (``NEVER_MS``: none left); ``run_count``: occurrences before it."""

    runs: list[PlannedRun]
    skipped: list[int]  # nominal times of misfired runs dropped by the policy
    until_ms: int
    run_count: int

    @property
    def done(self) -> bool:
        return self.until_ms >= NEVER_MS


def plan(
    rec: Recurrence,
    *,
    tenant: str,
    schedule_id: str,
    anchor_ms: int,
    tolerance_s: int,
    until_ms: int,
    run_count: int,
    now_ms: int,
    horizon_ms: int,
    max_runs: int = 500,
) -> Plan:
    """Occurrences from ``until_ms`` with nominal time before ``now_ms + horizon_ms`` (at
    most ``max_runs`` of them, so a long outage is worked off in bounded steps).

    Misfired occurrences (due more than ``tolerance_s`` before ``now_ms``) are dropped
    under ``skip``, and under ``fire_latest`` when a later occurrence is already due; under
    ``fire_all`` they are kept. Deterministic for equal arguments.
    """
    runs: list[PlannedRun] = []
    skipped: list[int] = []
    horizon = now_ms + horizon_ms
    stream = occurrences(rec, until_ms, anchor_ms=anchor_ms)
    pending = next(stream, None)
    considered = 0
    while pending is not None:
        if rec.max_runs is not None and run_count >= rec.max_runs:
            pending = None
            break
        if pending >= horizon or considered >= max_runs:
            break
        nominal = pending
        pending = next(stream, None)
        last_one = rec.max_runs is not None and run_count + 1 >= rec.max_runs
        following = None if last_one else pending
        considered += 1
        run_count += 1
        rid = run_id(schedule_id, nominal)
        due = nominal + jitter_ms(tenant, rid, rec.jitter_s)
        late = now_ms - due > tolerance_s * 1000
        superseded = following is not None and following <= now_ms
        if late and (
            rec.misfire is Misfire.SKIP or (rec.misfire is Misfire.FIRE_LATEST and superseded)
        ):
            skipped.append(nominal)
            continue
        runs.append(
            PlannedRun(
                nominal_ms=nominal,
                due_ms=due,
                run_id=rid,
                misfire_tolerance_s=run_tolerance_s(rec, tolerance_s, due, following),
            )
        )
    until = NEVER_MS if pending is None else pending
    return Plan(runs=runs, skipped=skipped, until_ms=until, run_count=run_count)


def extend_at(until_ms: int, horizon_ms: int, schedule_id: str = "") -> int:
    """When the materialiser must next extend a schedule whose first unhandled occurrence
    is at ``until_ms``: half a horizon ahead of it, so there are always runs written,
    plus up to a quarter horizon earlier by a stable hash of ``schedule_id``. Without the
    spread, schedules created together (or sharing an expression) all extend in the same
    second every half horizon: a herd that delayed their fires by seconds."""
    if until_ms >= NEVER_MS:
        return NEVER_MS
    spread = horizon_ms // 4
    offset = 0
    if spread > 0 and schedule_id:
        digest = hashlib.blake2b(schedule_id.encode(), digest_size=8).digest()
        offset = int.from_bytes(digest, "big") % spread
    return max(0, until_ms - horizon_ms // 2 - offset)


__all__ = [
    "NEVER_MS",
    "Plan",
    "PlannedRun",
    "extend_at",
    "first_run",
    "jitter_ms",
    "next_runs",
    "occurrences",
    "parse_run_id",
    "plan",
    "run_id",
    "run_tolerance_s",
    "series_start",
    "wall_instants",
    "zone",
]

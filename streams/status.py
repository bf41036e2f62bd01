"""``tocsin status``: per-tenant figures of what is scheduled, what fired and was delivered
lately, and how far the consumers are behind (pure: aggregation, percentiles, rendering).

The store reads that feed it are bounded by time, never by all of history
(``streams.status_io``): the bucket rows due in ``[now - lookback, now + 1 h)`` of every
commands partition (one-shot schedules and the recurring runs written so far), each
tenant's one-shot schedules due before ``now + horizon`` (its day index) and its recurring
schedules. Everything here takes those rows and the clock as arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from streams.buckets import BUCKET_MS
from streams.buckets import minute_ms as bucket_of
from streams.model import ScheduleState
from streams.ports import CqlRow
from topics.models import DeliveryOutcome

HOUR_MS = 3_600_000
# A display unit of ``duration`` (bucket reads step by streams.buckets.BUCKET_MS).
MINUTE_MS = 60_000
# A trigger is recorded as fired once Kafka acknowledges it, a moment after its due time:
# one still waiting this long after it is overdue, not just in flight.
OVERDUE_AFTER_MS = 10_000


@dataclass(frozen=True, kw_only=True)
class Window:
    """The instants the figures are about.

    ``recent_ms``: "in the last hour" (fired_ms or delivery_ms in ``[now - recent, now]``).
    ``lookback_ms``: how far back, by due time, triggers are read to find those: a trigger
    fires at most its misfire tolerance after its due time, so the default is an hour
    plus the default tolerance; one fired or delivered later than that after its due time
    is not counted. ``ahead_ms``: "due in the next hour". ``horizon_ms``: one-shot
    schedules due before ``now + horizon`` count as scheduled."""

    now_ms: int
    lookback_ms: int
    horizon_ms: int
    recent_ms: int = HOUR_MS
    ahead_ms: int = HOUR_MS

    def __post_init__(self) -> None:
        if self.lookback_ms < 0 or self.horizon_ms < 0 or self.recent_ms < 0:
            raise ValueError("lookback, horizon and recent must not be negative")

    @property
    def past_from_ms(self) -> int:
        return self.now_ms - self.lookback_ms

    @property
    def ahead_until_ms(self) -> int:
        return self.now_ms + self.ahead_ms

    def minutes(self) -> list[int]:
        """Start of every minute bucket that holds a row due in
        ``[past_from_ms, ahead_until_ms)``, in order."""
        first = bucket_of(self.past_from_ms)
        return list(range(first, self.ahead_until_ms, BUCKET_MS))

    def recent(self, at_ms: int | None) -> bool:
        return at_ms is not None and self.now_ms - self.recent_ms <= at_ms <= self.now_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class StateColumns:
    """The columns of a ``schedules`` row the figures need (no payload)."""

    schedule_id: str
    state: str
    due_ms: int | None
    version: int | None
    fired_ms: int | None = None
    updated_ms: int | None = None  # a missed trigger's time (it has no fired_ms)
    delivery_outcome: str | None = None
    delivery_ms: int | None = None

    @classmethod
    def from_row(cls, row: CqlRow) -> StateColumns:
        def opt(name: str) -> int | None:
            value = row.get(name)
            return None if value is None else int(value)

        return cls(
            schedule_id=str(row["schedule_id"]),
            state=str(row.get("state") or ""),
            due_ms=opt("due_ms"),
            version=opt("version"),
            fired_ms=opt("fired_ms"),
            updated_ms=opt("updated_ms"),
            delivery_outcome=row.get("delivery_outcome"),
            delivery_ms=opt("delivery_ms"),
        )


def percentile(values: Sequence[int], q: float) -> int | None:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values``; None when empty."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(kw_only=True)
class TenantFigures:
    tenant: str
    scheduled: int = 0
    due_next_hour: int = 0
    overdue: int = 0
    fired_last_hour: int = 0
    missed_last_hour: int = 0
    delivered_last_hour: int = 0
    dead_lettered_last_hour: int = 0
    lateness_ms: list[int] = field(default_factory=list)
    # More rows than --max-rows were due within the horizon: ``scheduled`` is a lower bound.
    scheduled_truncated: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "tenant": self.tenant,
            "scheduled": self.scheduled,
            "scheduled_truncated": self.scheduled_truncated,
            "due_next_hour": self.due_next_hour,
            "overdue": self.overdue,
            "fired_last_hour": self.fired_last_hour,
            "missed_last_hour": self.missed_last_hour,
            "delivered_last_hour": self.delivered_last_hour,
            "dead_lettered_last_hour": self.dead_lettered_last_hour,
            "lateness_p50_ms": percentile(self.lateness_ms, 50),
            "lateness_p99_ms": percentile(self.lateness_ms, 99),
        }


class Tally:
    """Per-tenant figures built from the rows the I/O edge reads, in any order.

    Keyed by tenant names found in the store (bounded by the tenants and the window)."""

    def __init__(self, window: Window, tenants: Iterable[str] = ()) -> None:
        self.window = window
        self._figures: dict[str, TenantFigures] = {}
        for name in tenants:
            self._of(name)

    def _of(self, tenant: str) -> TenantFigures:
        figures = self._figures.get(tenant)
        if figures is None:
            figures = self._figures[tenant] = TenantFigures(tenant=tenant)
        return figures

    def bucket_row(self, tenant: str, due_ms: int) -> bool:
        """A bucket row in the window; True when its schedule row must be read (it was
        due before now). A bucket row due from now on is waiting to fire: a cancel or a
        reschedule deletes it."""
        if due_ms >= self.window.ahead_until_ms or due_ms < self.window.past_from_ms:
            return False
        if due_ms >= self.window.now_ms:
            self._of(tenant).due_next_hour += 1
            return False
        return True

    def past_trigger(
        self, tenant: str, due_ms: int, version: int, row: StateColumns | None
    ) -> None:
        """The schedule row of a bucket row due in ``[now - lookback, now)``: was it fired
        (or missed) and delivered within the last hour? A row of another version or due
        time (rescheduled since) speaks for a later bucket row, not this one."""
        figures = self._of(tenant)
        if row is None or row.version != version or row.due_ms != due_ms:
            return
        if row.state == ScheduleState.SCHEDULED:
            if due_ms <= self.window.now_ms - OVERDUE_AFTER_MS:
                figures.overdue += 1
            return
        if (
            row.state == ScheduleState.FIRED
            and row.fired_ms is not None
            and self.window.recent(row.fired_ms)
        ):
            figures.fired_last_hour += 1
            figures.lateness_ms.append(max(0, row.fired_ms - due_ms))
        elif row.state == ScheduleState.MISSED and self.window.recent(row.updated_ms):
            figures.missed_last_hour += 1
        if self.window.recent(row.delivery_ms):
            if row.delivery_outcome == DeliveryOutcome.DELIVERED:
                figures.delivered_last_hour += 1
            elif row.delivery_outcome == DeliveryOutcome.DEAD_LETTERED:
                figures.dead_lettered_last_hour += 1

    def waiting(self, tenant: str, count: int, *, truncated: bool = False) -> None:
        """``count`` schedules of the tenant waiting to fire (one-shots due before the
        horizon, active recurring schedules)."""
        figures = self._of(tenant)
        figures.scheduled += count
        figures.scheduled_truncated = figures.scheduled_truncated or truncated

    def figures(self) -> list[TenantFigures]:
        return [self._figures[name] for name in sorted(self._figures)]


@dataclass(frozen=True, kw_only=True)
class Lag:
    """How far one consumer group is behind on one topic, summed over its partitions."""

    group: str
    topic: str
    lag: int
    partitions: int
    # Partitions the group has no committed offset for: counted from the earliest
    # retained offset (the consumers' auto.offset.reset), as a new member would read.
    uncommitted: int

    def to_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "topic": self.topic,
            "lag": self.lag,
            "partitions": self.partitions,
            "uncommitted_partitions": self.uncommitted,
        }


def lag_of(
    group: str,
    topic: str,
    committed: Mapping[int, int | None],
    low: Mapping[int, int],
    high: Mapping[int, int],
) -> Lag:
    """Records of ``topic`` the group has yet to read: per partition, high watermark less
    the committed offset (or the low watermark where it has none), never negative."""
    total = 0
    uncommitted = 0
    for partition, end in high.items():
        position = committed.get(partition)
        if position is None or position < 0:
            uncommitted += 1
            position = low.get(partition, 0)
        total += max(0, end - position)
    return Lag(group=group, topic=topic, lag=total, partitions=len(high), uncommitted=uncommitted)


@dataclass(frozen=True, kw_only=True)
class Report:
    window: Window
    tenants: list[TenantFigures]
    lags: list[Lag]
    # What could not be read (e.g. Kafka unreachable): said, the rest still shown.
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        w = self.window
        return {
            "now_ms": w.now_ms,
            "window": {
                "recent_s": w.recent_ms // 1000,
                "ahead_s": w.ahead_ms // 1000,
                "lookback_s": w.lookback_ms // 1000,
                "horizon_s": w.horizon_ms // 1000,
            },
            "tenants": [t.to_json() for t in self.tenants],
            "consumer_lag": [lag.to_json() for lag in self.lags],
            "problems": list(self.problems),
        }


_COLUMNS = (
    ("tenant", "TENANT"),
    ("scheduled", "SCHEDULED"),
    ("due_next_hour", "DUE<1H"),
    ("overdue", "OVERDUE"),
    ("fired_last_hour", "FIRED"),
    ("missed_last_hour", "MISSED"),
    ("delivered_last_hour", "DELIVERED"),
    ("dead_lettered_last_hour", "DEAD"),
    ("lateness_p50_ms", "LATE P50"),
    ("lateness_p99_ms", "LATE P99"),
)


def _cell(key: str, figures: Mapping[str, object]) -> str:
    value = figures[key]
    if value is None:
        return "-"
    if key.startswith("lateness"):
        return f"{value} ms"
    if key == "scheduled" and figures["scheduled_truncated"]:
        return f">={value}"
    return str(value)


def render(report: Report) -> str:
    """The report as a terminal table: tenants, then consumer lag, then any problems."""
    w = report.window
    rows = [t.to_json() for t in report.tenants]
    table = [[title for _, title in _COLUMNS]]
    table += [[_cell(key, r) for key, _ in _COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(widths[i + 1]) for i, c in enumerate(cells[1:]))
        return "  ".join([first, *rest]).rstrip()

    out = [
        f"SCHEDULED: waiting to fire (one-shots due within {_span(w.horizon_ms)}, recurring "
        f"once); DUE<1H: due in the next {_span(w.ahead_ms)}",
        f"FIRED to LATE: in the last {_span(w.recent_ms)}, of triggers due in the last "
        f"{_span(w.lookback_ms)}",
    ]
    out += [line(cells) for cells in table]
    if not rows:
        out.append("(no tenants)")
    out.append("")
    out.append("consumer lag (records not yet read)")
    if report.lags:
        lag_rows = [["GROUP", "TOPIC", "LAG", "NOTE"]] + [
            [
                lag.group,
                lag.topic,
                str(lag.lag),
                f"{lag.uncommitted}/{lag.partitions} partitions never committed"
                if lag.uncommitted
                else "",
            ]
            for lag in report.lags
        ]
        lw = [max(len(r[i]) for r in lag_rows) for i in range(4)]
        for r in lag_rows:
            out.append(
                f"{r[0].ljust(lw[0])}  {r[1].ljust(lw[1])}  {r[2].rjust(lw[2])}  {r[3]}".rstrip()
            )
    else:
        out.append("(not available)")
    for problem in report.problems:
        out.append(f"warning: {problem}")
    return "\n".join(out) + "\n"


def _span(ms: int) -> str:
    if ms % HOUR_MS == 0:
        hours = ms // HOUR_MS
        if hours % 24 == 0 and hours:
            return f"{hours // 24} d"
        return f"{hours} h"
    if ms % MINUTE_MS == 0:
        return f"{ms // MINUTE_MS} min"
    return f"{ms / 1000:g} s"

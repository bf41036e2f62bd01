"""What a partition's ticker knows of stopped backfills: a pause or cancel of a recurring
schedule stops the backfilled runs (``streams.decisions.decide_backfill``) it has not
emitted yet. Pure: no clock, no I/O, no asyncio.

A backfilled run is a bucket row with ``run_due_ms`` set, schedule id ``<parent>@<nominal>``
and the parent's version when it was backfilled. A pause or cancel writes the parent's
``backfill_stop_version`` (its own, new version): every backfilled row below it is dropped
and recorded, never fired. Two views of that, and the ticker needs both:

- the stored parent row, read when the ticker loads a minute holding backfilled rows: what
  a successor (after a crash or a rebalance) and every later load go by;
- ``BackfillStops``, told by this worker's command agent before the pause or cancel is
  persisted, with no ``await`` between: the rows this ticker holds already (timeline,
  fair queue) are taken out at once, and a load whose parent read ran before the pause's
  write landed is refused its rows when it adds them (``ttl_ms`` covers any such read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streams.model import BucketRow, ScheduleEvent, ScheduleState
from streams.recurring import parse_run_id
from topics.ids import format_iso_ms

# How long a stop told by the command agent is kept: far longer than any parent read of a
# bucket load can take (rows held already are taken out at once; later loads read the
# stored stop).
STOP_TTL_MS = 600_000
# Most stops kept; beyond it the oldest go first (only loads in flight rely on them).
MAX_STOPS = 10_000
# Most runs a stop remembers as recorded (one backfill command writes at most 10,000).
MAX_COUNTED_RUNS = 10_000


@dataclass(frozen=True, slots=True)
class Stop:
    """Backfilled rows of a version below ``version`` are not fired."""

    version: int
    cancelled: bool  # else paused


@dataclass(slots=True)
class _Told:
    stop: Stop
    expires_ms: int
    # Runs already tallied under this stop: a row withdrawn from memory and then read with
    # its minute (or handed over again) is recorded once.
    counted: set[str]


@dataclass(frozen=True, slots=True)
class Skipped:
    """Backfilled runs of one parent a stop dropped: one history event."""

    tenant: str
    parent: str
    cancelled: bool
    count: int
    first_nominal_ms: int
    last_nominal_ms: int

    @property
    def event(self) -> ScheduleEvent:
        return ScheduleEvent.SKIPPED if self.cancelled else ScheduleEvent.SKIPPED_PAUSED

    @property
    def detail(self) -> str:
        why = "cancelled" if self.cancelled else "paused"
        return (
            f"{self.count} backfilled runs not fired, nominal times "
            f"{format_iso_ms(self.first_nominal_ms)} to {format_iso_ms(self.last_nominal_ms)}: "
            f"the schedule was {why}"
        )


def backfilled_run(row: BucketRow) -> tuple[str, int] | None:
    """(parent schedule id, nominal ms) of a backfilled run's row; None for any other row."""
    if row.run_due_ms is None:
        return None
    return parse_run_id(row.schedule_id)


def stored_stop(parent: Mapping[str, Any] | None) -> Stop | None:
    """The stop a stored parent row records (None: its backfills fire). A cancelled parent
    stops every backfill (a cancelled schedule cannot be backfilled)."""
    if parent is None:
        return None
    cancelled = parent.get("state") == ScheduleState.CANCELLED
    version = parent.get("backfill_stop_version")
    if version is None and cancelled:
        version = parent.get("version")
    return Stop(int(version), cancelled) if version is not None else None


def blocks(stop: Stop | None, row: BucketRow) -> bool:
    """Whether ``stop`` drops the backfilled ``row`` (written before it)."""
    return stop is not None and row.version < stop.version


class BackfillStops:
    """Stops told by the command agent, the backfilled runs the ticker holds per parent
    (to take them out when one comes), and the dropped runs not recorded yet. Bounded:
    stops by count and age, held runs by what the ticker holds, tallies by the parents
    with drops not yet handed to the recorder."""

    def __init__(self, *, ttl_ms: int = STOP_TTL_MS, max_stops: int = MAX_STOPS) -> None:
        self._ttl_ms = ttl_ms
        self._max_stops = max_stops
        self._stops: OrderedDict[tuple[str, str], _Told] = OrderedDict()
        self._held: dict[tuple[str, str], set[str]] = {}
        self._tally: dict[tuple[str, str, bool], list[int]] = {}

    def stop(self, tenant: str, parent: str, stop: Stop, *, now_ms: int) -> None:
        key = (tenant, parent)
        self._stops.pop(key, None)
        self._stops[key] = _Told(stop, now_ms + self._ttl_ms, set())
        while self._stops:
            oldest = next(iter(self._stops.values()))
            if len(self._stops) <= self._max_stops and oldest.expires_ms > now_ms:
                break
            self._stops.popitem(last=False)

    def stop_of(self, row: BucketRow, now_ms: int) -> Stop | None:
        """The stop told for ``row``'s parent if it drops ``row``."""
        run = backfilled_run(row) if self._stops else None
        if run is None:
            return None
        told = self._stops.get((row.tenant, run[0]))
        if told is None or told.expires_ms <= now_ms or not blocks(told.stop, row):
            return None
        return told.stop

    def hold(self, row: BucketRow) -> None:
        """``row`` is now in the ticker's timeline."""
        run = backfilled_run(row)
        if run is not None:
            self._held.setdefault((row.tenant, run[0]), set()).add(row.schedule_id)

    def release(self, tenant: str, schedule_id: str) -> None:
        """The row of ``schedule_id`` left the timeline and the fair queue (emitted,
        recorded missed, withdrawn)."""
        if not self._held:
            return
        run = parse_run_id(schedule_id)
        if run is None:
            return
        runs = self._held.get((tenant, run[0]))
        if runs is not None:
            runs.discard(schedule_id)
            if not runs:
                del self._held[(tenant, run[0])]

    def take_held(self, tenant: str, parent: str) -> set[str]:
        """The backfilled runs of ``parent`` held now, forgotten here."""
        return self._held.pop((tenant, parent), set())

    def tally(self, row: BucketRow, stop: Stop) -> None:
        """``row`` was dropped by ``stop``: recorded with the next ``take_skipped``."""
        run = backfilled_run(row)
        if run is None:
            return
        told = self._stops.get((row.tenant, run[0]))
        if told is not None:
            if row.schedule_id in told.counted:
                return
            if len(told.counted) < MAX_COUNTED_RUNS:
                told.counted.add(row.schedule_id)
        nominals = self._tally.setdefault((row.tenant, run[0], stop.cancelled), [])
        if nominals:
            nominals[0] = min(nominals[0], run[1])
            nominals[1] = max(nominals[1], run[1])
            nominals[2] += 1
        else:
            nominals.extend((run[1], run[1], 1))

    def take_skipped(self) -> list[Skipped]:
        out = [
            Skipped(tenant, parent, cancelled, count, first, last)
            for (tenant, parent, cancelled), (first, last, count) in self._tally.items()
        ]
        self._tally.clear()
        return out

    def __len__(self) -> int:
        return len(self._stops)

"""The in-memory due queue of one commands partition, used by that partition's ticker.

The ticker loads each minute bucket from Cassandra shortly before the minute starts and adds
its rows here; the command agent offers creates/reschedules whose due time falls below the
loaded horizon (``covers``) and removes cancelled ones, so a command that arrives after its
bucket was read still fires on time. ``pop_due(now_ms)`` then hands the ticker every entry
whose second has come, in due order.

Memory holds only loaded minutes (the horizon is a few seconds to a minute ahead), never all
stored schedules: that is what keeps worker RSS flat as the store grows.

Heap plus a dict of live entries: add/replace/remove are O(log n) or O(1) with lazy deletion
(a replaced or removed entry stays in the heap until it surfaces, and is skipped because it
is no longer the live entry of its schedule). The heap is rebuilt when stale items dominate.

Pure: no clock, no I/O, no asyncio. It must never decide whether to fire (misfire
tolerance, checkpoints) - it only orders what it was given.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")

# Rebuild the heap once it holds this many dead items and they outnumber the live ones, so
# memory stays O(live) under churn without rebuilding on every replacement.
_COMPACT_MIN_STALE = 1024

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Entry(Generic[P]):
    """One schedule waiting to fire. ``payload`` is opaque here (e.g. the bucket row)."""

    due_ms: int
    tenant: str
    schedule_id: str
    version: int
    payload: P

    @property
    def key(self) -> Key:
        return (self.tenant, self.schedule_id)


class Timeline(Generic[P]):
    """Due queue of one partition. Not thread-safe: use it from the event loop only."""

    def __init__(self, *, loaded_until_ms: int = 0, tombstone_ttl_ms: int = 60_000) -> None:
        # (due_ms, seq, entry): seq breaks ties in insertion order and keeps Entry (whose
        # payload may not be orderable) out of comparisons.
        self._heap: list[tuple[int, int, Entry[P]]] = []
        self._live: dict[Key, Entry[P]] = {}
        self._seq = itertools.count()
        self._loaded_until_ms = loaded_until_ms
        # Versions of removed schedules, so a bucket read that started before a cancel and
        # completes after it cannot resurrect the cancelled row. Expire FIFO by the clock
        # the ticker passes to pop_due (tombstone_ttl_ms after the removal).
        self._tombstone_ttl_ms = tombstone_ttl_ms
        self._tombstones: dict[Key, int] = {}
        self._tombstone_expiry: deque[tuple[int, Key, int]] = deque()
        self._now_ms = 0

    # -- horizon ---------------------------------------------------------------------------

    @property
    def loaded_until_ms(self) -> int:
        """Every stored entry due before this instant has been loaded into the timeline."""
        return self._loaded_until_ms

    def mark_loaded(self, until_ms: int) -> None:
        """Record that buckets below ``until_ms`` are loaded. Never moves backwards: a late,
        smaller value (e.g. from a slow catch-up read) must not make the command agent stop
        offering schedules for minutes that are already in memory."""
        self._loaded_until_ms = max(self._loaded_until_ms, until_ms)

    def covers(self, due_ms: int) -> bool:
        """True if a schedule due at ``due_ms`` must be offered to this timeline (its bucket
        has already been read, so the ticker would never see it otherwise)."""
        return due_ms < self._loaded_until_ms

    # -- mutation --------------------------------------------------------------------------

    def add(self, entry: Entry[P]) -> bool:
        """Add or replace the entry of ``entry``'s schedule; returns whether it was taken.

        Refused when an entry with a higher version is live, when the same version at the
        same due time is already live (a re-read of a loaded row), or when a tombstone of
        an equal or higher version exists (the schedule was removed after this row was
        read). An equal version with a different due time replaces (should not happen, but
        the newer write wins rather than firing twice).
        """
        key = entry.key
        dead_version = self._tombstones.get(key)
        if dead_version is not None and entry.version <= dead_version:
            return False
        current = self._live.get(key)
        if current is not None:
            if entry.version < current.version:
                return False
            if entry.version == current.version and entry.due_ms == current.due_ms:
                return False
        self._live[key] = entry
        heapq.heappush(self._heap, (entry.due_ms, next(self._seq), entry))
        if current is not None:
            self._maybe_compact()
        return True

    def remove(
        self,
        tenant: str,
        schedule_id: str,
        *,
        version: int | None = None,
        now_ms: int | None = None,
    ) -> bool:
        """Drop the schedule's entry; returns whether one was live.

        With ``version`` (the version written by a cancel, or by a reschedule whose new due
        time is beyond the loaded horizon) and ``now_ms``, also keep a tombstone so a stale
        row of that version or lower, read from Cassandra before the change, is refused by
        ``add`` until ``now_ms + tombstone_ttl_ms``. Call it that way on every cancel and
        reschedule, even when ``covers`` is False: a bucket read may be in flight.
        """
        key = (tenant, schedule_id)
        if version is not None:
            if now_ms is None:
                raise ValueError("remove(version=...) needs now_ms to expire the tombstone")
            previous = self._tombstones.get(key)
            if previous is None or version > previous:
                self._tombstones[key] = version
                expires_ms = max(now_ms, self._now_ms) + self._tombstone_ttl_ms
                self._tombstone_expiry.append((expires_ms, key, version))
        current = self._live.pop(key, None)
        if current is None:
            return False
        self._maybe_compact()
        return True

    def pop_due(self, now_ms: int, *, limit: int | None = None) -> list[Entry[P]]:
        """Remove and return live entries with ``due_ms <= now_ms``, oldest first.

        ``limit`` caps one call so a burst minute can be emitted in slices without starving
        the event loop; the rest stay queued.
        """
        self._now_ms = max(self._now_ms, now_ms)
        self._expire_tombstones()
        due: list[Entry[P]] = []
        heap = self._heap
        while heap and heap[0][0] <= now_ms and (limit is None or len(due) < limit):
            _, _, entry = heapq.heappop(heap)
            if self._live.get(entry.key) is entry:
                del self._live[entry.key]
                due.append(entry)
        return due

    def clear(self) -> None:
        """Forget everything, e.g. when the partition is revoked."""
        self._heap.clear()
        self._live.clear()
        self._tombstones.clear()
        self._tombstone_expiry.clear()
        self._loaded_until_ms = 0

    # -- queries ---------------------------------------------------------------------------

    def next_due_ms(self) -> int | None:
        """Due time of the earliest live entry, or None when empty (drops dead heap heads)."""
        heap = self._heap
        while heap:
            _, _, entry = heap[0]
            if self._live.get(entry.key) is entry:
                return entry.due_ms
            heapq.heappop(heap)
        return None

    def superseded(self, tenant: str, schedule_id: str, version: int) -> bool:
        """True if ``version`` of the schedule was removed (a tombstone of it or a later
        version) or a later version is live: a row of it must not fire any more."""
        key = (tenant, schedule_id)
        dead_version = self._tombstones.get(key)
        if dead_version is not None and version <= dead_version:
            return True
        live = self._live.get(key)
        return live is not None and live.version > version

    def get(self, tenant: str, schedule_id: str) -> Entry[P] | None:
        return self._live.get((tenant, schedule_id))

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    # -- internals -------------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        stale = len(self._heap) - len(self._live)
        if stale >= _COMPACT_MIN_STALE and stale > len(self._live):
            # Rebuild from the live entries only, keeping their seq so ties keep their order.
            items = sorted(
                (item for item in self._heap if self._live.get(item[2].key) is item[2]),
                key=lambda item: (item[0], item[1]),
            )
            self._heap = items  # a sorted list is a valid heap

    def _expire_tombstones(self) -> None:
        expiry = self._tombstone_expiry
        while expiry and expiry[0][0] <= self._now_ms:
            _, key, version = expiry.popleft()
            # Only drop it if no newer tombstone replaced it.
            if self._tombstones.get(key) == version:
                del self._tombstones[key]

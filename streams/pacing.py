"""Fair, quota-paced emission of one partition's due triggers (pure; used by the ticker).

The ticker moves every entry whose due second has come out of the timeline and into this
queue, then takes slices from it to emit. Two rules decide the order:

* **Round-robin across tenants.** Each tenant has its own queue (earliest due first); a
  slice takes one entry per tenant in turn. A tenant with 100,000 triggers due in this
  second and a tenant with one both get their first trigger out in the first slice, so one
  tenant's burst cannot delay another's triggers past their misfire tolerance.
* **Fire quota.** A tenant with ``fire_quota_per_min`` > 0 has a token bucket per
  partition, refilled at ``quota / 60 / partitions`` tokens a second and holding at most a
  minute's share (``quota / partitions``, at least 1). Fires spread over partitions by
  murmur2 of the schedule id, so the buckets add up to the tenant's quota across the
  cluster (the create quota's reasoning, streams.tenants.QuotaBook). A tenant without a
  token is skipped - its entries stay queued (**deferred, never dropped**) until a token
  comes - and the other tenants go on.

The queue also knows which order keys it holds (per tenant): the ticker lets a trigger a
command waits for skip the queue only when nothing of its order key is queued, since
triggers of one order key must reach the fire topic in due order. For the same reason an
order key can be **held** (``hold``; the ticker holds the key of a trigger whose send
failed until Kafka has it again): its entries wait apart, are not taken, and go back to
their tenant's queue on ``release``.

The ticker judges a trigger's misfire tolerance when it enters this queue; the time it
then waits here (its tenant's quota, or its turn) is reported as ``waited_ms`` so that a
trigger is never recorded as missed merely because of pacing. The ticker's checkpoint must
stay below ``earliest_due_ms()`` (entries here are neither emitted nor recorded).

Pure: the clock is passed in, no I/O, no asyncio.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from streams.tenants import TokenBucket
from streams.timeline import Entry, Key

P = TypeVar("P")

# Rebuild the queues once this many removed entries linger and they outnumber live ones.
_COMPACT_MIN_DEAD = 1024
# Entries one tenant takes per turn when ``take`` has no limit (the catch-up path).
_PER_TURN = 64


@dataclass(frozen=True, slots=True)
class Paced(Generic[P]):
    """An entry taken for emission, with how long it waited in the queue."""

    entry: Entry[P]
    waited_ms: int
    throttled: bool  # it waited (at least once) because its tenant had no fire token


class FirePacer(Generic[P]):
    """Per-tenant queues of due entries, taken round-robin within each tenant's fire quota.
    Not thread-safe: use it from the event loop only."""

    def __init__(
        self,
        *,
        partitions: int = 1,
        order_key_of: Callable[[Entry[P]], Hashable] | None = None,
    ) -> None:
        self.partitions = max(1, partitions)
        # An entry's order key (default its schedule id); bounded: live entries only.
        self._order_key_of = order_key_of or _schedule_id
        self._order_keys: dict[tuple[str, Hashable], int] = {}  # -> live entries of it
        # Per tenant: heap of (due_ms, seq, pushed_ms, entry).
        self._queues: dict[str, list[tuple[int, int, int, Entry[P]]]] = {}
        self._ring: deque[str] = deque()  # tenants with a queue, in turn order
        self._live: dict[Key, Entry[P]] = {}
        self._dead = 0
        self._seq = itertools.count()
        self._buckets: dict[str, TokenBucket] = {}
        self._blocked_at: dict[str, int] = {}  # when each tenant last ran out of tokens
        # Held order keys -> heap of their entries, as in the tenants' queues; bounded by
        # the keys the ticker holds (a failed send each).
        self._held: dict[tuple[str, Hashable], list[tuple[int, int, int, Entry[P]]]] = {}

    # -- queue -----------------------------------------------------------------------------

    def push(self, entry: Entry[P], now_ms: int) -> None:
        """Queue a due entry (replacing a queued older entry of the same schedule)."""
        key = entry.key
        replaced = self._live.get(key)
        if replaced is not None:
            self._dead += 1
            self._count(replaced, -1)
        self._live[key] = entry
        order_key = (entry.tenant, self._order_key_of(entry))
        self._order_keys[order_key] = self._order_keys.get(order_key, 0) + 1
        if self._held and order_key in self._held:
            heapq.heappush(self._held[order_key], (entry.due_ms, next(self._seq), now_ms, entry))
            return
        queue = self._queues.get(entry.tenant)
        if queue is None:
            queue = self._queues[entry.tenant] = []
            self._ring.append(entry.tenant)
        heapq.heappush(queue, (entry.due_ms, next(self._seq), now_ms, entry))

    def remove(self, tenant: str, schedule_id: str, *, version: int | None = None) -> bool:
        """Drop the schedule's queued entry (only if its version is <= ``version``, when
        given: a cancel or reschedule of that version); returns whether one was queued."""
        key = (tenant, schedule_id)
        current = self._live.get(key)
        if current is None or (version is not None and current.version > version):
            return False
        del self._live[key]
        self._count(current, -1)
        self._dead += 1
        self._maybe_compact()
        return True

    def get(self, tenant: str, schedule_id: str) -> Entry[P] | None:
        return self._live.get((tenant, schedule_id))

    def holds_order_key_of(self, entry: Entry[P]) -> bool:
        """True if an entry of ``entry``'s tenant and order key is queued."""
        return (entry.tenant, self._order_key_of(entry)) in self._order_keys

    def hold(self, tenant: str, order_key: Hashable) -> None:
        """Take nothing of ``tenant``'s ``order_key`` until ``release``: its queued entries,
        and those pushed meanwhile, wait apart (still queued for ``get``, ``remove`` and
        ``earliest_due_ms``)."""
        key = (tenant, order_key)
        if key in self._held:
            return
        held: list[tuple[int, int, int, Entry[P]]] = []
        queue = self._queues.get(tenant)
        if queue and key in self._order_keys:
            kept = []
            for item in queue:
                if self._live.get(item[3].key) is not item[3]:
                    self._dead = max(0, self._dead - 1)
                    continue  # removed or replaced: dropped here
                if self._order_key_of(item[3]) == order_key:
                    held.append(item)
                else:
                    kept.append(item)
            heapq.heapify(held)
            heapq.heapify(kept)
            self._queues[tenant] = kept
        self._held[key] = held

    def release(self, tenant: str, order_key: Hashable) -> None:
        """Let ``hold``'s entries be taken again, in due order with their tenant's others."""
        held = self._held.pop((tenant, order_key), None)
        if not held:
            return
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = []
            self._ring.append(tenant)
        for item in held:
            if self._live.get(item[3].key) is item[3]:
                heapq.heappush(queue, item)

    def __len__(self) -> int:
        return len(self._live)

    def clear(self) -> None:
        self._queues.clear()
        self._ring.clear()
        self._live.clear()
        self._order_keys.clear()
        self._held.clear()
        self._dead = 0

    # -- taking ----------------------------------------------------------------------------

    def take(
        self, now_ms: int, quota_of: Callable[[str], int], *, limit: int | None = None
    ) -> list[Paced[P]]:
        """Up to ``limit`` entries, tenants taking turns, each within its tenant's fire
        quota (``quota_of(tenant)``: fires per minute, 0 = unlimited). Tenants out of
        tokens keep their entries and their place after the others.

        A turn takes an equal share of what is left of ``limit`` (at least one; at most
        ``_PER_TURN`` without a limit), not always exactly one: with one tenant bursting
        that keeps the cost per trigger near a heap pop, and another tenant's trigger still
        comes within the same slice."""
        out: list[Paced[P]] = []
        ring = self._ring
        live = self._live
        order_keys, order_key_of = self._order_keys, self._order_key_of
        parked: list[str] = []
        now_s = now_ms / 1000
        while ring and (limit is None or len(out) < limit):
            tenant = ring.popleft()
            if self._head(tenant) is None:
                del self._queues[tenant]
                continue
            want = _PER_TURN if limit is None else max(1, (limit - len(out)) // (len(ring) + 1))
            bucket = self._bucket(tenant, quota_of(tenant), now_ms)
            if bucket is not None:
                allowed = int(bucket.available(now_s))
                if allowed < 1:
                    self._blocked_at[tenant] = now_ms
                    parked.append(tenant)
                    continue
                want = min(want, allowed)
            queue = self._queues[tenant]
            blocked_at = self._blocked_at.get(tenant, -1)
            got = 0
            while got < want and queue:
                _, _, pushed_ms, entry = heapq.heappop(queue)
                key = (entry.tenant, entry.schedule_id)
                if live.get(key) is not entry:
                    self._dead = max(0, self._dead - 1)
                    continue  # removed or replaced meanwhile
                del live[key]
                order_key = (entry.tenant, order_key_of(entry))
                left = order_keys[order_key] - 1
                if left:
                    order_keys[order_key] = left
                else:
                    del order_keys[order_key]
                out.append(Paced(entry, max(0, now_ms - pushed_ms), pushed_ms <= blocked_at))
                got += 1
            if bucket is not None and got:
                bucket.take(now_s, got)
            ring.append(tenant)  # (dropped on its next turn if its queue is empty now)
        ring.extend(parked)
        return out

    def next_token_ms(self, now_ms: int, quota_of: Callable[[str], int]) -> int | None:
        """When the earliest tenant waiting for a fire token gets one (now when some queued
        tenant could take already); None when nothing is queued."""
        best: int | None = None
        for tenant in self._ring:
            if self._head(tenant) is None:
                continue
            bucket = self._bucket(tenant, quota_of(tenant), now_ms)
            at = now_ms if bucket is None else now_ms + _ceil_ms(bucket.wait_s(now_ms / 1000))
            if best is None or at < best:
                best = at
        return best

    def earliest_due_ms(self) -> int | None:
        """Due time of the earliest queued entry (the ticker's checkpoint stays below it)."""
        best: int | None = None
        for tenant in list(self._ring):
            head = self._head(tenant)
            if head is not None and (best is None or head[0] < best):
                best = head[0]
        for held in self._held.values():
            for due, _, _, entry in held:  # few: one key's entries; removed ones too
                if self._live.get(entry.key) is entry and (best is None or due < best):
                    best = due
        return best

    # -- internals -------------------------------------------------------------------------

    def _head(self, tenant: str) -> tuple[int, int, int, Entry[P]] | None:
        """The tenant's earliest live item, dropping removed or replaced ones on top."""
        queue = self._queues.get(tenant)
        while queue:
            item = queue[0]
            if self._live.get(item[3].key) is item[3]:
                return item
            heapq.heappop(queue)
            self._dead = max(0, self._dead - 1)
        return None

    def _count(self, entry: Entry[P], delta: int) -> None:
        key = (entry.tenant, self._order_key_of(entry))
        left = self._order_keys.get(key, 0) + delta
        if left > 0:
            self._order_keys[key] = left
        else:
            self._order_keys.pop(key, None)

    def _bucket(self, tenant: str, quota_per_min: int, now_ms: int) -> TokenBucket | None:
        if quota_per_min <= 0:
            self._buckets.pop(tenant, None)
            return None
        rate = quota_per_min / 60 / self.partitions
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != rate:
            # A minute's share may go out at once: the quota is per minute, not per second.
            burst = max(1.0, quota_per_min / self.partitions)
            bucket = self._buckets[tenant] = TokenBucket(rate, burst, now_ms / 1000)
        return bucket

    def _maybe_compact(self) -> None:
        if self._dead < _COMPACT_MIN_DEAD or self._dead <= len(self._live):
            return
        for tenant, queue in self._queues.items():
            kept = [item for item in queue if self._live.get(item[3].key) is item[3]]
            heapq.heapify(kept)
            self._queues[tenant] = kept
        self._dead = 0


def _schedule_id(entry: Entry[P]) -> str:
    return entry.schedule_id


def _ceil_ms(seconds: float) -> int:
    return max(0, -int(-seconds * 1000 // 1))

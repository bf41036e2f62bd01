"""A small time-to-live cache for async lookups, with one load in flight per key.

Without the single flight, every request that arrives while an entry is expired reads the
store itself: at a few hundred requests per second through the API, each tenant and API
key expiry (every ``TOCSIN_TENANT_CACHE_TTL_S``) sent a burst of identical Cassandra reads.
Now the first caller loads and the others wait for that same load.

Keys come from outside (tenant names, API key ids in requests that may be random), so the
cache holds at most ``max_entries``, dropping the least recently used: a flood of unknown
keys costs reads, never memory.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


DEFAULT_MAX_ENTRIES = 10_000


class TtlCache(Generic[K, V]):
    """``get(key)``: the cached value while fresh, else ``load(key)`` (shared by concurrent
    callers). ``ttl_s(value)``: how long a loaded value stays fresh (e.g. shorter for
    "not found"). A load that fails is not cached; its callers get the error. At most
    ``max_entries`` values are kept (least recently used dropped first)."""

    def __init__(
        self,
        load: Callable[[K], Awaitable[V]],
        *,
        ttl_s: Callable[[V], float],
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._load = load
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._loading: dict[K, asyncio.Task[V]] = {}

    async def get(self, key: K) -> V:
        hit = self._entries.get(key)
        if hit is not None and hit[0] > self._clock():
            self._entries.move_to_end(key)
            return hit[1]
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fill(key))
            # Retrieve a failure even when every caller was cancelled (no "never
            # retrieved" noise); callers that wait get it raised.
            task.add_done_callback(_retrieve)
            self._loading[key] = task
        # A cancelled caller must not cancel the load the others wait for.
        return await asyncio.shield(task)

    def peek(self, key: K) -> V | None:
        """The cached value without waiting, stale or not (None if never loaded); a stale
        or missing entry starts a background load (one at a time; its failure is only
        dropped, the stale value keeps serving). For callers that cannot wait, such as the
        ticker deciding a fire."""
        hit = self._entries.get(key)
        if (hit is None or hit[0] <= self._clock()) and key not in self._loading:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no running loop: nothing to refresh with
                return hit[1] if hit is not None else None
            task = asyncio.ensure_future(self._fill(key))
            task.add_done_callback(_retrieve)
            self._loading[key] = task
        return hit[1] if hit is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def invalidate(self, key: K) -> None:
        """Forget ``key``: the next ``get`` loads again (a load already in flight still
        answers its callers but is not cached)."""
        self._entries.pop(key, None)
        self._loading.pop(key, None)

    async def _fill(self, key: K) -> V:
        me = asyncio.current_task()
        try:
            value = await self._load(key)
            if self._loading.get(key) is me:  # not invalidated meanwhile
                self._entries[key] = (self._clock() + self._ttl_s(value), value)
                self._entries.move_to_end(key)
                while len(self._entries) > self._max_entries:
                    self._entries.popitem(last=False)
            return value
        finally:
            if self._loading.get(key) is me:
                del self._loading[key]


def _retrieve(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()

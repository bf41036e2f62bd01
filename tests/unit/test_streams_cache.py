"""streams.cache.TtlCache: freshness, one load in flight per key, failures, invalidation."""

from __future__ import annotations

import asyncio

import pytest

from streams.cache import TtlCache


class Loader:
    """Counts loads; each load waits for ``release`` so tests control concurrency."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.fail: Exception | None = None
        self.version = 0

    async def __call__(self, key: str) -> str | None:
        self.calls.append(key)
        version = self.version  # what the store holds when the read starts
        self.started.set()
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return None if key == "missing" else f"{key}-v{version}"


def cache_with(loader: Loader, now: list[float]) -> TtlCache[str, str | None]:
    return TtlCache(loader, ttl_s=lambda v: 5.0 if v is not None else 1.0, clock=lambda: now[0])


async def test_concurrent_misses_share_one_load() -> None:
    loader, now = Loader(), [0.0]
    cache = cache_with(loader, now)
    waiting = [asyncio.ensure_future(cache.get("acme")) for _ in range(50)]
    await asyncio.sleep(0)
    loader.release.set()
    assert await asyncio.gather(*waiting) == ["acme-v0"] * 50
    assert loader.calls == ["acme"]


async def test_fresh_until_its_ttl_then_loaded_again() -> None:
    loader, now = Loader(), [0.0]
    loader.release.set()
    cache = cache_with(loader, now)
    assert await cache.get("acme") == "acme-v0"
    loader.version = 1
    now[0] = 4.9
    assert await cache.get("acme") == "acme-v0"
    now[0] = 5.1
    assert await cache.get("acme") == "acme-v1"
    # "Not found" has its own, shorter lifetime.
    assert await cache.get("missing") is None
    now[0] = 6.0
    assert await cache.get("missing") is None
    now[0] = 6.2
    await cache.get("missing")
    assert loader.calls == ["acme", "acme", "missing", "missing"]


async def test_a_failed_load_reaches_every_waiter_and_is_not_cached() -> None:
    loader, now = Loader(), [0.0]
    cache = cache_with(loader, now)
    loader.fail = RuntimeError("store down")
    waiting = [asyncio.ensure_future(cache.get("acme")) for _ in range(3)]
    await asyncio.sleep(0)
    loader.release.set()
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    loader.fail = None
    assert await cache.get("acme") == "acme-v0"
    assert loader.calls == ["acme", "acme"]


async def test_invalidate_during_a_load_keeps_its_stale_answer_out_of_the_cache() -> None:
    loader, now = Loader(), [0.0]
    cache = cache_with(loader, now)
    early = asyncio.ensure_future(cache.get("acme"))
    await loader.started.wait()
    cache.invalidate("acme")  # e.g. the tenant was just changed by this API
    loader.version = 1
    loader.release.set()
    assert await early == "acme-v0"  # asked before the change
    assert await cache.get("acme") == "acme-v1"  # loaded again, not the stale value
    assert loader.calls == ["acme", "acme"]


async def test_a_cancelled_caller_does_not_cancel_the_shared_load() -> None:
    loader, now = Loader(), [0.0]
    cache = cache_with(loader, now)
    first = asyncio.ensure_future(cache.get("acme"))
    second = asyncio.ensure_future(cache.get("acme"))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    loader.release.set()
    assert await second == "acme-v0"
    assert loader.calls == ["acme"]


async def test_peek_never_waits_serves_stale_and_refreshes_once_in_the_background() -> None:
    loader, now = Loader(), [0.0]
    cache = cache_with(loader, now)
    assert cache.peek("acme") is None  # never loaded: nothing yet, a load starts
    await asyncio.sleep(0)
    assert cache.peek("acme") is None and loader.calls == ["acme"]  # one load at a time
    loader.release.set()
    await asyncio.sleep(0.01)
    assert cache.peek("acme") == "acme-v0" and loader.calls == ["acme"]  # fresh: no load
    loader.version, now[0] = 1, 6.0
    loader.release.clear()
    assert cache.peek("acme") == "acme-v0"  # stale value at once, refresh behind it
    loader.fail = RuntimeError("store down")
    loader.release.set()
    await asyncio.sleep(0.01)
    assert cache.peek("acme") == "acme-v0"  # a failed refresh keeps the stale value
    loader.fail = None
    await asyncio.sleep(0.01)
    assert cache.peek("acme") == "acme-v1"
    assert loader.calls == ["acme", "acme", "acme"]


async def test_a_flood_of_unknown_keys_is_bounded_and_keeps_the_busy_ones() -> None:
    loader, now = Loader(), [0.0]
    loader.release.set()
    cache: TtlCache[str, str | None] = TtlCache(
        loader, ttl_s=lambda v: 5.0, clock=lambda: now[0], max_entries=100
    )
    assert await cache.get("acme") == "acme-v0"
    for i in range(5_000):  # random, well-formed, unknown keys
        await cache.get(f"random-{i}")
        if i % 50 == 0:
            await cache.get("acme")  # a real key in use stays cached
    assert len(cache) <= 100
    assert loader.calls.count("acme") == 1

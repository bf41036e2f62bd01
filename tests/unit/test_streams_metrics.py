"""The worker's own health metrics: event-loop lag and GC pauses are observed."""

from __future__ import annotations

import asyncio
import gc
import time

from streams import metrics


def _count(hist: object, le: str) -> float:
    """Observations of a prometheus histogram above ``le`` seconds."""
    total = above = 0.0
    for sample in hist.collect()[0].samples:  # type: ignore[attr-defined]
        if sample.name.endswith("_bucket"):
            if sample.labels["le"] == "+Inf":
                total += sample.value
            elif sample.labels["le"] == le:
                above -= sample.value
    return total + above


async def test_a_blocked_loop_is_seen_as_lag() -> None:
    before = _count(metrics.LOOP_LAG, "0.25")
    watch = asyncio.ensure_future(metrics.watch_loop_lag(interval_s=0.01))
    await asyncio.sleep(0.05)
    # A callback holding the loop, as a long CPU-bound step would.
    asyncio.get_running_loop().call_soon(time.sleep, 0.3)
    await asyncio.sleep(0.1)
    watch.cancel()
    assert _count(metrics.LOOP_LAG, "0.25") == before + 1


def test_gc_pauses_are_recorded_by_generation() -> None:
    metrics.observe_gc_pauses()
    metrics.observe_gc_pauses()  # once only
    assert gc.callbacks.count(metrics._on_gc) == 1
    counted = sum(
        s.value
        for s in metrics.GC_PAUSE.collect()[0].samples
        if s.name.endswith("_count") and s.labels["generation"] == "2"
    )
    gc.collect()
    after = sum(
        s.value
        for s in metrics.GC_PAUSE.collect()[0].samples
        if s.name.endswith("_count") and s.labels["generation"] == "2"
    )
    assert after == counted + 1


def test_worker_gc_tuning_freezes_start_up_and_sets_thresholds() -> None:
    old = gc.get_threshold()
    try:
        metrics.tune_gc_for_worker()
        assert gc.get_threshold() == metrics.WORKER_GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)

"""``tocsin status``: aggregation, percentiles, lag, rendering, and the window the reads
are bounded by (no servers)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from streams.status import (
    HOUR_MS,
    MINUTE_MS,
    OVERDUE_AFTER_MS,
    Lag,
    Report,
    StateColumns,
    Tally,
    Window,
    lag_of,
    percentile,
    render,
)
from streams.status_io import collect
from tests.fakes import FakeStore

NOW = 1_800_000_000_000 + 30_500  # 30.5 s into a minute
WINDOW = Window(now_ms=NOW, lookback_ms=2 * HOUR_MS, horizon_ms=24 * HOUR_MS)


def state(sid: str, st: str, due: int, **kw: Any) -> StateColumns:
    return StateColumns(schedule_id=sid, state=st, due_ms=due, version=1, **kw)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([7], 99) == 7
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([5, 1, 3], 50) == 3  # unsorted input
    with pytest.raises(ValueError):
        percentile(values, 0)


def test_window_minutes_cover_lookback_to_an_hour_ahead() -> None:
    minutes = WINDOW.minutes()
    assert minutes[0] <= WINDOW.past_from_ms < minutes[0] + MINUTE_MS
    assert minutes[-1] < WINDOW.ahead_until_ms <= minutes[-1] + MINUTE_MS
    assert all(b - a == MINUTE_MS for a, b in itertools.pairwise(minutes))
    assert len(minutes) == 3 * 60 + 1  # 2 h back, 1 h ahead, unaligned ends
    with pytest.raises(ValueError):
        Window(now_ms=NOW, lookback_ms=-1, horizon_ms=0)


def test_bucket_rows_due_ahead_count_without_reading_the_schedule() -> None:
    tally = Tally(WINDOW, ["a", "quiet"])
    assert tally.bucket_row("a", NOW) is False  # due now: still waiting
    assert tally.bucket_row("a", NOW + HOUR_MS - 1) is False
    assert tally.bucket_row("a", NOW + HOUR_MS) is False  # beyond the hour: not counted
    assert tally.bucket_row("a", NOW - 1) is True  # due before now: read its row
    assert tally.bucket_row("a", WINDOW.past_from_ms - 1) is False  # before the window
    figures = {f.tenant: f for f in tally.figures()}
    assert figures["a"].due_next_hour == 2
    assert figures["quiet"].due_next_hour == 0  # a tenant with nothing is still listed


def test_past_triggers_count_by_when_they_fired_and_were_delivered() -> None:
    tally = Tally(WINDOW)
    recent_due = NOW - 10 * MINUTE_MS
    old_due = NOW - 90 * MINUTE_MS
    rows = [
        # fired 40 ms late, delivered: in the last hour
        (
            recent_due,
            state(
                "f1",
                "fired",
                recent_due,
                fired_ms=recent_due + 40,
                delivery_outcome="delivered",
                delivery_ms=recent_due + 90,
            ),
        ),
        (
            recent_due,
            state(
                "f2",
                "fired",
                recent_due,
                fired_ms=recent_due + 2,
                delivery_outcome="dead_lettered",
                delivery_ms=recent_due + 500,
            ),
        ),
        # fired 90 min ago, dead-lettered (after retries) 5 min ago
        (
            old_due,
            state(
                "f3",
                "fired",
                old_due,
                fired_ms=old_due + 1,
                delivery_outcome="dead_lettered",
                delivery_ms=NOW - 5 * MINUTE_MS,
            ),
        ),
        # missed 30 min ago (no fired_ms; its time is updated_ms)
        (old_due, state("m1", "missed", old_due, updated_ms=NOW - 30 * MINUTE_MS)),
        (recent_due, state("o1", "scheduled", recent_due)),  # overdue
        # due a moment ago: being fired, not overdue
        (NOW - OVERDUE_AFTER_MS + 1, state("w1", "scheduled", NOW - OVERDUE_AFTER_MS + 1)),
        (recent_due, state("c1", "cancelled", recent_due)),
    ]
    for due, row in rows:
        tally.past_trigger("a", due, 1, row)
    tally.past_trigger("a", recent_due, 1, None)  # row expired: nothing
    # A bucket row of an older version (rescheduled since): its row speaks for another.
    tally.past_trigger(
        "a",
        recent_due,
        1,
        StateColumns(schedule_id="r1", state="scheduled", due_ms=recent_due, version=2),
    )
    tally.past_trigger("a", recent_due, 1, state("r2", "fired", NOW + 5, fired_ms=NOW))
    (a,) = tally.figures()
    assert a.fired_last_hour == 2  # f3 fired before the last hour
    assert a.lateness_ms == [40, 2]
    assert a.delivered_last_hour == 1
    assert a.dead_lettered_last_hour == 2
    assert a.missed_last_hour == 1
    assert a.overdue == 1
    out = a.to_json()
    assert out["lateness_p50_ms"] == 2 and out["lateness_p99_ms"] == 40


def test_waiting_adds_up_and_remembers_truncation() -> None:
    tally = Tally(WINDOW)
    tally.waiting("a", 3)
    tally.waiting("a", 2, truncated=True)
    tally.waiting("a", 1)
    (a,) = tally.figures()
    assert a.scheduled == 6 and a.scheduled_truncated


def test_lag_counts_from_committed_or_earliest() -> None:
    lag = lag_of(
        "g", "t", {0: 10, 1: None, 2: 50}, low={0: 0, 1: 4, 2: 0}, high={0: 15, 1: 9, 2: 40}
    )
    # 5 behind, 5 from earliest (never committed), a commit past a truncated end: 0
    assert (lag.lag, lag.partitions, lag.uncommitted) == (10, 3, 1)
    assert lag.to_json()["uncommitted_partitions"] == 1


def test_render_is_a_table_with_lag_and_problems() -> None:
    tally = Tally(WINDOW, ["acme", "b"])
    tally.waiting("acme", 12, truncated=True)
    tally.bucket_row("acme", NOW + 1)
    due = NOW - MINUTE_MS
    tally.past_trigger("acme", due, 1, state("x", "fired", due, fired_ms=due + 3))
    report = Report(
        window=WINDOW,
        tenants=tally.figures(),
        lags=[
            Lag(
                group="tocsin.scheduler",
                topic="tocsin.commands",
                lag=7,
                partitions=8,
                uncommitted=2,
            )
        ],
        problems=["something unreadable"],
    )
    text = render(report)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("TENANT"))
    assert lines[header].split() == [
        "TENANT",
        "SCHEDULED",
        "DUE<1H",
        "OVERDUE",
        "FIRED",
        "MISSED",
        "DELIVERED",
        "DEAD",
        "LATE",
        "P50",
        "LATE",
        "P99",
    ]
    assert lines[header + 1].split() == [
        "acme",
        ">=12",
        "1",
        "0",
        "1",
        "0",
        "0",
        "0",
        "3",
        "ms",
        "3",
        "ms",
    ]
    assert lines[header + 2].split()[:2] == ["b", "0"] and lines[header + 2].endswith("-")
    assert "within 1 d" in lines[0] and "next 1 h" in lines[0]
    assert "in the last 1 h, of triggers due in the last 2 h" in lines[1]
    assert any(
        line.split()[:3] == ["tocsin.scheduler", "tocsin.commands", "7"]
        and "2/8 partitions never committed" in line
        for line in lines
    )
    assert lines[-1] == "warning: something unreadable"
    out = report.to_json()
    assert out["window"] == {
        "recent_s": 3600,
        "ahead_s": 3600,
        "lookback_s": 7200,
        "horizon_s": 86400,
    }
    assert out["tenants"][0]["scheduled"] == 12 and out["tenants"][0]["scheduled_truncated"]
    assert out["consumer_lag"][0]["lag"] == 7


def status_store(
    buckets: list[dict[str, Any]],
    schedules: dict[tuple[str, str], dict[str, Any]],
    index: dict[str, list[tuple[int, str]]],
    recurring: dict[str, list[str]],
) -> FakeStore:
    """The fake answering ``collect``'s own statements from these lists."""

    def bucket_keys(params: Sequence[Any]) -> list[dict[str, Any]]:
        p, minute, shard, lo, hi = params
        return [
            r
            for r in buckets
            if r["partition"] == p
            and r["shard"] == shard
            and r["due_ms"] - r["due_ms"] % MINUTE_MS == minute
            and lo <= r["due_ms"] < hi
        ]

    def states(params: Sequence[Any]) -> list[dict[str, Any]]:
        tenant, ids = params
        assert len(ids) <= 100
        return [schedules[(tenant, i)] for i in ids if (tenant, i) in schedules]

    store = FakeStore(
        tenants={"b": {"tenant": "b"}, "a": {"tenant": "a"}},
        statements={"status_bucket_keys": bucket_keys, "status_states": states},
    )
    store.index = {tenant: set(entries) for tenant, entries in index.items()}
    store.recurring_index = {t: dict.fromkeys(ids, 0) for t, ids in recurring.items()}
    return store


def bucket_queries(store: FakeStore) -> list[tuple[Any, ...]]:
    return [params for name, params in store.statement_runs if name == "status_bucket_keys"]


def index_queries(store: FakeStore) -> list[tuple[str, int, int]]:
    return [
        (c.args[0], c.kwargs["from_ms"], c.kwargs["to_ms"]) for c in store.calls_of("read_index")
    ]


def _row(tenant: str, sid: str, st: str, due: int, **kw: Any) -> dict[str, Any]:
    return {"tenant": tenant, "schedule_id": sid, "state": st, "due_ms": due, "version": 1, **kw}


def test_collect_reads_only_the_window_and_counts_per_tenant() -> None:
    past = NOW - 20 * MINUTE_MS
    buckets = [
        {
            "partition": 0,
            "shard": 0,
            "due_ms": NOW + 5 * MINUTE_MS,
            "tenant": "a",
            "schedule_id": "up1",
            "version": 1,
        },
        {
            "partition": 1,
            "shard": 1,
            "due_ms": NOW + 50 * MINUTE_MS,
            "tenant": "a",
            "schedule_id": "run@1",
            "version": 1,
        },
        {
            "partition": 1,
            "shard": 0,
            "due_ms": past,
            "tenant": "a",
            "schedule_id": "done",
            "version": 1,
        },
        {
            "partition": 0,
            "shard": 1,
            "due_ms": past,
            "tenant": "b",
            "schedule_id": "late",
            "version": 1,
        },
    ]
    schedules = {
        ("a", "up1"): _row("a", "up1", "scheduled", NOW + 5 * MINUTE_MS),
        ("a", "done"): _row(
            "a",
            "done",
            "fired",
            past,
            fired_ms=past + 7,
            delivery_outcome="delivered",
            delivery_ms=past + 50,
        ),
        ("b", "late"): _row("b", "late", "scheduled", past),
        ("a", "far"): _row("a", "far", "scheduled", NOW + 20 * HOUR_MS),
        ("a", "gone"): _row("a", "gone", "cancelled", NOW + 2 * HOUR_MS),
        ("a", "moved"): _row("a", "moved", "scheduled", NOW + 3 * HOUR_MS),
        ("a", "run"): _row("a", "run", "scheduled", None),
        ("a", "ended"): _row("a", "ended", "cancelled", None),
    }
    index = {
        "a": [
            (NOW + 5 * MINUTE_MS, "up1"),
            (past, "done"),
            (NOW + 20 * HOUR_MS, "far"),
            (NOW + 2 * HOUR_MS, "gone"),
            (NOW + HOUR_MS, "moved"),
        ],  # moved: stale entry
        "b": [(past, "late")],
    }
    store = status_store(buckets, schedules, index, {"a": ["run", "ended"]})
    tally = asyncio.run(collect(store, WINDOW, partitions=2, shards=2, tenant=None, max_rows=1000))
    figures = {f.tenant: f.to_json() for f in tally.figures()}
    assert figures["a"]["due_next_hour"] == 2
    assert figures["a"]["fired_last_hour"] == 1 and figures["a"]["delivered_last_hour"] == 1
    assert figures["a"]["lateness_p50_ms"] == 7
    assert figures["a"]["scheduled"] == 3  # up1, far, the recurring "run"
    assert figures["b"]["overdue"] == 1 and figures["b"]["scheduled"] == 1
    # Bounded: every bucket read is inside the window; every minute, partition and shard
    # of it read once; the index only up to the horizon.
    assert len(bucket_queries(store)) == len(WINDOW.minutes()) * 2 * 2
    assert {q[1] for q in bucket_queries(store)} == set(WINDOW.minutes())
    assert all(
        WINDOW.past_from_ms <= q[3] and q[4] <= WINDOW.ahead_until_ms for q in bucket_queries(store)
    )
    assert all(
        to == NOW + 24 * HOUR_MS and lo == WINDOW.past_from_ms for _, lo, to in index_queries(store)
    )


def test_collect_for_one_tenant_and_a_row_cap() -> None:
    index = {"a": [(NOW + i * MINUTE_MS, f"s{i}") for i in range(10)]}
    schedules = {
        ("a", f"s{i}"): _row("a", f"s{i}", "scheduled", NOW + i * MINUTE_MS) for i in range(10)
    }
    buckets = [
        {
            "partition": 0,
            "shard": 0,
            "due_ms": NOW + MINUTE_MS,
            "tenant": t,
            "schedule_id": "x",
            "version": 1,
        }
        for t in ("a", "other")
    ]
    store = status_store(buckets, schedules, index, {})
    tally = asyncio.run(collect(store, WINDOW, partitions=1, shards=1, tenant="a", max_rows=4))
    (a,) = tally.figures()  # the other tenant's rows are left out
    assert a.tenant == "a" and a.due_next_hour == 1
    assert a.scheduled == 4 and a.scheduled_truncated


def test_lag_covers_the_proxys_retry_lane() -> None:
    from base.settings import Settings
    from proxy.app import retry_group_id
    from streams.status_io import lag_pairs

    pairs = lag_pairs(Settings.from_env({}), "tocsin-proxy")
    assert (retry_group_id("tocsin-proxy"), "tocsin.retries") in {(g, t) for g, t, _ in pairs}

"""The time math of recurring schedules (streams.recurring) as tables."""

from __future__ import annotations

from typing import Any

import pytest

from streams.recurring import (
    MAX_TOLERANCE_S,
    NEVER_MS,
    extend_at,
    jitter_ms,
    next_runs,
    occurrences,
    parse_run_id,
    plan,
    run_id,
    run_tolerance_s,
)
from topics.ids import parse_iso_ms
from topics.models import Ambiguous, Misfire, Nonexistent, Recurrence
from topics.recurrence import normalize_cron


def ms(text: str) -> int:
    return parse_iso_ms(text)


def cron(expr: str, zone: str = "UTC", **kw: Any) -> Recurrence:
    return Recurrence(cron=normalize_cron(expr), time_zone=zone, **kw)


SKIP, SHIFT = Nonexistent.SKIP, Nonexistent.SHIFT_FORWARD
ONCE, TWICE = Ambiguous.ONCE, Ambiguous.TWICE

# (case, recurrence, from (UTC), expected next runs (UTC))
DST_TABLE: list[tuple[str, Recurrence, str, list[str]]] = [
    (
        "New York spring forward: 02:30 does not exist, skipped",
        cron("30 2 * * *", "America/New_York", nonexistent=SKIP),
        "2026-03-07T00:00:00Z",
        ["2026-03-07T07:30:00Z", "2026-03-09T06:30:00Z"],
    ),
    (
        "New York spring forward: 02:30 shifted forward by the gap to 03:30 EDT",
        cron("30 2 * * *", "America/New_York", nonexistent=SHIFT),
        "2026-03-07T00:00:00Z",
        ["2026-03-07T07:30:00Z", "2026-03-08T07:30:00Z", "2026-03-09T06:30:00Z"],
    ),
    (
        "New York fall back: 01:30 occurs twice, runs once (EDT)",
        cron("30 1 * * *", "America/New_York", ambiguous=ONCE),
        "2026-10-31T12:00:00Z",
        ["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"],
    ),
    (
        "New York fall back: 01:30 runs twice (EDT then EST)",
        cron("30 1 * * *", "America/New_York", ambiguous=TWICE),
        "2026-10-31T12:00:00Z",
        ["2026-11-01T05:30:00Z", "2026-11-01T06:30:00Z", "2026-11-02T06:30:00Z"],
    ),
    (
        "New York: a 03:00 run is unaffected by the 02:00 gap",
        cron("0 3 * * *", "America/New_York"),
        "2026-03-07T12:00:00Z",
        ["2026-03-08T07:00:00Z", "2026-03-09T07:00:00Z"],
    ),
    (
        "London spring forward: 01:30 does not exist, skipped",
        cron("30 1 * * *", "Europe/London"),
        "2026-03-28T00:00:00Z",
        ["2026-03-28T01:30:00Z", "2026-03-30T00:30:00Z"],
    ),
    (
        "London spring forward: 01:30 shifted to 02:30 BST",
        cron("30 1 * * *", "Europe/London", nonexistent=SHIFT),
        "2026-03-28T00:00:00Z",
        ["2026-03-28T01:30:00Z", "2026-03-29T01:30:00Z", "2026-03-30T00:30:00Z"],
    ),
    (
        "London fall back: every 30 min through the repeated hour, once",
        cron("*/30 0-2 * * *", "Europe/London"),
        "2026-10-24T23:00:00Z",
        [
            "2026-10-24T23:00:00Z",
            "2026-10-24T23:30:00Z",
            "2026-10-25T00:00:00Z",
            "2026-10-25T00:30:00Z",
            "2026-10-25T02:00:00Z",
            "2026-10-25T02:30:00Z",
        ],
    ),
    (
        "London fall back: every 30 min through the repeated hour, twice",
        cron("*/30 0-2 * * *", "Europe/London", ambiguous=TWICE),
        "2026-10-24T23:00:00Z",
        [
            "2026-10-24T23:00:00Z",
            "2026-10-24T23:30:00Z",
            "2026-10-25T00:00:00Z",
            "2026-10-25T00:30:00Z",
            "2026-10-25T01:00:00Z",
            "2026-10-25T01:30:00Z",
            "2026-10-25T02:00:00Z",
            "2026-10-25T02:30:00Z",
        ],
    ),
    (
        "Lord Howe DST end: 30-minute overlap, 01:45 once (+11:00)",
        cron("45 1 * * *", "Australia/Lord_Howe"),
        "2026-04-04T00:00:00Z",
        ["2026-04-04T14:45:00Z", "2026-04-05T15:15:00Z"],
    ),
    (
        "Lord Howe DST end: 01:45 twice (+11:00 then +10:30)",
        cron("45 1 * * *", "Australia/Lord_Howe", ambiguous=TWICE),
        "2026-04-04T00:00:00Z",
        ["2026-04-04T14:45:00Z", "2026-04-04T15:15:00Z", "2026-04-05T15:15:00Z"],
    ),
    (
        "Lord Howe DST start: 30-minute gap, 02:15 skipped",
        cron("15 2 * * *", "Australia/Lord_Howe"),
        "2026-10-02T12:00:00Z",
        ["2026-10-02T15:45:00Z", "2026-10-04T15:15:00Z"],
    ),
    (
        "Lord Howe DST start: 02:15 shifted 30 minutes to 02:45 (+11:00)",
        cron("15 2 * * *", "Australia/Lord_Howe", nonexistent=SHIFT),
        "2026-10-02T12:00:00Z",
        ["2026-10-02T15:45:00Z", "2026-10-03T15:45:00Z", "2026-10-04T15:15:00Z"],
    ),
    (
        "Lord Howe DST start: shifted runs landing on regular ones run once",
        cron("*/15 2 * * *", "Australia/Lord_Howe", nonexistent=SHIFT),
        "2026-10-03T15:00:00Z",
        [
            "2026-10-03T15:30:00Z",
            "2026-10-03T15:45:00Z",
            "2026-10-04T15:00:00Z",
        ],
    ),
    (
        "Kolkata: +05:30 all year, no DST",
        cron("0 9 * * *", "Asia/Kolkata"),
        "2026-03-08T00:00:00Z",
        ["2026-03-08T03:30:00Z", "2026-03-09T03:30:00Z"],
    ),
    (
        "Kolkata: midnight local is the previous UTC day",
        cron("@daily", "Asia/Kolkata"),
        "2026-12-31T00:00:00Z",
        ["2026-12-31T18:30:00Z", "2027-01-01T18:30:00Z"],
    ),
]

CALENDAR_TABLE: list[tuple[str, Recurrence, str, list[str]]] = [
    (
        "day 31 skips short months",
        cron("0 0 31 * *"),
        "2026-01-01T00:00:00Z",
        ["2026-01-31T00:00:00Z", "2026-03-31T00:00:00Z", "2026-05-31T00:00:00Z"],
    ),
    (
        "February 29 only in leap years",
        cron("0 12 29 2 *"),
        "2026-01-01T00:00:00Z",
        ["2028-02-29T12:00:00Z", "2032-02-29T12:00:00Z"],
    ),
    (
        "day 30 never in February",
        cron("0 0 30 * *"),
        "2028-01-15T00:00:00Z",
        ["2028-01-30T00:00:00Z", "2028-03-30T00:00:00Z"],
    ),
    (
        "last day of February in a leap year, local New York",
        cron("0 23 28,29 2 *", "America/New_York"),
        "2028-02-01T00:00:00Z",
        ["2028-02-29T04:00:00Z", "2028-03-01T04:00:00Z", "2029-03-01T04:00:00Z"],
    ),
    (
        "both day fields restricted: either matches (1st, 15th or Mondays)",
        cron("0 0 1,15 * mon"),
        "2026-01-01T00:00:00Z",
        [
            "2026-01-01T00:00:00Z",
            "2026-01-05T00:00:00Z",
            "2026-01-12T00:00:00Z",
            "2026-01-15T00:00:00Z",
        ],
    ),
    (
        "day of month starting with '*': both must match (Vixie)",
        cron("0 0 */2 * 1"),
        "2026-01-01T00:00:00Z",
        ["2026-01-05T00:00:00Z", "2026-01-19T00:00:00Z", "2026-02-09T00:00:00Z"],
    ),
    (
        "7 is Sunday too",
        cron("0 0 * * 7"),
        "2026-01-01T00:00:00Z",
        ["2026-01-04T00:00:00Z", "2026-01-11T00:00:00Z"],
    ),
    (
        "six fields: seconds first",
        cron("15,45 0 0 1 1 *"),
        "2026-01-01T00:00:00Z",
        ["2026-01-01T00:00:15Z", "2026-01-01T00:00:45Z", "2027-01-01T00:00:15Z"],
    ),
    (
        "@hourly",
        cron("@hourly"),
        "2026-01-01T00:00:00.001Z",
        ["2026-01-01T01:00:00Z", "2026-01-01T02:00:00Z"],
    ),
    (
        "end is inclusive",
        cron("0 0 * * *", end_ms=ms("2026-01-03T00:00:00Z")),
        "2026-01-01T00:00:00Z",
        ["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"],
    ),
    (
        "start bounds the series",
        cron("0 0 * * *", start_ms=ms("2026-06-01T00:00:00Z")),
        "2026-01-01T00:00:00Z",
        ["2026-06-01T00:00:00Z", "2026-06-02T00:00:00Z"],
    ),
    (
        "max_runs counts from the start",
        cron("0 0 * * *", start_ms=ms("2026-01-01T00:00:00Z"), max_runs=3),
        "2026-01-02T00:00:00Z",
        ["2026-01-02T00:00:00Z", "2026-01-03T00:00:00Z"],
    ),
    (
        "rate every 90 s from start",
        Recurrence(every_s=90, start_ms=ms("2026-01-01T00:00:00Z")),
        "2026-01-01T00:01:00Z",
        ["2026-01-01T00:01:30Z", "2026-01-01T00:03:00Z", "2026-01-01T00:04:30Z"],
    ),
    (
        "rate ignores DST (elapsed time)",
        Recurrence(every_s=3600, start_ms=ms("2026-03-08T05:00:00Z"), time_zone="America/New_York"),
        "2026-03-08T06:00:00Z",
        ["2026-03-08T06:00:00Z", "2026-03-08T07:00:00Z", "2026-03-08T08:00:00Z"],
    ),
    (
        "rate with max_runs and end",
        Recurrence(
            every_s=60,
            start_ms=ms("2026-01-01T00:00:00Z"),
            end_ms=ms("2026-01-01T00:10:00Z"),
            max_runs=2,
        ),
        "2026-01-01T00:00:00Z",
        ["2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"],
    ),
]


@pytest.mark.parametrize(("case", "rec", "start", "expected"), DST_TABLE + CALENDAR_TABLE)
def test_next_runs_table(case: str, rec: Recurrence, start: str, expected: list[str]) -> None:
    got = next_runs(rec, ms(start), len(expected) + 5, anchor_ms=0)
    want = [ms(e) for e in expected]
    assert got[: len(want)] == want, case
    if rec.max_runs is not None or rec.end_ms is not None:
        assert got == want, case


def test_occurrences_are_strictly_increasing_across_a_year_of_dst() -> None:
    for zone in ("America/New_York", "Europe/London", "Australia/Lord_Howe", "Asia/Kolkata"):
        for policy in (
            {"nonexistent": SHIFT, "ambiguous": TWICE},
            {"nonexistent": SKIP, "ambiguous": ONCE},
        ):
            rec = cron("30 * * * *", zone, **policy)
            got = []
            for at in occurrences(rec, ms("2026-01-01T00:00:00Z"), anchor_ms=0):
                if at >= ms("2027-01-01T00:00:00Z"):
                    break
                got.append(at)
            assert got == sorted(set(got))
            # Every hour of the year, minus/plus the DST hours by policy.
            assert 365 * 24 - 2 <= len(got) <= 365 * 24 + 2, (zone, policy, len(got))


def test_rate_without_start_begins_one_interval_after_the_anchor() -> None:
    rec = Recurrence(every_s=90)
    assert next_runs(rec, 0, 2, anchor_ms=1_000_000) == [1_090_000, 1_180_000]


def test_run_ids_and_jitter_are_deterministic() -> None:
    rid = run_id("daily-report", 1_800_000_000_000)
    assert rid == "daily-report@1800000000000"
    assert parse_run_id(rid) == ("daily-report", 1_800_000_000_000)
    assert parse_run_id("a@b@12") == ("a@b", 12)
    assert parse_run_id("plain") is None
    assert jitter_ms("t", rid, 0) == 0
    spread = {jitter_ms("t", run_id("s", n * 60_000), 30) for n in range(200)}
    assert all(0 <= j < 30_000 for j in spread)
    assert len(spread) > 150  # spread out, not a herd
    assert jitter_ms("t", rid, 30) == jitter_ms("t", rid, 30)


NOW = ms("2026-05-01T12:00:00Z")


def plan_for(rec: Recurrence, *, until: int, now: int = NOW, count: int = 0, **kw: Any) -> Any:
    return plan(
        rec,
        tenant="t",
        schedule_id="s",
        anchor_ms=0,
        tolerance_s=kw.pop("tolerance_s", 60),
        until_ms=until,
        run_count=count,
        now_ms=now,
        horizon_ms=kw.pop("horizon_ms", 600_000),
        **kw,
    )


def test_plan_materialises_the_horizon_and_points_at_the_next_occurrence() -> None:
    step = plan_for(cron("* * * * *"), until=NOW)
    assert [r.nominal_ms for r in step.runs] == [NOW + i * 60_000 for i in range(10)]
    assert step.until_ms == NOW + 600_000 and step.run_count == 10
    assert all(r.run_id == f"s@{r.nominal_ms}" and r.due_ms == r.nominal_ms for r in step.runs)
    again = plan_for(cron("* * * * *"), until=NOW)
    assert again == step  # recomputation gives identical rows
    assert extend_at(step.until_ms, 600_000) == NOW + 300_000
    # Schedules sharing an expression extend at different moments (no herd), each within
    # [until - 3/4 horizon, until - 1/2 horizon], always the same for one schedule.
    spread = {extend_at(step.until_ms, 600_000, f"s{i}") for i in range(200)}
    assert len(spread) > 150
    assert all(NOW + 150_000 <= at <= NOW + 300_000 for at in spread)
    assert extend_at(step.until_ms, 600_000, "s1") == extend_at(step.until_ms, 600_000, "s1")


@pytest.mark.parametrize(
    ("policy", "fired_nominals"),
    [
        (Misfire.FIRE_ALL, list(range(-10, 10))),
        # 60 s late is still within the 60 s tolerance: on time.
        (Misfire.FIRE_LATEST, list(range(-1, 10))),
        (Misfire.SKIP, list(range(-1, 10))),
    ],
)
def test_plan_after_an_outage_applies_the_misfire_policy(
    policy: Misfire, fired_nominals: list[int]
) -> None:
    # Ten minutes down: materialised up to NOW - 10 min; NOW itself is on time.
    rec = cron("* * * * *", misfire=policy)
    step = plan_for(rec, until=NOW - 600_000)
    got = [(r.nominal_ms - NOW) // 60_000 for r in step.runs]
    assert got == fired_nominals
    assert len(step.skipped) == 20 - len(got)
    assert step.run_count == 20  # skipped occurrences still count (max_runs)


def test_fire_latest_keeps_the_latest_missed_run_when_none_is_on_time() -> None:
    rec = cron("0 * * * *", misfire=Misfire.FIRE_LATEST)  # hourly
    step = plan_for(rec, until=NOW - 5 * 3_600_000 + 1_800_000, now=NOW + 1_800_000)
    assert [r.nominal_ms for r in step.runs] == [NOW]  # 12:00, 30 min late, is the latest
    skip = plan_for(cron("0 * * * *", misfire=Misfire.SKIP), until=NOW - 3_600_000, now=NOW + 1)
    assert [r.nominal_ms for r in skip.runs] == [NOW]  # 1 ms late: within tolerance


def test_run_tolerance_encodes_the_policy_for_the_ticker() -> None:
    due, nxt = NOW, NOW + 3_600_000
    assert run_tolerance_s(cron("0 * * * *", misfire=Misfire.FIRE_ALL), 60, due, nxt) == (
        MAX_TOLERANCE_S
    )
    assert run_tolerance_s(cron("0 * * * *", misfire=Misfire.SKIP), 60, due, nxt) == 60
    assert run_tolerance_s(cron("0 * * * *"), 60, due, nxt) == 3600
    assert run_tolerance_s(cron("0 * * * *"), 7200, due, nxt) == 7200
    assert run_tolerance_s(cron("0 * * * *"), 60, due, None) == MAX_TOLERANCE_S


def test_plan_stops_at_max_runs_and_end() -> None:
    rec = Recurrence(every_s=60, start_ms=NOW, max_runs=3)
    step = plan_for(rec, until=NOW)
    assert len(step.runs) == 3 and step.done and step.until_ms == NEVER_MS
    assert step.runs[-1].misfire_tolerance_s == MAX_TOLERANCE_S  # the last one is "latest"
    ended = plan_for(Recurrence(every_s=60, start_ms=NOW, end_ms=NOW + 120_000), until=NOW)
    assert len(ended.runs) == 3 and ended.done
    later = plan_for(rec, until=NOW, count=3)
    assert later.runs == [] and later.done


def test_plan_is_bounded_per_step() -> None:
    rec = cron("* * * * * *", misfire=Misfire.FIRE_ALL)  # every second
    step = plan_for(rec, until=NOW - 3_600_000, max_runs=500)
    assert len(step.runs) == 500 and step.until_ms == NOW - 3_600_000 + 500_000


def test_sparse_expressions_jump_ahead() -> None:
    rec = cron("0 0 29 2 *")
    step = plan_for(rec, until=NOW)
    assert step.runs == [] and step.until_ms == ms("2028-02-29T00:00:00Z")

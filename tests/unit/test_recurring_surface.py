"""The user-facing parts of recurring schedules, pure: day_match, go-scheduler cron
translation, the tenant horizon, parent status / listing windows / next runs, page merging,
the CLI's create flags, and the misfire defaults docs/scheduler.md argues for."""

from __future__ import annotations

import argparse
import itertools
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from api import gocron, recurring
from api.gocron import GoCronError
from base.errors import CommandRejected
from base.settings import Settings
from streams.decisions import check_recurring_horizon, recurring_index_changes
from streams.model import ScheduleChange, ScheduleRow
from streams.recurring import NEVER_MS, occurrences, plan
from tocsin.schedule_cli import _create_command, _Usage
from topics.codec import recurrence_from_json, recurrence_to_json
from topics.codes import Code
from topics.ids import parse_iso_ms
from topics.models import DayMatch, Misfire, Recurrence
from topics.recurrence import normalize_cron, parse_recurrence
from topics.validation import DEFAULT_LIMITS, decode_command

NOW = parse_iso_ms("2026-11-21T12:00:00Z")  # a Saturday


def ms(text: str) -> int:
    return parse_iso_ms(text)


def first(rec: Recurrence, start: int, n: int) -> list[int]:
    return list(itertools.islice(occurrences(rec, start, anchor_ms=start), n))


# -- day_match (wire contract) -------------------------------------------------------------


def test_day_match_all_means_both_day_fields() -> None:
    rec = parse_recurrence({"cron": "0 9 1-7 * mon", "day_match": "all"}, now_ms=NOW)
    assert rec.day_match is DayMatch.ALL
    got = first(rec, ms("2026-12-01T00:00:00Z"), 3)
    # The first Monday of December 2026, January and February 2027.
    assert got == [
        ms("2026-12-07T09:00:00Z"),
        ms("2027-01-04T09:00:00Z"),
        ms("2027-02-01T09:00:00Z"),
    ]
    vixie = parse_recurrence({"cron": "0 9 1-7 * mon"}, now_ms=NOW)
    assert vixie.day_match is DayMatch.ANY
    # Vixie: the 1st to 7th and every Monday.
    assert first(vixie, ms("2026-12-01T00:00:00Z"), 8)[:7] == [
        ms(f"2026-12-0{d}T09:00:00Z") for d in range(1, 8)
    ]
    assert ms("2026-12-14T09:00:00Z") in first(vixie, ms("2026-12-01T00:00:00Z"), 9)


def test_day_match_is_checked_and_stored_only_when_not_the_default() -> None:
    with pytest.raises(CommandRejected) as err:
        parse_recurrence({"every_s": 60, "day_match": "all"}, now_ms=NOW)
    assert err.value.code == Code.INVALID_FIELD and "cron" in err.value.message
    with pytest.raises(CommandRejected) as err:
        parse_recurrence({"cron": "0 0 30 2 mon", "day_match": "all"}, now_ms=NOW)
    assert "never matches" in err.value.message
    parse_recurrence({"cron": "0 0 30 2 mon"}, now_ms=NOW)  # Vixie: every Monday
    with pytest.raises(CommandRejected):
        parse_recurrence({"cron": "* * * * *", "day_match": "both"}, now_ms=NOW)
    plain = parse_recurrence({"cron": "0 9 * * *"}, now_ms=NOW)
    assert "day_match" not in recurrence_to_json(plain)  # stored text as before day_match
    both = parse_recurrence({"cron": "0 9 1 * 1", "day_match": "all"}, now_ms=NOW)
    assert recurrence_from_json(recurrence_to_json(both)) == both


# -- go-scheduler cron ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("go", "ours", "day_match"),
    [
        ("*/5 * * * *", "*/5 * * * *", DayMatch.ANY),
        ("0 0 * * *", "0 0 * * *", DayMatch.ANY),
        ("12/10 * * * *", "20-50/10 * * * *", DayMatch.ANY),  # next multiple of 10
        ("0 0 */10 * *", "0 0 10-30/10 * *", DayMatch.ANY),  # days count from 0, stop at 30
        ("0 0 */1 * *", "0 0 1-30 * *", DayMatch.ANY),  # never the 31st
        ("0 12 * * MON-FRI", "0 12 * * 1-5", DayMatch.ANY),
        ("0 8,12,18 * * *", "0 8,12,18 * * *", DayMatch.ANY),
        ("0 0 * JAN,mar *", "0 0 * 1,3 *", DayMatch.ANY),
        ("0 9 1-7 * 1", "0 9 1-7 * 1", DayMatch.ALL),
        ("0 0 13 * FRI", "0 0 13 * 5", DayMatch.ALL),
        ("*/15 */6 * * SUN,sat", "*/15 */6 * * 0,6", DayMatch.ANY),
        ("0-59 0-23 1-31 1-12 0-6", "* * * * *", DayMatch.ALL),
    ],
)
def test_go_cron_translation(go: str, ours: str, day_match: DayMatch) -> None:
    got = gocron.translate(go)
    assert (got.cron, got.day_match) == (ours, day_match)
    normalize_cron(got.cron, day_match=got.day_match)  # valid for the wire contract


@pytest.mark.parametrize(
    ("go", "why"),
    [
        ("* * * *", "5 fields"),
        ("@daily", "5 fields"),
        ("*/0 * * * *", "at least 1"),
        ("0 0 * */2 *", "no step"),
        ("0 0 * * 7", "outside 0-6"),
        ("61 * * * *", "outside 0-59"),
        ("1,2/5 * * * *", "not a number"),
        ("0 0 */40 * *", "selects no day"),
        ("70/10 * * * *", "beyond"),
        ("5-1 * * * *", "backwards"),
        ("0 0 L * *", "not a number"),
        (7, "string"),
    ],
)
def test_go_cron_rejections(go: Any, why: str) -> None:
    with pytest.raises(GoCronError, match=why):
        gocron.translate(go)


def _go_values(
    text: str, low: int, high: int, step_range: int, names: tuple[str, ...]
) -> list[int]:
    """An independent transcription of go-scheduler's cron.go parsing of one field (an
    empty list matches anything), for comparison with the translation."""
    if text == "*":
        return []
    if "/" in text and step_range:
        base, inc_text = text.split("/")
        inc = int(inc_text)
        start = 0 if base == "*" else (int(base) + inc - 1) // inc * inc
        return [v for v in range(start, step_range, inc) if v >= low]
    out: list[int] = []
    for part in text.split(","):
        if part.upper() in names:
            out.append(names.index(part.upper()) + low)
        elif "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def _go_match(expr: str, moment: datetime) -> bool:
    m, h, d, mo, w = expr.split(" ")
    fields = [
        (_go_values(m, 0, 59, 60, ()), moment.minute),
        (_go_values(h, 0, 23, 24, ()), moment.hour),
        (_go_values(d, 1, 31, 31, ()), moment.day),
        (_go_values(mo, 1, 12, 0, gocron._MONTHS), moment.month),
        (_go_values(w, 0, 6, 0, gocron._DAYS), (moment.weekday() + 1) % 7),
    ]
    return all(not values or value in values for values, value in fields)


def _random_field(rng: random.Random, low: int, high: int, steps: bool) -> str:
    kind = rng.choice(["*", "n", "list", "range"] + (["step", "start_step"] if steps else []))
    if kind == "*":
        return "*"
    if kind == "n":
        return str(rng.randint(low, high))
    if kind == "list":
        return ",".join(str(v) for v in sorted(rng.sample(range(low, high + 1), 3)))
    if kind == "range":
        a = rng.randint(low, high - 1)
        return f"{a}-{rng.randint(a, high)}"
    inc = rng.randint(1, 12)
    return f"*/{inc}" if kind == "step" else f"{rng.randint(0, inc * 2)}/{inc}"


def test_translated_go_crons_match_the_same_minutes_as_go_scheduler() -> None:
    """Random go-scheduler expressions: the translated recurrence runs at exactly the minutes
    go-scheduler's matcher accepts, over 100 days around a leap day (minutes sampled)."""
    rng = random.Random(6)
    start = datetime(2028, 1, 1, tzinfo=UTC)
    days = 100
    minutes = [start + timedelta(minutes=i) for i in range(0, days * 1440, 31)]
    lo = int(start.timestamp() * 1000)
    hi = lo + days * 86_400_000
    checked = 0
    for _ in range(40):
        expr = " ".join(
            [
                _random_field(rng, 0, 59, True),
                _random_field(rng, 0, 23, True),
                _random_field(rng, 1, 31, True),
                _random_field(rng, 1, 12, False),
                _random_field(rng, 0, 6, False),
            ]
        )
        try:
            got = gocron.translate(expr)
        except GoCronError:
            continue
        rec = Recurrence(
            cron=normalize_cron(got.cron, day_match=got.day_match), day_match=got.day_match
        )
        ours = set(itertools.takewhile(lambda t: t < hi, occurrences(rec, lo, anchor_ms=lo)))
        for moment in minutes:
            at = int(moment.timestamp() * 1000)
            assert (at in ours) == _go_match(expr, moment), (expr, got, moment)
        checked += 1
    assert checked >= 20


def test_go_cron_display_drops_a_zero_seconds_field() -> None:
    assert gocron.display("0 */5 * * * *") == "*/5 * * * *"
    assert gocron.display("30 */5 * * * *") == "30 */5 * * * *"


# -- the tenant horizon --------------------------------------------------------------------


def test_recurring_horizon_applies_to_the_first_run() -> None:
    day = 86_400
    check_recurring_horizon(Recurrence(cron=normalize_cron("0 9 * * *")), day, NOW)
    check_recurring_horizon(Recurrence(every_s=3600), day, NOW)
    rejected = [
        Recurrence(every_s=60, start_ms=NOW + 2 * day * 1000),  # a far start
        Recurrence(cron=normalize_cron("0 0 1 1 *")),  # yearly: next run in January
        Recurrence(every_s=7 * day),  # the first run is one interval away
    ]
    for rec in rejected:
        with pytest.raises(CommandRejected) as err:
            check_recurring_horizon(rec, day, NOW)
        assert err.value.code == Code.BEYOND_HORIZON and "max_horizon_s=86400" in err.value.message
    # No run at all is the decision's business (invalid_field), not a horizon question.
    check_recurring_horizon(Recurrence(every_s=60, start_ms=NOW, end_ms=NOW - 1), day, NOW)


def test_recurring_index_entries_on_create_and_cancel() -> None:
    def change(event: str, recurrence: str | None = '{"every_s":60}') -> ScheduleChange:
        row = ScheduleRow(
            tenant="t",
            schedule_id="s",
            partition=0,
            state="scheduled",
            due_ms=NOW,
            version=1,
            created_ms=5,
            updated_ms=5,
            recurrence=recurrence,
        )
        return ScheduleChange(row=row, new_bucket=None, old_bucket=None, now_ms=NOW, event=event)

    assert recurring_index_changes(
        [change("created"), change("updated"), change("cancelled"), change("created", None)]
    ) == [("t", "s", 5, False), ("t", "s", 5, True)]


# -- parents: status, window, next runs ----------------------------------------------------


def parent(rec: Recurrence, **kw: Any) -> dict[str, Any]:
    row = {
        "tenant": "t",
        "schedule_id": "p",
        "state": "scheduled",
        "created_ms": NOW,
        "anchor_ms": NOW,
        "updated_ms": NOW,
        "recurrence": recurrence_to_json(rec),
        "materialized_until_ms": NOW + 600_000,
        "run_count": 10,
    }
    row.update(kw)
    return row


MINUTELY = Recurrence(cron=normalize_cron("* * * * *"))


def test_parent_status() -> None:
    assert recurring.parent_status(parent(MINUTELY), now_ms=NOW, last_due_ms=None) == "scheduled"
    cancelled = parent(MINUTELY, state="cancelled")
    assert recurring.parent_status(cancelled, now_ms=NOW, last_due_ms=None) == "cancelled"
    done = parent(MINUTELY, materialized_until_ms=NEVER_MS)
    # Every run written: completed once the newest is due, scheduled until then.
    assert recurring.parent_status(done, now_ms=NOW, last_due_ms=NOW + 1) == "scheduled"
    assert recurring.parent_status(done, now_ms=NOW, last_due_ms=NOW) == "completed"


def test_window_run_is_the_first_run_in_the_window() -> None:
    hourly = Recurrence(cron=normalize_cron("0 * * * *"))
    row = parent(hourly, materialized_until_ms=NOW + 3_600_000, run_count=1)
    h = 3_600_000
    assert recurring.window_run(row, hourly, from_ms=NOW + 10, to_ms=NOW + 2 * h) == NOW + h
    assert recurring.window_run(row, hourly, from_ms=NOW + 10, to_ms=NOW + h) is None
    # Before the recurrence was set (its anchor): no runs there.
    assert recurring.window_run(row, hourly, from_ms=NOW - 5 * h, to_ms=NOW - h) is None
    # A week ahead is found without enumerating (no max_runs).
    assert (
        recurring.window_run(row, hourly, from_ms=NOW + 168 * h, to_ms=NOW + 169 * h)
        == NOW + 168 * h
    )
    # Cancelled two hours in: later windows are empty.
    gone = dict(row, state="cancelled", updated_ms=NOW + 2 * h + 5)
    assert recurring.window_run(gone, hourly, from_ms=NOW + 1, to_ms=NOW + 10 * h) == NOW + h
    assert recurring.window_run(gone, hourly, from_ms=NOW + 3 * h, to_ms=NOW + 10 * h) is None


def test_window_run_honours_max_runs_and_the_last_written_run() -> None:
    h = 3_600_000
    five = Recurrence(cron=normalize_cron("0 * * * *"), max_runs=5)
    # Runs at NOW .. NOW+4h; two written (until NOW+2h).
    row = parent(five, materialized_until_ms=NOW + 2 * h, run_count=2)
    assert recurring.window_run(row, five, from_ms=NOW + 4 * h, to_ms=NOW + 5 * h) == NOW + 4 * h
    assert recurring.window_run(row, five, from_ms=NOW + 5 * h, to_ms=NOW + 9 * h) is None
    written = parent(five, materialized_until_ms=NEVER_MS, run_count=5)
    assert (
        recurring.window_run(
            written, five, from_ms=NOW + 4 * h, to_ms=NOW + 9 * h, last_nominal_ms=NOW + 4 * h
        )
        == NOW + 4 * h
    )
    assert (
        recurring.window_run(
            written, five, from_ms=NOW + 5 * h, to_ms=NOW + 9 * h, last_nominal_ms=NOW + 4 * h
        )
        is None
    )


def test_upcoming_runs_count_max_runs_also_once_every_run_is_written() -> None:
    three = Recurrence(every_s=60, start_ms=NOW, max_runs=3)
    # All three written at once (the horizon covers them): until is the end of time.
    row = parent(three, materialized_until_ms=NEVER_MS, run_count=3)
    last = NOW + 120_000
    got = recurring.upcoming(row, three, now_ms=NOW + 1, n=10, last_nominal_ms=last)
    assert [r["nominal_ms"] for r in got] == [NOW + 60_000, NOW + 120_000]
    assert got[0]["run_id"] == f"p@{NOW + 60_000}" and len(got[0]["trigger_id"]) == 32
    assert recurring.next_run(row, three, now_ms=NOW + 1, last_nominal_ms=last) == NOW + 60_000
    assert recurring.upcoming(row, three, now_ms=NOW + 130_000, n=10, last_nominal_ms=last) == []
    # Paging: after a given run; beyond the written part the count is extended.
    minutely = parent(MINUTELY, materialized_until_ms=NOW + 600_000, run_count=10)
    page = recurring.upcoming(minutely, MINUTELY, now_ms=NOW, n=2, after_ms=NOW + 3_600_001)
    assert [r["nominal_ms"] for r in page] == [NOW + 3_660_000, NOW + 3_720_000]
    capped = Recurrence(cron=normalize_cron("* * * * *"), max_runs=30)
    row = parent(capped, materialized_until_ms=NOW + 600_000, run_count=10)
    got = recurring.upcoming(row, capped, now_ms=NOW, n=100, after_ms=NOW + 1_500_000)
    assert [r["nominal_ms"] for r in got] == [NOW + i * 60_000 for i in range(25, 30)]
    assert recurring.upcoming(dict(row, state="cancelled"), capped, now_ms=NOW, n=5) == []


def test_merge_page_never_skips_a_one_shot() -> None:
    def item(at: int, sid: str) -> tuple[tuple[int, str], str]:
        return (at, sid), sid

    one = [item(10, "a"), item(30, "b")]
    parents = [item(20, "P"), item(40, "Q"), item(50, "R")]
    # The one-shot source is exhausted: parents fill the page, the cursor follows the page.
    assert recurring.merge_page(one, None, parents, 3) == (["a", "P", "b"], (30, "b"))
    assert recurring.merge_page(one, None, parents, 10) == (["a", "P", "b", "Q", "R"], None)
    # The one-shot source stopped at (30, b): parents beyond it wait for the next page.
    assert recurring.merge_page(one, (30, "b"), parents, 10) == (["a", "P", "b"], (30, "b"))
    assert recurring.merge_page([], None, [], 5) == ([], None)


# -- the CLI's create flags ----------------------------------------------------------------


def cli_args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "tenant": "acme",
        "schedule_id": "s1",
        "due": "",
        "cron": None,
        "every_s": None,
        "url": "https://h.example/x",
        "topic": None,
        "payload": None,
        "time_zone": None,
        "start": None,
        "end": None,
        "max_runs": None,
        "jitter_s": None,
        "misfire": None,
        "dst_gap": None,
        "dst_overlap": None,
        "day_match": None,
        "misfire_tolerance_s": None,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def test_cli_flags_make_a_recurring_create() -> None:
    settings = Settings.from_env({})
    cmd = _create_command(
        cli_args(
            cron="30 8 * * mon-fri",
            time_zone="Europe/London",
            start="2030-01-01T00:00:00Z",
            end="1924992000000",
            max_runs=10,
            jitter_s=120,
            misfire="skip",
            dst_gap="shift_forward",
            dst_overlap="twice",
            day_match="all",
            payload='{"a": 1}',
            misfire_tolerance_s=30,
        ),
        settings,
        "r1",
    )
    rec = cmd.recurrence
    assert rec is not None and rec.cron == "0 30 8 * * mon-fri"
    assert (rec.time_zone, rec.start_ms, rec.end_ms, rec.max_runs, rec.jitter_s) == (
        "Europe/London",
        ms("2030-01-01T00:00:00Z"),
        1924992000000,
        10,
        120,
    )
    assert (str(rec.misfire), str(rec.nonexistent), str(rec.ambiguous), str(rec.day_match)) == (
        "skip",
        "shift_forward",
        "twice",
        "all",
    )
    assert cmd.misfire_tolerance_s == 30 and orjson.loads(cmd.payload) == {"a": 1}
    rate = _create_command(cli_args(every_s=90, topic="acme.t", url=None), settings, "r2")
    assert rate.recurrence.every_s == 90 and rate.misfire_tolerance_s == 60
    one = _create_command(cli_args(due=str(NOW * 10)), settings, "r3")
    assert one.recurrence is None and one.misfire_tolerance_s == 3600


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({}, "exactly one of --due"),
        ({"due": "1", "cron": "* * * * *"}, "exactly one of --due"),
        ({"due": "2030-01-01T00:00:00Z", "time_zone": "UTC"}, "--tz only apply"),
        ({"cron": "* * * * *", "url": None}, "exactly one of --url"),
        ({"cron": "* * * * *", "payload": "{nope"}, "not JSON"),
    ],
)
def test_cli_usage_errors(kw: dict[str, Any], why: str) -> None:
    with pytest.raises(_Usage, match=why):
        _create_command(cli_args(**kw), Settings.from_env({}), "r")


def test_cli_bad_values_get_the_decoders_code() -> None:
    with pytest.raises(CommandRejected) as err:
        _create_command(cli_args(cron="0 0 31 2 *"), Settings.from_env({}), "r")
    assert err.value.code == Code.INVALID_FIELD
    with pytest.raises(CommandRejected) as err:
        _create_command(
            cli_args(cron="* * * * *", time_zone="Mars/Olympus"), Settings.from_env({}), "r"
        )
    assert "IANA" in err.value.message


# -- the default misfire tolerance of recurring runs (docs/scheduler.md) --------------------


def decoded_recurrence(extra: dict[str, Any]) -> tuple[Recurrence, int]:
    raw = orjson.dumps(
        {
            "type": "create",
            "tenant": "t",
            "schedule_id": "s",
            "callback": {"type": "kafka", "topic": "x"},
            "recurrence": extra,
        }
    )
    cmd = decode_command(raw, key=None, now_ms=NOW, limits=DEFAULT_LIMITS)
    assert cmd.recurrence is not None
    return cmd.recurrence, cmd.misfire_tolerance_s


def test_default_tolerance_never_loses_the_latest_run_of_fire_latest() -> None:
    daily, tolerance = decoded_recurrence({"cron": "0 9 * * *"})
    assert tolerance == 60 and daily.misfire is Misfire.FIRE_LATEST
    # Workers down for two hours across the 09:00 run: it still fires, late.
    due = ms("2026-11-22T09:00:00Z")
    step = plan(
        daily,
        tenant="t",
        schedule_id="s",
        anchor_ms=NOW,
        tolerance_s=tolerance,
        until_ms=due,
        run_count=0,
        now_ms=due + 2 * 3_600_000,
        horizon_ms=600_000,
    )
    assert [r.nominal_ms for r in step.runs] == [due] and step.skipped == []
    # A minutely schedule after ten minutes down: the superseded runs are dropped, the
    # ones within a minute of now still fire.
    minutely, tolerance = decoded_recurrence({"cron": "* * * * *"})
    step = plan(
        minutely,
        tenant="t",
        schedule_id="s",
        anchor_ms=NOW - 86_400_000,
        tolerance_s=tolerance,
        until_ms=NOW - 600_000,
        run_count=0,
        now_ms=NOW,
        horizon_ms=60_000,
    )
    assert [r.nominal_ms for r in step.runs] == [NOW - 60_000, NOW]
    assert len(step.skipped) == 9


def test_default_tolerance_absorbs_a_failover_under_skip() -> None:
    daily, tolerance = decoded_recurrence({"cron": "0 9 * * *", "misfire": "skip"})
    due = ms("2026-11-22T09:00:00Z")

    def fired(late_s: int) -> bool:
        step = plan(
            daily,
            tenant="t",
            schedule_id="s",
            anchor_ms=NOW,
            tolerance_s=tolerance,
            until_ms=due,
            run_count=0,
            now_ms=due + late_s * 1000,
            horizon_ms=600_000,
        )
        return [r.nominal_ms for r in step.runs] == [due]

    # A worker failover (~10 s, the session timeout) or a broker restart (~26 s): fires.
    assert fired(10) and fired(30) and fired(60)
    # Late beyond the minute (a Cassandra outage): skip drops it, as asked.
    assert not fired(61)


def test_the_facade_refuses_an_unknown_cron_time_zone_at_startup() -> None:
    from aiohttp import web

    from api import goscheduler
    from base.errors import ConfigError

    key: web.AppKey[Any] = web.AppKey("svc", object)
    with pytest.raises(ConfigError, match="TOCSIN_GOSCHEDULER_CRON_TIME_ZONE"):
        goscheduler.add_routes(web.Application(), key, "Mars/Olympus_Mons")
    goscheduler.add_routes(web.Application(), key, "Asia/Kolkata")


class _ParentsStore:
    """The reads a listing makes, over parents that still have runs to write."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = {r["schedule_id"]: r for r in rows}

    async def list_recurring(self, tenant: str) -> list[str]:
        return list(self.rows)

    async def get_schedules(self, tenant: str, ids: list[str]) -> dict[str, dict[str, Any]]:
        return {i: self.rows[i] for i in ids}


def test_listing_evaluates_rules_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of crons of one tenant are CPU work; on the loop they would stall every
    other request the API serves meanwhile."""
    import asyncio
    import threading

    from api import recurring_io

    rows = [parent(MINUTELY, schedule_id=f"p{i}") for i in range(50)]
    threads: set[str] = set()
    real = recurring.window_run

    def spy(*args: Any, **kw: Any) -> int | None:
        threads.add(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(recurring, "window_run", spy)

    async def main() -> tuple[list[Any], str]:
        found = await recurring_io.parents_in_window(
            _ParentsStore(rows),
            "t",
            from_ms=NOW,
            to_ms=NOW + 3_600_000,
            statuses=None,
            after=None,
            now_ms=NOW,
        )
        return found, threading.current_thread().name

    found, loop_thread = asyncio.run(main())
    assert len(found) == 50 and found[0][0] == (NOW, "p0")
    assert threads and loop_thread not in threads

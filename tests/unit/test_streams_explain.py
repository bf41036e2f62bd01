"""The "why didn't it fire?" assembler: rows in, an ordered timeline and a reason out."""

from __future__ import annotations

from typing import Any

from streams.explain import NOT_RECORDED, Facts, RunFacts, explain, render
from topics.ids import format_iso_ms

DUE = 1_795_000_000_000  # 2026-11-18T...
CREATED = DUE - 60_000


def row(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "tenant": "acme",
        "schedule_id": "s1",
        "partition": 3,
        "state": "scheduled",
        "due_ms": DUE,
        "misfire_tolerance_s": 60,
        "recurrence": None,
    }
    base.update(over)
    return base


def ev(
    at_ms: int, event: str, detail: str | None = None, due_ms: int | None = DUE
) -> dict[str, Any]:
    return {"at_ms": at_ms, "event": event, "detail": detail, "due_ms": due_ms, "trigger_id": "t"}


def facts(r: dict[str, Any], events: list[dict[str, Any]], **over: Any) -> Facts:
    kw: dict[str, Any] = {"now_ms": DUE + 3_600_000, "default_tolerance_s": 3600}
    kw.update(over)
    return Facts(row=r, events=events, **kw)


def test_a_fired_and_delivered_schedule_reads_in_time_order() -> None:
    r = row(
        state="fired",
        fired_ms=DUE + 12,
        delivery_outcome="delivered",
        delivery_status_code=204,
        delivery_attempts=1,
    )
    # Given out of order: the timeline sorts them.
    events = [
        ev(DUE + 40, "delivered", "HTTP 204 on attempt 1"),
        ev(CREATED, "created"),
        ev(DUE + 12, "fired"),
    ]
    ex = explain(facts(r, events))
    assert [e.event for e in ex.entries] == ["created", "fired", "delivered"]
    fired = ex.entries[1]
    assert (fired.lateness_ms, fired.attempt) == (12, 1)
    assert fired.text == f"emitted, attempt 1, 12 ms after due {format_iso_ms(DUE)}"
    assert ex.entries[2].text == "delivered: HTTP 204 on attempt 1"
    assert ex.reason == (
        f"fired at {format_iso_ms(DUE + 12)}, 12 ms after due; "
        "delivered with status 204 after 1 attempt(s)"
    )
    assert ex.kind == "one_shot" and ex.state == "fired"


def test_a_miss_says_due_when_reached_and_the_tolerance() -> None:
    r = row(state="missed")
    events = [
        ev(CREATED, "created"),
        ev(DUE + 125_000, "missed", "late by 125000 ms, beyond tolerance"),
    ]
    ex = explain(facts(r, events))
    want = (
        f"missed: due {format_iso_ms(DUE)}, reached by a worker only 2.1 min later, "
        "beyond its misfire tolerance of 60 s"
    )
    assert ex.reason == want
    assert ex.entries[-1].text == want and ex.entries[-1].lateness_ms == 125_000


def test_the_default_tolerance_applies_when_the_schedule_sets_none() -> None:
    r = row(state="missed", misfire_tolerance_s=None)
    ex = explain(facts(r, [ev(DUE + 7_300_000, "missed", "late by 7300000 ms")]))
    assert ex.reason.endswith("2 h later, beyond its misfire tolerance of 3600 s")


def test_a_trigger_that_could_not_be_emitted_says_why() -> None:
    r = row(state="missed")
    ex = explain(facts(r, [ev(DUE + 5, "missed", "cannot be emitted: record too large")]))
    assert ex.reason == f"missed (due {format_iso_ms(DUE)}): cannot be emitted: record too large"


def test_a_dead_letter_gives_the_proxys_reason() -> None:
    r = row(
        state="fired",
        fired_ms=DUE + 3,
        delivery_outcome="dead_lettered",
        delivery_status_code=600,
        delivery_attempts=4,
    )
    why = "HTTP 600: nope (6xx retried 3 times); 4 attempts, 3 failed"
    events = [ev(DUE + 3, "fired"), ev(DUE + 9_000, "dead_lettered", why)]
    ex = explain(facts(r, events))
    assert ex.reason.endswith(f"dead-lettered after 4 attempt(s): {why}")
    assert ex.entries[-1].text == f"dead-lettered: {why}"


def test_fired_without_an_outcome_says_the_proxy_may_still_be_trying() -> None:
    ex = explain(facts(row(state="fired", fired_ms=DUE), [ev(DUE, "fired")]))
    assert "no delivery outcome recorded" in ex.reason


def test_a_refire_is_the_next_emission_attempt() -> None:
    r = row(state="fired", fired_ms=DUE)
    events = [
        ev(DUE, "fired"),
        ev(DUE + 5000, "dead_lettered", "HTTP 700"),
        ev(DUE + 90_000, "refired", "re-fired by bulk reconcile"),
    ]
    ex = explain(facts(r, events))
    assert [e.attempt for e in ex.entries] == [1, None, 2]
    assert ex.entries[2].text.startswith("emitted again (re-fire), attempt 2, 90 s after due")


def test_a_reschedule_names_both_due_times() -> None:
    later = DUE + 600_000
    events = [ev(CREATED, "created"), ev(CREATED + 1, "updated", due_ms=later)]
    ex = explain(facts(row(due_ms=later), events, now_ms=CREATED + 2))
    assert ex.entries[1].text == f"rescheduled from {format_iso_ms(DUE)} to {format_iso_ms(later)}"
    assert ex.reason.startswith(f"scheduled: due {format_iso_ms(later)}, in ")


def test_an_unknown_event_still_appears_and_a_pause_explains_a_waiting_schedule() -> None:
    events = [ev(CREATED, "created"), ev(CREATED + 10, "paused", "by operator")]
    ex = explain(facts(row(), events))
    assert ex.entries[-1].event == "paused" and ex.entries[-1].text == "paused: by operator"
    assert ex.reason.startswith(
        f"paused since {format_iso_ms(CREATED + 10)}: it does not fire until resumed"
    )
    # The state alone says so too (a pause whose event expired).
    assert explain(facts(row(state="paused"), [])).reason.startswith("paused: it does not")
    resumed = explain(facts(row(), [*events, ev(CREATED + 20, "resumed")]))
    assert not resumed.reason.startswith("paused")
    odd = explain(facts(row(), [ev(CREATED, "made_up_later", "x")]))
    assert odd.entries[0].text == "made up later: x"


def test_an_overdue_schedule_points_at_the_worker_of_its_partition() -> None:
    ex = explain(facts(row(), [ev(CREATED, "created")], now_ms=DUE + 120_000))
    assert ex.reason.startswith(f"overdue: due {format_iso_ms(DUE)}, 2 min ago")
    assert "commands partition 3" in ex.reason and "misfire tolerance of 60 s" in ex.reason


def test_a_cancelled_schedule() -> None:
    events = [ev(CREATED, "created"), ev(CREATED + 5, "cancelled")]
    ex = explain(facts(row(state="cancelled"), events))
    assert ex.reason == f"cancelled at {format_iso_ms(CREATED + 5)}: it will not fire"


def test_a_late_fire_with_a_quota_notes_the_quota_may_have_held_it() -> None:
    r = row(state="fired", fired_ms=DUE + 20_000, delivery_outcome="delivered")
    ex = explain(facts(r, [ev(DUE + 20_000, "fired")], fire_quota_per_min=60))
    assert any("fire quota of 60/min" in n for n in ex.notes)
    quiet = explain(facts(r, [ev(DUE + 20_000, "fired")]))
    assert quiet.notes == []


def test_a_recurring_schedule_merges_its_runs_and_explains_the_newest() -> None:
    parent = row(schedule_id="cron", recurrence='{"every_s": 60}', due_ms=None)
    run1 = RunFacts(
        run_id="cron@1",
        nominal_ms=DUE,
        due_ms=DUE,
        row={
            "schedule_id": "cron@1",
            "state": "fired",
            "fired_ms": DUE + 2,
            "due_ms": DUE,
            "delivery_outcome": "delivered",
            "delivery_attempts": 1,
        },
        events=[ev(DUE + 2, "fired"), ev(DUE + 50, "delivered")],
    )
    due2 = DUE + 60_000
    run2 = RunFacts(
        run_id="cron@2",
        nominal_ms=due2,
        due_ms=due2,
        row={"schedule_id": "cron@2", "state": "missed", "due_ms": due2},
        events=[ev(due2 + 400_000, "missed", "late by 400000 ms", due_ms=due2)],
    )
    events = [ev(CREATED, "created", due_ms=None), ev(DUE + 1, "skipped", "misfire policy")]
    ex = explain(facts(parent, events, runs=[run2, run1], runs_limit=2))
    assert [(e.schedule_id, e.event) for e in ex.entries] == [
        ("cron", "created"),
        ("cron", "skipped"),
        ("cron@1", "fired"),
        ("cron@1", "delivered"),
        ("cron@2", "missed"),
    ]
    assert ex.kind == "recurring" and ex.runs_shown == 2
    assert ex.reason.startswith("recurring, scheduled; newest 2 run(s): 1 delivered, 1 missed")
    assert "newest run cron@2: missed: due" in ex.reason
    assert ex.notes == ["only the newest 2 runs are shown"]


def test_json_and_text_say_what_is_not_recorded() -> None:
    ex = explain(facts(row(state="fired", fired_ms=DUE), [ev(DUE, "fired")]))
    doc = ex.to_json()
    assert doc["not_recorded"] == list(NOT_RECORDED)
    timeline = doc["timeline"]
    assert isinstance(timeline, list) and timeline[0]["at"] == format_iso_ms(DUE)
    text = render(ex)
    assert "why     fired at" in text and "not recorded, so not shown:" in text
    assert render(explain(facts(row(), []))).count("(no history recorded)") == 1


def test_the_text_view_shows_a_receivers_control_characters_escaped() -> None:
    # A dead letter's reason holds the start of the receiver's answer: whoever runs the
    # callback's endpoint chooses it, and it must not reach an operator's terminal raw.
    hostile = "HTTP 700: \x1b]0;owned\x07\x1b[2J\u202egnp.exe\x9b31m"
    r = row(state="fired", fired_ms=DUE + 3, delivery_outcome="dead_lettered", delivery_attempts=1)
    ex = explain(facts(r, [ev(DUE + 3, "fired"), ev(DUE + 9, "dead_lettered", hostile)]))
    assert hostile in ex.reason  # the JSON keeps it as it came
    text = render(ex)
    for raw in ("\x1b", "\x07", "\u202e", "\x9b"):
        assert raw not in text
    assert "HTTP 700: \\x1b]0;owned\\x07\\x1b[2J\\u202egnp.exe\\x9b31m" in text

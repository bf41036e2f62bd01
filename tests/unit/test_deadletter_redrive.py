"""Dead letters: what the worker records of a dead-lettered outcome, and what a redrive
decides and sends (fakes for the store and Kafka; the tables on the real stack are covered
by tests/integration/test_deadletter_redrive.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson
import pytest

from api.deadletters import (
    MAX_REDRIVE,
    DeadLetters,
    dead_letter_view,
    next_attempt,
    redrive_source,
)
from api.views import ApiError
from base.errors import KafkaError, StoreError
from streams.deadletter_store import (
    DAY_MS,
    MAX_WINDOW_DAYS,
    DeadLetterEntry,
    days_newest_first,
    entry_from_outcome,
    latest_unclaimed,
    record_dead_letters,
)
from streams.model import ScheduleEvent
from streams.tenants import TenantConfig
from topics.codec import decode_trigger
from topics.ids import trigger_id

T0 = 1_764_000_000_000
CALLBACK = '{"type":"http","url":"https://r.example/hook"}'

OUTCOME: dict[str, Any] = {
    "outcome": "dead_lettered",
    "tenant": "acme",
    "schedule_id": "s1",
    "trigger_id": "t1",
    "due_ms": T0 - 5000,
    "emit_attempt": 1,
    "dead_lettered_ms": T0,
    "attempts": 1,
    "status_code": 700,
    "reason": "HTTP 700: bad sku",
    "response": {"status_code": 700, "body_excerpt": "bad sku"},
    "endpoint": "https://r.example/hook",
}


# -- what the worker records ------------------------------------------------------------------


def test_a_dead_lettered_outcome_becomes_an_entry_with_its_last_response() -> None:
    e = entry_from_outcome(OUTCOME)
    assert e is not None
    assert (e.tenant, e.trigger_id, e.schedule_id, e.dead_lettered_ms) == ("acme", "t1", "s1", T0)
    assert (e.status_code, e.body_excerpt, e.reason) == (700, "bad sku", "HTTP 700: bad sku")
    assert e.day_ms == T0 - T0 % DAY_MS and e.redrive_claim is None
    view = dead_letter_view(e)
    assert view["response"] == {"status_code": 700, "body_excerpt": "bad sku"}
    assert view["redriven"] is None and view["endpoint"] == "https://r.example/hook"


def test_outcomes_that_are_not_dead_letters_of_a_trigger_are_not_recorded() -> None:
    assert entry_from_outcome({**OUTCOME, "outcome": "delivered"}) is None
    assert entry_from_outcome({**OUTCOME, "trigger_id": None}) is None
    assert entry_from_outcome({**OUTCOME, "dead_lettered_ms": "soon"}) is None
    # An outcome without the response (an older proxy) keeps its status code.
    old = {k: v for k, v in OUTCOME.items() if k != "response"}
    e = entry_from_outcome(old)
    assert e is not None and (e.status_code, e.body_excerpt) == (700, None)
    timeout = entry_from_outcome({**OUTCOME, "status_code": None, "response": None})
    assert timeout is not None and dead_letter_view(timeout)["response"] is None


class Letters:
    """The dead-letter store's I/O in memory; ``fail`` holds errors for the next puts."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], DeadLetterEntry] = {}
        self.fail: list[StoreError] = []
        self.puts = 0

    async def put(self, entry: DeadLetterEntry, *, retention_s: int | None) -> None:
        self.puts += 1
        if self.fail:
            raise self.fail.pop(0)
        self.rows[(entry.tenant, entry.trigger_id)] = entry

    async def get(self, tenant: str, trigger_id: str) -> tuple[DeadLetterEntry, int] | None:
        e = self.rows.get((tenant, trigger_id))
        return None if e is None else (e, 3600)

    async def list_window(
        self, tenant: str, *, from_ms: int, to_ms: int, limit: int, before: Any = None
    ) -> tuple[list[DeadLetterEntry], Any]:
        rows = sorted(
            (e for e in self.rows.values() if e.tenant == tenant),
            key=lambda e: e.position,
            reverse=True,
        )
        rows = [e for e in rows if from_ms <= e.dead_lettered_ms < to_ms]
        if before is not None:
            rows = [e for e in rows if e.position < before]
        page = rows[:limit]
        return page, (page[-1].position if len(rows) > limit else None)

    async def claim(
        self,
        entry: DeadLetterEntry,
        *,
        claim: str,
        at_ms: int,
        attempt: int,
        ttl_s: int,
        replacing: str | None = None,
    ) -> bool:
        key = (entry.tenant, entry.trigger_id)
        if self.rows[key].redrive_claim != replacing:
            return False
        self.rows[key] = replace(
            self.rows[key], redrive_claim=claim, redriven_ms=at_ms, redrive_attempt=attempt
        )
        return True

    async def release(self, entry: DeadLetterEntry, *, claim: str, ttl_s: int) -> None:
        key = (entry.tenant, entry.trigger_id)
        if self.rows[key].redrive_claim == claim:
            self.rows[key] = replace(
                self.rows[key], redrive_claim=None, redriven_ms=None, redrive_attempt=None
            )


class Tenants:
    def peek(self, tenant: str) -> TenantConfig | None:
        return TenantConfig()

    async def config(self, tenant: str) -> TenantConfig:
        return TenantConfig(retention_s=60)


def test_recording_waits_out_a_retriable_failure_and_drops_only_a_refused_one() -> None:
    letters = Letters()
    letters.fail = [StoreError("timeout", retriable=True), StoreError("bad", retriable=False)]
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    other = {**OUTCOME, "trigger_id": "t2"}
    delivered = {**OUTCOME, "outcome": "delivered", "trigger_id": "t3"}
    outcomes: Sequence[dict[str, Any]] = [OUTCOME, other, delivered]
    n = asyncio.run(record_dead_letters(letters, Tenants(), outcomes, sleep=sleep))  # type: ignore[arg-type]
    # One of the two was refused for good (logged), the other recorded after one wait.
    assert n == 1 and len(letters.rows) == 1 and sleeps == [0.5] and letters.puts == 3


def test_a_window_is_read_day_by_day_newest_first_and_bounded() -> None:
    day = T0 - T0 % DAY_MS
    assert days_newest_first(day - 1, day + 1) == [day, day - DAY_MS]
    assert days_newest_first(day, day + DAY_MS) == [day]  # 'to' is exclusive
    with pytest.raises(ValueError, match="at most"):
        days_newest_first(day, day + (MAX_WINDOW_DAYS + 1) * DAY_MS)
    with pytest.raises(ValueError, match="empty"):
        days_newest_first(day, day)


def test_a_window_redrive_takes_each_triggers_newest_dead_letter_if_not_redriven() -> None:
    a2 = DeadLetterEntry(tenant="x", trigger_id="a", dead_lettered_ms=30, schedule_id="s")
    b = DeadLetterEntry(tenant="x", trigger_id="b", dead_lettered_ms=20, schedule_id="s")
    a1 = replace(a2, dead_lettered_ms=10, redrive_claim="c")
    c = replace(b, trigger_id="c", redrive_claim="c")
    assert latest_unclaimed([a2, b, a1, c]) == [a2, b]


# -- what a redrive decides -------------------------------------------------------------------


def entry(**kw: Any) -> DeadLetterEntry:
    e = entry_from_outcome(OUTCOME)
    assert e is not None
    tid = trigger_id("acme", kw.get("schedule_id", "s1"), kw.get("due_ms", T0 - 5000))
    return replace(e, trigger_id=tid, **kw)


def schedule(e: DeadLetterEntry, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "tenant": "acme",
        "schedule_id": e.schedule_id,
        "partition": 0,
        "state": "fired",
        "due_ms": e.due_ms,
        "version": 1,
        "created_ms": T0 - 9000,
        "updated_ms": T0 - 5000,
        "order_key": "orders-7",
        "payload": b'{"n":1}',
        "payload_type": "json",
        "callback": CALLBACK,
        "trigger_id": e.trigger_id,
        "delivery_outcome": "dead_lettered",
        "delivery_ms": T0,
    }
    row.update(kw)
    return row


def refused(dl: DeadLetterEntry, row: Any, parent: Any = None, force: bool = False) -> str:
    with pytest.raises(ApiError) as err:
        redrive_source(dl, row, parent, force=force)
    return f"{err.value.status} {err.value.code}"


def test_redrive_refusals_each_have_their_own_code() -> None:
    dl = entry()
    assert refused(dl, None) == "410 schedule_gone"
    assert refused(dl, schedule(dl, state="cancelled")) == "409 schedule_cancelled"
    assert refused(dl, schedule(dl, state="scheduled")) == "409 superseded"
    assert refused(dl, schedule(dl, trigger_id="other")) == "409 superseded"
    claimed = replace(dl, redrive_claim="c", redriven_ms=T0 + 1, redrive_attempt=2)
    assert refused(claimed, schedule(dl)) == "409 already_redriven"
    later = schedule(dl, delivery_outcome="delivered", delivery_ms=T0 + 10)
    assert refused(dl, later) == "409 already_delivered"
    # force: once more, even after a delivery; never past a cancel
    assert redrive_source(claimed, later, None, force=True).schedule_id == "s1"
    assert refused(claimed, schedule(dl, state="cancelled"), force=True) == "409 schedule_cancelled"


def test_a_dead_letter_that_beat_its_fire_record_is_retriable_not_superseded() -> None:
    # A 7xx answer dead-letters a trigger at once, and the worker's fired record can land
    # after it: the row still reads scheduled, same due, no trigger id, for a second or two.
    dl = entry()
    pending = schedule(dl, state="scheduled", trigger_id=None, delivery_outcome=None)
    with pytest.raises(ApiError) as err:
        redrive_source(dl, pending, None, force=False)
    assert (err.value.status, err.value.code, err.value.retriable) == (
        503,
        "fire_not_recorded",
        True,
    )
    assert dl.due_ms is not None
    moved = schedule(dl, state="scheduled", trigger_id=None, due_ms=dl.due_ms + 60_000)
    assert refused(dl, moved) == "409 superseded"


def test_a_run_of_a_recurring_schedule_is_rebuilt_from_its_schedule_unless_cancelled() -> None:
    dl = entry(schedule_id=f"cron1@{T0 - 60_000}", due_ms=T0 - 59_000)
    run_row = {"tenant": "acme", "schedule_id": dl.schedule_id, "state": "fired",
               "trigger_id": dl.trigger_id}  # fmt: skip
    parent = schedule(dl, schedule_id="cron1", state="scheduled", due_ms=None, order_key=None)
    parent["recurrence"] = '{"every_s": 60}'
    src = redrive_source(dl, run_row, parent, force=False)
    assert (src.schedule_id, src.due_ms, src.order_key) == (dl.schedule_id, dl.due_ms, "cron1")
    assert refused(dl, run_row, {**parent, "state": "cancelled"}) == "409 schedule_cancelled"
    assert refused(dl, run_row, None) == "410 schedule_gone"


def test_the_attempt_is_one_past_every_emission_recorded_and_the_dead_lettered_one() -> None:
    dl = entry()
    fired = {"event": ScheduleEvent.FIRED}
    assert next_attempt([fired, {"event": "created"}], dl) == 2
    assert next_attempt([fired, {"event": ScheduleEvent.REFIRED}], dl) == 3
    assert next_attempt([], replace(dl, emit_attempt=4)) == 5  # history expired


# -- a redrive end to end over fakes ----------------------------------------------------------


class Schedules:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = {(r["tenant"], r["schedule_id"]): r for r in rows}
        self.events: list[tuple[str, str, str, dict[str, Any]]] = []

    async def get_schedule(self, tenant: str, schedule_id: str) -> dict[str, Any] | None:
        return self.rows.get((tenant, schedule_id))

    async def list_events(self, tenant: str, schedule_id: str) -> list[dict[str, Any]]:
        return [{"event": "fired"}] + [
            {"event": e} for t, s, e, _ in self.events if (t, s) == (tenant, schedule_id)
        ]

    async def record_event(self, tenant: str, schedule_id: str, event: str, **kw: Any) -> None:
        self.events.append((tenant, schedule_id, event, kw))


class Fires:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, bytes]] = []
        self.fail: BaseException | None = None

    async def __call__(self, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append((key, value))


def setup() -> tuple[DeadLetters, DeadLetterEntry, Schedules, Fires, Letters]:
    dl = entry()
    letters, fires = Letters(), Fires()
    letters.rows[("acme", dl.trigger_id)] = dl
    store = Schedules([schedule(dl)])
    dls = DeadLetters(store, fires, clock=lambda: T0 + 1000, letters=letters)  # type: ignore[arg-type]
    return dls, dl, store, fires, letters


def test_a_redrive_sends_the_same_trigger_keyed_by_its_order_key_with_the_next_attempt() -> None:
    dls, dl, store, fires, letters = setup()
    got = asyncio.run(dls.redrive("acme", dl.trigger_id))
    assert got["attempt"] == 2 and got["trigger_id"] == dl.trigger_id
    ((key, value),) = fires.sent
    trig = decode_trigger(value)
    assert key == b"orders-7" and (trig.trigger_id, trig.attempt) == (dl.trigger_id, 2)
    assert (trig.due_ms, trig.emitted_ms) == (dl.due_ms, T0 + 1000)
    ((_, sid, event, kw),) = store.events
    assert (sid, event, kw["trigger_id"]) == ("s1", ScheduleEvent.REFIRED, dl.trigger_id)
    assert "redriven from its dead letter" in kw["detail"] and "bad sku" in kw["detail"]
    assert letters.rows[("acme", dl.trigger_id)].redrive_attempt == 2


def test_a_second_redrive_is_refused_unless_forced_and_another_tenant_gets_404() -> None:
    dls, dl, _store, fires, _letters = setup()
    asyncio.run(dls.redrive("acme", dl.trigger_id))
    with pytest.raises(ApiError) as err:
        asyncio.run(dls.redrive("acme", dl.trigger_id))
    assert err.value.code == "already_redriven" and len(fires.sent) == 1
    assert asyncio.run(dls.redrive("acme", dl.trigger_id, force=True))["attempt"] == 3
    with pytest.raises(ApiError) as err:
        asyncio.run(dls.redrive("globex", dl.trigger_id))
    assert err.value.status == 404 and len(fires.sent) == 2


def test_two_redrives_at_once_send_the_trigger_once() -> None:
    dls, dl, _store, fires, _letters = setup()

    async def both() -> list[Any]:
        return await asyncio.gather(
            dls.redrive("acme", dl.trigger_id),
            dls.redrive("acme", dl.trigger_id),
            return_exceptions=True,
        )

    results = asyncio.run(both())
    assert len(fires.sent) == 1
    assert sorted(type(r).__name__ for r in results) == ["ApiError", "dict"]


def test_a_trigger_kafka_did_not_take_gives_its_claim_back() -> None:
    dls, dl, store, fires, letters = setup()
    fires.fail = KafkaError("broker down", retriable=True)
    with pytest.raises(KafkaError):
        asyncio.run(dls.redrive("acme", dl.trigger_id))
    assert letters.rows[("acme", dl.trigger_id)].redrive_claim is None and store.events == []
    fires.fail = TimeoutError()
    with pytest.raises(ApiError) as err:
        asyncio.run(dls.redrive("acme", dl.trigger_id))
    assert (err.value.status, err.value.retriable) == (503, True)
    fires.fail = None
    assert asyncio.run(dls.redrive("acme", dl.trigger_id))["attempt"] == 2


def test_many_and_window_redrives_answer_each_one_and_are_bounded() -> None:
    dls, dl, _store, fires, _letters = setup()
    got = asyncio.run(dls.redrive_many("acme", [dl.trigger_id, "nope", dl.trigger_id]))
    assert got["matched"] == 2 and [r["trigger_id"] for r in got["redriven"]] == [dl.trigger_id]  # type: ignore[index, union-attr]
    assert [(f["trigger_id"], f["code"]) for f in got["failed"]] == [("nope", "not_found")]  # type: ignore[union-attr]
    with pytest.raises(ApiError) as err:
        asyncio.run(dls.redrive_many("acme", [str(i) for i in range(MAX_REDRIVE + 1)]))
    assert err.value.code == "too_many"
    # The window holds it, redriven already: nothing is sent again.
    again = asyncio.run(dls.redrive_window("acme", from_ms=T0 - 1, to_ms=T0 + 1))
    assert again["matched"] == 0 and len(fires.sent) == 1
    with pytest.raises(ApiError) as err:
        asyncio.run(dls.redrive_window("acme", from_ms=T0, to_ms=T0 + 40 * DAY_MS))
    assert err.value.status == 400


def test_a_window_redrive_sends_what_is_left_in_it() -> None:
    dls, _dl, _store, fires, _letters = setup()
    got = asyncio.run(dls.redrive_window("acme", from_ms=T0 - 1, to_ms=T0 + 1))
    assert got["matched"] == 1 and got["truncated"] is False and len(fires.sent) == 1
    assert orjson.loads(fires.sent[0][1])["attempt"] == 2


def test_the_routes_are_in_the_openapi_document() -> None:
    from api.openapi import openapi_document

    paths = openapi_document()["paths"]
    for path in (
        "/v1/dead-letters",
        "/v1/dead-letters/redrive",
        "/v1/dead-letters/{trigger_id}",
        "/v1/dead-letters/{trigger_id}/redrive",
    ):
        assert path in paths  # type: ignore[operator]
    one = paths["/v1/dead-letters/{trigger_id}/redrive"]["post"]  # type: ignore[index]
    assert {"404", "409", "410"} <= set(one["responses"])


def test_an_extra_run_keeps_its_own_trigger_id_and_is_sent_with_its_schedules_callback() -> None:
    # A run fired at once by hand: its id is not <schedule>@<digits> and its trigger id is
    # not derived from its due time; its row holds only the fire state.
    dl = replace(entry(), schedule_id="cron1@now-1764000000000-7", trigger_id="f" * 32)
    run_row = {"tenant": "acme", "schedule_id": dl.schedule_id, "state": "fired",
               "trigger_id": dl.trigger_id}  # fmt: skip
    parent = schedule(dl, schedule_id="cron1", state="scheduled", due_ms=None, order_key=None)
    letters, fires = Letters(), Fires()
    letters.rows[("acme", dl.trigger_id)] = dl
    store = Schedules([run_row, parent])
    dls = DeadLetters(store, fires, clock=lambda: T0 + 1000, letters=letters)  # type: ignore[arg-type]
    got = asyncio.run(dls.redrive("acme", dl.trigger_id))
    ((key, value),) = fires.sent
    trig = decode_trigger(value)
    assert got["attempt"] == 2 and key == b"cron1"
    assert (trig.trigger_id, trig.schedule_id, trig.due_ms) == (
        dl.trigger_id,
        dl.schedule_id,
        dl.due_ms,
    )


def test_a_window_redrive_goes_on_past_dead_letters_it_cannot_redrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The newest dead letters of the window are refused for good (their schedules are
    gone) and stay unclaimed: repeating the same request picks them again each time, so
    the answer's next_cursor is what reaches the older one."""
    import api.deadletters as module

    monkeypatch.setattr(module, "MAX_REDRIVE", 2)
    dls, dl, _store, fires, letters = setup()
    for i in (1, 2, 3):
        gone = entry(schedule_id=f"gone{i}", dead_lettered_ms=T0 + i)
        letters.rows[("acme", gone.trigger_id)] = gone
    window = {"from_ms": T0 - 1, "to_ms": T0 + 10}
    first = asyncio.run(dls.redrive_window("acme", **window))  # type: ignore[arg-type]
    assert first["truncated"] is True and first["redriven"] == []
    assert [f["code"] for f in first["failed"]] == ["schedule_gone"] * 2  # type: ignore[union-attr]
    again = asyncio.run(dls.redrive_window("acme", **window))  # type: ignore[arg-type]
    assert again["failed"] == first["failed"] and fires.sent == []  # no progress by repeating
    cursor = first["next_cursor"]
    assert isinstance(cursor, str)
    rest = asyncio.run(dls.redrive_window("acme", **window, cursor=cursor))  # type: ignore[arg-type]
    assert [r["trigger_id"] for r in rest["redriven"]] == [dl.trigger_id]  # type: ignore[union-attr]
    assert [f["code"] for f in rest["failed"]] == ["schedule_gone"]  # type: ignore[union-attr]
    assert rest["truncated"] is False and rest["next_cursor"] is None and len(fires.sent) == 1


def test_a_redrive_sent_whose_history_event_fails_is_answered_as_sent() -> None:
    """Once Kafka has the trigger the redrive is done (its claim holds): a history write
    failing after it must not answer 'unavailable, try again', whose retry could only be
    refused already_redriven."""
    dls, dl, store, fires, letters = setup()

    async def failing(*args: Any, **kw: Any) -> None:
        raise StoreError("cassandra timed out", retriable=True)

    store.record_event = failing  # type: ignore[method-assign]
    got = asyncio.run(dls.redrive("acme", dl.trigger_id))
    assert got["attempt"] == 2 and got["history_recorded"] is False and len(fires.sent) == 1
    assert letters.rows[("acme", dl.trigger_id)].redrive_claim is not None


def test_the_command_line_prints_a_receivers_answer_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead letter's reason and body excerpt are the start of the receiver's answer, which
    whoever runs the endpoint chooses: a terminal must not act on them (an OSC title, a
    screen clear, reversed text). --json keeps them as recorded."""
    import argparse

    import tocsin.deadletter_cli as cli
    from base.settings import Settings

    hostile = "HTTP 700: \x1b]0;pwned\x07\x1b[2J\u202eoops"
    dl = replace(entry(), reason=hostile, body_excerpt=hostile[10:], endpoint="https://r/\x1b[31m")
    answers = {"get": (dl, 60), "list": ([dl], None)}
    monkeypatch.setattr(cli, "_run", lambda _s, work: answers[action])
    for action in ("get", "list"):
        args = argparse.Namespace(
            action=action, tenant="acme", trigger_ids=[dl.trigger_id], from_=None, to=None,
            limit=100, force=False, cursor=None,
        )  # fmt: skip
        assert cli.cmd_deadletter(args, Settings()) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
        assert "\\x1b" in out
    args.json = True
    assert cli.cmd_deadletter(args, Settings()) == 0
    assert orjson.loads(capsys.readouterr().out)[0]["reason"] == hostile

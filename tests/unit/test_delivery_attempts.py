"""Each failed delivery attempt, and each wait its host imposed, reaches the schedule's
history: the proxy's sampled attempt records, the worker's bounded events, explain's
timeline and notes."""

from __future__ import annotations

import asyncio
import time

import orjson

from proxy.attempts import FIRST_ATTEMPTS, Held, attempt_sampled, hold_sampled
from proxy.retry import HttpResult, Retry, RetryPolicy, decide
from streams.deadletter_store import entry_from_outcome
from streams.deliveries import AttemptBook, parse_outcome, record_attempt, record_outcome
from streams.explain import Facts, explain, render
from tests.fakes import FakeStore
from tests.unit.test_proxy_outcomes import publisher
from tests.unit.test_proxy_writer import fire
from tests.unit.test_streams_deliveries import Tenants

POLICY = RetryPolicy(base_delay_s=0.2, max_delay_s=60.0, jitter=0.0, max_retry_age_s=0)


def test_failed_attempts_are_reported_first_eight_then_at_powers_of_two() -> None:
    pub, outbox, offsets, _ = publisher()
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    now = time.monotonic()
    for i in range(40):
        decision, env.attempt_state = decide(
            POLICY,
            env.attempt_state,
            HttpResult(status=503, body_snippet="busy"),
            now_s=now + i,
            rand=lambda: 0.0,
        )
        assert isinstance(decision, Retry)
        pub.attempt_failed(env, decision, "5xx")
    docs = [orjson.loads(r.value) for r in outbox.records]
    assert [d["attempt"] for d in docs] == [*range(1, FIRST_ATTEMPTS + 1), 16, 32]
    assert all(r.topic == "out" and r.key == b"s0" for r in outbox.records)
    first = docs[0]
    assert first["kind"] == "attempt" and "outcome" not in first
    assert (first["status_code"], first["status_class"], first["result"]) == (
        503,
        "5xx",
        "HTTP 503: busy",
    )
    assert (first["backoff_ms"], docs[1]["backoff_ms"]) == (200, 400)
    assert (first["trigger_id"], first["emit_attempt"], first["held"]) == ("t0", 1, None)
    # An attempt record never holds the message's offset; only the final outcome does.
    outbox.waiting.clear()
    assert offsets.done == []


def test_a_hold_is_reported_once_per_power_of_two_seconds_crossed() -> None:
    assert hold_sampled(0.0, 30.0)
    assert not hold_sampled(0.1, 0.2)
    # Back-to-back holds of 3 s from the first failure: one per power of two crossed.
    starts = [3.0 * i for i in range(1, 400)]
    reported = [s for s in starts if hold_sampled(s, 3.0)]
    assert len(reported) == 9  # 3 to 1,200 s: crossing 4, 8, ..., 1,024 s
    assert attempt_sampled(8) and not attempt_sampled(9) and attempt_sampled(64)


def test_a_hold_record_says_which_limit_held_it() -> None:
    pub, outbox, _, _ = publisher()
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    pub.held(env, Held.RATE_LIMIT, 1.0, time.monotonic(), "rate limit of r.example")
    assert outbox.records == []  # pacing of a message that never failed: not reported
    now = time.monotonic()
    _, env.attempt_state = decide(
        POLICY, env.attempt_state, HttpResult(status=500), now_s=now, rand=lambda: 0.0
    )
    pub.held(env, Held.CIRCUIT_OPEN, 30.0, now, "circuit breaker open for r.example")
    (doc,) = [orjson.loads(r.value) for r in outbox.records]
    assert (doc["held"], doc["attempt"], doc["backoff_ms"], doc["status_class"]) == (
        "circuit_open",
        1,
        30_000,
        "held",
    )


def _record(attempt: int, held: str | None = None) -> dict[str, object]:
    return {
        "kind": "attempt",
        "trigger_id": "t1",
        "schedule_id": "s1",
        "tenant": "acme",
        "due_ms": 1_000,
        "emit_attempt": 1,
        "attempt": attempt,
        "status_code": None if held else 503,
        "status_class": "held" if held else "5xx",
        "result": "circuit breaker open for h" if held else "HTTP 503: busy",
        "backoff_ms": 400,
        "held": held,
        "at_ms": 2_000 + attempt,
    }


def test_the_worker_keeps_attempt_records_as_events_bounded_per_emission() -> None:
    store = FakeStore()
    book = AttemptBook(per_trigger=3)
    raw = orjson.dumps(_record(1))
    parsed = parse_outcome(raw)
    assert parsed is not None
    # Never a dead letter, whatever the dead-letter listing is given.
    assert entry_from_outcome(parsed) is None
    kept = [
        asyncio.run(record_attempt(store, Tenants(), _record(i), book=book)) for i in range(1, 6)
    ]
    assert kept == [True, True, True, False, False] and book.dropped == 2
    assert [e["event"] for e in store.events] == ["attempt_failed"] * 3
    assert store.events[0]["detail"] == "attempt 1 failed: HTTP 503: busy; next attempt in 0.4 s"
    assert store.events[0]["trigger_id"] == "t1" and store.deliveries == []
    # Through the outcome entry point too, as the worker's agent calls it.
    assert asyncio.run(record_outcome(store, Tenants(), _record(1, held="circuit_open")))
    assert store.events[-1]["event"] == "attempt_held"


def test_explain_shows_the_attempts_in_time_order_and_the_breaker() -> None:
    due = 1_000
    events = [
        {"at_ms": 500, "event": "created", "due_ms": due, "detail": None, "trigger_id": None},
        {"at_ms": 1_010, "event": "fired", "due_ms": due, "detail": None, "trigger_id": "t1"},
        {
            "at_ms": 1_300,
            "event": "attempt_failed",
            "due_ms": due,
            "trigger_id": "t1",
            "detail": "attempt 2 failed: HTTP 502; next attempt in 0.4 s",
        },
        {
            "at_ms": 1_100,
            "event": "attempt_failed",
            "due_ms": due,
            "trigger_id": "t1",
            "detail": "attempt 1 failed: HTTP 503: busy; next attempt in 0.2 s",
        },
        {
            "at_ms": 1_500,
            "event": "attempt_held",
            "due_ms": due,
            "trigger_id": "t1",
            "detail": "held by its host's open circuit breaker after 2 attempt(s): 30 s",
        },
        {
            "at_ms": 40_000,
            "event": "delivered",
            "due_ms": due,
            "trigger_id": "t1",
            "detail": "status 204 on attempt 12; 11 failed over 39 s, the last: HTTP 502",
        },
    ]
    row = {
        "tenant": "acme",
        "schedule_id": "s1",
        "partition": 0,
        "state": "fired",
        "due_ms": due,
        "fired_ms": 1_010,
        "recurrence": None,
        "delivery_outcome": "delivered",
        "delivery_status_code": 204,
        "delivery_attempts": 12,
    }
    ex = explain(Facts(row=row, events=events, now_ms=50_000, default_tolerance_s=60))
    assert [e.event for e in ex.entries] == [
        "created",
        "fired",
        "attempt_failed",
        "attempt_failed",
        "attempt_held",
        "delivered",
    ]
    assert ex.entries[2].text == "attempt 1 failed: HTTP 503: busy; next attempt in 0.2 s"
    assert any("11 failed attempt(s), 2 shown one by one" in n for n in ex.notes)
    assert any("tocsin_proxy_breaker_open{tenant,host,state}" in n for n in ex.notes)
    assert "held by its host's open circuit breaker" in render(ex)


def test_the_writer_reports_failed_attempts_and_its_hosts_open_breaker() -> None:
    """Two 503s open the host's breaker: the deliveries topic gets both attempts (status,
    attempt number, backoff) and then the hold, before any final outcome."""
    from proxy.breaker import BreakerPolicy
    from proxy.hostlimits import HostGate
    from proxy.metrics import ProxyMetrics
    from proxy.ordering import Bounds
    from proxy.settings import ProxySettings
    from proxy.state import SharedState
    from proxy.writer import Writer
    from tests.unit.test_proxy_host_writer import H, HostSender, wait_until
    from tests.unit.test_proxy_host_writer import fire as host_fire
    from tests.unit.test_proxy_writer import FakeOutbox

    gate = HostGate(BreakerPolicy(failures=2, open_s=30.0, open_max_s=30.0))
    sender = HostSender(lambda env: HttpResult(status=503, body_snippet="down"))
    state = SharedState(Bounds())
    state.assign([("t", 0)])
    outbox = FakeOutbox()
    settings = ProxySettings(
        mode="fires",
        metrics_port=0,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.01,
        max_retry_age_s=0,
        per_host_concurrency=1,
    )
    writer = Writer(
        state=state,
        settings=settings,
        metrics=ProxyMetrics(),
        outbox=outbox,
        dead_letter_topic="dlq",
        deliveries_topic="deliveries",
        http=sender,
        kafka=HostSender(),
        hosts=gate,
    )
    try:
        writer.start()
        state.push([host_fire(0, "a", f"{H}/x")])
        writer.notify()
        wait_until(lambda: len(outbox.records) >= 3)
    finally:
        writer.drain(1)
    docs = [orjson.loads(r.value) for r in outbox.records if r.topic == "deliveries"]
    assert [(d["attempt"], d["status_code"], d["held"]) for d in docs[:3]] == [
        (1, 503, None),
        (2, 503, None),
        (2, None, "circuit_open"),
    ]
    assert docs[0]["result"] == "HTTP 503: down" and 5 <= docs[0]["backoff_ms"] <= 10
    assert docs[2]["backoff_ms"] > 20_000  # the breaker's open period, not the backoff
    assert all("outcome" not in d for d in docs)

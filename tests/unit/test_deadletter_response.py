"""The last response a dead letter and its delivery outcome carry: the status code and a
bounded excerpt of the body, taken from the attempt state ``proxy.retry.decide`` leaves."""

from __future__ import annotations

import time

import orjson

from proxy.deadletter import MAX_BODY_EXCERPT_CHARS, delivery_outcome, last_response
from proxy.retry import (
    AttemptState,
    ConnectFailure,
    DeadLetter,
    HttpResult,
    RetryPolicy,
    TimeoutResult,
    decide,
)
from tests.unit.test_proxy_writer import fire
from topics.models import DeliveryOutcome

POLICY = RetryPolicy(max_retry_age_s=1.0, base_delay_s=0.5, max_delay_s=0.5)


def after(*results: object) -> tuple[object, AttemptState]:
    state, decision = AttemptState(), None
    for i, result in enumerate(results):
        decision, state = decide(POLICY, state, result, now_s=float(i), rand=lambda: 1.0)  # type: ignore[arg-type]
    return decision, state


def test_a_7xx_dead_letter_keeps_the_status_and_the_body_it_answered() -> None:
    decision, state = after(HttpResult(status=700, body_snippet="bad sku"))
    assert isinstance(decision, DeadLetter)
    assert last_response(state) == {"status_code": 700, "body_excerpt": "bad sku"}


def test_an_empty_body_gives_an_empty_excerpt_and_a_long_one_is_cut() -> None:
    _, state = after(HttpResult(status=700))
    assert last_response(state) == {"status_code": 700, "body_excerpt": ""}
    _, state = after(HttpResult(status=700, body_snippet="x" * 5000))
    got = last_response(state)
    assert got is not None and got["body_excerpt"] == "x" * MAX_BODY_EXCERPT_CHARS


def test_the_last_attempt_decides_a_timeout_after_a_500_has_no_response() -> None:
    decision, state = after(HttpResult(status=500, body_snippet="down"), TimeoutResult())
    assert isinstance(decision, DeadLetter)  # retry age over 1 s
    assert last_response(state) is None
    decision, state = after(
        ConnectFailure(detail="refused"), HttpResult(status=503, body_snippet="busy")
    )
    assert isinstance(decision, DeadLetter)
    assert last_response(state) == {"status_code": 503, "body_excerpt": "busy"}


def test_a_dead_lettered_outcome_carries_the_response_and_endpoint_a_delivered_one_not() -> None:
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    _, env.attempt_state = after(HttpResult(status=700, body_snippet="bad sku"))
    rec = delivery_outcome(
        env,
        outcome=DeliveryOutcome.DEAD_LETTERED,
        status=700,
        reason="HTTP 700: bad sku",
        latency_ms=3,
        now_ms=int(time.time() * 1000),
    )
    assert rec is not None
    doc = orjson.loads(rec[1])
    assert doc["response"] == {"status_code": 700, "body_excerpt": "bad sku"}
    assert doc["endpoint"] == "http://r.example/hook"
    rec = delivery_outcome(
        env, outcome=DeliveryOutcome.DELIVERED, status=200, reason=None, latency_ms=3, now_ms=1
    )
    assert rec is not None and "response" not in orjson.loads(rec[1])

"""The MPS return-code policy."""

from __future__ import annotations

from email.utils import formatdate

import pytest

from proxy.retry import (
    AttemptResult,
    AttemptState,
    CallbackPolicies,
    ConnectFailure,
    DeadLetter,
    Decision,
    Done,
    HttpResult,
    KafkaResult,
    KafkaVerdict,
    Retry,
    RetryPolicy,
    TimeoutResult,
    Undeliverable,
    backoff_s,
    decide,
    parse_retry_after,
    status_class,
)
from topics.models import DeliveryRetry

NO_JITTER = RetryPolicy(jitter=0.0, base_delay_s=1.0, max_delay_s=30.0)


def run(policy: RetryPolicy, results: list[AttemptResult], step_s: float = 1.0) -> list[Decision]:
    state = AttemptState()
    out: list[Decision] = []
    now = 1000.0
    for r in results:
        d, state = decide(policy, state, r, now_s=now, now_epoch_s=now, rand=lambda: 0.5)
        out.append(d)
        now += step_s
    return out


def test_2xx_done() -> None:
    (d,) = run(NO_JITTER, [HttpResult(status=204)])
    assert d == Done(status=204)


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503, 302, 199, 800])
def test_4xx_5xx_and_oddities_retry_with_backoff(status: int) -> None:
    ds = run(NO_JITTER, [HttpResult(status=status)] * 50)
    assert all(isinstance(d, Retry) for d in ds)
    delays = [d.after_s for d in ds if isinstance(d, Retry)]
    assert delays[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]  # exponential, capped
    assert delays[-1] == 30.0


def test_max_retry_age_dead_letters() -> None:
    policy = RetryPolicy(jitter=0.0, base_delay_s=1.0, max_delay_s=1.0, max_retry_age_s=5.0)
    ds = run(policy, [HttpResult(status=503, body_snippet="busy")] * 10, step_s=1.0)
    first_dl = next(i for i, d in enumerate(ds) if isinstance(d, DeadLetter))
    assert first_dl == 5  # failed at t=0..5; the retry at t=6 would be 6 s after the first
    dl = ds[first_dl]
    assert isinstance(dl, DeadLetter) and dl.status == 503 and "busy" in dl.reason


def test_6xx_retried_n_times_then_dead_letter() -> None:
    policy = RetryPolicy(retries_6xx=2, jitter=0.0)
    ds = run(policy, [HttpResult(status=600)] * 3)
    assert [type(d) for d in ds] == [Retry, Retry, DeadLetter]
    zero = run(RetryPolicy(retries_6xx=0), [HttpResult(status=650)])
    assert isinstance(zero[0], DeadLetter)


def test_7xx_dead_letter_at_once_with_snippet() -> None:
    (d,) = run(NO_JITTER, [HttpResult(status=700, body_snippet="bad sku")])
    assert d == DeadLetter(reason="HTTP 700: bad sku", status=700)


def test_retry_after_seconds_and_date() -> None:
    (d,) = run(NO_JITTER, [HttpResult(status=429, retry_after="7")])
    assert d == Retry(after_s=7.0, reason="HTTP 429")
    now = 1_700_000_000.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now) == 0.0
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("-3", now) == 0.0
    assert parse_retry_after(None, now) is None
    policy = RetryPolicy(max_retry_after_s=10.0)
    (capped,) = run(policy, [HttpResult(status=503, retry_after="99999")])
    assert isinstance(capped, Retry) and capped.after_s == 10.0


def test_retry_after_never_shortens_the_backoff() -> None:
    # A failing endpoint answering Retry-After: 0 must not get a hot retry loop.
    ds = run(NO_JITTER, [HttpResult(status=503, retry_after="0")] * 6)
    assert [d.after_s for d in ds if isinstance(d, Retry)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


def test_by_default_a_failing_trigger_is_dead_lettered_after_a_day() -> None:
    policy = RetryPolicy(jitter=0.0)
    assert policy.max_retry_age_s == 86_400.0
    ds = run(policy, [HttpResult(status=503)] * 2_000, step_s=60.0)
    assert any(isinstance(d, DeadLetter) for d in ds)
    first_dl = next(i for i, d in enumerate(ds) if isinstance(d, DeadLetter))
    assert 86_400 - 120 <= first_dl * 60.0 <= 86_400


def test_poison_pill_after_consecutive_timeouts() -> None:
    policy = RetryPolicy(poison_timeouts=3, jitter=0.0)
    ds = run(policy, [TimeoutResult()] * 3)
    assert [type(d) for d in ds] == [Retry, Retry, DeadLetter]
    assert isinstance(ds[-1], DeadLetter) and "poison" in ds[-1].reason


def test_other_results_reset_the_timeout_streak() -> None:
    policy = RetryPolicy(poison_timeouts=3, jitter=0.0)
    seq: list[AttemptResult] = [TimeoutResult(), TimeoutResult(), HttpResult(status=500)]
    ds = run(policy, [*seq, TimeoutResult(), TimeoutResult()])
    assert all(isinstance(d, Retry) for d in ds)


def test_connect_failures_never_poison() -> None:
    policy = RetryPolicy(poison_timeouts=2)
    ds = run(policy, [ConnectFailure(detail="refused")] * 20)
    assert all(isinstance(d, Retry) for d in ds)


def test_state_tracks_attempts_and_failure_times() -> None:
    state = AttemptState()
    _, state = decide(NO_JITTER, state, HttpResult(status=500), now_s=10, rand=lambda: 0)
    _, state = decide(NO_JITTER, state, HttpResult(status=500), now_s=12, rand=lambda: 0)
    d, state = decide(NO_JITTER, state, HttpResult(status=200), now_s=15, rand=lambda: 0)
    assert isinstance(d, Done)
    assert (state.attempts, state.failures) == (3, 2)
    assert (state.first_failure_s, state.last_failure_s) == (10, 12)


def test_jitter_stays_in_range() -> None:
    policy = RetryPolicy(base_delay_s=4.0, max_delay_s=4.0, jitter=0.5)
    assert backoff_s(policy, 1, lambda: 0.0) == 4.0
    assert backoff_s(policy, 1, lambda: 0.999) == pytest.approx(2.002)
    assert backoff_s(policy, 10_000, lambda: 0.0) == 4.0  # no overflow


def test_status_classes() -> None:
    assert status_class(HttpResult(status=201)) == "2xx"
    assert status_class(HttpResult(status=799)) == "7xx"
    assert status_class(HttpResult(status=302)) == "other"
    assert status_class(TimeoutResult()) == "timeout"
    assert status_class(ConnectFailure(detail="x")) == "connect"


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(poison_timeouts=0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=2)


def test_undeliverable_dead_letters_at_once() -> None:
    (d,) = run(NO_JITTER, [Undeliverable(detail="undecodable trigger")])
    assert d == DeadLetter(reason="undecodable trigger")


def kafka(verdict: KafkaVerdict, detail: str = "kafka callback to 'sink' failed") -> KafkaResult:
    return KafkaResult(verdict=verdict, detail=detail)


def test_a_kafka_ack_is_delivered_and_reported_as_200() -> None:
    (d,) = run(NO_JITTER, [kafka(KafkaVerdict.ACKED, "")])
    assert d == Done(status=200)
    assert status_class(kafka(KafkaVerdict.ACKED)) == "2xx"


def test_a_kafka_refusal_dead_letters_at_once() -> None:
    (d,) = run(NO_JITTER, [kafka(KafkaVerdict.REFUSED, "cannot succeed")])
    assert d == DeadLetter(reason="cannot succeed")
    assert status_class(kafka(KafkaVerdict.REFUSED)) == "undeliverable"


def test_a_failed_kafka_produce_is_retried_and_never_poison() -> None:
    ds = run(RetryPolicy(poison_timeouts=2), [kafka(KafkaVerdict.FAILED)] * 20)
    assert all(isinstance(d, Retry) for d in ds)
    assert status_class(kafka(KafkaVerdict.FAILED)) == "connect"


def test_unacknowledged_kafka_produces_count_toward_poison() -> None:
    ds = run(RetryPolicy(poison_timeouts=2), [kafka(KafkaVerdict.UNACKNOWLEDGED, "no ack")] * 2)
    assert isinstance(ds[0], Retry)
    assert isinstance(ds[1], DeadLetter) and "poison pill" in ds[1].reason
    assert status_class(kafka(KafkaVerdict.UNACKNOWLEDGED)) == "timeout"


def test_a_callbacks_policy_is_built_once_per_distinct_retry_and_the_cache_is_bounded() -> None:
    policies = CallbackPolicies(NO_JITTER, max_entries=2)
    assert policies.of(None) is NO_JITTER
    own = policies.of(DeliveryRetry(retries_6xx=0, max_retry_age_s=5.0))
    assert (own.retries_6xx, own.max_retry_age_s, own.base_delay_s) == (0, 5.0, 1.0)
    assert policies.of(DeliveryRetry(retries_6xx=0, max_retry_age_s=5.0)) is own
    for n in range(10):
        policies.of(DeliveryRetry(retries_6xx=n))
        assert len(policies) <= 2

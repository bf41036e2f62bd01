"""The host circuit breaker's state machine on a fake clock, and what counts as a host
failure."""

from __future__ import annotations

import pytest

from proxy.breaker import Breaker, BreakerPolicy, BreakerState, HostVerdict, host_verdict
from proxy.retry import (
    ConnectFailure,
    HttpResult,
    KafkaResult,
    KafkaVerdict,
    TimeoutResult,
    Undeliverable,
)

UP, FAILED, UNKNOWN = HostVerdict.UP, HostVerdict.FAILED, HostVerdict.UNKNOWN
CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def breaker(**kw: float) -> Breaker:
    policy = {"failures": 3, "window": 10, "failure_ratio": 0.5, "open_s": 2.0, "open_max_s": 5.0}
    return Breaker(BreakerPolicy(**{**policy, **kw}))  # type: ignore[arg-type]


def test_what_an_attempt_says_about_its_host() -> None:
    assert host_verdict(HttpResult(status=200)) is UP
    assert host_verdict(HttpResult(status=404)) is UP  # the host judged the message
    assert host_verdict(HttpResult(status=600)) is UP
    assert host_verdict(HttpResult(status=700)) is UP
    assert host_verdict(HttpResult(status=503)) is FAILED
    assert host_verdict(HttpResult(status=429)) is FAILED  # overloaded: the host's state
    assert host_verdict(TimeoutResult()) is FAILED
    assert host_verdict(ConnectFailure(detail="refused")) is FAILED
    assert host_verdict(Undeliverable(detail="bad url")) is UNKNOWN
    assert host_verdict(KafkaResult(verdict=KafkaVerdict.ACKED)) is UP
    assert host_verdict(KafkaResult(verdict=KafkaVerdict.FAILED)) is FAILED


def test_it_opens_after_n_consecutive_failures_and_a_success_resets_the_count() -> None:
    b = breaker()
    b.record(FAILED, 0.0, probe=False)
    b.record(FAILED, 0.1, probe=False)
    b.record(UP, 0.2, probe=False)  # the streak starts again
    b.record(FAILED, 0.3, probe=False)
    assert b.record(FAILED, 0.4, probe=False) is CLOSED
    assert b.record(FAILED, 0.5, probe=False, detail="HTTP 503") is OPEN
    assert b.allow(0.6) == (False, False)
    view = b.view(0.6)
    assert view.state is OPEN and view.retry_in_s == pytest.approx(1.9)
    assert view.last_failure == "HTTP 503" and view.opened_count == 1


def test_failures_of_attempts_begun_before_the_last_success_are_not_consecutive() -> None:
    # Poison requests sent together time out together, while the host answered others
    # after they began: that is not a host failing three times in a row.
    b = breaker(window=20)
    b.record(UP, 1.0, probe=False, started_s=0.9)
    for _ in range(3):
        assert b.record(FAILED, 1.5, probe=False, started_s=0.5) is CLOSED
    assert b.view(1.5).window_failures == 3  # still counted for the ratio
    # Failures of attempts begun after that success are consecutive.
    for i in range(2):
        assert b.record(FAILED, 2.5, probe=False, started_s=2.0 + i / 10) is CLOSED
    assert b.record(FAILED, 2.6, probe=False, started_s=2.2) is OPEN


@pytest.mark.parametrize("probe", [False, True], ids=["closed", "probe"])
def test_a_success_either_way_is_the_last_success(probe: bool) -> None:
    # A success while closed and the probe's success that closes the breaker both restart
    # the consecutive count from their time: failures of attempts begun before it are not
    # consecutive, those begun after it are.
    b = breaker()
    for t in (0.0, 0.1, 0.2) if probe else (0.0, 0.1):
        b.record(FAILED, t, probe=False)
    if probe:
        assert b.allow(2.2) == (True, True)
    assert b.record(UP, 2.5, probe=probe, started_s=2.3) is CLOSED
    for _ in range(3):
        assert b.record(FAILED, 3.0, probe=False, started_s=2.4) is CLOSED
    assert b.view(3.0).consecutive_failures == 0
    for _ in range(2):
        assert b.record(FAILED, 3.5, probe=False, started_s=2.6) is CLOSED
    assert b.record(FAILED, 3.6, probe=False, started_s=2.6) is OPEN


def test_it_opens_on_the_failure_ratio_of_a_full_window() -> None:
    b = breaker(failures=100, window=4, failure_ratio=0.5)
    for verdict in (FAILED, UP, FAILED):
        assert b.record(verdict, 0.0, probe=False) is CLOSED  # window not full yet
    assert b.record(UP, 0.0, probe=False) is CLOSED  # full, 2 of 4: the ratio is met...
    assert b.record(FAILED, 0.0, probe=False) is OPEN  # ...and it trips on a failure


def test_one_probe_at_a_time_after_the_open_period_and_its_success_closes() -> None:
    b = breaker()
    for t in (0.0, 0.1, 0.2):
        b.record(FAILED, t, probe=False)
    assert b.allow(2.1) == (False, False)  # opened at 0.2 for 2 s
    assert b.allow(2.2) == (True, True)  # the probe
    assert b.state is HALF_OPEN
    assert b.allow(2.3) == (False, False)  # the others wait for it
    assert b.record(FAILED, 2.4, probe=False) is HALF_OPEN  # an older attempt: ignored
    assert b.record(UP, 2.5, probe=True) is CLOSED
    assert b.allow(2.6) == (True, False)
    assert b.view(2.6).consecutive_failures == 0


def test_a_failed_probe_reopens_for_twice_as_long_up_to_the_cap() -> None:
    b = breaker()
    for t in (0.0, 0.0, 0.0):
        b.record(FAILED, t, probe=False)
    now, periods = 0.0, []
    for _ in range(4):
        now += b.open_for_s
        assert b.allow(now) == (True, True)
        b.record(FAILED, now, probe=True)
        periods.append(b.open_for_s)
        assert b.state is OPEN and b.allow(now + b.open_for_s - 0.01) == (False, False)
    assert periods == [4.0, 5.0, 5.0, 5.0]
    now += b.open_for_s
    b.allow(now)
    b.record(UP, now, probe=True)
    assert b.state is CLOSED and b.open_for_s == 2.0  # the next opening starts short again


def test_a_dropped_or_inconclusive_probe_lets_the_next_attempt_probe() -> None:
    b = breaker()
    for _ in range(3):
        b.record(FAILED, 0.0, probe=False)
    assert b.allow(2.0) == (True, True)
    b.probe_dropped()  # revoked before it was attempted
    assert b.allow(2.0) == (True, True)
    assert b.record(UNKNOWN, 2.1, probe=True) is HALF_OPEN  # undeliverable: says nothing
    assert b.allow(2.2) == (True, True)


def test_failures_zero_never_opens() -> None:
    b = breaker(failures=0, window=2, failure_ratio=0.5)
    for t in range(50):
        assert b.record(FAILED, float(t), probe=False) is CLOSED
    assert b.allow(50.0) == (True, False)


def test_unknown_results_do_not_count_either_way() -> None:
    b = breaker()
    b.record(FAILED, 0.0, probe=False)
    b.record(FAILED, 0.0, probe=False)
    b.record(UNKNOWN, 0.0, probe=False)
    assert b.record(FAILED, 0.0, probe=False) is OPEN


@pytest.mark.parametrize(
    "kw",
    [
        {"failures": -1},
        {"window": 0},
        {"failure_ratio": 0.0},
        {"failure_ratio": 1.5},
        {"open_s": 0.0},
        {"open_s": 10.0, "open_max_s": 5.0},
    ],
)
def test_bad_policies_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(**kw)  # type: ignore[arg-type]

"""Rate limits and breakers per (tenant, host) on a fake clock: the token bucket, the limits
and their file, the gate both lanes share, and the retry age under an open breaker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from base.errors import ConfigError
from proxy.breaker import BreakerPolicy, BreakerState
from proxy.hostlimits import (
    Hold,
    HoldReason,
    HostGate,
    HostLimits,
    Pass,
    TokenBucket,
    describe,
    endpoint_host,
    parse_limits,
)
from proxy.limitsfile import CHECK_EVERY_S, LimitsFile
from proxy.metrics import MAX_BREAKER_SERIES, ProxyMetrics
from proxy.retry import AttemptState, DeadLetter, HttpResult, Retry, RetryPolicy, held_by_host

BAD = HttpResult(status=503)
OK = HttpResult(status=200)


# ---- token bucket ------------------------------------------------------------------------


def test_a_bucket_allows_one_second_of_burst_then_paces_at_its_rate() -> None:
    b = TokenBucket(4.0, now_s=0.0)
    assert [b.take(0.0) for _ in range(4)] == [0.0] * 4  # a quiet host's burst
    assert b.take(0.0) == pytest.approx(0.25)  # nothing taken: wait for the next token
    assert b.take(0.1) == pytest.approx(0.15)
    assert b.take(0.25) == 0.0
    assert b.take(0.25) == pytest.approx(0.25)
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(3.0)  # saved up to capacity


def test_a_slow_bucket_holds_one_token_and_rate_zero_is_no_limit() -> None:
    slow = TokenBucket(0.5, now_s=0.0)
    assert slow.take(0.0) == 0.0
    assert slow.take(0.0) == pytest.approx(2.0) and slow.spacing_s == pytest.approx(2.0)
    free = TokenBucket(0.0, now_s=0.0)
    assert all(free.take(0.0) == 0.0 for _ in range(1000)) and free.spacing_s == 0.0


def test_a_new_rate_applies_from_now_and_keeps_no_more_than_its_capacity() -> None:
    b = TokenBucket(10.0, now_s=0.0)
    b.set_rate(1.0, now_s=0.0)
    assert b.take(0.0) == 0.0 and b.take(0.0) == pytest.approx(1.0)


# ---- limits ------------------------------------------------------------------------------


def test_a_tenants_host_override_then_its_rate_then_the_default() -> None:
    limits = parse_limits(
        {
            "a": {"rps": 5, "hosts": {"API.example.com": 2, "slow.example.com:8443": 0.5}},
            "b": {"hosts": {"x.example.com": 0}},
        },
        default_rps=10.0,
    )
    assert limits.rps_for("a", "https://api.example.com") == 2.0  # names are case-free
    assert limits.rps_for("a", "https://api.example.com:9000") == 2.0  # host name matches
    assert limits.rps_for("a", "https://slow.example.com:8443") == 0.5
    assert limits.rps_for("a", "https://slow.example.com") == 5.0  # another port
    assert limits.rps_for("a", "https://other.example.com") == 5.0
    assert limits.rps_for("b", "https://x.example.com") == 0.0  # explicitly unlimited
    assert limits.rps_for("b", "https://y.example.com") == 10.0
    assert limits.rps_for("c", "https://api.example.com") == 10.0
    assert limits.rps_for(None, "https://api.example.com") == 10.0  # generic mode


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"a": 5},
        {"a": {"rps": -1}},
        {"a": {"rps": "fast"}},
        {"a": {"rps": True}},
        {"a": {"hosts": ["h"]}},
        {"a": {"hosts": {"h": None}}},
        {"a": {"burst": 3}},
    ],
)
def test_bad_limits_are_refused_with_the_entry_named(doc: object) -> None:
    with pytest.raises(ValueError):
        parse_limits(doc, default_rps=0.0)


# ---- the gate ----------------------------------------------------------------------------

H = "https://api.example.com"


def gate(**limits: float) -> HostGate:
    policy = BreakerPolicy(failures=2, open_s=1.0, open_max_s=4.0)
    return HostGate(policy, HostLimits(default_rps=limits.get("rps", 0.0)))


def test_the_rate_is_per_tenant_and_host() -> None:
    g = gate(rps=1.0)
    assert g.check("a", H, 0.0) == Pass()
    answer = g.check("a", H, 0.0)
    assert answer == Hold(HoldReason.RATE, pytest.approx(1.0), pytest.approx(1.0))  # type: ignore[arg-type]
    assert g.check("b", H, 0.0) == Pass()  # another tenant: its own bucket
    assert g.check("a", "https://other.example.com", 0.0) == Pass()  # another host
    assert g.check("a", H, 1.0) == Pass()


def test_a_tenants_failing_host_opens_its_breaker_only() -> None:
    g = gate()
    for _ in range(2):
        g.check("a", H, 0.0)
        change = g.record("a", H, BAD, 0.0, probe=False, detail="HTTP 503")
    assert change is not None and change.after is BreakerState.OPEN
    assert g.check("a", H, 0.5) == Hold(HoldReason.OPEN, 0.5, 0.0)
    assert g.check("b", H, 0.5) == Pass()  # the same host for another tenant: closed
    assert g.explain("b", H, 0.5).breaker.state is BreakerState.CLOSED
    assert g.check("a", H, 1.0) == Pass(probe=True)
    # While the probe is out the others ask again after the shortest open period.
    assert g.check("a", H, 1.1) == Hold(HoldReason.OPEN, 1.0, 0.0)
    change = g.record("a", H, OK, 1.2, probe=True)
    assert change is not None and change.after is BreakerState.CLOSED
    assert g.check("a", H, 1.3) == Pass()


def test_a_rate_limited_probe_is_given_back() -> None:
    g = HostGate(BreakerPolicy(failures=1, open_s=1.0), HostLimits(default_rps=1.0))
    g.check("a", H, 0.0)
    g.record("a", H, BAD, 0.0, probe=False)
    assert g.check("a", H, 1.0) == Pass(probe=True)  # the token saved since 0.0
    g.record("a", H, BAD, 1.0, probe=True)  # reopened for 2 s
    assert g.check("a", H, 3.0) == Pass(probe=True)
    g.probe_dropped("a", H)
    answer = g.check("a", H, 3.0)  # a probe may go, but no token: not the probe then
    assert isinstance(answer, Hold) and answer.reason is HoldReason.RATE
    assert g.check("a", H, 4.0) == Pass(probe=True)


def test_the_gate_is_bounded_least_recently_used_first() -> None:
    g = HostGate(BreakerPolicy(failures=1), max_entries=3)
    for i in range(3):
        g.check("a", f"https://h{i}", 0.0)
    g.check("a", "https://h0", 0.0)  # used again: h1 is now the oldest
    g.check("a", "https://h3", 0.0)
    assert len(g) == 3
    g.record("a", "https://h0", BAD, 0.0, probe=False)
    counts, _ = g.snapshot(0.0, limit=10)
    assert counts[BreakerState.OPEN] == 1 and sum(counts.values()) == 3


def open_breaker(g: HostGate, tenant: str, host: str) -> None:
    g.check(tenant, host, 0.0)
    g.record(tenant, host, BAD, 0.0, probe=False)
    assert g.explain(tenant, host, 0.0).breaker.state is BreakerState.OPEN


def test_one_tenants_host_churn_never_forgets_another_tenants_open_breaker() -> None:
    g = HostGate(BreakerPolicy(failures=1, open_s=30.0), max_entries=10)
    open_breaker(g, "a", H)
    for i in range(100):
        g.check("noisy", f"https://h{i}.example", 1.0)
    assert len(g) == 10
    assert g.check("a", H, 1.0) == Hold(HoldReason.OPEN, 29.0, 0.0)


def test_at_the_global_bound_the_tenant_holding_the_most_gives_one_up() -> None:
    g = HostGate(BreakerPolicy(failures=1, open_s=30.0), max_entries=5, max_entries_per_tenant=5)
    kept = [("a", H), ("b", "https://b0"), ("b", "https://b1"), ("b", "https://b2")]
    kept += [("c", "https://c0"), ("c", "https://c1")]
    for tenant, host in kept:  # every breaker open: only the bounds decide who goes
        open_breaker(g, tenant, host)
    # At c1 the gate was full: b, holding the most, gave up its oldest (b0), not a.
    assert len(g) == 5
    states = {(t, h): g.explain(t, h, 0.0).breaker.state for t, h in kept}
    forgotten = [k for k, state in states.items() if state is BreakerState.CLOSED]
    assert forgotten == [("b", "https://b0")]


def test_a_tenant_keeps_at_most_its_bound_and_forgets_only_its_own() -> None:
    g = HostGate(BreakerPolicy(failures=1, open_s=30.0), max_entries=100, max_entries_per_tenant=3)
    open_breaker(g, "b", H)
    for i in range(10):
        g.check("a", f"https://h{i}", 0.0)
    assert len(g) == 4  # a's three newest, and b's
    assert g.check("b", H, 0.0) == Hold(HoldReason.OPEN, 30.0, 0.0)


def test_a_tenants_closed_entries_are_forgotten_before_its_open_ones() -> None:
    g = HostGate(BreakerPolicy(failures=1, open_s=30.0), max_entries=3)
    open_breaker(g, "a", "https://h0")  # the least recently used, but open
    g.check("a", "https://h1", 0.0)
    g.check("a", "https://h2", 0.0)
    g.check("a", "https://h3", 0.0)  # h1 (closed) goes, not h0
    assert g.check("a", "https://h0", 0.0) == Hold(HoldReason.OPEN, 30.0, 0.0)
    for i in range(4, 8):
        g.check("a", f"https://h{i}", 0.0)
    assert g.check("a", "https://h0", 0.0) == Hold(HoldReason.OPEN, 30.0, 0.0)
    for i in range(8, 11):  # every entry open: the least recently used open one goes
        open_breaker(g, "a", f"https://h{i}")
    assert len(g) == 3 and g.explain("a", "https://h0", 0.0).breaker.state is BreakerState.CLOSED


def test_new_limits_reach_existing_entries() -> None:
    g = gate(rps=100.0)
    g.check("a", H, 0.0)
    g.set_limits(parse_limits({"a": {"rps": 1}}, default_rps=100.0))
    assert g.check("a", H, 0.0) == Pass()  # one token kept of the old burst
    assert isinstance(g.check("a", H, 0.0), Hold)
    assert g.explain("a", H, 0.0).rps == 1.0
    assert g.explain("z", H, 0.0).rps == 100.0  # unknown: shown as it would start


def test_the_snapshot_lists_at_most_limit_troubled_hosts_open_first() -> None:
    g = gate()
    for i in range(5):
        host = f"https://h{i}"
        for _ in range(2):
            g.record("a", host, BAD, 0.0, probe=False)
    g.check("a", "https://h4", 1.0)  # h4 half-open: its probe is out
    counts, troubled = g.snapshot(1.0, limit=3)
    assert counts == {
        BreakerState.CLOSED: 0,
        BreakerState.OPEN: 4,
        BreakerState.HALF_OPEN: 1,
    }
    assert len(troubled) == 3 and all(v.breaker.state is BreakerState.OPEN for v in troubled)


def test_endpoint_host_is_the_requests_host() -> None:
    assert endpoint_host("https://API.example.com:8443/hook?x=1") == "https://API.example.com:8443"


# ---- the retry age under an open breaker -------------------------------------------------


def test_a_held_message_is_failing_for_its_retry_age() -> None:
    policy = RetryPolicy(max_retry_age_s=10.0)
    decision, state = held_by_host(
        policy, AttemptState(), now_s=100.0, wait_s=4.0, reason="circuit breaker open"
    )
    assert isinstance(decision, Retry) and decision.after_s == 4.0
    assert state.first_failure_s == 100.0 and state.attempts == 0 and state.failures == 0
    decision, state = held_by_host(policy, state, now_s=105.0, wait_s=4.0, reason="open")
    assert isinstance(decision, Retry) and state.first_failure_s == 100.0
    decision, _ = held_by_host(policy, state, now_s=107.0, wait_s=4.0, reason="open")
    assert isinstance(decision, DeadLetter) and "open" in decision.reason


def test_an_earlier_failure_starts_the_clock_and_age_zero_never_ends_it() -> None:
    failed = AttemptState(attempts=1, failures=1, first_failure_s=50.0, last_status=503)
    decision, _ = held_by_host(
        RetryPolicy(max_retry_age_s=10.0), failed, now_s=58.0, wait_s=4.0, reason="open"
    )
    assert isinstance(decision, DeadLetter) and decision.status == 503
    decision, _ = held_by_host(
        RetryPolicy(max_retry_age_s=0.0), failed, now_s=1e9, wait_s=60.0, reason="open"
    )
    assert isinstance(decision, Retry)


# ---- the limits file ---------------------------------------------------------------------


def write(path: Path, doc: object) -> None:
    path.write_text(json.dumps(doc))
    st = path.stat()
    # A later version must look changed even within the file system's time resolution.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_the_limits_file_is_read_at_start_and_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "limits.json"
    write(path, {"a": {"rps": 1}})
    g = gate(rps=50.0)
    lf = LimitsFile(str(path), 50.0, g)
    lf.load()
    assert g.limits.rps_for("a", H) == 1.0
    assert not lf.poll(0.0)  # unchanged
    write(path, {"a": {"rps": 2}})
    assert not lf.poll(CHECK_EVERY_S / 2)  # not looked at again so soon
    assert lf.poll(10.0) and g.limits.rps_for("a", H) == 2.0
    path.write_text("{not json")
    os.utime(path, ns=(0, 5_000_000_000))
    assert not lf.poll(20.0) and g.limits.rps_for("a", H) == 2.0  # the last good stays
    path.unlink()
    assert lf.poll(30.0) and g.limits.rps_for("a", H) == 50.0  # removed: the default


def test_a_missing_or_bad_limits_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="HOST_LIMITS_FILE"):
        LimitsFile(str(tmp_path / "none.json"), 0.0, gate()).load()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": {"rps": -3}}))
    with pytest.raises(ConfigError, match="tenant 'a'"):
        LimitsFile(str(bad), 0.0, gate()).load()


def test_describe_says_the_state_the_next_probe_and_the_rate() -> None:
    g = HostGate(BreakerPolicy(failures=2, open_s=4.0), HostLimits(default_rps=2.5))
    assert describe(g.explain("a", H, 0.0)) == (f"{H}: circuit breaker closed; 2.5 requests/s")
    g.record("a", H, BAD, 0.0, probe=False, detail="HTTP 503")
    assert "closed (consecutive failures: 1, last: HTTP 503)" in describe(g.explain("a", H, 0.0))
    g.record("a", H, BAD, 1.0, probe=False, detail="connect refused")
    text = describe(g.explain("a", H, 2.0))
    assert "open (times opened: 1, last: connect refused)" in text
    assert "next probe in 3.0s" in text
    g.check("a", H, 5.0)
    assert "half-open: one probe out" in describe(g.explain("a", H, 5.0))


def test_metrics_show_the_breakers_with_a_bounded_label_set() -> None:
    metrics = ProxyMetrics()
    g = HostGate(BreakerPolicy(failures=1))
    metrics.watch_hosts(g)
    for i in range(MAX_BREAKER_SERIES + 10):
        g.record("a", f"https://h{i}", BAD, 0.0, probe=False)
    g.record("b", H, OK, 0.0, probe=False)
    reg = metrics.registry
    assert reg.get_sample_value("tocsin_proxy_breakers", {"state": "open"}) == 60
    assert reg.get_sample_value("tocsin_proxy_breakers", {"state": "closed"}) == 1
    series = [s for m in reg.collect() if m.name == "tocsin_proxy_breaker_open" for s in m.samples]
    assert len(series) == MAX_BREAKER_SERIES
    assert all(s.labels["tenant"] == "a" and s.labels["state"] == "open" for s in series)

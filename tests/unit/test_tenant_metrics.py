"""Per-tenant counts of what did not fire or deliver (missed, skipped, deferred by quota,
dead-lettered) with a bounded tenant label, and what a delivery outcome leaves in a
schedule's history about its attempts."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from base.errors import CommandRejected
from proxy.deadletter import delivery_outcome, failure_summary
from proxy.retry import AttemptState, HttpResult, RetryPolicy, decide
from streams import metrics
from streams.deliveries import delivery_detail, record_outcome
from streams.metrics import MissCause, SkipReason, TenantLabels
from streams.timeline import Entry
from tests.fakes import FakeStore
from tests.unit.test_proxy_writer import fire
from tests.unit.test_streams_deliveries import Tenants
from tests.unit.test_streams_ticker import make, row, settle
from topics.fields import check_tenant
from topics.models import DeliveryOutcome


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_tenant_labels_name_the_first_tenants_and_pool_the_rest() -> None:
    labels = TenantLabels(2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d", "b")] == [
        "a",
        "b",
        metrics.OTHER_TENANTS,
        "a",
        metrics.OTHER_TENANTS,
        "b",
    ]
    assert TenantLabels(0)("a") == metrics.OTHER_TENANTS


def test_the_pool_label_is_no_tenant_name() -> None:
    with pytest.raises(CommandRejected):
        check_tenant(metrics.OTHER_TENANTS)
    # A tenant named like the old pool label keeps a series of its own.
    labels = TenantLabels(1)
    assert labels("_other") == "_other"
    assert labels("b") == metrics.OTHER_TENANTS != labels("_other")


async def test_a_trigger_beyond_its_tolerance_counts_as_missed_for_its_tenant() -> None:
    name = "tocsin_triggers_missed_by_tenant_total"
    before = sample(name, tenant="t", cause="tolerance")
    now = [1_000_000]
    ticker, store, _ = make(now)
    r = row("late", now[0] - 61_000, tolerance_s=60)
    ticker._dispatch(Entry(r.due_ms, r.tenant, r.schedule_id, r.version, r), now[0])
    await settle()
    assert store.missed == ["late"]
    assert sample(name, tenant="t", cause="tolerance") == before + 1


def test_skips_and_quota_deferrals_count_per_tenant() -> None:
    skipped = "tocsin_runs_skipped_by_tenant_total"
    before = sample(skipped, tenant="sk", reason="misfire")
    metrics.count_skipped("sk", SkipReason.MISFIRE, 3)
    metrics.count_skipped("sk", SkipReason.MISFIRE, 0)
    assert sample(skipped, tenant="sk", reason="misfire") == before + 3
    metrics.count_skipped("sk", SkipReason.PAUSED)
    assert sample(skipped, tenant="sk", reason="paused") >= 1
    throttled = "tocsin_fires_throttled_total"
    before = sample(throttled, tenant="q")
    metrics.count_throttled("q")
    assert sample(throttled, tenant="q") == before + 1
    missed = "tocsin_triggers_missed_by_tenant_total"
    before = sample(missed, tenant="q", cause="unemittable")
    metrics.count_missed("q", MissCause.UNEMITTABLE)
    assert sample(missed, tenant="q", cause="unemittable") == before + 1


def test_a_recorded_dead_letter_counts_for_its_tenant_and_keeps_its_attempts() -> None:
    name = "tocsin_dead_lettered_by_tenant_total"
    before = sample(name, tenant="dl")
    store = FakeStore()
    outcome = {
        "outcome": "dead_lettered",
        "tenant": "dl",
        "schedule_id": "s1",
        "dead_lettered_ms": 5,
        "attempts": 4,
        "status_code": 600,
        "reason": "HTTP 600: no (6xx retried 3 times)",
        "failures": 4,
        "last_failure": "HTTP 600: no",
        "failed_for_ms": 2500,
    }
    assert asyncio.run(record_outcome(store, Tenants(), outcome))
    assert sample(name, tenant="dl") == before + 1
    assert store.events[0]["detail"] == (
        "HTTP 600: no (6xx retried 3 times); 4 attempt(s); 4 failed over 2.5 s"
    )
    delivered = {**outcome, "outcome": "delivered", "tenant": "ok"}
    assert asyncio.run(record_outcome(store, Tenants(), delivered))
    assert sample(name, tenant="ok") == 0


def test_the_history_of_a_delivery_says_its_status_attempt_and_earlier_failures() -> None:
    first_try: dict[str, Any] = {"outcome": "delivered", "status_code": 204, "attempts": 1}
    assert delivery_detail(first_try) == "status 204 on attempt 1"
    assert delivery_detail({**first_try, "failures": 0}) == "status 204 on attempt 1"
    retried = {
        **first_try,
        "attempts": 3,
        "failures": 2,
        "last_failure": "HTTP 503: busy",
        "failed_for_ms": 400,
    }
    assert delivery_detail(retried) == (
        "status 204 on attempt 3; 2 failed over 0.4 s, the last: HTTP 503: busy"
    )
    assert delivery_detail({"outcome": "dead_lettered"}) == "dead-lettered"


def test_the_proxy_outcome_reports_the_failed_attempts() -> None:
    policy = RetryPolicy(max_retry_age_s=60.0, base_delay_s=0.5, max_delay_s=0.5)
    state = AttemptState()
    for i, result in enumerate(
        [
            HttpResult(status=503, body_snippet="busy"),
            HttpResult(status=500),
            HttpResult(status=200),
        ]
    ):
        _, state = decide(policy, state, result, now_s=float(i), rand=lambda: 1.0)
    assert failure_summary(state) == {
        "failures": 2,
        "last_failure": "HTTP 500",
        "failed_for_ms": 1000,
    }
    assert failure_summary(AttemptState(attempts=1)) == {
        "failures": 0,
        "last_failure": None,
        "failed_for_ms": None,
    }
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    env.attempt_state = state
    rec = delivery_outcome(
        env, outcome=DeliveryOutcome.DELIVERED, status=200, reason=None, latency_ms=3, now_ms=1
    )
    assert rec is not None
    doc = orjson.loads(rec[1])
    assert (doc["failures"], doc["last_failure"], doc["failed_for_ms"]) == (2, "HTTP 500", 1000)

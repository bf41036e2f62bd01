"""Prometheus metrics of one proxy instance.

Each ``ProxyMetrics`` owns its registry, so two proxies in one test process never collide.
Counters are bumped where things happen; gauges are refreshed from the shared state once a
second by the committer thread (cheaper than updating them per message). Never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.hostlimits import HostGate

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.pending = Gauge(
            "tocsin_proxy_pending_messages",
            "Messages read and waiting to be handed to a writer",
            registry=r,
        )
        self.pending_bytes = Gauge(
            "tocsin_proxy_held_bytes",
            "Bytes held (waiting + in flight) against the bound",
            registry=r,
        )
        self.in_flight = Gauge(
            "tocsin_proxy_in_flight",
            "Messages handed out and not finished (incl. retry backoff)",
            registry=r,
        )
        self.paused = Gauge(
            "tocsin_proxy_paused_partitions", "Partitions paused by backpressure", registry=r
        )
        self.oldest_in_flight = Gauge(
            "tocsin_proxy_oldest_in_flight_seconds",
            "Age of the oldest unfinished message since it was read",
            registry=r,
        )
        self.commit_lag = Gauge(
            "tocsin_proxy_commit_lag_messages",
            "Messages read but not covered by a committed offset",
            ["topic", "partition"],
            registry=r,
        )
        self.deliveries = Counter(
            "tocsin_proxy_deliveries",
            "Final outcomes by outcome and last status class",
            ["outcome", "status_class"],
            registry=r,
        )
        self.attempts = Counter(
            "tocsin_proxy_attempts",
            "Delivery attempts by status class",
            ["status_class"],
            registry=r,
        )
        self.retries = Counter(
            "tocsin_proxy_retries",
            "Retries scheduled, by status class",
            ["status_class"],
            registry=r,
        )
        self.dead_letters = Counter(
            "tocsin_proxy_dead_letters",
            "Messages dead-lettered, by kind of reason",
            ["kind"],
            registry=r,
        )
        self.latency = Histogram(
            "tocsin_proxy_delivery_seconds",
            "From read to final outcome",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "tocsin_proxy_request_seconds",
            "One HTTP attempt, request to response",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.parking = Gauge(
            "tocsin_proxy_parking",
            "1 if failing messages are parked in the retry topic, 0 if it is "
            "missing and they stay in memory",
            registry=r,
        )
        self.parked = Counter(
            "tocsin_proxy_parked",
            "Messages parked in the retry topic, by reason",
            ["reason"],
            registry=r,
        )
        self.lines_evicted = Counter(
            "tocsin_proxy_park_lines_evicted",
            "Keys whose parked-message line was forgotten (its bound, or its records sit on "
            "a retry partition another proxy owns): their order across parking is lost",
            registry=r,
        )
        self.records_refused = Counter(
            "tocsin_proxy_records_refused",
            "Dead letters/outcomes Kafka refused for good even in their smallest form, dropped",
            ["topic"],
            registry=r,
        )
        self.signatures = Counter(
            "tocsin_proxy_signatures",
            "HTTP callback attempts by signature: signed, unsigned (no secret, optional) or "
            "refused (no secret, required: dead-lettered)",
            ["result"],
            registry=r,
        )
        self.signing_tenants = Gauge(
            "tocsin_proxy_signing_tenants",
            "Tenants with a delivery secret in the secrets file in use",
            registry=r,
        )
        self.signing_file_stale = Gauge(
            "tocsin_proxy_signing_file_stale",
            "1 while the secrets file's newest version could not be used (the previous "
            "secrets still sign)",
            registry=r,
        )
        self.host_held = Counter(
            "tocsin_proxy_host_held",
            "Messages held back before an attempt by their host's rate limit (rate) or "
            "circuit breaker (open)",
            ["reason"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "tocsin_proxy_breaker_transitions",
            "Circuit breaker state changes of (tenant, host) pairs, by the state entered",
            ["state"],
            registry=r,
        )
        self.commits = Counter("tocsin_proxy_commits", "Offset commits", ["result"], registry=r)
        self.rebalances = Counter(
            "tocsin_proxy_rebalances", "Partitions assigned or revoked", ["event"], registry=r
        )

        self._attempt_children: dict[str, Counter] = {}
        self._delivery_children: dict[tuple[str, str], Counter] = {}

    def attempt(self, status_class: str) -> None:
        """Count one attempt (children cached: ``labels()`` takes a lock and builds a key)."""
        child = self._attempt_children.get(status_class)
        if child is None:
            child = self._attempt_children[status_class] = self.attempts.labels(status_class)
        child.inc()

    def delivery(self, outcome: str, status_class: str) -> None:
        """Count one final outcome (children cached, as in ``attempt``; both labels come
        from small fixed sets)."""
        key = (outcome, status_class)
        child = self._delivery_children.get(key)
        if child is None:
            child = self._delivery_children[key] = self.deliveries.labels(outcome, status_class)
        child.inc()

    def watch_hosts(self, gate: HostGate) -> None:
        """Publish ``gate``'s breakers at each scrape: how many (tenant, host) pairs are in
        each state, and which are not closed (at most ``MAX_BREAKER_SERIES`` of them, so the
        label set stays bounded however many hosts fail)."""
        self.registry.register(_BreakerCollector(gate))

    def serve(self, port: int) -> None:
        """Expose /metrics on ``port`` (0 disables)."""
        if port:
            start_http_server(port, registry=self.registry)


# Series of ``tocsin_proxy_breaker_open`` at most: one per (tenant, host) not closed.
MAX_BREAKER_SERIES = 50


class _BreakerCollector(Collector):
    def __init__(self, gate: HostGate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        counts, troubled = self._gate.snapshot(time.monotonic(), limit=MAX_BREAKER_SERIES)
        states = GaugeMetricFamily(
            "tocsin_proxy_breakers",
            "(tenant, host) pairs known to the proxy, by circuit breaker state",
            labels=["state"],
        )
        for state, n in counts.items():
            states.add_metric([state.value], n)
        yield states
        hosts = GaugeMetricFamily(
            "tocsin_proxy_breaker_open",
            f"1 per (tenant, host) whose circuit breaker is open or half-open (at most "
            f"{MAX_BREAKER_SERIES}, open ones first)",
            labels=["tenant", "host", "state"],
        )
        for view in troubled:
            hosts.add_metric([view.tenant or "", view.host, view.breaker.state.value], 1)
        yield hosts

"""The scheduler's Prometheus metrics (names follow Prometheus conventions)."""

from __future__ import annotations

import asyncio
import gc
import time
from enum import StrEnum

from prometheus_client import Counter, Gauge, Histogram

COMMANDS = Counter(
    "tocsin_commands_total",
    "Commands processed, by type and outcome code",
    ["command", "status", "code"],
)
# Creates the API answered 201 at Kafka's acknowledgement (topics.admission): "honoured"
# (stored without deciding again), "unverified" (a stamp that did not verify: decided like
# any other command) and "refused" (an admitted create the worker could not store: an
# alert, since its tenant was told it would fire).
ADMISSIONS = Counter(
    "tocsin_admissions_total", "Admission-stamped commands, by what the worker did", ["outcome"]
)
TRIGGERS_EMITTED = Counter(
    "tocsin_triggers_emitted_total", "Triggers acknowledged on the fire topic", ["partition"]
)
TRIGGERS_MISSED = Counter(
    "tocsin_triggers_missed_total", "Triggers beyond their misfire tolerance", ["partition"]
)
TRIGGERS_UNEMITTABLE = Counter(
    "tocsin_triggers_unemittable_total",
    "Triggers the broker refuses for good (recorded as missed with the reason)",
    ["partition"],
)
FIRE_LATENESS = Histogram(
    "tocsin_fire_lateness_seconds",
    "Emit time minus nominal due time",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600),
)
CATCHUP_BACKLOG = Gauge(
    "tocsin_catchup_backlog_minutes",
    "Minute buckets still to read before a partition is live",
    ["partition"],
)
BUCKET_LOADS = Counter("tocsin_bucket_loads_total", "(partition, minute) buckets loaded")
BUCKET_QUERIES = Counter(
    "tocsin_bucket_queries_total", "CQL bucket queries (one per shard per load, all pages)"
)
BUCKET_ROWS = Counter("tocsin_bucket_rows_total", "Bucket rows read")
BUCKET_READ_SECONDS = Histogram(
    "tocsin_bucket_read_seconds",
    "Latency of one bucket query (all pages)",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TIMELINE_SIZE = Gauge("tocsin_timeline_entries", "Loaded triggers waiting to fire", ["partition"])
INFLIGHT = Gauge("tocsin_triggers_inflight", "Emitted triggers not yet checkpointed", ["partition"])
CHECKPOINT_LAG = Gauge(
    "tocsin_checkpoint_lag_seconds", "Now minus the fire checkpoint", ["partition"]
)
CONSUMER_LAG = Gauge("tocsin_consumer_lag_messages", "Commands not yet processed", ["partition"])
CONSUMER_FETCH_MAX_WAIT = Gauge(
    "tocsin_consumer_fetch_max_wait_ms",
    "The fetch wait the worker's Kafka consumer really uses (read back from it)",
)
CONSUMER_FETCH_ROUNDS = Counter(
    "tocsin_consumer_fetch_rounds_total",
    "Fetch requests the worker's Kafka consumer sent, by mode (streams.fetch_wait): busy "
    "(records flowing: batching wait and minimum) or idle (held until the first record)",
    ["mode"],
)
CONSUMER_HANDOVERS = Counter(
    "tocsin_consumer_handovers_total",
    "Fetched records handed to the streams, by path (streams.drain): inline, or waited "
    "(the delivery suspended: buffer full or flow control)",
    ["path"],
)
OWNED_PARTITIONS = Gauge("tocsin_owned_partitions", "Commands partitions this worker fires")
# The worker's group coordinator watch (streams.coordinator_watch). Each counts an action
# that should be rare outside a broker's failure: a steady rate means something is wrong
# with the cluster (or the watch), which the log alone shows only line by line.
COORDINATOR_SWITCHES = Counter(
    "tocsin_coordinator_watch_switches_total",
    "Group coordinator moves made by the watch (old node left, same member and generation)",
)
COORDINATOR_GONE_CLOSES = Counter(
    "tocsin_coordinator_watch_gone_closes_total",
    "Brokers missing from the metadata whose connections the watch closed",
)
COORDINATOR_METADATA_READS = Counter(
    "tocsin_coordinator_watch_metadata_reads_total",
    "Metadata re-read by the watch from a live broker, by reason: switch (before leaving "
    "the old coordinator) or stale (the client's own re-read stuck)",
    ["reason"],
)
# Label values: streams.coordinator_watch.TickFailure (a fixed set, whatever is raised).
COORDINATOR_WATCH_FAILURES = Counter(
    "tocsin_coordinator_watch_failed_ticks_total",
    "Ticks of the coordinator watch that could not do their work, by error class",
    ["error"],
)
# A traceparent that is not W3C-valid is dropped (tracing never fails a schedule), and
# counted here by where it came in: a command's Kafka header, an API request's header.
TRACEPARENT_DROPPED = Counter(
    "tocsin_traceparent_dropped_total",
    "Invalid W3C traceparent values dropped at the edge, by edge",
    ["edge"],
)
DELIVERIES = Counter("tocsin_deliveries_recorded_total", "Delivery outcomes recorded", ["outcome"])
FIRES_THROTTLED = Counter(
    "tocsin_fires_throttled_total",
    "Triggers whose emission was deferred by their tenant's fire quota (fires/min)",
    ["tenant"],
)
FIRES_DEFERRED = Gauge(
    "tocsin_fires_deferred",
    "Due triggers waiting in the fair queue (their tenant's fire quota, or their turn)",
    ["partition"],
)


class TenantLabels:
    """The label value a tenant's series take: its own name for the first ``limit`` tenants
    a process counts, ``OTHER_TENANTS`` for every tenant after them. Tenant names come from
    outside, so one series each would grow the registry (and every scrape) without bound;
    operators see the busiest tenants, which are the first to be counted, by name."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("the tenant label limit must not be negative")
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


# Series per tenant label of each per-tenant metric; beyond it tenants share one series.
MAX_TENANT_LABELS = 200
# Parentheses are outside the tenant-name alphabet (topics.fields.check_tenant: A-Z a-z 0-9
# . _ -), so no tenant's own series can be mistaken for the pool.
OTHER_TENANTS = "(other)"
tenant_label = TenantLabels(MAX_TENANT_LABELS)


class SkipReason(StrEnum):
    """Why a run was skipped: its recurring schedule's misfire policy, or a pause."""

    MISFIRE = "misfire"
    PAUSED = "paused"


class MissCause(StrEnum):
    """Why a trigger was recorded as missed."""

    TOLERANCE = "tolerance"  # reached later than its misfire tolerance
    UNEMITTABLE = "unemittable"  # the broker refuses the record for good


RUNS_SKIPPED_BY_TENANT = Counter(
    "tocsin_runs_skipped_by_tenant_total",
    "Runs not fired: dropped by the misfire policy of a recurring schedule, or paused",
    ["tenant", "reason"],
)
TRIGGERS_MISSED_BY_TENANT = Counter(
    "tocsin_triggers_missed_by_tenant_total",
    "Triggers recorded as missed, by cause",
    ["tenant", "cause"],
)
DEAD_LETTERED_BY_TENANT = Counter(
    "tocsin_dead_lettered_by_tenant_total",
    "Triggers the proxy dead-lettered, as recorded from the deliveries topic",
    ["tenant"],
)


def count_skipped(tenant: str, reason: SkipReason, runs: int = 1) -> None:
    if runs > 0:
        RUNS_SKIPPED_BY_TENANT.labels(tenant_label(tenant), reason).inc(runs)


def count_missed(tenant: str, cause: MissCause) -> None:
    TRIGGERS_MISSED_BY_TENANT.labels(tenant_label(tenant), cause).inc()


def count_dead_lettered(tenant: str) -> None:
    DEAD_LETTERED_BY_TENANT.labels(tenant_label(tenant)).inc()


def count_throttled(tenant: str) -> None:
    """A trigger deferred by its tenant's fire quota (``FIRES_THROTTLED``)."""
    FIRES_THROTTLED.labels(tenant_label(tenant)).inc()


# Where a worker's time goes when triggers are late although Cassandra and Kafka answer:
# every trigger of the process is emitted from one event loop, so a long callback, a GC
# pause or CPU starvation delays them all by the same amount. Sampled once a second: each
# sample is a wake-up of an otherwise idle worker (about 0.2 ms of CPU), and a stall of a
# second or more is seen whenever it comes; a shorter one is seen when it covers a sample.
LOOP_LAG = Histogram(
    "tocsin_event_loop_lag_seconds",
    "How much later than asked the event loop woke a 1 s sleep",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
GC_PAUSE = Histogram(
    "tocsin_gc_pause_seconds",
    "Python garbage-collection pauses, by generation",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)


async def watch_loop_lag(interval_s: float = 1.0) -> None:
    """Observe ``LOOP_LAG`` forever (run as a task of the loop to watch)."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        LOOP_LAG.observe(max(0.0, loop.time() - asked))


_gc_started: list[float] = []


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        GC_PAUSE.labels(str(info.get("generation", -1))).observe(
            time.perf_counter() - _gc_started[0]
        )


def observe_gc_pauses() -> None:
    """Record every collection's pause in ``GC_PAUSE`` (idempotent)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


# Collector thresholds for the worker (gen0 allocations, gen1 and gen2 collection counts).
# With CPython's (700, 10, 10), two workers firing 100,000 recurring schedules a minute ran
# 576 full collections in 20 minutes, 202 s of pauses, 108 of them over 0.5 s: the worker
# holds a few hundred thousand loaded triggers, and each full collection walks them all
# while no trigger of the process is emitted (bench-cron; tocsin_gc_pause_seconds). Fewer,
# larger young collections made full ones 70x rarer there (576 -> 8), and 318 s of pauses
# in all 121 s; objects are still collected.
WORKER_GC_THRESHOLDS = (10_000, 20, 20)


def tune_gc_for_worker() -> None:
    """Freeze what start-up allocated (modules, clients: never garbage, walked by every full
    collection otherwise) and set ``WORKER_GC_THRESHOLDS``. Call once, after start-up."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*WORKER_GC_THRESHOLDS)

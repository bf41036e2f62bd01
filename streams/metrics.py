"""The scheduler's Prometheus metrics (names follow Prometheus conventions)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

COMMANDS = Counter(
    "tocsin_commands_total",
    "Commands processed, by type and outcome code",
    ["command", "status", "code"],
)
TRIGGERS_EMITTED = Counter(
    "tocsin_triggers_emitted_total", "Triggers acknowledged on the fire topic", ["partition"]
)
TRIGGERS_MISSED = Counter(
    "tocsin_triggers_missed_total", "Triggers beyond their misfire tolerance", ["partition"]
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
OWNED_PARTITIONS = Gauge("tocsin_owned_partitions", "Commands partitions this worker fires")
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

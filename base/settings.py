"""Settings as keyword-only dataclasses, read from the environment in this one place.

Every variable is ``TOCSIN_*``; units are in the names. ``Settings.from_env()`` is the only
reader of ``os.environ`` in the code base, so a test can build settings from a plain dict.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from base.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent


def _get(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(f"TOCSIN_{name}", default)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = _get(env, name, str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"TOCSIN_{name} must be an integer, got {raw!r}") from exc


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = _get(env, name, str(default))
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"TOCSIN_{name} must be a number, got {raw!r}") from exc


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    return _get(env, name, "true" if default else "false").lower() in ("1", "true", "yes")


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = _get(env, name, default).strip().lower()
    if raw not in allowed:
        raise ConfigError(f"TOCSIN_{name} must be one of {', '.join(allowed)}, got {raw!r}")
    return raw


def _port(env: Mapping[str, str], name: str, default: int, *, zero_is_off: bool = False) -> int:
    """A listening port: TOCSIN_<name> if set, else the default moved by TOCSIN_PORT_OFFSET,
    so a second stack on one machine moves every port with one variable. ``zero_is_off``: an
    explicit 0 is accepted and means the server is not started."""
    if f"TOCSIN_{name}" in env:
        port = _int(env, name, default)
        if port == 0 and zero_is_off:
            return 0
    else:
        port = default + _int(env, "PORT_OFFSET", 0)
    if not 0 < port < 65536:
        raise ConfigError(
            f"TOCSIN_{name} (or the default {default} + TOCSIN_PORT_OFFSET) must be a port "
            f"number, got {port}"
        )
    return port


def _opt(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(f"TOCSIN_{name}")
    return value if value else None


# A confluent-kafka client configuration: librdkafka property names to strings, numbers,
# booleans and, for "logger", a logging.Logger (which the library's own stubs do not list).
KafkaConfig = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    bootstrap_servers: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    # How clients follow a broker failover. A dead or hung leader's partitions move only
    # once the controller fences it (broker.session.timeout.ms, docs/operations.md); these
    # bound how long a client takes to notice after that.
    # Longest pause between reconnects to a broker that went away (librdkafka's
    # reconnect.backoff.max.ms, stock 10 s): each failed reconnect also re-reads metadata,
    # so with the stock backoff a client saw a dead leader's successor up to 10 s late.
    reconnect_backoff_max_ms: int = 1000
    # How often clients re-read the cluster's metadata unasked (librdkafka's
    # topic.metadata.refresh.interval.ms and aiokafka's metadata_max_age_ms, stock 5 min).
    # A hung broker answers no request, so no error prompts a re-read: only this or a
    # request timeout tells a client that its partitions have a new leader, and up to one
    # period adds to the fencing time before a hung leader's partitions are written again.
    # One small request per client per period.
    metadata_refresh_ms: int = 1000
    # How long a request to a broker may stay unanswered before the connection is given up
    # and its requests re-sent elsewhere (librdkafka's socket.timeout.ms, stock 60 s). An
    # idempotent producer sends nothing to a partition's new leader while requests to its
    # old leader are in flight, so this bounds a produce stalled on a hung broker. A
    # request legitimately slower than this is re-sent (without duplicates: idempotent).
    socket_timeout_ms: int = 10000
    # The same timeout for the idempotent producers of the worker and the API
    # (streams.emitter), shorter: it is what bounds a produce in flight to a hung leader.
    # librdkafka fails such a request at once only when its metadata stops listing the
    # broker, and it asks the broker it used last, which is the hung one when that broker
    # led everything the producer wrote; a leader change alone does not release it. A
    # request older than this is given up, the connection closed and the batch re-sent
    # with the same sequence numbers (the broker keeps one copy). Above the fencing
    # time, so writes to healthy leaders that wait on a hung follower's fencing are not
    # re-sent; below it, they are re-sent once per period, with a reconnect.
    producer_socket_timeout_ms: int = 4000

    def librdkafka(self) -> KafkaConfig:
        """Client configuration for confluent-kafka (librdkafka property names)."""
        conf: KafkaConfig = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
            # librdkafka leaves Nagle's algorithm on. No delay was measured from it here
            # (unlike cassandra-driver's, base/cassandra.py); off so that a request queued
            # behind an unacknowledged one never waits for the broker's delayed ACK.
            "socket.nagle.disable": True,
            # librdkafka prints to stderr itself unless given a logger: through ours, its
            # lines are structured and filtered like every other.
            "logger": logging.getLogger("tocsin.librdkafka"),
            "reconnect.backoff.max.ms": self.reconnect_backoff_max_ms,
            "topic.metadata.refresh.interval.ms": self.metadata_refresh_ms,
            "socket.timeout.ms": self.socket_timeout_ms,
        }
        optional = {
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        return conf


@dataclass(frozen=True, kw_only=True)
class CassandraSettings:
    contact_points: tuple[str, ...] = ("127.0.0.1",)
    port: int = 9042
    keyspace: str = "tocsin"
    username: str | None = None
    password: str | None = None
    ssl_ca_location: str | None = None
    local_dc: str | None = None
    # "SimpleStrategy:1" locally; "NetworkTopologyStrategy:dc1=3,dc2=3" in production.
    replication: str = "SimpleStrategy:1"
    request_timeout_s: float = 10.0
    # A hung node (its process stopped, its sockets open) answers nothing and raises
    # nothing, so the driver would keep choosing it as coordinator, each request then
    # waiting request_timeout_s. An idempotent statement still unanswered after
    # speculative_delay_ms is sent to the next host as well, up to speculative_executions
    # more times (0: never); the first answer wins. Statements that are not idempotent
    # (lightweight transactions) are never sent twice. Each extra execution is one more
    # request only when a node is that slow.
    speculative_delay_ms: int = 250
    speculative_executions: int = 2
    # A connection that received nothing for heartbeat_interval_s is sent a heartbeat; one
    # unanswered for heartbeat_timeout_s marks the node down, so that nothing, lightweight
    # transactions included, is sent to a hung node after a few seconds (the driver's
    # stock 30 s + 30 s). A node paused longer than that (a long GC pause) is marked down
    # too and reconnected to once it answers; two of three replicas still serve every
    # LOCAL_QUORUM request meanwhile.
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 3.0
    # Native protocol version (0: negotiate the highest both sides speak). v4, not
    # Cassandra 5's v5: v5 wraps every frame in checksummed segments whose CRC24 the
    # driver computes in pure Python, which cost 8-20 % more client CPU per request here
    # (make bench-cassandra: insert 219 vs 260 us, 16-row batch 440 vs 535 us), and the
    # client's CPU is what bounds the worker. TCP (and TLS) still check the bytes.
    protocol_version: int = 4

    def replication_cql(self) -> str:
        """The keyspace replication map as CQL, parsed from ``replication``."""
        strategy, _, spec = self.replication.partition(":")
        if strategy == "SimpleStrategy":
            factor = int(spec or "1")
            return f"{{'class': 'SimpleStrategy', 'replication_factor': {factor}}}"
        if strategy == "NetworkTopologyStrategy":
            parts = [p.split("=") for p in spec.split(",") if p]
            if not parts or any(len(p) != 2 or not p[1].isdigit() for p in parts):
                raise ConfigError(
                    "TOCSIN_CASSANDRA_REPLICATION must look like "
                    f"NetworkTopologyStrategy:dc1=3,dc2=3, got {self.replication!r}"
                )
            dcs = ", ".join(f"'{dc}': {rf}" for dc, rf in parts)
            return f"{{'class': 'NetworkTopologyStrategy', {dcs}}}"
        raise ConfigError(f"unknown replication strategy {strategy!r}")


@dataclass(frozen=True, kw_only=True)
class TopicSettings:
    prefix: str = "tocsin."
    command_partitions: int = 8
    fire_partitions: int = 8
    replication_factor: int = 1
    # min.insync.replicas of new topics: how many replicas an acknowledged (acks=all) write
    # is on. 0: 2 when replication_factor is 3 or more, else the broker's default.
    min_insync_replicas: int = 0

    def min_insync(self) -> int | None:
        """The topics' min.insync.replicas, or None to leave the broker's default."""
        if self.min_insync_replicas == 0:
            return 2 if self.replication_factor >= 3 else None
        if not 1 <= self.min_insync_replicas <= self.replication_factor:
            raise ConfigError(
                "TOCSIN_TOPIC_MIN_INSYNC_REPLICAS must be between 1 and "
                f"TOCSIN_TOPIC_REPLICATION_FACTOR ({self.replication_factor}), "
                f"got {self.min_insync_replicas}"
            )
        return self.min_insync_replicas


@dataclass(frozen=True, kw_only=True)
class StackSettings:
    """The local single-node stack started by ``tocsin infra``."""

    state_dir: Path = REPO_ROOT / ".state"
    kafka_port: int = 9092
    kafka_controller_port: int = 9093
    cassandra_port: int = 9042
    cassandra_storage_port: int = 7000
    kafka_heap_mib: int = 512
    cassandra_heap_mib: int = 1024
    start_timeout_s: float = 240.0
    java_home: str | None = None
    # Where resolved jars are cached; None means state_dir/jars. A second stack (e.g. the
    # fault-injection suite's, bench/chaos.py) points this at the main stack's cache.
    jars_dir: Path | None = None


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    max_payload_bytes: int = 64 * 1024
    default_misfire_tolerance_s: int = 3600
    bucket_shards: int = 1
    preload_ahead_s: float = 10.0
    fired_retention_s: int = 7 * 24 * 3600
    metrics_port: int = 9464
    metrics_addr: str = "0.0.0.0"
    worker_web_port: int = 6066
    command_batch_size: int = 500
    # How long the command agent gathers commands after finishing a batch (Faust's
    # take_events ``within``): shorter answers sooner, longer makes bigger batches.
    command_batch_wait_ms: int = 20
    # How long the broker may hold the worker's fetch for new data (aiokafka's
    # fetch_max_wait_ms, which Faust fixes at 1500). At 1500 the command agent could settle
    # 1.3-1.5 s behind the commands topic and stay there (bench-api at 500 creates/s: 13 of
    # 27 runs, p99 about 2 s); at 100, none of 8. With consumer_fetch_min_bytes above one
    # record this is also how long a lone command may wait at the broker, so it is short;
    # it costs at most 50 idle fetches/s.
    consumer_fetch_max_wait_ms: int = 20
    # How many bytes the broker gathers before it answers the worker's fetch early (aiokafka's
    # fetch_min_bytes). At 1, every record that arrives ends a fetch, so a busy commands
    # topic reaches the worker in a fetch round per few records, and each round costs the
    # worker (aiokafka, Faust's thread hand-over) and Kafka CPU whatever it carries; above
    # one record, rounds come at most every consumer_fetch_max_wait_ms, fuller.
    consumer_fetch_min_bytes: int = 16384
    # After a fetch that brought no records, the next one asks for one byte and may be held
    # this long (streams.fetch_wait): an idle worker then fetches a few times a second
    # instead of every consumer_fetch_max_wait_ms, and the first record to arrive is
    # answered at once. At or below consumer_fetch_max_wait_ms: every fetch is busy.
    consumer_fetch_idle_wait_ms: int = 500
    # Hand each fetched record to the command stream inline instead of through Faust's
    # per-record four-task race (streams.drain says why and how; false: Faust's own path).
    inline_handover: bool = True
    commit_group_size: int = 16
    # Secure by default: a tenant without a signing key cannot command anything.
    require_signed_commands: bool = True
    # The clock difference tolerated between the signers of one schedule's commands (the
    # API's replicas sign with their own clocks, as do a tenant's producer hosts): a command
    # signed up to this long before the newest one applied still applies, a copy of one
    # applied within it is refused by its kept signature (streams.decisions). 2 s is many
    # times what NTP-synced hosts differ by (milliseconds); a genuine command signed more
    # than this before the newest applied is refused replayed_command. Larger is no safer:
    # only 16 signatures are kept, so a schedule commanded more often within the window
    # refuses a skewed command at or before the oldest kept.
    signed_order_skew_ms: int = 2_000
    # Whether callbacks may target loopback, private, link-local and reserved addresses.
    # False: a create or update whose callback host is such an IP literal is rejected
    # (invalid_url) by the worker and the API, and the proxy (unless
    # TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS says otherwise) refuses them at delivery.
    allow_private_targets: bool = False
    session_timeout_s: float = 10.0
    # The worker's Kafka request timeout (Faust's broker_request_timeout, aiokafka's
    # request_timeout_ms; at least session_timeout_s, which Faust requires). It bounds how
    # long a heartbeat to a hung group coordinator waits (at Faust's default, 90 s, such a
    # worker stays out of touch that long); it also bounds a JoinGroup, which the
    # coordinator holds until every member has revoked its partitions, so it stays above
    # a revocation's length (ticker_release_wait_ms plus a checkpoint write) and above a
    # broker's fencing time (9 s stock), during which an offset commit waits.
    kafka_request_timeout_s: float = 15.0
    # How often the worker asks a broker which node coordinates its group
    # (streams.coordinator_watch; 0: never). aiokafka asks only after a request to the
    # coordinator fails, and a hung coordinator fails nothing until the request timeout
    # above, by when the new coordinator has expired the member; asked every second, the
    # worker moves to the new one within a second of the hung broker's fencing, with its
    # membership. One small request a second per worker.
    coordinator_query_interval_s: float = 1.0
    # How long a ticker whose partition is revoked waits for its in-flight triggers'
    # acknowledgements before the rebalance goes on (streams.ticker.suspend). Every
    # member's rebalance waits for the slowest revocation, and while a lost broker is not
    # fenced no acknowledgement comes, so this is short; a trigger still in flight then
    # stays below the checkpoint and is re-emitted only if another worker takes the
    # partition (a duplicate with the same trigger id).
    ticker_release_wait_ms: int = 1000
    # Recurring schedules (streams.materializer): runs are written this far ahead...
    recurring_horizon_s: float = 600.0
    # ... at most this many per schedule and step; missed runs re-fired after an outage
    # at most this fast per partition; the materialiser looks for work this often.
    recurring_max_runs_per_step: int = 500
    recurring_catchup_per_s: float = 200.0
    recurring_interval_s: float = 1.0
    # Fault injection only (bench/chaos.py): the worker's scheduling clock (tickers, command
    # processor, materialisers) reads the wall clock plus this offset, to model a host
    # whose clock runs fast (>0) or slow (<0). Never set it in production.
    clock_skew_ms: int = 0


@dataclass(frozen=True, kw_only=True)
class ApiSettings:
    """The REST API (``tocsin api``, package ``api``)."""

    host: str = "127.0.0.1"
    port: int = 8480
    # Admin credential for tenant management; None disables the admin endpoints.
    admin_key: str | None = None
    # How long a synchronous request waits for its command result before answering 504.
    request_timeout_s: float = 10.0
    # Largest request body accepted (413 beyond); a maximal command is ~103 KiB.
    max_body_bytes: int = 256 * 1024
    # Tenants and API keys are cached this long, so changes apply without a restart.
    tenant_cache_ttl_s: float = 5.0
    # The IANA zone in which the go-scheduler facade reads cronExpression (go-scheduler
    # uses its server's local zone; set this to what those servers ran in).
    goscheduler_cron_time_zone: str = "UTC"
    # The API's producer linger: commands of concurrent requests share produce requests.
    produce_linger_ms: int = 2
    # Prometheus endpoints (workers' and proxies' /metrics) the console's Health page reads
    # into a rolling hour in memory; empty: the page says that nothing is scraped.
    metrics_urls: tuple[str, ...] = ()
    # How often those endpoints are read (the hour keeps 3600 / this samples per endpoint).
    metrics_scrape_s: float = 15.0


@dataclass(frozen=True, kw_only=True)
class AdmissionSettings:
    """The API-only admission key (topics.admission), held by the APIs and the workers and
    never by a tenant. With a current key the API answers a synchronous one-shot create it
    gave the id to once Kafka has acknowledged it, and the workers store such a create
    without deciding it again; without one, every create waits for its worker's answer."""

    # (key id, secret) the API stamps with and the workers accept; None: no admission.
    current: tuple[str, str] | None = field(default=None, repr=False)
    # (key id, secret) the workers still accept during a rotation.
    previous: tuple[str, str] | None = field(default=None, repr=False)
    # How many API instances share a tenant's create quota: each admits 1/this of it.
    api_instances: int = 1


def _admission_key(name: str, raw: str | None) -> tuple[str, str] | None:
    if raw is None:
        return None
    key_id, sep, secret = raw.partition(":")
    # The stamp is only as strong as its secret; ids name the key in the stamp, which
    # carries [A-Za-z0-9_-] only (topics.admission): any other id would make every stamp
    # malformed at the workers.
    id_ok = key_id.isascii() and all(c.isalnum() or c in "_-" for c in key_id)
    if not sep or not key_id or not id_ok or len(key_id) > 32 or len(secret) < 32:
        raise ConfigError(
            f"TOCSIN_{name} must be <key id>:<secret>, an id of 1-32 characters of "
            "A-Z a-z 0-9 _ - and a secret of at least 32"
        )
    return key_id, secret


@dataclass(frozen=True, kw_only=True)
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    cassandra: CassandraSettings = field(default_factory=CassandraSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)
    stack: StackSettings = field(default_factory=StackSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    log_level: str = "INFO"
    log_format: str = "json"  # json or text
    # The asyncio loop of the API, the proxy and the command line: "uvloop" (libuv; less
    # CPU per wake-up, which the API does thousands of times a second) or "asyncio" (the
    # standard library's). The worker always runs the standard loop: its Kafka consumer is
    # aiokafka (through Faust), which catches only OSError when writing to a connection
    # the broker closed, and uvloop raises RuntimeError there, which ends the consumer's
    # group coordination (aio-libs/aiokafka#1038, open): a broker restart or an idle
    # connection closed after connections.max.idle.ms would stall the worker.
    event_loop: str = "uvloop"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e: Mapping[str, str] = os.environ if env is None else env
        stack_defaults = StackSettings()
        kafka_port = _port(e, "KAFKA_PORT", stack_defaults.kafka_port)
        cassandra_port = _port(e, "CASSANDRA_PORT", stack_defaults.cassandra_port)
        return cls(
            kafka=KafkaSettings(
                bootstrap_servers=_get(e, "KAFKA_BOOTSTRAP_SERVERS", f"127.0.0.1:{kafka_port}"),
                security_protocol=_get(e, "KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),
                sasl_mechanism=_opt(e, "KAFKA_SASL_MECHANISM"),
                sasl_username=_opt(e, "KAFKA_SASL_USERNAME"),
                sasl_password=_opt(e, "KAFKA_SASL_PASSWORD"),
                ssl_ca_location=_opt(e, "KAFKA_SSL_CA_LOCATION"),
                ssl_certificate_location=_opt(e, "KAFKA_SSL_CERTIFICATE_LOCATION"),
                ssl_key_location=_opt(e, "KAFKA_SSL_KEY_LOCATION"),
                reconnect_backoff_max_ms=_int(e, "KAFKA_RECONNECT_BACKOFF_MAX_MS", 1000),
                metadata_refresh_ms=_int(e, "KAFKA_METADATA_REFRESH_MS", 1000),
                socket_timeout_ms=_int(e, "KAFKA_SOCKET_TIMEOUT_MS", 10000),
                producer_socket_timeout_ms=_int(e, "KAFKA_PRODUCER_SOCKET_TIMEOUT_MS", 4000),
            ),
            cassandra=CassandraSettings(
                contact_points=tuple(
                    p.strip()
                    for p in _get(e, "CASSANDRA_CONTACT_POINTS", "127.0.0.1").split(",")
                    if p.strip()
                ),
                port=cassandra_port,
                keyspace=_get(e, "CASSANDRA_KEYSPACE", "tocsin"),
                username=_opt(e, "CASSANDRA_USERNAME"),
                password=_opt(e, "CASSANDRA_PASSWORD"),
                ssl_ca_location=_opt(e, "CASSANDRA_SSL_CA_LOCATION"),
                local_dc=_opt(e, "CASSANDRA_LOCAL_DC"),
                replication=_get(e, "CASSANDRA_REPLICATION", "SimpleStrategy:1"),
                request_timeout_s=_float(e, "CASSANDRA_REQUEST_TIMEOUT_S", 10.0),
                speculative_delay_ms=_int(e, "CASSANDRA_SPECULATIVE_DELAY_MS", 250),
                speculative_executions=_int(e, "CASSANDRA_SPECULATIVE_EXECUTIONS", 2),
                heartbeat_interval_s=_float(e, "CASSANDRA_HEARTBEAT_INTERVAL_S", 2.0),
                heartbeat_timeout_s=_float(e, "CASSANDRA_HEARTBEAT_TIMEOUT_S", 3.0),
                protocol_version=_int(e, "CASSANDRA_PROTOCOL_VERSION", 4),
            ),
            topics=TopicSettings(
                prefix=_get(e, "TOPIC_PREFIX", "tocsin."),
                command_partitions=_int(e, "COMMAND_PARTITIONS", 8),
                fire_partitions=_int(e, "FIRE_PARTITIONS", 8),
                replication_factor=_int(e, "TOPIC_REPLICATION_FACTOR", 1),
                min_insync_replicas=_int(e, "TOPIC_MIN_INSYNC_REPLICAS", 0),
            ),
            stack=StackSettings(
                state_dir=Path(_get(e, "STATE_DIR", str(stack_defaults.state_dir))),
                kafka_port=kafka_port,
                kafka_controller_port=_port(e, "KAFKA_CONTROLLER_PORT", 9093),
                cassandra_port=cassandra_port,
                cassandra_storage_port=_port(e, "CASSANDRA_STORAGE_PORT", 7000),
                kafka_heap_mib=_int(e, "KAFKA_HEAP_MIB", 512),
                cassandra_heap_mib=_int(e, "CASSANDRA_HEAP_MIB", 1024),
                start_timeout_s=_float(e, "STACK_START_TIMEOUT_S", 240.0),
                java_home=_opt(e, "JAVA_HOME"),
                jars_dir=Path(j) if (j := _opt(e, "JARS_DIR")) else None,
            ),
            scheduler=SchedulerSettings(
                max_payload_bytes=_int(e, "MAX_PAYLOAD_BYTES", 64 * 1024),
                default_misfire_tolerance_s=_int(e, "DEFAULT_MISFIRE_TOLERANCE_S", 3600),
                bucket_shards=_int(e, "BUCKET_SHARDS", 1),
                preload_ahead_s=_float(e, "PRELOAD_AHEAD_S", 10.0),
                fired_retention_s=_int(e, "FIRED_RETENTION_S", 7 * 24 * 3600),
                metrics_port=_port(e, "METRICS_PORT", 9464),
                metrics_addr=_get(e, "METRICS_ADDR", "0.0.0.0"),
                worker_web_port=_port(e, "WORKER_WEB_PORT", 6066),
                command_batch_size=_int(e, "COMMAND_BATCH_SIZE", 500),
                command_batch_wait_ms=_int(e, "COMMAND_BATCH_WAIT_MS", 20),
                consumer_fetch_max_wait_ms=_int(e, "CONSUMER_FETCH_MAX_WAIT_MS", 20),
                consumer_fetch_min_bytes=_int(e, "CONSUMER_FETCH_MIN_BYTES", 16384),
                consumer_fetch_idle_wait_ms=_int(e, "CONSUMER_FETCH_IDLE_WAIT_MS", 500),
                inline_handover=_bool(e, "INLINE_HANDOVER", True),
                commit_group_size=_int(e, "COMMIT_GROUP_SIZE", 16),
                require_signed_commands=_bool(e, "REQUIRE_SIGNED_COMMANDS", True),
                signed_order_skew_ms=_int(e, "SIGNED_ORDER_SKEW_MS", 2_000),
                allow_private_targets=_bool(e, "ALLOW_PRIVATE_TARGETS", False),
                session_timeout_s=_float(e, "SESSION_TIMEOUT_S", 10.0),
                kafka_request_timeout_s=_float(e, "WORKER_KAFKA_REQUEST_TIMEOUT_S", 15.0),
                coordinator_query_interval_s=_float(e, "WORKER_COORDINATOR_QUERY_INTERVAL_S", 1.0),
                ticker_release_wait_ms=_int(e, "TICKER_RELEASE_WAIT_MS", 1000),
                recurring_horizon_s=_float(e, "RECURRING_HORIZON_S", 600.0),
                recurring_max_runs_per_step=_int(e, "RECURRING_MAX_RUNS_PER_STEP", 500),
                recurring_catchup_per_s=_float(e, "RECURRING_CATCHUP_PER_S", 200.0),
                recurring_interval_s=_float(e, "RECURRING_INTERVAL_S", 1.0),
                clock_skew_ms=_int(e, "CLOCK_SKEW_MS", 0),
            ),
            api=ApiSettings(
                host=_get(e, "API_HOST", "127.0.0.1"),
                port=_port(e, "API_PORT", 8480),
                admin_key=_opt(e, "ADMIN_KEY"),
                request_timeout_s=_float(e, "API_REQUEST_TIMEOUT_S", 10.0),
                max_body_bytes=_int(e, "API_MAX_BODY_BYTES", 256 * 1024),
                tenant_cache_ttl_s=_float(e, "TENANT_CACHE_TTL_S", 5.0),
                goscheduler_cron_time_zone=_get(e, "GOSCHEDULER_CRON_TIME_ZONE", "UTC"),
                produce_linger_ms=_int(e, "API_PRODUCE_LINGER_MS", 2),
                metrics_urls=tuple(
                    u.strip() for u in _get(e, "API_METRICS_URLS", "").split(",") if u.strip()
                ),
                metrics_scrape_s=_float(e, "API_METRICS_SCRAPE_S", 15.0),
            ),
            admission=AdmissionSettings(
                current=_admission_key("ADMISSION_KEY", _opt(e, "ADMISSION_KEY")),
                previous=_admission_key(
                    "ADMISSION_PREVIOUS_KEY", _opt(e, "ADMISSION_PREVIOUS_KEY")
                ),
                api_instances=max(1, _int(e, "API_INSTANCES", 1)),
            ),
            log_level=_get(e, "LOG_LEVEL", "INFO"),
            log_format=_get(e, "LOG_FORMAT", "json"),
            event_loop=_choice(e, "EVENT_LOOP", "uvloop", ("uvloop", "asyncio")),
        )

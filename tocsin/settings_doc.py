"""What every ``TOCSIN_*`` variable means, by the process that reads it.

The docs' settings tables are generated from this list (``tocsin settings --markdown``), and
tests check it against the code both ways: every variable the settings modules read is
here, nothing here is read by no code, and every default stated here is the one the code
applies (setting a variable to its stated default changes nothing).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path


class Process(enum.Enum):
    COMMON = "common"
    WORKER = "worker"
    PROXY = "proxy"
    API = "api"
    STACK = "stack"


# Where each process's table lives, and what its heading says.
TABLE_PAGES: dict[Process, str] = {
    Process.COMMON: "docs/operations.md",
    Process.STACK: "docs/operations.md",
    Process.WORKER: "docs/scheduler.md",
    Process.PROXY: "docs/proxy.md",
    Process.API: "docs/api.md",
}

UNSET = "unset"


@dataclass(frozen=True)
class SettingDoc:
    name: str  # without the TOCSIN_ prefix
    process: Process
    default: str  # as a person would type it; UNSET when unset means something of its own
    meaning: str
    # False where the default depends on the machine (a folder of the checkout).
    default_checkable: bool = True

    @property
    def variable(self) -> str:
        return f"TOCSIN_{self.name}"


C, W, P, A, S = Process.COMMON, Process.WORKER, Process.PROXY, Process.API, Process.STACK

SETTINGS: tuple[SettingDoc, ...] = (
    # --- every process
    SettingDoc(
        "KAFKA_BOOTSTRAP_SERVERS",
        C,
        "127.0.0.1:9092",
        "Kafka bootstrap servers (default follows `TOCSIN_KAFKA_PORT`)",
    ),
    SettingDoc(
        "KAFKA_SECURITY_PROTOCOL", C, "PLAINTEXT", "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL"
    ),
    SettingDoc("KAFKA_SASL_MECHANISM", C, UNSET, "SASL mechanism (PLAIN, SCRAM-SHA-512, ...)"),
    SettingDoc("KAFKA_SASL_USERNAME", C, UNSET, "SASL user"),
    SettingDoc("KAFKA_SASL_PASSWORD", C, UNSET, "SASL password"),
    SettingDoc("KAFKA_SSL_CA_LOCATION", C, UNSET, "CA bundle for the brokers' TLS"),
    SettingDoc("KAFKA_SSL_CERTIFICATE_LOCATION", C, UNSET, "client certificate (mutual TLS)"),
    SettingDoc("KAFKA_SSL_KEY_LOCATION", C, UNSET, "client key (mutual TLS)"),
    SettingDoc(
        "KAFKA_RECONNECT_BACKOFF_MAX_MS",
        C,
        "1000",
        "longest pause between reconnects to a broker gone away (each also re-reads metadata)",
    ),
    SettingDoc(
        "KAFKA_METADATA_REFRESH_MS",
        C,
        "1000",
        "how often clients re-read metadata unasked (finds a hung leader's successor)",
    ),
    SettingDoc(
        "KAFKA_SOCKET_TIMEOUT_MS",
        C,
        "10000",
        "a request to a broker unanswered this long is given up and re-sent (hung broker)",
    ),
    SettingDoc(
        "KAFKA_PRODUCER_SOCKET_TIMEOUT_MS",
        C,
        "4000",
        "the same for the worker's and the API's producers: bounds a produce in flight to a "
        "hung leader; below the brokers' fencing time, writes waiting on a fencing are re-sent",
    ),
    SettingDoc("CASSANDRA_CONTACT_POINTS", C, "127.0.0.1", "comma-separated Cassandra hosts"),
    SettingDoc("CASSANDRA_PORT", C, "9042", "Cassandra native (CQL) port"),
    SettingDoc("CASSANDRA_USERNAME", C, UNSET, "Cassandra user"),
    SettingDoc("CASSANDRA_PASSWORD", C, UNSET, "Cassandra password"),
    SettingDoc("CASSANDRA_SSL_CA_LOCATION", C, UNSET, "CA bundle; setting it enables TLS"),
    SettingDoc(
        "CASSANDRA_LOCAL_DC",
        C,
        UNSET,
        "local data center for request routing (unset: the driver's choice)",
    ),
    SettingDoc(
        "CASSANDRA_KEYSPACE",
        C,
        "tocsin",
        "keyspace; one per topic prefix (workers refuse a keyspace bound to another)",
    ),
    SettingDoc(
        "CASSANDRA_REPLICATION",
        C,
        "SimpleStrategy:1",
        "`SimpleStrategy:N` or `NetworkTopologyStrategy:dc1=3,dc2=3` (new keyspaces)",
    ),
    SettingDoc("CASSANDRA_REQUEST_TIMEOUT_S", C, "10", "client-side timeout of one request"),
    SettingDoc(
        "CASSANDRA_SPECULATIVE_DELAY_MS",
        C,
        "250",
        "an idempotent statement unanswered this long is also sent to the next host",
    ),
    SettingDoc(
        "CASSANDRA_SPECULATIVE_EXECUTIONS",
        C,
        "2",
        "at most this many such extra executions per statement (0: none)",
    ),
    SettingDoc(
        "CASSANDRA_HEARTBEAT_INTERVAL_S",
        C,
        "2",
        "a connection that received nothing this long is sent a heartbeat",
    ),
    SettingDoc(
        "CASSANDRA_HEARTBEAT_TIMEOUT_S",
        C,
        "3",
        "a heartbeat unanswered this long marks the node down (a hung node)",
    ),
    SettingDoc(
        "CASSANDRA_PROTOCOL_VERSION",
        C,
        "4",
        "native protocol version (0 negotiates; v5's checksums cost the driver CPU)",
    ),
    SettingDoc("TOPIC_PREFIX", C, "tocsin.", "prefix of every topic name"),
    SettingDoc("COMMAND_PARTITIONS", C, "8", "partitions of the commands topic"),
    SettingDoc("FIRE_PARTITIONS", C, "8", "partitions of the fires topic"),
    SettingDoc("TOPIC_REPLICATION_FACTOR", C, "1", "replication factor of new topics"),
    SettingDoc(
        "TOPIC_MIN_INSYNC_REPLICAS",
        C,
        "0",
        "`min.insync.replicas` of new topics: the replicas an acknowledged write is "
        "on; 0 means 2 when the replication factor is 3 or more, else the broker's",
    ),
    SettingDoc(
        "TENANT_CACHE_TTL_S", C, "5", "how long workers and the API cache a tenant row or API key"
    ),
    SettingDoc(
        "LOG_LEVEL",
        C,
        "INFO",
        "log level of the servers; the commands a person runs log from WARNING unless this is set",
    ),
    SettingDoc("LOG_FORMAT", C, "json", "`json` (one object per line) or `text`"),
    SettingDoc(
        "EVENT_LOOP",
        C,
        "uvloop",
        "`uvloop` or `asyncio` for the API, proxy and command line (the worker always "
        "runs asyncio's)",
    ),
    SettingDoc(
        "PORT_OFFSET", C, "0", "added to every default listening port (stack, worker, proxy, API)"
    ),
    SettingDoc(
        "ALLOW_PRIVATE_TARGETS",
        C,
        "false",
        "allow callbacks to loopback, private, link-local and reserved addresses; "
        "false: the worker and API reject such IP-literal callback hosts at create "
        "(`invalid_url`) and the proxy refuses such addresses at delivery",
    ),
    # --- the local stack (tocsin infra)
    SettingDoc(
        "STATE_DIR",
        S,
        ".state/ in the checkout",
        "data, logs, pid files and jar cache of the local stack",
        default_checkable=False,
    ),
    SettingDoc("JARS_DIR", S, UNSET, "jar cache (unset: `STATE_DIR/jars`)"),
    SettingDoc("JAVA_HOME", S, UNSET, "Java 17-23 for the servers (unset: found on the machine)"),
    SettingDoc("KAFKA_PORT", S, "9092", "local broker port"),
    SettingDoc("KAFKA_CONTROLLER_PORT", S, "9093", "local KRaft controller port"),
    SettingDoc("CASSANDRA_STORAGE_PORT", S, "7000", "local Cassandra storage (gossip) port"),
    SettingDoc("KAFKA_HEAP_MIB", S, "512", "local broker heap"),
    SettingDoc("CASSANDRA_HEAP_MIB", S, "1024", "local Cassandra heap"),
    SettingDoc("STACK_START_TIMEOUT_S", S, "240", "how long a server may take to become ready"),
    # --- scheduler worker
    SettingDoc("MAX_PAYLOAD_BYTES", W, "65536", "largest trigger payload accepted"),
    SettingDoc(
        "DEFAULT_MISFIRE_TOLERANCE_S",
        W,
        "3600",
        "how late a trigger may still fire when its command names no tolerance",
    ),
    SettingDoc(
        "REQUIRE_SIGNED_COMMANDS", W, "true", "refuse commands of tenants without a signing key"
    ),
    SettingDoc(
        "SIGNED_ORDER_SKEW_MS",
        W,
        "2000",
        "signers' clock difference tolerated in a schedule's signed-command order",
    ),
    SettingDoc("BUCKET_SHARDS", W, "1", "shards per (partition, minute) bucket"),
    SettingDoc("PRELOAD_AHEAD_S", W, "10", "how early the ticker reads the next minute's bucket"),
    SettingDoc("FIRED_RETENTION_S", W, "604800", "how long fired rows are kept (7 days)"),
    SettingDoc("METRICS_PORT", W, "9464", "worker's metrics and health port"),
    SettingDoc("METRICS_ADDR", W, "0.0.0.0", "address the metrics server binds"),
    SettingDoc("WORKER_WEB_PORT", W, "6066", "the worker's Faust web server"),
    SettingDoc("COMMAND_BATCH_SIZE", W, "500", "most commands the command agent takes at once"),
    SettingDoc(
        "COMMAND_BATCH_WAIT_MS",
        W,
        "20",
        "how long the command agent gathers commands after a batch",
    ),
    SettingDoc(
        "CONSUMER_FETCH_MAX_WAIT_MS",
        W,
        "20",
        "how long the broker may hold the worker's fetch for new data",
    ),
    SettingDoc(
        "CONSUMER_FETCH_MIN_BYTES",
        W,
        "16384",
        "bytes the broker gathers before it answers the worker's fetch early",
    ),
    SettingDoc(
        "CONSUMER_FETCH_IDLE_WAIT_MS",
        W,
        "500",
        "after an empty fetch, how long the next (one byte minimum) may be held",
    ),
    SettingDoc(
        "INLINE_HANDOVER",
        W,
        "true",
        "hand fetched records to the command stream inline (false: Faust's path)",
    ),
    SettingDoc("COMMIT_GROUP_SIZE", W, "16", "most schedule rows written in one batch"),
    SettingDoc("SESSION_TIMEOUT_S", W, "10", "consumer group session timeout"),
    SettingDoc(
        "WORKER_KAFKA_REQUEST_TIMEOUT_S",
        W,
        "15",
        "Kafka request timeout (a heartbeat to a hung coordinator); at least the session timeout",
    ),
    SettingDoc(
        "WORKER_COORDINATOR_QUERY_INTERVAL_S",
        W,
        "1",
        "how often the worker asks which broker coordinates its group (0: never)",
    ),
    SettingDoc(
        "TICKER_RELEASE_WAIT_MS",
        W,
        "1000",
        "how long a revoked partition's ticker waits for its in-flight triggers",
    ),
    SettingDoc(
        "RECURRING_HORIZON_S",
        W,
        "600",
        "how far ahead recurring runs are written; more than 2 x (60 + RECURRING_INTERVAL_S), "
        "else the worker refuses to start (an extension written by another worker in a "
        "rebalance is read up to a minute late)",
    ),
    SettingDoc(
        "RECURRING_MAX_RUNS_PER_STEP", W, "500", "most runs written per recurring schedule and step"
    ),
    SettingDoc(
        "RECURRING_CATCHUP_PER_S",
        W,
        "200",
        "how fast missed recurring runs are re-fired per partition after an outage",
    ),
    SettingDoc(
        "RECURRING_INTERVAL_S",
        W,
        "1",
        "at most how often the materialiser reads its due queue while entries fall due one "
        "after another (it sleeps until the next one otherwise), and its first back-off "
        "after a failure",
    ),
    SettingDoc(
        "CLOCK_SKEW_MS",
        W,
        "0",
        "fault injection only: the worker's clock runs this far ahead; never in production",
    ),
    # --- REST API
    SettingDoc("API_HOST", A, "127.0.0.1", "address the API listens on"),
    SettingDoc("API_PORT", A, "8480", "API port"),
    SettingDoc(
        "ADMIN_KEY",
        A,
        UNSET,
        "the admin credential (tenant management); unset disables the admin endpoints",
    ),
    SettingDoc(
        "ADMISSION_KEY",
        C,
        UNSET,
        "`<key id>:<secret>` (id: 1-32 of A-Z a-z 0-9 _ -; secret: 32+ characters) held by "
        "the APIs and workers only, "
        "never by a tenant: the API answers a one-shot create it gave the id to at Kafka's "
        "acknowledgement and the workers honour its stamp; unset: every create waits for "
        "its worker (docs/api.md)",
    ),
    SettingDoc(
        "ADMISSION_PREVIOUS_KEY",
        C,
        UNSET,
        "the admission key being rotated out, still accepted by the workers",
    ),
    SettingDoc(
        "API_INSTANCES",
        A,
        "1",
        "how many API instances admit creates: each enforces 1/this of a tenant's create quota",
    ),
    SettingDoc(
        "API_REQUEST_TIMEOUT_S",
        A,
        "10",
        "how long a synchronous request waits for its command result (504 after)",
    ),
    SettingDoc("API_MAX_BODY_BYTES", A, "262144", "largest request body (413 beyond)"),
    SettingDoc(
        "API_PRODUCE_LINGER_MS",
        A,
        "2",
        "how long the producer gathers concurrent requests' commands into one request",
    ),
    SettingDoc(
        "API_METRICS_URLS",
        A,
        UNSET,
        "comma-separated /metrics URLs of workers and proxies the console's Health page "
        "reads (unset: none)",
    ),
    SettingDoc(
        "API_METRICS_SCRAPE_S",
        A,
        "15",
        "how often the console reads those URLs (it keeps the last hour in memory)",
    ),
    SettingDoc(
        "GOSCHEDULER_CRON_TIME_ZONE",
        A,
        "UTC",
        "IANA zone in which the go-scheduler facade reads `cronExpression`",
    ),
    # --- delivery proxy
    SettingDoc(
        "PROXY_MODE",
        P,
        "fires",
        "`fires` (each trigger names its callback) or `generic` (MPS: topics to one URL)",
    ),
    SettingDoc(
        "PROXY_SOURCE_TOPIC",
        P,
        UNSET,
        "generic: comma-separated source topics (fires: the catalog's fires topic)",
    ),
    SettingDoc("PROXY_ENDPOINT_URL", P, UNSET, "generic: the one endpoint"),
    SettingDoc("PROXY_GROUP_ID", P, "tocsin-proxy", "consumer group"),
    SettingDoc("PROXY_DEAD_LETTER_TOPIC", P, UNSET, "dead letters (unset: the catalog's)"),
    SettingDoc(
        "PROXY_DELIVERIES_TOPIC", P, UNSET, "fires: delivery outcomes (unset: the catalog's)"
    ),
    SettingDoc(
        "PROXY_RETRY_TOPIC",
        P,
        UNSET,
        "parked messages: failing ones and a tenant's over its share (unset: the catalog's)",
    ),
    SettingDoc(
        "PROXY_MAX_PENDING_MESSAGES",
        P,
        "10000",
        "messages read and not yet done before reading pauses",
    ),
    SettingDoc(
        "PROXY_MAX_PENDING_BYTES",
        P,
        "67108864",
        "bytes read and not yet done before reading pauses (64 MiB)",
    ),
    SettingDoc(
        "PROXY_RESUME_RATIO",
        P,
        "0.5",
        "reading resumes when held count and bytes fall under this fraction",
    ),
    SettingDoc("PROXY_CONCURRENCY", P, "100", "requests in flight at once"),
    SettingDoc(
        "PROXY_PER_HOST_CONCURRENCY",
        P,
        "100",
        "requests in flight to one host (fires: to one host for one tenant)",
    ),
    SettingDoc(
        "PROXY_TENANT_SHARE", P, "0.5", "fires: fraction of `CONCURRENCY` one tenant may hold"
    ),
    SettingDoc(
        "PROXY_REQUEST_TIMEOUT_S", P, "10", "generic: request timeout (fires: each callback's own)"
    ),
    SettingDoc("PROXY_CONNECT_TIMEOUT_S", P, "5", "connect timeout"),
    SettingDoc(
        "PROXY_BODY_SNIPPET_BYTES",
        P,
        "512",
        "how much of a response body is kept for dead letters and logs",
    ),
    SettingDoc("PROXY_RETRY_BASE_DELAY_S", P, "0.2", "first retry delay (doubles each time)"),
    SettingDoc("PROXY_RETRY_MAX_DELAY_S", P, "60", "longest retry delay"),
    SettingDoc(
        "PROXY_MAX_RETRY_AGE_S",
        P,
        "86400",
        "how long 4xx/5xx/timeouts are retried before the dead letter (0: no limit)",
    ),
    SettingDoc("PROXY_RETRIES_6XX", P, "3", "retries of a 6xx before the dead letter"),
    SettingDoc(
        "PROXY_POISON_TIMEOUTS",
        P,
        "5",
        "timeouts after which a message is a poison pill (dead-lettered)",
    ),
    SettingDoc(
        "PROXY_PARK_AFTER_S",
        P,
        "10",
        "how long a failing message is retried in memory before it is parked in the "
        "retry topic (its source offset then commits)",
    ),
    SettingDoc(
        "PROXY_TENANT_PENDING_SHARE",
        P,
        "0.25",
        "fires: fraction of either pending bound one tenant may hold; its further "
        "messages are parked instead",
    ),
    SettingDoc("PROXY_COMMIT_INTERVAL_S", P, "5", "how often offsets are committed"),
    SettingDoc("PROXY_SHUTDOWN_TIMEOUT_S", P, "20", "how long a stop waits for in-flight work"),
    SettingDoc(
        "PROXY_REVOKE_TIMEOUT_S",
        P,
        "5",
        "how long a revoked partition's in-flight attempts are waited for",
    ),
    SettingDoc("PROXY_MAX_POLL_INTERVAL_S", P, "300", "consumer max poll interval"),
    SettingDoc("PROXY_SESSION_TIMEOUT_S", P, "10", "consumer group session timeout"),
    SettingDoc("PROXY_METRICS_PORT", P, "9465", "metrics and health port (0: none)"),
    SettingDoc(
        "PROXY_ALLOW_PRIVATE_TARGETS",
        P,
        "false",
        "fires: allow callbacks to loopback, private and link-local addresses "
        "(default follows `TOCSIN_ALLOW_PRIVATE_TARGETS`)",
    ),
    SettingDoc(
        "PROXY_SIGNING_SECRETS_FILE",
        P,
        UNSET,
        "fires: JSON file of tenant -> delivery secrets (newest first) signing each HTTP "
        "callback (`Tocsin-Signature`), re-read when it changes; unset: no signatures",
    ),
    SettingDoc(
        "PROXY_REQUIRE_SIGNATURE",
        P,
        "false",
        "fires: dead-letter a tenant's HTTP callbacks when it has no secret in that file "
        "(instead of sending them unsigned)",
    ),
    SettingDoc(
        "PROXY_HOST_RPS",
        P,
        "0",
        "requests per second to one endpoint host per tenant, unless the limits file says "
        "otherwise (0: no limit)",
    ),
    SettingDoc(
        "PROXY_HOST_LIMITS_FILE",
        P,
        UNSET,
        "JSON file of tenant -> `{rps, hosts: {host: rps}}` overriding `HOST_RPS`, re-read "
        "when it changes; unset: the default for every tenant",
    ),
    SettingDoc(
        "PROXY_BREAKER_FAILURES",
        P,
        "5",
        "consecutive failures (5xx, 429, timeout, connect) that open a (tenant, host)'s "
        "circuit breaker (0: no breaker)",
    ),
    SettingDoc(
        "PROXY_BREAKER_FAILURE_RATIO",
        P,
        "0.5",
        "the breaker also opens when this fraction of its last `BREAKER_WINDOW` attempts failed",
    ),
    SettingDoc("PROXY_BREAKER_WINDOW", P, "20", "attempts the failure ratio is taken over"),
    SettingDoc(
        "PROXY_BREAKER_OPEN_S",
        P,
        "1",
        "how long an opened breaker holds its host's messages before one probe (doubles "
        "after each failed probe)",
    ),
    SettingDoc("PROXY_BREAKER_OPEN_MAX_S", P, "60", "longest open period of a breaker"),
)


def of(process: Process) -> list[SettingDoc]:
    return [s for s in SETTINGS if s.process is process]


def markdown_table(process: Process) -> str:
    rows = [
        "| variable | meaning | default |",
        "|---|---|---|",
        *(
            f"| `{s.variable}` | {s.meaning} | "
            f"{s.default if s.default == UNSET or not s.default_checkable else f'`{s.default}`'} |"
            for s in of(process)
        ),
    ]
    return "\n".join(rows)


def begin_marker(process: Process) -> str:
    return f"<!-- settings:{process.value} (generated: tocsin settings --markdown) -->"


END_MARKER = "<!-- end of settings -->"


def block(process: Process) -> str:
    """The generated block as it stands in the docs page, markers included."""
    return f"{begin_marker(process)}\n{markdown_table(process)}\n{END_MARKER}"


# The settings helpers of base/settings.py: _get, _int and their siblings, called with
# the environment and the name without its TOCSIN_ prefix.
_READ = re.compile(r'_(?:get|int|float|opt|bool|choice|port)\(\s*\w+,\s*"([A-Z][A-Z0-9_]*)"')
_PACKAGES = ("base", "topics", "schema", "streams", "proxy", "api", "tocsin")


def names_read_by_code(root: Path) -> set[str]:
    """Every TOCSIN_* variable the code under ``root`` reads through the settings helpers."""
    names: set[str] = set()
    for package in _PACKAGES:
        for path in (root / package).rglob("*.py"):
            names.update(f"TOCSIN_{n}" for n in _READ.findall(path.read_text()))
    return names

"""Scheduler benchmarks (``make bench-scheduler``): ingest, burst, lateness, reads, memory.

Everything runs on this machine against the local stack, with one real ``tocsin worker``
subprocess, in a fresh topic prefix and keyspace (removed at the end). Phases:

1. ingest: creates produced as fast as the worker answers (at most ``window`` unanswered)
   for ``--ingest-s`` seconds; rate = accepted results / seconds from first send to last
   accepted result. ``ingest_cpu_per_create_ms``: CPU ms per accepted create of the
   workers, Kafka and Cassandra (all threads, /proc; the bench's own client excluded).
2. lateness: ``--lateness-rate`` fires/s spread over ``--lateness-s`` seconds; lateness is
   the trigger's emit time minus its due time, as stamped by the worker.
3. burst: ``--burst`` schedules due in the same second; seconds from that due time until
   the bench consumer has received the last trigger from the fire topic. Bucket reads per
   partition-minute = CQL bucket queries / bucket loads (worker metrics) during the phase.
4. memory: worker RSS with 10K and with 1M stored future schedules (rows written straight
   to Cassandra, spread over the next 30 days), each after a fresh start and warm-up.

Prints ``RESULT name=value unit`` lines last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from base.settings import REPO_ROOT, Settings
from bench import pinning
from streams.client import CommandClient, FireWatcher, ResultWatcher
from topics.ids import trigger_id
from topics.models import CreateCommand, HttpCallback, PayloadType

TENANT = "bench"
METRICS_PORT = 19664


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def pct(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


# ``python -m`` arguments of a worker process (bench.api's floor runs another module).
WORKER_COMMAND: tuple[str, ...] = ("tocsin.cli", "worker")


class Worker:
    """A worker process: ``tocsin worker``, or ``command`` (bench.api's storeless floor)."""

    def __init__(
        self, env: dict[str, str], log: Path, command: Sequence[str] = WORKER_COMMAND
    ) -> None:
        self.env, self.log, self.command = env, log, tuple(command)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.command],
                env=self.env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def rss_mib(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


WORKER_PORTS: list[int] = [METRICS_PORT]


def start_workers(
    env: dict[str, str],
    log: Path,
    count: int,
    *,
    ports: Callable[[], int] | None = None,
    command: Sequence[str] = WORKER_COMMAND,
) -> list[Worker]:
    """``count`` worker processes of one deployment (they share its consumer group and
    split its partitions), each with its own metrics port, listed in WORKER_PORTS.
    ``ports``: where each metrics and web port comes from (e.g. a free-port finder); by
    default fixed ports from METRICS_PORT. ``command``: the module (and arguments) run with
    ``python -m``."""
    WORKER_PORTS[:] = []
    workers = []
    for i in range(max(1, count)):
        port = METRICS_PORT + 10 * i if ports is None else ports()
        web = port + 1 if ports is None else ports()
        WORKER_PORTS.append(port)
        worker = Worker(
            {**env, "TOCSIN_METRICS_PORT": str(port), "TOCSIN_WORKER_WEB_PORT": str(web)},
            log,
            command,
        )
        worker.start()
        workers.append(worker)
    return workers


def histogram(name: str, **labels: str) -> dict[str, float]:
    """Cumulative bucket counts (``le`` as "%g" -> count, plus ``sum``) of a histogram, summed over
    all workers' /metrics and over the label sets matching ``labels``."""
    text = b"".join(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for port in WORKER_PORTS
    )
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        head, _, value = line.rpartition(" ")
        if not head.startswith(name + "_") or any(
            f'{k}="{v}"' not in head for k, v in labels.items()
        ):
            continue
        if head.startswith(name + "_bucket"):
            le = head.split('le="', 1)[1].split('"', 1)[0]
            key = le if le == "+Inf" else f"{float(le):g}"  # "1.0" -> "1", "0.25" stays
            out[key] = out.get(key, 0.0) + float(value)
        elif head.startswith(name + "_sum"):
            out["sum"] = out.get("sum", 0.0) + float(value)
    return out


def metric(name: str, ports: Sequence[int] | None = None) -> float:
    """Sum of a counter or gauge over all label sets and the /metrics of ``ports`` (default:
    all workers')."""
    text = b"".join(
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for port in (WORKER_PORTS if ports is None else ports)
    )
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(settings: Settings) -> dict[str, int]:
    """The local stack's Kafka and Cassandra processes, when their pid files are there
    (shared with whatever else runs on the machine)."""
    pids: dict[str, int] = {}
    for name in ("kafka", "cassandra"):
        with contextlib.suppress(OSError, ValueError):
            pid = int((settings.stack.state_dir / name / "server.pid").read_text().split()[0])
            proc_cpu_s(pid)
            pids[name] = pid
    return pids


def make_create(sid: str, due_ms: int) -> CreateCommand:
    return CreateCommand(
        tenant=TENANT,
        schedule_id=sid,
        request_id=sid,
        due_ms=due_ms,
        payload=orjson.dumps({"sid": sid}),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=3600,
    )


def send_and_count(
    settings: Settings, creates: list[CreateCommand], *, window: int, label: str
) -> tuple[int, float, float]:
    """Send with at most ``window`` unanswered; return (accepted, first_send, last_accept)."""
    client, results = CommandClient(settings), ResultWatcher(settings)
    want = {c.schedule_id for c in creates}
    accepted = 0
    answered = 0
    sent = 0
    first = time.monotonic()
    last = first
    next_note = first + 10
    while answered < len(creates):
        while sent < len(creates) and sent - answered < window:
            client.send(creates[sent])
            sent += 1
            if sent % 2000 == 0:
                client.producer.poll(0)
        client.producer.poll(0)
        for r in results.poll(0.05):
            if r.schedule_id in want:
                answered += 1
                if str(r.status) == "accepted":
                    accepted += 1
                    last = time.monotonic()
        if time.monotonic() > next_note:
            next_note += 10
            rate = accepted / max(1e-9, last - first)
            print(f"[{label}] sent {sent} answered {answered} ({rate:.0f}/s)", flush=True)
    client.flush()
    results.close()
    return accepted, first, last


def phase_ingest(settings: Settings, seconds: float, window: int) -> tuple[float, int]:
    """Creates/s accepted and how many were accepted."""
    # Enough creates for `seconds` at an optimistic 6000/s; stop counting at `seconds`.
    run = uuid.uuid4().hex[:6]
    far = now_ms() + 2 * 3600_000
    client, results = CommandClient(settings), ResultWatcher(settings)
    accepted = answered = sent = 0
    first = time.monotonic()
    last = first
    next_note = first + 10
    i = 0
    while time.monotonic() - first < seconds:
        while sent - answered < window:
            client.send(make_create(f"in-{run}-{i}", far + i))
            i += 1
            sent += 1
        client.producer.poll(0)
        for r in results.poll(0.05):
            if r.schedule_id and r.schedule_id.startswith(f"in-{run}-"):
                answered += 1
                if str(r.status) == "accepted":
                    accepted += 1
                    last = time.monotonic()
        if time.monotonic() > next_note:
            next_note += 10
            print(f"[ingest] {accepted} accepted, {accepted / (last - first):.0f}/s", flush=True)
    client.flush()
    results.close()
    return accepted / (last - first), accepted


def phase_lateness(settings: Settings, rate: int, seconds: int, ingest_rate: float) -> list[int]:
    n = rate * seconds
    lead_s = n / max(ingest_rate, 500) * 1.5 + 20
    t0 = now_ms() + int(lead_s * 1000)
    run = uuid.uuid4().hex[:6]
    creates = [make_create(f"lt-{run}-{i}", t0 + (i * 1000) // rate) for i in range(n)]
    fires = FireWatcher(settings)
    print(f"[lateness] {n} schedules, {rate}/s over {seconds} s from +{lead_s:.0f} s", flush=True)
    send_and_count(settings, creates, window=20_000, label="lateness ingest")
    want = {trigger_id(TENANT, c.schedule_id, c.due_ms) for c in creates}
    lateness: list[int] = []
    seen: set[str] = set()
    deadline = time.monotonic() + (t0 - now_ms()) / 1000 + seconds + 60
    next_note = time.monotonic() + 10
    while len(seen) < n and time.monotonic() < deadline:
        for trig, _ in fires.poll(0.2):
            if trig.trigger_id in want and trig.trigger_id not in seen:
                seen.add(trig.trigger_id)
                lateness.append(trig.emitted_ms - trig.due_ms)
        if time.monotonic() > next_note:
            next_note += 10
            print(
                f"[lateness] fired {len(seen)}/{n} p99 so far {pct(lateness, 0.99):.0f} ms",
                flush=True,
            )
    fires.close()
    print(f"[lateness] fired {len(seen)}/{n}", flush=True)
    return lateness + [10**9] * (n - len(seen))  # unfired count as infinitely late


def phase_burst(settings: Settings, n: int, ingest_rate: float) -> tuple[float, float, int]:
    lead_s = n / max(ingest_rate, 500) * 1.5 + 25
    due = now_ms() + int(lead_s * 1000)
    run = uuid.uuid4().hex[:6]
    creates = [make_create(f"bu-{run}-{i}", due) for i in range(n)]
    fires = FireWatcher(settings)
    print(f"[burst] {n} schedules due at +{lead_s:.0f} s", flush=True)
    queries0, loads0 = metric("tocsin_bucket_queries_total"), metric("tocsin_bucket_loads_total")
    send_and_count(settings, creates, window=20_000, label="burst ingest")
    want = {trigger_id(TENANT, c.schedule_id, due) for c in creates}
    seen: set[str] = set()
    last_ms = 0
    deadline = time.monotonic() + (due - now_ms()) / 1000 + 120
    while len(seen) < n and time.monotonic() < deadline:
        for trig, got_ms in fires.poll(0.2):
            if trig.trigger_id in want and trig.trigger_id not in seen:
                seen.add(trig.trigger_id)
                last_ms = max(last_ms, got_ms)
    fires.close()
    queries = metric("tocsin_bucket_queries_total") - queries0
    loads = metric("tocsin_bucket_loads_total") - loads0
    print(
        f"[burst] received {len(seen)}/{n}; bucket queries {queries:.0f} for {loads:.0f} "
        "partition-minute loads",
        flush=True,
    )
    emit_s = (last_ms - due) / 1000 if len(seen) == n else float("inf")
    return emit_s, queries / max(loads, 1), n - len(seen)


def store_future_rows(settings: Settings, count: int, start_index: int) -> None:
    """Write ``count`` future schedules (schedule + bucket rows) straight to Cassandra,
    due one to two days ahead (so no worker loads them), through the same grouped writes
    the command agent uses (bucket rows batched per bucket partition)."""
    from streams.model import BucketRow, ScheduleChange, ScheduleRow
    from streams.partitioner import partition_for
    from streams.store import Store

    async def go() -> None:
        store = Store(settings.cassandra, commit_group_size=32)
        await store.connect()
        base = now_ms() + 24 * 3_600_000
        span = 24 * 3_600_000
        stamp = now_ms()
        done = 0
        for chunk in range(start_index, start_index + count, 5_000):
            changes = []
            for i in range(chunk, min(chunk + 5_000, start_index + count)):
                sid = f"mem-{i}"
                row = ScheduleRow(
                    tenant=TENANT,
                    schedule_id=sid,
                    partition=partition_for(sid.encode(), settings.topics.command_partitions),
                    state="scheduled",
                    due_ms=base + (i * 7919) % span,
                    version=1,
                    created_ms=stamp,
                    updated_ms=stamp,
                    order_key=sid,
                    payload=b'{"x":1}',
                    payload_type="json",
                    callback='{"type":"http","url":"https://r.example/cb"}',
                    misfire_tolerance_s=60,
                )
                changes.append(
                    ScheduleChange(
                        row=row,
                        new_bucket=BucketRow.for_schedule(row, shards=1),
                        old_bucket=None,
                        now_ms=stamp,
                    )
                )
            await store.apply_schedule_changes(changes)
            done += len(changes)
            if done % 100_000 < 5_000:
                print(f"[memory] stored {done}/{count}", flush=True)
        await store.close()

    asyncio.run(go())


def phase_memory(settings: Settings, env: dict[str, str], log: Path) -> tuple[float, float]:
    """In a topic prefix and keyspace of its own, so nothing left from the other phases
    (commands still queued, checkpoints) is in either measurement."""
    from schema.migrate import migrate
    from tocsin.demo import _register_tenant
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    run = uuid.uuid4().hex[:6]
    env = {
        **env,
        "TOCSIN_TOPIC_PREFIX": f"benchmem.{run}.",
        "TOCSIN_CASSANDRA_KEYSPACE": f"benchmem_{run}",
    }
    settings = Settings.from_env(env)
    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    _register_tenant(settings, TENANT)
    try:
        return _measure_memory(settings, env, log)
    finally:
        cleanup(settings)


def _measure_memory(settings: Settings, env: dict[str, str], log: Path) -> tuple[float, float]:
    def measure(label: str) -> float:
        w = Worker(env, log)
        w.start()
        time.sleep(45)  # join, assignment, catch-up scan of the lookback window, warm-up
        samples = []
        for _ in range(10):
            samples.append(w.rss_mib())
            time.sleep(1)
        w.stop()
        print(f"[memory] {label}: worker RSS {max(samples):.1f} MiB", flush=True)
        return max(samples)

    store_future_rows(settings, 10_000, 0)
    small = measure("10K stored")
    store_future_rows(settings, 990_000, 10_000)
    large = measure("1M stored")
    return small, large


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ingest-s", type=float, default=60)
    parser.add_argument("--window", type=int, default=20_000)
    parser.add_argument("--lateness-rate", type=int, default=1000)
    parser.add_argument("--lateness-s", type=int, default=180)
    parser.add_argument("--burst", type=int, default=60_000)
    parser.add_argument("--phases", default="ingest,lateness,burst,memory")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    pinning.add_argument(parser)
    args = parser.parse_args()
    pinning.begin(args.pin)
    phases = set(args.phases.split(","))

    run = uuid.uuid4().hex[:6]
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.{run}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_{run}",
            "TOCSIN_METRICS_PORT": str(METRICS_PORT),
            "TOCSIN_WORKER_WEB_PORT": "19666",
            "TOCSIN_LOG_LEVEL": "WARNING",
        }
    )
    settings = Settings.from_env(env)
    from schema.migrate import migrate
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    from tocsin.demo import _register_tenant

    _register_tenant(settings, TENANT)
    log = settings.stack.state_dir / f"bench-worker-{run}.log"
    worker, *extra = start_workers(env, log, args.workers)
    pinning.place(
        {f"worker{i or ''}": w.proc.pid for i, w in enumerate([worker, *extra]) if w.proc}
    )
    results: list[str] = []
    try:
        probe = ResultWatcher(settings)
        c = CommandClient(settings)
        c.send(make_create("probe", now_ms() + 3_600_000))
        c.flush()
        assert probe.wait_for(["probe"], 120), f"worker did not start; see {log}"
        probe.close()

        if extra:
            time.sleep(15)  # let the group settle over every worker before measuring
        everyone = [worker, *extra]
        ingest = 1000.0  # a planning guess for lead times when the ingest phase is skipped
        if "ingest" in phases:
            servers = server_pids(settings)
            cpu0, wall0 = sum(w.cpu_s() for w in everyone), time.monotonic()
            servers0 = {name: proc_cpu_s(pid) for name, pid in servers.items()}
            ingest, accepted = phase_ingest(settings, args.ingest_s, args.window)
            worker_cpu = sum(w.cpu_s() for w in everyone) - cpu0
            cpu = worker_cpu / (time.monotonic() - wall0)
            per = {"worker": worker_cpu * 1000 / max(1, accepted)}
            for name, pid in servers.items():
                per[name] = (proc_cpu_s(pid) - servers0[name]) * 1000 / max(1, accepted)
            print(f"[ingest] {len(everyone)} worker(s), CPU {cpu:.2f} s/s", flush=True)
            shares = ", ".join(f"{k} {v:.2f}" for k, v in per.items())
            print(f"[ingest] CPU per create: {shares} ms", flush=True)
            results.append(f"RESULT ingest_rate={ingest:.0f} commands/s")
            results.append(f"RESULT ingest_cpu_per_create_ms={sum(per.values()):.2f} ms")
        if "lateness" in phases:
            lateness = phase_lateness(settings, args.lateness_rate, args.lateness_s, ingest)
            results += [
                f"RESULT lateness_p50_ms={pct(lateness, 0.5):.0f} ms",
                f"RESULT lateness_p99_ms={pct(lateness, 0.99):.0f} ms",
            ]
        if "burst" in phases:
            burst_s, reads, burst_lost = phase_burst(settings, args.burst, ingest)
            results += [
                f"RESULT burst_emit_s={burst_s:.1f} s",
                f"RESULT burst_missing={burst_lost} triggers",
                f"RESULT bucket_reads_per_partition_minute={reads:.2f} reads",
            ]
        for w in [worker, *extra]:
            w.stop()
        if "memory" in phases:
            small, large = phase_memory(settings, env, log)
            results.append(f"RESULT rss_ratio_1m_vs_10k={large / small:.2f} ratio")
    finally:
        for w in [worker, *extra]:
            w.stop()
        cleanup(settings)
    for line in results:
        print(line)
    return 0


def cleanup(settings: Settings) -> None:
    from confluent_kafka.admin import AdminClient

    from base.cassandra import make_cluster

    admin = AdminClient(settings.kafka.librdkafka())
    names = [
        n for n in admin.list_topics(timeout=10).topics if n.startswith(settings.topics.prefix)
    ]
    if names:
        for fut in admin.delete_topics(names).values():
            fut.result(30)
    cluster = make_cluster(settings.cassandra)
    try:
        cluster.connect().execute(
            f"DROP KEYSPACE IF EXISTS {settings.cassandra.keyspace}", timeout=120
        )
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())

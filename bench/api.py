"""REST API benchmark (``make bench-api``): synchronous creates through ``tocsin api``.

Runs on this machine against the local stack with real ``tocsin worker`` processes
(``--workers``, default 1) and one ``tocsin api`` subprocess, in a fresh topic prefix and
keyspace (removed at the end). A tenant is registered through the admin API; every
create is signed by the API and waits for its command result (request-reply over Kafka),
exactly as a client would use it.

1. rate: ``--concurrency`` clients send synchronous creates back to back for ``--rate-s``
   seconds; rate = answers 201 with result code ``ok`` / elapsed seconds.
2. latency: an open loop of ``--latency-rate`` creates/s for ``--latency-s`` seconds (each
   request sent at its slot whatever the previous ones do); p50/p99 of the request time
   of the creates answered 201 ``ok`` (any other answer counts as failed).

The load generator is a minimal keep-alive HTTP/1.1 client (``RawClient``): real HTTP
requests on real connections, each answered by the API only once the worker's result came
back, but without aiohttp's client machinery, which cost about as much CPU per request as
the API on these shared two cores. ``--client aiohttp`` uses aiohttp's client instead.

After the latency phase, a per-hop breakdown says where a create's time went, from the
client's own clocks and the records themselves: client sent -> the command's record
timestamp (the API produced it) -> the start of the worker batch that applied it (the
result's ``at_ms``) -> the result's record timestamp (the worker answered, its Cassandra
writes done) -> the client has the answer (the API read the result and replied).

``api_cpu_per_create_ms`` is the CPU of the servers (the API, the workers, Kafka and
Cassandra, all threads, from /proc; the load client excluded) per create answered in the
rate phase; ``api_cpu_per_create_at_<rate>_ms`` the same in the open-loop phase. Each
process's share is printed beside it.

Ports: the API, the workers' web and metrics ports and the API's metrics port are free
ports picked at start (``--api-port`` etc. fix them), so the bench never collides with
another benchmark or test run on the machine.

Each phase prints the CPU seconds per second the API, the worker, this client and (when
their pid files are in the state directory) Kafka and Cassandra used, and the load average,
since the machine is shared and absolute figures are noisy. ``--py-spy PATH`` records a
py-spy profile of the API and of the worker during the rate phase (collapsed
stacks ``PATH-api.txt`` and ``PATH-worker.txt``, one line per stack with its sample count,
for flamegraph.pl or speedscope; py-spy must be on PATH and allowed to attach).

``--worker-store none`` measures the path's floor instead: the workers run
``bench.storeless_worker``, the real worker with its command agent's Cassandra read and
writes patched out (nothing is stored). The API, Kafka, Faust's consumer, decoding,
validation, tenants and results are unchanged, so the figures (named ``*_storeless``) say
how fast synchronous creates could be on this machine if persisting them cost nothing.

Prints ``RESULT name=value unit`` lines last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from base.settings import REPO_ROOT, Settings
from bench import pinning
from bench.scheduler import (
    WORKER_COMMAND,
    WORKER_PORTS,
    Worker,
    cleanup,
    metric,
    pct,
    start_workers,
)
from topics.catalog import catalog


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds of each live thread of a process, by (thread id, thread name)."""
    out: dict[tuple[int, str], float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, fields = task.joinpath("stat").read_text().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
        ticks = fields.split()[11:13]
        out[(int(task.name), name)] = (int(ticks[0]) + int(ticks[1])) / os.sysconf("SC_CLK_TCK")
    return out


class CpuMeter:
    """CPU seconds per wall second of the API, the worker and the bench's client."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.start = {name: cpu_s(pid) for name, pid in pids.items()}
        # Per thread of Tocsin's own processes, to say which thread a change moved.
        self.start_threads = {
            name: thread_cpu_s(pid) for name, pid in pids.items() if name not in THREADLESS
        }

    def threads_line(self, creates: int) -> str:
        """CPU ms per create of the busiest threads of the API and the workers: where a
        process's share goes. Python 3.11 gives its threads no OS name, so the main thread
        (the event loop) is ``main`` and every other thread has its OS name (librdkafka's
        ``rdk:*``; Python's helper threads, the Kafka consumer's, the Cassandra driver's
        I/O thread are all ``python``), with its thread id."""
        parts = []
        for name, start in self.start_threads.items():
            pid = self.pids[name]
            spent = [
                ("main" if tid == pid else f"{thread}/{tid}", cpu - start.get((tid, thread), 0.0))
                for (tid, thread), cpu in thread_cpu_s(pid).items()
            ]
            top = sorted(spent, key=lambda kv: -kv[1])[:6]
            parts.append(
                f"{name}: " + ", ".join(f"{t} {s * 1000 / max(1, creates):.3f}" for t, s in top)
            )
        return "; ".join(parts) + " ms CPU per create, by thread"

    def report(self) -> str:
        wall = time.monotonic() - self.t0
        parts = [
            f"{name} CPU {(cpu_s(pid) - self.start[name]) / wall:.2f} s/s"
            for name, pid in self.pids.items()
        ]
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        return "; ".join(parts) + f"; load average {load}"

    def ms_per_create(self, creates: int) -> dict[str, float]:
        """CPU ms per create of each process since the meter started, and ``servers``: the
        sum over every process but the load client (API, workers, Kafka, Cassandra)."""
        per = {
            name: (cpu_s(pid) - self.start[name]) * 1000 / max(1, creates)
            for name, pid in self.pids.items()
        }
        per["servers"] = sum(v for k, v in per.items() if k != "client")
        return per


# Processes whose threads are not broken down: the JVMs (dozens of pool threads) and the
# load client.
THREADLESS = frozenset({"kafka", "cassandra", "client"})


def cpu_line(per: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.2f}" for name, ms in per.items()) + " ms CPU per create"


def breakdown(settings: Settings, since_ms: int, until_ms: int) -> dict[str, list[int]]:
    """Where a synchronous create's time went, hop by hop (``HOPS``), from the records
    themselves and the client's clocks, for the commands produced in [since_ms, until_ms):
    ms per create of each hop."""
    from confluent_kafka import Consumer, TopicPartition

    topics = catalog(settings.topics)
    consumer = Consumer(
        {
            **settings.kafka.librdkafka(),
            "group.id": f"bench-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    try:

        def read(topic: str, partitions: int) -> list[Any]:
            tps = consumer.offsets_for_times(
                [TopicPartition(topic, p, since_ms) for p in range(partitions)], 10
            )
            ends = [
                consumer.get_watermark_offsets(TopicPartition(topic, p), 10)[1]
                for p in range(partitions)
            ]
            consumer.assign(tps)
            left = sum(
                max(0, end - tp.offset) for tp, end in zip(tps, ends, strict=True) if tp.offset >= 0
            )
            out: list[Any] = []
            while left > 0:
                batch = consumer.consume(10_000, 2.0)
                if not batch:
                    break
                left -= len(batch)
                out.extend(m for m in batch if m.error() is None)
            consumer.unassign()
            return out

        sent: dict[object, tuple[int, object]] = {}
        for m in read(topics.commands.name, topics.commands.partitions):
            ts = m.timestamp()[1]
            if since_ms <= ts < until_ms:
                doc = orjson.loads(m.value())
                sent[doc.get("request_id")] = (ts, doc.get("schedule_id"))
        hops: dict[str, list[int]] = {name: [] for name in HOPS}
        for m in read(topics.command_results.name, topics.command_results.partitions):
            doc = orjson.loads(m.value())
            produced, sid = sent.get(doc.get("request_id"), (None, None))
            if produced is None:
                continue
            result_ms = m.timestamp()[1]
            hops["command -> worker batch start"].append(doc["at_ms"] - produced)
            hops["batch start -> result produced"].append(result_ms - doc["at_ms"])
            hops["command -> result"].append(result_ms - produced)
            clocks = CLIENT_CLOCKS.get(sid) if isinstance(sid, str) else None
            if clocks is not None:
                hops["client sent -> command produced"].append(produced - clocks[0])
                hops["result produced -> client answered"].append(clocks[1] - result_ms)
                hops["client total"].append(clocks[1] - clocks[0])
    finally:
        consumer.close()
    return hops


# The hops of a synchronous create, in order: the client's wall clock (same machine) at
# send and answer, the command record's timestamp (the API's producer stamped it), the
# result's at_ms (the worker's batch started) and the result record's timestamp.
HOPS = (
    "client sent -> command produced",
    "command -> worker batch start",
    "batch start -> result produced",
    "result produced -> client answered",
    "command -> result",
    "client total",
)


def hop_table(hops: dict[str, list[int]]) -> str:
    rows = [
        f"  {name:<38} p50 {pct(xs, 0.5):>5.0f}  p99 {pct(xs, 0.99):>5.0f} ms  (n={len(xs)})"
        for name, xs in hops.items()
    ]
    return "\n".join(rows)


def wait_partitions_owned(total: int, deadline: float) -> None:
    """Until every commands partition is owned and every worker owns some (the group has
    settled): a rebalance during a measured phase would stall it."""
    while True:
        try:
            owned = [metric("tocsin_owned_partitions", [port]) for port in WORKER_PORTS]
        except OSError:  # a worker's metrics server is not up yet
            owned = []
        if owned and sum(owned) == total and all(n > 0 for n in owned[:total]):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the workers own {owned} of {total} partitions")
        time.sleep(0.5)


def py_spy(pid: int, out: str, seconds: float) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("[py-spy] not found on PATH; no profile recorded", flush=True)
        return None
    return subprocess.Popen(
        [
            exe,
            "record",
            "-p",
            str(pid),
            "-o",
            out,
            "-d",
            str(int(seconds)),
            "-r",
            "50",
            "-f",
            "raw",
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, answers framed by
    Content-Length (what aiohttp's web.Response sends)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection closed: {exc}"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buf[:end]).split(b"\r\n")
        length = -1
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length < 0:
            self.waiter.set_exception(ValueError(f"no Content-Length in {lines!r}"))
            return
        total = end + 4 + length
        if len(self.buf) < total:
            return
        status = int(lines[0].split(b" ", 2)[1])
        body = bytes(self.buf[end + 4 : total])
        del self.buf[:total]
        waiter, self.waiter = self.waiter, None
        waiter.set_result((status, body))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter


class RawClient:
    """The load generator: a minimal keep-alive HTTP/1.1 client (at most ``limit``
    connections). It shares the machine's two cores with the API, the worker, Kafka and
    Cassandra, so it must cost little: aiohttp's client took about as much CPU per request
    as the API itself (``--client aiohttp`` runs with it, to compare)."""

    def __init__(self, base: str, key: str, limit: int) -> None:
        url = urllib.parse.urlsplit(base)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.head = (
            f"Host: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\n"
        ).encode()
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[_Connection] = []
        self.all: list[_Connection] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.slots:
            conn = self.idle.pop() if self.idle else await self._open()
            data = b"".join(
                (
                    b"POST ",
                    path.encode(),
                    b" HTTP/1.1\r\n",
                    self.head,
                    b"Content-Length: ",
                    str(len(body)).encode(),
                    b"\r\n\r\n",
                    body,
                )
            )
            try:
                answer = await conn.request(data)
            except BaseException:
                if conn.transport is not None:
                    conn.transport.close()
                raise
            if not conn.closed:
                self.idle.append(conn)
            return answer

    async def _open(self) -> _Connection:
        _, conn = await asyncio.get_running_loop().create_connection(
            _Connection, self.host, self.port
        )
        self.all.append(conn)
        return conn

    async def close(self) -> None:
        for conn in self.all:
            if conn.transport is not None:
                conn.transport.close()


class AiohttpClient:
    """The same interface over aiohttp's client (the load generator until 2026-11-21)."""

    def __init__(self, base: str, key: str, limit: int) -> None:
        self.base = base
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            connector=aiohttp.TCPConnector(limit=limit),
        )

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        async with self.session.post(self.base + path, data=body) as resp:
            return resp.status, await resp.read()

    async def close(self) -> None:
        await self.session.close()


Client = RawClient | AiohttpClient
CLIENTS: dict[str, type[RawClient] | type[AiohttpClient]] = {
    "raw": RawClient,
    "aiohttp": AiohttpClient,
}


# Client clocks of the latency phase's creates (wall ms sent, wall ms answered), by
# schedule id, for the per-hop breakdown; bounded by that phase's request count.
CLIENT_CLOCKS: dict[str, tuple[int, int]] = {}
# ``--generated-ids``: the body names no schedule id, so the API generates it and, with an
# admission key (TOCSIN_ADMISSION_KEY), answers at Kafka's acknowledgement (docs/api.md).
GENERATED_IDS = False


async def create(client: Client, n: int, clocks: bool = False) -> tuple[bool, float]:
    """One synchronous create; True when answered 201 with the worker's ``ok`` result."""
    body: dict[str, object] = {
        "due": now_ms() + 3_600_000 + n,
        "payload": {"n": n},
        "callback": {"type": "http", "url": "https://receiver.example/hook"},
    }
    if not GENERATED_IDS:
        body["schedule_id"] = f"b-{n}"
    sent_ms = now_ms()
    t0 = time.perf_counter()
    status, answer = await client.post("/v1/schedules", orjson.dumps(body))
    ms = (time.perf_counter() - t0) * 1000
    doc = orjson.loads(answer) if answer else {}
    if clocks and isinstance(doc, dict):
        CLIENT_CLOCKS[str(doc.get("schedule_id") or f"b-{n}")] = (sent_ms, now_ms())
    return status == 201 and isinstance(doc, dict) and doc.get("code") == "ok", ms


def wait_drained(settings: Settings, timeout_s: float = 120.0) -> float:
    """Seconds until the workers have answered every command produced so far (as many
    results as commands: one each); with admitted creates the API answers before its
    worker, so a phase's CPU is measured until then."""
    from confluent_kafka import Consumer, TopicPartition

    topics = catalog(settings.topics)
    consumer = Consumer({**settings.kafka.librdkafka(), "group.id": f"drain-{uuid.uuid4()}"})
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout_s:
            ends = [
                sum(
                    consumer.get_watermark_offsets(TopicPartition(t.name, p), 10)[1]
                    for p in range(t.partitions)
                )
                for t in (topics.commands, topics.command_results)
            ]
            if ends[1] >= ends[0]:
                break
            time.sleep(0.05)
    finally:
        consumer.close()
    return time.monotonic() - t0


async def phase_rate(
    base: str, key: str, seconds: float, concurrency: int, kind: str = "raw"
) -> float:
    counter = iter(range(10**9))
    ok = 0
    stop = time.monotonic() + seconds
    client = CLIENTS[kind](base, key, concurrency)
    try:

        async def one_client() -> None:
            nonlocal ok
            while time.monotonic() < stop:
                good, _ = await create(client, next(counter))
                ok += good

        t0 = time.monotonic()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return ok / (time.monotonic() - t0)
    finally:
        await client.close()


# Answers of the latency phase slower than this, counted by the second of the phase they
# were sent in: a stall of the machine shows as one or two seconds holding them all, a
# tail of the code as a few in every second.
SLOW_MS = 50.0
SLOW_SECONDS: dict[int, int] = {}


async def phase_latency(
    base: str, key: str, rate: int, seconds: float, kind: str = "raw"
) -> tuple[list[float], int]:
    latencies: list[float] = []
    failed = 0
    total = int(rate * seconds)
    client = CLIENTS[kind](base, key, 2000)
    try:

        async def one(n: int) -> None:
            nonlocal failed
            good, ms = await create(client, 10**8 + n, clocks=True)
            if good:
                latencies.append(ms)
                if ms > SLOW_MS:
                    SLOW_SECONDS[n // rate] = SLOW_SECONDS.get(n // rate, 0) + 1
            else:
                failed += 1

        tasks = []
        t0 = time.monotonic()
        for n in range(total):
            delay = t0 + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(n)))
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return latencies, failed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate-s", type=float, default=20)
    parser.add_argument(
        "--generated-ids",
        action="store_true",
        help="creates name no schedule id (the API generates it): with TOCSIN_ADMISSION_KEY "
        "set they are answered at Kafka's acknowledgement, and each phase's CPU is "
        "measured until the workers have answered every command",
    )
    parser.add_argument(
        "--admission",
        action="store_true",
        help="run the API and workers with an admission key made for this run (implies "
        "--generated-ids): creates are answered at Kafka's acknowledgement (docs/api.md)",
    )
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--latency-rate", type=int, default=500)
    parser.add_argument("--latency-s", type=float, default=20)
    parser.add_argument("--api-port", type=int, default=0, help="0: a free port")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes (they split the commands partitions; one Python process is "
        "bound to about one core, as in bench-cron)",
    )
    parser.add_argument(
        "--worker-store",
        choices=("cassandra", "none"),
        default="cassandra",
        help="none: workers that skip Cassandra (bench.storeless_worker), the path's floor",
    )
    parser.add_argument("--api-metrics-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--py-spy", metavar="PATH", help="profile the rate phase into PATH-*")
    parser.add_argument(
        "--client", choices=sorted(CLIENTS), default="raw", help="the load generator's HTTP client"
    )
    pinning.add_argument(parser)
    return parser.parse_args()


def wait_ready(base: str, api_log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the API did not start; see {api_log}")
        time.sleep(0.2)


def create_tenant(base: str, admin: str) -> str:
    req = urllib.request.Request(
        base + "/v1/tenants",
        data=orjson.dumps({"tenant": "bench"}),
        method="POST",
        headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        key: str = orjson.loads(r.read())["api_key"]
    return key


def warm_up(base: str, key: str, settings: Settings) -> None:
    # The first create waits until the worker owns its partitions.
    probe_deadline = time.monotonic() + 120
    while asyncio.run(phase_rate(base, key, 0.01, 1)) == 0:
        if time.monotonic() > probe_deadline:
            raise SystemExit("the worker does not answer")
    wait_partitions_owned(catalog(settings.topics).commands.partitions, probe_deadline)


def measured_pids(
    api: subprocess.Popen[bytes], workers: list[Worker], state: Path
) -> dict[str, int]:
    pids = {"api": api.pid, "client": os.getpid()}
    for i, worker in enumerate(workers):
        assert worker.proc is not None
        pids[f"worker{i}" if len(workers) > 1 else "worker"] = worker.proc.pid
    # The local stack's servers too (shared with whatever else runs on the machine).
    for name in ("kafka", "cassandra"):
        pid_file = state / name / "server.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().split()[0])
            cpu_s(pid)
            pids[name] = pid
    return pids


def start_spies(
    prefix: str | None, pids: dict[str, int], seconds: float
) -> list[subprocess.Popen[bytes]]:
    if not prefix:
        return []
    return [
        p
        for name, pid in pids.items()
        if name != "client"
        if (p := py_spy(pid, f"{prefix}-{name}.txt", seconds)) is not None
    ]


def measure(
    args: argparse.Namespace, base: str, key: str, settings: Settings, pids: dict[str, int]
) -> list[str]:
    storeless = args.worker_store == "none"
    spies = start_spies(args.py_spy, pids, args.rate_s)
    meter = CpuMeter(pids)
    t0 = time.monotonic()
    rate = asyncio.run(phase_rate(base, key, args.rate_s, args.concurrency, args.client))
    rate_creates = round(rate * (time.monotonic() - t0))
    if GENERATED_IDS:
        # Answered at the acknowledgement, creates can outrun the workers: what they stored
        # per second is the phase's creates over the phase and the drain after it.
        drained = wait_drained(settings)
        stored = rate_creates / (args.rate_s + drained)
        print(
            f"[rate] workers drained {drained:.1f} s after the phase: stored {stored:.0f}/s",
            flush=True,
        )
    rate_cpu = meter.ms_per_create(rate_creates)
    rate_threads = meter.threads_line(rate_creates)
    print(
        f"[rate] {rate:.0f} synchronous creates/s with {args.concurrency} clients; "
        + meter.report(),
        flush=True,
    )
    print(f"[rate] {cpu_line(rate_cpu)}", flush=True)
    print(f"[rate] {rate_threads}", flush=True)
    for spy in spies:
        spy.wait(60)
    meter = CpuMeter(pids)
    latency_from_ms = now_ms()
    CLIENT_CLOCKS.clear()
    lat, failed = asyncio.run(
        phase_latency(base, key, args.latency_rate, args.latency_s, args.client)
    )
    if GENERATED_IDS:
        drained = wait_drained(settings)
        print(f"[latency] workers drained {drained:.1f} s after the phase", flush=True)
    latency_cpu = meter.ms_per_create(len(lat) + failed)
    latency_threads = meter.threads_line(len(lat) + failed)
    print(
        f"[latency] {len(lat)} ok, {failed} failed at {args.latency_rate}/s: "
        f"p50 {pct([int(x) for x in lat], 0.5):.0f} ms, "
        f"p99 {pct([int(x) for x in lat], 0.99):.0f} ms; " + meter.report(),
        flush=True,
    )
    print(f"[latency] {cpu_line(latency_cpu)}", flush=True)
    slow = ", ".join(f"s{sec}: {n}" for sec, n in sorted(SLOW_SECONDS.items()))
    print(f"[latency] answers over {SLOW_MS:g} ms by second sent: {slow or 'none'}", flush=True)
    print(f"[latency] {latency_threads}", flush=True)
    hops = breakdown(settings, latency_from_ms, now_ms())
    print(f"[latency] per-hop breakdown:\n{hop_table(hops)}", flush=True)
    suffix = "_storeless" if storeless else ""
    return [
        f"RESULT api_create_p50_ms{suffix}={pct([int(x) for x in lat], 0.5):.0f} ms",
        f"RESULT api_create_rate{suffix}={rate:.0f} creates/s",
        f"RESULT api_create_p99_ms{suffix}={pct([int(x) for x in lat], 0.99):.0f} ms",
        f"RESULT api_cpu_per_create_ms{suffix}={rate_cpu['servers']:.2f} ms",
        f"RESULT api_cpu_per_create_at_{args.latency_rate}_ms{suffix}="
        f"{latency_cpu['servers']:.2f} ms",
    ]


def stop_api(api: subprocess.Popen[bytes]) -> None:
    if api.poll() is None:
        os.killpg(api.pid, signal.SIGTERM)
        try:
            api.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(api.pid, signal.SIGKILL)


def main() -> int:
    global GENERATED_IDS
    args = parse_args()
    GENERATED_IDS = args.generated_ids or args.admission
    pinning.begin(args.pin)

    run = uuid.uuid4().hex[:6]
    port = args.api_port or free_port()
    admin = uuid.uuid4().hex
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.{run}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_{run}",
            "TOCSIN_LOG_LEVEL": "WARNING",
            "TOCSIN_API_PORT": str(port),
            "TOCSIN_ADMIN_KEY": admin,
        }
    )
    if args.admission:
        env["TOCSIN_ADMISSION_KEY"] = f"bench{run}:{uuid.uuid4().hex}{uuid.uuid4().hex}"
    settings = Settings.from_env(env)
    from schema.migrate import migrate
    from tocsin.topic_admin import ensure_topics

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    state = settings.stack.state_dir
    state.mkdir(parents=True, exist_ok=True)
    storeless = args.worker_store == "none"
    if storeless:
        print(
            "[floor] workers skip Cassandra (bench.storeless_worker): NOTHING is stored; "
            "these figures are the path's floor, not the scheduler's",
            flush=True,
        )
    workers = start_workers(
        env,
        state / f"bench-api-worker-{run}.log",
        args.workers,
        ports=free_port,
        command=("bench.storeless_worker",) if storeless else WORKER_COMMAND,
    )
    api_log = state / f"bench-api-{run}.log"
    with api_log.open("ab") as out:
        api = subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", "api"],
            env=dict(env, TOCSIN_METRICS_PORT=str(args.api_metrics_port or free_port())),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    results: list[str] = []
    try:
        wait_ready(base, api_log)
        key = create_tenant(base, admin)
        warm_up(base, key, settings)
        pids = measured_pids(api, workers, state)
        pinning.place(pids)
        results = measure(args, base, key, settings, pids)
    finally:
        stop_api(api)
        for worker in workers:
            worker.stop()
        cleanup(settings)
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

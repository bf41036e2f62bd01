"""REST API benchmark (``make bench-api``): synchronous creates through ``tocsin api``.

Runs on this machine against the local stack with one real ``tocsin worker`` and one
``tocsin api`` subprocess, in a fresh topic prefix and keyspace (removed at the end). A
tenant is registered through the admin API; every create is signed by the API and waits
for its command result (request-reply over Kafka), exactly as a client would use it.

1. rate: ``--concurrency`` clients send synchronous creates back to back for ``--rate-s``
   seconds; rate = 201 answers / elapsed seconds.
2. latency: an open loop of ``--latency-rate`` creates/s for ``--latency-s`` seconds (each
   request sent at its slot whatever the previous ones do); p50/p99 of the request time.

Ports: the API, the worker's web and metrics ports and the API's metrics port are free
ports picked at start (``--api-port`` etc. fix them), so the bench never collides with
another benchmark or test run on the machine.

Each phase prints the CPU seconds per second the API and the worker used, and the load
average, since the machine is shared and absolute figures are noisy. ``--py-spy PATH``
records a py-spy profile of the API and of the worker during the rate phase (collapsed
stacks ``PATH-api.txt`` and ``PATH-worker.txt``, one line per stack with its sample count,
for flamegraph.pl or speedscope; py-spy must be on PATH and allowed to attach).

Prints ``RESULT name=value unit`` lines last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import orjson

from bench.scheduler import Worker, cleanup, pct
from tocsin.settings import REPO_ROOT, Settings


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds per wall second of the API and the worker over one phase."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.monotonic()
        self.start = {name: cpu_s(pid) for name, pid in pids.items()}

    def report(self) -> str:
        wall = time.monotonic() - self.t0
        parts = [
            f"{name} CPU {(cpu_s(pid) - self.start[name]) / wall:.2f} s/s"
            for name, pid in self.pids.items()
        ]
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        return "; ".join(parts) + f"; load average {load}"


def py_spy(pid: int, out: str, seconds: float) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("[py-spy] not found on PATH; no profile recorded", flush=True)
        return None
    return subprocess.Popen(
        [exe, "record", "-p", str(pid), "-o", out, "-d", str(int(seconds)), "-r", "50",
         "-f", "raw", "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def create(session: aiohttp.ClientSession, base: str, n: int) -> tuple[int, float]:
    body = {
        "schedule_id": f"b-{n}",
        "due": now_ms() + 3_600_000 + n,
        "payload": {"n": n},
        "callback": {"type": "http", "url": "https://receiver.example/hook"},
    }
    t0 = time.perf_counter()
    async with session.post(f"{base}/v1/schedules", data=orjson.dumps(body)) as resp:
        await resp.read()
        return resp.status, (time.perf_counter() - t0) * 1000


async def phase_rate(base: str, key: str, seconds: float, concurrency: int) -> float:
    counter = iter(range(10**9))
    ok = 0
    stop = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=conn) as session:

        async def client() -> None:
            nonlocal ok
            while time.monotonic() < stop:
                status, _ = await create(session, base, next(counter))
                ok += status == 201

        t0 = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return ok / (time.monotonic() - t0)


async def phase_latency(base: str, key: str, rate: int, seconds: float) -> tuple[list[float], int]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    latencies: list[float] = []
    failed = 0
    total = int(rate * seconds)
    conn = aiohttp.TCPConnector(limit=2000)
    async with aiohttp.ClientSession(headers=headers, connector=conn) as session:

        async def one(n: int) -> None:
            nonlocal failed
            status, ms = await create(session, base, 10**8 + n)
            if status == 201:
                latencies.append(ms)
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
    return latencies, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate-s", type=float, default=20)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--latency-rate", type=int, default=500)
    parser.add_argument("--latency-s", type=float, default=20)
    parser.add_argument("--api-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--worker-web-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--worker-metrics-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--api-metrics-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--py-spy", metavar="PATH", help="profile the rate phase into PATH-*")
    args = parser.parse_args()

    run = uuid.uuid4().hex[:6]
    port = args.api_port or free_port()
    admin = uuid.uuid4().hex
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.{run}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_{run}",
            "TOCSIN_METRICS_PORT": str(args.worker_metrics_port or free_port()),
            "TOCSIN_WORKER_WEB_PORT": str(args.worker_web_port or free_port()),
            "TOCSIN_LOG_LEVEL": "WARNING",
            "TOCSIN_API_PORT": str(port),
            "TOCSIN_ADMIN_KEY": admin,
        }
    )
    settings = Settings.from_env(env)
    from schema.migrate import migrate
    from topics.catalog import catalog, ensure_topics

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    state = settings.stack.state_dir
    state.mkdir(parents=True, exist_ok=True)
    worker = Worker(env, state / f"bench-api-worker-{run}.log")
    worker.start()
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
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the API did not start; see {api_log}")
            time.sleep(0.2)
        req = urllib.request.Request(
            base + "/v1/tenants",
            data=orjson.dumps({"tenant": "bench"}),
            method="POST",
            headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            key = orjson.loads(r.read())["api_key"]
        # Warm up: the first create waits until the worker owns its partitions.
        probe_deadline = time.monotonic() + 120
        while asyncio.run(phase_rate(base, key, 0.01, 1)) == 0:
            if time.monotonic() > probe_deadline:
                raise SystemExit("the worker does not answer")
        assert worker.proc is not None
        pids = {"api": api.pid, "worker": worker.proc.pid}
        spies = []
        if args.py_spy:
            spies = [
                p for name, pid in pids.items()
                if (p := py_spy(pid, f"{args.py_spy}-{name}.txt", args.rate_s)) is not None
            ]
        meter = CpuMeter(pids)
        rate = asyncio.run(phase_rate(base, key, args.rate_s, args.concurrency))
        print(
            f"[rate] {rate:.0f} synchronous creates/s with {args.concurrency} clients; "
            + meter.report(),
            flush=True,
        )
        for spy in spies:
            spy.wait(60)
        meter = CpuMeter(pids)
        lat, failed = asyncio.run(phase_latency(base, key, args.latency_rate, args.latency_s))
        print(
            f"[latency] {len(lat)} ok, {failed} failed at {args.latency_rate}/s: "
            f"p50 {pct([int(x) for x in lat], 0.5):.0f} ms, "
            f"p99 {pct([int(x) for x in lat], 0.99):.0f} ms; " + meter.report(),
            flush=True,
        )
        results += [
            f"RESULT api_create_p50_ms={pct([int(x) for x in lat], 0.5):.0f} ms",
            f"RESULT api_create_rate={rate:.0f} creates/s",
            f"RESULT api_create_p99_ms={pct([int(x) for x in lat], 0.99):.0f} ms",
        ]
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGTERM)
            try:
                api.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(api.pid, signal.SIGKILL)
        worker.stop()
        cleanup(settings)
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Delivery proxy benchmark (`make bench-proxy`): throughput, order, loss and memory.

Runs the real proxy (``tocsin proxy``, one process) against real Kafka and a local
aiohttp receiver (another process, so neither steals the other's interpreter), and prints
``RESULT`` lines last. Each efficiency's bound is computed in the same run as
min(concurrency, keys) / endpoint latency; a rate is measured at the receiver from the
first to the last delivery of the run, so consumer-group start-up is not counted.

Runs: fanout (10,000 keys, 50 ms, concurrency 100), keylimited (5 keys, 50 ms), zero
latency vs. a plain single-threaded consumer posting synchronously, one poison pill per
1,000 messages (goodput of the other keys over the clean fanout run), and a memory run with
a 64 MiB pending-bytes bound. Must never touch topics other than its own (uuid-named).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import pinning

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = os.environ.get("TOCSIN_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
PARTITIONS = 8


# ---- receiver process ----------------------------------------------------------------------


def receiver_main(port: int) -> None:
    from aiohttp import web

    state: dict[str, Any] = {}

    def reset(cfg: dict[str, Any]) -> None:
        state.clear()
        state.update(
            latency_s=float(cfg.get("latency_s", 0.0)),
            next={},
            seen=set(),
            total=0,
            violations=0,
            first=None,
            last=None,
        )

    reset({})

    async def process(request: web.Request) -> web.Response:
        body = await request.read()
        if b"POISON" in body:
            await asyncio.sleep(30)  # never answers in time
            return web.Response(status=200)
        if state["latency_s"]:
            await asyncio.sleep(state["latency_s"])
        key, seq_s, _ = body.split(b":", 2)
        seq = int(seq_s)
        now = time.monotonic()
        state["total"] += 1
        if body not in state["seen"]:
            state["seen"].add(body)
            # First deliveries of a key must come in produce order (seq 0, 1, 2, ...; the
            # poison run skips the pills' numbers, so only "never backwards" is checked).
            if seq < state["next"].get(key, 0):
                state["violations"] += 1
            state["next"][key] = seq + 1
        if state["first"] is None:
            state["first"] = now
        state["last"] = now
        return web.Response(status=200)

    async def control(request: web.Request) -> web.Response:
        if request.method == "POST":
            reset(await request.json())
            return web.json_response({"ok": True})
        return web.json_response(
            {
                "unique": len(state["seen"]),
                "total": state["total"],
                "violations": state["violations"],
                "first": state["first"],
                "last": state["last"],
            }
        )

    app = web.Application()
    app.router.add_post("/process", process)
    app.router.add_route("*", "/control", control)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


class ReceiverClient:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/process"
        self.pid = 0  # the receiver process, for its CPU

    def _call(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/control",
            data=data,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]

    def reset(self, latency_s: float) -> None:
        self._call({"latency_s": latency_s})

    def stats(self) -> dict[str, Any]:
        return self._call()


# ---- Kafka helpers ---------------------------------------------------------------------------


def create_topic(name: str, partitions: int = PARTITIONS) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[
        name
    ].result(30)
    for _ in range(100):
        if len(admin.list_topics(name, timeout=10).topics[name].partitions) == partitions:
            return
        time.sleep(0.1)


def delete_topics(names: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    for fut in admin.delete_topics(names, operation_timeout=30).values():
        with contextlib.suppress(Exception):  # best-effort cleanup of bench topics
            fut.result(30)


def produce(topic: str, n: int, keys: int, *, value_bytes: int = 0, poison_every: int = 0) -> int:
    """n messages, round-robin over ``keys`` keys, body "key:seq:padding"; returns pills."""
    from confluent_kafka import Producer

    p = Producer(
        {
            "bootstrap.servers": BOOTSTRAP,
            "linger.ms": 20,
            "batch.num.messages": 10000,
            "compression.type": "lz4",
        }
    )
    counters = [0] * keys
    pills = 0
    pad = b"x" * value_bytes
    for i in range(n):
        k = i % keys
        seq = counters[k]
        counters[k] += 1
        extra = pad
        if poison_every and i % poison_every == poison_every // 2:
            extra = b"POISON"
            pills += 1
        value = b"k%d:%d:" % (k, seq) + extra
        while True:
            try:
                p.produce(topic, key=b"k%d" % k, value=value)
                break
            except BufferError:
                p.poll(0.1)
    p.flush(60)
    return pills


# ---- runs ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    rate: float
    unique: int
    violations: int
    lost: int
    rss_mib: float


def proxy_env(topic: str, dlq: str, url: str, concurrency: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOCSIN_PROXY_")}
    env.update(
        {
            "TOCSIN_KAFKA_BOOTSTRAP_SERVERS": BOOTSTRAP,
            "TOCSIN_LOG_LEVEL": "ERROR",
            "TOCSIN_PROXY_MODE": "generic",
            "TOCSIN_PROXY_SOURCE_TOPIC": topic,
            "TOCSIN_PROXY_ENDPOINT_URL": url,
            "TOCSIN_PROXY_DEAD_LETTER_TOPIC": dlq,
            "TOCSIN_PROXY_GROUP_ID": f"bench-{uuid.uuid4().hex[:8]}",
            "TOCSIN_PROXY_CONCURRENCY": str(concurrency),
            "TOCSIN_PROXY_PER_HOST_CONCURRENCY": str(concurrency),
            "TOCSIN_PROXY_METRICS_PORT": "0",
            "TOCSIN_PROXY_SESSION_TIMEOUT_S": "6",
            "TOCSIN_PROXY_COMMIT_INTERVAL_S": "1",
        }
    )
    env.update(extra)
    return env


def peak_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_proxy(
    rx: ReceiverClient,
    *,
    n: int,
    keys: int,
    latency_s: float,
    concurrency: int,
    poison_every: int = 0,
    value_bytes: int = 0,
    timeout_s: float = 300,
    **extra: str,
) -> RunResult:
    tag = uuid.uuid4().hex[:8]
    topic, dlq = f"bench.proxy.{tag}", f"bench.proxy.{tag}.dlq"
    create_topic(topic)
    create_topic(dlq, 1)
    pills = produce(topic, n, keys, value_bytes=value_bytes, poison_every=poison_every)
    expected = n - pills
    rx.reset(latency_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tocsin", "proxy"],
        cwd=REPO,
        env=proxy_env(topic, dlq, rx.url, concurrency, **extra),
    )
    pinning.place({"proxy": proc.pid})
    # CPU per message of each process from the first delivery seen to the last.
    pids = {"proxy": proc.pid, "receiver": rx.pid, **pinning.server_pids()}
    cpu0: dict[str, float] = {}
    rss = 0.0
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rss = max(rss, peak_rss_mib(proc.pid))
            unique = rx.stats()["unique"]
            if not cpu0 and unique > 0:
                cpu0, unique0 = pinning.cpu_seconds(pids), unique
            if unique >= expected or proc.poll() is not None:
                break
            time.sleep(0.2)
        rss = max(rss, peak_rss_mib(proc.pid))
        cpu = {k: v - cpu0[k] for k, v in pinning.cpu_seconds(pids).items() if k in cpu0}
        per = ", ".join(f"{k} {v * 1000 / max(1, unique - unique0):.3f}" for k, v in cpu.items())
        print(f"[cpu] {per} ms CPU per message, first delivery to last", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    st = rx.stats()
    span = (st["last"] - st["first"]) if st["first"] is not None else 0.0
    # Rate over the deliveries after the first one (n-1 intervals in the span).
    rate = (st["unique"] - 1) / span if span > 0 else 0.0
    delete_topics([topic, dlq])
    return RunResult(
        rate=rate,
        unique=st["unique"],
        violations=st["violations"],
        lost=max(0, expected - st["unique"]),
        rss_mib=rss,
    )


def run_baseline(rx: ReceiverClient, *, n: int, keys: int) -> float:
    """A plain single-threaded consumer posting each message synchronously."""
    from confluent_kafka import Consumer

    tag = uuid.uuid4().hex[:8]
    topic = f"bench.proxy.{tag}.base"
    create_topic(topic)
    produce(topic, n, keys)
    rx.reset(0.0)
    c = Consumer(
        {
            "bootstrap.servers": BOOTSTRAP,
            "group.id": f"base-{tag}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": True,
        }
    )
    c.subscribe([topic])
    conn = http.client.HTTPConnection("127.0.0.1", rx.port, timeout=10)
    done = 0
    t0: float | None = None
    deadline = time.monotonic() + 300
    while done < n and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        if t0 is None:
            t0 = time.monotonic()
        conn.request(
            "POST",
            "/process",
            body=m.value(),
            headers={
                "Key": (m.key() or b"").decode(),
                "Topic": str(m.topic()),
                "Partition": str(m.partition()),
                "Offset": str(m.offset()),
            },
        )
        conn.getresponse().read()
        done += 1
    elapsed = time.monotonic() - (t0 or time.monotonic())
    c.close()
    conn.close()
    delete_topics([topic])
    return (done - 1) / elapsed if elapsed > 0 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    pinning.add_argument(ap)
    args = ap.parse_args()
    if args.receiver:
        receiver_main(args.receiver)
        return 0
    pinning.begin(args.pin)

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rx_proc = subprocess.Popen(
        [sys.executable, "-m", "bench.proxy", "--receiver", str(port)], cwd=REPO
    )
    rx = ReceiverClient(port)
    rx.pid = rx_proc.pid
    for _ in range(100):
        try:
            rx.stats()
            break
        except OSError:
            time.sleep(0.1)
    scale = 4 if args.quick else 1
    lat, conc = 0.05, 100
    results: dict[str, RunResult] = {}
    try:
        results["fanout"] = run_proxy(
            rx, n=20_000 // scale, keys=10_000, latency_s=lat, concurrency=conc
        )
        fanout_bound = min(conc, 10_000) / lat
        print(f"fanout: {results['fanout']}", flush=True)
        results["keylimited"] = run_proxy(
            rx, n=1_000 // scale, keys=5, latency_s=lat, concurrency=conc
        )
        keylimited_bound = min(conc, 5) / lat
        print(f"keylimited: {results['keylimited']}", flush=True)
        results["zero"] = run_proxy(
            rx, n=40_000 // scale, keys=10_000, latency_s=0.0, concurrency=conc
        )
        print(f"zero latency: {results['zero']}", flush=True)
        baseline = run_baseline(rx, n=5_000 // scale, keys=10_000)
        print(f"baseline: {baseline:.0f} msgs/s", flush=True)
        results["poison"] = run_proxy(
            rx,
            n=20_000 // scale,
            keys=10_000,
            latency_s=lat,
            concurrency=conc,
            poison_every=1000,
            TOCSIN_PROXY_REQUEST_TIMEOUT_S="1",
            TOCSIN_PROXY_POISON_TIMEOUTS="3",
        )
        print(f"poison: {results['poison']}", flush=True)
        results["memory"] = run_proxy(
            rx,
            n=12_000 // scale,
            keys=10_000,
            latency_s=lat,
            concurrency=conc,
            value_bytes=8192,
            TOCSIN_PROXY_MAX_PENDING_BYTES=str(64 * 1024 * 1024),
            TOCSIN_PROXY_MAX_PENDING_MESSAGES="1000000",
        )
        print(f"memory: {results['memory']}", flush=True)
    finally:
        rx_proc.kill()  # it may be holding poison requests open; nothing to save
        rx_proc.wait(10)

    violations = sum(r.violations for r in results.values())
    lost = sum(r.lost for r in results.values())
    print(f"RESULT fanout_efficiency={results['fanout'].rate / fanout_bound:.3f}")
    print(f"RESULT keylimited_efficiency={results['keylimited'].rate / keylimited_bound:.3f}")
    print(f"RESULT zero_latency_rate={results['zero'].rate:.0f} msgs/s")
    print(f"RESULT baseline_rate={baseline:.0f} msgs/s")
    print(f"RESULT poison_goodput_ratio={results['poison'].rate / results['fanout'].rate:.3f}")
    print(f"RESULT order_violations={violations}")
    print(f"RESULT lost={lost}")
    print(f"RESULT rss_mib={results['memory'].rss_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Delivery benchmark (``make bench-delivery``): lateness of a callback, due -> received.

One ``tocsin worker`` and one ``tocsin proxy`` (fires mode) run against the local stack in a
fresh topic prefix and keyspace (removed at the end), delivering to a local aiohttp receiver
(another process) that answers 200 at once. ``--rate`` schedules per second are created
ahead, due evenly over ``--seconds`` seconds; lateness is the receiver's clock at arrival
minus the trigger's due time (one machine, one clock).

Per-hop breakdown of one delivery, each hop p50/p99 over the delivered fires:

- due -> emitted: the trigger's ``emitted_ms`` (the worker's clock at emit);
- emitted -> on the fires topic: when a reference consumer (this process, its own group,
  returning as soon as a record is there) received the record; the record's own timestamp
  is the producer's clock at ``produce()`` and is reported beside it;
- on the topic -> received by the receiver: the proxy's read, its hand-off to a writer and
  the request (loopback, so request sent ~ received), split at the proxy's read, which its
  delivery outcome tells (``delivered_ms`` less ``latency_ms``, read -> outcome): on the
  topic -> read by the proxy (negative when the proxy's fetch returned before the
  reference consumer's) and read by the proxy -> received;
- received -> answered: the proxy's outcome record on the deliveries topic (its record
  timestamp), written once the answer is in.

CPU: the worker's, the proxy's, and the Kafka and Cassandra JVMs' CPU seconds from /proc
over the firing window, divided by the fires delivered in it (``fire_cpu_ms``), and each
process's share. Prints ``RESULT`` lines last.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from base.settings import REPO_ROOT, Settings
from bench import pinning
from bench.scheduler import (
    TENANT,
    cleanup,
    histogram,
    now_ms,
    pct,
    send_and_count,
    start_workers,
)
from streams.client import CommandClient, ResultWatcher
from topics.models import CreateCommand, HttpCallback, PayloadType

# ---- receiver process ----------------------------------------------------------------------


def receiver_main(port: int) -> None:
    from aiohttp import web

    got: dict[str, list[int]] = {}  # schedule id -> [due, emitted, received ms]

    async def callback(request: web.Request) -> web.Response:
        at = time.time_ns() // 1_000_000
        await request.read()
        h = request.headers
        sid = h.get("Tocsin-Schedule-Id", "")
        if sid not in got:
            got[sid] = [int(h["Tocsin-Due-Ms"]), int(h["Tocsin-Emitted-Ms"]), at]
        return web.Response(status=200)

    async def control(request: web.Request) -> web.Response:
        if request.method == "POST":
            got.clear()
            return web.json_response({"ok": True})
        if request.query.get("count"):
            return web.json_response({"count": len(got)})
        return web.Response(body=orjson.dumps(got), content_type="application/json")

    app = web.Application()
    app.router.add_post("/cb", callback)
    app.router.add_route("*", "/control", control)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _get(port: int, query: str = "") -> Any:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/control{query}", timeout=30) as r:
        return orjson.loads(r.read())


# ---- the reference consumer ------------------------------------------------------------------


def proxy_read_ms(outcome: bytes | None) -> int | None:
    """When the proxy read the fire, from its delivery outcome: the outcome's wall time less
    its ``latency_ms`` (read -> outcome, the proxy's monotonic clock), to 1 ms."""
    try:
        v = orjson.loads(outcome or b"")
        return int(v["delivered_ms"]) - int(v["latency_ms"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class Watcher(threading.Thread):
    """Reads the fires and deliveries topics as they are written: per schedule id, when a fire
    became readable (this consumer's clock), its record timestamp, the record timestamp of
    its delivery outcome and when the proxy read it (from the outcome)."""

    def __init__(self, settings: Settings, fires: str, deliveries: str) -> None:
        super().__init__(daemon=True)
        from confluent_kafka import Consumer

        self.consumer = Consumer(
            {
                **settings.kafka.librdkafka(),
                "group.id": f"bench-delivery-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 5,
            }
        )
        self.consumer.subscribe([fires, deliveries])
        self.fires_topic = fires
        self.fire: dict[str, tuple[int, int]] = {}  # sid -> (readable ms, record ts)
        self.answered: dict[str, int] = {}  # sid -> outcome record ts
        self.read: dict[str, int] = {}  # sid -> when the proxy read the fire (its clock)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            m = self.consumer.poll(0.05)
            if m is None or m.error():
                continue
            at = now_ms()
            sid = (m.key() or b"").decode()
            ts = m.timestamp()[1]
            if m.topic() == self.fires_topic:
                self.fire.setdefault(sid, (at, ts))
            elif sid not in self.answered:
                self.answered[sid] = ts
                read = proxy_read_ms(m.value())
                if read is not None:
                    self.read[sid] = read
        self.consumer.close()


class NoReference:
    """``--no-reference``: no reader of the topics beside the proxy and the worker."""

    def __init__(self) -> None:
        self.fire: dict[str, tuple[int, int]] = {}
        self.answered: dict[str, int] = {}
        self.read: dict[str, int] = {}
        self.stop = threading.Event()

    def start(self) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


# ---- CPU from /proc --------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(settings: Settings) -> dict[str, int]:
    """The local stack's Kafka and Cassandra JVMs, from their pid files."""
    pids = {}
    for name in ("kafka", "cassandra"):
        pid_file = settings.stack.state_dir / name / "server.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text().split()[0])
            try:
                cpu_s(pid)
            except OSError:
                continue
            pids[name] = pid
    return pids


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of ``pid``'s threads by thread name (same names summed): the
    Python threads are all named after the process, librdkafka's ``rdk:...``."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        secs = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        out[name] = out.get(name, 0.0) + secs
    return out


def gc_pauses() -> dict[str, tuple[float, float, float]]:
    """The worker's collections so far by generation: (count, seconds paused, count over
    50 ms), from its ``tocsin_gc_pause_seconds``."""
    out = {}
    for gen in ("0", "1", "2"):
        h = histogram("tocsin_gc_pause_seconds", generation=gen)
        count = h.get("+Inf", 0.0)
        out[gen] = (count, h.get("sum", 0.0), count - h.get("0.05", 0.0))
    return out


def print_worker_detail(
    threads: dict[str, float], fires: int, rx: dict[str, list[int]], t0: int
) -> None:
    for name, secs in sorted(threads.items(), key=lambda kv: -kv[1]):
        if secs > 0:
            print(f"[delivery]   worker thread {name}: {secs * 1000 / fires:.3f} ms/fire")
    for line in worst_seconds(rx, t0):
        print(f"[delivery] worst due -> emitted: {line}")


def start_profiles(
    pids: dict[str, int], seconds: int, out_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """py-spy (a measuring tool, not a dependency: it must be in the venv) on each process
    over the firing window, collapsed stacks in ``out_dir/<name>.txt``."""
    spy = Path(sys.executable).with_name("py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(seconds),
                "--rate",
                "250",
                "--format",
                "raw",
                "--nonblocking",
                "--threads",
                "--output",
                str(out_dir / f"{name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]


def worst_seconds(rx: dict[str, list[int]], t0: int, top: int = 5) -> list[str]:
    """The due seconds with the worst due -> emitted p99: whether the worker's outliers
    cluster (a minute's bucket read, the start) or spread."""
    by_second: dict[int, list[int]] = {}
    for due, emitted, _ in rx.values():
        by_second.setdefault((due - t0) // 1000, []).append(emitted - due)
    rows = sorted(by_second.items(), key=lambda kv: -pct(kv[1], 0.99))[:top]
    return [
        f"second {s:>3} (due minute {((t0 + s * 1000) // 60_000) % 60:02d}:"
        f"{((t0 + s * 1000) // 1000) % 60:02d}): p50 {pct(v, 0.5):.0f} p99 {pct(v, 0.99):.0f}"
        f" max {max(v)} ms"
        for s, v in rows
    ]


# ---- the run ---------------------------------------------------------------------------------


def make_create(sid: str, due_ms: int, url: str) -> CreateCommand:
    return CreateCommand(
        tenant=TENANT,
        schedule_id=sid,
        request_id=sid,
        due_ms=due_ms,
        payload=orjson.dumps({"sid": sid}),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url=url, timeout_s=10),
        misfire_tolerance_s=3600,
    )


def hops(
    rx: dict[str, list[int]], watcher: Watcher | NoReference
) -> tuple[list[int], dict[str, list[int]]]:
    lateness: list[int] = []
    h: dict[str, list[int]] = {
        "due -> emitted": [],
        "emitted -> record timestamp": [],
        "emitted -> on the fires topic": [],
        "on the topic -> received": [],
        "on the topic -> read by the proxy": [],
        "read by the proxy -> received": [],
        "received -> answered": [],
    }
    for sid, (due, emitted, received) in rx.items():
        lateness.append(received - due)
        h["due -> emitted"].append(emitted - due)
        fire = watcher.fire.get(sid)
        if fire is not None:
            h["emitted -> record timestamp"].append(fire[1] - emitted)
            h["emitted -> on the fires topic"].append(fire[0] - emitted)
            h["on the topic -> received"].append(received - fire[0])
        read = watcher.read.get(sid)
        if read is not None:
            if fire is not None:
                h["on the topic -> read by the proxy"].append(read - fire[0])
            h["read by the proxy -> received"].append(received - read)
        answered = watcher.answered.get(sid)
        if answered is not None:
            h["received -> answered"].append(answered - received)
    return lateness, h


def run(args: argparse.Namespace) -> int:
    run_id = uuid.uuid4().hex[:6]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.dlv.{run_id}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_dlv_{run_id}",
            "TOCSIN_LOG_LEVEL": "WARNING",
            "TOCSIN_ALLOW_PRIVATE_TARGETS": "true",
            "TOCSIN_PROXY_METRICS_PORT": "0",
            "TOCSIN_PROXY_GROUP_ID": f"bench-dlv-{run_id}",
        }
    )
    settings = Settings.from_env(env)
    from schema.migrate import migrate
    from tocsin.demo import _register_tenant
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    _register_tenant(settings, TENANT)
    log = settings.stack.state_dir / f"bench-delivery-{run_id}.log"
    rx_proc = subprocess.Popen(
        [sys.executable, "-m", "bench.delivery", "--receiver", str(port)], cwd=REPO_ROOT
    )
    workers = start_workers(env, log, 1)
    with log.open("ab") as out:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tocsin", "proxy"],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    tocsin = {f"worker{i or ''}": w.proc.pid for i, w in enumerate(workers) if w.proc}
    pinning.place({**tocsin, "proxy": proxy.pid, "receiver": rx_proc.pid})
    try:
        return measure(args, settings, port, workers[0].proc, proxy, log, rx_proc.pid)  # type: ignore[arg-type]
    finally:
        os.killpg(proxy.pid, signal.SIGTERM)
        for w in workers:
            w.stop()
        proxy.wait(60)
        rx_proc.kill()
        rx_proc.wait(10)
        cleanup(settings)


def measure(
    args: argparse.Namespace,
    settings: Settings,
    port: int,
    worker: subprocess.Popen[bytes],
    proxy: subprocess.Popen[bytes],
    log: Path,
    receiver_pid: int,
) -> int:
    url = f"http://127.0.0.1:{port}/cb"
    for _ in range(100):
        try:
            _get(port, "?count=1")
            break
        except OSError:
            time.sleep(0.1)
    probe = ResultWatcher(settings)
    c = CommandClient(settings)
    c.send(make_create("probe", now_ms() + 3_600_000, url))
    c.flush()
    assert probe.wait_for(["probe"], 120), f"worker did not start; see {log}"
    probe.close()
    from topics.catalog import catalog

    cat = catalog(settings.topics)
    # Without it Kafka serves no reader but the proxy and the worker, and only the due ->
    # emitted hop is known: what Kafka's share of fire_cpu_ms owes to the bench itself.
    watcher: Watcher | NoReference = NoReference()
    if not args.no_reference:
        watcher = Watcher(settings, cat.fires.name, cat.deliveries.name)
    watcher.start()
    n = args.rate * args.seconds
    lead_s = n / 700 + 25  # creates at a pessimistic 700/s, then the proxy's group join
    t0 = now_ms() + int(lead_s * 1000)
    run_id = uuid.uuid4().hex[:6]
    creates = [make_create(f"dl-{run_id}-{i}", t0 + (i * 1000) // args.rate, url) for i in range(n)]
    print(f"[delivery] {n} schedules, {args.rate}/s over {args.seconds} s from +{lead_s:.0f} s")
    send_and_count(settings, creates, window=20_000, label="delivery ingest")
    _get(port, "")  # warm the control path; the receiver keeps only first deliveries
    if now_ms() > t0:
        print("[delivery] creates took longer than the lead time; lateness includes that")
    pids = {"worker": worker.pid, "proxy": proxy.pid, **server_pids(settings)}
    time.sleep(max(0.0, (t0 - now_ms()) / 1000))
    cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
    rx_cpu0 = cpu_s(receiver_pid)
    threads0 = thread_cpu_s(worker.pid)
    gc0 = gc_pauses()
    load0 = loadavg()
    profiles = []
    if args.profile:
        tocsin = {"worker": worker.pid, "proxy": proxy.pid}
        profiles = start_profiles(tocsin, args.seconds, Path(args.profile))
    time.sleep(args.seconds + 1)  # the firing window and the last fire's delivery
    cpu = {name: cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
    rx_cpu = cpu_s(receiver_pid) - rx_cpu0
    threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu_s(worker.pid).items()}
    gc1 = gc_pauses()
    load1 = loadavg()
    for spy in profiles:
        spy.wait(30)
    deadline = time.monotonic() + 60
    while _get(port, "?count=1")["count"] < n and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2)  # the last outcomes reach the deliveries topic
    watcher.stop.set()
    watcher.join(10)
    rx: dict[str, list[int]] = _get(port)
    rx.pop("probe", None)
    delivered_in_window = sum(1 for v in rx.values() if v[2] <= t0 + (args.seconds + 1) * 1000)
    lateness, per_hop = hops(rx, watcher)
    missing = n - len(rx)
    lateness += [10**9] * missing  # undelivered count as infinitely late
    print(f"[delivery] load average {load0} at start, {load1} at end of the firing window")
    print(f"[delivery] delivered {len(rx)}/{n}; early {sum(1 for x in lateness if x < 0)}")
    print(f"{'hop':32} {'p50 ms':>8} {'p99 ms':>8}")
    for name, values in per_hop.items():
        print(f"{name:32} {pct(values, 0.5):8.0f} {pct(values, 0.99):8.0f}")
    fires = max(1, delivered_in_window)
    for name, secs in cpu.items():
        print(
            f"[delivery] {name} CPU {secs / (args.seconds + 1):.2f} s/s, "
            f"{secs * 1000 / fires:.3f} ms/fire"
        )
    print_worker_detail(threads, fires, rx, t0)
    for gen, (count, secs, long) in gc1.items():
        c0, s0, l0 = gc0[gen]
        print(
            f"[delivery] worker GC generation {gen} in the window: {count - c0:.0f} collections, "
            f"{(secs - s0) * 1000:.0f} ms paused, {long - l0:.0f} over 50 ms"
        )
    # The receiver shares the machine but is not counted in fire_cpu_ms (another service's).
    print(
        f"[delivery] receiver CPU {rx_cpu / (args.seconds + 1):.2f} s/s, "
        f"{rx_cpu * 1000 / fires:.3f} ms/fire (not counted in fire_cpu_ms)"
    )
    results = [
        f"RESULT delivery_lateness_p50_ms={pct(lateness, 0.5):.0f} ms",
        f"RESULT delivery_lateness_p99_ms={pct(lateness, 0.99):.0f} ms",
        f"RESULT fire_cpu_ms={sum(cpu.values()) * 1000 / fires:.3f} ms",
        f"RESULT delivery_missing={missing} fires",
    ]
    results += [f"RESULT fire_cpu_{k}_ms={v * 1000 / fires:.3f} ms" for k, v in cpu.items()]
    for line in results:
        print(line)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=int, default=1000, help="fires per second")
    ap.add_argument("--seconds", type=int, default=30, help="firing window")
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="py-spy the worker and the proxy over the firing window (collapsed stacks in DIR)",
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="no reference consumer (its fetches are part of Kafka's CPU); hops after "
        "due -> emitted are not measured",
    )
    pinning.add_argument(ap)
    args = ap.parse_args()
    if args.receiver:
        receiver_main(args.receiver)
        return 0
    pinning.begin(args.pin)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Idle worker benchmark (``make bench-worker-idle``): what one worker costs with nothing to do.

One real ``tocsin worker`` runs against the local stack in a fresh topic prefix and keyspace
(removed at the end), owning all the commands partitions (``TOCSIN_COMMAND_PARTITIONS``,
default 8) with an empty bucket table. Once it owns every partition, answers ``/readyz``
and its tickers have caught up (``--settle-s`` more seconds, for the first bucket reads and
the group's first commits), its CPU is measured over ``--seconds`` (default 60) with nothing
due and nothing arriving.

``worker_idle_cpu`` is the worker process's user + system CPU seconds (all threads, and
children if it had any: /proc/<pid>/stat utime+stime+cutime+cstime) per wall second.
``worker_idle_kafka_cpu`` and ``worker_idle_cassandra_cpu`` are the same for the local
stack's Kafka and Cassandra servers over the same window (found by their pid files), since
an idle worker's polling (fetches, heartbeats, commits, bucket and checkpoint queries) costs
the servers too. Those two are shared with whatever else runs on the machine, so they are
an upper bound of the worker's share; ``--baseline-s`` first measures them for that long
with no worker running, for comparison.

Beside them it prints the worker's wake-ups: voluntary context switches per second summed
over its threads (/proc/<pid>/task/*/status), each one a thread that went to sleep and
was woken again, and the deltas of a few worker metrics (bucket queries and loads, fetch
rounds).

CPU time is charged to a process only while it runs, so it is much less sensitive to other
load on this shared machine than wall-clock figures, though not immune (cache and
frequency effects, and the servers' figures include everyone's requests); the load average
is printed with each run.

``--repo PATH`` runs the worker from another checkout of the code (e.g. a ``git worktree``
of an older commit), for before/after comparisons in one sitting; ``--env K=V`` (repeated)
adds worker settings; ``--runs N`` measures N windows on the same worker (the median
window is reported); ``--py-spy PATH`` records a py-spy profile of the worker (collapsed stacks,
running stacks only, by thread) over an extra window after the measured ones (the sampling costs the
worker CPU, so never during them).

Prints ``RESULT name=value unit`` lines last. Run it under ``flock /tmp/bench.lock`` (the
Makefile target does), so that benchmarks do not overlap.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from base.settings import REPO_ROOT, Settings
from bench import pinning
from bench.api import free_port
from bench.scheduler import Worker, cleanup, metric, server_pids

# Worker metrics whose change over the window says what the worker did while idle.
WATCHED = (
    "tocsin_bucket_queries_total",
    "tocsin_bucket_loads_total",
    "tocsin_consumer_fetch_rounds_total",  # (0 on code without streams.fetch_wait)
)


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) and of its waited-for
    children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Voluntary context switches summed over the process's threads: each is a thread that
    blocked (a sleep, a poll, a lock) and was woken again."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def threads(pid: int) -> dict[str, int]:
    """Voluntary context switches per thread, keyed by name and thread id (the main thread
    as ``main``: where the event loop, and so every asyncio timer, runs; Python's other
    threads are all named ``python``, librdkafka's ``rdk:*``)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            name = "main" if task.name == str(pid) else f"{comm}/{task.name}"
            lines = (task / "status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("voluntary_ctxt_switches:"):
                out[name] = out.get(name, 0) + int(line.split()[1])
    return out


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_idle(port: int, partitions: int, deadline: float, log: Path) -> None:
    """Until the worker owns every partition, is ready and has no bucket backlog."""
    while True:
        try:
            owned = metric("tocsin_owned_partitions", [port])
            backlog = metric("tocsin_catchup_backlog_minutes", [port])
        except OSError:  # its metrics server is not up yet
            owned, backlog = -1, -1
        if owned == partitions and backlog == 0 and ready(port):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"worker owns {owned} of {partitions} partitions; see {log}")
        time.sleep(0.5)


def measure(pids: dict[str, int], seconds: float, port: int) -> dict[str, float]:
    """CPU s/s of each process over ``seconds``, the worker's wake-ups/s and metric deltas."""
    worker = pids["worker"]
    cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
    wake0, per_thread0 = wakeups(worker), threads(worker)
    metrics0 = {name: metric(name, [port]) for name in WATCHED}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    out = {name: (proc_cpu_s(pid) - cpu0[name]) / wall for name, pid in pids.items()}
    out["wakeups"] = (wakeups(worker) - wake0) / wall
    for name in WATCHED:
        out[name] = (metric(name, [port]) - metrics0[name]) / wall
    per_thread = threads(worker)
    busiest = sorted(
        ((n - per_thread0.get(name, 0)) / wall, name) for name, n in per_thread.items()
    )[::-1][:8]
    print(
        "[idle] wake-ups/s by thread: " + ", ".join(f"{name} {rate:.1f}" for rate, name in busiest),
        flush=True,
    )
    return out


def py_spy(pid: int, out: str, seconds: float) -> None:
    exe = Path(sys.executable).parent / "py-spy"
    if not exe.exists():
        print("[py-spy] not found beside the interpreter; no profile recorded", flush=True)
        return
    cmd = [str(exe), "record", "-p", str(pid), "-o", out, "-d", str(int(seconds))]
    cmd += ["-r", "200", "-f", "raw", "--threads", "--nonblocking"]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    print(f"[py-spy] worker profile: {out}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window")
    parser.add_argument("--runs", type=int, default=1, help="measured windows, same worker")
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--baseline-s", type=float, default=0.0)
    parser.add_argument("--repo", type=Path, default=REPO_ROOT, help="checkout to run from")
    parser.add_argument("--env", action="append", default=[], help="K=V worker setting")
    parser.add_argument("--py-spy", dest="py_spy", default=None, help="profile path")
    pinning.add_argument(parser)
    args = parser.parse_args()
    pinning.begin(args.pin)

    run = uuid.uuid4().hex[:6]
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.idle.{run}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_idle_{run}",
            "TOCSIN_LOG_LEVEL": "WARNING",
        }
    )
    for kv in args.env:
        key, _, value = kv.partition("=")
        env[key] = value
    settings = Settings.from_env(env)
    partitions = settings.topics.command_partitions
    from schema.migrate import migrate
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    servers = server_pids(settings)
    load0 = os.getloadavg()
    results: list[str] = []
    baseline: dict[str, float] = {}
    if args.baseline_s > 0 and servers:
        cpu0 = {name: proc_cpu_s(pid) for name, pid in servers.items()}
        t0 = time.monotonic()
        time.sleep(args.baseline_s)
        wall = time.monotonic() - t0
        baseline = {n: (proc_cpu_s(p) - cpu0[n]) / wall for n, p in servers.items()}
        shown = ", ".join(f"{n} {v:.4f}" for n, v in baseline.items())
        print(f"[baseline] no worker: {shown} s/s", flush=True)

    port, web = free_port(), free_port()
    log = settings.stack.state_dir / f"bench-worker-idle-{run}.log"
    worker = Worker(
        {**env, "TOCSIN_METRICS_PORT": str(port), "TOCSIN_WORKER_WEB_PORT": str(web)}, log
    )
    # The worker's modules come from --repo: ``python -m`` puts the working directory first.
    with log.open("ab") as out:
        worker.proc = subprocess.Popen(
            [sys.executable, "-m", *worker.command],
            env=worker.env,
            cwd=args.repo,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert worker.proc is not None
        pinning.place({"worker": worker.proc.pid})
        wait_idle(port, partitions, time.monotonic() + 180, log)
        time.sleep(args.settle_s)
        pids = {"worker": worker.proc.pid, **servers}
        figures: list[dict[str, float]] = []
        for i in range(max(1, args.runs)):
            got = measure(pids, args.seconds, port)
            figures.append(got)
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            shown = ", ".join(f"{n} {got[n]:.4f}" for n in pids)
            print(
                f"[idle {i + 1}] {args.seconds:.0f} s: CPU {shown} s/s; worker wake-ups "
                f"{got['wakeups']:.0f}/s; bucket queries {got[WATCHED[0]]:.2f}/s; "
                f"fetches {got[WATCHED[2]]:.1f}/s; "
                f"load average {load}",
                flush=True,
            )
        if args.py_spy:
            py_spy(worker.proc.pid, args.py_spy, args.seconds)
    finally:
        worker.stop()
        cleanup(settings)
    # The median window by worker CPU (a single run: that run).
    best = sorted(figures, key=lambda f: f["worker"])[len(figures) // 2]
    print(f"[idle] load average at start {', '.join(f'{x:.2f}' for x in load0)}", flush=True)
    results.append(f"RESULT worker_idle_cpu={best['worker']:.4f} s/s")
    for name in servers:
        results.append(f"RESULT worker_idle_{name}_cpu={best[name]:.4f} s/s")
        if name in baseline:
            results.append(f"RESULT worker_idle_{name}_baseline_cpu={baseline[name]:.4f} s/s")
    results.append(f"RESULT worker_idle_wakeups={best['wakeups']:.0f} per_s")
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cassandra round trip with and without TCP_NODELAY, and the driver's CPU per request
with native protocol v4 and v5 (``make bench-cassandra``).

Why it exists: cassandra-driver leaves Nagle's algorithm on unless ``sockopts`` says
otherwise. A request over about 4 KB (an 11-row batch of this shape; 10 rows are not
delayed) then waits for the server's delayed ACK (about 40 ms on Linux) before its tail
leaves: 43.6 ms against 0.9 ms with TCP_NODELAY, on an idle local node. Every grouped
write of the command agent (bucket rows, listing index, schedule rows with their events)
and of the ticker is that large. ``base.cassandra.make_cluster`` now sets TCP_NODELAY.

Against the local stack's Cassandra, in a scratch keyspace (dropped at the end): waves
of ``--concurrency`` unlogged batches of ``--rows`` rows (one partition each, the shape
of the command agent's bucket writes), sent together and awaited, ``--waves`` times,
with the project's cluster settings, once as they are (TCP_NODELAY) and once with
``sockopts=[]`` (the driver's default).

Then the client's CPU per request (``time.process_time`` of this process, which runs the
driver's I/O thread too) for protocol v4 and v5, alternating, ``--cpu-rounds`` rounds:
``--cpu-requests`` prepared single-row inserts, a fifth as many 16-row unlogged batches
and as many point reads, ``--cpu-in-flight`` at a time. v5 frames every message in
checksummed segments whose CRC24 the driver computes in a Python loop; Tocsin speaks v4
(settings: ``CassandraSettings.protocol_version``). Prints ``RESULT`` lines last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from base.cassandra import make_cluster
from base.settings import Settings


def measure(sockopts: list[tuple[int, int, int]] | None, args: argparse.Namespace) -> list[float]:
    from cassandra.query import BatchStatement, BatchType

    settings = Settings.from_env().cassandra
    overrides = {} if sockopts is None else {"sockopts": sockopts}
    cluster = make_cluster(settings, **overrides)
    session = cluster.connect()
    try:
        ks = args.keyspace
        session.execute(
            f"CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = "
            "{'class': 'SimpleStrategy', 'replication_factor': 1}"
        )
        session.execute(
            f"CREATE TABLE IF NOT EXISTS {ks}.rows "
            "(p int, m bigint, c text, v blob, PRIMARY KEY ((p, m), c))"
        )
        insert = session.prepare(f"INSERT INTO {ks}.rows (p, m, c, v) VALUES (?, ?, ?, ?)")
        waves_ms = []
        for wave in range(args.waves + 5):  # the first 5 warm up
            batches = []
            for p in range(args.concurrency):
                batch = BatchStatement(batch_type=BatchType.UNLOGGED)
                for _ in range(args.rows):
                    batch.add(insert, (p, wave, uuid.uuid4().hex, b"x" * 300))
                batches.append(batch)
            t0 = time.perf_counter()
            futures = [session.execute_async(b) for b in batches]
            for f in futures:
                f.result()
            if wave >= 5:
                waves_ms.append((time.perf_counter() - t0) * 1000)
        return waves_ms
    finally:
        cluster.shutdown()


def cpu_per_request(version: int, args: argparse.Namespace) -> dict[str, float]:
    """Microseconds of this process's CPU per request, by request kind, with ``version``."""
    from cassandra.query import BatchStatement, BatchType

    cluster = make_cluster(Settings.from_env().cassandra, protocol_version=version)
    session = cluster.connect()
    try:
        ks = args.keyspace
        insert = session.prepare(f"INSERT INTO {ks}.rows (p, m, c, v) VALUES (?, ?, ?, ?)")
        select = session.prepare(f"SELECT * FROM {ks}.rows WHERE p = ? AND m = ? AND c = ?")

        def run(n: int, make: Callable[[int], Any]) -> float:
            done = threading.Semaphore(0)
            slots = threading.Semaphore(args.cpu_in_flight)
            errors: list[BaseException] = []

            def ok(_rows: Any) -> None:
                slots.release()
                done.release()

            def failed(exc: BaseException) -> None:
                errors.append(exc)
                ok(None)

            t0 = time.process_time()
            for i in range(n):
                slots.acquire()
                session.execute_async(make(i)).add_callbacks(ok, failed)
            for _ in range(n):
                done.acquire()
            if errors:
                raise SystemExit(f"{len(errors)} requests failed: {errors[0]!r}")
            return (time.process_time() - t0) / n * 1e6

        def batch(i: int) -> Any:
            b = BatchStatement(batch_type=BatchType.UNLOGGED)
            for j in range(16):
                b.add(insert, (i % 50, 0, f"b{i}-{j}", b"x" * 300))
            return b

        n = args.cpu_requests
        return {
            "insert": run(n, lambda i: insert.bind((i % 50, 1, f"r{i}", b"x" * 300))),
            "batch16": run(max(1, n // 5), batch),
            "read": run(n, lambda i: select.bind((i % 50, 1, f"r{i}"))),
        }
    finally:
        cluster.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--waves", type=int, default=50)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--keyspace", default=f"bench_nodelay_{uuid.uuid4().hex[:6]}")
    parser.add_argument("--cpu-rounds", type=int, default=2)
    parser.add_argument("--cpu-requests", type=int, default=5000)
    parser.add_argument("--cpu-in-flight", type=int, default=64)
    args = parser.parse_args()
    results = {}
    cpu: dict[int, list[dict[str, float]]] = {4: [], 5: []}
    try:
        for name, sockopts in (("driver_default", []), ("tocsin", None)):
            waves = sorted(measure(sockopts, args))
            p50, p99 = statistics.median(waves), waves[int(0.99 * (len(waves) - 1))]
            print(
                f"[{name}] {args.waves} waves of {args.concurrency} x {args.rows}-row batches: "
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms",
                flush=True,
            )
            results[name] = p50
        for _ in range(args.cpu_rounds):
            for version in (4, 5):
                us = cpu_per_request(version, args)
                cpu[version].append(us)
                print(
                    f"[protocol v{version}] client CPU per request: "
                    + ", ".join(f"{k} {v:.0f} us" for k, v in us.items()),
                    flush=True,
                )
    finally:
        cluster = make_cluster(Settings.from_env().cassandra)
        try:
            cluster.connect().execute(f"DROP KEYSPACE IF EXISTS {args.keyspace}")
        finally:
            cluster.shutdown()
    print(f"RESULT cassandra_wave_p50_ms_driver_default={results['driver_default']:.1f} ms")
    print(f"RESULT cassandra_wave_p50_ms_tcp_nodelay={results['tocsin']:.1f} ms")
    for version in (4, 5):
        for kind in ("insert", "batch16", "read"):
            median = statistics.median(r[kind] for r in cpu[version])
            print(f"RESULT cassandra_client_cpu_us_{kind}_v{version}={median:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

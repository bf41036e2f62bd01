"""Recurring-schedule benchmark (``make bench-cron``): N schedules firing every minute.

``--workers`` (2) real ``tocsin worker`` subprocesses of one deployment on the local stack,
in a fresh topic prefix and keyspace (removed at the end). Phases:

1. create ``--schedules`` (100,000) recurring schedules ``* * * * *`` through the commands
   topic, like any client (not inserted into Cassandra directly), each with a flexible
   window of ``--jitter-s`` seconds so the minute's runs are spread instead of all firing
   at second 0 (``--jitter-s 0`` measures the herd);
2. wait until the worker's materialisers have written the first runs of every schedule;
3. measure ``--minutes`` whole minutes: every trigger read back from the fire topic counts
   once per run id; lateness = the trigger's emit time minus its (jittered) due time, as
   stamped by the worker; worker CPU = the workers' CPU seconds / wall seconds over the
   window (summed over the workers).

Prints ``RESULT name=value unit`` lines last: cron_fires_per_min (distinct runs fired per
measured minute), cron_lateness_p99_ms, cron_worker_cpu, plus the runs expected and
missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

import orjson

from base.settings import Settings
from bench.scheduler import (
    TENANT,
    Worker,
    cleanup,
    histogram,
    metric,
    now_ms,
    pct,
    send_and_count,
    start_workers,
)
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.recurring import jitter_ms, parse_run_id, run_id
from topics.models import CreateCommand, HttpCallback, PayloadType, Recurrence


def make_recurring(sid: str, jitter_s: int) -> CreateCommand:
    return CreateCommand(
        tenant=TENANT,
        schedule_id=sid,
        request_id=sid,
        payload=orjson.dumps({"sid": sid}),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(cron="0 * * * * *", jitter_s=jitter_s),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--jitter-s", type=int, default=55)
    parser.add_argument("--minutes", type=int, default=5)
    parser.add_argument("--horizon-s", type=int, default=600)
    parser.add_argument("--window", type=int, default=20_000)
    # The scheduler scales by partitions across worker processes; one Python process is
    # bound to about one core (the GIL), and 100,000 runs a minute need more than that.
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    return parser.parse_args()


def wait_for_workers(settings: Settings, log: Path, workers: list[Worker]) -> None:
    probe = ResultWatcher(settings)
    client = CommandClient(settings)
    client.send(make_recurring("probe", 0))
    client.flush()
    assert probe.wait_for(["probe"], 120), f"worker did not start; see {log}"
    probe.close()
    if len(workers) > 1:
        time.sleep(15)  # let the group settle over every worker before creating


def create_schedules(settings: Settings, sids: list[str], jitter_s: int, window: int) -> None:
    t0 = time.monotonic()
    accepted, _, _ = send_and_count(
        settings,
        [make_recurring(s, jitter_s) for s in sids],
        window=window,
        label="create",
    )
    print(
        f"[create] {accepted}/{len(sids)} recurring schedules accepted in "
        f"{time.monotonic() - t0:.0f} s",
        flush=True,
    )


def wait_materialised(schedules: int, horizon_s: int) -> None:
    # Wait for the first materialisation of every schedule: each writes one horizon of
    # minutely runs at once. (Counting extension steps instead, as this did first,
    # returned early: schedules created first had extended several times already.)
    deadline = time.monotonic() + 900
    first_runs = schedules * max(1, horizon_s // 60)
    while metric("tocsin_recurring_runs_materialized_total") < 0.98 * first_runs:
        if time.monotonic() > deadline:
            print("[materialise] timed out", flush=True)
            break
        print(
            f"[materialise] {metric('tocsin_recurring_extended_total'):.0f} schedules "
            f"extended, {metric('tocsin_recurring_runs_materialized_total'):.0f} runs",
            flush=True,
        )
        time.sleep(5)


class CpuWindow:
    """The workers' CPU seconds per wall second over the measured minutes, read once when
    the last minute ends (or when the measurement stops before that)."""

    def __init__(self, workers: list[Worker], first_minute: int, last_minute: int) -> None:
        self.workers = workers
        self.first_minute = first_minute
        self.last_minute = last_minute
        self.start: tuple[float, float] | None = None  # (CPU s, monotonic s)
        self.done = False
        self.ratio = float("nan")

    def _cpu_s(self) -> float:
        return sum(w.cpu_s() for w in self.workers)

    def _measure(self) -> float:
        assert self.start is not None
        cpu0, wall0 = self.start
        return (self._cpu_s() - cpu0) / (time.monotonic() - wall0)

    def begin_if_due(self) -> None:
        if self.start is None and now_ms() >= self.first_minute:
            self.start = (self._cpu_s(), time.monotonic())

    def end_if_due(self) -> None:
        if self.start is not None and not self.done and now_ms() >= self.last_minute:
            self.ratio = self._measure()
            self.done = True
            print(f"[measure] worker CPU {self.ratio:.2f} s/s", flush=True)

    def finish(self) -> float:
        if self.start is not None and not self.done:
            self.ratio = self._measure()
        return self.ratio


def collect_fires(
    fires: FireWatcher,
    expected: dict[str, int],
    cpu: CpuWindow,
    wait_until_ms: int,
) -> dict[str, int]:
    """Lateness (ms) of each expected run fired in the measured minutes, counted once."""
    seen: dict[str, int] = {}
    next_note = time.monotonic() + 15
    while now_ms() < wait_until_ms and len(seen) < len(expected):
        cpu.begin_if_due()
        for trig, _ in fires.poll(0.5):
            parsed = parse_run_id(trig.schedule_id)
            if parsed is None or not cpu.first_minute <= parsed[1] < cpu.last_minute:
                continue
            if trig.schedule_id in expected and trig.schedule_id not in seen:
                seen[trig.schedule_id] = trig.emitted_ms - trig.due_ms
        cpu.end_if_due()
        if time.monotonic() > next_note:
            next_note += 15
            print(
                f"[measure] {len(seen)}/{len(expected)} runs fired, p99 lateness so far "
                f"{pct(list(seen.values()), 0.99):.0f} ms",
                flush=True,
            )
    return seen


def print_worker_pauses() -> None:
    """Where late fires come from inside the workers (streams.metrics): how often their
    event loop woke late, and their Python GC pauses, since the workers started."""
    lag = histogram("tocsin_event_loop_lag_seconds")
    if lag:
        total = lag.get("+Inf", 0.0)
        print(
            "[measure] event-loop lag over the run: "
            + ", ".join(
                f"> {le} s: {total - lag.get(le, total):.0f}" for le in ("0.1", "0.25", "0.5", "1")
            )
            + f" of {total:.0f} wake-ups",
            flush=True,
        )
    for gen in ("0", "1", "2"):
        pauses = histogram("tocsin_gc_pause_seconds", generation=gen)
        if pauses:
            count = pauses.get("+Inf", 0.0)
            print(
                f"[measure] GC generation {gen}: {count:.0f} pauses, "
                f"{pauses.get('sum', 0):.1f} s in all, "
                f"{count - pauses.get('0.1', count):.0f} over 0.1 s, "
                f"{count - pauses.get('0.5', count):.0f} over 0.5 s",
                flush=True,
            )


def measure(
    settings: Settings, workers: list[Worker], sids: list[str], args: argparse.Namespace
) -> list[str]:
    fires = FireWatcher(settings)
    # Measure whole minutes starting at the next minute boundary + 1 (warm-up).
    first_minute = (now_ms() // 60_000 + 2) * 60_000
    last_minute = first_minute + args.minutes * 60_000  # exclusive
    print(
        f"[measure] minutes {first_minute} .. {last_minute} "
        f"(starts in {(first_minute - now_ms()) / 1000:.0f} s)",
        flush=True,
    )
    expected = {
        run_id(s, m): m + jitter_ms(TENANT, run_id(s, m), args.jitter_s)
        for m in range(first_minute, last_minute, 60_000)
        for s in sids
    }
    cpu = CpuWindow(workers, first_minute, last_minute)
    wait_until = last_minute + 60_000 + args.jitter_s * 1000
    seen = collect_fires(fires, expected, cpu, wait_until)
    fires.close()
    print_worker_pauses()
    lateness = list(seen.values()) + [10**9] * (len(expected) - len(seen))
    missing = len(expected) - len(seen)
    results_cpu = cpu.finish()
    return [
        f"RESULT cron_schedules={len(sids)} schedules",
        f"RESULT cron_runs_expected={len(expected)} runs",
        f"RESULT cron_runs_missing={missing} runs",
        f"RESULT cron_lateness_p50_ms={pct(lateness, 0.5):.0f} ms",
        f"RESULT cron_fires_per_min={len(seen) / args.minutes:.0f} fires/min",
        f"RESULT cron_lateness_p99_ms={pct(lateness, 0.99):.0f} ms",
        f"RESULT cron_worker_cpu={results_cpu:.2f} ratio",
    ]


def main() -> int:
    args = parse_args()

    run = uuid.uuid4().hex[:6]
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": f"bench.{run}.",
            "TOCSIN_CASSANDRA_KEYSPACE": f"bench_{run}",
            "TOCSIN_LOG_LEVEL": "WARNING",
            "TOCSIN_RECURRING_HORIZON_S": str(args.horizon_s),
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
    log = settings.stack.state_dir / f"bench-cron-worker-{run}.log"
    workers = start_workers(env, log, args.workers)
    results: list[str] = []
    try:
        wait_for_workers(settings, log, workers)
        sids = [f"cron-{run}-{i}" for i in range(args.schedules)]
        create_schedules(settings, sids, args.jitter_s, args.window)
        wait_materialised(args.schedules, args.horizon_s)
        results = measure(settings, workers, sids, args)
    finally:
        for w in workers:
            w.stop()
        cleanup(settings)
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

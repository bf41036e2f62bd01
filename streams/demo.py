"""The README's first command: a worker, a few thousand schedules, watched while they fire.

Starts a ``tocsin worker`` subprocess against the local stack, registers a ``demo``
tenant, creates ``count`` schedules due over the next ``spread_s`` seconds, prints
progress while the fire topic fills, and a summary (fired, missed, lateness p50/p99).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import orjson

from streams.client import CommandClient, FireWatcher, ResultWatcher
from tocsin.settings import REPO_ROOT, Settings
from topics.ids import trigger_id
from topics.models import CreateCommand, KafkaCallback, PayloadType


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _register_tenant(settings: Settings, tenant: str) -> None:
    from streams.store import Store

    async def go() -> None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            await store.put_tenant(
                tenant, active=True, created_ms=time.time_ns() // 10**6, config="{}"
            )
        finally:
            await store.close()

    asyncio.run(go())


def run_demo(settings: Settings, *, count: int = 3000, spread_s: int = 120) -> int:
    tenant = "demo"
    _register_tenant(settings, tenant)
    log_path = settings.stack.state_dir / "demo-worker.log"
    print(f"[demo] starting a worker (log: {log_path})", flush=True)
    with log_path.open("ab") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", "worker"],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return _drive(settings, tenant, count, spread_s, worker)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)


def _drive(
    settings: Settings, tenant: str, count: int, spread_s: int, worker: subprocess.Popen[bytes]
) -> int:
    client, results, fires = CommandClient(settings), ResultWatcher(settings), FireWatcher(settings)
    run = uuid.uuid4().hex[:6]
    callback = KafkaCallback(topic=f"{settings.topics.prefix}demo-callbacks", key=None)

    probe = f"demo-{run}-probe"
    client.send(
        CreateCommand(
            tenant=tenant,
            schedule_id=probe,
            due_ms=time.time_ns() // 10**6 + 3_600_000,
            callback=callback,
            misfire_tolerance_s=3600,
        )
    )
    client.flush()
    if probe not in results.wait_for([probe], timeout_s=120):
        print("[demo] the worker did not answer within 120 s; see its log", flush=True)
        return 1

    start_ms = time.time_ns() // 10**6 + 10_000
    due: dict[str, int] = {}
    for i in range(count):
        sid = f"demo-{run}-{i}"
        due_ms = start_ms + (i * spread_s * 1000) // count
        due[trigger_id(tenant, sid, due_ms)] = due_ms
        client.send(
            CreateCommand(
                tenant=tenant,
                schedule_id=sid,
                request_id=f"{run}-{i}",
                due_ms=due_ms,
                payload=orjson.dumps({"demo": run, "n": i}),
                payload_type=PayloadType.JSON,
                callback=callback,
                misfire_tolerance_s=300,
            )
        )
    client.flush()
    print(f"[demo] {count} schedules sent, due from +10 s over {spread_s} s", flush=True)

    accepted = rejected = 0
    lateness: list[int] = []
    seen: set[str] = set()
    duplicates = 0
    deadline = time.monotonic() + spread_s + 90
    next_report = time.monotonic() + 5
    while len(seen) < count and time.monotonic() < deadline:
        for r in results.poll(0.05):
            sid = r.schedule_id or ""
            if sid.startswith(f"demo-{run}-") and sid != probe:
                if str(r.status) == "accepted":
                    accepted += 1
                else:
                    rejected += 1
        for trig, _ in fires.poll(0.2):
            if trig.trigger_id not in due:
                continue
            if trig.trigger_id in seen:
                duplicates += 1
                continue
            seen.add(trig.trigger_id)
            lateness.append(trig.emitted_ms - trig.due_ms)
        if time.monotonic() >= next_report:
            next_report += 5
            print(
                f"[demo] accepted {accepted}/{count}  fired {len(seen)}/{count}  "
                f"lateness p50 {_percentile(lateness, 0.5):.0f} ms "
                f"p99 {_percentile(lateness, 0.99):.0f} ms",
                flush=True,
            )
        if worker.poll() is not None:
            print("[demo] the worker exited unexpectedly; see its log", flush=True)
            return 1
    missed = count - len(seen)
    early = sum(1 for v in lateness if v < 0)
    print("[demo] summary", flush=True)
    print(f"  scheduled  {count} (accepted {accepted}, rejected {rejected})")
    print(f"  fired      {len(seen)}   duplicates {duplicates}   early {early}")
    print(f"  missed     {missed}")
    print(
        f"  lateness   p50 {_percentile(lateness, 0.5):.0f} ms   "
        f"p99 {_percentile(lateness, 0.99):.0f} ms   max {max(lateness, default=0)} ms"
    )
    for closable in (results, fires):
        closable.close()
    return 0 if missed == 0 and early == 0 else 1

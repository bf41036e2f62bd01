"""``tocsin status`` on the real stack: a tenant's scheduled, upcoming, fired and delivered
schedules, and the worker's consumer lag."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import orjson

from base.settings import REPO_ROOT, Settings
from streams.client import CommandClient, ResultWatcher
from streams.store import Store
from tests.integration.conftest import wait_worker_ready
from topics.models import CancelCommand, CreateCommand, HttpCallback


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _tocsin(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        TOCSIN_TOPIC_PREFIX=settings.topics.prefix,
        TOCSIN_CASSANDRA_KEYSPACE=settings.cassandra.keyspace,
        TOCSIN_COMMAND_PARTITIONS=str(settings.topics.command_partitions),
        TOCSIN_FIRE_PARTITIONS=str(settings.topics.fire_partitions),
        TOCSIN_LOG_LEVEL="WARNING",
    )
    return subprocess.run(
        [sys.executable, "-m", "tocsin.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _store_call(settings: Settings, fn: Any) -> Any:
    async def run() -> Any:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(run())


def test_status_reports_a_tenants_schedules(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    name = f"status-{uuid.uuid4().hex[:8]}"
    registered = _tocsin(real_stack, "tenant", "register", name, "--no-print-keys")
    assert registered.returncode == 0, registered.stderr
    worker = worker_factory.make("status")
    wait_worker_ready(real_stack, tenant, worker=worker)

    client, results = CommandClient(real_stack), ResultWatcher(real_stack)
    base = now_ms()
    due = {
        "soon": base + 3_000,  # fires during the test
        "in-10m": base + 10 * 60_000,
        "in-20m": base + 20 * 60_000,
        "in-40m": base + 40 * 60_000,
        "cancelled": base + 30 * 60_000,
        "in-5h": base + 5 * 3_600_000,
    }
    ids = {key: f"{key}-{uuid.uuid4().hex[:6]}" for key in due}
    for key, at in due.items():
        client.send(
            CreateCommand(
                tenant=name,
                schedule_id=ids[key],
                request_id=f"r-{ids[key]}",
                due_ms=at,
                callback=HttpCallback(url="https://receiver.example/cb"),
                misfire_tolerance_s=3600,
            )
        )
    client.flush()
    answers = results.wait_for(list(ids.values()), timeout_s=60)
    assert {sid: str(a.status) for sid, a in answers.items()} == {
        sid: "accepted" for sid in ids.values()
    }
    client.send(CancelCommand(tenant=name, schedule_id=ids["cancelled"], request_id="r-c"))
    client.flush()
    assert (
        str(results.wait_for([ids["cancelled"]], timeout_s=60)[ids["cancelled"]].status)
        == "accepted"
    )
    results.close()

    fired = ids["soon"]
    deadline = time.monotonic() + 60
    row = None
    while time.monotonic() < deadline:
        row = _store_call(real_stack, lambda s: s.get_schedule(name, fired))
        if row and row["state"] == "fired":
            break
        time.sleep(0.5)
    assert row is not None and row["state"] == "fired", row
    # The outcome the worker records when the proxy reports a delivery.
    _store_call(
        real_stack,
        lambda s: s.record_delivery(
            name,
            fired,
            outcome="delivered",
            status_code=200,
            attempts=1,
            at_ms=now_ms(),
            trigger_id=row["trigger_id"],
            due_ms=row["due_ms"],
        ),
    )

    out = _tocsin(real_stack, "status", "--json")
    assert out.returncode == 0, out.stderr
    report = orjson.loads(out.stdout)
    mine = [t for t in report["tenants"] if t["tenant"] == name]
    assert len(mine) == 1, report["tenants"]
    figures = mine[0]
    assert figures["scheduled"] == 4  # three within the hour and one in five hours
    assert not figures["scheduled_truncated"]
    assert figures["due_next_hour"] == 3  # the cancelled one is not due any more
    assert figures["overdue"] == 0
    assert figures["fired_last_hour"] == 1
    assert figures["delivered_last_hour"] == 1
    assert figures["dead_lettered_last_hour"] == 0
    assert figures["missed_last_hour"] == 0
    late = row["fired_ms"] - row["due_ms"]
    assert figures["lateness_p50_ms"] == late and figures["lateness_p99_ms"] == late
    lags = {(lag["group"], lag["topic"]): lag for lag in report["consumer_lag"]}
    prefix = real_stack.topics.prefix
    commands = lags[(f"{prefix}scheduler", f"{prefix}commands")]
    assert commands["partitions"] == real_stack.topics.command_partitions
    assert commands["lag"] >= 0
    assert ("tocsin-proxy", f"{prefix}fires") in lags
    assert report["problems"] == []

    # One tenant only, as a terminal table.
    text = _tocsin(real_stack, "status", "--tenant", name)
    assert text.returncode == 0, text.stderr
    rows = [line.split() for line in text.stdout.splitlines() if line.startswith(name)]
    assert rows == [[name, "4", "3", "0", "1", "0", "1", "0", f"{late}", "ms", f"{late}", "ms"]]
    assert "consumer lag" in text.stdout

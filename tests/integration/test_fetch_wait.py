"""The running worker paces its consumer's fetches (streams.fetch_wait): idle fetches while
nothing arrives, busy ones while commands flow, and commands sent to an idle worker are
still answered."""

from __future__ import annotations

import time
import uuid
from typing import Any

from base.settings import Settings
from streams.client import CommandClient, ResultWatcher
from tests.integration.conftest import wait_worker_ready
from topics.models import CreateCommand, HttpCallback


def fetch_rounds(worker: Any, mode: str) -> float:
    import urllib.request

    port = worker.env["TOCSIN_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    head = f'tocsin_consumer_fetch_rounds_total{{mode="{mode}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(head))


def test_an_idle_worker_fetches_in_idle_rounds_and_commands_still_reach_it(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    """The pacing wraps private methods of the pinned aiokafka's fetcher, so this checks
    that the running consumer really uses it: idle rounds grow while nothing arrives (an
    uninstalled or bypassed wrapper leaves both counters at zero), and creates sent to the
    idle worker are answered, their fetches counted as busy after the first."""
    worker = worker_factory.make("fetch")
    wait_worker_ready(real_stack, tenant, worker=worker)
    idle0, busy0 = fetch_rounds(worker, "idle"), fetch_rounds(worker, "busy")
    time.sleep(3)
    assert fetch_rounds(worker, "idle") > idle0, worker.log_tail()

    client, results = CommandClient(real_stack), ResultWatcher(real_stack)
    ids = [f"fw-{uuid.uuid4().hex[:8]}" for _ in range(5)]
    for sid in ids:
        client.send(
            CreateCommand(
                tenant=tenant,
                schedule_id=sid,
                due_ms=time.time_ns() // 10**6 + 600_000,
                callback=HttpCallback(url="https://receiver.example/cb"),
                misfire_tolerance_s=3600,
            )
        )
        client.flush()
        assert sid in results.wait_for([sid], 30), worker.log_tail()
    results.close()
    assert fetch_rounds(worker, "busy") > busy0, worker.log_tail()

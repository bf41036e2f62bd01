"""Production-shaped input on stock server limits: every command answered, none blocks others."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

import orjson
import pytest

from base.settings import Settings
from streams.client import CommandClient, ResultWatcher
from tests.integration.conftest import wait_worker_ready
from topics.models import CreateCommand, HttpCallback, PayloadType


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture
def worker(worker_factory: Any, real_stack: Settings, tenant: str) -> Any:
    w = worker_factory.make("hostile")
    wait_worker_ready(real_stack, tenant)
    return w


def _create(tenant: str, sid: str, payload_bytes: int) -> CreateCommand:
    return CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        request_id=f"r-{sid}",
        due_ms=now_ms() + 3_600_000,
        payload=orjson.dumps({"pad": "x" * payload_bytes}),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=3600,
    )


def test_a_burst_of_large_payloads_is_stored_under_stock_batch_limits(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    client, results = CommandClient(real_stack), ResultWatcher(real_stack)
    run = uuid.uuid4().hex[:8]
    # 32 KiB payloads (half the allowed maximum): any two schedule rows in one batch are
    # over Cassandra's stock batch_size_fail_threshold (50 KiB).
    big = [f"big-{run}-{i}" for i in range(48)]
    for sid in big:
        client.send(_create(tenant, sid, 32 * 1024))
    client.flush()
    small = [f"small-{run}-{i}" for i in range(5)]
    for sid in small:
        client.send(_create(tenant, sid, 10))
    client.flush()
    # Started after the burst, so the worker finds it waiting and takes it in full batches.
    worker = worker_factory.make("burst")
    answered = results.wait_for(big + small, timeout_s=90)
    assert sorted(set(big + small) - set(answered)) == [], worker.log_tail()
    assert {r.code for r in answered.values()} == {"ok"}


def test_a_create_due_beyond_what_can_be_stored_is_rejected_alone(
    worker: Any, real_stack: Settings, tenant: str
) -> None:
    client, results = CommandClient(real_stack), ResultWatcher(real_stack)
    run = uuid.uuid4().hex[:8]
    good = [f"near-{run}-{i}" for i in range(20)]
    far = f"far-{run}"
    # Sent together, so in the batches of their partitions: the far one among them.
    for sid in good[:10]:
        client.send(_create(tenant, sid, 10))
    client.send(replace(_create(tenant, far, 10), due_ms=2_524_608_000_000))  # 2050-01-01
    for sid in good[10:]:
        client.send(_create(tenant, sid, 10))
    client.flush()
    answered = results.wait_for([*good, far], timeout_s=60)
    assert sorted({*good, far} - set(answered)) == [], worker.log_tail()
    assert {answered[sid].code for sid in good} == {"ok"}
    assert answered[far].code == "beyond_horizon"
    assert "20 years" in answered[far].message

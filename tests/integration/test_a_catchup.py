"""A worker stopped for two minutes catches up; beyond-tolerance triggers are marked missed.

This module's name sorts before every other integration module on purpose: later modules
(the API's session fixture) leave a worker running in the shared consumer group, and a
live worker would fire these triggers on time, so nothing would be caught up or missed.
(Known weakness, see the session note: those fixtures should get a prefix of their own.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.store import Store
from tests.integration.test_scheduler import collect_fires, create, now_ms, wait_worker_ready
from tocsin.settings import Settings
from topics.ids import trigger_id


@pytest.mark.slow
def test_worker_stopped_two_minutes_catches_up(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    client, results = CommandClient(real_stack), ResultWatcher(real_stack)
    fires = FireWatcher(real_stack)
    w = worker_factory.make("before")
    wait_worker_ready(real_stack, tenant)
    base = now_ms() + 10_000
    sids = [f"down-{uuid.uuid4().hex[:8]}-{i}" for i in range(120)]
    due = {sid: base + i * 1_000 for i, sid in enumerate(sids)}  # over 2 minutes
    # Due 45 s after base with a 20 s tolerance: the first worker is stopped long before it
    # is due (on a loaded CI machine answering 121 creates can take many seconds), and the
    # second one starts ~75 s after it: beyond its tolerance, so it must be marked missed.
    tight = f"tight-{uuid.uuid4().hex[:8]}"
    tight_due = base + 45_000
    for sid in sids:
        client.send(create(tenant, sid, due[sid]))
    client.send(create(tenant, tight, tight_due, misfire_tolerance_s=20))
    client.flush()
    assert len(results.wait_for([*sids, tight], 60)) == len(sids) + 1
    w.stop()
    assert now_ms() < tight_due, "the first worker was still up when the tight one was due"
    time.sleep(max(0.0, (base + 120_000 - now_ms()) / 1000))  # down for two minutes
    worker_factory.make("after")
    want = {trigger_id(tenant, sid, due[sid]) for sid in sids}
    seen = collect_fires(fires, want, timeout_s=120)
    assert want <= set(seen), f"{len(want - set(seen))} not caught up"
    assert trigger_id(tenant, tight, tight_due) not in seen

    async def state_of(sid: str) -> str:
        store = Store(real_stack.cassandra)
        await store.connect()
        try:
            row = await store.get_schedule(tenant, sid)
            assert row is not None
            return str(row["state"])
        finally:
            await store.close()

    assert asyncio.run(state_of(tight)) == "missed"

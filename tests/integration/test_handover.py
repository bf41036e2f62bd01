"""The command agent's hand-over to the ticker across owners and crashes, on the real stack:
an acknowledged schedule fires at least once, whatever checkpoint the ticker inherited."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from base.settings import Settings
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.partitioner import partition_for
from streams.store import Store
from tests.integration.conftest import WorkerProcess, _env_for, _ports, wait_worker_ready
from tests.integration.test_scheduler import collect_fires, create, now_ms
from topics.ids import trigger_id

SKEW_MS = 60_000


def stored_checkpoint(settings: Settings, partition: int) -> int | None:
    async def read() -> int | None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            return await store.get_checkpoint(partition)
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.slow
def test_a_create_below_a_fast_predecessors_checkpoint_survives_a_kill(
    worker_factory: Any, own_stack: Settings, tenant: str, tmp_path: Path
) -> None:
    """A worker whose clock runs a minute fast owns the partitions first and leaves its
    checkpoints a minute ahead of real time. The next owner gets a create due in 8 s - below
    that checkpoint - and is SIGKILLed as soon as it answers. Its answer need not wait for
    the fire, but it must have written the stored checkpoint back below the row, so that the
    successor reads the row's bucket and fires it."""
    env = {**_env_for(own_stack, next(_ports), next(_ports)), "TOCSIN_CLOCK_SKEW_MS": str(SKEW_MS)}
    fast = WorkerProcess(own_stack, env, tmp_path / "fast.log")
    try:
        fast.start()
        wait_worker_ready(own_stack, tenant, worker=fast)
        time.sleep(3)  # checkpoints written at its clock
    finally:
        fast.stop()  # graceful: its final checkpoint too
    sid = f"skew-{uuid.uuid4().hex[:8]}"
    checkpoint = stored_checkpoint(
        own_stack, partition_for(sid.encode(), own_stack.topics.command_partitions)
    )
    assert checkpoint is not None and checkpoint > now_ms() + SKEW_MS // 2, (
        f"no checkpoint ahead of the clock to test with: {checkpoint}\n{fast.log_tail()}"
    )

    second = worker_factory.make("second", own_stack)
    wait_worker_ready(own_stack, tenant, worker=second)
    client, results = CommandClient(own_stack), ResultWatcher(own_stack)
    fires = FireWatcher(own_stack, from_start=True)
    due = now_ms() + 8_000
    assert due < checkpoint - 5_000, "the second worker took too long to start"
    client.send(create(tenant, sid, due))
    client.flush()
    answer = results.wait_for([sid], timeout_s=60).get(sid)
    second.kill()  # SIGKILL right after the answer: nothing flushed, nothing written
    assert answer is not None and answer.code == "ok", second.log_tail()
    left = stored_checkpoint(
        own_stack, partition_for(sid.encode(), own_stack.topics.command_partitions)
    )
    assert left is not None and left <= due, (
        f"answered with the stored checkpoint {left} past the row due {due}"
    )

    worker_factory.make("third", own_stack)
    tid = trigger_id(tenant, sid, due)
    seen = collect_fires(fires, {tid}, timeout_s=60)
    assert tid in seen, "an acknowledged schedule never fired"
    assert seen[tid][0][0].emitted_ms >= due

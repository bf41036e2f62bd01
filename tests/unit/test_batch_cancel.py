"""A command batch cancelled mid-handling (the worker stopping) must not be committed."""

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from streams.app import Worker
from tests.unit.test_timing_holes import OutcomeStore, run_delivery_agent, stop_agent


async def test_a_command_batch_cancelled_mid_handling_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch generator acks its events when it is closed, whatever its handler did;
    a batch cancelled while its commands were being stored (the worker stopping, the
    agent restarted) was then committed unstored. A create answered at Kafka's
    acknowledgement (the admission) has no client left to re-send it: lost. Its events
    are kept out of the commit, so the next owner reads them again."""
    entered = asyncio.Event()

    async def storing(batch: Sequence[Any]) -> list[Any]:
        entered.set()
        await asyncio.Event().wait()  # the store's answer never comes before the stop
        return []

    def run(worker: Worker) -> None:
        monkeypatch.setattr(worker.processor, "process_until_answered", storing)

    worker, committed, agent = await run_delivery_agent(
        tmp_path, OutcomeStore(), [b"a command"], agent_name="commands", setup=run
    )
    await entered.wait()
    agent.cancel()
    await asyncio.gather(agent, return_exceptions=True)
    for _ in range(20):  # the generator's close runs as its own task
        await asyncio.sleep(0)
    assert committed == {b"a command": False}
    await stop_agent(worker, agent)

"""Which tickers ``streams.app.Ownership`` resumes after a rebalance, and what a command
sees meanwhile: a resumed ticker must hold what the store holds (the fixes for the review
of fbd9410 in tests/unit/test_ticker_suspend_review.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.unit.test_ticker_suspend_review import Rig


@pytest.fixture
async def rig() -> Any:
    r = Rig()
    yield r
    await r.close()


async def test_a_ticker_suspended_before_reading_its_checkpoint_is_replaced_not_resumed(
    rig: Rig,
) -> None:
    gate = asyncio.Event()
    rig.store.hold("get_checkpoint", gate)  # Cassandra slow at the ticker's start
    await rig.ownership.assigned({0}, 1)
    first = rig.tickers[0]
    for _ in range(5):
        await asyncio.sleep(0)
    assert first.fired_before_ms is None  # its checkpoint read has not answered
    await rig.ownership.revoked({0}, 1)
    gate.set()
    await rig.ownership.assigned({0}, 2)  # the next generation: would be a resume
    fresh = rig.tickers[0]
    assert fresh is not first
    assert rig.ownership.suspended == {}
    await asyncio.wait_for(fresh.ready.wait(), 5)
    assert fresh.begun

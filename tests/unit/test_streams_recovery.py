"""streams.recovery: Faust's resumption of the streams after a rebalance survives a seek
slower than the request timeout (the reviewer's test in test_ticker_suspend_review), but
a recovery service that really stops still ends it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from faust.tables.recovery import ServiceStopped
from faust.types import TP

from base.settings import Settings
from streams.app import Worker


def paused_app(tmp_path: Path) -> tuple[Any, asyncio.Event]:
    """A worker's Faust app with its flow suspended (as a revocation leaves it) and a
    consumer whose seek waits for the event returned."""
    settings = Settings.from_env(
        {
            "TOCSIN_STATE_DIR": str(tmp_path),
            "TOCSIN_SESSION_TIMEOUT_S": "0.05",
            "TOCSIN_WORKER_KAFKA_REQUEST_TIMEOUT_S": "0.05",
        }
    )
    worker = Worker(settings)
    app: Any = worker.app
    answered = asyncio.Event()

    async def perform_seek() -> None:
        await answered.wait()

    tp = TP(worker.catalog.commands.name, 0)
    app.consumer.assignment = lambda: {tp}
    app.consumer.resume_partitions = lambda tps: None
    app.consumer.resume_flow = lambda: None
    app.consumer.perform_seek = perform_seek
    app.flow_control.suspend()
    return app, answered


async def test_a_seek_answered_in_time_resumes_the_streams_and_restores_the_wait(
    tmp_path: Path,
) -> None:
    app, answered = paused_app(tmp_path)
    recovery = app.tables.recovery
    answered.set()
    await recovery._resume_streams(generation_id=app.consumer_generation_id)
    assert app.flow_control.is_active()
    assert "_wait" not in vars(recovery)  # Faust's own again


async def test_a_recovery_service_stopping_during_the_seek_still_ends_it(tmp_path: Path) -> None:
    app, _ = paused_app(tmp_path)
    recovery = app.tables.recovery
    recovery._stopped.set()
    with pytest.raises(ServiceStopped):
        await recovery._resume_streams(generation_id=app.consumer_generation_id)
    assert not app.flow_control.is_active()
    assert "_wait" not in vars(recovery)

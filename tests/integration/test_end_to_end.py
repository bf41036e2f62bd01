"""Schedule to delivery on the real stack: worker -> fires topic -> proxy -> HTTP receiver,
and the proxy's outcome recorded back into each schedule's status."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from base.settings import Settings
from proxy.app import ProxyApp
from streams.client import CommandClient, ResultWatcher
from streams.store import Store
from tests.integration.conftest import WorkerProcess, _env_for, _ports, isolated_stack
from tests.integration.test_proxy_delivery import Receiver, fast_settings
from topics.models import CreateCommand, HttpCallback, PayloadType


def test_schedules_are_delivered_and_outcomes_recorded(
    real_stack: Settings, tenant: str, tmp_path: Path
) -> None:
    # A deployment of its own (prefix and keyspace), so the proxy reads only this test's
    # triggers and no other worker ticks its keyspace.
    with isolated_stack(real_stack, "e2e") as settings:
        _deliver_and_record(settings, tenant, tmp_path)


def _deliver_and_record(settings: Settings, tenant: str, tmp_path: Path) -> None:
    worker = WorkerProcess(
        settings, _env_for(settings, next(_ports), next(_ports)), tmp_path / "worker.log"
    ).start()

    def behave(hit: Any, n: int) -> int:
        return 700 if hit.path == "/reject" else 200  # 7xx: dead-letter at once (MPS)

    receiver = Receiver(behave=behave).start()
    proxy = ProxyApp(
        settings,
        fast_settings(mode="fires", source_topic="", group_id=f"e2e-{uuid.uuid4().hex[:6]}"),
    )
    proxy.start()
    try:
        client, results = CommandClient(settings), ResultWatcher(settings)
        due = time.time_ns() // 1_000_000 + 6_000
        sids = [f"e2e-{uuid.uuid4().hex[:6]}-{i}" for i in range(10)]
        for i, sid in enumerate(sids):
            path = "/reject" if i == 0 else "/ok"
            client.send(
                CreateCommand(
                    tenant=tenant,
                    schedule_id=sid,
                    due_ms=due + i * 100,
                    payload=orjson.dumps({"i": i}),
                    payload_type=PayloadType.JSON,
                    callback=HttpCallback(url=f"http://127.0.0.1:{receiver.port}{path}"),
                    misfire_tolerance_s=3600,
                )
            )
        client.flush()
        answered = results.wait_for(sids, timeout_s=90)
        assert {r.code for r in answered.values()} == {"ok"}, worker.log_tail()

        deadline = time.monotonic() + 60
        while len(receiver.delivered()) < 9 and time.monotonic() < deadline:
            time.sleep(0.2)
        delivered = receiver.delivered()
        assert sorted(h.headers["Tocsin-Schedule-Id"] for h in delivered) == sorted(sids[1:])
        for hit in delivered:
            assert hit.headers["Idempotency-Key"] == hit.headers["Tocsin-Trigger-Id"]
            assert int(hit.headers["Tocsin-Due-Ms"]) <= hit.at * 1000
            assert orjson.loads(hit.body) == {"i": sids.index(hit.headers["Tocsin-Schedule-Id"])}

        async def outcomes() -> dict[str, Any]:
            store = Store(settings.cassandra)
            await store.connect()
            try:
                rows = {sid: await store.get_schedule(tenant, sid) for sid in sids}
                return {sid: row and row.get("delivery_outcome") for sid, row in rows.items()}
            finally:
                await store.close()

        want = {sid: ("dead_lettered" if i == 0 else "delivered") for i, sid in enumerate(sids)}
        seen: dict[str, Any] = {}
        while seen != want and time.monotonic() < deadline + 30:
            seen = asyncio.run(outcomes())
            time.sleep(0.5)
        assert seen == want, worker.log_tail()
    finally:
        proxy.stop(timeout_s=5)
        receiver.stop()
        worker.stop()

"""Dead-letter redrive on the real stack: a worker, the proxy (fires mode), the REST API and
a receiver that fails until it is fixed. The dead letter is listed with its reason and last
response, the other tenant can neither see nor redrive it, and the redrive delivers the
same trigger id with the next emission attempt.

No timing assertions: waits poll for an outcome with a generous deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from api.server import build_app
from base.settings import REPO_ROOT, Settings
from proxy.app import ProxyApp
from tests.integration.conftest import (
    ApiServer,
    WorkerProcess,
    _env_for,
    _ports,
    isolated_stack,
    until,
    wait_worker_ready,
)
from tests.integration.test_proxy_delivery import Hit, Receiver, fast_settings

pytestmark = pytest.mark.integration


class ApiThread:
    """``tocsin api``'s app served from a thread of this process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ApiThread:
        self._thread.start()
        assert self._ready.wait(60), "the API did not start"
        return self

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(build_app(self.settings), access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.fixture
def dlq_stack(real_stack: Settings, tenant: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Its own deployment with a worker, a proxy, the API and a receiver that answers 700
    ("dead-letter at once") while ``state["broken"]``."""
    state = {"broken": True}
    with isolated_stack(real_stack, "dlq") as base:
        admin = "admin-" + os.urandom(8).hex()
        settings = replace(
            base,
            api=replace(base.api, admin_key=admin),
            scheduler=replace(base.scheduler, allow_private_targets=True),
        )
        env = _env_for(settings, next(_ports), next(_ports))
        env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"  # tenants registered by the test, just now
        worker = WorkerProcess(settings, env, tmp_path / "worker.log").start()

        def behave(hit: Hit, n: int) -> int:
            return 700 if state["broken"] else 200

        receiver = Receiver(behave=behave).start()
        proxy = ProxyApp(
            settings,
            fast_settings(mode="fires", source_topic="", group_id=f"dlq-{uuid.uuid4().hex[:6]}"),
        )
        proxy.start()
        api = ApiThread(settings).start()
        try:
            wait_worker_ready(settings, tenant, worker=worker)
            client = ApiServer(settings, f"http://127.0.0.1:{api.port}", admin)
            yield {"api": client, "receiver": receiver, "state": state, "worker": worker}
        finally:
            api.stop()
            proxy.stop(timeout_s=5)
            receiver.stop()
            worker.stop()


def test_a_dead_letter_is_listed_and_redriven_to_the_fixed_endpoint_by_its_tenant_only(
    dlq_stack: dict[str, Any],
) -> None:
    api: ApiServer = dlq_stack["api"]
    receiver: Receiver = dlq_stack["receiver"]
    keys, names = {}, {}
    for name in ("a", "b"):
        names[name] = f"dl{name}-{os.urandom(3).hex()}"
        st, body = api.call("POST", "/v1/tenants", key=api.admin_key, body={"tenant": names[name]})
        assert st == 201, body
        keys[name] = body["api_key"]  # type: ignore[index]
    a, b = keys["a"], keys["b"]
    sid = f"dl-{uuid.uuid4().hex[:8]}"
    st, body = api.call(
        "POST",
        "/v1/schedules",
        key=a,
        body={
            "schedule_id": sid,
            "due": time.time_ns() // 1_000_000 + 2000,
            "order_key": "orders-7",
            "payload": {"sku": 42},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{receiver.port}/hook"},
        },
    )
    assert st == 201, body

    def listed(key: str) -> list[dict[str, Any]]:
        st, body = api.call("GET", "/v1/dead-letters", key=key)
        assert st == 200, body
        return [d for d in body["dead_letters"] if d["schedule_id"] == sid]  # type: ignore[index]

    (letter,) = until(lambda: listed(a), timeout_s=120, what="the dead letter to be listed")
    tid = letter["trigger_id"]
    assert letter["reason"].startswith("HTTP 700"), letter
    assert letter["response"] == {"status_code": 700, "body_excerpt": "answer 700"}
    assert letter["endpoint"].endswith("/hook") and letter["redriven"] is None
    assert letter["emit_attempt"] == 1

    # The other tenant: not in its listing, 404 for the id, and its redrive sends nothing.
    assert listed(b) == []
    assert api.call("GET", f"/v1/dead-letters/{tid}", key=b)[0] == 404
    st, body = api.call("POST", f"/v1/dead-letters/{tid}/redrive", key=b)
    assert st == 404, body
    st, body = api.call("POST", "/v1/dead-letters/redrive", key=b, body={"trigger_ids": [tid]})
    assert st == 200 and body["failed"][0]["code"] == "not_found", body  # type: ignore[index]

    dlq_stack["state"]["broken"] = False

    def redriven() -> tuple[int, Any] | None:
        # A 7xx dead letter can arrive before the worker records the fire: the redrive then
        # answers 503 fire_not_recorded, and the same request goes through once it is.
        st, body = api.call("POST", f"/v1/dead-letters/{tid}/redrive", key=a)
        if st == 503 and body["error"]["code"] == "fire_not_recorded":  # type: ignore[index]
            return None
        return st, body

    st, body = until(redriven, timeout_s=90, what="the redrive to be taken")
    assert st == 200, body
    assert body["trigger_id"] == tid and body["attempt"] == 2  # type: ignore[index]
    st, again = api.call("POST", f"/v1/dead-letters/{tid}/redrive", key=a)
    assert st == 409 and again["error"]["code"] == "already_redriven", again  # type: ignore[index]

    def delivered() -> list[Hit]:
        return [h for h in receiver.delivered() if h.headers.get("Tocsin-Trigger-Id") == tid]

    (hit,) = until(delivered, timeout_s=90, what="the redriven trigger to be delivered")
    assert hit.headers["Tocsin-Emit-Attempt"] == "2"
    assert hit.headers["Tocsin-Order-Key"] == "orders-7" and hit.body == b'{"sku":42}'

    def recorded() -> dict[str, Any] | None:
        st, view = api.call("GET", f"/v1/schedules/{sid}", key=a)
        assert st == 200, view
        done = (view.get("delivery") or {}).get("outcome") == "delivered"  # type: ignore[union-attr]
        return view if done else None  # type: ignore[return-value]

    view = until(recorded, timeout_s=90, what="the delivery to be recorded")
    refired = [h for h in view["history"] if h["event"] == "refired"]
    assert refired and "redriven" in refired[0]["detail"], view["history"]
    st, letter = api.call("GET", f"/v1/dead-letters/{tid}", key=a)
    assert st == 200 and letter["redriven"]["attempt"] == 2, letter  # type: ignore[index]
    assert len(delivered()) == 1  # the refused second redrive sent nothing

    # The command line, on the same deployment: the listing, then a forced redrive.
    tenant_a = names["a"]
    cli_env = _env_for(api.settings, next(_ports), next(_ports))

    def cli(*args: str) -> Any:
        done = subprocess.run(
            [sys.executable, "-m", "tocsin.cli", "--json", "deadletter", *args],
            env=cli_env,
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return json.loads(done.stdout)

    (shown,) = [d for d in cli("list", tenant_a) if d["trigger_id"] == tid]
    assert shown["response"]["status_code"] == 700 and shown["redriven"]["attempt"] == 2
    answer = cli("redrive", tenant_a, tid, "--force")
    assert [r["attempt"] for r in answer["redriven"]] == [3] and answer["failed"] == []
    (_, third) = until(
        lambda: len(delivered()) == 2 and delivered(), timeout_s=90, what="the forced redrive"
    )
    assert third.headers["Tocsin-Emit-Attempt"] == "3"


def test_the_dead_letter_tables_page_by_day_keep_tenants_apart_and_claim_once(
    keyspace: Settings,
) -> None:
    from streams.deadletter_store import DAY_MS, DeadLetterEntry, DeadLetterStore
    from streams.store import Store

    day = (time.time_ns() // 1_000_000) // DAY_MS * DAY_MS
    t, other = f"dl-{uuid.uuid4().hex[:6]}", f"dl-{uuid.uuid4().hex[:6]}"

    def entry(tenant: str, at_ms: int, tid: str) -> DeadLetterEntry:
        return DeadLetterEntry(
            tenant=tenant, trigger_id=tid, dead_lettered_ms=at_ms, schedule_id="s", reason="r"
        )

    mine = [
        entry(t, day + 5000, "b"),
        entry(t, day + 5000, "a"),  # the same instant: ordered by trigger id
        entry(t, day + 10, "c"),
        entry(t, day - 10, "d"),  # the day before
        entry(t, day - DAY_MS + 1, "e"),
    ]

    async def check() -> None:
        store = Store(keyspace.cassandra)
        await store.connect()
        try:
            dls = DeadLetterStore(store)
            for e in [*mine, entry(other, day + 20, "x")]:
                await dls.put(e, retention_s=3600)
            pages: list[str] = []
            cursor = None
            while True:
                page, cursor = await dls.list_window(
                    t, from_ms=day - DAY_MS, to_ms=day + DAY_MS, limit=2, before=cursor
                )
                pages += [e.trigger_id for e in page]
                if cursor is None:
                    break
            assert pages == ["b", "a", "c", "d", "e"]
            page, _ = await dls.list_window(t, from_ms=day, to_ms=day + 5000, limit=10)
            assert [e.trigger_id for e in page] == ["c"]  # the window's bounds hold
            assert await dls.get(other, "a") is None
            got = await dls.get(t, "a")
            assert got is not None and got[0] == mine[1] and 0 < got[1] <= 3600

            first = got[0]
            assert await dls.claim(first, claim="c1", at_ms=day + 6000, attempt=2, ttl_s=got[1])
            assert not await dls.claim(first, claim="c2", at_ms=day + 6001, attempt=2, ttl_s=60)
            # A driver retry of an applied claim reads back its own claim.
            assert await dls.claim(first, claim="c1", at_ms=day + 6000, attempt=2, ttl_s=60)
            await dls.put(first, retention_s=3600)  # the same outcome read again
            again = await dls.get(t, "a")
            assert again is not None and again[0].redrive_claim == "c1"
            assert again[0].redrive_attempt == 2
            await dls.release(first, claim="c2", ttl_s=60)  # not its claim: nothing changes
            assert (await dls.get(t, "a") or (first, 0))[0].redrive_claim == "c1"
            await dls.release(first, claim="c1", ttl_s=60)
            freed = await dls.get(t, "a")
            assert freed is not None and freed[0].redrive_claim is None
            assert await dls.claim(first, claim="c3", at_ms=day + 7000, attempt=3, ttl_s=60)
            assert await dls.claim(
                first, claim="c4", at_ms=day + 8000, attempt=4, ttl_s=60, replacing="c3"
            )
            # A newer dead letter of the same trigger becomes its latest, unclaimed.
            newer = replace(first, dead_lettered_ms=day + 9000)
            await dls.put(newer, retention_s=3600)
            latest = await dls.get(t, "a")
            assert latest is not None and latest[0] == newer
            # The older outcome read again after it (a replay, or two of one batch written
            # at once in either order): the newer stays the trigger's latest.
            await dls.put(first, retention_s=3600)
            latest = await dls.get(t, "a")
            assert latest is not None and latest[0].dead_lettered_ms == newer.dead_lettered_ms
        finally:
            await store.close()

    asyncio.run(check())

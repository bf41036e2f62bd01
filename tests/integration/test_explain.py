""" "Why didn't it fire?" on the real stack: a worker, the proxy, an HTTP receiver and the
REST API on a deployment of their own. One schedule is delivered after a failed attempt,
one is dead-lettered, one misses its one-second tolerance while its worker is stopped;
each is explained, through the API and the command line, and another tenant learns
nothing of them. No timing assertions: waits poll for an outcome with a deadline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Stack:
    def __init__(self, settings: Settings, api: ApiServer, env: dict[str, str], worker: Any):
        self.settings, self.api, self.env, self.worker = settings, api, env, worker


@pytest.fixture
def explain_stack(real_stack: Settings, tenant: str, tmp_path: Path) -> Iterator[Stack]:
    with isolated_stack(real_stack, "explain") as settings:
        env = _env_for(settings, next(_ports), next(_ports))
        env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"
        worker = WorkerProcess(settings, env, tmp_path / "worker.log").start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        admin = "admin-" + os.urandom(8).hex()
        api_env = dict(
            env,
            TOCSIN_API_PORT=str(port),
            TOCSIN_ADMIN_KEY=admin,
            TOCSIN_METRICS_PORT=str(next(_ports)),
        )
        with (tmp_path / "api.log").open("ab") as out:
            api = subprocess.Popen(
                [sys.executable, "-m", "tocsin.cli", "api"],
                env=api_env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            until(lambda: _ready(base), 60, "the api")
            wait_worker_ready(settings, tenant, worker=worker)
            yield Stack(settings, ApiServer(settings, base, admin, worker), env, worker)
        finally:
            if api.poll() is None:
                os.killpg(api.pid, signal.SIGTERM)
                api.wait(20)
            worker.stop()


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _register(api: ApiServer, name: str) -> dict[str, Any]:
    st, body = api.call("POST", "/v1/tenants", key=api.admin_key, body={"tenant": name})
    assert st == 201 and isinstance(body, dict), body
    return body


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "tocsin.cli", *args],
        env=stack.env,
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=60,
    )


def _explain(api: ApiServer, key: str, sid: str, query: str = "") -> tuple[int, Any]:
    return api.call("GET", f"/v1/schedules/{sid}/explain{query}", key=key)


def test_fired_dead_lettered_and_missed_schedules_are_explained(explain_stack: Stack) -> None:
    def behave(hit: Hit, n: int) -> int:
        if hit.path == "/reject":
            return 700  # dead-lettered at once
        return 503 if hit.path == "/flaky" and n == 1 else 200

    receiver = Receiver(behave=behave).start()
    proxy = ProxyApp(
        explain_stack.settings,
        fast_settings(mode="fires", source_topic="", group_id=f"explain-{uuid.uuid4().hex[:6]}"),
    )
    proxy.start()
    try:
        _run(explain_stack, receiver)
    finally:
        proxy.stop(timeout_s=5)
        receiver.stop()


def _run(stack: Stack, receiver: Receiver) -> None:
    api = stack.api
    alice = _register(api, f"alice-{uuid.uuid4().hex[:6]}")
    mallory = _register(api, f"mallory-{uuid.uuid4().hex[:6]}")
    due = now_ms() + 8_000
    sids = {kind: f"{kind}-{uuid.uuid4().hex[:6]}" for kind in ("ok", "dead", "late")}
    paths = {"ok": "/flaky", "dead": "/reject", "late": "/late"}
    for kind, sid in sids.items():
        body: dict[str, Any] = {
            "schedule_id": sid,
            "due": due,
            "payload": {"kind": kind},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{receiver.port}{paths[kind]}"},
        }
        if kind == "late":
            body["misfire_tolerance_s"] = 1
        st, res = api.call("POST", "/v1/schedules", key=alice["api_key"], body=body)
        assert st == 201, res
    # The worker stops before the due time and comes back 3 s after it: "late" is then
    # beyond its tolerance (1 s), the others (3,600 s) fire late.
    assert stack.worker.proc is not None
    time.sleep(max(0.0, (due - 1_000 - now_ms()) / 1000))
    os.killpg(stack.worker.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(max(0.0, (due + 3_000 - now_ms()) / 1000))
    finally:
        os.killpg(stack.worker.proc.pid, signal.SIGCONT)

    def explained(kind: str, want: str) -> Any:
        def check() -> Any:
            st, doc = _explain(api, alice["api_key"], sids[kind])
            assert st == 200, doc
            return doc if want in doc["reason"] else None

        return until(check, 90, f"{kind}: {want}")

    ok = explained("ok", "delivered with status 200 after 2 attempt(s)")
    assert ok["reason"].startswith("fired at ") and ok["kind"] == "one_shot"
    events = [e["event"] for e in ok["timeline"]]
    assert events == ["created", "fired", "attempt_failed", "delivered"], ok["timeline"]
    fired, delivered = ok["timeline"][1], ok["timeline"][3]
    assert fired["emit_attempt"] == 1 and fired["lateness_ms"] >= 3_000
    assert delivered["detail"].startswith("status 200 on attempt 2; 1 failed")
    assert "the last: HTTP 503" in delivered["detail"]

    dead = explained("dead", "dead-lettered after 1 attempt(s): HTTP 700")
    assert [e["event"] for e in dead["timeline"]] == ["created", "fired", "dead_lettered"]

    late = explained("late", "beyond its misfire tolerance of 1 s")
    assert late["state"] == "missed" and late["reason"].startswith("missed: due ")
    assert [e["event"] for e in late["timeline"]] == ["created", "missed"]
    assert late["timeline"][1]["lateness_ms"] > 1_000
    assert not [h for h in receiver.delivered() if h.path == "/late"]
    assert late["not_recorded"], "the view says what it cannot show"

    # Another tenant learns nothing: the same answer as for an id that does not exist.
    st, other = _explain(api, mallory["api_key"], sids["ok"])
    st_none, none = _explain(api, mallory["api_key"], "no-such-" + uuid.uuid4().hex[:6])
    assert (st, st_none) == (404, 404)
    assert other["error"]["code"] == none["error"]["code"] == "not_found"
    # Naming the owner changes nothing: the very answer of a schedule mallory has not.
    st, named = _explain(api, mallory["api_key"], sids["ok"], f"?tenant={alice['tenant']}")
    assert (st, named) == (404, other)
    # The admin names the tenant.
    st, doc = _explain(api, api.admin_key, sids["late"], f"?tenant={alice['tenant']}")
    assert st == 200 and doc["reason"] == late["reason"]

    # The command line reads the same facts from Cassandra.
    cli = _cli(stack, "schedule", "explain", alice["tenant"], sids["late"], "--json")
    assert cli.returncode == 0, cli.stderr.decode()[-2000:]
    assert json.loads(cli.stdout)["reason"] == late["reason"]
    text = _cli(stack, "schedule", "explain", mallory["tenant"], sids["late"])
    assert text.returncode == 3  # not found: keyed by tenant

    # A recurring schedule: its runs' histories, each entry naming its run id.
    cron = f"cron-{uuid.uuid4().hex[:6]}"
    st, res = api.call(
        "POST",
        "/v1/schedules",
        key=alice["api_key"],
        body={
            "schedule_id": cron,
            "recurrence": {"every_s": 1, "max_runs": 2},
            "payload": {"kind": "cron"},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{receiver.port}/cron"},
        },
    )
    assert st == 201, res

    def both_runs() -> Any:
        st, doc = _explain(api, alice["api_key"], cron)
        assert st == 200, doc
        return doc if "2 delivered" in doc["reason"] else None

    rec = until(both_runs, 90, "two delivered runs")
    assert rec["kind"] == "recurring" and rec["runs_shown"] == 2
    runs = {e["schedule_id"] for e in rec["timeline"] if e["schedule_id"] != cron}
    assert len(runs) == 2 and all(r.startswith(cron + "@") for r in runs)
    assert [e["event"] for e in rec["timeline"]].count("delivered") == 2

    # And the worker counted the miss and the dead letter for alice.
    port = stack.env["TOCSIN_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        scraped = r.read().decode()
    name = alice["tenant"]
    assert f'tocsin_triggers_missed_by_tenant_total{{cause="tolerance",tenant="{name}"}} 1.0' in (
        scraped
    )
    assert f'tocsin_dead_lettered_by_tenant_total{{tenant="{name}"}} 1.0' in scraped


def test_failed_attempts_and_a_refused_update_are_in_the_timeline(explain_stack: Stack) -> None:
    """An endpoint answering 503, then 502, then 200: the two failed attempts, with their
    status codes and the backoff chosen, come before the delivery; an update refused
    once it fired is in the timeline too."""

    def behave(hit: Hit, n: int) -> int:
        return {1: 503, 2: 502}.get(n, 200)

    receiver = Receiver(behave=behave).start()
    proxy = ProxyApp(
        explain_stack.settings,
        fast_settings(mode="fires", source_topic="", group_id=f"explain-{uuid.uuid4().hex[:6]}"),
    )
    proxy.start()
    try:
        api = explain_stack.api
        alice = _register(api, f"alice-{uuid.uuid4().hex[:6]}")
        key = alice["api_key"]
        sid = f"twice-{uuid.uuid4().hex[:6]}"
        url = f"http://127.0.0.1:{receiver.port}/twice"
        st, res = api.call(
            "POST",
            "/v1/schedules",
            key=key,
            body={
                "schedule_id": sid,
                "due": now_ms() + 2_000,
                "payload": {},
                "callback": {"type": "http", "url": url},
            },
        )
        assert st == 201, res

        def delivered() -> Any:
            st, doc = _explain(api, key, sid)
            assert st == 200, doc
            return doc if "delivered with status 200 after 3 attempt(s)" in doc["reason"] else None

        doc = until(delivered, 90, "delivery on the third attempt")
        events = [e["event"] for e in doc["timeline"]]
        assert events == [
            "created",
            "fired",
            "attempt_failed",
            "attempt_failed",
            "delivered",
        ], doc["timeline"]
        first, second = doc["timeline"][2], doc["timeline"][3]
        assert first["detail"].startswith(
            "attempt 1 failed: HTTP 503: answer 503; next attempt in "
        )
        assert second["detail"].startswith(
            "attempt 2 failed: HTTP 502: answer 502; next attempt in "
        )
        assert first["at_ms"] <= second["at_ms"] <= doc["timeline"][4]["at_ms"]
        backoff_s = float(first["detail"].rsplit(" in ", 1)[1].removesuffix(" s"))
        assert 0 < backoff_s <= 0.2  # the proxy's retry_max_delay_s
        # A receiver that failed twice: both shown, so no note of attempts left out.
        assert not [n for n in doc["notes"] if "shown one by one" in n]

        st, res = api.call(
            "PATCH", f"/v1/schedules/{sid}", key=key, body={"due": now_ms() + 60_000}
        )
        assert st == 409 and "already_fired" in json.dumps(res), res

        def refused() -> Any:
            st, doc = _explain(api, key, sid)
            assert st == 200, doc
            return [e for e in doc["timeline"] if e["event"] == "command_refused"]

        (entry,) = until(refused, 60, "the refused update in the timeline")
        assert entry["text"].startswith("update refused (already_fired): ")
        text = _cli(explain_stack, "schedule", "explain", alice["tenant"], sid)
        assert text.returncode == 0, text.stderr.decode()[-2000:]
        assert b"attempt 2 failed: HTTP 502" in text.stdout
        assert b"update refused (already_fired)" in text.stdout
    finally:
        proxy.stop(timeout_s=5)
        receiver.stop()

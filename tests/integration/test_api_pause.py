"""Pause, resume and trigger-now through the REST API and ``tocsin schedule`` on the real
stack (the API's own deployment and worker): one schedule and a tenant's schedules in bulk,
by id prefix, one-shot and recurring alike.

No timing assertions: waits poll for an outcome with a generous deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson
import pytest

from base.settings import REPO_ROOT, Settings
from tests.integration.test_api_endpoints import acct, create_body, now_ms, uid

pytestmark = pytest.mark.integration

__all__ = ["acct"]  # the module-scoped tenant fixture, shared with the endpoint tests


def _status(api_server: Any, key: str, sid: str) -> str:
    status, body = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert status == 200, body
    return str(body["status"])


def _create(api_server: Any, key: str, body: dict[str, Any]) -> None:
    status, res = api_server.call("POST", "/v1/schedules", key=key, body=body)
    assert status == 201, res


def test_pause_resume_and_trigger_one_schedule(api_server: Any, acct: dict[str, Any]) -> None:
    key, sid = acct["api_key"], uid("p")
    _create(api_server, key, create_body(now_ms() + 3_600_000, schedule_id=sid))
    status, res = api_server.call("POST", f"/v1/schedules/{sid}/pause", key=key)
    assert (status, res["code"], res["command"]) == (200, "ok", "pause"), res
    assert _status(api_server, key, sid) == "paused"
    status, res = api_server.call("POST", f"/v1/schedules/{sid}/pause", key=key)
    assert (status, res["code"]) == (200, "duplicate"), res
    # Triggered while paused: fired once now, and still paused.
    status, res = api_server.call("POST", f"/v1/schedules/{sid}/trigger", key=key)
    assert (status, res["code"]) == (200, "ok") and "triggered" in res["message"], res
    status, body = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert body["status"] == "paused"
    assert [e["event"] for e in body["history"]][-1] == "triggered", body["history"]
    status, res = api_server.call("POST", f"/v1/schedules/{sid}/resume", key=key)
    assert (status, res["code"]) == (200, "ok"), res
    assert _status(api_server, key, sid) == "scheduled"
    status, res = api_server.call("POST", f"/v1/schedules/{uid('none')}/pause", key=key)
    assert (status, res["code"]) == (404, "not_found"), res
    status, listed = api_server.call(
        "GET",
        f"/v1/schedules?from={now_ms()}&to={now_ms() + 7_200_000}&status=paused",
        key=key,
    )
    assert status == 200 and sid not in {s["schedule_id"] for s in listed["schedules"]}


def test_bulk_pause_and_resume_by_id_prefix(api_server: Any, acct: dict[str, Any]) -> None:
    key = acct["api_key"]
    prefix = uid("grp") + "-"
    due = now_ms() + 10 * 86_400_000
    one_shots = [f"{prefix}{i}" for i in range(3)]
    for i, sid in enumerate(one_shots):
        _create(api_server, key, create_body(due + i, schedule_id=sid))
    recurring = f"{prefix}cron"
    _create(
        api_server,
        key,
        {
            "schedule_id": recurring,
            "recurrence": {"every_s": 3600},
            "callback": {"type": "http", "url": "https://receiver.example/hook"},
        },
    )
    other = uid("other")
    _create(api_server, key, create_body(due, schedule_id=other))

    status, res = api_server.call("POST", "/v1/bulk/pause", key=key, body={"id_prefix": prefix})
    assert status == 200, res
    assert (res["matched"], res["paused"], res["failed"], res["truncated"]) == (4, 4, [], False)
    assert res["next_cursor"] is None
    for sid in [*one_shots, recurring]:
        assert _status(api_server, key, sid) == "paused", sid
    assert _status(api_server, key, other) == "scheduled"
    # Already paused: nothing left to match.
    status, res = api_server.call("POST", "/v1/bulk/pause", key=key, body={"id_prefix": prefix})
    assert status == 200 and res["matched"] == 0, res

    status, res = api_server.call(
        "POST", "/v1/bulk/resume", key=key, body={"id_prefix": prefix, "to": due + 2}
    )
    assert status == 200, res  # the window leaves out the last one-shot
    assert (res["matched"], res["resumed"], res["failed"]) == (3, 3, []), res
    assert _status(api_server, key, one_shots[2]) == "paused"
    assert _status(api_server, key, recurring) == "scheduled"
    status, res = api_server.call(
        "POST", "/v1/bulk/resume", key=key, body={"id_prefix": prefix, "bogus": 1}
    )
    assert (status, res["error"]["code"]) == (400, "invalid_field"), res
    status, res = api_server.call(
        "POST", "/v1/bulk/resume", key=key, body={"id_prefix": prefix, "cursor": "nonsense"}
    )
    assert (status, res["error"]["code"]) == (400, "invalid_parameter"), res


def _tocsin(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        TOCSIN_TOPIC_PREFIX=settings.topics.prefix,
        TOCSIN_CASSANDRA_KEYSPACE=settings.cassandra.keyspace,
        TOCSIN_LOG_LEVEL="WARNING",
    )
    return subprocess.run(
        [sys.executable, "-m", "tocsin.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_command_line_pauses_resumes_and_triggers(
    api_server: Any, api_stack: Settings, acct: dict[str, Any]
) -> None:
    key, tenant = acct["api_key"], acct["tenant"]
    prefix = uid("cli") + "-"
    sids = [f"{prefix}{i}" for i in range(2)]
    for sid in sids:
        _create(api_server, key, create_body(now_ms() + 3_600_000, schedule_id=sid))
    out = _tocsin(api_stack, "schedule", "pause", tenant, sids[0], "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    [row] = orjson.loads(out.stdout)
    assert (row["schedule_id"], row["code"]) == (sids[0], "ok")
    out = _tocsin(api_stack, "schedule", "pause", tenant, "--all", "--id-prefix", prefix, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    summary = orjson.loads(out.stdout)
    assert (summary["matched"], summary["paused"], summary["failed"]) == (1, 1, []), summary
    assert all(_status(api_server, key, sid) == "paused" for sid in sids)
    out = _tocsin(api_stack, "schedule", "trigger", tenant, sids[0], "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert orjson.loads(out.stdout)[0]["message"].startswith("triggered")
    out = _tocsin(api_stack, "schedule", "resume", tenant, "--all", "--id-prefix", prefix, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert orjson.loads(out.stdout)["resumed"] == 2
    assert all(_status(api_server, key, sid) == "scheduled" for sid in sids)
    usage = _tocsin(api_stack, "schedule", "pause", tenant)
    assert usage.returncode == 2 and "needs a schedule id" in usage.stderr

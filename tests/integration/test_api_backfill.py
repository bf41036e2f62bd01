"""Backfill through the REST API and ``tocsin schedule backfill`` on the real stack (the
API's own deployment and worker): the answer counts the runs, the history records them,
and a one-shot, a window in the future or a malformed body is refused with its code.

No timing assertions: the API waits for the worker's result.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from base.settings import Settings
from tests.integration.test_api_endpoints import acct, create_body, now_ms, uid
from tests.integration.test_api_pause import _create, _tocsin

pytestmark = pytest.mark.integration

__all__ = ["acct"]  # the module-scoped tenant fixture, shared with the endpoint tests


def _recurring(api_server: Any, key: str, sid: str) -> None:
    body = {
        "schedule_id": sid,
        "recurrence": {"every_s": 60},
        "callback": {"type": "http", "url": "https://receiver.example/hook"},
    }
    _create(api_server, key, body)


def test_backfill_through_the_api(api_server: Any, acct: dict[str, Any]) -> None:
    key, sid = acct["api_key"], uid("bf")
    _recurring(api_server, key, sid)
    now = now_ms()
    path = f"/v1/schedules/{sid}/backfill"
    status, res = api_server.call("POST", path, key=key, body={"from": now - 300_000, "to": now})
    assert (status, res["code"], res["command"]) == (200, "ok", "backfill"), res
    assert res["message"].startswith("backfilled 5 runs"), res
    status, body = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert status == 200 and "backfilled" in [e["event"] for e in body["history"]], body
    # A window starting now or later has no past runs.
    status, res = api_server.call(
        "POST", path, key=key, body={"from": now_ms() + 60_000, "to": now_ms() + 120_000}
    )
    assert (status, res["code"]) == (422, "window_in_future"), res
    one_shot = uid("bf-once")
    _create(api_server, key, create_body(now_ms() + 3_600_000, schedule_id=one_shot))
    status, res = api_server.call(
        "POST",
        f"/v1/schedules/{one_shot}/backfill",
        key=key,
        body={"from": "2026-01-01T00:00:00Z", "to": "2026-01-02T00:00:00Z"},
    )
    assert (status, res["code"]) == (409, "not_recurring"), res
    for bad in ({"from": now - 1}, {"from": now, "to": now - 1}, {"from": 1, "to": 2, "x": 3}):
        status, res = api_server.call("POST", path, key=key, body=bad)
        assert status == 400, (bad, res)
    status, res = api_server.call(
        "POST", f"/v1/schedules/{uid('none')}/backfill", key=key, body={"from": 1, "to": now}
    )
    assert (status, res["code"]) == (404, "not_found"), res


def test_the_command_line_backfills(
    api_server: Any, api_stack: Settings, acct: dict[str, Any]
) -> None:
    key, tenant, sid = acct["api_key"], acct["tenant"], uid("bf-cli")
    _recurring(api_server, key, sid)
    now = now_ms()
    out = _tocsin(
        api_stack,
        "schedule",
        "backfill",
        tenant,
        sid,
        "--from",
        str(now - 180_000),
        "--to",
        str(now),
        "--json",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [row] = orjson.loads(out.stdout)
    assert (row["schedule_id"], row["code"]) == (sid, "ok")
    assert row["message"].startswith("backfilled 3 runs"), row
    usage = _tocsin(api_stack, "schedule", "backfill", tenant, sid, "--from", str(now))
    assert usage.returncode == 2 and "--from and --to" in usage.stderr

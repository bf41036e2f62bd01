"""Recurring schedules through the REST API, the go-scheduler facade and the CLI, on the
real stack (a real worker behind a real ``tocsin api``; the CLI as a subprocess).

No timing assertions: waits poll for an outcome with a generous deadline.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.integration.test_api_endpoints import cli_runner, now_ms, uid, until

pytestmark = pytest.mark.integration

HOOK = {"type": "http", "url": "https://receiver.example/hook"}


@pytest.fixture(scope="module")
def acct(api_server: Any) -> dict[str, Any]:
    status, body = api_server.call(
        "POST", "/v1/tenants", key=api_server.admin_key, body={"tenant": uid("rec")}
    )
    assert status == 201, body
    return body  # type: ignore[no-any-return]


def test_cron_schedule_create_get_runs_list_update_cancel(
    api_server: Any, acct: dict[str, Any]
) -> None:
    key, sid = acct["api_key"], uid("cron")
    # Every two seconds (six fields, seconds first), in a zone with DST.
    body = {
        "schedule_id": sid,
        "payload": {"n": 1},
        "callback": HOOK,
        "recurrence": {"cron": "*/2 * * * * *", "time_zone": "Europe/London"},
    }
    st, res = api_server.call("POST", "/v1/schedules", key=key, body=body)
    assert st == 201 and res["code"] == "ok", res
    st, res = api_server.call("POST", "/v1/schedules", key=key, body=body)
    assert st == 200 and res["code"] == "duplicate", res

    st, view = api_server.call("GET", f"/v1/schedules/{sid}?next=4&past=0", key=key)
    assert st == 200, view
    assert view["recurring"] is True and view["status"] == "scheduled"
    assert view["recurrence"]["cron"] == "*/2 * * * * *"
    assert view["recurrence"]["time_zone"] == "Europe/London"
    assert view["payload"] == {"n": 1} and view["callback"]["url"] == HOOK["url"]
    nxt = [r["nominal_ms"] for r in view["runs"]["next"]]
    assert len(nxt) == 4 and all(b - a == 2000 for a, b in itertools.pairwise(nxt))
    assert view["next_run_ms"] == nxt[0] and nxt[0] % 2000 == 0
    assert [h["event"] for h in view["history"]] == ["created"]

    # Runs fire through the real worker; their history shows them fired.
    def fired_runs() -> list[dict[str, Any]]:
        s, got = api_server.call("GET", f"/v1/schedules/{sid}/runs?past=20&next=3", key=key)
        assert s == 200, got
        return [r for r in got["past"] if r["status"] == "fired"]

    fired = until(lambda: fired_runs() if len(fired_runs()) >= 2 else None, 90, "two runs to fire")
    run = fired[0]
    assert run["run_id"] == f"{sid}@{run['nominal_ms']}" and run["fired_ms"] >= run["due_ms"]
    st, one = api_server.call("GET", f"/v1/schedules/{run['run_id']}", key=key)
    assert st == 200 and one["recurring_run"] is True and one["status"] == "fired", one
    assert one["parent_schedule_id"] == sid and one["trigger_id"] == run["trigger_id"]
    assert one["due_ms"] == run["due_ms"]
    # Paging back through the history with `before`.
    st, older = api_server.call(
        "GET", f"/v1/schedules/{sid}/runs?past=1&next=0&before={run['nominal_ms']}", key=key
    )
    assert st == 200 and older["next"] == []
    assert all(r["nominal_ms"] < run["nominal_ms"] for r in older["past"])

    # The listing: a one-shot in the window and the cron, merged in due order over pages.
    other = uid("one")
    st, _ = api_server.call(
        "POST",
        "/v1/schedules",
        key=key,
        body={"schedule_id": other, "due": now_ms() + 1_800_000, "callback": HOOK},
    )
    assert st == 201
    lo, hi = now_ms(), now_ms() + 3_600_000
    seen: list[dict[str, Any]] = []
    cursor = None
    while True:
        q = f"/v1/schedules?from={lo}&to={hi}&limit=1" + (f"&cursor={cursor}" if cursor else "")
        st, page = api_server.call("GET", q, key=key)
        assert st == 200 and len(page["schedules"]) <= 1, page
        seen += page["schedules"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    ids = [s["schedule_id"] for s in seen]
    assert ids.index(sid) < ids.index(other), ids  # the cron runs within seconds
    cron_entry = seen[ids.index(sid)]
    assert cron_entry["recurring"] is True and cron_entry["status"] == "scheduled"
    assert lo <= cron_entry["due_ms"] < hi and cron_entry["next_run_ms"] >= cron_entry["due_ms"]
    st, page = api_server.call("GET", f"/v1/schedules?from={lo}&to={hi}&status=completed", key=key)
    assert st == 200 and sid not in [s["schedule_id"] for s in page["schedules"]]

    # Update: a new rule for the runs to come.
    st, res = api_server.call(
        "PATCH",
        f"/v1/schedules/{sid}",
        key=key,
        body={"recurrence": {"every_s": 3600}, "payload": {"n": 2}},
    )
    assert st == 200 and res["code"] == "ok", res
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert view["recurrence"]["every_s"] == 3600 and view["payload"] == {"n": 2}
    assert view["next_run_ms"] > now_ms() + 3_000_000
    st, res = api_server.call(
        "POST", f"/v1/schedules/{sid}/reschedule", key=key, body={"due": now_ms() + 60_000}
    )
    assert st == 400 and res["code"] == "invalid_field"

    st, res = api_server.call("DELETE", f"/v1/schedules/{sid}", key=key)
    assert st == 200 and res["code"] == "ok", res
    st, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
    assert view["status"] == "cancelled" and view["next_run_ms"] is None
    assert view["runs"]["next"] == []
    st, page = api_server.call(
        "GET", f"/v1/schedules?from={lo - 60_000}&to={hi}&status=cancelled", key=key
    )
    assert sid in [s["schedule_id"] for s in page["schedules"]]

    st, res = api_server.call("GET", f"/v1/schedules/{other}/runs", key=key)
    assert st == 404 and res["error"]["code"] == "not_recurring"
    st, doc = api_server.call("GET", "/openapi.json")
    assert "/v1/schedules/{schedule_id}/runs" in doc["paths"]
    assert "recurrence" in doc["components"]["schemas"]["CreateSchedule"]["properties"]


def test_a_finished_schedule_is_completed(api_server: Any, acct: dict[str, Any]) -> None:
    key, sid = acct["api_key"], uid("two")
    st, res = api_server.call(
        "POST",
        "/v1/schedules",
        key=key,
        body={"schedule_id": sid, "callback": HOOK, "recurrence": {"every_s": 1, "max_runs": 2}},
    )
    assert st == 201 and res["code"] == "ok", res

    def status() -> str:
        s, view = api_server.call("GET", f"/v1/schedules/{sid}", key=key)
        assert s == 200, view
        return str(view["status"])

    until(lambda: status() == "completed", 60, "the schedule to complete")
    st, got = api_server.call("GET", f"/v1/schedules/{sid}/runs", key=key)
    assert st == 200 and got["next"] == [] and len(got["past"]) == 2
    st, page = api_server.call(
        "GET", f"/v1/schedules?from={now_ms() - 600_000}&to={now_ms()}&status=completed", key=key
    )
    assert sid in [s["schedule_id"] for s in page["schedules"]]


def test_recurring_schedules_and_the_tenant_horizon(api_server: Any) -> None:
    st, t = api_server.call(
        "POST",
        "/v1/tenants",
        key=api_server.admin_key,
        body={"tenant": uid("hz"), "config": {"max_horizon_s": 3600}},
    )
    assert st == 201, t
    key = t["api_key"]

    def post(rec: dict[str, Any]) -> tuple[int, Any]:
        return api_server.call(  # type: ignore[no-any-return]
            "POST", "/v1/schedules", key=key, body={"callback": HOOK, "recurrence": rec}
        )

    st, r = post({"cron": "*/10 * * * *"})
    assert st == 201, r
    st, r = post({"every_s": 60, "start": now_ms() + 7_200_000})
    assert st == 422 and r["code"] == "beyond_horizon", r
    st, r = post({"every_s": 86_400})  # first run a day after the create
    assert st == 422 and r["code"] == "beyond_horizon", r
    # Yearly, unless the next 1 January is within the hour.
    if datetime.now(UTC).timetuple().tm_yday < 365:
        st, r = post({"cron": "0 0 1 1 *"})
        assert st == 422 and r["code"] == "beyond_horizon", r
    st, r = post({"cron": "0 0 31 2 *"})
    assert st == 400 and r["error"]["code"] == "invalid_field", r


def test_goscheduler_cron_round_trip(api_server: Any) -> None:
    admin = api_server.admin_key
    app_id = f"gocron-{uuid.uuid4().hex[:8]}"
    st, body = api_server.call(
        "POST",
        "/goscheduler/apps",
        key=admin,
        body={"appId": app_id, "partitions": 2, "active": True},
    )
    assert st == 201, body
    key = body["data"]["apiKey"]
    cron = {
        "appId": app_id,
        "payload": '{"kind": "cron"}',
        "cronExpression": "* * * * *",
        "callback": {
            "type": "http",
            "details": {"url": "https://receiver.example/cron", "method": "POST", "headers": {}},
        },
    }
    st, body = api_server.call("POST", "/goscheduler/schedules", key=key, body=cron)
    assert st == 201 and body["status"]["statusType"] == "Success", body
    created = body["data"]["schedule"]
    sid = created["scheduleId"]
    assert created["cronExpression"] == "* * * * *" and created["status"] == "SCHEDULED"
    assert "scheduleTime" not in created and created["payload"] == '{"kind": "cron"}'

    st, body = api_server.call("GET", f"/goscheduler/schedules/{sid}", key=key)
    assert st == 200 and body["data"]["schedule"]["cronExpression"] == "* * * * *"
    # Future runs page by page, each a one-time schedule at a minute boundary.
    st, body = api_server.call(
        "GET", f"/goscheduler/schedules/{sid}/runs?when=future&size=3", key=key
    )
    assert st == 200, body
    first = body["data"]["schedules"]
    assert len(first) == 3 and all(r["scheduleTime"] % 60 == 0 for r in first)
    assert [r["status"] for r in first] == ["SCHEDULED"] * 3
    token = body["data"]["continuationToken"]
    st, body = api_server.call(
        "GET",
        f"/goscheduler/schedules/{sid}/runs?when=future&size=3&continuation_token={token}",
        key=key,
    )
    second = body["data"]["schedules"]
    assert [r["scheduleTime"] for r in second] == [
        first[-1]["scheduleTime"] + 60 * i for i in (1, 2, 3)
    ]
    st, body = api_server.call("GET", f"/goscheduler/crons/schedules?app_id={app_id}", key=key)
    assert st == 200 and sid in [c["scheduleId"] for c in body["data"]], body
    now_s = int(time.time())
    st, body = api_server.call(
        "GET",
        f"/goscheduler/apps/{app_id}/schedules?start_time={now_s}&end_time={now_s + 300}",
        key=key,
    )
    assert st == 200 and sid in [s["scheduleId"] for s in body["data"]["schedules"]], body

    # go-scheduler's AND of the day fields: the first Monday of the month at 09:00.
    st, body = api_server.call(
        "POST", "/goscheduler/schedules", key=key, body={**cron, "cronExpression": "0 9 1-7 * 1"}
    )
    assert st == 201, body
    monday = body["data"]["schedule"]["scheduleId"]
    st, native = api_server.call("GET", f"/v1/schedules/{monday}", key=key)
    assert st == 200 and native["recurrence"] == {
        "cron": "0 0 9 1-7 * 1",
        "day_match": "all",
        "time_zone": "UTC",
        "ambiguous": "twice",
        "nonexistent": "skip",
        "jitter_s": 0,
        "misfire": "fire_latest",
    }, native
    st, body = api_server.call(
        "GET", f"/goscheduler/schedules/{monday}/runs?when=future&size=4", key=key
    )
    for run in body["data"]["schedules"]:
        moment = datetime.fromtimestamp(run["scheduleTime"], UTC)
        assert moment.weekday() == 0 and moment.day <= 7 and moment.hour == 9, moment
    st, body = api_server.call("DELETE", f"/goscheduler/schedules/{monday}", key=key)
    assert st == 200 and body["data"]["schedule"]["status"] == "DELETED"

    st, body = api_server.call(
        "POST", "/goscheduler/schedules", key=key, body={**cron, "cronExpression": "0 0 * */2 *"}
    )
    assert st == 400 and body["status"]["errorCode"] == "invalid_cron", body
    st, body = api_server.call(
        "POST", "/goscheduler/schedules", key=key, body={**cron, "scheduleTime": now_s + 600}
    )
    assert st == 400 and body["status"]["statusType"] == "Fail"

    # The every-minute cron fires through the worker: a past run, reported SUCCESS.
    def past() -> list[Any]:
        s, b = api_server.call("GET", f"/goscheduler/schedules/{sid}/runs?when=past", key=key)
        return b["data"]["schedules"] if s == 200 else []

    # A past run reads SCHEDULED until its fire is recorded (moments after it is emitted).
    runs = until(
        lambda: [r for r in past() if r["status"] == "SUCCESS"], 150, "the cron's first fired run"
    )
    assert runs[0]["scheduleId"].startswith(sid + "@")
    st, body = api_server.call("GET", f"/goscheduler/schedules/{runs[0]['scheduleId']}", key=key)
    assert st == 200 and body["data"]["schedule"]["status"] == "SUCCESS", body
    assert body["data"]["schedule"]["scheduleTime"] == runs[0]["scheduleTime"]
    assert body["data"]["schedule"]["payload"] == '{"kind": "cron"}'
    st, body = api_server.call("DELETE", f"/goscheduler/schedules/{sid}", key=key)
    assert st == 200 and body["data"]["schedule"]["status"] == "DELETED"
    st, body = api_server.call(
        "GET", f"/goscheduler/crons/schedules?app_id={app_id}&status=SCHEDULED", key=key
    )
    assert st == 404, body


def test_cli_recurring_flags(api_server: Any) -> None:
    tocsin = cli_runner(api_server)
    name = uid("clirec")
    assert tocsin("tenant", "register", name).returncode == 0
    out = tocsin(
        "schedule",
        "create",
        name,
        "c1",
        "--cron",
        "*/5 * * * * *",
        "--tz",
        "Europe/London",
        "--max-runs",
        "1000",
        "--jitter-s",
        "2",
        "--misfire",
        "skip",
        "--dst-gap",
        "shift_forward",
        "--dst-overlap",
        "twice",
        "--url",
        "https://h.example/x",
        "--payload",
        '{"a": 1}',
        "--json",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)[0]["code"] == "ok"
    out = tocsin("schedule", "get", name, "c1", "--json")
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert view["recurring"] is True and view["status"] == "scheduled"
    assert view["recurrence"] == {
        "cron": "*/5 * * * * *",
        "time_zone": "Europe/London",
        "max_runs": 1000,
        "jitter_s": 2,
        "misfire": "skip",
        "nonexistent": "shift_forward",
        "ambiguous": "twice",
    }
    assert view["misfire_tolerance_s"] == 60
    out = tocsin("schedule", "runs", name, "c1", "--next", "3", "--past", "0", "--json")
    assert out.returncode == 0 and len(json.loads(out.stdout)["next"]) == 3, out.stderr
    out = tocsin("schedule", "get", name, "c1")  # readable
    assert out.returncode == 0 and "recurrence" in out.stdout and "next" in out.stdout

    out = tocsin(
        "schedule",
        "create",
        name,
        "c2",
        "--every-s",
        "3600",
        "--start",
        str(now_ms() + 600_000),
        "--topic",
        "acme.ticks",
    )
    assert out.returncode == 0 and "accepted" in out.stdout, out.stdout + out.stderr
    assert "tocsin schedule runs" in out.stdout
    lo, hi = now_ms(), now_ms() + 3_600_000
    out = tocsin("schedule", "list", name, "--from", str(lo), "--to", str(hi), "--json")
    assert out.returncode == 0, out.stderr
    listed = {r["schedule_id"]: r for r in json.loads(out.stdout)}
    assert set(listed) == {"c1", "c2"} and listed["c2"]["recurring"] == "yes"
    assert listed["c2"]["due_ms"] == listed["c2"]["next_run_ms"]

    # Rejected by the contract's decoder (exit 4, the code printed), usage errors (exit 2).
    out = tocsin(
        "schedule", "create", name, "c3", "--cron", "0 0 31 2 *", "--url", "https://h.example/x"
    )
    assert out.returncode == 4 and "invalid_field" in out.stdout, out.stdout + out.stderr
    out = tocsin(
        "schedule",
        "create",
        name,
        "c3",
        "--cron",
        "* * * * *",
        "--tz",
        "Nowhere/X",
        "--url",
        "https://h.example/x",
        "--json",
    )
    assert out.returncode == 4 and json.loads(out.stdout)[0]["code"] == "invalid_field"
    out = tocsin(
        "schedule",
        "create",
        name,
        "c3",
        "--cron",
        "* * * * *",
        "--due",
        str(now_ms() + 60_000),
        "--url",
        "https://h.example/x",
    )
    assert out.returncode == 2 and "exactly one of --due" in out.stderr
    out = tocsin(
        "schedule",
        "create",
        name,
        "c3",
        "--due",
        str(now_ms() + 60_000),
        "--max-runs",
        "3",
        "--url",
        "https://h.example/x",
    )
    assert out.returncode == 2 and "--max-runs" in out.stderr
    assert (
        tocsin(
            "schedule",
            "create",
            name,
            "c3",
            "--cron",
            "* * * * *",
            "--misfire",
            "later",
            "--url",
            "https://h.example/x",
        ).returncode
        == 2
    )  # argparse choices
    assert tocsin("schedule", "cancel", name, "c1").returncode == 0
    out = tocsin("schedule", "get", name, "c1", "--json")
    assert json.loads(out.stdout)["status"] == "cancelled"

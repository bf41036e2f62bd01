"""A go-scheduler client's round trip through the facade (/goscheduler/...)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_goscheduler_round_trip(api_server: Any) -> None:
    admin = api_server.admin_key
    app_id = f"go-{uuid.uuid4().hex[:8]}"
    assert api_server.call("GET", "/goscheduler/healthcheck")[0] == 200

    st, body = api_server.call(
        "POST",
        "/goscheduler/apps",
        key=admin,
        body={"appId": app_id, "partitions": 5, "active": True},
    )
    assert st == 201 and body["status"]["statusType"] == "Success", body
    assert body["data"]["appId"] == app_id and body["data"]["active"] is True
    key = body["data"]["apiKey"]
    st, body = api_server.call("GET", "/goscheduler/apps", key=admin)
    assert app_id in [a["appId"] for a in body["data"]["apps"]]

    when = int(time.time()) + 3600
    schedule = {
        "appId": app_id,
        "payload": "{}",
        "scheduleTime": when,
        "callback": {
            "type": "http",
            "details": {
                "url": "https://receiver.example/hook",
                "method": "GET",
                "headers": {"Content-Type": "application/json"},
            },
        },
    }
    st, body = api_server.call("POST", "/goscheduler/schedules", key=key, body=schedule)
    assert st == 201, body
    created = body["data"]["schedule"]
    sid = created["scheduleId"]
    assert created["status"] == "SCHEDULED" and created["scheduleTime"] == when
    assert created["payload"] == "{}" and created["callback"]["details"]["method"] == "GET"

    st, body = api_server.call("GET", f"/goscheduler/schedules/{sid}", key=key)
    assert st == 200 and body["data"]["schedule"]["appId"] == app_id
    st, body = api_server.call("GET", f"/goscheduler/schedules/{sid}/runs", key=key)
    assert st == 404 and body["status"]["statusType"] == "Fail"
    st, body = api_server.call(
        "GET",
        f"/goscheduler/apps/{app_id}/schedules?start_time={when - 60}"
        f"&end_time={when + 60}&status=SCHEDULED",
        key=key,
    )
    assert st == 200 and sid in [s["scheduleId"] for s in body["data"]["schedules"]]

    st, body = api_server.call("DELETE", f"/goscheduler/schedules/{sid}", key=key)
    assert st == 200 and body["data"]["schedule"]["status"] == "DELETED"
    assert api_server.call("DELETE", "/goscheduler/schedules/nope", key=key)[0] == 404

    # Another app's key, or a body naming another app, cannot reach this app's schedules.
    st, other = api_server.call(
        "POST",
        "/goscheduler/apps",
        key=admin,
        body={"appId": app_id + "x", "partitions": 1, "active": True},
    )
    okey = other["data"]["apiKey"]
    assert api_server.call("GET", f"/goscheduler/schedules/{sid}", key=okey)[0] == 404
    st, body = api_server.call("POST", "/goscheduler/schedules", key=okey, body=schedule)
    assert st == 403 and body["status"]["statusType"] == "Fail"

    # A fired schedule reports SUCCESS and one run.
    schedule["scheduleTime"] = int(time.time()) + 1
    st, body = api_server.call("POST", "/goscheduler/schedules", key=key, body=schedule)
    assert st == 201
    fired_id = body["data"]["schedule"]["scheduleId"]
    deadline = time.monotonic() + 60
    status = ""
    while status != "SUCCESS" and time.monotonic() < deadline:
        status = api_server.call("GET", f"/goscheduler/schedules/{fired_id}", key=key)[1]["data"][
            "schedule"
        ]["status"]
        time.sleep(0.3)
    assert status == "SUCCESS"
    st, body = api_server.call("GET", f"/goscheduler/schedules/{fired_id}/runs", key=key)
    assert st == 200 and len(body["data"]["schedules"]) == 1

    # Reconcile (any status) re-fires it under the same trigger id: a second run.
    fired_at = schedule["scheduleTime"]
    st, body = api_server.call(
        "POST",
        f"/goscheduler/apps/{app_id}/bulk-action/reconcile"
        f"?start_time={fired_at - 60}&end_time={fired_at + 120}",
        key=key,
    )
    assert st == 200 and body["status"]["totalCount"] == 1, body
    assert body["data"]["refired"] == 1 and "reconcile done" in body["remarks"]
    st, body = api_server.call("GET", f"/goscheduler/schedules/{fired_id}/runs", key=key)
    runs = body["data"]["schedules"]
    assert st == 200 and len(runs) == 2 and runs[0]["runId"] == runs[1]["runId"], runs

    st, body = api_server.call("POST", f"/goscheduler/apps/{app_id}/deactivate", key=admin)
    assert st == 200 and body["data"]["Active"] is False
    st, body = api_server.call("POST", f"/goscheduler/apps/{app_id}/deactivate", key=admin)
    assert st == 400

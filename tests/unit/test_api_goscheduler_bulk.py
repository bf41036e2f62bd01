"""go-scheduler's bulk action through the facade: ``reconcile`` onto the bulk re-fire and
``delete`` onto the bulk cancel, with go-scheduler's window rules and answer shape."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from api import goscheduler
from api import goscheduler_views as gv
from api.server import errors
from api.service import Principal, Service
from api.views import ApiError

KEY: web.AppKey[Service] = web.AppKey("service", Service)
MIN = 60_000


def _ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


class FakeService:
    """The service calls the facade's bulk action makes, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def authenticate(self, key: str | None) -> Principal:
        if key != "app-key":
            raise ApiError(401, "unauthorized", "no such key")
        return Principal(tenant="app1")

    async def bulk_refire(
        self, tenant: str, from_ms: int, to_ms: int, statuses: frozenset[str]
    ) -> dict[str, object]:
        self.calls.append(("refire", tenant, from_ms, to_ms, statuses))
        failed = [{"schedule_id": "b", "code": "unavailable", "retriable": True}]
        return {"matched": 3, "refired": 2, "failed": failed, "truncated": False}

    async def bulk_cancel(self, tenant: str, from_ms: int, to_ms: int) -> dict[str, object]:
        self.calls.append(("cancel", tenant, from_ms, to_ms))
        return {"matched": 1, "cancelled": 1, "codes": {"ok": 1}, "failed": [], "truncated": False}


async def _post(path: str, key: str = "app-key") -> tuple[int, dict[str, Any], FakeService]:
    svc = FakeService()
    app = web.Application(middlewares=[errors])
    app[KEY] = svc  # type: ignore[assignment]
    goscheduler.add_routes(app, KEY)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(path, headers={"Authorization": f"Bearer {key}"})
        return resp.status, await resp.json(), svc


async def test_reconcile_of_failures_refires_the_dead_lettered_due_in_the_window() -> None:
    st, body, svc = await _post(
        "/goscheduler/apps/app1/bulk-action/reconcile?status=FAILURE"
        "&start_time=2026-11-20 10:00:30&end_time=2026-11-20 12:00:59"
    )
    assert st == 200, body
    # Both ends floored to the minute, as go-scheduler walks minutes [start, end).
    lo, hi = _ms("2026-11-20T10:00:00"), _ms("2026-11-20T12:00:00")
    assert svc.calls == [("refire", "app1", lo, hi, frozenset({"dead_lettered"}))]
    assert body["status"] == {
        "statusCode": 200,
        "statusMessage": "Success",
        "statusType": "Success",
        "totalCount": 3,
    }
    assert body["remarks"].startswith("reconcile done for app: app1, timeRange: [2026-11-20T10")
    assert "status: FAILURE: 2 of 3 matched, 1 failed" in body["remarks"]
    assert body["data"]["refired"] == 2 and body["data"]["failed"][0]["schedule_id"] == "b"


@pytest.mark.parametrize(
    ("status", "native"),
    [
        ("", {"fired", "missed"}),
        ("SUCCESS", {"delivered"}),
        ("MISS", {"missed"}),
    ],
)
async def test_each_status_maps_to_the_refire_statuses(status: str, native: set[str]) -> None:
    st, _, svc = await _post(f"/goscheduler/apps/app1/bulk-action/reconcile?status={status}")
    assert st == 200
    assert svc.calls[0][4] == frozenset(native)


async def test_without_times_the_window_is_the_last_hour() -> None:
    st, _, svc = await _post("/goscheduler/apps/app1/bulk-action/reconcile")
    assert st == 200
    _, _, lo, hi, _ = svc.calls[0]
    assert hi - lo == 60 * MIN and hi % MIN == 0


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("status=SCHEDULED", "fires scheduled ones itself"),
        ("status=DELETED", "never fired again"),
        ("status=DONE", "unknown status"),
        ("start_time=1700000000&end_time=1700700000", "more than 7 days"),
        ("start_time=1700000600&end_time=1700000000", "cannot be before"),
        ("start_time=yesterday", "start_time"),
    ],
)
async def test_refusals_answer_in_go_schedulers_envelope_and_act_on_nothing(
    query: str, words: str
) -> None:
    st, body, svc = await _post(f"/goscheduler/apps/app1/bulk-action/reconcile?{query}")
    assert st == 400, body
    assert body["status"]["statusType"] == "Fail" and words in body["status"]["statusMessage"]
    assert svc.calls == []


async def test_an_unknown_action_or_another_app_is_refused() -> None:
    st, body, svc = await _post("/goscheduler/apps/app1/bulk-action/purge")
    assert st == 400 and "purge is invalid" in body["status"]["statusMessage"]
    st, body, svc = await _post("/goscheduler/apps/app2/bulk-action/reconcile")
    assert st == 403 and svc.calls == []
    st, body, svc = await _post("/goscheduler/apps/app1/bulk-action/reconcile", key="other")
    assert st == 401 and svc.calls == []


async def test_delete_cancels_the_ones_still_to_fire_only() -> None:
    st, body, svc = await _post(
        "/goscheduler/apps/app1/bulk-action/delete?status=SCHEDULED"
        "&start_time=1700000000&end_time=1700003600"
    )
    assert st == 200, body
    assert svc.calls == [("cancel", "app1", 1_699_999_980_000, 1_700_003_580_000)]
    assert "delete done" in body["remarks"] and "1 of 1 matched" in body["remarks"]
    st, body, svc = await _post("/goscheduler/apps/app1/bulk-action/delete?status=SUCCESS")
    assert st == 400 and svc.calls == []


def test_a_truncated_answer_says_how_to_go_on() -> None:
    done = {"matched": 10_000, "refired": 10_000, "failed": [], "truncated": True}
    body = gv.bulk_body(gv.BulkAction.RECONCILE, "a", (0, MIN), "MISS", done)
    assert "truncated: reconcile narrower windows" in str(body["remarks"])

"""A go-scheduler (Myntra MySS) compatible facade: its core routes under ``/goscheduler``,
its request and response shapes, mapped onto the native service. Every difference is listed
in docs/api.md ("go-scheduler facade")."""

from __future__ import annotations

import base64
import binascii
import time
from datetime import UTC, datetime
from typing import Any

import orjson
from aiohttp import web

from api import gocron, recurring, recurring_io, views
from api.views import ApiError
from base.errors import CommandRejected, ConfigError
from streams.recurring import parse_run_id
from streams.tenants import TenantConfig
from topics.validation import check_time_zone

_STATUS_MESSAGE = {200: "Success", 201: "Success", 202: "Accepted"}


def _ok(data: Any, status: int = 200, count: int = 1) -> web.Response:
    body = {"status": {"statusCode": status, "statusMessage": _STATUS_MESSAGE.get(status, "OK"),
                       "statusType": "Success", "totalCount": count}, "data": data}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def error_response(exc: ApiError) -> web.Response:
    body = {"status": {"statusCode": exc.status, "statusMessage": exc.message,
                       "statusType": "Fail", "errorCode": exc.code}}
    return web.Response(body=orjson.dumps(body), status=exc.status,
                        content_type="application/json")


def go_status(row: dict[str, Any]) -> str:
    """go-scheduler's status for a schedule row."""
    state = views.effective_state(row)
    if state == "scheduled":
        return "SCHEDULED"
    if state == "cancelled":
        return "DELETED"
    if state == "missed":
        return "MISS"
    if row.get("delivery_outcome") == "dead_lettered":
        return "FAILURE"
    return "SUCCESS"  # fired (delivered, or handed to the fires topic for a consumer)


def go_schedule(row: dict[str, Any]) -> dict[str, Any]:
    due_s = int(row["due_ms"]) // 1000
    payload = row.get("payload") or b""
    go_cb = _go_callback(row)
    out: dict[str, Any] = {
        "scheduleId": row["schedule_id"],
        "payload": payload.decode("utf-8", "replace"),
        "appId": row["tenant"],
        "scheduleTime": due_s,
        "partitionId": row.get("partition"),
        "scheduleGroup": due_s - due_s % 60,
        "callback": go_cb,
        "status": go_status(row),
    }
    if row.get("delivery_outcome") == "dead_lettered":
        out["errorMessage"] = f"delivery failed (HTTP {row.get('delivery_status_code')})"
    return out


_PARENT_STATUS = {recurring.SCHEDULED: "SCHEDULED", recurring.CANCELLED: "DELETED",
                  recurring.COMPLETED: "SUCCESS"}


def _go_callback(row: dict[str, Any]) -> dict[str, Any]:
    callback = orjson.loads(row["callback"]) if row.get("callback") else {}
    if callback.get("type") == "http":
        return {"type": "http", "details": {"url": callback["url"],
                                            "method": callback.get("method", "POST"),
                                            "headers": callback.get("headers", {})}}
    return {"type": callback.get("type", "kafka"),
            "details": {k: v for k, v in callback.items() if k != "type"}}


def go_cron_schedule(row: dict[str, Any], status: str) -> dict[str, Any]:
    """go-scheduler's view of a recurring schedule (a "cron"): no scheduleTime, its
    cronExpression (a rate made through /v1 shows as ``@every <n>s``)."""
    rec = recurring.recurrence_view(row)
    expression = (gocron.display(rec["cron"]) if "cron" in rec
                  else f"@every {rec['every_s']}s")
    return {
        "scheduleId": row["schedule_id"],
        "payload": (row.get("payload") or b"").decode("utf-8", "replace"),
        "appId": row["tenant"],
        "partitionId": row.get("partition"),
        "callback": _go_callback(row),
        "cronExpression": expression,
        "status": _PARENT_STATUS.get(status, "SCHEDULED"),
    }


def go_run(run: dict[str, Any], parent: dict[str, Any]) -> dict[str, Any]:
    """One run of a cron as go-scheduler shows it: a one-time schedule of its own."""
    due_s = int(run["due_ms"]) // 1000
    state = run.get("state", "scheduled")
    status = {"scheduled": "SCHEDULED", "missed": "MISS", "cancelled": "DELETED"}.get(
        state, "FAILURE" if run.get("delivery") == "dead_lettered" else "SUCCESS")
    return {
        "scheduleId": run["run_id"],
        "payload": (parent.get("payload") or b"").decode("utf-8", "replace"),
        "appId": parent["tenant"],
        "scheduleTime": due_s,
        "partitionId": parent.get("partition"),
        "scheduleGroup": due_s - due_s % 60,
        "callback": _go_callback(parent),
        "status": status,
        "runId": run["trigger_id"],
    }


def _token_ms(token: str | None) -> int | None:
    """Our continuation token of runs: a nominal time in epoch ms, as 16 hex digits."""
    if not token:
        return None
    try:
        raw = binascii.unhexlify(token)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}") from None
    if len(raw) != 8:
        raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}")
    return int.from_bytes(raw, "big")


def _go_time(value: str, name: str) -> int:
    """'2006-01-02 15:04:05' (UTC here), unix seconds (like scheduleTime) or RFC 3339."""
    if value.isdigit():
        return int(value) * 1000
    try:
        moment = datetime.strptime(value, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        return int(moment.timestamp()) * 1000
    except ValueError:
        return views.parse_time(value, name)


def add_routes(app: web.Application, key: Any, cron_time_zone: str = "UTC") -> None:
    from api.server import principal, read_json

    try:
        check_time_zone(cron_time_zone, "TOCSIN_GOSCHEDULER_CRON_TIME_ZONE")
    except CommandRejected as exc:
        raise ConfigError(exc.message) from None

    def service(request: web.Request) -> Any:
        return request.app[key]

    def now_ms() -> int:
        return time.time_ns() // 1_000_000

    async def healthcheck(request: web.Request) -> web.Response:
        return _ok({"status": "healthy"})

    async def register_app(request: web.Request) -> web.Response:
        (await principal(request)).require_admin()
        body = await read_json(request)
        app_id = body.get("appId")
        active = body.get("active", True)
        if not isinstance(active, bool):
            raise ApiError(400, "invalid_field", "active must be a boolean")
        created = await service(request).register_tenant(app_id, {}, active=active)
        return _ok({"appId": app_id, "partitions": body.get("partitions", 0),
                    "active": active, "configuration": {},
                    "apiKey": created["api_key"], "signingKey": created["signing_key"]}, 201)

    def _app(row: dict[str, Any]) -> dict[str, Any]:
        return {"appId": row["tenant"], "partitions": 0, "active": bool(row.get("active")),
                "configuration": TenantConfig.from_json(row.get("config")).to_dict()}

    async def get_apps(request: web.Request) -> web.Response:
        (await principal(request)).require_admin()
        rows = await service(request).list_tenants()
        wanted = request.query.get("app_id")
        apps = [_app(r) for r in rows if not wanted or r["tenant"] == wanted]
        return _ok({"apps": apps}, count=len(apps))

    async def set_active(request: web.Request, active: bool) -> web.Response:
        (await principal(request)).require_admin()
        app_id = request.match_info["appId"]
        row = await service(request).get_tenant(app_id)
        if bool(row.get("active")) == active:
            raise ApiError(400, "already_" + ("active" if active else "inactive"),
                           f"app {app_id} is already {'active' if active else 'deactivated'}")
        await service(request).update_tenant(app_id, config=None, active=active)
        return _ok({"appId": app_id, "Active": active})

    async def activate(request: web.Request) -> web.Response:
        return await set_active(request, True)

    async def deactivate(request: web.Request) -> web.Response:
        return await set_active(request, False)

    async def create(request: web.Request) -> web.Response:
        tenant = (await principal(request)).require_tenant()
        body = await read_json(request)
        svc = service(request)
        app_id = body.get("appId", tenant)
        if app_id != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}, "
                                             f"not {app_id!r}")
        unknown = sorted(set(body) - {"appId", "payload", "scheduleTime", "callback",
                                      "cronExpression"})
        if unknown:
            raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
        cron = body.get("cronExpression") or None  # "" is a one-time schedule, as there
        when = body.get("scheduleTime")
        if cron is not None:
            if when not in (None, 0):
                raise ApiError(400, "invalid_field", "give either scheduleTime (a one-time "
                                                     "schedule) or cronExpression, not both")
            try:
                translated = gocron.translate(cron)
            except gocron.GoCronError as exc:
                raise ApiError(400, "invalid_cron", str(exc)) from None
            # go-scheduler matches the server clock minute by minute: a local time that DST
            # repeats matches twice, one it skips never (docs/api.md).
            timing: dict[str, Any] = {"recurrence": {
                "cron": translated.cron, "time_zone": cron_time_zone, "ambiguous": "twice",
                **({"day_match": "all"} if translated.day_match == "all" else {})}}
        elif isinstance(when, bool) or not isinstance(when, int):
            raise ApiError(400, "invalid_field", "scheduleTime must be unix seconds")
        else:
            timing = {"due": when * 1000}
        payload = body.get("payload", "")
        if not isinstance(payload, str):
            raise ApiError(400, "invalid_field", "payload must be a string")
        cb = body.get("callback")
        if not isinstance(cb, dict) or cb.get("type") != "http" or not isinstance(
            cb.get("details"), dict
        ):
            raise ApiError(400, "invalid_callback",
                           "callback must be {\"type\": \"http\", \"details\": {url, method, "
                           "headers}}")
        details = cb["details"]
        callback = {"type": "http", "url": details.get("url"),
                    "method": str(details.get("method", "POST")).upper()}
        if details.get("headers"):
            callback["headers"] = details["headers"]
        sid = svc.new_schedule_id()
        cmd = views.create_command(
            {**timing, "callback": callback,
             "payload_b64": base64.b64encode(payload.encode("utf-8")).decode("ascii")},
            tenant=tenant, schedule_id=sid, request_id=svc.bridge.new_request_id(),
        )
        result = await svc.send(cmd, wait=True)
        if result["status"] != "accepted":
            raise ApiError(views.http_status(result["code"]), result["code"], result["message"])
        row, _ = await svc.get_schedule(tenant, sid)
        return _ok({"schedule": await _view(svc, row)}, 201)

    async def _view(svc: Any, row: dict[str, Any]) -> dict[str, Any]:
        if recurring.is_parent(row):
            status, _, _ = await recurring_io.parent_state(svc.store, row, now_ms=now_ms())
            return go_cron_schedule(row, status)
        if row.get("due_ms") is None:
            # A cron's run (<cron id>@<nominal ms>) that fired: its row holds the outcome,
            # its cron the payload and callback.
            parsed = parse_run_id(str(row["schedule_id"]))
            if parsed is None:
                raise ApiError(404, "not_found", f"no schedule {row['schedule_id']!r}")
            cron, _ = await svc.get_schedule(row["tenant"], parsed[0])
            events = await svc.store.list_events(row["tenant"], row["schedule_id"])
            run = recurring.run_row_view(row, events, parent_id=parsed[0],
                                         nominal_ms=parsed[1])
            return go_run({"run_id": run["schedule_id"], "state": run["status"],
                           "due_ms": run["due_ms"] or parsed[1],
                           "delivery": (run["delivery"] or {}).get("outcome"),
                           "trigger_id": run["trigger_id"]}, cron)
        return go_schedule(row)

    async def get(request: web.Request) -> web.Response:
        tenant = (await principal(request)).require_tenant()
        svc = service(request)
        row, _ = await svc.get_schedule(tenant, request.match_info["scheduleId"])
        return _ok({"schedule": await _view(svc, row)})

    async def delete(request: web.Request) -> web.Response:
        tenant = (await principal(request)).require_tenant()
        svc = service(request)
        sid = svc.check_schedule_id(request.match_info["scheduleId"])
        await svc.get_schedule(tenant, sid)  # 404 for an unknown id, like go-scheduler
        result = await svc.send(views.cancel_command(
            tenant=tenant, schedule_id=sid, request_id=svc.bridge.new_request_id()), wait=True)
        if result["code"] not in ("ok", "already_cancelled"):
            raise ApiError(views.http_status(result["code"]), result["code"], result["message"])
        row, _ = await svc.get_schedule(tenant, sid)
        return _ok({"schedule": await _view(svc, row)})

    async def cron_runs(request: web.Request, row: dict[str, Any]) -> web.Response:
        """go-scheduler's runs of a cron: ``when=past`` (newest first), ``future`` (soonest
        first) or neither (the future runs, latest first, then the past ones: newest
        first throughout); ``size`` (15) and a ``continuation_token`` for past/future."""
        q = request.query
        size = views.parse_limit(q.get("size"), default=15, name="size")
        when = q.get("when", "")
        token = _token_ms(q.get("continuation_token"))
        now = now_ms()
        svc = service(request)
        tenant, sid = row["tenant"], row["schedule_id"]
        past: list[dict[str, Any]] = []
        future: list[dict[str, Any]] = []
        if when in ("past", ""):
            got = await recurring_io.runs(svc.store, tenant, sid, now_ms=now, past=size,
                                          upcoming=0,
                                          before_ms=token if when == "past" else None)
            past = got["past"] if got else []
        if when in ("future", ""):
            after = token + 1 if token is not None and when == "future" else None
            got = await recurring_io.runs(svc.store, tenant, sid, now_ms=now, past=0,
                                          upcoming=size, after_ms=after)
            future = got["next"] if got else []
        if when == "past":
            page, last = past, (past[-1]["nominal_ms"] if len(past) == size else None)
        elif when == "future":
            page, last = future, (future[-1]["nominal_ms"] if len(future) == size else None)
        else:
            page, last = (list(reversed(future)) + past)[:size], None
        if not page:
            raise ApiError(404, "not_found", "No cron runs found")
        next_token = "" if last is None else int(last).to_bytes(8, "big").hex()
        return _ok({"schedules": [go_run(r, row) for r in page],
                    "continuationToken": next_token}, count=len(page))

    async def runs(request: web.Request) -> web.Response:
        tenant = (await principal(request)).require_tenant()
        row, events = await service(request).get_schedule(
            tenant, request.match_info["scheduleId"])
        if recurring.is_parent(row):
            return await cron_runs(request, row)
        fired = [e for e in events if e["event"] in ("fired", "refired", "missed")]
        if not fired:
            raise ApiError(404, "not_found", "No runs found")
        out = []
        for e in fired:
            run = go_schedule(row)
            run["scheduleTime"] = int(e.get("due_ms") or row["due_ms"]) // 1000
            run["status"] = "MISS" if e["event"] == "missed" else run["status"]
            run["runId"] = e.get("trigger_id")
            run["firedAt"] = int(e["at_ms"]) // 1000
            out.append(run)
        return _ok({"schedules": out, "continuationToken": ""}, count=len(out))

    async def app_schedules(request: web.Request) -> web.Response:
        tenant = (await principal(request)).require_tenant()
        if request.match_info["appId"] != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}")
        q = request.query
        hour = 3_600_000
        start, end = q.get("start_time"), q.get("end_time")
        now = time.time_ns() // 1_000_000
        lo = _go_time(start, "start_time") if start else None
        hi = _go_time(end, "end_time") if end else None
        lo, hi = (lo if lo is not None else (hi - hour if hi is not None else now - hour),
                  hi if hi is not None else (lo + hour if lo is not None else now))
        if hi < lo:
            raise ApiError(400, "invalid_parameter", "end_time cannot be before start_time")
        if hi - lo > 30 * 24 * hour:
            raise ApiError(400, "invalid_parameter", "Time range of more than 30 days is not "
                                                     "allowed")
        go_to_native = {"SCHEDULED": {"scheduled"}, "SUCCESS": {"delivered", "completed"},
                        "FAILURE": {"dead_lettered"}, "MISS": {"missed"},
                        "DELETED": {"cancelled"}}
        status = q.get("status")
        if status and status not in go_to_native:
            raise ApiError(400, "invalid_parameter", f"unknown status {status!r}")
        token = q.get("continuation_token")
        try:
            after = views.decode_cursor(
                base64.urlsafe_b64encode(binascii.unhexlify(token)).decode().rstrip("=")
            ) if token else None
        except (binascii.Error, ValueError):
            raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}") from None
        size = views.parse_limit(q.get("size"), default=15)
        svc = service(request)

        def parent(row: dict[str, Any], *, status: str, position_ms: int,
                   next_ms: int | None) -> dict[str, Any]:
            return go_cron_schedule(row, status)

        rows, cursor = await recurring_io.list_page(
            svc.store, svc.list_schedules, go_schedule, tenant, from_ms=lo, to_ms=hi + 1,
            statuses=frozenset(go_to_native[status]) if status else None,
            limit=size, after=after, now_ms=now_ms(), parent_view=parent,
        )
        next_token = ""
        if cursor:
            raw = views.encode_cursor(*cursor)
            next_token = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
        return _ok({"schedules": rows,
                    "continuationToken": next_token,
                    "continuationStartTime": lo // 1000}, count=len(rows))

    async def cron_schedules(request: web.Request) -> web.Response:
        """go-scheduler's ``GET /goscheduler/crons/schedules?app_id=&status=``: the app's
        cron schedules (data is the list itself, as there)."""
        tenant = (await principal(request)).require_tenant()
        app_id = request.query.get("app_id") or tenant
        if app_id != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}")
        wanted = request.query.get("status")
        if wanted and wanted not in _PARENT_STATUS.values():
            raise ApiError(400, "invalid_parameter", f"unknown status {wanted!r}")
        parents = await recurring_io.tenant_parents(service(request).store, tenant,
                                                    now_ms=now_ms())
        crons = [go_cron_schedule(row, status) for row, status, _ in parents]
        crons = [c for c in crons if not wanted or c["status"] == wanted]
        if not crons:
            raise ApiError(404, "not_found", "No cron schedules found")
        return _ok(crons, count=len(crons))

    r = app.router
    r.add_get("/goscheduler/healthcheck", healthcheck)
    r.add_get("/goscheduler/crons/schedules", cron_schedules)
    r.add_post("/goscheduler/apps", register_app)
    r.add_get("/goscheduler/apps", get_apps)
    r.add_post("/goscheduler/apps/{appId}/activate", activate)
    r.add_post("/goscheduler/apps/{appId}/deactivate", deactivate)
    r.add_get("/goscheduler/apps/{appId}/schedules", app_schedules)
    r.add_post("/goscheduler/schedules", create)
    r.add_get("/goscheduler/schedules/{scheduleId}", get)
    r.add_delete("/goscheduler/schedules/{scheduleId}", delete)
    r.add_get("/goscheduler/schedules/{scheduleId}/runs", runs)

"""A go-scheduler (Myntra MySS) compatible facade: its core routes under ``/goscheduler``,
its request and response shapes, mapped onto the native service. Every difference is listed
in docs/api.md ("go-scheduler facade"); the pure parts are in api/goscheduler_views.py."""

from __future__ import annotations

from aiohttp import web

from api import goscheduler_views as gv
from api import recurring, recurring_io, views
from api.context import caller, json_response, read_json
from api.service import Service
from api.views import ApiError
from base.clock import now_ms
from base.errors import CommandRejected, ConfigError
from streams.decisions import Run
from streams.ports import CqlRow
from streams.recurring import parse_run_id
from streams.tenants import TenantConfig
from topics.codes import Code
from topics.models import ResultStatus
from topics.recurrence import check_time_zone


def _ok(data: object, status: int = 200, count: int = 1) -> web.Response:
    return json_response(gv.ok_body(data, status, count), status)


def error_response(exc: ApiError) -> web.Response:
    """An ApiError in go-scheduler's envelope (the API's error middleware calls this for
    every path under ``/goscheduler``)."""
    return json_response(gv.error_body(exc), exc.status)


def _app_view(row: CqlRow) -> dict[str, object]:
    return {
        "appId": row["tenant"],
        "partitions": 0,
        "active": bool(row.get("active")),
        "configuration": TenantConfig.from_json(row.get("config")).to_dict(),
    }


async def _run_view(svc: Service, row: CqlRow) -> dict[str, object]:
    """A cron's run (<cron id>@<nominal ms>) that fired: its row holds the outcome, its
    cron the payload and callback."""
    parsed = parse_run_id(str(row["schedule_id"]))
    if parsed is None:
        raise ApiError(404, "not_found", f"no schedule {row['schedule_id']!r}")
    parent_id, nominal_ms = parsed
    cron, _ = await svc.get_schedule(row["tenant"], parent_id)
    events = await svc.store.list_events(row["tenant"], row["schedule_id"])
    run = recurring.run_row_view(row, events, parent_id=parent_id, nominal_ms=nominal_ms)
    shown = Run(
        run_id=run["schedule_id"],
        nominal_ms=nominal_ms,
        state=run["status"],
        due_ms=run["due_ms"] or nominal_ms,
        delivery=(run["delivery"] or {}).get("outcome"),
        trigger_id=run["trigger_id"],
    )
    return gv.go_run(shown, cron)


async def _schedule_view(svc: Service, row: CqlRow) -> dict[str, object]:
    if recurring.is_parent(row):
        status, _, _ = await recurring_io.parent_state(svc.store, row, now_ms=now_ms())
        return gv.go_cron_schedule(row, status)
    if row.get("due_ms") is None:
        return await _run_view(svc, row)
    return gv.go_schedule(row)


def _cron_listed(
    row: CqlRow, *, status: str, position_ms: int, next_ms: int | None
) -> dict[str, object]:
    return gv.go_cron_schedule(row, status)


async def _cron_runs_of(
    svc: Service, row: CqlRow, when: gv.When, size: int, token_ms: int | None
) -> tuple[list[Run], list[Run]]:
    """(past runs newest first, future runs soonest first) of a cron, as ``when`` asks."""
    tenant, sid, now = row["tenant"], row["schedule_id"], now_ms()
    past: list[Run] = []
    future: list[Run] = []
    if when is not gv.When.FUTURE:
        before = token_ms if when is gv.When.PAST else None
        got = await recurring_io.runs(
            svc.store, tenant, sid, now_ms=now, past=size, upcoming=0, before_ms=before
        )
        past = got["past"] if got else []
    if when is not gv.When.PAST:
        after = token_ms + 1 if token_ms is not None and when is gv.When.FUTURE else None
        got = await recurring_io.runs(
            svc.store, tenant, sid, now_ms=now, past=0, upcoming=size, after_ms=after
        )
        future = got["next"] if got else []
    return past, future


class Facade:
    """The facade's handlers, over the ``Service`` each request's app holds under ``key``."""

    def __init__(self, key: web.AppKey[Service], cron_time_zone: str) -> None:
        self.key = key
        self.cron_time_zone = cron_time_zone

    def add_to(self, r: web.UrlDispatcher) -> None:
        r.add_get("/goscheduler/healthcheck", self.healthcheck)
        r.add_get("/goscheduler/crons/schedules", self.cron_schedules)
        r.add_post("/goscheduler/apps", self.register_app)
        r.add_get("/goscheduler/apps", self.get_apps)
        r.add_post("/goscheduler/apps/{appId}/activate", self.activate)
        r.add_post("/goscheduler/apps/{appId}/deactivate", self.deactivate)
        r.add_get("/goscheduler/apps/{appId}/schedules", self.app_schedules)
        r.add_post("/goscheduler/apps/{appId}/bulk-action/{action}", self.bulk_action)
        r.add_post("/goscheduler/schedules", self.create)
        r.add_get("/goscheduler/schedules/{scheduleId}", self.get)
        r.add_delete("/goscheduler/schedules/{scheduleId}", self.delete)
        r.add_get("/goscheduler/schedules/{scheduleId}/runs", self.runs)

    async def _admin(self, request: web.Request) -> Service:
        svc = request.app[self.key]
        (await caller(svc, request)).require_admin()
        return svc

    async def _tenant(self, request: web.Request) -> tuple[Service, str]:
        svc = request.app[self.key]
        return svc, (await caller(svc, request)).require_tenant()

    # -- apps ------------------------------------------------------------------------------

    async def healthcheck(self, request: web.Request) -> web.Response:
        return _ok({"status": "healthy"})

    async def register_app(self, request: web.Request) -> web.Response:
        svc = await self._admin(request)
        body = await read_json(svc, request)
        app_id = body.get("appId")
        active = body.get("active", True)
        if not isinstance(active, bool):
            raise ApiError(400, "invalid_field", "active must be a boolean")
        created = await svc.register_tenant(app_id, {}, active=active)
        app = {
            "appId": app_id,
            "partitions": body.get("partitions", 0),
            "active": active,
            "configuration": {},
            "apiKey": created["api_key"],
            "signingKey": created["signing_key"],
        }
        return _ok(app, 201)

    async def get_apps(self, request: web.Request) -> web.Response:
        svc = await self._admin(request)
        rows = await svc.list_tenants()
        wanted = request.query.get("app_id")
        apps = [_app_view(r) for r in rows if not wanted or r["tenant"] == wanted]
        return _ok({"apps": apps}, count=len(apps))

    async def _set_active(self, request: web.Request, active: bool) -> web.Response:
        svc = await self._admin(request)
        app_id = request.match_info["appId"]
        row = await svc.get_tenant(app_id)
        if bool(row.get("active")) == active:
            raise ApiError(
                400,
                "already_" + ("active" if active else "inactive"),
                f"app {app_id} is already {'active' if active else 'deactivated'}",
            )
        await svc.update_tenant(app_id, config=None, active=active)
        return _ok({"appId": app_id, "Active": active})

    async def activate(self, request: web.Request) -> web.Response:
        return await self._set_active(request, True)

    async def deactivate(self, request: web.Request) -> web.Response:
        return await self._set_active(request, False)

    # -- schedules -------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        svc, tenant = await self._tenant(request)
        body = await read_json(svc, request)
        app_id = body.get("appId", tenant)
        if app_id != tenant:
            raise ApiError(
                403, "wrong_app", f"the API key belongs to app {tenant!r}, not {app_id!r}"
            )
        native = gv.create_body(body, self.cron_time_zone)
        sid = svc.new_schedule_id()
        cmd = views.create_command(
            native, tenant=tenant, schedule_id=sid, request_id=svc.bridge.new_request_id()
        )
        result = await svc.send(cmd, wait=True)
        if result["status"] != ResultStatus.ACCEPTED:
            raise ApiError(views.http_status(result["code"]), result["code"], result["message"])
        row, _ = await svc.get_schedule(tenant, sid)
        return _ok({"schedule": await _schedule_view(svc, row)}, 201)

    async def get(self, request: web.Request) -> web.Response:
        svc, tenant = await self._tenant(request)
        row, _ = await svc.get_schedule(tenant, request.match_info["scheduleId"])
        return _ok({"schedule": await _schedule_view(svc, row)})

    async def delete(self, request: web.Request) -> web.Response:
        svc, tenant = await self._tenant(request)
        sid = svc.check_schedule_id(request.match_info["scheduleId"])
        await svc.get_schedule(tenant, sid)  # 404 for an unknown id, like go-scheduler
        cmd = views.cancel_command(
            tenant=tenant, schedule_id=sid, request_id=svc.bridge.new_request_id()
        )
        result = await svc.send(cmd, wait=True)
        if result["code"] not in (Code.OK, Code.ALREADY_CANCELLED):
            raise ApiError(views.http_status(result["code"]), result["code"], result["message"])
        row, _ = await svc.get_schedule(tenant, sid)
        return _ok({"schedule": await _schedule_view(svc, row)})

    async def runs(self, request: web.Request) -> web.Response:
        svc, tenant = await self._tenant(request)
        row, events = await svc.get_schedule(tenant, request.match_info["scheduleId"])
        if recurring.is_parent(row):
            return await self._cron_runs(request, svc, row)
        out = gv.fire_runs(row, events)
        if not out:
            raise ApiError(404, "not_found", "No runs found")
        return _ok({"schedules": out, "continuationToken": ""}, count=len(out))

    async def _cron_runs(self, request: web.Request, svc: Service, row: CqlRow) -> web.Response:
        """go-scheduler's runs of a cron: ``when=past`` (newest first), ``future`` (soonest
        first) or neither (the future runs, latest first, then the past ones: newest
        first throughout); ``size`` (15) and a ``continuation_token`` for past/future."""
        q = request.query
        size = views.parse_limit(q.get("size"), default=15, name="size")
        token_ms = gv.run_token_ms(q.get("continuation_token"))
        when = gv.parse_when(q.get("when", ""))
        past, future = await _cron_runs_of(svc, row, when, size, token_ms)
        page, last = gv.runs_page(when, past, future, size)
        if not page:
            raise ApiError(404, "not_found", "No cron runs found")
        shown = [gv.go_run(r, row) for r in page]
        return _ok({"schedules": shown, "continuationToken": gv.run_token(last)}, count=len(page))

    async def app_schedules(self, request: web.Request) -> web.Response:
        svc, tenant = await self._tenant(request)
        if request.match_info["appId"] != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}")
        q = request.query
        lo, hi = gv.list_window(q.get("start_time"), q.get("end_time"), now_ms())
        statuses = gv.list_statuses(q.get("status"))
        after = gv.list_cursor(q.get("continuation_token"))
        size = views.parse_limit(q.get("size"), default=15)
        rows, cursor = await recurring_io.list_page(
            svc.store,
            svc.list_schedules,
            gv.go_schedule,
            tenant,
            from_ms=lo,
            to_ms=hi + 1,
            statuses=statuses,
            limit=size,
            after=after,
            now_ms=now_ms(),
            parent_view=_cron_listed,
        )
        page = {
            "schedules": rows,
            "continuationToken": gv.list_token(cursor),
            "continuationStartTime": lo // 1000,
        }
        return _ok(page, count=len(rows))

    async def bulk_action(self, request: web.Request) -> web.Response:
        """go-scheduler's ``POST /goscheduler/apps/{appId}/bulk-action/{action}?status=
        &start_time=&end_time=``: ``reconcile`` re-fires the app's one-time schedules due in
        the window and of that status (``Service.bulk_refire``: same trigger id, next
        attempt), ``delete`` cancels the ones still to fire (``Service.bulk_cancel``)."""
        svc, tenant = await self._tenant(request)
        app_id = request.match_info["appId"]
        if app_id != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}")
        action = gv.bulk_action(request.match_info["action"])
        q = request.query
        status = q.get("status", "")
        window = gv.bulk_window(q.get("start_time"), q.get("end_time"), now_ms())
        if action is gv.BulkAction.RECONCILE:
            done = await svc.bulk_refire(tenant, *window, gv.reconcile_statuses(status))
        else:
            gv.check_delete_status(status)
            done = await svc.bulk_cancel(tenant, *window)
        return json_response(gv.bulk_body(action, app_id, window, status, done))

    async def cron_schedules(self, request: web.Request) -> web.Response:
        """go-scheduler's ``GET /goscheduler/crons/schedules?app_id=&status=``: the app's
        cron schedules (data is the list itself, as there)."""
        svc, tenant = await self._tenant(request)
        app_id = request.query.get("app_id") or tenant
        if app_id != tenant:
            raise ApiError(403, "wrong_app", f"the API key belongs to app {tenant!r}")
        wanted = request.query.get("status")
        if wanted and wanted not in gv.PARENT_STATUS.values():
            raise ApiError(400, "invalid_parameter", f"unknown status {wanted!r}")
        parents = await recurring_io.tenant_parents(svc.store, tenant, now_ms=now_ms())
        crons = [gv.go_cron_schedule(row, status) for row, status, _ in parents]
        crons = [c for c in crons if not wanted or c["status"] == wanted]
        if not crons:
            raise ApiError(404, "not_found", "No cron schedules found")
        return _ok(crons, count=len(crons))


def add_routes(app: web.Application, key: web.AppKey[Service], cron_time_zone: str = "UTC") -> None:
    """Serve the facade on ``app`` over the service under ``key``; ``cron_time_zone`` is the
    zone its cron expressions are read in (a ConfigError when it is no IANA zone)."""
    try:
        check_time_zone(cron_time_zone, "TOCSIN_GOSCHEDULER_CRON_TIME_ZONE")
    except CommandRejected as exc:
        raise ConfigError(exc.message) from None
    Facade(key, cron_time_zone).add_to(app.router)

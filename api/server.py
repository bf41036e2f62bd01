"""The REST API (``tocsin api``): aiohttp routes over ``api.service.Service``.

Native routes live under ``/v1`` (described by the OpenAPI document at ``/openapi.json``),
the go-scheduler facade under ``/goscheduler`` (api/goscheduler.py). Errors are JSON:
``{"error": {"code", "message", ...}}``. See docs/api.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from aiohttp import web

from api import deadletter_routes, explain, goscheduler, recurring, recurring_io, views
from api.console import routes as console
from api.context import caller, json_response, read_json
from api.openapi import openapi_document
from api.service import Principal, Service
from api.tracing import trace_requests
from api.views import ApiError, Mode
from base.clock import now_ms
from base.errors import TocsinError
from base.settings import Settings
from streams import tenant_admin
from streams.model import ScheduleState
from streams.ports import CqlRow
from streams.tenants import TenantConfig
from topics.models import DeliveryOutcome

log = logging.getLogger("tocsin.api")

SERVICE: web.AppKey[Service] = web.AppKey("service", Service)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if request.path.startswith("/goscheduler"):
            return goscheduler.error_response(exc)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status in (429, 503):
            headers = {"Retry-After": "1"}
        return json_response(exc.body(), exc.status, headers)
    except web.HTTPRequestEntityTooLarge as exc:
        return json_response(ApiError(413, "body_too_large", exc.text or "").body(), 413)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "no_route", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return json_response(ApiError(exc.status, code, exc.reason).body(), exc.status)
    except TocsinError as exc:
        log.warning("backend unavailable", extra={"error": str(exc), "path": request.path})
        return json_response(ApiError(503, "unavailable", str(exc)).body(), 503)
    except Exception:
        log.exception("unexpected API error", extra={"path": request.path})
        return json_response(ApiError(500, "internal", "internal error").body(), 500)


async def principal(request: web.Request) -> Principal:
    return await caller(request.app[SERVICE], request)


async def _body(request: web.Request) -> dict[str, object]:
    return await read_json(request.app[SERVICE], request)


def _timeout(request: web.Request, default: float) -> float:
    raw = request.query.get("timeout_s")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, "invalid_parameter", "timeout_s must be a number") from None
    if not 0 < value <= 60:
        raise ApiError(400, "invalid_parameter", "timeout_s must be in (0, 60]")
    return value


def _async(request: web.Request) -> bool:
    try:
        mode = Mode(request.query.get("mode", Mode.SYNC))
    except ValueError:
        raise ApiError(400, "invalid_parameter", "mode must be sync or async") from None
    return mode is Mode.ASYNC or "respond-async" in request.headers.get("Prefer", "")


def result_body(result: Mapping[str, object]) -> dict[str, object]:
    keys = (
        "schedule_id",
        "request_id",
        "command",
        "status",
        "code",
        "message",
        "partition",
        "offset",
    )
    return {k: result.get(k) for k in keys}


# -- health ----------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    checks = await service.ready() if service.started else {"kafka": False, "cassandra": False}
    ok = all(checks.values())
    return json_response(
        {"status": "ready" if ok else "not_ready", "checks": checks}, 200 if ok else 503
    )


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


# -- schedules -------------------------------------------------------------------------------


async def _command(
    request: web.Request,
    command: dict[str, object],
    *,
    created: bool = False,
    cancel: bool = False,
    admit: bool = False,
) -> web.Response:
    service = request.app[SERVICE]
    sid = command["schedule_id"]
    if _async(request):
        await service.send(command, wait=False)
        return json_response(
            {
                "schedule_id": sid,
                "request_id": command["request_id"],
                "status": "pending",
                "location": f"/v1/schedules/{sid}",
            },
            202,
            {"Location": f"/v1/schedules/{sid}"},
        )
    timeout_s = _timeout(request, service.timeout_s)
    result = await service.send(command, wait=True, timeout_s=timeout_s, admit=admit)
    code = result["code"]
    status = (
        200
        if (cancel and code == "already_cancelled")
        else views.http_status(code, created=created)
    )
    headers = {"Retry-After": "1"} if status == 429 else None
    return json_response(result_body(result), status, headers)


async def _addressed(request: web.Request) -> tuple[str, Service, str]:
    """The caller's tenant, the service and the (checked) schedule id the path names."""
    who = await principal(request)
    tenant = who.require_tenant()
    service = request.app[SERVICE]
    return tenant, service, service.check_schedule_id(request.match_info["schedule_id"])


async def create_schedule(request: web.Request) -> web.Response:
    who = await principal(request)
    tenant = who.require_tenant()
    body = await _body(request)
    service = request.app[SERVICE]
    # Only an id generated here can be admitted (answered at Kafka's acknowledgement): a
    # client's id may already be taken, which only its worker's store knows.
    generated = "schedule_id" not in body
    sid = service.new_schedule_id() if generated else service.check_schedule_id(body["schedule_id"])
    cmd = views.create_command(
        body, tenant=tenant, schedule_id=sid, request_id=service.bridge.new_request_id()
    )
    return await _command(request, cmd, created=True, admit=generated)


async def update_schedule(request: web.Request) -> web.Response:
    tenant, service, sid = await _addressed(request)
    body = await _body(request)
    cmd = views.update_command(
        body, tenant=tenant, schedule_id=sid, request_id=service.bridge.new_request_id()
    )
    return await _command(request, cmd)


async def reschedule(request: web.Request) -> web.Response:
    tenant, service, sid = await _addressed(request)
    body = await _body(request)
    if set(body) != {"due"}:
        raise ApiError(400, "invalid_field", 'reschedule takes exactly {"due": ...}')
    cmd = views.update_command(
        body, tenant=tenant, schedule_id=sid, request_id=service.bridge.new_request_id()
    )
    return await _command(request, cmd)


async def cancel_schedule(request: web.Request) -> web.Response:
    tenant, service, sid = await _addressed(request)
    cmd = views.cancel_command(
        tenant=tenant, schedule_id=sid, request_id=service.bridge.new_request_id()
    )
    return await _command(request, cmd, cancel=True)


async def pause_schedule(request: web.Request) -> web.Response:
    return await _simple(request, "pause")


async def resume_schedule(request: web.Request) -> web.Response:
    return await _simple(request, "resume")


async def trigger_schedule(request: web.Request) -> web.Response:
    return await _simple(request, "trigger")


async def backfill_schedule(request: web.Request) -> web.Response:
    """POST /v1/schedules/{id}/backfill {from, to}: the worker writes the window's past runs
    to fire paced (docs/wire-contract.md); answered once they are stored."""
    tenant, service, sid = await _addressed(request)
    cmd = views.backfill_command(
        await _body(request),
        tenant=tenant,
        schedule_id=sid,
        request_id=service.bridge.new_request_id(),
    )
    return await _command(request, cmd)


async def _simple(request: web.Request, kind: str) -> web.Response:
    """A command that names the path's schedule and nothing else (pause, resume, trigger)."""
    tenant, service, sid = await _addressed(request)
    cmd = views.simple_command(
        kind, tenant=tenant, schedule_id=sid, request_id=service.bridge.new_request_id()
    )
    return await _command(request, cmd)


async def get_schedule(request: web.Request) -> web.Response:
    tenant, service, sid = await _addressed(request)
    row, events = await service.get_schedule(tenant, sid)
    if recurring.is_parent(row) or row.get("due_ms") is None:
        # A recurring schedule, or one of its runs (api/recurring_io.py).
        return json_response(
            await recurring_io.schedule_json(
                service.store,
                row,
                events,
                now_ms=now_ms(),
                past=_count(request, "past", 5),
                upcoming=_count(request, "next", 5),
            )
        )
    return json_response(views.schedule_view(row, events))


def _count(request: web.Request, name: str, default: int) -> int:
    return views.parse_limit(request.query.get(name), default=default, name=name, minimum=0)


async def schedule_runs(request: web.Request) -> web.Response:
    """A recurring schedule's past runs (newest first) and next runs."""
    tenant, service, sid = await _addressed(request)
    before = request.query.get("before")
    got = await recurring_io.runs(
        service.store,
        tenant,
        sid,
        now_ms=now_ms(),
        past=_count(request, "past", 10),
        upcoming=_count(request, "next", 10),
        before_ms=views.parse_time(before, "before") if before else None,
    )
    if got is None:
        await service.get_schedule(tenant, sid)  # 404 when there is no such schedule at all
        raise ApiError(
            404,
            "not_recurring",
            f"schedule {sid!r} is not a recurring schedule; "
            "its fire history is in GET /v1/schedules/{id}",
        )
    return json_response(recurring_io.runs_json(got))


async def list_schedules(request: web.Request) -> web.Response:
    who = await principal(request)
    tenant = who.require_tenant()
    q = request.query
    lo, hi = views.parse_window(q)
    service = request.app[SERVICE]
    page, cursor = await recurring_io.list_page(
        service.store,
        service.list_schedules,
        lambda r: views.schedule_view(r, brief=True),
        tenant,
        from_ms=lo,
        to_ms=hi,
        statuses=views.parse_statuses(q.get("status")),
        limit=views.parse_limit(q.get("limit")),
        after=views.decode_cursor(q.get("cursor")),
        now_ms=now_ms(),
    )
    return json_response(
        {
            "schedules": page,
            "next_cursor": views.encode_cursor(*cursor) if cursor else None,
        }
    )


async def bulk_cancel(request: web.Request) -> web.Response:
    who = await principal(request)
    tenant = who.require_tenant()
    body = await _body(request)
    lo, hi = views.parse_window({k: str(v) for k, v in body.items()})
    return json_response(await request.app[SERVICE].bulk_cancel(tenant, lo, hi))


async def bulk_refire(request: web.Request) -> web.Response:
    who = await principal(request)
    tenant = who.require_tenant()
    body = await _body(request)
    statuses = body.pop("status", None) or [DeliveryOutcome.DEAD_LETTERED, ScheduleState.MISSED]
    if not isinstance(statuses, list) or not all(isinstance(s, str) for s in statuses):
        raise ApiError(400, "invalid_field", "status must be a list of statuses")
    wanted = views.parse_statuses(",".join(statuses))
    assert wanted is not None
    lo, hi = views.parse_window({k: str(v) for k, v in body.items()})
    return json_response(await request.app[SERVICE].bulk_refire(tenant, lo, hi, wanted))


async def bulk_pause(request: web.Request) -> web.Response:
    return await _bulk_toggle(request, "pause")


async def bulk_resume(request: web.Request) -> web.Response:
    return await _bulk_toggle(request, "resume")


async def _bulk_toggle(request: web.Request, kind: str) -> web.Response:
    who = await principal(request)
    tenant = who.require_tenant()
    body = await _body(request) if request.can_read_body else {}
    cursor = body.get("cursor")
    if cursor is not None and not isinstance(cursor, str):
        raise ApiError(400, "invalid_field", "cursor is a previous answer's next_cursor")
    lo, hi, prefix = views.parse_bulk_scope(
        {k: v for k, v in body.items() if k != "cursor"},
        now_ms=now_ms(),
        default_span_ms=BULK_DEFAULT_SPAN_MS,
    )
    answer = await request.app[SERVICE].bulk_toggle(tenant, kind, lo, hi, prefix, cursor)
    return json_response(answer)


# A bulk pause or resume without ``to``: one-shots due up to a year ahead.
BULK_DEFAULT_SPAN_MS = 365 * 86_400_000


# -- tenants ---------------------------------------------------------------------------------


def _tenant_json(row: CqlRow) -> dict[str, object]:
    return views.tenant_view(
        row,
        TenantConfig.from_json(row.get("config")).to_dict(),
        tenant_admin.signing_status(row, now_ms()),
    )


async def register_tenant(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    body = await _body(request)
    unknown = sorted(set(body) - {"tenant", "config", "active"})
    if unknown:
        raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
    active = body.get("active", True)
    if not isinstance(active, bool):
        raise ApiError(400, "invalid_field", "active must be a boolean")
    created = await request.app[SERVICE].register_tenant(
        body.get("tenant"), body.get("config"), active=active
    )
    return json_response(created, 201)


async def list_tenants(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    rows = await request.app[SERVICE].list_tenants()
    return json_response({"tenants": [_tenant_json(r) for r in rows]})


def _self_or_admin(who: Principal, tenant: str) -> None:
    if not who.admin and who.tenant != tenant:
        # The same answer as for a tenant that does not exist: no probing of names.
        raise ApiError(404, "not_found", f"no tenant {tenant!r}")


async def get_tenant(request: web.Request) -> web.Response:
    who = await principal(request)
    name = request.match_info["tenant"]
    _self_or_admin(who, name)
    return json_response(_tenant_json(await request.app[SERVICE].get_tenant(name)))


async def update_tenant(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    body = await _body(request)
    unknown = sorted(set(body) - {"config", "active"})
    if unknown:
        raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
    active = body.get("active")
    if active is not None and not isinstance(active, bool):
        raise ApiError(400, "invalid_field", "active must be a boolean")
    config = body.get("config")
    if config is not None and not isinstance(config, dict):
        raise ApiError(400, "invalid_config", "config must be an object")
    row = await request.app[SERVICE].update_tenant(
        request.match_info["tenant"], config=config, active=active
    )
    return json_response(_tenant_json(row))


async def create_key(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    service = request.app[SERVICE]
    name = request.match_info["tenant"]
    await service.get_tenant(name)
    return json_response(await service.new_key(name), 201)


async def list_keys(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    service = request.app[SERVICE]
    name = request.match_info["tenant"]
    await service.get_tenant(name)
    return json_response({"keys": await service.store.list_api_keys(name)})


async def revoke_key(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    await request.app[SERVICE].revoke_key(
        request.match_info["tenant"], request.match_info["key_id"]
    )
    return json_response({"revoked": request.match_info["key_id"]})


async def rotate_signing_key(request: web.Request) -> web.Response:
    """A new current signing key (returned once); the previous one stays valid until it is
    retired, or for ``previous_valid_s`` seconds."""
    (await principal(request)).require_admin()
    body = await _body(request) if request.can_read_body else {}
    unknown = sorted(set(body) - {"previous_valid_s"})
    if unknown:
        raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
    valid_s = body.get("previous_valid_s")
    if valid_s is not None and (
        isinstance(valid_s, bool) or not isinstance(valid_s, int) or valid_s < 0
    ):
        raise ApiError(400, "invalid_field", "previous_valid_s must be an integer >= 0")
    service, name = request.app[SERVICE], request.match_info["tenant"]
    try:
        done = await tenant_admin.rotate_signing_key(service.store, name, previous_valid_s=valid_s)
    except tenant_admin.TenantNotFound as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    except tenant_admin.RotationConflict as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    service.tenants.invalidate(name)  # this API signs with the new key at once
    return json_response(done, 201)


async def retire_previous_signing_key(request: web.Request) -> web.Response:
    (await principal(request)).require_admin()
    service, name = request.app[SERVICE], request.match_info["tenant"]
    try:
        done = await tenant_admin.retire_previous_signing_key(service.store, name)
    except tenant_admin.TenantNotFound as exc:
        raise ApiError(404, "not_found", str(exc)) from None
    except ValueError as exc:
        raise ApiError(409, "no_previous_key", str(exc)) from None
    except tenant_admin.RotationConflict as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    service.tenants.invalidate(name)
    return json_response(done)


# -- app -------------------------------------------------------------------------------------


def build_app(settings: Settings, service: Service | None = None) -> web.Application:
    app = web.Application(
        middlewares=[trace_requests, errors], client_max_size=settings.api.max_body_bytes
    )
    svc = service or Service(settings)
    app[SERVICE] = svc

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await svc.start()
        yield
        await svc.close()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/openapi.json", openapi)
    r.add_post("/v1/schedules", create_schedule)
    r.add_get("/v1/schedules", list_schedules)
    r.add_get("/v1/schedules/{schedule_id}", get_schedule)
    r.add_get("/v1/schedules/{schedule_id}/runs", schedule_runs)
    r.add_patch("/v1/schedules/{schedule_id}", update_schedule)
    r.add_delete("/v1/schedules/{schedule_id}", cancel_schedule)
    r.add_post("/v1/schedules/{schedule_id}/reschedule", reschedule)
    r.add_post("/v1/schedules/{schedule_id}/pause", pause_schedule)
    r.add_post("/v1/schedules/{schedule_id}/resume", resume_schedule)
    r.add_post("/v1/schedules/{schedule_id}/trigger", trigger_schedule)
    r.add_post("/v1/schedules/{schedule_id}/backfill", backfill_schedule)
    r.add_post("/v1/bulk/cancel", bulk_cancel)
    r.add_post("/v1/bulk/refire", bulk_refire)
    r.add_post("/v1/bulk/pause", bulk_pause)
    r.add_post("/v1/bulk/resume", bulk_resume)
    r.add_post("/v1/tenants", register_tenant)
    r.add_get("/v1/tenants", list_tenants)
    r.add_get("/v1/tenants/{tenant}", get_tenant)
    r.add_patch("/v1/tenants/{tenant}", update_tenant)
    r.add_post("/v1/tenants/{tenant}/keys", create_key)
    r.add_get("/v1/tenants/{tenant}/keys", list_keys)
    r.add_delete("/v1/tenants/{tenant}/keys/{key_id}", revoke_key)
    r.add_post("/v1/tenants/{tenant}/signing-key", rotate_signing_key)
    r.add_delete("/v1/tenants/{tenant}/signing-key/previous", retire_previous_signing_key)
    explain.add_route(app, SERVICE)
    deadletter_routes.add_routes(app, SERVICE)
    console.add_routes(app, SERVICE)
    goscheduler.add_routes(app, SERVICE, settings.api.goscheduler_cron_time_zone)
    return app


def run(settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT (blocking)."""
    app = build_app(settings)
    log.info(
        "api listening",
        extra={
            "host": settings.api.host,
            "port": settings.api.port,
            "admin": settings.api.admin_key is not None,
        },
    )
    web.run_app(app, host=settings.api.host, port=settings.api.port, access_log=None, print=None)

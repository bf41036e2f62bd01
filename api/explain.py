"""``GET /v1/schedules/{schedule_id}/explain``: why a schedule did or did not fire
(``streams.explain``). A tenant key reads its own schedules only; the admin key names the
tenant with ``?tenant=``. Another tenant's schedule is answered exactly like one that does
not exist (404): the answer reveals nothing about other tenants."""

from __future__ import annotations

from aiohttp import web

from api.context import caller, json_response
from api.service import Principal, Service
from api.views import ApiError, parse_limit
from base.clock import now_ms
from streams.explain import Explanation, explain
from streams.explain_io import DEFAULT_RUNS, MAX_RUNS, read_facts

PATH = "/v1/schedules/{schedule_id}/explain"


def not_found(schedule_id: str) -> ApiError:
    """The one answer for a schedule the caller may not read, whether it does not exist or
    is another tenant's."""
    return ApiError(404, "not_found", f"no schedule {schedule_id!r}")


def tenant_of(who: Principal, asked: str | None, schedule_id: str) -> str:
    """The tenant whose schedule is read: the admin's ``?tenant=``, else the caller's own.
    A tenant asking for another tenant gets the not-found answer."""
    if who.admin:
        if not asked:
            raise ApiError(400, "invalid_parameter", "the admin key needs ?tenant=NAME")
        return asked
    tenant = who.require_tenant()
    if asked and asked != tenant:
        raise not_found(schedule_id)
    return tenant


async def explanation(
    service: Service, tenant: str, schedule_id: str, *, runs: int = DEFAULT_RUNS
) -> Explanation:
    """The schedule's explanation, or ApiError 404."""
    facts = await read_facts(
        service.store,
        tenant,
        schedule_id,
        now_ms=now_ms(),
        default_tolerance_s=service.settings.scheduler.default_misfire_tolerance_s,
        runs=runs,
    )
    if facts is None:
        raise not_found(schedule_id)
    return explain(facts)


def add_route(app: web.Application, key: web.AppKey[Service]) -> None:
    """Serve the route on ``app`` over the service under ``key``."""

    async def handle(request: web.Request) -> web.Response:
        service = request.app[key]
        who = await caller(service, request)
        sid = service.check_schedule_id(request.match_info["schedule_id"])
        tenant = tenant_of(who, request.query.get("tenant"), sid)
        runs = parse_limit(
            request.query.get("runs"),
            default=DEFAULT_RUNS,
            maximum=MAX_RUNS,
            name="runs",
            minimum=0,
        )
        found = await explanation(service, tenant, sid, runs=runs)
        return json_response(found.to_json())

    app.router.add_get(PATH, handle)

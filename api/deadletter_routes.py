"""The dead-letter routes (``/v1/dead-letters``) over ``api.deadletters.DeadLetters``. A
tenant key lists and redrives its own tenant's dead letters only: another tenant's trigger
id is answered like one with no dead letter (404)."""

from __future__ import annotations

import re

from aiohttp import web

from api.context import caller, json_response, read_json
from api.deadletters import DEFAULT_WINDOW_MS, DeadLetters, dead_letter_view
from api.service import Service
from api.views import ApiError, decode_cursor, encode_cursor, parse_limit, parse_time, parse_window
from base.clock import now_ms

# Trigger ids are 32 lowercase hex digits (topics.ids.trigger_id); anything else has none.
_TRIGGER_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_LIST_LIMIT = 1000


def _trigger_id(value: object) -> str:
    if not isinstance(value, str) or not _TRIGGER_ID.match(value):
        raise ApiError(400, "invalid_field", "a trigger id is 32 lowercase hex digits")
    return value


def _force(body: dict[str, object]) -> bool:
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise ApiError(400, "invalid_field", "force must be a boolean")
    return force


def dead_letters(service: Service) -> DeadLetters:
    """The dead letters over ``service``'s store, sending to the deployment's fires topic."""
    fires = service.bridge.catalog.fires.name

    async def emit(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        await service.bridge.send_record(fires, key, value, headers)

    return DeadLetters(service.store, emit)


def add_routes(app: web.Application, key: web.AppKey[Service]) -> None:
    """Serve the dead-letter routes on ``app`` over the service under ``key``."""

    async def tenant_of(request: web.Request) -> tuple[str, Service]:
        service = request.app[key]
        who = await caller(service, request)
        return who.require_tenant(), service

    async def list_letters(request: web.Request) -> web.Response:
        tenant, service = await tenant_of(request)
        q = request.query
        now = now_ms()
        hi = parse_time(q["to"], "to") if q.get("to") else now + 1
        lo = parse_time(q["from"], "from") if q.get("from") else hi - DEFAULT_WINDOW_MS
        limit = parse_limit(q.get("limit"), maximum=MAX_LIST_LIMIT)
        page, cursor = await dead_letters(service).list(
            tenant, from_ms=lo, to_ms=hi, limit=limit, before=decode_cursor(q.get("cursor"))
        )
        return json_response(
            {
                "dead_letters": [dead_letter_view(e) for e in page],
                "next_cursor": encode_cursor(*cursor) if cursor else None,
            }
        )

    async def get_letter(request: web.Request) -> web.Response:
        tenant, service = await tenant_of(request)
        tid = _trigger_id(request.match_info["trigger_id"])
        entry, _ = await dead_letters(service).get(tenant, tid)
        return json_response(dead_letter_view(entry))

    async def redrive_one(request: web.Request) -> web.Response:
        tenant, service = await tenant_of(request)
        tid = _trigger_id(request.match_info["trigger_id"])
        body = await read_json(service, request) if request.can_read_body else {}
        unknown = sorted(set(body) - {"force"})
        if unknown:
            raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
        done = await dead_letters(service).redrive(tenant, tid, force=_force(body))
        return json_response(done)

    async def redrive_many(request: web.Request) -> web.Response:
        tenant, service = await tenant_of(request)
        body = await read_json(service, request)
        unknown = sorted(set(body) - {"trigger_ids", "from", "to", "force", "cursor"})
        if unknown:
            raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
        ids = body.get("trigger_ids")
        dls = dead_letters(service)
        if ids is not None:
            window = "from" in body or "to" in body or "cursor" in body
            if window or not isinstance(ids, list) or not ids:
                raise ApiError(
                    400,
                    "invalid_field",
                    "give either trigger_ids (a non-empty list) or a window (from, to)",
                )
            checked = [_trigger_id(t) for t in ids]
            return json_response(await dls.redrive_many(tenant, checked, force=_force(body)))
        if "force" in body:
            raise ApiError(400, "invalid_field", "force applies to trigger_ids only")
        cursor = body.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise ApiError(400, "invalid_field", "cursor is a previous answer's next_cursor")
        lo, hi = parse_window({k: str(v) for k, v in body.items() if k in ("from", "to")})
        answer = await dls.redrive_window(tenant, from_ms=lo, to_ms=hi, cursor=cursor)
        return json_response(answer)

    r = app.router
    r.add_get("/v1/dead-letters", list_letters)
    r.add_post("/v1/dead-letters/redrive", redrive_many)
    r.add_get("/v1/dead-letters/{trigger_id}", get_letter)
    r.add_post("/v1/dead-letters/{trigger_id}/redrive", redrive_one)

"""What every HTTP handler of the API reads from a request: who is calling and the JSON
body, and how it answers JSON. Shared by the native routes (api/server.py) and the
go-scheduler facade (api/goscheduler.py); the service is passed in by the caller."""

from __future__ import annotations

import orjson
from aiohttp import web

from api.service import Principal, Service
from api.views import ApiError, parse_body


def json_response(
    body: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("X-Api-Key")


async def caller(service: Service, request: web.Request) -> Principal:
    """Who sends ``request``, by its API key (401/403 as ``Service.authenticate``)."""
    return await service.authenticate(bearer(request))


async def read_json(service: Service, request: web.Request) -> dict[str, object]:
    """The request's JSON object body, at most ``TOCSIN_API_MAX_BODY_BYTES`` (413 beyond)."""
    limit = service.settings.api.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413,
            "body_too_large",
            f"body is {request.content_length} bytes; at most {limit} are accepted",
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, "body_too_large", f"body exceeds {limit} bytes; at most {limit} are accepted"
        ) from None
    return parse_body(raw)

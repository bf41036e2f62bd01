"""Trace context through the REST API: an incoming request's ``traceparent`` (validated,
an invalid one dropped and counted, never a refusal) goes on the commands the request
produces, as their Kafka headers; with tracing on (``base.tracing``) the request is a
server span and each produce a producer span under it, whose context the command carries.

The request's context is held in a context variable, so the produce path
(``api.bridge.Bridge.send_command``) needs no new argument through the service.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

from aiohttp import web

from base import tracing
from base.tracing import SpanKind, Spanned
from streams import metrics
from topics.tracecontext import TraceContext, from_headers

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The context commands produced while serving the current request carry (None: none).
_current: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "tocsin_api_trace", default=None
)
_dropped = metrics.TRACEPARENT_DROPPED.labels("api")


@web.middleware
async def trace_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    found = from_headers(request.headers)
    if found.invalid:
        _dropped.inc()
    context = found.context
    span: Spanned | None = None
    if tracing.enabled() and request.path.startswith("/v1/"):
        # The route's template, never the raw path: span names must not grow with input.
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "(no route)"
        span = tracing.start(
            f"{request.method} {name}",
            kind=SpanKind.SERVER,
            parent=context.pair if context is not None else None,
            attributes={"http.request.method": request.method, "http.route": name},
        )
        if span is not None:
            context = TraceContext(span.traceparent, span.tracestate)
    if context is None:
        return await handler(request)
    token = _current.set(context)
    try:
        response = await handler(request)
        if span is not None:
            span.set("http.response.status_code", response.status)
            if response.status >= 500:
                span.fail(f"HTTP {response.status}")
        return response
    finally:
        _current.reset(token)
        if span is not None:
            span.end()


def command_headers() -> tuple[list[tuple[str, bytes]], Spanned | None]:
    """The Kafka headers carrying the current request's context to a command (none outside
    a traced request), and, tracing on, the produce span the caller ends once Kafka has
    the command."""
    context = _current.get()
    if context is None:
        return [], None
    span = tracing.start("tocsin.command.produce", kind=SpanKind.PRODUCER, parent=context.pair)
    if span is not None:
        context = TraceContext(span.traceparent, span.tracestate)
    return context.headers(), span

"""A client span per HTTP delivery attempt, when tracing is on (``base.tracing``).

The attempt's parent is the request's own ``traceparent`` (the trigger's, or the callback's
when the trigger carries none, see ``proxy.envelope.fire_request``); the receiver then
gets the span's context instead, so its server span is a child of this attempt. A request
without a valid traceparent gets no span: a root trace per delivery would be noise.
"""

from __future__ import annotations

from multidict import CIMultiDict

from base import tracing
from base.tracing import SpanKind, Spanned
from proxy.envelope import Envelope, Request
from proxy.retry import HttpResult, TimeoutResult
from topics.tracecontext import TRACEPARENT, TRACESTATE, from_headers


def attempt_span(env: Envelope, req: Request, headers: CIMultiDict[str]) -> Spanned | None:
    """Tracing on and the request traced: the attempt's span, its context put in
    ``headers``. None otherwise (one boolean test when tracing is off)."""
    if not tracing.enabled():
        return None
    parent = from_headers(headers).context
    if parent is None:
        return None
    attributes: dict[str, str | int | float | bool] = {
        "http.request.method": req.method,
        "url.full": req.url,
        "tocsin.delivery_attempt": env.attempt_state.attempts + 1,
    }
    trigger = env.trigger
    if trigger is not None:
        attributes["tocsin.tenant"] = trigger.tenant
        attributes["tocsin.trigger_id"] = trigger.trigger_id
        attributes["tocsin.schedule_id"] = trigger.schedule_id
    span = tracing.start(
        "tocsin.deliver", kind=SpanKind.CLIENT, parent=parent.pair, attributes=attributes
    )
    if span is None:
        return None
    headers[TRACEPARENT] = span.traceparent
    headers.popall(TRACESTATE, None)
    if span.tracestate:
        headers[TRACESTATE] = span.tracestate
    return span


def end_attempt(span: Spanned, outcome: object) -> None:
    """Record how the attempt ended (status code, or why there was none) and end it."""
    if isinstance(outcome, HttpResult):
        span.set("http.response.status_code", outcome.status)
        if outcome.status >= 400:
            span.fail(f"HTTP {outcome.status}")
    elif isinstance(outcome, TimeoutResult):
        span.set("error.type", "timeout")
        span.fail(outcome.detail)
    else:
        detail = getattr(outcome, "detail", type(outcome).__name__)
        span.set("error.type", type(outcome).__name__)
        span.fail(str(detail))
    span.end()

"""OpenTelemetry spans, off unless an exporter is configured with the standard variables.

Tracing is on when ``OTEL_SDK_DISABLED`` is not ``true`` and either an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or
``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``; ``OTEL_TRACES_EXPORTER=none`` keeps
it off. The SDK reads every other standard variable itself (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, the exporter's headers and timeout).

Off, it costs one boolean test per call site: nothing here imports OpenTelemetry until the
first span of a process that has tracing on, so the hot paths never load it. The trace
context itself (``topics.tracecontext``, which validates it at the edges) travels whether
tracing is on or not; here it is two strings, already valid.

These variables are read here rather than in ``base.settings`` because the SDK reads them
too: they are OpenTelemetry's contract, not Tocsin's.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("tocsin.tracing")

_EXPORTERS = frozenset({"otlp", "console"})


class SpanKind(StrEnum):
    SERVER = "server"
    CLIENT = "client"
    PRODUCER = "producer"
    CONSUMER = "consumer"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Whether this process exports spans, through which exporter, and where."""

    exporter: str | None  # None: tracing off
    traces_url: str | None = None  # None: the exporter's default (localhost:4318)
    service: str | None = None  # OTEL_SERVICE_NAME

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(None)
        named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        traces_url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
        base_url = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if traces_url is None and base_url:
            # The OpenTelemetry rule: the general endpoint gets the signal's path appended.
            traces_url = base_url.rstrip("/") + "/v1/traces"
        service = env.get("OTEL_SERVICE_NAME") or None
        if named == "none":
            return cls(None)
        if named:
            # A list ("otlp,console") takes its first exporter we know.
            for name in (n.strip() for n in named.split(",")):
                if name in _EXPORTERS:
                    return cls(name, traces_url, service)
            log.warning("OTEL_TRACES_EXPORTER=%s names no exporter Tocsin has; off", named)
            return cls(None)
        return cls("otlp" if traces_url else None, traces_url, service)


class _State:
    """The process's tracer, built on first use (under a lock: the proxy's lanes run on
    threads of their own)."""

    def __init__(self) -> None:
        self.config = TracingConfig.from_env()
        self.lock = threading.Lock()
        self.tracer: Tracer | None = None
        self.provider: Any = None
        self.service = "tocsin"


_state = _State()


def enabled() -> bool:
    """Whether spans are recorded and exported: one attribute test, no import."""
    return _state.config.exporter is not None


def configure(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Read the variables again (processes call it once at start, tests to switch tracing
    on); ``service`` is the default ``service.name`` when OTEL_SERVICE_NAME is unset.
    Returns whether tracing is on."""
    with _state.lock:
        previous = _state.provider
        _state.config = TracingConfig.from_env(env)
        _state.service = service
        _state.tracer = None
        _state.provider = None
    if previous is not None:
        previous.shutdown()  # its queued spans are sent, and its export thread ends
    return enabled()


def _tracer() -> Tracer:
    tracer = _state.tracer
    if tracer is not None:
        return tracer
    with _state.lock:
        if _state.tracer is None:
            _state.provider = _build(_state.config, _state.service)
            _state.tracer = _state.provider.get_tracer("tocsin")
        return _state.tracer


def _build(config: TracingConfig, default_service: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    service = config.service or default_service
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES itself; the service name goes over it.
    resource = Resource.create({"service.name": service})
    provider = TracerProvider(resource=resource)
    span_exporter: SpanExporter
    if config.exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter(endpoint=config.traces_url)
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    # Spans still queued at exit are sent (bounded by the exporter's own timeout); a
    # provider already shut down by configure() does nothing again.
    atexit.register(provider.shutdown)
    log.info("tracing on", extra={"exporter": config.exporter, "service": service})
    return provider


def flush(timeout_s: float = 5.0) -> None:
    """Send the spans still queued (a clean stop does it at exit as well)."""
    provider = _state.provider
    if provider is not None:
        provider.force_flush(int(timeout_s * 1000))


class Spanned:
    """One recorded span, and the context a message it causes carries on."""

    __slots__ = ("_span", "traceparent", "tracestate")

    def __init__(self, span: Span, traceparent: str, tracestate: str | None) -> None:
        self._span = span
        self.traceparent = traceparent
        self.tracestate = tracestate

    def set(self, name: str, value: str | int | float | bool) -> None:
        self._span.set_attribute(name, value)

    def fail(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description[:256]))

    def end(self) -> None:
        self._span.end()


def start(
    name: str,
    *,
    kind: SpanKind,
    parent: tuple[str, str | None] | None,
    attributes: Mapping[str, str | int | float | bool] | None = None,
) -> Spanned | None:
    """A span (None when tracing is off), a child of ``parent`` (a valid version-00
    traceparent and its tracestate; a root without one). The caller ends it; its
    ``traceparent``/``tracestate`` are what the next hop carries."""
    if _state.config.exporter is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    ctx: Any = None
    if parent is not None:
        traceparent, tracestate = parent
        state = TraceState.from_header([tracestate]) if tracestate else TraceState()
        remote = SpanContext(
            trace_id=int(traceparent[3:35], 16),
            span_id=int(traceparent[36:52], 16),
            is_remote=True,
            trace_flags=TraceFlags(int(traceparent[53:55], 16)),
            trace_state=state,
        )
        ctx = trace.set_span_in_context(NonRecordingSpan(remote))
    span = _tracer().start_span(
        name, context=ctx, kind=getattr(trace.SpanKind, kind.name), attributes=attributes
    )
    own = span.get_span_context()
    flags = "01" if own.trace_flags.sampled else "00"
    state_header = own.trace_state.to_header() if own.trace_state else ""
    traceparent = f"00-{own.trace_id:032x}-{own.span_id:016x}-{flags}"
    return Spanned(span, traceparent, state_header or None)

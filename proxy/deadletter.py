"""The records the proxy writes: dead letters and (fires mode) delivery outcomes.

Dead-letter record (value of the dead-letters topic, keyed by the original key)::

    {"original": {"topic", "partition", "offset", "timestamp_ms",
                  "key_b64", "value_b64", "headers": [[name, value_b64 | null], ...]},
     "reason": "HTTP 700: bad sku" | "poison pill: ..." | "undecodable trigger: ...",
     "status_code": 700 | null, "attempts": 3,
     "response": {"status_code": 700, "body_excerpt": "bad sku"} | null,
     "first_failure_ms": ..., "last_failure_ms": ..., "dead_lettered_ms": ...,
     "proxy_group": "tocsin-proxy", "endpoint": "https://h/p" | null,
     "trigger_id": ... | null, "schedule_id": ... | null, "tenant": ... | null,
     "traceparent": "00-<trace id>-<parent id>-01" | null, "tracestate": ... | null}

Bytes travel as base64 so any key, value or header survives JSON intact. A dead letter
must always be writable, so one that would exceed ``MAX_RECORD_BYTES`` carries the source
coordinates and the reason with the value (then the key and headers) omitted, and says so
in ``"omitted"``: the source record stays readable at its coordinates until retention.

Delivery outcome (fires mode, value of the deliveries topic, keyed by schedule id)::

    {"trigger_id", "schedule_id", "tenant", "due_ms", "emit_attempt",
     "outcome": "delivered" | "dead_lettered", "status_code": 204 | null,
     "reason": null | "...", "attempts": 1, "latency_ms": 12,
     "delivered_ms" | "dead_lettered_ms": ..., "fire": {"topic", "partition", "offset"},
     "failures": 0, "last_failure": null | "HTTP 503: ...", "failed_for_ms": null | 1200,
     dead letters only: "response": {"status_code", "body_excerpt"} | null, "endpoint"}

``failures`` counts the failed attempts, ``last_failure`` says what the last of them got and
``failed_for_ms`` is the time from the first failure to the last: the scheduler keeps them
in the schedule's history, so a delivery that needed retries says so.

``response`` is the last attempt's HTTP answer: its status code and the start of its body
(what the proxy read of it, at most ``MAX_BODY_EXCERPT_CHARS``); null when the last attempt
got no HTTP answer (a timeout, a refused connection, a Kafka callback).

Pure: builds bytes from values; callers pass the wall-clock times.
"""

from __future__ import annotations

import base64

import orjson

from proxy.envelope import Envelope
from proxy.retry import AttemptState
from topics.models import DeliveryOutcome

# Below Kafka's default topic limit (1,048,588 bytes), with room for batch framing: the
# dead-letters topic is created with the default.
MAX_RECORD_BYTES = 900_000
# A reason is built from a body snippet and a URL; cap it so it can never be the problem.
_MAX_REASON_CHARS = 4096
# The proxy reads at most TOCSIN_PROXY_BODY_SNIPPET_BYTES (512) of a body; this caps what a
# dead letter and its outcome repeat of it whatever that setting says.
MAX_BODY_EXCERPT_CHARS = 1024


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def last_response(st: AttemptState) -> dict[str, object] | None:
    """The last attempt's HTTP answer: its status code and a bounded excerpt of its body, or
    None when the last attempt got no HTTP answer.

    ``proxy.retry.decide`` keeps an HTTP failure as ``last_status`` and ``last_error`` =
    ``"HTTP <status>: <body snippet>"`` (``"HTTP <status>"`` for an empty body); every other
    failure clears ``last_status``. ``last_error`` also survives a trip through the retry
    topic (``proxy.parking``), so the excerpt is taken from it.
    """
    status = st.last_status
    if status is None:
        return None
    prefix = f"HTTP {status}: "
    error = st.last_error or ""
    body = error[len(prefix) :] if error.startswith(prefix) else ""
    return {"status_code": status, "body_excerpt": body[:MAX_BODY_EXCERPT_CHARS]}


def failure_times_ms(st: AttemptState, now_s: float, now_ms: int) -> tuple[int, int]:
    """The first and last failure of ``st`` (monotonic; ``now_s`` if none yet) as wall-clock
    ms, for a dead letter's ``first_failure_ms`` and ``last_failure_ms``."""
    first = st.first_failure_s if st.first_failure_s is not None else now_s
    last = st.last_failure_s if st.last_failure_s is not None else now_s
    return now_ms - int((now_s - first) * 1000), now_ms - int((now_s - last) * 1000)


def dead_letter_record(
    env: Envelope,
    *,
    reason: str,
    status: int | None,
    first_failure_ms: int,
    last_failure_ms: int,
    now_ms: int,
    group_id: str,
    max_bytes: int = MAX_RECORD_BYTES,
    coordinates_only: bool = False,
) -> bytes:
    """The dead letter, at most ``max_bytes`` long (see the module docstring).

    ``coordinates_only`` leaves out key, value and headers at once: the form written when
    Kafka refused the full record for good.
    """
    trig = env.trigger
    src = env.source
    original: dict[str, object] = {
        "topic": src.topic,
        "partition": src.partition,
        "offset": src.offset,
        "timestamp_ms": src.timestamp_ms,
        "key_b64": _b64(env.key),
        "value_b64": _b64(env.value),
        "headers": [[k, _b64(v)] for k, v in env.headers],
    }
    doc: dict[str, object] = {
        "original": original,
        "reason": reason[:_MAX_REASON_CHARS],
        "status_code": status,
        "attempts": env.attempt_state.attempts,
        "response": last_response(env.attempt_state),
        "first_failure_ms": first_failure_ms,
        "last_failure_ms": last_failure_ms,
        "dead_lettered_ms": now_ms,
        "proxy_group": group_id,
        "endpoint": env.request.url if env.request is not None else None,
        "trigger_id": trig.trigger_id if trig else None,
        "schedule_id": trig.schedule_id if trig else None,
        "tenant": trig.tenant if trig else None,
        # The trigger's W3C trace context: the dead letter belongs to the command's trace.
        "traceparent": trig.traceparent if trig else None,
        "tracestate": trig.tracestate if trig else None,
    }
    # Drop the biggest parts first, one at a time, until the record fits.
    steps = ("value_b64", "headers", "key_b64")
    omitted: list[str] = []
    if coordinates_only:
        for field in steps:
            _omit(original, field)
        omitted = list(steps)
        doc["omitted"] = f"{', '.join(omitted)} left out: Kafka refused the full dead letter"
    data = orjson.dumps(doc)
    for field in steps:
        if len(data) <= max_bytes or field in omitted:
            continue
        _omit(original, field)
        omitted.append(field)
        doc["omitted"] = f"{', '.join(omitted)} left out: {_omitted_reason(max_bytes)}"
        data = orjson.dumps(doc)
    return data


def _omit(original: dict[str, object], field: str) -> None:
    original[field] = [] if field == "headers" else None


def _omitted_reason(max_bytes: int) -> str:
    return (
        f"the dead letter would exceed {max_bytes} bytes; the source record is at its "
        "topic/partition/offset until retention"
    )


def delivery_outcome(
    env: Envelope,
    *,
    outcome: DeliveryOutcome,
    status: int | None,
    reason: str | None,
    latency_ms: int,
    now_ms: int,
) -> tuple[bytes, bytes] | None:
    """(key, value) of the outcome record, or None when the record was not a trigger."""
    trig = env.trigger
    if trig is None:
        return None
    doc: dict[str, object] = {
        "trigger_id": trig.trigger_id,
        "schedule_id": trig.schedule_id,
        "tenant": trig.tenant,
        "due_ms": trig.due_ms,
        "emit_attempt": trig.attempt,
        "outcome": outcome,
        "status_code": status,
        "reason": reason,
        "attempts": env.attempt_state.attempts,
        "latency_ms": latency_ms,
        f"{outcome}_ms": now_ms,
        "fire": {
            "topic": env.source.topic,
            "partition": env.source.partition,
            "offset": env.source.offset,
        },
        **failure_summary(env.attempt_state),
    }
    if outcome is DeliveryOutcome.DEAD_LETTERED:
        # What a tenant's dead-letter listing shows (streams.deadletter_store).
        doc["response"] = last_response(env.attempt_state)
        doc["endpoint"] = env.request.url if env.request is not None else None
    return trig.schedule_id.encode(), orjson.dumps(doc)


def failure_summary(st: AttemptState) -> dict[str, object]:
    """The failed attempts of ``st``: how many, the last one's error, and the time from the
    first failure to the last (None without failures)."""
    span_ms = None
    if st.first_failure_s is not None and st.last_failure_s is not None:
        span_ms = int((st.last_failure_s - st.first_failure_s) * 1000)
    last = st.last_error if st.failures else None
    return {
        "failures": st.failures,
        "last_failure": None if last is None else last[:MAX_BODY_EXCERPT_CHARS],
        "failed_for_ms": span_ms,
    }

"""The records the proxy writes: dead letters and (fires mode) delivery outcomes.

Dead-letter record (value of the dead-letters topic, keyed by the original key)::

    {"original": {"topic", "partition", "offset", "timestamp_ms",
                  "key_b64", "value_b64", "headers": [[name, value_b64 | null], ...]},
     "reason": "HTTP 700: bad sku" | "poison pill: ..." | "undecodable trigger: ...",
     "status_code": 700 | null, "attempts": 3,
     "first_failure_ms": ..., "last_failure_ms": ..., "dead_lettered_ms": ...,
     "proxy_group": "tocsin-proxy", "endpoint": "https://h/p" | null,
     "trigger_id": ... | null, "schedule_id": ... | null, "tenant": ... | null}

Bytes travel as base64 so any key, value or header survives JSON intact.

Delivery outcome (fires mode, value of the deliveries topic, keyed by schedule id)::

    {"trigger_id", "schedule_id", "tenant", "due_ms", "emit_attempt",
     "outcome": "delivered" | "dead_lettered", "status_code": 204 | null,
     "reason": null | "...", "attempts": 1, "latency_ms": 12,
     "delivered_ms" | "dead_lettered_ms": ..., "fire": {"topic", "partition", "offset"}}

Pure: builds bytes from values; callers pass the wall-clock times.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from proxy.envelope import DeliveryOutcome, Envelope


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def dead_letter_record(
    env: Envelope,
    *,
    reason: str,
    status: int | None,
    first_failure_ms: int,
    last_failure_ms: int,
    now_ms: int,
    group_id: str,
) -> bytes:
    trig = env.trigger
    doc: dict[str, Any] = {
        "original": {
            "topic": env.topic,
            "partition": env.partition,
            "offset": env.offset,
            "timestamp_ms": env.timestamp_ms,
            "key_b64": _b64(env.key),
            "value_b64": _b64(env.value),
            "headers": [[k, _b64(v)] for k, v in env.headers],
        },
        "reason": reason,
        "status_code": status,
        "attempts": env.attempt_state.attempts,
        "first_failure_ms": first_failure_ms,
        "last_failure_ms": last_failure_ms,
        "dead_lettered_ms": now_ms,
        "proxy_group": group_id,
        "endpoint": env.request.url if env.request is not None else None,
        "trigger_id": trig.trigger_id if trig else None,
        "schedule_id": trig.schedule_id if trig else None,
        "tenant": trig.tenant if trig else None,
    }
    return orjson.dumps(doc)


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
    doc: dict[str, Any] = {
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
        "fire": {"topic": env.topic, "partition": env.partition, "offset": env.offset},
    }
    return trig.schedule_id.encode(), orjson.dumps(doc)

"""Attempt records: each failed delivery attempt, and each wait its host imposed, as a record
on the deliveries topic next to the final outcome (fires mode), so a schedule's history shows
the status codes and the backoff before its delivery or dead letter.

Attempt record (value of the deliveries topic, keyed by schedule id like the outcome)::

    {"kind": "attempt", "trigger_id", "schedule_id", "tenant", "due_ms", "emit_attempt",
     "attempt": 2, "status_code": 503 | null, "status_class": "5xx" | "timeout" | ... | "held",
     "result": "HTTP 503: busy" | "read timeout" | "circuit breaker open for h",
     "backoff_ms": 400, "held": null | "circuit_open" | "rate_limit", "at_ms": ...}

It has no ``outcome`` field: a consumer that reads final outcomes (``outcome`` delivered or
dead_lettered) skips it, as the scheduler's worker before this record did.

``attempt`` is the message's attempt count after the failed attempt; a hold is no attempt
and carries the count so far (0: never attempted). ``backoff_ms`` is the wait chosen before
the next attempt: the retry policy's backoff (or the receiver's Retry-After), or for a hold
the wait its host's breaker or rate limit imposed.

Sampled, so a failing endpoint retried for hours cannot flood the topic (nor the history
the worker keeps of it): every failed attempt up to ``FIRST_ATTEMPTS``, then only attempts
whose number is a power of two (16, 32, 64, ...: a day of retries at the one-minute backoff
cap, about 1,440 attempts, gives 14 records); a hold only when its wait takes the time
since the message's first failure past a power of two seconds (or it is the first), which
no two holds of one message can share, so about 17 a day. A record lost (Kafka refusing it)
costs nothing but the line in the history: the final outcome still counts every attempt.

Pure: builds bytes from values; callers pass the wall-clock time.
"""

from __future__ import annotations

import enum
import math

import orjson

from proxy.envelope import Envelope

KIND = "attempt"
FIRST_ATTEMPTS = 8
_MAX_RESULT_CHARS = 1024


class Held(enum.StrEnum):
    """What held a message back without an attempt."""

    CIRCUIT_OPEN = "circuit_open"
    RATE_LIMIT = "rate_limit"


def attempt_sampled(attempt: int) -> bool:
    """Whether failed attempt number ``attempt`` (1-based) is reported."""
    return attempt <= FIRST_ATTEMPTS or attempt & (attempt - 1) == 0


def hold_sampled(since_first_failure_s: float, wait_s: float) -> bool:
    """Whether a hold starting ``since_first_failure_s`` after the message's first failure
    and lasting ``wait_s`` is reported: the first, and one whose wait crosses a power of two
    seconds (holds of one message never overlap, so each power is crossed at most once)."""
    if since_first_failure_s <= 0:
        return True
    end = since_first_failure_s + wait_s
    if end <= 1:
        return False
    start = max(since_first_failure_s, 0.5)
    return math.floor(math.log2(end)) > math.floor(math.log2(start))


def attempt_record(
    env: Envelope,
    *,
    status_code: int | None,
    status_class: str,
    result: str,
    backoff_s: float,
    held: Held | None,
    now_ms: int,
) -> tuple[bytes, bytes] | None:
    """(key, value) of the attempt record, or None when the message is not a trigger."""
    trig = env.trigger
    if trig is None:
        return None
    doc: dict[str, object] = {
        "kind": KIND,
        "trigger_id": trig.trigger_id,
        "schedule_id": trig.schedule_id,
        "tenant": trig.tenant,
        "due_ms": trig.due_ms,
        "emit_attempt": trig.attempt,
        "attempt": env.attempt_state.attempts,
        "status_code": status_code,
        "status_class": status_class,
        "result": result[:_MAX_RESULT_CHARS],
        "backoff_ms": max(0, round(backoff_s * 1000)),
        "held": None if held is None else held.value,
        "at_ms": now_ms,
    }
    return trig.schedule_id.encode(), orjson.dumps(doc)

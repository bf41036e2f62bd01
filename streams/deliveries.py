"""The proxy's final delivery outcomes, recorded into each schedule's status and history.

An outcome the store cannot take *now* (Cassandra unavailable, a timeout) is retried with
backoff before the agent moves on, so the deliveries topic's offset never passes an
unrecorded outcome: a dead-lettered trigger must never later read as delivered, nor be
missed by a bulk re-fire of dead letters. One the store refuses for good, or that is not a
delivery outcome at all, is logged and counted, and the rest proceed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from base.errors import StoreError
from streams import metrics
from streams.ports import DeliveryStore, TenantPolicies
from topics.models import DeliveryOutcome

log = logging.getLogger("tocsin.deliveries")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0


def parse_outcome(raw: bytes | None) -> dict[str, Any] | None:
    """A proxy delivery outcome (docs/proxy.md), or None when it is not one."""
    try:
        value = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("outcome") not in tuple(DeliveryOutcome):
        return None
    if not isinstance(value.get("tenant"), str) or not isinstance(value.get("schedule_id"), str):
        return None
    return value


def delivery_detail(outcome: dict[str, Any]) -> str | None:
    """What the schedule's history keeps of an outcome: a dead letter's reason, the final
    status and attempt, and the failed attempts before it (``failures``, ``last_failure``,
    ``failed_for_ms``, which a proxy of an older version leaves out)."""
    status = outcome.get("status_code")
    attempts = outcome.get("attempts")
    dead = outcome.get("outcome") == DeliveryOutcome.DEAD_LETTERED
    if dead:
        head = str(outcome.get("reason") or "dead-lettered")
        head += f"; {attempts} attempt(s)" if attempts else ""
    else:
        head = "status " + (str(status) if status is not None else "?")
        head += f" on attempt {attempts}" if attempts else ""
    failures = outcome.get("failures")
    if not isinstance(failures, int) or failures <= 0:
        return head
    span = outcome.get("failed_for_ms")
    over = f" over {span / 1000:g} s" if isinstance(span, int) and span > 0 else ""
    last = outcome.get("last_failure")
    # A dead letter's reason already names its last failure.
    tail = f", the last: {last}" if last and not dead else ""
    return f"{head}; {failures} failed{over}{tail}"


async def record_outcome(
    store: DeliveryStore,
    tenants: TenantPolicies,
    outcome: dict[str, Any],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Record one outcome; True when recorded, False when it was dropped for good (logged
    and counted). Returns only then: a retriable store failure is waited out."""
    delay = RETRY_FIRST_S
    while True:
        try:
            config = await tenants.config(outcome["tenant"])
            await store.record_delivery(
                outcome["tenant"],
                outcome["schedule_id"],
                outcome=DeliveryOutcome(outcome["outcome"]),
                status_code=outcome.get("status_code"),
                attempts=int(outcome.get("attempts", 0)),
                at_ms=int(outcome.get("delivered_ms") or outcome.get("dead_lettered_ms") or 0),
                trigger_id=outcome.get("trigger_id"),
                due_ms=outcome.get("due_ms"),
                detail=delivery_detail(outcome),
                retention_s=config.retention_s,
            )
            metrics.DELIVERIES.labels(outcome["outcome"]).inc()
            if outcome["outcome"] == DeliveryOutcome.DEAD_LETTERED:
                metrics.count_dead_lettered(outcome["tenant"])
            return True
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("unusable delivery outcome", extra={"error": repr(exc)})
            metrics.DELIVERIES.labels("unusable").inc()
            return False
        except StoreError as exc:
            if not exc.retriable:
                log.error(
                    "delivery outcome refused by the store",
                    extra={"error": str(exc), "schedule_id": outcome.get("schedule_id")},
                )
                metrics.DELIVERIES.labels("refused").inc()
                return False
            log.warning(
                "store unavailable; retrying a delivery outcome",
                extra={"error": str(exc), "retry_s": delay},
            )
            await sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

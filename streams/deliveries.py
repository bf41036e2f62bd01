"""The proxy's final delivery outcomes, recorded into each schedule's status and history,
and its attempt records (``"kind": "attempt"``: a failed attempt, or a wait its host imposed)
recorded into the history as ``attempt_failed`` / ``attempt_held`` events, at most
``MAX_ATTEMPTS_PER_TRIGGER`` per emission of a trigger (the proxy samples them already; this
bounds what a misbehaving or replayed producer can add).

An outcome the store cannot take *now* (Cassandra unavailable, a timeout) is retried with
backoff before the agent moves on, so the deliveries topic's offset never passes an
unrecorded outcome: a dead-lettered trigger must never later read as delivered, nor be
missed by a bulk re-fire of dead letters. One the store refuses for good, or that is not a
delivery outcome at all, is logged and counted, and the rest proceed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from base.errors import StoreError
from streams import metrics
from streams.model import DeliveryMark
from streams.ports import DeliveryStore, TenantPolicies
from topics.models import DeliveryOutcome

log = logging.getLogger("tocsin.deliveries")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
# How long the worker's delivery agent gathers outcomes into one batch after the first
# (Faust's take_events ``within``). Nothing waits for an outcome's record but a reader of
# the schedule's status, and every batch costs a turn of the agent, its commit
# bookkeeping and a part-filled group of writes (``record_outcomes`` sends them
# ``commit_group_size`` to a request): at 1,000 deliveries/s a 50 ms window made 20
# batches a second of about 50 outcomes, four requests each, the last a quarter full.
BATCH_WAIT_S = 0.5

ATTEMPT = "attempt"  # the attempt record's kind
ATTEMPT_FAILED = "attempt_failed"
ATTEMPT_HELD = "attempt_held"
MAX_ATTEMPTS_PER_TRIGGER = 20
# Emissions whose attempt count is kept; least recently seen forgotten first.
MAX_TRACKED_TRIGGERS = 10_000
# How far ahead of this worker's clock an outcome's time may be and still order its write
# (``outcome_order_us``): proxies' clocks differ from it by NTP's skew, milliseconds; an
# outcome dated further ahead (a broken clock) would otherwise hide every later outcome of
# its schedule until then, so it is written at the time of its write instead.
MAX_OUTCOME_AHEAD_MS = 60_000


class AttemptStore(DeliveryStore, Protocol):
    """What recording outcomes and attempt records calls."""

    async def record_event(
        self,
        tenant: str,
        schedule_id: str,
        event: str,
        *,
        at_ms: int,
        detail: str | None = None,
        trigger_id: str | None = None,
        due_ms: int | None = None,
        retention_s: int | None = None,
    ) -> None: ...


class AttemptBook:
    """How many attempt records each emission of a trigger has had recorded (bounded LRU):
    past ``per_trigger`` the rest are counted, not recorded."""

    def __init__(
        self, per_trigger: int = MAX_ATTEMPTS_PER_TRIGGER, max_triggers: int = MAX_TRACKED_TRIGGERS
    ) -> None:
        self.per_trigger = per_trigger
        self.max_triggers = max_triggers
        self._kept: OrderedDict[tuple[str, str, int], int] = OrderedDict()
        self.dropped = 0

    def admit(self, key: tuple[str, str, int]) -> bool:
        """True: record this one (and count it); False: over the bound, dropped."""
        kept = self._kept.pop(key, 0)
        self._kept[key] = kept
        while len(self._kept) > self.max_triggers:
            self._kept.popitem(last=False)
        if kept >= self.per_trigger:
            self.dropped += 1
            return False
        self._kept[key] = kept + 1
        return True


ATTEMPTS = AttemptBook()


def parse_outcome(raw: bytes | None) -> dict[str, Any] | None:
    """A proxy delivery outcome or attempt record (docs/proxy.md), or None when it is
    neither."""
    try:
        value = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    if value.get("kind") == ATTEMPT:
        if not isinstance(value.get("attempt"), int) or value.get("outcome") is not None:
            return None
    elif value.get("outcome") not in tuple(DeliveryOutcome):
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


def attempt_detail(record: dict[str, Any]) -> str:
    """An attempt record in words for the schedule's history."""
    attempt = record.get("attempt")
    backoff_ms = record.get("backoff_ms")
    wait = f"{backoff_ms / 1000:g} s" if isinstance(backoff_ms, int) else "?"
    result = str(record.get("result") or record.get("status_class") or "?")
    held = record.get("held")
    if held == "circuit_open":
        return f"held by its host's open circuit breaker after {attempt} attempt(s): {wait}"
    if held:
        return f"held by its host's rate limit after {attempt} attempt(s): {wait}"
    return f"attempt {attempt} failed: {result}; next attempt in {wait}"


async def record_attempt(
    store: AttemptStore,
    tenants: TenantPolicies,
    record: dict[str, Any],
    *,
    book: AttemptBook = ATTEMPTS,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Record one attempt record as a history event; False when dropped (over the bound of
    its emission, unusable, or refused for good). A retriable store failure is waited out."""
    try:
        key = (str(record["tenant"]), str(record["trigger_id"]), int(record["emit_attempt"]))
        at_ms = int(record["at_ms"])
    except (KeyError, TypeError, ValueError):
        metrics.DELIVERIES.labels("unusable").inc()
        return False
    if not book.admit(key):
        metrics.DELIVERIES.labels("attempt_over_bound").inc()
        return False
    event = ATTEMPT_HELD if record.get("held") else ATTEMPT_FAILED
    due = record.get("due_ms")

    async def write() -> None:
        config = await tenants.config(record["tenant"])
        await store.record_event(
            record["tenant"],
            record["schedule_id"],
            event,
            at_ms=at_ms,
            detail=attempt_detail(record),
            trigger_id=key[1],
            due_ms=due if isinstance(due, int) else None,
            retention_s=config.retention_s,
        )

    if await _stored(write, record, sleep):
        metrics.DELIVERIES.labels(event).inc()
        return True
    return False


async def _stored(
    write: Callable[[], Awaitable[None]],
    record: dict[str, Any],
    sleep: Callable[[float], Awaitable[None]],
) -> bool:
    """``write`` done, waiting out retriable store failures; False: refused for good."""
    delay = RETRY_FIRST_S
    while True:
        try:
            await write()
            return True
        except StoreError as exc:
            if not exc.retriable:
                log.error(
                    "attempt record refused by the store",
                    extra={"error": str(exc), "schedule_id": record.get("schedule_id")},
                )
                metrics.DELIVERIES.labels("refused").inc()
                return False
            await sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


async def record_outcomes(
    store: AttemptStore,
    tenants: TenantPolicies,
    outcomes: list[dict[str, Any]],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Record one batch of the deliveries topic; returns once every record is recorded or
    dropped for good. Final outcomes go to the store together (``record_deliveries_many``:
    a few requests, not one each); attempt records, outcomes that are not usable, and any
    whose request failed go one by one through ``record_outcome``, which logs, counts and
    waits out a retriable failure. A schedule's outcomes are written in their order (the
    last one is its status: last write wins)."""
    marks: list[tuple[dict[str, Any], DeliveryMark]] = []
    one_by_one: list[dict[str, Any]] = []
    # Schedules with a final outcome going one by one (its tenant lookup failed, say): their
    # later outcomes follow it there, since the grouped rounds are written first.
    alone: set[tuple[str, str]] = set()  # at most one entry per outcome of this batch
    for outcome in outcomes:
        if outcome.get("kind") == ATTEMPT:
            one_by_one.append(outcome)
            continue
        schedule = _schedule_of(outcome)
        if schedule not in alone:
            try:
                config = await tenants.config(outcome["tenant"])
                marks.append((outcome, _delivery_mark(outcome, config.retention_s)))
                continue
            except (KeyError, TypeError, ValueError, StoreError):
                alone.add(schedule)
        one_by_one.append(outcome)
    for round_ in _rounds(marks):
        results = await store.record_deliveries_many([m for _, m in round_])
        failed = [o for (o, _), exc in zip(round_, results, strict=True) if exc is not None]
        for (outcome, _), exc in zip(round_, results, strict=True):
            if exc is None:
                _count_recorded(outcome)
        # Recorded before the next round's outcomes of the same schedules are written.
        await asyncio.gather(*(record_outcome(store, tenants, o, sleep=sleep) for o in failed))
    if one_by_one:
        # Each schedule's records one after another, in order; schedules concurrently.
        lines: dict[tuple[str, str], list[dict[str, Any]]] = {}  # bounded by the batch
        for o in one_by_one:
            lines.setdefault(_schedule_of(o), []).append(o)
        await asyncio.gather(
            *(_record_in_order(store, tenants, line, sleep) for line in lines.values())
        )


def _schedule_of(outcome: dict[str, Any]) -> tuple[str, str]:
    """The schedule a record is of, as text (a malformed record's values too)."""
    return str(outcome.get("tenant")), str(outcome.get("schedule_id"))


async def _record_in_order(
    store: AttemptStore,
    tenants: TenantPolicies,
    line: list[dict[str, Any]],
    sleep: Callable[[float], Awaitable[None]],
) -> None:
    for outcome in line:
        await record_outcome(store, tenants, outcome, sleep=sleep)


def _rounds(
    marks: list[tuple[dict[str, Any], DeliveryMark]],
) -> list[list[tuple[dict[str, Any], DeliveryMark]]]:
    """``marks`` in rounds holding each schedule at most once, in their order: the n-th
    outcome of a schedule in the n-th round. Two outcomes of one schedule in one unlogged
    batch without their own timestamps (``order_us`` None: no time) carry the batch's, and
    Cassandra then keeps the greater value of each status cell (a mix of both); a round
    written after the one before ends wins whole. One round unless a batch holds a
    schedule twice (a backlog of a recurring schedule's runs, a redelivery)."""
    rounds: list[list[tuple[dict[str, Any], DeliveryMark]]] = []
    seen: dict[tuple[str, str], int] = {}  # at most one entry per mark of this batch
    for item in marks:
        key = (item[1].tenant, item[1].schedule_id)
        n = seen.get(key, 0)
        seen[key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(item)
    return rounds


def outcome_order_us(
    at_ms: int,
    outcome: str,
    status_code: int | None,
    attempts: int,
    trigger_id: str | None,
    *,
    now_ms: int,
) -> int | None:
    """The write timestamp (µs) of an outcome's delivery cells: its own time (the proxy's
    ``delivered_ms`` / ``dead_lettered_ms``), so the schedule's status is the outcome with
    the latest time whoever writes it and whenever the write lands (a revoked worker
    retrying through a Cassandra failure after the next owner wrote a later outcome, a
    batch read again). The microseconds tell apart different outcomes of one millisecond by
    a hash of their content: at equal timestamps Cassandra keeps the greater value of each
    cell, a mix of both; the same outcome written twice gets the same timestamp. None (the
    time of the write) for an outcome with no time or one dated past
    ``MAX_OUTCOME_AHEAD_MS`` ahead."""
    if at_ms <= 0 or at_ms > now_ms + MAX_OUTCOME_AHEAD_MS:
        return None
    content = f"{trigger_id}|{outcome}|{status_code}|{attempts}".encode()
    return at_ms * 1000 + zlib.crc32(content) % 1000


def _delivery_mark(
    outcome: dict[str, Any], retention_s: int | None, now_ms: int | None = None
) -> DeliveryMark:
    """The store's record of a final outcome (KeyError, TypeError, ValueError: unusable)."""
    kind = DeliveryOutcome(outcome["outcome"])
    status_code = outcome.get("status_code")
    attempts = int(outcome.get("attempts", 0))
    at_ms = int(outcome.get("delivered_ms") or outcome.get("dead_lettered_ms") or 0)
    trigger_id = outcome.get("trigger_id")
    return DeliveryMark(
        tenant=outcome["tenant"],
        schedule_id=outcome["schedule_id"],
        outcome=kind,
        status_code=status_code,
        attempts=attempts,
        at_ms=at_ms,
        trigger_id=trigger_id,
        due_ms=outcome.get("due_ms"),
        detail=delivery_detail(outcome),
        retention_s=retention_s,
        order_us=outcome_order_us(
            at_ms,
            kind,
            status_code,
            attempts,
            trigger_id,
            now_ms=int(time.time() * 1000) if now_ms is None else now_ms,
        ),
    )


def _count_recorded(outcome: dict[str, Any]) -> None:
    metrics.DELIVERIES.labels(outcome["outcome"]).inc()
    if outcome["outcome"] == DeliveryOutcome.DEAD_LETTERED:
        metrics.count_dead_lettered(outcome["tenant"])


async def record_outcome(
    store: AttemptStore,
    tenants: TenantPolicies,
    outcome: dict[str, Any],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bool:
    """Record one outcome (or attempt record: ``record_attempt``); True when recorded, False
    when it was dropped for good (logged and counted). Returns only then: a retriable store
    failure is waited out."""
    if outcome.get("kind") == ATTEMPT:
        return await record_attempt(store, tenants, outcome, sleep=sleep)
    delay = RETRY_FIRST_S
    while True:
        try:
            config = await tenants.config(outcome["tenant"])
            mark = _delivery_mark(outcome, config.retention_s)
            await store.record_delivery(
                mark.tenant,
                mark.schedule_id,
                outcome=mark.outcome,
                status_code=mark.status_code,
                attempts=mark.attempts,
                at_ms=mark.at_ms,
                trigger_id=mark.trigger_id,
                due_ms=mark.due_ms,
                detail=mark.detail,
                retention_s=mark.retention_s,
                order_us=mark.order_us,
            )
            _count_recorded(outcome)
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

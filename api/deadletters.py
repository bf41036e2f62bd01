"""A tenant's dead letters: list them, and redrive chosen ones (by trigger id) or every one
of a time window. Used by the REST API (``/v1/dead-letters``) and ``tocsin deadletter``.

A redrive sends the trigger again through the fires topic, keyed by its order key like the
ticker's emission, so the proxy delivers it in its key's order with its normal retries and
dead letter. It keeps its trigger id and gets the next emission attempt; the schedule's
history records a ``refired`` event saying it was redriven. It is not a command on the
commands topic: it changes no schedule, so no worker has to decide it (as the bulk re-fire,
``api.service.Service.bulk_refire``).

What a redrive refuses, each with its own code:

* ``not_found`` (404): no dead letter of this trigger for the caller's tenant (none, expired,
  or another tenant's: the same answer, so ids cannot be probed);
* ``already_redriven`` (409): it was redriven already (or by a request at the same moment:
  a conditional update lets one of them send it); ``force`` sends it once more;
* ``already_delivered`` (409): a later emission of the trigger was delivered since; ``force``
  sends it anyway;
* ``schedule_cancelled`` (409): the schedule (or a run's recurring schedule) was cancelled
  since; cancelling says no more callbacks, so a redrive never overrides it;
* ``superseded`` (409): the schedule was changed since and its current version has
  another trigger (or is still to fire): that one is the one that counts;
* ``schedule_gone`` (410): the schedule's rows have expired (retention);
* ``fire_not_recorded`` (503, retriable): the worker has not yet recorded the fire the dead
  letter came from (a 7xx dead letter can arrive first); the same request soon succeeds.

A pause does not refuse a redrive: it holds the fires a schedule would make by itself, not
one an operator asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from typing import Protocol

from api.service import row_failure
from api.views import ApiError, decode_cursor, encode_cursor
from base.clock import now_ms
from base.errors import CommandRejected, StoreError
from streams.deadletter_store import (
    CqlRunner,
    DeadLetterEntry,
    DeadLetterStore,
    days_newest_first,
    latest_unclaimed,
)
from streams.model import ScheduleEvent, ScheduleRow, ScheduleState, trigger_for
from streams.ports import CqlRow
from topics.codec import encode_trigger, trigger_headers
from topics.ids import format_iso_ms
from topics.models import DeliveryOutcome, Trigger

log = logging.getLogger("tocsin.api.deadletters")

# At most this many dead letters are redriven by one request (trigger ids or a window); a
# window with more answers ``truncated`` and a ``next_cursor`` to go on from.
MAX_REDRIVE = 500
# A window redrive reads at most this many dead letters looking for ones not redriven yet.
MAX_SCAN = 10_000
# Redrives of one request in flight at once.
REDRIVE_CONCURRENCY = 50
# The listing's default window: the default retention of fired schedules.
DEFAULT_WINDOW_MS = 7 * 86_400_000
_PAGE = 500

# (key, value, headers) of one fires-topic record, produced and acknowledged.
Emit = Callable[[bytes, bytes, list[tuple[str, bytes]]], Awaitable[None]]


class ScheduleReader(CqlRunner, Protocol):
    """What a redrive reads and writes of the scheduler's tables (``streams.store.Store``)."""

    async def get_schedule(self, tenant: str, schedule_id: str) -> CqlRow | None: ...

    async def list_events(self, tenant: str, schedule_id: str) -> list[CqlRow]: ...

    async def record_event(
        self,
        tenant: str,
        schedule_id: str,
        event: ScheduleEvent,
        *,
        at_ms: int,
        detail: str | None = None,
        trigger_id: str | None = None,
        due_ms: int | None = None,
        retention_s: int | None = None,
    ) -> None: ...


# -- pure ------------------------------------------------------------------------------------


def dead_letter_view(e: DeadLetterEntry) -> dict[str, object]:
    """A dead letter as the API and ``tocsin deadletter --json`` show it."""
    response = (
        None
        if e.status_code is None
        else {"status_code": e.status_code, "body_excerpt": e.body_excerpt or ""}
    )
    redriven = (
        None
        if e.redriven_ms is None
        else {"at": format_iso_ms(e.redriven_ms), "attempt": e.redrive_attempt}
    )
    return {
        "trigger_id": e.trigger_id,
        "schedule_id": e.schedule_id,
        "dead_lettered_at": format_iso_ms(e.dead_lettered_ms),
        "due": None if e.due_ms is None else format_iso_ms(e.due_ms),
        "reason": e.reason,
        "response": response,
        "endpoint": e.endpoint,
        "attempts": e.attempts,
        "emit_attempt": e.emit_attempt,
        "redriven": redriven,
    }


def next_attempt(events: Iterable[CqlRow], dead_letter: DeadLetterEntry) -> int:
    """The emission attempt of a redrive: one past every emission the history records
    (as ``Service._refire`` counts) and past the one that was dead-lettered."""
    emitted = sum(1 for e in events if e["event"] in (ScheduleEvent.FIRED, ScheduleEvent.REFIRED))
    return max(emitted, dead_letter.emit_attempt or 0) + 1


def _refuse(status: int, code: str, message: str, dl: DeadLetterEntry) -> ApiError:
    return ApiError(status, code, message, trigger_id=dl.trigger_id, schedule_id=dl.schedule_id)


def owner_id(dl: DeadLetterEntry, row: CqlRow | None) -> str | None:
    """The recurring schedule a run's dead letter belongs to, or None for a one-shot. A run
    (``<schedule id>@<nominal ms>``, or an extra run fired at once) has a row of its own
    holding only its fire state (no due time); its schedule holds what it fires with."""
    if row is None or row.get("due_ms") is not None:
        return None
    parent, sep, _ = dl.schedule_id.rpartition("@")
    return parent if sep and parent else None


def fire_not_recorded(dl: DeadLetterEntry, row: CqlRow) -> bool:
    """True while the worker has not yet recorded the fire this dead letter came from: the
    proxy can dead-letter a trigger (a 7xx answer at once) before the ticker's fired record
    lands, and the row then still reads scheduled, for the same due time, with no trigger
    id. Refusing that as superseded would be final for what a retry soon gets through."""
    return (
        row.get("state") == ScheduleState.SCHEDULED
        and row.get("trigger_id") is None
        and dl.due_ms is not None
        and row.get("due_ms") == dl.due_ms
    )


def redrive_source(
    dl: DeadLetterEntry, row: CqlRow | None, parent: CqlRow | None, *, force: bool
) -> ScheduleRow:
    """The schedule row ``dl``'s trigger is rebuilt from, or the ApiError that refuses the
    redrive (module docstring). ``row`` is the schedule's (a run's own row for a run of a
    recurring schedule, which holds only its fire state), ``parent`` a run's recurring
    schedule."""
    if dl.redrive_claim is not None and not force:
        when = format_iso_ms(dl.redriven_ms) if dl.redriven_ms else "before"
        return_msg = f"redriven at {when} (attempt {dl.redrive_attempt}); force sends it again"
        raise _refuse(409, "already_redriven", return_msg, dl)
    run = owner_id(dl, row)
    owner = parent if run is not None else row
    if row is None or owner is None:
        raise _refuse(410, "schedule_gone", "the schedule's rows have expired", dl)
    if owner.get("state") == ScheduleState.CANCELLED:
        raise _refuse(409, "schedule_cancelled", "the schedule was cancelled since", dl)
    if fire_not_recorded(dl, row):
        raise _refuse(
            503,
            "fire_not_recorded",
            "the schedule's fire is not recorded yet (the dead letter can arrive first); "
            "retry in a few seconds",
            dl,
        )
    if row.get("trigger_id") != dl.trigger_id or row.get("state") == ScheduleState.SCHEDULED:
        raise _refuse(
            409, "superseded", "the schedule was changed since; its current version counts", dl
        )
    delivered_ms = row.get("delivery_ms")
    if (
        not force
        and row.get("delivery_outcome") == DeliveryOutcome.DELIVERED
        and isinstance(delivered_ms, int)
        and delivered_ms > dl.dead_lettered_ms
    ):
        raise _refuse(409, "already_delivered", "delivered since; force sends it again", dl)
    if run is None:
        return ScheduleRow(**row)
    if dl.due_ms is None:
        raise _refuse(410, "schedule_gone", "the dead letter does not say the run's due time", dl)
    base = ScheduleRow(**owner)
    # A run fires as a one-shot of its recurring schedule (streams.decisions.run_bucket_row)
    # under its own trigger id, which the caller passes on (an extra run's is not derived).
    return replace(
        base,
        schedule_id=dl.schedule_id,
        due_ms=dl.due_ms,
        order_key=base.order_key or base.schedule_id,
    )


def _redrive_detail(dl: DeadLetterEntry) -> str:
    why = (dl.reason or "").splitlines()[0][:200] if dl.reason else "no reason recorded"
    return f"redriven from its dead letter of {format_iso_ms(dl.dead_lettered_ms)} ({why})"


def bulk_answer(
    ids: Sequence[str], results: Sequence[dict[str, object] | Exception], truncated: bool
) -> dict[str, object]:
    """A redrive of many: each one's outcome; one that fails is listed with its code and the
    others proceed."""
    done = [r for r in results if isinstance(r, dict)]
    failed = []
    for tid, r in zip(ids, results, strict=True):
        if isinstance(r, Exception):
            fail = row_failure(tid, r)
            fail.pop("schedule_id", None)
            failed.append({"trigger_id": tid, **fail})
    return {
        "matched": len(ids),
        "redriven": done,
        "failed": failed,
        "truncated": truncated,
        "limit": MAX_REDRIVE,
    }


# -- with I/O --------------------------------------------------------------------------------


class DeadLetters:
    """List and redrive one tenant's dead letters over ``store`` (a connected
    ``streams.store.Store``); ``emit`` produces a trigger to the fires topic."""

    def __init__(
        self,
        store: ScheduleReader,
        emit: Emit,
        *,
        clock: Callable[[], int] = now_ms,
        letters: DeadLetterStore | None = None,
    ) -> None:
        self.store = store
        self.letters = letters or DeadLetterStore(store)
        self.emit = emit
        self.clock = clock

    async def list(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        limit: int,
        before: tuple[int, str] | None = None,
    ) -> tuple[list[DeadLetterEntry], tuple[int, str] | None]:
        """Newest first; raises ApiError(400) for a window over the bound."""
        check_window(from_ms, to_ms)
        return await self.letters.list_window(
            tenant, from_ms=from_ms, to_ms=to_ms, limit=limit, before=before
        )

    async def get(self, tenant: str, trigger_id: str) -> tuple[DeadLetterEntry, int]:
        got = await self.letters.get(tenant, trigger_id)
        if got is None:
            raise ApiError(404, "not_found", f"no dead letter of trigger {trigger_id!r}")
        return got

    async def redrive(
        self, tenant: str, trigger_id: str, *, force: bool = False
    ) -> dict[str, object]:
        """Send the trigger of ``tenant``'s latest dead letter of ``trigger_id`` again."""
        dl, ttl_s = await self.get(tenant, trigger_id)
        return await self._redrive(dl, ttl_s, force=force)

    async def _redrive(self, dl: DeadLetterEntry, ttl_s: int, *, force: bool) -> dict[str, object]:
        row = await self.store.get_schedule(dl.tenant, dl.schedule_id)
        parent = None
        run = owner_id(dl, row)
        if run is not None:
            parent = await self.store.get_schedule(dl.tenant, run)
        source = redrive_source(dl, row, parent, force=force)
        events = await self.store.list_events(dl.tenant, dl.schedule_id)
        attempt = next_attempt(events, dl)
        at = self.clock()
        try:
            trig = trigger_for(source, emitted_ms=at, attempt=attempt, trigger_id=dl.trigger_id)
        except (ValueError, CommandRejected) as exc:
            raise _refuse(
                409, "not_redrivable", f"its trigger cannot be rebuilt: {exc}", dl
            ) from None
        claim = uuid.uuid4().hex
        replacing = dl.redrive_claim if force else None
        if not await self.letters.claim(
            dl, claim=claim, at_ms=at, attempt=attempt, ttl_s=ttl_s, replacing=replacing
        ):
            raise _refuse(409, "already_redriven", "redriven by another request just now", dl)
        await self._send(dl, trig, claim, ttl_s)
        # Sent and claimed: the redrive is done whatever the history write does (an error
        # answered now would invite a retry that can only be refused already_redriven).
        recorded = True
        try:
            await self.store.record_event(
                dl.tenant,
                dl.schedule_id,
                ScheduleEvent.REFIRED,
                at_ms=at,
                trigger_id=trig.trigger_id,
                due_ms=trig.due_ms,
                detail=_redrive_detail(dl),
            )
        except StoreError as exc:
            recorded = False
            log.warning(
                "redriven, but its history event was not recorded",
                extra={"trigger_id": trig.trigger_id, "error": str(exc)},
            )
        return {
            "trigger_id": trig.trigger_id,
            "schedule_id": trig.schedule_id,
            "attempt": attempt,
            "redriven_at": format_iso_ms(at),
            "history_recorded": recorded,
        }

    async def _send(self, dl: DeadLetterEntry, trig: Trigger, claim: str, ttl_s: int) -> None:
        """Produce the trigger; if Kafka did not take it, the claim is given back so the
        same request may be repeated."""
        try:
            await self.emit(trig.order_key.encode(), encode_trigger(trig), trigger_headers(trig))
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self.letters.release(dl, claim=claim, ttl_s=ttl_s)
            if isinstance(exc, TimeoutError):
                raise ApiError(
                    503, "unavailable", "Kafka did not acknowledge the trigger in time"
                ) from None
            raise

    async def redrive_many(
        self, tenant: str, trigger_ids: Sequence[str], *, force: bool = False
    ) -> dict[str, object]:
        """Redrive each of ``trigger_ids`` (at most ``MAX_REDRIVE``) on its own."""
        ids = list(dict.fromkeys(trigger_ids))
        if len(ids) > MAX_REDRIVE:
            raise ApiError(
                400, "too_many", f"at most {MAX_REDRIVE} trigger ids per request", limit=MAX_REDRIVE
            )
        results = await _each(ids, lambda tid: self.redrive(tenant, tid, force=force))
        return bulk_answer(ids, results, truncated=False)

    async def redrive_window(
        self, tenant: str, *, from_ms: int, to_ms: int, cursor: str | None = None
    ) -> dict[str, object]:
        """Redrive the dead letters of [from_ms, to_ms) not redriven yet, newest first, at
        most ``MAX_REDRIVE``, from ``cursor`` (a previous answer's ``next_cursor``). When
        more are left, ``truncated`` and ``next_cursor`` say where to go on: repeating the
        request without it would pick again the ones refused for good (cancelled, gone),
        which stay unclaimed."""
        check_window(from_ms, to_ms)
        picked: list[DeadLetterEntry] = []
        seen: list[DeadLetterEntry] = []
        before = decode_cursor(cursor)
        truncated = False
        while True:
            page, before = await self.letters.list_window(
                tenant, from_ms=from_ms, to_ms=to_ms, limit=_PAGE, before=before
            )
            seen.extend(page)
            picked = latest_unclaimed(seen)
            if before is None:
                break
            if len(picked) > MAX_REDRIVE or len(seen) >= MAX_SCAN:
                truncated = True
                break
        if len(picked) > MAX_REDRIVE:
            # Everything newer than the last one sent was sent or passed over.
            picked, truncated = picked[:MAX_REDRIVE], True
            before = picked[-1].position
        ids = [e.trigger_id for e in picked]
        results = await _each(ids, lambda tid: self.redrive(tenant, tid))
        answer = bulk_answer(ids, results, truncated=truncated)
        answer["next_cursor"] = encode_cursor(*before) if truncated and before else None
        return answer


def check_window(from_ms: int, to_ms: int) -> None:
    try:
        days_newest_first(from_ms, to_ms)
    except ValueError as exc:
        raise ApiError(400, "invalid_parameter", str(exc)) from None


async def _each(
    ids: Sequence[str], work: Callable[[str], Awaitable[dict[str, object]]]
) -> list[dict[str, object] | Exception]:
    """``work`` for every id, ``REDRIVE_CONCURRENCY`` at a time, each one's result or
    error in order: no error is lost and none stops the others."""
    sem = asyncio.Semaphore(REDRIVE_CONCURRENCY)

    async def one(tid: str) -> dict[str, object]:
        async with sem:
            return await work(tid)

    results = await asyncio.gather(*(one(t) for t in ids), return_exceptions=True)
    out: list[dict[str, object] | Exception] = []
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r
        out.append(r)
    return out

"""Each tenant's dead letters (tables ``dead_letters`` and ``dead_letters_by_trigger``,
migration 009): written by the worker when the proxy's ``dead_lettered`` outcome arrives on
the deliveries topic, read and claimed by a redrive (``api.deadletters``).

The dead-letters topic holds every tenant's records of a deployment, and reading a topic per
request is slow; these tables hold one tenant's dead letters per UTC day, newest first, kept
as long as the tenant's fired schedules, on the worker's ``Store`` session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from base.errors import StoreError
from streams.cql import gather_all, unset_none
from streams.ports import CqlRow, TenantPolicies
from topics.models import DeliveryOutcome

log = logging.getLogger("tocsin.deadletters")

DAY_MS = 86_400_000
# A listing or window redrive reads at most this many day partitions (a month and a day).
MAX_WINDOW_DAYS = 32
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
# What a row repeats of the outcome's texts: the proxy caps them already (4,096 characters
# of reason, 1,024 of body), this holds whatever a producer of outcomes wrote.
_MAX_TEXT_CHARS = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterEntry:
    """One dead letter of a tenant: which trigger, why, what the endpoint last answered,
    and whether (when, with which attempt) it was redriven."""

    tenant: str
    trigger_id: str
    dead_lettered_ms: int
    schedule_id: str
    due_ms: int | None = None
    emit_attempt: int | None = None
    attempts: int | None = None
    reason: str | None = None
    status_code: int | None = None
    body_excerpt: str | None = None
    endpoint: str | None = None
    redrive_claim: str | None = None
    redriven_ms: int | None = None
    redrive_attempt: int | None = None

    @property
    def day_ms(self) -> int:
        return day_of(self.dead_lettered_ms)

    @property
    def position(self) -> tuple[int, str]:
        """Where it sits in a listing (newest first): the cursor after it."""
        return self.dead_lettered_ms, self.trigger_id


_COLUMNS = tuple(f.name for f in fields(DeadLetterEntry))
_KEY = "tenant = ? AND day_ms = ? AND dead_lettered_ms = ? AND trigger_id = ?"
_WRITTEN = _COLUMNS[: _COLUMNS.index("redrive_claim")]  # what an outcome sets

STATEMENTS = {
    "dl_put": f"INSERT INTO {{keyspace}}.dead_letters (day_ms, {', '.join(_WRITTEN)}) "
    f"VALUES (?, {', '.join('?' for _ in _WRITTEN)}) USING TTL ?",
    # Written at the dead letter's own time (microseconds): whatever order two outcomes of
    # one trigger are written in (a replay, or both of one batch at once), the newer wins.
    "dl_put_latest": "INSERT INTO {keyspace}.dead_letters_by_trigger "
    "(tenant, trigger_id, dead_lettered_ms) VALUES (?, ?, ?) USING TTL ? AND TIMESTAMP ?",
    "dl_latest": "SELECT dead_lettered_ms FROM {keyspace}.dead_letters_by_trigger "
    "WHERE tenant = ? AND trigger_id = ?",
    "dl_get": f"SELECT {', '.join(_COLUMNS)}, TTL(schedule_id) AS ttl_s "
    f"FROM {{keyspace}}.dead_letters WHERE {_KEY}",
    # Newest first below a position (exclusive) and at or after a lower bound.
    "dl_page": f"SELECT {', '.join(_COLUMNS)} FROM {{keyspace}}.dead_letters "
    "WHERE tenant = ? AND day_ms = ? AND (dead_lettered_ms, trigger_id) < (?, ?) "
    "AND (dead_lettered_ms) >= (?) LIMIT ?",
    # Conditional: of two redrives at once only one claims the dead letter. A driver retry
    # of a claim that did apply reads back its own claim (``DeadLetterStore.claim``).
    "dl_claim": "UPDATE {keyspace}.dead_letters USING TTL ? SET redrive_claim = ?, "
    f"redriven_ms = ?, redrive_attempt = ? WHERE {_KEY} IF redrive_claim = null",
    "dl_claim_again": "UPDATE {keyspace}.dead_letters USING TTL ? SET redrive_claim = ?, "
    f"redriven_ms = ?, redrive_attempt = ? WHERE {_KEY} IF redrive_claim = ?",
    "dl_release": "UPDATE {keyspace}.dead_letters USING TTL ? SET redrive_claim = null, "
    f"redriven_ms = null, redrive_attempt = null WHERE {_KEY} IF redrive_claim = ?",
}


def day_of(at_ms: int) -> int:
    """The UTC day (its first ms) a dead letter's partition is keyed by."""
    return at_ms - at_ms % DAY_MS


def days_newest_first(from_ms: int, to_ms: int) -> list[int]:
    """The day partitions of the window [from_ms, to_ms), newest first. Raises ValueError
    for an empty window or one over ``MAX_WINDOW_DAYS`` days."""
    if to_ms <= from_ms:
        raise ValueError("the window is empty: 'to' must be after 'from'")
    first, last = day_of(from_ms), day_of(to_ms - 1)
    count = (last - first) // DAY_MS + 1
    if count > MAX_WINDOW_DAYS:
        raise ValueError(f"the window spans {count} days; at most {MAX_WINDOW_DAYS}")
    return [last - i * DAY_MS for i in range(count)]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: object) -> str | None:
    return value[:_MAX_TEXT_CHARS] if isinstance(value, str) else None


def entry_from_outcome(outcome: Mapping[str, Any]) -> DeadLetterEntry | None:
    """The dead letter a proxy delivery outcome records (docs/proxy.md), or None when the
    outcome is not a dead-lettered trigger (delivered, or no trigger id or time)."""
    if outcome.get("outcome") != DeliveryOutcome.DEAD_LETTERED:
        return None
    tenant, sid, tid = outcome.get("tenant"), outcome.get("schedule_id"), outcome.get("trigger_id")
    at = _int(outcome.get("dead_lettered_ms"))
    if not (isinstance(tenant, str) and isinstance(sid, str) and isinstance(tid, str)):
        return None
    if at is None or not tenant or not tid:
        return None
    response = outcome.get("response")
    body = response.get("body_excerpt") if isinstance(response, dict) else None
    status = _int(response.get("status_code")) if isinstance(response, dict) else None
    return DeadLetterEntry(
        tenant=tenant,
        trigger_id=tid,
        dead_lettered_ms=at,
        schedule_id=sid,
        due_ms=_int(outcome.get("due_ms")),
        emit_attempt=_int(outcome.get("emit_attempt")),
        attempts=_int(outcome.get("attempts")),
        reason=_text(outcome.get("reason")),
        status_code=status if status is not None else _int(outcome.get("status_code")),
        body_excerpt=_text(body),
        endpoint=_text(outcome.get("endpoint")),
    )


def latest_unclaimed(entries: Iterable[DeadLetterEntry]) -> list[DeadLetterEntry]:
    """Of ``entries`` (newest first), each trigger's newest dead letter if it is not
    redriven yet, in the same order: what a window redrive sends again."""
    seen: set[str] = set()
    out: list[DeadLetterEntry] = []
    for e in entries:
        if e.trigger_id in seen:
            continue
        seen.add(e.trigger_id)
        if e.redrive_claim is None:
            out.append(e)
    return out


class CqlRunner(Protocol):
    """What this module needs of the worker's or API's ``streams.store.Store``."""

    async def run(
        self, name: str, params: Sequence[object], *, fetch_size: int | None = None
    ) -> list[CqlRow]: ...

    async def prepare_statements(self, cql: dict[str, str]) -> None: ...

    def has_statements(self, names: Iterable[str]) -> bool: ...

    def keep_s(self, retention_s: int | None) -> int: ...


def _entry(row: CqlRow) -> DeadLetterEntry:
    values: dict[str, Any] = {c: row.get(c) for c in _COLUMNS}
    return DeadLetterEntry(**values)


class DeadLetterStore:
    """The dead-letter statements on top of a connected ``Store`` (same session)."""

    def __init__(self, store: CqlRunner) -> None:
        self.store = store
        self._prepared = False

    async def prepare(self) -> None:
        if not self._prepared:
            if not self.store.has_statements(list(STATEMENTS)):
                await self.store.prepare_statements(STATEMENTS)
            self._prepared = True

    async def put(self, entry: DeadLetterEntry, *, retention_s: int | None) -> None:
        """Record ``entry`` (an overwrite when the same outcome is read again, its redrive
        columns left as they are) and make it its trigger's latest."""
        await self.prepare()
        keep = self.store.keep_s(retention_s)
        values = unset_none([getattr(entry, c) for c in _WRITTEN])
        await gather_all(
            [
                self.store.run("dl_put", [entry.day_ms, *values, keep]),
                self.store.run(
                    "dl_put_latest",
                    [
                        entry.tenant,
                        entry.trigger_id,
                        entry.dead_lettered_ms,
                        keep,
                        entry.dead_lettered_ms * 1000,
                    ],
                ),
            ]
        )

    async def get(self, tenant: str, trigger_id: str) -> tuple[DeadLetterEntry, int] | None:
        """The trigger's latest dead letter of ``tenant`` and its remaining lifetime in
        seconds, or None (none, expired, or another tenant's)."""
        await self.prepare()
        latest = await self.store.run("dl_latest", [tenant, trigger_id])
        if not latest:
            return None
        at = int(latest[0]["dead_lettered_ms"])
        rows = await self.store.run("dl_get", [tenant, day_of(at), at, trigger_id])
        if not rows or rows[0].get("schedule_id") is None:
            return None
        return _entry(rows[0]), int(rows[0].get("ttl_s") or 1)

    async def list_window(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        limit: int,
        before: tuple[int, str] | None = None,
    ) -> tuple[list[DeadLetterEntry], tuple[int, str] | None]:
        """Up to ``limit`` dead letters of [from_ms, to_ms), newest first, after the cursor
        ``before``; and the cursor to continue from (None: the window is exhausted)."""
        await self.prepare()
        cursor = before if before is not None and before[0] <= to_ms else (to_ms, "")
        out: list[DeadLetterEntry] = []
        for day in days_newest_first(from_ms, to_ms):
            if day > day_of(cursor[0]):
                continue  # the cursor is past this whole day already
            rows = await self.store.run(
                "dl_page",
                [tenant, day, cursor[0], cursor[1], max(from_ms, day), limit - len(out)],
            )
            out.extend(_entry(r) for r in rows)
            if len(out) >= limit:
                return out, out[-1].position
        return out, None

    async def claim(
        self,
        entry: DeadLetterEntry,
        *,
        claim: str,
        at_ms: int,
        attempt: int,
        ttl_s: int,
        replacing: str | None = None,
    ) -> bool:
        """Mark ``entry`` redriven by ``claim`` if it still has the claim ``replacing``
        (None: not redriven); True when this claim holds."""
        await self.prepare()
        key = [entry.tenant, entry.day_ms, entry.dead_lettered_ms, entry.trigger_id]
        params: list[object] = [max(1, ttl_s), claim, at_ms, attempt, *key]
        if replacing is None:
            rows = await self.store.run("dl_claim", params)
        else:
            rows = await self.store.run("dl_claim_again", [*params, replacing])
        if not rows:
            return False
        # A retried conditional update that had applied reads back its own claim.
        return bool(rows[0].get("[applied]")) or rows[0].get("redrive_claim") == claim

    async def release(self, entry: DeadLetterEntry, *, claim: str, ttl_s: int) -> None:
        """Undo ``claim`` (the trigger could not be sent), unless another replaced it."""
        await self.prepare()
        key = [entry.tenant, entry.day_ms, entry.dead_lettered_ms, entry.trigger_id]
        await self.store.run("dl_release", [max(1, ttl_s), *key, claim])


async def record_dead_letters(
    store: DeadLetterStore,
    tenants: TenantPolicies,
    outcomes: Sequence[Mapping[str, Any]],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Record the dead-lettered ones of ``outcomes`` (proxy delivery outcomes); how many.
    Returns only once each is recorded or refused for good: a retriable store failure is
    waited out, so the deliveries topic's offset never passes an unlisted dead letter."""
    entries = [e for o in outcomes if (e := entry_from_outcome(o)) is not None]
    results = await asyncio.gather(*(_record(store, tenants, e, sleep) for e in entries))
    return sum(results)


async def _record(
    store: DeadLetterStore,
    tenants: TenantPolicies,
    entry: DeadLetterEntry,
    sleep: Callable[[float], Awaitable[None]],
) -> bool:
    delay = RETRY_FIRST_S
    while True:
        try:
            config = await tenants.config(entry.tenant)
            await store.put(entry, retention_s=config.retention_s)
            return True
        except StoreError as exc:
            if not exc.retriable:
                log.error(
                    "dead letter refused by the store",
                    extra={"error": str(exc), "trigger_id": entry.trigger_id},
                )
                return False
            log.warning(
                "store unavailable; retrying a dead letter",
                extra={"error": str(exc), "retry_s": delay},
            )
            await sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

"""Refused commands of an existing schedule, recorded in its history (``command_refused``)
so ``explain`` shows them next to the commands that were applied.

Only a command whose tenant was proven (known sender, valid signature, within its policy)
and refused by the decision or its quota is recorded, and only when the tenant has a
schedule of that id: rows are keyed by tenant, so a refusal never reaches another tenant's
schedule, and nothing is written for an id the tenant does not have.

Bounded: at most ``PER_WINDOW`` refusals per schedule per ``WINDOW_MS``; the rest are
counted and the next one recorded says how many were not (``RefusalBook``, an LRU of at
most ``MAX_SCHEDULES`` schedules). Recording is best effort: a store failure is logged and
counted, and never holds up or changes the command's answer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from base.errors import StoreError
from streams.tenants import TenantConfig

log = logging.getLogger("tocsin.commands")

COMMAND_REFUSED = "command_refused"
PER_WINDOW = 5
WINDOW_MS = 60_000
MAX_SCHEDULES = 10_000
_MAX_MESSAGE_CHARS = 512


class RefusalStore(Protocol):
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


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A proven tenant's command refused for a schedule it has."""

    tenant: str
    schedule_id: str
    command: str  # the command's type: update, pause, ...
    code: str
    message: str


@dataclass
class _Window:
    start_ms: int
    recorded: int = 0
    unrecorded: int = 0


class RefusalBook:
    """Per schedule: how many refusals this window recorded, and how many were not."""

    def __init__(
        self,
        per_window: int = PER_WINDOW,
        window_ms: int = WINDOW_MS,
        max_schedules: int = MAX_SCHEDULES,
    ) -> None:
        self.per_window = per_window
        self.window_ms = window_ms
        self.max_schedules = max_schedules
        self._windows: OrderedDict[tuple[str, str], _Window] = OrderedDict()
        self.unrecorded = 0  # over the bound, or not written: in this process's life

    def admit(self, key: tuple[str, str], now_ms: int) -> tuple[int, int] | None:
        """None: over the bound (counted); else how many before it went unrecorded, and
        its place in the window (0-based: it is written that many ms after ``now_ms``, so
        two refusals of one schedule in one batch keep a history row each)."""
        window = self._windows.pop(key, None)
        if window is None or now_ms - window.start_ms >= self.window_ms:
            carried = window.unrecorded if window is not None else 0
            window = _Window(start_ms=now_ms, unrecorded=carried)
        self._windows[key] = window
        while len(self._windows) > self.max_schedules:
            self._windows.popitem(last=False)
        if window.recorded >= self.per_window:
            window.unrecorded += 1
            self.unrecorded += 1
            return None
        window.recorded += 1
        skipped, window.unrecorded = window.unrecorded, 0
        return skipped, window.recorded - 1


def detail(refusal: Refusal, skipped: int) -> str:
    text = f"{refusal.command} refused ({refusal.code}): {refusal.message[:_MAX_MESSAGE_CHARS]}"
    if skipped:
        text += f" ({skipped} earlier refusal(s) not recorded one by one)"
    return text


async def record_refusals(
    store: RefusalStore,
    book: RefusalBook,
    refusals: Sequence[Refusal],
    policies: Mapping[str, TenantConfig],
    now_ms: int,
) -> int:
    """Record what the bound admits; how many were recorded."""
    recorded = 0
    for refusal in refusals:
        admitted = book.admit((refusal.tenant, refusal.schedule_id), now_ms)
        if admitted is None:
            continue
        skipped, place = admitted
        config = policies.get(refusal.tenant) or TenantConfig()
        try:
            await store.record_event(
                refusal.tenant,
                refusal.schedule_id,
                COMMAND_REFUSED,
                at_ms=now_ms + place,
                detail=detail(refusal, skipped),
                retention_s=config.retention_s,
            )
            recorded += 1
        except StoreError as exc:
            log.warning(
                "refused command not recorded in its schedule's history",
                extra={"error": str(exc), "schedule_id": refusal.schedule_id},
            )
            book.unrecorded += 1
    return recorded

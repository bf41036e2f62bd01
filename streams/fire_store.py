"""What happened to a schedule's trigger: fired or missed (the ``schedules`` row's state,
trigger id and times) and the proxy's delivery outcome, each with its history event in
the same mutation (the two tables share the schedule's partition key)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import ClassVar

from cassandra.query import UNSET_VALUE

from streams.cql import gather_all
from streams.event_store import EventStore
from streams.model import DeliveryMark, FiredMark, ScheduleEvent, ScheduleState, Stmt
from topics.models import DeliveryOutcome

_BY_SCHEDULE = "WHERE tenant = ? AND schedule_id = ?"
# The ``schedules`` cells of the last delivery outcome. Only ``record_delivery`` writes them,
# with the outcome's own time as their timestamp (``DeliveryMark.order_us``): a write of the
# whole row (``put_schedule``: commands, the materialiser) copies what it read, and at the
# time of its write it would put back an older outcome over one written meanwhile.
DELIVERY_COLUMNS = frozenset(
    {"delivery_outcome", "delivery_status_code", "delivery_attempts", "delivery_ms"}
)
# The history event that records each state a trigger ends in, and each delivery outcome.
_EVENT_OF_STATE = {
    ScheduleState.FIRED: ScheduleEvent.FIRED,
    ScheduleState.MISSED: ScheduleEvent.MISSED,
}
_EVENT_OF_OUTCOME = {
    DeliveryOutcome.DELIVERED: ScheduleEvent.DELIVERED,
    DeliveryOutcome.DEAD_LETTERED: ScheduleEvent.DEAD_LETTERED,
}


class FireRecordStore(EventStore):
    """Record fires, misses and delivery outcomes on schedule rows and in their history."""

    CQL: ClassVar[dict[str, str]] = {
        "mark_done": "UPDATE {keyspace}.schedules USING TTL ? SET state = ?, fired_ms = ?, "
        f"trigger_id = ?, updated_ms = ? {_BY_SCHEDULE}",
        "mark_done_if": "UPDATE {keyspace}.schedules USING TTL ? SET state = ?, fired_ms = ?, "
        f"trigger_id = ?, updated_ms = ? {_BY_SCHEDULE} IF version = ?",
        "record_delivery": "UPDATE {keyspace}.schedules USING TTL ? AND TIMESTAMP ? "
        "SET delivery_outcome = ?, "
        "delivery_status_code = ?, delivery_attempts = ?, delivery_ms = ? "
        f"{_BY_SCHEDULE}",
    }
    # A lightweight transaction: never retried blindly by the driver.
    CONDITIONAL: ClassVar[frozenset[str]] = frozenset({"mark_done_if"})

    async def mark_fired(
        self,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        *,
        fired_ms: int,
        due_ms: int,
        if_version: int | None = None,
        retention_s: int | None = None,
    ) -> bool:
        """Set state 'fired' (+ fired_ms, trigger_id) and append a 'fired' event, both kept
        ``retention_s`` (the tenant's retention; None: the global one).

        Plain UPDATE by default (no Paxos, so it keeps up with burst fire rates). Race: a
        reschedule accepted while this fire is in flight is overwritten to 'fired' although
        its new version is still pending. Readers detect that case because ``trigger_id``
        (uuid5 of tenant/schedule_id/due_ms of the fired version) no longer matches the row's
        ``due_ms``; the pending version still fires from its own bucket row and marks the
        row again. Pass ``if_version`` to make the update conditional (an LWT: correct but
        about four times the cost); returns False when the version did not match (the event
        row is written either way, since the fire did happen).
        """
        return await self._mark(
            ScheduleState.FIRED,
            tenant,
            schedule_id,
            trigger_id,
            fired_ms,
            due_ms,
            if_version,
            retention_s=retention_s,
        )

    async def mark_fired_many(self, marks: Sequence[FiredMark]) -> list[BaseException | None]:
        """``mark_fired`` (unconditional) for many triggers; the outcome of each (None when
        recorded). Up to ``commit_group_size`` marks share one unlogged batch: a mark's
        update and event stay one mutation, the group is just one request instead of many
        (the ticker records every fire, so per-request client CPU is what limits burst and
        recurring fire rates on a small box)."""
        groups: list[list[Stmt]] = []
        for m in marks:
            params, event = self._mark_stmts(
                ScheduleState.FIRED,
                m.tenant,
                m.schedule_id,
                m.trigger_id,
                m.fired_ms,
                m.due_ms,
                None,
                m.retention_s,
            )
            groups.append([("mark_done", params), event])
        return await self._run_packed("mark_fired", groups)

    async def mark_missed(
        self,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        *,
        missed_ms: int,
        due_ms: int,
        detail: str | None = None,
        if_version: int | None = None,
        retention_s: int | None = None,
    ) -> bool:
        """Set state 'missed' (beyond misfire tolerance) and append a 'missed' event. Same
        race, ``if_version`` and ``retention_s`` semantics as ``mark_fired``; fired_ms stays
        empty."""
        return await self._mark(
            ScheduleState.MISSED,
            tenant,
            schedule_id,
            trigger_id,
            missed_ms,
            due_ms,
            if_version,
            detail,
            retention_s=retention_s,
        )

    def _mark_stmts(
        self,
        state: ScheduleState,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        at_ms: int,
        due_ms: int,
        detail: str | None,
        retention_s: int | None,
    ) -> tuple[list[object], Stmt]:
        """The parameters of ``mark_done`` (or, plus a version, ``mark_done_if``) and the
        event statement that record a fired or missed trigger."""
        fired_ms = at_ms if state == ScheduleState.FIRED else UNSET_VALUE
        params: list[object] = [
            self.keep_s(retention_s),
            state,
            fired_ms,
            trigger_id,
            at_ms,
            tenant,
            schedule_id,
        ]
        event = self.event_stmt(
            tenant,
            schedule_id,
            _EVENT_OF_STATE[state],
            at_ms,
            detail,
            trigger_id,
            due_ms,
            retention_s,
        )
        return params, event

    async def _mark(
        self,
        state: ScheduleState,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        at_ms: int,
        due_ms: int,
        if_version: int | None,
        detail: str | None = None,
        *,
        retention_s: int | None = None,
    ) -> bool:
        params, event = self._mark_stmts(
            state, tenant, schedule_id, trigger_id, at_ms, due_ms, detail, retention_s
        )
        if if_version is None:
            # Same partition key in both tables: one request, one mutation.
            await self.run_together("mark_" + state, [("mark_done", params), event])
            return True
        # Cassandra refuses conditional batches spanning tables: two requests.
        rows, _ = await gather_all(
            [self.run("mark_done_if", [*params, if_version]), self.run(*event)]
        )
        return bool(rows and rows[0].get("[applied]"))

    async def record_delivery(
        self,
        tenant: str,
        schedule_id: str,
        *,
        outcome: DeliveryOutcome,
        status_code: int | None,
        attempts: int,
        at_ms: int,
        trigger_id: str | None = None,
        due_ms: int | None = None,
        detail: str | None = None,
        retention_s: int | None = None,
        order_us: int | None = None,
    ) -> None:
        """Store the delivery outcome reported by the proxy and append an event named after
        it ('delivered' | 'dead_lettered'), kept ``retention_s`` (None: the global one).
        The outcome's cells are written at timestamp ``order_us`` (``DeliveryMark``): a
        write of an older outcome landing later does not replace them."""
        mark = DeliveryMark(
            tenant=tenant,
            schedule_id=schedule_id,
            outcome=outcome,
            status_code=status_code,
            attempts=attempts,
            at_ms=at_ms,
            trigger_id=trigger_id,
            due_ms=due_ms,
            detail=detail,
            retention_s=retention_s,
            order_us=order_us,
        )
        await self.run_together("record_delivery", self._delivery_stmts(mark))

    async def record_deliveries_many(
        self, marks: Sequence[DeliveryMark]
    ) -> list[BaseException | None]:
        """``record_delivery`` for many outcomes; the outcome of each (None when recorded).
        Up to ``commit_group_size`` outcomes share one unlogged batch, as in
        ``mark_fired_many``: each outcome's update and event stay one mutation, the group is
        one request instead of one per outcome (the driver's CPU per request was the largest
        share of the worker's main thread at 1,000 deliveries/s). At most one mark per
        schedule: two in one batch without ``order_us`` share its timestamp, and Cassandra
        keeps the greater value of each cell (``deliveries.record_outcomes`` writes them in
        rounds)."""
        return await self._run_packed("record_delivery", [self._delivery_stmts(m) for m in marks])

    async def _run_packed(
        self, name: str, groups: Sequence[Sequence[Stmt]]
    ) -> list[BaseException | None]:
        """Each group's statements packed into unlogged batches (``pack``), the batches
        sent concurrently; the outcome of each group (None when recorded, else its batch's
        error)."""
        batches = self.pack(groups)
        results = await asyncio.gather(
            *(self.run_together(name, [s for i in batch for s in groups[i]]) for batch in batches),
            return_exceptions=True,
        )
        out: list[BaseException | None] = [None] * len(groups)
        for batch, result in zip(batches, results, strict=True):
            for i in batch:
                out[i] = result if isinstance(result, BaseException) else None
        return out

    def _delivery_stmts(self, m: DeliveryMark) -> list[Stmt]:
        update: Stmt = (
            "record_delivery",
            [
                self.keep_s(m.retention_s),
                time.time_ns() // 1000 if m.order_us is None else m.order_us,
                m.outcome,
                # None writes a null at the outcome's timestamp: an outcome with no response
                # (a timeout) must hide an older outcome's status code, as its other cells do.
                m.status_code,
                m.attempts,
                m.at_ms,
                m.tenant,
                m.schedule_id,
            ],
        )
        event = self.event_stmt(
            m.tenant,
            m.schedule_id,
            _EVENT_OF_OUTCOME[m.outcome],
            m.at_ms,
            m.detail,
            m.trigger_id,
            m.due_ms,
            m.retention_s,
        )
        return [update, event]

"""A schedule's history (the ``schedule_events`` table): one row per event, keyed by
(at_ms, event) under the schedule's own partition key, so an event can share a batch (one
mutation) with the schedule row it belongs to."""

from __future__ import annotations

from typing import ClassVar

from streams.cql import CqlExecutor, insert_cql, unset_none
from streams.model import ScheduleEvent, Stmt
from streams.ports import CqlRow

_EVENT_COLUMNS = ("tenant", "schedule_id", "at_ms", "event", "trigger_id", "due_ms", "detail")


class EventStore(CqlExecutor):
    """Append to and read a schedule's history."""

    CQL: ClassVar[dict[str, str]] = {
        "record_event": insert_cql("schedule_events", _EVENT_COLUMNS, ttl=True),
        "list_events": f"SELECT {', '.join(_EVENT_COLUMNS)} FROM {{keyspace}}.schedule_events "
        "WHERE tenant = ? AND schedule_id = ?",
        "list_newest_events": f"SELECT {', '.join(_EVENT_COLUMNS)} "
        "FROM {keyspace}.schedule_events WHERE tenant = ? AND schedule_id = ? "
        "ORDER BY at_ms DESC, event DESC LIMIT ?",
    }

    def event_stmt(
        self,
        tenant: str,
        schedule_id: str,
        event: ScheduleEvent | str,
        at_ms: int,
        detail: str | None,
        trigger_id: str | None,
        due_ms: int | None,
        retention_s: int | None = None,
    ) -> Stmt:
        values = unset_none([tenant, schedule_id, at_ms, event, trigger_id, due_ms, detail])
        return ("record_event", [*values, self.keep_s(retention_s)])

    async def record_event(
        self,
        tenant: str,
        schedule_id: str,
        event: ScheduleEvent | str,
        *,
        at_ms: int,
        detail: str | None = None,
        trigger_id: str | None = None,
        due_ms: int | None = None,
        retention_s: int | None = None,
    ) -> None:
        """Append to the schedule's history; (at_ms, event) is the row key, so writing the
        same event at the same instant again is an overwrite, not a duplicate."""
        await self.run(
            *self.event_stmt(
                tenant, schedule_id, event, at_ms, detail, trigger_id, due_ms, retention_s
            )
        )

    async def list_events(
        self, tenant: str, schedule_id: str, *, newest: int | None = None
    ) -> list[CqlRow]:
        """The schedule's history, oldest first; with ``newest``, only its newest that many
        events (read newest first by the clustering order, so the cost is bounded however
        long the history: a failing endpoint's attempts and refused commands add to it)."""
        if newest is None:
            return await self.run("list_events", (tenant, schedule_id))
        if newest <= 0:
            return []
        rows = await self.run("list_newest_events", (tenant, schedule_id, newest))
        return list(reversed(rows))

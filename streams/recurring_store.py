"""The recurring schedules' own tables, on the worker's store (same session): the due
queue that orders parents by when they must next be extended (``recurring_due``, read
forward by minute like a bucket), each partition reader's position
(``materialize_checkpoints``), the history of written runs (``recurring_runs``), and the
commit of a materialisation step (the parents' new state with their runs' history rows).

What is written is decided in ``streams.decisions``; when, by ``streams.materializer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from streams.decisions import DueEntry, Run, ScheduleRuns, materialize_key, upcoming_runs
from streams.model import (
    SCHEDULE_COLUMNS,
    BucketRow,
    ScheduleEvent,
    ScheduleRow,
    ScheduleState,
    Stmt,
)
from streams.ports import CqlRow, MaterializerStore
from streams.recurring import NEVER_MS
from streams.store import load_schedule_rows
from topics.codec import recurrence_from_json
from topics.ids import trigger_id

# -- storage ------------------------------------------------------------------------------

_RUN_COLUMNS = ("tenant", "schedule_id", "nominal_ms", "run_id", "due_ms", "trigger_id", "version")
STATEMENTS = {
    # Only when a partition's reader starts on a keyspace for the first time (no
    # checkpoint): parents keyed before the due queue existed (migration 007). A filtering
    # scan of the table, once per partition and keyspace.
    "rec_keyed_scan": f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {{keyspace}}.schedules "
    "WHERE materialize_key >= ? AND materialize_key < ? ALLOW FILTERING",
    "rec_due_put": "INSERT INTO {keyspace}.recurring_due (partition, slot_ms, due_ms, tenant, "
    "schedule_id) VALUES (?, ?, ?, ?, ?)",
    "rec_due_read": "SELECT tenant, schedule_id FROM {keyspace}.recurring_due "
    "WHERE partition = ? AND slot_ms = ? AND due_ms > ? AND due_ms <= ?",
    "rec_due_next": "SELECT due_ms FROM {keyspace}.recurring_due "
    "WHERE partition = ? AND slot_ms = ? AND due_ms > ? LIMIT 1",
    "rec_due_drop": "DELETE FROM {keyspace}.recurring_due WHERE partition = ? AND slot_ms = ?",
    "rec_cursor_get": "SELECT slot_ms, read_upto_ms FROM {keyspace}.materialize_checkpoints "
    "WHERE partition = ?",
    "rec_cursor_set": "INSERT INTO {keyspace}.materialize_checkpoints (partition, slot_ms, "
    "read_upto_ms, updated_ms) VALUES (?, ?, ?, ?)",
    "rec_put_run": f"INSERT INTO {{keyspace}}.recurring_runs ({', '.join(_RUN_COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in _RUN_COLUMNS)}) USING TTL ?",
    "rec_delete_run": "DELETE FROM {keyspace}.recurring_runs "
    "WHERE tenant = ? AND schedule_id = ? AND nominal_ms = ?",
    "rec_runs_before": f"SELECT {', '.join(_RUN_COLUMNS)} FROM {{keyspace}}.recurring_runs "
    "WHERE tenant = ? AND schedule_id = ? AND nominal_ms < ? LIMIT ?",
}


class RecurringStore:
    """The materialiser's statements on top of the worker's ``Store`` (same session)."""

    def __init__(self, store: MaterializerStore) -> None:
        self.store = store
        self._prepared = False

    async def prepare(self) -> None:
        if not self._prepared:
            # Several instances may share one store: prepare once per session.
            if not self.store.has_statements(list(STATEMENTS)):
                await self.store.prepare_statements(STATEMENTS)
            self._prepared = True

    async def keyed_parents(self, partition: int) -> list[ScheduleRow]:
        """Every parent of ``partition`` with a key (bootstrap of a partition's reader)."""
        await self.prepare()
        rows = await self.store.run(
            "rec_keyed_scan",
            (materialize_key(partition, 0), materialize_key(partition, NEVER_MS)),
        )
        return [ScheduleRow(**r) for r in rows if r.get("partition") == partition]

    async def put_due(self, entries: Sequence[DueEntry]) -> None:
        """Due-queue entries, one unlogged batch (one mutation) per minute partition."""
        if not entries:
            return
        await self.prepare()
        by_slot: dict[tuple[int, int], list[Stmt]] = {}
        for e in entries:
            by_slot.setdefault((e.partition, e.slot_ms), []).append(
                ("rec_due_put", [e.partition, e.slot_ms, e.due_ms, e.tenant, e.schedule_id])
            )
        sends = []
        for stmts in by_slot.values():
            for i in range(0, len(stmts), 200):
                sends.append(self.store.run_together("rec_due_put", stmts[i : i + 200]))
        for result in await asyncio.gather(*sends, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result

    async def read_due(
        self, partition: int, slot_ms: int, after_ms: int, upto_ms: int
    ) -> list[tuple[str, str]]:
        """(tenant, schedule_id) of the entries of one minute partition due in
        (``after_ms``, ``upto_ms``], in due order."""
        await self.prepare()
        rows = await self.store.run("rec_due_read", (partition, slot_ms, after_ms, upto_ms))
        return [(str(r["tenant"]), str(r["schedule_id"])) for r in rows]

    async def next_due(self, partition: int, slot_ms: int, after_ms: int) -> int | None:
        """Due time of the first entry of one minute partition due after ``after_ms``, if
        any (the materialiser sleeps until then)."""
        await self.prepare()
        rows = await self.store.run("rec_due_next", (partition, slot_ms, after_ms))
        return int(rows[0]["due_ms"]) if rows else None

    async def drop_due(self, partition: int, slots: Sequence[int]) -> None:
        await self.prepare()
        await asyncio.gather(*(self.store.run("rec_due_drop", (partition, s)) for s in slots))

    async def get_cursor(self, partition: int) -> tuple[int, int] | None:
        """(slot_ms, read_upto_ms) of the partition's reader, None before its first start."""
        await self.prepare()
        rows = await self.store.run("rec_cursor_get", (partition,))
        if not rows or rows[0].get("slot_ms") is None:
            return None
        return int(rows[0]["slot_ms"]), int(rows[0]["read_upto_ms"])

    async def set_cursor(
        self, partition: int, slot_ms: int, read_upto_ms: int, now_ms: int
    ) -> None:
        await self.prepare()
        await self.store.run("rec_cursor_set", (partition, slot_ms, read_upto_ms, now_ms))

    async def get_parents(
        self, partition: int, ids: Sequence[tuple[str, str]]
    ) -> list[ScheduleRow]:
        """The parent rows of ``ids`` that exist and belong to ``partition``, in order."""
        rows = await load_schedule_rows(self.store, ids)
        return [
            row for key in ids if (row := rows.get(key)) is not None and row.partition == partition
        ]

    async def write_runs(self, buckets: Sequence[BucketRow], *, now_ms: int) -> None:
        """Bucket rows of new runs (idempotent overwrites, batched per bucket partition)."""
        await self.store.write_buckets(put=buckets, now_ms=now_ms)

    def _history_stmts(
        self, parent: ScheduleRow, buckets: Sequence[BucketRow], now_ms: int
    ) -> list[Stmt]:
        out: list[Stmt] = []
        for row in buckets:
            nominal = int(row.schedule_id.rpartition("@")[2])
            ttl = max(1, -(-(row.due_ms - now_ms) // 1000) + self.store.retention_s)
            out.append(
                (
                    "rec_put_run",
                    [
                        parent.tenant,
                        parent.schedule_id,
                        nominal,
                        row.schedule_id,
                        row.due_ms,
                        trigger_id(row.tenant, row.schedule_id, row.due_ms),
                        row.version,
                        ttl,
                    ],
                )
            )
        return out

    async def commit(
        self,
        rows: Sequence[tuple[ScheduleRow, str | None]],
        *,
        now_ms: int,
        runs: Sequence[Sequence[BucketRow]] | None = None,
    ) -> None:
        """Write the parents' new state (the commit point of a step) with their runs'
        history rows and an optional event; each parent's statements share its partition
        key (one mutation), and up to ``commit_group_size`` parents go in one request."""
        await self.prepare()
        per_parent: list[list[Stmt]] = []
        for index, (row, event) in enumerate(rows):
            group = [self.store.put_schedule_stmt(row, now_ms)]
            if event is not None:
                group.append(
                    self.store.event_stmt(
                        row.tenant,
                        row.schedule_id,
                        ScheduleEvent.SKIPPED,
                        now_ms,
                        event,
                        None,
                        None,
                    )
                )
            if runs is not None:
                group.extend(self._history_stmts(row, runs[index], now_ms))
            per_parent.append(group)
        sends = [
            self.store.run_together("rec_commit", [s for i in batch for s in per_parent[i]])
            for batch in self.store.pack(per_parent)
        ]
        results = await asyncio.gather(*sends, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def past_runs(
        self, tenant: str, schedule_id: str, before_ms: int, limit: int
    ) -> list[CqlRow]:
        await self.prepare()
        return await self.store.run("rec_runs_before", (tenant, schedule_id, before_ms, limit))


class RecurringRuns(Protocol):
    """What the materialiser calls on its recurring store (``RecurringStore`` is one)."""

    async def keyed_parents(self, partition: int) -> list[ScheduleRow]: ...

    async def put_due(self, entries: Sequence[DueEntry]) -> None: ...

    async def read_due(
        self, partition: int, slot_ms: int, after_ms: int, upto_ms: int
    ) -> list[tuple[str, str]]: ...

    async def next_due(self, partition: int, slot_ms: int, after_ms: int) -> int | None: ...

    async def drop_due(self, partition: int, slots: Sequence[int]) -> None: ...

    async def get_cursor(self, partition: int) -> tuple[int, int] | None: ...

    async def set_cursor(
        self, partition: int, slot_ms: int, read_upto_ms: int, now_ms: int
    ) -> None: ...

    async def get_parents(
        self, partition: int, ids: Sequence[tuple[str, str]]
    ) -> list[ScheduleRow]: ...

    async def write_runs(self, buckets: Sequence[BucketRow], *, now_ms: int) -> None: ...

    async def commit(
        self,
        rows: Sequence[tuple[ScheduleRow, str | None]],
        *,
        now_ms: int,
        runs: Sequence[Sequence[BucketRow]] | None = None,
    ) -> None: ...


# -- the run history ------------------------------------------------------------------------


async def schedule_runs(
    store: MaterializerStore,
    tenant: str,
    schedule_id: str,
    *,
    now_ms: int,
    past: int = 10,
    upcoming: int = 10,
) -> ScheduleRuns | None:
    """Past runs (newest first, with their fire and delivery state) and the next runs of
    a recurring schedule; None if there is no such recurring schedule.

    For the ``tocsin schedule runs`` command and the REST API. Each run: ``run_id`` (the
    schedule id its triggers carry), ``nominal_ms``, ``due_ms`` (nominal + jitter),
    ``trigger_id``, and for past runs ``state`` (scheduled | fired | missed),
    ``fired_ms``, ``delivery`` (delivered | dead_lettered | None).
    """
    raw = await store.get_schedule(tenant, schedule_id)
    if raw is None or raw.get("recurrence") is None:
        return None
    parent = ScheduleRow(**raw)
    assert parent.recurrence is not None
    rec = recurrence_from_json(parent.recurrence)
    rstore = RecurringStore(store)
    history = await rstore.past_runs(tenant, schedule_id, now_ms, past) if past > 0 else []
    states = await store.get_schedules(tenant, [h["run_id"] for h in history]) if history else {}
    past_runs: list[Run] = []
    for h in history:
        st = states.get(h["run_id"]) or {}
        past_runs.append(
            Run(
                run_id=h["run_id"],
                nominal_ms=h["nominal_ms"],
                due_ms=h["due_ms"],
                trigger_id=h["trigger_id"],
                state=st.get("state") or "scheduled",
                fired_ms=st.get("fired_ms"),
                delivery=st.get("delivery_outcome"),
            )
        )
    next_list: list[Run] = []
    if parent.state == ScheduleState.SCHEDULED and upcoming > 0:
        next_list = upcoming_runs(parent, rec, now_ms=now_ms, upcoming=upcoming)
    return ScheduleRuns(
        tenant=tenant,
        schedule_id=schedule_id,
        state=parent.state,
        version=parent.version,
        recurrence=parent.recurrence,
        materialized_until_ms=parent.materialized_until_ms,
        run_count=parent.run_count,
        past=past_runs,
        next=next_list,
    )


__all__ = ["STATEMENTS", "RecurringRuns", "RecurringStore", "schedule_runs"]

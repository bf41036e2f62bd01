"""The one in-memory store the unit tests share.

``FakeStore`` answers every Protocol of ``streams.ports`` (and the recurring store's calls
the materialiser makes) from plain dicts, with the semantics the tests rely on: the first
deployment bound wins, a checkpoint read returns the last one written, a change writes its
bucket rows and schedule row. Its fault knobs stand in for Cassandra's failures:

- ``inject(method, error, times=1, when=None)``: the next ``times`` calls of ``method``
  (``"*"``: any) for which ``when(call)`` holds raise ``error`` (``times=None``: every one);
- ``down = True``: every call raises a retriable StoreError until set back to False;
- ``hold(method, gate, when=None)``: matching calls wait for ``gate`` before answering;
- ``calls``: every call made, in order (``count(method)``, ``calls_of(method)``).

A statement run through ``run`` is answered by ``statements[name](params)`` (default: no
rows), so a module's own CQL is faked by the test that knows what it means.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from base.errors import StoreError
from streams import ports
from streams.buckets import BucketKey
from streams.decisions import DueEntry
from streams.model import (
    BucketRow,
    DeliveryMark,
    Deployment,
    FiredMark,
    ScheduleChange,
    ScheduleRow,
    ScheduleState,
    Stmt,
)
from streams.ports import CqlRow
from streams.recurring_store import RecurringRuns
from topics.models import DeliveryOutcome

StatementHandler = Callable[[Sequence[Any]], list[CqlRow]]


@dataclass(frozen=True)
class Call:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _Fault:
    method: str
    error: BaseException
    times: int | None
    when: Callable[[Call], bool] | None

    def matches(self, call: Call) -> bool:
        return (
            self.method in ("*", call.method)
            and (self.times is None or self.times > 0)
            and (self.when is None or self.when(call))
        )


@dataclass
class _Hold:
    method: str
    gate: asyncio.Event
    when: Callable[[Call], bool] | None


@dataclass(eq=False)
class FakeStore:
    """In-memory store; see the module docstring for its knobs."""

    tenants: dict[str, CqlRow] = field(default_factory=dict)
    schedules: dict[tuple[str, str], ScheduleRow] = field(default_factory=dict)
    bucket_rows: dict[BucketKey, BucketRow] = field(default_factory=dict)
    checkpoint_ms: int | None = None
    deployment: Deployment | None = None
    statements: dict[str, StatementHandler] = field(default_factory=dict)
    retention_s: int = 7 * 24 * 3600
    commit_group_size: int = 1
    # partition -> the materialise key meaning "never" (the recurring store's parents with
    # a key below it are keyed); None: every row with a key is.
    never_key: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        self.calls: list[Call] = []
        self.down = False
        self.failures = 0
        self._faults: list[_Fault] = []
        self._holds: list[_Hold] = []
        self.checkpoints: list[int] = []
        self.fired: list[str] = []
        self.missed: list[str] = []
        self.mark_requests: list[int] = []
        self.delivery_requests: list[int] = []
        self.retention: dict[str, int | None] = {}
        self.deliveries: list[CqlRow] = []
        # A schedule's delivery cells with their write timestamps (µs), as Cassandra keeps
        # them: a write with a lower timestamp than the cell's is lost (``delivery_status``).
        self.delivery_cells: dict[tuple[str, str], dict[str, tuple[int, Any]]] = {}
        self.events: list[CqlRow] = []
        self.api_keys: dict[str, CqlRow] = {}
        self.index: dict[str, set[tuple[int, str]]] = {}
        self.recurring_index: dict[str, dict[str, int]] = {}
        self.prepared: set[str] = set()
        self.statement_runs: list[tuple[str, tuple[Any, ...]]] = []
        # The recurring store's tables (streams.recurring_store.RecurringStore).
        self.due: dict[tuple[int, int], set[tuple[int, str, str]]] = {}
        self.cursor: tuple[int, int] | None = None
        self.commits = 0

    # -- knobs -----------------------------------------------------------------------------

    def inject(
        self,
        method: str,
        error: BaseException,
        *,
        times: int | None = 1,
        when: Callable[[Call], bool] | None = None,
    ) -> None:
        self._faults.append(_Fault(method, error, times, when))

    def hold(
        self, method: str, gate: asyncio.Event, *, when: Callable[[Call], bool] | None = None
    ) -> None:
        self._holds.append(_Hold(method, gate, when))

    def count(self, method: str) -> int:
        return len(self.calls_of(method))

    def calls_of(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    async def _enter(self, method: str, *args: Any, **kwargs: Any) -> None:
        call = Call(method, args, kwargs)
        self.calls.append(call)
        for held in self._holds:
            if held.method in ("*", method) and (held.when is None or held.when(call)):
                await held.gate.wait()
        if self.down:
            self.failures += 1
            raise StoreError(f"cassandra {method} failed: NoHostAvailable", retriable=True)
        for fault in self._faults:
            if fault.matches(call):
                if fault.times is not None:
                    fault.times -= 1
                self.failures += 1
                raise fault.error

    # -- lifecycle and statements ----------------------------------------------------------

    async def connect(self) -> None:
        await self._enter("connect")

    async def close(self) -> None:
        await self._enter("close")

    async def prepare_statements(self, cql: dict[str, str]) -> None:
        await self._enter("prepare_statements", cql)
        self.prepared.update(cql)

    def has_statements(self, names: Iterable[str]) -> bool:
        return all(name in self.prepared for name in names)

    async def run(
        self, name: str, params: Sequence[Any], *, fetch_size: int | None = None
    ) -> list[CqlRow]:
        await self._enter("run", name, params)
        self.statement_runs.append((name, tuple(params)))
        handler = self.statements.get(name)
        return handler(params) if handler is not None else []

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None:
        await self._enter("run_together", name, statements)
        for stmt_name, params in statements:
            handler = self.statements.get(stmt_name)
            self.statement_runs.append((stmt_name, tuple(params)))
            if handler is not None:
                handler(params)

    def pack(self, groups: Sequence[Sequence[Stmt]]) -> list[list[int]]:
        size = max(1, self.commit_group_size)
        return [list(range(i, min(i + size, len(groups)))) for i in range(0, len(groups), size)]

    def put_schedule_stmt(
        self, row: ScheduleRow, now_ms: int, retention_s: int | None = None
    ) -> Stmt:
        return ("put_schedule", [row, now_ms, retention_s])

    def event_stmt(
        self,
        tenant: str,
        schedule_id: str,
        event: str,
        at_ms: int,
        detail: str | None,
        trigger_id: str | None,
        due_ms: int | None,
        retention_s: int | None = None,
    ) -> Stmt:
        return ("record_event", [tenant, schedule_id, at_ms, event, trigger_id, due_ms, detail])

    # -- schedules and buckets -------------------------------------------------------------

    async def get_schedule(self, tenant: str, schedule_id: str) -> CqlRow | None:
        await self._enter("get_schedule", tenant, schedule_id)
        row = self.schedules.get((tenant, schedule_id))
        return asdict(row) if row is not None else None

    async def get_schedules(
        self, tenant: str, schedule_ids: Sequence[str], *, chunk: int = 100
    ) -> dict[str, CqlRow]:
        await self._enter("get_schedules", tenant, schedule_ids)
        rows = (self.schedules.get((tenant, sid)) for sid in schedule_ids)
        return {row.schedule_id: asdict(row) for row in rows if row is not None}

    async def write_buckets(
        self,
        *,
        put: Sequence[BucketRow] = (),
        delete: Sequence[BucketKey] = (),
        now_ms: int,
    ) -> None:
        await self._enter("write_buckets", put=put, delete=delete, now_ms=now_ms)
        self._write_buckets(put, delete)

    def _write_buckets(self, put: Iterable[BucketRow], delete: Iterable[BucketKey]) -> None:
        for key in delete:
            self.bucket_rows.pop(key, None)
        for row in put:
            self.bucket_rows[row.key] = row

    async def read_bucket(
        self,
        partition: int,
        minute_ms: int,
        shards: int,
        *,
        from_due_ms: int | None = None,
        fetch_size: int | None = None,
    ) -> list[BucketRow]:
        await self._enter("read_bucket", partition, minute_ms, shards, from_due_ms=from_due_ms)
        floor = from_due_ms if from_due_ms is not None else minute_ms
        found = [
            r
            for r in self.bucket_rows.values()
            if r.partition == partition and r.minute_ms == minute_ms and r.due_ms >= floor
        ]
        return sorted(found, key=lambda r: (r.due_ms, r.tenant, r.schedule_id))

    async def apply_schedule_changes(
        self,
        changes: Sequence[ScheduleChange],
        *,
        before_commit: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        await self._enter("apply_schedule_changes", changes)
        if before_commit is not None:
            await before_commit()
        for change in changes:
            new = change.new_bucket
            deletes = list(change.run_deletes)
            if change.old_bucket is not None and (new is None or new.key != change.old_bucket):
                deletes.append(change.old_bucket)
            puts = [new] if new is not None else []
            self._write_buckets([*puts, *change.bucket_puts], deletes)
            row = change.row
            if change.write_row:
                self.schedules[(row.tenant, row.schedule_id)] = row
            if change.event is not None:
                self._event(
                    row.tenant,
                    row.schedule_id,
                    change.event,
                    change.now_ms,
                    row.due_ms,
                    detail=change.event_detail,
                )
            for note in change.notes:
                self._event(
                    row.tenant,
                    row.schedule_id,
                    note.event,
                    change.now_ms,
                    note.due_ms,
                    note.trigger_id,
                    note.detail,
                )

    # -- fire bookkeeping ------------------------------------------------------------------

    async def get_checkpoint(self, partition: int) -> int | None:
        await self._enter("get_checkpoint", partition)
        return self.checkpoint_ms

    async def set_checkpoint(
        self, partition: int, fired_before_ms: int, owner: str, *, now_ms: int
    ) -> None:
        await self._enter("set_checkpoint", partition, fired_before_ms, owner, now_ms=now_ms)
        self.checkpoint_ms = fired_before_ms
        self.checkpoints.append(fired_before_ms)

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
        await self._enter("mark_fired", tenant, schedule_id, trigger_id, fired_ms=fired_ms)
        self._mark(ScheduleState.FIRED, tenant, schedule_id, trigger_id, fired_ms, retention_s)
        self.fired.append(schedule_id)
        return True

    async def mark_fired_many(self, marks: Sequence[FiredMark]) -> list[BaseException | None]:
        """Each mark through ``mark_fired``: an injected fault fails its own mark only."""
        await self._enter("mark_fired_many", marks)
        self.mark_requests.append(len(marks))
        out: list[BaseException | None] = []
        for m in marks:
            try:
                await self.mark_fired(
                    m.tenant,
                    m.schedule_id,
                    m.trigger_id,
                    fired_ms=m.fired_ms,
                    due_ms=m.due_ms,
                    retention_s=m.retention_s,
                )
                out.append(None)
            except Exception as exc:
                out.append(exc)
        return out

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
        await self._enter("mark_missed", tenant, schedule_id, trigger_id, missed_ms=missed_ms)
        self._mark(ScheduleState.MISSED, tenant, schedule_id, trigger_id, missed_ms, retention_s)
        self.missed.append(schedule_id)
        return True

    def _mark(
        self,
        state: ScheduleState,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        at_ms: int,
        retention_s: int | None,
    ) -> None:
        self.retention[schedule_id] = retention_s
        row = self.schedules.get((tenant, schedule_id))
        if row is not None:
            fired_ms = at_ms if state == ScheduleState.FIRED else row.fired_ms
            self.schedules[(tenant, schedule_id)] = replace(
                row, state=state, fired_ms=fired_ms, trigger_id=trigger_id, updated_ms=at_ms
            )
        self._event(tenant, schedule_id, state, at_ms, None, trigger_id)

    async def record_delivery(
        self,
        tenant: str,
        schedule_id: str,
        *,
        outcome: str,
        status_code: int | None,
        attempts: int,
        at_ms: int,
        trigger_id: str | None = None,
        due_ms: int | None = None,
        detail: str | None = None,
        retention_s: int | None = None,
        order_us: int | None = None,
    ) -> None:
        await self._enter("record_delivery", tenant, schedule_id, outcome=outcome)
        self._delivered(
            DeliveryMark(
                tenant=tenant,
                schedule_id=schedule_id,
                outcome=DeliveryOutcome(outcome),
                status_code=status_code,
                attempts=attempts,
                at_ms=at_ms,
                trigger_id=trigger_id,
                due_ms=due_ms,
                detail=detail,
                order_us=order_us,
            )
        )

    def _delivered(self, m: DeliveryMark) -> None:
        self.deliveries.append(
            {
                "tenant": m.tenant,
                "schedule_id": m.schedule_id,
                "outcome": m.outcome,
                "status_code": m.status_code,
                "attempts": m.attempts,
                "at_ms": m.at_ms,
            }
        )
        self._event(m.tenant, m.schedule_id, m.outcome, m.at_ms, m.due_ms, m.trigger_id, m.detail)
        # Cassandra's reconciliation, cell by cell: the greater timestamp wins, and at equal
        # timestamps the greater value. No timestamp: the driver's, the time of the write.
        stamp = m.order_us if m.order_us is not None else time.time_ns() // 1000
        cells = self.delivery_cells.setdefault((m.tenant, m.schedule_id), {})
        written = {
            "delivery_outcome": str(m.outcome),
            "delivery_status_code": m.status_code,
            "delivery_attempts": m.attempts,
            "delivery_ms": m.at_ms,
        }
        for name, value in written.items():
            # None: a null written (a tombstone), which wins a tie with a live cell.
            held = cells.get(name)
            if (
                held is None
                or stamp > held[0]
                or (
                    stamp == held[0]
                    and (value is None or (held[1] is not None and value > held[1]))
                )
            ):
                cells[name] = (stamp, value)

    def delivery_status(self, tenant: str, schedule_id: str) -> dict[str, Any]:
        """The schedule's delivery cells as a read of its row gives them."""
        cells = self.delivery_cells.get((tenant, schedule_id), {})
        return {name: value for name, (_, value) in cells.items()}

    async def record_deliveries_many(
        self, marks: Sequence[DeliveryMark]
    ) -> list[BaseException | None]:
        """One request per ``commit_group_size`` outcomes (``delivery_requests`` their
        sizes); a fault injected on ``record_delivery`` fails a whole request."""
        out: list[BaseException | None] = []
        for start in range(0, len(marks), self.commit_group_size):
            group = marks[start : start + self.commit_group_size]
            self.delivery_requests.append(len(group))
            try:
                await self._enter("record_delivery", group[0].tenant, group[0].schedule_id)
            except Exception as exc:
                out += [exc] * len(group)
                continue
            for m in group:
                self._delivered(m)
                out.append(None)
        return out

    async def bind_deployment(
        self, deployment: Deployment, *, owner: str, now_ms: int
    ) -> Deployment:
        """The ``deployment`` row's IF NOT EXISTS: the first bind wins."""
        await self._enter("bind_deployment", deployment, owner=owner, now_ms=now_ms)
        if self.deployment is None:
            self.deployment = deployment
        return self.deployment

    # -- events ----------------------------------------------------------------------------

    def _event(
        self,
        tenant: str,
        schedule_id: str,
        event: str,
        at_ms: int,
        due_ms: int | None = None,
        trigger_id: str | None = None,
        detail: str | None = None,
    ) -> None:
        self.events.append(
            {
                "tenant": tenant,
                "schedule_id": schedule_id,
                "at_ms": at_ms,
                "event": str(event),
                "trigger_id": trigger_id,
                "due_ms": due_ms,
                "detail": detail,
            }
        )

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
    ) -> None:
        await self._enter("record_event", tenant, schedule_id, event, at_ms=at_ms)
        self._event(tenant, schedule_id, event, at_ms, due_ms, trigger_id, detail)

    async def list_events(
        self, tenant: str, schedule_id: str, *, newest: int | None = None
    ) -> list[CqlRow]:
        await self._enter("list_events", tenant, schedule_id)
        mine = [e for e in self.events if (e["tenant"], e["schedule_id"]) == (tenant, schedule_id)]
        ordered = sorted(mine, key=lambda e: (e["at_ms"], e["event"]))
        if newest is None:
            return ordered
        return ordered[max(0, len(ordered) - newest) :] if newest > 0 else []

    # -- tenants and API keys --------------------------------------------------------------

    async def get_tenant(self, tenant: str) -> CqlRow | None:
        await self._enter("get_tenant", tenant)
        row = self.tenants.get(tenant)
        return dict(row) if row is not None else None

    async def list_tenants(self) -> list[CqlRow]:
        await self._enter("list_tenants")
        return [dict(row) for row in self.tenants.values()]

    async def put_tenant(
        self,
        tenant: str,
        *,
        active: bool | None,
        created_ms: int | None,
        config: str | None = None,
        signing_secret: str | None = None,
        updated_ms: int | None = None,
    ) -> None:
        await self._enter("put_tenant", tenant)
        given = {
            "active": active,
            "created_ms": created_ms,
            "config": config,
            "signing_secret": signing_secret,
            "updated_ms": updated_ms,
        }
        row = self.tenants.setdefault(tenant, {"tenant": tenant})
        row.update({k: v for k, v in given.items() if v is not None})

    async def rotate_signing_key(
        self,
        tenant: str,
        *,
        expected_current: str | None,
        new_secret: str,
        previous_expires_ms: int | None,
        retired: str | None,
        now_ms: int,
    ) -> bool:
        await self._enter("rotate_signing_key", tenant)
        row = self.tenants.get(tenant)
        if row is None or row.get("signing_secret") != expected_current:
            return False
        row.update(
            signing_secret=new_secret,
            previous_signing_secret=expected_current,
            previous_signing_expires_ms=previous_expires_ms,
            retired_signing_secret=retired,
            signing_rotated_ms=now_ms,
            updated_ms=now_ms,
        )
        return True

    async def retire_previous_signing_key(self, tenant: str, *, previous: str, at_ms: int) -> bool:
        await self._enter("retire_previous_signing_key", tenant)
        row = self.tenants.get(tenant)
        if row is None or row.get("previous_signing_secret") != previous:
            return False
        row.update(previous_signing_expires_ms=at_ms, updated_ms=at_ms)
        return True

    async def put_api_key(
        self, key_id: str, tenant: str, *, salt: bytes, hash: bytes, created_ms: int
    ) -> None:
        await self._enter("put_api_key", key_id, tenant)
        self.api_keys[key_id] = {
            "key_id": key_id,
            "tenant": tenant,
            "salt": salt,
            "hash": hash,
            "created_ms": created_ms,
            "revoked": False,
        }

    async def get_api_key(self, key_id: str) -> CqlRow | None:
        await self._enter("get_api_key", key_id)
        row = self.api_keys.get(key_id)
        return dict(row) if row is not None else None

    async def revoke_api_key(self, key_id: str) -> None:
        await self._enter("revoke_api_key", key_id)
        if key_id in self.api_keys:
            self.api_keys[key_id]["revoked"] = True

    async def list_api_keys(self, tenant: str) -> list[CqlRow]:
        await self._enter("list_api_keys", tenant)
        return [
            {"key_id": k["key_id"], "created_ms": k["created_ms"]}
            for k in self.api_keys.values()
            if k["tenant"] == tenant
        ]

    # -- listing indexes -------------------------------------------------------------------

    async def write_index(
        self,
        put: Sequence[tuple[str, str, int]],
        delete: Sequence[tuple[str, str, int]],
        *,
        now_ms: int,
        retention_s: int | None = None,
    ) -> None:
        await self._enter("write_index", put, delete, now_ms=now_ms)
        for tenant, sid, due in delete:
            self.index.get(tenant, set()).discard((due, sid))
        for tenant, sid, due in put:
            self.index.setdefault(tenant, set()).add((due, sid))

    async def read_index(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        after: tuple[int, str] | None = None,
        limit: int = 100,
    ) -> list[tuple[int, str]]:
        await self._enter("read_index", tenant, from_ms=from_ms, to_ms=to_ms, after=after)
        rows = sorted(e for e in self.index.get(tenant, set()) if from_ms <= e[0] < to_ms)
        if after is not None:
            rows = [e for e in rows if e > after]
        return rows[:limit]

    async def write_recurring_index(self, entries: Sequence[tuple[str, str, int, bool]]) -> None:
        await self._enter("write_recurring_index", entries)
        for tenant, sid, created_ms, _finished in entries:
            self.recurring_index.setdefault(tenant, {})[sid] = created_ms

    async def list_recurring(self, tenant: str) -> list[str]:
        await self._enter("list_recurring", tenant)
        return sorted(self.recurring_index.get(tenant, {}))

    async def list_recurring_page(self, tenant: str, *, after: str, limit: int) -> list[str]:
        await self._enter("list_recurring_page", tenant, after=after, limit=limit)
        return [i for i in sorted(self.recurring_index.get(tenant, {})) if i > after][:limit]

    # -- the recurring store's calls (what the materialiser asks of it) --------------------

    async def keyed_parents(self, partition: int) -> list[ScheduleRow]:
        await self._enter("keyed_parents", partition)
        never = self.never_key(partition) if self.never_key is not None else None
        return [
            r
            for r in self.schedules.values()
            if r.materialize_key is not None and (never is None or r.materialize_key < never)
        ]

    async def put_due(self, entries: Sequence[DueEntry]) -> None:
        await self._enter("put_due", entries)
        for e in entries:
            self.due.setdefault((e.partition, e.slot_ms), set()).add(
                (e.due_ms, e.tenant, e.schedule_id)
            )

    async def read_due(
        self, partition: int, slot_ms: int, after_ms: int, upto_ms: int
    ) -> list[tuple[str, str]]:
        await self._enter("read_due", partition, slot_ms, after_ms, upto_ms)
        found = sorted(self.due.get((partition, slot_ms), set()))
        return [(t, s) for due, t, s in found if after_ms < due <= upto_ms]

    async def next_due(self, partition: int, slot_ms: int, after_ms: int) -> int | None:
        await self._enter("next_due", partition, slot_ms, after_ms)
        return min(
            (due for due, _, _ in self.due.get((partition, slot_ms), ()) if due > after_ms),
            default=None,
        )

    async def drop_due(self, partition: int, slots: Sequence[int]) -> None:
        await self._enter("drop_due", partition, slots)
        for slot in slots:
            self.due.pop((partition, slot), None)

    async def get_cursor(self, partition: int) -> tuple[int, int] | None:
        await self._enter("get_cursor", partition)
        return self.cursor

    async def set_cursor(
        self, partition: int, slot_ms: int, read_upto_ms: int, now_ms: int
    ) -> None:
        await self._enter("set_cursor", partition, slot_ms, read_upto_ms, now_ms)
        self.cursor = (slot_ms, read_upto_ms)

    async def get_parents(
        self, partition: int, ids: Sequence[tuple[str, str]]
    ) -> list[ScheduleRow]:
        await self._enter("get_parents", partition, ids)
        return [
            row
            for key in ids
            if (row := self.schedules.get(key)) is not None and row.partition == partition
        ]

    async def write_runs(self, buckets: Sequence[BucketRow], *, now_ms: int) -> None:
        await self._enter("write_runs", buckets, now_ms=now_ms)
        self._write_buckets(buckets, ())

    async def commit(
        self,
        rows: Sequence[tuple[ScheduleRow, str | None]],
        *,
        now_ms: int,
        runs: Sequence[Sequence[BucketRow]] | None = None,
    ) -> None:
        await self._enter("commit", rows, now_ms=now_ms)
        for row, _ in rows:
            self.schedules[(row.tenant, row.schedule_id)] = row
            self.commits += 1

    def queued(self) -> set[str]:
        """Schedule ids in the due queue."""
        return {s for entries in self.due.values() for _, _, s in entries}


def _answers_every_port(
    store: FakeStore,
) -> tuple[
    ports.ApiStore,
    ports.BindingStore,
    ports.CommandStore,
    ports.DeliveryStore,
    ports.MaterializerStore,
    ports.StatusStore,
    ports.TenantAdminStore,
    ports.TickerStore,
    RecurringRuns,
]:
    """Never called: ``mypy tests/fakes.py`` proves the fake answers every Protocol."""
    return (store, store, store, store, store, store, store, store, store)


def bucket_row(sid: str, due_ms: int, *, version: int = 1, tolerance_s: int = 60) -> BucketRow:
    """Tenant ``t``'s schedule ``sid`` in partition 0's bucket, due at ``due_ms`` (an HTTP
    callback, a JSON payload)."""
    return BucketRow(
        partition=0,
        minute_ms=due_ms - due_ms % 60_000,
        shard=0,
        due_ms=due_ms,
        tenant="t",
        schedule_id=sid,
        version=version,
        order_key=sid,
        payload=b"{}",
        payload_type="json",
        callback='{"type":"http","url":"https://h/cb"}',
        misfire_tolerance_s=tolerance_s,
    )


async def until_true(done: Callable[[], bool]) -> None:
    """Yield to the event loop (1 ms at a time, 5,000 times at most) until ``done()``."""
    for _ in range(5_000):
        if done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


class FakeMonotonic:
    """A monotonic clock (seconds) that moves only when told to; ``FakeKafkaProducer``'s waits
    move it instead of sleeping."""

    def __init__(self, start_s: float = 1_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class ProducerHung(AssertionError):
    """The code under test kept waiting on ``FakeKafkaProducer`` past ``hang_after_s``: on
    the real producer it would wait for as long as Kafka stays down."""


@dataclass
class _Queued:
    topic: str
    key: bytes | None
    value: bytes
    on_delivery: Callable[[Any, Any], None] | None
    partition: int
    produced_s: float
    reported: bool = False


class _FakeMessage:
    """What a delivery callback is given (``confluent_kafka.Message``'s getters)."""

    def __init__(self, q: _Queued) -> None:
        self._q = q

    def topic(self) -> str:
        return self._q.topic

    def key(self) -> bytes | None:
        return self._q.key

    def value(self) -> bytes:
        return self._q.value

    def partition(self) -> int:
        return self._q.partition

    def error(self) -> None:
        return None


class FakeKafkaProducer:
    """A ``confluent_kafka.Producer`` with librdkafka's local queue and Kafka up or down.

    At most ``queue_max`` records wait in the local queue; ``produce`` raises
    ``BufferError`` when it is full. While ``down`` nothing is acknowledged, and a record
    that has waited ``message_timeout_s`` is reported ``_MSG_TIMED_OUT``; as in librdkafka,
    its room is freed only once its delivery callback returns. ``poll`` and ``flush`` move
    ``clock`` by their timeout instead of sleeping, and once they have waited
    ``hang_after_s`` in all they raise ``ProducerHung``: code that would wait for ever fails
    instead. While up, ``poll`` and ``flush`` acknowledge everything queued, in order.

    Kafka refuses records of ``refuse_at_produce`` topics in ``produce`` (librdkafka's own
    size check) and those of ``refuse_on_ack`` topics in their delivery report (the broker's),
    both as too large. ``written``: (topic, key, value) of every acknowledged record, in the
    order Kafka has them."""

    def __init__(
        self,
        clock: FakeMonotonic | None = None,
        *,
        queue_max: int = 100_000,
        message_timeout_s: float = 30.0,
        hang_after_s: float = 3_600.0,
    ) -> None:
        self.clock = clock or FakeMonotonic()
        self.queue_max = queue_max
        self.message_timeout_s = message_timeout_s
        self.hang_after_s = hang_after_s
        self.down = False
        self.refuse_at_produce: set[str] = set()
        self.refuse_on_ack: set[str] = set()
        self.queue: list[_Queued] = []
        self.written: list[tuple[str, bytes | None, bytes]] = []
        self.waited_s = 0.0

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Any = None,
        on_delivery: Callable[[Any, Any], None] | None = None,
        partition: int = -1,
    ) -> None:
        if topic in self.refuse_at_produce:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        if len(self.queue) >= self.queue_max:
            raise BufferError("Local: Queue full")
        q = _Queued(topic, key, value or b"", on_delivery, max(partition, 0), self.clock())
        self.queue.append(q)

    def __len__(self) -> int:
        return len(self.queue)

    def poll(self, timeout: float = -1) -> int:
        return self._serve(timeout)

    def flush(self, timeout: float = -1) -> int:
        self._serve(timeout)
        return len(self.queue)

    def _serve(self, timeout_s: float) -> int:
        if self.down:
            self._wait(timeout_s)
            now = self.clock()
            due = [
                q
                for q in self.queue
                if not q.reported and now - q.produced_s >= self.message_timeout_s
            ]
        else:
            due = [q for q in self.queue if not q.reported]
        for q in due:
            q.reported = True
            err: KafkaError | None = None
            if self.down:
                err = KafkaError(KafkaError._MSG_TIMED_OUT)
            elif q.topic in self.refuse_on_ack:
                err = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
            else:
                self.written.append((q.topic, q.key, q.value))
            if q.on_delivery is not None:
                q.on_delivery(err, _FakeMessage(q))
            self.queue.remove(q)
        return len(due)

    def _wait(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ProducerHung("waited with no timeout while Kafka is down")
        self.clock.advance(timeout_s)
        self.waited_s += timeout_s
        if self.waited_s > self.hang_after_s:
            raise ProducerHung(f"still waiting on the producer after {self.waited_s:.0f} s")

"""Cassandra I/O edge of the scheduler (schema/cql/): the ``Store`` every worker, the API
and the command line connect, made of one class per concern -

- ``ScheduleStore`` (here): schedule rows, minute buckets, the changes commands make,
  fire checkpoints and the keyspace's deployment binding;
- ``streams.fire_store``: fires, misses and delivery outcomes recorded on schedule rows;
- ``streams.event_store``: a schedule's history;
- ``streams.tenant_store``: tenants, signing keys and API keys;
- ``streams.index_store``: the per-tenant listing indexes;
- ``streams.cql``: the statement executor under all of them (session, prepared
  statements, asyncio bridge, batching, error translation).

This package must never decide scheduling policy (what to fire, when, whether a command is
valid): callers pass every time (``now_ms``) and every value explicitly. It must never use
logged batches: multi-row changes are ordered, idempotent writes (see
``apply_schedule_changes``), batched where the rows share a partition key (a bucket's rows;
a schedule row with its event row) and across partition keys only when the caller opts in
(``commit_group_size``). It must never read a whole table on a hot path.
"""

from __future__ import annotations

import asyncio
import heapq
import operator
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, ClassVar, Unpack

from base.errors import StoreError
from base.settings import CassandraSettings
from streams import ports
from streams.buckets import BucketKey, ttl_s
from streams.cql import (
    ExecutorOptions,
    gather_all,
    insert_cql,
    unset_none,
)
from streams.event_store import EventStore
from streams.fire_store import DELIVERY_COLUMNS, FireRecordStore
from streams.index_store import ListingIndexStore
from streams.model import (
    SCHEDULE_COLUMNS,
    BucketRow,
    Deployment,
    ScheduleChange,
    ScheduleEvent,
    ScheduleRow,
    ScheduleState,
    Stmt,
)
from streams.ports import CqlRow, ScheduleReader
from streams.tenant_store import TenantStore

_BUCKET_COLUMNS = tuple(f.name for f in fields(BucketRow))
# What a write of a whole row writes: every column but the delivery outcome's, which only
# the outcome's own write sets (fire_store.DELIVERY_COLUMNS says why).
_PUT_COLUMNS = tuple(c for c in SCHEDULE_COLUMNS if c not in DELIVERY_COLUMNS)
# A row's values in column order (attrgetter: one C call, not a getattr per column).
_SCHEDULE_VALUES = operator.attrgetter(*_PUT_COLUMNS)
_BUCKET_VALUES = operator.attrgetter(*_BUCKET_COLUMNS)
_BUCKET_WHERE = "partition = ? AND minute_ms = ? AND shard = ?"
_BY_SCHEDULE = "WHERE tenant = ? AND schedule_id = ?"


class ScheduleStore(EventStore):
    """Schedules, their bucket rows, the changes commands make to both, fire checkpoints
    and the deployment binding of the keyspace."""

    CQL: ClassVar[dict[str, str]] = {
        "get_schedule": f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {{keyspace}}.schedules "
        f"{_BY_SCHEDULE}",
        # IN on the last partition-key column: one request for a batch of commands.
        "get_schedules": f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {{keyspace}}.schedules "
        "WHERE tenant = ? AND schedule_id IN ?",
        "put_schedule": insert_cql("schedules", _PUT_COLUMNS, ttl=True),
        "put_bucket": insert_cql("buckets", _BUCKET_COLUMNS, ttl=True),
        "delete_bucket": f"DELETE FROM {{keyspace}}.buckets WHERE {_BUCKET_WHERE} "
        "AND due_ms = ? AND tenant = ? AND schedule_id = ?",
        "read_bucket": f"SELECT {', '.join(_BUCKET_COLUMNS)} FROM {{keyspace}}.buckets "
        f"WHERE {_BUCKET_WHERE}",
        "read_bucket_from": f"SELECT {', '.join(_BUCKET_COLUMNS)} FROM {{keyspace}}.buckets "
        f"WHERE {_BUCKET_WHERE} AND due_ms >= ?",
        "get_checkpoint": "SELECT fired_before_ms FROM {keyspace}.fire_checkpoints "
        "WHERE partition = ?",
        "set_checkpoint": insert_cql(
            "fire_checkpoints", ("partition", "fired_before_ms", "updated_ms", "owner"), ttl=False
        ),
    }

    def __init__(
        self,
        settings: CassandraSettings,
        *,
        bucket_read_hook: Callable[[float, int], None] | None = None,
        **options: Unpack[ExecutorOptions],
    ) -> None:
        super().__init__(settings, **options)
        # Called after every bucket shard read with (seconds, rows) - metrics hang off it.
        self._bucket_read_hook = bucket_read_hook
        # Observability of the "one paged read per (partition, minute, shard)" promise.
        self.bucket_reads = 0
        self.bucket_pages = 0
        self.bucket_rows = 0

    def _pages_read(self, name: str, pages: int) -> None:
        if name.startswith("read_bucket"):
            self.bucket_pages += pages

    # -- schedules -------------------------------------------------------------------------

    async def get_schedule(self, tenant: str, schedule_id: str) -> CqlRow | None:
        """The schedule's row as a dict keyed like ``ScheduleRow``, or None (also for
        delivery cells alone, ``_is_schedule``)."""
        rows = await self.run("get_schedule", (tenant, schedule_id))
        return _own_delivery(rows[0]) if rows and _is_schedule(rows[0]) else None

    async def get_schedules(
        self, tenant: str, schedule_ids: Sequence[str], *, chunk: int = 100
    ) -> dict[str, CqlRow]:
        """Rows of many schedules of one tenant by id, one IN query per ``chunk`` ids (the
        command agent reads a whole batch this way instead of one request per command)."""
        unique = list(dict.fromkeys(schedule_ids))
        parts = await gather_all(
            [
                self.run("get_schedules", (tenant, unique[i : i + chunk]))
                for i in range(0, len(unique), chunk)
            ]
        )
        return {
            row["schedule_id"]: _own_delivery(row)
            for rows in parts
            for row in rows
            if _is_schedule(row)
        }

    def schedule_ttl_s(self, row: ScheduleRow, now_ms: int, retention_s: int | None = None) -> int:
        """A scheduled row lives until due + retention (past due, as a late resume or a
        create within its misfire tolerance leaves it: retention from now, so the row
        outlives its fire); a finished one retention from now; a paused one until it is
        resumed or cancelled (0: no TTL), however long that is.
        ``retention_s``: the tenant's retention (None: the global one)."""
        keep = self.keep_s(retention_s)
        if row.state == ScheduleState.PAUSED:
            return 0
        if row.state == ScheduleState.SCHEDULED:
            return ttl_s(max(row.due_ms, now_ms), now_ms, keep)
        return keep

    async def put_schedule(
        self, row: ScheduleRow, *, now_ms: int, retention_s: int | None = None
    ) -> None:
        """Upsert every non-None column of ``row`` but the delivery outcome's with the TTL
        of ``schedule_ttl_s``."""
        await self.run(*self.put_schedule_stmt(row, now_ms, retention_s))

    def put_schedule_stmt(
        self, row: ScheduleRow, now_ms: int, retention_s: int | None = None
    ) -> Stmt:
        values = unset_none(_SCHEDULE_VALUES(row))
        return ("put_schedule", [*values, self.schedule_ttl_s(row, now_ms, retention_s)])

    def _put_bucket_stmt(self, row: BucketRow, now_ms: int) -> Stmt:
        values = unset_none(_BUCKET_VALUES(row))
        return ("put_bucket", [*values, ttl_s(row.due_ms, now_ms, self.retention_s)])

    # -- buckets ---------------------------------------------------------------------------

    async def put_bucket_row(self, row: BucketRow, *, now_ms: int) -> None:
        """Write a bucket row living until due + retention (catch-up after an outage of up
        to the retention still finds it)."""
        await self.run(*self._put_bucket_stmt(row, now_ms))

    async def delete_bucket_row(self, key: BucketKey) -> None:
        await self.run(*_delete_bucket_stmt(key))

    async def write_buckets(
        self,
        *,
        put: Sequence[BucketRow] = (),
        delete: Sequence[BucketKey] = (),
        now_ms: int,
    ) -> None:
        """Write and delete many bucket rows: one unlogged batch per bucket partition
        (partition, minute, shard), in chunks under ``max_batch_bytes``, all concurrently.
        Never two partitions in one batch: Cassandra measures a batch's mutations its own
        way against batch_size_fail_threshold (50 KiB by default), and refused batches of
        several bucket partitions that the estimate kept under ``max_batch_bytes`` ("Batch
        too large": a recurring schedule's runs stored, its commit never made).

        A minute's rows share one Cassandra partition, so a command batch whose schedules
        fall in a few minutes costs a few requests instead of one per row (measured locally:
        about 8x fewer client CPU seconds per row). The caller must not put and delete the
        same key in one call (equal timestamps: the delete would win)."""
        await self._write_buckets([(row, now_ms) for row in put], delete)

    async def _write_buckets(
        self, put: Sequence[tuple[BucketRow, int]], delete: Sequence[BucketKey]
    ) -> None:
        """``write_buckets`` with each put row's own ``now_ms`` (its TTL is relative to it):
        rows of different times still share their bucket partition's batch."""
        groups: dict[tuple[int, int, int], list[tuple[int, Stmt]]] = {}
        for row, now_ms in put:
            groups.setdefault((row.partition, row.minute_ms, row.shard), []).append(
                (_row_bytes(row), self._put_bucket_stmt(row, now_ms))
            )
        for key in delete:
            groups.setdefault((key.partition, key.minute_ms, key.shard), []).append(
                (len(key.tenant) + len(key.schedule_id) + 64, _delete_bucket_stmt(key))
            )
        sends = []
        for items in groups.values():
            chunk: list[Stmt] = []
            size = 0
            for nbytes, stmt in items:
                if chunk and (size + nbytes > self.max_batch_bytes):
                    sends.append(self.run_together("write_buckets", chunk))
                    chunk, size = [], 0
                chunk.append(stmt)
                size += nbytes
            if chunk:
                sends.append(self.run_together("write_buckets", chunk))
        await gather_all(sends)

    async def read_bucket(
        self,
        partition: int,
        minute_ms: int,
        shards: int,
        *,
        from_due_ms: int | None = None,
        fetch_size: int | None = None,
    ) -> list[BucketRow]:
        """Every row of bucket (partition, minute) ordered by (due_ms, tenant, schedule_id):
        ONE paged query per shard, run concurrently and merged. ``from_due_ms`` skips rows
        due earlier (catch-up resuming inside the checkpoint's minute)."""
        if shards < 1:
            raise StoreError(f"shards must be >= 1, got {shards}", retriable=False)
        per_shard = await asyncio.gather(
            *(
                self._read_shard(partition, minute_ms, shard, from_due_ms, fetch_size)
                for shard in range(shards)
            )
        )
        if len(per_shard) == 1:
            return per_shard[0]
        # Each shard is already in clustering order; a k-way merge keeps the total order.
        return list(heapq.merge(*per_shard, key=lambda r: (r.due_ms, r.tenant, r.schedule_id)))

    async def _read_shard(
        self,
        partition: int,
        minute_ms: int,
        shard: int,
        from_due_ms: int | None,
        fetch_size: int | None,
    ) -> list[BucketRow]:
        started = time.perf_counter()
        self.bucket_reads += 1
        if from_due_ms is None:
            rows = await self.run(
                "read_bucket", (partition, minute_ms, shard), fetch_size=fetch_size
            )
        else:
            rows = await self.run(
                "read_bucket_from",
                (partition, minute_ms, shard, from_due_ms),
                fetch_size=fetch_size,
            )
        self.bucket_rows += len(rows)
        if self._bucket_read_hook is not None:
            self._bucket_read_hook(time.perf_counter() - started, len(rows))
        return [BucketRow(**r) for r in rows]

    async def apply_schedule_change(
        self,
        row: ScheduleRow,
        *,
        new_bucket: BucketRow | None,
        old_bucket: BucketKey | None,
        now_ms: int,
        event: ScheduleEvent | None = None,
        event_detail: str | None = None,
    ) -> None:
        """Persist one create/reschedule/cancel; see ``apply_schedule_changes``."""
        await self.apply_schedule_changes(
            [
                ScheduleChange(
                    row=row,
                    new_bucket=new_bucket,
                    old_bucket=old_bucket,
                    now_ms=now_ms,
                    event=event,
                    event_detail=event_detail,
                )
            ]
        )

    async def apply_schedule_changes(
        self,
        changes: Sequence[ScheduleChange],
        *,
        before_commit: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Persist creates (new_bucket), reschedules (new_bucket + old_bucket) and cancels
        (old_bucket); each ``change.row`` holds the schedule's new full state.

        ``before_commit``: another write that must be durable before any schedule row is
        (the command agent's listing index); it runs concurrently with step 1, so it costs
        no round trip of its own.

        Order, chosen so any crash leaves a state that replaying the commands repairs:
          1. bucket rows: write the new ones and delete the old ones (an old key equal to
             the new key is an in-place upsert, not deleted), batched per bucket partition;
          2. then the schedule row together with its event, one unlogged batch per schedule
             (the two tables share the partition key, so it is one mutation: both or
             neither). This is the commit point: the row carries the new version and
             applied_offset, which is how a replayed command recognises itself.
        A crash before 2 leaves the schedule row at the old version, so the command agent
        (whose Kafka offset is committed only after this returns) re-applies the command in
        full: the old due time is still known, the old bucket row is deleted (again) and the
        new one written (again) - every step is an idempotent overwrite. A crash after 2 has
        nothing left to do. Deleting the old bucket row *after* the schedule row (the other
        order) would leave a stale row that fires at the old due time if the process died
        in between, because the replay would no longer know the old due time. Without a
        crash, the window between 1 and 2 (new bucket row written, schedule row not yet) is
        harmless: a fire in it follows the new bucket row, i.e. what the command asked for.
        No logged batch: rows of different schedules and buckets live in different
        partitions, and a batchlog write on every command would buy nothing the replay does
        not already give. Pass each change a deterministic ``now_ms`` (the Kafka record
        timestamp) so a replayed event row overwrites itself instead of duplicating.

        Several changes of the same schedule are applied one after the other, in order.
        """
        # Split into waves where each schedule appears at most once, so two changes of one
        # schedule never race inside one concurrent step.
        waves: list[list[ScheduleChange]] = []
        seen: dict[tuple[str, str], int] = {}
        for change in changes:
            key = (change.row.tenant, change.row.schedule_id)
            index = seen.get(key, 0)
            seen[key] = index + 1
            if index == len(waves):
                waves.append([])
            waves[index].append(change)
        for i, wave in enumerate(waves):
            await self._apply_wave(wave, before_commit if i == 0 else None)

    async def _apply_wave(
        self,
        wave: Sequence[ScheduleChange],
        before_commit: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        puts: list[tuple[BucketRow, int]] = []
        deletes: list[BucketKey] = []
        for change in wave:
            if change.new_bucket is not None:
                puts.append((change.new_bucket, change.now_ms))
            puts.extend((run, change.now_ms) for run in change.bucket_puts)
            old = change.old_bucket
            deletes.extend(change.run_deletes)
            if old is not None and (change.new_bucket is None or change.new_bucket.key != old):
                deletes.append(old)
        # One batch per bucket partition for the whole wave, whatever each row's now_ms:
        # grouping by now_ms would cost about one request per row, since commands arriving
        # one by one through the API carry as many record timestamps as rows. Each row
        # keeps its own TTL.
        steps: list[Awaitable[object]] = [self._write_buckets(puts, deletes)]
        if before_commit is not None:
            steps.append(before_commit())
        await gather_all(steps)
        commits = []
        for change in wave:
            row = change.row
            stmts = []
            if change.write_row:
                stmts.append(self.put_schedule_stmt(row, change.now_ms, change.retention_s))
            if change.event is not None:
                stmts.append(
                    self.event_stmt(
                        row.tenant,
                        row.schedule_id,
                        change.event,
                        change.now_ms,
                        change.event_detail,
                        None,
                        row.due_ms,
                        change.retention_s,
                    )
                )
            stmts.extend(
                self.event_stmt(
                    row.tenant,
                    row.schedule_id,
                    note.event,
                    change.now_ms,
                    note.detail,
                    note.trigger_id,
                    note.due_ms,
                    change.retention_s,
                )
                for note in change.notes
            )
            stmts.extend(change.commit_with)
            if stmts:
                commits.append(stmts)
        await gather_all(
            [
                self.run_together("put_schedule", [s for i in batch for s in commits[i]])
                for batch in self.pack(commits)
            ]
        )

    # -- fire checkpoints and the deployment binding ---------------------------------------

    async def get_checkpoint(self, partition: int) -> int | None:
        """``fired_before_ms`` of the partition, or None if it never fired."""
        rows = await self.run("get_checkpoint", (partition,))
        if not rows:
            return None
        value = rows[0]["fired_before_ms"]
        return int(value) if value is not None else None

    async def set_checkpoint(
        self, partition: int, fired_before_ms: int, owner: str, *, now_ms: int
    ) -> None:
        """Plain upsert (no LWT). During a rebalance two owners may write: the last write
        wins, which can move the checkpoint back (re-fires, deduplicated by the stable
        trigger id) but never past triggers that somebody's Kafka producer did not ack,
        since each owner only writes what its own acks cover."""
        await self.run("set_checkpoint", (partition, fired_before_ms, now_ms, owner))

    async def bind_deployment(
        self, deployment: Deployment, *, owner: str, now_ms: int
    ) -> Deployment:
        """Bind the keyspace to ``deployment`` unless it is bound already; the deployment
        it is bound to now (streams.binding decides what a mismatch means). Prepared here,
        not in ``connect``: only workers and ``tocsin setup`` need the 004 table."""
        if not self.has_statements(["bind_deployment"]):
            await self.prepare_statements(
                {
                    # IF NOT EXISTS: of workers starting together, exactly one binds. (A
                    # driver retry of our own applied insert reads back our own row.)
                    "bind_deployment": "INSERT INTO {keyspace}.deployment (name, "
                    "topic_prefix, command_partitions, bucket_ms, bound_ms, bound_by) "
                    "VALUES ('scheduler', ?, ?, ?, ?, ?) IF NOT EXISTS",
                }
            )
        rows = await self.run(
            "bind_deployment",
            (
                deployment.topic_prefix,
                deployment.command_partitions,
                deployment.bucket_ms,
                now_ms,
                owner,
            ),
        )
        row = rows[0] if rows else {}
        if row.get("[applied]"):
            return deployment
        # Not applied: the LWT answers with the row that is there.
        return Deployment.from_row(row)


class Store(ScheduleStore, FireRecordStore, TenantStore, ListingIndexStore):
    """Async access to every table of the scheduler. ``await connect()`` before use,
    ``await close()`` after; one instance per process (the driver pools connections)."""


def _is_schedule(row: CqlRow) -> bool:
    """Whether ``row`` is a schedule, not its delivery cells outliving the rest: they live a
    retention from the outcome (fire_store.record_delivery), the other cells a retention
    from the row's last write, and an outcome after retries lands later. Every write of a
    schedule sets its state."""
    return row.get("state") is not None


# How much earlier than a schedule's create its delivery outcome may be dated and still be
# its own: the proxies' clocks differ from the brokers' (the create's time) by NTP's skew;
# an expired predecessor's outcome left under the id is older than that.
_PREDECESSOR_MARGIN_MS = 60_000


def _own_delivery(row: CqlRow) -> CqlRow:
    """``row`` without delivery cells left by an expired schedule of the same id (they
    outlive its row, ``_is_schedule``, and a create writes no delivery columns): those
    dated before the row's create."""
    at = row.get("delivery_ms")
    created = row.get("created_ms")
    if at is None or created is None or at >= created - _PREDECESSOR_MARGIN_MS:
        return row
    return {**row, **dict.fromkeys(DELIVERY_COLUMNS)}


def _delete_bucket_stmt(key: BucketKey) -> Stmt:
    return (
        "delete_bucket",
        [key.partition, key.minute_ms, key.shard, key.due_ms, key.tenant, key.schedule_id],
    )


async def load_schedule_rows(
    store: ScheduleReader, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], ScheduleRow]:
    """The stored rows of (tenant, schedule_id) ``keys``, one ``get_schedules`` (IN
    queries) per tenant, concurrently; keys without a row are left out."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, schedule_id in keys:
        by_tenant.setdefault(tenant, []).append(schedule_id)
    found = await asyncio.gather(
        *(store.get_schedules(tenant, ids) for tenant, ids in by_tenant.items())
    )
    return {
        (tenant, sid): ScheduleRow(**row)
        for tenant, rows in zip(by_tenant, found, strict=True)
        for sid, row in rows.items()
    }


def _row_bytes(row: BucketRow) -> int:
    """A generous estimate of a bucket row's size in a batch (for chunking)."""
    return (
        len(row.payload or b"")
        + len(row.callback or "")
        + len(row.order_key or "")
        + len(row.tenant)
        + len(row.schedule_id)
        + 96
    )


if TYPE_CHECKING:
    # mypy proves here that the Store answers every consumer's Protocol.
    def _answers_every_port(
        store: Store,
    ) -> tuple[
        ports.ApiStore,
        ports.BindingStore,
        ports.CommandStore,
        ports.DeliveryStore,
        ports.MaterializerStore,
        ports.StatusStore,
        ports.TenantAdminStore,
        ports.TickerStore,
    ]:
        return (store, store, store, store, store, store, store, store)

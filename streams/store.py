"""Cassandra I/O edge of the scheduler: schedules, minute buckets, fire checkpoints, schedule
events and tenants (schema/cql/001_initial.cql).

Everything here is a thin async wrapper over cassandra-driver: statements are prepared once
in ``connect``, ``execute_async`` futures are bridged into asyncio with
``loop.call_soon_threadsafe`` (the driver completes them on its own I/O thread), a semaphore
caps requests in flight, and every driver error leaves as ``base.errors.StoreError`` with
``retriable`` set for timeouts, unavailability and lost connections.

This module must never decide scheduling policy (what to fire, when, whether a command is
valid): callers pass every time (``now_ms``) and every value explicitly. It must never use
logged batches: multi-row changes are ordered, idempotent writes (see
``apply_schedule_changes``), batched where the rows share a partition key (a bucket's rows;
a schedule row with its event row) and across partition keys only when the caller opts in
(``commit_group_size``). It must never read a whole table on a hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from cassandra import (
    ConsistencyLevel,
    OperationTimedOut,
    RequestExecutionException,
    RequestValidationException,
)
from cassandra import protocol as cql_protocol
from cassandra.cluster import Cluster, NoHostAvailable
from cassandra.connection import ConnectionException
from cassandra.query import (
    UNSET_VALUE,
    BatchStatement,
    BatchType,
    PreparedStatement,
    dict_factory,
)
from prometheus_client import Counter

from base.cassandra import make_cluster
from base.errors import StoreError
from base.settings import CassandraSettings
from streams import ports
from streams.buckets import BucketKey, ttl_s
from streams.model import (
    DEFAULT_RETENTION_S,
    SCHEDULE_COLUMNS,
    BucketRow,
    Deployment,
    FiredMark,
    ScheduleChange,
    ScheduleRow,
    ScheduleState,
    Stmt,
)
from streams.ports import ScheduleReader

DEFAULT_FETCH_SIZE = 5000
DEFAULT_MAX_IN_FLIGHT = 256
# Under Cassandra's default batch_size_fail_threshold (50 KiB). Batches above the warn
# threshold (5 KiB) make the server log a warning; raise it in cassandra.yaml, the batches
# are single-partition by construction.
DEFAULT_MAX_BATCH_BYTES = 40_000

_KEYSPACE_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")

# Errors that say "the cluster could not do it right now", not "the request is wrong".
_RETRIABLE: tuple[type[BaseException], ...] = (
    OperationTimedOut,
    NoHostAvailable,
    ConnectionException,
    RequestExecutionException,  # Unavailable, Read/WriteTimeout, Read/WriteFailure
    cql_protocol.OverloadedErrorMessage,
    cql_protocol.IsBootstrappingErrorMessage,
)


_BUCKET_COLUMNS = tuple(f.name for f in fields(BucketRow))
_EVENT_COLUMNS = ("tenant", "schedule_id", "at_ms", "event", "trigger_id", "due_ms", "detail")
_TENANT_COLUMNS = (
    "tenant",
    "active",
    "created_ms",
    "config",
    "signing_secret",
    "updated_ms",
    # 004: signing-key rotation (topics.signing.SigningKeys)
    "previous_signing_secret",
    "previous_signing_expires_ms",
    "retired_signing_secret",
    "signing_rotated_ms",
)
_API_KEY_COLUMNS = ("key_id", "tenant", "salt", "hash", "created_ms", "revoked")
_DAY_MS = 86_400_000
# Lightweight transactions: never retried blindly by the driver.
_CONDITIONAL = frozenset({"mark_done_if", "rotate_signing_key", "retire_previous_key"})

# Requests and statements sent, by operation: the client CPU of this process scales with
# them (see BENCHMARKS.md), so they are the first thing to look at when a worker is busy.
STORE_REQUESTS = Counter("tocsin_store_requests_total", "Cassandra requests sent", ["op"])
STORE_STATEMENTS = Counter(
    "tocsin_store_statements_total", "Cassandra statements sent (batch members count)", ["op"]
)


def _unset_none(values: Sequence[Any]) -> list[Any]:
    # UNSET leaves the cell as it is and writes no tombstone; binding None would write one
    # tombstone per empty column on every create.
    return [UNSET_VALUE if v is None else v for v in values]


def translate_error(exc: BaseException, what: str) -> StoreError:
    """The StoreError for a driver exception (``retriable`` for transient failures)."""
    retriable = isinstance(exc, _RETRIABLE)
    if isinstance(exc, RequestValidationException):
        retriable = False  # InvalidRequest, Unauthorized, ConfigurationException...
    return StoreError(f"cassandra {what} failed: {type(exc).__name__}: {exc}", retriable=retriable)


class Store:
    """Async access to the scheduler's tables. ``await connect()`` before use,
    ``await close()`` after; one instance per process (the driver pools connections)."""

    def __init__(
        self,
        settings: CassandraSettings,
        *,
        retention_s: int = DEFAULT_RETENTION_S,
        fetch_size: int = DEFAULT_FETCH_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        commit_group_size: int = 1,
        protocol_version: int | None = None,  # None: settings.protocol_version
        bucket_read_hook: Callable[[float, int], None] | None = None,
    ) -> None:
        if not _KEYSPACE_RE.match(settings.keyspace):
            # The keyspace is spliced into CQL text, so it must be a plain identifier.
            raise StoreError(f"invalid keyspace name {settings.keyspace!r}", retriable=False)
        if fetch_size < 1 or max_in_flight < 1:
            raise StoreError("fetch_size and max_in_flight must be >= 1", retriable=False)
        self.settings = settings
        self.retention_s = retention_s
        self.fetch_size = fetch_size
        self.max_batch_bytes = max_batch_bytes
        # Schedules committed per request by apply_schedule_changes. 1 (default): one
        # single-partition batch per schedule. >1: an UNLOGGED batch spanning that many
        # schedule partitions - each schedule's row+event stay atomic (one mutation), the
        # group is not. Saves client CPU, which is the bottleneck on a small box (measured
        # on the 2-core dev machine: 1 -> ~1,000 commands/s, 10 -> ~2,400/s), at the price
        # of coordinator fan-out on a large cluster. Keep it <= 10 (Cassandra's
        # unlogged_batch_across_partitions_warn_threshold).
        if commit_group_size < 1:
            raise StoreError("commit_group_size must be >= 1", retriable=False)
        self.commit_group_size = commit_group_size
        self._max_in_flight = max_in_flight
        self._protocol_version = protocol_version
        # Called after every bucket shard read with (seconds, rows) - metrics hang off it.
        self._bucket_read_hook = bucket_read_hook
        self._cluster: Cluster | None = None
        self._session: Any = None
        self._stmts: dict[str, PreparedStatement] = {}
        # Created lazily inside the running loop (a Semaphore binds to the loop it runs on).
        self._semaphore: asyncio.Semaphore | None = None
        # Observability of the "one paged read per (partition, minute, shard)" promise.
        self.bucket_reads = 0
        self.bucket_pages = 0
        self.bucket_rows = 0

    # -- lifecycle -------------------------------------------------------------------------

    def _build_cluster(self) -> Cluster:
        cluster: Cluster = make_cluster(
            self.settings,
            protocol_version=self._protocol_version,
            profile={
                "consistency_level": ConsistencyLevel.LOCAL_QUORUM,
                "serial_consistency_level": ConsistencyLevel.LOCAL_SERIAL,
                "row_factory": dict_factory,
            },
            connect_timeout=self.settings.request_timeout_s,
        )
        return cluster

    async def connect(self) -> None:
        """Connect and prepare every statement (blocking driver calls run in a thread)."""
        if self._session is not None:
            return
        self._semaphore = asyncio.Semaphore(self._max_in_flight)
        cluster = self._build_cluster()
        try:
            self._session = await asyncio.to_thread(cluster.connect)
            self._cluster = cluster
            self._stmts = await asyncio.to_thread(self._prepare_all)
        except Exception as exc:
            await asyncio.to_thread(cluster.shutdown)
            self._session = None
            self._cluster = None
            raise translate_error(exc, "connect") from exc

    async def close(self) -> None:
        cluster, self._cluster, self._session = self._cluster, None, None
        if cluster is not None:
            await asyncio.to_thread(cluster.shutdown)

    def _prepare_all(self) -> dict[str, PreparedStatement]:
        ks = self.settings.keyspace

        def insert(table: str, columns: Sequence[str], ttl: bool) -> str:
            using = " USING TTL ?" if ttl else ""
            return (
                f"INSERT INTO {ks}.{table} ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' for _ in columns)}){using}"
            )

        bucket_cols = ", ".join(_BUCKET_COLUMNS)
        bucket_where = "partition = ? AND minute_ms = ? AND shard = ?"
        by_schedule = "WHERE tenant = ? AND schedule_id = ?"
        cql = {
            "get_schedule": f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {ks}.schedules "
            f"{by_schedule}",
            # IN on the last partition-key column: one request for a batch of commands.
            "get_schedules": f"SELECT {', '.join(SCHEDULE_COLUMNS)} FROM {ks}.schedules "
            "WHERE tenant = ? AND schedule_id IN ?",
            "put_schedule": insert("schedules", SCHEDULE_COLUMNS, ttl=True),
            "put_bucket": insert("buckets", _BUCKET_COLUMNS, ttl=True),
            "delete_bucket": f"DELETE FROM {ks}.buckets WHERE {bucket_where} "
            "AND due_ms = ? AND tenant = ? AND schedule_id = ?",
            "read_bucket": f"SELECT {bucket_cols} FROM {ks}.buckets WHERE {bucket_where}",
            "read_bucket_from": f"SELECT {bucket_cols} FROM {ks}.buckets WHERE {bucket_where} "
            "AND due_ms >= ?",
            "get_checkpoint": f"SELECT fired_before_ms FROM {ks}.fire_checkpoints "
            "WHERE partition = ?",
            "set_checkpoint": insert(
                "fire_checkpoints", ("partition", "fired_before_ms", "updated_ms", "owner"), False
            ),
            "mark_done": f"UPDATE {ks}.schedules USING TTL ? SET state = ?, fired_ms = ?, "
            f"trigger_id = ?, updated_ms = ? {by_schedule}",
            "mark_done_if": f"UPDATE {ks}.schedules USING TTL ? SET state = ?, fired_ms = ?, "
            f"trigger_id = ?, updated_ms = ? {by_schedule} IF version = ?",
            "record_delivery": f"UPDATE {ks}.schedules USING TTL ? SET delivery_outcome = ?, "
            "delivery_status_code = ?, delivery_attempts = ?, delivery_ms = ? "
            f"{by_schedule}",
            "record_event": insert("schedule_events", _EVENT_COLUMNS, ttl=True),
            "list_events": f"SELECT {', '.join(_EVENT_COLUMNS)} FROM {ks}.schedule_events "
            f"{by_schedule}",
            "put_tenant": insert("tenants", _TENANT_COLUMNS, ttl=False),
            "get_tenant": f"SELECT {', '.join(_TENANT_COLUMNS)} FROM {ks}.tenants WHERE tenant = ?",
            "list_tenants": f"SELECT {', '.join(_TENANT_COLUMNS)} FROM {ks}.tenants",
            # Conditional on the key being rotated, so two concurrent rotations cannot both
            # win (one key would be lost without ever being retired).
            "rotate_signing_key": f"UPDATE {ks}.tenants SET signing_secret = ?, "
            "previous_signing_secret = ?, previous_signing_expires_ms = ?, "
            "retired_signing_secret = ?, signing_rotated_ms = ?, updated_ms = ? "
            "WHERE tenant = ? IF signing_secret = ?",
            "retire_previous_key": f"UPDATE {ks}.tenants SET previous_signing_expires_ms = ?, "
            "updated_ms = ? WHERE tenant = ? IF previous_signing_secret = ?",
            # 002: API keys and the per-tenant listing index (issue 5).
            "put_api_key": insert("api_keys", _API_KEY_COLUMNS, ttl=False),
            "get_api_key": f"SELECT {', '.join(_API_KEY_COLUMNS)} FROM {ks}.api_keys "
            "WHERE key_id = ?",
            "revoke_api_key": f"UPDATE {ks}.api_keys SET revoked = true WHERE key_id = ?",
            "put_tenant_key": insert(
                "api_keys_by_tenant", ("tenant", "key_id", "created_ms"), ttl=False
            ),
            "list_tenant_keys": f"SELECT key_id, created_ms FROM {ks}.api_keys_by_tenant "
            "WHERE tenant = ?",
            "put_index": insert(
                "schedules_by_tenant_day", ("tenant", "day", "due_ms", "schedule_id"), ttl=True
            ),
            "delete_index": f"DELETE FROM {ks}.schedules_by_tenant_day WHERE tenant = ? "
            "AND day = ? AND due_ms = ? AND schedule_id = ?",
            "read_index": f"SELECT due_ms, schedule_id FROM {ks}.schedules_by_tenant_day "
            "WHERE tenant = ? AND day = ? AND due_ms >= ? AND due_ms < ? LIMIT ?",
            "read_index_after": f"SELECT due_ms, schedule_id FROM "
            f"{ks}.schedules_by_tenant_day WHERE tenant = ? AND day = ? "
            "AND (due_ms, schedule_id) > (?, ?) AND due_ms < ? LIMIT ?",
            # 004: the tenant's recurring schedules (listing, go-scheduler crons).
            "put_recurring": insert(
                "recurring_by_tenant", ("tenant", "schedule_id", "created_ms"), ttl=True
            ),
            "list_recurring": f"SELECT schedule_id FROM {ks}.recurring_by_tenant WHERE tenant = ?",
        }
        prepared: dict[str, PreparedStatement] = {}
        for name, text in cql.items():
            stmt = self._session.prepare(text)
            # Every statement here writes fixed values under a full key, so replaying it is
            # harmless and the driver may retry it on timeouts - except the conditional one.
            stmt.is_idempotent = name not in _CONDITIONAL
            prepared[name] = stmt
        return prepared

    async def prepare_statements(self, cql: dict[str, str]) -> None:
        """Prepare more named statements (other modules' tables, e.g. streams.materializer);
        ``{keyspace}`` in the text is replaced. All must be idempotent writes or reads."""
        if self._session is None:
            raise StoreError("store is not connected", retriable=False)
        ks = self.settings.keyspace

        def prepare() -> dict[str, PreparedStatement]:
            out = {}
            for name, text in cql.items():
                stmt = self._session.prepare(text.replace("{keyspace}", ks))
                stmt.is_idempotent = True
                out[name] = stmt
            return out

        try:
            self._stmts.update(await asyncio.to_thread(prepare))
        except Exception as exc:
            raise translate_error(exc, "prepare") from exc

    # -- asyncio bridge --------------------------------------------------------------------

    def _bind(self, name: str, params: Sequence[Any]) -> Any:
        if self._session is None:
            raise StoreError("store is not connected", retriable=False)
        return self._stmts[name].bind(list(params))

    def has_statements(self, names: Iterable[str]) -> bool:
        """Whether every statement of ``names`` is prepared on this session already."""
        return all(name in self._stmts for name in names)

    async def run(
        self, name: str, params: Sequence[Any], *, fetch_size: int | None = None
    ) -> list[dict[str, Any]]:
        """Execute one prepared statement; all its rows (every page of the one query)."""
        bound = self._bind(name, params)
        bound.fetch_size = fetch_size or self.fetch_size
        return await self._execute(bound, name)

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None:
        """Send statements as ONE unlogged batch - only ever for statements whose rows share
        a partition key (one mutation per replica: atomic there, no batchlog, no
        coordinator fan-out). A single statement goes alone."""
        if len(statements) == 1:
            await self.run(*statements[0])
            return
        batch = BatchStatement(batch_type=BatchType.UNLOGGED)
        for stmt_name, params in statements:
            batch.add(self._bind(stmt_name, params))
        batch.is_idempotent = True  # every member is (see _prepare_all)
        await self._execute(batch, name)

    async def _execute(self, statement: Any, name: str) -> list[dict[str, Any]]:
        """Execute and return all rows, following every page of the one query (the driver
        fetches page n+1 only when asked, from its callback on its own thread)."""
        session = self._session
        if session is None or self._semaphore is None:
            raise StoreError("store is not connected", retriable=False)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
        rows: list[dict[str, Any]] = []
        pages = 0  # touched on the driver thread only, read in settle after the last page

        def settle(result: list[dict[str, Any]] | None, error: BaseException | None) -> None:
            # Runs on the event loop thread, so counters need no lock.
            if name.startswith("read_bucket"):
                self.bucket_pages += pages
            if done.done():  # the awaiting task was cancelled
                return
            if error is not None:
                translated = translate_error(error, name)
                translated.__cause__ = error
                done.set_exception(translated)
            else:
                done.set_result(result or [])

        def post(result: list[dict[str, Any]] | None, error: BaseException | None) -> None:
            # Runs on the driver's I/O thread: hand over to the event loop thread.
            # RuntimeError: the loop closed during shutdown; nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, error)

        STORE_REQUESTS.labels(name).inc()
        STORE_STATEMENTS.labels(name).inc(
            len(statement) if isinstance(statement, BatchStatement) else 1
        )
        async with self._semaphore:
            try:
                future = session.execute_async(statement)
            except Exception as exc:  # the driver raises synchronously when shut down
                raise translate_error(exc, name) from exc

            def on_page(page: list[dict[str, Any]] | None) -> None:
                # Writes complete with page None; reads once per page.
                nonlocal pages
                pages += 1
                try:
                    if page:
                        rows.extend(page)
                    if future.has_more_pages:
                        future.start_fetching_next_page()
                    else:
                        post(rows, None)
                except Exception as exc:  # never let an error die on the driver thread
                    post(None, exc)

            def on_error(exc: BaseException) -> None:
                post(None, exc)

            future.add_callbacks(callback=on_page, errback=on_error)
            return await done

    # Private aliases: streams.materializer and api.recurring_io still call these names.
    _run = run
    _run_together = run_together

    # -- schedules -------------------------------------------------------------------------

    async def get_schedule(self, tenant: str, schedule_id: str) -> dict[str, Any] | None:
        """The schedule's row as a dict keyed like ``ScheduleRow``, or None."""
        rows = await self.run("get_schedule", (tenant, schedule_id))
        return rows[0] if rows else None

    async def get_schedules(
        self, tenant: str, schedule_ids: Sequence[str], *, chunk: int = 100
    ) -> dict[str, dict[str, Any]]:
        """Rows of many schedules of one tenant by id, one IN query per ``chunk`` ids (the
        command agent reads a whole batch this way instead of one request per command)."""
        unique = list(dict.fromkeys(schedule_ids))
        parts = await _gather_all(
            [
                self.run("get_schedules", (tenant, unique[i : i + chunk]))
                for i in range(0, len(unique), chunk)
            ]
        )
        return {row["schedule_id"]: row for rows in parts for row in rows}

    def keep_s(self, retention_s: int | None) -> int:
        """A tenant's retention (seconds) or, for None, the global one."""
        return max(1, self.retention_s if retention_s is None else retention_s)

    def schedule_ttl_s(self, row: ScheduleRow, now_ms: int, retention_s: int | None = None) -> int:
        """A scheduled row lives until due + retention; a finished one retention from now.
        ``retention_s``: the tenant's retention (None: the global one)."""
        keep = self.keep_s(retention_s)
        if row.state == ScheduleState.SCHEDULED:
            return ttl_s(row.due_ms, now_ms, keep)
        return keep

    async def put_schedule(
        self, row: ScheduleRow, *, now_ms: int, retention_s: int | None = None
    ) -> None:
        """Upsert every non-None column of ``row`` with the TTL of ``schedule_ttl_s``."""
        await self.run(*self.put_schedule_stmt(row, now_ms, retention_s))

    def put_schedule_stmt(
        self, row: ScheduleRow, now_ms: int, retention_s: int | None = None
    ) -> Stmt:
        values = _unset_none([getattr(row, c) for c in SCHEDULE_COLUMNS])
        return ("put_schedule", [*values, self.schedule_ttl_s(row, now_ms, retention_s)])

    def _put_bucket_stmt(self, row: BucketRow, now_ms: int) -> Stmt:
        values = _unset_none([getattr(row, c) for c in _BUCKET_COLUMNS])
        return ("put_bucket", [*values, ttl_s(row.due_ms, now_ms, self.retention_s)])

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
        values = _unset_none([tenant, schedule_id, at_ms, event, trigger_id, due_ms, detail])
        return ("record_event", [*values, self.keep_s(retention_s)])

    _event_stmt = event_stmt
    _put_schedule_stmt = put_schedule_stmt

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
        (partition, minute, shard), in chunks under ``max_batch_bytes`` (Cassandra rejects
        batches above batch_size_fail_threshold, 50 KiB by default), all concurrently.

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
        await _gather_all(sends)

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
        event: str | None = None,
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
        before_commit: Callable[[], Awaitable[Any]] | None = None,
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
        before_commit: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        puts: list[tuple[BucketRow, int]] = []
        deletes: list[BucketKey] = []
        for change in wave:
            if change.new_bucket is not None:
                puts.append((change.new_bucket, change.now_ms))
            old = change.old_bucket
            deletes.extend(change.run_deletes)
            if old is not None and (change.new_bucket is None or change.new_bucket.key != old):
                deletes.append(old)
        # One batch per bucket partition for the whole wave. (Grouping by now_ms first, as
        # before, made it about one request per row: commands arriving one by one through
        # the API carry as many record timestamps as rows. Each row keeps its own TTL.)
        steps: list[Awaitable[Any]] = [self._write_buckets(puts, deletes)]
        if before_commit is not None:
            steps.append(before_commit())
        await _gather_all(steps)
        commits = []
        for change in wave:
            row = change.row
            stmts = [self.put_schedule_stmt(row, change.now_ms, change.retention_s)]
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
            stmts.extend(change.commit_with)
            commits.append(stmts)
        await _gather_all(
            [
                self.run_together("put_schedule", [s for i in batch for s in commits[i]])
                for batch in self.pack(commits)
            ]
        )

    def pack(self, groups: Sequence[Sequence[Stmt]]) -> list[list[int]]:
        """``pack_groups`` with this store's count and byte limits."""
        return pack_groups(groups, max_count=self.commit_group_size, max_bytes=self.max_batch_bytes)

    # -- fire bookkeeping ------------------------------------------------------------------

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
        if "bind_deployment" not in self._stmts:
            await self.prepare_statements(
                {
                    # IF NOT EXISTS: of workers starting together, exactly one binds. (A
                    # driver retry of our own applied insert reads back our own row.)
                    "bind_deployment": "INSERT INTO {keyspace}.deployment (name, "
                    "topic_prefix, command_partitions, bound_ms, bound_by) "
                    "VALUES ('scheduler', ?, ?, ?, ?) IF NOT EXISTS",
                }
            )
        rows = await self.run(
            "bind_deployment",
            (deployment.topic_prefix, deployment.command_partitions, now_ms, owner),
        )
        row = rows[0] if rows else {}
        if row.get("[applied]"):
            return deployment
        # Not applied: the LWT answers with the row that is there.
        return Deployment(
            topic_prefix=str(row.get("topic_prefix")),
            command_partitions=int(row.get("command_partitions") or 0),
        )

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
        batches = self.pack(groups)
        results = await asyncio.gather(
            *(
                self.run_together("mark_fired", [s for i in batch for s in groups[i]])
                for batch in batches
            ),
            return_exceptions=True,
        )
        out: list[BaseException | None] = [None] * len(marks)
        for batch, result in zip(batches, results, strict=True):
            for i in batch:
                out[i] = result if isinstance(result, BaseException) else None
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
        state: str,
        tenant: str,
        schedule_id: str,
        trigger_id: str,
        at_ms: int,
        due_ms: int,
        detail: str | None,
        retention_s: int | None,
    ) -> tuple[list[Any], Stmt]:
        """The parameters of ``mark_done`` (or, plus a version, ``mark_done_if``) and the
        event statement that record a fired or missed trigger."""
        fired_ms = at_ms if state == ScheduleState.FIRED else UNSET_VALUE
        params: list[Any] = [
            self.keep_s(retention_s),
            state,
            fired_ms,
            trigger_id,
            at_ms,
            tenant,
            schedule_id,
        ]
        event = self.event_stmt(
            tenant, schedule_id, state, at_ms, detail, trigger_id, due_ms, retention_s
        )
        return params, event

    async def _mark(
        self,
        state: str,
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
        rows, _ = await _gather_all(
            [self.run("mark_done_if", [*params, if_version]), self.run(*event)]
        )
        return bool(rows and rows[0].get("[applied]"))

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
    ) -> None:
        """Store the delivery outcome reported by the proxy and append an event named after
        it ('delivered' | 'dead_lettered'), kept ``retention_s`` (None: the global one)."""
        update: Stmt = (
            "record_delivery",
            [
                self.keep_s(retention_s),
                outcome,
                UNSET_VALUE if status_code is None else status_code,
                attempts,
                at_ms,
                tenant,
                schedule_id,
            ],
        )
        event = self.event_stmt(
            tenant, schedule_id, outcome, at_ms, detail, trigger_id, due_ms, retention_s
        )
        await self.run_together("record_delivery", [update, event])

    # -- events ----------------------------------------------------------------------------

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
        """Append to the schedule's history; (at_ms, event) is the row key, so writing the
        same event at the same instant again is an overwrite, not a duplicate."""
        await self.run(
            *self.event_stmt(
                tenant, schedule_id, event, at_ms, detail, trigger_id, due_ms, retention_s
            )
        )

    async def list_events(self, tenant: str, schedule_id: str) -> list[dict[str, Any]]:
        """The schedule's history, oldest first."""
        return await self.run("list_events", (tenant, schedule_id))

    # -- tenants ---------------------------------------------------------------------------

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
        """Upsert; None leaves a column as it is (so a config change keeps the secret).
        Signing keys change through ``rotate_signing_key`` only."""
        await self.run(
            "put_tenant",
            _unset_none(
                [tenant, active, created_ms, config, signing_secret, updated_ms]
                + [None] * (len(_TENANT_COLUMNS) - 6)
            ),
        )

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
        """Make ``new_secret`` current and ``expected_current`` the previous key (valid until
        ``previous_expires_ms``; None: until retired), ``retired`` the one before. False when
        the current key is no longer ``expected_current`` (a concurrent rotation)."""
        rows = await self.run(
            "rotate_signing_key",
            [
                new_secret,
                expected_current,
                previous_expires_ms,
                retired,
                now_ms,
                now_ms,
                tenant,
                expected_current,
            ],
        )
        return bool(rows and rows[0].get("[applied]"))

    async def retire_previous_signing_key(self, tenant: str, *, previous: str, at_ms: int) -> bool:
        """The previous key stops verifying at ``at_ms``. False when it is no longer
        ``previous`` (rotated meanwhile)."""
        rows = await self.run("retire_previous_key", [at_ms, at_ms, tenant, previous])
        return bool(rows and rows[0].get("[applied]"))

    async def get_tenant(self, tenant: str) -> dict[str, Any] | None:
        rows = await self.run("get_tenant", (tenant,))
        return rows[0] if rows else None

    async def list_tenants(self) -> list[dict[str, Any]]:
        """All tenants (a small table; admin use only, never on a hot path)."""
        return await self.run("list_tenants", ())

    # -- API keys (hashes only; see streams.tenants) ----------------------------------------

    async def put_api_key(
        self, key_id: str, tenant: str, *, salt: bytes, hash: bytes, created_ms: int
    ) -> None:
        await self.run("put_api_key", (key_id, tenant, salt, hash, created_ms, False))
        await self.run("put_tenant_key", (tenant, key_id, created_ms))

    async def get_api_key(self, key_id: str) -> dict[str, Any] | None:
        rows = await self.run("get_api_key", (key_id,))
        return rows[0] if rows else None

    async def revoke_api_key(self, key_id: str) -> None:
        await self.run("revoke_api_key", (key_id,))

    async def list_api_keys(self, tenant: str) -> list[dict[str, Any]]:
        return await self.run("list_tenant_keys", (tenant,))

    # -- per-tenant listing index (schedules_by_tenant_day) --------------------------------

    async def write_index(
        self,
        put: Sequence[tuple[str, str, int]],
        delete: Sequence[tuple[str, str, int]],
        *,
        now_ms: int,
        retention_s: int | None = None,
    ) -> None:
        """Add (tenant, schedule_id, due_ms) entries (kept until due + retention) and drop
        stale ones (a reschedule's old due). Idempotent overwrites; see the 002 migration."""
        keep_s = self.retention_s if retention_s is None else retention_s
        # One unlogged batch per (tenant, day) partition (chunks of 50 tiny rows): a burst
        # of one tenant's creates costs a few requests, not one per schedule.
        groups: dict[tuple[str, int], list[Stmt]] = {}
        for t, sid, due in put:
            ttl = max(1, (due - now_ms) // 1000 + keep_s)
            groups.setdefault((t, due // _DAY_MS), []).append(
                ("put_index", [t, due // _DAY_MS, due, sid, ttl])
            )
        for t, sid, due in delete:
            groups.setdefault((t, due // _DAY_MS), []).append(
                ("delete_index", [t, due // _DAY_MS, due, sid])
            )
        await _gather_all(
            [
                self.run_together("write_index", stmts[i : i + 50])
                for stmts in groups.values()
                for i in range(0, len(stmts), 50)
            ]
        )

    async def read_index(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        after: tuple[int, str] | None = None,
        limit: int = 100,
    ) -> list[tuple[int, str]]:
        """(due_ms, schedule_id) of the tenant's schedules with from_ms <= due < to_ms, in
        due order, strictly after ``after``; at most ``limit``. One slice per UTC day."""
        out: list[tuple[int, str]] = []
        resume = after if after is not None and after[0] >= from_ms else None
        day = (resume[0] if resume else from_ms) // _DAY_MS
        last_day = (to_ms - 1) // _DAY_MS
        while day <= last_day and len(out) < limit:
            left = limit - len(out)
            if resume is not None:
                rows = await self.run(
                    "read_index_after", (tenant, day, resume[0], resume[1], to_ms, left)
                )
                resume = None
            else:
                lo = max(from_ms, day * _DAY_MS)
                rows = await self.run("read_index", (tenant, day, lo, to_ms, left))
            out.extend((int(r["due_ms"]), r["schedule_id"]) for r in rows)
            day += 1
        return out

    # -- the tenant's recurring schedules (recurring_by_tenant, 004) ------------------------

    async def write_recurring_index(self, entries: Sequence[tuple[str, str, int, bool]]) -> None:
        """(tenant, schedule_id, created_ms, finished) entries: live ones without a TTL,
        finished (cancelled) ones expiring with the parent row (the retention)."""
        groups: dict[str, list[Stmt]] = {}
        for tenant, sid, created_ms, finished in entries:
            ttl = max(1, self.retention_s) if finished else 0  # TTL 0: never expires
            groups.setdefault(tenant, []).append(("put_recurring", [tenant, sid, created_ms, ttl]))
        await _gather_all(
            [
                self.run_together("write_recurring_index", stmts[i : i + 50])
                for stmts in groups.values()
                for i in range(0, len(stmts), 50)
            ]
        )

    async def list_recurring(self, tenant: str) -> list[str]:
        """Ids of the tenant's recurring schedules (their rows may have expired), by id."""
        rows = await self.run("list_recurring", (tenant,))
        return [r["schedule_id"] for r in rows]


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


def _stmt_bytes(stmt: Stmt) -> int:
    """A generous estimate of a statement's share of a batch (for packing): its values'
    lengths plus a fixed cost per value and statement."""
    size = 64
    for value in stmt[1]:
        size += 16 + (len(value) if isinstance(value, bytes | str) else 8)
    return size


def pack_groups(
    groups: Sequence[Sequence[Stmt]], *, max_count: int, max_bytes: int
) -> list[list[int]]:
    """Indexes of ``groups`` packed into batches (pure): each group (statements sharing one
    partition key, which must stay one mutation) goes whole into one batch; a batch holds
    at most ``max_count`` groups and ``max_bytes`` estimated bytes, except that a group
    larger than ``max_bytes`` goes alone. Cassandra refuses a multi-partition batch over
    batch_size_fail_threshold (50 KiB stock) but never a single-partition one, so a group
    alone is always accepted whatever its size."""
    packed: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, group in enumerate(groups):
        nbytes = sum(_stmt_bytes(stmt) for stmt in group)
        if current and (len(current) >= max_count or size + nbytes > max_bytes):
            packed.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        packed.append(current)
    return packed


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


async def _gather_all(awaitables: Sequence[Any]) -> list[Any]:
    """Run concurrently; wait for all of them even if one fails (so no write is left
    running unobserved), then raise the first error."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


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

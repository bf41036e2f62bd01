"""The statement executor under every table of the scheduler: one driver session, named
prepared statements, and the bridge from the driver's callbacks into asyncio.

Statements are prepared once in ``connect``: each table module declares its own as a class
attribute ``CQL`` (name to text, ``{keyspace}`` replaced here) and the conditional ones (a
lightweight transaction, never retried blindly by the driver) in ``CONDITIONAL``; every
other statement writes fixed values under a full key, so the driver may replay it.
``execute_async`` futures complete on the driver's own I/O thread and are handed to the
event loop with ``loop.call_soon_threadsafe``; a semaphore caps requests in flight; every
driver error leaves as ``base.errors.StoreError`` with ``retriable`` set for timeouts,
unavailability and lost connections. Never a logged batch: ``run_together`` sends an
unlogged one, for statements sharing a partition key or, up to ``commit_group_size``
schedules, when the caller opts in.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import ClassVar, TypedDict, TypeVar

from cassandra import (
    ConsistencyLevel,
    OperationTimedOut,
    RequestExecutionException,
    RequestValidationException,
)
from cassandra import protocol as cql_protocol
from cassandra.cluster import Cluster, NoHostAvailable, ResponseFuture, Session
from cassandra.connection import ConnectionException
from cassandra.query import (
    UNSET_VALUE,
    BatchStatement,
    BatchType,
    BoundStatement,
    PreparedStatement,
    Statement,
    dict_factory,
)
from prometheus_client import Counter

from base.cassandra import make_cluster
from base.errors import StoreError
from base.settings import CassandraSettings
from streams.model import DEFAULT_RETENTION_S, Stmt
from streams.ports import CqlRow
from topics.signing import MAX_SKEW_MS

DEFAULT_FETCH_SIZE = 5000
# Whatever a tenant's retention, what it keeps (a finished schedule's row above all) lives
# at least this long. A copy of a signed or admission-stamped create (anyone who reads the
# commands topic can produce one) verifies while its broker time is within MAX_SKEW_MS of
# the stamp, so up to 2 x MAX_SKEW_MS after the original's; the workers' copy checks are in
# memory, and after a restart or rebalance only the row left by the original makes the
# copy a duplicate instead of a schedule back from cancelled. The rest (50 min) is how far
# the worker may fall behind between reading the original and its copy (a restart, an
# outage) before a copy could outlive that row.
MIN_KEEP_S = 3600
assert MIN_KEEP_S > 2 * MAX_SKEW_MS // 1000
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

# Requests and statements sent, by operation: the client CPU of this process scales with
# them (see BENCHMARKS.md), so they are the first thing to look at when a worker is busy.
STORE_REQUESTS = Counter("tocsin_store_requests_total", "Cassandra requests sent", ["op"])
STORE_STATEMENTS = Counter(
    "tocsin_store_statements_total", "Cassandra statements sent (batch members count)", ["op"]
)

T = TypeVar("T")


def unset_none(values: Sequence[object]) -> list[object]:
    """None as UNSET: the cell is left as it is and no tombstone written (binding None
    would write one tombstone per empty column on every create)."""
    return [UNSET_VALUE if v is None else v for v in values]


class _Binder:
    """Binds a positional list to one prepared statement as the driver's
    ``BoundStatement.bind`` does, with each column's serializer looked up once: the driver
    builds a column descriptor and asks the encryption policy for every value, about half
    of its bind time, and the command agent binds four statements per create. Only for a
    statement without column encryption on protocol v4+ (UNSET_VALUE); others, and a value
    the serializer refuses (for the driver's own TypeError), go to the driver's bind."""

    __slots__ = ("direct", "key_indexes", "prepared", "protocol_version", "serializers")

    def __init__(self, prepared: PreparedStatement) -> None:
        self.prepared = prepared
        self.protocol_version = prepared.protocol_version
        self.serializers = [col.type.serialize for col in prepared.column_metadata or ()]
        self.key_indexes = tuple(prepared.routing_key_indexes or ())
        self.direct = prepared.column_encryption_policy is None and self.protocol_version >= 4

    def bind(self, params: Sequence[object]) -> BoundStatement:
        if not self.direct or len(params) > len(self.serializers):
            return self.prepared.bind(list(params))
        version = self.protocol_version
        try:
            values = [
                v if v is None or v is UNSET_VALUE else serialize(v, version)
                for v, serialize in zip(params, self.serializers, strict=False)
            ]
        except (TypeError, struct.error):
            return self.prepared.bind(list(params))  # raises the driver's TypeError
        values.extend([UNSET_VALUE] * (len(self.serializers) - len(values)))
        if any(values[i] is UNSET_VALUE for i in self.key_indexes):
            return self.prepared.bind(list(params))  # raises the driver's ValueError
        bound = BoundStatement(self.prepared)
        bound.raw_values = list(params)
        bound.values = values
        return bound


def insert_cql(table: str, columns: Sequence[str], *, ttl: bool) -> str:
    """An INSERT of ``columns`` (plus ``USING TTL ?`` last when ``ttl``)."""
    using = " USING TTL ?" if ttl else ""
    return (
        f"INSERT INTO {{keyspace}}.{table} ({', '.join(columns)}) "
        f"VALUES ({', '.join('?' for _ in columns)}){using}"
    )


def translate_error(exc: BaseException, what: str) -> StoreError:
    """The StoreError for a driver exception (``retriable`` for transient failures)."""
    retriable = isinstance(exc, _RETRIABLE)
    if isinstance(exc, RequestValidationException):
        retriable = False  # InvalidRequest, Unauthorized, ConfigurationException...
    return StoreError(f"cassandra {what} failed: {type(exc).__name__}: {exc}", retriable=retriable)


async def gather_all(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Run concurrently; wait for all of them even if one fails (so no write is left
    running unobserved), then raise the first error."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    out: list[T] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out


def _stmt_bytes(stmt: Stmt) -> int:
    """A generous estimate of a statement's share of a batch (for packing): its values'
    lengths plus a fixed cost per value and statement: 64 + 16 a value + its length, or
    8 for one that is not bytes or text. (Counted per value that has a length, half the
    cost of the per-value sum, on every statement of every command batch.)"""
    values = stmt[1]
    size = 64 + 24 * len(values)
    for value in values:
        if isinstance(value, _SIZED):
            size += len(value) - 8
    return size


_SIZED = (bytes, str)


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


class _Paged:
    """One request's rows across every page of its query. The driver fetches page n+1
    only when asked, from its callback on its own I/O thread; the outcome is handed to the
    event loop thread, where ``done`` completes."""

    def __init__(
        self,
        name: str,
        loop: asyncio.AbstractEventLoop,
        on_pages: Callable[[str, int], None],
    ) -> None:
        self.name = name
        self.loop = loop
        self.on_pages = on_pages
        self.done: asyncio.Future[list[CqlRow]] = loop.create_future()
        self.rows: list[CqlRow] = []
        self.pages = 0  # touched on the driver thread only, read after the last page
        self.future: ResponseFuture | None = None

    def start(self, future: ResponseFuture) -> None:
        self.future = future
        future.add_callbacks(callback=self._on_page, errback=self._on_error)

    def _on_page(self, page: list[CqlRow] | None) -> None:
        # Writes complete with page None; reads once per page.
        self.pages += 1
        try:
            if page:
                self.rows.extend(page)
            if self.future is not None and self.future.has_more_pages:
                self.future.start_fetching_next_page()
            else:
                self._post(self.rows, None)
        except Exception as exc:  # never let an error die on the driver thread
            self._post(None, exc)

    def _on_error(self, exc: BaseException) -> None:
        self._post(None, exc)

    def _post(self, result: list[CqlRow] | None, error: BaseException | None) -> None:
        # Settled: let go of the driver's future. It holds this object's callbacks, and it
        # and its timer refer to each other (the driver cancels the timer on the result but
        # keeps it): left so, every request, with its statements and their values (about 90
        # objects for a batch of 16 groups), is garbage only a collection finds. At 1,000
        # fires/s those made the worker's young collections: about one a second.
        future, self.future = self.future, None
        if future is not None and hasattr(future, "_timer"):
            future._timer = None  # (the driver's own attribute; read by nothing once settled)
        # RuntimeError: the loop closed during shutdown; nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._settle, result, error)

    def _settle(self, result: list[CqlRow] | None, error: BaseException | None) -> None:
        # On the event loop thread, so the owner's counters need no lock.
        self.on_pages(self.name, self.pages)
        if self.done.done():  # the awaiting task was cancelled
            return
        if error is not None:
            translated = translate_error(error, self.name)
            translated.__cause__ = error
            self.done.set_exception(translated)
        else:
            self.done.set_result(result or [])


class ExecutorOptions(TypedDict, total=False):
    """``CqlExecutor``'s keyword options (defaults there), so a subclass that takes options
    of its own passes these on without declaring them again."""

    retention_s: int
    fetch_size: int
    max_in_flight: int
    max_batch_bytes: int
    commit_group_size: int
    protocol_version: int | None  # None: settings.protocol_version


class CqlExecutor:
    """One session and its prepared statements. ``await connect()`` before use, ``await
    close()`` after; one instance per process (the driver pools connections)."""

    CQL: ClassVar[dict[str, str]] = {}
    CONDITIONAL: ClassVar[frozenset[str]] = frozenset()

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
        self._cluster: Cluster | None = None
        self._session: Session | None = None
        self._stmts: dict[str, PreparedStatement] = {}
        # By statement name (this store's own, a fixed set), made on first use.
        self._binders: dict[str, _Binder] = {}
        # Created lazily inside the running loop (a Semaphore binds to the loop it runs on).
        self._semaphore: asyncio.Semaphore | None = None

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
            self._stmts = await asyncio.to_thread(self._prepare, self._own_statements(), True)
            self._binders = {}
        except Exception as exc:
            await asyncio.to_thread(cluster.shutdown)
            self._session = None
            self._cluster = None
            raise translate_error(exc, "connect") from exc

    async def close(self) -> None:
        cluster, self._cluster, self._session = self._cluster, None, None
        if cluster is not None:
            await asyncio.to_thread(cluster.shutdown)

    def _own_statements(self) -> dict[str, str]:
        """``CQL`` of every table class this store is made of."""
        texts: dict[str, str] = {}
        for cls in reversed(type(self).__mro__):
            texts.update(vars(cls).get("CQL", {}))
        return texts

    def _conditional(self) -> frozenset[str]:
        return frozenset().union(*(vars(c).get("CONDITIONAL", ()) for c in type(self).__mro__))

    def _prepare(self, cql: dict[str, str], own: bool) -> dict[str, PreparedStatement]:
        session = self._session
        if session is None:
            raise StoreError("store is not connected", retriable=False)
        ks = self.settings.keyspace
        conditional = self._conditional() if own else frozenset()
        prepared: dict[str, PreparedStatement] = {}
        for name, text in cql.items():
            stmt = session.prepare(text.replace("{keyspace}", ks))
            stmt.is_idempotent = name not in conditional
            prepared[name] = stmt
        return prepared

    async def prepare_statements(self, cql: dict[str, str]) -> None:
        """Prepare more named statements (other modules' tables, e.g. the recurring store);
        ``{keyspace}`` in the text is replaced. All must be idempotent writes or reads."""
        if self._session is None:
            raise StoreError("store is not connected", retriable=False)
        try:
            prepared = await asyncio.to_thread(self._prepare, cql, False)
            self._stmts.update(prepared)
            for name in prepared:
                self._binders.pop(name, None)
        except Exception as exc:
            raise translate_error(exc, "prepare") from exc

    def has_statements(self, names: Iterable[str]) -> bool:
        """Whether every statement of ``names`` is prepared on this session already."""
        return all(name in self._stmts for name in names)

    # -- running statements ----------------------------------------------------------------

    def keep_s(self, retention_s: int | None) -> int:
        """A tenant's retention (seconds) or, for None, the global one; at least
        ``MIN_KEEP_S``."""
        return max(MIN_KEEP_S, self.retention_s if retention_s is None else retention_s)

    def pack(self, groups: Sequence[Sequence[Stmt]]) -> list[list[int]]:
        """``pack_groups`` with this store's count and byte limits."""
        return pack_groups(groups, max_count=self.commit_group_size, max_bytes=self.max_batch_bytes)

    def _bind(self, name: str, params: Sequence[object]) -> BoundStatement:
        if self._session is None:
            raise StoreError("store is not connected", retriable=False)
        binder = self._binders.get(name)
        if binder is None:
            binder = self._binders[name] = _Binder(self._stmts[name])
        return binder.bind(params)

    async def run(
        self, name: str, params: Sequence[object], *, fetch_size: int | None = None
    ) -> list[CqlRow]:
        """Execute one prepared statement; all its rows (every page of the one query)."""
        bound = self._bind(name, params)
        bound.fetch_size = fetch_size or self.fetch_size
        return await self._execute(bound, name)

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None:
        """Send statements as ONE unlogged batch - only ever for statements whose rows share
        a partition key (one mutation per replica: atomic there, no batchlog, no
        coordinator fan-out), or a group the caller packed on purpose. A single statement
        goes alone."""
        if len(statements) == 1:
            await self.run(*statements[0])
            return
        batch = BatchStatement(batch_type=BatchType.UNLOGGED)
        for stmt_name, params in statements:
            batch.add(self._bind(stmt_name, params))
        batch.is_idempotent = True  # every member is (see _prepare)
        await self._execute(batch, name)

    def _pages_read(self, name: str, pages: int) -> None:
        """Called on the event loop with the pages one request read (for observability)."""

    async def _execute(self, statement: Statement, name: str) -> list[CqlRow]:
        """Execute and return all rows, following every page of the one query."""
        session = self._session
        if session is None or self._semaphore is None:
            raise StoreError("store is not connected", retriable=False)
        paged = _Paged(name, asyncio.get_running_loop(), self._pages_read)
        STORE_REQUESTS.labels(name).inc()
        STORE_STATEMENTS.labels(name).inc(
            len(statement) if isinstance(statement, BatchStatement) else 1
        )
        async with self._semaphore:
            try:
                future = session.execute_async(statement)
            except Exception as exc:  # the driver raises synchronously when shut down
                raise translate_error(exc, name) from exc
            paged.start(future)
            return await paged.done

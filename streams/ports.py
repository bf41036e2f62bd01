"""What each consumer of the scheduler's store calls on it, one ``Protocol`` per consumer.

``streams.store.Store`` satisfies every one of them; ``tests/fakes.py`` holds the in-memory
fake the unit tests share. A consumer names the narrowest Protocol it needs, so a reader
sees at the signature which tables a module touches, and a fake need only model those.

Pure: type declarations only, no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from streams.buckets import BucketKey
from streams.model import (
    BucketRow,
    DeliveryMark,
    Deployment,
    FiredMark,
    ScheduleChange,
    ScheduleEvent,
    ScheduleRow,
    Stmt,
)
from streams.tenants import TenantConfig
from topics.models import DeliveryOutcome

# A row as the driver returns it: column name to value (the columns are heterogeneous).
CqlRow = dict[str, Any]


class Lifecycle(Protocol):
    async def connect(self) -> None: ...

    async def close(self) -> None: ...


class ScheduleReader(Protocol):
    """Schedule rows by key (``streams.store.load_schedule_rows`` takes this)."""

    async def get_schedule(self, tenant: str, schedule_id: str) -> CqlRow | None: ...

    async def get_schedules(
        self, tenant: str, schedule_ids: Sequence[str], *, chunk: int = 100
    ) -> dict[str, CqlRow]: ...


class TenantReader(Protocol):
    """The tenant cache of the command agent."""

    async def get_tenant(self, tenant: str) -> CqlRow | None: ...


class StatementRunner(Protocol):
    """Named prepared statements of a module's own tables, run on the store's session
    (the recurring store, status, the API's recurring reads)."""

    retention_s: int

    async def prepare_statements(self, cql: dict[str, str]) -> None: ...

    def has_statements(self, names: Iterable[str]) -> bool: ...

    async def run(
        self, name: str, params: Sequence[object], *, fetch_size: int | None = None
    ) -> list[CqlRow]: ...

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None: ...

    def pack(self, groups: Sequence[Sequence[Stmt]]) -> list[list[int]]: ...


class MaterializerStore(ScheduleReader, StatementRunner, Protocol):
    """What the recurring store (the materialiser's I/O) calls."""

    def put_schedule_stmt(
        self, row: ScheduleRow, now_ms: int, retention_s: int | None = None
    ) -> Stmt: ...

    def event_stmt(
        self,
        tenant: str,
        schedule_id: str,
        event: ScheduleEvent,
        at_ms: int,
        detail: str | None,
        trigger_id: str | None,
        due_ms: int | None,
        retention_s: int | None = None,
    ) -> Stmt: ...

    async def write_buckets(
        self,
        *,
        put: Sequence[BucketRow] = (),
        delete: Sequence[BucketKey] = (),
        now_ms: int,
    ) -> None: ...


class CommandStore(TenantReader, MaterializerStore, Protocol):
    """What the command agent calls (it also builds a recurring store on the same one)."""

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

    async def write_index(
        self,
        put: Sequence[tuple[str, str, int]],
        delete: Sequence[tuple[str, str, int]],
        *,
        now_ms: int,
        retention_s: int | None = None,
    ) -> None: ...

    async def write_recurring_index(
        self, entries: Sequence[tuple[str, str, int, bool]]
    ) -> None: ...

    async def apply_schedule_changes(
        self,
        changes: Sequence[ScheduleChange],
        *,
        before_commit: Callable[[], Awaitable[object]] | None = None,
    ) -> None: ...


class TickerStore(ScheduleReader, Protocol):
    """What a partition's ticker calls (it reads the parents of backfilled runs it loads,
    and records those a pause or cancel stopped in their history)."""

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

    async def get_checkpoint(self, partition: int) -> int | None: ...

    async def set_checkpoint(
        self, partition: int, fired_before_ms: int, owner: str, *, now_ms: int
    ) -> None: ...

    async def read_bucket(
        self,
        partition: int,
        minute_ms: int,
        shards: int,
        *,
        from_due_ms: int | None = None,
        fetch_size: int | None = None,
    ) -> list[BucketRow]: ...

    async def mark_fired_many(self, marks: Sequence[FiredMark]) -> list[BaseException | None]: ...

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
    ) -> bool: ...


class TenantPolicies(Protocol):
    """Tenant configs (streams.commands.TenantCache): ``peek`` answers at once from the
    cache (None: never read), ``config`` may read the store."""

    def peek(self, tenant: str) -> TenantConfig | None: ...

    async def config(self, tenant: str) -> TenantConfig: ...


class DeliveryStore(Protocol):
    """What the delivery-report agent calls."""

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
    ) -> None: ...

    async def record_deliveries_many(
        self, marks: Sequence[DeliveryMark]
    ) -> list[BaseException | None]: ...


class IndexReader(Protocol):
    """The per-tenant listing indexes."""

    async def read_index(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        after: tuple[int, str] | None = None,
        limit: int = 100,
    ) -> list[tuple[int, str]]: ...

    async def list_recurring(self, tenant: str) -> list[str]: ...


class TenantLister(Protocol):
    async def list_tenants(self) -> list[CqlRow]: ...


class StatusStore(StatementRunner, IndexReader, TenantLister, Protocol):
    """What ``streams.status_io`` calls."""


class TenantAdminStore(TenantReader, Protocol):
    """What ``streams.tenant_admin`` (tenant and key administration) calls."""

    async def put_tenant(
        self,
        tenant: str,
        *,
        active: bool | None,
        created_ms: int | None,
        config: str | None = None,
        signing_secret: str | None = None,
        updated_ms: int | None = None,
    ) -> None: ...

    async def put_api_key(
        self, key_id: str, tenant: str, *, salt: bytes, hash: bytes, created_ms: int
    ) -> None: ...

    async def rotate_signing_key(
        self,
        tenant: str,
        *,
        expected_current: str | None,
        new_secret: str,
        previous_expires_ms: int | None,
        retired: str | None,
        now_ms: int,
    ) -> bool: ...

    async def retire_previous_signing_key(
        self, tenant: str, *, previous: str, at_ms: int
    ) -> bool: ...


class BindingStore(Protocol):
    """What the keyspace binding check calls."""

    async def connect(self) -> None: ...

    async def bind_deployment(
        self, deployment: Deployment, *, owner: str, now_ms: int
    ) -> Deployment: ...


class EventStore(Protocol):
    """A schedule's history."""

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

    async def list_events(self, tenant: str, schedule_id: str) -> list[CqlRow]: ...


class ApiKeyStore(Protocol):
    async def get_api_key(self, key_id: str) -> CqlRow | None: ...

    async def revoke_api_key(self, key_id: str) -> None: ...

    async def list_api_keys(self, tenant: str) -> list[CqlRow]: ...


class ApiStore(
    Lifecycle,
    ScheduleReader,
    StatementRunner,
    TenantAdminStore,
    TenantLister,
    IndexReader,
    EventStore,
    ApiKeyStore,
    Protocol,
):
    """What ``api/`` calls (reads, history, tenant and key administration, and the
    recurring reads' own statements)."""

"""The scheduler's data model: the rows it stores, the states a schedule is in and the
change one command makes. Pure: no I/O, imported by the decisions, the store and the API.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from streams.buckets import BUCKET_MS, UNRECORDED_BUCKET_MS, BucketKey, shard_of
from streams.buckets import minute_ms as minute_of
from topics.codec import callback_from_json
from topics.ids import trigger_id as make_trigger_id
from topics.models import Callback, DeliveryOutcome, PayloadType, Trigger

# How long fired rows and events are kept unless a tenant sets its own retention.
DEFAULT_RETENTION_S = 7 * 24 * 3600


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """What a keyspace's buckets and checkpoints are laid out for (streams.binding)."""

    topic_prefix: str
    command_partitions: int
    bucket_ms: int = BUCKET_MS

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Deployment:
        """The binding a ``deployment`` row records (no width: ``UNRECORDED_BUCKET_MS``)."""
        width = row.get("bucket_ms")
        return cls(
            topic_prefix=str(row.get("topic_prefix")),
            command_partitions=int(row.get("command_partitions") or 0),
            bucket_ms=int(width) if width is not None else UNRECORDED_BUCKET_MS,
        )


class ScheduleState(StrEnum):
    """The values of ``schedules.state``. A StrEnum so a row read from Cassandra (a plain
    string) compares equal to its member."""

    SCHEDULED = "scheduled"
    FIRED = "fired"
    MISSED = "missed"
    CANCELLED = "cancelled"
    # Not firing until resumed: no bucket row (a one-shot), no runs written (recurring).
    PAUSED = "paused"
    # A recurring schedule with no runs left (api.recurring derives it; not written today).
    COMPLETED = "completed"


class ScheduleEvent(StrEnum):
    """The values of ``schedule_events.event``: what a schedule's history records. A
    StrEnum so an event read from Cassandra compares equal to its member."""

    CREATED = "created"
    UPDATED = "updated"
    CANCELLED = "cancelled"
    FIRED = "fired"
    MISSED = "missed"
    # Emitted again by a bulk re-fire (api.service), same trigger id, next attempt.
    REFIRED = "refired"
    # Runs of a recurring schedule dropped by its misfire policy (the materialiser).
    SKIPPED = "skipped"
    DELIVERED = "delivered"
    DEAD_LETTERED = "dead_lettered"
    PAUSED = "paused"
    RESUMED = "resumed"
    # Runs of a recurring schedule that fell while it was paused (recorded at the resume).
    SKIPPED_PAUSED = "skipped_paused"
    # Fired once at once by a trigger command, as an extra run (``manual_run_id``).
    TRIGGERED = "triggered"
    # Past runs of a recurring schedule written to fire again, paced (a backfill command).
    BACKFILLED = "backfilled"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRow:
    """All columns of ``schedules``; ``ScheduleRow(**store_row)`` rebuilds one from
    ``Store.get_schedule``. A None field is left untouched by ``put_schedule``."""

    tenant: str
    schedule_id: str
    partition: int
    state: str
    due_ms: int
    version: int
    created_ms: int
    updated_ms: int
    order_key: str | None = None
    payload: bytes | None = None
    payload_type: str | None = None
    callback: str | None = None
    misfire_tolerance_s: int | None = None
    fired_ms: int | None = None
    trigger_id: str | None = None
    applied_offset: int | None = None
    last_code: str | None = None
    delivery_outcome: str | None = None
    delivery_status_code: int | None = None
    delivery_attempts: int | None = None
    delivery_ms: int | None = None
    # Recurring schedules (migration 003, streams.materializer); None for one-shots.
    recurrence: str | None = None
    anchor_ms: int | None = None
    materialized_until_ms: int | None = None
    run_count: int | None = None
    materialize_key: int | None = None
    # The W3C trace context of the command that made the schedule (migration 011), so a
    # trigger emitted days later carries it (topics.tracecontext).
    traceparent: str | None = None
    tracestate: str | None = None
    # The version the last pause or cancel of a recurring schedule wrote (migration 012):
    # its backfilled runs written before it (their bucket rows carry an older version) are
    # dropped, not fired. None: never paused or cancelled.
    backfill_stop_version: int | None = None
    # The tocsin-signed-at of the newest tenant-signed command applied to the schedule, and
    # the signature prefixes (topics.signing.mac_prefix) of those applied within
    # TOCSIN_SIGNED_ORDER_SKEW_MS below it, with their signed times (migration 013; layout
    # in decisions.entries): a copy of one of those, or a signed command too long before
    # it, is refused (decisions.check_signed_order). None: no signed command applied yet.
    signed_at_ms: int | None = None
    signed_macs: bytes | None = None


@dataclass(frozen=True, slots=True)
class FiredMark:
    """One acknowledged trigger to record as fired (``Store.mark_fired_many``)."""

    tenant: str
    schedule_id: str
    trigger_id: str
    fired_ms: int
    due_ms: int
    retention_s: int | None = None  # the tenant's retention (None: the global one)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliveryMark:
    """One final delivery outcome to record (``Store.record_deliveries_many``; the fields
    are ``record_delivery``'s)."""

    tenant: str
    schedule_id: str
    outcome: DeliveryOutcome
    status_code: int | None
    attempts: int
    at_ms: int
    trigger_id: str | None = None
    due_ms: int | None = None
    detail: str | None = None
    retention_s: int | None = None
    # The write timestamp (µs) of the schedule's delivery cells: the outcome's own order
    # (``deliveries.outcome_order_us``), so that of two outcomes written in any order, by
    # any worker, the later one stays (Cassandra keeps the cell with the greater timestamp).
    # None: the time of the write.
    order_us: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketRow(BucketKey):
    """All columns of ``buckets``: the key's (first, in the table's order) and everything a
    fire needs, so firing never reads ``schedules``."""

    version: int
    order_key: str | None = None
    payload: bytes | None = None
    payload_type: str | None = None
    callback: str | None = None
    misfire_tolerance_s: int | None = None
    # The schedule's trace context (ScheduleRow.traceparent), so firing needs no other read.
    traceparent: str | None = None
    tracestate: str | None = None
    # A backfilled run (migration 010): the due time its trigger carries and its trigger id
    # is made from, the run's own (nominal plus jitter), while ``due_ms`` is when it fires
    # now. None: the row fires at the due time it carries.
    run_due_ms: int | None = None

    @property
    def trigger_due_ms(self) -> int:
        """The due time this row's trigger carries (``run_due_ms`` of a backfilled run)."""
        return self.due_ms if self.run_due_ms is None else self.run_due_ms

    @property
    def key(self) -> BucketKey:
        return BucketKey(
            partition=self.partition,
            minute_ms=self.minute_ms,
            shard=self.shard,
            due_ms=self.due_ms,
            tenant=self.tenant,
            schedule_id=self.schedule_id,
        )

    @classmethod
    def for_schedule(cls, row: ScheduleRow, *, shards: int) -> BucketRow:
        """The bucket row that makes ``row`` fire (minute and shard derived from it)."""
        return cls(
            partition=row.partition,
            minute_ms=minute_of(row.due_ms),
            shard=shard_of(row.tenant, row.schedule_id, shards),
            due_ms=row.due_ms,
            tenant=row.tenant,
            schedule_id=row.schedule_id,
            version=row.version,
            order_key=row.order_key,
            payload=row.payload,
            payload_type=row.payload_type,
            callback=row.callback,
            misfire_tolerance_s=row.misfire_tolerance_s,
            traceparent=row.traceparent,
            tracestate=row.tracestate,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ManualRun(BucketRow):
    """The one extra run of a trigger command: fired through the ticker like a bucket row
    (never stored as one: the command waits for Kafka's acknowledgement, and a replay of
    the command fires it again with the same ids), under a trigger id of its own."""

    trigger_id: str


# A trigger command's runs get their ids from this namespace, never from
# ``topics.ids.NAMESPACE``: no manual run's trigger id can equal a nominal run's, whatever
# ids a client picks.
MANUAL_NAMESPACE = uuid.UUID("5b1f0c8e-3f4a-4c55-9e0b-7d2a61c4e9a3")


def manual_run_id(schedule_id: str, at_ms: int, offset: int) -> str:
    """The schedule id a trigger command's run carries: never a nominal run id
    (``<id>@<digits>``, streams.recurring.parse_run_id), distinct per command."""
    return f"{schedule_id}@now-{at_ms}-{offset}"


def manual_trigger_id(
    tenant: str, schedule_id: str, partition: int, offset: int, at_ms: int
) -> str:
    """The trigger id of a trigger command's run: the same for every emission of it (a
    replayed command fires it again under this id), 32 lowercase hex digits."""
    return uuid.uuid5(MANUAL_NAMESPACE, f"{tenant}/{schedule_id}/{partition}/{offset}/{at_ms}").hex


def trigger_id_of(row: BucketRow) -> str:
    """The trigger id ``row`` fires under."""
    if isinstance(row, ManualRun):
        return row.trigger_id
    return make_trigger_id(row.tenant, row.schedule_id, row.trigger_due_ms)


@dataclass(frozen=True, slots=True)
class EventNote:
    """One more history event a change writes with its schedule row."""

    event: ScheduleEvent
    detail: str | None = None
    trigger_id: str | None = None
    due_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleChange:
    """One command's effect for ``Store.apply_schedule_changes``: the schedule's new full
    row, the bucket row to write (create/reschedule) and the one to delete
    (reschedule/cancel), and an optional history event stamped ``now_ms``."""

    row: ScheduleRow
    new_bucket: BucketRow | None
    old_bucket: BucketKey | None
    now_ms: int
    event: ScheduleEvent | None = None
    event_detail: str | None = None
    # Recurring schedules: bucket rows of runs to delete with the change (step 1), and
    # statements on the schedule's own partition key committed with its row (step 2).
    run_deletes: tuple[BucketKey, ...] = ()
    commit_with: tuple[tuple[str, list[Any]], ...] = ()
    # The tenant's retention (TenantConfig.retention_s) for the schedule row and its event;
    # None: the store's global one. Bucket rows always keep the global retention.
    retention_s: int | None = None
    # More history events, written with the row (same partition key: one mutation).
    notes: tuple[EventNote, ...] = ()
    # False: only the events are written, the row is left as it is (a trigger command,
    # which must not overwrite a state the ticker may be recording meanwhile).
    write_row: bool = True
    # A paused one-shot whose due time an update moved: the listing index entry to move
    # (it has no bucket row, which is what moves the entry otherwise).
    index_old_due_ms: int | None = None
    # More bucket rows to write in step 1 (a backfill's runs, each due when it is to fire).
    bucket_puts: tuple[BucketRow, ...] = ()


# A prepared statement's name and its bind values.
Stmt = tuple[str, list[Any]]

# The columns of ``schedules``, in the order the store reads and writes them.
SCHEDULE_COLUMNS = tuple(f.name for f in fields(ScheduleRow))


def trigger_for(
    row: BucketRow | ScheduleRow,
    *,
    emitted_ms: int,
    attempt: int = 1,
    trigger_id: str | None = None,
) -> Trigger:
    """The trigger that fires ``row`` at its due time (the ticker's emit, the API's
    re-fire). ``trigger_id``: the stable id when the caller has it already. Raises
    ValueError for a row without a callback and the codec's error for an invalid one."""
    if not row.callback:
        raise ValueError(f"schedule {row.schedule_id!r} has no callback")
    # A backfilled run carries its own due time, not the one it fires at now.
    due_ms = row.trigger_due_ms if isinstance(row, BucketRow) else row.due_ms
    return Trigger(
        trigger_id=trigger_id or make_trigger_id(row.tenant, row.schedule_id, due_ms),
        schedule_id=row.schedule_id,
        tenant=row.tenant,
        due_ms=due_ms,
        emitted_ms=emitted_ms,
        attempt=attempt,
        order_key=row.order_key or row.schedule_id,
        payload=row.payload or b"",
        payload_type=PayloadType(row.payload_type or "bytes"),
        callback=_parse_callback(row.callback),
        traceparent=row.traceparent,
        tracestate=row.tracestate,
    )


@functools.lru_cache(maxsize=4096)
def _parse_callback(text: str) -> Callback:
    # Every run of a recurring schedule (and many one-shots) carries the same callback
    # text; parsing and validating it again per fire was a visible share of emit CPU.
    # Callbacks are frozen dataclasses, so sharing one object between triggers is safe.
    return callback_from_json(text)

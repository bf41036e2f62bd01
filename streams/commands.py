"""The command agent's logic: validate, apply idempotently, persist, answer.

One message of the commands topic in, one result on the command-results topic out, for
every message, including garbage: a rejection is an answer, never an exception, so a bad
message can never stall its partition.

Idempotency: the schedule row records the (partition-local) offset of the last command
applied to it. A command at or below that offset is a replay after a crash (its Kafka
offset was not committed yet): it is answered again without being applied twice, and a
still-scheduled schedule is offered to the ticker again (the crash may have hit between
the write and the fire of a late create). Commands for one schedule are applied strictly
in offset order; different schedules in a batch are applied concurrently.

It must never raise out of ``process_batch`` for a bad message, and never answer before
the change is durable in Cassandra.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streams import metrics
from streams.partitioner import partition_for
from streams.store import (
    STATE_CANCELLED,
    STATE_FIRED,
    STATE_MISSED,
    STATE_SCHEDULED,
    BucketRow,
    ScheduleRow,
)
from streams.ticker import PartitionTicker, TriggerSink
from tocsin.errors import CommandRejected
from topics.codec import callback_to_json, encode_result
from topics.codes import ACCEPTED_CODES, Code
from topics.models import (
    CancelCommand,
    Command,
    CommandResult,
    CommandType,
    CreateCommand,
    ResultStatus,
    UpdateCommand,
)
from topics.validation import Limits, check_not_past, decode_command, salvage_ids

log = logging.getLogger("tocsin.commands")


@dataclass(frozen=True, slots=True)
class RawCommand:
    """One record of the commands topic, as read."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


class TenantCache:
    """Registered tenants, cached briefly so every command does not read Cassandra."""

    def __init__(self, store: Any, *, ttl_s: float = 10.0, negative_ttl_s: float = 1.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._cache: dict[str, tuple[float, dict[str, Any] | None]] = {}

    async def get(self, tenant: str) -> dict[str, Any] | None:
        now = time.monotonic()
        hit = self._cache.get(tenant)
        if hit is not None and hit[0] > now:
            return hit[1]
        row: dict[str, Any] | None = await self.store.get_tenant(tenant)
        ttl = self.ttl_s if row is not None else self.negative_ttl_s
        self._cache[tenant] = (now + ttl, row)
        return row


class CommandProcessor:
    def __init__(
        self,
        *,
        store: Any,
        sink: TriggerSink,
        tickers: Mapping[int, PartitionTicker],
        results_topic: str,
        partitions: int,
        limits: Limits,
        bucket_shards: int = 1,
        clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.store = store
        self.sink = sink
        self.tickers = tickers
        self.results_topic = results_topic
        self.partitions = partitions
        self.limits = limits
        self.bucket_shards = bucket_shards
        self.clock_ms = clock_ms
        self.tenants = TenantCache(store)

    async def process_batch(self, batch: Sequence[RawCommand]) -> list[CommandResult]:
        """Apply a batch and wait until every result is acknowledged by Kafka."""
        groups: dict[bytes | None, list[RawCommand]] = {}
        for msg in batch:
            # Keyless messages can't be ordered against anything: each is its own group.
            groups.setdefault(
                msg.key if msg.key is not None else object().__repr__().encode(), []
            ).append(msg)

        async def run_group(msgs: list[RawCommand]) -> list[CommandResult]:
            return [await self.handle(m) for m in msgs]

        per_group = await asyncio.gather(*(run_group(g) for g in groups.values()))
        results = [r for group in per_group for r in group]
        acks = [
            self.sink.send(
                self.results_topic,
                key=(r.schedule_id or "").encode() or None,
                value=encode_result(r),
            )
            for r in results
        ]
        await asyncio.gather(*acks)
        return results

    async def handle(self, msg: RawCommand) -> CommandResult:
        now = self.clock_ms()
        command: Command | None = None
        try:
            command = decode_command(msg.value or b"", key=msg.key, now_ms=now, limits=self.limits)
            code, text = await self._apply(command, msg, now)
        except CommandRejected as rej:
            code, text = Code(rej.code), rej.message
        result = self._result(msg, command, code, text, now)
        metrics.COMMANDS.labels(
            str(result.command or "unknown"), str(result.status), str(result.code)
        ).inc()
        if result.status == ResultStatus.REJECTED:
            log.info(
                "command rejected",
                extra={
                    "code": str(code),
                    "reason": text,
                    "partition": msg.partition,
                    "offset": msg.offset,
                    "schedule_id": result.schedule_id,
                },
            )
        return result

    def _result(
        self, msg: RawCommand, command: Command | None, code: Code, text: str, now: int
    ) -> CommandResult:
        tenant: str | None
        sid: str | None
        rid: str | None
        ctype: CommandType | None
        if command is not None:
            tenant, sid, rid, ctype = (
                command.tenant,
                command.schedule_id,
                command.request_id,
                command.type,
            )
        else:
            s = salvage_ids(msg.value or b"", msg.key)
            tenant, sid, rid, ctype = s.tenant, s.schedule_id, s.request_id, s.command
        status = ResultStatus.ACCEPTED if code in ACCEPTED_CODES else ResultStatus.REJECTED
        return CommandResult(
            schedule_id=sid,
            tenant=tenant,
            request_id=rid,
            command=ctype,
            status=status,
            code=code,
            message=text,
            at_ms=now,
            partition=msg.partition,
            offset=msg.offset,
        )

    # -- applying --------------------------------------------------------------------------

    async def _apply(self, command: Command, msg: RawCommand, now: int) -> tuple[Code, str]:
        tenant = await self.tenants.get(command.tenant)
        if tenant is None:
            raise CommandRejected(
                Code.UNKNOWN_TENANT, f"tenant {command.tenant!r} is not registered"
            )
        if tenant.get("active") is False:
            raise CommandRejected(Code.INACTIVE_TENANT, f"tenant {command.tenant!r} is deactivated")
        expected = partition_for(command.schedule_id.encode(), self.partitions)
        if expected != msg.partition:
            # Another partitioner than Kafka's default (murmur2) would split one schedule's
            # commands over partitions, and a cancel could miss the owner of its buckets.
            raise CommandRejected(
                Code.WRONG_PARTITION,
                f"schedule {command.schedule_id!r} belongs to partition {expected} "
                f"(murmur2 of the key) but arrived on {msg.partition}; produce with Kafka's "
                "default partitioner (librdkafka: partitioner=murmur2_random)",
            )
        existing_raw = await self.store.get_schedule(command.tenant, command.schedule_id)
        existing = ScheduleRow(**existing_raw) if existing_raw is not None else None
        if (
            existing is not None
            and existing.applied_offset is not None
            and msg.offset <= existing.applied_offset
        ):
            return await self._replayed(existing, msg, now)
        if isinstance(command, CreateCommand):
            return await self._create(command, existing, msg, now)
        if isinstance(command, UpdateCommand):
            return await self._update(command, existing, msg, now)
        return await self._cancel(command, existing, msg, now)

    async def _replayed(self, row: ScheduleRow, msg: RawCommand, now: int) -> tuple[Code, str]:
        if row.state == STATE_SCHEDULED:
            await self._hand_to_ticker(row, now)
        code = (
            Code(row.last_code) if (row.applied_offset == msg.offset and row.last_code) else Code.OK
        )
        return code, "already applied (replayed command)"

    async def _create(
        self, cmd: CreateCommand, existing: ScheduleRow | None, msg: RawCommand, now: int
    ) -> tuple[Code, str]:
        callback = callback_to_json(cmd.callback)
        if existing is not None:
            same = (
                existing.due_ms == cmd.due_ms
                and (existing.payload or b"") == cmd.payload
                and existing.payload_type == str(cmd.payload_type)
                and existing.callback == callback
                and existing.order_key == cmd.order_key
                and existing.misfire_tolerance_s == cmd.misfire_tolerance_s
            )
            if same:
                return Code.DUPLICATE, f"schedule {cmd.schedule_id!r} already exists unchanged"
            raise CommandRejected(
                Code.CONFLICT,
                f"schedule {cmd.schedule_id!r} already exists (state {existing.state}) with "
                "different content; use update, or a new schedule id",
            )
        row = ScheduleRow(
            tenant=cmd.tenant,
            schedule_id=cmd.schedule_id,
            partition=msg.partition,
            state=STATE_SCHEDULED,
            due_ms=cmd.due_ms,
            version=1,
            created_ms=msg.timestamp_ms,
            updated_ms=msg.timestamp_ms,
            order_key=cmd.order_key,
            payload=cmd.payload,
            payload_type=str(cmd.payload_type),
            callback=callback,
            misfire_tolerance_s=cmd.misfire_tolerance_s,
            applied_offset=msg.offset,
            last_code=str(Code.OK),
        )
        bucket = BucketRow.for_schedule(row, shards=self.bucket_shards)
        await self.store.apply_schedule_change(
            row, new_bucket=bucket, old_bucket=None, now_ms=msg.timestamp_ms, event="created"
        )
        await self._hand_to_ticker(row, now, bucket)
        return Code.OK, "scheduled"

    async def _update(
        self, cmd: UpdateCommand, existing: ScheduleRow | None, msg: RawCommand, now: int
    ) -> tuple[Code, str]:
        current = self._changeable(existing, cmd.schedule_id)
        tolerance = current.misfire_tolerance_s or self.limits.default_misfire_tolerance_s
        if cmd.due_ms is not None:
            check_not_past(cmd.due_ms, now_ms=now, misfire_tolerance_s=tolerance)
        row = ScheduleRow(
            **{
                **_as_dict(current),
                "due_ms": cmd.due_ms if cmd.due_ms is not None else current.due_ms,
                "payload": cmd.payload if cmd.payload is not None else current.payload,
                "payload_type": str(cmd.payload_type)
                if cmd.payload_type is not None
                else current.payload_type,
                "callback": callback_to_json(cmd.callback)
                if cmd.callback is not None
                else current.callback,
                "version": current.version + 1,
                "updated_ms": msg.timestamp_ms,
                "applied_offset": msg.offset,
                "last_code": str(Code.OK),
            },
        )
        old = BucketRow.for_schedule(current, shards=self.bucket_shards)
        new = BucketRow.for_schedule(row, shards=self.bucket_shards)
        ticker = self.tickers.get(msg.partition)
        if ticker is not None:
            # Tombstone the old version only: stale rows of it are refused, the new one isn't.
            ticker.withdraw(row.tenant, row.schedule_id, current.version)
        await self.store.apply_schedule_change(
            row, new_bucket=new, old_bucket=old.key, now_ms=msg.timestamp_ms, event="updated"
        )
        await self._hand_to_ticker(row, now, new)
        return Code.OK, "updated" if cmd.due_ms is None else "rescheduled"

    async def _cancel(
        self, cmd: CancelCommand, existing: ScheduleRow | None, msg: RawCommand, now: int
    ) -> tuple[Code, str]:
        current = self._changeable(existing, cmd.schedule_id)
        row = ScheduleRow(
            **{
                **_as_dict(current),
                "state": STATE_CANCELLED,
                "version": current.version + 1,
                "updated_ms": msg.timestamp_ms,
                "applied_offset": msg.offset,
                "last_code": str(Code.OK),
            }
        )
        ticker = self.tickers.get(msg.partition)
        if ticker is not None:
            ticker.withdraw(row.tenant, row.schedule_id, row.version)
        old = BucketRow.for_schedule(current, shards=self.bucket_shards)
        await self.store.apply_schedule_change(
            row, new_bucket=None, old_bucket=old.key, now_ms=msg.timestamp_ms, event="cancelled"
        )
        return Code.OK, "cancelled"

    def _changeable(self, existing: ScheduleRow | None, schedule_id: str) -> ScheduleRow:
        if existing is None:
            raise CommandRejected(Code.NOT_FOUND, f"no schedule {schedule_id!r}")
        if existing.state == STATE_CANCELLED:
            raise CommandRejected(
                Code.ALREADY_CANCELLED, f"schedule {schedule_id!r} was already cancelled"
            )
        ticker = self.tickers.get(existing.partition)
        firing = ticker is not None and ticker.is_firing(existing.tenant, existing.schedule_id)
        if existing.state in (STATE_FIRED, STATE_MISSED) or firing:
            raise CommandRejected(Code.ALREADY_FIRED, f"schedule {schedule_id!r} has already fired")
        return existing

    async def _hand_to_ticker(
        self, row: ScheduleRow, now: int, bucket: BucketRow | None = None
    ) -> None:
        ticker = self.tickers.get(row.partition)
        if ticker is None:
            return  # not owned here (rebalance in progress): the owner's bucket read finds it
        bucket = bucket or BucketRow.for_schedule(row, shards=self.bucket_shards)
        if row.due_ms <= now:
            # Late but within tolerance: fire at once, and only answer (and let the offset
            # be committed) once Kafka has it - a crash before then replays this command.
            await ticker.fire_now(bucket)
        else:
            ticker.offer(bucket)


def _as_dict(row: ScheduleRow) -> dict[str, Any]:
    return {f: getattr(row, f) for f in row.__dataclass_fields__}


__all__ = ["CommandProcessor", "CommandType", "RawCommand", "TenantCache"]

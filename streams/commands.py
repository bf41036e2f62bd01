"""The command agent: validate, apply idempotently, persist, answer. What each command
does is decided in ``streams.decisions`` (pure); this module reads, writes and answers.

One message of the commands topic in, one result on the command-results topic out, for
every message, including garbage: a rejection is an answer, never an exception, so a bad
message can never stall its partition.

A batch is applied in four steps, so a few requests serve hundreds of commands:
  1. decode and check each message (tenants from a short-lived cache; their limits are
     ``decisions.check_tenant_limits``);
  2. read the current rows of all named schedules (one IN query per tenant and 100 ids);
  3. decide each command against the row as it stands after the batch's earlier commands
     (``decisions.decide``: strict offset order per schedule);
  4. persist every change (bucket rows first, the schedule row as the commit point; see
     ``Store.apply_schedule_changes``), hand what is due soon to the partition's ticker
     (waiting for Kafka's acknowledgement of the trigger of each row already due or not
     above the ticker's checkpoint), and publish the results, waiting for Kafka's
     acknowledgement before the batch is done.

Idempotency: the schedule row records the (partition-local) offset of the last command
applied to it. A command at or below that offset is a replay after a crash (its Kafka
offset was not committed): it is answered again without being applied twice, and a
still-scheduled schedule is handed to the ticker again (the crash may have hit between the
write and the fire of a late create).

It must never raise out of ``process_batch`` for a bad message, and never answer before
the change is durable in Cassandra.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import orjson

from base.clock import Clock, now_ms
from base.errors import CommandRejected, KafkaError, TocsinError
from streams import metrics
from streams.cache import TtlCache
from streams.decisions import (
    DEFAULT_SIGNED_ORDER_SKEW_MS,
    Decision,
    Signed,
    Unrowed,
    check_tenant_limits,
    decide,
    due_entries,
    index_writes,
    is_replay,
    own_topics,
    recurring_index_changes,
    stopped_backfills,
    with_default_retry,
    with_retention,
)
from streams.materializer import PartitionMaterializer
from streams.model import (
    DEFAULT_RETENTION_S,
    BucketRow,
    ScheduleChange,
    ScheduleRow,
    ScheduleState,
)
from streams.partitioner import partition_for
from streams.ports import CommandStore, CqlRow, TenantReader
from streams.recurring_store import RecurringStore
from streams.refusals import COMMAND_REFUSED, Refusal, RefusalBook, record_refusals
from streams.signed_store import SignedStore, unrowed_of
from streams.store import load_schedule_rows
from streams.tenants import QuotaBook, TenantConfig
from streams.ticker import PartitionTicker, TriggerSink
from streams.tracing import NO_TRACES, CommandTraces
from topics.admission import Admission, AdmissionKeys, Unverified
from topics.codec import encode_result
from topics.codes import ACCEPTED_CODES, Code
from topics.models import (
    BackfillCommand,
    CancelCommand,
    Command,
    CommandResult,
    CommandType,
    CreateCommand,
    PauseCommand,
    ResultStatus,
    TriggerCommand,
)
from topics.signing import (
    SeenSignatures,
    SigningKeys,
    TimestampType,
    check_signature,
    header_map,
    mac_prefix,
    signed_fields,
)
from topics.validation import Limits, decode_command, salvage_ids

log = logging.getLogger("tocsin.commands")

# How the history of a create answered 201 at Kafka's acknowledgement (topics.admission)
# that its worker could not store begins (the API answers GET with it: 410 ``refused``).
ADMITTED_REFUSED = "create admitted by the API, refused by the worker"
# Backoff of a batch waiting for Cassandra or Kafka to come back.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
# Counted on every admitted create: the child looked up once, not by label each time.
_HONOURED = metrics.ADMISSIONS.labels("honoured")


@dataclass(frozen=True, slots=True)
class RawCommand:
    """One record of the commands topic, as read."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    # Kafka headers as (name, value) pairs; carry the tenant signature (topics.signing).
    headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] = ()
    # Whether ``timestamp_ms`` is the broker's: only then can a signature's freshness be
    # judged (topics.signing), so a record of unknown origin counts as producer time.
    timestamp_type: TimestampType = TimestampType.CREATE_TIME


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """One tenant as the command agent checks it: its row (None: not registered), its
    parsed configuration (defaults for an unknown tenant) and its signing keys, parsed once
    per cache load rather than once per command."""

    row: CqlRow | None
    config: TenantConfig
    keys: SigningKeys


class TenantCache:
    """Registered tenants, cached briefly so every command does not read Cassandra; a
    change (config, deactivation, new signing key) applies within ``ttl_s`` everywhere
    without a restart. Shared by the command agent and the REST API. One read in flight
    per tenant (streams.cache): concurrent API requests share a refresh."""

    def __init__(
        self, store: TenantReader, *, ttl_s: float = 5.0, negative_ttl_s: float = 1.0
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._cache: TtlCache[str, TenantEntry] = TtlCache(
            self._load, ttl_s=lambda e: self.ttl_s if e.row is not None else self.negative_ttl_s
        )

    def peek(self, tenant: str) -> TenantConfig | None:
        """The cached config without waiting (for the ticker, which decides synchronously):
        None when the tenant was never read. An expired or missing entry is refreshed in
        the background, so the answer is at most one TTL plus one read old."""
        hit = self._cache.peek(tenant)
        return hit.config if hit is not None else None

    async def get(self, tenant: str) -> CqlRow | None:
        return (await self._cache.get(tenant)).row

    async def config(self, tenant: str) -> TenantConfig:
        """The tenant's parsed configuration (defaults for an unknown tenant)."""
        return (await self._cache.get(tenant)).config

    async def entry(self, tenant: str) -> TenantEntry:
        """Row, configuration and signing keys in one look-up (the command agent's)."""
        return await self._cache.get(tenant)

    def invalidate(self, tenant: str) -> None:
        self._cache.invalidate(tenant)

    async def _load(self, tenant: str) -> TenantEntry:
        row: CqlRow | None = await self.store.get_tenant(tenant)
        return TenantEntry(
            row=row,
            config=TenantConfig.from_json(row.get("config") if row else None),
            keys=SigningKeys.of_row(row),
        )


class CommandProcessor:
    def __init__(
        self,
        *,
        store: CommandStore,
        sink: TriggerSink,
        tickers: Mapping[int, PartitionTicker],
        results_topic: str,
        partitions: int,
        limits: Limits,
        bucket_shards: int = 1,
        clock_ms: Clock = now_ms,
        tenant_ttl_s: float = 5.0,
        require_signed: bool = True,
        results_sink: TriggerSink | None = None,
        fired_retention_s: int = DEFAULT_RETENTION_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        assigned: Callable[[int], bool] | None = None,
        admission: AdmissionKeys | None = None,
        signed_order_skew_ms: int = DEFAULT_SIGNED_ORDER_SKEW_MS,
    ) -> None:
        self.sleep = sleep
        # The signers' clock difference tolerated in a schedule's signed-command order
        # (decisions.check_signed_order; TOCSIN_SIGNED_ORDER_SKEW_MS). Below 0 it would keep
        # no signature, not even the newest: 0 is the strictest order.
        self.signed_order_skew_ms = max(0, signed_order_skew_ms)
        # The API-only admission keys (topics.admission): a one-shot create an API stamped
        # was answered 201 at Kafka's acknowledgement, so it is stored without deciding
        # again what the API decided (``_honoured``). None: no stamp is honoured.
        self.admission = admission or AdmissionKeys()
        # Whether the consumer group has this commands partition assigned to this worker
        # right now (the worker asks its Kafka consumer); None: every partition is (no
        # consumer group: tests, tools). See ``_still_assigned``.
        self.assigned = assigned
        # Given the withdrawals of a decision made while its partition had no running
        # ticker here (a batch past its ``assigned`` check when a rebalance came): the
        # command's replay withdraws nothing, so the worker applies them to the partition's
        # next ticker here, resumed or fresh (streams.app.Ownership); None: dropped.
        self.unwithdrawn: Callable[[int, Callable[[PartitionTicker], None]], None] | None = None
        self.require_signed = require_signed
        self.fired_retention_s = fired_retention_s
        self.store = store
        self.sink = sink
        # Where results go (default: ``sink``). The worker gives results a producer without
        # linger: a batch is done (and the next one starts) only once they are acknowledged.
        self.results_sink = results_sink or sink
        self.tickers = tickers
        self.results_topic = results_topic
        self.partitions = partitions
        self.limits = limits
        self.bucket_shards = bucket_shards
        self.clock_ms = clock_ms
        self.tenants = TenantCache(store, ttl_s=tenant_ttl_s)
        # Recurring schedules (streams.materializer), set by the worker: the materialisers
        # of owned partitions (their lock is held for a batch) and their horizon.
        self.materializers: Mapping[int, PartitionMaterializer] = {}
        self.recurring = RecurringStore(store)
        self.signed_store = SignedStore(store)
        self.recurring_horizon_ms = 600_000
        self.quotas = QuotaBook(partitions)
        # Per partition (so bounded by the partition count): signatures of verified
        # commands within the freshness window, to refuse copies of them.
        self.seen_signatures: dict[int, SeenSignatures] = {}
        # The same for admission stamps (a copy of an admitted record is refused).
        self.seen_admissions: dict[int, SeenSignatures] = {}
        # Tocsin's own topics: a Kafka callback may never produce into them.
        self.internal_topics = own_topics(results_topic)
        # Refusals of a proven tenant's existing schedule go to its history, bounded.
        self.refusals = RefusalBook()

    async def process_batch(self, batch: Sequence[RawCommand]) -> list[CommandResult]:
        """Apply a batch and wait until every result is acknowledged by Kafka.

        Holds the batch's partitions' materialiser locks, so no recurring schedule is
        extended between being read and being written here (streams.materializer)."""
        async with contextlib.AsyncExitStack() as stack:
            for partition in sorted({m.partition for m in batch}):
                materializer = self.materializers.get(partition)
                if materializer is not None:
                    await stack.enter_async_context(materializer.lock)
            # Each command's trace context (and, tracing on, its span until answered).
            traces = CommandTraces(batch)
            stack.callback(traces.close)
            return await self._process_batch(batch, traces)

    async def _process_batch(
        self, batch: Sequence[RawCommand], traces: CommandTraces = NO_TRACES
    ) -> list[CommandResult]:
        now = self.clock_ms()
        outcomes: list[tuple[Command | None, Code, str]] = []
        valid: list[tuple[int, Command]] = []
        policies: dict[str, TenantConfig] = {}
        # Index -> reply_nonce to echo: only for commands that proved their tenant.
        nonces: dict[int, str] = {}
        # Indexes of creates an API admitted (answered 201 already): stored, not re-decided.
        admitted: dict[int, bool] = {}
        # Index -> the verified signature of a tenant-signed command (None: admitted or
        # unsigned): decided only if after the last one applied to its schedule, and
        # recorded with the row it writes.
        signed: dict[int, Signed | None] = {}
        # Records whose admission stamp verifies (an API answered them 201) refused before
        # any decision: the refusal goes to the schedule's history (_record_admitted_refusal).
        refused_admitted: list[tuple[RawCommand, CommandRejected]] = []
        for index, msg in enumerate(batch):
            command: Command | None = None
            verified = self._honoured(msg)
            try:
                command, honoured = self._decode(msg, now, verified)
                # One cache look-up per command for all three checks.
                tenant = await self.tenants.entry(command.tenant)
                admitted[index], signed[index] = self._check_origin(
                    command, msg, now, tenant, honoured
                )
                if command.reply_nonce is not None:
                    nonces[index] = command.reply_nonce
                self._check_tenant_policy(command, now, tenant.config, admitted=admitted[index])
                policies[command.tenant] = tenant.config
                valid.append((index, command))
                outcomes.append((command, Code.OK, ""))
            except CommandRejected as rej:
                outcomes.append((command, Code(rej.code), rej.message))
                # A copy's original was decided on its own: no news for the tenant.
                copy = rej.code == Code.REPLAYED_COMMAND
                refused_admitted.extend([(msg, rej)] if verified and not copy else [])

        current = await load_schedule_rows(
            self.store, ((command.tenant, command.schedule_id) for _, command in valid)
        )
        unrowed = await self._unrowed(valid, signed)
        decisions: list[tuple[RawCommand, Decision]] = []
        refused: list[Refusal] = []
        for index, command in valid:
            msg = batch[index]
            key = (command.tenant, command.schedule_id)
            ticker = self.tickers.get(msg.partition)
            if isinstance(command, (PauseCommand, CancelCommand)):
                # A pause is decided on what the ticker may still emit, and both stop the
                # backfilled runs it holds (withdraw_backfill): without the ticker (a
                # rebalance under way) they wait for one, like a hand-over.
                ticker = self._stopping_view(command, msg.partition)
            firing = ticker is not None and ticker.is_firing(*key)
            existing = current.get(key)
            replay = is_replay(existing, msg.offset)
            command = with_default_retry(command, policies[command.tenant], existing)
            quota = policies[command.tenant].create_quota_per_s
            if not replay and self._over_quota(command, msg.partition, quota, admitted[index]):
                outcomes[index] = (
                    command,
                    Code.QUOTA_EXCEEDED,
                    f"tenant {command.tenant!r} exceeded its create quota of {quota:g} "
                    "commands/s; nothing was applied, retry later",
                )
                _note_refusal(refused, command, existing, *outcomes[index][1:], replay)
                continue
            try:
                decision = decide(
                    command,
                    current.get(key),
                    msg,
                    now_ms=now,
                    shards=self.bucket_shards,
                    default_tolerance_s=self.limits.default_misfire_tolerance_s,
                    firing=firing,
                    horizon_ms=self.recurring_horizon_ms,
                    unemitted=ticker,
                    signed=signed[index],
                    unrowed=unrowed.get(key),
                    signed_order_skew_ms=self.signed_order_skew_ms,
                )
            except CommandRejected as rej:
                outcomes[index] = (command, Code(rej.code), rej.message)
                _note_refusal(refused, command, current.get(key), *outcomes[index][1:], replay)
                admitted_refused(msg, command, Code(rej.code), rej.message, admitted[index])
                continue
            decision = traces.stamp(decision, command, msg)
            outcomes[index] = (command, decision.code, decision.text)
            if decision.change is not None:
                current[key] = decision.change.row
                _note_unrowed(unrowed, key, decision.change)
            decisions.append((msg, decision))

        await self._persist(decisions, now, policies)
        await record_refusals(self.store, self.refusals, refused, policies, now)
        await self._record_admitted_refusals(refused_admitted)
        results = [
            self._result(msg, *outcome, now, reply_nonce=nonces.get(index))
            for index, (msg, outcome) in enumerate(zip(batch, outcomes, strict=True))
        ]
        # One counter update per outcome, not per command (a label lookup each).
        outcomes_seen: Counter[tuple[str, str, str]] = Counter(
            (str(r.command or "unknown"), str(r.status), str(r.code)) for r in results
        )
        for labels, count in outcomes_seen.items():
            metrics.COMMANDS.labels(*labels).inc(count)
        for result in results:
            if result.status == ResultStatus.REJECTED:
                log.info(
                    "command rejected",
                    extra={
                        "code": str(result.code),
                        "reason": result.message,
                        "partition": result.partition,
                        "offset": result.offset,
                        "schedule_id": result.schedule_id,
                    },
                )
        acks = [
            self.results_sink.send(
                self.results_topic,
                key=(r.schedule_id or "").encode() or None,
                value=encode_result(r),
            )
            for r in results
        ]
        await asyncio.gather(*acks)
        return results

    async def _unrowed(
        self, valid: Sequence[tuple[int, Command]], signed: Mapping[int, Signed | None]
    ) -> dict[tuple[str, str], Unrowed]:
        """The ``signed_without_row`` records of the batch's signed triggers and backfills,
        which write no schedule row to hold their signatures (streams.signed_store); no
        request for a batch without one."""
        wanted = [
            (command.tenant, command.schedule_id)
            for index, command in valid
            if signed[index] is not None and isinstance(command, TriggerCommand | BackfillCommand)
        ]
        rows = await self.signed_store.read(wanted)
        return {
            key: Unrowed(int(at), bytes(row.get("signed_macs") or b""), int(offset))
            for key, row in rows.items()
            if (at := row.get("signed_at_ms")) is not None
            and (offset := row.get("applied_offset")) is not None
        }

    def _decode(
        self, msg: RawCommand, now: int, honoured: Admission | None
    ) -> tuple[Command, Admission | None]:
        """The command, and its admission (``honoured``: its stamp verified) when it is a
        one-shot create an API admitted."""
        if honoured is not None:
            command = self._decode_admitted(msg, honoured)
            if command is not None:
                return command, honoured
        command = decode_command(msg.value or b"", key=msg.key, now_ms=now, limits=self.limits)
        return command, None

    def _over_quota(self, command: Command, partition: int, quota: float, admitted: bool) -> bool:
        """Whether the tenant's create quota refuses the command. An admitted create was
        counted by the API's share of the quota: it is debited here, never refused, so the
        tenant's creates produced to the topic directly still see the budget it used."""
        if admitted:
            self.quotas.debit(command.tenant, partition, quota, time.monotonic())
            return False
        return not self.quotas.allow(command.tenant, partition, quota, time.monotonic())

    def _verify_stamp(self, msg: RawCommand) -> Admission | Unverified | None:
        """``AdmissionKeys.verify`` of the record's admission stamp."""
        return self.admission.verify(
            header_map(msg.headers),
            record_key=msg.key,
            value=msg.value or b"",
            record_ms=msg.timestamp_ms,
            timestamp_type=msg.timestamp_type,
        )

    def _honoured(self, msg: RawCommand) -> Admission | None:
        """The record's admission stamp when it verifies here; None when it has none or it
        does not verify (then the command is decided like any other, logged and counted:
        a tenant producing a forged stamp, or an admission key this worker lacks)."""
        if not self.admission.enabled:
            return None
        got = self._verify_stamp(msg)
        if isinstance(got, str):
            # A stamp that matched no key here or no broker time is a 201 this worker now
            # decides in full: a misconfiguration (docs/operations.md, the alert), unlike
            # a stamp that does not match (a tenant's forgery).
            metrics.ADMISSIONS.labels(got.outcome).inc()
            log.log(
                logging.WARNING if got.outcome == "unverified" else logging.ERROR,
                "admission stamp not honoured; deciding the command in full",
                extra={
                    "reason": str(got),
                    "outcome": got.outcome,
                    "partition": msg.partition,
                    "offset": msg.offset,
                },
            )
            return None
        return got

    def _decode_admitted(self, msg: RawCommand, admission: Admission) -> Command | None:
        """An admitted record decoded as the API decoded it, at its admission time (a due
        time within the misfire tolerance then is not ``due_in_past`` after a worker
        outage); None when it is not a one-shot create (only those are admitted), which is
        then decoded and decided like any other."""
        try:
            command = self._admitted_create(msg, admission)
        except CommandRejected as rej:
            # The API decoded it at that time: only a worker configured with other limits
            # (TOCSIN_MAX_PAYLOAD_BYTES...) than the API refuses it here. Counted as refused
            # if the full decision refuses it too (_record_admitted_refusal).
            log.error(
                "an admitted command does not decode here; deciding it in full",
                extra={"code": rej.code, "reason": rej.message, "offset": msg.offset},
            )
            return None
        if command is not None:
            _HONOURED.inc()
        return command

    def _admitted_create(self, msg: RawCommand, admission: Admission) -> CreateCommand | None:
        """The one-shot create of an admitted record, decoded at its admission time; None
        for any other command (only those are admitted). Raises CommandRejected."""
        command = decode_command(
            msg.value or b"", key=msg.key, now_ms=admission.admitted_at_ms, limits=self.limits
        )
        if not isinstance(command, CreateCommand) or command.recurrence is not None:
            return None
        return command

    def _check_admission_copy(self, msg: RawCommand, admission: Admission) -> None:
        """A second record carrying an admission stamp already read at another offset of
        the partition is a copy (``replayed_command``); the same offset is the same record."""
        seen = self.seen_admissions.get(msg.partition)
        if seen is None:
            seen = self.seen_admissions[msg.partition] = SeenSignatures()
        first = seen.first_offset(
            admission.mac,
            offset=msg.offset,
            signed_at_ms=admission.admitted_at_ms,
            record_ms=msg.timestamp_ms,
        )
        if first is not None:
            raise CommandRejected(
                Code.REPLAYED_COMMAND,
                f"the same admitted record was read at offset {first} of partition "
                f"{msg.partition}; a copy is not applied",
            )

    def _check_sender(self, command: Command, msg: RawCommand, tenant: CqlRow | None) -> None:
        if tenant is None:
            raise CommandRejected(
                Code.UNKNOWN_TENANT, f"tenant {command.tenant!r} is not registered"
            )
        if tenant.get("active") is False:
            raise CommandRejected(Code.INACTIVE_TENANT, f"tenant {command.tenant!r} is deactivated")
        self._check_partition(command, msg)

    def _check_partition(self, command: Command, msg: RawCommand) -> None:
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

    def _check_signature(
        self, command: Command, msg: RawCommand, now: int, keys: SigningKeys
    ) -> Signed | None:
        """The command comes from its tenant, freshly: signed with its key (the current
        one, or the previous one during a rotation), within the window of the broker's
        append time, and not a copy of a record already read (topics.signing). A tenant
        without a key passes only where unsigned commands are allowed. The tenant row is
        cached with its keys parsed. Returns the verified signature (None: unsigned).

        The signatures read are remembered in memory only, so a copy produced after a
        restart, or after the partition moved, passes here: the schedule row's signed
        time refuses it (``decisions.check_signed_order``)."""
        if keys.current is None:
            if self.require_signed:
                raise CommandRejected(
                    Code.BAD_SIGNATURE,
                    f"tenant {command.tenant!r} has no signing key, so none of its commands "
                    "can be verified; give it one (`tocsin tenant rotate-key`) or, for a "
                    "trusted network only, set TOCSIN_REQUIRE_SIGNED_COMMANDS=false",
                )
            return None
        headers = header_map(msg.headers)
        failed = check_signature(
            keys,
            headers,
            key=msg.key,
            value=msg.value or b"",
            record_ms=msg.timestamp_ms,
            timestamp_type=msg.timestamp_type,
            now_ms=now,
        )
        if failed is not None:
            raise CommandRejected(*failed)
        signed = signed_fields(headers)
        assert signed is not None  # it verified
        seen = self.seen_signatures.get(msg.partition)
        if seen is None:
            seen = self.seen_signatures[msg.partition] = SeenSignatures()
        first = seen.first_offset(
            signed[1], offset=msg.offset, signed_at_ms=signed[0], record_ms=msg.timestamp_ms
        )
        if first is not None:
            raise CommandRejected(
                Code.REPLAYED_COMMAND,
                f"the same signed record was read at offset {first} of partition "
                f"{msg.partition}; a copy is not applied (sign each command anew)",
            )
        return Signed(signed[0], mac_prefix(signed[1]))

    def _check_origin(
        self,
        command: Command,
        msg: RawCommand,
        now: int,
        tenant: TenantEntry,
        honoured: Admission | None,
    ) -> tuple[bool, Signed | None]:
        """The command comes from its tenant, or from an API that admitted it: (admitted,
        the tenant's verified signature, None when admitted or unsigned)."""
        if honoured is not None:
            # The API decided the tenant, its limits, its quota and its key when it
            # admitted the create; only what it cannot know is decided here.
            self._check_partition(command, msg)
            self._check_admission_copy(msg, honoured)
            return True, None
        self._check_sender(command, msg, tenant.row)
        return False, self._check_signature(command, msg, now, tenant.keys)

    def _check_tenant_policy(
        self, command: Command, now: int, config: TenantConfig, *, admitted: bool = False
    ) -> None:
        """The tenant's own limits (its cached configuration); an admitted create's were
        judged by the API that admitted it."""
        if admitted:
            return
        check_tenant_limits(
            command,
            config,
            now_ms=now,
            default_retention_s=self.fired_retention_s,
            internal_topics=self.internal_topics,
        )

    async def _persist(
        self,
        decisions: list[tuple[RawCommand, Decision]],
        now: int,
        policies: Mapping[str, TenantConfig],
    ) -> None:
        """Make the batch's decisions durable, then hand what is due soon to the tickers."""
        # A pause decided on the tickers' state (Unemitted) withdraws its runs here, before
        # anything is awaited: nothing the ticker holds can fire in between.
        self._withdraw(decisions)
        changes = [
            with_retention(d.change, policies.get(d.change.row.tenant))
            for _, d in decisions
            if d.change is not None
        ]
        if changes:
            await self._write_changes(changes, now)
        for _, d in decisions:
            if d.change is not None and (d.skipped_paused or d.missed):
                tenant = d.change.row.tenant
                metrics.count_skipped(tenant, metrics.SkipReason.PAUSED, d.skipped_paused)
                if d.missed:
                    metrics.count_missed(tenant, metrics.MissCause.TOLERANCE)
        self._notify_materializers(decisions)
        await self._hand_over_all(decisions)

    def _withdraw(self, decisions: Sequence[tuple[RawCommand, Decision]]) -> None:
        """Before persisting: the tickers refuse the rows the decisions replace."""
        for msg, d in decisions:
            ticker = self.tickers.get(msg.partition)
            if ticker is not None:
                _withdraw_replaced(ticker, d)
            elif self.unwithdrawn is not None and _replaces(d):
                self.unwithdrawn(msg.partition, functools.partial(_withdraw_replaced, d=d))

    async def _write_changes(self, changes: Sequence[ScheduleChange], now: int) -> None:
        """The changes, with the listing indexes and the due-queue entries they need written
        before the schedule rows (together with the bucket rows): a crash before the
        schedule row replays the command, which rewrites them (see the 002 migration)."""
        indexes = index_writes(changes)
        recurring = recurring_index_changes(changes)
        # Parents with a new key get their due-queue entry before their row, too.
        due = due_entries([c.row for c in changes if c.write_row], self.materializers, now)

        async def write_index() -> None:
            for put, drop, retention in indexes:
                await self.store.write_index(put, drop, now_ms=now, retention_s=retention)
            if recurring:
                await self.store.write_recurring_index(recurring)
            if due:
                await self.recurring.put_due(due)

        await self.store.apply_schedule_changes(
            changes,
            before_commit=write_index if (indexes or recurring or due) else None,
        )

    def _notify_materializers(self, decisions: Sequence[tuple[RawCommand, Decision]]) -> None:
        """Recurring parents just written: their runs are written now rather than when the
        materialiser's reader gets to their due-queue entry."""
        for msg, d in decisions:
            change = d.change
            if change is not None and change.write_row and change.row.recurrence is not None:
                materializer = self.materializers.get(msg.partition)
                if materializer is not None:
                    materializer.notify(change.row.tenant, change.row.schedule_id)

    async def _hand_over_all(self, decisions: Sequence[tuple[RawCommand, Decision]]) -> None:
        pending: list[asyncio.Future[None]] = []
        for _, d in decisions:
            if d.hand_over is not None:
                fire = self._hand_to_ticker(d.hand_over)
                if fire is not None:
                    pending.append(fire)
            if d.fire_now is not None:
                # A trigger command's run is in no bucket: only Kafka makes it durable, so
                # its command waits for the acknowledgement (a replay fires it again).
                ticker = self._ticker_of(d.fire_now.partition)
                if ticker is not None:
                    pending.append(asyncio.ensure_future(ticker.fire_now(d.fire_now)))
            for run in d.hand_over_runs:
                # A backfill's rows are written and due ahead: held in memory when their
                # minute is loaded already, else read with it (a checkpoint left above
                # them by a clock that ran ahead is written back first).
                ticker = self._ticker_of(run.partition)
                fire = ticker.hand_over(run) if ticker is not None else None
                if fire is not None:
                    pending.append(fire)
        if pending:
            # Due already: answered (so the offset can be committed) only once Kafka has
            # the trigger, since a successor would start past its row. Not due but not
            # above the ticker's checkpoint (a previous owner's clock ran ahead): once that
            # checkpoint is written back below it. A crash before either replays the
            # command, which hands the row over again.
            await asyncio.gather(*pending)

    async def process_until_answered(self, batch: Sequence[RawCommand]) -> list[RawCommand]:
        """Process a batch until every command in it is answered, or left to the
        partition's new owner; returns those left (their offsets must not be committed).

        A retriable failure (Cassandra or Kafka unavailable, a timeout) is waited out with
        backoff: the commands are neither rejected nor lost, and a retry after a partial
        write is safe, since each schedule row records the offset it applied (a replay is
        answered with the original outcome, nothing is applied twice). Any other failure
        (the store refusing a write for good, a bug) cannot succeed by waiting, so the
        batch is split and its commands applied one at a time: the one that fails on its
        own is answered ``store_rejected`` or ``internal_error`` and every other command
        proceeds. Nothing leaves this method unanswered but commands of partitions no
        longer assigned to this worker (``_still_assigned``), and it raises nothing but
        cancellation."""
        left: list[RawCommand] = []
        delay = RETRY_FIRST_S
        while True:
            batch = self._still_assigned(batch, left)
            if not batch:
                return left
            try:
                await self.process_batch(batch)
                return left
            except Exception as exc:
                if not (isinstance(exc, TocsinError) and exc.retriable):
                    failure = exc
                    break
                log.warning(
                    "store or broker unavailable; retrying the command batch",
                    extra={"commands": len(batch), "error": str(exc), "retry_s": delay},
                )
                await self.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        if len(batch) > 1:
            log.warning(
                "a command batch failed for good; applying its commands one at a time",
                extra={"commands": len(batch), "error": str(failure)},
            )
            for msg in batch:
                left.extend(await self.process_until_answered([msg]))
            return left
        if isinstance(failure, TocsinError):
            code, text = Code.STORE_REJECTED, str(failure)
        else:
            log.error(
                "command failed unexpectedly",
                exc_info=failure,
                extra={"partition": batch[0].partition, "offset": batch[0].offset},
            )
            code, text = Code.INTERNAL_ERROR, f"{type(failure).__name__}: {failure}"
        await self._admitted_failed(batch[0], code, text)
        delay = RETRY_FIRST_S
        while True:
            if not self._still_assigned(batch, left):
                return left
            try:
                await self.answer(batch[0], code, text)
                return left
            except TocsinError as exc:
                log.warning(
                    "cannot send a command's answer; retrying",
                    extra={"error": str(exc), "retry_s": delay},
                )
                await self.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)

    async def _admitted_failed(self, msg: RawCommand, code: Code, text: str) -> None:
        """An admitted create that failed on its own (the store refusing it for good, a
        defect): its tenant was answered 201, so the refusal goes where the tenant sees it,
        the schedule's history (``GET /v1/schedules/{id}`` answers 410 ``refused`` with
        it), besides the alert (log, ``tocsin_admissions_total{outcome="refused"}``).
        Best effort: the store may refuse that too, and the log and counter remain."""
        admission = self._verify_stamp(msg)
        if not isinstance(admission, Admission):
            return
        try:
            command = self._admitted_create(msg, admission)
        except CommandRejected:
            command = None
        if command is None:
            return
        admitted_refused(msg, command, code, text)
        try:
            await self.store.record_event(
                command.tenant,
                command.schedule_id,
                COMMAND_REFUSED,
                at_ms=self.clock_ms(),
                detail=f"{ADMITTED_REFUSED}: {code}: {text}"[:512],
            )
        except TocsinError as exc:
            log.error(
                "cannot record an admitted create's refusal",
                extra={"schedule_id": command.schedule_id, "error": str(exc)},
            )

    async def _record_admitted_refusals(
        self, refused: Sequence[tuple[RawCommand, CommandRejected]]
    ) -> None:
        for msg, rej in refused:
            await self._record_admitted_refusal(msg, Code(rej.code), rej.message)

    async def _record_admitted_refusal(self, msg: RawCommand, code: Code, text: str) -> None:
        """A record whose admission stamp verified, refused before it was decided (decoded
        under other limits than its API's): its tenant was answered 201, and the answer on
        command-results reaches no one, so the refusal goes to the schedule's history
        (``GET`` answers 410 ``refused``) besides the alert. A retriable store error
        retries the batch (nothing else of it is written twice: a replay is answered from
        the row). ``wrong_partition`` is the alert only: either every command goes astray
        (an API with another partition count) or the record is a copy someone who reads
        the topic put on another partition, whose original is stored on its own and must
        not read as refused."""
        ids = admitted_ids(msg)
        if ids is None:
            return
        tenant, schedule_id = ids
        _alert_refused(msg, tenant, schedule_id, code, text)
        if code == Code.WRONG_PARTITION:
            return
        try:
            await self.store.record_event(
                tenant,
                schedule_id,
                COMMAND_REFUSED,
                at_ms=self.clock_ms(),
                detail=f"{ADMITTED_REFUSED}: {code}: {text}"[:512],
            )
        except TocsinError as exc:
            if exc.retriable:
                raise
            log.error(
                "cannot record an admitted create's refusal",
                extra={"schedule_id": schedule_id, "error": str(exc)},
            )

    def _still_assigned(
        self, batch: Sequence[RawCommand], left: list[RawCommand]
    ) -> Sequence[RawCommand]:
        """The commands of ``batch`` whose partition is still assigned to this worker; the
        others are added to ``left``, unanswered.

        A command is answered only by the worker the consumer group assigns its partition
        to. Once it is assigned elsewhere (a rebalance while the command was being
        applied or waited for its trigger), an answer from here would be wrong: its
        row may be at or below the checkpoint the ticker wrote on release, so the new
        owner's bucket read would not find it, and only the new owner's replay of the
        command (from the offset committed last, which this one must not pass) makes
        it fire. Applied twice is safe: each schedule row records the offset it applied."""
        if self.assigned is None:
            return batch
        gone = {p for p in {msg.partition for msg in batch} if not self.assigned(p)}
        if not gone:
            return batch
        kept = [msg for msg in batch if msg.partition not in gone]
        dropped = [msg for msg in batch if msg.partition in gone]
        left.extend(dropped)
        log.warning(
            "partition no longer assigned here; its commands are left to its new owner",
            extra={"partitions": sorted(gone), "commands": len(dropped)},
        )
        return kept

    async def answer(self, msg: RawCommand, code: Code, text: str) -> CommandResult:
        """Answer one command with ``code`` without applying it (a command whose batch
        failed for a reason of its own); waits until Kafka acknowledges the answer."""
        now = self.clock_ms()
        command: Command | None
        try:
            command = decode_command(msg.value or b"", key=msg.key, now_ms=now, limits=self.limits)
        except CommandRejected:
            command = None
        nonce = None
        if command is not None and command.reply_nonce is not None:
            nonce = command.reply_nonce if await self._proves_tenant(command, msg, now) else None
        result = self._result(msg, command, code, text, now, reply_nonce=nonce)
        labels = (str(result.command or "unknown"), str(result.status), str(code))
        metrics.COMMANDS.labels(*labels).inc()
        log.warning(
            "command rejected on its own",
            extra={
                "code": str(code),
                "reason": text,
                "partition": msg.partition,
                "offset": msg.offset,
                "schedule_id": result.schedule_id,
            },
        )
        await self.results_sink.send(
            self.results_topic,
            key=(result.schedule_id or "").encode() or None,
            value=encode_result(result),
        )
        return result

    async def _proves_tenant(self, command: Command, msg: RawCommand, now: int) -> bool:
        """Whether a command answered on its own may have its reply_nonce echoed: its
        signature verifies now. A failure to tell (the tenant unreadable) means no echo;
        the requester then times out rather than trust an unverified answer."""
        try:
            tenant = await self.tenants.get(command.tenant)
        except TocsinError:
            return False
        keys = SigningKeys.of_row(tenant)
        if keys.current is None:
            return not self.require_signed
        failed = check_signature(
            keys,
            header_map(msg.headers),
            key=msg.key,
            value=msg.value or b"",
            record_ms=msg.timestamp_ms,
            timestamp_type=msg.timestamp_type,
            now_ms=now,
        )
        return failed is None

    def _hand_to_ticker(self, row: ScheduleRow) -> asyncio.Future[None] | None:
        """Give the partition's ticker a row just written; a future to wait for before
        answering, or None. The ticker decides by its own clock and checkpoint
        (PartitionTicker.hand_over): the batch's clock is older than the write, and the
        checkpoint may have been written by a previous owner whose clock ran ahead."""
        ticker = self._ticker_of(row.partition)
        if ticker is None:
            return None
        return ticker.hand_over(BucketRow.for_schedule(row, shards=self.bucket_shards))

    def _ticker_of(self, partition: int) -> PartitionTicker | None:
        """The partition's running ticker; None where there are no tickers at all (tests,
        tools: nothing fires here)."""
        ticker = self.tickers.get(partition)
        if ticker is None and self.assigned is not None:
            # Released (its ticker stopped) but, as far as this worker's consumer knows,
            # not yet assigned elsewhere: nothing makes the row durable now, so the
            # batch is retried until the partition is either back (a new ticker) or
            # gone (its commands left to the new owner: _still_assigned).
            raise KafkaError(
                f"partition {partition} has no running ticker here (being rebalanced)",
                retriable=True,
            )
        return ticker

    def _stopping_view(self, command: Command, partition: int) -> PartitionTicker | None:
        """The ticker a pause or cancel is decided on. Until it has read its checkpoint it
        can only say that anything an hour back may still come, and a pause decided on that
        would withdraw the runs a previous owner fired (deleting their history, taking them
        off ``run_count``): the batch is retried until it is read, like a hand-over."""
        ticker = self._ticker_of(partition)
        if isinstance(command, PauseCommand) and ticker and ticker.fired_before_ms is None:
            raise KafkaError(
                f"partition {partition}: its ticker has not read its checkpoint yet",
                retriable=True,
            )
        return ticker

    def _result(
        self,
        msg: RawCommand,
        command: Command | None,
        code: Code,
        text: str,
        now: int,
        *,
        reply_nonce: str | None = None,
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
            reply_nonce=reply_nonce,
        )


__all__ = [
    "ADMITTED_REFUSED",
    "CommandProcessor",
    "RawCommand",
    "TenantCache",
    "TenantEntry",
]


def _replaces(d: Decision) -> bool:
    """Whether ``d`` withdraws anything from its partition's ticker."""
    return bool(d.withdraw_version is not None or d.withdraw_runs) or (
        stopped_backfills(d.change) is not None
    )


def _withdraw_replaced(ticker: PartitionTicker, d: Decision) -> None:
    """``ticker`` refuses the rows ``d`` replaces (no ``await``: nothing fires in between)."""
    if d.withdraw_version is not None and d.change is not None:
        ticker.withdraw(d.change.row.tenant, d.change.row.schedule_id, d.withdraw_version)
    for tenant, run, version in d.withdraw_runs:
        ticker.withdraw(tenant, run, version)
    stop = stopped_backfills(d.change)
    if stop is not None and d.change is not None:
        row = d.change.row
        cancelled = row.state == ScheduleState.CANCELLED
        ticker.withdraw_backfill(row.tenant, row.schedule_id, stop, cancelled=cancelled)


def admitted_ids(msg: RawCommand) -> tuple[str, str] | None:
    """The (tenant, schedule id) of a record that reads as a one-shot create, the only
    command an API admits, even one that does not decode here; None for anything else."""
    try:
        obj = orjson.loads(msg.value or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("type") != "create" or "recurrence" in obj:
        return None
    ids = salvage_ids(msg.value or b"", msg.key)
    if ids.tenant is None or ids.schedule_id is None:
        return None
    return ids.tenant, ids.schedule_id


def admitted_refused(
    msg: RawCommand, command: Command, code: Code, text: str, admitted: bool = True
) -> None:
    """A create answered 201 at Kafka's acknowledgement that the worker did not store: an
    alert (its tenant was told it would fire). Nothing when ``admitted`` is false."""
    if not admitted:
        return
    _alert_refused(msg, command.tenant, command.schedule_id, code, text)


def _alert_refused(msg: RawCommand, tenant: str, schedule_id: str, code: Code, text: str) -> None:
    """The alert for an admitted create that was refused: counted and logged."""
    metrics.ADMISSIONS.labels("refused").inc()
    log.error(
        "an admitted create was refused",
        extra={
            "code": str(code),
            "reason": text,
            "tenant": tenant,
            "schedule_id": schedule_id,
            "partition": msg.partition,
            "offset": msg.offset,
        },
    )


def _note_unrowed(
    unrowed: dict[tuple[str, str], Unrowed], key: tuple[str, str], change: ScheduleChange
) -> None:
    """A trigger's or backfill's signature recorded by ``change``, for the batch's later
    commands of the schedule (the record is read once per batch)."""
    record = unrowed_of(change.commit_with)
    if record is not None:
        unrowed[key] = Unrowed(*record)


def _note_refusal(
    refused: list[Refusal],
    command: Command,
    existing: object,
    code: Code,
    text: str,
    replay: bool,
) -> None:
    """A proven tenant's command refused for a schedule it has (``streams.refusals``); a
    replayed command's refusal was noted when it was first decided."""
    if existing is not None and not replay:
        refused.append(
            Refusal(
                tenant=command.tenant,
                schedule_id=command.schedule_id,
                command=str(command.type),
                code=str(code),
                message=text,
            )
        )

"""The scheduler's decisions: what a command does to a schedule, and what one step of a
recurring schedule's materialisation writes. Pure: no I/O, no clock, no Kafka, no
Cassandra, no metrics; every input is an argument (the command, the stored row, the
tenant's config, ``now_ms``) and every output a value the caller persists.

One-shot commands (``decide``): a create writes the schedule row and its bucket row; an
update or cancel bumps the row's version, deletes the old bucket row and tells the ticker
which version's rows to refuse from now on. A command at or below the offset recorded on
the row is a replay: answered again, applied never twice.

Recurring schedules (``decide_recurring``): one ``schedules`` row (the *parent*, with a
``recurrence``) whose runs are written ahead as one-shot bucket rows with schedule id
``<parent>@<nominal_ms>``. The parent's ``materialized_until_ms`` is the nominal time of
the first occurrence not handled yet, ``run_count`` the occurrences before it, and
``materialize_key`` (``partition * KEY_SPAN + when to extend next``) what the due queue
orders parents by. A create registers the parent for immediate extension; an update or
cancel deletes the bucket rows of its runs not yet due (``run_deletes``) and withdraws
them from the ticker; an update then lets the materialiser write the new runs.

Materialisation (``plan_extension``, ``parent_commits``): for each parent due, the runs to
write (``streams.recurring.plan``), bounded by a budget of past-due runs per step, and
the parent's new state, which the caller commits last.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NotRequired, Protocol, TypedDict
from urllib.parse import urlsplit

from base.errors import CommandRejected
from streams.buckets import BUCKET_MS, BucketKey, max_due_ms, shard_of
from streams.buckets import minute_ms as minute_of
from streams.model import (
    BucketRow,
    EventNote,
    ManualRun,
    ScheduleChange,
    ScheduleEvent,
    ScheduleRow,
    ScheduleState,
    Stmt,
    manual_run_id,
    manual_trigger_id,
)
from streams.recurring import (
    MAX_TOLERANCE_S,
    NEVER_MS,
    Plan,
    extend_at,
    first_run,
    jitter_ms,
    next_runs,
    occurrences,
    past_occurrences,
    plan,
    run_id,
    series_start,
)
from streams.signed_store import put_stmt
from streams.tenants import TenantConfig, host_allowed, stamp_retry, topic_allowed
from topics.codec import (
    callback_from_json,
    callback_to_json,
    recurrence_from_json,
    recurrence_to_json,
)
from topics.codes import Code
from topics.fields import check_not_past
from topics.ids import format_iso_ms, trigger_id
from topics.models import (
    BackfillCommand,
    CancelCommand,
    Command,
    CreateCommand,
    HttpCallback,
    KafkaCallback,
    PauseCommand,
    Recurrence,
    ResumeCommand,
    TriggerCommand,
    UpdateCommand,
)
from topics.signing import SIGNED_MAC_BYTES

# -- commands -------------------------------------------------------------------------------


class CommandAt(Protocol):
    """Where and when a command was read (``streams.commands.RawCommand`` is one)."""

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def timestamp_ms(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Decision:
    """What one command does: its answer, and the change to persist (None: nothing)."""

    code: Code
    text: str
    change: ScheduleChange | None = None
    # After persisting: the row to hand to the ticker (scheduled state) ...
    hand_over: ScheduleRow | None = None
    # ... and, before persisting, the version whose stale bucket rows the ticker must drop.
    withdraw_version: int | None = None
    # Recurring schedules: (tenant, run id, version) of runs the ticker must drop.
    withdraw_runs: tuple[tuple[str, str, int], ...] = ()
    # A trigger command's run: emitted after persisting, answered once Kafka has it.
    fire_now: ManualRun | None = None
    # For the per-tenant metrics: runs a resume skipped, and whether it recorded a miss.
    skipped_paused: int = 0
    missed: bool = False
    # A backfill's rows, written with the change: handed to the ticker after persisting.
    hand_over_runs: tuple[BucketRow, ...] = ()


class Unemitted(Protocol):
    """What the partition's ticker may still emit (``streams.ticker.PartitionTicker``), so
    a pause withdraws every run not emitted yet, also one already due and loaded."""

    def earliest_unemitted_ms(self, now_ms: int) -> int:
        """No trigger due before this is still to be emitted."""
        ...

    def may_emit(self, tenant: str, schedule_id: str, due_ms: int) -> bool:
        """Whether this trigger is not emitted yet (loaded and waiting, or not loaded)."""
        ...


@dataclass(frozen=True, slots=True)
class DueAfter:
    """``Unemitted`` without a ticker (tests, tools): what is due after ``now_ms``."""

    def earliest_unemitted_ms(self, now_ms: int) -> int:
        return now_ms + 1

    def may_emit(self, tenant: str, schedule_id: str, due_ms: int) -> bool:
        return True


def is_replay(existing: ScheduleRow | None, offset: int) -> bool:
    """Whether the command at ``offset`` was applied to ``existing`` already (a replay
    after a crash: its Kafka offset was not committed)."""
    return (
        existing is not None
        and existing.applied_offset is not None
        and offset <= existing.applied_offset
    )


# A tenant-signed command as the order check sees it: its verified tocsin-signed-at and
# the first SIGNED_MAC_BYTES of its signature (topics.signing.mac_prefix).
@dataclass(frozen=True, slots=True)
class Signed:
    at_ms: int
    mac: bytes


# The signers' clocks differ (the API's replicas each sign with their own clock, as do a
# tenant's producer hosts), so a command may be signed a little before one applied ahead
# of it. Order is judged with this tolerance (TOCSIN_SIGNED_ORDER_SKEW_MS): the signature
# prefixes of the commands applied within it below the newest applied signed time are kept
# (``signed_macs``) with their signed times, so a copy of one is refused by its prefix
# and a genuine command of a skewed signer applies; a command signed before the window is
# refused by time (a copy there can no longer be told from a new command). At most this
# many are kept: with the window full, a command signed at or before the oldest kept
# entry's time is refused too (the entries dropped were at or before it).
MAX_SIGNED_IN_ONE_MS = 16
DEFAULT_SIGNED_ORDER_SKEW_MS = 2_000

# ``signed_macs`` holds either migration 013's layout (SIGNED_MAC_BYTES prefixes, all
# signed at ``signed_at_ms``; a create still writes it so, one prefix) or, once a command
# signed at another time is kept with them, this marker byte and entries of the signed
# time (8 bytes, big-endian) and the prefix. 1 + 24 n bytes is never a multiple of 16, so
# the two layouts are told apart by length.
_WINDOW_MARK = b"\x01"
_ENTRY = struct.Struct(f">q{SIGNED_MAC_BYTES}s")

# (signed time, signature prefix) of an applied signed command, oldest first.
Entry = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class Unrowed:
    """A schedule's record of ``signed_without_row`` (streams.signed_store): the signatures
    of the triggers and backfills applied to it (the newest's signed time and the kept
    window, as on a row), which its row does not hold."""

    at_ms: int
    macs: bytes
    offset: int


def entries(at_ms: int | None, raw: bytes | None) -> list[Entry]:
    """The kept window of ``signed_at_ms``/``signed_macs`` (either layout), oldest first."""
    if at_ms is None or not raw:
        return []
    if len(raw) % SIGNED_MAC_BYTES == 0:
        return [
            (at_ms, raw[i : i + SIGNED_MAC_BYTES]) for i in range(0, len(raw), SIGNED_MAC_BYTES)
        ]
    return [(int(t), bytes(m)) for t, m in _ENTRY.iter_unpack(raw[len(_WINDOW_MARK) :])]


def encode(window: Sequence[Entry]) -> tuple[int, bytes]:
    """(``signed_at_ms``, ``signed_macs``) holding ``window`` (not empty, oldest first): the
    013 layout when every entry has the newest's time, so a row of one command is unchanged."""
    newest = window[-1][0]
    if all(t == newest for t, _ in window):
        return newest, b"".join(m for _, m in window)
    return newest, _WINDOW_MARK + b"".join(_ENTRY.pack(t, m) for t, m in window)


def kept(window: Sequence[Entry], skew_ms: int) -> list[Entry]:
    """``window`` (any order, possibly repeating a prefix) as kept: each prefix once, oldest
    first, those signed more than ``skew_ms`` before the newest dropped (refused by time),
    and at most MAX_SIGNED_IN_ONE_MS, the newest."""
    seen: dict[bytes, int] = {}
    for t, m in window:
        seen[m] = max(t, seen.get(m, t))
    ordered = sorted(((t, m) for m, t in seen.items()), key=lambda e: e[0])
    if not ordered:
        return []
    floor = ordered[-1][0] - skew_ms
    return [e for e in ordered if e[0] >= floor][-MAX_SIGNED_IN_ONE_MS:]


def with_unrowed(
    existing: ScheduleRow | None,
    unrowed: Unrowed | None,
    skew_ms: int = DEFAULT_SIGNED_ORDER_SKEW_MS,
) -> ScheduleRow | None:
    """``existing`` as the order check judges a trigger or backfill: the signatures kept on
    its row and in its record together (each once), and the higher offset."""
    if existing is None or unrowed is None:
        return existing
    offset = max(existing.applied_offset or -1, unrowed.offset)
    both = [
        *entries(existing.signed_at_ms, existing.signed_macs),
        *entries(unrowed.at_ms, unrowed.macs),
    ]
    window = kept(both, skew_ms)
    if not window:
        return replace(existing, applied_offset=offset)
    at_ms, macs = encode(window)
    return replace(existing, signed_at_ms=at_ms, signed_macs=macs, applied_offset=offset)


def check_signed_order(
    existing: ScheduleRow | None,
    offset: int,
    signed: Signed,
    skew_ms: int = DEFAULT_SIGNED_ORDER_SKEW_MS,
) -> None:
    """Raises ``replayed_command`` when a tenant-signed command is a copy of one applied to
    its schedule and kept (its signature prefix in ``signed_macs``), or is signed more than
    ``skew_ms`` before the newest applied (``signed_at_ms``), or, with MAX_SIGNED_IN_ONE_MS
    kept, at or before the oldest kept: a copy of an applied command produced again within
    the signature window (a new offset and the broker's new time: once the worker that read
    the original restarted or the partition moved, only the row tells it from a new
    command), or a command too old to tell from one. A command signed a little before the
    newest applied (a signer whose clock is behind, within ``skew_ms``) applies, in arrival
    order. A record at or below the row's applied offset is the same record read again
    after a crash, answered by the replay path, not judged here."""
    if existing is None or existing.signed_at_ms is None or is_replay(existing, offset):
        return
    last = existing.signed_at_ms
    window = entries(last, existing.signed_macs)
    if any(m == signed.mac for _, m in window):
        why = f"a command already applied to schedule {existing.schedule_id!r}"
    elif signed.at_ms < last - skew_ms:
        why = (
            f"more than {skew_ms} ms before the last command applied to schedule "
            f"{existing.schedule_id!r}"
        )
    elif len(window) >= MAX_SIGNED_IN_ONE_MS and signed.at_ms <= window[0][0]:
        why = (
            f"at or before the oldest of the last {MAX_SIGNED_IN_ONE_MS} commands applied "
            f"to schedule {existing.schedule_id!r} within {skew_ms} ms"
        )
    else:
        return
    raise CommandRejected(
        Code.REPLAYED_COMMAND,
        f"signed at epoch ms {signed.at_ms}, {why} (signed at {last}): a copy, or a command "
        "signed too long before the last applied, is not applied; sign a new command",
    )


def _signed_by(
    decision: Decision,
    signed: Signed | None,
    judged: ScheduleRow | None,
    offset: int,
    skew_ms: int = DEFAULT_SIGNED_ORDER_SKEW_MS,
) -> Decision:
    """``decision`` with the row it writes keeping the command's signature in its window; a
    change that writes no row (trigger, backfill) records it in ``signed_without_row``
    instead, with the window ``judged`` (its row with its record) kept."""
    change = decision.change
    if signed is None or change is None:
        return decision
    row = change.row
    if not change.write_row:
        return replace(decision, change=_record_unrowed(change, signed, judged, offset, skew_ms))
    window = entries(row.signed_at_ms, row.signed_macs)
    if any(m == signed.mac for _, m in window):
        return decision  # recorded already (a create)
    at_ms, macs = encode(kept([*window, (signed.at_ms, signed.mac)], skew_ms))
    row = replace(row, signed_at_ms=at_ms, signed_macs=macs)
    return replace(decision, change=replace(change, row=row))


def _record_unrowed(
    change: ScheduleChange,
    signed: Signed,
    judged: ScheduleRow | None,
    offset: int,
    skew_ms: int,
) -> ScheduleChange:
    """``change`` (a trigger's or backfill's) committing its signature to its record: the
    window kept, and never a lower offset (a crash replay of the command writes it again,
    its signature kept once)."""
    window: list[Entry] = [(signed.at_ms, signed.mac)]
    top = offset
    if judged is not None:
        top = max(offset, judged.applied_offset or -1)
        window += entries(judged.signed_at_ms, judged.signed_macs)
    row = change.row
    at_ms, macs = encode(kept(window, skew_ms))
    record = put_stmt(row.tenant, row.schedule_id, at_ms, macs, top)
    return replace(change, commit_with=(*change.commit_with, record))


def decide(
    command: Command,
    existing: ScheduleRow | None,
    msg: CommandAt,
    *,
    now_ms: int,
    shards: int,
    default_tolerance_s: int,
    firing: bool,
    horizon_ms: int = 600_000,
    unemitted: Unemitted | None = None,
    signed: Signed | None = None,
    unrowed: Unrowed | None = None,
    signed_order_skew_ms: int = DEFAULT_SIGNED_ORDER_SKEW_MS,
) -> Decision:
    """The outcome of ``command`` against the schedule's current row.

    ``firing``: a trigger of this schedule is emitted but not yet recorded as fired.
    ``horizon_ms``: how far ahead recurring schedules' runs are materialised.
    ``unemitted``: what the ticker may still emit (None: what is due after now).
    ``signed``: the command's verified signature (None: not signed by its tenant);
    refused unless after the row's (``check_signed_order``), recorded on the row it
    writes. ``unrowed``: the schedule's record of the last signed trigger or backfill
    (read for those two commands only). ``signed_order_skew_ms``: the signers' clock
    difference tolerated in that order.
    Raises CommandRejected for state-dependent rejections.
    """
    if signed is not None:
        judged = with_unrowed(existing, unrowed, signed_order_skew_ms)
        check_signed_order(judged, msg.offset, signed, signed_order_skew_ms)
    decision = _decide(
        command,
        existing,
        msg,
        now_ms,
        shards,
        default_tolerance_s,
        firing,
        horizon_ms,
        unemitted,
        signed,
    )
    if signed is None:
        return decision
    return _signed_by(decision, signed, judged, msg.offset, signed_order_skew_ms)


def _decide(
    command: Command,
    existing: ScheduleRow | None,
    msg: CommandAt,
    now_ms: int,
    shards: int,
    default_tolerance_s: int,
    firing: bool,
    horizon_ms: int,
    unemitted: Unemitted | None,
    signed: Signed | None = None,
) -> Decision:
    if isinstance(command, TriggerCommand):
        # Before the replay check: a trigger command writes no row, and its replay fires
        # its run again under the same ids (at least once).
        return _decide_trigger(command, existing, msg)
    if isinstance(command, BackfillCommand):
        # Likewise: a replayed backfill writes its runs again (same run and trigger ids).
        return decide_backfill(command, existing, msg, now_ms=now_ms, shards=shards)
    if existing is not None and is_replay(existing, msg.offset):
        return _replayed(existing, msg.offset)
    if is_recurring(existing) or (
        isinstance(command, CreateCommand) and command.recurrence is not None
    ):
        r = decide_recurring(
            command,
            existing,
            partition=msg.partition,
            offset=msg.offset,
            timestamp_ms=msg.timestamp_ms,
            now_ms=now_ms,
            shards=shards,
            horizon_ms=horizon_ms,
            unemitted=unemitted,
        )
        return Decision(
            r.code,
            r.text,
            change=r.change,
            withdraw_runs=r.withdraw,
            skipped_paused=r.skipped_paused,
        )
    if isinstance(command, UpdateCommand) and command.recurrence is not None:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"schedule {command.schedule_id!r} is a one-shot schedule; it has no recurrence",
        )
    if isinstance(command, CreateCommand):
        return _decide_create(command, existing, msg, shards, signed)
    if isinstance(command, PauseCommand):
        return _decide_pause(command, existing, msg, shards, firing)
    if isinstance(command, ResumeCommand):
        return _decide_resume(command, existing, msg, now_ms, shards, default_tolerance_s)
    current = _changeable(existing, command.schedule_id, firing)
    stamped = replace(
        current,
        version=current.version + 1,
        updated_ms=msg.timestamp_ms,
        applied_offset=msg.offset,
        last_code=str(Code.OK),
    )
    old_bucket = BucketRow.for_schedule(current, shards=shards).key
    if isinstance(command, CancelCommand):
        row = replace(stamped, state=ScheduleState.CANCELLED)
        change = ScheduleChange(
            row=row,
            new_bucket=None,
            old_bucket=old_bucket,
            now_ms=msg.timestamp_ms,
            event=ScheduleEvent.CANCELLED,
        )
        return Decision(Code.OK, "cancelled", change=change, withdraw_version=row.version)
    assert isinstance(command, UpdateCommand)
    return _decide_update(
        command, current, stamped, old_bucket, msg, now_ms, shards, default_tolerance_s
    )


def _replayed(existing: ScheduleRow, offset: int) -> Decision:
    code = (
        Code(existing.last_code)
        if (existing.applied_offset == offset and existing.last_code)
        else Code.OK
    )
    # A recurring parent never fires itself: its materialiser redoes what is left.
    scheduled = existing.state == ScheduleState.SCHEDULED and not is_recurring(existing)
    hand = existing if scheduled else None
    return Decision(code, "already applied (replayed command)", hand_over=hand)


def _decide_update(
    command: UpdateCommand,
    current: ScheduleRow,
    stamped: ScheduleRow,
    old_bucket: BucketKey,
    msg: CommandAt,
    now_ms: int,
    shards: int,
    default_tolerance_s: int,
) -> Decision:
    if command.due_ms is not None:
        tolerance = current.misfire_tolerance_s or default_tolerance_s
        check_not_past(command.due_ms, now_ms=now_ms, misfire_tolerance_s=tolerance)
    row = replace(
        _updated_content(command, stamped, current),
        due_ms=command.due_ms if command.due_ms is not None else current.due_ms,
    )
    if current.state == ScheduleState.PAUSED:
        # Changed, still paused: no bucket row until it is resumed.
        paused = ScheduleChange(
            row=row,
            new_bucket=None,
            old_bucket=None,
            now_ms=msg.timestamp_ms,
            event=ScheduleEvent.UPDATED,
            index_old_due_ms=current.due_ms if row.due_ms != current.due_ms else None,
        )
        return Decision(Code.OK, "updated (still paused)", change=paused)
    change = ScheduleChange(
        row=row,
        new_bucket=BucketRow.for_schedule(row, shards=shards),
        old_bucket=old_bucket,
        now_ms=msg.timestamp_ms,
        event=ScheduleEvent.UPDATED,
    )
    # Tombstone the old version only: its stale rows are refused, the new one is not.
    return Decision(
        Code.OK,
        "updated" if command.due_ms is None else "rescheduled",
        change=change,
        hand_over=row,
        withdraw_version=current.version,
    )


def _stamped(current: ScheduleRow, msg: CommandAt) -> ScheduleRow:
    """``current`` as a command at ``msg`` leaves it: next version, applied offset."""
    return replace(
        current,
        version=current.version + 1,
        updated_ms=msg.timestamp_ms,
        applied_offset=msg.offset,
        last_code=str(Code.OK),
    )


def _decide_pause(
    command: PauseCommand,
    existing: ScheduleRow | None,
    msg: CommandAt,
    shards: int,
    firing: bool,
) -> Decision:
    """A one-shot stops firing: its bucket row is deleted and the ticker refuses the old
    version from now on, like a cancel (``firing``: its trigger is out already)."""
    current = _changeable(existing, command.schedule_id, firing)
    if current.state == ScheduleState.PAUSED:
        return Decision(Code.DUPLICATE, f"schedule {command.schedule_id!r} is already paused")
    row = replace(_stamped(current, msg), state=ScheduleState.PAUSED)
    change = ScheduleChange(
        row=row,
        new_bucket=None,
        old_bucket=BucketRow.for_schedule(current, shards=shards).key,
        now_ms=msg.timestamp_ms,
        event=ScheduleEvent.PAUSED,
    )
    return Decision(Code.OK, "paused", change=change, withdraw_version=row.version)


def _decide_resume(
    command: ResumeCommand,
    existing: ScheduleRow | None,
    msg: CommandAt,
    now_ms: int,
    shards: int,
    default_tolerance_s: int,
) -> Decision:
    """A paused one-shot fires again at its due time; one whose due time passed while it
    was paused fires late within its misfire tolerance, and beyond it is recorded missed
    here (the answer says which)."""
    current = _changeable(existing, command.schedule_id, firing=False)
    if current.state != ScheduleState.PAUSED:
        return Decision(Code.DUPLICATE, f"schedule {command.schedule_id!r} is not paused")
    stamped = _stamped(current, msg)
    tolerance_s = (
        current.misfire_tolerance_s
        if current.misfire_tolerance_s is not None
        else default_tolerance_s
    )
    late_ms = now_ms - current.due_ms
    if late_ms > tolerance_s * 1000:
        tid = trigger_id(current.tenant, current.schedule_id, current.due_ms)
        missed = ScheduleChange(
            row=replace(stamped, state=ScheduleState.MISSED, trigger_id=tid),
            new_bucket=None,
            old_bucket=None,
            now_ms=msg.timestamp_ms,
            event=ScheduleEvent.RESUMED,
            notes=(
                EventNote(
                    ScheduleEvent.MISSED,
                    f"due time passed while paused: late by {late_ms} ms, beyond its "
                    f"misfire tolerance of {tolerance_s} s",
                    tid,
                    current.due_ms,
                ),
            ),
        )
        return Decision(
            Code.OK,
            f"resumed; its due time passed while paused, {late_ms} ms ago, beyond its "
            f"misfire tolerance of {tolerance_s} s: recorded missed",
            change=missed,
            missed=True,
        )
    row = replace(stamped, state=ScheduleState.SCHEDULED)
    change = ScheduleChange(
        row=row,
        new_bucket=BucketRow.for_schedule(row, shards=shards),
        old_bucket=None,
        now_ms=msg.timestamp_ms,
        event=ScheduleEvent.RESUMED,
    )
    text = "resumed" if late_ms <= 0 else "resumed; due while paused, fires late (within tolerance)"
    return Decision(Code.OK, text, change=change, hand_over=row)


def _decide_trigger(
    command: TriggerCommand, existing: ScheduleRow | None, msg: CommandAt
) -> Decision:
    """One extra run of the schedule, due at the command's record time, with the
    schedule's payload, callback and order key, under ids of its own (``ManualRun``).
    The schedule itself is left as it is, paused or not; only a cancelled one refuses."""
    if existing is None or not existing.callback:
        raise CommandRejected(Code.NOT_FOUND, f"no schedule {command.schedule_id!r}")
    if existing.state == ScheduleState.CANCELLED:
        raise CommandRejected(
            Code.ALREADY_CANCELLED, f"schedule {command.schedule_id!r} was cancelled"
        )
    at = msg.timestamp_ms
    rid = manual_run_id(existing.schedule_id, at, msg.offset)
    tid = manual_trigger_id(existing.tenant, existing.schedule_id, msg.partition, msg.offset, at)
    run = ManualRun(
        partition=msg.partition,
        minute_ms=minute_of(at),
        shard=0,
        due_ms=at,
        tenant=existing.tenant,
        schedule_id=rid,
        version=1,
        order_key=existing.order_key or existing.schedule_id,
        payload=existing.payload,
        payload_type=existing.payload_type,
        callback=existing.callback,
        # Fired however late the command is read: it was asked for explicitly.
        misfire_tolerance_s=MAX_TOLERANCE_S,
        trigger_id=tid,
    )
    change = ScheduleChange(
        row=existing,
        new_bucket=None,
        old_bucket=None,
        now_ms=at,
        write_row=False,
        notes=(EventNote(ScheduleEvent.TRIGGERED, f"fired now as run {rid}", tid, at),),
    )
    return Decision(Code.OK, f"triggered: run {rid}, trigger id {tid}", change=change, fire_now=run)


# Most runs one backfill command writes: a year of minutely runs (525,600) is asked for in
# pieces of this size, the answer naming where the next piece starts.
BACKFILL_MAX_RUNS = 10_000
# Runs per second one backfill fires: its rows are due this far apart, so at most 10,000
# runs spread over 500 s (on top of the tenant's fire quota), never a burst on the partition.
BACKFILL_RUNS_PER_S = 20
# The first backfilled run fires this long after the decision, so its row is written
# before it is due and the ticker reads it like any row ahead of its clock.
BACKFILL_LEAD_MS = 1_000


def backfill_nominals(
    rec: Recurrence,
    *,
    tenant: str,
    schedule_id: str,
    anchor_ms: int,
    from_ms: int,
    to_ms: int,
    now_ms: int,
    limit: int = BACKFILL_MAX_RUNS,
) -> tuple[list[tuple[int, int]], int | None]:
    """(nominal, due) of the runs with nominal time in ``[from_ms, to_ms)`` due before
    ``now_ms``, at most ``limit``; and the nominal time of the first run past the limit
    (None: the window's runs are all there)."""
    runs: list[tuple[int, int]] = []
    for nominal in past_occurrences(rec, from_ms, anchor_ms=anchor_ms):
        if nominal >= to_ms or nominal >= now_ms:
            break
        due = nominal + jitter_ms(tenant, run_id(schedule_id, nominal), rec.jitter_s)
        if due >= now_ms:
            break  # its own emission is still ahead: it fires anyway
        if len(runs) >= limit:
            return runs, nominal
        runs.append((nominal, due))
    return runs, None


def decide_backfill(
    command: BackfillCommand,
    existing: ScheduleRow | None,
    msg: CommandAt,
    *,
    now_ms: int,
    shards: int,
) -> Decision:
    """The runs a recurring schedule had (or would have had) in a past window, written as
    bucket rows due from ``now_ms + BACKFILL_LEAD_MS`` on, ``BACKFILL_RUNS_PER_S`` apart:
    the ticker fires them like any row, so a crash or a rebalance neither loses nor repeats
    the rest. Each carries its run id and its own due time (``run_due_ms``), so its trigger
    id is the one its own emission had: a receiver that saw the run drops it. Every run of
    the window is written, fired before or not; a paused schedule may be backfilled (an
    explicit request, like a trigger command) and stays paused. Each row carries the
    parent's version, so a later pause or cancel stops the runs not emitted yet
    (``stopped_backfills``). Recorded as one ``backfilled`` event; the schedule row is
    left as it is."""
    if existing is None or not existing.callback:
        raise CommandRejected(Code.NOT_FOUND, f"no schedule {command.schedule_id!r}")
    if existing.state == ScheduleState.CANCELLED:
        raise CommandRejected(
            Code.ALREADY_CANCELLED, f"schedule {command.schedule_id!r} was cancelled"
        )
    if existing.recurrence is None:
        raise CommandRejected(
            Code.NOT_RECURRING,
            f"schedule {command.schedule_id!r} is a one-shot schedule; it has no runs to backfill",
        )
    if command.from_ms >= now_ms:
        raise CommandRejected(
            Code.WINDOW_IN_FUTURE,
            f"the window starts at {format_iso_ms(command.from_ms)}, not before now "
            f"({format_iso_ms(now_ms)}): only past runs can be backfilled",
        )
    rec = recurrence_from_json(existing.recurrence)
    nominals, next_from = backfill_nominals(
        rec,
        tenant=existing.tenant,
        schedule_id=existing.schedule_id,
        anchor_ms=existing.anchor_ms or existing.created_ms,
        from_ms=command.from_ms,
        to_ms=command.to_ms,
        now_ms=now_ms,
    )
    runs = tuple(
        # Fired however late it is read: it was asked for explicitly.
        replace(run_bucket(existing, nominal, fire_ms, MAX_TOLERANCE_S, shards), run_due_ms=due)
        for (nominal, due), fire_ms in zip(
            nominals, backfill_fire_times(len(nominals), now_ms), strict=True
        )
    )
    text = _backfill_text(command, nominals, runs, next_from)
    change = ScheduleChange(
        row=existing,
        new_bucket=None,
        old_bucket=None,
        now_ms=msg.timestamp_ms,
        event=ScheduleEvent.BACKFILLED,
        event_detail=text,
        write_row=False,
        bucket_puts=runs,
    )
    return Decision(Code.OK, text, change=change, hand_over_runs=runs)


def stopped_backfills(change: ScheduleChange | None) -> int | None:
    """The version a pause or cancel of a recurring schedule writes, below which its
    backfilled runs (bucket rows carrying the version they were written for) are not
    fired any more; None for any other change. Stored on the row
    (``backfill_stop_version``), so whichever ticker loads such a row later drops it, and
    handed to this worker's ticker before persisting (rows it holds already)."""
    if change is None or not change.write_row:
        return None
    row = change.row
    stop = row.backfill_stop_version
    return stop if stop is not None and stop == row.version else None


def backfill_fire_times(count: int, now_ms: int) -> list[int]:
    """When each of ``count`` backfilled runs fires: ``BACKFILL_RUNS_PER_S`` a second."""
    start = now_ms + BACKFILL_LEAD_MS
    return [start + i * 1000 // BACKFILL_RUNS_PER_S for i in range(count)]


def _backfill_text(
    command: BackfillCommand,
    nominals: Sequence[tuple[int, int]],
    runs: Sequence[BucketRow],
    next_from: int | None,
) -> str:
    window = f"[{format_iso_ms(command.from_ms)}, {format_iso_ms(command.to_ms)})"
    if not runs:
        return f"backfilled 0 runs: none of window {window} is due before now"
    text = (
        f"backfilled {len(runs)} runs of window {window}, nominal times "
        f"{format_iso_ms(nominals[0][0])} to {format_iso_ms(nominals[-1][0])}, firing from "
        f"{format_iso_ms(runs[0].due_ms)} to {format_iso_ms(runs[-1].due_ms)} "
        f"({BACKFILL_RUNS_PER_S} runs/s)"
    )
    if next_from is not None:
        text += (
            f"; truncated at {BACKFILL_MAX_RUNS} runs: backfill again from "
            f"{format_iso_ms(next_from)}"
        )
    return text


def _updated_content(
    command: UpdateCommand, stamped: ScheduleRow, current: ScheduleRow
) -> ScheduleRow:
    """``stamped`` with the payload, payload type and callback the update names, and the
    current row's where it names none."""
    return replace(
        stamped,
        payload=command.payload if command.payload is not None else current.payload,
        payload_type=str(command.payload_type)
        if command.payload_type is not None
        else current.payload_type,
        callback=callback_to_json(command.callback)
        if command.callback is not None
        else current.callback,
    )


def _decide_create(
    cmd: CreateCommand,
    existing: ScheduleRow | None,
    msg: CommandAt,
    shards: int,
    signed: Signed | None = None,
) -> Decision:
    callback = callback_to_json(cmd.callback)
    if existing is not None:
        return Decision(
            Code.DUPLICATE,
            repeated_create(existing, cmd, callback, same_timing=existing.due_ms == cmd.due_ms),
        )
    row = ScheduleRow(
        tenant=cmd.tenant,
        schedule_id=cmd.schedule_id,
        partition=msg.partition,
        state=ScheduleState.SCHEDULED,
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
        # Here rather than by _signed_by: a create is the hot path, a copy of the row costs.
        signed_at_ms=signed.at_ms if signed is not None else None,
        signed_macs=signed.mac if signed is not None else None,
    )
    change = ScheduleChange(
        row=row,
        new_bucket=BucketRow.for_schedule(row, shards=shards),
        old_bucket=None,
        now_ms=msg.timestamp_ms,
        event=ScheduleEvent.CREATED,
    )
    return Decision(Code.OK, "scheduled", change=change, hand_over=row)


def _changeable(existing: ScheduleRow | None, schedule_id: str, firing: bool) -> ScheduleRow:
    if existing is None:
        raise CommandRejected(Code.NOT_FOUND, f"no schedule {schedule_id!r}")
    if existing.state == ScheduleState.CANCELLED:
        raise CommandRejected(
            Code.ALREADY_CANCELLED, f"schedule {schedule_id!r} was already cancelled"
        )
    if existing.state in (ScheduleState.FIRED, ScheduleState.MISSED) or firing:
        raise CommandRejected(Code.ALREADY_FIRED, f"schedule {schedule_id!r} has already fired")
    return existing


def repeated_create(
    existing: ScheduleRow, cmd: CreateCommand, callback: str, *, same_timing: bool
) -> str:
    """A create naming an existing schedule: the ``duplicate`` message when its content is
    identical (an idempotent retry), else raises ``conflict``. ``same_timing`` is the caller's
    comparison of due time (one-shot) or recurrence (recurring); shared by both kinds."""
    same = (
        same_timing
        and (existing.payload or b"") == cmd.payload
        and existing.payload_type == str(cmd.payload_type)
        and existing.callback == callback
        and existing.order_key == cmd.order_key
        and existing.misfire_tolerance_s == cmd.misfire_tolerance_s
    )
    if same:
        return f"schedule {cmd.schedule_id!r} already exists unchanged"
    raise CommandRejected(
        Code.CONFLICT,
        f"schedule {cmd.schedule_id!r} already exists (state {existing.state}) with "
        "different content; use update, or a new schedule id",
    )


# -- a tenant's limits ----------------------------------------------------------------------


def check_tenant_limits(
    command: Command,
    config: TenantConfig,
    *,
    now_ms: int,
    default_retention_s: int,
    internal_topics: frozenset[str],
) -> None:
    """The tenant's own limits on a create or update (raises CommandRejected): payload
    size, horizon, storability, and where its callback may go."""
    if not isinstance(command, CreateCommand | UpdateCommand):
        return
    limit = config.max_payload_bytes
    if command.payload is not None and limit is not None and len(command.payload) > limit:
        raise CommandRejected(
            Code.PAYLOAD_TOO_LARGE,
            f"payload is {len(command.payload)} bytes; tenant {command.tenant!r} "
            f"allows at most {limit}",
        )
    horizon = config.max_horizon_s
    due = command.due_ms
    if due is not None and horizon is not None and due > now_ms + horizon * 1000:
        raise CommandRejected(
            Code.BEYOND_HORIZON, f"due is more than max_horizon_s={horizon} ahead of now"
        )
    if command.recurrence is not None and horizon is not None:
        check_recurring_horizon(command.recurrence, horizon, now_ms)
    retention = config.retention_s or default_retention_s
    if command.recurrence is None:
        check_storable(due, now_ms, retention)
    elif (first := first_run(command.recurrence, now_ms)) < NEVER_MS:
        # A rule without any run (NEVER_MS) is left to the decision: invalid_field.
        check_storable(first, now_ms, retention)
    if command.callback is not None:
        check_callback(command.callback, config, internal_topics)


def check_callback(
    callback: HttpCallback | KafkaCallback, config: TenantConfig, internal_topics: frozenset[str]
) -> None:
    """The callback goes where the tenant allows, and never into Tocsin's own topics."""
    if isinstance(callback, HttpCallback):
        host = urlsplit(callback.url).hostname or ""
        if not host_allowed(host, config.allowed_callback_hosts):
            raise CommandRejected(
                Code.CALLBACK_NOT_ALLOWED,
                f"callback host {host!r} is not in the tenant's allowed_callback_hosts",
            )
        return
    if callback.topic in internal_topics:
        raise CommandRejected(
            Code.CALLBACK_NOT_ALLOWED,
            f"callback topic {callback.topic!r} is one of Tocsin's own topics",
        )
    if not topic_allowed(callback.topic, config.allowed_kafka_topics):
        raise CommandRejected(
            Code.CALLBACK_NOT_ALLOWED,
            f"callback topic {callback.topic!r} is not in the tenant's allowed_kafka_topics",
        )


def own_topics(results_topic: str) -> frozenset[str]:
    """Tocsin's own topics, from the name of its results topic: a Kafka callback may never
    produce into them."""
    suffix = "command-results"
    prefix = results_topic[: -len(suffix)] if results_topic.endswith(suffix) else None
    if prefix is None:
        return frozenset({results_topic})
    return frozenset(
        prefix + n for n in ("commands", "command-results", "fires", "deliveries", "dead-letters")
    )


def check_storable(first_ms: int | None, now_ms: int, retention_s: int) -> None:
    """Rows of a schedule first due at ``first_ms`` must be storable at all: kept until due
    plus ``retention_s``, which Cassandra allows up to a 20-year TTL
    (streams.buckets.max_due_ms); later is ``beyond_horizon``, whatever the tenant's own
    horizon."""
    if first_ms is None:
        return
    limit = max_due_ms(now_ms, retention_s)
    if first_ms > limit:
        raise CommandRejected(
            Code.BEYOND_HORIZON,
            f"{format_iso_ms(first_ms)} is later than Tocsin can store a schedule "
            f"({format_iso_ms(limit)}: Cassandra's 20 years of TTL less {retention_s} s of "
            "retention)",
        )


def check_recurring_horizon(rec: Recurrence, horizon_s: int, now_ms: int) -> None:
    """A tenant's ``max_horizon_s`` for a recurring schedule: its first run, as of
    ``now_ms``, must lie within the horizon, exactly like a one-shot's due time, so a sparse
    rule or a far ``start`` cannot park a schedule beyond it (``beyond_horizon``). Later
    runs are not checked: each is written at most TOCSIN_RECURRING_HORIZON_S ahead of its
    time. A recurrence without any run is left to the decision (``invalid_field``)."""
    first = first_run(rec, now_ms)
    limit = now_ms + horizon_s * 1000
    if limit < first < NEVER_MS:
        raise CommandRejected(
            Code.BEYOND_HORIZON,
            f"the first run ({format_iso_ms(first)}) is more than max_horizon_s={horizon_s} "
            "ahead of now; a recurring schedule must first run within the tenant's horizon",
        )


def with_default_retry(
    command: Command, config: TenantConfig, existing: ScheduleRow | None
) -> Command:
    """``command`` with the tenant's default retry policy stamped into a callback that has
    no ``retry`` of its own (see streams.tenants.stamp_retry).

    A create naming an existing schedule is only compared (duplicate or conflict): it gets
    the retry the schedule was stored with instead, so repeating a create after the tenant
    changed its default is still a ``duplicate``."""
    if not isinstance(command, CreateCommand | UpdateCommand):
        return command
    callback = command.callback
    if callback is None or callback.retry is not None:
        return command
    if isinstance(command, CreateCommand) and existing is not None and existing.callback:
        try:
            stored = callback_from_json(existing.callback)
        except CommandRejected:
            stored = None
        if stored is not None and type(stored) is type(callback):
            return replace(command, callback=replace(callback, retry=stored.retry))
    stamped = stamp_retry(callback, config.retry_policy)
    return command if stamped is callback else replace(command, callback=stamped)


def with_retention(change: ScheduleChange, config: TenantConfig | None) -> ScheduleChange:
    """The change kept as long as its tenant's ``retention_s`` says. Recurring parents keep
    the global retention: their materialiser refreshes their TTL with it."""
    if config is None or config.retention_s is None or change.row.recurrence is not None:
        return change
    return replace(change, retention_s=config.retention_s)


# -- the listing indexes --------------------------------------------------------------------

# Entries of schedules_by_tenant_day: (tenant, schedule_id, due_ms).
IndexEntry = tuple[str, str, int]


def index_changes(
    changes: Sequence[ScheduleChange],
) -> tuple[list[IndexEntry], list[IndexEntry]]:
    """Entries of schedules_by_tenant_day to add and to drop for these changes."""
    put: list[IndexEntry] = []
    drop: list[IndexEntry] = []
    for change in changes:
        row = change.row
        moved_from = change.index_old_due_ms
        if change.new_bucket is None and moved_from is not None:
            # A paused one-shot moved by an update: it has no bucket row to go by.
            put.append((row.tenant, row.schedule_id, row.due_ms))
            drop.append((row.tenant, row.schedule_id, moved_from))
            continue
        if change.new_bucket is None:
            continue  # a cancel or pause keeps its entry (listed as cancelled, paused)
        old = change.old_bucket
        if old is not None and old.due_ms == row.due_ms:
            continue  # an update that kept the due time
        put.append((row.tenant, row.schedule_id, row.due_ms))
        if old is not None:
            drop.append((row.tenant, row.schedule_id, old.due_ms))
    return put, drop


def index_writes(
    changes: Sequence[ScheduleChange],
) -> list[tuple[list[IndexEntry], list[IndexEntry], int | None]]:
    """(put, drop, retention_s) per distinct retention of ``changes``: the listing index is
    kept as long as the schedule rows, so one write per retention (usually one)."""
    by_retention: dict[int | None, list[ScheduleChange]] = {}
    for change in changes:
        by_retention.setdefault(change.retention_s, []).append(change)
    out = []
    for retention, group in by_retention.items():
        put, drop = index_changes(group)
        if put or drop:
            out.append((put, drop, retention))
    return out


def recurring_index_changes(
    changes: Sequence[ScheduleChange],
) -> list[tuple[str, str, int, bool]]:
    """Entries of recurring_by_tenant for these changes: (tenant, schedule_id, created_ms,
    finished) for each recurring parent created or cancelled."""
    out = []
    for change in changes:
        row = change.row
        cancelled = change.event == ScheduleEvent.CANCELLED
        if row.recurrence is not None and (cancelled or change.event == ScheduleEvent.CREATED):
            out.append((row.tenant, row.schedule_id, row.created_ms, cancelled))
    return out


# -- recurring schedules: the due queue -----------------------------------------------------

# materialize_key = partition * KEY_SPAN + epoch ms (ms stay below 10^13 until 2286).
KEY_SPAN = 10**13
# Every active parent row is rewritten at least this often, which keeps its TTL (due_ms +
# retention) from lapsing however sparse its expression is.
REFRESH_MS = 30 * 24 * 3_600_000


def key_time(key: int, partition: int) -> int:
    """The epoch ms of a ``materialize_key`` (when its parent is due for extension)."""
    return key - partition * KEY_SPAN


def materialize_key(partition: int, at_ms: int) -> int:
    """The indexed value saying "extend this schedule of ``partition`` at ``at_ms``"."""
    return partition * KEY_SPAN + max(0, min(at_ms, KEY_SPAN - 1))


def is_recurring(row: ScheduleRow | None) -> bool:
    return row is not None and row.recurrence is not None


def slot_of(at_ms: int) -> int:
    """The due queue's partition (a minute, like the fire buckets) holding ``at_ms``."""
    return at_ms - at_ms % BUCKET_MS


@dataclass(frozen=True, slots=True)
class DueEntry:
    """One row of the due queue: parent (tenant, schedule_id) of ``partition`` is due for
    extension at ``due_ms`` (its key time, or later if that was already read past)."""

    partition: int
    due_ms: int
    tenant: str
    schedule_id: str

    @property
    def slot_ms(self) -> int:
        return slot_of(self.due_ms)


class ReadPosition(Protocol):
    """A partition's due-queue reader (``streams.materializer.PartitionMaterializer``)."""

    def position(self, due_ms: int) -> int: ...


def due_entries(
    rows: Sequence[ScheduleRow], readers: Mapping[int, ReadPosition] | None, now_ms: int
) -> list[DueEntry]:
    """The due-queue entries for parent rows about to be written with a new key (none for
    a key of NEVER). ``readers``: partition -> its reader in this process, if any; its
    ``position`` keeps each entry ahead of what it has read (callers hold its lock)."""
    out = []
    for row in rows:
        key = row.materialize_key
        if row.recurrence is None or key is None:
            continue
        at = key_time(key, row.partition)
        if at >= KEY_SPAN - 1 or at < 0:  # never (materialize_key clamps NEVER_MS to this)
            continue
        owner = readers.get(row.partition) if readers is not None else None
        due = owner.position(at) if owner is not None else at
        out.append(DueEntry(row.partition, due, row.tenant, row.schedule_id))
    return out


# -- recurring schedules: commands ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecurringDecision:
    code: Code
    text: str
    change: ScheduleChange | None = None
    # (tenant, run schedule id, version) to withdraw from the ticker before persisting.
    withdraw: tuple[tuple[str, str, int], ...] = ()
    # Runs a resume skipped (they fell in the pause).
    skipped_paused: int = 0


def decide_recurring(
    command: Command,
    existing: ScheduleRow | None,
    *,
    partition: int,
    offset: int,
    timestamp_ms: int,
    now_ms: int,
    shards: int,
    horizon_ms: int,
    unemitted: Unemitted | None = None,
) -> RecurringDecision:
    """The outcome of a command on a recurring schedule (raises CommandRejected).

    Called for a create carrying a recurrence and for any command on a recurring parent
    (a trigger command is ``decide``'s, for both kinds).
    """
    if isinstance(command, CreateCommand):
        return _create(command, existing, partition, offset, timestamp_ms, now_ms, horizon_ms)
    parent = _changeable_parent(existing, command.schedule_id)
    assert parent.recurrence is not None
    paused = parent.state == ScheduleState.PAUSED
    if isinstance(command, PauseCommand) and paused:
        return RecurringDecision(
            Code.DUPLICATE, f"schedule {command.schedule_id!r} is already paused"
        )
    if isinstance(command, ResumeCommand) and not paused:
        return RecurringDecision(Code.DUPLICATE, f"schedule {command.schedule_id!r} is not paused")
    old_rec = recurrence_from_json(parent.recurrence)
    stamped = replace(
        parent,
        version=parent.version + 1,
        updated_ms=timestamp_ms,
        applied_offset=offset,
        last_code=str(Code.OK),
    )
    if isinstance(command, CancelCommand):
        return _cancel(parent, stamped, old_rec, now_ms, timestamp_ms, shards)
    if isinstance(command, PauseCommand):
        return _pause(parent, stamped, old_rec, now_ms, timestamp_ms, shards, unemitted)
    if isinstance(command, ResumeCommand):
        return _resume(parent, stamped, old_rec, now_ms, timestamp_ms, horizon_ms)
    assert isinstance(command, UpdateCommand)
    return _update(command, parent, stamped, old_rec, now_ms, timestamp_ms, shards, horizon_ms)


def _changeable_parent(existing: ScheduleRow | None, schedule_id: str) -> ScheduleRow:
    if existing is None:
        raise CommandRejected(Code.NOT_FOUND, f"no schedule {schedule_id!r}")
    if existing.recurrence is None:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"schedule {schedule_id!r} is a one-shot schedule; change it with due",
        )
    if existing.state == ScheduleState.CANCELLED:
        raise CommandRejected(
            Code.ALREADY_CANCELLED, f"schedule {schedule_id!r} was already cancelled"
        )
    if existing.state in (ScheduleState.FIRED, ScheduleState.MISSED):
        raise CommandRejected(Code.ALREADY_FIRED, f"schedule {schedule_id!r} has no runs left")
    return existing


def _cancel(
    existing: ScheduleRow,
    stamped: ScheduleRow,
    old_rec: Recurrence,
    now_ms: int,
    timestamp_ms: int,
    shards: int,
) -> RecurringDecision:
    # Every run not due yet, including one whose nominal time passed but that waits
    # inside its jitter window.
    pending = _pending_runs(
        existing,
        old_rec,
        from_ms=now_ms - old_rec.jitter_s * 1000,
        due_after_ms=now_ms,
    )
    row = replace(
        stamped,
        state=ScheduleState.CANCELLED,
        materialize_key=materialize_key(existing.partition, NEVER_MS),
        backfill_stop_version=stamped.version,
    )
    return RecurringDecision(
        Code.OK,
        f"cancelled; {len(pending)} pending runs removed",
        change=_change(row, existing, pending, timestamp_ms, shards, ScheduleEvent.CANCELLED),
        withdraw=tuple((row.tenant, run_id(row.schedule_id, n), row.version) for n, _ in pending),
    )


def _pause(
    existing: ScheduleRow,
    stamped: ScheduleRow,
    old_rec: Recurrence,
    now_ms: int,
    timestamp_ms: int,
    shards: int,
    unemitted: Unemitted | None,
) -> RecurringDecision:
    """Every run not emitted yet is withdrawn and its bucket row deleted - unlike a cancel,
    also one already due and waiting in the ticker (its timeline, its fair queue, a minute
    not read yet): none fires once the pause is answered. The materialiser writes no runs
    while the parent is paused; ``materialized_until_ms`` stays at the first run not
    fired, where the resume counts the skipped runs from."""
    ticker = unemitted or DueAfter()
    earliest = ticker.earliest_unemitted_ms(now_ms)
    candidates = _pending_runs(
        existing,
        old_rec,
        from_ms=earliest - old_rec.jitter_s * 1000,
        due_after_ms=min(earliest, now_ms + 1) - 1,
    )
    pending = [
        (nominal, due)
        for nominal, due in candidates
        if ticker.may_emit(existing.tenant, run_id(existing.schedule_id, nominal), due)
    ]
    until = existing.materialized_until_ms or 0
    first = min((nominal for nominal, _ in pending), default=until)
    row = replace(
        stamped,
        state=ScheduleState.PAUSED,
        materialize_key=materialize_key(existing.partition, NEVER_MS),
        materialized_until_ms=min(until, first),
        run_count=max(0, (existing.run_count or 0) - len(pending)),
        # Its backfills' runs not emitted yet stop too (``stopped_backfills``).
        backfill_stop_version=stamped.version,
    )
    change = _change(row, existing, pending, timestamp_ms, shards, ScheduleEvent.PAUSED)
    return RecurringDecision(
        Code.OK,
        f"paused; {len(pending)} pending runs removed",
        change=replace(change, event_detail=f"{len(pending)} pending runs removed"),
        withdraw=tuple(
            (row.tenant, run_id(row.schedule_id, n), existing.version) for n, _ in pending
        ),
    )


# Most runs a resume counts as skipped while paused (each costs a cron step): a longer
# pause of a frequent schedule counts this many towards ``max_runs``.
MAX_SKIPPED_COUNT = 10_000


def _resume(
    existing: ScheduleRow,
    stamped: ScheduleRow,
    rec: Recurrence,
    now_ms: int,
    timestamp_ms: int,
    horizon_ms: int,
) -> RecurringDecision:
    """The parent goes on with its first run after now. The runs from where it was
    paused up to that one were skipped: they count towards ``max_runs`` and are recorded
    as one ``skipped_paused`` event."""
    until = existing.materialized_until_ms or 0
    anchor = existing.anchor_ms or existing.created_ms
    count = existing.run_count or 0
    skipped: list[int] = []
    new_until = NEVER_MS
    if until < NEVER_MS:
        begin = max(now_ms + 1, series_start(rec, anchor))
        new_until = next(occurrences(rec, begin, anchor_ms=anchor), NEVER_MS)
        left = None if rec.max_runs is None else max(0, rec.max_runs - count)
        for nominal in occurrences(rec, until, anchor_ms=anchor):
            if nominal >= new_until or len(skipped) >= MAX_SKIPPED_COUNT:
                break
            if left is not None and len(skipped) >= left:
                break
            skipped.append(nominal)
        count += len(skipped)
        if rec.max_runs is not None and count >= rec.max_runs:
            new_until = NEVER_MS  # the pause used up the runs it had left
    row = _row_state(
        replace(stamped, state=ScheduleState.SCHEDULED),
        until_ms=new_until,
        run_count=count,
        now_ms=now_ms,
        horizon_ms=horizon_ms,
    )
    notes: tuple[EventNote, ...] = ()
    text = "resumed"
    if skipped:
        many = "at least " if len(skipped) >= MAX_SKIPPED_COUNT else ""
        span = f"{many}{len(skipped)} runs from {format_iso_ms(skipped[0])} to " + format_iso_ms(
            skipped[-1]
        )
        notes = (EventNote(ScheduleEvent.SKIPPED_PAUSED, f"{span} skipped while paused"),)
        text = f"resumed; {span} were skipped while paused"
    change = ScheduleChange(
        row=row,
        new_bucket=None,
        old_bucket=None,
        now_ms=timestamp_ms,
        event=ScheduleEvent.RESUMED,
        notes=notes,
    )
    return RecurringDecision(Code.OK, text, change=change, skipped_paused=len(skipped))


def _update(
    command: UpdateCommand,
    existing: ScheduleRow,
    stamped: ScheduleRow,
    old_rec: Recurrence,
    now_ms: int,
    timestamp_ms: int,
    shards: int,
    horizon_ms: int,
) -> RecurringDecision:
    if command.due_ms is not None:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"schedule {command.schedule_id!r} is recurring: it has no due; send recurrence",
        )
    new_rec = command.recurrence or old_rec
    changed = recurrence_to_json(new_rec) != existing.recurrence
    until = existing.materialized_until_ms or 0
    # Runs with a nominal time after now follow the update; those already materialised
    # are removed here and written again by the materialiser. A run whose nominal time
    # has come keeps its old content (it may be firing).
    pending = _pending_runs(existing, old_rec, from_ms=now_ms + 1, due_after_ms=now_ms)
    count = max(0, (existing.run_count or 0) - len(pending))
    anchor = timestamp_ms if changed else (existing.anchor_ms or timestamp_ms)
    if not changed and until < now_ms:
        new_until = until  # a backlog (the materialiser lagged): keep working it off
    else:
        begin = max(now_ms + 1, series_start(new_rec, anchor))
        new_until = next(occurrences(new_rec, begin, anchor_ms=anchor), NEVER_MS)
        if changed and new_until >= NEVER_MS:
            raise CommandRejected(
                Code.INVALID_FIELD, "recurrence has no run after now (check start, end, cron)"
            )
    row = replace(
        _updated_content(command, stamped, existing),
        recurrence=recurrence_to_json(new_rec),
        anchor_ms=anchor,
    )
    row = _row_state(row, until_ms=new_until, run_count=count, now_ms=now_ms, horizon_ms=horizon_ms)
    return RecurringDecision(
        Code.OK,
        f"updated; {len(pending)} pending runs will follow the update",
        change=_change(row, existing, pending, timestamp_ms, shards, ScheduleEvent.UPDATED),
        # The old version's rows are refused from now on, the new ones (version + 1) not.
        withdraw=tuple(
            (row.tenant, run_id(row.schedule_id, n), existing.version) for n, _ in pending
        ),
    )


def _pending_runs(
    row: ScheduleRow, rec: Recurrence, *, from_ms: int, due_after_ms: int
) -> list[tuple[int, int]]:
    """(nominal, due) of the runs of ``row`` materialised at or after ``from_ms`` whose due
    time is after ``due_after_ms`` (i.e. not fired yet)."""
    until = row.materialized_until_ms or 0
    anchor = row.anchor_ms or 0
    out = []
    for nominal in occurrences(rec, from_ms, anchor_ms=anchor):
        if nominal >= until:
            break
        due = nominal + jitter_ms(row.tenant, run_id(row.schedule_id, nominal), rec.jitter_s)
        if due > due_after_ms:
            out.append((nominal, due))
    return out


def _change(
    row: ScheduleRow,
    old: ScheduleRow,
    pending: Sequence[tuple[int, int]],
    now_ms: int,
    shards: int,
    event: ScheduleEvent,
) -> ScheduleChange:
    deletes = tuple(
        BucketKey.of(
            partition=old.partition,
            due_ms=due,
            tenant=old.tenant,
            schedule_id=run_id(old.schedule_id, nominal),
            shards=shards,
        )
        for nominal, due in pending
    )
    history: tuple[Stmt, ...] = tuple(
        ("rec_delete_run", [old.tenant, old.schedule_id, nominal]) for nominal, _ in pending
    )
    return ScheduleChange(
        row=row,
        new_bucket=None,
        old_bucket=None,
        now_ms=now_ms,
        event=event,
        run_deletes=deletes,
        commit_with=history,
    )


def _create(
    cmd: CreateCommand,
    existing: ScheduleRow | None,
    partition: int,
    offset: int,
    timestamp_ms: int,
    now_ms: int,
    horizon_ms: int,
) -> RecurringDecision:
    assert cmd.recurrence is not None
    text = recurrence_to_json(cmd.recurrence)
    callback = callback_to_json(cmd.callback)
    if existing is not None:
        return RecurringDecision(
            Code.DUPLICATE,
            repeated_create(existing, cmd, callback, same_timing=existing.recurrence == text),
        )
    rec = cmd.recurrence
    # Occurrences before the create are not runs that were missed: start from now.
    begin = max(series_start(rec, timestamp_ms), timestamp_ms)
    first = next(occurrences(rec, begin, anchor_ms=timestamp_ms), NEVER_MS)
    if first >= NEVER_MS:
        raise CommandRejected(
            Code.INVALID_FIELD, "recurrence has no run after now (check start, end, cron)"
        )
    row = ScheduleRow(
        tenant=cmd.tenant,
        schedule_id=cmd.schedule_id,
        partition=partition,
        state=ScheduleState.SCHEDULED,
        due_ms=first,
        version=1,
        created_ms=timestamp_ms,
        updated_ms=timestamp_ms,
        order_key=cmd.order_key,
        payload=cmd.payload,
        payload_type=str(cmd.payload_type),
        callback=callback,
        misfire_tolerance_s=cmd.misfire_tolerance_s,
        applied_offset=offset,
        last_code=str(Code.OK),
        recurrence=text,
        anchor_ms=timestamp_ms,
    )
    row = _row_state(row, until_ms=first, run_count=0, now_ms=now_ms, horizon_ms=horizon_ms)
    change = ScheduleChange(
        row=row, new_bucket=None, old_bucket=None, now_ms=timestamp_ms, event=ScheduleEvent.CREATED
    )
    return RecurringDecision(Code.OK, f"scheduled; first run at epoch ms {first}", change=change)


def _row_state(
    row: ScheduleRow, *, until_ms: int, run_count: int, now_ms: int, horizon_ms: int
) -> ScheduleRow:
    """``row`` with its materialisation columns for a new ``until_ms``."""
    refresh = now_ms + REFRESH_MS
    due = until_ms if until_ms < NEVER_MS else now_ms
    return replace(
        row,
        materialized_until_ms=until_ms,
        run_count=run_count,
        due_ms=min(due, refresh + horizon_ms),
        materialize_key=materialize_key(
            row.partition,
            NEVER_MS
            if until_ms >= NEVER_MS
            else min(extend_at(until_ms, horizon_ms, row.schedule_id), refresh),
        ),
    )


# -- recurring schedules: one step of materialisation ---------------------------------------


@dataclass(frozen=True, slots=True)
class ParentStep:
    """One parent's share of a step: its plan and the bucket rows of its planned runs."""

    parent: ScheduleRow
    plan: Plan
    runs: list[BucketRow]


@dataclass(frozen=True, slots=True)
class Extension:
    """One step over a list of parents: ``steps`` to write, ``retired`` parents to take out
    of the due queue (no longer scheduled or recurring), and ``done``, how many of the
    parents it handled (fewer than all when the past-due budget cut it short)."""

    steps: list[ParentStep]
    retired: list[tuple[ScheduleRow, str | None]]
    done: int


def plan_extension(
    parents: Sequence[ScheduleRow],
    *,
    now_ms: int,
    horizon_ms: int,
    shards: int,
    max_runs: int,
    late_budget: int,
) -> Extension:
    """Plan the runs of ``parents`` due at ``now_ms``. Planning stops before a parent whose
    past-due runs would take the step beyond ``late_budget`` (the first parent always
    goes), so the catch-up fired under the partition's lock stays bounded."""
    steps: list[ParentStep] = []
    retired: list[tuple[ScheduleRow, str | None]] = []
    late_planned = 0
    for index, parent in enumerate(parents):
        if parent.recurrence is None or parent.state != ScheduleState.SCHEDULED:
            # Nothing to extend any more: take it out of the index.
            key = materialize_key(parent.partition, NEVER_MS)
            retired.append((replace(parent, materialize_key=key), None))
            continue
        step = _plan_parent(parent, now_ms=now_ms, horizon_ms=horizon_ms, max_runs=max_runs)
        late_here = sum(1 for r in step.runs if r.due_ms <= now_ms)
        if steps and late_here and late_planned + late_here > late_budget:
            return Extension(steps, retired, index)
        late_planned += late_here
        rows = [
            run_bucket(parent, r.nominal_ms, r.due_ms, r.misfire_tolerance_s, shards)
            for r in step.runs
        ]
        steps.append(ParentStep(parent, step, rows))
    return Extension(steps, retired, len(parents))


def _plan_parent(parent: ScheduleRow, *, now_ms: int, horizon_ms: int, max_runs: int) -> Plan:
    assert parent.recurrence is not None
    return plan(
        recurrence_from_json(parent.recurrence),
        tenant=parent.tenant,
        schedule_id=parent.schedule_id,
        anchor_ms=parent.anchor_ms or parent.created_ms,
        tolerance_s=parent.misfire_tolerance_s or 0,
        until_ms=parent.materialized_until_ms or 0,
        run_count=parent.run_count or 0,
        now_ms=now_ms,
        horizon_ms=horizon_ms,
        max_runs=max_runs,
    )


def run_bucket(
    parent: ScheduleRow, nominal_ms: int, due_ms: int, tolerance_s: int, shards: int
) -> BucketRow:
    """The bucket row of one run of ``parent`` (a one-shot row the ticker fires)."""
    rid = run_id(parent.schedule_id, nominal_ms)
    return BucketRow(
        partition=parent.partition,
        minute_ms=minute_of(due_ms),
        shard=shard_of(parent.tenant, rid, shards),
        due_ms=due_ms,
        tenant=parent.tenant,
        schedule_id=rid,
        version=parent.version,
        order_key=parent.order_key or parent.schedule_id,
        payload=parent.payload,
        payload_type=parent.payload_type,
        callback=parent.callback,
        misfire_tolerance_s=tolerance_s,
        # Every run carries the context of the command that last set the schedule.
        traceparent=parent.traceparent,
        tracestate=parent.tracestate,
    )


def parent_commits(
    steps: Sequence[ParentStep], *, now_ms: int, horizon_ms: int
) -> list[tuple[ScheduleRow, str | None]]:
    """The parents' new state after ``steps`` (the step's commit point), each with the
    note of the runs the misfire policy skipped, if any."""
    commits = []
    for s in steps:
        new = _row_state(
            s.parent,
            until_ms=s.plan.until_ms,
            run_count=s.plan.run_count,
            now_ms=now_ms,
            horizon_ms=horizon_ms,
        )
        note = None
        if s.plan.skipped:
            note = (
                f"misfire policy skipped {len(s.plan.skipped)} runs from epoch ms "
                f"{s.plan.skipped[0]} to {s.plan.skipped[-1]}"
            )
        commits.append((new, note))
    return commits


# -- recurring schedules: the runs to come --------------------------------------------------


class Run(TypedDict):
    """One run of a recurring schedule as its run listings show it; a past run also has its
    fire state and delivery outcome."""

    run_id: str  # the schedule id its triggers carry
    nominal_ms: int
    due_ms: int  # nominal + jitter
    trigger_id: str
    state: NotRequired[str]  # scheduled | fired | missed
    fired_ms: NotRequired[int | None]
    delivery: NotRequired[str | None]  # delivered | dead_lettered


class ScheduleRuns(TypedDict):
    """A recurring schedule's past runs (newest first) and next runs, with its row's
    figures (``streams.recurring_store.schedule_runs``)."""

    tenant: str
    schedule_id: str
    state: str
    version: int
    recurrence: str  # its JSON text, as stored
    materialized_until_ms: int | None
    run_count: int | None
    past: list[Run]
    next: list[Run]


def upcoming_runs(parent: ScheduleRow, rec: Recurrence, *, now_ms: int, upcoming: int) -> list[Run]:
    """The next ``upcoming`` runs of a scheduled parent after ``now_ms``: ``run_id``,
    ``nominal_ms``, ``due_ms`` (nominal + jitter) and ``trigger_id`` of each."""
    anchor = parent.anchor_ms or parent.created_ms
    until = parent.materialized_until_ms or 0
    counted: int | None = parent.run_count or 0
    if until >= NEVER_MS:
        # Every run was written (max_runs or end reached): the expression may go on
        # forever, so let next_runs count the runs before now from the series start
        # (bounded by max_runs) instead of walking forward to ``until``.
        counted = None
    elif until > now_ms:
        # Runs materialised after now were counted but have not happened yet.
        counted = max(0, (counted or 0) - _count_between(rec, now_ms, until, anchor))
    out: list[Run] = []
    for nominal in next_runs(rec, now_ms, upcoming, anchor_ms=anchor, counted=counted):
        rid = run_id(parent.schedule_id, nominal)
        due = nominal + jitter_ms(parent.tenant, rid, rec.jitter_s)
        out.append(
            Run(
                run_id=rid,
                nominal_ms=nominal,
                due_ms=due,
                trigger_id=trigger_id(parent.tenant, rid, due),
            )
        )
    return out


def _count_between(rec: Recurrence, lo: int, hi: int, anchor: int) -> int:
    count = 0
    for at in occurrences(rec, lo, anchor_ms=anchor):
        if at >= hi:
            break
        count += 1
    return count

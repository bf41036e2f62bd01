"""The messages of the wire contract as frozen dataclasses.

These are the in-memory shapes every package shares: commands read from the commands
topic, the results written back, and the triggers emitted on the fires topic. They hold
already-validated values; parsing and checking untrusted bytes is ``topics.validation``'s
job and turning models into bytes is ``topics.codec``'s. Must never do I/O.

Payloads are carried as ``payload: bytes`` plus ``payload_type``: with ``json`` the bytes
are canonical JSON (``topics.fields.canonical_json``), with ``bytes`` they are opaque.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, TypeAlias

from base.errors import CommandRejected
from topics.codes import ACCEPTED_CODES, Code


class CommandType(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    CANCEL = "cancel"
    # Stop firing until resumed (a recurring schedule skips its runs meanwhile).
    PAUSE = "pause"
    RESUME = "resume"
    # Fire once, at once, as an extra run with a trigger id of its own.
    TRIGGER = "trigger"
    # Emit a recurring schedule's runs of a past window, under their own run and trigger ids.
    BACKFILL = "backfill"


class ResultStatus(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"


class PayloadType(StrEnum):
    JSON = "json"  # bytes are canonical JSON; delivered as a JSON value
    BYTES = "bytes"  # opaque bytes; travel as base64 inside JSON messages


HttpMethod: TypeAlias = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]
HTTP_METHODS: frozenset[str] = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})


class DeliveryOutcome(StrEnum):
    """How a trigger's delivery ended, as the proxy reports it on the deliveries topic and
    the scheduler stores it in ``schedules.delivery_outcome`` (docs/proxy.md)."""

    DELIVERED = "delivered"
    DEAD_LETTERED = "dead_lettered"


@dataclass(frozen=True, kw_only=True)
class DeliveryRetry:
    """How the proxy retries one callback (``proxy.retry``); a None field keeps the proxy's
    own setting. A callback without one gets its tenant's default ``retry_policy`` stamped
    by the command agent when the command is accepted (``streams.tenants.stamp_retry``)."""

    max_retry_age_s: float | None = None  # 0: retry 4xx/5xx/timeouts without limit
    retries_6xx: int | None = None


@dataclass(frozen=True, kw_only=True)
class HttpCallback:
    """Deliver the trigger by an HTTP request (done by the proxy)."""

    url: str
    method: HttpMethod = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0
    retry: DeliveryRetry | None = None


@dataclass(frozen=True, kw_only=True)
class KafkaCallback:
    """Deliver the trigger as a record on a Kafka topic; ``key`` None means a keyless record."""

    topic: str
    key: str | None = None
    retry: DeliveryRetry | None = None


Callback: TypeAlias = HttpCallback | KafkaCallback


class Nonexistent(StrEnum):
    """What a recurring schedule does with a local time that a DST gap skips."""

    SKIP = "skip"  # no run that day
    SHIFT_FORWARD = "shift_forward"  # run at the same wall time + the gap (02:30 -> 03:30)


class Ambiguous(StrEnum):
    """What a recurring schedule does with a local time that occurs twice (DST ends)."""

    ONCE = "once"  # only the first occurrence
    TWICE = "twice"  # both occurrences


class DayMatch(StrEnum):
    """How a cron's day-of-month and day-of-week combine when both are restricted."""

    ANY = "any"  # Vixie cron: a day matching either field runs
    ALL = "all"  # a day must match both (go-scheduler, "the first Monday": 1-7 and mon)


class Misfire(StrEnum):
    """What happens to runs that could not fire within ``misfire_tolerance_s`` (downtime)."""

    FIRE_ALL = "fire_all"
    FIRE_LATEST = "fire_latest"
    SKIP = "skip"


@dataclass(frozen=True, kw_only=True)
class Recurrence:
    """When a recurring schedule runs; exactly one of ``cron`` / ``every_s``.

    ``cron`` is normalised to six fields, seconds first (``"0 */5 * * * *"``); macros
    (``@hourly``...) are expanded. Times are epoch ms; ``start_ms`` None means "from when
    the create (or the update that set this recurrence) was applied". The time math lives
    in ``streams.recurring``.
    """

    cron: str | None = None
    every_s: int | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    max_runs: int | None = None
    time_zone: str = "UTC"
    nonexistent: Nonexistent = Nonexistent.SKIP
    ambiguous: Ambiguous = Ambiguous.ONCE
    jitter_s: int = 0
    misfire: Misfire = Misfire.FIRE_LATEST
    day_match: DayMatch = DayMatch.ANY

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every_s is None):
            raise CommandRejected(
                Code.INVALID_FIELD, "a recurrence needs exactly one of cron and every_s"
            )


@dataclass(frozen=True, kw_only=True)
class CreateCommand:
    tenant: str
    schedule_id: str
    request_id: str | None = None
    # Echoed in the result only once the worker verified the command's signature, so a
    # requester can tell its own command's answer from one another producer provoked.
    reply_nonce: str | None = None
    due_ms: int = 0
    payload: bytes = b""
    payload_type: PayloadType = PayloadType.BYTES
    callback: Callback
    # Empty means "the schedule id" (resolved in __post_init__), so callers may leave it out.
    order_key: str = ""
    misfire_tolerance_s: int
    # A recurring schedule (streams.recurring); ``due_ms`` is then unused (0).
    recurrence: Recurrence | None = None

    def __post_init__(self) -> None:
        if not self.order_key:
            object.__setattr__(self, "order_key", self.schedule_id)

    @property
    def type(self) -> CommandType:
        return CommandType.CREATE


@dataclass(frozen=True, kw_only=True)
class UpdateCommand:
    """Change some of due, payload, callback; ``None`` leaves a field as it is."""

    tenant: str
    schedule_id: str
    request_id: str | None = None
    reply_nonce: str | None = None
    due_ms: int | None = None
    payload: bytes | None = None
    payload_type: PayloadType | None = None
    callback: Callback | None = None
    # Replaces the whole recurrence of a recurring schedule (runs not yet fired follow it).
    recurrence: Recurrence | None = None

    def __post_init__(self) -> None:
        # The decoder reports these with a precise field name first; these guards catch
        # programmatic construction (clients, tests) that would otherwise encode nonsense.
        if (self.payload is None) != (self.payload_type is None):
            raise CommandRejected(
                Code.INVALID_FIELD, "payload and payload_type must be given together"
            )
        if (
            self.due_ms is None
            and self.payload is None
            and self.callback is None
            and self.recurrence is None
        ):
            raise CommandRejected(
                Code.NOTHING_TO_UPDATE,
                "an update must change at least one of due, payload, callback, recurrence",
            )

    @property
    def type(self) -> CommandType:
        return CommandType.UPDATE


@dataclass(frozen=True, kw_only=True)
class OnSchedule:
    """What every command that names one schedule and carries nothing else holds."""

    tenant: str
    schedule_id: str
    request_id: str | None = None
    reply_nonce: str | None = None


@dataclass(frozen=True, kw_only=True)
class CancelCommand(OnSchedule):
    @property
    def type(self) -> CommandType:
        return CommandType.CANCEL


@dataclass(frozen=True, kw_only=True)
class PauseCommand(OnSchedule):
    """Stop the schedule from firing until a resume; triggers already emitted are not
    recalled."""

    @property
    def type(self) -> CommandType:
        return CommandType.PAUSE


@dataclass(frozen=True, kw_only=True)
class ResumeCommand(OnSchedule):
    """Let a paused schedule fire again: a one-shot whose due time passed meanwhile follows
    its misfire tolerance, a recurring one goes on with its next run."""

    @property
    def type(self) -> CommandType:
        return CommandType.RESUME


@dataclass(frozen=True, kw_only=True)
class TriggerCommand(OnSchedule):
    """Fire the schedule once now, besides its own runs (paused or not)."""

    @property
    def type(self) -> CommandType:
        return CommandType.TRIGGER


@dataclass(frozen=True, kw_only=True)
class BackfillCommand:
    """Emit the runs a recurring schedule would have had with nominal times in
    ``[from_ms, to_ms)`` and in the past, each with its nominal run id and trigger id,
    paced by the worker, a bounded number per command (docs/wire-contract.md)."""

    tenant: str
    schedule_id: str
    from_ms: int
    to_ms: int
    request_id: str | None = None
    reply_nonce: str | None = None

    @property
    def type(self) -> CommandType:
        return CommandType.BACKFILL


# The commands that name a schedule and nothing else.
SimpleCommand: TypeAlias = CancelCommand | PauseCommand | ResumeCommand | TriggerCommand

Command: TypeAlias = (
    CreateCommand
    | UpdateCommand
    | CancelCommand
    | PauseCommand
    | ResumeCommand
    | TriggerCommand
    | BackfillCommand
)


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """The outcome of one message of the commands topic.

    Ids are ``None`` only when a rejected message was too broken to recover them;
    ``partition``/``offset`` locate the command message itself.
    """

    schedule_id: str | None
    tenant: str | None
    request_id: str | None
    command: CommandType | None
    status: ResultStatus
    code: Code
    message: str
    at_ms: int
    partition: int
    offset: int
    # The command's reply_nonce, only when its signature verified (see CreateCommand).
    reply_nonce: str | None = None

    def __post_init__(self) -> None:
        # Clients branch on either field; they must never disagree.
        accepted = self.code in ACCEPTED_CODES
        if accepted != (self.status == ResultStatus.ACCEPTED):
            raise ValueError(f"status {self.status} contradicts code {self.code}")


@dataclass(frozen=True, kw_only=True)
class Trigger:
    """One emission of a due schedule on the fires topic.

    ``trigger_id`` is ``topics.ids.trigger_id(tenant, schedule_id, due_ms)``, identical
    across re-emissions; ``attempt`` counts emissions of this trigger, starting at 1.
    """

    trigger_id: str
    schedule_id: str
    tenant: str
    due_ms: int
    emitted_ms: int
    attempt: int
    order_key: str
    payload: bytes
    payload_type: PayloadType
    callback: Callback
    # W3C trace context carried from the command that made the schedule; travels as the
    # fires record's ``traceparent``/``tracestate`` headers, never in its JSON value.
    traceparent: str | None = None
    tracestate: str | None = None

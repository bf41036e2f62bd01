"""Turning untrusted command bytes into a validated ``Command``, or a precise rejection.

Everything a client can get wrong is caught here and raised as
``CommandRejected(code, message)`` naming the offending field, so the scheduler can answer
on the command-results topic instead of crashing or storing garbage. The checks of single
values live beside it and are shared with ``topics.codec``, so a callback means the same
thing wherever it is read: ``topics.fields`` (limits, ids, due times, payloads),
``topics.callbacks`` and ``topics.recurrence``.

Checks that need stored state (tenant registered, schedule exists, duplicate or conflict,
an update's due against the stored misfire tolerance) belong to the scheduler. This module
must never do I/O, read the clock (``now_ms`` is passed in) or raise anything but
``CommandRejected`` from ``decode_command``; ``salvage_ids`` must never raise at all.
"""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import orjson

from base.errors import CommandRejected
from topics.callbacks import check_own_headers, check_target, parse_callback
from topics.codes import Code
from topics.fields import (
    DEFAULT_LIMITS,
    MAX_MISFIRE_TOLERANCE_S,
    Fields,
    Limits,
    canonical_json,
    check_fields,
    check_not_past,
    check_tenant,
    check_text,
    integer,
    load_object,
    parse_due,
    parse_payload,
    show,
)
from topics.ids import format_iso_ms
from topics.models import (
    BackfillCommand,
    CancelCommand,
    Command,
    CommandType,
    CreateCommand,
    PauseCommand,
    PayloadType,
    ResumeCommand,
    SimpleCommand,
    TriggerCommand,
    UpdateCommand,
)
from topics.recurrence import RECURRING_DEFAULT_MISFIRE_TOLERANCE_S, parse_recurrence

# The decoder's interface: what a caller of ``decode_command`` and ``salvage_ids`` needs.
__all__ = [
    "COMMAND_FIELDS",
    "DEFAULT_LIMITS",
    "Limits",
    "Salvaged",
    "canonical_json",
    "check_reply_nonce",
    "decode_command",
    "salvage_ids",
]

# The single source of the command and callback shapes: the decoder enforces these and the
# unit tests compare them with schema/json/*.schema.json.
COMMAND_FIELDS: dict[CommandType, Fields] = {
    # Exactly one of due (one-shot) and recurrence (recurring) is required as well.
    CommandType.CREATE: Fields(
        required=("type", "tenant", "schedule_id", "callback"),
        optional=(
            "request_id",
            "reply_nonce",
            "due",
            "recurrence",
            "payload",
            "payload_b64",
            "order_key",
            "misfire_tolerance_s",
        ),
    ),
    CommandType.UPDATE: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=(
            "request_id",
            "reply_nonce",
            "due",
            "recurrence",
            "payload",
            "payload_b64",
            "callback",
        ),
    ),
    CommandType.CANCEL: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=("request_id", "reply_nonce"),
    ),
    CommandType.PAUSE: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=("request_id", "reply_nonce"),
    ),
    CommandType.RESUME: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=("request_id", "reply_nonce"),
    ),
    CommandType.TRIGGER: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=("request_id", "reply_nonce"),
    ),
    CommandType.BACKFILL: Fields(
        required=("type", "tenant", "schedule_id", "from", "to"),
        optional=("request_id", "reply_nonce"),
    ),
}
# The commands that carry nothing but the schedule they name.
_SIMPLE_COMMANDS: dict[CommandType, type[SimpleCommand]] = {
    CommandType.CANCEL: CancelCommand,
    CommandType.PAUSE: PauseCommand,
    CommandType.RESUME: ResumeCommand,
    CommandType.TRIGGER: TriggerCommand,
}

_REPLY_NONCE = re.compile(r"[A-Za-z0-9_-]{16,128}", re.ASCII)
_COMMAND_TYPES = frozenset(t.value for t in CommandType)


class Salvaged(NamedTuple):
    tenant: str | None
    schedule_id: str | None
    request_id: str | None
    command: CommandType | None


def _command_type(obj: dict[str, object]) -> CommandType:
    if "type" not in obj:
        raise CommandRejected(Code.MISSING_FIELD, "missing required field 'type'")
    value = obj["type"]
    if not isinstance(value, str) or value not in _COMMAND_TYPES:
        raise CommandRejected(
            Code.UNKNOWN_COMMAND_TYPE,
            f"type {show(value)} is not one of {', '.join(t.value for t in CommandType)}",
        )
    return CommandType(value)


def _check_key(key: bytes | None, schedule_id: str) -> None:
    if key is not None and key != schedule_id.encode("utf-8"):
        raise CommandRejected(
            Code.KEY_MISMATCH,
            f"Kafka key {show(key)} differs from schedule_id {show(schedule_id)}; key "
            "commands by schedule_id so every command of a schedule shares a partition",
        )


def decode_command(raw: bytes, *, key: bytes | None, now_ms: int, limits: Limits) -> Command:
    """The command in a commands-topic message, or ``CommandRejected`` saying what is wrong.

    ``key`` is the Kafka message key; when given it must be the UTF-8 schedule id.
    """
    if len(raw) > limits.message_cap:
        raise CommandRejected(
            Code.TOO_LARGE,
            f"message is {len(raw)} bytes; at most {limits.message_cap} are accepted",
        )
    obj = load_object(raw)
    ctype = _command_type(obj)
    check_fields(obj, COMMAND_FIELDS[ctype], where=f"{ctype} command")
    if ctype is CommandType.CREATE and "due" not in obj and "recurrence" not in obj:
        raise CommandRejected(
            Code.MISSING_FIELD,
            "create command: missing required field 'due' (or 'recurrence' for a recurring "
            "schedule)",
        )
    tenant = check_tenant(obj["tenant"])
    schedule_id = check_text(obj["schedule_id"], "schedule_id", max_len=limits.max_id_len)
    _check_key(key, schedule_id)
    request_id = obj.get("request_id")
    if request_id is not None:
        request_id = check_text(request_id, "request_id", max_len=limits.max_id_len)
    nonce = check_reply_nonce(obj["reply_nonce"]) if "reply_nonce" in obj else None
    simple = _SIMPLE_COMMANDS.get(ctype)
    if simple is not None:
        return simple(
            tenant=tenant, schedule_id=schedule_id, request_id=request_id, reply_nonce=nonce
        )
    if ctype is CommandType.CREATE:
        return _create(obj, tenant, schedule_id, request_id, nonce, now_ms=now_ms, limits=limits)
    if ctype is CommandType.BACKFILL:
        return _backfill(obj, tenant, schedule_id, request_id, nonce)
    return _update(obj, tenant, schedule_id, request_id, nonce, now_ms=now_ms, limits=limits)


def _backfill(
    obj: dict[str, object],
    tenant: str,
    schedule_id: str,
    request_id: str | None,
    nonce: str | None,
) -> BackfillCommand:
    """A backfill's window ``[from, to)``: two times like ``due``, ``from`` before ``to``.
    Whether the window lies in the past is the scheduler's to decide (its clock)."""
    from_ms = parse_due(obj["from"], "from")
    to_ms = parse_due(obj["to"], "to")
    if from_ms >= to_ms:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"from ({format_iso_ms(from_ms)}) must be before to ({format_iso_ms(to_ms)})",
        )
    return BackfillCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        from_ms=from_ms,
        to_ms=to_ms,
        request_id=request_id,
        reply_nonce=nonce,
    )


def check_reply_nonce(value: object) -> str:
    """A command's ``reply_nonce``: 16-128 characters of ``A-Z a-z 0-9 _ -``. At least 16
    so a requester cannot pick one another producer could guess (the API sends 32 hex
    digits of 128 random bits)."""
    if not isinstance(value, str) or not _REPLY_NONCE.fullmatch(value):
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"reply_nonce must be 16-128 characters of A-Z a-z 0-9 _ -, got {show(value)}",
        )
    return value


def _create(
    obj: dict[str, object],
    tenant: str,
    schedule_id: str,
    request_id: str | None,
    reply_nonce: str | None,
    *,
    now_ms: int,
    limits: Limits,
) -> CreateCommand:
    recurrence = None
    if "recurrence" in obj:
        if "due" in obj:
            raise CommandRejected(
                Code.INVALID_FIELD,
                "give either due (a one-shot schedule) or recurrence, not both; a recurring "
                "schedule's first run is set by recurrence.start",
            )
        recurrence = parse_recurrence(obj["recurrence"], now_ms=now_ms)
        due_ms = 0
        tolerance = RECURRING_DEFAULT_MISFIRE_TOLERANCE_S
    else:
        due_ms = parse_due(obj["due"])
        tolerance = limits.default_misfire_tolerance_s
    if "misfire_tolerance_s" in obj:
        tolerance = integer(obj["misfire_tolerance_s"], "misfire_tolerance_s", Code.INVALID_FIELD)
        if not 0 <= tolerance <= MAX_MISFIRE_TOLERANCE_S:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"misfire_tolerance_s must be within 0..{MAX_MISFIRE_TOLERANCE_S}, got {tolerance}",
            )
    if recurrence is None:
        check_not_past(due_ms, now_ms=now_ms, misfire_tolerance_s=tolerance)
    payload, payload_type = parse_payload(obj, max_bytes=limits.max_payload_bytes)
    callback = parse_callback(obj["callback"], limits=limits)
    check_target(callback, limits=limits)
    check_own_headers(callback)
    order_key = schedule_id
    if "order_key" in obj:
        order_key = check_text(obj["order_key"], "order_key", max_len=limits.max_id_len)
    return CreateCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        request_id=request_id,
        reply_nonce=reply_nonce,
        due_ms=due_ms,
        payload=b"" if payload is None else payload,
        payload_type=PayloadType.BYTES if payload_type is None else payload_type,
        callback=callback,
        order_key=order_key,
        misfire_tolerance_s=tolerance,
        recurrence=recurrence,
    )


def _update(
    obj: dict[str, object],
    tenant: str,
    schedule_id: str,
    request_id: str | None,
    reply_nonce: str | None,
    *,
    now_ms: int,
    limits: Limits,
) -> UpdateCommand:
    if not any(name in obj for name in ("due", "recurrence", "payload", "payload_b64", "callback")):
        raise CommandRejected(
            Code.NOTHING_TO_UPDATE,
            "an update must carry at least one of due, recurrence, payload, payload_b64, callback",
        )
    if "due" in obj and "recurrence" in obj:
        raise CommandRejected(
            Code.INVALID_FIELD,
            "give either due (a one-shot schedule) or recurrence (a recurring one), not both",
        )
    due_ms = parse_due(obj["due"]) if "due" in obj else None
    recurrence = parse_recurrence(obj["recurrence"], now_ms=now_ms) if "recurrence" in obj else None
    payload, payload_type = parse_payload(obj, max_bytes=limits.max_payload_bytes)
    callback = parse_callback(obj["callback"], limits=limits) if "callback" in obj else None
    if callback is not None:
        check_target(callback, limits=limits)
        check_own_headers(callback)
    return UpdateCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        request_id=request_id,
        reply_nonce=reply_nonce,
        due_ms=due_ms,
        payload=payload,
        payload_type=payload_type,
        callback=callback,
        recurrence=recurrence,
    )


def _salvage_text(value: object) -> str | None:
    try:
        return check_text(value, "", max_len=DEFAULT_LIMITS.max_id_len)
    except CommandRejected:
        return None


def salvage_ids(raw: bytes, key: bytes | None) -> Salvaged:
    """Whatever ids a rejected message still yields, to correlate its rejection result.

    Best effort and total: never raises. Values that would not pass validation (too long,
    control characters, malformed tenant) come back as ``None`` rather than be echoed. The
    schedule id falls back to the Kafka key when the body does not give one.
    """
    tenant = schedule_id = request_id = None
    command = None
    try:
        obj = orjson.loads(raw)
    except Exception:  # any garbage at all: fall back to the key alone
        obj = None
    with contextlib.suppress(Exception):  # correlation is optional, the rejection is not
        if isinstance(obj, dict):
            with contextlib.suppress(CommandRejected):
                tenant = check_tenant(obj.get("tenant"))
            schedule_id = _salvage_text(obj.get("schedule_id"))
            request_id = _salvage_text(obj.get("request_id"))
            raw_type = obj.get("type")
            if isinstance(raw_type, str) and raw_type in _COMMAND_TYPES:
                command = CommandType(raw_type)
        if schedule_id is None and key is not None:
            schedule_id = _salvage_text(key.decode("utf-8"))
    return Salvaged(tenant=tenant, schedule_id=schedule_id, request_id=request_id, command=command)

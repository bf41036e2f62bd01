"""Bytes <-> models for every message Tocsin writes, plus client-side command encoding.

Command *decoding* lives in ``topics.validation`` (it is the untrusted edge); this module
encodes commands for clients and tests, encodes/decodes command results and triggers, and
(de)serialises callbacks for storage. Decoders of results and triggers ignore unknown
fields, so fields can be added to those messages without breaking older readers; they raise
``CommandRejected`` (the wire-contract error) on anything else that is wrong.

Pure: must never do I/O or read the clock.
"""

from __future__ import annotations

import base64
import functools

import orjson

from base.errors import CommandRejected
from topics.callbacks import parse_callback
from topics.codes import Code
from topics.fields import DEFAULT_LIMITS, Fields, Limits, load_object, parse_payload
from topics.models import (
    BackfillCommand,
    Callback,
    Command,
    CommandResult,
    CommandType,
    CreateCommand,
    DayMatch,
    HttpCallback,
    PayloadType,
    Recurrence,
    ResultStatus,
    Trigger,
    UpdateCommand,
)
from topics.recurrence import parse_recurrence

HEADER_TRIGGER_ID = "tocsin-trigger-id"
HEADER_SCHEDULE_ID = "tocsin-schedule-id"
HEADER_TENANT = "tocsin-tenant"
HEADER_DUE_MS = "tocsin-due-ms"

# Shapes of the messages Tocsin writes; the unit tests compare them with the JSON Schemas.
RESULT_FIELDS = Fields(
    required=(
        "schedule_id",
        "tenant",
        "request_id",
        "command",
        "status",
        "code",
        "message",
        "at_ms",
        "partition",
        "offset",
    ),
    optional=("reply_nonce",),
)
# Exactly one of payload / payload_b64 is present in a trigger.
TRIGGER_FIELDS = Fields(
    required=(
        "trigger_id",
        "schedule_id",
        "tenant",
        "due_ms",
        "emitted_ms",
        "attempt",
        "order_key",
        "callback",
    ),
    optional=("payload", "payload_b64"),
)

_COMMAND_TYPES = frozenset(m.value for m in CommandType)
_STATUSES = frozenset(m.value for m in ResultStatus)
_CODES = frozenset(m.value for m in Code)


def _bad(field: str, expected: str, value: object) -> CommandRejected:
    shown = repr(value)
    shown = shown if len(shown) <= 64 else shown[:61] + "..."
    return CommandRejected(Code.INVALID_FIELD, f"{field} must be {expected}, got {shown}")


def _required(obj: dict[str, object], field: str) -> object:
    if field not in obj:
        raise CommandRejected(Code.MISSING_FIELD, f"missing required field {field!r}")
    return obj[field]


def _str(obj: dict[str, object], field: str) -> str:
    value = _required(obj, field)
    if not isinstance(value, str) or not value:
        raise _bad(field, "a non-empty string", value)
    return value


def _opt_str(obj: dict[str, object], field: str) -> str | None:
    value = _required(obj, field)
    if value is not None and not isinstance(value, str):
        raise _bad(field, "a string or null", value)
    return value


def _int(obj: dict[str, object], field: str, *, minimum: int = 0) -> int:
    value = _required(obj, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(field, f"an integer >= {minimum}", value)
    return value


def _payload_fields(payload: bytes, payload_type: PayloadType) -> dict[str, object]:
    if payload_type is PayloadType.JSON:
        # Embedded as is: the bytes are canonical JSON already, and re-parsing 64 KiB per
        # trigger would cost more than the rest of the encoding.
        return {"payload": orjson.Fragment(payload)}
    return {"payload_b64": base64.b64encode(payload).decode("ascii")}


# -- callbacks ----------------------------------------------------------------------------


def callback_to_dict(callback: Callback) -> dict[str, object]:
    """The JSON object form of a callback, every field spelled out."""
    out: dict[str, object]
    if isinstance(callback, HttpCallback):
        out = {
            "type": "http",
            "url": callback.url,
            "method": callback.method,
            "headers": dict(callback.headers),
            "timeout_s": callback.timeout_s,
        }
    else:
        out = {"type": "kafka", "topic": callback.topic, "key": callback.key}
    # Only when present: callbacks stored before `retry` existed keep their exact JSON, so
    # repeated creates of them still compare equal (duplicate, not conflict).
    if callback.retry is not None:
        out["retry"] = {
            "max_retry_age_s": callback.retry.max_retry_age_s,
            "retries_6xx": callback.retry.retries_6xx,
        }
    return out


def callback_from_dict(obj: object, *, limits: Limits = DEFAULT_LIMITS) -> Callback:
    """A callback from its JSON object, validated exactly as in a command."""
    return parse_callback(obj, limits=limits)


def callback_to_json(callback: Callback) -> str:
    """Deterministic JSON text (sorted keys) for storage, so equal callbacks compare equal."""
    return orjson.dumps(callback_to_dict(callback), option=orjson.OPT_SORT_KEYS).decode()


def callback_from_json(text: str | bytes, *, limits: Limits = DEFAULT_LIMITS) -> Callback:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise CommandRejected(Code.MALFORMED_JSON, f"callback is not valid JSON: {exc}") from None
    return parse_callback(obj, limits=limits)


# -- recurrences --------------------------------------------------------------------------


def recurrence_to_dict(recurrence: Recurrence) -> dict[str, object]:
    """The JSON object form of a recurrence (times as epoch ms), defaults spelled out."""
    out: dict[str, object] = {}
    if recurrence.cron is not None:
        out["cron"] = recurrence.cron
    if recurrence.every_s is not None:
        out["every_s"] = recurrence.every_s
    if recurrence.start_ms is not None:
        out["start"] = recurrence.start_ms
    if recurrence.end_ms is not None:
        out["end"] = recurrence.end_ms
    if recurrence.max_runs is not None:
        out["max_runs"] = recurrence.max_runs
    out.update(
        time_zone=recurrence.time_zone,
        nonexistent=str(recurrence.nonexistent),
        ambiguous=str(recurrence.ambiguous),
        jitter_s=recurrence.jitter_s,
        misfire=str(recurrence.misfire),
    )
    # Only when not the default, so recurrences stored before day_match existed still
    # compare equal to the same recurrence decoded today (duplicate creates, updates).
    if recurrence.day_match is not DayMatch.ANY:
        out["day_match"] = str(recurrence.day_match)
    return out


def recurrence_to_json(recurrence: Recurrence) -> str:
    """Deterministic JSON text (sorted keys) for storage: equal recurrences compare equal."""
    return orjson.dumps(recurrence_to_dict(recurrence), option=orjson.OPT_SORT_KEYS).decode()


def recurrence_from_json(text: str | bytes) -> Recurrence:
    """A stored recurrence (see ``recurrence_to_json``); its end may lie in the past."""
    return _stored_recurrence(text if isinstance(text, str) else text.decode())


# The materialiser reads every parent's recurrence at each extension; validating the cron
# and the zone again each time was a tenth of a worker's CPU at 100,000 schedules. The
# result is immutable and most schedules share a few expressions.
@functools.lru_cache(maxsize=4096)
def _stored_recurrence(text: str) -> Recurrence:
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise CommandRejected(Code.MALFORMED_JSON, f"recurrence is not valid JSON: {exc}") from None
    return parse_recurrence(obj, now_ms=0)


# -- commands -----------------------------------------------------------------------------


def command_to_dict(command: Command) -> dict[str, object]:
    """The JSON object of a command; ``due`` as epoch ms, defaults left out."""
    out: dict[str, object] = {
        "type": str(command.type),
        "tenant": command.tenant,
        "schedule_id": command.schedule_id,
    }
    if command.request_id is not None:
        out["request_id"] = command.request_id
    if command.reply_nonce is not None:
        out["reply_nonce"] = command.reply_nonce
    if isinstance(command, CreateCommand):
        if command.recurrence is not None:
            out["recurrence"] = recurrence_to_dict(command.recurrence)
        else:
            out["due"] = command.due_ms
        if command.payload or command.payload_type is PayloadType.JSON:
            out.update(_payload_fields(command.payload, command.payload_type))
        out["callback"] = callback_to_dict(command.callback)
        if command.order_key != command.schedule_id:
            out["order_key"] = command.order_key
        out["misfire_tolerance_s"] = command.misfire_tolerance_s
    elif isinstance(command, UpdateCommand):
        out.update(_update_fields(command))
    elif isinstance(command, BackfillCommand):
        out["from"] = command.from_ms
        out["to"] = command.to_ms
    return out


def _update_fields(command: UpdateCommand) -> dict[str, object]:
    """The fields an update changes (the others are left out)."""
    out: dict[str, object] = {}
    if command.due_ms is not None:
        out["due"] = command.due_ms
    if command.recurrence is not None:
        out["recurrence"] = recurrence_to_dict(command.recurrence)
    if command.payload is not None and command.payload_type is not None:
        out.update(_payload_fields(command.payload, command.payload_type))
    if command.callback is not None:
        out["callback"] = callback_to_dict(command.callback)
    return out


def encode_command(command: Command) -> bytes:
    """The commands-topic value for ``command`` (key it by ``command.schedule_id``)."""
    return orjson.dumps(command_to_dict(command))


# -- command results ----------------------------------------------------------------------


def encode_result(result: CommandResult) -> bytes:
    out = {
        "schedule_id": result.schedule_id,
        "tenant": result.tenant,
        "request_id": result.request_id,
        "command": None if result.command is None else str(result.command),
        "status": str(result.status),
        "code": str(result.code),
        "message": result.message,
        "at_ms": result.at_ms,
        "partition": result.partition,
        "offset": result.offset,
    }
    if result.reply_nonce is not None:
        out["reply_nonce"] = result.reply_nonce
    return orjson.dumps(out)


def decode_result(raw: bytes) -> CommandResult:
    obj = load_object(raw)
    command = _opt_str(obj, "command")
    status = _str(obj, "status")
    code = _str(obj, "code")
    if command is not None and command not in _COMMAND_TYPES:
        raise _bad("command", "create, update, cancel or null", command)
    if status not in _STATUSES:
        raise _bad("status", "accepted or rejected", status)
    if code not in _CODES:
        raise _bad("code", "a code listed in topics.codes", code)
    try:
        return CommandResult(
            schedule_id=_opt_str(obj, "schedule_id"),
            tenant=_opt_str(obj, "tenant"),
            request_id=_opt_str(obj, "request_id"),
            command=None if command is None else CommandType(command),
            status=ResultStatus(status),
            code=Code(code),
            message=_str_or_empty(obj, "message"),
            at_ms=_int(obj, "at_ms"),
            partition=_int(obj, "partition"),
            offset=_int(obj, "offset"),
            reply_nonce=_opt_str(obj, "reply_nonce") if "reply_nonce" in obj else None,
        )
    except ValueError as exc:
        raise CommandRejected(Code.INVALID_FIELD, str(exc)) from None


def _str_or_empty(obj: dict[str, object], field: str) -> str:
    value = _required(obj, field)
    if not isinstance(value, str):
        raise _bad(field, "a string", value)
    return value


# -- triggers -----------------------------------------------------------------------------


def encode_trigger(trigger: Trigger) -> bytes:
    """The fires-topic value; the payload is a JSON value for json, base64 for bytes."""
    return orjson.dumps(
        {
            "trigger_id": trigger.trigger_id,
            "schedule_id": trigger.schedule_id,
            "tenant": trigger.tenant,
            "due_ms": trigger.due_ms,
            "emitted_ms": trigger.emitted_ms,
            "attempt": trigger.attempt,
            "order_key": trigger.order_key,
            **_payload_fields(trigger.payload, trigger.payload_type),
            "callback": callback_to_dict(trigger.callback),
        }
    )


def decode_trigger(raw: bytes, *, limits: Limits = DEFAULT_LIMITS) -> Trigger:
    """The trigger in a fires-topic value; ``decode_trigger(encode_trigger(t)) == t``."""
    obj = load_object(raw)
    payload, payload_type = parse_payload(obj, max_bytes=None)
    if payload is None or payload_type is None:
        raise CommandRejected(Code.MISSING_FIELD, "a trigger needs payload or payload_b64")
    return Trigger(
        trigger_id=_str(obj, "trigger_id"),
        schedule_id=_str(obj, "schedule_id"),
        tenant=_str(obj, "tenant"),
        due_ms=_int(obj, "due_ms"),
        emitted_ms=_int(obj, "emitted_ms"),
        attempt=_int(obj, "attempt", minimum=1),
        order_key=_str(obj, "order_key"),
        payload=payload,
        payload_type=payload_type,
        callback=parse_callback(_required(obj, "callback"), limits=limits),
    )


def trigger_headers(trigger: Trigger) -> list[tuple[str, bytes]]:
    """Kafka headers of a fires-topic record, so consumers can route without parsing JSON."""
    return [
        (HEADER_TRIGGER_ID, trigger.trigger_id.encode("utf-8")),
        (HEADER_SCHEDULE_ID, trigger.schedule_id.encode("utf-8")),
        (HEADER_TENANT, trigger.tenant.encode("utf-8")),
        (HEADER_DUE_MS, str(trigger.due_ms).encode("ascii")),
        # W3C names, as OpenTelemetry's Kafka instrumentations read them.
        *_trace_headers(trigger),
    ]


def _trace_headers(trigger: Trigger) -> list[tuple[str, bytes]]:
    if trigger.traceparent is None:
        return []
    out = [("traceparent", trigger.traceparent.encode("ascii"))]
    if trigger.tracestate:
        out.append(("tracestate", trigger.tracestate.encode("ascii")))
    return out

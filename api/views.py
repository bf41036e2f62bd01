"""Pure pieces of the REST API: request bodies -> commands, rows -> JSON views, result codes
-> HTTP statuses, cursors and times. No I/O, no clock (``now_ms`` is passed in)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from enum import StrEnum

import orjson

from base.errors import TocsinError
from streams.model import ScheduleState
from streams.ports import CqlRow
from topics.codes import Code
from topics.ids import MAX_EPOCH_MS, format_iso_ms, parse_iso_ms, trigger_id
from topics.models import DeliveryOutcome

# Fields the API sets itself; a body carrying them is refused with a clear message.
RESERVED_BODY_FIELDS = ("type", "tenant", "request_id", "reply_nonce")
CREATE_BODY_FIELDS = frozenset(
    {
        "schedule_id",
        "due",
        "recurrence",
        "payload",
        "payload_b64",
        "callback",
        "order_key",
        "misfire_tolerance_s",
    }
)
UPDATE_BODY_FIELDS = frozenset({"due", "recurrence", "payload", "payload_b64", "callback"})
# What a listing's ``status`` filter selects: a schedule's state or its delivery's outcome
# ("completed": a recurring schedule with no runs left, api.recurring).
STATUSES: tuple[str, ...] = (
    ScheduleState.SCHEDULED,
    ScheduleState.FIRED,
    ScheduleState.MISSED,
    ScheduleState.CANCELLED,
    ScheduleState.PAUSED,
    DeliveryOutcome.DELIVERED,
    DeliveryOutcome.DEAD_LETTERED,
    ScheduleState.COMPLETED,
)
MAX_WINDOW_MS = 366 * 86_400_000


class Mode(StrEnum):
    """How a schedule command is answered: with its result, or once Kafka has it."""

    SYNC = "sync"
    ASYNC = "async"


# Answers a client may get otherwise by sending the same request again later: over its
# quota, the backend unavailable, no result in time.
RETRIABLE_HTTP_STATUSES = frozenset({429, 502, 503, 504})


class ApiError(TocsinError):
    """An HTTP error with a machine-readable code and a human message; retriable when its
    status says the same request may succeed later (``RETRIABLE_HTTP_STATUSES``)."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.extra = extra
        self.retriable = status in RETRIABLE_HTTP_STATUSES

    def body(self) -> dict[str, object]:
        return {"error": {"code": self.code, "message": self.message, **self.extra}}


# Result code -> HTTP status of the API's answer.
_HTTP: dict[str, int] = {
    Code.OK: 200,
    Code.DUPLICATE: 200,
    Code.NOT_FOUND: 404,
    Code.CONFLICT: 409,
    Code.ALREADY_FIRED: 409,
    Code.ALREADY_CANCELLED: 409,
    Code.QUOTA_EXCEEDED: 429,
    Code.UNKNOWN_TENANT: 403,
    Code.INACTIVE_TENANT: 403,
    Code.BAD_SIGNATURE: 403,
    Code.SIGNING_KEY_RETIRED: 403,
    Code.STALE_COMMAND: 403,
    Code.REPLAYED_COMMAND: 403,
    Code.CALLBACK_NOT_ALLOWED: 422,
    Code.BEYOND_HORIZON: 422,
    Code.DUE_IN_PAST: 422,
    Code.PAYLOAD_TOO_LARGE: 413,
    Code.TOO_LARGE: 413,
    Code.KEY_MISMATCH: 500,  # the API keys commands itself: a bug if it happens
    Code.WRONG_PARTITION: 500,
    Code.STORE_REJECTED: 422,
    Code.INTERNAL_ERROR: 500,
    Code.NOT_RECURRING: 409,
    Code.WINDOW_IN_FUTURE: 422,
}


def http_status(code: str, *, created: bool = False) -> int:
    """The HTTP status for a command result code (400 for every other decoder code)."""
    if code == Code.OK and created:
        return 201
    return _HTTP.get(code, 400)


def parse_body(raw: bytes) -> dict[str, object]:
    if not raw:
        raise ApiError(400, "empty_body", "the request needs a JSON object body")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "not_an_object", "body must be a JSON object")
    return obj


def _check_body(body: Mapping[str, object], allowed: frozenset[str], what: str) -> None:
    for name in RESERVED_BODY_FIELDS:
        if name in body:
            raise ApiError(
                400,
                "invalid_field",
                f"{name!r} is set by the API (the tenant comes from the API key); remove it",
            )
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(
            400,
            "invalid_field",
            f"{what}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}",
        )


def create_command(
    body: Mapping[str, object], *, tenant: str, schedule_id: str, request_id: str
) -> dict[str, object]:
    """The create command (wire JSON) for a POST /v1/schedules body."""
    _check_body(body, CREATE_BODY_FIELDS, "create")
    cmd = {k: v for k, v in body.items() if k != "schedule_id"}
    return {
        "type": "create",
        "tenant": tenant,
        "schedule_id": schedule_id,
        "request_id": request_id,
        **cmd,
    }


def update_command(
    body: Mapping[str, object], *, tenant: str, schedule_id: str, request_id: str
) -> dict[str, object]:
    _check_body(body, UPDATE_BODY_FIELDS, "update")
    return {
        "type": "update",
        "tenant": tenant,
        "schedule_id": schedule_id,
        "request_id": request_id,
        **body,
    }


def cancel_command(*, tenant: str, schedule_id: str, request_id: str) -> dict[str, object]:
    return simple_command("cancel", tenant=tenant, schedule_id=schedule_id, request_id=request_id)


def simple_command(
    kind: str, *, tenant: str, schedule_id: str, request_id: str
) -> dict[str, object]:
    """A command that names its schedule and nothing else: cancel, pause, resume, trigger."""
    return {
        "type": kind,
        "tenant": tenant,
        "schedule_id": schedule_id,
        "request_id": request_id,
    }


def backfill_command(
    body: Mapping[str, object], *, tenant: str, schedule_id: str, request_id: str
) -> dict[str, object]:
    """The backfill command of a ``{from, to}`` body (RFC 3339 with offset or epoch ms,
    ``from`` before ``to``); whether the window is in the past is the worker's to say."""
    unknown = sorted(set(body) - {"from", "to"})
    if unknown:
        raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}; allowed: from, to")
    window = {}
    for name in ("from", "to"):
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ApiError(400, "invalid_field", f"{name!r} must be an RFC 3339 time or epoch ms")
        window[name] = str(value)
    lo = parse_time(window["from"], "from")
    hi = parse_time(window["to"], "to")
    if hi <= lo:
        raise ApiError(400, "invalid_field", "'to' must be after 'from'")
    return {
        "type": "backfill",
        "tenant": tenant,
        "schedule_id": schedule_id,
        "from": lo,
        "to": hi,
        "request_id": request_id,
    }


# What a bulk pause or resume acts on: the state it changes and the state it leaves.
BULK_TOGGLES: dict[str, tuple[str, str]] = {
    "pause": (ScheduleState.SCHEDULED, "paused"),
    "resume": (ScheduleState.PAUSED, "resumed"),
}
MAX_ID_PREFIX_LEN = 256


def parse_bulk_scope(
    body: Mapping[str, object], *, now_ms: int, default_span_ms: int
) -> tuple[int, int, str]:
    """(from_ms, to_ms, id_prefix) of a bulk pause/resume body: ``from``/``to`` bound the
    due times of one-shot schedules (default: the day before now to ``default_span_ms``
    after it); ``id_prefix`` (default: every id) selects one-shot and recurring alike."""
    unknown = sorted(set(body) - {"from", "to", "id_prefix"})
    if unknown:
        raise ApiError(
            400, "invalid_field", f"unknown field {unknown[0]!r}; allowed: from, id_prefix, to"
        )
    prefix = body.get("id_prefix", "")
    if not isinstance(prefix, str) or len(prefix.encode()) > MAX_ID_PREFIX_LEN:
        raise ApiError(400, "invalid_field", "id_prefix must be a string of at most 256 bytes")
    window = {
        "from": str(body.get("from", now_ms - 86_400_000)),
        "to": str(body.get("to", now_ms + default_span_ms)),
    }
    lo, hi = parse_window(window)
    return lo, hi, prefix


def parse_time(value: str | None, name: str) -> int:
    """Epoch ms from a query parameter given as epoch ms or RFC 3339 with offset."""
    if value is None or value == "":
        raise ApiError(400, "missing_parameter", f"query parameter {name!r} is required")
    if value.isdigit():
        ms = int(value)
    else:
        try:
            ms = parse_iso_ms(value)
        except ValueError as exc:
            raise ApiError(400, "invalid_parameter", f"{name}: {exc}") from None
    if not 0 <= ms <= MAX_EPOCH_MS:
        raise ApiError(400, "invalid_parameter", f"{name} is out of range")
    return ms


def parse_window(params: Mapping[str, str]) -> tuple[int, int]:
    lo = parse_time(params.get("from"), "from")
    hi = parse_time(params.get("to"), "to")
    if hi <= lo:
        raise ApiError(400, "invalid_parameter", "'to' must be after 'from'")
    if hi - lo > MAX_WINDOW_MS:
        raise ApiError(400, "invalid_parameter", "the window may span at most 366 days")
    return lo, hi


def parse_statuses(value: str | None) -> frozenset[str] | None:
    if not value:
        return None
    wanted = frozenset(s.strip() for s in value.split(",") if s.strip())
    bad = sorted(wanted - set(STATUSES))
    if bad:
        raise ApiError(
            400, "invalid_parameter", f"status {bad[0]!r} is not one of {', '.join(STATUSES)}"
        )
    return wanted


def parse_limit(
    value: str | None,
    *,
    default: int = 100,
    maximum: int = 1000,
    name: str = "limit",
    minimum: int = 1,
) -> int:
    if value is None or value == "":
        return default
    if not value.isdigit() or not minimum <= int(value) <= maximum:
        raise ApiError(
            400, "invalid_parameter", f"{name} must be an integer in {minimum}..{maximum}"
        )
    return int(value)


def encode_cursor(due_ms: int, schedule_id: str) -> str:
    raw = orjson.dumps([due_ms, schedule_id])
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_cursor(value: str | None) -> tuple[int, str] | None:
    if not value:
        return None
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        due, sid = orjson.loads(raw)
        if isinstance(due, int) and isinstance(sid, str):
            return due, sid
    except (binascii.Error, ValueError, TypeError, orjson.JSONDecodeError):
        pass
    raise ApiError(400, "invalid_parameter", "cursor is not one this API returned")


def effective_state(row: CqlRow) -> str:
    """The schedule's state; a 'fired' row whose trigger is of an older due time (a
    reschedule raced the fire, see Store.mark_fired) is still scheduled."""
    state = str(row.get("state") or ScheduleState.SCHEDULED)
    if state == ScheduleState.FIRED and row.get("trigger_id") not in (
        None,
        trigger_id(row["tenant"], row["schedule_id"], int(row["due_ms"])),
    ):
        return ScheduleState.SCHEDULED
    return state


def matches(row: CqlRow, statuses: frozenset[str] | None) -> bool:
    if statuses is None:
        return True
    state = effective_state(row)
    outcome = row.get("delivery_outcome")
    return state in statuses or (outcome is not None and outcome in statuses)


def delivery_view(row: CqlRow) -> dict[str, object] | None:
    """The last delivery's outcome of a schedule or run row (None before any delivery)."""
    if not row.get("delivery_outcome"):
        return None
    return {
        "outcome": row["delivery_outcome"],
        "status_code": row.get("delivery_status_code"),
        "attempts": row.get("delivery_attempts"),
        "at_ms": row.get("delivery_ms"),
    }


def settings_view(row: CqlRow) -> dict[str, object]:
    """What a schedule's full JSON shows of its row's version, times, order key and misfire
    tolerance (one-shot and recurring alike), and its traceparent when it has one.

    The tracestate is not shown: it is vendors' opaque data for the receiver, of no use to
    find the trace, which the traceparent's trace id names."""
    view: dict[str, object] = {
        "version": row.get("version"),
        "created_ms": row.get("created_ms"),
        "updated_ms": row.get("updated_ms"),
        "order_key": row.get("order_key"),
        "misfire_tolerance_s": row.get("misfire_tolerance_s"),
    }
    if row.get("traceparent"):
        view["traceparent"] = row["traceparent"]
    return view


def callback_view(row: CqlRow) -> object:
    """A schedule row's callback as JSON (None when it has none)."""
    return orjson.loads(row["callback"]) if row.get("callback") else None


def schedule_view(
    row: CqlRow,
    events: Sequence[CqlRow] | None = None,
    *,
    brief: bool = False,
) -> dict[str, object]:
    """The JSON of a schedule (brief: without payload, callback and history)."""
    due = int(row["due_ms"])
    view: dict[str, object] = {
        "schedule_id": row["schedule_id"],
        "tenant": row["tenant"],
        "status": effective_state(row),
        "due": format_iso_ms(due),
        "due_ms": due,
        "delivery": delivery_view(row),
    }
    if row.get("fired_ms"):
        view["fired_ms"] = row["fired_ms"]
    if brief:
        return view
    view.update(settings_view(row))
    view["trigger_id"] = row.get("trigger_id")
    view["callback"] = callback_view(row)
    view.update(payload_view(row))
    view["history"] = [event_view(e) for e in (events or [])]
    return view


def payload_view(row: CqlRow) -> dict[str, object]:
    """A stored payload as the API answers it: JSON as is, anything else base64."""
    payload = row.get("payload") or b""
    if row.get("payload_type") == "json" and payload:
        return {"payload": orjson.Fragment(payload)}
    return {"payload_b64": base64.b64encode(payload).decode("ascii")}


def event_view(e: CqlRow) -> dict[str, object]:
    """One history event of a schedule (``schedule_events``) with a readable time."""
    return {
        "at": format_iso_ms(int(e["at_ms"])),
        "at_ms": e["at_ms"],
        "event": e["event"],
        "due_ms": e.get("due_ms"),
        "trigger_id": e.get("trigger_id"),
        "detail": e.get("detail"),
    }


def tenant_view(
    row: CqlRow, config: dict[str, object], signing: dict[str, object] | None = None
) -> dict[str, object]:
    """``signing``: the state of its signing keys (streams.tenant_admin.signing_status)."""
    return {
        "tenant": row["tenant"],
        "active": bool(row.get("active")),
        "created_ms": row.get("created_ms"),
        "updated_ms": row.get("updated_ms"),
        "signed_commands": bool(row.get("signing_secret")),
        "signing_key": signing,
        "config": config,
    }

"""Pure pieces of the go-scheduler facade (api/goscheduler.py): its status names, its
request fields read into native commands, rows shown in its response shapes, its times and
page tokens. No I/O, no clock (``now_ms`` is passed in)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum

import orjson

from api import gocron, recurring, views
from api.views import ApiError
from streams.decisions import Run
from streams.model import ScheduleEvent, ScheduleState
from streams.ports import CqlRow
from topics.ids import format_iso_ms
from topics.models import Ambiguous, DayMatch, DeliveryOutcome

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
# The longest window go-scheduler lists the schedules of an app in.
MAX_LIST_WINDOW_MS = 30 * 24 * HOUR_MS
# The longest window of one go-scheduler bulk action (its MaxBulkActionPeriodInDays).
MAX_BULK_WINDOW_MS = 7 * 24 * HOUR_MS
CREATE_FIELDS = frozenset({"appId", "payload", "scheduleTime", "callback", "cronExpression"})


class GoStatus(StrEnum):
    """go-scheduler's status of a schedule (or of one run of a cron)."""

    SCHEDULED = "SCHEDULED"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"
    MISS = "MISS"
    DELETED = "DELETED"


class BulkAction(StrEnum):
    """The actions of go-scheduler's ``POST /goscheduler/apps/{appId}/bulk-action/{action}``."""

    RECONCILE = "reconcile"
    DELETE = "delete"


class When(StrEnum):
    """Which runs of a cron ``GET /goscheduler/schedules/{id}/runs?when=`` asks for."""

    PAST = "past"
    FUTURE = "future"
    BOTH = ""


# The states that name a go-scheduler status by themselves; the others (fired) are
# SUCCESS or FAILURE by the delivery's outcome.
_STATE_STATUS: dict[str, GoStatus] = {
    ScheduleState.SCHEDULED: GoStatus.SCHEDULED,
    # go-scheduler has no paused status: still to fire, once resumed.
    ScheduleState.PAUSED: GoStatus.SCHEDULED,
    ScheduleState.CANCELLED: GoStatus.DELETED,
    ScheduleState.MISSED: GoStatus.MISS,
}
# A cron's status from its parent status (api.recurring.parent_status).
PARENT_STATUS: dict[str, GoStatus] = {
    ScheduleState.SCHEDULED: GoStatus.SCHEDULED,
    ScheduleState.PAUSED: GoStatus.SCHEDULED,
    ScheduleState.CANCELLED: GoStatus.DELETED,
    ScheduleState.COMPLETED: GoStatus.SUCCESS,
}
# What a ``status`` filter of a listing selects, in native statuses (api.views.STATUSES).
NATIVE_STATUSES: dict[str, frozenset[str]] = {
    GoStatus.SCHEDULED: frozenset({ScheduleState.SCHEDULED}),
    GoStatus.SUCCESS: frozenset({DeliveryOutcome.DELIVERED, ScheduleState.COMPLETED}),
    GoStatus.FAILURE: frozenset({DeliveryOutcome.DEAD_LETTERED}),
    GoStatus.MISS: frozenset({ScheduleState.MISSED}),
    GoStatus.DELETED: frozenset({ScheduleState.CANCELLED}),
}
# What a reconcile re-fires (``Service.bulk_refire``'s native statuses) for the go-scheduler
# status it names; no status is every fired or missed schedule, as go-scheduler re-fires
# every status then. SCHEDULED has no entry: the ticker fires those itself (or records them
# missed), so nothing is left to reconcile; DELETED neither: a cancel is never overridden.
RECONCILE_STATUSES: dict[str, frozenset[str]] = {
    "": frozenset({ScheduleState.FIRED, ScheduleState.MISSED}),
    GoStatus.SUCCESS: frozenset({DeliveryOutcome.DELIVERED}),
    GoStatus.FAILURE: frozenset({DeliveryOutcome.DEAD_LETTERED}),
    GoStatus.MISS: frozenset({ScheduleState.MISSED}),
}
_STATUS_MESSAGE = {200: "Success", 201: "Success", 202: "Accepted"}


def ok_body(data: object, status: int, count: int) -> dict[str, object]:
    return {
        "status": {
            "statusCode": status,
            "statusMessage": _STATUS_MESSAGE.get(status, "OK"),
            "statusType": "Success",
            "totalCount": count,
        },
        "data": data,
    }


def error_body(exc: ApiError) -> dict[str, object]:
    return {
        "status": {
            "statusCode": exc.status,
            "statusMessage": exc.message,
            "statusType": "Fail",
            "errorCode": exc.code,
        }
    }


def _status(state: str, outcome: object) -> GoStatus:
    found = _STATE_STATUS.get(state)
    if found is not None:
        return found
    # Fired: delivered, or handed to the fires topic for a consumer.
    return GoStatus.FAILURE if outcome == DeliveryOutcome.DEAD_LETTERED else GoStatus.SUCCESS


def go_status(row: CqlRow) -> GoStatus:
    """go-scheduler's status for a schedule row."""
    return _status(views.effective_state(row), row.get("delivery_outcome"))


def _text(payload: bytes | None) -> str:
    return (payload or b"").decode("utf-8", "replace")


def go_callback(row: CqlRow) -> dict[str, object]:
    callback = orjson.loads(row["callback"]) if row.get("callback") else {}
    if callback.get("type") == "http":
        return {
            "type": "http",
            "details": {
                "url": callback["url"],
                "method": callback.get("method", "POST"),
                "headers": callback.get("headers", {}),
            },
        }
    return {
        "type": callback.get("type", "kafka"),
        "details": {k: v for k, v in callback.items() if k != "type"},
    }


def _go_one_time(schedule_id: str, row: CqlRow, due_ms: int) -> dict[str, object]:
    """What go-scheduler shows of a one-time schedule due at ``due_ms`` whose payload,
    tenant, partition and callback are ``row``'s (a run takes its parent's)."""
    due_s = due_ms // 1000
    return {
        "scheduleId": schedule_id,
        "payload": _text(row.get("payload")),
        "appId": row["tenant"],
        "scheduleTime": due_s,
        "partitionId": row.get("partition"),
        "scheduleGroup": due_s - due_s % 60,
        "callback": go_callback(row),
    }


def go_schedule(row: CqlRow) -> dict[str, object]:
    out = _go_one_time(row["schedule_id"], row, int(row["due_ms"]))
    out["status"] = go_status(row)
    if row.get("delivery_outcome") == DeliveryOutcome.DEAD_LETTERED:
        out["errorMessage"] = f"delivery failed (HTTP {row.get('delivery_status_code')})"
    return out


def go_cron_schedule(row: CqlRow, status: str) -> dict[str, object]:
    """go-scheduler's view of a recurring schedule (a "cron"): no scheduleTime, its
    cronExpression (a rate made through /v1 shows as ``@every <n>s``)."""
    rec = recurring.recurrence_view(row)
    expression = gocron.display(str(rec["cron"])) if "cron" in rec else f"@every {rec['every_s']}s"
    return {
        "scheduleId": row["schedule_id"],
        "payload": _text(row.get("payload")),
        "appId": row["tenant"],
        "partitionId": row.get("partition"),
        "callback": go_callback(row),
        "cronExpression": expression,
        "status": PARENT_STATUS.get(status, GoStatus.SCHEDULED),
    }


def go_run(run: Run, parent: CqlRow) -> dict[str, object]:
    """One run of a cron as go-scheduler shows it: a one-time schedule of its own."""
    out = _go_one_time(run["run_id"], parent, int(run["due_ms"]))
    out["status"] = _status(run.get("state", ScheduleState.SCHEDULED), run.get("delivery"))
    out["runId"] = run["trigger_id"]
    return out


def fire_runs(row: CqlRow, events: list[CqlRow]) -> list[dict[str, object]]:
    """The runs of a one-time schedule: each fire (and re-fire) or miss of its history."""
    out = []
    for e in events:
        if e["event"] not in (ScheduleEvent.FIRED, ScheduleEvent.REFIRED, ScheduleEvent.MISSED):
            continue
        run = go_schedule(row)
        run["scheduleTime"] = int(e.get("due_ms") or row["due_ms"]) // 1000
        if e["event"] == ScheduleEvent.MISSED:
            run["status"] = GoStatus.MISS
        run["runId"] = e.get("trigger_id")
        run["firedAt"] = int(e["at_ms"]) // 1000
        out.append(run)
    return out


def run_token_ms(token: str | None) -> int | None:
    """Our continuation token of runs: a nominal time in epoch ms, as 16 hex digits."""
    if not token:
        return None
    try:
        raw = binascii.unhexlify(token)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}") from None
    if len(raw) != 8:
        raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}")
    return int.from_bytes(raw, "big")


def run_token(nominal_ms: int | None) -> str:
    return "" if nominal_ms is None else int(nominal_ms).to_bytes(8, "big").hex()


def runs_page(
    when: When, past: list[Run], future: list[Run], size: int
) -> tuple[list[Run], int | None]:
    """One page of a cron's runs and the nominal time to continue after (None: no more):
    ``past`` newest first, ``future`` soonest first, or both (the future runs latest first,
    then the past ones) without a continuation."""
    if when is When.PAST:
        return past, (past[-1]["nominal_ms"] if len(past) == size else None)
    if when is When.FUTURE:
        return future, (future[-1]["nominal_ms"] if len(future) == size else None)
    return (list(reversed(future)) + past)[:size], None


def parse_when(value: str) -> When:
    """``when`` of a runs request; any other value selects no runs, as before."""
    try:
        return When(value)
    except ValueError:
        raise ApiError(404, "not_found", "No cron runs found") from None


def go_time_ms(value: str, name: str) -> int:
    """'2006-01-02 15:04:05' (UTC here), unix seconds (like scheduleTime) or RFC 3339."""
    if value.isdigit():
        return int(value) * 1000
    try:
        moment = datetime.strptime(value, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        return int(moment.timestamp()) * 1000
    except ValueError:
        return views.parse_time(value, name)


def list_window(
    start: str | None, end: str | None, now_ms: int, *, max_ms: int = MAX_LIST_WINDOW_MS
) -> tuple[int, int]:
    """``[lo, hi]`` of a listing: both given, or an hour from the one given, or the last
    hour; at most ``max_ms`` (30 days)."""
    lo = go_time_ms(start, "start_time") if start else None
    hi = go_time_ms(end, "end_time") if end else None
    if lo is None:
        hi = now_ms if hi is None else hi
        lo = hi - HOUR_MS
    elif hi is None:
        hi = lo + HOUR_MS
    if hi < lo:
        raise ApiError(400, "invalid_parameter", "end_time cannot be before start_time")
    if hi - lo > max_ms:
        days = max_ms // (24 * HOUR_MS)
        raise ApiError(
            400, "invalid_parameter", f"Time range of more than {days} days is not allowed"
        )
    return lo, hi


def bulk_action(value: str) -> BulkAction:
    try:
        return BulkAction(value)
    except ValueError:
        # go-scheduler answers 500 (its code 4005) here; a bad path is the client's error.
        raise ApiError(
            400, "invalid_parameter", f"action type {value} is invalid (reconcile or delete)"
        ) from None


def bulk_window(start: str | None, end: str | None, now_ms: int) -> tuple[int, int]:
    """``[lo, hi)`` of a bulk action: the listing's defaults, at most 7 days, both ends
    floored to the minute, as go-scheduler walks the minutes from start up to end."""
    lo, hi = list_window(start, end, now_ms, max_ms=MAX_BULK_WINDOW_MS)
    return lo - lo % MINUTE_MS, hi - hi % MINUTE_MS


def reconcile_statuses(status: str) -> frozenset[str]:
    """The native statuses a reconcile of go-scheduler's ``status`` re-fires."""
    found = RECONCILE_STATUSES.get(status)
    if found is not None:
        return found
    if status in (GoStatus.SCHEDULED, GoStatus.DELETED):
        why = (
            "Tocsin fires scheduled ones itself (or records them MISS: reconcile status=MISS)"
            if status == GoStatus.SCHEDULED
            else "a deleted schedule is never fired again"
        )
        raise ApiError(400, "invalid_parameter", f"reconcile of status {status}: {why}")
    raise ApiError(400, "invalid_parameter", f"unknown status {status!r}")


def check_delete_status(status: str) -> None:
    """A bulk delete cancels the schedules still to fire (``Service.bulk_cancel``); the fired
    ones are kept for their retention, not deleted on request."""
    if status not in ("", GoStatus.SCHEDULED):
        raise ApiError(
            400,
            "invalid_parameter",
            f"delete of status {status}: only schedules still to fire (SCHEDULED) are cancelled",
        )


def bulk_body(
    action: BulkAction,
    app_id: str,
    window: tuple[int, int],
    status: str,
    done: Mapping[str, object],
) -> dict[str, object]:
    """go-scheduler's bulk-action answer (``{"status", "remarks"}``) of ``done``, the answer of
    ``Service.bulk_refire`` or ``bulk_cancel``, which ``data`` holds too. It is given once the
    action is done here, where go-scheduler answers once it queued it."""
    lo, hi = window
    key, rest = (
        ("refired", "reconcile narrower windows for the rest (again re-fires them all)")
        if action is BulkAction.RECONCILE
        else ("cancelled", "send it again for the rest")
    )
    failed = done.get("failed")
    remarks = (
        f"{action} done for app: {app_id}, timeRange: [{format_iso_ms(lo)}, "
        f"{format_iso_ms(hi)}), status: {status or 'any'}: {done.get(key)} of "
        f"{done.get('matched')} matched, {len(failed) if isinstance(failed, list) else 0} failed"
        + (f", truncated: {rest}" if done.get("truncated") else "")
    )
    body = ok_body(dict(done), 200, int(str(done.get("matched", 0))))
    return {"status": body["status"], "remarks": remarks, "data": body["data"]}


def list_statuses(status: str | None) -> frozenset[str] | None:
    if not status:
        return None
    if status not in NATIVE_STATUSES:
        raise ApiError(400, "invalid_parameter", f"unknown status {status!r}")
    return NATIVE_STATUSES[status]


def list_cursor(token: str | None) -> tuple[int, str] | None:
    """A listing's continuation token (our cursor's bytes in hex) as a cursor."""
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64encode(binascii.unhexlify(token)).decode().rstrip("=")
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_parameter", f"Invalid page token: {token}") from None
    return views.decode_cursor(raw)


def list_token(cursor: tuple[int, str] | None) -> str:
    if not cursor:
        return ""
    raw = views.encode_cursor(*cursor)
    return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()


def create_timing(body: Mapping[str, object], cron_time_zone: str) -> dict[str, object]:
    """``{"due": ms}`` for a one-time schedule, ``{"recurrence": ...}`` for a cron."""
    cron = body.get("cronExpression") or None  # "" is a one-time schedule, as there
    when = body.get("scheduleTime")
    if cron is None:
        if isinstance(when, bool) or not isinstance(when, int):
            raise ApiError(400, "invalid_field", "scheduleTime must be unix seconds")
        return {"due": when * 1000}
    if when not in (None, 0):
        raise ApiError(
            400,
            "invalid_field",
            "give either scheduleTime (a one-time schedule) or cronExpression, not both",
        )
    try:
        translated = gocron.translate(cron)
    except gocron.GoCronError as exc:
        raise ApiError(400, "invalid_cron", str(exc)) from None
    # go-scheduler matches the server clock minute by minute: a local time that DST
    # repeats matches twice, one it skips never (docs/api.md).
    recurrence: dict[str, object] = {
        "cron": translated.cron,
        "time_zone": cron_time_zone,
        "ambiguous": Ambiguous.TWICE,
    }
    if translated.day_match == DayMatch.ALL:
        recurrence["day_match"] = DayMatch.ALL
    return {"recurrence": recurrence}


def create_callback(body: Mapping[str, object]) -> dict[str, object]:
    """The native HTTP callback of go-scheduler's ``{"type": "http", "details": ...}``."""
    cb = body.get("callback")
    if (
        not isinstance(cb, dict)
        or cb.get("type") != "http"
        or not isinstance(cb.get("details"), dict)
    ):
        raise ApiError(
            400,
            "invalid_callback",
            'callback must be {"type": "http", "details": {url, method, headers}}',
        )
    details = cb["details"]
    callback: dict[str, object] = {
        "type": "http",
        "url": details.get("url"),
        "method": str(details.get("method", "POST")).upper(),
    }
    if details.get("headers"):
        callback["headers"] = details["headers"]
    return callback


def create_body(body: Mapping[str, object], cron_time_zone: str) -> dict[str, object]:
    """The native create body (``POST /v1/schedules``) of go-scheduler's create request."""
    unknown = sorted(set(body) - CREATE_FIELDS)
    if unknown:
        raise ApiError(400, "invalid_field", f"unknown field {unknown[0]!r}")
    timing = create_timing(body, cron_time_zone)
    payload = body.get("payload", "")
    if not isinstance(payload, str):
        raise ApiError(400, "invalid_field", "payload must be a string")
    callback = create_callback(body)
    return {
        **timing,
        "callback": callback,
        "payload_b64": base64.b64encode(payload.encode("utf-8")).decode("ascii"),
    }

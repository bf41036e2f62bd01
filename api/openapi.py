"""The API's OpenAPI 3.1 document, served at ``/openapi.json`` (native ``/v1`` routes).

``openapi_document`` assembles it from named parts: the schemas (``_schemas``, one small
function per group) and the paths (``_paths``: health, schedules, bulk, tenants)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache

from api.views import STATUSES, Mode
from streams.model import ScheduleState
from topics.codes import Code
from topics.models import Ambiguous, DayMatch, Misfire, Nonexistent, ResultStatus
from topics.tracecontext import (
    MAX_TRACEPARENT_CHARS,
    MAX_TRACESTATE_CHARS,
    TRACEPARENT,
    TRACESTATE,
)

Schema = Mapping[str, object]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _string() -> Schema:
    return {"type": "string"}


def _nullable(kind: str) -> Schema:
    return {"type": [kind, "null"]}


def _runs_of(schema: str) -> Schema:
    return {"type": "array", "items": _ref(schema)}


_ERR: Schema = _json(_ref("Error"), "error")
_ERRORS: dict[str, Schema] = {
    "400": _ERR,
    "401": _ERR,
    "403": _ERR,
    "404": _ERR,
    "413": _ERR,
    "503": _ERR,
}
_RESULT_ERRORS: dict[str, Schema] = {
    **_ERRORS,
    "409": _json(_ref("CommandResult"), "rejected (state)"),
    "422": _json(_ref("CommandResult"), "rejected (tenant policy)"),
    "429": _json(_ref("CommandResult"), "quota_exceeded"),
    "504": _json(
        _ref("Error"),
        "no result in time; it may still be applied (even after a GET's 404): re-send a "
        "create with the answer's schedule_id in its body, never without",
    ),
}
_SID: Schema = {"name": "schedule_id", "in": "path", "required": True, "schema": _string()}
_TENANT: Schema = {"name": "tenant", "in": "path", "required": True, "schema": _string()}
# The W3C trace context of a command that stores it with the schedule (create, update,
# reschedule) or fires at once (trigger); an invalid one is dropped and counted, never refused.
_TRACE: list[Schema] = [
    {
        "name": TRACEPARENT,
        "in": "header",
        "schema": {
            "type": "string",
            "maxLength": MAX_TRACEPARENT_CHARS,
            "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}",
        },
        "description": "W3C trace context: stored with the schedule and carried by each of "
        "its triggers to the callback and the dead letter (docs/wire-contract.md); an invalid "
        "one is dropped, not refused",
    },
    {
        "name": TRACESTATE,
        "in": "header",
        "schema": {"type": "string", "maxLength": MAX_TRACESTATE_CHARS},
        "description": "W3C vendor trace data, kept only with a valid traceparent",
    },
]
_MODE: list[Schema] = [
    {
        "name": "mode",
        "in": "query",
        "schema": {"enum": list(Mode)},
        "description": "async: answer 202 once Kafka has the command (also Prefer: respond-async)",
    },
    {
        "name": "timeout_s",
        "in": "query",
        "schema": {"type": "number", "maximum": 60},
        "description": "how long a sync request waits for the result (default 10)",
    },
]


def _run_counts(default: int) -> list[Schema]:
    return [
        {
            "name": name,
            "in": "query",
            "schema": {"type": "integer", "minimum": 0, "maximum": 1000, "default": default},
            "description": f"how many {what} runs (recurring schedules)",
        }
        for name, what in (("past", "past"), ("next", "next"))
    ]


def _window(**more: Schema) -> Schema:
    """A request body naming a due-time window ``[from, to)``, with ``more`` properties."""
    return {
        "type": "object",
        "required": ["from", "to"],
        "properties": {"from": _ref("Time"), "to": _ref("Time"), **more},
    }


def _op(
    summary: str,
    responses: Schema,
    *,
    body: Schema | None = None,
    params: Sequence[Schema] | None = None,
    admin: bool = False,
) -> Schema:
    op: dict[str, object] = {
        "summary": summary,
        "responses": responses,
        "security": [{"adminKey": []}] if admin else [{"apiKey": []}],
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


# -- schemas -----------------------------------------------------------------------------------


def _basic_schemas() -> dict[str, Schema]:
    return {
        "Time": {
            "oneOf": [
                {"type": "integer", "description": "epoch ms"},
                {"type": "string", "format": "date-time"},
            ]
        },
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": _string(), "message": _string()},
                }
            },
        },
    }


def _callback_schemas() -> dict[str, Schema]:
    return {
        "Callback": {
            "type": "object",
            "required": ["type"],
            "description": "docs/wire-contract.md#callbacks",
            "properties": {
                "type": {"enum": ["http", "kafka"]},
                "url": _string(),
                "method": _string(),
                "headers": {"type": "object"},
                "timeout_s": {"type": "number"},
                "topic": _string(),
                "key": _nullable("string"),
                "retry": _ref("Retry"),
            },
        },
        "Retry": {
            "type": "object",
            "additionalProperties": False,
            "description": "delivery retry limits; null keeps the proxy's",
            "properties": {
                "max_retry_age_s": _nullable("number"),
                "retries_6xx": _nullable("integer"),
            },
        },
    }


def _recurrence_properties() -> Schema:
    return {
        "cron": {
            "type": "string",
            "description": "5 fields, 6 with seconds first, or @yearly @monthly @weekly "
            "@daily @hourly",
        },
        "every_s": {"type": "integer", "minimum": 1, "maximum": 316224000},
        "start": _ref("Time"),
        "end": _ref("Time"),
        "max_runs": {"type": "integer", "minimum": 1},
        "time_zone": {
            "type": "string",
            "default": "UTC",
            "description": "IANA zone of the cron fields",
        },
        "nonexistent": {
            "enum": list(Nonexistent),
            "default": Nonexistent.SKIP,
            "description": "a local time a DST change skips",
        },
        "ambiguous": {
            "enum": list(Ambiguous),
            "default": Ambiguous.ONCE,
            "description": "a local time a DST change repeats",
        },
        "jitter_s": {
            "type": "integer",
            "minimum": 0,
            "maximum": 86400,
            "default": 0,
            "description": "fire each run in [nominal, +jitter_s)",
        },
        "misfire": {"enum": list(Misfire), "default": Misfire.FIRE_LATEST},
        "day_match": {
            "enum": list(DayMatch),
            "default": DayMatch.ANY,
            "description": "both day fields restricted: either matches (any, Vixie) or both (all)",
        },
    }


def _recurrence_schemas() -> dict[str, Schema]:
    return {
        "Recurrence": {
            "type": "object",
            "additionalProperties": False,
            "description": "a recurring schedule: exactly one of cron and every_s "
            "(docs/wire-contract.md#recurring-schedules)",
            "oneOf": [{"required": ["cron"]}, {"required": ["every_s"]}],
            "properties": _recurrence_properties(),
        },
    }


def _request_schemas() -> dict[str, Schema]:
    return {
        "CreateSchedule": {
            "type": "object",
            "required": ["callback"],
            "additionalProperties": False,
            "description": "exactly one of due (one-shot) and recurrence",
            "oneOf": [{"required": ["due"]}, {"required": ["recurrence"]}],
            "properties": {
                "schedule_id": _string(),
                "due": _ref("Time"),
                "recurrence": _ref("Recurrence"),
                "payload": {},
                "payload_b64": _string(),
                "callback": _ref("Callback"),
                "order_key": _string(),
                "misfire_tolerance_s": {
                    "type": "integer",
                    "description": "default 3600, 60 for recurring",
                },
            },
        },
        "UpdateSchedule": {
            "type": "object",
            "additionalProperties": False,
            "description": "due for a one-shot schedule, recurrence (replaces the whole "
            "object) for a recurring one",
            "properties": {
                "due": _ref("Time"),
                "recurrence": _ref("Recurrence"),
                "payload": {},
                "payload_b64": _string(),
                "callback": _ref("Callback"),
            },
        },
    }


def _run_schemas() -> dict[str, Schema]:
    run_states = [ScheduleState.SCHEDULED, ScheduleState.FIRED, ScheduleState.MISSED]
    return {
        "Run": {
            "type": "object",
            "description": "a run of a recurring schedule; past runs carry status "
            "(scheduled, fired, missed), fired_ms and delivery",
            "properties": {
                "run_id": {"type": "string", "description": "<schedule_id>@<nominal_ms>"},
                "nominal": _string(),
                "nominal_ms": {"type": "integer"},
                "due": _string(),
                "due_ms": {"type": "integer"},
                "trigger_id": _string(),
                "status": {"enum": run_states},
                "fired_ms": _nullable("integer"),
                "delivery": _nullable("string"),
            },
        },
        "Runs": {
            "type": "object",
            "properties": {
                "schedule_id": _string(),
                "recurrence": _ref("Recurrence"),
                "runs_written": _nullable("integer"),
                "past": _runs_of("Run"),
                "next": _runs_of("Run"),
            },
        },
    }


def _result_schemas() -> dict[str, Schema]:
    return {
        "CommandResult": {
            "type": "object",
            "properties": {
                "schedule_id": _string(),
                "request_id": _string(),
                "command": _string(),
                "status": {"enum": list(ResultStatus)},
                "code": {"enum": [c.value for c in Code]},
                "message": _string(),
                "partition": {"type": "integer"},
                "offset": {"type": "integer"},
            },
        },
        "Pending": {
            "type": "object",
            "properties": {
                "schedule_id": _string(),
                "request_id": _string(),
                "status": {"const": "pending"},
                "location": _string(),
            },
        },
    }


def _schedule_schema() -> Schema:
    return {
        "type": "object",
        "description": "a one-shot schedule, or with recurring: true a recurring one (due = "
        "its next run; in a listing, its first run in the window), or with recurring_run: "
        "true one of its runs",
        "properties": {
            "schedule_id": _string(),
            "tenant": _string(),
            "status": {"enum": list(ScheduleState)},
            "due": _nullable("string"),
            "due_ms": _nullable("integer"),
            "delivery": _nullable("object"),
            "callback": _ref("Callback"),
            "payload": {},
            "payload_b64": _string(),
            "recurring": {"type": "boolean"},
            "recurrence": _ref("Recurrence"),
            "next_run": _nullable("string"),
            "next_run_ms": _nullable("integer"),
            "runs_written": _nullable("integer"),
            "runs": {
                "type": "object",
                "properties": {"past": _runs_of("Run"), "next": _runs_of("Run")},
            },
            "recurring_run": {"type": "boolean"},
            "parent_schedule_id": _string(),
            "nominal_ms": {"type": "integer"},
            "traceparent": {
                "type": "string",
                "description": "the trace context stored with it (only when it has one)",
            },
            "history": {"type": "array", "items": {"type": "object"}},
        },
    }


def _tenant_schemas() -> dict[str, Schema]:
    strings = {"type": "array", "items": _string()}
    return {
        "TenantConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "create_quota_per_s": {"type": "number", "minimum": 0},
                "fire_quota_per_min": {"type": "integer", "minimum": 0},
                "max_payload_bytes": _nullable("integer"),
                "max_horizon_s": _nullable("integer"),
                "retention_s": _nullable("integer"),
                "retry_policy": _ref("Retry"),
                "allowed_callback_hosts": strings,
                "allowed_kafka_topics": strings,
            },
        },
        "Tenant": {
            "type": "object",
            "properties": {
                "tenant": _string(),
                "active": {"type": "boolean"},
                "signed_commands": {"type": "boolean"},
                "signing_key": {
                    "type": "object",
                    "properties": {
                        "rotated_ms": _nullable("integer"),
                        "previous_key": {"enum": ["valid", "retired", None]},
                        "previous_expires_ms": _nullable("integer"),
                    },
                },
                "config": _ref("TenantConfig"),
            },
        },
    }


def _schemas() -> dict[str, Schema]:
    return {
        **_basic_schemas(),
        **_callback_schemas(),
        **_recurrence_schemas(),
        **_request_schemas(),
        **_run_schemas(),
        **_result_schemas(),
        "Schedule": _schedule_schema(),
        **_tenant_schemas(),
    }


def _security_schemes() -> dict[str, Schema]:
    return {
        "apiKey": {
            "type": "http",
            "scheme": "bearer",
            "description": "a tenant API key (tsk_...), also as X-Api-Key",
        },
        "adminKey": {"type": "http", "scheme": "bearer", "description": "TOCSIN_ADMIN_KEY"},
    }


# -- paths -------------------------------------------------------------------------------------

_SCHEDULE_OK: dict[str, Schema] = {
    "200": _json(_ref("CommandResult"), "accepted (or duplicate)"),
    "202": _json(_ref("Pending"), "async: command queued"),
}


def _health_paths() -> dict[str, Schema]:
    return {
        "/healthz": {
            "get": {
                "summary": "liveness",
                "security": [],
                "responses": {"200": {"description": "alive"}},
            }
        },
        "/readyz": {
            "get": {
                "summary": "readiness (Kafka and Cassandra)",
                "security": [],
                "responses": {
                    "200": {"description": "ready"},
                    "503": {"description": "not ready"},
                },
            }
        },
    }


def _listing_params() -> list[Schema]:
    return [
        {"name": "from", "in": "query", "required": True, "schema": _ref("Time")},
        {"name": "to", "in": "query", "required": True, "schema": _ref("Time")},
        {
            "name": "status",
            "in": "query",
            "schema": _string(),
            "description": "comma-separated: " + ", ".join(STATUSES),
        },
        {"name": "limit", "in": "query", "schema": {"type": "integer", "maximum": 1000}},
        {"name": "cursor", "in": "query", "schema": _string()},
    ]


def _schedules_path() -> Schema:
    created = _json(
        _ref("CommandResult"),
        "created: stored by its worker; or, with an admission key and no schedule_id in the "
        "body, admitted and durable in Kafka (acks=all), to be stored and fired unless "
        "cancelled (docs/api.md)",
    )
    page = {
        "type": "object",
        "properties": {"schedules": _runs_of("Schedule"), "next_cursor": _nullable("string")},
    }
    return {
        "post": _op(
            "create a schedule",
            {"201": created, **_SCHEDULE_OK, **_RESULT_ERRORS},
            body=_ref("CreateSchedule"),
            params=[*_MODE, *_TRACE],
        ),
        "get": _op(
            "list the tenant's schedules in a due-time window (recurring ones once each, at "
            "their first run in the window)",
            {"200": _json(page, "a page"), **_ERRORS},
            params=_listing_params(),
        ),
    }


def _schedule_path() -> Schema:
    changed = {**_SCHEDULE_OK, **_RESULT_ERRORS}
    return {
        "get": _op(
            "a schedule with status and history (recurring: with its newest past and next runs)",
            {"200": _json(_ref("Schedule"), "the schedule"), **_ERRORS},
            params=[_SID, *_run_counts(5)],
        ),
        "patch": _op(
            "update due (one-shot) or recurrence (recurring), payload or callback",
            changed,
            body=_ref("UpdateSchedule"),
            params=[_SID, *_MODE, *_TRACE],
        ),
        "delete": _op("cancel", changed, params=[_SID, *_MODE]),
    }


def _schedule_paths() -> dict[str, Schema]:
    before = {
        "name": "before",
        "in": "query",
        "schema": _ref("Time"),
        "description": "past runs with a nominal time before this (paging; default now)",
    }
    due = {"type": "object", "required": ["due"], "properties": {"due": _ref("Time")}}
    return {
        "/v1/schedules": _schedules_path(),
        "/v1/schedules/{schedule_id}": _schedule_path(),
        "/v1/schedules/{schedule_id}/runs": {
            "get": _op(
                "a recurring schedule's past runs (newest first, with status and delivery) "
                "and next runs; 404 not_recurring for a one-shot",
                {"200": _json(_ref("Runs"), "runs"), **_ERRORS},
                params=[_SID, *_run_counts(10), before],
            )
        },
        "/v1/schedules/{schedule_id}/reschedule": {
            "post": _op(
                "move the due time",
                {**_SCHEDULE_OK, **_RESULT_ERRORS},
                body=due,
                params=[_SID, *_MODE, *_TRACE],
            )
        },
        **_control_paths(),
        **_backfill_path(),
    }


def _backfill_path() -> dict[str, Schema]:
    """Backfill one recurring schedule over a past window (docs/wire-contract.md)."""
    window = {
        "type": "object",
        "required": ["from", "to"],
        "properties": {"from": _ref("Time"), "to": _ref("Time")},
        "additionalProperties": False,
    }
    summary = (
        "emit the runs a recurring schedule had (or would have had) with nominal times in "
        "[from, to) due before now, each under its own run id and trigger id, paced by the "
        "worker at 20 runs/s, at most 10,000 per request (the result's message counts them "
        "and says where to go on when truncated); 409 not_recurring for a one-shot, 422 "
        "window_in_future when from is not in the past"
    )
    return {
        "/v1/schedules/{schedule_id}/backfill": {
            "post": _op(
                summary,
                {**_SCHEDULE_OK, **_RESULT_ERRORS},
                body=window,
                params=[_SID, *_MODE],
            )
        }
    }


def _control_paths() -> dict[str, Schema]:
    """Pause, resume and trigger one schedule (no body; docs/wire-contract.md)."""
    summaries = {
        "pause": "stop the schedule firing until resumed (recurring: its runs are skipped); "
        "duplicate when it is paused already",
        "resume": "let a paused schedule fire again: a one-shot due meanwhile fires late "
        "within its misfire tolerance or is recorded missed, a recurring one goes on at its "
        "next run; duplicate when it is not paused",
        "trigger": "fire the schedule once now as an extra run with its own trigger id (the "
        "result's message names it); a paused schedule stays paused",
    }
    return {
        f"/v1/schedules/{{schedule_id}}/{kind}": {
            "post": _op(
                summary,
                {**_SCHEDULE_OK, **_RESULT_ERRORS},
                params=[_SID, *_MODE, *(_TRACE if kind == "trigger" else [])],
            )
        }
        for kind, summary in summaries.items()
    }


def _bulk_paths() -> dict[str, Schema]:
    counts = {"200": _json({"type": "object"}, "counts"), **_ERRORS}
    statuses = {"type": "array", "items": {"enum": list(STATUSES)}}
    scope = {
        "type": "object",
        "description": "one-shots due in [from, to) (default: a day ago to a year ahead)",
        "properties": {
            "from": _ref("Time"),
            "to": _ref("Time"),
            "id_prefix": {"type": "string", "maxLength": 256},
            "cursor": {**_string(), "description": "a previous answer's next_cursor"},
        },
    }
    toggled_counts = {
        "type": "object",
        "description": "matched; paused or resumed (answered ok); codes (count per result "
        "code); no_result (sent, unanswered in time); failed (one entry per schedule whose "
        "command failed); truncated (it stopped at 10,000 selected or 50,000 index rows "
        "read: send it again with next_cursor as cursor)",
        "properties": {
            "matched": {"type": "integer"},
            "paused": {"type": "integer"},
            "resumed": {"type": "integer"},
            "codes": {"type": "object", "additionalProperties": {"type": "integer"}},
            "no_result": {"type": "integer"},
            "failed": {"type": "array", "items": {"type": "object"}},
            "truncated": {"type": "boolean"},
            "next_cursor": {
                **_nullable("string"),
                "description": "a truncated request: send it again with this cursor",
            },
        },
    }
    toggled = {"200": _json(toggled_counts, "counts"), **_ERRORS}
    return {
        "/v1/bulk/cancel": {
            "post": _op("cancel every scheduled schedule due in a window", counts, body=_window())
        },
        "/v1/bulk/refire": {
            "post": _op(
                "emit again the triggers of fired/missed schedules in a window (reconcile)",
                counts,
                body=_window(status=statuses),
            )
        },
        "/v1/bulk/pause": {
            "post": _op(
                "pause every scheduled schedule of the tenant (one-shots due in the window, "
                "recurring ones whatever their times), optionally only ids with a prefix; at "
                "most 10,000 selected and 50,000 index rows read per request",
                toggled,
                body=scope,
            )
        },
        "/v1/bulk/resume": {
            "post": _op(
                "resume every paused schedule of the tenant (as /v1/bulk/pause selects them)",
                toggled,
                body=scope,
            )
        },
    }


def _answer(description: str, status: str = "200", schema: Schema | None = None) -> Schema:
    return {status: _json(schema or {"type": "object"}, description), **_ERRORS}


def _tenant_paths() -> dict[str, Schema]:
    register = {
        "type": "object",
        "required": ["tenant"],
        "properties": {
            "tenant": _string(),
            "active": {"type": "boolean"},
            "config": _ref("TenantConfig"),
        },
    }
    change = {
        "type": "object",
        "properties": {"config": _ref("TenantConfig"), "active": {"type": "boolean"}},
    }
    tenant = _answer("tenant", schema=_ref("Tenant"))
    return {
        "/v1/tenants": {
            "post": _op(
                "register a tenant (returns its API key and signing key once)",
                {**_answer("registered", "201"), "409": _ERR},
                body=register,
                admin=True,
            ),
            "get": _op("list tenants", _answer("tenants"), admin=True),
        },
        "/v1/tenants/{tenant}": {
            "get": _op("a tenant (admin, or the tenant itself)", tenant, params=[_TENANT]),
            "patch": _op(
                "change config (merged) or active",
                tenant,
                body=change,
                params=[_TENANT],
                admin=True,
            ),
        },
    }


def _key_paths() -> dict[str, Schema]:
    key_id = {"name": "key_id", "in": "path", "required": True, "schema": _string()}
    return {
        "/v1/tenants/{tenant}/keys": {
            "post": _op(
                "issue another API key", _answer("key", "201"), params=[_TENANT], admin=True
            ),
            "get": _op("list key ids", _answer("keys"), params=[_TENANT], admin=True),
        },
        "/v1/tenants/{tenant}/signing-key": {
            "post": _op(
                "rotate the signing key: a new current key (returned once); the previous one "
                "verifies until retired or previous_valid_s passes",
                {**_answer("the new key", "201"), "409": _ERR},
                body={
                    "type": "object",
                    "properties": {"previous_valid_s": {"type": "integer", "minimum": 0}},
                },
                params=[_TENANT],
                admin=True,
            )
        },
        "/v1/tenants/{tenant}/signing-key/previous": {
            "delete": _op(
                "retire the previous signing key now",
                {**_answer("retired"), "409": _ERR},
                params=[_TENANT],
                admin=True,
            )
        },
        "/v1/tenants/{tenant}/keys/{key_id}": {
            "delete": _op("revoke a key", _answer("revoked"), params=[_TENANT, key_id], admin=True)
        },
    }


def _explain_paths() -> dict[str, Schema]:
    entry = {
        "type": "object",
        "properties": {
            "at": _string(),
            "at_ms": {"type": "integer"},
            "event": {**_string(), "description": "the history event, as recorded"},
            "schedule_id": {**_string(), "description": "the schedule, or one of its runs"},
            "trigger_id": _nullable("string"),
            "due_ms": _nullable("integer"),
            "lateness_ms": _nullable("integer"),
            "emit_attempt": _nullable("integer"),
            "detail": _nullable("string"),
            "text": _string(),
        },
    }
    explanation = {
        "type": "object",
        "properties": {
            "tenant": _string(),
            "schedule_id": _string(),
            "kind": {"enum": ["one_shot", "recurring"]},
            "state": _string(),
            "reason": {**_string(), "description": "why it stands where it does, in words"},
            "timeline": {"type": "array", "items": entry},
            "notes": {"type": "array", "items": _string()},
            "runs_shown": {"type": "integer"},
            "not_recorded": {
                "type": "array",
                "items": _string(),
                "description": "what the system does not record, so the timeline cannot show",
            },
        },
    }
    params = [
        _SID,
        {
            "name": "tenant",
            "in": "query",
            "schema": _string(),
            "description": "admin key: whose schedule (a tenant key reads its own only)",
        },
        {
            "name": "runs",
            "in": "query",
            "schema": {"type": "integer", "minimum": 0, "maximum": 100, "default": 10},
            "description": "recurring: how many of the newest runs to include",
        },
    ]
    op = dict(
        _op(
            "why it did or did not fire: everything recorded about the schedule in time "
            "order, with the reason for its state; another tenant's schedule is 404",
            {"200": _json(explanation, "the explanation"), **_ERRORS},
            params=params,
        )
    )
    op["security"] = [{"apiKey": []}, {"adminKey": []}]
    return {"/v1/schedules/{schedule_id}/explain": {"get": op}}


def _dead_letter_paths() -> dict[str, Schema]:
    """``/v1/dead-letters`` (api.deadletter_routes): a tenant key's own dead letters."""
    tid = {
        "name": "trigger_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
    }
    letter = {
        "type": "object",
        "properties": {
            "trigger_id": _string(),
            "schedule_id": _string(),
            "dead_lettered_at": _string(),
            "due": _nullable("string"),
            "reason": _nullable("string"),
            "response": {
                "type": ["object", "null"],
                "description": "the last attempt's HTTP answer (null: none, e.g. a timeout)",
                "properties": {
                    "status_code": {"type": "integer"},
                    "body_excerpt": {**_string(), "description": "at most 1,024 characters"},
                },
            },
            "endpoint": _nullable("string"),
            "attempts": _nullable("integer"),
            "emit_attempt": _nullable("integer"),
            "redriven": {
                "type": ["object", "null"],
                "properties": {"at": _string(), "attempt": {"type": "integer"}},
            },
        },
    }
    redriven = {
        "type": "object",
        "properties": {
            "trigger_id": _string(),
            "schedule_id": _string(),
            "attempt": {"type": "integer", "description": "the new emission attempt"},
            "redriven_at": _string(),
            "history_recorded": {
                "type": "boolean",
                "description": "false: sent, but its refired history event was not written",
            },
        },
    }
    bulk = {
        "type": "object",
        "properties": {
            "matched": {"type": "integer"},
            "redriven": {"type": "array", "items": redriven},
            "failed": {"type": "array", "items": {"type": "object"}},
            "truncated": {"type": "boolean", "description": "more are left: send it again"},
            "limit": {"type": "integer", "description": "at most this many per request (500)"},
            "next_cursor": {
                **_nullable("string"),
                "description": "a truncated window redrive: send it again with this cursor",
            },
        },
    }
    window = {"name": "from", "in": "query", "schema": _ref("Time")}
    listing = {
        "type": "object",
        "properties": {
            "dead_letters": {"type": "array", "items": letter},
            "next_cursor": _nullable("string"),
        },
    }
    force = {"force": {"type": "boolean", "description": "redrive even if redriven/delivered"}}
    many = {
        "type": "object",
        "description": "either trigger_ids (at most 500) or a window [from, to) of at most 32 "
        "days (its dead letters not redriven yet, newest first, at most 500)",
        "properties": {
            "trigger_ids": {"type": "array", "items": _string(), "maxItems": 500},
            "from": _ref("Time"),
            "to": _ref("Time"),
            "cursor": {**_string(), "description": "with a window: a previous next_cursor"},
            **force,
        },
    }
    refusals = {**_ERRORS, "409": _ERR, "410": _ERR}
    return {
        "/v1/dead-letters": {
            "get": _op(
                "the tenant's dead letters, newest first, with reason and last response "
                "(window default: the last 7 days, at most 32)",
                {"200": _json(listing, "a page"), **_ERRORS},
                params=[
                    {**window, "description": "from (default: to - 7 days)"},
                    {"name": "to", "in": "query", "schema": _ref("Time")},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "maximum": 1000},
                    },
                    {"name": "cursor", "in": "query", "schema": _string()},
                ],
            )
        },
        "/v1/dead-letters/redrive": {
            "post": _op(
                "send dead-lettered triggers again (same trigger id, next attempt, per-key "
                "order); each one's outcome is listed",
                {"200": _json(bulk, "each one's outcome"), **_ERRORS},
                body=many,
            )
        },
        "/v1/dead-letters/{trigger_id}": {
            "get": _op(
                "one dead letter (the trigger's latest); another tenant's is 404",
                {"200": _json(letter, "the dead letter"), **_ERRORS},
                params=[tid],
            )
        },
        "/v1/dead-letters/{trigger_id}/redrive": {
            "post": _op(
                "send this dead-lettered trigger again; 409 already_redriven, "
                "already_delivered, schedule_cancelled, superseded; 410 schedule_gone; 503 "
                "unavailable, fire_not_recorded (send it again)",
                {"200": _json(redriven, "sent"), **refusals},
                body={"type": "object", "properties": force},
                params=[tid],
            )
        },
    }


def _paths() -> dict[str, Schema]:
    return {
        **_health_paths(),
        **_schedule_paths(),
        **_bulk_paths(),
        **_tenant_paths(),
        **_key_paths(),
        **_explain_paths(),
        **_dead_letter_paths(),
    }


@cache
def openapi_document() -> Schema:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tocsin API",
            "version": "1",
            "description": "Schedules, tenants and health of a Tocsin cluster. Commands travel "
            "over Kafka; see docs/api.md.",
        },
        "components": {"securitySchemes": _security_schemes(), "schemas": _schemas()},
        "paths": _paths(),
    }

"""The API's OpenAPI 3.1 document, served at ``/openapi.json`` (native ``/v1`` routes)."""

from __future__ import annotations

from functools import cache
from typing import Any

from api.views import STATUSES
from topics.codes import Code


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERR = _json(_ref("Error"), "error")
_ERRORS = {"400": _ERR, "401": _ERR, "403": _ERR, "404": _ERR, "413": _ERR, "503": _ERR}
_RESULT_ERRORS = {
    **_ERRORS,
    "409": _json(_ref("CommandResult"), "rejected (state)"),
    "422": _json(_ref("CommandResult"), "rejected (tenant policy)"),
    "429": _json(_ref("CommandResult"), "quota_exceeded"),
    "504": _json(_ref("Error"), "no result in time; check with GET"),
}
_SID = {"name": "schedule_id", "in": "path", "required": True, "schema": {"type": "string"}}
_TENANT = {"name": "tenant", "in": "path", "required": True, "schema": {"type": "string"}}
_MODE = [
    {
        "name": "mode",
        "in": "query",
        "schema": {"enum": ["sync", "async"]},
        "description": "async: answer 202 once Kafka has the command (also Prefer: respond-async)",
    },
    {
        "name": "timeout_s",
        "in": "query",
        "schema": {"type": "number", "maximum": 60},
        "description": "how long a sync request waits for the result (default 10)",
    },
]


def _run_counts(default: int) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "in": "query",
            "schema": {"type": "integer", "minimum": 0, "maximum": 1000, "default": default},
            "description": f"how many {what} runs (recurring schedules)",
        }
        for name, what in (("past", "past"), ("next", "next"))
    ]


_WINDOW: dict[str, Any] = {
    "type": "object",
    "required": ["from", "to"],
    "properties": {"from": _ref("Time"), "to": _ref("Time")},
}


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
    params: list[dict[str, Any]] | None = None,
    admin: bool = False,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": responses,
        "security": [{"adminKey": []}] if admin else [{"apiKey": []}],
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


@cache
def openapi_document() -> dict[str, Any]:
    schedule_ok = {
        "200": _json(_ref("CommandResult"), "accepted (or duplicate)"),
        "202": _json(_ref("Pending"), "async: command queued"),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tocsin API",
            "version": "1",
            "description": "Schedules, tenants and health of a Tocsin cluster. "
            "Commands travel over Kafka; see docs/api.md.",
        },
        "components": {
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a tenant API key (tsk_...), also as X-Api-Key",
                },
                "adminKey": {"type": "http", "scheme": "bearer", "description": "TOCSIN_ADMIN_KEY"},
            },
            "schemas": {
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
                            "properties": {
                                "code": {"type": "string"},
                                "message": {"type": "string"},
                            },
                        }
                    },
                },
                "Callback": {
                    "type": "object",
                    "required": ["type"],
                    "description": "docs/wire-contract.md#callbacks",
                    "properties": {
                        "type": {"enum": ["http", "kafka"]},
                        "url": {"type": "string"},
                        "method": {"type": "string"},
                        "headers": {"type": "object"},
                        "timeout_s": {"type": "number"},
                        "topic": {"type": "string"},
                        "key": {"type": ["string", "null"]},
                        "retry": _ref("Retry"),
                    },
                },
                "Retry": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "delivery retry limits; null keeps the proxy's",
                    "properties": {
                        "max_retry_age_s": {"type": ["number", "null"]},
                        "retries_6xx": {"type": ["integer", "null"]},
                    },
                },
                "Recurrence": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "a recurring schedule: exactly one of cron and every_s "
                    "(docs/wire-contract.md#recurring-schedules)",
                    "oneOf": [{"required": ["cron"]}, {"required": ["every_s"]}],
                    "properties": {
                        "cron": {
                            "type": "string",
                            "description": "5 fields, 6 with seconds "
                            "first, or @yearly @monthly @weekly @daily @hourly",
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
                            "enum": ["skip", "shift_forward"],
                            "default": "skip",
                            "description": "a local time a DST change skips",
                        },
                        "ambiguous": {
                            "enum": ["once", "twice"],
                            "default": "once",
                            "description": "a local time a DST change repeats",
                        },
                        "jitter_s": {
                            "type": "integer",
                            "minimum": 0,
                            "maximum": 86400,
                            "default": 0,
                            "description": "fire each run in [nominal, +jitter_s)",
                        },
                        "misfire": {
                            "enum": ["fire_all", "fire_latest", "skip"],
                            "default": "fire_latest",
                        },
                        "day_match": {
                            "enum": ["any", "all"],
                            "default": "any",
                            "description": "both day fields restricted: either "
                            "matches (any, Vixie) or both (all)",
                        },
                    },
                },
                "CreateSchedule": {
                    "type": "object",
                    "required": ["callback"],
                    "additionalProperties": False,
                    "description": "exactly one of due (one-shot) and recurrence",
                    "oneOf": [{"required": ["due"]}, {"required": ["recurrence"]}],
                    "properties": {
                        "schedule_id": {"type": "string"},
                        "due": _ref("Time"),
                        "recurrence": _ref("Recurrence"),
                        "payload": {},
                        "payload_b64": {"type": "string"},
                        "callback": _ref("Callback"),
                        "order_key": {"type": "string"},
                        "misfire_tolerance_s": {
                            "type": "integer",
                            "description": "default 3600, 60 for recurring",
                        },
                    },
                },
                "UpdateSchedule": {
                    "type": "object",
                    "additionalProperties": False,
                    "description": "due for a one-shot schedule, recurrence (replaces the "
                    "whole object) for a recurring one",
                    "properties": {
                        "due": _ref("Time"),
                        "recurrence": _ref("Recurrence"),
                        "payload": {},
                        "payload_b64": {"type": "string"},
                        "callback": _ref("Callback"),
                    },
                },
                "Run": {
                    "type": "object",
                    "description": "a run of a recurring schedule; past runs carry status "
                    "(scheduled, fired, missed), fired_ms and delivery",
                    "properties": {
                        "run_id": {"type": "string", "description": "<schedule_id>@<nominal_ms>"},
                        "nominal": {"type": "string"},
                        "nominal_ms": {"type": "integer"},
                        "due": {"type": "string"},
                        "due_ms": {"type": "integer"},
                        "trigger_id": {"type": "string"},
                        "status": {"enum": ["scheduled", "fired", "missed"]},
                        "fired_ms": {"type": ["integer", "null"]},
                        "delivery": {"type": ["string", "null"]},
                    },
                },
                "Runs": {
                    "type": "object",
                    "properties": {
                        "schedule_id": {"type": "string"},
                        "recurrence": _ref("Recurrence"),
                        "runs_written": {"type": ["integer", "null"]},
                        "past": {"type": "array", "items": _ref("Run")},
                        "next": {"type": "array", "items": _ref("Run")},
                    },
                },
                "CommandResult": {
                    "type": "object",
                    "properties": {
                        "schedule_id": {"type": "string"},
                        "request_id": {"type": "string"},
                        "command": {"type": "string"},
                        "status": {"enum": ["accepted", "rejected"]},
                        "code": {"enum": [c.value for c in Code]},
                        "message": {"type": "string"},
                        "partition": {"type": "integer"},
                        "offset": {"type": "integer"},
                    },
                },
                "Pending": {
                    "type": "object",
                    "properties": {
                        "schedule_id": {"type": "string"},
                        "request_id": {"type": "string"},
                        "status": {"const": "pending"},
                        "location": {"type": "string"},
                    },
                },
                "Schedule": {
                    "type": "object",
                    "description": "a one-shot schedule, or with recurring: true a recurring "
                    "one (due = its next run; in a listing, its first run in "
                    "the window), or with recurring_run: true one of its runs",
                    "properties": {
                        "schedule_id": {"type": "string"},
                        "tenant": {"type": "string"},
                        "status": {
                            "enum": ["scheduled", "fired", "missed", "cancelled", "completed"]
                        },
                        "due": {"type": ["string", "null"]},
                        "due_ms": {"type": ["integer", "null"]},
                        "delivery": {"type": ["object", "null"]},
                        "callback": _ref("Callback"),
                        "payload": {},
                        "payload_b64": {"type": "string"},
                        "recurring": {"type": "boolean"},
                        "recurrence": _ref("Recurrence"),
                        "next_run": {"type": ["string", "null"]},
                        "next_run_ms": {"type": ["integer", "null"]},
                        "runs_written": {"type": ["integer", "null"]},
                        "runs": {
                            "type": "object",
                            "properties": {
                                "past": {"type": "array", "items": _ref("Run")},
                                "next": {"type": "array", "items": _ref("Run")},
                            },
                        },
                        "recurring_run": {"type": "boolean"},
                        "parent_schedule_id": {"type": "string"},
                        "nominal_ms": {"type": "integer"},
                        "history": {"type": "array", "items": {"type": "object"}},
                    },
                },
                "TenantConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "create_quota_per_s": {"type": "number", "minimum": 0},
                        "fire_quota_per_min": {"type": "integer", "minimum": 0},
                        "max_payload_bytes": {"type": ["integer", "null"]},
                        "max_horizon_s": {"type": ["integer", "null"]},
                        "retention_s": {"type": ["integer", "null"]},
                        "retry_policy": _ref("Retry"),
                        "allowed_callback_hosts": {"type": "array", "items": {"type": "string"}},
                        "allowed_kafka_topics": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "Tenant": {
                    "type": "object",
                    "properties": {
                        "tenant": {"type": "string"},
                        "active": {"type": "boolean"},
                        "signed_commands": {"type": "boolean"},
                        "signing_key": {
                            "type": "object",
                            "properties": {
                                "rotated_ms": {"type": ["integer", "null"]},
                                "previous_key": {"enum": ["valid", "retired", None]},
                                "previous_expires_ms": {"type": ["integer", "null"]},
                            },
                        },
                        "config": _ref("TenantConfig"),
                    },
                },
            },
        },
        "paths": {
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
            "/v1/schedules": {
                "post": _op(
                    "create a schedule",
                    {
                        "201": _json(_ref("CommandResult"), "created"),
                        **schedule_ok,
                        **_RESULT_ERRORS,
                    },
                    body=_ref("CreateSchedule"),
                    params=_MODE,
                ),
                "get": _op(
                    "list the tenant's schedules in a due-time window (recurring "
                    "ones once each, at their first run in the window)",
                    {
                        "200": _json(
                            {
                                "type": "object",
                                "properties": {
                                    "schedules": {"type": "array", "items": _ref("Schedule")},
                                    "next_cursor": {"type": ["string", "null"]},
                                },
                            },
                            "a page",
                        ),
                        **_ERRORS,
                    },
                    params=[
                        {"name": "from", "in": "query", "required": True, "schema": _ref("Time")},
                        {"name": "to", "in": "query", "required": True, "schema": _ref("Time")},
                        {
                            "name": "status",
                            "in": "query",
                            "schema": {"type": "string"},
                            "description": "comma-separated: " + ", ".join(STATUSES),
                        },
                        {
                            "name": "limit",
                            "in": "query",
                            "schema": {"type": "integer", "maximum": 1000},
                        },
                        {"name": "cursor", "in": "query", "schema": {"type": "string"}},
                    ],
                ),
            },
            "/v1/schedules/{schedule_id}": {
                "get": _op(
                    "a schedule with status and history (recurring: with its "
                    "newest past and next runs)",
                    {"200": _json(_ref("Schedule"), "the schedule"), **_ERRORS},
                    params=[_SID, *_run_counts(5)],
                ),
                "patch": _op(
                    "update due (one-shot) or recurrence (recurring), payload or callback",
                    {**schedule_ok, **_RESULT_ERRORS},
                    body=_ref("UpdateSchedule"),
                    params=[_SID, *_MODE],
                ),
                "delete": _op("cancel", {**schedule_ok, **_RESULT_ERRORS}, params=[_SID, *_MODE]),
            },
            "/v1/schedules/{schedule_id}/runs": {
                "get": _op(
                    "a recurring schedule's past runs (newest first, with status "
                    "and delivery) and next runs; 404 not_recurring for a one-shot",
                    {"200": _json(_ref("Runs"), "runs"), **_ERRORS},
                    params=[
                        _SID,
                        *_run_counts(10),
                        {
                            "name": "before",
                            "in": "query",
                            "schema": _ref("Time"),
                            "description": "past runs with a nominal time before this "
                            "(paging; default now)",
                        },
                    ],
                )
            },
            "/v1/schedules/{schedule_id}/reschedule": {
                "post": _op(
                    "move the due time",
                    {**schedule_ok, **_RESULT_ERRORS},
                    body={
                        "type": "object",
                        "required": ["due"],
                        "properties": {"due": _ref("Time")},
                    },
                    params=[_SID, *_MODE],
                )
            },
            "/v1/bulk/cancel": {
                "post": _op(
                    "cancel every scheduled schedule due in a window",
                    {"200": _json({"type": "object"}, "counts"), **_ERRORS},
                    body=_WINDOW,
                )
            },
            "/v1/bulk/refire": {
                "post": _op(
                    "emit again the triggers of fired/missed schedules in a window (reconcile)",
                    {"200": _json({"type": "object"}, "counts"), **_ERRORS},
                    body={
                        **_WINDOW,
                        "properties": {
                            **_WINDOW["properties"],
                            "status": {"type": "array", "items": {"enum": list(STATUSES)}},
                        },
                    },
                )
            },
            "/v1/tenants": {
                "post": _op(
                    "register a tenant (returns its API key and signing key once)",
                    {"201": _json({"type": "object"}, "registered"), **_ERRORS, "409": _ERR},
                    body={
                        "type": "object",
                        "required": ["tenant"],
                        "properties": {
                            "tenant": {"type": "string"},
                            "active": {"type": "boolean"},
                            "config": _ref("TenantConfig"),
                        },
                    },
                    admin=True,
                ),
                "get": _op(
                    "list tenants",
                    {"200": _json({"type": "object"}, "tenants"), **_ERRORS},
                    admin=True,
                ),
            },
            "/v1/tenants/{tenant}": {
                "get": _op(
                    "a tenant (admin, or the tenant itself)",
                    {"200": _json(_ref("Tenant"), "tenant"), **_ERRORS},
                    params=[_TENANT],
                ),
                "patch": _op(
                    "change config (merged) or active",
                    {"200": _json(_ref("Tenant"), "tenant"), **_ERRORS},
                    body={
                        "type": "object",
                        "properties": {
                            "config": _ref("TenantConfig"),
                            "active": {"type": "boolean"},
                        },
                    },
                    params=[_TENANT],
                    admin=True,
                ),
            },
            "/v1/tenants/{tenant}/keys": {
                "post": _op(
                    "issue another API key",
                    {"201": _json({"type": "object"}, "key"), **_ERRORS},
                    params=[_TENANT],
                    admin=True,
                ),
                "get": _op(
                    "list key ids",
                    {"200": _json({"type": "object"}, "keys"), **_ERRORS},
                    params=[_TENANT],
                    admin=True,
                ),
            },
            "/v1/tenants/{tenant}/signing-key": {
                "post": _op(
                    "rotate the signing key: a new current key (returned once); the "
                    "previous one verifies until retired or previous_valid_s passes",
                    {"201": _json({"type": "object"}, "the new key"), **_ERRORS, "409": _ERR},
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
                    {"200": _json({"type": "object"}, "retired"), **_ERRORS, "409": _ERR},
                    params=[_TENANT],
                    admin=True,
                )
            },
            "/v1/tenants/{tenant}/keys/{key_id}": {
                "delete": _op(
                    "revoke a key",
                    {"200": _json({"type": "object"}, "revoked"), **_ERRORS},
                    params=[
                        _TENANT,
                        {
                            "name": "key_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        },
                    ],
                    admin=True,
                )
            },
        },
    }

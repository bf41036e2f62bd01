"""The trace context a schedule was stored with is visible: declared as request headers in
the OpenAPI document, and shown (the traceparent) by the schedule's view."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from api import views
from api.openapi import openapi_document

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _headers(path: str, method: str) -> set[str]:
    op = openapi_document()["paths"][path][method]  # type: ignore[index]
    return {p["name"] for p in op.get("parameters", []) if p["in"] == "header"}


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/v1/schedules", "post"),
        ("/v1/schedules/{schedule_id}", "patch"),
        ("/v1/schedules/{schedule_id}/reschedule", "post"),
        ("/v1/schedules/{schedule_id}/trigger", "post"),
    ],
)
def test_the_commands_that_store_or_fire_a_context_declare_its_headers(
    path: str, method: str
) -> None:
    assert _headers(path, method) == {"traceparent", "tracestate"}


def test_the_declared_traceparent_pattern_accepts_a_w3c_example() -> None:
    import re

    op = openapi_document()["paths"]["/v1/schedules"]["post"]  # type: ignore[index]
    (param,) = [p for p in op["parameters"] if p["name"] == "traceparent"]
    assert re.match(param["schema"]["pattern"], TRACEPARENT)
    assert not re.match(param["schema"]["pattern"], TRACEPARENT.upper())


def test_the_schedule_schema_has_the_traceparent() -> None:
    schema = openapi_document()["components"]["schemas"]["Schedule"]  # type: ignore[index]
    assert "traceparent" in schema["properties"]


def _row(**kw: Any) -> dict[str, Any]:
    return {
        "tenant": "a",
        "schedule_id": "s",
        "state": "scheduled",
        "due_ms": 1000,
        "payload": orjson.dumps({"x": 1}),
        "payload_type": "json",
        "callback": '{"type":"kafka","topic":"t","key":null}',
        **kw,
    }


def test_the_schedule_view_shows_its_traceparent_and_not_its_tracestate() -> None:
    view = views.schedule_view(_row(traceparent=TRACEPARENT, tracestate="vendor=opaque"), [])
    assert view["traceparent"] == TRACEPARENT
    assert "tracestate" not in orjson.loads(orjson.dumps(view))
    # A recurring schedule's view takes the same part of the row.
    assert views.settings_view(_row(traceparent=TRACEPARENT))["traceparent"] == TRACEPARENT


def test_a_schedule_without_a_context_shows_none() -> None:
    assert "traceparent" not in views.schedule_view(_row(traceparent=None), [])
    assert "traceparent" not in views.schedule_view(_row(), [])
    assert "traceparent" not in views.schedule_view(_row(traceparent=TRACEPARENT), brief=True)

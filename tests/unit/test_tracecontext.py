"""W3C trace context: strict parsing at the edges, and its way from a command's headers to
the schedule's rows, the trigger, the fires record, the callback request and the dead
letter. Tracing off, nothing imports OpenTelemetry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import orjson
import pytest

from base.settings import REPO_ROOT
from proxy.deadletter import dead_letter_record
from proxy.envelope import Envelope, prepare_fire
from streams import metrics
from streams.decisions import Decision
from streams.model import BucketRow, ScheduleChange, ScheduleRow, trigger_for
from streams.tracing import CommandTraces
from topics.codec import callback_to_json, decode_trigger, encode_trigger, trigger_headers
from topics.codes import Code
from topics.models import CancelCommand, CreateCommand, HttpCallback
from topics.tracecontext import (
    MAX_TRACESTATE_MEMBERS,
    TraceContext,
    from_headers,
    parse_traceparent,
    parse_tracestate,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TP = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
OTHER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.mark.parametrize(
    "value",
    [
        TP,
        TP.encode(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-ff",  # unknown flags kept
    ],
)
def test_valid_traceparents_are_kept_as_they_are(value: str | bytes) -> None:
    text = value.decode() if isinstance(value, bytes) else value
    assert parse_traceparent(value) == text


@pytest.mark.parametrize(
    "value",
    [
        "",
        TP.upper(),  # lowercase hex only
        TP.replace(TRACE_ID, "0" * 32),  # all-zero trace id
        TP.replace("00f067aa0ba902b7", "0" * 16),  # all-zero parent id
        "ff" + TP[2:],  # version ff is invalid
        TP + "-extra",  # version 00 has exactly four fields
        TP[:-1],
        TP + "0",
        " " + TP,
        TP.replace("-", "_"),
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",  # misplaced dash
        "00-" + "g" * 32 + "-00f067aa0ba902b7-01",
        "01-" + TP[3:] + "x",  # a later version must go on with a dash
        "01-" + TP[3:] + "-" + "a" * 300,  # bounded however it goes on
        "é" * 55,
        b"\xff" * 55,
    ],
)
def test_invalid_traceparents_are_dropped(value: str | bytes) -> None:
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_by_its_first_fields_and_sent_on_as_version_00() -> None:
    assert parse_traceparent("cc-" + TP[3:] + "-what-comes-next") == TP
    assert parse_traceparent("cc-" + TP[3:]) == TP


def test_context_fields() -> None:
    ctx = TraceContext(TP, "a=1")
    assert (ctx.trace_id, ctx.parent_id, ctx.flags, ctx.sampled) == (
        TRACE_ID,
        "00f067aa0ba902b7",
        1,
        True,
    )
    assert ctx.headers() == [("traceparent", TP.encode()), ("tracestate", b"a=1")]
    assert TraceContext(TP).headers() == [("traceparent", TP.encode())]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
        ("a=1, ,b=2 ", "a=1,b=2"),  # empty members and surrounding blanks dropped
        ("tenant@vendor=x", "tenant@vendor=x"),
        ("A=1", None),  # keys are lowercase
        ("a=1,a=2", None),  # a key once
        ("a=,b=2", None),  # a value has at least one character
        ("a=x=y", None),
        ("a", None),
        ("", None),
        ("a=" + "x" * 600, None),  # over 512 characters: dropped, never cut
        (",".join(f"k{i}=v" for i in range(MAX_TRACESTATE_MEMBERS + 1)), None),
    ],
)
def test_tracestate_is_a_bounded_w3c_list(value: str, expected: str | None) -> None:
    assert parse_tracestate(value) == expected


def test_headers_are_read_ignoring_case_and_two_different_parents_are_invalid() -> None:
    got = from_headers([("TraceParent", TP.encode()), ("tracestate", b"a=1"), ("x", b"y")])
    assert got.context == TraceContext(TP, "a=1") and not got.invalid
    both = from_headers([("traceparent", TP.encode()), ("traceparent", OTHER.encode())])
    assert both.context is None and both.invalid
    same_twice = from_headers([("traceparent", TP), ("traceparent", TP)])
    assert same_twice.context == TraceContext(TP)
    joined = from_headers({"traceparent": TP, "tracestate": "a=1"})
    assert joined.context == TraceContext(TP, "a=1")
    multi = from_headers([("traceparent", TP), ("tracestate", "a=1"), ("tracestate", "b=2")])
    assert multi.context == TraceContext(TP, "a=1,b=2")
    # A tracestate never travels alone, and a bad one is dropped without its traceparent.
    assert from_headers([("tracestate", b"a=1")]).context is None
    assert from_headers([("traceparent", TP), ("tracestate", "A=1")]).context == TraceContext(TP)
    bad = from_headers([("traceparent", b"00-nope")])
    assert bad.context is None and bad.invalid
    assert not from_headers([]).invalid


# -- through the worker ---------------------------------------------------------------


class Msg:
    def __init__(self, offset: int, headers: list[tuple[str, bytes]]) -> None:
        self.partition = 0
        self.offset = offset
        self.headers = headers


CALLBACK = HttpCallback(url="https://hooks.example/x", headers={"traceparent": OTHER})


def create_decision(sid: str) -> Decision:
    row = ScheduleRow(
        tenant="acme",
        schedule_id=sid,
        partition=0,
        state="scheduled",
        due_ms=1_900_000_000_000,
        version=1,
        created_ms=1,
        updated_ms=1,
        callback=callback_to_json(CALLBACK),
        payload=b"{}",
        payload_type="json",
    )
    bucket = BucketRow.for_schedule(row, shards=4)
    change = ScheduleChange(row=row, new_bucket=bucket, old_bucket=None, now_ms=1)
    return Decision(code=Code.OK, text="", change=change, hand_over=row)


def test_a_create_stores_its_context_on_the_rows_and_an_invalid_one_is_counted() -> None:
    dropped = metrics.TRACEPARENT_DROPPED.labels("command")
    before = dropped._value.get()
    good, bad, none = (
        Msg(1, [("traceparent", TP.encode()), ("tracestate", b"a=1")]),
        Msg(2, [("traceparent", TP.upper().encode())]),
        Msg(3, []),
    )
    traces = CommandTraces([good, bad, none])
    assert dropped._value.get() == before + 1
    create = CreateCommand(
        tenant="acme", schedule_id="s", callback=CALLBACK, misfire_tolerance_s=60
    )
    stamped = traces.stamp(create_decision("s"), create, good)
    assert stamped.change is not None and stamped.change.new_bucket is not None
    assert stamped.change.row.traceparent == TP and stamped.change.row.tracestate == "a=1"
    assert stamped.change.new_bucket.traceparent == TP
    assert stamped.hand_over is not None and stamped.hand_over.traceparent == TP
    for msg in (bad, none):
        untouched = traces.stamp(create_decision("s"), create, msg)
        assert untouched.change is not None and untouched.change.row.traceparent is None
    # A cancel changes no stored context.
    cancel = CancelCommand(tenant="acme", schedule_id="s")
    assert traces.stamp(create_decision("s"), cancel, good).change.row.traceparent is None  # type: ignore[union-attr]

    # The ticker's trigger carries it, as the fires record's headers (not in its value).
    bucket = stamped.change.new_bucket
    trigger = trigger_for(bucket, emitted_ms=bucket.due_ms)
    assert (trigger.traceparent, trigger.tracestate) == (TP, "a=1")
    assert ("traceparent", TP.encode()) in trigger_headers(trigger)
    assert ("tracestate", b"a=1") in trigger_headers(trigger)
    value = encode_trigger(trigger)
    assert TP.encode() not in value
    assert decode_trigger(value).traceparent is None


def fire_envelope(headers: list[tuple[str, bytes | None]], callback: HttpCallback) -> Envelope:
    row = create_decision("s").change.row  # type: ignore[union-attr]
    trigger = trigger_for(row, emitted_ms=row.due_ms)
    doc = orjson.loads(encode_trigger(trigger))
    doc["callback"]["headers"] = dict(callback.headers)
    env = Envelope(
        topic="fires",
        partition=0,
        offset=9,
        key=b"s",
        value=orjson.dumps(doc),
        headers=headers,
        timestamp_ms=1,
        read_s=0.0,
    )
    prepare_fire(env, decode_trigger)
    return env


def test_the_commands_context_wins_over_the_callbacks_and_reaches_the_dead_letter() -> None:
    traced = fire_envelope([("traceparent", TP.encode()), ("tracestate", b"a=1")], CALLBACK)
    assert traced.request is not None
    sent = [(k.lower(), v) for k, v in traced.request.headers]
    assert [v for k, v in sent if k == "traceparent"] == [TP]
    assert [v for k, v in sent if k == "tracestate"] == ["a=1"]
    letter = orjson.loads(
        dead_letter_record(
            traced,
            reason="HTTP 700",
            status=700,
            first_failure_ms=1,
            last_failure_ms=1,
            now_ms=2,
            group_id="g",
        )
    )
    assert (letter["traceparent"], letter["tracestate"]) == (TP, "a=1")

    # Without one (or with an invalid one) the callback's own passes as given.
    for headers in ([], [("traceparent", b"00-bad")]):
        plain = fire_envelope(headers, CALLBACK)
        assert plain.request is not None
        assert [v for k, v in plain.request.headers if k.lower() == "traceparent"] == [OTHER]
        assert plain.trigger is not None and plain.trigger.traceparent is None


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = (
        "import sys, streams.app, streams.commands, streams.ticker, proxy.app, "
        "proxy.http_sender, api.server, base.tracing\n"
        "assert not base.tracing.enabled()\n"
        "assert base.tracing.start('x', kind=base.tracing.SpanKind.INTERNAL, parent=None) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tracing_on_a_span_continues_the_trace_with_its_own_parent_id() -> None:
    from base import tracing
    from streams.tracing import emit_span

    assert tracing.configure("unit", {"OTEL_TRACES_EXPORTER": "console"})
    try:
        traces = CommandTraces([Msg(1, [("traceparent", TP.encode())]), Msg(2, [])])
        create = CreateCommand(
            tenant="acme", schedule_id="s", callback=CALLBACK, misfire_tolerance_s=60
        )
        child = traces.stamp(create_decision("s"), create, Msg(1, []))
        root = traces.stamp(create_decision("s"), create, Msg(2, []))
        traces.close()
        assert child.change is not None and root.change is not None
        stored = child.change.row.traceparent
        assert stored is not None and stored != TP
        assert parse_traceparent(stored) == stored and stored[3:35] == TRACE_ID
        # Tracing on, a command without a context starts a trace of its own.
        assert root.change.row.traceparent is not None
        assert root.change.row.traceparent[3:35] != TRACE_ID

        trigger = trigger_for(child.change.row, emitted_ms=1)
        emitted = emit_span(trigger, 0)
        assert emitted.traceparent is not None and emitted.traceparent[3:35] == TRACE_ID
        assert emitted.traceparent != stored
        untraced = trigger_for(create_decision("u").change.row, emitted_ms=1)  # type: ignore[union-attr]
        assert emit_span(untraced, 0) is untraced  # no context, no span
    finally:
        tracing.configure("unit", {})
    assert not tracing.enabled()


@pytest.mark.parametrize(
    ("env", "exporter", "url"),
    [
        ({}, None, None),  # off by default
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "otlp", "http://c:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/t"}, "otlp", "http://c/t"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console", None),
        ({"OTEL_TRACES_EXPORTER": "zipkin,otlp"}, "otlp", None),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, None, None),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, None, None),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, None, None),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(
    env: dict[str, str], exporter: str | None, url: str | None
) -> None:
    from base.tracing import TracingConfig

    config = TracingConfig.from_env(env)
    assert config.exporter == exporter
    if exporter is not None:
        assert config.traces_url == url


async def test_a_kafka_callback_record_carries_the_triggers_context() -> None:
    from proxy.kafka_sender import KafkaSender
    from tests.unit.test_proxy_kafka_sender import FakeProducer

    producer = FakeProducer()
    env = Envelope(
        topic="fires",
        partition=0,
        offset=0,
        key=b"s1",
        value=orjson.dumps(
            {
                "trigger_id": "t1",
                "schedule_id": "s1",
                "tenant": "acme",
                "due_ms": 5,
                "emitted_ms": 6,
                "attempt": 1,
                "order_key": "s1",
                "payload": {"n": 1},
                "callback": {"type": "kafka", "topic": "sink"},
            }
        ),
        headers=[("traceparent", TP.encode()), ("tracestate", b"a=1")],
        timestamp_ms=None,
        read_s=0.0,
    )
    prepare_fire(env, decode_trigger)
    await KafkaSender(producer, own_topics=frozenset(), ack_timeout_s=5).send(env)  # type: ignore[arg-type]
    (record,) = producer.produced
    assert ("traceparent", TP) in record.headers and ("tracestate", "a=1") in record.headers


def test_a_recurring_schedules_runs_carry_its_context() -> None:
    from streams.decisions import run_bucket

    parent = create_decision("r").change.row  # type: ignore[union-attr]
    traced = run_bucket(
        dataclasses.replace(parent, traceparent=TP, tracestate="a=1"),
        1_900_000_000_000,
        1_900_000_000_000,
        60,
        4,
    )
    assert (traced.traceparent, traced.tracestate) == (TP, "a=1")
    assert trigger_for(traced, emitted_ms=1).traceparent == TP
    assert run_bucket(parent, 1_900_000_000_000, 1_900_000_000_000, 60, 4).traceparent is None

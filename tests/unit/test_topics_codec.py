"""Encode/decode of results, triggers, commands and callbacks; the fires-topic headers."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from base.errors import CommandRejected
from topics.codec import (
    callback_from_dict,
    callback_from_json,
    callback_to_dict,
    callback_to_json,
    command_to_dict,
    decode_result,
    decode_trigger,
    encode_command,
    encode_result,
    encode_trigger,
    trigger_headers,
)
from topics.codes import Code
from topics.ids import trigger_id
from topics.models import (
    Callback,
    CancelCommand,
    Command,
    CommandResult,
    CommandType,
    CreateCommand,
    HttpCallback,
    KafkaCallback,
    PayloadType,
    ResultStatus,
    Trigger,
    UpdateCommand,
)
from topics.validation import Limits, canonical_json, decode_command

NOW = 1_795_280_400_000  # 2026-11-21T17:00:00Z
DUE = 1_893_517_205_000  # 2030-01-01T17:00:05Z
HTTP = HttpCallback(
    url="https://hooks.example.com/due",
    method="PATCH",
    headers={"X-B": "2", "Authorization": "Bearer t"},
    timeout_s=2.5,
)
KAFKA = KafkaCallback(topic="acme.out", key="k")
DROP = object()  # marks a field to leave out


def trigger(**fields: Any) -> Trigger:
    base: dict[str, Any] = {
        "trigger_id": trigger_id("acme", "s1", DUE),
        "schedule_id": "s1",
        "tenant": "acme",
        "due_ms": DUE,
        "emitted_ms": DUE + 12,
        "attempt": 1,
        "order_key": "customer-7",
        "payload": canonical_json({"order": 42, "items": ["a"]}),
        "payload_type": PayloadType.JSON,
        "callback": HTTP,
    }
    base.update(fields)
    return Trigger(**base)


TRIGGERS = {
    "json payload, http": trigger(),
    "json scalar payload": trigger(payload=b"null"),
    "bytes payload, kafka": trigger(
        payload=b"\x00\xff", payload_type=PayloadType.BYTES, callback=KAFKA
    ),
    "empty bytes, keyless kafka": trigger(
        payload=b"", payload_type=PayloadType.BYTES, callback=KafkaCallback(topic="t")
    ),
    "re-emission": trigger(attempt=3, emitted_ms=DUE + 60_000),
}


@pytest.mark.parametrize("value", TRIGGERS.values(), ids=TRIGGERS.keys())
def test_trigger_round_trip(value: Trigger) -> None:
    assert decode_trigger(encode_trigger(value)) == value


def test_trigger_json_shape() -> None:
    as_json = orjson.loads(encode_trigger(trigger()))
    assert as_json["payload"] == {"items": ["a"], "order": 42}
    assert "payload_b64" not in as_json
    assert as_json["callback"] == {
        "type": "http",
        "url": "https://hooks.example.com/due",
        "method": "PATCH",
        "headers": {"X-B": "2", "Authorization": "Bearer t"},
        "timeout_s": 2.5,
    }
    as_bytes = orjson.loads(encode_trigger(TRIGGERS["empty bytes, keyless kafka"]))
    assert as_bytes["payload_b64"] == ""
    assert "payload" not in as_bytes
    assert as_bytes["callback"] == {"type": "kafka", "topic": "t", "key": None}


def test_trigger_headers() -> None:
    assert trigger_headers(trigger()) == [
        ("tocsin-trigger-id", trigger_id("acme", "s1", DUE).encode()),
        ("tocsin-schedule-id", b"s1"),
        ("tocsin-tenant", b"acme"),
        ("tocsin-due-ms", b"1893517205000"),
    ]
    assert trigger_headers(trigger(schedule_id="é"))[1] == ("tocsin-schedule-id", "é".encode())


def test_decoders_ignore_unknown_fields() -> None:
    value = trigger()
    extended = orjson.loads(encode_trigger(value)) | {"future_field": [1]}
    assert decode_trigger(orjson.dumps(extended)) == value
    result = RESULTS["accepted"]
    extended = orjson.loads(encode_result(result)) | {"future_field": 1}
    assert decode_result(orjson.dumps(extended)) == result


def trigger_json(**changes: Any) -> bytes:
    obj = orjson.loads(encode_trigger(trigger()))
    obj.update(changes)
    return orjson.dumps({k: v for k, v in obj.items() if v is not DROP})


BAD_TRIGGERS: list[tuple[str, bytes, Code]] = [
    ("not JSON", b"{", Code.MALFORMED_JSON),
    ("not an object", b"[]", Code.NOT_AN_OBJECT),
    ("no payload at all", trigger_json(payload=DROP), Code.MISSING_FIELD),
    ("both payloads", trigger_json(payload_b64="AA=="), Code.INVALID_FIELD),
    ("bad base64", trigger_json(payload=DROP, payload_b64="*"), Code.INVALID_FIELD),
    ("no trigger_id", trigger_json(trigger_id=DROP), Code.MISSING_FIELD),
    ("empty schedule_id", trigger_json(schedule_id=""), Code.INVALID_FIELD),
    ("due_ms a string", trigger_json(due_ms="1"), Code.INVALID_FIELD),
    ("due_ms a boolean", trigger_json(due_ms=True), Code.INVALID_FIELD),
    ("attempt 0", trigger_json(attempt=0), Code.INVALID_FIELD),
    ("emitted_ms negative", trigger_json(emitted_ms=-1), Code.INVALID_FIELD),
    ("no callback", trigger_json(callback=DROP), Code.MISSING_FIELD),
    (
        "callback url ftp",
        trigger_json(callback={"type": "http", "url": "ftp://x/"}),
        Code.INVALID_URL,
    ),
    ("callback type", trigger_json(callback={"type": "smtp"}), Code.INVALID_CALLBACK),
]


@pytest.mark.parametrize(
    ("raw", "code"), [c[1:] for c in BAD_TRIGGERS], ids=[c[0] for c in BAD_TRIGGERS]
)
def test_decode_trigger_rejects(raw: bytes, code: Code) -> None:
    with pytest.raises(CommandRejected) as caught:
        decode_trigger(raw)
    assert caught.value.code == code


def test_decode_trigger_trusts_the_schedulers_payload_limit() -> None:
    big = trigger(payload=b"x" * 200_000, payload_type=PayloadType.BYTES)
    assert decode_trigger(encode_trigger(big), limits=Limits(max_payload_bytes=10)) == big


RESULTS = {
    "accepted": CommandResult(
        schedule_id="s1",
        tenant="acme",
        request_id="r-1",
        command=CommandType.CREATE,
        status=ResultStatus.ACCEPTED,
        code=Code.OK,
        message="scheduled",
        at_ms=NOW,
        partition=3,
        offset=1187,
    ),
    "duplicate": CommandResult(
        schedule_id="s1",
        tenant="acme",
        request_id=None,
        command=CommandType.CREATE,
        status=ResultStatus.ACCEPTED,
        code=Code.DUPLICATE,
        message="",
        at_ms=NOW,
        partition=0,
        offset=0,
    ),
    "rejected unparseable": CommandResult(
        schedule_id=None,
        tenant=None,
        request_id=None,
        command=None,
        status=ResultStatus.REJECTED,
        code=Code.MALFORMED_JSON,
        message="message is not valid JSON: ... \u2028 é",
        at_ms=NOW,
        partition=7,
        offset=2**40,
    ),
}


@pytest.mark.parametrize("value", RESULTS.values(), ids=RESULTS.keys())
def test_result_round_trip(value: CommandResult) -> None:
    assert decode_result(encode_result(value)) == value


def test_result_json_shape() -> None:
    assert orjson.loads(encode_result(RESULTS["rejected unparseable"])) == {
        "schedule_id": None,
        "tenant": None,
        "request_id": None,
        "command": None,
        "status": "rejected",
        "code": "malformed_json",
        "message": "message is not valid JSON: ... \u2028 é",
        "at_ms": NOW,
        "partition": 7,
        "offset": 2**40,
    }


def result_json(**changes: Any) -> bytes:
    obj = orjson.loads(encode_result(RESULTS["accepted"]))
    obj.update(changes)
    return orjson.dumps({k: v for k, v in obj.items() if v is not DROP})


BAD_RESULTS: list[tuple[str, bytes, Code]] = [
    ("not JSON", b"nope", Code.MALFORMED_JSON),
    ("not an object", b"1", Code.NOT_AN_OBJECT),
    ("no status", result_json(status=DROP), Code.MISSING_FIELD),
    ("no request_id (null must be explicit)", result_json(request_id=DROP), Code.MISSING_FIELD),
    ("unknown status", result_json(status="maybe"), Code.INVALID_FIELD),
    ("unknown code", result_json(code="teapot"), Code.INVALID_FIELD),
    ("unknown command", result_json(command="delete"), Code.INVALID_FIELD),
    ("status contradicts code", result_json(code="conflict"), Code.INVALID_FIELD),
    ("offset negative", result_json(offset=-1), Code.INVALID_FIELD),
    ("at_ms a boolean", result_json(at_ms=False), Code.INVALID_FIELD),
    ("message null", result_json(message=None), Code.INVALID_FIELD),
    ("tenant a number", result_json(tenant=1), Code.INVALID_FIELD),
]


@pytest.mark.parametrize(
    ("raw", "code"), [c[1:] for c in BAD_RESULTS], ids=[c[0] for c in BAD_RESULTS]
)
def test_decode_result_rejects(raw: bytes, code: Code) -> None:
    with pytest.raises(CommandRejected) as caught:
        decode_result(raw)
    assert caught.value.code == code


def test_result_model_refuses_contradictions() -> None:
    with pytest.raises(ValueError):
        CommandResult(
            schedule_id="s1",
            tenant="acme",
            request_id=None,
            command=CommandType.CANCEL,
            status=ResultStatus.ACCEPTED,
            code=Code.NOT_FOUND,
            message="",
            at_ms=0,
            partition=0,
            offset=0,
        )


COMMANDS: dict[str, Command] = {
    "minimal create": CreateCommand(
        tenant="acme", schedule_id="s1", due_ms=DUE, callback=HTTP, misfire_tolerance_s=60
    ),
    "full create": CreateCommand(
        tenant="acme",
        schedule_id="s1",
        request_id="r",
        due_ms=DUE,
        payload=canonical_json({"z": 1, "a": [True, None]}),
        payload_type=PayloadType.JSON,
        callback=KAFKA,
        order_key="o",
        misfire_tolerance_s=0,
    ),
    "bytes create": CreateCommand(
        tenant="acme",
        schedule_id="s1",
        due_ms=DUE,
        payload=b"\x00\x01",
        payload_type=PayloadType.BYTES,
        callback=KafkaCallback(topic="t"),
        misfire_tolerance_s=3600,
    ),
    "update due": UpdateCommand(tenant="acme", schedule_id="s1", due_ms=DUE),
    "update all": UpdateCommand(
        tenant="acme",
        schedule_id="s1",
        request_id="r",
        due_ms=DUE,
        payload=b"",
        payload_type=PayloadType.BYTES,
        callback=HTTP,
    ),
    "update payload to JSON": UpdateCommand(
        tenant="acme", schedule_id="s1", payload=b'"x"', payload_type=PayloadType.JSON
    ),
    "cancel": CancelCommand(tenant="acme", schedule_id="s1"),
    "cancel with request id": CancelCommand(tenant="acme", schedule_id="s1", request_id="r"),
}


@pytest.mark.parametrize("value", COMMANDS.values(), ids=COMMANDS.keys())
def test_command_round_trip(value: Command) -> None:
    raw = encode_command(value)
    decoded = decode_command(
        raw,
        key=value.schedule_id.encode(),
        now_ms=NOW,
        limits=Limits(default_misfire_tolerance_s=1),
    )
    assert decoded == value


def test_command_to_dict_leaves_defaults_out() -> None:
    assert command_to_dict(COMMANDS["cancel"]) == {
        "type": "cancel",
        "tenant": "acme",
        "schedule_id": "s1",
    }
    minimal = command_to_dict(COMMANDS["minimal create"])
    assert "order_key" not in minimal and "payload_b64" not in minimal
    assert "request_id" not in minimal


def test_model_defaults_and_guards() -> None:
    command = CreateCommand(
        tenant="acme", schedule_id="s1", due_ms=DUE, callback=HTTP, misfire_tolerance_s=1
    )
    assert command.order_key == "s1"
    assert (command.payload, command.payload_type) == (b"", PayloadType.BYTES)
    assert command.type is CommandType.CREATE
    assert HttpCallback(url="https://h/") == HttpCallback(
        url="https://h/", method="POST", headers={}, timeout_s=10.0
    )
    with pytest.raises(CommandRejected) as caught:
        UpdateCommand(tenant="acme", schedule_id="s1")
    assert caught.value.code == Code.NOTHING_TO_UPDATE
    with pytest.raises(CommandRejected) as caught:
        UpdateCommand(tenant="acme", schedule_id="s1", payload=b"x")
    assert caught.value.code == Code.INVALID_FIELD


@pytest.mark.parametrize(
    "value", [HTTP, KAFKA, KafkaCallback(topic="t"), HttpCallback(url="http://h")]
)
def test_callback_round_trips(value: Callback) -> None:
    assert callback_from_dict(callback_to_dict(value)) == value
    assert callback_from_json(callback_to_json(value)) == value
    assert callback_from_json(callback_to_json(value).encode()) == value


def test_callback_json_is_deterministic() -> None:
    reordered = HttpCallback(
        url=HTTP.url,
        method=HTTP.method,
        headers={"Authorization": "Bearer t", "X-B": "2"},
        timeout_s=HTTP.timeout_s,
    )
    assert callback_to_json(reordered) == callback_to_json(HTTP)
    assert callback_to_json(KAFKA) == '{"key":"k","topic":"acme.out","type":"kafka"}'


def test_callback_from_json_rejects() -> None:
    with pytest.raises(CommandRejected) as caught:
        callback_from_json("{")
    assert caught.value.code == Code.MALFORMED_JSON
    with pytest.raises(CommandRejected) as caught:
        callback_from_json('{"type": "kafka", "topic": ".."}')
    assert caught.value.code == Code.INVALID_CALLBACK

"""decode_command and salvage_ids: every rejection code from bytes, and what is accepted."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from base.errors import CommandRejected, ConfigError
from base.settings import SchedulerSettings
from topics.codec import callback_from_dict
from topics.codes import STATEFUL_CODES, Code
from topics.fields import ENVELOPE_BYTES, check_not_past
from topics.ids import parse_iso_ms
from topics.models import (
    CancelCommand,
    CommandType,
    CreateCommand,
    HttpCallback,
    KafkaCallback,
    PayloadType,
    UpdateCommand,
)
from topics.validation import Limits, Salvaged, decode_command, salvage_ids

NOW = parse_iso_ms("2026-11-21T17:00:00Z")
DUE = parse_iso_ms("2030-01-01T17:00:05Z")
LIMITS = Limits()
DROP = object()  # marks a field to leave out
HTTP = {"type": "http", "url": "https://hooks.example.com/due"}


def create(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "type": "create",
        "tenant": "acme",
        "schedule_id": "s1",
        "due": DUE,
        "callback": HTTP,
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def update(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "update", "tenant": "acme", "schedule_id": "s1"}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def cancel(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "cancel", "tenant": "acme", "schedule_id": "s1"}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def http(**fields: Any) -> dict[str, Any]:
    base = dict(HTTP)
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def kafka(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"type": "kafka", "topic": "acme.out"}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def encode(value: object) -> bytes:
    return value if isinstance(value, bytes) else orjson.dumps(value)


def decode(value: object, key: bytes | None = b"s1", limits: Limits = LIMITS) -> Any:
    return decode_command(encode(value), key=key, now_ms=NOW, limits=limits)


def with_raw(obj: dict[str, Any], field: str, raw_json: bytes) -> bytes:
    """``obj`` with ``field`` set to JSON text orjson itself could not produce."""
    return orjson.dumps(obj)[:-1] + b',"' + field.encode() + b'":' + raw_json + b"}"


many_headers = {f"X-H{i}": "v" for i in range(33)}
big_headers = {"X-Big": "v" * (8 * 1024)}

# (name, message, key, code, a fragment the human message must contain)
REJECTIONS: list[tuple[str, object, bytes | None, Code, str]] = [
    ("whole message over the cap", b" " * (LIMITS.message_cap + 1), b"s1", Code.TOO_LARGE, "bytes"),
    ("truncated JSON", b'{"type": "create"', b"s1", Code.MALFORMED_JSON, "not valid JSON"),
    ("empty value", b"", b"s1", Code.MALFORMED_JSON, "not valid JSON"),
    ("invalid UTF-8", b'{"type": "\xff"}', b"s1", Code.MALFORMED_JSON, "not valid JSON"),
    ("byte order mark", b'\xef\xbb\xbf{"type": "cancel"}', None, Code.MALFORMED_JSON, "BOM"),
    ("NaN", b'{"due": NaN}', None, Code.MALFORMED_JSON, "not valid JSON"),
    ("lone surrogate escape", b'{"tenant": "\\ud800"}', None, Code.MALFORMED_JSON, "surrogate"),
    (
        "nesting beyond 1024",
        b'{"x":' + b"[" * 1100 + b"]" * 1100 + b"}",
        b"s1",
        Code.MALFORMED_JSON,
        "depth",
    ),
    ("array", b"[1, 2]", None, Code.NOT_AN_OBJECT, "an array"),
    ("string", b'"create"', None, Code.NOT_AN_OBJECT, "a string"),
    ("null", b"null", None, Code.NOT_AN_OBJECT, "null"),
    ("no type", cancel(type=DROP), b"s1", Code.MISSING_FIELD, "'type'"),
    ("type delete", cancel(type="delete"), b"s1", Code.UNKNOWN_COMMAND_TYPE, "'delete'"),
    ("type in capitals", cancel(type="Cancel"), b"s1", Code.UNKNOWN_COMMAND_TYPE, "'Cancel'"),
    ("type a number", cancel(type=3), b"s1", Code.UNKNOWN_COMMAND_TYPE, "3"),
    ("type a list", cancel(type=["cancel"]), b"s1", Code.UNKNOWN_COMMAND_TYPE, "cancel"),
    ("create without tenant", create(tenant=DROP), b"s1", Code.MISSING_FIELD, "'tenant'"),
    (
        "cancel without schedule_id",
        cancel(schedule_id=DROP),
        b"s1",
        Code.MISSING_FIELD,
        "'schedule_id'",
    ),
    ("create without due", create(due=DROP), b"s1", Code.MISSING_FIELD, "'due'"),
    ("create without callback", create(callback=DROP), b"s1", Code.MISSING_FIELD, "'callback'"),
    ("unknown field", create(paylod={}), b"s1", Code.INVALID_FIELD, "'paylod'"),
    (
        "order_key on update",
        update(due=DUE, order_key="x"),
        b"s1",
        Code.INVALID_FIELD,
        "'order_key'",
    ),
    ("due on cancel", cancel(due=DUE), b"s1", Code.INVALID_FIELD, "'due'"),
    ("tenant with a space", create(tenant="ac me"), b"s1", Code.INVALID_FIELD, "tenant"),
    ("tenant of 65 characters", create(tenant="a" * 65), b"s1", Code.INVALID_FIELD, "tenant"),
    ("tenant empty", create(tenant=""), b"s1", Code.INVALID_FIELD, "tenant"),
    ("tenant a number", create(tenant=7), b"s1", Code.INVALID_FIELD, "tenant must be a string"),
    ("tenant non-ASCII", create(tenant="acmé"), b"s1", Code.INVALID_FIELD, "tenant"),
    (
        "schedule_id empty",
        create(schedule_id=""),
        b"",
        Code.INVALID_FIELD,
        "schedule_id must not be empty",
    ),
    (
        "schedule_id a number",
        create(schedule_id=1),
        b"1",
        Code.INVALID_FIELD,
        "schedule_id must be a string",
    ),
    ("schedule_id null", create(schedule_id=None), None, Code.INVALID_FIELD, "got null"),
    (
        "schedule_id with NUL",
        create(schedule_id="a\x00b"),
        None,
        Code.INVALID_FIELD,
        "U+0000 at index 1",
    ),
    ("schedule_id with newline", create(schedule_id="a\nb"), None, Code.INVALID_FIELD, "U+000A"),
    (
        "schedule_id with C1 control",
        create(schedule_id="a\x85"),
        None,
        Code.INVALID_FIELD,
        "U+0085",
    ),
    (
        "schedule_id with bidi override",
        create(schedule_id="a\u202eb"),
        None,
        Code.INVALID_FIELD,
        "U+202E",
    ),
    (
        "schedule_id with line separator",
        create(schedule_id="a\u2028"),
        None,
        Code.INVALID_FIELD,
        "U+2028",
    ),
    (
        "schedule_id of 257 bytes",
        create(schedule_id="é" * 128 + "a"),
        None,
        Code.INVALID_FIELD,
        "257 bytes",
    ),
    ("request_id empty", create(request_id=""), b"s1", Code.INVALID_FIELD, "request_id"),
    ("request_id a number", create(request_id=5), b"s1", Code.INVALID_FIELD, "request_id"),
    ("order_key empty", create(order_key=""), b"s1", Code.INVALID_FIELD, "order_key"),
    ("order_key null", create(order_key=None), b"s1", Code.INVALID_FIELD, "order_key"),
    (
        "misfire_tolerance_s a boolean",
        create(misfire_tolerance_s=True),
        b"s1",
        Code.INVALID_FIELD,
        "misfire_tolerance_s",
    ),
    (
        "misfire_tolerance_s negative",
        create(misfire_tolerance_s=-1),
        b"s1",
        Code.INVALID_FIELD,
        "misfire_tolerance_s",
    ),
    (
        "misfire_tolerance_s fractional",
        create(misfire_tolerance_s=1.5),
        b"s1",
        Code.INVALID_FIELD,
        "misfire_tolerance_s",
    ),
    (
        "misfire_tolerance_s beyond int32",
        create(misfire_tolerance_s=2**31),
        b"s1",
        Code.INVALID_FIELD,
        "misfire_tolerance_s",
    ),
    (
        "misfire_tolerance_s a string",
        create(misfire_tolerance_s="60"),
        b"s1",
        Code.INVALID_FIELD,
        "misfire_tolerance_s",
    ),
    (
        "payload and payload_b64",
        create(payload=1, payload_b64="AA=="),
        b"s1",
        Code.INVALID_FIELD,
        "not both",
    ),
    ("payload_b64 a number", create(payload_b64=12), b"s1", Code.INVALID_FIELD, "payload_b64"),
    (
        "payload_b64 bad alphabet",
        create(payload_b64="a*b="),
        b"s1",
        Code.INVALID_FIELD,
        "payload_b64",
    ),
    (
        "payload_b64 bad padding",
        create(payload_b64="abc"),
        b"s1",
        Code.INVALID_FIELD,
        "payload_b64",
    ),
    (
        "payload_b64 url-safe alphabet",
        create(payload_b64="-_-_"),
        b"s1",
        Code.INVALID_FIELD,
        "payload_b64",
    ),
    ("payload_b64 non-ASCII", create(payload_b64="é"), b"s1", Code.INVALID_FIELD, "payload_b64"),
    (
        "payload nested 300 deep",
        with_raw(create(), "payload", b"[" * 300 + b"]" * 300),
        b"s1",
        Code.INVALID_FIELD,
        "254 levels",
    ),
    (
        "due without offset",
        create(due="2030-01-01T17:00:05"),
        b"s1",
        Code.INVALID_DUE,
        "explicit offset",
    ),
    ("due a date", create(due="2030-01-01"), b"s1", Code.INVALID_DUE, "explicit offset"),
    (
        "due with a space",
        create(due="2030-01-01 17:00:05Z"),
        b"s1",
        Code.INVALID_DUE,
        "explicit offset",
    ),
    (
        "due without seconds",
        create(due="2030-01-01T17:00Z"),
        b"s1",
        Code.INVALID_DUE,
        "explicit offset",
    ),
    (
        "due with Unicode digits",
        create(due="\uff12\uff10\uff13\uff10-01-01T17:00:05Z"),
        b"s1",
        Code.INVALID_DUE,
        "explicit offset",
    ),
    (
        "due on 30 February",
        create(due="2030-02-30T17:00:05Z"),
        b"s1",
        Code.INVALID_DUE,
        "not a real date",
    ),
    (
        "due at a leap second",
        create(due="2030-06-30T23:59:60Z"),
        b"s1",
        Code.INVALID_DUE,
        "not a real date",
    ),
    (
        "due with offset 24:00",
        create(due="2030-01-01T17:00:05+24:00"),
        b"s1",
        Code.INVALID_DUE,
        "offset",
    ),
    ("due a boolean", create(due=True), b"s1", Code.INVALID_DUE, "a boolean"),
    ("due null", create(due=None), b"s1", Code.INVALID_DUE, "got null"),
    ("due an object", create(due={"ms": DUE}), b"s1", Code.INVALID_DUE, "an object"),
    ("due fractional ms", create(due=DUE + 0.5), b"s1", Code.INVALID_DUE, "must be an integer"),
    ("due a numeric string", create(due=str(DUE)), b"s1", Code.INVALID_DUE, "explicit offset"),
    ("due negative", create(due=-1), b"s1", Code.INVALID_DUE, "outside"),
    ("due after year 9999", create(due=253_402_300_800_000), b"s1", Code.INVALID_DUE, "outside"),
    (
        "due beyond 64 bits",
        b'{"type":"update","tenant":"acme","schedule_id":"s1","due":1' + b"0" * 30 + b"}",
        b"s1",
        Code.INVALID_DUE,
        "outside",
    ),
    (
        "due before 1970 as ISO",
        create(due="1969-12-31T23:59:59Z"),
        b"s1",
        Code.INVALID_DUE,
        "outside",
    ),
    (
        "due in seconds by mistake",
        create(due=1_893_517_205),
        b"s1",
        Code.DUE_IN_PAST,
        "misfire_tolerance_s=3600",
    ),
    (
        "due beyond the tolerance",
        create(due=NOW - 3_600_001),
        b"s1",
        Code.DUE_IN_PAST,
        "2026-11-21T15:59:59.999Z",
    ),
    (
        "due past with tolerance 0",
        create(due=NOW - 1, misfire_tolerance_s=0),
        b"s1",
        Code.DUE_IN_PAST,
        "misfire_tolerance_s=0",
    ),
    (
        "JSON payload too large",
        create(payload="x" * (64 * 1024 - 1)),
        b"s1",
        Code.PAYLOAD_TOO_LARGE,
        "65537 bytes",
    ),
    (
        "bytes payload too large",
        create(payload_b64="A" * (((64 * 1024 + 1) // 3 + 1) * 4)),
        b"s1",
        Code.PAYLOAD_TOO_LARGE,
        "payload_b64",
    ),
    ("ftp URL", create(callback=http(url="ftp://h/x")), b"s1", Code.INVALID_URL, "http or https"),
    (
        "javascript URL",
        create(callback=http(url="javascript:alert(1)")),
        b"s1",
        Code.INVALID_URL,
        "http or https",
    ),
    ("relative URL", create(callback=http(url="/due")), b"s1", Code.INVALID_URL, "http or https"),
    (
        "URL without host",
        create(callback=http(url="http:///due")),
        b"s1",
        Code.INVALID_URL,
        "no host",
    ),
    (
        "URL with only a port",
        create(callback=http(url="http://:80/")),
        b"s1",
        Code.INVALID_URL,
        "no host",
    ),
    (
        "URL with credentials",
        create(callback=http(url="https://u:p@h/x")),
        b"s1",
        Code.INVALID_URL,
        "user info",
    ),
    (
        "URL with a space",
        create(callback=http(url="https://h/a b")),
        b"s1",
        Code.INVALID_URL,
        "printable ASCII",
    ),
    (
        "URL with a tab",
        create(callback=http(url="https://h/a\tb")),
        b"s1",
        Code.INVALID_URL,
        "printable ASCII",
    ),
    (
        "URL non-ASCII",
        create(callback=http(url="https://bücher.de/")),
        b"s1",
        Code.INVALID_URL,
        "punycode",
    ),
    ("URL empty", create(callback=http(url="")), b"s1", Code.INVALID_URL, "printable ASCII"),
    (
        "URL too long",
        create(callback=http(url="https://h/" + "a" * 2048)),
        b"s1",
        Code.INVALID_URL,
        "at most 2048",
    ),
    (
        "URL port out of range",
        create(callback=http(url="https://h:99999/")),
        b"s1",
        Code.INVALID_URL,
        "Port out of range",
    ),
    ("URL port 0", create(callback=http(url="https://h:0/")), b"s1", Code.INVALID_URL, "port 0"),
    (
        "URL broken IPv6",
        create(callback=http(url="https://[::1/")),
        b"s1",
        Code.INVALID_URL,
        "IPv6",
    ),
    (
        "URL IPv6 brackets not an address",
        create(callback=http(url="https://[zz]/")),
        b"s1",
        Code.INVALID_URL,
        "IPv6",
    ),
    (
        "URL host with percent",
        create(callback=http(url="https://h%41/")),
        b"s1",
        Code.INVALID_URL,
        "host name",
    ),
    ("URL a number", create(callback=http(url=5)), b"s1", Code.INVALID_URL, "must be a string"),
    (
        "callback a string",
        create(callback="https://h/x"),
        b"s1",
        Code.INVALID_CALLBACK,
        "must be an object",
    ),
    (
        "callback without type",
        create(callback=http(type=DROP)),
        b"s1",
        Code.INVALID_CALLBACK,
        "'type'",
    ),
    (
        "callback type smtp",
        create(callback=http(type="smtp")),
        b"s1",
        Code.INVALID_CALLBACK,
        "'smtp'",
    ),
    (
        "callback type a list",
        create(callback=http(type=["http"])),
        b"s1",
        Code.INVALID_CALLBACK,
        "callback.type",
    ),
    (
        "http callback without url",
        create(callback=http(url=DROP)),
        b"s1",
        Code.INVALID_CALLBACK,
        "'url'",
    ),
    (
        "http callback unknown field",
        create(callback=http(retries=3)),
        b"s1",
        Code.INVALID_CALLBACK,
        "'retries'",
    ),
    (
        "method lower case",
        create(callback=http(method="post")),
        b"s1",
        Code.INVALID_CALLBACK,
        "callback.method",
    ),
    (
        "method TRACE",
        create(callback=http(method="TRACE")),
        b"s1",
        Code.INVALID_CALLBACK,
        "DELETE, GET, PATCH, POST, PUT",
    ),
    (
        "headers a list",
        create(callback=http(headers=[["a", "b"]])),
        b"s1",
        Code.INVALID_CALLBACK,
        "callback.headers",
    ),
    (
        "header value a number",
        create(callback=http(headers={"X-N": 1})),
        b"s1",
        Code.INVALID_CALLBACK,
        "must be a string",
    ),
    (
        "header name with a space",
        create(callback=http(headers={"X N": "1"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "header name",
    ),
    (
        "header name empty",
        create(callback=http(headers={"": "1"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "header name",
    ),
    (
        "header value with CRLF",
        create(callback=http(headers={"X-A": "1\r\nX-B: 2"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "printable ASCII",
    ),
    (
        "header value non-ASCII",
        create(callback=http(headers={"X-A": "caf\u00e9"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "printable ASCII",
    ),
    (
        "Host header",
        create(callback=http(headers={"Host": "evil"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "not allowed",
    ),
    (
        "Content-Length header",
        create(callback=http(headers={"content-length": "1"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "not allowed",
    ),
    (
        "header twice by case",
        create(callback=http(headers={"X-A": "1", "x-a": "2"})),
        b"s1",
        Code.INVALID_CALLBACK,
        "twice",
    ),
    (
        "33 headers",
        create(callback=http(headers=many_headers)),
        b"s1",
        Code.INVALID_CALLBACK,
        "at most 32",
    ),
    (
        "headers over 8 KiB",
        create(callback=http(headers=big_headers)),
        b"s1",
        Code.INVALID_CALLBACK,
        "at most 8192",
    ),
    ("timeout 0", create(callback=http(timeout_s=0)), b"s1", Code.INVALID_CALLBACK, "timeout_s"),
    (
        "timeout negative",
        create(callback=http(timeout_s=-1)),
        b"s1",
        Code.INVALID_CALLBACK,
        "timeout_s",
    ),
    (
        "timeout over 300",
        create(callback=http(timeout_s=300.5)),
        b"s1",
        Code.INVALID_CALLBACK,
        "timeout_s",
    ),
    (
        "timeout a boolean",
        create(callback=http(timeout_s=True)),
        b"s1",
        Code.INVALID_CALLBACK,
        "timeout_s",
    ),
    (
        "timeout a string",
        create(callback=http(timeout_s="10")),
        b"s1",
        Code.INVALID_CALLBACK,
        "timeout_s",
    ),
    (
        "kafka callback without topic",
        create(callback=kafka(topic=DROP)),
        b"s1",
        Code.INVALID_CALLBACK,
        "'topic'",
    ),
    (
        "kafka topic '..'",
        create(callback=kafka(topic="..")),
        b"s1",
        Code.INVALID_CALLBACK,
        "legal Kafka topic",
    ),
    (
        "kafka topic with a slash",
        create(callback=kafka(topic="a/b")),
        b"s1",
        Code.INVALID_CALLBACK,
        "legal Kafka topic",
    ),
    (
        "kafka topic of 250 characters",
        create(callback=kafka(topic="t" * 250)),
        b"s1",
        Code.INVALID_CALLBACK,
        "legal Kafka topic",
    ),
    (
        "kafka topic empty",
        create(callback=kafka(topic="")),
        b"s1",
        Code.INVALID_CALLBACK,
        "legal Kafka topic",
    ),
    (
        "kafka key empty",
        create(callback=kafka(key="")),
        b"s1",
        Code.INVALID_CALLBACK,
        "callback.key",
    ),
    (
        "kafka key a number",
        create(callback=kafka(key=1)),
        b"s1",
        Code.INVALID_CALLBACK,
        "callback.key",
    ),
    (
        "kafka callback unknown field",
        create(callback=kafka(partition=1)),
        b"s1",
        Code.INVALID_CALLBACK,
        "'partition'",
    ),
    ("key of another schedule", cancel(), b"s2", Code.KEY_MISMATCH, "differs from schedule_id"),
    ("empty key", cancel(), b"", Code.KEY_MISMATCH, "differs from schedule_id"),
    ("key not UTF-8", cancel(), b"\xff", Code.KEY_MISMATCH, "differs from schedule_id"),
    ("update with nothing", update(), b"s1", Code.NOTHING_TO_UPDATE, "at least one of"),
    (
        "update with only a request_id",
        update(request_id="r"),
        b"s1",
        Code.NOTHING_TO_UPDATE,
        "at least one of",
    ),
]


@pytest.mark.parametrize(
    ("message", "key", "code", "fragment"),
    [case[1:] for case in REJECTIONS],
    ids=[case[0] for case in REJECTIONS],
)
def test_rejections(message: object, key: bytes | None, code: Code, fragment: str) -> None:
    with pytest.raises(CommandRejected) as caught:
        decode(message, key=key)
    assert caught.value.code == code, caught.value.message
    assert fragment in caught.value.message


def test_every_stateless_code_is_reachable_from_bytes() -> None:
    reached = {case[3] for case in REJECTIONS}
    assert reached == set(Code) - STATEFUL_CODES - {Code.OK}


# (name, message, key, expected command)
ACCEPTED: list[tuple[str, object, bytes | None, object]] = [
    (
        "minimal create",
        create(),
        b"s1",
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            due_ms=DUE,
            payload=b"",
            payload_type=PayloadType.BYTES,
            callback=HttpCallback(url="https://hooks.example.com/due"),
            order_key="s1",
            misfire_tolerance_s=3600,
        ),
    ),
    (
        "full create",
        create(
            request_id="r-1",
            due="2030-01-01T18:00:05.123456789+01:00",
            payload={"b": [1, 2.5, None], "a": "é"},
            callback=http(
                url="HTTPS://[2606:4700::1111]:8443/p?q=1#f",
                method="PUT",
                headers={"Authorization": "Bearer x", "X-Tab": "a\tb"},
                timeout_s=300,
            ),
            order_key="customer-7",
            misfire_tolerance_s=0,
        ),
        b"s1",
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            request_id="r-1",
            due_ms=DUE + 123,
            payload='{"a":"é","b":[1,2.5,null]}'.encode(),
            payload_type=PayloadType.JSON,
            callback=HttpCallback(
                url="HTTPS://[2606:4700::1111]:8443/p?q=1#f",
                method="PUT",
                headers={"Authorization": "Bearer x", "X-Tab": "a\tb"},
                timeout_s=300.0,
            ),
            order_key="customer-7",
            misfire_tolerance_s=0,
        ),
    ),
    (
        "create with a null JSON payload and no key",
        create(payload=None, request_id=None, callback=kafka()),
        None,
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            due_ms=DUE,
            payload=b"null",
            payload_type=PayloadType.JSON,
            callback=KafkaCallback(topic="acme.out"),
            misfire_tolerance_s=3600,
        ),
    ),
    (
        "create with bytes to Kafka, lower-case t and z, integral float tolerance",
        create(
            due="2030-01-01t17:00:05z",
            payload_b64="AAEC/w==",
            callback=kafka(topic="a-b_c.D", key="k 1"),
            misfire_tolerance_s=60.0,
        ),
        b"s1",
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            due_ms=DUE,
            payload=b"\x00\x01\x02\xff",
            payload_type=PayloadType.BYTES,
            callback=KafkaCallback(topic="a-b_c.D", key="k 1"),
            misfire_tolerance_s=60,
        ),
    ),
    (
        "due exactly at the tolerance edge, as an integral float",
        create(due=float(NOW - 3_600_000)),
        b"s1",
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            due_ms=NOW - 3_600_000,
            callback=HttpCallback(url="https://hooks.example.com/due"),
            misfire_tolerance_s=3600,
        ),
    ),
    (
        "Unicode ids at the length limit",
        create(tenant="a.B_c-9" + "x" * 57, schedule_id="é" * 128, order_key="🔔" * 64),
        ("é" * 128).encode(),
        CreateCommand(
            tenant="a.B_c-9" + "x" * 57,
            schedule_id="é" * 128,
            due_ms=DUE,
            callback=HttpCallback(url="https://hooks.example.com/due"),
            order_key="🔔" * 64,
            misfire_tolerance_s=3600,
        ),
    ),
    (
        "update of due only; a past due is the scheduler's call",
        update(due=1000),
        b"s1",
        UpdateCommand(tenant="acme", schedule_id="s1", due_ms=1000),
    ),
    (
        "update of an empty bytes payload",
        update(payload_b64="", request_id="r"),
        b"s1",
        UpdateCommand(
            tenant="acme",
            schedule_id="s1",
            request_id="r",
            payload=b"",
            payload_type=PayloadType.BYTES,
        ),
    ),
    (
        "update of the payload to JSON false",
        update(payload=False),
        b"s1",
        UpdateCommand(
            tenant="acme", schedule_id="s1", payload=b"false", payload_type=PayloadType.JSON
        ),
    ),
    (
        "update of the callback",
        update(callback=http(url="http://svc_1.internal./x", method="DELETE")),
        b"s1",
        UpdateCommand(
            tenant="acme",
            schedule_id="s1",
            callback=HttpCallback(url="http://svc_1.internal./x", method="DELETE"),
        ),
    ),
    (
        "cancel",
        cancel(request_id="r-3"),
        b"s1",
        CancelCommand(tenant="acme", schedule_id="s1", request_id="r-3"),
    ),
    (
        "whitespace around the object",
        b' \n{"type":"cancel","tenant":"t","schedule_id":"s1"}\n',
        b"s1",
        CancelCommand(tenant="t", schedule_id="s1"),
    ),
]


@pytest.mark.parametrize(
    ("message", "key", "expected"),
    [case[1:] for case in ACCEPTED],
    ids=[case[0] for case in ACCEPTED],
)
def test_accepted(message: object, key: bytes | None, expected: object) -> None:
    assert decode(message, key=key) == expected


def test_payload_at_the_limit_is_accepted_in_both_forms() -> None:
    limits = Limits(max_payload_bytes=1000)
    as_json = decode(create(payload="x" * 998), limits=limits)  # 998 + 2 quotes
    assert len(as_json.payload) == 1000
    raw = bytes(range(256)) * 3 + bytes(232)
    as_b64 = decode(create(payload_b64=base64.b64encode(raw).decode()), limits=limits)
    assert as_b64.payload == raw


def test_a_maximal_bytes_payload_fits_the_default_message_cap() -> None:
    raw = b"\xff" * LIMITS.max_payload_bytes
    message = orjson.dumps(create(payload_b64=base64.b64encode(raw).decode()))
    assert len(message) <= LIMITS.message_cap
    assert decode(message).payload == raw


def test_duplicate_keys_keep_the_last() -> None:
    message = b'{"type":"cancel","tenant":"acme","schedule_id":"x","schedule_id":"s1"}'
    assert decode(message) == CancelCommand(tenant="acme", schedule_id="s1")


def test_limits() -> None:
    assert Limits().message_cap == 87_384 + ENVELOPE_BYTES
    assert Limits(max_message_bytes=10).message_cap == 10
    settings = SchedulerSettings(max_payload_bytes=10, default_misfire_tolerance_s=5)
    assert Limits.from_settings(settings) == Limits(
        max_payload_bytes=10, default_misfire_tolerance_s=5
    )
    tiny = Limits(max_payload_bytes=3, default_misfire_tolerance_s=7)
    assert decode(create(), limits=tiny).misfire_tolerance_s == 7
    with pytest.raises(CommandRejected) as caught:
        decode(create(payload="abcd"), limits=tiny)
    assert caught.value.code == Code.PAYLOAD_TOO_LARGE
    for bad in (
        {"max_payload_bytes": 0},
        {"max_id_len": 0},
        {"max_headers": -1},
        {"default_misfire_tolerance_s": -1},
        {"max_message_bytes": 0},
    ):
        with pytest.raises(ConfigError):
            Limits(**bad)


INTERNAL_URLS = [
    "http://169.254.169.254/x",  # link-local: cloud metadata
    "http://10.0.0.1/",
    "http://[::1]/",
    "http://[64:ff9b::a00:1]/",  # NAT64 form of 10.0.0.1
    "https://127.0.0.1:8443/cb",
    "http://[::ffff:192.168.1.1]/",
    "http://0.0.0.0/",
    # Numeric forms the resolver's inet_aton reads as IPv4 (127.0.0.1, 10.0.0.1).
    "http://2130706433/",
    "http://0x7f000001/",
    "http://0177.0.0.1/",
    "http://127.1/",
    "http://10.1/",
]


@pytest.mark.parametrize("url", INTERNAL_URLS)
def test_a_callback_to_an_internal_ip_literal_is_rejected_at_once(url: str) -> None:
    for message in (create(callback=http(url=url)), update(callback=http(url=url))):
        with pytest.raises(CommandRejected) as caught:
            decode(message)
        assert caught.value.code == Code.INVALID_URL
        assert "TOCSIN_ALLOW_PRIVATE_TARGETS" in caught.value.message


@pytest.mark.parametrize(
    "url",
    [
        "http://93.184.216.34/cb",
        "http://134744072/cb",  # 8.8.8.8 in decimal
        "https://[2606:4700::1111]:8443/cb",
        "https://hooks.example.com/due",
        # A name is judged by the proxy once resolved, whatever it resolves to.
        "http://localhost:8080/cb",
    ],
)
def test_a_public_literal_or_a_host_name_passes(url: str) -> None:
    assert decode(create(callback=http(url=url))).callback == HttpCallback(url=url)


@pytest.mark.parametrize("url", INTERNAL_URLS)
def test_a_deployment_that_allows_private_targets_accepts_them(url: str) -> None:
    allowing = Limits(allow_private_targets=True)
    assert decode(create(callback=http(url=url)), limits=allowing).callback == HttpCallback(url=url)
    assert Limits.from_settings(SchedulerSettings(allow_private_targets=True)) == allowing


PROXY_HEADER_NAMES = [
    "Tocsin-Trigger-Id",
    "tocsin-trigger-id",
    "IDEMPOTENCY-KEY",
    "Tocsin-Signature",
    "Tocsin-Delivery-Attempt",
    "tocsin-some-future-header",
]


@pytest.mark.parametrize("name", PROXY_HEADER_NAMES)
def test_a_callback_naming_a_header_the_proxy_sets_is_rejected(name: str) -> None:
    headers = {"Authorization": "Bearer x", name: "forged"}
    for message in (create(callback=http(headers=headers)), update(callback=http(headers=headers))):
        with pytest.raises(CommandRejected) as caught:
            decode(message)
        assert caught.value.code == Code.INVALID_CALLBACK
        assert repr(name) in caught.value.message and "delivery proxy" in caught.value.message


def test_a_stored_callback_naming_a_proxy_header_still_decodes() -> None:
    # Schedules and triggers stored before the rule must keep firing: the proxy drops the
    # names from them instead.
    callback = http(headers={"Tocsin-Trigger-Id": "forged", "Idempotency-Key": "k"})
    assert callback_from_dict(callback) == HttpCallback(
        url=HTTP["url"], headers={"Tocsin-Trigger-Id": "forged", "Idempotency-Key": "k"}
    )


def test_headers_near_the_proxy_names_pass() -> None:
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "X-Tocsin-Id": "1"}
    assert decode(create(callback=http(headers=headers))).callback == HttpCallback(
        url=HTTP["url"], headers=headers
    )


def test_check_not_past_for_updates() -> None:
    check_not_past(NOW - 10_000, now_ms=NOW, misfire_tolerance_s=10)
    with pytest.raises(CommandRejected) as caught:
        check_not_past(NOW - 10_001, now_ms=NOW, misfire_tolerance_s=10)
    assert caught.value.code == Code.DUE_IN_PAST
    with pytest.raises(CommandRejected):
        check_not_past(-5, now_ms=NOW, misfire_tolerance_s=0)


SALVAGE: list[tuple[str, bytes, bytes | None, Salvaged]] = [
    ("nothing at all", b"\x00garbage", None, Salvaged(None, None, None, None)),
    ("garbage with a key", b"{not json", b"s1", Salvaged(None, "s1", None, None)),
    (
        "every id",
        b'{"type":"update","tenant":"acme","schedule_id":"s9","request_id":"r","due":"x"}',
        b"s1",
        Salvaged("acme", "s9", "r", CommandType.UPDATE),
    ),
    (
        "unusable values are dropped",
        orjson.dumps(
            {"type": "delete", "tenant": "a b", "schedule_id": "a\x00", "request_id": "r" * 300}
        ),
        b"k",
        Salvaged(None, "k", None, None),
    ),
    (
        "ids of the wrong type",
        b'{"type":1,"tenant":[],"schedule_id":{}}',
        None,
        Salvaged(None, None, None, None),
    ),
    ("an array", b'["acme"]', b"s1", Salvaged(None, "s1", None, None)),
    ("a key that is not UTF-8", b"[]", b"\xff\xfe", Salvaged(None, None, None, None)),
    ("an empty key", b"", b"", Salvaged(None, None, None, None)),
    (
        "too large but valid",
        orjson.dumps(cancel(pad="x" * 200_000)),
        None,
        Salvaged("acme", "s1", None, CommandType.CANCEL),
    ),
]


@pytest.mark.parametrize(
    ("raw", "key", "expected"),
    [case[1:] for case in SALVAGE],
    ids=[case[0] for case in SALVAGE],
)
def test_salvage_ids(raw: bytes, key: bytes | None, expected: Salvaged) -> None:
    assert salvage_ids(raw, key) == expected

"""Property tests: no input makes the decoders raise anything but CommandRejected, and
every valid model survives an encode/decode round trip unchanged."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import orjson
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from base.errors import CommandRejected
from topics.codec import (
    decode_result,
    decode_trigger,
    encode_command,
    encode_result,
    encode_trigger,
    trigger_headers,
)
from topics.codes import ACCEPTED_CODES, Code
from topics.ids import MAX_EPOCH_MS, trigger_id
from topics.models import (
    HTTP_METHODS,
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
from topics.validation import (
    COMMAND_FIELDS,
    Limits,
    canonical_json,
    decode_command,
    salvage_ids,
)

NOW = 1_795_280_400_000
# Shape tests: which callback addresses a deployment allows is test_topics_validation's.
LIMITS = Limits(max_payload_bytes=4096, allow_private_targets=True)
FIELD_NAMES = sorted({f for spec in COMMAND_FIELDS.values() for f in spec.allowed})
VALID: dict[str, Any] = {
    "type": "create",
    "tenant": "acme",
    "schedule_id": "s1",
    "request_id": "r",
    "due": "2030-01-01T17:00:05Z",
    "payload": {"a": [1, 2]},
    "callback": {
        "type": "http",
        "url": "https://h.example/x",
        "method": "POST",
        "headers": {"X-A": "1"},
        "timeout_s": 5,
    },
    "order_key": "o",
    "misfire_tolerance_s": 60,
}


def only_rejections(raw: bytes, key: bytes | None = None) -> Command | None:
    """Decode; a rejection must be a well-formed CommandRejected, anything else fails."""
    try:
        return decode_command(raw, key=key, now_ms=NOW, limits=LIMITS)
    except CommandRejected as rej:
        assert rej.code in set(Code) and rej.message
        return None


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=12,
)


def dumps(value: object) -> bytes:
    # Integers beyond 64 bits cannot be dumped by orjson; their text is still fair input.
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        assume(False)
        raise


@settings(max_examples=500)
@given(st.binary(max_size=300), st.none() | st.binary(max_size=10))
def test_random_bytes(raw: bytes, key: bytes | None) -> None:
    only_rejections(raw, key)
    salvage_ids(raw, key)


@settings(max_examples=300)
@given(json_values, st.none() | st.just(b"s1"))
def test_random_json(value: object, key: bytes | None) -> None:
    only_rejections(dumps(value), key)


@settings(max_examples=300)
@given(
    st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=10),
    st.sampled_from([t.value for t in CommandType]),
)
def test_random_objects_with_real_field_names(obj: dict[str, Any], ctype: str) -> None:
    only_rejections(dumps({"type": ctype, **obj}))


paths = st.sampled_from(
    [(name,) for name in FIELD_NAMES]
    + [
        ("callback", name)
        for name in ("type", "url", "method", "headers", "timeout_s", "topic", "key", "x")
    ]
    + [("callback", "headers", "X-A"), ("callback", "headers", "Host")]
)


@settings(max_examples=600)
@given(paths, st.none() | json_values, st.booleans())
def test_mutated_valid_command(path: tuple[str, ...], value: object, delete: bool) -> None:
    obj = orjson.loads(orjson.dumps(VALID))
    node = obj
    for part in path[:-1]:
        node = node[part]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    command = only_rejections(dumps(obj), b"s1" if path != ("schedule_id",) else None)
    if command is not None:
        assert only_rejections(encode_command(command), command.schedule_id.encode()) == command


@settings(max_examples=200)
@given(
    st.integers(1, 3000),
    st.sampled_from(["top", "payload", "headers", "due", "callback"]),
    st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]),
)
def test_deep_nesting(depth: int, where: str, brackets: tuple[bytes, bytes]) -> None:
    opening, closing = brackets
    nested = opening * depth + b"1" + closing * depth
    if where == "top":
        raw = nested
    else:
        obj = orjson.loads(orjson.dumps(VALID))
        del obj["payload"]
        head = orjson.dumps(obj)
        if where == "headers":
            raw = head.replace(b'"X-A":"1"', b'"X-A":' + nested)
        elif where == "callback":
            raw = head.replace(b'"method":"POST"', b'"method":' + nested)
        else:
            head = head.replace(b'"due":"2030-01-01T17:00:05Z",', b"") if where == "due" else head
            raw = head[:-1] + b',"' + where.encode() + b'":' + nested + b"}"
    command = only_rejections(raw, b"s1")
    if where == "payload":
        assert (command is not None) == (depth <= 254)


# Escapes orjson.dumps would never write: lone surrogates, noncharacters, NUL, bidi, BOM.
odd_escapes = st.sampled_from(
    [
        "\\ud800",
        "\\udfff",
        "\\ud83d\\ude00",
        "\\uffff",
        "\\ufffe",
        "\\u0000",
        "\\u202e",
        "\\ufeff",
        "\\u0085",
        "\\u2028",
        "\\u0301",
        "\\u00e9",
        "\\\\",
        '\\"',
        "\\/",
    ]
)
odd_text = st.lists(
    odd_escapes
    | st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters='"\\'), max_size=3
    ).map(lambda s: orjson.dumps(s).decode()[1:-1]),
    max_size=6,
).map("".join)
text_slots = [
    "tenant",
    "schedule_id",
    "request_id",
    "order_key",
    "due",
    "payload_b64",
    "callback.url",
    "callback.method",
    "header-name",
    "header-value",
    "type",
]


@settings(max_examples=1000)
@given(st.sampled_from(text_slots), odd_text)
def test_odd_unicode_in_every_string(slot: str, text: str) -> None:
    raw = orjson.dumps(VALID).decode()
    quoted = f'"{text}"'
    targets = {
        "tenant": '"tenant":"acme"',
        "schedule_id": '"schedule_id":"s1"',
        "request_id": '"request_id":"r"',
        "order_key": '"order_key":"o"',
        "due": '"due":"2030-01-01T17:00:05Z"',
        "payload_b64": '"payload":{"a":[1,2]}',
        "callback.url": '"url":"https://h.example/x"',
        "callback.method": '"method":"POST"',
        "header-name": '"X-A":"1"',
        "header-value": '"X-A":"1"',
        "type": '"type":"create"',
    }
    target = targets[slot]
    name = target.split(":", 1)[0]
    if slot == "header-name":
        replacement = f'{quoted}:"1"'
    elif slot == "header-value":
        replacement = f'"X-A":{quoted}'
    elif slot == "payload_b64":
        replacement = f'"payload_b64":{quoted}'
    else:
        replacement = f"{name}:{quoted}"
    mutated = raw.replace(target, replacement, 1).encode("utf-8", "surrogatepass")
    only_rejections(mutated, None)
    salvage_ids(mutated, text.encode("utf-8", "surrogatepass"))


@settings(max_examples=300)
@given(st.binary(max_size=200), st.none() | st.binary(max_size=40))
def test_salvage_only_returns_sane_values(raw: bytes, key: bytes | None) -> None:
    found = salvage_ids(raw, key)
    for value in (found.tenant, found.schedule_id, found.request_id):
        assert value is None or (value and len(value.encode()) <= 256)
    assert found.command is None or isinstance(found.command, CommandType)


@settings(max_examples=300)
@given(json_values)
def test_other_decoders_only_raise_command_rejected(value: object) -> None:
    raw = dumps(value)
    for decoder in (decode_trigger, decode_result):
        with contextlib.suppress(CommandRejected):
            decoder(raw)


# -- round trips of valid models ---------------------------------------------------------

id_text = st.text(
    st.characters(
        blacklist_categories=("Cc", "Cs", "Zl", "Zp"),
        blacklist_characters="\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069",
    ),
    min_size=1,
    max_size=30,
).filter(lambda s: len(s.encode()) <= 256)
tenants = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
json_payloads = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
).map(canonical_json)
payloads = st.one_of(
    json_payloads.map(lambda b: (b, PayloadType.JSON)),
    st.binary(max_size=50).map(lambda b: (b, PayloadType.BYTES)),
)
header_maps = st.dictionaries(
    st.from_regex(r"X-[A-Za-z0-9!#$%&'*+.^_`|~-]{1,10}", fullmatch=True),
    st.text(st.characters(min_codepoint=32, max_codepoint=126) | st.just("\t"), max_size=20),
    max_size=4,
).filter(lambda h: len({k.lower() for k in h}) == len(h))
callbacks = st.one_of(
    st.builds(
        HttpCallback,
        url=st.sampled_from(["https://h.example/x", "http://10.0.0.1:8080/a?b=c", "http://[::1]/"]),
        method=st.sampled_from(sorted(HTTP_METHODS)),
        headers=header_maps,
        timeout_s=st.floats(min_value=0.001, max_value=300),
    ),
    st.builds(
        KafkaCallback,
        topic=st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,30}", fullmatch=True),
        key=st.none() | id_text,
    ),
)
dues = st.integers(NOW, MAX_EPOCH_MS)


@st.composite
def commands(draw: st.DrawFn) -> Command:
    tenant, schedule_id = draw(tenants), draw(id_text)
    request_id = draw(st.none() | id_text)
    kind = draw(st.sampled_from(list(CommandType)))
    if kind is CommandType.CANCEL:
        return CancelCommand(tenant=tenant, schedule_id=schedule_id, request_id=request_id)
    payload, payload_type = draw(payloads)
    if kind is CommandType.CREATE:
        return CreateCommand(
            tenant=tenant,
            schedule_id=schedule_id,
            request_id=request_id,
            due_ms=draw(dues),
            payload=payload,
            payload_type=payload_type,
            callback=draw(callbacks),
            order_key=draw(id_text),
            misfire_tolerance_s=draw(st.integers(0, 2**31 - 1)),
        )
    change = draw(st.sets(st.sampled_from(["due", "payload", "callback"]), min_size=1))
    return UpdateCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        request_id=request_id,
        due_ms=draw(dues) if "due" in change else None,
        payload=payload if "payload" in change else None,
        payload_type=payload_type if "payload" in change else None,
        callback=draw(callbacks) if "callback" in change else None,
    )


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(commands())
def test_command_round_trip(command: Command) -> None:
    raw = encode_command(command)
    assert (
        decode_command(raw, key=command.schedule_id.encode(), now_ms=NOW, limits=LIMITS) == command
    )


@st.composite
def triggers(draw: st.DrawFn) -> Trigger:
    tenant, schedule_id, due_ms = draw(tenants), draw(id_text), draw(dues)
    payload, payload_type = draw(payloads)
    return Trigger(
        trigger_id=trigger_id(tenant, schedule_id, due_ms),
        schedule_id=schedule_id,
        tenant=tenant,
        due_ms=due_ms,
        emitted_ms=draw(st.integers(0, 2**63 - 1)),
        attempt=draw(st.integers(1, 1000)),
        order_key=draw(id_text),
        payload=payload,
        payload_type=payload_type,
        callback=draw(callbacks),
    )


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(triggers())
def test_trigger_round_trip(trigger: Trigger) -> None:
    raw = encode_trigger(trigger)
    assert decode_trigger(raw) == trigger
    obj = orjson.loads(raw)
    if trigger.payload_type is PayloadType.JSON:
        assert canonical_json(obj["payload"]) == trigger.payload
    else:
        assert base64.b64decode(obj["payload_b64"]) == trigger.payload
    headers = dict(trigger_headers(trigger))
    assert headers["tocsin-trigger-id"].decode() == trigger.trigger_id
    assert int(headers["tocsin-due-ms"]) == trigger.due_ms


@given(
    st.none() | id_text,
    st.none() | tenants,
    st.none() | id_text,
    st.none() | st.sampled_from(list(CommandType)),
    st.sampled_from(list(Code)),
    st.text(),
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**31 - 1),
    st.integers(0, 2**63 - 1),
)
def test_result_round_trip(
    schedule_id: str | None,
    tenant: str | None,
    request_id: str | None,
    command: CommandType | None,
    code: Code,
    message: str,
    at_ms: int,
    partition: int,
    offset: int,
) -> None:
    result = CommandResult(
        schedule_id=schedule_id,
        tenant=tenant,
        request_id=request_id,
        command=command,
        status=ResultStatus.ACCEPTED if code in ACCEPTED_CODES else ResultStatus.REJECTED,
        code=code,
        message=message,
        at_ms=at_ms,
        partition=partition,
        offset=offset,
    )
    assert decode_result(encode_result(result)) == result

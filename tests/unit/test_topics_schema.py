"""schema/json/*.schema.json and the examples in docs/wire-contract.md agree with the code.

The field lists are compared with the decoder's own tables (``COMMAND_FIELDS``,
``CALLBACK_FIELDS``, ``RESULT_FIELDS``, ``TRIGGER_FIELDS``) and probed by deleting fields
from real messages, so neither side can drift. A small validator for the keywords the
schemas use (no jsonschema dependency) checks that every message the decoder accepts is
also valid under the schema, i.e. the schemas never promise less than Tocsin accepts.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.errors import CommandRejected
from topics.callbacks import CALLBACK_FIELDS
from topics.codec import (
    RESULT_FIELDS,
    TRIGGER_FIELDS,
    decode_result,
    decode_trigger,
    encode_command,
    encode_result,
    encode_trigger,
)
from topics.codes import ACCEPTED_CODES, Code
from topics.ids import MAX_EPOCH_MS, parse_iso_ms, trigger_id
from topics.models import HTTP_METHODS, CommandType
from topics.validation import COMMAND_FIELDS, Limits, decode_command

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = ROOT / "schema" / "json"
WIRE_DOC = ROOT / "docs" / "wire-contract.md"
NOW = parse_iso_ms("2026-11-21T17:00:00Z")  # the doc's examples are decoded at this time
# Shape tests: which callback addresses a deployment allows is test_topics_validation's.
LIMITS = Limits(allow_private_targets=True)


def load_schema(name: str) -> dict[str, Any]:
    value = orjson.loads((SCHEMA_DIR / name).read_bytes())
    assert isinstance(value, dict)
    return value


SCHEMAS = {p.name: load_schema(p.name) for p in sorted(SCHEMA_DIR.glob("*.schema.json"))}
COMMAND = SCHEMAS["command.schema.json"]
RESULT = SCHEMAS["command-result.schema.json"]
TRIGGER = SCHEMAS["trigger.schema.json"]


# -- a validator for the subset of draft 2020-12 the schemas use -------------------------

ANNOTATIONS = {
    "$schema",
    "$id",
    "title",
    "description",
    "examples",
    "default",
    "format",
    "contentEncoding",
    "$defs",
}
ASSERTIONS = {
    "type",
    "required",
    "properties",
    "additionalProperties",
    "const",
    "enum",
    "oneOf",
    "anyOf",
    "not",
    "$ref",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "maxProperties",
    "propertyNames",
    "if",
    "then",
    "else",
}


def keywords(schema: object) -> set[str]:
    """Every keyword used anywhere in ``schema`` (property names excluded)."""
    found: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            found.add(key)
            if key in ("properties", "$defs"):
                for sub in value.values():
                    found |= keywords(sub)
            elif key in ("oneOf", "anyOf"):
                for sub in value:
                    found |= keywords(sub)
            elif key in ("not", "if", "then", "else", "additionalProperties", "propertyNames"):
                found |= keywords(value)
    return found


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def json_equal(a: object, b: object) -> bool:
    return json_type(a) == json_type(b) and a == b


def resolve(ref: str, here: dict[str, Any]) -> dict[str, Any]:
    file, _, pointer = ref.partition("#")
    node: Any = SCHEMAS[file] if file else here
    for part in pointer.strip("/").split("/") if pointer else []:
        node = node[part]
    assert isinstance(node, dict)
    return node


def valid(value: object, schema: object, root: dict[str, Any]) -> bool:
    if schema is True or schema == {}:
        return True
    if schema is False:
        return False
    assert isinstance(schema, dict)
    return all(check(value, schema, root) for check in CHECKS)


# Each check takes (value, schema, root) and applies one group of keywords; a keyword that
# does not apply to the value's JSON type passes, as in JSON Schema.


def ref_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if "$ref" not in schema:
        return True
    ref = schema["$ref"]
    target_root = SCHEMAS[ref.split("#")[0]] if not ref.startswith("#") else root
    return valid(value, resolve(ref, root), target_root)


def type_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if "type" not in schema:
        return True
    kind = json_type(value)
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return kind in types or (kind == "integer" and "number" in types)


def const_enum_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if "const" in schema and not json_equal(value, schema["const"]):
        return False
    return "enum" not in schema or any(json_equal(value, e) for e in schema["enum"])


def string_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if not isinstance(value, str):
        return True
    if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1e9):
        return False
    return "pattern" not in schema or re.search(schema["pattern"], value) is not None


def number_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if json_type(value) not in ("integer", "number"):
        return True
    assert isinstance(value, int | float)
    if "minimum" in schema and value < schema["minimum"]:
        return False
    if "maximum" in schema and value > schema["maximum"]:
        return False
    return "exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"]


def object_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if not isinstance(value, dict):
        return True
    if any(name not in value for name in schema.get("required", [])):
        return False
    if len(value) > schema.get("maxProperties", 1e9):
        return False
    props = schema.get("properties", {})
    for name, item in value.items():
        if "propertyNames" in schema and not valid(name, schema["propertyNames"], root):
            return False
        if not valid(item, props.get(name, schema.get("additionalProperties", True)), root):
            return False
    return True


def combinators_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if "oneOf" in schema and sum(valid(value, s, root) for s in schema["oneOf"]) != 1:
        return False
    if "anyOf" in schema and not any(valid(value, s, root) for s in schema["anyOf"]):
        return False
    return "not" not in schema or not valid(value, schema["not"], root)


def conditional_ok(value: object, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    if "if" not in schema:
        return True
    branch = "then" if valid(value, schema["if"], root) else "else"
    return branch not in schema or valid(value, schema[branch], root)


CHECKS = (
    ref_ok,
    type_ok,
    const_enum_ok,
    string_ok,
    number_ok,
    object_ok,
    combinators_ok,
    conditional_ok,
)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_files_are_draft_2020_12_with_known_keywords(name: str) -> None:
    schema = SCHEMAS[name]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    unknown = keywords(schema) - ANNOTATIONS - ASSERTIONS
    assert not unknown, f"the test validator does not implement {unknown}"
    assert schema["examples"]
    for example in schema["examples"]:
        assert valid(example, schema, schema), example


def test_the_validator_rejects_what_it_should() -> None:
    good = COMMAND["examples"][0]
    assert valid(good, COMMAND, COMMAND)
    for broken in (
        {**good, "extra": 1},
        {**good, "type": "delete"},
        {**good, "due": "tomorrow"},
        {**good, "payload_b64": "AA=="},
        {k: v for k, v in good.items() if k != "callback"},
        {**good, "callback": {"type": "http"}},
    ):
        assert not valid(broken, COMMAND, COMMAND), broken
    assert not valid({**RESULT["examples"][0], "code": "conflict"}, RESULT, RESULT)


# -- field lists derived from the decoder --------------------------------------------------


def command_def(ctype: CommandType) -> dict[str, Any]:
    return resolve(f"#/$defs/{ctype}", COMMAND)


@pytest.mark.parametrize("ctype", list(CommandType))
def test_command_schema_fields_match_the_decoder(ctype: CommandType) -> None:
    definition = command_def(ctype)
    fields = COMMAND_FIELDS[ctype]
    assert definition["required"] == list(fields.required)
    assert set(definition["properties"]) == fields.allowed
    assert definition["additionalProperties"] is False
    assert definition["properties"]["type"] == {"const": ctype.value}


def test_command_schema_lists_every_command_type() -> None:
    refs = [s["$ref"] for s in COMMAND["oneOf"]]
    assert refs == [f"#/$defs/{t}" for t in CommandType]


@pytest.mark.parametrize("kind", sorted(CALLBACK_FIELDS))
def test_callback_schema_fields_match_the_decoder(kind: str) -> None:
    definition = resolve(f"#/$defs/{kind}_callback", COMMAND)
    fields = CALLBACK_FIELDS[kind]
    assert definition["required"] == list(fields.required)
    assert set(definition["properties"]) == fields.allowed
    assert definition["additionalProperties"] is False
    alternatives = [s["$ref"] for s in resolve("#/$defs/callback", COMMAND)["oneOf"]]
    assert f"#/$defs/{kind}_callback" in alternatives


def test_http_methods_match() -> None:
    method = resolve("#/$defs/http_callback", COMMAND)["properties"]["method"]
    assert set(method["enum"]) == HTTP_METHODS


def test_result_schema_matches_the_codec() -> None:
    assert RESULT["required"] == list(RESULT_FIELDS.required)
    assert set(RESULT["properties"]) == RESULT_FIELDS.allowed
    assert RESULT["properties"]["code"]["enum"] == [c.value for c in Code]
    assert RESULT["properties"]["status"]["enum"] == ["accepted", "rejected"]
    assert RESULT["properties"]["command"]["enum"] == [*(t.value for t in CommandType), None]
    assert set(RESULT["then"]["properties"]["code"]["enum"]) == ACCEPTED_CODES


def test_trigger_schema_matches_the_codec() -> None:
    assert TRIGGER["required"] == list(TRIGGER_FIELDS.required)
    assert set(TRIGGER["properties"]) == TRIGGER_FIELDS.allowed
    assert [s["required"] for s in TRIGGER["oneOf"]] == [[f] for f in TRIGGER_FIELDS.optional]


# -- behaviour: required means the decoder refuses the message without it ------------------


def command_examples() -> list[dict[str, Any]]:
    return [*COMMAND["examples"], *(e for e in doc_examples() if "type" in e)]


@pytest.mark.parametrize("ctype", list(CommandType))
def test_required_and_optional_command_fields_behave_as_listed(ctype: CommandType) -> None:
    examples = [e for e in command_examples() if e["type"] == ctype.value]
    assert examples, f"no {ctype} example"
    for example in examples:
        key = example["schedule_id"].encode()
        for name in COMMAND_FIELDS[ctype].required:
            without = orjson.dumps({k: v for k, v in example.items() if k != name})
            with pytest.raises(CommandRejected) as caught:
                decode_command(without, key=key, now_ms=NOW, limits=LIMITS)
            assert caught.value.code == Code.MISSING_FIELD, name
        for name in set(example) & set(COMMAND_FIELDS[ctype].optional):
            if ctype is CommandType.CREATE and name in ("due", "recurrence"):
                continue  # a create needs exactly one of them (tested in test_recurring_wire)
            without = {k: v for k, v in example.items() if k != name}
            if ctype is CommandType.UPDATE and not set(without) - {
                "type",
                "tenant",
                "schedule_id",
                "request_id",
            }:
                continue  # an update needs one change; nothing_to_update is tested elsewhere
            decode_command(orjson.dumps(without), key=key, now_ms=NOW, limits=LIMITS)
        with pytest.raises(CommandRejected) as caught:
            decode_command(
                orjson.dumps({**example, "bogus": 1}), key=key, now_ms=NOW, limits=LIMITS
            )
        assert caught.value.code == Code.INVALID_FIELD


def test_required_result_and_trigger_fields_behave_as_listed() -> None:
    result = RESULT["examples"][0]
    for name in RESULT_FIELDS.required:
        with pytest.raises(CommandRejected) as caught:
            decode_result(orjson.dumps({k: v for k, v in result.items() if k != name}))
        assert caught.value.code == Code.MISSING_FIELD, name
    trig = TRIGGER["examples"][0]
    for name in TRIGGER_FIELDS.required:
        with pytest.raises(CommandRejected) as caught:
            decode_trigger(orjson.dumps({k: v for k, v in trig.items() if k != name}))
        assert caught.value.code == Code.MISSING_FIELD, name


# -- examples in the docs and schemas decode, and match the schemas ----------------------


def doc_examples() -> list[dict[str, Any]]:
    blocks = re.findall(r"```json\n(.*?)```", WIRE_DOC.read_text(), flags=re.S)
    values = [orjson.loads(block) for block in blocks]
    assert all(isinstance(v, dict) for v in values)
    return values


def all_examples() -> list[dict[str, Any]]:
    return [*doc_examples(), *(e for s in SCHEMAS.values() for e in s["examples"])]


def test_doc_has_examples_of_every_message() -> None:
    kinds = {
        ("command" if "type" in e else "trigger" if "trigger_id" in e else "result")
        for e in doc_examples()
    }
    assert kinds == {"command", "result", "trigger"}
    assert {e["type"] for e in doc_examples() if "type" in e} == {t.value for t in CommandType}


@pytest.mark.parametrize("example", all_examples(), ids=lambda e: str(e)[:40])
def test_examples_decode_and_validate(example: dict[str, Any]) -> None:
    raw = orjson.dumps(example)
    if "type" in example:
        command = decode_command(
            raw, key=example["schedule_id"].encode(), now_ms=NOW, limits=LIMITS
        )
        assert valid(orjson.loads(encode_command(command)), COMMAND, COMMAND)
        assert valid(example, COMMAND, COMMAND)
    elif "trigger_id" in example:
        trig = decode_trigger(raw)
        assert trig.trigger_id == trigger_id(trig.tenant, trig.schedule_id, trig.due_ms)
        assert orjson.loads(encode_trigger(trig)) == example  # payload already canonical
        assert valid(example, TRIGGER, TRIGGER)
    else:
        result = decode_result(raw)
        assert orjson.loads(encode_result(result)) == example
        assert valid(example, RESULT, RESULT)


# -- every command the decoder accepts is valid under the schema --------------------------

ids = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=20)
tenants = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
http_callbacks = st.fixed_dictionaries(
    {
        "type": st.just("http"),
        "url": st.sampled_from(
            [
                "https://h.example/x",
                "HTTP://10.0.0.1:8080/a?b=c#d",
                "http://[::1]/",
                "https://svc_1.internal./",
            ]
        ),
    },
    optional={
        "method": st.sampled_from(sorted(HTTP_METHODS)),
        "headers": st.dictionaries(
            st.from_regex(r"X-[A-Za-z0-9]{1,8}", fullmatch=True),
            st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=10),
            max_size=3,
        ).filter(lambda headers: len({name.lower() for name in headers}) == len(headers)),
        "timeout_s": st.floats(min_value=0.001, max_value=300) | st.integers(1, 300),
    },
)
kafka_callbacks = st.fixed_dictionaries(
    {
        "type": st.just("kafka"),
        "topic": st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,20}", fullmatch=True),
    },
    optional={"key": ids | st.none()},
)
dues = (
    st.integers(NOW, MAX_EPOCH_MS)
    | st.integers(NOW, MAX_EPOCH_MS).map(float)
    | st.sampled_from(
        ["2030-01-01T17:00:05Z", "2030-01-01t17:00:05.123456+05:30", "9999-12-31T23:59:59.999Z"]
    )
)
payloads = st.one_of(
    st.just({}),
    json_values.map(lambda v: {"payload": v}),
    st.binary(max_size=30).map(lambda b: {"payload_b64": base64.b64encode(b).decode()}),
)
creates = st.tuples(
    st.fixed_dictionaries(
        {
            "type": st.just("create"),
            "tenant": tenants,
            "schedule_id": ids,
            "due": dues,
            "callback": http_callbacks | kafka_callbacks,
        },
        optional={
            "request_id": ids | st.none(),
            "order_key": ids,
            "misfire_tolerance_s": st.integers(0, 2**31 - 1),
        },
    ),
    payloads,
).map(lambda t: {**t[0], **t[1]})
updates = st.tuples(
    st.fixed_dictionaries(
        {"type": st.just("update"), "tenant": tenants, "schedule_id": ids},
        optional={
            "request_id": ids | st.none(),
            "due": dues,
            "callback": http_callbacks | kafka_callbacks,
        },
    ),
    payloads,
).map(lambda t: {**t[0], **t[1]})
cancels = st.fixed_dictionaries(
    {"type": st.just("cancel"), "tenant": tenants, "schedule_id": ids},
    optional={"request_id": ids | st.none()},
)


@settings(max_examples=300)
@given(creates | updates | cancels)
def test_accepted_commands_are_schema_valid(message: dict[str, Any]) -> None:
    try:
        command = decode_command(orjson.dumps(message), key=None, now_ms=NOW, limits=LIMITS)
    except CommandRejected as rej:
        assert rej.code == Code.NOTHING_TO_UPDATE, rej  # updates drawn without a change
        return
    assert valid(message, COMMAND, COMMAND), message
    assert valid(orjson.loads(encode_command(command)), COMMAND, COMMAND)

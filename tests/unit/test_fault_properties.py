"""Property tests for hostile input: every decoder and validator that
reads bytes from the outside - the command decoder, the trigger and result decoders, the
callback decoder, signature verification, the proxy's envelope preparation - either returns
a value or raises its one documented rejection, and a worker fed any batch of records
answers every record, each bad one with its own rejection code, without crashing.

(tests/unit/test_topics_properties.py covers decode_command in depth; this file covers the
rest and the command agent end to end with fake edges.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.errors import CommandRejected, TocsinError
from proxy.envelope import Envelope, prepare_fire
from streams.commands import CommandProcessor, RawCommand
from streams.partitioner import partition_for
from tests import fakes
from topics.admission import AdmissionKeys
from topics.codec import callback_from_json, decode_result, decode_trigger, encode_command
from topics.codes import Code
from topics.models import CreateCommand, HttpCallback, PayloadType
from topics.signing import (
    TimestampType,
    header_map,
    new_signing_key,
    sign_headers,
    verify,
)
from topics.validation import Limits

PARTITIONS = 8
SECRET = new_signing_key()

# JSON of every shape: odd unicode, huge numbers, deep-ish nesting, wrong types.
odd_text = st.text(
    st.characters(codec="utf-8") | st.sampled_from(["\u0000", "\u202e", "\ufeff", "\U0001f4a3"]),
    max_size=40,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | odd_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=25,
)
TRIGGER_FIELDS = [
    "trigger_id",
    "schedule_id",
    "tenant",
    "due_ms",
    "emitted_ms",
    "attempt",
    "order_key",
    "payload",
    "payload_b64",
    "payload_type",
    "callback",
]
RESULT_FIELDS = [
    "schedule_id",
    "tenant",
    "request_id",
    "command",
    "status",
    "code",
    "message",
    "partition",
    "offset",
    "processed_ms",
]
CALLBACK_FIELDS = ["type", "url", "method", "headers", "timeout_s", "topic", "key"]


def objects_with(fields: list[str]) -> st.SearchStrategy[bytes]:
    """JSON objects using the real field names with values of any type."""
    return st.dictionaries(st.sampled_from(fields) | odd_text, json_values, max_size=12).map(
        lambda d: orjson.dumps(d, option=orjson.OPT_NON_STR_KEYS) if _dumpable(d) else b"{}"
    )


def _dumpable(value: object) -> bool:
    try:
        orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True


def raw_inputs(fields: list[str]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        json_values.filter(_dumpable).map(orjson.dumps),
        objects_with(fields),
        st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
        st.integers(1, 3000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        # huge fields (kept out of the failure report's repr by building them from a size)
        st.integers(10_000, 200_000).map(
            lambda n: (
                b'{"callback": {"type": "http", "url": "http://' + b"x" * n + b'"},'
                b' "payload": "' + b"y" * n + b'", "tenant": "' + b"t" * n + b'"}'
            )
        ),
    )


# -- the decoders of topics/ ----------------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw_inputs(TRIGGER_FIELDS))
def test_decode_trigger_only_rejects(raw: bytes) -> None:
    with contextlib.suppress(CommandRejected):
        decode_trigger(raw)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw_inputs(RESULT_FIELDS))
def test_decode_result_only_rejects(raw: bytes) -> None:
    with contextlib.suppress(CommandRejected):
        decode_result(raw)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw_inputs(CALLBACK_FIELDS))
def test_callback_from_json_only_rejects(raw: bytes) -> None:
    with contextlib.suppress(CommandRejected):
        callback_from_json(raw)
    with contextlib.suppress(CommandRejected, UnicodeDecodeError):
        callback_from_json(raw.decode("utf-8"))


header_names = (
    st.sampled_from(["tocsin-signature", "tocsin-signed-at", "Tocsin-Signature", "x-other"])
    | odd_text
)
header_values = st.binary(max_size=80) | odd_text | st.none() | st.integers()
header_shapes = st.one_of(
    st.none(),
    st.lists(st.tuples(header_names | st.binary(max_size=20), header_values), max_size=6),
    st.dictionaries(header_names, header_values, max_size=6),
)


@settings(max_examples=300)
@given(
    header_shapes,
    st.none() | st.binary(max_size=40),
    st.binary(max_size=200),
    st.integers(-(2**63), 2**63),
)
def test_signature_verification_never_raises_and_never_accepts_garbage(
    headers: Any, key: bytes | None, value: bytes, record_ms: int
) -> None:
    why = verify(SECRET, header_map(headers), key=key, value=value, record_ms=record_ms)
    assert isinstance(why, str) and why  # nothing random is ever a valid signature


@given(st.none() | st.binary(max_size=40), st.binary(max_size=200), st.binary(min_size=1))
def test_a_signature_covers_key_and_value(key: bytes | None, value: bytes, flip: bytes) -> None:
    at = 1_800_000_000_000
    headers = header_map(sign_headers(SECRET, signed_at_ms=at, key=key, value=value))
    assert verify(SECRET, headers, key=key, value=value, record_ms=at) is None
    assert verify(SECRET, headers, key=key, value=value + flip, record_ms=at) is not None
    assert verify(new_signing_key(), headers, key=key, value=value, record_ms=at) is not None


# -- the proxy's envelope decoding ----------------------------------------------------------


def _envelope(value: bytes | None) -> Envelope:
    return Envelope(
        topic="t",
        partition=0,
        offset=1,
        key=b"k",
        value=value,
        headers=[],
        timestamp_ms=0,
        read_s=0.0,
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(raw_inputs(TRIGGER_FIELDS) | st.none())
def test_proxy_envelope_never_raises(raw: bytes | None) -> None:
    """An undecodable trigger marks the envelope invalid (dead-lettered), never raises."""
    env = _envelope(raw)
    prepare_fire(env, decode_trigger)
    assert env.invalid or env.request is not None or env.kafka_target is not None


# -- a worker's command agent end to end (fake store and sink) -------------------------------


class FakeStore(fakes.FakeStore):
    """The shared fake with tenant acme registered, signing with SECRET."""

    def __init__(self) -> None:
        acme = {"tenant": "acme", "active": True, "config": "{}", "signing_secret": SECRET}
        super().__init__(tenants={"acme": acme})


class FakeSink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, bytes]] = []

    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        self.sent.append((topic, key, value))
        return fut


NOW = int(time.time() * 1000)


def command_processor(
    store: fakes.FakeStore, admission: AdmissionKeys | None = None
) -> CommandProcessor:
    """A worker's command processor on ``store``, a FakeSink and default limits, at NOW."""
    return CommandProcessor(
        store=store,
        sink=FakeSink(),
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: NOW,
        admission=admission,
    )


def good_record(offset: int) -> RawCommand:
    sid = f"ok-{offset}"
    value = encode_command(
        CreateCommand(
            tenant="acme",
            schedule_id=sid,
            due_ms=NOW + 3_600_000,
            payload=b'{"a":1}',
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url="https://h.example/cb"),
            misfire_tolerance_s=60,
        )
    )
    key = sid.encode()
    return RawCommand(
        partition=partition_for(key, PARTITIONS),
        offset=offset,
        key=key,
        value=value,
        timestamp_ms=NOW,
        headers=sign_headers(SECRET, signed_at_ms=NOW, key=key, value=value),
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )


records = st.builds(
    lambda key, value, signed, partition: (key, value, signed, partition),
    st.none() | st.binary(max_size=30),
    raw_inputs(
        sorted(
            {
                "type",
                "tenant",
                "schedule_id",
                "due",
                "payload",
                "callback",
                "request_id",
                "misfire_tolerance_s",
                "recurrence",
            }
        )
    )
    | st.none(),
    st.booleans(),
    st.integers(0, PARTITIONS - 1),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(records, min_size=1, max_size=12), st.integers(0, 12))
def test_worker_answers_every_record_and_never_crashes(batch: list[Any], good_at: int) -> None:
    """Random records (signed or not, any partition) mixed with one valid command: one result
    per record, in order; the valid one is accepted; each rejection carries a known code and
    a message; the processor raises nothing."""
    raws = [
        RawCommand(
            partition=p,
            offset=i,
            key=k,
            value=v,
            timestamp_ms=NOW,
            headers=sign_headers(SECRET, signed_at_ms=NOW, key=k, value=v or b"") if signed else (),
            timestamp_type=TimestampType.LOG_APPEND_TIME,
        )
        for i, (k, v, signed, p) in enumerate(batch)
    ]
    good_at = min(good_at, len(raws))
    good = good_record(1000)
    raws.insert(good_at, good)
    sink = FakeSink()
    processor = CommandProcessor(
        store=FakeStore(),
        sink=sink,
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(max_payload_bytes=64 * 1024),
        clock_ms=lambda: NOW,
    )
    results = asyncio.run(processor.process_batch(raws))
    assert len(results) == len(raws) == len(sink.sent)
    assert [r.offset for r in results] == [m.offset for m in raws]
    assert str(results[good_at].code) == "ok", results[good_at]
    known = {c.value for c in Code}
    for r in results:
        assert str(r.code) in known
        if str(r.status) == "rejected":
            assert r.message
            assert str(r.code) != "internal_error"


@settings(max_examples=100, deadline=None)
@given(raw_inputs(["type", "tenant", "schedule_id", "due", "callback"]))
def test_each_bad_input_gets_its_own_code(raw: bytes) -> None:
    """Garbage that fails before the tenant check is rejected for a reason about its shape
    (malformed_json, invalid_field, ...), never a catch-all: decode errors name the field."""
    from topics.validation import decode_command

    try:
        decode_command(raw, key=b"k", now_ms=NOW, limits=Limits(max_payload_bytes=1024))
    except CommandRejected as rej:
        assert rej.code in {c.value for c in Code} and rej.code != "internal_error"
        assert rej.message
    except TocsinError as exc:  # pragma: no cover - would be a bug
        raise AssertionError(f"unexpected {exc!r}") from exc

"""Requests bound to their replies, and signed commands good only once and only briefly.

The pure parts (topics.signing, the decoder and codec, api.bridge.Expected) and the command
agent's echo of ``reply_nonce`` with a fake store, as in test_fault_properties.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import orjson
import pytest

from api.bridge import Expected, new_reply_nonce
from base.errors import CommandRejected
from streams.app import _timestamp_type
from streams.commands import CommandProcessor, RawCommand
from streams.partitioner import partition_for
from tests.unit.test_fault_properties import NOW, PARTITIONS, SECRET, FakeSink, FakeStore
from topics.codec import decode_result, encode_command, encode_result
from topics.codes import Code
from topics.models import (
    CancelCommand,
    Command,
    CommandResult,
    CreateCommand,
    HttpCallback,
    PayloadType,
    ResultStatus,
    UpdateCommand,
)
from topics.signing import (
    MAX_SKEW_MS,
    SeenSignatures,
    SigningKeys,
    TimestampType,
    check_signature,
    header_map,
    new_signing_key,
    sign_headers,
)
from topics.validation import Limits, decode_command

LIMITS = Limits(max_payload_bytes=64 * 1024)
NONCE = "0123456789abcdef0123456789abcdef"
BROKER = TimestampType.LOG_APPEND_TIME


# -- freshness against the broker's time -------------------------------------------------


def _check(
    secret: str,
    *,
    signed_at: int,
    record_ms: int,
    kind: TimestampType = BROKER,
    keys_secret: str | None = None,
) -> Code | None:
    key, value = b"s1", b'{"type":"cancel"}'
    headers = header_map(sign_headers(secret, signed_at_ms=signed_at, key=key, value=value))
    keys = SigningKeys(current=keys_secret or secret)
    failed = check_signature(
        keys,
        headers,
        key=key,
        value=value,
        record_ms=record_ms,
        timestamp_type=kind,
        now_ms=record_ms,
    )
    return None if failed is None else failed[0]


def test_a_signed_command_appended_long_after_it_was_signed_is_stale() -> None:
    secret = new_signing_key()
    assert _check(secret, signed_at=NOW, record_ms=NOW + MAX_SKEW_MS) is None
    assert _check(secret, signed_at=NOW, record_ms=NOW + MAX_SKEW_MS + 1) == Code.STALE_COMMAND
    assert _check(secret, signed_at=NOW, record_ms=NOW - MAX_SKEW_MS - 1) == Code.STALE_COMMAND
    # Only a holder of the key learns that: a wrong signature stays bad_signature.
    assert (
        _check(secret, signed_at=NOW, record_ms=NOW + 3_600_000, keys_secret=new_signing_key())
        == Code.BAD_SIGNATURE
    )


def test_a_timestamp_its_producer_set_proves_no_freshness() -> None:
    secret = new_signing_key()
    # A replay re-produced with its timestamp set to match the old signature.
    code = _check(
        secret, signed_at=NOW - 3_600_000, record_ms=NOW - 3_600_000, kind=TimestampType.CREATE_TIME
    )
    assert code == Code.STALE_COMMAND


def test_the_worker_reads_the_records_timestamp_type() -> None:
    assert _timestamp_type(1) is TimestampType.LOG_APPEND_TIME
    assert _timestamp_type(0) is TimestampType.CREATE_TIME
    assert _timestamp_type(None) is TimestampType.CREATE_TIME


# -- copies within the window --------------------------------------------------------------


def test_a_signature_seen_at_another_offset_is_a_copy_and_the_same_offset_is_not() -> None:
    seen = SeenSignatures()
    assert seen.first_offset(b"v1=aa", offset=5, signed_at_ms=NOW, record_ms=NOW) is None
    # The same record read again (a retried batch, a crash replay).
    assert seen.first_offset(b"v1=aa", offset=5, signed_at_ms=NOW, record_ms=NOW + 1) is None
    # A copy of it, produced again.
    assert seen.first_offset(b"v1=aa", offset=9, signed_at_ms=NOW, record_ms=NOW + 2) == 5
    assert seen.first_offset(b"v1=bb", offset=9, signed_at_ms=NOW, record_ms=NOW + 2) is None


def test_seen_signatures_forget_what_the_window_refuses_and_stay_bounded() -> None:
    seen = SeenSignatures(window_ms=1_000, max_entries=3)
    seen.first_offset(b"a", offset=1, signed_at_ms=NOW, record_ms=NOW)
    seen.first_offset(b"b", offset=2, signed_at_ms=NOW + 500, record_ms=NOW + 500)
    # Once the broker's time is more than the window past "a", a copy of it is stale anyway.
    seen.first_offset(b"c", offset=3, signed_at_ms=NOW + 1_200, record_ms=NOW + 1_200)
    assert len(seen) == 2
    for n in range(10):
        seen.first_offset(
            bytes([n]), offset=10 + n, signed_at_ms=NOW + 1_300, record_ms=NOW + 1_300
        )
        assert len(seen) <= 3
    assert (
        seen.first_offset(bytes([9]), offset=99, signed_at_ms=NOW + 1_300, record_ms=NOW + 1_300)
        == 19
    )


# -- reply_nonce on the wire ---------------------------------------------------------------


def test_reply_nonce_is_decoded_for_every_command_type_and_encoded_back() -> None:
    callback = HttpCallback(url="https://h.example/cb")
    commands: list[Command] = [
        CreateCommand(
            tenant="acme",
            schedule_id="s1",
            due_ms=NOW + 60_000,
            callback=callback,
            misfire_tolerance_s=60,
            reply_nonce=NONCE,
        ),
        UpdateCommand(tenant="acme", schedule_id="s1", due_ms=NOW + 60_000, reply_nonce=NONCE),
        CancelCommand(tenant="acme", schedule_id="s1", reply_nonce=NONCE),
    ]
    for command in commands:
        decoded = decode_command(encode_command(command), key=b"s1", now_ms=NOW, limits=LIMITS)
        assert decoded.reply_nonce == NONCE
    assert "reply_nonce" not in orjson.loads(encode_command(replace(commands[2], reply_nonce=None)))


@pytest.mark.parametrize(
    "nonce",
    ["short", "x" * 129, 12345678901234567890, None, "0123456789abcdef 0123456789abcdef", "é" * 20],
)
def test_a_guessable_or_malformed_reply_nonce_is_invalid(nonce: object) -> None:
    raw = orjson.dumps(
        {"type": "cancel", "tenant": "acme", "schedule_id": "s1", "reply_nonce": nonce}
    )
    with pytest.raises(CommandRejected) as caught:
        decode_command(raw, key=b"s1", now_ms=NOW, limits=LIMITS)
    assert caught.value.code == Code.INVALID_FIELD


def test_results_carry_reply_nonce_only_when_given() -> None:
    result = CommandResult(
        schedule_id="s1",
        tenant="acme",
        request_id="r",
        command=None,
        status=ResultStatus.REJECTED,
        code=Code.NOT_FOUND,
        message="m",
        at_ms=1,
        partition=0,
        offset=0,
    )
    assert "reply_nonce" not in orjson.loads(encode_result(result))
    assert decode_result(encode_result(result)).reply_nonce is None
    echoed = replace(result, reply_nonce=NONCE)
    assert decode_result(encode_result(echoed)).reply_nonce == NONCE


# -- the bridge's matching -----------------------------------------------------------------


def test_the_bridge_takes_a_result_only_with_its_nonce_tenant_and_schedule() -> None:
    nonce = new_reply_nonce()
    assert len(nonce) == 32 and nonce != new_reply_nonce()
    expected = Expected(reply_nonce=nonce, tenant="acme", schedule_id="s1")
    doc: dict[str, Any] = {
        "request_id": "api-x-1",
        "tenant": "acme",
        "schedule_id": "s1",
        "code": "ok",
        "reply_nonce": nonce,
    }
    assert expected.matches(doc)
    assert not expected.matches({k: v for k, v in doc.items() if k != "reply_nonce"})
    assert not expected.matches({**doc, "reply_nonce": new_reply_nonce()})
    assert not expected.matches({**doc, "reply_nonce": 7})
    assert not expected.matches({**doc, "tenant": "mallory"})
    assert not expected.matches({**doc, "schedule_id": "s2"})


# -- the command agent echoes the nonce only for a command that proved its tenant ----------


def _record(
    offset: int,
    *,
    signed: bool = True,
    sid: str = "n-1",
    kind: TimestampType = BROKER,
    signed_at: int = NOW,
    secret: str = SECRET,
) -> RawCommand:
    value = encode_command(
        CreateCommand(
            tenant="acme",
            schedule_id=sid,
            request_id="api-x-1",
            reply_nonce=NONCE,
            due_ms=NOW + 3_600_000,
            payload=b'{"a":1}',
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url="https://h.example/cb"),
            misfire_tolerance_s=60,
        )
    )
    key = sid.encode()
    headers = sign_headers(secret, signed_at_ms=signed_at, key=key, value=value) if signed else ()
    return RawCommand(
        partition=partition_for(key, PARTITIONS),
        offset=offset,
        key=key,
        value=value,
        timestamp_ms=NOW,
        headers=headers,
        timestamp_type=kind,
    )


def _process(*records: RawCommand) -> list[dict[str, Any]]:
    sink = FakeSink()
    processor = CommandProcessor(
        store=FakeStore(),
        sink=sink,
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=LIMITS,
        clock_ms=lambda: NOW,
    )
    asyncio.run(processor.process_batch(list(records)))
    return [orjson.loads(value) for _, _, value in sink.sent]


def test_a_verified_command_gets_its_nonce_back_and_a_forged_one_does_not() -> None:
    good, unsigned, foreign, stale, producer_time = _process(
        _record(1, sid="n-1"),
        _record(2, sid="n-2", signed=False),
        _record(3, sid="n-3", secret=new_signing_key()),
        _record(4, sid="n-4", signed_at=NOW - MAX_SKEW_MS - 1),
        _record(5, sid="n-5", kind=TimestampType.CREATE_TIME),
    )
    assert (good["code"], good["reply_nonce"]) == ("ok", NONCE)
    for result, code in (
        (unsigned, "bad_signature"),
        (foreign, "bad_signature"),
        (stale, "stale_command"),
        (producer_time, "stale_command"),
    ):
        assert result["code"] == code, result
        # The request id is still echoed, so it cannot be what binds a reply.
        assert result["request_id"] == "api-x-1"
        assert "reply_nonce" not in result, result


def test_a_copy_of_a_signed_record_is_refused_without_the_nonce() -> None:
    original = _record(7)
    first, again, copy = _process(original, original, replace(original, offset=8))
    assert first["code"] == again["code"] == "ok"  # the same record (a retried batch)
    assert (copy["code"], copy["offset"]) == ("replayed_command", 8)
    assert "reply_nonce" not in copy and first["reply_nonce"] == NONCE


class KeylessStore(FakeStore):
    """A tenant registered without a signing key (rows older than the keys)."""

    async def get_tenant(self, tenant: str) -> dict[str, Any] | None:
        return {"tenant": tenant, "active": True, "config": "{}"} if tenant == "acme" else None


@pytest.mark.parametrize("require_signed", [True, False])
def test_a_keyless_tenant_gets_its_nonce_only_where_unsigned_commands_are_trusted(
    require_signed: bool,
) -> None:
    sink = FakeSink()
    processor = CommandProcessor(
        store=KeylessStore(),
        sink=sink,
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=LIMITS,
        clock_ms=lambda: NOW,
        require_signed=require_signed,
    )
    asyncio.run(processor.process_batch([_record(1, signed=False)]))
    result = orjson.loads(sink.sent[0][2])
    if require_signed:
        assert result["code"] == "bad_signature" and "reply_nonce" not in result
    else:
        assert (result["code"], result["reply_nonce"]) == ("ok", NONCE)


def test_a_command_answered_on_its_own_echoes_the_nonce_only_when_it_verifies() -> None:
    sink = FakeSink()
    processor = CommandProcessor(
        store=FakeStore(),
        sink=sink,
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=LIMITS,
        clock_ms=lambda: NOW,
    )

    async def answer_both() -> None:
        await processor.answer(_record(1), Code.STORE_REJECTED, "refused")
        await processor.answer(_record(2, signed=False), Code.STORE_REJECTED, "refused")

    asyncio.run(answer_both())
    signed, unsigned = (orjson.loads(value) for _, _, value in sink.sent)
    assert (signed["code"], signed["reply_nonce"]) == ("store_rejected", NONCE)
    assert unsigned["code"] == "store_rejected" and "reply_nonce" not in unsigned

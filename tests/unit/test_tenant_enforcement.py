"""Pure parts of tenant enforcement: signing-key rotation, the callback retry policy (wire
form, tenant default stamping, the proxy policy it yields) and per-tenant retention TTLs."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from base.errors import CommandRejected
from base.settings import CassandraSettings
from proxy.retry import AttemptState, HttpResult, RetryPolicy, decide
from streams.decisions import with_default_retry, with_retention
from streams.model import ScheduleChange, ScheduleRow
from streams.store import Store
from streams.tenant_admin import signing_status
from streams.tenants import RetryPolicyConfig, TenantConfig, stamp_retry
from topics.codec import callback_from_json, callback_to_json, decode_trigger, encode_trigger
from topics.codes import Code
from topics.models import (
    CancelCommand,
    CreateCommand,
    DeliveryRetry,
    HttpCallback,
    KafkaCallback,
    PayloadType,
    Trigger,
    UpdateCommand,
)
from topics.signing import (
    MAX_SKEW_MS,
    SigningKeys,
    TimestampType,
    check_signature,
    header_map,
    new_signing_key,
    sign_headers,
)
from topics.validation import Limits, decode_command

NOW = 1_900_000_000_000
OLD, NEW, OLDER = new_signing_key(), new_signing_key(), new_signing_key()


# -- signing-key rotation ------------------------------------------------------------------


def check(
    keys: SigningKeys, secret: str, *, record_ms: int = NOW, now_ms: int = NOW
) -> tuple[Code, str] | None:
    key, value = b"s1", b'{"type":"cancel"}'
    headers = header_map(sign_headers(secret, signed_at_ms=record_ms, key=key, value=value))
    return check_signature(
        keys,
        headers,
        key=key,
        value=value,
        record_ms=record_ms,
        timestamp_type=TimestampType.LOG_APPEND_TIME,
        now_ms=now_ms,
    )


def code(result: tuple[Code, str] | None) -> Code | None:
    return None if result is None else result[0]


def test_current_key_verifies_and_a_foreign_key_does_not() -> None:
    keys = SigningKeys(current=NEW)
    assert check(keys, NEW) is None
    assert code(check(keys, OLD)) == Code.BAD_SIGNATURE


def test_previous_key_verifies_during_the_rotation_window() -> None:
    keys = SigningKeys(current=NEW, previous=OLD)  # no expiry: until retired explicitly
    assert check(keys, OLD) is None and check(keys, NEW) is None
    timed = SigningKeys(current=NEW, previous=OLD, previous_expires_ms=NOW + 1)
    assert check(timed, OLD) is None


def test_previous_key_is_retired_with_its_own_code() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, previous_expires_ms=NOW - 1)
    result = check(keys, OLD)
    assert code(result) == Code.SIGNING_KEY_RETIRED
    assert result is not None and "current key" in result[1]
    assert check(keys, NEW) is None
    assert code(check(keys, OLDER)) == Code.BAD_SIGNATURE


def test_a_key_rotated_out_earlier_is_recognised_as_retired() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, retired=OLDER)
    assert code(check(keys, OLDER)) == Code.SIGNING_KEY_RETIRED


def test_records_from_before_the_retirement_verify_briefly_and_back_dating_does_not_help() -> None:
    retired_at = NOW
    keys = SigningKeys(current=NEW, previous=OLD, previous_expires_ms=retired_at)
    # Produced a second before the retirement, checked (or replayed) a minute after it.
    assert check(keys, OLD, record_ms=retired_at - 1_000, now_ms=retired_at + 60_000) is None
    # The same record checked long after: the old key is dead, whatever the timestamp says.
    late = check(keys, OLD, record_ms=retired_at - 1_000, now_ms=retired_at + MAX_SKEW_MS)
    assert code(late) == Code.SIGNING_KEY_RETIRED
    # Produced after the retirement: rejected at once.
    assert code(check(keys, OLD, record_ms=retired_at, now_ms=retired_at)) == (
        Code.SIGNING_KEY_RETIRED
    )


def test_missing_headers_are_a_bad_signature_not_a_retirement() -> None:
    keys = SigningKeys(current=NEW, previous=OLD, previous_expires_ms=NOW - 1)
    result = check_signature(
        keys,
        {},
        key=b"k",
        value=b"v",
        record_ms=NOW,
        timestamp_type=TimestampType.LOG_APPEND_TIME,
        now_ms=NOW,
    )
    assert code(result) == Code.BAD_SIGNATURE


def test_keys_and_status_from_a_tenant_row() -> None:
    row = {
        "signing_secret": NEW,
        "previous_signing_secret": OLD,
        "previous_signing_expires_ms": NOW,
        "retired_signing_secret": None,
        "signing_rotated_ms": NOW - 5,
    }
    assert SigningKeys.of_row(row) == SigningKeys(
        current=NEW, previous=OLD, previous_expires_ms=NOW
    )
    assert SigningKeys.of_row(None) == SigningKeys(current=None)
    assert signing_status(row, NOW - 1)["previous_key"] == "valid"
    assert signing_status(row, NOW)["previous_key"] == "retired"
    assert signing_status({"signing_secret": NEW}, NOW)["previous_key"] is None
    assert OLD not in orjson.dumps(signing_status(row, NOW)).decode()  # never the keys


# -- callback retry: wire form ---------------------------------------------------------------


def create(callback: dict[str, object]) -> bytes:
    return orjson.dumps(
        {
            "type": "create",
            "tenant": "acme",
            "schedule_id": "s1",
            "due": NOW + 60_000,
            "callback": callback,
        }
    )


def test_callback_retry_round_trips_and_is_optional() -> None:
    cmd = decode_command(
        create(
            {
                "type": "http",
                "url": "https://h.test/cb",
                "retry": {"retries_6xx": 1, "max_retry_age_s": 30},
            }
        ),
        key=b"s1",
        now_ms=NOW,
        limits=Limits(),
    )
    assert isinstance(cmd, CreateCommand)
    assert cmd.callback.retry == DeliveryRetry(max_retry_age_s=30.0, retries_6xx=1)
    assert callback_from_json(callback_to_json(cmd.callback)) == cmd.callback
    plain = HttpCallback(url="https://h.test/cb")
    # Without retry the stored JSON is what it was before the field existed.
    assert "retry" not in callback_to_json(plain)
    kafka = KafkaCallback(topic="acme.out", retry=DeliveryRetry(retries_6xx=0))
    assert callback_from_json(callback_to_json(kafka)) == kafka


@pytest.mark.parametrize(
    "retry",
    [
        {"retries_6xx": -1},
        {"retries_6xx": 1.5},
        {"retries_6xx": True},
        {"retries_6xx": 1001},
        {"max_retry_age_s": -1},
        {"max_retry_age_s": "60"},
        {"max_retry_age_s": 1e12},
        {"other": 1},
        [1],
        "x",
    ],
)
def test_bad_callback_retry_is_invalid_callback(retry: object) -> None:
    with pytest.raises(CommandRejected) as info:
        decode_command(
            create({"type": "http", "url": "https://h.test/cb", "retry": retry}),
            key=b"s1",
            now_ms=NOW,
            limits=Limits(),
        )
    assert info.value.code == Code.INVALID_CALLBACK


def test_trigger_carries_the_callback_retry_to_the_proxy() -> None:
    trig = Trigger(
        trigger_id="t",
        schedule_id="s",
        tenant="acme",
        due_ms=NOW,
        emitted_ms=NOW,
        attempt=1,
        order_key="s",
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://h.test/cb", retry=DeliveryRetry(retries_6xx=1)),
    )
    assert decode_trigger(encode_trigger(trig)).callback == trig.callback


# -- callback retry: the tenant default ------------------------------------------------------


def test_tenant_retry_policy_is_optional_and_bounded() -> None:
    assert TenantConfig().retry_policy.empty
    cfg = TenantConfig.from_dict({"retry_policy": {"retries_6xx": 2}})
    assert cfg.retry_policy == RetryPolicyConfig(retries_6xx=2)
    assert TenantConfig.from_json(cfg.to_json()) == cfg
    for bad in ({"retries_6xx": 1001}, {"max_retry_age_s": -1}, {"retries_6xx": "2"}):
        with pytest.raises(ValueError, match="retry_policy"):
            TenantConfig.from_dict({"retry_policy": bad})


def test_stamp_retry_only_fills_a_missing_policy() -> None:
    policy = RetryPolicyConfig(retries_6xx=1)
    plain = HttpCallback(url="https://h.test/cb")
    assert stamp_retry(plain, policy).retry == DeliveryRetry(retries_6xx=1)
    explicit = replace(plain, retry=DeliveryRetry(max_retry_age_s=5.0))
    assert stamp_retry(explicit, policy) is explicit
    empty = replace(plain, retry=DeliveryRetry())  # explicit {}: the proxy's own settings
    assert stamp_retry(empty, policy) is empty
    assert stamp_retry(plain, RetryPolicyConfig()) is plain


def existing_row(callback: str) -> ScheduleRow:
    return ScheduleRow(
        tenant="acme",
        schedule_id="s1",
        partition=0,
        state="scheduled",
        due_ms=NOW,
        version=1,
        created_ms=NOW,
        updated_ms=NOW,
        callback=callback,
    )


def test_commands_get_the_tenant_default_and_repeats_compare_with_what_was_stored() -> None:
    cfg = TenantConfig(retry_policy=RetryPolicyConfig(retries_6xx=1))
    cb = HttpCallback(url="https://h.test/cb")
    cmd = CreateCommand(
        tenant="acme", schedule_id="s1", due_ms=NOW, callback=cb, misfire_tolerance_s=60
    )
    stamped = with_default_retry(cmd, cfg, None)
    assert isinstance(stamped, CreateCommand)
    assert stamped.callback.retry == DeliveryRetry(retries_6xx=1)
    # The schedule was stored before the tenant had a default: a repeat is still identical.
    repeat = with_default_retry(cmd, cfg, existing_row(callback_to_json(cb)))
    assert isinstance(repeat, CreateCommand)
    assert callback_to_json(repeat.callback) == callback_to_json(cb)
    update = UpdateCommand(tenant="acme", schedule_id="s1", callback=cb)
    up = with_default_retry(update, cfg, existing_row(callback_to_json(cb)))
    assert isinstance(up, UpdateCommand) and up.callback is not None
    assert up.callback.retry == DeliveryRetry(retries_6xx=1)  # an update is applied: stamp
    cancel = CancelCommand(tenant="acme", schedule_id="s1")
    assert with_default_retry(cancel, cfg, None) is cancel


def test_the_proxy_applies_a_callbacks_retry_over_its_own_policy() -> None:
    base = RetryPolicy(retries_6xx=3, max_retry_age_s=0.0, jitter=0.0)
    assert base.for_callback(None) is base
    assert base.for_callback(DeliveryRetry()) is base
    mine = base.for_callback(DeliveryRetry(retries_6xx=1))
    assert (mine.retries_6xx, mine.max_retry_age_s) == (1, 0.0)
    decisions = []
    state = AttemptState()
    for i in range(3):
        decision, state = decide(
            mine, state, HttpResult(status=600), now_s=float(i), rand=lambda: 0.0
        )
        decisions.append(type(decision).__name__)
    assert decisions == ["Retry", "DeadLetter", "DeadLetter"]  # 1 retry, not the proxy's 3


# -- per-tenant retention ----------------------------------------------------------------------


def test_schedule_rows_and_events_take_the_tenants_retention() -> None:
    store = Store(CassandraSettings(), retention_s=7 * 86_400)
    row = existing_row("{}")
    assert store.schedule_ttl_s(row, NOW) == 7 * 86_400
    assert store.schedule_ttl_s(row, NOW, 6000) == 6000  # due now: retention from now
    assert store.schedule_ttl_s(replace(row, due_ms=NOW + 10_000), NOW, 6000) == 6010
    assert store.schedule_ttl_s(replace(row, state="fired"), NOW, 6000) == 6000
    stmt = store.event_stmt("acme", "s1", "fired", NOW, None, None, NOW, 6000)
    assert stmt[1][-1] == 6000
    assert store.event_stmt("acme", "s1", "fired", NOW, None, None, NOW)[1][-1] == 7 * 86_400


def test_with_retention_applies_to_one_shots_not_recurring_parents() -> None:
    change = ScheduleChange(row=existing_row("{}"), new_bucket=None, old_bucket=None, now_ms=NOW)
    cfg = TenantConfig(retention_s=600)
    assert with_retention(change, cfg).retention_s == 600
    assert with_retention(change, TenantConfig()).retention_s is None
    assert with_retention(change, None).retention_s is None
    parent = replace(change, row=replace(change.row, recurrence='{"every_s":60}'))
    assert with_retention(parent, cfg).retention_s is None

"""The API's admission stamp (topics.admission): only a holder of the admission key makes
one, it covers every byte of the record's key and value, and it is fresh only on the
broker's clock."""

from __future__ import annotations

import pytest

from base.errors import ConfigError
from base.settings import Settings
from topics.admission import (
    HEADER_ADMISSION,
    Admission,
    AdmissionKey,
    AdmissionKeys,
    keys_of,
    stamp,
)
from topics.signing import MAX_SKEW_MS, TimestampType

OLD = AdmissionKey("k1", "o" * 40)
NEW = AdmissionKey("k2", "n" * 40)
KEY = b"sched-1"
VALUE = b'{"type":"create","tenant":"t","schedule_id":"sched-1","due":"2030-01-01T00:00:00Z"}'
AT = 1_800_000_000_000


def _verify(keys: AdmissionKeys, headers: dict[str, bytes], **kw: object) -> object:
    args: dict[str, object] = {
        "record_key": KEY,
        "value": VALUE,
        "record_ms": AT + 3,
        "timestamp_type": TimestampType.LOG_APPEND_TIME,
    }
    args.update(kw)
    return keys.verify(headers, **args)  # type: ignore[arg-type]


def _stamped(key: AdmissionKey = NEW, at: int = AT) -> dict[str, bytes]:
    name, value = stamp(key, admitted_at_ms=at, record_key=KEY, value=VALUE)
    return {name: value}


def test_a_stamp_verifies_under_the_key_that_made_it() -> None:
    got = _verify(AdmissionKeys(current=NEW), _stamped())
    assert isinstance(got, Admission)
    assert (got.key_id, got.admitted_at_ms) == ("k2", AT)


def test_no_stamp_is_none_not_a_failure() -> None:
    assert _verify(AdmissionKeys(current=NEW), {}) is None


@pytest.mark.parametrize(
    "change",
    [
        {"value": VALUE.replace(b"2030", b"2031")},  # a field of the command changed
        {"value": VALUE + b" "},
        {"record_key": b"sched-2"},  # the record key changed (another partition)
    ],
)
def test_changing_any_byte_of_the_record_breaks_it(change: dict[str, object]) -> None:
    got = _verify(AdmissionKeys(current=NEW), _stamped(), **change)
    assert got == "admission stamp does not match the record"


def test_a_stamp_made_with_another_secret_under_a_held_key_id_is_refused() -> None:
    forged = _stamped(AdmissionKey("k2", "f" * 40))
    assert _verify(AdmissionKeys(current=NEW), forged) == (
        "admission stamp does not match the record"
    )


def test_a_changed_admission_time_breaks_it() -> None:
    headers = _stamped()
    headers[HEADER_ADMISSION] = headers[HEADER_ADMISSION].replace(
        str(AT).encode(), str(AT + 1).encode()
    )
    assert isinstance(_verify(AdmissionKeys(current=NEW), headers), str)


def test_an_unknown_key_id_and_garbage_are_refused() -> None:
    keys = AdmissionKeys(current=NEW)
    assert _verify(keys, _stamped(OLD)) == "admission key 'k1' is not held by this worker"
    assert _verify(keys, {HEADER_ADMISSION: b"v1=yes"}) == "malformed admission stamp"
    assert _verify(keys, {HEADER_ADMISSION: b"\xff\xfe"}) == "malformed admission stamp"


def test_rotation_the_previous_key_still_verifies_and_a_dropped_one_does_not() -> None:
    rotating = AdmissionKeys(current=NEW, previous=OLD)
    assert isinstance(_verify(rotating, _stamped(OLD)), Admission)
    assert isinstance(_verify(rotating, _stamped(NEW)), Admission)
    assert isinstance(_verify(AdmissionKeys(current=NEW), _stamped(OLD)), str)


def test_fresh_only_on_the_brokers_clock() -> None:
    keys = AdmissionKeys(current=NEW)
    assert isinstance(_verify(keys, _stamped(), record_ms=AT + MAX_SKEW_MS), Admission)
    late = _verify(keys, _stamped(), record_ms=AT + MAX_SKEW_MS + 1)
    assert isinstance(late, str) and "append time" in late
    early = _verify(keys, _stamped(), record_ms=AT - MAX_SKEW_MS - 1)
    assert isinstance(early, str)
    producer_time = _verify(keys, _stamped(), timestamp_type=TimestampType.CREATE_TIME)
    assert producer_time == "the record's timestamp is not the broker's (LogAppendTime)"


def test_settings_read_both_keys_and_the_instances() -> None:
    s = Settings.from_env(
        {
            "TOCSIN_ADMISSION_KEY": "k2:" + "n" * 40,
            "TOCSIN_ADMISSION_PREVIOUS_KEY": "k1:" + "o" * 40,
            "TOCSIN_API_INSTANCES": "3",
        }
    )
    assert keys_of(s.admission.current, s.admission.previous) == AdmissionKeys(
        current=NEW, previous=OLD
    )
    assert s.admission.api_instances == 3
    assert "nnnn" not in repr(s)  # secrets are not in logs of the settings
    assert not keys_of(Settings.from_env({}).admission.current, None).enabled


@pytest.mark.parametrize("raw", ["k1", "k1:short", ":" + "x" * 40, "x" * 33 + ":" + "y" * 40])
def test_settings_refuse_a_malformed_or_weak_key(raw: str) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env({"TOCSIN_ADMISSION_KEY": raw})

"""The ``recurrence`` object of create and update commands: decoding, rejections, codec."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from base.errors import CommandRejected
from topics.codec import encode_command, recurrence_from_json, recurrence_to_json
from topics.codes import Code
from topics.ids import parse_iso_ms
from topics.models import (
    Ambiguous,
    CreateCommand,
    Misfire,
    Nonexistent,
    Recurrence,
    UpdateCommand,
)
from topics.recurrence import RECURRING_DEFAULT_MISFIRE_TOLERANCE_S, normalize_cron
from topics.validation import Limits, decode_command

NOW = parse_iso_ms("2026-11-21T17:00:00Z")
BASE: dict[str, Any] = {
    "type": "create",
    "tenant": "acme",
    "schedule_id": "r1",
    "callback": {"type": "http", "url": "https://h.example/cb"},
}


def decode(obj: dict[str, Any]) -> Any:
    return decode_command(orjson.dumps(obj), key=b"r1", now_ms=NOW, limits=Limits())


def rejected(obj: dict[str, Any]) -> CommandRejected:
    with pytest.raises(CommandRejected) as caught:
        decode(obj)
    return caught.value


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("*/5 * * * *", "0 */5 * * * *"),
        ("  30  8 * *   MON-fri ", "0 30 8 * * mon-fri"),
        ("15 30 8 * * *", "15 30 8 * * *"),
        ("@hourly", "0 0 * * * *"),
        ("@daily", "0 0 0 * * *"),
        ("@yearly", "0 0 0 1 1 *"),
        ("0 0 * * 7", "0 0 0 * * 0"),
        ("0 0 * * 5-7", "0 0 0 * * 0,5,6"),
        ("0 0 1 jan,jul *", "0 0 0 1 jan,jul *"),
    ],
)
def test_cron_is_normalised_to_six_fields(given: str, normal: str) -> None:
    assert normalize_cron(given) == normal


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("* * * *", "must have 5 fields"),
        ("* * * * * * *", "must have 5 fields"),
        ("60 * * * *", "outside"),
        ("* 24 * * *", "outside"),
        ("* * 0 * *", "outside"),
        ("* * * 13 *", "outside"),
        ("* * * * 8", "outside"),
        ("5-1 * * * *", "not ascending"),
        ("*/0 * * * *", "outside"),
        ("0 0 L * *", "not a valid"),
        ("0 0 * * 5L", "not a valid"),
        ("0 0 * * 1#2", "not standard"),
        ("0 0 ? * *", "not standard"),
        ("H * * * *", "not a valid"),
        ("0 0 30 2 *", "never matches"),
        ("0 0 31 4,6 *", "never matches"),
        ("@reboot", "is not one of"),
        ("", "must have 5 fields"),
    ],
)
def test_bad_cron_expressions_are_rejected(expr: str, why: str) -> None:
    err = rejected({**BASE, "recurrence": {"cron": expr}})
    assert err.code == Code.INVALID_FIELD and why in err.message, err.message


def test_day_31_or_weekday_is_fine_when_both_day_fields_are_restricted() -> None:
    assert normalize_cron("0 0 30 2 mon") == "0 0 0 30 2 mon"  # Mondays in February


def test_a_recurring_create_decodes_with_defaults() -> None:
    cmd = decode({**BASE, "recurrence": {"cron": "*/5 * * * *"}})
    assert isinstance(cmd, CreateCommand)
    assert cmd.recurrence == Recurrence(cron="0 */5 * * * *")
    assert cmd.recurrence.time_zone == "UTC"
    assert cmd.recurrence.nonexistent is Nonexistent.SKIP
    assert cmd.recurrence.ambiguous is Ambiguous.ONCE
    assert cmd.recurrence.misfire is Misfire.FIRE_LATEST
    assert cmd.misfire_tolerance_s == RECURRING_DEFAULT_MISFIRE_TOLERANCE_S


def test_every_field_of_a_recurrence() -> None:
    cmd = decode(
        {
            **BASE,
            "misfire_tolerance_s": 300,
            "recurrence": {
                "every_s": 90,
                "start": "2030-01-01T00:00:00+01:00",
                "end": 1_900_000_000_000,
                "max_runs": 10,
                "time_zone": "Australia/Lord_Howe",
                "nonexistent": "shift_forward",
                "ambiguous": "twice",
                "jitter_s": 30,
                "misfire": "fire_all",
            },
        }
    )
    assert cmd.misfire_tolerance_s == 300
    assert cmd.recurrence == Recurrence(
        every_s=90,
        start_ms=parse_iso_ms("2029-12-31T23:00:00Z"),
        end_ms=1_900_000_000_000,
        max_runs=10,
        time_zone="Australia/Lord_Howe",
        nonexistent=Nonexistent.SHIFT_FORWARD,
        ambiguous=Ambiguous.TWICE,
        jitter_s=30,
        misfire=Misfire.FIRE_ALL,
    )
    assert recurrence_from_json(recurrence_to_json(cmd.recurrence)) == cmd.recurrence
    again = decode_command(encode_command(cmd), key=b"r1", now_ms=NOW, limits=Limits())
    assert again == cmd


@pytest.mark.parametrize(
    ("recurrence", "code", "why"),
    [
        ({}, Code.INVALID_FIELD, "exactly one of cron and every_s"),
        ({"cron": "* * * * *", "every_s": 5}, Code.INVALID_FIELD, "exactly one"),
        ({"every_s": 0}, Code.INVALID_FIELD, "every_s must be within"),
        ({"every_s": 1.5}, Code.INVALID_FIELD, "integer"),
        ({"every_s": "90"}, Code.INVALID_FIELD, "every_s"),
        ({"every_s": 5, "time_zone": "Mars/Olympus"}, Code.INVALID_FIELD, "IANA"),
        ({"every_s": 5, "time_zone": "../../etc/passwd"}, Code.INVALID_FIELD, "IANA"),
        ({"every_s": 5, "time_zone": "/etc/localtime"}, Code.INVALID_FIELD, "IANA"),
        ({"every_s": 5, "nonexistent": "later"}, Code.INVALID_FIELD, "shift_forward"),
        ({"every_s": 5, "ambiguous": 2}, Code.INVALID_FIELD, "twice"),
        ({"every_s": 5, "misfire": "all"}, Code.INVALID_FIELD, "fire_latest"),
        ({"every_s": 5, "jitter_s": -1}, Code.INVALID_FIELD, "jitter_s"),
        ({"every_s": 5, "max_runs": 0}, Code.INVALID_FIELD, "max_runs"),
        ({"every_s": 5, "start": "2030-01-01T00:00:00"}, Code.INVALID_DUE, "start"),
        ({"every_s": 5, "end": 1000}, Code.DUE_IN_PAST, "end"),
        (
            {"every_s": 5, "start": 1_900_000_000_000, "end": 1_899_000_000_000},
            Code.INVALID_FIELD,
            "after recurrence.start",
        ),
        ({"every_s": 5, "cronn": "x"}, Code.INVALID_FIELD, "unknown field"),
        ("every 5 s", Code.INVALID_FIELD, "must be an object"),
    ],
)
def test_bad_recurrences_name_their_field(recurrence: Any, code: Code, why: str) -> None:
    err = rejected({**BASE, "recurrence": recurrence})
    assert err.code == code and why in err.message, err.message


def test_a_create_needs_exactly_one_of_due_and_recurrence() -> None:
    err = rejected(BASE)
    assert err.code == Code.MISSING_FIELD and "'due'" in err.message
    both = rejected({**BASE, "due": NOW + 60_000, "recurrence": {"every_s": 5}})
    assert both.code == Code.INVALID_FIELD and "not both" in both.message


def test_an_update_may_replace_the_recurrence() -> None:
    cmd = decode(
        {
            "type": "update",
            "tenant": "acme",
            "schedule_id": "r1",
            "recurrence": {"cron": "@hourly", "time_zone": "Asia/Kolkata"},
        }
    )
    assert isinstance(cmd, UpdateCommand)
    assert cmd.recurrence == Recurrence(cron="0 0 * * * *", time_zone="Asia/Kolkata")
    err = rejected(
        {
            "type": "update",
            "tenant": "acme",
            "schedule_id": "r1",
            "due": NOW + 1000,
            "recurrence": {"every_s": 5},
        }
    )
    assert err.code == Code.INVALID_FIELD
    again = decode_command(encode_command(cmd), key=b"r1", now_ms=NOW, limits=Limits())
    assert again == cmd

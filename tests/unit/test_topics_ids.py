"""Trigger ids never change; RFC 3339 <-> epoch ms."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topics.ids import (
    MAX_EPOCH_MS,
    MIN_EPOCH_MS,
    NAMESPACE,
    format_iso_ms,
    parse_iso_ms,
    trigger_id,
)

# Golden values: if one of these changes, every consumer's deduplication breaks.
GOLDEN = [
    ("acme", "order-42", 1_893_517_205_000, "e9464060545c58b7bc11ff77204bbdbd"),
    ("acme", "order-42", 1_893_517_205_001, trigger_id("acme", "order-42", 1_893_517_205_001)),
]


def test_namespace_is_fixed() -> None:
    assert uuid.UUID("00656fcb-ba61-4d92-9ada-684def13749f") == NAMESPACE


def test_trigger_id_golden() -> None:
    assert trigger_id("acme", "order-42", 1_893_517_205_000) == "e9464060545c58b7bc11ff77204bbdbd"
    assert trigger_id("t", "a/b", 0) == uuid.uuid5(NAMESPACE, "t/a/b/0").hex


def test_trigger_id_shape_and_sensitivity() -> None:
    base = trigger_id("acme", "s1", 1000)
    assert len(base) == 32 and int(base, 16) >= 0 and base == base.lower()
    assert trigger_id("acme", "s1", 1000) == base
    assert (
        len(
            {
                base,
                trigger_id("acme", "s1", 1001),
                trigger_id("acme", "s2", 1000),
                trigger_id("acm", "s1", 1000),
            }
        )
        == 4
    )


@given(
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
    st.integers(min_value=MIN_EPOCH_MS, max_value=MAX_EPOCH_MS),
)
def test_trigger_id_is_a_pure_function(tenant: str, schedule_id: str, due_ms: int) -> None:
    assert trigger_id(tenant, schedule_id, due_ms) == trigger_id(tenant, schedule_id, due_ms)
    assert uuid.UUID(hex=trigger_id(tenant, schedule_id, due_ms)).version == 5


PARSE = [
    ("1970-01-01T00:00:00Z", 0),
    ("2030-01-01T17:00:05Z", 1_893_517_205_000),
    ("2030-01-01t17:00:05z", 1_893_517_205_000),
    ("2030-01-01T18:00:05+01:00", 1_893_517_205_000),
    ("2030-01-01T16:30:05-00:30", 1_893_517_205_000),
    ("2030-01-01T17:00:05.1Z", 1_893_517_205_100),
    ("2030-01-01T17:00:05.12Z", 1_893_517_205_120),
    ("2030-01-01T17:00:05.999999999Z", 1_893_517_205_999),
    ("2030-01-01T17:00:05.000+00:00", 1_893_517_205_000),
    ("1970-01-01T00:00:00.5+00:01", -59_500),
    ("9999-12-31T23:59:59.999Z", MAX_EPOCH_MS),
    ("2028-02-29T00:00:00Z", 1_835_395_200_000),
]


@pytest.mark.parametrize(("text", "ms"), PARSE)
def test_parse_iso_ms(text: str, ms: int) -> None:
    assert parse_iso_ms(text) == ms


@pytest.mark.parametrize(
    "text",
    [
        "2030-01-01T17:00:05",
        "2030-01-01",
        "2030-01-01 17:00:05Z",
        "2030-01-01T17:00:05.Z",
        "2030-01-01T17:00:05.1234567890Z",
        "2030-01-01T17:00:05+0100",
        "2030-01-01T17:00:05+01",
        "2030-01-01T17:00:05+24:00",
        "2030-01-01T17:00:05+01:60",
        "2030-13-01T17:00:05Z",
        "2030-02-29T17:00:05Z",
        "2030-01-01T24:00:00Z",
        "0000-01-01T00:00:00Z",
        " 2030-01-01T17:00:05Z",
        "2030-01-01T17:00:05Z\n",
        "20300101T170005Z",
        "\uff12\uff10\uff13\uff10-01-01T17:00:05Z",
        "",
    ],
)
def test_parse_iso_ms_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_iso_ms(text)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (1_893_517_205_007, "2030-01-01T17:00:05.007Z"),
        (MAX_EPOCH_MS, "9999-12-31T23:59:59.999Z"),
    ],
)
def test_format_iso_ms(ms: int, text: str) -> None:
    assert format_iso_ms(ms) == text


@pytest.mark.parametrize("ms", [-1, MAX_EPOCH_MS + 1])
def test_format_iso_ms_range(ms: int) -> None:
    with pytest.raises(ValueError):
        format_iso_ms(ms)


@given(st.integers(min_value=MIN_EPOCH_MS, max_value=MAX_EPOCH_MS))
def test_format_then_parse_round_trips(ms: int) -> None:
    text = format_iso_ms(ms)
    assert parse_iso_ms(text) == ms
    assert len(text) == 24


@given(st.integers(min_value=MIN_EPOCH_MS, max_value=MAX_EPOCH_MS - 1))
def test_formatted_times_sort_as_text(ms: int) -> None:
    assert format_iso_ms(ms) < format_iso_ms(ms + 1)

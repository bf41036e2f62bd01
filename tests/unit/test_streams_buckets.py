"""Bucket arithmetic: minute floors, shards, minute ranges and TTLs, at their boundaries."""

from __future__ import annotations

import zlib

import pytest

from streams.buckets import (
    BUCKET_MS,
    MAX_TTL_S,
    BucketKey,
    max_due_ms,
    minute_ms,
    minutes_between,
    shard_of,
    ttl_s,
)

T0 = 1_763_744_400_000  # 2025-11-21T17:00:00Z, a minute start


@pytest.mark.parametrize(
    ("due_ms", "expected"),
    [
        (T0, T0),  # exact minute start stays
        (T0 + 1, T0),
        (T0 + 59_999, T0),  # 1 ms before the next minute
        (T0 + 60_000, T0 + 60_000),
        (T0 - 1, T0 - 60_000),  # 1 ms before this minute
        (0, 0),
        (59_999, 0),
    ],
)
def test_minute_ms_floors_to_minute(due_ms: int, expected: int) -> None:
    assert minute_ms(due_ms) == expected


@pytest.mark.parametrize(
    ("from_ms", "to_ms", "expected"),
    [
        (T0, T0, [T0]),
        (T0, T0 + 59_999, [T0]),
        (T0, T0 + 60_000, [T0, T0 + BUCKET_MS]),
        (T0 - 1, T0, [T0 - BUCKET_MS, T0]),
        (T0 + 30_000, T0 + 150_000, [T0, T0 + BUCKET_MS, T0 + 2 * BUCKET_MS]),
        (T0 + 1, T0, []),  # empty range
    ],
)
def test_minutes_between_is_inclusive(from_ms: int, to_ms: int, expected: list[int]) -> None:
    assert minutes_between(from_ms, to_ms) == expected


@pytest.mark.parametrize(
    ("due_ms", "now_ms", "retention_s", "expected"),
    [
        (T0 + 60_000, T0, 100, 160),  # whole seconds
        (T0 + 60_001, T0, 100, 161),  # a partial second rounds up, never expires early
        (T0 + 59_999, T0, 100, 160),
        (T0, T0, 100, 100),  # due now
        (T0 - 30_000, T0, 100, 70),  # already past due (late create within tolerance)
        (T0 - 1_500, T0, 100, 99),  # ceil(-1.5) = -1
        (T0 - 200_000, T0, 100, 1),  # never 0 (which would mean "no TTL")
        (T0, T0, 0, 1),
    ],
)
def test_ttl_s(due_ms: int, now_ms: int, retention_s: int, expected: int) -> None:
    assert ttl_s(due_ms, now_ms, retention_s) == expected


def test_ttl_s_rejects_more_than_cassandra_allows() -> None:
    assert ttl_s(max_due_ms(T0, 100), T0, 100) == MAX_TTL_S
    with pytest.raises(ValueError, match="maximum"):
        ttl_s(max_due_ms(T0, 100) + 1_000, T0, 100)


def test_shard_of_is_stable_and_in_range() -> None:
    # Pinned: stored buckets depend on this exact mapping.
    assert shard_of("acme", "order-42", 16) == zlib.crc32(b"acme\x00order-42") % 16
    shards = {shard_of("acme", f"s-{i}", 8) for i in range(1000)}
    assert shards == set(range(8))  # spreads over every shard
    assert all(shard_of("t", f"s-{i}", 1) == 0 for i in range(50))


def test_shard_of_separates_tenant_and_id() -> None:
    values = {shard_of("ab", "c", 1 << 30), shard_of("a", "bc", 1 << 30)}
    assert len(values) == 2


def test_shard_of_rejects_zero_shards() -> None:
    with pytest.raises(ValueError):
        shard_of("t", "s", 0)


def test_bucket_key_of_derives_minute_and_shard() -> None:
    key = BucketKey.of(partition=3, due_ms=T0 + 61_234, tenant="t", schedule_id="s", shards=4)
    assert key == BucketKey(
        partition=3,
        minute_ms=T0 + 60_000,
        shard=shard_of("t", "s", 4),
        due_ms=T0 + 61_234,
        tenant="t",
        schedule_id="s",
    )

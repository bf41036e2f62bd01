"""Kafka default partitioner: Java Utils.murmur2 vectors and kafka-python/aiokafka partitions."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import DefaultPartitioner

from streams.partitioner import murmur2, partition_for, to_positive


# org.apache.kafka.common.utils.UtilsTest#testMurmur2 (signed Java ints).
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
    ],
)
def test_murmur2_matches_java(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected


# kafka-python's test_murmur2_java_compatibility: partitions out of 1000, as chosen by the
# Java producer. Covers every tail length (0..3 bytes after the 4-byte blocks).
@pytest.mark.parametrize(
    ("key", "partition"),
    [(b"", 681), (b"a", 524), (b"ab", 434), (b"abc", 107), (b"123456789", 566), (b"\x00 ", 742)],
)
def test_partition_matches_java_producer(key: bytes, partition: int) -> None:
    assert partition_for(key, 1000) == partition


def test_str_keys_are_utf8() -> None:
    assert partition_for("ordér-42", 12) == partition_for("ordér-42".encode(), 12)


def test_matches_aiokafka_default_partitioner() -> None:
    # Faust producers (aiokafka) must put a schedule id where we expect it too.
    partitions = list(range(8))
    aiokafka_partitioner = DefaultPartitioner()
    for i in range(500):
        key = f"tenant-{i % 7}/schedule-{i}".encode()
        assert partition_for(key, 8) == aiokafka_partitioner(key, partitions, partitions)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-1, 0x7FFFFFFF), (-(2**31), 0), (0, 0), (5, 5), (2**31 - 1, 2**31 - 1)],
)
def test_to_positive_clears_sign_bit(value: int, expected: int) -> None:
    assert to_positive(value) == expected


def test_partition_for_rejects_zero_partitions() -> None:
    with pytest.raises(ValueError):
        partition_for(b"k", 0)

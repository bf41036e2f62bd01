"""Kafka's default key partitioner, so Tocsin can compute the commands-topic partition of a
schedule id without asking a producer.

The bucket rows of a schedule are stored under the commands-topic partition its id hashes to
(docs/design.md), so the worker that owns commands partition p fires bucket p. That only
works if this function agrees byte for byte with what producers choose: the Java client's
``Utils.toPositive(Utils.murmur2(key)) % partitions``, which librdkafka's ``murmur2_random``
and aiokafka's default partitioner reproduce for non-null keys. (librdkafka's own default,
``consistent_random``, is CRC32-based and does NOT match: every Tocsin producer of the
commands topic must set ``partitioner=murmur2_random``.)

Pure: must never do I/O, and must never change (stored buckets depend on it).
"""

from __future__ import annotations

import struct

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK32 = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Java's ``org.apache.kafka.common.utils.Utils.murmur2``: a signed 32-bit int.

    Python ints are unbounded, so every multiplication is masked to 32 bits to mimic Java's
    wrapping int arithmetic, and ``>>`` on the unsigned value plays Java's ``>>>``.
    """
    length = len(data)
    h = (_SEED ^ length) & _MASK32
    body = length - length % 4
    # The 4-byte little-endian words in one call (a quarter off the hash of a schedule id,
    # computed on every command by the API and again by its worker).
    for k in struct.unpack_from(f"<{body // 4}I", data):
        k = (k * _M) & _MASK32
        k ^= k >> 24
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    tail = length % 4
    # The Java switch falls through: case 3 also does cases 2 and 1.
    if tail == 3:
        h ^= data[body + 2] << 16
    if tail >= 2:
        h ^= data[body + 1] << 8
    if tail >= 1:
        h ^= data[body]
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    # Back to Java's signed int so results compare with Java test vectors.
    return h - (1 << 32) if h & 0x80000000 else h


def to_positive(value: int) -> int:
    """Java's ``Utils.toPositive``: clear the sign bit (not ``abs``, which breaks on MIN_VALUE)."""
    return value & 0x7FFFFFFF


def partition_for(key: bytes | str, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for ``key`` (str keys are UTF-8)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    data = key.encode() if isinstance(key, str) else key
    return to_positive(murmur2(data)) % partitions

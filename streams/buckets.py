"""Bucket arithmetic: which Cassandra minute bucket and shard a schedule lives in, and how long
its rows must live.

A schedule due at ``due_ms`` is stored in the bucket ``(partition, minute_ms(due_ms), shard)``
where ``partition`` is the commands-topic partition of its id (see streams.partitioner) and
``shard`` spreads one hot minute over several Cassandra partitions (go-scheduler's "poller
count id"). Reading a minute is then one paged query per shard.

Pure: no I/O, no clock. Every time is an explicit epoch-millisecond argument so callers and
tests decide what "now" is. This module must never read the clock, the environment or the
network, and the mapping functions must never change for existing data: a changed
``shard_of`` would strand every stored bucket row.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

# The width of a bucket: a schedule's bucket is its due time floored to a multiple of it,
# and a ticker reads one bucket per step of it. The keyspace's deployment binding records
# it (streams.binding), so a worker built with another width refuses a keyspace whose
# buckets it would read at the wrong instants.
BUCKET_MS = 60_000
# The width of a keyspace whose binding row does not record one (written before it did).
UNRECORDED_BUCKET_MS = 60_000

# Cassandra rejects a TTL above 20 years (630,720,000 s); a row that would need more cannot
# be written, so validation must reject due times beyond ``max_due_ms``.
MAX_TTL_S = 630_720_000


def minute_ms(due_ms: int) -> int:
    """The start of the bucket holding ``due_ms`` (floor to a multiple of ``BUCKET_MS``)."""
    return due_ms - due_ms % BUCKET_MS


def shard_of(tenant: str, schedule_id: str, shards: int) -> int:
    """The bucket shard of a schedule, in ``range(shards)``, stable across processes.

    crc32 rather than ``hash()``: Python's str hash is salted per process, and every worker
    (and every restart) must agree. The NUL separator keeps ("ab", "c") and ("a", "bc") apart.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1:
        return 0
    key = f"{tenant}\x00{schedule_id}".encode()
    return zlib.crc32(key) % shards


def minutes_between(from_ms: int, to_ms: int) -> list[int]:
    """Starts of every minute overlapping ``[from_ms, to_ms]``, both ends inclusive.

    Empty when ``to_ms < from_ms``. Used by catch-up to list the buckets between the
    checkpoint and now.
    """
    if to_ms < from_ms:
        return []
    return list(range(minute_ms(from_ms), minute_ms(to_ms) + 1, BUCKET_MS))


def ttl_s(due_ms: int, now_ms: int, retention_s: int) -> int:
    """Seconds a row written at ``now_ms`` for a fire at ``due_ms`` must live.

    Until the due time plus ``retention_s`` (so status and catch-up still find it after the
    fire), rounded up to whole seconds, at least 1 (Cassandra treats TTL 0 as "no TTL",
    which would keep a past-due row forever). Raises ValueError above Cassandra's maximum.
    """
    remaining_ms = due_ms - now_ms
    # Ceiling division: a row must never expire before due + retention.
    ttl = -(-remaining_ms // 1000) + retention_s
    if ttl > MAX_TTL_S:
        raise ValueError(
            f"TTL {ttl} s exceeds Cassandra's maximum {MAX_TTL_S} s (due_ms={due_ms}, "
            f"now_ms={now_ms}, retention_s={retention_s})"
        )
    return max(1, ttl)


def max_due_ms(now_ms: int, retention_s: int) -> int:
    """The latest due time whose rows can still be stored (see ``ttl_s``)."""
    return now_ms + (MAX_TTL_S - retention_s) * 1000


@dataclass(frozen=True, slots=True)
class BucketKey:
    """The full primary key of one bucket row (partition key + clustering columns)."""

    partition: int
    minute_ms: int
    shard: int
    due_ms: int
    tenant: str
    schedule_id: str

    @classmethod
    def of(
        cls, *, partition: int, due_ms: int, tenant: str, schedule_id: str, shards: int
    ) -> BucketKey:
        """The key of the row for a schedule due at ``due_ms`` on commands partition
        ``partition``; the minute and shard are derived, so callers cannot get them wrong."""
        return cls(
            partition=partition,
            minute_ms=minute_ms(due_ms),
            shard=shard_of(tenant, schedule_id, shards),
            due_ms=due_ms,
            tenant=tenant,
            schedule_id=schedule_id,
        )

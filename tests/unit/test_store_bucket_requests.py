"""How ``Store.write_buckets`` groups bucket rows into Cassandra requests: each bucket
partition's rows in chunks under the byte cap, one partition per request. Cassandra
refused requests of several bucket partitions that the estimate kept under the cap with
"Batch too large" (its own measure against ``batch_size_fail_threshold``, 50 KiB stock;
the materialiser's runs in test_recurring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cassandra.query import UNSET_VALUE

from base.settings import CassandraSettings
from streams.buckets import BucketKey
from streams.cql import _stmt_bytes
from streams.model import Stmt
from streams.store import Store, _row_bytes
from tests.fakes import bucket_row

M = 1_763_744_400_000  # a minute boundary


class Recording(Store):
    """A store that records the requests it would send."""

    def __init__(self, **options: int) -> None:
        super().__init__(CassandraSettings(), **options)  # type: ignore[arg-type]
        self.requests: list[list[Stmt]] = []

    async def run_together(self, name: str, statements: Sequence[Stmt]) -> None:
        self.requests.append(list(statements))


def rows(partitions: int, per_partition: int) -> list:  # type: ignore[type-arg]
    return [
        replace(bucket_row(f"p{p}-{i}", M + 1_000 + i), partition=p)
        for p in range(partitions)
        for i in range(per_partition)
    ]


def partitions_of(request: list[Stmt]) -> set[int]:
    return {int(str(params[0])) for _, params in request}


async def test_each_bucket_partition_goes_in_a_request_of_its_own() -> None:
    store = Recording(commit_group_size=4)
    await store.write_buckets(
        put=rows(10, 3), delete=[BucketKey(1, M, 0, M + 5_000, "t", "gone")], now_ms=M
    )
    assert [partitions_of(r) for r in store.requests] == [{p} for p in range(10)]
    assert sum(len(r) for r in store.requests) == 31


async def test_the_byte_cap_splits_a_partitions_rows() -> None:
    two = rows(2, 2)
    # Room for one row of a partition, not two.
    store = Recording(commit_group_size=16, max_batch_bytes=_row_bytes(two[0]) + 1)
    await store.write_buckets(put=two, now_ms=M)
    assert [partitions_of(r) for r in store.requests] == [{0}, {0}, {1}, {1}]
    assert [len(r) for r in store.requests] == [1, 1, 1, 1]


def test_a_statements_estimated_size() -> None:
    # 64 a statement, 16 a value plus its length, or 8 for a value without one.
    stmt: Stmt = ("put", ["ab", b"cde", 5, UNSET_VALUE, None])
    assert _stmt_bytes(stmt) == 64 + (16 + 2) + (16 + 3) + 3 * (16 + 8)

"""How ``Store.write_buckets`` groups bucket rows into Cassandra requests: each bucket
partition's rows stay whole in one request (under the byte cap), and up to
``commit_group_size`` partitions share one."""

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


async def test_bucket_partitions_share_requests_up_to_the_group_size() -> None:
    store = Recording(commit_group_size=4)
    await store.write_buckets(put=rows(10, 3), now_ms=M)
    assert [len(partitions_of(r)) for r in store.requests] == [4, 4, 2]
    assert sum(len(r) for r in store.requests) == 30


async def test_a_group_size_of_one_keeps_one_partition_per_request() -> None:
    store = Recording(commit_group_size=1)
    await store.write_buckets(
        put=rows(3, 2), delete=[BucketKey(1, M, 0, M + 5_000, "t", "gone")], now_ms=M
    )
    assert [partitions_of(r) for r in store.requests] == [{0}, {1}, {2}]
    assert sum(len(r) for r in store.requests) == 7


async def test_the_byte_cap_splits_requests_but_never_a_partitions_chunk() -> None:
    two = rows(4, 2)
    # Room for two partitions' two rows each, not three partitions'.
    store = Recording(commit_group_size=16, max_batch_bytes=4 * _row_bytes(two[0]) + 1)
    await store.write_buckets(put=two, now_ms=M)
    assert [partitions_of(r) for r in store.requests] == [{0, 1}, {2, 3}]
    assert [len(r) for r in store.requests] == [4, 4]


def test_a_statements_estimated_size() -> None:
    # 64 a statement, 16 a value plus its length, or 8 for a value without one.
    stmt: Stmt = ("put", ["ab", b"cde", 5, UNSET_VALUE, None])
    assert _stmt_bytes(stmt) == 64 + (16 + 2) + (16 + 3) + 3 * (16 + 8)

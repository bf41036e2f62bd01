"""A command that fails for a reason of its own is answered alone; the rest of its batch
proceeds; an unavailable store is waited out (fake store and sink, no servers)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from base.errors import CommandRejected, StoreError
from streams.commands import CommandProcessor, RawCommand
from streams.cql import pack_groups
from streams.decisions import check_storable
from streams.emitter import produce_retriable
from streams.partitioner import partition_for
from tests.unit.test_fault_properties import (
    NOW,
    PARTITIONS,
    SECRET,
    FakeSink,
    FakeStore,
    good_record,
)
from topics.codec import decode_result, encode_command
from topics.models import CreateCommand, HttpCallback, PayloadType
from topics.signing import sign_headers
from topics.validation import Limits


def picky(error: BaseException | None = None, outages: int = 0) -> FakeStore:
    """The fake (tenant acme) refusing any write that includes the schedule ``poison``
    with ``error``, and failing the first ``outages`` writes as unavailable."""
    store = FakeStore()
    if outages:
        unavailable = StoreError("cassandra put_schedule failed: NoHostAvailable", retriable=True)
        store.inject("apply_schedule_changes", unavailable, times=outages)
    if error is not None:
        store.inject(
            "apply_schedule_changes",
            error,
            times=None,
            when=lambda call: "poison" in [c.row.schedule_id for c in call.args[0]],
        )
    return store


def applied(store: FakeStore) -> list[str]:
    return [sid for _, sid in store.schedules]


def record(sid: str, offset: int, due_ms: int = NOW + 3_600_000) -> RawCommand:
    value = encode_command(
        CreateCommand(
            tenant="acme",
            schedule_id=sid,
            due_ms=due_ms,
            payload=b'{"a":1}',
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url="https://h.example/cb"),
            misfire_tolerance_s=60,
        )
    )
    key = sid.encode()
    return replace(
        good_record(offset),
        key=key,
        value=value,
        partition=partition_for(key, PARTITIONS),
        headers=sign_headers(SECRET, signed_at_ms=NOW, key=key, value=value),
    )


def answers(sink: FakeSink) -> dict[str, str]:
    return {str(r.schedule_id): str(r.code) for r in (decode_result(v) for _, _, v in sink.sent)}


def run(store: FakeStore, batch: list[RawCommand]) -> tuple[FakeSink, list[float]]:
    sink, slept = FakeSink(), []

    async def sleep(s: float) -> None:
        slept.append(s)

    processor = CommandProcessor(
        store=store,
        sink=sink,
        tickers={},
        results_topic="t.command-results",
        partitions=PARTITIONS,
        limits=Limits(),
        clock_ms=lambda: NOW,
        sleep=sleep,
    )
    asyncio.run(processor.process_until_answered(batch))
    return sink, slept


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (
            StoreError(
                "cassandra put_schedule failed: InvalidRequest: Batch too large", retriable=False
            ),
            "store_rejected",
        ),
        (ValueError("TTL exceeds Cassandra's maximum"), "internal_error"),
    ],
)
def test_a_command_failing_for_good_is_answered_alone_and_the_batch_proceeds(
    error: BaseException, code: str
) -> None:
    store = picky(error)
    batch = [record("a", 1), record("poison", 2), record("b", 3)]
    sink, slept = run(store, batch)
    assert answers(sink) == {"a": "ok", "poison": code, "b": "ok"}
    assert sorted(applied(store)) == ["a", "b"]
    assert slept == []  # nothing waits for what waiting cannot fix


def test_an_unavailable_store_is_waited_out_with_backoff_not_answered() -> None:
    store = picky(outages=3)
    sink, slept = run(store, [record("a", 1), record("b", 2)])
    assert answers(sink) == {"a": "ok", "b": "ok"}
    assert slept == [0.5, 1.0, 2.0]


def test_a_create_due_beyond_what_cassandra_can_keep_is_rejected_alone() -> None:
    store = picky()
    far = 2_524_608_000_000  # 2050-01-01
    sink, _ = run(store, [record("a", 1), record("far", 2, due_ms=far), record("b", 3)])
    assert answers(sink) == {"a": "ok", "far": "beyond_horizon", "b": "ok"}


def test_a_create_due_at_the_last_representable_instant_is_rejected_alone() -> None:
    """9999-12-31T23:59:59.999Z is also the recurring rules' 'never' marker; as a due time
    it is just too far ahead."""
    store = picky()
    sink, _ = run(
        store, [record("a", 1), record("max", 2, due_ms=253_402_300_799_999), record("b", 3)]
    )
    assert answers(sink) == {"a": "ok", "max": "beyond_horizon", "b": "ok"}
    with pytest.raises(CommandRejected, match="beyond_horizon"):
        check_storable(253_402_300_799_999, NOW, 7 * 24 * 3600)


def test_storable_limit_follows_retention() -> None:
    year_s = 365 * 24 * 3600
    check_storable(NOW + 19 * year_s * 1000, NOW, 7 * 24 * 3600)
    with pytest.raises(CommandRejected, match="beyond_horizon"):
        check_storable(NOW + 19 * year_s * 1000, NOW, 2 * year_s)  # a tenant's retention_s
    check_storable(None, NOW, 0)


def test_pack_groups_bounds_count_and_bytes_and_sends_an_oversized_group_alone() -> None:
    def group(nbytes: int) -> list[tuple[str, list[Any]]]:
        return [("put_schedule", [b"x" * nbytes]), ("event", ["e"])]

    groups = [group(10_000)] * 7 + [group(60_000)] + [group(100)] * 3
    packed = pack_groups(groups, max_count=4, max_bytes=40_000)
    assert [i for batch in packed for i in batch] == list(range(len(groups)))
    for batch in packed:
        assert len(batch) <= 4
        if len(batch) > 1:
            assert sum(len(groups[i][0][1][0]) for i in batch) <= 40_000
    assert [7] in packed  # the 60 KB group is alone: a single-partition batch is never refused


class _Err:
    def __init__(self, code: int) -> None:
        self._code = code

    def code(self) -> int:
        return self._code


def test_produce_errors_are_permanent_only_for_the_record_itself() -> None:
    from confluent_kafka import KafkaError as K

    assert produce_retriable(_Err(K._MSG_TIMED_OUT))
    assert produce_retriable(_Err(K._ALL_BROKERS_DOWN))
    assert produce_retriable(_Err(K.NOT_ENOUGH_REPLICAS))
    assert not produce_retriable(_Err(K.MSG_SIZE_TOO_LARGE))
    assert not produce_retriable(_Err(K.INVALID_RECORD))

"""The retry lane co-partitioned with the main lane: where a source partition's parked
records go (``RetryLayout``), and the following reader that moves with the main lane."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.parker import ParkReason
from proxy.parking import RetryLayout, retry_layout
from proxy.reader import Reader
from proxy.state import SharedState
from tests.unit.test_proxy_lanes import (
    RETRIES,
    AckingOutbox,
    envelope,
    later,
    parkers,
    settings,
    writers,
)


def test_one_source_topic_parks_partition_p_to_retries_partition_p() -> None:
    layout = retry_layout({"fires": 4}, 4)
    assert layout is not None
    assert [layout.retry_partition("fires", p) for p in range(4)] == [0, 1, 2, 3]
    assert layout.followed([("fires", 1), ("fires", 3)]) == {1, 3}
    assert layout.retry_partition("fires", 4) is None  # added after the start: no place
    assert layout.retry_partition("other", 0) is None


def test_several_source_topics_are_laid_end_to_end_in_name_order() -> None:
    layout = retry_layout({"b": 2, "a": 3}, 5)
    assert layout is not None
    assert [layout.retry_partition("a", p) for p in range(3)] == [0, 1, 2]
    assert [layout.retry_partition("b", p) for p in range(2)] == [3, 4]
    assert layout.followed([("b", 1)]) == {4}


def test_a_retries_topic_with_too_few_partitions_has_no_layout() -> None:
    assert retry_layout({"fires": 4}, 3) is None
    assert retry_layout({"a": 2, "b": 2}, 3) is None
    assert retry_layout({"fires": 0}, 3) is None  # the source topic's count is unknown
    assert retry_layout({}, 3) is None


def test_every_retries_partition_has_exactly_one_reader_whatever_the_split() -> None:
    layout = retry_layout({"a": 3, "b": 2}, 12)  # more retries partitions than sources
    assert layout is not None
    sources = [("a", p) for p in range(3)] + [("b", p) for p in range(2)]
    for split in range(1, len(sources)):
        mine, theirs = layout.followed(sources[:split]), layout.followed(sources[split:])
        assert not mine & theirs
        assert mine | theirs == set(range(12))
    # What a source partition's owner reads includes where its records are parked.
    for t, p in sources:
        assert layout.retry_partition(t, p) in layout.followed([(t, p)])


def test_a_park_goes_to_the_retries_partition_of_its_source_partition() -> None:
    outbox = AckingOutbox(partition=0)
    lanes = parkers(outbox)
    state, lot = lanes.state, lanes.lot
    lot.layout = RetryLayout(starts=(("t", 0, 1),), retry_partitions=1)
    lanes.retry.assigned({(RETRIES, 0)})
    a = envelope(state, 0)
    assert state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    assert [r.partition for r in outbox.records] == [0]
    assert lot.lines.has_line(a.line_key)
    lot.layout = None  # not co-partitioned: Kafka's partitioner places it by key
    b = envelope(state, 1, key=b"L")
    assert state.take() is b
    assert lanes.main.park(b, ParkReason.RETRYING, later())
    assert outbox.records[-1].partition is None


class FollowingConsumer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []
        self.committed: list[tuple[str, int, int]] = []

    def incremental_assign(self, tps: list[TopicPartition]) -> None:
        self.calls.append(("assign", [(p.topic, p.partition) for p in tps]))

    def incremental_unassign(self, tps: list[TopicPartition]) -> None:
        self.calls.append(("unassign", [(p.topic, p.partition) for p in tps]))


class FlushingOutbox:
    def flush(self, timeout_s: float) -> int:
        return 0


@pytest.fixture
def following() -> Iterator[tuple[Reader, SharedState, FollowingConsumer, Any]]:
    yield from following_reader()


def following_reader() -> Iterator[tuple[Reader, SharedState, FollowingConsumer, Any]]:
    _main, retry, _state, lot = writers(AckingOutbox())
    retry.start()  # a revoke's freeze runs on the writer's loop
    state = SharedState(Bounds())
    consumer = FollowingConsumer()

    def commit(_c: Any, positions: dict[tuple[str, int], int]) -> None:
        consumer.committed.extend((t, p, o) for (t, p), o in positions.items())

    reader = Reader(
        kafka_conf={},
        settings=settings(revoke_timeout_s=0.1),
        topics=[RETRIES],
        state=state,
        writer=retry,
        outbox=FlushingOutbox(),  # type: ignore[arg-type]
        metrics=ProxyMetrics(),
        prepare=lambda env: None,
        commit=commit,
        name="proxy-retry-reader",
        subscribe=False,
    )
    yield reader, state, consumer, lot
    retry.drain(1)


def apply_while_following(reader: Reader, consumer: FollowingConsumer, **change: Any) -> None:
    """``follow`` from another thread (the main lane's), applied on this one (the reader's)."""
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(reader.follow(timeout_s=5, **change)))
    t.start()
    while not reader._changes:
        time.sleep(0.001)
    reader._apply_changes(consumer)  # type: ignore[arg-type]
    t.join(5)
    assert done == [True]


def test_a_following_reader_reads_what_it_is_given_and_commits_what_it_lets_go(
    following: Any,
) -> None:
    reader, state, consumer, lot = following
    apply_while_following(reader, consumer, add=[(RETRIES, 1), (RETRIES, 3)])
    assert consumer.calls == [("assign", [(RETRIES, 1), (RETRIES, 3)])]
    assert reader.assignment == {(RETRIES, 1), (RETRIES, 3)}
    assert lot.retry_known and lot.retry_owned == {1, 3}
    # A parked record read from partition 3 and finished: its offset is committed when the
    # partition goes (its source partition was revoked from the main lane).
    env = Envelope(
        topic=RETRIES,
        partition=3,
        offset=7,
        key=b"K",
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(env, url="http://127.0.0.1:9/", timeout_s=1.0)
    state.push([env])
    assert state.take() is env
    state.release(env)
    state.offset_done(env)
    apply_while_following(reader, consumer, remove=[(RETRIES, 3)])
    assert consumer.calls[-1] == ("unassign", [(RETRIES, 3)])
    assert consumer.committed == [(RETRIES, 3, 8)]
    assert reader.assignment == {(RETRIES, 1)} and lot.retry_owned == {1}
    # Lost (another proxy may own it already): let go without a commit.
    apply_while_following(reader, consumer, remove=[(RETRIES, 1)], commit=False)
    assert consumer.committed == [(RETRIES, 3, 8)] and reader.assignment == set()


def test_a_line_on_a_partition_the_retry_lane_lets_go_is_dropped(following: Any) -> None:
    reader, _state, consumer, lot = following
    apply_while_following(reader, consumer, add=[(RETRIES, 0)])
    lot.lines.append(("t", 0, b"K"), "p1")
    lot.lines.placed(("t", 0, b"K"), 0)
    apply_while_following(reader, consumer, remove=[(RETRIES, 0)])
    assert len(lot.lines) == 0


def test_a_reader_no_longer_polling_takes_no_change(following: Any) -> None:
    reader, _state, _consumer, _lot = following
    reader._changes_closed = True
    assert reader.follow(add=[(RETRIES, 0)], timeout_s=0.01)
    assert reader._changes == []


def test_a_follow_nobody_applies_gives_up_after_its_timeout(following: Any) -> None:
    reader, _state, _consumer, _lot = following
    assert not reader.follow(add=[(RETRIES, 0)], timeout_s=0.01)

"""Contiguous offset tracking: commit only below the first unfinished message."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from proxy.offsets import OffsetTracker, PartitionOffsets


def test_commit_position_waits_for_the_gap() -> None:
    p = PartitionOffsets()
    for o in (10, 11, 12, 13):
        assert p.record(o)
    assert p.position is None
    p.mark_done(11)
    p.mark_done(12)
    assert p.position is None  # 10 is still out
    p.mark_done(10)
    assert p.position == 13
    p.mark_done(13)
    assert p.position == 14


def test_sparse_offsets_from_compaction_or_markers() -> None:
    p = PartitionOffsets()
    for o in (5, 7, 20):
        p.record(o)
    p.mark_done(7)
    p.mark_done(20)
    p.mark_done(5)
    assert p.position == 21


def test_repeats_are_rejected_and_late_done_is_harmless() -> None:
    p = PartitionOffsets()
    assert p.record(1)
    assert not p.record(1)
    assert not p.record(0)
    p.mark_done(1)
    p.mark_done(1)
    p.mark_done(0)
    assert p.position == 2
    assert not p.record(1)
    assert p.record(2)


def test_tracker_commits_only_moved_positions_and_revoke() -> None:
    t: OffsetTracker[tuple[str, int]] = OffsetTracker()
    a, b = ("t", 0), ("t", 1)
    t.assign([a, b])
    for o in range(3):
        t.record(a, o)
        t.record(b, o)
    t.mark_done(a, 0)
    t.mark_done(b, 1)
    assert t.to_commit() == {a: 1}
    t.mark_committed({a: 1})
    assert t.to_commit() == {}
    assert t.uncommitted() == {a: 2, b: 3}
    t.mark_done(b, 0)
    assert t.revoke(b) == 2
    assert b not in t
    t.mark_done(b, 2)  # late completion after revoke: ignored
    assert not t.record(b, 3)
    assert t.revoke(a) is None  # nothing beyond the last commit


@given(n=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_random_completion_order(n: int, seed: int) -> None:
    rnd = random.Random(seed)
    p = PartitionOffsets()
    offsets = sorted(rnd.sample(range(n * 3), n))
    for o in offsets:
        p.record(o)
    order = offsets[:]
    rnd.shuffle(order)
    done: set[int] = set()
    for o in order:
        p.mark_done(o)
        done.add(o)
        # Expected: one past the longest done prefix of the read offsets.
        prefix = 0
        while prefix < len(offsets) and offsets[prefix] in done:
            prefix += 1
        expected = offsets[prefix - 1] + 1 if prefix else None
        assert p.position == expected
    assert p.position == offsets[-1] + 1

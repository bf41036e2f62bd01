"""The order iterator: one message per key in flight, FIFO per key, bounds with hysteresis."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.ordering import Bounds, OrderQueue


@dataclass(eq=False)
class Msg:
    order_key: str | None
    seq: int
    tp: tuple[str, int] = ("t", 0)
    size: int = 10


def drain(q: OrderQueue[Msg]) -> list[Msg]:
    out = []
    while (m := q.take()) is not None:
        out.append(m)
    return out


def test_busy_key_waits_and_keyless_flows() -> None:
    q: OrderQueue[Msg] = OrderQueue()
    a1, a2, b1, n1, n2 = Msg("a", 1), Msg("a", 2), Msg("b", 1), Msg(None, 1), Msg(None, 2)
    for m in (a1, a2, b1, n1, n2):
        q.push(m)
    assert drain(q) == [a1, b1, n1, n2]  # a2 waits behind a1
    assert q.in_flight == 4 and q.waiting == 1
    q.done(b1)
    assert q.take() is None
    q.done(a1)
    assert q.take() is a2
    assert q.take() is None


def test_retried_message_keeps_its_key_blocked() -> None:
    # A retry never calls done(): the message stays in flight until its final outcome.
    q: OrderQueue[Msg] = OrderQueue()
    first, second = Msg("k", 1), Msg("k", 2)
    q.push(first)
    q.push(second)
    assert q.take() is first
    for _ in range(5):  # five failed attempts, each re-sent by the writer without the queue
        assert q.take() is None
    q.done(first)
    assert q.take() is second


def test_done_is_idempotent_and_ignores_unknown() -> None:
    q: OrderQueue[Msg] = OrderQueue()
    m = Msg("k", 1)
    q.push(m)
    assert q.take() is m
    q.done(m)
    q.done(m)
    q.done(Msg("k", 9))
    assert len(q) == 0 and q.held_bytes == 0 and q.in_flight == 0


def test_bounds_pause_at_high_water_resume_under_low_water() -> None:
    q: OrderQueue[Msg] = OrderQueue(Bounds(max_messages=4, max_bytes=10_000, low_ratio=0.5))
    msgs = [Msg(None, i) for i in range(4)]
    for m in msgs[:3]:
        q.push(m)
    assert not q.should_pause()
    q.push(msgs[3])
    assert q.should_pause()
    taken = drain(q)
    q.done(taken[0])
    assert q.should_pause()  # 3 held > low water 2: stay paused (hysteresis)
    q.done(taken[1])
    assert not q.should_pause()


def test_byte_bound() -> None:
    q: OrderQueue[Msg] = OrderQueue(Bounds(max_messages=1000, max_bytes=100))
    q.push(Msg(None, 1, size=60))
    assert not q.should_pause()
    q.push(Msg(None, 2, size=60))
    assert q.should_pause()
    assert q.held_bytes == 120


def test_drop_partition_drops_waiting_and_leaves_in_flight() -> None:
    q: OrderQueue[Msg] = OrderQueue()
    p0 = [Msg("a", i, tp=("t", 0)) for i in range(3)] + [Msg(None, 9, tp=("t", 0))]
    p1 = [Msg("b", i, tp=("t", 1)) for i in range(2)]
    for m in p0 + p1:
        q.push(m)
    out = q.take()
    assert out is p0[0]
    assert q.drop_partition(("t", 0)) == 3  # a1, a2 and the keyless one
    assert q.in_flight == 1
    assert drain(q) == [p1[0]]
    q.done(out)  # the late completion of a dropped partition's message is harmless
    assert q.take() is None
    q.done(p1[0])
    assert q.take() is p1[1]
    q.done(p1[1])
    assert len(q) == 0 and q.held_bytes == 0


def test_bounds_validation() -> None:
    with pytest.raises(ValueError):
        Bounds(max_messages=0)
    with pytest.raises(ValueError):
        Bounds(low_ratio=1.0)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=1, max_size=80),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_interleavings_keep_per_key_order(keys: list[str | None], seed: int) -> None:
    """Push, take and finish in random interleavings: each key is delivered in push order,
    never two at once, and every message exactly once."""
    rnd = random.Random(seed)
    q: OrderQueue[Msg] = OrderQueue()
    pending = [Msg(k, i) for i, k in enumerate(keys)]
    out: list[Msg] = []
    in_flight: list[Msg] = []
    while pending or in_flight or q.waiting:
        action = rnd.random()
        if pending and action < 0.4:
            q.push(pending.pop(0))
        elif action < 0.7:
            m = q.take()
            if m is not None:
                assert m.order_key is None or all(f.order_key != m.order_key for f in in_flight)
                in_flight.append(m)
        elif in_flight:
            m = in_flight.pop(rnd.randrange(len(in_flight)))
            out.append(m)
            q.done(m)
    assert sorted(m.seq for m in out) == list(range(len(keys)))
    for key in {k for k in keys if k is not None}:
        seqs = [m.seq for m in out if m.order_key == key]
        assert seqs == sorted(seqs)
    assert len(q) == 0 and q.held_bytes == 0


def test_take_is_not_a_rescan() -> None:
    """100k waiting messages behind one busy key: taking from other keys stays cheap."""
    q: OrderQueue[Msg] = OrderQueue(Bounds(max_messages=10**6))
    for i in range(100_000):
        q.push(Msg("hot", i))
    assert q.take() is not None
    for i in range(1000):
        q.push(Msg(f"k{i}", i))
    # If take() rescanned the hot key's backlog each time this would be 1e8 steps.
    assert len(drain(q)) == 1000

"""SharedState's transitions: a message from push to take, release and done, a partition
from assign through revoke, and the share and pressure checks the writer parks by."""

from __future__ import annotations

import time
from types import SimpleNamespace

from proxy.envelope import Envelope, prepare_generic
from proxy.ordering import Bounds
from proxy.state import SharedState


def envelope(
    offset: int, key: bytes | None = b"k", partition: int = 0, tenant: str | None = None
) -> Envelope:
    e = Envelope(
        topic="t",
        partition=partition,
        offset=offset,
        key=key,
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(e, url="http://h/", timeout_s=1.0)
    if tenant is not None:
        e.trigger = SimpleNamespace(tenant=tenant)  # type: ignore[assignment]
    return e


def assigned(*partitions: int, bounds: Bounds | None = None) -> SharedState:
    state = SharedState(bounds or Bounds())
    state.assign([("t", p) for p in partitions])
    return state


def test_only_records_of_assigned_partitions_not_read_before_are_queued() -> None:
    state = assigned(0)
    a = envelope(0)
    assert state.push([a, envelope(0), envelope(1, partition=1)]) == 1  # repeat, unassigned
    assert state.snapshot(time.monotonic()).waiting == 1


def test_one_message_per_key_is_out_until_it_is_released() -> None:
    state = assigned(0)
    a, b, c = envelope(0), envelope(1), envelope(2, key=b"other")
    state.push([a, b, c])
    assert state.take() is a
    assert state.take() is c  # b waits behind a
    assert state.take() is None
    state.release(a)
    assert state.take() is b
    assert state.snapshot(time.monotonic()).in_flight == 2


def test_the_commit_position_moves_over_the_contiguous_done_prefix_only() -> None:
    state = assigned(0)
    envs = [envelope(i, key=f"k{i}".encode()) for i in range(3)]
    state.push(envs)
    for _ in envs:
        state.take()
    for env in envs:
        state.release(env)
    state.offset_done(envs[1])
    assert state.to_commit() == {}  # offset 0 is not done: nothing may be committed
    state.offset_done(envs[0])
    assert state.to_commit() == {("t", 0): 2}
    state.mark_committed({("t", 0): 2})
    assert state.to_commit() == {}
    state.offset_done(envs[2])
    assert state.to_commit() == {("t", 0): 3}


def test_a_cancelled_message_moves_no_offset() -> None:
    state = assigned(0)
    a = envelope(0)
    state.push([a])
    state.take()
    a.cancelled = True
    state.offset_done(a)
    assert state.to_commit() == {}


def test_a_revoke_drops_waiting_messages_stops_attempts_and_hands_back_what_is_out() -> None:
    state = assigned(0, 1)
    out, waiting, other = envelope(0), envelope(1), envelope(0, partition=1)
    state.push([out, waiting, other])
    assert state.take() is out
    out.attempting = True
    assert state.begin_revoke([("t", 0)]) == 1  # the one waiting behind ``out``
    assert ("t", 0) in state.revoking
    assert state.attempting([("t", 0)]) == 1 and state.attempting([("t", 1)]) == 0
    state.release(out)
    state.offset_done(out)
    positions, leftovers = state.end_revoke([("t", 0)])
    assert positions == {("t", 0): 1} and leftovers == []
    assert state.take() is other  # the other partition is untouched
    positions, leftovers = state.end_revoke([("t", 1)])
    assert positions == {} and leftovers == [other] and other.cancelled
    assert state.snapshot(time.monotonic()).held == 0


def test_a_partition_assigned_again_is_no_longer_revoking() -> None:
    state = assigned(0)
    state.begin_revoke([("t", 0)])
    state.end_revoke([("t", 0)])
    state.assign([("t", 0)])
    assert state.revoking == set()
    assert state.push([envelope(5)]) == 1


def test_a_tenants_share_and_the_pressure_on_the_bounds() -> None:
    state = assigned(0, bounds=Bounds(max_messages=10, low_ratio=0.5))
    state.push([envelope(i, key=f"a{i}".encode(), tenant="a") for i in range(3)])
    state.push([envelope(i, key=f"b{i}".encode(), tenant="b") for i in range(3, 4)])
    assert state.over_share("a", 0.25) and not state.over_share("b", 0.25)
    assert not state.over_share(None, 0.25)
    assert not state.under_pressure()  # 4 of 10: under the resume mark
    state.push([envelope(i, key=f"b{i}".encode(), tenant="b") for i in range(4, 6)])
    assert state.under_pressure()  # 6 of 10: past it


def test_the_snapshot_reports_the_oldest_message_out() -> None:
    state = assigned(0)
    a = envelope(0)
    a.read_s = 100.0
    state.push([a, envelope(1, key=b"x")])
    state.take()
    snap = state.snapshot(now_s=103.0)
    assert (snap.waiting, snap.in_flight, snap.held) == (1, 1, 2)
    assert snap.oldest_in_flight_s == 3.0 and snap.uncommitted == {("t", 0): 2}


def test_the_partitions_holding_pending_messages() -> None:
    state = assigned(0, 1, 2)
    a, b, c = envelope(0), envelope(1, key=b"x"), envelope(0, partition=1)
    state.push([a, b, c])
    assert state.holding([("t", 0), ("t", 1), ("t", 2)]) == {("t", 0), ("t", 1)}
    assert state.take() is a
    state.release(a)
    assert state.holding([("t", 0), ("t", 1)]) == {("t", 0), ("t", 1)}  # b still waits
    state.begin_revoke([("t", 0)])  # drops b
    assert state.holding([("t", 0), ("t", 1)]) == {("t", 1)}
    assert state.take() is c  # in flight: still held
    assert state.holding([("t", 1)]) == {("t", 1)}
    state.release(c)
    assert state.holding([("t", 0), ("t", 1), ("t", 2)]) == set()

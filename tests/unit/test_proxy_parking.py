"""Parking: the retry-topic header, the per-key lines, and the per-tenant share."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest

from proxy.ordering import Bounds, OrderQueue
from proxy.parking import (
    RETRY_HEADER,
    Lines,
    Origin,
    Parked,
    decode_headers,
    encode_header,
    park_headers,
)
from proxy.retry import AttemptState

ORIGIN = Origin(topic="fires", partition=3, offset=77, timestamp_ms=5)


def test_the_header_carries_origin_state_and_not_before_across_clocks() -> None:
    state = AttemptState(
        attempts=4,
        failures=4,
        consecutive_timeouts=1,
        failures_6xx=2,
        first_failure_s=100.0,
        last_failure_s=130.0,
        last_status=503,
        last_error="HTTP 503: busy",
    )
    header = encode_header(
        Parked(park_id="p1", origin=ORIGIN, not_before_ms=2_000_500, state=state),
        now_s=140.0,
        now_ms=2_000_000,
    )
    headers = park_headers([("trace", b"t"), (RETRY_HEADER, b"forged")], header)
    assert [k for k, _ in headers] == ["trace", RETRY_HEADER]  # a forged one is dropped
    # Read back 3 s later on another clock: the ages are kept, not the monotonic values.
    parked, own = decode_headers(headers, now_s=10.0, now_ms=2_003_000)
    assert own == [("trace", b"t")]
    assert parked.park_id == "p1" and parked.origin == ORIGIN
    assert parked.not_before_ms == 2_000_500
    st = parked.state
    assert (st.attempts, st.failures, st.consecutive_timeouts, st.failures_6xx) == (4, 4, 1, 2)
    assert st.first_failure_s == pytest.approx(10.0 - 43.0)
    assert st.last_failure_s == pytest.approx(10.0 - 13.0)
    assert (st.last_status, st.last_error) == (503, "HTTP 503: busy")


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(RETRY_HEADER, b"{}")],
        [(RETRY_HEADER, b"not json")],
        [(RETRY_HEADER, None)],
        [(RETRY_HEADER, b"{}"), (RETRY_HEADER, b"{}")],
        [(RETRY_HEADER, orjson.dumps({"id": "x", "origin": {"topic": "t"}}))],
    ],
)
def test_a_missing_or_malformed_header_is_a_value_error(headers: list) -> None:
    with pytest.raises(ValueError):
        decode_headers(headers, now_s=0.0, now_ms=0)


def test_lines_keep_park_order_and_a_reparked_message_keeps_its_place() -> None:
    lines, k = Lines(), ("fires", 0, b"k")
    assert not lines.has_line(k) and lines.is_head(k, "x")
    for pid in ("a", "b", "c"):
        lines.append(k, pid)
    assert lines.has_line(k) and lines.is_head(k, "a") and not lines.is_head(k, "b")
    lines.replace(k, "a", "a2")  # the head failed again and was parked again
    assert lines.is_head(k, "a2") and not lines.is_head(k, "b")
    lines.replace(k, "c", "c2")  # one behind the head went round again
    lines.finish(k, "a2")
    assert lines.is_head(k, "b") and not lines.is_head(k, "c2")
    lines.finish(k, "b")
    lines.finish(k, "c2")
    assert not lines.has_line(k) and len(lines) == 0
    assert lines.is_head(k, "unknown")  # parked by an earlier life: no order known


def test_lines_are_bounded_and_forget_a_revoked_partition() -> None:
    lines = Lines(max_entries=3)
    lines.append(("fires", 0, b"a"), "1")
    lines.append(("fires", 1, b"b"), "2")
    lines.append(("fires", 0, b"a"), "3")  # a is now the line touched last
    assert lines.append(("fires", 1, b"c"), "4") == 1  # over the bound: b's line goes
    assert len(lines) == 3 and not lines.has_line(("fires", 1, b"b"))
    for i in range(1000):
        lines.append(("fires", 1, str(i).encode()), str(i))
        lines.append(("fires", 1, b"hot"), f"h{i}")  # one key's line is bounded too
    assert len(lines) <= 3
    lines.drop_partition("fires", 0)
    assert not lines.has_line(("fires", 0, b"a"))
    lines.append(("fires", 1, b"b"), "3")
    before = len(lines)
    lines.finish(("fires", 1, b"b"), "nope")  # unknown id: nothing changes
    assert len(lines) == before
    lines.clear()
    assert len(lines) == 0


@dataclass(eq=False)
class Msg:
    order_key: str | None
    tenant: str | None
    tp: tuple[str, int] = ("t", 0)
    size: int = 100


def test_the_queue_counts_each_tenants_share_and_forgets_empty_tenants() -> None:
    q: OrderQueue[Msg] = OrderQueue(
        Bounds(max_messages=100, max_bytes=1000), group_of=lambda m: m.tenant
    )
    a = [Msg(f"a{i}", "A") for i in range(3)]
    b = Msg("b", "B")
    for m in (*a, b, Msg("n", None)):
        q.push(m)
    assert q.group_held("A") == (3, 300) and q.group_held("B") == (1, 100)
    assert q.over_share("A", 0.25) and not q.over_share("B", 0.25)  # 300 of 1000 bytes
    assert not q.over_share(None, 0.01)
    taken = [q.take() for _ in range(5)]
    for m in taken:
        assert m is not None
        q.done(m)
    assert q.group_held("A") == (0, 0) and not q._groups  # no entry left behind
    q.push(Msg("a9", "A", tp=("t", 1)))
    assert q.drop_partition(("t", 1)) == 1 and not q._groups


def test_lines_forget_only_those_on_revoked_retry_partitions() -> None:
    lines = Lines()
    on0, on1, unacked = ("fires", 0, b"a"), ("fires", 0, b"b"), ("fires", 0, b"c")
    for k in (on0, on1, unacked):
        lines.append(k, "x")
    lines.placed(on0, 0)
    lines.placed(on1, 1)
    lines.placed(("fires", 9, b"none"), 1)  # no line: nothing recorded
    assert lines.drop_retry_partitions({1}) == 1
    assert lines.has_line(on0) and not lines.has_line(on1) and lines.has_line(unacked)
    assert len(lines) == 2

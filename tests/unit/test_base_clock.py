"""base.clock: the wall clock in epoch milliseconds."""

from __future__ import annotations

import time

from base.clock import Clock, now_ms


def test_now_ms_is_the_wall_clock_in_whole_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    got = now_ms()
    after = time.time_ns() // 1_000_000
    assert isinstance(got, int)
    assert before <= got <= after


def test_a_function_and_a_fake_are_both_clocks() -> None:
    clocks: list[Clock] = [now_ms, lambda: 1_700_000_000_000]
    assert clocks[1]() == 1_700_000_000_000
    assert clocks[0]() > 1_700_000_000_000

"""Wall-clock time in epoch milliseconds: the unit of every time Tocsin stores or sends."""

from __future__ import annotations

import time
from typing import Protocol


def now_ms() -> int:
    """The wall clock now, in epoch milliseconds (integer nanoseconds divided: no float
    rounding)."""
    return time.time_ns() // 1_000_000


class Clock(Protocol):
    """A source of epoch-millisecond time, for code that takes its clock as a parameter:
    ``now_ms`` in production, a fixed or stepped one in tests."""

    def __call__(self) -> int: ...

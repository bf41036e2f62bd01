"""A circuit breaker for one endpoint host: back off a failing host once for all its messages.

Without it every message to a dead host fails, backs off and retries on its own, so a host
with a thousand waiting triggers gets a thousand requests per backoff round. With it, the
host's failures are counted together:

* CLOSED: attempts go. After ``failures`` consecutive host failures, or when at least
  ``failure_ratio`` of the last ``window`` attempts failed (the window full), it opens.
  A failure of an attempt that started before the host's last success does not add to the
  consecutive count (it still counts in the window): the host answered after that attempt
  began, so the failure says more about the message (a poison request timing out) than
  about the host. Without that, a few such requests started together and timing out in
  the same turn of the loop read as consecutive failures while the host answered
  hundreds of others in between.
* OPEN: no attempt goes until ``open_s`` has passed (doubling after each failed probe, at
  most ``open_max_s``).
* HALF_OPEN: one attempt goes as the probe; the others wait. The probe delivered (or
  answered in a way that says the host is up): CLOSED. The probe failed: OPEN again, for
  longer. The probe abandoned (revoke, shutdown) or inconclusive: the next attempt probes.

What counts is the host's health, not the message's: a connect failure, a read timeout, a
5xx or a 429 is a host failure; any other answer (2xx, 4xx, 6xx, 7xx: the host is up and
judged this message) is a success; an undeliverable message is neither.

Pure: no clock (callers pass ``now_s``, any monotonic clock), no I/O, no locks.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from proxy.retry import (
    AttemptResult,
    ConnectFailure,
    HttpResult,
    KafkaResult,
    KafkaVerdict,
    TimeoutResult,
    Undeliverable,
)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class HostVerdict(enum.Enum):
    """What one attempt says about its host."""

    UP = "up"  # it answered: the message's fate is the message's business
    FAILED = "failed"  # unreachable, too slow, overloaded or broken
    UNKNOWN = "unknown"  # nothing was learnt (the request was never made)


# 429: the host says it is overloaded, which is the host's state, not the message's.
_HOST_FAILURE_STATUSES = frozenset({429})


def host_verdict(result: AttemptResult) -> HostVerdict:
    """The host's health as one attempt's result shows it."""
    if isinstance(result, HttpResult):
        if result.status // 100 == 5 or result.status in _HOST_FAILURE_STATUSES:
            return HostVerdict.FAILED
        return HostVerdict.UP
    if isinstance(result, TimeoutResult | ConnectFailure):
        return HostVerdict.FAILED
    if isinstance(result, Undeliverable):
        return HostVerdict.UNKNOWN
    if isinstance(result, KafkaResult):
        return HostVerdict.UP if result.verdict is KafkaVerdict.ACKED else HostVerdict.FAILED
    return HostVerdict.UNKNOWN


@dataclass(frozen=True, kw_only=True)
class BreakerPolicy:
    """``failures`` 0 turns the breaker off (it never opens)."""

    failures: int = 5
    failure_ratio: float = 0.5
    window: int = 20
    open_s: float = 1.0
    open_max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.failures < 0 or self.window < 1:
            raise ValueError("breaker failures must be >= 0 and window >= 1")
        if not 0 < self.failure_ratio <= 1:
            raise ValueError("breaker failure ratio must be in (0, 1]")
        if self.open_s <= 0 or self.open_max_s < self.open_s:
            raise ValueError("need 0 < breaker open_s <= open_max_s")

    @property
    def enabled(self) -> bool:
        return self.failures > 0


@dataclass(frozen=True, slots=True)
class BreakerView:
    """One breaker as the metrics and the explain view show it."""

    state: BreakerState
    consecutive_failures: int
    window_failures: int
    window_size: int
    open_for_s: float  # the current (or next) open period
    retry_in_s: float  # OPEN: until the next probe may go; otherwise 0
    opened_count: int  # times it opened since it was created
    last_failure: str | None


class Breaker:
    def __init__(self, policy: BreakerPolicy) -> None:
        self.policy = policy
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self._recent: deque[bool] = deque(maxlen=policy.window)  # True: a failure
        self.open_for_s = policy.open_s
        self.retry_at_s = 0.0
        self.probing = False
        self.opened_count = 0
        self.last_failure: str | None = None
        self.last_success_s: float | None = None

    def allow(self, now_s: float) -> tuple[bool, bool]:
        """May an attempt go at ``now_s``? Returns (allowed, is_probe). An allowed probe
        must be answered with ``record(..., probe=True)`` or ``probe_dropped``."""
        if self.state is BreakerState.CLOSED:
            return True, False
        if self.state is BreakerState.OPEN:
            if now_s < self.retry_at_s:
                return False, False
            self.state = BreakerState.HALF_OPEN
            self.probing = False
        if self.probing:
            return False, False
        self.probing = True
        return True, True

    def retry_in_s(self, now_s: float) -> float:
        """How long a message refused now should wait before asking again."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self.retry_at_s - now_s)
        return 0.0

    def record(
        self,
        verdict: HostVerdict,
        now_s: float,
        *,
        probe: bool,
        detail: str | None = None,
        started_s: float | None = None,
    ) -> BreakerState:
        """One attempt's verdict; returns the state after it. Attempts that started before
        the breaker opened and end while it is open or probing are ignored: only the probe
        speaks for the host then. ``started_s``: when the attempt began (same clock), so a
        failure of one that began before the last success is not counted as consecutive."""
        if verdict is HostVerdict.FAILED:
            self.last_failure = detail
        if self.state is not BreakerState.CLOSED:
            if probe and self.state is BreakerState.HALF_OPEN:
                self._probe_result(verdict, now_s)
            return self.state
        if verdict is HostVerdict.UNKNOWN:
            return self.state
        failed = verdict is HostVerdict.FAILED
        self._recent.append(failed)
        if not failed:
            self._succeeded(now_s)
        elif started_s is None or self.last_success_s is None or started_s >= self.last_success_s:
            self.consecutive += 1
        if failed and self._tripped():
            self._open(now_s, self.policy.open_s)
        return self.state

    def probe_dropped(self) -> None:
        """The probe was never attempted: the next attempt probes instead."""
        if self.state is BreakerState.HALF_OPEN:
            self.probing = False

    def _tripped(self) -> bool:
        p = self.policy
        if not p.enabled:
            return False
        if self.consecutive >= p.failures:
            return True
        recent = self._recent
        return len(recent) >= p.window and sum(recent) >= p.failure_ratio * len(recent)

    def _succeeded(self, now_s: float) -> None:
        """The host answered at ``now_s`` (while closed, or the probe that closes it): the
        consecutive count restarts, and a failure of an attempt begun before then is not
        consecutive (``record``). The one place either is set on a success."""
        self.consecutive = 0
        self.last_success_s = now_s

    def _probe_result(self, verdict: HostVerdict, now_s: float) -> None:
        self.probing = False
        if verdict is HostVerdict.UP:
            self.state = BreakerState.CLOSED
            self._succeeded(now_s)
            self._recent.clear()
            self.open_for_s = self.policy.open_s
        elif verdict is HostVerdict.FAILED:
            self._open(now_s, min(self.policy.open_max_s, self.open_for_s * 2))

    def _open(self, now_s: float, for_s: float) -> None:
        self.state = BreakerState.OPEN
        self.open_for_s = for_s
        self.retry_at_s = now_s + for_s
        self.opened_count += 1

    def view(self, now_s: float) -> BreakerView:
        return BreakerView(
            state=self.state,
            consecutive_failures=self.consecutive,
            window_failures=sum(self._recent),
            window_size=len(self._recent),
            open_for_s=self.open_for_s,
            retry_in_s=self.retry_in_s(now_s),
            opened_count=self.opened_count,
            last_failure=self.last_failure,
        )

"""The MPS return-code policy: what to do after each delivery attempt.

Policy (also in docs/proxy.md):

=====================  ==============================================================
attempt result          decision
=====================  ==============================================================
2xx                     done (delivered)
4xx, 5xx                retry with exponential backoff and jitter, or after the
                        response's Retry-After (seconds or HTTP date) when given;
                        without limit unless ``max_retry_age_s`` is set, then
                        dead-letter once the next try would start later than that
                        age after the first failure
6xx                     retry like 4xx/5xx, at most ``retries_6xx`` times, then
                        dead-letter ("the receiver says: try a few times")
7xx                     dead-letter at once ("bad message / failed validation")
1xx, 3xx, >= 800        treated as 4xx/5xx: the receiver is misbehaving or
                        misconfigured, which an operator can fix, so keep retrying
read timeout            retry with backoff; ``poison_timeouts`` consecutive read
                        timeouts make the message a poison pill: dead-letter
undeliverable           dead-letter at once (undecodable trigger, invalid URL or
                        headers: no receiver can ever accept it)
connect failure         (connect timeout, refused, DNS, reset before a response)
                        retry with backoff like 5xx; never counts toward poison,
                        because an unreachable receiver says nothing about the
                        message
Kafka acked             done, reported with status 200 like a delivered HTTP callback
Kafka failed            retried like a connect failure (broker down, throttled)
Kafka refused           dead-letter at once (no such topic, not authorised, too large)
Kafka unacknowledged    treated as a read timeout (no verdict within the wait)
=====================  ==============================================================

Any non-timeout result resets the consecutive-timeout count. ``max_retry_age_s`` bounds
every retried class, timeouts included.

Per callback: a trigger's callback may carry ``retry`` (``topics.models.DeliveryRetry``),
either given explicitly in the command or stamped from the tenant's default retry policy
when the command was accepted; its non-null fields replace the process-wide
``max_retry_age_s`` / ``retries_6xx`` for that message (``for_callback``).

The module is pure: no I/O, no clock, no global random state. Callers pass ``now`` and a
``rand`` callable returning floats in [0, 1), so decisions are reproducible in tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Literal

from topics.models import DeliveryRetry

# ---- attempt results ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HttpResult:
    """The receiver answered with a status code."""

    status: int
    retry_after: str | None = None  # the raw Retry-After header, if any
    body_snippet: str = ""


@dataclass(frozen=True, kw_only=True)
class TimeoutResult:
    """The receiver accepted the request but did not answer in time."""

    detail: str = "read timeout"


@dataclass(frozen=True, kw_only=True)
class ConnectFailure:
    """The request never reached the receiver (connect timeout, refused, DNS, reset)."""

    detail: str


@dataclass(frozen=True, kw_only=True)
class Undeliverable:
    """The message can never be sent as it is (bad trigger, invalid URL or headers)."""

    detail: str


class KafkaVerdict(enum.Enum):
    """What Kafka said about a Kafka callback's produce."""

    ACKED = "acked"
    FAILED = "failed"  # may clear by itself: broker down, throttled, a timeout inside Kafka
    REFUSED = "refused"  # can never succeed as configured: no such topic, not authorised
    UNACKNOWLEDGED = "unacknowledged"  # no verdict within the sender's wait


@dataclass(frozen=True, kw_only=True)
class KafkaResult:
    """A Kafka callback's produce, in Kafka's terms."""

    verdict: KafkaVerdict
    detail: str = ""


# A Kafka ack is reported as this status (outcome records, the 2xx metric class), so a
# reader of delivery outcomes sees one "delivered" status whatever the callback kind.
KAFKA_ACKED_STATUS = 200

# A failed attempt in the classes the policy decides on.
Failure = HttpResult | TimeoutResult | ConnectFailure | Undeliverable

AttemptResult = Failure | KafkaResult


# ---- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Done:
    """Delivered; release the message."""

    status: int


@dataclass(frozen=True, kw_only=True)
class Retry:
    """Try again after ``after_s`` seconds; the message stays in flight (its key blocked)."""

    after_s: float
    reason: str


@dataclass(frozen=True, kw_only=True)
class DeadLetter:
    """Give up: publish a dead-letter record and release the message."""

    reason: str
    status: int | None = None


Decision = Done | Retry | DeadLetter


# ---- policy ------------------------------------------------------------------------------


DEFAULT_MAX_RETRY_AGE_S = 86_400.0


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Knobs of the return-code policy. ``max_retry_age_s`` 0 means retry without limit;
    the default gives up after a day (a dead letter can be redriven, a trigger retried for
    ever pins its partition's commit position)."""

    base_delay_s: float = 0.2
    max_delay_s: float = 60.0
    multiplier: float = 2.0
    jitter: float = 0.5  # delay is drawn from [d * (1 - jitter), d]
    max_retry_age_s: float = DEFAULT_MAX_RETRY_AGE_S
    retries_6xx: int = 3
    poison_timeouts: int = 5
    max_retry_after_s: float = 3600.0  # clamp absurd Retry-After values

    def __post_init__(self) -> None:
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")
        if self.multiplier < 1:
            raise ValueError("multiplier must be >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")
        if self.retries_6xx < 0 or self.poison_timeouts < 1 or self.max_retry_age_s < 0:
            raise ValueError("retries_6xx >= 0, poison_timeouts >= 1, max_retry_age_s >= 0")

    def for_callback(self, retry: DeliveryRetry | None) -> RetryPolicy:
        """This policy with a callback's own limits (None fields keep this policy's)."""
        if retry is None:
            return self
        changes: dict[str, float | int] = {}
        if retry.max_retry_age_s is not None:
            changes["max_retry_age_s"] = retry.max_retry_age_s
        if retry.retries_6xx is not None:
            changes["retries_6xx"] = retry.retries_6xx
        return replace(self, **changes) if changes else self  # type: ignore[arg-type]


# Distinct callback retry settings whose policies are kept built; a handful in practice,
# but they come from outside (each trigger's callback), so the cache must stay bounded.
MAX_CALLBACK_POLICIES = 1024


class CallbackPolicies:
    """The process-wide policy with each callback's own ``retry`` applied (its own, or its
    tenant's default stamped at accept time), built once per distinct one."""

    def __init__(self, base: RetryPolicy, max_entries: int = MAX_CALLBACK_POLICIES) -> None:
        self.base = base
        self._max_entries = max_entries
        self._built: dict[DeliveryRetry, RetryPolicy] = {}

    def of(self, retry: DeliveryRetry | None) -> RetryPolicy:
        if retry is None:
            return self.base
        policy = self._built.get(retry)
        if policy is None:
            if len(self._built) >= self._max_entries:
                self._built.clear()
            policy = self._built[retry] = self.base.for_callback(retry)
        return policy

    def __len__(self) -> int:
        return len(self._built)


@dataclass(frozen=True, kw_only=True)
class AttemptState:
    """What the policy remembers about one message across its attempts."""

    attempts: int = 0
    failures: int = 0
    consecutive_timeouts: int = 0
    failures_6xx: int = 0
    first_failure_s: float | None = None
    last_failure_s: float | None = None
    last_status: int | None = None
    last_error: str | None = None


StatusClass = Literal[
    "2xx", "4xx", "5xx", "6xx", "7xx", "other", "timeout", "connect", "undeliverable"
]


_KAFKA_CLASS: dict[KafkaVerdict, StatusClass] = {
    KafkaVerdict.ACKED: "2xx",
    KafkaVerdict.FAILED: "connect",
    KafkaVerdict.REFUSED: "undeliverable",
    KafkaVerdict.UNACKNOWLEDGED: "timeout",
}


def status_class(result: AttemptResult) -> StatusClass:
    """A low-cardinality label for metrics."""
    if isinstance(result, KafkaResult):
        return _KAFKA_CLASS[result.verdict]
    if isinstance(result, TimeoutResult):
        return "timeout"
    if isinstance(result, ConnectFailure):
        return "connect"
    if isinstance(result, Undeliverable):
        return "undeliverable"
    hundreds = result.status // 100
    if hundreds in (2, 4, 5, 6, 7):
        return f"{hundreds}xx"  # type: ignore[return-value]
    return "other"


def parse_retry_after(value: str | None, now_epoch_s: float) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date); None if absent
    or unparseable. A date in the past means 0."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if seconds == seconds else None  # reject NaN
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_epoch_s)


def backoff_s(policy: RetryPolicy, failures: int, rand: Callable[[], float]) -> float:
    """Exponential backoff for the ``failures``-th failure (1-based), with jitter."""
    exp = max(0, failures - 1)
    # Cap the exponent first so a message retried for days cannot overflow the float.
    delay = min(policy.max_delay_s, policy.base_delay_s * policy.multiplier ** min(exp, 64))
    return delay * (1.0 - policy.jitter * rand())


def delivered_status(result: AttemptResult) -> int | None:
    """The status a delivered attempt is reported with; None: the attempt failed."""
    if isinstance(result, KafkaResult):
        return KAFKA_ACKED_STATUS if result.verdict is KafkaVerdict.ACKED else None
    if isinstance(result, HttpResult) and 200 <= result.status < 300:
        return result.status
    return None


def as_failure(result: AttemptResult) -> Failure:
    """A failed attempt in the policy's classes: a Kafka failure that may clear is retried
    like an unreachable receiver, a refusal is undeliverable, no verdict is a timeout."""
    if not isinstance(result, KafkaResult):
        return result
    if result.verdict is KafkaVerdict.REFUSED:
        return Undeliverable(detail=result.detail)
    if result.verdict is KafkaVerdict.UNACKNOWLEDGED:
        return TimeoutResult(detail=result.detail)
    return ConnectFailure(detail=result.detail)


def _snippet_reason(result: HttpResult) -> str:
    body = f": {result.body_snippet}" if result.body_snippet else ""
    return f"HTTP {result.status}{body}"


def decide(
    policy: RetryPolicy,
    state: AttemptState,
    result: AttemptResult,
    *,
    now_s: float,
    now_epoch_s: float | None = None,
    rand: Callable[[], float],
) -> tuple[Decision, AttemptState]:
    """The decision after one attempt, and the updated state to keep for the next one.

    ``now_s`` is any monotonic clock (ages are measured with it); ``now_epoch_s`` is wall
    time, needed only to read a Retry-After date (defaults to ``now_s``).
    """
    attempts = state.attempts + 1
    delivered = delivered_status(result)
    if delivered is not None:
        return Done(status=delivered), replace(
            state, attempts=attempts, consecutive_timeouts=0, last_status=delivered
        )
    result = as_failure(result)

    first = state.first_failure_s if state.first_failure_s is not None else now_s
    failures = state.failures + 1
    base = replace(
        state,
        attempts=attempts,
        failures=failures,
        first_failure_s=first,
        last_failure_s=now_s,
    )

    server_delay: float | None = None
    status: int | None = None
    if isinstance(result, HttpResult):
        status = result.status
        reason = _snippet_reason(result)
        new = replace(base, consecutive_timeouts=0, last_status=status, last_error=reason)
        hundreds = status // 100
        if hundreds == 7:
            return DeadLetter(reason=reason, status=status), new
        if hundreds == 6:
            new = replace(new, failures_6xx=state.failures_6xx + 1)
            if new.failures_6xx > policy.retries_6xx:
                return (
                    DeadLetter(
                        reason=f"{reason} (6xx retried {policy.retries_6xx} times)",
                        status=status,
                    ),
                    new,
                )
        ra = parse_retry_after(result.retry_after, now_s if now_epoch_s is None else now_epoch_s)
        if ra is not None:
            server_delay = min(ra, policy.max_retry_after_s)
    elif isinstance(result, TimeoutResult):
        reason = result.detail
        new = replace(
            base,
            consecutive_timeouts=state.consecutive_timeouts + 1,
            last_status=None,
            last_error=reason,
        )
        if new.consecutive_timeouts >= policy.poison_timeouts:
            return (
                DeadLetter(
                    reason=f"poison pill: {new.consecutive_timeouts} consecutive timeouts "
                    f"({reason})"
                ),
                new,
            )
    elif isinstance(result, Undeliverable):
        new = replace(base, consecutive_timeouts=0, last_status=None, last_error=result.detail)
        return DeadLetter(reason=result.detail), new
    else:
        reason = result.detail
        new = replace(base, consecutive_timeouts=0, last_status=None, last_error=reason)

    # A server may ask for a longer wait than our backoff, never a shorter one: Retry-After:
    # 0 from a failing endpoint would otherwise retry in a hot loop.
    delay = backoff_s(policy, failures, rand)
    if server_delay is not None:
        delay = max(delay, server_delay)
    if policy.max_retry_age_s > 0 and (now_s + delay) - first > policy.max_retry_age_s:
        return (
            DeadLetter(
                reason=f"retry age over {policy.max_retry_age_s:g}s; last: {reason}",
                status=status,
            ),
            new,
        )
    return Retry(after_s=delay, reason=reason), new


def held_by_host(
    policy: RetryPolicy, state: AttemptState, *, now_s: float, wait_s: float, reason: str
) -> tuple[Retry | DeadLetter, AttemptState]:
    """A message its host's open circuit breaker holds back for ``wait_s``.

    The host is failing, so the message is failing too as far as ``max_retry_age_s`` goes:
    its failure clock starts now unless an attempt of its own already failed, and it is
    dead-lettered once the wait would take it past that age. Without this a message to a
    host that never comes back would wait (and be parked and read again) for ever, never
    attempted and so never judged. The hold is no attempt: no attempt or failure is
    counted, so backoff and the 6xx and poison counts are untouched.
    """
    first = state.first_failure_s if state.first_failure_s is not None else now_s
    last_s = state.last_failure_s if state.last_failure_s is not None else now_s
    new = replace(state, first_failure_s=first, last_failure_s=last_s)
    if policy.max_retry_age_s > 0 and (now_s + wait_s) - first > policy.max_retry_age_s:
        last = f"; last: {state.last_error}" if state.last_error else ""
        return (
            DeadLetter(
                reason=f"retry age over {policy.max_retry_age_s:g}s: {reason}{last}",
                status=state.last_status,
            ),
            new,
        )
    return Retry(after_s=wait_s, reason=reason), new

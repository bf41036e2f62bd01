"""The order iterator: the proxy's bounded pending queue with one message per key in flight.

The reader pushes every polled message here; writers take messages out with ``take()`` and
hand them back with ``done()`` once their final outcome is known (delivered or
dead-lettered). A message taken out is *in flight* until ``done()``: it stays in flight
across all of its retries, so the next message of its key cannot overtake it. That is how
per-key order holds end to end. Keyless messages (order key ``None``) are never held back.

Cost: ``push``, ``take`` and ``done`` are O(1) amortised. Waiting messages live in one FIFO
deque per key; a *ready* deque holds the keys whose head may go out now (and keyless
messages directly), so ``take`` never rescans the queue. Only ``drop_partition`` (a
rebalance, rare) is linear in the number of waiting messages.

Bounds: the queue counts everything it holds, waiting *and* in flight, by number and by
bytes, because an in-flight message is still in the proxy's memory. ``should_pause`` gives
the reader a high/low water mark decision with hysteresis. The bounds are soft: ``push``
never refuses a message (the reader cannot un-poll it), it only reports that the reader
should stop fetching. The same counts are kept per *group* (the tenant, in fires mode) so
the runtime can tell when one group holds more than its share (``over_share``), and the
number held per source partition, so the reader pauses only the partitions that hold
something (``holding``).

This module must never do I/O, take locks or look at the clock: the runtime serialises
access and owns time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Orderable(Protocol):
    """What the queue needs to know about a message."""

    @property
    def order_key(self) -> Hashable | None:
        """Messages with equal keys are delivered one at a time in push order; None = unordered."""

    @property
    def tp(self) -> Hashable:
        """The source partition (with its topic: partitions of several topics share
        numbers), so a revoked partition's messages can be dropped."""

    @property
    def size(self) -> int:
        """Bytes the message holds in memory (key + value + headers, roughly)."""


M = TypeVar("M", bound=Orderable)


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """High-water marks by count and bytes; the reader resumes below ``low_ratio`` of both."""

    max_messages: int = 10_000
    max_bytes: int = 64 * 1024 * 1024
    low_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.max_messages < 1 or self.max_bytes < 1:
            raise ValueError("pending bounds must be positive")
        if not 0.0 <= self.low_ratio < 1.0:
            raise ValueError("low_ratio must be in [0, 1)")


class _KeyState(Generic[M]):
    __slots__ = ("in_flight", "waiting")

    def __init__(self) -> None:
        self.waiting: deque[M] = deque()
        self.in_flight = False


class OrderQueue(Generic[M]):
    """Pending messages, handed out so that at most one message per key is in flight."""

    def __init__(
        self, bounds: Bounds | None = None, group_of: Callable[[M], Hashable | None] | None = None
    ) -> None:
        self.bounds = bounds or Bounds()
        self._group_of = group_of
        # Per group: [messages, bytes] held. An entry leaves when its group holds nothing,
        # so the map is bounded by what is held.
        self._groups: dict[Hashable, list[int]] = {}
        # Per source partition: messages held. Same rule: an entry leaves at zero.
        self._partitions: dict[Hashable, int] = {}
        self._keys: dict[Hashable, _KeyState[M]] = {}
        # Entries are either a key (its head is ready) or a keyless message. A key appears
        # here at most once: it is appended only when it goes from "blocked or empty" to
        # "has a head and nothing in flight".
        self._ready: deque[tuple[Hashable, M | None]] = deque()
        # id() -> message handed out and not yet done; holding the message keeps its id unique.
        self._in_flight: dict[int, M] = {}
        self._waiting_count = 0
        self._held_count = 0
        self._held_bytes = 0
        self._paused = False

    # ---- the reader side ---------------------------------------------------------------

    def push(self, msg: M) -> None:
        """Append a polled message; it becomes ready at once unless its key is busy."""
        self._held_count += 1
        self._held_bytes += msg.size
        self._count_group(msg, 1)
        self._count_partition(msg, 1)
        self._waiting_count += 1
        key = msg.order_key
        if key is None:
            self._ready.append((None, msg))
            return
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState()
        state.waiting.append(msg)
        if len(state.waiting) == 1 and not state.in_flight:
            self._ready.append((key, None))

    def should_pause(self) -> bool:
        """The reader's pause decision: pause at a high-water mark, resume under low-water.

        Hysteresis keeps the reader from flapping pause/resume on every message.
        """
        b = self.bounds
        if self._paused:
            low_count = b.max_messages * b.low_ratio
            low_bytes = b.max_bytes * b.low_ratio
            if self._held_count <= low_count and self._held_bytes <= low_bytes:
                self._paused = False
        elif self._held_count >= b.max_messages or self._held_bytes >= b.max_bytes:
            self._paused = True
        return self._paused

    # ---- the writer side ---------------------------------------------------------------

    def take(self) -> M | None:
        """The next message that may go out now, marked in flight; None if none may."""
        while self._ready:
            key, msg = self._ready.popleft()
            if msg is not None:  # keyless
                self._waiting_count -= 1
                self._in_flight[id(msg)] = msg
                return msg
            state = self._keys.get(key)
            if state is None or state.in_flight or not state.waiting:
                continue  # stale entry left behind by drop_partition
            head = state.waiting.popleft()
            state.in_flight = True
            self._waiting_count -= 1
            self._in_flight[id(head)] = head
            return head
        return None

    def done(self, msg: M) -> None:
        """Release an in-flight message for good (delivered or dead-lettered).

        Idempotent, and a no-op for a message that is not in flight (e.g. its partition was
        dropped while it was out), so a late completion after a rebalance is harmless.
        """
        ident = id(msg)
        if ident not in self._in_flight:
            return
        del self._in_flight[ident]
        self._held_count -= 1
        self._held_bytes -= msg.size
        self._count_group(msg, -1)
        self._count_partition(msg, -1)
        key = msg.order_key
        if key is None:
            return
        state = self._keys.get(key)
        if state is None:
            return
        state.in_flight = False
        if state.waiting:
            self._ready.append((key, None))
        else:
            del self._keys[key]

    # ---- rebalance ---------------------------------------------------------------------

    def drop_partition(self, partition: Hashable) -> int:
        """Forget the waiting messages of a revoked partition; returns how many were dropped.

        In-flight messages are left alone: the runtime stops their retries and then calls
        ``done()`` for each, which releases their keys. Linear in the waiting messages;
        rebalances are rare.
        """
        dropped = 0
        for key in list(self._keys):
            state = self._keys[key]
            kept: deque[M] = deque(m for m in state.waiting if m.tp != partition)
            for m in state.waiting:
                if m.tp == partition:
                    self._forget(m)
                    dropped += 1
            state.waiting = kept
            if not kept and not state.in_flight:
                del self._keys[key]
        ready: deque[tuple[Hashable, M | None]] = deque()
        for key, msg in self._ready:
            if msg is not None and msg.tp == partition:
                self._forget(msg)
                dropped += 1
            else:
                ready.append((key, msg))
        self._ready = ready
        self._waiting_count -= dropped
        return dropped

    def _forget(self, msg: M) -> None:
        self._held_count -= 1
        self._held_bytes -= msg.size
        self._count_group(msg, -1)
        self._count_partition(msg, -1)

    def _count_partition(self, msg: M, sign: int) -> None:
        tp = msg.tp
        held = self._partitions.get(tp, 0) + sign
        if held <= 0:
            self._partitions.pop(tp, None)
        else:
            self._partitions[tp] = held

    def _count_group(self, msg: M, sign: int) -> None:
        if self._group_of is None:
            return
        group = self._group_of(msg)
        if group is None:
            return
        held = self._groups.get(group)
        if held is None:
            held = self._groups[group] = [0, 0]
        held[0] += sign
        held[1] += sign * msg.size
        if held[0] <= 0:
            del self._groups[group]

    def over_share(self, group: Hashable | None, share: float) -> bool:
        """True when ``group`` holds at least ``share`` of either bound."""
        held = self._groups.get(group) if group is not None else None
        if held is None:
            return False
        b = self.bounds
        return held[0] >= b.max_messages * share or held[1] >= b.max_bytes * share

    def holding(self, partitions: Iterable[Hashable]) -> set[Hashable]:
        """Those of ``partitions`` of which something is held (waiting or in flight)."""
        held = self._partitions
        return {tp for tp in partitions if tp in held}

    def group_held(self, group: Hashable) -> tuple[int, int]:
        """(messages, bytes) held by ``group``."""
        held = self._groups.get(group)
        return (0, 0) if held is None else (held[0], held[1])

    # ---- introspection -----------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Messages pushed and not yet handed out."""
        return self._waiting_count

    @property
    def in_flight(self) -> int:
        """Messages handed out and not yet done."""
        return len(self._in_flight)

    @property
    def held_messages(self) -> int:
        return self._held_count

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    def busy_keys(self) -> Iterator[Hashable]:
        """Keys with a message in flight (for tests and debugging)."""
        return (k for k, s in self._keys.items() if s.in_flight)

    def __len__(self) -> int:
        return self._held_count

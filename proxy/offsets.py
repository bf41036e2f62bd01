"""Per-partition contiguous offset tracking: what the proxy may safely commit.

Writers finish messages out of order (other keys overtake a slow one), so the proxy may
only commit, per partition, the position below which *every* message it read is done
(delivered or dead-lettered). Committing that position means a crash or rebalance can
re-deliver finished messages (duplicates) but never skip an unfinished one (loss).

Offsets need not be dense: compaction and transaction markers leave gaps, so the tracker
works from the offsets it actually saw. A record at or below the highest offset already
seen in the partition is reported as a repeat (``record`` returns False) and should be
skipped: it is either still pending here or already done.

All operations are O(1) amortised. This module must never do I/O, take locks or read the
clock; the runtime serialises access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

P = TypeVar("P", bound=Hashable)


class PartitionOffsets:
    """Offsets read from one partition, and the contiguous done prefix among them."""

    __slots__ = ("_committed", "_done", "_first_read", "_last_read", "_open", "_position")

    def __init__(self, committed: int | None = None) -> None:
        self._open: deque[int] = deque()  # read, in order, not yet part of the done prefix
        self._done: set[int] = set()  # done but behind an unfinished one
        self._first_read: int | None = None
        self._last_read: int | None = None
        self._position: int | None = committed  # next offset to consume after a restart
        self._committed: int | None = committed

    def record(self, offset: int) -> bool:
        """Note an offset read from Kafka. False if it is a repeat that must be skipped."""
        if self._last_read is not None and offset <= self._last_read:
            return False
        if self._position is not None and offset < self._position:
            return False  # below what is already done/committed
        if self._first_read is None:
            self._first_read = offset
        self._last_read = offset
        self._open.append(offset)
        return True

    def mark_done(self, offset: int) -> None:
        """Note a message as finished for good; advances the commit position if contiguous."""
        if not self._open or offset < self._open[0]:
            return  # already behind the done prefix (a late or duplicate completion)
        self._done.add(offset)
        while self._open and self._open[0] in self._done:
            head = self._open.popleft()
            self._done.discard(head)
            self._position = head + 1

    @property
    def position(self) -> int | None:
        """Highest offset + 1 below which every read message is done; None if none yet."""
        return self._position

    @property
    def committed(self) -> int | None:
        return self._committed

    def mark_committed(self, position: int) -> None:
        if self._committed is None or position > self._committed:
            self._committed = position

    @property
    def uncommitted(self) -> int:
        """Messages read here whose offsets are not yet covered by a commit."""
        if self._last_read is None:
            return 0
        base = self._committed if self._committed is not None else self._first_read
        assert base is not None  # set together with _last_read
        return max(0, self._last_read + 1 - base)

    @property
    def open_count(self) -> int:
        """Messages read and not yet inside the done prefix."""
        return len(self._open)


class OffsetTracker(Generic[P]):
    """``PartitionOffsets`` for every assigned partition."""

    def __init__(self) -> None:
        self._parts: dict[P, PartitionOffsets] = {}

    def assign(self, partitions: Iterable[P]) -> None:
        """Start tracking partitions afresh (a new assignment starts from Kafka's position)."""
        for p in partitions:
            self._parts[p] = PartitionOffsets()

    def record(self, partition: P, offset: int) -> bool:
        """Note an offset read. False if the partition is not assigned or it is a repeat."""
        part = self._parts.get(partition)
        return part.record(offset) if part is not None else False

    def mark_done(self, partition: P, offset: int) -> None:
        """Note a message finished; a no-op for a partition no longer assigned."""
        part = self._parts.get(partition)
        if part is not None:
            part.mark_done(offset)

    def to_commit(self) -> dict[P, int]:
        """Positions that moved past the last commit, to be committed now."""
        out: dict[P, int] = {}
        for p, part in self._parts.items():
            pos = part.position
            if pos is not None and (part.committed is None or pos > part.committed):
                out[p] = pos
        return out

    def mark_committed(self, positions: dict[P, int]) -> None:
        for p, pos in positions.items():
            part = self._parts.get(p)
            if part is not None:
                part.mark_committed(pos)

    def revoke(self, partition: P) -> int | None:
        """Stop tracking a partition; returns its final position if it still needs a commit."""
        part = self._parts.pop(partition, None)
        if part is None or part.position is None:
            return None
        if part.committed is not None and part.position <= part.committed:
            return None
        return part.position

    def position(self, partition: P) -> int | None:
        part = self._parts.get(partition)
        return part.position if part is not None else None

    def uncommitted(self) -> dict[P, int]:
        """Per partition, messages read whose offsets no commit covers yet (commit lag)."""
        return {p: part.uncommitted for p, part in self._parts.items()}

    def partitions(self) -> list[P]:
        return list(self._parts)

    def __contains__(self, partition: object) -> bool:
        return partition in self._parts

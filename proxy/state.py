"""The state the proxy's threads share, behind one lock.

The reader pushes, the writer takes and releases, the committer reads commit positions and
gauges, and rebalance callbacks drop partitions. Each method holds ``lock`` for a few
dictionary operations only: never across I/O, never while calling back into Kafka or
aiohttp. ``commit_lock`` serialises "compute positions + commit" so a periodic commit can
never land after (and behind) the commit made on revoke.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from proxy.envelope import Envelope, TopicPartition
from proxy.offsets import OffsetTracker
from proxy.ordering import Bounds, OrderQueue


@dataclass(frozen=True, slots=True)
class Snapshot:
    waiting: int
    in_flight: int
    held: int
    held_bytes: int
    oldest_in_flight_s: float
    uncommitted: dict[TopicPartition, int]


class SharedState:
    def __init__(self, bounds: Bounds) -> None:
        self.lock = threading.Lock()
        self.commit_lock = threading.Lock()
        self.queue: OrderQueue[Envelope] = OrderQueue(bounds, group_of=lambda e: e.tenant)
        self.offsets: OffsetTracker[TopicPartition] = OffsetTracker()
        # Unfinished envelopes handed out to the writer, per partition (for revoke + gauges).
        self.out: dict[TopicPartition, set[Envelope]] = {}
        # Partitions being revoked: the writer starts no new attempt for them.
        self.revoking: set[TopicPartition] = set()

    # reader
    def push(self, envs: Iterable[Envelope]) -> int:
        n = 0
        with self.lock:
            for env in envs:
                if self.offsets.record(env.tp, env.offset):
                    self.queue.push(env)
                    n += 1
        return n

    def should_pause(self) -> bool:
        with self.lock:
            return self.queue.should_pause()

    def holding(self, tps: Iterable[TopicPartition]) -> set[TopicPartition]:
        """Those of ``tps`` with a message pending here (waiting or in flight)."""
        with self.lock:
            return cast(set[TopicPartition], self.queue.holding(tps))

    def assign(self, tps: Iterable[TopicPartition]) -> None:
        with self.lock:
            tps = list(tps)
            self.offsets.assign(tps)
            self.revoking.difference_update(tps)

    def begin_revoke(self, tps: Iterable[TopicPartition]) -> int:
        """Drop waiting messages of these partitions and stop new attempts for them."""
        dropped = 0
        with self.lock:
            for tp in tps:
                self.revoking.add(tp)
                dropped += self.queue.drop_partition(tp)
        return dropped

    def attempting(self, tps: Iterable[TopicPartition]) -> int:
        with self.lock:
            return sum(1 for tp in tps for env in self.out.get(tp, ()) if env.attempting)

    def end_revoke(
        self, tps: Iterable[TopicPartition]
    ) -> tuple[dict[TopicPartition, int], list[Envelope]]:
        """Forget the partitions: final positions to commit, and envelopes still out."""
        positions: dict[TopicPartition, int] = {}
        leftovers: list[Envelope] = []
        with self.lock:
            for tp in tps:
                pos = self.offsets.revoke(tp)
                if pos is not None:
                    positions[tp] = pos
                for env in self.out.pop(tp, ()):
                    env.cancelled = True
                    self.queue.done(env)
                    leftovers.append(env)
        return positions, leftovers

    # writer
    def take(self) -> Envelope | None:
        with self.lock:
            env = self.queue.take()
            if env is not None:
                self.out.setdefault(env.tp, set()).add(env)
            return env

    def release(self, env: Envelope) -> None:
        """The envelope leaves the writer: its key unblocks and it leaves the bounds."""
        with self.lock:
            self.queue.done(env)
            out = self.out.get(env.tp)
            if out is not None:
                out.discard(env)

    def over_share(self, tenant: str | None, share: float) -> bool:
        """True when ``tenant`` holds at least ``share`` of either pending bound."""
        if tenant is None:
            return False
        with self.lock:
            return self.queue.over_share(tenant, share)

    def under_pressure(self) -> bool:
        """True when what is pending fills either bound past the reader's resume mark: only
        then is a tenant's share worth enforcing (a park costs two Kafka writes)."""
        with self.lock:
            q = self.queue
            b = q.bounds
            return (
                q.held_messages > b.max_messages * b.low_ratio
                or q.held_bytes > b.max_bytes * b.low_ratio
            )

    def offset_done(self, env: Envelope) -> None:
        if env.cancelled:
            return  # its partition was revoked; the new owner delivers it again
        with self.lock:
            self.offsets.mark_done(env.tp, env.offset)

    # committer
    def to_commit(self) -> dict[TopicPartition, int]:
        with self.lock:
            return self.offsets.to_commit()

    def mark_committed(self, positions: dict[TopicPartition, int]) -> None:
        with self.lock:
            self.offsets.mark_committed(positions)

    def snapshot(self, now_s: float) -> Snapshot:
        """Gauge values (one consistent read)."""
        with self.lock:
            oldest = min((env.read_s for out in self.out.values() for env in out), default=None)
            return Snapshot(
                waiting=self.queue.waiting,
                in_flight=self.queue.in_flight,
                held=self.queue.held_messages,
                held_bytes=self.queue.held_bytes,
                oldest_in_flight_s=0.0 if oldest is None else max(0.0, now_s - oldest),
                uncommitted=self.offsets.uncommitted(),
            )

"""Parking: how a message that keeps failing leaves memory for the retry topic.

A message that is still failing after ``park_after_s`` in memory, or whose tenant holds more
than its share of the pending bounds, is *parked*: produced to the retry topic (its key,
value and headers as read, plus a ``tocsin-retry`` header with its origin, retry state and
not-before time), and once Kafka acknowledges that, its source offset counts as done. So a
failing endpoint holds neither the source partition's commit position nor the pending
bounds every tenant shares. The proxy's retry lane (a second reader and writer on the retry
topic) waits for each parked message's not-before time, attempts it once, and parks it again
if it fails, until it is delivered or dead-lettered under the same retry policy.

Per-key order across parking: ``Lines`` keeps, per original key (source topic, partition,
key), the ids of its parked messages in order. While a key has a line, its later messages
are parked behind it instead of attempted; in the retry lane only the head of a line is
attempted and a message behind the head is parked again in the same place. Every record of
a key goes to the same retry-topic partition, so the topic keeps the line's order.

Co-partitioning (``RetryLayout``): a record parked from source partition P goes to the
retries partition the layout gives P, and the retry lane reads exactly the retries
partitions of the source partitions its main lane owns. So the proxy that holds a key's line
is the one that sees its parked records finish, with any number of proxies. ``Lines`` lives
in memory: like the rest of the proxy's order guarantee it holds within one proxy's
lifetime. A line is kept only while its records sit on a retry partition this proxy's retry
lane owns (``placed`` records which one; the runtime forgets the line otherwise, and
``drop_retry_partitions`` on a retry-lane revoke), since only then does this proxy see them
finish. It is bounded; past the bound the line touched least recently is forgotten.

Pure: no I/O, no clock, no locks (the runtime passes times and serialises access).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import orjson

from proxy.retry import AttemptState

RETRY_HEADER = "tocsin-retry"
# A parked record carries the whole source record. The retries topic allows 2 MiB, twice
# Kafka's default limit, so any record a default topic admits can be parked; a larger one
# (a source topic configured above that) is retried in memory.
MAX_PARKED_BYTES = 2_000_000
# Parked messages tracked for order at once (about 100 bytes each). Past it the line
# touched least recently is forgotten: a full table must not stall the proxy.
MAX_LINE_ENTRIES = 100_000

KafkaHeaders = Sequence[tuple[str, bytes | None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Where a parked message was first read."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Parked:
    """What the ``tocsin-retry`` header says about a parked record."""

    park_id: str
    origin: Origin
    not_before_ms: int
    state: AttemptState


def encode_header(parked: Parked, *, now_s: float, now_ms: int) -> bytes:
    """The header value; monotonic failure times (``state``) become wall-clock ms."""
    st = parked.state

    def wall(mono: float | None) -> int | None:
        return None if mono is None else now_ms - int((now_s - mono) * 1000)

    o = parked.origin
    return orjson.dumps(
        {
            "v": 1,
            "id": parked.park_id,
            "origin": {
                "topic": o.topic,
                "partition": o.partition,
                "offset": o.offset,
                "timestamp_ms": o.timestamp_ms,
            },
            "not_before_ms": parked.not_before_ms,
            "attempts": st.attempts,
            "failures": st.failures,
            "consecutive_timeouts": st.consecutive_timeouts,
            "failures_6xx": st.failures_6xx,
            "first_failure_ms": wall(st.first_failure_s),
            "last_failure_ms": wall(st.last_failure_s),
            "last_status": st.last_status,
            "last_error": None if st.last_error is None else st.last_error[:1024],
        }
    )


def park_headers(headers: KafkaHeaders, header: bytes) -> list[tuple[str, bytes | None]]:
    """The source record's headers (any ``tocsin-retry`` among them dropped) plus ours."""
    return [(k, v) for k, v in headers if k != RETRY_HEADER] + [(RETRY_HEADER, header)]


def decode_headers(
    headers: KafkaHeaders, *, now_s: float, now_ms: int
) -> tuple[Parked, list[tuple[str, bytes | None]]]:
    """(what the header says, the source record's own headers) of a retry-topic record;
    ValueError if the header is missing or malformed. Wall-clock ms become monotonic."""
    own = [(k, v) for k, v in headers if k != RETRY_HEADER]
    raw = [v for k, v in headers if k == RETRY_HEADER]
    if len(raw) != 1 or raw[0] is None:
        raise ValueError(f"a retry record needs exactly one {RETRY_HEADER} header")
    try:
        doc = orjson.loads(raw[0])
        o = doc["origin"]

        def mono(ms: object) -> float | None:
            return None if ms is None else now_s - (now_ms - int(ms)) / 1000  # type: ignore[call-overload]

        last_error = doc.get("last_error")
        parked = Parked(
            park_id=str(doc["id"]),
            origin=Origin(
                topic=str(o["topic"]),
                partition=int(o["partition"]),
                offset=int(o["offset"]),
                timestamp_ms=None if o.get("timestamp_ms") is None else int(o["timestamp_ms"]),
            ),
            not_before_ms=int(doc["not_before_ms"]),
            state=AttemptState(
                attempts=int(doc["attempts"]),
                failures=int(doc["failures"]),
                consecutive_timeouts=int(doc["consecutive_timeouts"]),
                failures_6xx=int(doc["failures_6xx"]),
                first_failure_s=mono(doc.get("first_failure_ms")),
                last_failure_s=mono(doc.get("last_failure_ms")),
                last_status=None if doc.get("last_status") is None else int(doc["last_status"]),
                last_error=None if last_error is None else str(last_error),
            ),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {RETRY_HEADER} header: {exc!r}") from exc
    return parked, own


@dataclass(frozen=True, slots=True)
class RetryLayout:
    """Where each source partition's parked records go in the retries topic.

    The source topics, sorted by name, are laid end to end: partition P of the i-th topic is
    source index (partitions of the topics before it) + P, and parks to the retries
    partition of that index. A retries partition past the last index (the topic has more
    partitions than the sources) is read by the owner of index ``r % total``, so every
    retries partition has exactly one reader and records parked there by an earlier
    layout are still read.
    """

    starts: tuple[tuple[str, int, int], ...]  # (topic, its first index, its partitions)
    retry_partitions: int

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.starts)

    def index(self, topic: str, partition: int) -> int | None:
        """The source index of ``topic``[``partition``]; None if the layout lacks it (a
        topic or partition added after the proxy started)."""
        for name, first, count in self.starts:
            if name == topic:
                return first + partition if 0 <= partition < count else None
        return None

    def retry_partition(self, topic: str, partition: int) -> int | None:
        """The retries partition a record parked from ``topic``[``partition``] goes to."""
        return self.index(topic, partition)

    def followed(self, source: Iterable[tuple[str, int]]) -> set[int]:
        """The retries partitions read by the owner of these source partitions."""
        owned = {i for t, p in source if (i := self.index(t, p)) is not None}
        total = self.total
        return {r for r in range(self.retry_partitions) if r % total in owned}


def retry_layout(source_partitions: Mapping[str, int], retry_partitions: int) -> RetryLayout | None:
    """The layout of these source topics ({topic: partitions}) on a retries topic of
    ``retry_partitions``; None when it has fewer partitions than the sources together (no
    co-partitioning is possible) or a count is unknown (< 1)."""
    if not source_partitions or any(n < 1 for n in source_partitions.values()):
        return None
    starts: list[tuple[str, int, int]] = []
    first = 0
    for topic in sorted(source_partitions):
        starts.append((topic, first, source_partitions[topic]))
        first += source_partitions[topic]
    if first > retry_partitions:
        return None
    return RetryLayout(starts=tuple(starts), retry_partitions=retry_partitions)


class Lines:
    """Per original key, the ids of its parked messages in park order (see the module)."""

    def __init__(self, max_entries: int = MAX_LINE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._lines: OrderedDict[Hashable, deque[str]] = OrderedDict()
        # The retry-topic partition a line's records sit on (every record of a key goes to
        # the same one), once Kafka has acknowledged one of them.
        self._placed: dict[Hashable, int] = {}
        self._entries = 0

    def has_line(self, key: Hashable) -> bool:
        return key in self._lines

    def is_head(self, key: Hashable, park_id: str) -> bool:
        """True if ``park_id`` may be attempted: the head of its line, or in no line (parked
        by an earlier life of the proxy or another instance: no order is known for it)."""
        line = self._lines.get(key)
        return line is None or line[0] == park_id or park_id not in line

    def holds(self, key: Hashable, park_id: str) -> bool:
        line = self._lines.get(key)
        return line is not None and park_id in line

    def append(self, key: Hashable, park_id: str) -> int:
        """A message of ``key`` was parked at the back of its line; returns how many lines
        were forgotten to stay within the bound (the order of those keys is lost)."""
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = deque()
        else:
            self._lines.move_to_end(key)
        line.append(park_id)
        self._entries += 1
        evicted = 0
        while self._entries > self.max_entries:
            old_key, oldest = self._lines.popitem(last=False)
            self._placed.pop(old_key, None)
            self._entries -= len(oldest)
            evicted += 1
        return evicted

    def placed(self, key: Hashable, retry_partition: int) -> None:
        """Kafka acknowledged a parked record of ``key`` on ``retry_partition``."""
        if key in self._lines:
            self._placed[key] = retry_partition

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s line: this proxy can no longer see its records finish."""
        line = self._lines.pop(key, None)
        if line is not None:
            self._entries -= len(line)
        self._placed.pop(key, None)

    def placed_partitions(self) -> set[int]:
        """The retry-topic partitions some line's records are known to sit on."""
        return set(self._placed.values())

    def drop_retry_partitions(self, partitions: set[int]) -> int:
        """Forget the lines whose records sit on these retry-topic partitions (revoked from
        this proxy's retry lane: another instance finishes those records, unseen here).
        Lines on other partitions, or not acknowledged yet, stay. Returns how many went."""
        gone = [k for k, p in self._placed.items() if p in partitions]
        for key in gone:
            self.forget(key)
        return len(gone)

    def replace(self, key: Hashable, old_id: str, new_id: str) -> None:
        """A parked message was parked again: it keeps its place under its new id. One in no
        line (see ``is_head``) stays in none."""
        line = self._lines.get(key)
        if line is None:
            return
        for i, pid in enumerate(line):
            if pid == old_id:
                line[i] = new_id
                return

    def finish(self, key: Hashable, park_id: str) -> None:
        """A parked message was delivered or dead-lettered: it leaves its line."""
        line = self._lines.get(key)
        if line is None:
            return
        try:
            line.remove(park_id)
        except ValueError:
            return
        self._entries -= 1
        if not line:
            del self._lines[key]
            self._placed.pop(key, None)

    def drop_partition(self, topic: str, partition: int) -> None:
        """Forget the lines of a source partition (revoked: its new owner starts afresh)."""
        for key in [k for k in self._lines if _partition_of(k) == (topic, partition)]:
            self.forget(key)

    def clear(self) -> None:
        self._lines.clear()
        self._placed.clear()
        self._entries = 0

    def __len__(self) -> int:
        return self._entries


def _partition_of(key: Hashable) -> tuple[object, object] | None:
    if isinstance(key, tuple) and len(key) == 3:
        return key[0], key[1]
    return None

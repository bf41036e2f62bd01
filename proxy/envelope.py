"""From a Kafka record to the request the proxy will make: the two delivery modes.

* fires mode: the record is a trigger (docs/design.md); its callback names the URL, method,
  headers and timeout. The body is the payload (JSON or opaque bytes).
* generic mode: any record goes to one configured endpoint with the MPS contract: POST,
  headers ``Key``, ``Topic``, ``Partition``, ``Offset`` and every Kafka header, body the
  record value as is.

An ``Envelope`` carries the original record (for dead letters), the request, the order key
and the per-message retry state. A record that cannot be turned into a request (a trigger
that does not parse) still becomes an envelope, marked ``invalid``, so it is dead-lettered
through the normal path and its offset gets committed.

Pure: no I/O, no clock (callers pass ``now``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

from base.errors import TocsinError
from proxy.parking import Origin
from proxy.retry import AttemptState
from topics.callbacks import is_proxy_header
from topics.models import HttpCallback, KafkaCallback, PayloadType, Trigger
from topics.tracecontext import TRACEPARENT, TRACESTATE, from_headers

if TYPE_CHECKING:
    import asyncio

KafkaHeaders = Sequence[tuple[str, bytes | None]]
TopicPartition = tuple[str, int]

# RFC 9110 token characters: what a header name may contain.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# Header values: visible ASCII/latin-1 plus space and tab; anything else is percent-encoded
# so a Kafka header can never smuggle CR/LF into the HTTP request.
_UNSAFE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_RESERVED = frozenset(
    {
        "key",
        "topic",
        "partition",
        "offset",
        "content-length",
        "host",
        "transfer-encoding",
        "connection",
        "content-type",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    timeout_s: float

    @property
    def host(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"


# Python objects per pending message beyond its bytes (envelope, trigger, request, state).
ENVELOPE_OVERHEAD_BYTES = 1024


class Envelope:
    """One record in the proxy, from poll to its final outcome."""

    __slots__ = (
        "attempt_state",
        "attempting",
        "cancelled",
        "first_attempt_s",
        "headers",
        "host",
        "invalid",
        "kafka_target",
        "key",
        "not_before_s",
        "offset",
        "order_key",
        "origin",
        "park_id",
        "partition",
        "read_s",
        "request",
        "size",
        "timer",
        "timestamp_ms",
        "topic",
        "tp",
        "trigger",
        "value",
    )

    def __init__(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: KafkaHeaders,
        timestamp_ms: int | None,
        read_s: float,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self.value = value
        self.headers = list(headers)
        self.timestamp_ms = timestamp_ms
        self.read_s = read_s
        self.tp: TopicPartition = (topic, partition)
        # Order is per Kafka key within a partition: that is the order Kafka itself gives.
        self.order_key: Hashable | None = None if key is None else (topic, partition, key)
        # What holding this message costs in memory, for the pending-bytes bound: the value
        # twice (the record, and the payload decoded from it into the trigger), plus about
        # 1 KiB of Python objects per envelope (measured: counting value + 200 B let the
        # process exceed its memory target by 3.5 % at the 64 MiB default).
        self.size = (
            len(key or b"")
            + 2 * len(value or b"")
            + sum(len(k) + len(v or b"") for k, v in self.headers)
            + ENVELOPE_OVERHEAD_BYTES
        )
        self.request: Request | None = None
        self.kafka_target: KafkaCallback | None = None
        self.trigger: Trigger | None = None
        self.invalid: str | None = None
        self.host = ""
        self.attempt_state = AttemptState()
        self.attempting = False
        self.cancelled = False
        self.timer: asyncio.TimerHandle | None = None  # a scheduled retry
        self.first_attempt_s: float | None = None
        # Set when the record came from the retry topic (proxy.parking): where it was first
        # read, its id in its key's line, and when it may be attempted (monotonic).
        self.origin: Origin | None = None
        self.park_id: str | None = None
        self.not_before_s: float | None = None

    @property
    def source(self) -> Origin:
        """Where the message was first read (its origin, or this record itself)."""
        if self.origin is not None:
            return self.origin
        return Origin(
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            timestamp_ms=self.timestamp_ms,
        )

    @property
    def line_key(self) -> Hashable | None:
        """The key whose parked messages form one line (proxy.parking); None: keyless."""
        if self.key is None:
            return None
        if self.origin is not None:
            return (self.origin.topic, self.origin.partition, self.key)
        return self.order_key

    @property
    def tenant(self) -> str | None:
        """Whose share of the pending bounds and writers this counts against (fires)."""
        return self.trigger.tenant if self.trigger is not None else None

    def __repr__(self) -> str:
        return f"Envelope({self.topic}[{self.partition}]@{self.offset})"


def _header_value(raw: bytes | str | None) -> str:
    text = raw.decode("latin-1") if isinstance(raw, bytes) else (raw or "")
    if _UNSAFE.search(text):
        return quote(text, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%"))
    return text


def generic_request(env: Envelope, *, url: str, timeout_s: float) -> Request:
    """The MPS request for any record: POST, Key/Topic/Partition/Offset + Kafka headers."""
    src = env.source
    headers: list[tuple[str, str]] = [
        ("Topic", src.topic),
        ("Partition", str(src.partition)),
        ("Offset", str(src.offset)),
        ("Content-Type", "application/octet-stream"),
        ("Accept", "application/json"),
    ]
    if env.key is not None:
        headers.append(("Key", _header_value(env.key)))
    for name, value in env.headers:
        # Names that are not HTTP tokens, or that would overwrite the contract's own headers
        # or break framing, cannot travel as headers; they stay in the dead letter if any.
        if _TOKEN.match(name) and name.lower() not in _RESERVED:
            headers.append((name, _header_value(value)))
    return Request(
        method="POST", url=url, headers=tuple(headers), body=env.value or b"", timeout_s=timeout_s
    )


def fire_request(trigger: Trigger, callback: HttpCallback) -> Request:
    # The proxy's own names are dropped from the callback's headers, not just appended
    # after them: a receiver reading the first value would take the tenant's. Commands may
    # not name them, but a schedule stored before that rule still carries them.
    # The trigger's trace context (from the command) wins over a traceparent among the
    # callback's own headers: the callback's is one fixed value for every run, the
    # command's is the request that asked for this run, and a receiver must see one
    # traceparent (the W3C rule drops both when two differ). A tracestate goes with its
    # traceparent, so the callback's is dropped with it. Without one, the callback's own
    # pass as given.
    traced = trigger.traceparent is not None
    headers = [
        (k, _header_value(v))
        for k, v in callback.headers.items()
        if _TOKEN.match(k)
        and k.lower() not in ("content-length", "host", "transfer-encoding", "connection")
        and not is_proxy_header(k)
        and not (traced and k.lower() in (TRACEPARENT, TRACESTATE))
    ]
    have = {k.lower() for k, _ in headers}
    if "content-type" not in have:
        ctype = (
            "application/json"
            if trigger.payload_type == PayloadType.JSON
            else "application/octet-stream"
        )
        headers.append(("Content-Type", ctype))
    headers += [
        ("Tocsin-Trigger-Id", trigger.trigger_id),
        ("Tocsin-Schedule-Id", _header_value(trigger.schedule_id)),
        ("Tocsin-Tenant", _header_value(trigger.tenant)),
        ("Tocsin-Due-Ms", str(trigger.due_ms)),
        # When the scheduler emitted it (its clock): lateness up to the fire topic apart
        # from the delivery's own.
        ("Tocsin-Emitted-Ms", str(trigger.emitted_ms)),
        ("Tocsin-Emit-Attempt", str(trigger.attempt)),
        # The key whose triggers are delivered one at a time, in order: a receiver can
        # check or use that order without parsing the payload.
        ("Tocsin-Order-Key", _header_value(trigger.order_key)),
        # Stable across re-emits and proxy retries: receivers can drop duplicates with it.
        ("Idempotency-Key", trigger.trigger_id),
    ]
    if trigger.traceparent is not None:
        headers.append((TRACEPARENT, trigger.traceparent))
        if trigger.tracestate:
            headers.append((TRACESTATE, trigger.tracestate))
    return Request(
        method=callback.method,
        url=callback.url,
        headers=tuple(headers),
        body=trigger.payload,
        timeout_s=callback.timeout_s,
    )


def prepare_fire(env: Envelope, decode: Callable[[bytes], Trigger]) -> None:
    """Fill a fires-topic envelope's request (or mark it invalid)."""
    try:
        trigger = decode(env.value or b"")
    except (ValueError, TocsinError) as exc:
        env.invalid = f"undecodable trigger: {exc}"
        return
    # The trace context travels in the record's headers (topics.codec.trigger_headers),
    # checked again here: any producer may write to the fires topic.
    trace = from_headers(env.headers).context
    if trace is not None:
        trigger = dataclasses.replace(
            trigger, traceparent=trace.traceparent, tracestate=trace.tracestate
        )
    env.trigger = trigger
    cb = trigger.callback
    if isinstance(cb, KafkaCallback):
        env.kafka_target = cb
        env.host = f"kafka:{cb.topic}"
        return
    parts = urlsplit(cb.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        env.invalid = f"callback url is not http(s): {cb.url!r}"
        return
    env.request = fire_request(trigger, cb)
    env.host = env.request.host


def prepare_generic(env: Envelope, *, url: str, timeout_s: float) -> None:
    env.request = generic_request(env, url=url, timeout_s=timeout_s)
    env.host = env.request.host

"""W3C Trace Context (``traceparent`` / ``tracestate``) as Tocsin carries it: parsed strictly
at every edge where it comes in (a command's Kafka headers, an API request's headers, a
fires record's headers), stored with a schedule, and sent on with its trigger.

A value that is not a valid ``traceparent`` is dropped, never a rejection: tracing must
never fail a schedule. Callers count what they drop. Pure: no I/O, no OpenTelemetry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# version 00 is 55 characters; a later version may append fields after a dash, which we
# neither read nor forward. Anything longer than this is refused unread.
MAX_TRACEPARENT_CHARS = 256
# The W3C limit: at most 32 list members, and a vendor may drop a tracestate longer than
# 512 characters rather than truncate it (truncating could cut a member in half).
MAX_TRACESTATE_CHARS = 512
MAX_TRACESTATE_MEMBERS = 32

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16
# A list member: key "=" value; keys are lowercase (optionally tenant@system), values are
# printable ASCII except "," and "=", not ending in a space.
_MEMBER = re.compile(
    r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A valid ``traceparent`` (normalised to version 00) and its optional ``tracestate``."""

    traceparent: str
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def parent_id(self) -> str:
        return self.traceparent[36:52]

    @property
    def flags(self) -> int:
        return int(self.traceparent[53:55], 16)

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    @property
    def pair(self) -> tuple[str, str | None]:
        """(traceparent, tracestate), the form ``base.tracing.start`` takes."""
        return self.traceparent, self.tracestate

    def headers(self) -> list[tuple[str, bytes]]:
        """Kafka headers carrying this context."""
        out = [(TRACEPARENT, self.traceparent.encode("ascii"))]
        if self.tracestate:
            out.append((TRACESTATE, self.tracestate.encode("ascii")))
        return out


def parse_traceparent(value: str | bytes | None) -> str | None:
    """The ``traceparent`` as version 00, or None when ``value`` is not a valid one.

    Strict: lowercase hex, version not ``ff``, trace id and parent id not all zeros,
    version 00 exactly 55 characters. A later version is read by its first four fields
    when what follows them starts with a dash (the W3C rule for versions we do not know)
    and forwarded as version 00, the only version we may send."""
    if value is None:
        return None
    if isinstance(value, bytes):
        if len(value) > MAX_TRACEPARENT_CHARS:
            return None
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(value) > MAX_TRACEPARENT_CHARS:
        return None
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or parent_id == _ZERO_PARENT:
        return None
    rest = value[match.end() :]
    if version == "00":
        if rest:
            return None
    elif rest and not rest.startswith("-"):
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def parse_tracestate(value: str | bytes | None) -> str | None:
    """The ``tracestate`` when it is a valid W3C list (at most 32 members, 512 characters),
    else None; empty members (``a=1,,b=2``) are allowed and dropped."""
    if value is None:
        return None
    if isinstance(value, bytes):
        if len(value) > MAX_TRACESTATE_CHARS:
            return None
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(value) > MAX_TRACESTATE_CHARS:
        return None
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    keys: set[str] = set()
    for member in members:
        if _MEMBER.fullmatch(member) is None:
            return None
        key = member.split("=", 1)[0]
        if key in keys:
            return None
        keys.add(key)
    return ",".join(members)


@dataclass(frozen=True, slots=True)
class Extracted:
    """What a set of headers held: the valid context (None: none, or dropped) and whether
    a ``traceparent`` was present but invalid (to be counted by the caller)."""

    context: TraceContext | None
    invalid: bool = False


NOTHING = Extracted(None)


def from_values(traceparent: str | bytes | None, tracestate: str | bytes | None) -> Extracted:
    """The context of one ``traceparent`` and ``tracestate`` pair (either may be None). An
    invalid tracestate is dropped alone; it is never kept without its traceparent."""
    if traceparent is None:
        return NOTHING
    parent = parse_traceparent(traceparent)
    if parent is None:
        return Extracted(None, invalid=True)
    return Extracted(TraceContext(parent, parse_tracestate(tracestate)))


def from_headers(
    headers: Iterable[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None],
) -> Extracted:
    """The context in Kafka or HTTP headers (names compared ignoring case). Two different
    ``traceparent`` values are invalid (the W3C rule: a receiver cannot tell which is
    meant); several ``tracestate`` values are one list, joined in order."""
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    parents: list[str | bytes] = []
    states: list[str] = []
    for name, value in pairs:
        # A length test first: most headers are neither, and this runs on every record.
        if value is None or len(name) not in (10, 11):
            continue
        lowered = name.lower()
        if lowered == TRACEPARENT:
            parents.append(value)
        elif lowered == TRACESTATE:
            if isinstance(value, bytes):
                try:
                    value = value.decode("ascii")
                except UnicodeDecodeError:
                    continue
            states.append(value)
    if not parents:
        return NOTHING
    if len(set(parents)) > 1:
        return Extracted(None, invalid=True)
    return from_values(parents[0], ",".join(states) if states else None)

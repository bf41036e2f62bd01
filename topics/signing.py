"""Per-tenant command signatures: proof that a commands-topic message comes from its tenant.

Every tenant registered through the API or ``tocsin tenant register`` gets a signing key.
Its producers add two Kafka headers to each command:

    tocsin-signed-at   decimal epoch ms when it was signed
    tocsin-signature   "v1=" + hex HMAC-SHA256(signing key, signed material)

    signed material = b"v1\\n" + signed_at + b"\\n" + len(key) + b"\\n" + key + value

(``key`` is the record key, empty when keyless; lengths and times are ASCII decimals). The
command agent looks the key up by the command's ``tenant`` and rejects the message with
``bad_signature`` when the header is missing or wrong. So tenant B cannot cancel, update or
create schedules of tenant A through the topic without A's key.

**Freshness.** A correctly signed record is refused with ``stale_command`` when
``signed_at`` is more than ``MAX_SKEW_MS`` away from the record's timestamp, and that
timestamp must be the broker's: the commands topic is created with
``message.timestamp.type=LogAppendTime`` (topics.catalog), so a copy re-produced later gets
the broker's time of the copy whatever its producer says, while a crash replay of the same
record keeps its own. A record stamped by its producer (``CreateTime``: a topic created
before this setting, or not altered) cannot be judged and is refused ``stale_command`` too.
Within the window, ``SeenSignatures`` refuses a second record carrying a signature already
read at another offset of the partition (``replayed_command``).

**Rotation** (``SigningKeys``): a tenant has a current key and, during a rotation, the
previous one. Both verify until the previous key is retired - explicitly, or when its
expiry passes. A command signed with a retired key (the previous one after retirement, or
the one rotated out before it) is rejected with ``signing_key_retired``, so its producer
knows to fetch the current key; anything else that does not verify is ``bad_signature``.
A previous key verifies a record only if the record's timestamp is before the retirement
*and* the check happens less than ``MAX_SKEW_MS`` after it: commands produced just before
the retirement (in flight, or replayed after a crash) are still answered as before, while
a holder of the old key cannot get past the retirement by back-dating record timestamps.

Pure: must never do I/O or read the clock (callers pass ``now_ms``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from topics.codes import Code

HEADER_SIGNATURE = "tocsin-signature"
HEADER_SIGNED_AT = "tocsin-signed-at"
VERSION = "v1"
MAX_SKEW_MS = 5 * 60 * 1000
SIGNING_KEY_PREFIX = "tss_"
# Signatures remembered per partition for the replay check: a bound on memory (about 4 MB
# a partition), covering 66 signed commands a second over the 5-minute window. Beyond that
# rate the oldest are forgotten first and only the window refuses their copies.
SEEN_SIGNATURES_PER_PARTITION = 20_000
# Bytes of a verified signature a schedule row keeps to recognise a copy of a command
# applied to it (streams.decisions.check_signed_order): 128 bits, as unforgeable as the
# whole MAC to anyone without the key, in a quarter of its hex.
SIGNED_MAC_BYTES = 16


class TimestampType(StrEnum):
    """Who set a Kafka record's timestamp (the topic's ``message.timestamp.type``)."""

    CREATE_TIME = "CreateTime"  # the producer: anything it likes
    LOG_APPEND_TIME = "LogAppendTime"  # the broker, when it appended the record


def new_signing_key() -> str:
    """A fresh signing key: ``tss_`` + 43 characters of base64url (256 random bits)."""
    raw = secrets.token_bytes(32)
    return SIGNING_KEY_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _material(signed_at_ms: int, key: bytes | None, value: bytes) -> bytes:
    k = key or b""
    return f"{VERSION}\n{signed_at_ms}\n{len(k)}\n".encode("ascii") + k + value


def signature(secret: str, *, signed_at_ms: int, key: bytes | None, value: bytes) -> str:
    """The ``tocsin-signature`` header value for one record."""
    mac = hmac.new(secret.encode("utf-8"), _material(signed_at_ms, key, value), hashlib.sha256)
    return f"{VERSION}={mac.hexdigest()}"


def sign_headers(
    secret: str, *, signed_at_ms: int, key: bytes | None, value: bytes
) -> list[tuple[str, bytes]]:
    """Kafka headers to attach to a command record."""
    return [
        (HEADER_SIGNED_AT, str(signed_at_ms).encode("ascii")),
        (
            HEADER_SIGNATURE,
            signature(secret, signed_at_ms=signed_at_ms, key=key, value=value).encode("ascii"),
        ),
    ]


def header_map(headers: Iterable[object] | Mapping[str, object] | None) -> dict[str, bytes]:
    """Kafka headers (a list of (name, value) pairs or a mapping) as {lowercase name: bytes};
    the first of repeated names wins. Values that are not bytes/str are dropped."""
    out: dict[str, bytes] = {}
    if headers is None:
        return out
    items = headers.items() if isinstance(headers, Mapping) else headers
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            continue
        name, value = item[0], item[1]
        if not isinstance(name, str | bytes):
            continue
        text = name.decode("latin-1") if isinstance(name, bytes) else name
        if isinstance(value, str):
            value = value.encode("utf-8")
        if isinstance(value, bytes):
            out.setdefault(text.lower(), value)
    return out


def verify(
    secret: str,
    headers: Mapping[str, bytes],
    *,
    key: bytes | None,
    value: bytes,
    record_ms: int,
    max_skew_ms: int = MAX_SKEW_MS,
) -> str | None:
    """None when the record is correctly signed with ``secret``; otherwise why not (for the
    ``bad_signature`` message; never reveals the expected signature)."""
    parsed = _signed(headers, record_ms, max_skew_ms)
    if isinstance(parsed, str):
        return parsed
    if not _matches(secret, parsed, key, value):
        return _MISMATCH
    return None


_MISMATCH = "signature does not match the command and the tenant's signing key"


def _signed(
    headers: Mapping[str, bytes], record_ms: int, max_skew_ms: int | None
) -> tuple[int, bytes] | str:
    """(signed_at, signature header) of a record, or why they are missing or unusable (or,
    with ``max_skew_ms``, too far from ``record_ms``)."""
    raw_sig = headers.get(HEADER_SIGNATURE)
    raw_at = headers.get(HEADER_SIGNED_AT)
    if raw_sig is None or raw_at is None:
        return (
            f"missing {HEADER_SIGNATURE}/{HEADER_SIGNED_AT} headers; this tenant's commands "
            "must be signed with its signing key"
        )
    try:
        signed_at = int(raw_at.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return f"{HEADER_SIGNED_AT} must be decimal epoch ms"
    if max_skew_ms is not None and abs(record_ms - signed_at) > max_skew_ms:
        return (
            f"{HEADER_SIGNED_AT} is {abs(record_ms - signed_at)} ms away from the record "
            f"timestamp (at most {max_skew_ms} allowed): sign when producing"
        )
    return signed_at, raw_sig


def _matches(secret: str, signed: tuple[int, bytes], key: bytes | None, value: bytes) -> bool:
    expected = signature(secret, signed_at_ms=signed[0], key=key, value=value).encode("ascii")
    return hmac.compare_digest(expected, signed[1])


def _stored_key(value: object) -> str | None:
    """A key column's value; None when the column is empty (null or "")."""
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True, kw_only=True)
class SigningKeys:
    """A tenant's signing keys (columns of ``tenants``, migration 006)."""

    current: str | None
    previous: str | None = None
    # When the previous key stops verifying; None: valid until retired explicitly.
    previous_expires_ms: int | None = None
    retired: str | None = None  # the key rotated out before ``previous`` (recognised only)

    @classmethod
    def of_row(cls, row: Mapping[str, object] | None) -> SigningKeys:
        row = row or {}
        expires = row.get("previous_signing_expires_ms")
        return cls(
            current=_stored_key(row.get("signing_secret")),
            previous=_stored_key(row.get("previous_signing_secret")),
            previous_expires_ms=expires if isinstance(expires, int) else None,
            retired=_stored_key(row.get("retired_signing_secret")),
        )

    def previous_valid(
        self, *, record_ms: int, now_ms: int, max_skew_ms: int = MAX_SKEW_MS
    ) -> bool:
        if self.previous is None:
            return False
        expires = self.previous_expires_ms
        return expires is None or (record_ms < expires and now_ms < expires + max_skew_ms)


def mac_prefix(signature_header: bytes) -> bytes:
    """The first ``SIGNED_MAC_BYTES`` of a verified ``tocsin-signature`` ("v1=" + hex)."""
    hex_digits = signature_header[len(VERSION) + 1 : len(VERSION) + 1 + 2 * SIGNED_MAC_BYTES]
    return bytes.fromhex(hex_digits.decode("ascii"))


def signed_fields(headers: Mapping[str, bytes]) -> tuple[int, bytes] | None:
    """(signed_at, signature header) of a record, None when missing or malformed."""
    parsed = _signed(headers, 0, None)
    return None if isinstance(parsed, str) else parsed


def check_signature(
    keys: SigningKeys,
    headers: Mapping[str, bytes],
    *,
    key: bytes | None,
    value: bytes,
    record_ms: int,
    timestamp_type: TimestampType,
    now_ms: int,
    max_skew_ms: int = MAX_SKEW_MS,
) -> tuple[Code, str] | None:
    """None when the record is signed with the current key, or with the previous key while
    it is valid, and fresh; else (``bad_signature``, ``signing_key_retired`` or
    ``stale_command``, why). Fresh: ``record_ms`` is the broker's append time and within
    ``max_skew_ms`` of ``signed_at``. The signature is checked first, so only a holder of
    the key learns that a record is stale."""
    if keys.current is None:
        return Code.BAD_SIGNATURE, "the tenant has no signing key"
    parsed = _signed(headers, record_ms, None)
    if isinstance(parsed, str):
        return Code.BAD_SIGNATURE, parsed  # missing or malformed headers
    if _matches(keys.current, parsed, key, value):
        return _stale(parsed[0], record_ms, timestamp_type, max_skew_ms)
    if keys.previous is not None and _matches(keys.previous, parsed, key, value):
        if keys.previous_valid(record_ms=record_ms, now_ms=now_ms, max_skew_ms=max_skew_ms):
            return _stale(parsed[0], record_ms, timestamp_type, max_skew_ms)
        return (
            Code.SIGNING_KEY_RETIRED,
            f"signed with the tenant's previous signing key, retired at epoch ms "
            f"{keys.previous_expires_ms}; sign with the current key",
        )
    if keys.retired is not None and _matches(keys.retired, parsed, key, value):
        return (
            Code.SIGNING_KEY_RETIRED,
            "signed with a signing key the tenant has rotated out; sign with the current key",
        )
    return Code.BAD_SIGNATURE, _MISMATCH


def _stale(
    signed_at_ms: int, record_ms: int, timestamp_type: TimestampType, max_skew_ms: int
) -> tuple[Code, str] | None:
    if timestamp_type is not TimestampType.LOG_APPEND_TIME:
        return (
            Code.STALE_COMMAND,
            "the record's timestamp was set by its producer (CreateTime), so its freshness "
            "cannot be checked; the commands topic must have "
            "message.timestamp.type=LogAppendTime (`tocsin setup` sets it)",
        )
    if abs(record_ms - signed_at_ms) > max_skew_ms:
        return (
            Code.STALE_COMMAND,
            f"{HEADER_SIGNED_AT} is {abs(record_ms - signed_at_ms)} ms away from the time the "
            f"broker appended the record (at most {max_skew_ms} allowed): sign when producing",
        )
    return None


class SeenSignatures:
    """The signatures of one partition's verified records within the freshness window.

    A record whose signature was already read at another offset is a copy of that record
    (``first_offset`` answers where); the same offset read again is the same record (a
    batch retried, a crash replay) and is not a copy. An entry is forgotten once its
    ``signed_at`` is more than the window behind the newest broker time of the partition
    (a copy of it would be stale) or, beyond ``max_entries``, oldest first. Pure."""

    def __init__(
        self, *, window_ms: int = MAX_SKEW_MS, max_entries: int = SEEN_SIGNATURES_PER_PARTITION
    ) -> None:
        self.window_ms = window_ms
        self.max_entries = max_entries
        # signature -> (offset, signed_at), in the order first read.
        self._seen: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._newest_ms = 0

    def __len__(self) -> int:
        return len(self._seen)

    def first_offset(
        self, signature: bytes, *, offset: int, signed_at_ms: int, record_ms: int
    ) -> int | None:
        """The offset where ``signature`` was first read when that is not ``offset``;
        otherwise None (and the signature is remembered)."""
        self._newest_ms = max(self._newest_ms, record_ms)
        horizon = self._newest_ms - self.window_ms
        seen = self._seen
        hit = seen.get(signature)
        if hit is not None:
            return hit[0] if hit[0] != offset else None
        while seen:
            first = next(iter(seen.values()))
            if first[1] >= horizon and len(seen) < self.max_entries:
                break
            seen.popitem(last=False)
        seen[signature] = (offset, signed_at_ms)
        return None

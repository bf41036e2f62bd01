"""Per-tenant command signatures: proof that a commands-topic message comes from its tenant.

Every tenant registered through the API or ``tocsin tenant register`` gets a signing key.
Its producers add two Kafka headers to each command:

    tocsin-signed-at   decimal epoch ms when it was signed
    tocsin-signature   "v1=" + hex HMAC-SHA256(signing key, signed material)

    signed material = b"v1\\n" + signed_at + b"\\n" + len(key) + b"\\n" + key + value

(``key`` is the record key, empty when keyless; lengths and times are ASCII decimals). The
command agent looks the key up by the command's ``tenant`` and rejects the message with
``bad_signature`` when the header is missing or wrong, or when ``signed_at`` is more than
``MAX_SKEW_MS`` away from the record's timestamp (a copied message re-produced later gets a
new timestamp; a crash replay of the same record keeps its own). So tenant B cannot cancel,
update or create schedules of tenant A through the topic without A's key.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from topics.codes import Code

HEADER_SIGNATURE = "tocsin-signature"
HEADER_SIGNED_AT = "tocsin-signed-at"
VERSION = "v1"
MAX_SKEW_MS = 5 * 60 * 1000
SIGNING_KEY_PREFIX = "tss_"


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


def header_map(headers: Iterable[Any] | Mapping[str, Any] | None) -> dict[str, bytes]:
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
    headers: Mapping[str, bytes], record_ms: int, max_skew_ms: int
) -> tuple[int, bytes] | str:
    """(signed_at, signature header) of a record, or why they are missing or unusable."""
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
    if abs(record_ms - signed_at) > max_skew_ms:
        return (
            f"{HEADER_SIGNED_AT} is {abs(record_ms - signed_at)} ms away from the record "
            f"timestamp (at most {max_skew_ms} allowed): sign when producing"
        )
    return signed_at, raw_sig


def _matches(secret: str, signed: tuple[int, bytes], key: bytes | None, value: bytes) -> bool:
    expected = signature(secret, signed_at_ms=signed[0], key=key, value=value).encode("ascii")
    return hmac.compare_digest(expected, signed[1])


@dataclass(frozen=True, kw_only=True)
class SigningKeys:
    """A tenant's signing keys (columns of ``tenants``, migration 006)."""

    current: str | None
    previous: str | None = None
    # When the previous key stops verifying; None: valid until retired explicitly.
    previous_expires_ms: int | None = None
    retired: str | None = None  # the key rotated out before ``previous`` (recognised only)

    @classmethod
    def of_row(cls, row: Mapping[str, Any] | None) -> SigningKeys:
        row = row or {}
        return cls(
            current=row.get("signing_secret") or None,
            previous=row.get("previous_signing_secret") or None,
            previous_expires_ms=row.get("previous_signing_expires_ms"),
            retired=row.get("retired_signing_secret") or None,
        )

    def previous_valid(
        self, *, record_ms: int, now_ms: int, max_skew_ms: int = MAX_SKEW_MS
    ) -> bool:
        if self.previous is None:
            return False
        expires = self.previous_expires_ms
        return expires is None or (record_ms < expires and now_ms < expires + max_skew_ms)


def check_signature(
    keys: SigningKeys,
    headers: Mapping[str, bytes],
    *,
    key: bytes | None,
    value: bytes,
    record_ms: int,
    now_ms: int,
    max_skew_ms: int = MAX_SKEW_MS,
) -> tuple[Code, str] | None:
    """None when the record is signed with the current key, or with the previous key while
    it is valid; else (``bad_signature`` or ``signing_key_retired``, why)."""
    if keys.current is None:
        return Code.BAD_SIGNATURE, "the tenant has no signing key"
    parsed = _signed(headers, record_ms, max_skew_ms)
    if isinstance(parsed, str):
        return Code.BAD_SIGNATURE, parsed  # missing or malformed headers, stale timestamp
    if _matches(keys.current, parsed, key, value):
        return None
    if keys.previous is not None and _matches(keys.previous, parsed, key, value):
        if keys.previous_valid(record_ms=record_ms, now_ms=now_ms, max_skew_ms=max_skew_ms):
            return None
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

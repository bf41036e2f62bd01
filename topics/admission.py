"""The API's admission stamp: proof that a create on the commands topic was admitted by a
Tocsin API, so its worker stores it without deciding it again.

A synchronous one-shot create whose schedule id the API generated may be answered 201 once
Kafka has acknowledged it (acks=all), instead of once the worker has stored it, only if
nothing the worker could still decide would refuse it (docs/api.md). The API runs every
check the worker would (the tenant active, its limits, its create quota) and adds one Kafka
header to the record:

    tocsin-admission   "v1=" + key_id + "." + admitted_at + "." + hex HMAC-SHA256(
                           admission secret, admitted material)

    admitted material = b"tocsin-admission-v1\\n" + key_id + b"\\n" + admitted_at + b"\\n"
                        + len(key) + b"\\n" + key + value

The secret is a deployment secret held by the APIs and the workers only
(``TOCSIN_ADMISSION_KEY``), never by a tenant: tenants hold their own signing keys and may
produce to the commands topic themselves, so a flag under the tenant's signature would let
any tenant skip its quota, its callback allow-list and its deactivation. The MAC covers
the record's exact key and value bytes, so changing any field of the command breaks it.

**Freshness and copies**, as for tenant signatures (``topics.signing``): a stamp verifies
only on a record whose timestamp is the broker's append time (``LogAppendTime``) and within
``MAX_SKEW_MS`` of ``admitted_at``; the worker refuses a second record carrying a MAC it has
read at another offset of the partition (``replayed_command``), as a copy of that record.

**Rotation**: the API stamps with the current key; workers accept the current key and the
previous one. Roll a new key out as the previous one everywhere first, then swap it to
current (APIs last), then drop the old one: a stamp no worker can verify is decided as an
unadmitted command, which is what the order avoids.

Pure: no I/O, no clock (callers pass times).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from topics.signing import MAX_SKEW_MS, TimestampType

HEADER_ADMISSION = "tocsin-admission"
_VERSION = "v1"
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}", re.ASCII)
_STAMP = re.compile(r"v1=([A-Za-z0-9_-]{1,32})\.(\d{1,15})\.([0-9a-f]{64})", re.ASCII)
# A secret shorter than this is refused at start: the stamp is only as strong as it.
MIN_SECRET_CHARS = 32
# A create is admitted only when its worker has at least this long to store it before its
# ticker would record it missed (due + misfire tolerance): the worker's read may wait for a
# batch window, a rebalance or a restart, and a 201 must not end in ``missed`` where the
# synchronous path answers ``due_in_past``. A closer one waits for its worker's answer.
MIN_SLACK_MS = 30_000


class Unverified(str):
    """Why a stamp did not verify (the text the worker logs), and its ``outcome`` as the
    workers count it (``tocsin_admissions_total``): ``unknown_key``, a key id this worker
    does not hold (the key rolled out to the APIs before this worker, or a rotation's old
    key dropped too early; or a forgery naming an unknown id); ``stale``, a broker time
    the stamp cannot be checked against (an API clock more than the window off the
    broker's, or a topic whose timestamps are the producer's); ``unverified``, malformed or
    not matching the record (a forgery, a tampered record, another deployment's key)."""

    outcome: str

    def __new__(cls, text: str, outcome: str) -> Unverified:
        self = super().__new__(cls, text)
        self.outcome = outcome
        return self


def fresh(admitted_at_ms: int, append_ms: int | None, max_skew_ms: int = MAX_SKEW_MS) -> bool:
    """Whether a record the broker appended at ``append_ms`` (None: a timestamp its
    producer set, which proves nothing) is within the window of a stamp made at
    ``admitted_at_ms``: the workers' check, which the API repeats on its delivery report
    before it answers 201."""
    return append_ms is not None and abs(append_ms - admitted_at_ms) <= max_skew_ms


def admissible(due_ms: int, misfire_tolerance_s: int, now_ms: int) -> bool:
    """Whether a one-shot create due at ``due_ms`` may be admitted at ``now_ms``."""
    return due_ms + misfire_tolerance_s * 1000 >= now_ms + MIN_SLACK_MS


@dataclass(frozen=True, slots=True)
class AdmissionKey:
    """One admission key: its id (named in the stamp, so rotation knows which) and secret."""

    key_id: str
    # Out of repr: a key (or the AdmissionKeys holding it) logged or shown in a traceback
    # would hand out the secret that lets anyone skip a tenant's quota and limits.
    secret: str = field(repr=False)

    @classmethod
    def parse(cls, text: str, what: str) -> AdmissionKey:
        """``<key_id>:<secret>`` (raises ValueError saying what is wrong)."""
        key_id, sep, secret = text.partition(":")
        if not sep or not _KEY_ID.fullmatch(key_id):
            raise ValueError(f"{what} must be <key id>:<secret>, the id of [A-Za-z0-9_-]{{1,32}}")
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"{what}'s secret must have at least {MIN_SECRET_CHARS} characters")
        return cls(key_id, secret)


@dataclass(frozen=True, slots=True)
class Admission:
    """A stamp that verified: which key, when the API admitted the command, and its MAC (what
    the worker's copy check remembers)."""

    key_id: str
    admitted_at_ms: int
    mac: bytes


def _material(key_id: str, admitted_at_ms: int, key: bytes | None, value: bytes) -> bytes:
    k = key or b""
    head = f"tocsin-admission-{_VERSION}\n{key_id}\n{admitted_at_ms}\n{len(k)}\n"
    return head.encode("ascii") + k + value


def _mac(key: AdmissionKey, admitted_at_ms: int, record_key: bytes | None, value: bytes) -> str:
    material = _material(key.key_id, admitted_at_ms, record_key, value)
    return hmac.new(key.secret.encode("utf-8"), material, hashlib.sha256).hexdigest()


def stamp(
    key: AdmissionKey, *, admitted_at_ms: int, record_key: bytes | None, value: bytes
) -> tuple[str, bytes]:
    """The ``tocsin-admission`` header for one record."""
    mac = _mac(key, admitted_at_ms, record_key, value)
    return HEADER_ADMISSION, f"{_VERSION}={key.key_id}.{admitted_at_ms}.{mac}".encode("ascii")


@dataclass(frozen=True, slots=True)
class AdmissionKeys:
    """The keys a process holds: the API stamps with ``current``; a worker accepts both."""

    current: AdmissionKey | None = None
    previous: AdmissionKey | None = None

    @property
    def enabled(self) -> bool:
        return self.current is not None

    def verify(
        self,
        headers: Mapping[str, bytes],
        *,
        record_key: bytes | None,
        value: bytes,
        record_ms: int,
        timestamp_type: TimestampType,
        max_skew_ms: int = MAX_SKEW_MS,
    ) -> Admission | Unverified | None:
        """None when the record carries no stamp; the Admission when its stamp verifies
        under a key held here, on a broker-timestamped record within ``max_skew_ms`` of
        ``admitted_at``; otherwise why not (logged and counted by the worker, which then
        decides the command like any other)."""
        raw = headers.get(HEADER_ADMISSION)
        if raw is None:
            return None
        m = _STAMP.fullmatch(raw.decode("latin-1"))
        if m is None:
            return Unverified("malformed admission stamp", "unverified")
        key_id, at_text, mac = m.group(1), m.group(2), m.group(3)
        held = [k for k in (self.current, self.previous) if k is not None and k.key_id == key_id]
        if not held:
            return Unverified(f"admission key {key_id!r} is not held by this worker", "unknown_key")
        at = int(at_text)
        if not hmac.compare_digest(_mac(held[0], at, record_key, value), mac):
            return Unverified("admission stamp does not match the record", "unverified")
        if timestamp_type is not TimestampType.LOG_APPEND_TIME:
            return Unverified("the record's timestamp is not the broker's (LogAppendTime)", "stale")
        if not fresh(at, record_ms, max_skew_ms):
            return Unverified(
                f"admitted {abs(record_ms - at)} ms away from the broker's append time", "stale"
            )
        return Admission(key_id, at, bytes.fromhex(mac))


def keys_of(current: tuple[str, str] | None, previous: tuple[str, str] | None) -> AdmissionKeys:
    """The keys of ``base.settings.AdmissionSettings`` (each (key id, secret) or None)."""
    return AdmissionKeys(
        current=AdmissionKey(*current) if current is not None else None,
        previous=AdmissionKey(*previous) if previous is not None else None,
    )

"""Signed callbacks: the ``Tocsin-Signature`` header and the per-tenant secrets file.

Every fires-mode HTTP callback of a tenant listed in the secrets file carries::

    Tocsin-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256>[,v1=<hex>...]

Each ``v1`` is HMAC-SHA256, keyed with one of the tenant's secrets (its UTF-8 bytes), over
``"<t>.<trigger id>." + body``: the timestamp bounds replays in time, and the trigger id
(also sent as ``Tocsin-Trigger-Id`` and ``Idempotency-Key``) binds the body to the one
delivery a receiver deduplicates by, so a captured request cannot be passed off as another
trigger. During a rotation the file lists two secrets (newest first) and the header carries
one ``v1`` per secret, so a receiver holding either verifies. Each attempt is signed anew,
so a retry hours later still falls inside a receiver's replay window.

Where the secrets come from: a JSON file (``TOCSIN_PROXY_SIGNING_SECRETS_FILE``), tenant ->
list of secrets, newest first, mounted from a Kubernetes Secret. The proxy reads no
Cassandra, and a secret must never travel on a Kafka topic, so it cannot come with the
trigger. ``SecretsFile`` re-reads the file when it changes (checked at most every
``RELOAD_CHECK_S``); a file that cannot be read or parsed keeps the last good secrets (one
ERROR log per bad version, never a secret in it), and one that could not be read is read
again at the next look. Its map holds only the tenants in the file, bounded by the file's
size.

Pure but for ``SecretsFile``, which reads one local file; no secret is ever logged or put
in an exception message.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from base.errors import CommandRejected, ConfigError
from proxy.metrics import ProxyMetrics
from proxy.settings import ProxySettings
from topics.fields import check_tenant

log = logging.getLogger("tocsin.proxy")

SIGNATURE_HEADER = "Tocsin-Signature"
SCHEME = "v1"
# What a receiver should allow between the signature's t and its own clock, either way
# (Stripe's default): longer than any clock skew, short enough that a captured request is
# useless soon; inside it, Idempotency-Key deduplication catches a replay.
REPLAY_WINDOW_S = 300
# A rotation needs two; a few more let an operator stage one, never a header without end.
MAX_SECRETS_PER_TENANT = 4
MIN_SECRET_CHARS = 24  # 144 bits of a random base64 string; shorter ones are guessable
MAX_SECRET_CHARS = 256
# The whole file is read into memory: at ~100 bytes a tenant, room for ~40,000 tenants.
MAX_FILE_BYTES = 4 * 1024 * 1024
RELOAD_CHECK_S = 1.0
SECRET_PREFIX = "tcs_"
# Unix seconds have 10 digits until the year 2286; a longer t is not a timestamp.
MAX_TIMESTAMP_DIGITS = 12


class SignResult(enum.StrEnum):
    """What became of one request's signature (metrics label)."""

    SIGNED = "signed"
    UNSIGNED = "unsigned"  # the tenant has no secret and signing is optional
    REFUSED = "refused"  # the tenant has no secret and signing is required: dead-lettered


def generate_secret() -> str:
    """A new random delivery secret: 256 bits, URL-safe, with a recognisable prefix."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def fingerprint(secret: str) -> str:
    """A short, non-reversible name for a secret, for listings and logs."""
    return hashlib.sha256(secret.encode()).hexdigest()[:12]


def signed_payload(timestamp_s: int, trigger_id: str, body: bytes) -> bytes:
    return f"{timestamp_s}.{trigger_id}.".encode() + body


def signature(secret: str, timestamp_s: int, trigger_id: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), signed_payload(timestamp_s, trigger_id, body), hashlib.sha256)
    return mac.hexdigest()


def sign(secrets_: Sequence[str], timestamp_s: int, trigger_id: str, body: bytes) -> str:
    """The ``Tocsin-Signature`` value: ``t=...`` and one ``v1=...`` per secret, in order."""
    parts = [f"t={timestamp_s}"]
    parts += [f"{SCHEME}={signature(s, timestamp_s, trigger_id, body)}" for s in secrets_]
    return ",".join(parts)


class VerifyFailure(enum.StrEnum):
    MALFORMED = "malformed"  # no t, or a t that is not a number
    STALE = "stale"  # t outside the window
    MISMATCH = "mismatch"  # no v1 matches this secret


def check(
    header: str,
    trigger_id: str,
    body: bytes,
    secret: str,
    *,
    now_s: float,
    window_s: float = REPLAY_WINDOW_S,
) -> VerifyFailure | None:
    """Why ``header`` does not verify with ``secret`` (None: it does): what a receiver
    does (docs/proxy.md has the same in ten lines). Any header, however malformed, gets an
    answer, never an exception: it comes from whoever reaches the receiver."""
    fields = [part.strip().partition("=")[::2] for part in header.split(",")]
    t = next((v for k, v in fields if k == "t"), "")
    # ASCII digits only ("²" and "٣" are digits to str), and few of them: int() refuses a
    # string of more than 4,300 digits.
    if not (t.isascii() and t.isdigit() and len(t) <= MAX_TIMESTAMP_DIGITS):
        return VerifyFailure.MALFORMED
    if abs(now_s - int(t)) > window_s:
        return VerifyFailure.STALE
    expected = signature(secret, int(t), trigger_id, body)
    # compare_digest raises on a str with non-ASCII characters: such a v1 matches nothing.
    if any(k == SCHEME and v.isascii() and hmac.compare_digest(v, expected) for k, v in fields):
        return None
    return VerifyFailure.MISMATCH


# ---- the secrets file ------------------------------------------------------------------


def parse_secrets(raw: bytes) -> dict[str, tuple[str, ...]]:
    """The file's tenants and their secrets (newest first); ``ConfigError`` naming what is
    wrong by tenant and position, never by value."""
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"secrets file is {len(raw)} bytes; at most {MAX_FILE_BYTES}")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson's message names the position only, never the text around it.
        raise ConfigError(f"secrets file is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError("secrets file must be a JSON object: tenant -> [secret, ...]")
    out: dict[str, tuple[str, ...]] = {}
    for tenant, listed in doc.items():
        try:
            check_tenant(tenant)
        except CommandRejected as exc:
            raise ConfigError(f"secrets file: {exc.message}") from None
        out[tenant] = _tenant_secrets(tenant, listed)
    return out


def _tenant_secrets(tenant: str, listed: object) -> tuple[str, ...]:
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"secrets file: tenant {tenant!r} needs a non-empty list of secrets")
    if len(listed) > MAX_SECRETS_PER_TENANT:
        raise ConfigError(
            f"secrets file: tenant {tenant!r} lists {len(listed)} secrets; "
            f"at most {MAX_SECRETS_PER_TENANT}"
        )
    for i, s in enumerate(listed):
        if not isinstance(s, str) or not MIN_SECRET_CHARS <= len(s) <= MAX_SECRET_CHARS:
            raise ConfigError(
                f"secrets file: tenant {tenant!r} secret #{i} must be a string of "
                f"{MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} characters "
                "(`tocsin proxy secret generate` makes one)"
            )
        if not s.isascii() or not s.isprintable():
            raise ConfigError(
                f"secrets file: tenant {tenant!r} secret #{i} must be printable ASCII"
            )
    if len(set(listed)) != len(listed):
        raise ConfigError(f"secrets file: tenant {tenant!r} lists one secret twice")
    return tuple(listed)


def dump_secrets(by_tenant: Mapping[str, Sequence[str]]) -> bytes:
    """The file's text for ``by_tenant`` (checked as the proxy will read it)."""
    raw = orjson.dumps(
        {t: list(s) for t, s in by_tenant.items()},
        option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS,
    )
    parse_secrets(raw)
    return raw + b"\n"


def read_secrets_file(path: Path) -> dict[str, tuple[str, ...]]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        err = ConfigError(f"cannot read the secrets file {path}: {exc.strerror}")
        # Not the file's fault (descriptors, permissions, a swap under way): may read later.
        err.retriable = True
        raise err from None
    return parse_secrets(raw)


def write_secrets_file(path: Path, by_tenant: Mapping[str, Sequence[str]]) -> None:
    """Replace ``path`` at once (a reader sees the old file or the new, never half), 0600."""
    raw = dump_secrets(by_tenant)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _version(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is replaced or rewritten (a Kubernetes Secret volume swaps
    a symlink, which ``stat`` follows)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass
class SecretsFile:
    """The secrets file, re-read when it changes. ``load()`` raises at start on a missing
    or bad file; later a bad version keeps the last good secrets."""

    path: Path
    monotonic: Callable[[], float] = time.monotonic
    on_reload: Callable[[bool, int], None] = lambda ok, tenants: None
    _by_tenant: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False)
    # The version in use, or the last one found invalid: neither is read again.
    _version: tuple[int, int, int] | None = field(default=None, init=False)
    # A version that could not be read: read again at each look, reported once.
    _unreadable: tuple[int, int, int] | None = field(default=None, init=False)
    _next_check: float = field(default=0.0, init=False)

    def load(self) -> SecretsFile:
        version = _version(self.path)
        self._by_tenant = read_secrets_file(self.path)
        self._version = version
        self._next_check = self.monotonic() + RELOAD_CHECK_S
        self.on_reload(True, len(self._by_tenant))
        return self

    @property
    def tenants(self) -> int:
        return len(self._by_tenant)

    def secrets_for(self, tenant: str) -> tuple[str, ...]:
        """The tenant's secrets, newest first (empty: none listed)."""
        now = self.monotonic()
        if now >= self._next_check:
            self._next_check = now + RELOAD_CHECK_S
            self._maybe_reload()
        return self._by_tenant.get(tenant, ())

    def _refuse(self, version: tuple[int, int, int], exc: ConfigError) -> None:
        if not exc.retriable:
            self._version = version  # invalid as written: wait for the next version
        elif version == self._unreadable:
            return  # still unreadable: already reported
        else:
            # Unreadable (chmod changes no part of the version): read it again next time.
            self._unreadable = version
        log.error(
            "callback secrets file unusable; keeping the previous secrets",
            extra={"path": str(self.path), "error": str(exc)},
        )
        self.on_reload(False, len(self._by_tenant))

    def _maybe_reload(self) -> None:
        version = _version(self.path)
        if version is None or version == self._version:
            # Gone (being replaced, or unmounted): keep signing with what we had.
            return
        try:
            by_tenant = read_secrets_file(self.path)
        except ConfigError as exc:
            self._refuse(version, exc)
            return
        self._version, self._unreadable = version, None
        self._by_tenant = by_tenant
        log.info(
            "callback secrets reloaded", extra={"path": str(self.path), "tenants": len(by_tenant)}
        )
        self.on_reload(True, len(by_tenant))


@dataclass(frozen=True)
class Signed:
    result: SignResult
    header: str | None = None  # the Tocsin-Signature value, when SIGNED


@dataclass
class CallbackSigner:
    """Decides each request's signature from the tenant's secrets and the clock."""

    keys: SecretsFile | None
    required: bool = False
    clock_s: Callable[[], float] = time.time

    def sign(self, tenant: str, trigger_id: str, body: bytes) -> Signed:
        listed = self.keys.secrets_for(tenant) if self.keys is not None else ()
        if not listed:
            return Signed(SignResult.REFUSED if self.required else SignResult.UNSIGNED)
        return Signed(SignResult.SIGNED, sign(listed, int(self.clock_s()), trigger_id, body))


def refusal(tenant: str) -> str:
    """The dead-letter reason of a required signature with no secret to make it."""
    return (
        f"unsigned: no delivery secret for tenant {tenant!r} in the secrets file and "
        "TOCSIN_PROXY_REQUIRE_SIGNATURE is set (add one, then redrive)"
    )


def signer_for(settings: ProxySettings, metrics: ProxyMetrics | None = None) -> CallbackSigner:
    """The signer a proxy with ``settings`` uses; reads the secrets file now (ConfigError if
    it is missing or bad, so a proxy never starts signing with nothing)."""
    if not settings.signing_secrets_file:
        return CallbackSigner(keys=None)

    def report(ok: bool, tenants: int) -> None:
        if metrics is not None:
            metrics.signing_tenants.set(tenants)
            metrics.signing_file_stale.set(0 if ok else 1)

    keys = SecretsFile(Path(settings.signing_secrets_file), on_reload=report).load()
    return CallbackSigner(keys=keys, required=settings.require_signature)

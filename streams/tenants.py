"""Tenants: per-tenant configuration, quotas and API key hashing (pure; no I/O).

A tenant row (``tenants`` table) carries ``active``, a JSON ``config`` (``TenantConfig``),
and the ``signing_secret`` its commands are signed with (``topics.signing``). API keys live
in ``api_keys``: the token handed out once is ``tsk_<key_id>_<secret>``; only a salted
SHA-256 of the secret is stored. A fast hash is right here because the secret is 256 random
bits (nothing to brute-force), unlike a password.

Quotas (``QuotaBook``): a token bucket per (tenant, commands partition) in each worker, each
refilled at ``create_quota_per_s / partitions``. Commands spread over partitions by murmur2
of the schedule id, so the buckets add up to the tenant's quota across the cluster whatever
the number of workers, and a rebalance moves a partition's share with it. Fire quotas work
the same way in the ticker (``streams.pacing``).

Signing keys (current, and the previous one during a rotation) are read with
``topics.signing.SigningKeys``; rotation lives in ``streams.tenant_admin``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import math
import re
import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import orjson

from topics.callbacks import MAX_RETRIES_6XX, MAX_RETRY_AGE_S
from topics.models import Callback, DeliveryRetry

API_KEY_PREFIX = "tsk_"
_API_KEY = re.compile(r"tsk_([0-9a-f]{16})_([A-Za-z0-9_-]{20,128})", re.ASCII)
_HOST_ENTRY = re.compile(r"(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", re.ASCII)
_TOPIC_ENTRY = re.compile(r"[A-Za-z0-9._-]{1,249}\*?", re.ASCII)


@dataclass(frozen=True, kw_only=True)
class RetryPolicyConfig:
    """The tenant's default delivery retry policy; None keeps the proxy's own setting.

    Applied by stamping: a create or update whose callback carries no ``retry`` of its own
    gets this one written into the callback when the command is accepted (``stamp_retry``),
    so the trigger carries it to the proxy, which needs no tenant lookup. A later change of
    the tenant's default applies to schedules accepted after it."""

    max_retry_age_s: float | None = None
    retries_6xx: int | None = None

    @property
    def empty(self) -> bool:
        return self.max_retry_age_s is None and self.retries_6xx is None


@dataclass(frozen=True, kw_only=True)
class TenantConfig:
    """Per-tenant limits; 0 / None / empty mean "no tenant-specific limit"."""

    create_quota_per_s: float = 0.0  # commands per second, 0 = unlimited
    fire_quota_per_min: int = 0  # fires per minute, 0 = unlimited (streams.pacing)
    max_payload_bytes: int | None = None  # None: TOCSIN_MAX_PAYLOAD_BYTES
    max_horizon_s: int | None = None  # how far ahead `due` may be; None: unlimited
    retention_s: int | None = None  # keep fired schedules this long; None: the global one
    retry_policy: RetryPolicyConfig = field(default_factory=RetryPolicyConfig)
    allowed_callback_hosts: tuple[str, ...] = ()  # empty: any public host
    allowed_kafka_topics: tuple[str, ...] = ()  # empty: any topic but Tocsin's own

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["allowed_callback_hosts"] = list(self.allowed_callback_hosts)
        d["allowed_kafka_topics"] = list(self.allowed_kafka_topics)
        return d

    def to_json(self) -> str:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS).decode()

    def merged(self, changes: Mapping[str, object]) -> TenantConfig:
        """This config with ``changes`` applied (validated like ``from_dict``)."""
        return TenantConfig.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_json(cls, text: str | None) -> TenantConfig:
        """Lenient: a stored config that cannot be read falls back to the defaults (a
        tenant row written by hand must not stop its commands)."""
        if not text:
            return cls()
        try:
            return cls.from_dict(orjson.loads(text))
        except (ValueError, orjson.JSONDecodeError):
            return cls()

    @classmethod
    def from_dict(cls, obj: object) -> TenantConfig:
        """Strict: raises ValueError naming the offending field."""
        if not isinstance(obj, dict):
            raise ValueError("config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(
                f"config: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(known))}"
            )
        d = cls()
        quota = _number(obj.get("create_quota_per_s", d.create_quota_per_s), "create_quota_per_s")
        fires = _int(obj.get("fire_quota_per_min", d.fire_quota_per_min), "fire_quota_per_min")
        return cls(
            create_quota_per_s=quota,
            fire_quota_per_min=fires,
            max_payload_bytes=_opt_int(obj.get("max_payload_bytes"), "max_payload_bytes", 1),
            max_horizon_s=_opt_int(obj.get("max_horizon_s"), "max_horizon_s", 1),
            retention_s=_opt_int(obj.get("retention_s"), "retention_s", 1),
            retry_policy=_retry(obj.get("retry_policy")),
            allowed_callback_hosts=_entries(
                obj.get("allowed_callback_hosts", []), "allowed_callback_hosts", _HOST_ENTRY
            ),
            allowed_kafka_topics=_entries(
                obj.get("allowed_kafka_topics", []), "allowed_kafka_topics", _TOPIC_ENTRY
            ),
        )


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"config.{name} must be a number")
    if value < 0:
        raise ValueError(f"config.{name} must be >= 0")
    return float(value)


def _int(value: object, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.{name} must be an integer")
    if value < minimum or value > 2**31 - 1:
        raise ValueError(f"config.{name} must be within {minimum}..{2**31 - 1}")
    return value


def _opt_int(value: object, name: str, minimum: int) -> int | None:
    return None if value is None else _int(value, name, minimum)


def _retry(value: object) -> RetryPolicyConfig:
    if value is None:
        return RetryPolicyConfig()
    if not isinstance(value, dict) or set(value) - {"max_retry_age_s", "retries_6xx"}:
        raise ValueError("config.retry_policy must be {max_retry_age_s?, retries_6xx?}")
    age = value.get("max_retry_age_s")
    r6 = value.get("retries_6xx")
    # The same bounds as a callback's own `retry` (topics.validation), since it is stamped
    # into callbacks that the proxy then re-validates.
    if age is not None and _number(age, "retry_policy.max_retry_age_s") > MAX_RETRY_AGE_S:
        raise ValueError(f"config.retry_policy.max_retry_age_s must be <= {MAX_RETRY_AGE_S}")
    if r6 is not None and _int(r6, "retry_policy.retries_6xx") > MAX_RETRIES_6XX:
        raise ValueError(f"config.retry_policy.retries_6xx must be <= {MAX_RETRIES_6XX}")
    return RetryPolicyConfig(
        max_retry_age_s=None if age is None else float(age),
        retries_6xx=r6,
    )


def stamp_retry(callback: Callback, policy: RetryPolicyConfig) -> Callback:
    """``callback`` with the tenant's default retry policy when it has none of its own (an
    explicit ``retry``, even ``{}``, always wins); unchanged when the tenant sets none."""
    if callback.retry is not None or policy.empty:
        return callback
    return replace(
        callback,
        retry=DeliveryRetry(max_retry_age_s=policy.max_retry_age_s, retries_6xx=policy.retries_6xx),
    )


def _entries(value: object, name: str, pattern: re.Pattern[str]) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > 256:
        raise ValueError(f"config.{name} must be a list of at most 256 strings")
    out = []
    for item in value:
        if not isinstance(item, str) or pattern.fullmatch(item) is None:
            raise ValueError(f"config.{name}: {item!r} is not a valid entry")
        out.append(item.lower() if pattern is _HOST_ENTRY else item)
    return tuple(out)


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a callback host matches the allow list (empty list: every host).

    Entries are exact host names (case-insensitive) or ``*.example.com``, which matches any
    subdomain of example.com but not example.com itself.
    """
    if not allowed:
        return True
    h = host.lower().rstrip(".")
    for entry in allowed:
        if entry.startswith("*."):
            if h.endswith(entry[1:]) and len(h) > len(entry) - 1:
                return True
        elif h == entry:
            return True
    return False


def topic_allowed(topic: str, allowed: tuple[str, ...]) -> bool:
    """Exact names, or a prefix ending in ``*`` (``acme.*``); empty list: every topic."""
    if not allowed:
        return True
    return any(topic.startswith(e[:-1]) if e.endswith("*") else topic == e for e in allowed)


# -- quotas ------------------------------------------------------------------------------


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; starts full."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now_s: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now_s

    def take(self, now_s: float, n: float = 1.0) -> bool:
        elapsed = max(0.0, now_s - self.stamp)
        self.stamp = now_s
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def debit(self, now_s: float, n: float = 1.0) -> None:
        """Take ``n`` tokens whether or not they are there: the balance may go negative,
        down to one burst below zero, and then what comes after waits until it is paid
        back (at most two bursts' refill)."""
        self.take(now_s, 0.0)  # refill to now
        self.tokens = max(-self.burst, self.tokens - n)

    def available(self, now_s: float) -> float:
        """Tokens there at ``now_s`` (without taking any)."""
        elapsed = max(0.0, now_s - self.stamp)
        return min(self.burst, self.tokens + elapsed * self.rate)

    def wait_s(self, now_s: float, n: float = 1.0) -> float:
        """Seconds from ``now_s`` until ``n`` tokens are there (0 if they are already)."""
        tokens = self.available(now_s)
        if tokens >= n:
            return 0.0
        return (n - tokens) / self.rate if self.rate > 0 else float("inf")


class QuotaBook:
    """Token buckets per (tenant, partition) for the command agent (see module doc)."""

    def __init__(self, partitions: int) -> None:
        self.partitions = max(1, partitions)
        self._buckets: dict[tuple[str, int], TokenBucket] = {}

    def allow(self, tenant: str, partition: int, quota_per_s: float, now_s: float) -> bool:
        if quota_per_s <= 0:
            return True
        rate = quota_per_s / self.partitions
        burst = max(1.0, rate)  # one second's worth, at least one command
        key = (tenant, partition)
        bucket = self._buckets.get(key)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[key] = TokenBucket(rate, burst, now_s)
        return bucket.take(now_s)

    def debit(self, tenant: str, partition: int, quota_per_s: float, now_s: float) -> None:
        """Count a create an API admitted against the budget without refusing it
        (topics.admission): the API enforced the quota already, and the tenant's creates
        produced to the topic directly still see the budget it used. The debt stops at one
        burst: APIs admitting more than the quota (``TOCSIN_API_INSTANCES`` set below the
        instances running) would otherwise refuse the tenant's own creates for as long as
        the excess takes to refill (minutes after a busy one)."""
        if quota_per_s > 0 and not self.allow(tenant, partition, quota_per_s, now_s):
            self._buckets[(tenant, partition)].debit(now_s)


# The API's share of a tenant's create quota is kept for at most this many tenants (the
# least recently used beyond it start again with a full bucket).
MAX_ADMISSION_TENANTS = 10_000


class AdmissionQuota:
    """The create quota as an API instance enforces it for the creates it admits
    (topics.admission): a token bucket per tenant refilled at ``create_quota_per_s /
    instances``, so ``instances`` APIs together admit the tenant's quota. The workers debit
    their own buckets for what was admitted, so creates the tenant produces to the topic
    directly share the same budget. Bounded: at most ``max_tenants`` buckets."""

    def __init__(self, instances: int = 1, max_tenants: int = MAX_ADMISSION_TENANTS) -> None:
        self.instances = max(1, instances)
        self.max_tenants = max_tenants
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, tenant: str, quota_per_s: float, now_s: float) -> bool:
        if quota_per_s <= 0:
            return True
        rate = quota_per_s / self.instances
        burst = max(1.0, rate)  # one second's worth, at least one command
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[tenant] = TokenBucket(rate, burst, now_s)
            while len(self._buckets) > self.max_tenants:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(tenant)
        return bucket.take(now_s)


# -- API keys ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NewApiKey:
    key_id: str
    token: str  # shown once
    salt: bytes
    hash: bytes


def new_api_key() -> NewApiKey:
    key_id = secrets.token_hex(8)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode("ascii").rstrip("=")
    salt = secrets.token_bytes(16)
    return NewApiKey(
        key_id=key_id,
        token=f"{API_KEY_PREFIX}{key_id}_{secret}",
        salt=salt,
        hash=hash_secret(salt, secret),
    )


def hash_secret(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode("utf-8")).digest()


def split_api_key(token: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed token, else None."""
    m = _API_KEY.fullmatch(token)
    return (m.group(1), m.group(2)) if m else None


def check_api_key(secret: str, *, salt: bytes, expected: bytes) -> bool:
    return hmac.compare_digest(hash_secret(salt, secret), expected)

"""Outbound load per endpoint host: a rate limit and a circuit breaker, per tenant and host.

``HostGate.check`` says whether a message may be attempted now or must wait, and how long:
its (tenant, host) must have a token in its bucket (``TokenBucket``, the rate limit) and a
breaker that lets it through (``proxy.breaker``). ``record`` feeds each attempt's result to
the breaker. The writers of both lanes share one gate, so a host's rate and its breaker
count every attempt of the process.

Scope is (tenant, host), never the host alone: one tenant's failing path on a shared host
(or its own rate limit) must not hold another tenant's deliveries to that host. In generic
mode there is no tenant; the scope is the host.

Limits (requests per second): a tenant's per-host override, else the tenant's own rate,
else the process default (``TOCSIN_PROXY_HOST_RPS``); 0 means no limit. A bucket holds at
most one second of its rate (at least one token), so a quiet host may take that burst.
A host name in the limits matches the URL's host name, or its ``host:port``.

Every map here is keyed by outside input, so it is bounded, per tenant first: a tenant
keeps at most ``MAX_HOST_ENTRIES_PER_TENANT`` hosts, and past ``MAX_HOST_ENTRIES`` in all
the tenant holding the most gives one up. So one tenant naming ever new hosts forgets only
its own entries, never another tenant's open breaker or spent bucket (a forgotten entry
starts again with a full bucket and a closed breaker). Within a tenant its least recently
used closed entry goes first; an entry whose breaker is not closed goes only when the
tenant has no closed one, as forgetting it would let a failing host's traffic through at
once. Generic mode has one tenant (None), bounded by ``MAX_HOST_ENTRIES`` alone.

Pure: no clock (callers pass ``now_s``), no I/O. The gate's lock is the only state the
writers' threads share; each call holds it for a few dictionary operations.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from proxy.breaker import Breaker, BreakerPolicy, BreakerState, BreakerView, host_verdict
from proxy.retry import AttemptResult

MAX_HOST_ENTRIES = 10_000
MAX_HOST_ENTRIES_PER_TENANT = 1_000
# Hosts (and tenants) one limits file may name; it is an operator's file, but a bound keeps
# a generated one from taking the process's memory.
MAX_LIMIT_ENTRIES = 100_000

HostKey = tuple[str | None, str]  # (tenant, host as "scheme://netloc")


def endpoint_host(url: str) -> str:
    """The host of a callback URL as the gate keys it (``proxy.envelope.Request.host``)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


# ---- the rate limit ----------------------------------------------------------------------


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``capacity`` saved; rate 0: no limit."""

    def __init__(self, rate_per_s: float, now_s: float) -> None:
        self.rate_per_s = 0.0
        self.capacity = 1.0
        self.tokens = 1.0
        self.last_s = now_s
        self.set_rate(rate_per_s, now_s)
        self.tokens = self.capacity  # a host not yet called may take its burst

    def set_rate(self, rate_per_s: float, now_s: float) -> None:
        self._refill(now_s)
        self.rate_per_s = rate_per_s
        self.capacity = max(1.0, rate_per_s)
        self.tokens = min(self.tokens, self.capacity)

    def _refill(self, now_s: float) -> None:
        if now_s > self.last_s:
            self.tokens = min(self.capacity, self.tokens + (now_s - self.last_s) * self.rate_per_s)
            self.last_s = now_s

    def take(self, now_s: float) -> float:
        """Take one token (0.0), or say how many seconds until one is there (taking none)."""
        if self.rate_per_s <= 0:
            return 0.0
        self._refill(now_s)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s

    @property
    def spacing_s(self) -> float:
        """Seconds between two requests at the full rate (0: no limit)."""
        return 1.0 / self.rate_per_s if self.rate_per_s > 0 else 0.0


# ---- limits ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TenantLimits:
    rps: float | None = None  # None: the process default
    hosts: Mapping[str, float] = field(default_factory=dict)  # lower-case host or host:port


@dataclass(frozen=True, kw_only=True)
class HostLimits:
    default_rps: float = 0.0
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    def rps_for(self, tenant: str | None, host: str) -> float:
        """Requests per second allowed to ``host`` ("scheme://netloc") for ``tenant``."""
        limits = self.tenants.get(tenant) if tenant is not None else None
        if limits is None:
            return self.default_rps
        if limits.hosts:
            parts = urlsplit(host)
            name = (parts.hostname or "").lower()
            port = parts.port
            for candidate in (f"{name}:{port}" if port else None, name):
                if candidate is not None and candidate in limits.hosts:
                    return limits.hosts[candidate]
        return self.default_rps if limits.rps is None else limits.rps


def _rps(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{where}: requests per second must be a number >= 0, got {value!r}")
    return float(value)


def parse_limits(doc: object, default_rps: float) -> HostLimits:
    """Limits from a parsed JSON document ``{tenant: {"rps": n, "hosts": {host: n}}}``.
    Raises ValueError naming the first bad entry."""
    if not isinstance(doc, dict):
        raise ValueError("the limits file must hold a JSON object of tenants")
    tenants: dict[str, TenantLimits] = {}
    count = 0
    for tenant, entry in doc.items():
        if not isinstance(entry, dict) or not set(entry) <= {"rps", "hosts"}:
            raise ValueError(f"tenant {tenant!r}: expected {{'rps': n, 'hosts': {{...}}}}")
        rps = None if entry.get("rps") is None else _rps(entry["rps"], f"tenant {tenant!r}")
        hosts_doc = entry.get("hosts", {})
        if not isinstance(hosts_doc, dict):
            raise ValueError(f"tenant {tenant!r}: hosts must be an object of host -> rps")
        hosts = {
            str(h).lower(): _rps(v, f"tenant {tenant!r} host {h!r}") for h, v in hosts_doc.items()
        }
        count += 1 + len(hosts)
        if count > MAX_LIMIT_ENTRIES:
            raise ValueError(f"the limits file names more than {MAX_LIMIT_ENTRIES} entries")
        tenants[str(tenant)] = TenantLimits(rps=rps, hosts=hosts)
    return HostLimits(default_rps=default_rps, tenants=tenants)


# ---- the gate ----------------------------------------------------------------------------


class HoldReason(enum.Enum):
    RATE = "rate"  # no token yet: the host's rate limit paces it
    OPEN = "open"  # the host's breaker is open (or its probe is out)


@dataclass(frozen=True, slots=True)
class Pass:
    """Attempt it now; ``probe``: it is the half-open breaker's one probe."""

    probe: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """Wait ``wait_s`` before asking again; ``spacing_s`` apart for those behind it."""

    reason: HoldReason
    wait_s: float
    spacing_s: float = 0.0


GateAnswer = Pass | Hold


@dataclass(frozen=True, slots=True)
class HostView:
    """One (tenant, host) as the metrics and the explain view show it."""

    tenant: str | None
    host: str
    rps: float  # 0: no limit
    breaker: BreakerView


@dataclass(frozen=True, slots=True)
class Transition:
    tenant: str | None
    host: str
    before: BreakerState
    after: BreakerState


class _Entry:
    __slots__ = ("breaker", "bucket", "version")

    def __init__(self, bucket: TokenBucket, breaker: Breaker, version: int) -> None:
        self.bucket = bucket
        self.breaker = breaker
        self.version = version


class HostGate:
    def __init__(
        self,
        policy: BreakerPolicy,
        limits: HostLimits | None = None,
        *,
        max_entries: int = MAX_HOST_ENTRIES,
        max_entries_per_tenant: int = MAX_HOST_ENTRIES_PER_TENANT,
    ) -> None:
        self.policy = policy
        self._limits = limits or HostLimits()
        self._version = 0
        self._max_entries = max(1, max_entries)
        self._max_per_tenant = max(1, max_entries_per_tenant)
        # Per tenant, its hosts least recently used first.
        self._tenants: dict[str | None, OrderedDict[str, _Entry]] = {}
        self._size = 0
        # Tenants by how many entries each holds, and the most any holds: the tenant to
        # give up an entry at the global bound is found without a scan of all tenants.
        self._by_count: dict[int, set[str | None]] = {}
        self._most = 0
        self._lock = threading.Lock()

    @property
    def limits(self) -> HostLimits:
        return self._limits

    def set_limits(self, limits: HostLimits) -> None:
        """New limits (a re-read limits file); each entry takes its new rate when next used."""
        with self._lock:
            self._limits = limits
            self._version += 1

    def _find(self, tenant: str | None, host: str) -> _Entry | None:
        held = self._tenants.get(tenant)
        return None if held is None else held.get(host)

    def _entry(self, key: HostKey, now_s: float) -> _Entry:
        tenant, host = key
        entry = self._find(tenant, host)
        if entry is None:
            rps = self._limits.rps_for(*key)
            entry = _Entry(TokenBucket(rps, now_s), Breaker(self.policy), self._version)
            self._make_room(tenant)
            held = self._tenants.setdefault(tenant, OrderedDict())
            held[host] = entry
            self._size += 1
            self._recount(tenant, len(held) - 1, len(held))
        else:
            self._tenants[tenant].move_to_end(host)
            if entry.version != self._version:
                entry.bucket.set_rate(self._limits.rps_for(*key), now_s)
                entry.version = self._version
        return entry

    def _make_room(self, tenant: str | None) -> None:
        """Before ``tenant`` adds an entry: forget one of its own at its bound, else one of
        the tenant holding the most at the global bound."""
        held = self._tenants.get(tenant)
        cap = self._max_entries if tenant is None else self._max_per_tenant
        if held is not None and len(held) >= cap:
            self._forget_one(tenant)
        elif self._size >= self._max_entries:
            self._forget_one(next(iter(self._by_count[self._most])))

    def _forget_one(self, tenant: str | None) -> None:
        held = self._tenants[tenant]
        victim = next(
            (h for h, e in held.items() if e.breaker.state is BreakerState.CLOSED),
            next(iter(held)),
        )
        del held[victim]
        if not held:
            del self._tenants[tenant]
        self._size -= 1
        self._recount(tenant, len(held) + 1, len(held))

    def _recount(self, tenant: str | None, before: int, after: int) -> None:
        if before:
            tenants = self._by_count[before]
            tenants.discard(tenant)
            if not tenants:
                del self._by_count[before]
        if after:
            self._by_count.setdefault(after, set()).add(tenant)
        if after > self._most:
            self._most = after
        elif before == self._most and before not in self._by_count:
            self._most = after  # counts move by one: nobody holds more than it now

    def check(self, tenant: str | None, host: str, now_s: float) -> GateAnswer:
        """May one attempt to ``host`` for ``tenant`` go now? A ``Pass`` took its token; a
        ``Pass(probe=True)`` must be answered with ``record(probe=True)`` or
        ``probe_dropped``."""
        with self._lock:
            entry = self._entry((tenant, host), now_s)
            spacing = entry.bucket.spacing_s
            allowed, probe = entry.breaker.allow(now_s)
            if not allowed:
                # While the probe is out nobody knows when it ends: ask again after the
                # shortest open period.
                wait = entry.breaker.retry_in_s(now_s) or self.policy.open_s
                return Hold(HoldReason.OPEN, wait, spacing)
            rate_wait = entry.bucket.take(now_s)
            if rate_wait > 0:
                if probe:
                    entry.breaker.probe_dropped()
                return Hold(HoldReason.RATE, rate_wait, spacing)
            return Pass(probe=probe)

    def blocked(self, tenant: str | None, host: str, now_s: float) -> Hold | None:
        """A ``Hold`` for a message that passed ``check`` but has not started (it waited for
        a writer) when its host's breaker has opened since; None: it may go. Takes no token
        and changes nothing."""
        with self._lock:
            entry = self._find(tenant, host)
            if entry is None or entry.breaker.state is BreakerState.CLOSED:
                return None
            if entry.breaker.state is BreakerState.OPEN:
                wait = entry.breaker.retry_in_s(now_s)
            else:
                wait = self.policy.open_s  # its probe is out
            return Hold(HoldReason.OPEN, wait, entry.bucket.spacing_s)

    def record(
        self,
        tenant: str | None,
        host: str,
        result: AttemptResult,
        now_s: float,
        *,
        probe: bool,
        detail: str | None = None,
        started_s: float | None = None,
    ) -> Transition | None:
        """Feed one attempt's result (the attempt begun at ``started_s``) to the host's
        breaker; the state change, if any."""
        verdict = host_verdict(result)
        with self._lock:
            entry = self._entry((tenant, host), now_s)
            before = entry.breaker.state
            after = entry.breaker.record(
                verdict, now_s, probe=probe, detail=detail, started_s=started_s
            )
        if before is after:
            return None
        return Transition(tenant=tenant, host=host, before=before, after=after)

    def probe_dropped(self, tenant: str | None, host: str) -> None:
        with self._lock:
            entry = self._find(tenant, host)
            if entry is not None:
                entry.breaker.probe_dropped()

    def explain(self, tenant: str | None, host: str, now_s: float) -> HostView:
        """What the proxy knows of (tenant, host) now; a host it has no entry for is shown
        as it would start: closed, with its configured rate."""
        with self._lock:
            entry = self._find(tenant, host)
            if entry is None:
                return HostView(
                    tenant=tenant,
                    host=host,
                    rps=self._limits.rps_for(tenant, host),
                    breaker=Breaker(self.policy).view(now_s),
                )
            return HostView(
                tenant=tenant,
                host=host,
                rps=entry.bucket.rate_per_s,
                breaker=entry.breaker.view(now_s),
            )

    def snapshot(
        self, now_s: float, *, limit: int
    ) -> tuple[dict[BreakerState, int], list[HostView]]:
        """How many entries are in each state, and up to ``limit`` of those not closed
        (open first, then half-open, most failures first): a bounded label set."""
        counts = dict.fromkeys(BreakerState, 0)
        troubled: list[HostView] = []
        with self._lock:
            entries = ((t, h, e) for t, held in self._tenants.items() for h, e in held.items())
            for tenant, host, entry in entries:
                state = entry.breaker.state
                counts[state] += 1
                if state is not BreakerState.CLOSED:
                    troubled.append(
                        HostView(
                            tenant=tenant,
                            host=host,
                            rps=entry.bucket.rate_per_s,
                            breaker=entry.breaker.view(now_s),
                        )
                    )
        troubled.sort(
            key=lambda v: (v.breaker.state is not BreakerState.OPEN, -v.breaker.opened_count)
        )
        return counts, troubled[:limit]

    def __len__(self) -> int:
        return self._size


def describe(view: HostView) -> str:
    """One (tenant, host) in words, for an explain view or a log line."""
    b = view.breaker
    rate = f"{view.rps:g} requests/s" if view.rps > 0 else "no rate limit"
    last = f", last: {b.last_failure}" if b.last_failure else ""
    if b.state is BreakerState.OPEN:
        state = (
            f"circuit breaker open (times opened: {b.opened_count}{last}); "
            f"next probe in {b.retry_in_s:.1f}s"
        )
    elif b.state is BreakerState.HALF_OPEN:
        state = f"circuit breaker half-open: one probe out{last}"
    else:
        failing = (
            f" (consecutive failures: {b.consecutive_failures}{last})"
            if b.consecutive_failures
            else ""
        )
        state = f"circuit breaker closed{failing}"
    return f"{view.host}: {state}; {rate}"

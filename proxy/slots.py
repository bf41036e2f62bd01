"""Writer slots: how many attempts may run at once, and who waits for which cap.

At most ``concurrency`` attempts run at once, at most ``per_host`` per receiver, so one slow
receiver cannot hold every writer, and at most ``per_tenant`` per tenant (fires mode), so
one tenant's burst cannot either. A message over its tenant's or its host's cap waits in
that tenant's or host's line, holding no slot; when a slot of its host or tenant frees, the
longest-waiting goes first.

The host cap counts per (tenant, host) in fires mode, never per host alone: two tenants may
name the same host, and one tenant's slow-but-answering calls must not hold the slots the
other needs there. A fixed cap per (tenant, host) is chosen over a fair share of one host
cap because a share would shift whenever a tenant starts or stops calling the host (slots
already held cannot be taken back), while the fixed cap needs no more bookkeeping than the
host alone did. What one host then gets in all stays bounded by ``concurrency`` and each
tenant's ``per_tenant``. In generic mode there is no tenant: the key is (None, host).

Pure bookkeeping: no clock, no I/O, no locks (the writer's loop is its only user).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

HostKey = tuple[str | None, str]  # (tenant, host): what the per-host cap counts


class Holder(Protocol):
    """What a slot is counted against (``proxy.envelope.Envelope``)."""

    @property
    def host(self) -> str: ...

    @property
    def tenant(self) -> str | None: ...


M = TypeVar("M", bound=Holder)


class Slots(Generic[M]):
    def __init__(self, *, concurrency: int, per_host: int, per_tenant: int) -> None:
        self.concurrency = concurrency
        self.per_host = per_host
        self.per_tenant = per_tenant
        self.active = 0
        # Counts and lines are keyed by receivers and tenants (outside input): an entry
        # leaves as soon as it reaches zero, so they hold only what is running or waiting.
        self._host_active: dict[HostKey, int] = {}
        self._tenant_active: dict[str, int] = {}
        self._host_waiting: dict[HostKey, deque[M]] = {}
        self._tenant_waiting: dict[str, deque[M]] = {}

    def has_room(self) -> bool:
        return self.active < self.concurrency

    def tenant_full(self, tenant: str | None) -> bool:
        """``tenant`` has every writer it may use busy."""
        return tenant is not None and self._tenant_active.get(tenant, 0) >= self.per_tenant

    def admit(self, msg: M) -> bool:
        """Take a slot for ``msg`` (True) if its tenant and its host each have one free;
        otherwise it waits in the line of the first that has none (False). The caller
        checks ``has_room`` first."""
        tenant = msg.tenant
        if tenant is not None and self.tenant_full(tenant):
            self._tenant_waiting.setdefault(tenant, deque()).append(msg)
            return False
        host = (tenant, msg.host)
        if self._host_active.get(host, 0) >= self.per_host:
            self._host_waiting.setdefault(host, deque()).append(msg)
            return False
        self.active += 1
        self._host_active[host] = self._host_active.get(host, 0) + 1
        if tenant is not None:
            self._tenant_active[tenant] = self._tenant_active.get(tenant, 0) + 1
        return True

    def free(self, msg: M) -> None:
        """``msg``'s attempt ended: its slot is free."""
        self.active -= 1
        _decrement(self._host_active, (msg.tenant, msg.host))
        if msg.tenant is not None:
            _decrement(self._tenant_active, msg.tenant)

    def next_up(self, freed: M, skip: Callable[[M], bool]) -> list[M]:
        """After ``free(freed)``: the waiting messages that take a slot now (each already
        holds it), the longest-waiting of ``freed``'s host first, then of its tenant's.
        A waiting message ``skip`` picks (revoked meanwhile) leaves its line unstarted."""
        started: list[M] = []
        host = (freed.tenant, freed.host)
        waiting = self._host_waiting.get(host)
        while waiting:
            msg = waiting.popleft()
            if not skip(msg) and self.admit(msg):
                started.append(msg)  # the freed host slot goes to its longest-waiting one
                break
        if waiting is not None and not waiting:
            del self._host_waiting[host]
        tenant = freed.tenant
        if tenant is not None:
            started.extend(self._admit_tenant(tenant, skip))
        return started

    def _admit_tenant(self, tenant: str, skip: Callable[[M], bool]) -> list[M]:
        started: list[M] = []
        waiting = self._tenant_waiting.get(tenant)
        while waiting and not self.tenant_full(tenant) and self.has_room():
            msg = waiting.popleft()
            if not skip(msg) and self.admit(msg):
                started.append(msg)
        if waiting is not None and not waiting:
            del self._tenant_waiting[tenant]
        return started

    def drop_waiting(self, drop: Callable[[M], bool]) -> list[M]:
        """Take the waiting messages ``drop`` picks out of their lines; returns them."""
        dropped: list[M] = []
        _drop_from(self._host_waiting, drop, dropped)
        _drop_from(self._tenant_waiting, drop, dropped)
        return dropped

    def waiting(self) -> int:
        """How many messages wait for a slot of their host or tenant."""
        lines = (*self._host_waiting.values(), *self._tenant_waiting.values())
        return sum(len(w) for w in lines)


K = TypeVar("K")


def _drop_from(lines: dict[K, deque[M]], drop: Callable[[M], bool], dropped: list[M]) -> None:
    for name, waiting in list(lines.items()):
        kept: deque[M] = deque()
        for msg in waiting:
            (dropped if drop(msg) else kept).append(msg)
        if kept:
            lines[name] = kept
        else:
            del lines[name]


def _decrement(counts: dict[K, int], name: K) -> None:
    left = counts.get(name, 1) - 1
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)

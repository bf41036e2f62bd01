"""SSRF guard of the fires-mode proxy: tenants choose callback URLs, so the proxy must not
become their way into the internal network.

A callback may only reach *global* unicast addresses: loopback, private (RFC 1918, ULA),
link-local (169.254/16 incl. cloud metadata, fe80::/10), shared (100.64/10), multicast,
unspecified and reserved addresses are refused unless ``TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS``
is set. The check is on the **resolved** address: ``GuardedResolver`` filters what DNS
returns and aiohttp connects only to what it hands back, so a host name that resolves to
127.0.0.1 (``localhost``, a rebinding domain) is refused at connect time, not just at create
time. IP literals bypass resolvers in aiohttp and are checked by ``literal_refusal``.

A refused target is undeliverable: it is dead-lettered at once with the reason.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver


class BlockedAddress(OSError):
    """Every address of a callback host is one the proxy may not call."""


# IPv6 ranges that carry (or translate to) an IPv4 address, or that Python versions have
# called global although they are not: an explicit list, so the guard does not depend on
# the interpreter's ``is_global`` tables.
_NAT64 = (
    ipaddress.IPv6Network("64:ff9b::/96"),  # well-known NAT64 prefix (RFC 6052)
    ipaddress.IPv6Network("64:ff9b:1::/48"),  # local-use NAT64 (RFC 8215)
)
_REFUSED_V6 = (
    ipaddress.IPv6Network("2002::/16"),  # 6to4: embeds an IPv4 address
    ipaddress.IPv6Network("2001::/32"),  # Teredo: embeds an IPv4 address
    ipaddress.IPv6Network("fec0::/10"),  # site-local (deprecated, still routed internally)
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (deprecated)
    ipaddress.IPv6Network("100::/64"),  # discard-only
    ipaddress.IPv6Network("2001:db8::/32"),  # documentation
)


def address_allowed(address: str) -> bool:
    """Whether the proxy may connect to this IP address (text form).

    An IPv6 address that embeds an IPv4 one (mapped, NAT64, 6to4, Teredo) is refused
    outright rather than judged by the IPv4 inside: in a DNS64/NAT64 cluster
    64:ff9b::a00:1 reaches 10.0.0.1, and a public callback never needs these forms."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif any(ip in net for net in _NAT64 + _REFUSED_V6):
            return False
    return bool(ip.is_global) and not ip.is_multicast


def literal_refusal(host: str) -> str | None:
    """Why an IP-literal host may not be called (None: allowed, or not a literal)."""
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare.split("%", 1)[0])
    except ValueError:
        return None
    if address_allowed(bare):
        return None
    return (
        f"callback address {bare} is loopback, private, link-local or reserved; the proxy "
        "refuses it (TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS=true allows it)"
    )


class GuardedResolver(AbstractResolver):
    """Resolves with aiohttp's default resolver and keeps only allowed addresses."""

    def __init__(self, inner: AbstractResolver | None = None) -> None:
        self._inner = inner if inner is not None else DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if address_allowed(str(r["host"]))]
        if not allowed:
            shown = ", ".join(sorted({str(r["host"]) for r in results})) or "nothing"
            raise BlockedAddress(
                f"callback host {host!r} resolves to {shown}: loopback, private, link-local "
                "or reserved addresses are refused (TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS=true "
                "allows them)"
            )
        return allowed

    async def close(self) -> None:
        await self._inner.close()


def blocked_reason(exc: BaseException) -> str | None:
    """The refusal message if ``exc`` (an aiohttp connector error) came from the guard."""
    seen: set[int] = set()
    cur: Any = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, BlockedAddress):
            return str(cur)
        os_error = getattr(cur, "os_error", None)
        if isinstance(os_error, BlockedAddress):
            return str(os_error)
        cur = cur.__cause__ or cur.__context__
    return None

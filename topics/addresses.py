"""Which IP addresses a callback may reach: the one classification behind both checks.

Tenants choose callback URLs, so a deployment must not become their way into its internal
network. Only *global* unicast addresses are allowed: loopback, private (RFC 1918, ULA),
link-local (169.254/16 incl. cloud metadata, fe80::/10), shared (100.64/10), multicast,
unspecified and reserved addresses are not, nor IPv6 forms that carry an IPv4 address.

Two places apply it: ``topics.callbacks`` refuses a create or update whose callback host
is such an IP *literal* (``invalid_url``, so the sender learns at once), and the proxy's
SSRF guard (``proxy.ssrf``) checks every *resolved* address at delivery, which is the only
place a host name's addresses are known. Both are lifted together by
``TOCSIN_ALLOW_PRIVATE_TARGETS`` (the proxy's own ``TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS``
overrides it for the proxy). Pure: no I/O, no name resolution.
"""

from __future__ import annotations

import ipaddress
import re
import socket

# IPv6 ranges that carry (or translate to) an IPv4 address, or that Python versions have
# called global although they are not: an explicit list, so the classification does not
# depend on the interpreter's ``is_global`` tables.
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
    """Whether a callback may reach this IP address (text form; not an address: False).

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


_NUMERIC_HOST = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]+|[0-9]+)){0,3}")


def refused_literal(host: str) -> str | None:
    """The address if ``host`` (a URL's host, IPv6 with or without brackets) is an IP
    literal a callback may not reach; None when it is allowed or a name (names are judged
    once resolved)."""
    bare = host.strip("[]")
    if ":" not in bare and not _NUMERIC_HOST.fullmatch(bare):
        # A name: no IPv6 literal lacks a colon, no IPv4 one (ipaddress's or inet_aton's)
        # is more than numbers and dots. Said first, since ip_address refusing a name
        # twice (v4, then v6) is most of this check's cost on every create.
        return None
    try:
        ipaddress.ip_address(bare.split("%", 1)[0])
    except ValueError:
        # The resolver's inet_aton also reads 2130706433, 0x7f000001, 0177.1 and 127.1 as
        # IPv4 addresses; a host name never consists of numbers and dots alone.
        if not _NUMERIC_HOST.fullmatch(bare):
            return None
        try:
            bare = socket.inet_ntoa(socket.inet_aton(bare))
        except OSError:
            return None
    return None if address_allowed(bare) else bare

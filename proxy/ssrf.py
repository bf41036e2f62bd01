"""SSRF guard of the fires-mode proxy: tenants choose callback URLs, so the proxy must not
become their way into the internal network.

A callback may only reach *global* unicast addresses (the classification is
``topics.addresses``, shared with the create-time check of IP literals): loopback, private,
link-local, shared, multicast, unspecified and reserved addresses are refused unless
``TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS`` is set. The check is on the **resolved** address:
``guarded_resolve`` filters what DNS returns and the proxy's HTTP client
(``proxy.http_client``) connects only to what it hands back, so a host name that resolves
to 127.0.0.1 (``localhost``, a rebinding domain) is refused at connect time; create time
can only judge literals. IP literals are checked by ``literal_refusal`` before any
connection.

A refused target is undeliverable: it is dead-lettered at once with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from base.errors import TocsinError
from proxy.http_client import resolve_any
from topics.addresses import address_allowed, refused_literal


class BlockedAddress(OSError, TocsinError):
    """Every address of a callback host is one the proxy may not call. An OSError because
    a resolver's failure is one (the HTTP clients turn it into a connection error, whose
    cause ``blocked_reason`` finds); never retriable."""


def _blocked(host: str, addresses: Sequence[str]) -> BlockedAddress:
    shown = ", ".join(sorted(set(addresses))) or "nothing"
    return BlockedAddress(
        f"callback host {host!r} resolves to {shown}: loopback, private, link-local "
        "or reserved addresses are refused (TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS=true "
        "allows them)"
    )


async def guarded_resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host`` the proxy may connect to; BlockedAddress when none."""
    addresses = await resolve_any(host, port)
    allowed = [a for a in addresses if address_allowed(a)]
    if not allowed:
        raise _blocked(host, addresses)
    return allowed


def literal_refusal(host: str) -> str | None:
    """Why an IP-literal host may not be called (None: allowed, or not a literal)."""
    bare = refused_literal(host)
    if bare is None:
        return None
    return (
        f"callback address {bare} is loopback, private, link-local or reserved; the proxy "
        "refuses it (TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS=true allows it)"
    )


def blocked_reason(exc: BaseException) -> str | None:
    """The refusal message if ``exc`` (a connection error) came from the guard."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, BlockedAddress):
            return str(cur)
        os_error = getattr(cur, "os_error", None)
        if isinstance(os_error, BlockedAddress):
            return str(os_error)
        cur = cur.__cause__ or cur.__context__
    return None

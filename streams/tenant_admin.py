"""Tenant administration against the store, shared by the REST API and the ``tocsin``
command: register (with a signing key and a first API key), issue keys, list, rotate and
retire signing keys."""

from __future__ import annotations

from typing import TypedDict

from base.clock import now_ms
from base.errors import CommandRejected, TocsinError
from streams.ports import CqlRow, TenantAdminStore
from streams.tenants import TenantConfig, new_api_key
from topics.fields import check_tenant
from topics.signing import SigningKeys, new_signing_key


class TenantExists(TocsinError):
    """The tenant is registered already."""


class RegisteredTenant(TypedDict):
    """A registered tenant with its first keys, shown only at registration."""

    tenant: str
    active: bool
    config: dict[str, object]
    api_key: str
    key_id: str
    signing_key: str


async def register_tenant(
    store: TenantAdminStore, name: object, config: TenantConfig, *, active: bool = True
) -> RegisteredTenant:
    """Create a tenant; returns its first API key and its signing key (shown only now).

    Raises ValueError for a bad name and TenantExists when it is registered already."""
    try:
        tenant = check_tenant(name)
    except CommandRejected as exc:
        raise ValueError(exc.message) from None
    if await store.get_tenant(tenant) is not None:
        raise TenantExists(f"tenant {tenant!r} is already registered")
    at = now_ms()
    signing = new_signing_key()
    await store.put_tenant(
        tenant,
        active=active,
        created_ms=at,
        config=config.to_json(),
        signing_secret=signing,
        updated_ms=at,
    )
    key = await issue_key(store, tenant)
    return RegisteredTenant(
        tenant=tenant,
        active=active,
        config=config.to_dict(),
        api_key=key["api_key"],
        key_id=key["key_id"],
        signing_key=signing,
    )


async def issue_key(store: TenantAdminStore, tenant: str) -> dict[str, str]:
    key = new_api_key()
    await store.put_api_key(key.key_id, tenant, salt=key.salt, hash=key.hash, created_ms=now_ms())
    return {"tenant": tenant, "key_id": key.key_id, "api_key": key.token}


class TenantNotFound(TocsinError):
    """No tenant of that name."""


class RotationConflict(TocsinError):
    """The tenant's keys changed while this rotation or retirement was being applied."""


async def rotate_signing_key(
    store: TenantAdminStore, tenant: str, *, previous_valid_s: int | None = None
) -> dict[str, object]:
    """Issue a new current signing key; the old one becomes the previous key, which still
    verifies until it is retired (``retire_previous_signing_key``) or, with
    ``previous_valid_s``, until that many seconds from now (0: retired at once, for a leaked
    key). A previous key still present from an earlier rotation is retired now.

    Returns the new key (shown only now). Raises TenantNotFound, ValueError for a negative
    ``previous_valid_s``, RotationConflict when another rotation won the race."""
    if previous_valid_s is not None and previous_valid_s < 0:
        raise ValueError("previous_valid_s must be >= 0")
    row = await store.get_tenant(tenant)
    if row is None:
        raise TenantNotFound(f"no tenant {tenant!r}")
    keys = SigningKeys.of_row(row)
    at = now_ms()
    new = new_signing_key()
    expires = None if previous_valid_s is None else at + previous_valid_s * 1000
    if keys.current is None:
        expires = None  # nothing to keep valid: a tenant from before signing keys
    applied = await store.rotate_signing_key(
        tenant,
        expected_current=keys.current,
        new_secret=new,
        previous_expires_ms=expires,
        retired=keys.previous or keys.retired,
        now_ms=at,
    )
    if not applied:
        raise RotationConflict(f"tenant {tenant!r} had its signing key rotated meanwhile")
    return {
        "tenant": tenant,
        "signing_key": new,
        "rotated_ms": at,
        "previous_key": keys.current is not None,
        "previous_expires_ms": expires,
        "retired_earlier_previous": keys.previous is not None,
    }


async def retire_previous_signing_key(store: TenantAdminStore, tenant: str) -> dict[str, object]:
    """The previous signing key stops verifying now (commands produced before this moment
    are still accepted for a few minutes, see topics.signing). Raises TenantNotFound, and
    ValueError when there is no previous key that is still valid."""
    row = await store.get_tenant(tenant)
    if row is None:
        raise TenantNotFound(f"no tenant {tenant!r}")
    keys = SigningKeys.of_row(row)
    at = now_ms()
    if keys.previous is None or (
        keys.previous_expires_ms is not None and keys.previous_expires_ms <= at
    ):
        raise ValueError(f"tenant {tenant!r} has no previous signing key to retire")
    if not await store.retire_previous_signing_key(tenant, previous=keys.previous, at_ms=at):
        raise RotationConflict(f"tenant {tenant!r} had its signing key rotated meanwhile")
    return {"tenant": tenant, "previous_retired_ms": at}


def signing_status(row: CqlRow, now_ms: int) -> dict[str, object]:
    """What a tenant view shows about its signing keys (never the keys)."""
    keys = SigningKeys.of_row(row)
    expires = keys.previous_expires_ms
    if keys.previous is None:
        previous = None
    elif expires is None or expires > now_ms:
        previous = "valid"
    else:
        previous = "retired"
    return {
        "rotated_ms": row.get("signing_rotated_ms"),
        "previous_key": previous,
        "previous_expires_ms": expires,
    }

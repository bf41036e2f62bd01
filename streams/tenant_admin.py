"""Tenant administration against the store, shared by the REST API and the ``tocsin``
command: register (with a signing key and a first API key), issue keys, list."""

from __future__ import annotations

import time
from typing import Any

from streams.tenants import TenantConfig, new_api_key
from tocsin.errors import CommandRejected
from topics.signing import new_signing_key
from topics.validation import check_tenant


class TenantExists(Exception):
    pass


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def register_tenant(
    store: Any, name: object, config: TenantConfig, *, active: bool = True
) -> dict[str, Any]:
    """Create a tenant; returns its first API key and its signing key (shown only now).

    Raises ValueError for a bad name and TenantExists when it is registered already."""
    try:
        tenant = check_tenant(name)
    except CommandRejected as exc:
        raise ValueError(exc.message) from None
    if await store.get_tenant(tenant) is not None:
        raise TenantExists(f"tenant {tenant!r} is already registered")
    at = _now_ms()
    signing = new_signing_key()
    await store.put_tenant(
        tenant, active=active, created_ms=at, config=config.to_json(),
        signing_secret=signing, updated_ms=at,
    )
    key = await issue_key(store, tenant)
    return {"tenant": tenant, "active": active, "config": config.to_dict(),
            "api_key": key["api_key"], "key_id": key["key_id"], "signing_key": signing}


async def issue_key(store: Any, tenant: str) -> dict[str, Any]:
    key = new_api_key()
    await store.put_api_key(key.key_id, tenant, salt=key.salt, hash=key.hash,
                            created_ms=_now_ms())
    return {"tenant": tenant, "key_id": key.key_id, "api_key": key.token}

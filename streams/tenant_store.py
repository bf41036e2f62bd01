"""Tenants and their API keys (the ``tenants``, ``api_keys`` and ``api_keys_by_tenant``
tables). API keys are stored as salted hashes only (see streams.tenants); signing keys
rotate through conditional updates, so two concurrent rotations cannot both win."""

from __future__ import annotations

from typing import ClassVar

from streams.cql import CqlExecutor, insert_cql, unset_none
from streams.ports import CqlRow

_TENANT_COLUMNS = (
    "tenant",
    "active",
    "created_ms",
    "config",
    "signing_secret",
    "updated_ms",
    # signing-key rotation (topics.signing.SigningKeys)
    "previous_signing_secret",
    "previous_signing_expires_ms",
    "retired_signing_secret",
    "signing_rotated_ms",
)
_API_KEY_COLUMNS = ("key_id", "tenant", "salt", "hash", "created_ms", "revoked")


class TenantStore(CqlExecutor):
    """Register, configure and list tenants; rotate their signing keys; keep their API
    keys."""

    CQL: ClassVar[dict[str, str]] = {
        "put_tenant": insert_cql("tenants", _TENANT_COLUMNS, ttl=False),
        "get_tenant": f"SELECT {', '.join(_TENANT_COLUMNS)} FROM {{keyspace}}.tenants "
        "WHERE tenant = ?",
        "list_tenants": f"SELECT {', '.join(_TENANT_COLUMNS)} FROM {{keyspace}}.tenants",
        # Conditional on the key being rotated, so two concurrent rotations cannot both
        # win (one key would be lost without ever being retired).
        "rotate_signing_key": "UPDATE {keyspace}.tenants SET signing_secret = ?, "
        "previous_signing_secret = ?, previous_signing_expires_ms = ?, "
        "retired_signing_secret = ?, signing_rotated_ms = ?, updated_ms = ? "
        "WHERE tenant = ? IF signing_secret = ?",
        "retire_previous_key": "UPDATE {keyspace}.tenants SET previous_signing_expires_ms = ?, "
        "updated_ms = ? WHERE tenant = ? IF previous_signing_secret = ?",
        "put_api_key": insert_cql("api_keys", _API_KEY_COLUMNS, ttl=False),
        "get_api_key": f"SELECT {', '.join(_API_KEY_COLUMNS)} FROM {{keyspace}}.api_keys "
        "WHERE key_id = ?",
        "revoke_api_key": "UPDATE {keyspace}.api_keys SET revoked = true WHERE key_id = ?",
        "put_tenant_key": insert_cql(
            "api_keys_by_tenant", ("tenant", "key_id", "created_ms"), ttl=False
        ),
        "list_tenant_keys": "SELECT key_id, created_ms FROM {keyspace}.api_keys_by_tenant "
        "WHERE tenant = ?",
    }
    # Lightweight transactions: never retried blindly by the driver.
    CONDITIONAL: ClassVar[frozenset[str]] = frozenset({"rotate_signing_key", "retire_previous_key"})

    async def put_tenant(
        self,
        tenant: str,
        *,
        active: bool | None,
        created_ms: int | None,
        config: str | None = None,
        signing_secret: str | None = None,
        updated_ms: int | None = None,
    ) -> None:
        """Upsert; None leaves a column as it is (so a config change keeps the secret).
        Signing keys change through ``rotate_signing_key`` only."""
        await self.run(
            "put_tenant",
            unset_none(
                [tenant, active, created_ms, config, signing_secret, updated_ms]
                + [None] * (len(_TENANT_COLUMNS) - 6)
            ),
        )

    async def rotate_signing_key(
        self,
        tenant: str,
        *,
        expected_current: str | None,
        new_secret: str,
        previous_expires_ms: int | None,
        retired: str | None,
        now_ms: int,
    ) -> bool:
        """Make ``new_secret`` current and ``expected_current`` the previous key (valid until
        ``previous_expires_ms``; None: until retired), ``retired`` the one before. False when
        the current key is no longer ``expected_current`` (a concurrent rotation)."""
        rows = await self.run(
            "rotate_signing_key",
            [
                new_secret,
                expected_current,
                previous_expires_ms,
                retired,
                now_ms,
                now_ms,
                tenant,
                expected_current,
            ],
        )
        return bool(rows and rows[0].get("[applied]"))

    async def retire_previous_signing_key(self, tenant: str, *, previous: str, at_ms: int) -> bool:
        """The previous key stops verifying at ``at_ms``. False when it is no longer
        ``previous`` (rotated meanwhile)."""
        rows = await self.run("retire_previous_key", [at_ms, at_ms, tenant, previous])
        return bool(rows and rows[0].get("[applied]"))

    async def get_tenant(self, tenant: str) -> CqlRow | None:
        rows = await self.run("get_tenant", (tenant,))
        return rows[0] if rows else None

    async def list_tenants(self) -> list[CqlRow]:
        """All tenants (a small table; admin use only, never on a hot path)."""
        return await self.run("list_tenants", ())

    async def put_api_key(
        self, key_id: str, tenant: str, *, salt: bytes, hash: bytes, created_ms: int
    ) -> None:
        await self.run("put_api_key", (key_id, tenant, salt, hash, created_ms, False))
        await self.run("put_tenant_key", (tenant, key_id, created_ms))

    async def get_api_key(self, key_id: str) -> CqlRow | None:
        rows = await self.run("get_api_key", (key_id,))
        return rows[0] if rows else None

    async def revoke_api_key(self, key_id: str) -> None:
        await self.run("revoke_api_key", (key_id,))

    async def list_api_keys(self, tenant: str) -> list[CqlRow]:
        return await self.run("list_tenant_keys", (tenant,))

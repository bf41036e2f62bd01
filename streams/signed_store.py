"""The signatures of commands that write no schedule row (trigger, backfill), so a copy of
one is refused by whichever worker reads it (migration 014, ``signed_without_row``).

Every other signed command records its signature on the schedule row it writes
(``decisions.check_signed_order``). A trigger or backfill leaves the row as it is, so its
signed time, signature prefix and offset go to this table, written in the same request
as the command's history event and read only for batches holding one of these commands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from streams.model import Stmt
from streams.ports import CqlRow, StatementRunner

# An hour: a copy is appended within 5 minutes of its signed time (the signature window),
# and the rest covers a worker that falls behind between reading the original and the
# copy, as the finished schedule rows' minimum retention does (streams.cql.MIN_KEEP_S).
TTL_S = 3600

STATEMENTS = {
    "signed_get": "SELECT schedule_id, signed_at_ms, signed_macs, applied_offset "
    "FROM {keyspace}.signed_without_row WHERE tenant = ? AND schedule_id IN ?",
    "signed_put": "INSERT INTO {keyspace}.signed_without_row (tenant, schedule_id, "
    "signed_at_ms, signed_macs, applied_offset) VALUES (?, ?, ?, ?, ?) USING TTL ?",
}


def put_stmt(tenant: str, schedule_id: str, at_ms: int, macs: bytes, offset: int) -> Stmt:
    """The statement recording a trigger's or backfill's signature."""
    return ("signed_put", [tenant, schedule_id, at_ms, macs, offset, TTL_S])


def unrowed_of(statements: Iterable[Stmt]) -> tuple[int, bytes, int] | None:
    """(signed_at_ms, signed_macs, applied_offset) of the record ``put_stmt`` made among
    ``statements``; None when there is none."""
    for name, params in statements:
        if name == "signed_put":
            return params[2], params[3], params[4]
    return None


class SignedStore:
    """``signed_without_row`` on the worker's store (same session)."""

    def __init__(self, store: StatementRunner) -> None:
        self.store = store
        self._prepared = False

    async def prepare(self) -> None:
        if not self._prepared:
            if not self.store.has_statements(list(STATEMENTS)):
                await self.store.prepare_statements(STATEMENTS)
            self._prepared = True

    async def read(self, schedules: Iterable[tuple[str, str]]) -> Mapping[tuple[str, str], CqlRow]:
        """The records of these (tenant, schedule id) pairs that have one; one request per
        tenant (a batch's triggers and backfills are few)."""
        by_tenant: dict[str, list[str]] = {}
        for tenant, sid in schedules:
            by_tenant.setdefault(tenant, []).append(sid)
        if not by_tenant:
            return {}
        await self.prepare()
        found: dict[tuple[str, str], CqlRow] = {}
        for tenant, ids in by_tenant.items():
            for row in await self.store.run("signed_get", (tenant, list(dict.fromkeys(ids)))):
                found[(tenant, row["schedule_id"])] = row
        return found

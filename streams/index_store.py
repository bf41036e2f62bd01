"""The per-tenant listing indexes: ``schedules_by_tenant_day`` (a tenant's schedules by
due time, one partition per UTC day) and ``recurring_by_tenant`` (its recurring schedules).
Both are idempotent overwrites, written beside the schedule rows by the command agent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from streams.cql import CqlExecutor, gather_all, insert_cql
from streams.model import Stmt

_DAY_MS = 86_400_000


class ListingIndexStore(CqlExecutor):
    """Write and page through a tenant's listing indexes."""

    CQL: ClassVar[dict[str, str]] = {
        "put_index": insert_cql(
            "schedules_by_tenant_day", ("tenant", "day", "due_ms", "schedule_id"), ttl=True
        ),
        "delete_index": "DELETE FROM {keyspace}.schedules_by_tenant_day WHERE tenant = ? "
        "AND day = ? AND due_ms = ? AND schedule_id = ?",
        "read_index": "SELECT due_ms, schedule_id FROM {keyspace}.schedules_by_tenant_day "
        "WHERE tenant = ? AND day = ? AND due_ms >= ? AND due_ms < ? LIMIT ?",
        "read_index_after": "SELECT due_ms, schedule_id FROM "
        "{keyspace}.schedules_by_tenant_day WHERE tenant = ? AND day = ? "
        "AND (due_ms, schedule_id) > (?, ?) AND due_ms < ? LIMIT ?",
        "put_recurring": insert_cql(
            "recurring_by_tenant", ("tenant", "schedule_id", "created_ms"), ttl=True
        ),
        "list_recurring": "SELECT schedule_id FROM {keyspace}.recurring_by_tenant WHERE tenant = ?",
        "list_recurring_after": "SELECT schedule_id FROM {keyspace}.recurring_by_tenant "
        "WHERE tenant = ? AND schedule_id > ? LIMIT ?",
    }

    async def write_index(
        self,
        put: Sequence[tuple[str, str, int]],
        delete: Sequence[tuple[str, str, int]],
        *,
        now_ms: int,
        retention_s: int | None = None,
    ) -> None:
        """Add (tenant, schedule_id, due_ms) entries (kept until due + retention) and drop
        stale ones (a reschedule's old due). Idempotent overwrites; see the 002 migration."""
        keep_s = self.retention_s if retention_s is None else retention_s
        # One unlogged batch per (tenant, day) partition (chunks of 50 tiny rows): a burst
        # of one tenant's creates costs a few requests, not one per schedule.
        groups: dict[tuple[str, int], list[Stmt]] = {}
        for t, sid, due in put:
            ttl = max(1, (due - now_ms) // 1000 + keep_s)
            groups.setdefault((t, due // _DAY_MS), []).append(
                ("put_index", [t, due // _DAY_MS, due, sid, ttl])
            )
        for t, sid, due in delete:
            groups.setdefault((t, due // _DAY_MS), []).append(
                ("delete_index", [t, due // _DAY_MS, due, sid])
            )
        await gather_all(
            [
                self.run_together("write_index", stmts[i : i + 50])
                for stmts in groups.values()
                for i in range(0, len(stmts), 50)
            ]
        )

    async def read_index(
        self,
        tenant: str,
        *,
        from_ms: int,
        to_ms: int,
        after: tuple[int, str] | None = None,
        limit: int = 100,
    ) -> list[tuple[int, str]]:
        """(due_ms, schedule_id) of the tenant's schedules with from_ms <= due < to_ms, in
        due order, strictly after ``after``; at most ``limit``. One slice per UTC day."""
        out: list[tuple[int, str]] = []
        resume = after if after is not None and after[0] >= from_ms else None
        day = (resume[0] if resume else from_ms) // _DAY_MS
        last_day = (to_ms - 1) // _DAY_MS
        while day <= last_day and len(out) < limit:
            left = limit - len(out)
            if resume is not None:
                rows = await self.run(
                    "read_index_after", (tenant, day, resume[0], resume[1], to_ms, left)
                )
                resume = None
            else:
                lo = max(from_ms, day * _DAY_MS)
                rows = await self.run("read_index", (tenant, day, lo, to_ms, left))
            out.extend((int(r["due_ms"]), r["schedule_id"]) for r in rows)
            day += 1
        return out

    # -- the tenant's recurring schedules (recurring_by_tenant) ---------------------------

    async def write_recurring_index(self, entries: Sequence[tuple[str, str, int, bool]]) -> None:
        """(tenant, schedule_id, created_ms, finished) entries: live ones without a TTL,
        finished (cancelled) ones expiring with the parent row (the retention)."""
        groups: dict[str, list[Stmt]] = {}
        for tenant, sid, created_ms, finished in entries:
            ttl = max(1, self.retention_s) if finished else 0  # TTL 0: never expires
            groups.setdefault(tenant, []).append(("put_recurring", [tenant, sid, created_ms, ttl]))
        await gather_all(
            [
                self.run_together("write_recurring_index", stmts[i : i + 50])
                for stmts in groups.values()
                for i in range(0, len(stmts), 50)
            ]
        )

    async def list_recurring(self, tenant: str) -> list[str]:
        """Ids of the tenant's recurring schedules (their rows may have expired), by id."""
        rows = await self.run("list_recurring", (tenant,))
        return [r["schedule_id"] for r in rows]

    async def list_recurring_page(self, tenant: str, *, after: str, limit: int) -> list[str]:
        """At most ``limit`` ids of the tenant's recurring schedules strictly after
        ``after`` ("" for the first), by id: a bounded read of a partition that may be
        large."""
        rows = await self.run(
            "list_recurring_after", (tenant, after, limit), fetch_size=min(limit, self.fetch_size)
        )
        return [r["schedule_id"] for r in rows]

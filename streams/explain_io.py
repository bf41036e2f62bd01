"""The reads behind ``streams.explain``: one schedule's row and history, its tenant's fire
quota, and for a recurring schedule its newest runs (at most ``MAX_RUNS``) with their rows
and histories. Every read is by the schedule's own partition key: the cost does not grow
with the store."""

from __future__ import annotations

import asyncio
from typing import Protocol

from streams.explain import Facts, RunFacts
from streams.ports import CqlRow, MaterializerStore, TenantReader
from streams.recurring_store import RecurringStore
from streams.tenants import TenantConfig

DEFAULT_RUNS = 10
MAX_RUNS = 100
# The newest events read of each schedule id's history: a failing endpoint's attempts and
# refused commands make a history grow, and the read must stay bounded.
MAX_EVENTS = 200


class ExplainStore(MaterializerStore, TenantReader, Protocol):
    """What an explanation reads (``streams.store.Store`` is one)."""

    async def list_events(
        self, tenant: str, schedule_id: str, *, newest: int | None = None
    ) -> list[CqlRow]: ...


async def newest_events(
    store: ExplainStore, tenant: str, schedule_id: str, limit: int = MAX_EVENTS
) -> tuple[list[CqlRow], bool]:
    """The schedule id's newest ``limit`` events, oldest first, and whether older ones
    exist (one more is read to tell)."""
    rows = await store.list_events(tenant, schedule_id, newest=limit + 1)
    return (rows[1:], True) if len(rows) > limit else (rows, False)


async def read_facts(
    store: ExplainStore,
    tenant: str,
    schedule_id: str,
    *,
    now_ms: int,
    default_tolerance_s: int,
    runs: int = DEFAULT_RUNS,
) -> Facts | None:
    """Everything recorded about the tenant's schedule, or None when it has no such schedule
    (another tenant's schedule of the same id is never read: rows are keyed by tenant)."""
    if not 0 <= runs <= MAX_RUNS:
        raise ValueError(f"runs must be in 0..{MAX_RUNS}, got {runs}")
    row, (events, older), tenant_row = await asyncio.gather(
        store.get_schedule(tenant, schedule_id),
        newest_events(store, tenant, schedule_id),
        store.get_tenant(tenant),
    )
    if row is None:
        return None
    config = TenantConfig.from_json(tenant_row.get("config")) if tenant_row else TenantConfig()
    run_facts: list[RunFacts] = []
    if row.get("recurrence") is not None and runs > 0:
        run_facts = await _newest_runs(store, tenant, schedule_id, runs, now_ms)
    return Facts(
        row=row,
        events=events,
        now_ms=now_ms,
        default_tolerance_s=default_tolerance_s,
        fire_quota_per_min=config.fire_quota_per_min,
        runs=run_facts,
        runs_limit=runs,
        events_limit=MAX_EVENTS,
        older_events=older,
    )


async def _newest_runs(
    store: ExplainStore, tenant: str, schedule_id: str, limit: int, now_ms: int
) -> list[RunFacts]:
    """The newest runs due by ``now_ms`` (nominal time), newest first."""
    history = await RecurringStore(store).past_runs(tenant, schedule_id, now_ms + 1, limit)
    ids = [str(h["run_id"]) for h in history]
    if not ids:
        return []
    rows, histories = await asyncio.gather(
        store.get_schedules(tenant, ids),
        asyncio.gather(*(newest_events(store, tenant, i) for i in ids)),
    )
    return [
        RunFacts(
            run_id=str(h["run_id"]),
            nominal_ms=int(h["nominal_ms"]),
            due_ms=int(h["due_ms"]),
            row=rows.get(str(h["run_id"])),
            events=events,
            older_events=older,
        )
        for h, (events, older) in zip(history, histories, strict=True)
    ]

"""The reads behind ``tocsin status`` (the pure part is streams.status).

Cassandra, bounded by time: the bucket rows of every commands partition due in
``[now - lookback, now + 1 h)`` (key columns only, one slice per bucket partition), the
schedule rows of those due before now (state columns only, IN queries per tenant), and per
tenant its day index up to ``now + horizon`` plus its recurring schedules, at most
``max_rows`` each. Kafka: committed offsets of the worker's and the proxy's consumer
groups against the watermarks of the topics they read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from base.errors import KafkaError
from base.settings import KafkaSettings, Settings
from streams.buckets import BUCKET_MS
from streams.ports import StatusStore
from streams.status import Lag, StateColumns, Tally, Window, lag_of
from topics.catalog import catalog

_CQL = {
    "status_bucket_keys": "SELECT due_ms, tenant, schedule_id, version FROM {keyspace}.buckets "
    "WHERE partition = ? AND minute_ms = ? AND shard = ? AND due_ms >= ? AND due_ms < ?",
    "status_states": "SELECT schedule_id, state, due_ms, version, fired_ms, updated_ms, "
    "delivery_outcome, delivery_ms FROM {keyspace}.schedules "
    "WHERE tenant = ? AND schedule_id IN ?",
}
_IN_CHUNK = 100
# Minutes whose bucket partitions are read at once (each fans out to partitions x shards
# queries; the store's semaphore caps requests in flight).
_MINUTES_AT_ONCE = 8


async def read_states(
    store: StatusStore, tenant: str, ids: Sequence[str]
) -> dict[str, StateColumns]:
    """State columns of the tenant's schedules ``ids`` (missing rows left out)."""
    unique = list(dict.fromkeys(ids))
    parts = await asyncio.gather(
        *(
            store.run("status_states", (tenant, unique[i : i + _IN_CHUNK]))
            for i in range(0, len(unique), _IN_CHUNK)
        )
    )
    return {str(row["schedule_id"]): StateColumns.from_row(row) for rows in parts for row in rows}


async def tally_buckets(
    store: StatusStore, tally: Tally, *, partitions: int, shards: int, tenant: str | None = None
) -> None:
    """Feed ``tally`` every bucket row of the window (only ``tenant``'s when given)."""
    window = tally.window
    minutes = window.minutes()
    gate = asyncio.Semaphore(_MINUTES_AT_ONCE)

    async def minute(minute_ms: int) -> None:
        async with gate:
            lo = max(minute_ms, window.past_from_ms)
            hi = min(minute_ms + BUCKET_MS, window.ahead_until_ms)
            slices = await asyncio.gather(
                *(
                    store.run("status_bucket_keys", (p, minute_ms, s, lo, hi))
                    for p in range(partitions)
                    for s in range(shards)
                )
            )
            past: dict[str, list[tuple[str, int, int]]] = {}
            for found_rows in slices:
                for r in found_rows:
                    name = str(r["tenant"])
                    if tenant is not None and name != tenant:
                        continue
                    due = int(r["due_ms"])
                    if tally.bucket_row(name, due):
                        past.setdefault(name, []).append(
                            (str(r["schedule_id"]), due, int(r["version"]))
                        )
            found = await asyncio.gather(
                *(
                    read_states(store, name, [sid for sid, _, _ in rows])
                    for name, rows in past.items()
                )
            )
            for (name, keys), states in zip(past.items(), found, strict=True):
                for sid, due, version in keys:
                    tally.past_trigger(name, due, version, states.get(sid))

    await asyncio.gather(*(minute(m) for m in minutes))


async def tally_waiting(store: StatusStore, tally: Tally, tenant: str, *, max_rows: int) -> None:
    """Count the tenant's schedules waiting to fire: one-shots due in
    ``[now - lookback, now + horizon)`` (its day index, state read from the rows) and its
    active recurring schedules, reading at most ``max_rows`` of each."""
    window = tally.window
    hi = window.now_ms + window.horizon_ms
    waiting = 0
    read = 0
    truncated = False
    after: tuple[int, str] | None = None
    while True:
        page = await store.read_index(
            tenant,
            from_ms=window.past_from_ms,
            to_ms=hi,
            after=after,
            limit=min(1000, max_rows - read),
        )
        if not page:
            break
        read += len(page)
        states = await read_states(store, tenant, [sid for _, sid in page])
        for due, sid in page:
            state = states.get(sid)
            # An entry whose due time no longer matches was rescheduled: its new entry counts.
            if state is not None and state.due_ms == due and state.state == "scheduled":
                waiting += 1
        after = page[-1]
        if read >= max_rows:
            truncated = True
            break
    recurring = await store.list_recurring(tenant)
    if len(recurring) > max_rows:
        recurring, truncated = recurring[:max_rows], True
    parents = await read_states(store, tenant, recurring)
    waiting += sum(1 for s in parents.values() if s.state == "scheduled")
    tally.waiting(tenant, waiting, truncated=truncated)


async def collect(
    store: StatusStore,
    window: Window,
    *,
    partitions: int,
    shards: int,
    tenant: str | None,
    max_rows: int,
) -> Tally:
    """Every store figure of the window, for ``tenant`` or every registered tenant."""
    await store.prepare_statements(_CQL)
    names = (
        [tenant]
        if tenant is not None
        else sorted(str(r["tenant"]) for r in await store.list_tenants())
    )
    tally = Tally(window, names)
    await tally_buckets(store, tally, partitions=partitions, shards=shards, tenant=tenant)
    # One tenant at a time: each already runs its reads concurrently.
    for name in names:
        await tally_waiting(store, tally, name, max_rows=max_rows)
    return tally


def consumer_lags(
    kafka: KafkaSettings, pairs: Sequence[tuple[str, str, int]], *, timeout_s: float = 10.0
) -> list[Lag]:
    """The lag of each (group, topic, partition count) from committed offsets and
    watermarks. Raises KafkaError (retriable) when the cluster does not answer."""
    # Imported here: only ``tocsin status`` needs the admin client, and importing it is slow.
    from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

    try:
        admin = AdminClient(kafka.librdkafka())
        # Loads the metadata list_offsets needs to find the leaders.
        admin.list_topics(timeout=timeout_s)
        tps = {TopicPartition(t, p) for _, t, n in pairs for p in range(n)}
        specs = {
            "low": OffsetSpec.earliest(),  # type: ignore[no-untyped-call]
            "high": OffsetSpec.latest(),  # type: ignore[no-untyped-call]
        }
        ends: dict[str, dict[tuple[str, int], int]] = {}
        for name, spec in specs.items():
            futures = admin.list_offsets({tp: spec for tp in tps}, request_timeout=timeout_s)
            ends[name] = {
                (tp.topic, tp.partition): int(f.result(timeout=timeout_s).offset)
                for tp, f in futures.items()
            }
        out = []
        for group, topic, n in pairs:
            request = ConsumerGroupTopicPartitions(
                group, [TopicPartition(topic, p) for p in range(n)]
            )
            answer = admin.list_consumer_group_offsets([request], request_timeout=timeout_s)
            result = answer[group].result(timeout=timeout_s)
            committed: dict[int, int | None] = {
                tp.partition: (tp.offset if tp.offset >= 0 else None)
                for tp in result.topic_partitions
                if tp.error is None
            }
            out.append(
                lag_of(
                    group,
                    topic,
                    committed,
                    low={p: ends["low"][(topic, p)] for p in range(n)},
                    high={p: ends["high"][(topic, p)] for p in range(n)},
                )
            )
        return out
    except KafkaException as exc:
        raise KafkaError(f"consumer lag: {exc}", retriable=True) from exc
    except KeyError as exc:
        raise KafkaError(f"consumer lag: no offsets for {exc}", retriable=True) from exc


def lag_pairs(settings: Settings, proxy_group: str) -> list[tuple[str, str, int]]:
    """The (group, topic, partitions) Tocsin's own consumers read: the worker's group
    (``<prefix>scheduler``) on the commands and deliveries topics, the proxy's on fires and
    its retry lane's (``<group>.retries``) on the retries topic, where parked triggers
    wait."""
    cat = catalog(settings.topics)
    worker = f"{settings.topics.prefix}scheduler"
    return [
        (worker, cat.commands.name, cat.commands.partitions),
        (worker, cat.deliveries.name, cat.deliveries.partitions),
        (proxy_group, cat.fires.name, cat.fires.partitions),
        (f"{proxy_group}.retries", cat.retries.name, cat.retries.partitions),
    ]

"""One keyspace, one deployment: a worker refuses a keyspace bound to another topic prefix.

Ownership of a commands partition comes from the consumer group of a topic prefix, but what
the owner fires comes from the keyspace, where buckets and fire checkpoints are keyed by
partition number only. Workers of two prefixes on one keyspace therefore both tick bucket
partition p. Each fires the other deployment's triggers onto its own fires topic, and - worse
- each moves the shared checkpoint past rows it never saw (a row written into a minute the
ticker had already loaded reaches only its own worker's ticker, by ``offer``), so when the
other deployment's worker next starts it catches up from a checkpoint beyond triggers nobody
fired: they are lost, neither fired nor recorded as missed. The same holds for one prefix
whose commands topic was recreated with another partition count (buckets sit at
``murmur2(id) % P``).

The same holds for a build of another bucket width (streams.buckets.BUCKET_MS): its
ticker would read the stored buckets at the wrong instants.

So the keyspace records the deployment it belongs to (the ``deployment`` table, migrations
004 and 008): the first worker (or ``tocsin setup``) binds it, and a worker of any other
deployment stops at start with a ConfigError. ``binding_conflict`` is the pure rule;
``bind_keyspace`` its thin edge.
"""

from __future__ import annotations

import asyncio
import logging

from base.clock import now_ms
from base.errors import ConfigError, StoreError
from base.settings import Settings
from streams.buckets import BUCKET_MS
from streams.model import Deployment
from streams.ports import BindingStore
from streams.store import Store

log = logging.getLogger("tocsin.binding")


def deployment_of(settings: Settings) -> Deployment:
    return Deployment(
        topic_prefix=settings.topics.prefix,
        command_partitions=settings.topics.command_partitions,
        bucket_ms=BUCKET_MS,
    )


def binding_conflict(bound: Deployment, mine: Deployment, keyspace: str) -> str | None:
    """Why ``mine`` must not run on ``keyspace``, bound to ``bound`` (None: it may)."""
    if bound.topic_prefix != mine.topic_prefix:
        return (
            f"keyspace {keyspace!r} belongs to topic prefix {bound.topic_prefix!r}, not "
            f"{mine.topic_prefix!r}: workers of two prefixes on one keyspace tick the same "
            "bucket partitions and checkpoints and lose each other's triggers; give this "
            "deployment a keyspace of its own (TOCSIN_CASSANDRA_KEYSPACE), see "
            "docs/operations.md"
        )
    if bound.command_partitions != mine.command_partitions:
        return (
            f"keyspace {keyspace!r} holds buckets for {bound.command_partitions} commands "
            f"partitions, not {mine.command_partitions} (TOCSIN_COMMAND_PARTITIONS): every "
            "stored schedule would sit in another partition's buckets; see "
            "docs/operations.md, 'Adding partitions safely'"
        )
    if bound.bucket_ms != mine.bucket_ms:
        return (
            f"keyspace {keyspace!r} holds {bound.bucket_ms} ms buckets, not {mine.bucket_ms}: "
            "this worker would read its buckets at the wrong instants and skip the "
            "triggers they hold; run a build of the same bucket width on it"
        )
    return None


async def bind_keyspace(
    store: BindingStore,
    mine: Deployment,
    keyspace: str,
    *,
    owner: str,
    now_ms: int,
    retry_s: float = 2.0,
) -> None:
    """Bind the keyspace to ``mine`` if it is unbound; ConfigError if it belongs to another
    deployment. A store that is unavailable is waited for (as the ticker waits for it): a
    worker started before Cassandra is up starts once it is."""
    while True:
        try:
            await store.connect()
            bound = await store.bind_deployment(mine, owner=owner, now_ms=now_ms)
            break
        except StoreError as exc:
            if not exc.retriable:
                raise
            log.warning(
                "store unavailable while checking the keyspace binding; retrying",
                extra={"error": str(exc), "retry_s": retry_s},
            )
        await asyncio.sleep(retry_s)
    conflict = binding_conflict(bound, mine, keyspace)
    if conflict is not None:
        raise ConfigError(conflict)


def check_keyspace(settings: Settings, *, owner: str) -> None:
    """Blocking ``bind_keyspace`` with a store of its own, for a process about to start (a
    worker before Faust runs, ``tocsin setup``); raises ConfigError on a mismatch."""

    async def run() -> None:
        store = Store(settings.cassandra)
        try:
            await bind_keyspace(
                store,
                deployment_of(settings),
                settings.cassandra.keyspace,
                owner=owner,
                now_ms=now_ms(),
            )
        finally:
            await store.close()

    asyncio.run(run())

"""The topic catalog as code: every topic Tocsin reads or writes, and what its key means.

Pure: ``tocsin.topic_admin.ensure_topics`` creates missing topics and verifies existing
ones against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from base.settings import TopicSettings

_DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    key: str  # what the message key means, for humans and docs
    value: str
    config: Mapping[str, str] = field(default_factory=dict)
    # Entries of ``config`` that ``tocsin.topic_admin`` also sets on an existing topic: ones
    # correctness depends on, unlike retention, which operators may tune.
    enforced: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class Catalog:
    commands: TopicSpec
    command_results: TopicSpec
    fires: TopicSpec
    deliveries: TopicSpec
    dead_letters: TopicSpec
    retries: TopicSpec

    def all(self) -> list[TopicSpec]:
        return [
            self.commands,
            self.command_results,
            self.fires,
            self.deliveries,
            self.dead_letters,
            self.retries,
        ]


def catalog(topics: TopicSettings) -> Catalog:
    """The topics for these settings (names carry the configured prefix)."""
    p, rf = topics.prefix, topics.replication_factor
    # min.insync.replicas only matters with replicas; 2 with RF 3 is the durable setting.
    min_insync = topics.min_insync()
    durable = {"min.insync.replicas": str(min_insync)} if min_insync is not None else {}
    return Catalog(
        commands=TopicSpec(
            name=f"{p}commands",
            partitions=topics.command_partitions,
            replication_factor=rf,
            key="schedule id; its partition owns the schedule's Cassandra buckets",
            value="command JSON (schema/json/command.schema.json)",
            # The broker stamps each command with its own append time, so a signed
            # command's freshness is judged against a clock its producer cannot set
            # (topics.signing): a copy produced again later is stale.
            config={
                "cleanup.policy": "delete",
                "retention.ms": str(7 * _DAY_MS),
                "message.timestamp.type": "LogAppendTime",
                **durable,
            },
            enforced=frozenset({"message.timestamp.type"}),
        ),
        command_results=TopicSpec(
            name=f"{p}command-results",
            partitions=topics.command_partitions,
            replication_factor=rf,
            key="schedule id",
            value="result JSON (schema/json/command-result.schema.json)",
            config={"cleanup.policy": "delete", "retention.ms": str(1 * _DAY_MS), **durable},
        ),
        fires=TopicSpec(
            name=f"{p}fires",
            partitions=topics.fire_partitions,
            replication_factor=rf,
            key="order key (default the schedule id): per-key order holds downstream",
            value="trigger JSON (schema/json/trigger.schema.json)",
            config={"cleanup.policy": "delete", "retention.ms": str(7 * _DAY_MS), **durable},
        ),
        deliveries=TopicSpec(
            name=f"{p}deliveries",
            partitions=topics.command_partitions,
            replication_factor=rf,
            key="schedule id (co-partitioned with commands)",
            value="delivery outcome JSON from the proxy",
            config={"cleanup.policy": "delete", "retention.ms": str(7 * _DAY_MS), **durable},
        ),
        dead_letters=TopicSpec(
            name=f"{p}dead-letters",
            partitions=topics.fire_partitions,
            replication_factor=rf,
            key="the original message key",
            value="dead-letter record JSON: original message, reason, attempts",
            config={"cleanup.policy": "delete", "retention.ms": str(30 * _DAY_MS), **durable},
        ),
        retries=TopicSpec(
            name=f"{p}retries",
            partitions=topics.fire_partitions,
            replication_factor=rf,
            key="the original message key: a key's parked messages stay in order",
            value="the original record, parked by the proxy; header tocsin-retry: its origin, "
            "retry state and not-before time (docs/proxy.md)",
            # A parked record is needed until the retry lane reads it; a week covers a proxy
            # that is down for days, like the fires topic. 2 MiB: a parked record is a whole
            # source record plus a header, so any record a default topic admits fits.
            config={
                "cleanup.policy": "delete",
                "retention.ms": str(7 * _DAY_MS),
                "max.message.bytes": str(2 * 1024 * 1024),
                **durable,
            },
        ),
    )

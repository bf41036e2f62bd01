"""The topic catalog as code: every topic Tocsin reads or writes, and what its key means.

``catalog(settings)`` is pure; ``ensure_topics`` is the one I/O edge here: it creates
missing topics and verifies existing ones. A partition-count mismatch is an error, never
"fixed" silently: bucket ownership follows the commands topic's partitions, so changing
them moves schedules between partitions (see docs/operations.md before doing it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from base.errors import KafkaError, TopicMismatchError
from base.settings import KafkaSettings, TopicSettings

log = logging.getLogger("tocsin.topics")

_DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    key: str  # what the message key means, for humans and docs
    value: str
    config: Mapping[str, str] = field(default_factory=dict)
    # Entries of ``config`` that ``ensure_topics`` also sets on an existing topic: ones
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
        return [self.commands, self.command_results, self.fires, self.deliveries,
                self.dead_letters, self.retries]


def catalog(topics: TopicSettings) -> Catalog:
    """The topics for these settings (names carry the configured prefix)."""
    p, rf = topics.prefix, topics.replication_factor
    # min.insync.replicas only matters with replicas; 2 with RF 3 is the durable setting.
    durable = {"min.insync.replicas": "2"} if rf >= 3 else {}
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
            config={"cleanup.policy": "delete", "retention.ms": str(7 * _DAY_MS),
                    "max.message.bytes": str(2 * 1024 * 1024), **durable},
        ),
    )


def ensure_topics(
    kafka: KafkaSettings, specs: list[TopicSpec], *, timeout_s: float = 30.0
) -> dict[str, str]:
    """Create missing topics and verify existing ones; return {name: "created"|"altered"|
    "ok"}. An existing topic gets its ``enforced`` config entries set where they differ
    ("altered").

    Raises TopicMismatchError when an existing topic has another partition count.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient(kafka.librdkafka())
    try:
        existing = admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise KafkaError(
            f"cannot list topics at {kafka.bootstrap_servers}: {exc}", retriable=True
        ) from exc
    outcome: dict[str, str] = {}
    problems: list[str] = []
    missing: list[TopicSpec] = []
    for spec in specs:
        meta = existing.get(spec.name)
        if meta is None or meta.error is not None:
            missing.append(spec)
            continue
        have = len(meta.partitions)
        if have != spec.partitions:
            problems.append(
                f"topic {spec.name} has {have} partitions but the catalog says "
                f"{spec.partitions}. Fix: set TOCSIN_COMMAND_PARTITIONS/TOCSIN_FIRE_PARTITIONS "
                f"to {have} to match, or migrate to a new topic prefix (TOCSIN_TOPIC_PREFIX); "
                f"never add partitions to a live commands topic (it moves schedules' buckets)."
            )
        else:
            outcome[spec.name] = "ok"
    if problems:
        raise TopicMismatchError("\n".join(problems))
    for name in _align_enforced(
        admin, [s for s in specs if s.enforced and outcome.get(s.name) == "ok"], timeout_s
    ):
        outcome[name] = "altered"
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=s.replication_factor,
                    config=dict(s.config),
                )
                for s in missing
            ],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout_s)
                outcome[name] = "created"
            except KafkaException as exc:
                err: Any = exc.args[0] if exc.args else None
                # Another process created it between our list and create: verify again.
                if err is not None and getattr(err, "name", lambda: "")() == "TOPIC_ALREADY_EXISTS":
                    outcome[name] = "ok"
                    continue
                raise KafkaError(f"cannot create topic {name}: {exc}") from exc
        log.info("topics created", extra={"topics": sorted(s.name for s in missing)})
        _wait_for_leaders(admin, [s.name for s in missing], timeout_s)
        _wait_for_offsets(admin, missing, timeout_s)
    return outcome


def _align_enforced(admin: Any, specs: list[TopicSpec], timeout_s: float) -> list[str]:
    """Set each spec's enforced config entries on its existing topic where they differ;
    the names of the topics altered."""
    if not specs:
        return []
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        ResourceType,
    )

    altered: list[str] = []
    try:
        described = admin.describe_configs(
            [ConfigResource(ResourceType.TOPIC, s.name) for s in specs],
            request_timeout=timeout_s,
        )
        current = {res.name: fut.result(timeout=timeout_s) for res, fut in described.items()}
        changes = []
        for spec in specs:
            entries = current.get(spec.name, {})
            wrong = [
                name for name in sorted(spec.enforced)
                if name not in entries or entries[name].value != spec.config[name]
            ]
            if wrong:
                changes.append(ConfigResource(ResourceType.TOPIC, spec.name, incremental_configs=[
                    ConfigEntry(name, spec.config[name],
                                incremental_operation=AlterConfigOpType.SET)
                    for name in wrong
                ]))
        if changes:
            done = admin.incremental_alter_configs(changes, request_timeout=timeout_s)
            for res, fut in done.items():
                fut.result(timeout=timeout_s)
                altered.append(res.name)
    except KafkaException as exc:
        err: Any = exc.args[0] if exc.args else None
        # Unreachable or busy brokers pass; a denied DescribeConfigs/AlterConfigs does not.
        retriable = bool(err.retriable()) if hasattr(err, "retriable") else True
        raise KafkaError(
            f"cannot set the topics' required configuration ({', '.join(s.name for s in specs)}"
            f"): {exc}; the principal running setup needs DescribeConfigs and AlterConfigs "
            "on them",
            retriable=retriable,
        ) from exc
    if altered:
        log.warning("topic configuration aligned with the catalog",
                    extra={"topics": sorted(altered)})
    return altered


def _wait_for_offsets(admin: Any, specs: list[TopicSpec], timeout_s: float) -> None:
    """Metadata can name a leader a moment before that broker serves the partition: an
    offset lookup then still answers NOT_LEADER_FOR_PARTITION (a fresh-stack CI run failed
    on one). Wait until every created partition answers one. Runs after
    ``_wait_for_leaders``, which it does not replace: those ``list_topics`` calls are also
    what refreshes the admin client's metadata, without which ``list_offsets`` kept
    answering "No leaders found" for 30 s (a CI run with this wait alone)."""
    import time

    from confluent_kafka import KafkaException, TopicPartition
    from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

    pending = {(s.name, p) for s in specs for p in range(s.partitions)}
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while pending and time.monotonic() < deadline:
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        try:
            futures = admin.list_offsets(
                {TopicPartition(t, p): latest for t, p in pending}, request_timeout=timeout_s
            )
        except KafkaException as exc:  # e.g. the new topics not in the client's metadata yet
            last, futures = exc, {}
        for tp, fut in futures.items():
            try:
                fut.result(timeout=timeout_s)
                pending.discard((tp.topic, tp.partition))
            except KafkaException as exc:
                last = exc
        if pending:
            time.sleep(0.1)
    if pending:
        raise KafkaError(
            f"{len(pending)} partitions of new topics answer no offsets after "
            f"{timeout_s:.0f}s: {last}", retriable=True,
        )


def _wait_for_leaders(admin: Any, names: list[str], timeout_s: float) -> None:
    """Created topics answer "not leader" until each partition has one: wait for that, so
    a caller's first produce or offset lookup does not fail."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        topics = admin.list_topics(timeout=timeout_s).topics
        if all(
            name in topics
            and topics[name].partitions
            and all(p.leader >= 0 for p in topics[name].partitions.values())
            for name in names
        ):
            return
        time.sleep(0.1)
    raise KafkaError(
        f"topics {names} have no partition leaders after {timeout_s:.0f}s", retriable=True
    )

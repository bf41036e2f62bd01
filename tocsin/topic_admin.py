"""Creating and verifying the catalog's topics on a Kafka cluster: the I/O edge of
``topics.catalog``, used by ``tocsin topics create``, ``tocsin setup``, the demo and tests.

A partition-count mismatch is an error, never "fixed" silently: bucket ownership follows the
commands topic's partitions, so changing them moves schedules between partitions (see
docs/operations.md before doing it).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError as BrokerError
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from base.errors import KafkaError, TopicMismatchError
from base.settings import KafkaSettings
from topics.catalog import TopicSpec

log = logging.getLogger("tocsin.topics")


def ensure_topics(
    kafka: KafkaSettings, specs: list[TopicSpec], *, timeout_s: float = 30.0
) -> dict[str, str]:
    """Create missing topics and verify existing ones; return {name: "created"|"altered"|
    "ok"}. An existing topic gets its ``enforced`` config entries set where they differ
    ("altered").

    Raises TopicMismatchError when an existing topic has another partition count.
    """
    admin = AdminClient(kafka.librdkafka())
    outcome, missing = _verify_existing(admin, kafka, specs, timeout_s)
    for name in _align_enforced(
        admin, [s for s in specs if s.enforced and outcome.get(s.name) == "ok"], timeout_s
    ):
        outcome[name] = "altered"
    if missing:
        outcome.update(_create(admin, missing, timeout_s))
        log.info("topics created", extra={"topics": sorted(s.name for s in missing)})
        _wait_for_leaders(admin, [s.name for s in missing], timeout_s)
        _wait_for_offsets(admin, missing, timeout_s)
    return outcome


def _verify_existing(
    admin: AdminClient, kafka: KafkaSettings, specs: list[TopicSpec], timeout_s: float
) -> tuple[dict[str, str], list[TopicSpec]]:
    """({name: "ok"} for the topics that exist as the catalog says, the missing specs);
    raises TopicMismatchError naming every existing topic with another partition count."""
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
    return outcome, missing


def _create(admin: AdminClient, missing: list[TopicSpec], timeout_s: float) -> dict[str, str]:
    """Create ``missing``; {name: "created"}, or "ok" for one another process created first."""
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
    outcome: dict[str, str] = {}
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
            outcome[name] = "created"
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            # Another process created it between our list and create: verify again.
            if isinstance(err, BrokerError) and err.name() == "TOPIC_ALREADY_EXISTS":
                outcome[name] = "ok"
                continue
            raise KafkaError(f"cannot create topic {name}: {exc}") from exc
    return outcome


def _align_enforced(admin: AdminClient, specs: list[TopicSpec], timeout_s: float) -> list[str]:
    """Set each spec's enforced config entries on its existing topic where they differ;
    the names of the topics altered."""
    if not specs:
        return []
    altered: list[str] = []
    try:
        described = admin.describe_configs(
            [ConfigResource(ResourceType.TOPIC, s.name) for s in specs],
            request_timeout=timeout_s,
        )
        current = {res.name: fut.result(timeout=timeout_s) for res, fut in described.items()}
        changes = [c for spec in specs if (c := _enforced_change(spec, current)) is not None]
        if changes:
            done = admin.incremental_alter_configs(changes, request_timeout=timeout_s)
            for res, fut in done.items():
                fut.result(timeout=timeout_s)
                altered.append(res.name)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        # Unreachable or busy brokers pass; a denied DescribeConfigs/AlterConfigs does not.
        retriable = bool(err.retriable()) if isinstance(err, BrokerError) else True
        raise KafkaError(
            f"cannot set the topics' required configuration ({', '.join(s.name for s in specs)}"
            f"): {exc}; the principal running setup needs DescribeConfigs and AlterConfigs "
            "on them",
            retriable=retriable,
        ) from exc
    if altered:
        log.warning(
            "topic configuration aligned with the catalog", extra={"topics": sorted(altered)}
        )
    return altered


def _enforced_change(
    spec: TopicSpec, current: dict[str, dict[str, ConfigEntry]]
) -> ConfigResource | None:
    """The incremental change that sets ``spec``'s enforced entries its topic lacks or has
    with another value (``current``: topic -> its described entries); None when none do."""
    entries = current.get(spec.name, {})
    wrong = [
        name
        for name in sorted(spec.enforced)
        if name not in entries or entries[name].value != spec.config[name]
    ]
    if not wrong:
        return None
    return ConfigResource(
        ResourceType.TOPIC,
        spec.name,
        incremental_configs=[
            ConfigEntry(name, spec.config[name], incremental_operation=AlterConfigOpType.SET)
            for name in wrong
        ],
    )


def _wait_for_offsets(admin: AdminClient, specs: list[TopicSpec], timeout_s: float) -> None:
    """Metadata can name a leader a moment before that broker serves the partition: an
    offset lookup then still answers NOT_LEADER_FOR_PARTITION. Wait until every created
    partition answers one. Runs after ``_wait_for_leaders``, which it does not replace:
    those ``list_topics`` calls are also what refreshes the admin client's metadata, without
    which ``list_offsets`` keeps answering "No leaders found" until its timeout."""
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
            f"{timeout_s:.0f}s: {last}",
            retriable=True,
        )


def _wait_for_leaders(admin: AdminClient, names: list[str], timeout_s: float) -> None:
    """Created topics answer "not leader" until each partition has one: wait for that, so
    a caller's first produce or offset lookup does not fail."""
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

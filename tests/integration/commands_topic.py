"""Reading back what commands did (the commands topic, their results, the stored row), for
tests that copy records."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from base.settings import Settings
from streams.client import ResultWatcher
from streams.partitioner import partition_for
from streams.store import Store
from topics.catalog import catalog
from topics.models import CommandResult


def commands_of(settings: Settings, sid: str) -> list[Message]:
    """The records of the commands topic keyed ``sid``, oldest first."""
    spec = catalog(settings.topics).commands
    key = sid.encode()
    consumer = Consumer(
        {
            **settings.kafka.librdkafka(),
            "group.id": f"read-{os.urandom(4).hex()}",
            "enable.auto.commit": False,
        }
    )
    tp = TopicPartition(spec.name, partition_for(key, spec.partitions))
    low, high = consumer.get_watermark_offsets(tp, timeout=10)
    consumer.assign([TopicPartition(spec.name, tp.partition, low)])
    found: list[Message] = []
    position, deadline = low, time.monotonic() + 30
    while position < high and time.monotonic() < deadline:
        m = consumer.poll(0.5)
        if m is None or m.error() is not None:
            continue
        position = m.offset() + 1
        if m.key() == key:
            found.append(m)
    consumer.close()
    return found


def result_of(results: ResultWatcher, sid: str, offset: int) -> CommandResult:
    """The result of the command at ``offset`` of schedule ``sid``."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in results.poll():
            if r.schedule_id == sid and r.offset == offset:
                return r
    raise AssertionError(f"no result for {sid} at offset {offset}")


def stored_row(settings: Settings, tenant: str, sid: str) -> dict[str, Any]:
    """Schedule ``sid``'s row as the store reads it; it must exist."""

    async def read() -> dict[str, Any]:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            row = await store.get_schedule(tenant, sid)
        finally:
            await store.close()
        assert row is not None
        return dict(row)

    return asyncio.run(read())

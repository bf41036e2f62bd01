"""How long ``CommandBridge.send_admitted`` waits for Kafka's acknowledgement: its answer
when it comes, None when it does not come in time, and a cancellation of the request
passed on, not taken for a timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api.bridge import CommandBridge
from base.settings import Settings
from topics.catalog import catalog


class Producer:
    """Hands out the acknowledgement futures it is asked for, resolved only when told."""

    def __init__(self) -> None:
        self.acks: list[asyncio.Future[Any]] = []

    def send_appended(self, topic: str, **kw: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.acks.append(fut)
        return fut


def bridge() -> tuple[CommandBridge, Producer]:
    b = CommandBridge.__new__(CommandBridge)
    b.catalog = catalog(Settings().topics)
    b.partitions = b.catalog.commands.partitions
    b._pending = {}
    producer = Producer()
    b.producer = producer  # type: ignore[assignment]
    return b, producer


async def test_the_acknowledgement_is_the_answer() -> None:
    b, producer = bridge()
    sent = asyncio.ensure_future(b.send_admitted(b"k", b"v", [], timeout_s=5))
    await asyncio.sleep(0)
    producer.acks[0].set_result((3, 7, 1_000))
    assert await sent == (3, 7, 1_000)


async def test_no_acknowledgement_in_time_is_none_and_stops_the_wait() -> None:
    b, producer = bridge()
    assert await b.send_admitted(b"k", b"v", [], timeout_s=0.01) is None
    assert producer.acks[0].cancelled()


async def test_a_refusal_by_kafka_is_raised() -> None:
    b, producer = bridge()
    sent = asyncio.ensure_future(b.send_admitted(b"k", b"v", [], timeout_s=5))
    await asyncio.sleep(0)
    producer.acks[0].set_exception(ValueError("refused"))
    with pytest.raises(ValueError, match="refused"):
        await sent


async def test_a_cancelled_request_is_cancelled_not_timed_out() -> None:
    b, _ = bridge()
    sent = asyncio.ensure_future(b.send_admitted(b"k", b"v", [], timeout_s=5))
    await asyncio.sleep(0)
    sent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sent

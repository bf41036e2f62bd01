"""The emitter's delivery-report thread: it polls librdkafka only while a report can come,
settles each send's future from the report, and ends promptly on close."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from base.settings import KafkaSettings
from streams import emitter as emitter_module
from streams.emitter import Emitter


class _Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class FakeProducer:
    """librdkafka's producer as the emitter uses it: ``produce`` queues a delivery callback,
    ``poll`` serves the queued ones, ``len`` counts what is queued or not yet served."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.lock = threading.Condition()
        self.pending: list[Callable[[Any, Any], None]] = []
        self.polls_while_idle = 0
        self.poll_timeouts: list[float] = []

    def produce(self, topic: str, **kwargs: Any) -> None:
        with self.lock:
            self.pending.append(kwargs["on_delivery"])
            self.lock.notify_all()

    def poll(self, timeout: float) -> int:
        """Waits up to ``timeout`` for a report, as librdkafka does."""
        with self.lock:
            self.poll_timeouts.append(timeout)
            if not self.pending:
                self.polls_while_idle += 1
                self.lock.wait_for(lambda: bool(self.pending), timeout)
            served, self.pending = self.pending, []
        for i, report in enumerate(served):
            report(None, _Message(0, i))
        return len(served)

    def flush(self, timeout: float) -> int:
        self.poll(0)
        return 0

    def __len__(self) -> int:
        with self.lock:
            return len(self.pending)


@pytest.fixture
def fake_producer(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeProducer]]:
    made: list[FakeProducer] = []

    def make(config: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(config))
        return made[-1]

    monkeypatch.setattr(emitter_module, "Producer", make)
    yield made


async def test_an_idle_emitter_does_not_poll_and_a_send_wakes_it(
    fake_producer: list[FakeProducer],
) -> None:
    emitter = Emitter(KafkaSettings())
    emitter.start()
    producer = fake_producer[0]
    await asyncio.sleep(0.15)  # the old thread polled every 50 ms whatever was queued
    assert producer.polls_while_idle == 0
    first = emitter.send("fires", key=b"k", value=b"v")
    second = emitter.send("fires", key=b"k", value=b"w")
    assert list(await asyncio.wait_for(asyncio.gather(first, second), 5)) == [(0, 0), (0, 1)]
    # Served, then idle again: the reports came from polls that had something to serve.
    await asyncio.sleep(0.15)
    assert producer.polls_while_idle == 0
    assert producer.poll_timeouts and min(producer.poll_timeouts) >= 0.2
    await emitter.close()
    assert not emitter._thread.is_alive()


async def test_close_ends_an_idle_thread_without_waiting_out_a_poll(
    fake_producer: list[FakeProducer],
) -> None:
    emitter = Emitter(KafkaSettings(), poll_s=30.0, idle_wait_s=30.0)
    emitter.start()
    await asyncio.wait_for(emitter.close(), 5)
    assert not emitter._thread.is_alive()


class _FlushOnlyProducer(FakeProducer):
    """Reports are served only by flush (on its caller's thread), and librdkafka counts
    nothing outstanding: the poll thread idles throughout."""

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        FakeProducer.poll(self, 0)
        return 0

    def __len__(self) -> int:
        return 0


async def test_reports_served_by_a_flush_settle_while_the_thread_idles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(emitter_module, "Producer", _FlushOnlyProducer)
    emitter = Emitter(KafkaSettings(), idle_wait_s=30.0)
    emitter.start()
    sent = emitter.send("fires", key=b"k", value=b"v")
    assert await emitter.flush(1.0) == 0
    assert await asyncio.wait_for(sent, 2) == (0, 0)
    await emitter.close()

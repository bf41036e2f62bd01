"""The fires producer's report thread gathers acknowledgements that come one after another
into one hand-over to the event loop (``gather_s``); without it, each goes alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from base.settings import KafkaSettings
from streams import emitter as emitter_module
from streams.emitter import Emitter
from tests.unit.test_emitter_poll import FakeProducer, _Message


class OneReportPerPoll(FakeProducer):
    """librdkafka acknowledging records sent one at a time: a waiting poll returns with the
    first report to come; a poll without a wait serves every report come by then."""

    served = 0

    def poll(self, timeout: float) -> int:
        with self.lock:
            if timeout > 0:
                self.lock.wait_for(lambda: bool(self.pending), timeout)
                reports, self.pending = self.pending[:1], self.pending[1:]
            else:
                reports, self.pending = self.pending, []
            first, self.served = self.served, self.served + len(reports)
        for i, report in enumerate(reports):
            report(None, _Message(0, first + i))
        return len(reports)

    def flush(self, timeout: float) -> int:
        self.poll(0)
        return 0


@pytest.fixture
def hand_overs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    sizes: list[int] = []
    settle = emitter_module._settle_all

    def counted(batch: list[Any]) -> None:
        sizes.append(len(batch))
        settle(batch)

    monkeypatch.setattr(emitter_module, "Producer", OneReportPerPoll)
    monkeypatch.setattr(emitter_module, "_settle_all", counted)
    yield sizes


async def _three_acks(emitter: Emitter) -> list[object]:
    emitter.start()
    # Queued before the thread serves any: the three acknowledgements come in three polls.
    sends = [emitter.send("fires", key=b"k", value=bytes([i])) for i in range(3)]
    try:
        return list(await asyncio.wait_for(asyncio.gather(*sends), 5))
    finally:
        await emitter.close()


async def test_acknowledgements_polled_one_by_one_are_handed_over_together(
    hand_overs: list[int],
) -> None:
    # A long gather: the reports served while it lasts go over with the first.
    acks = await _three_acks(Emitter(KafkaSettings(), gather_s=0.5))
    assert acks == [(0, 0), (0, 1), (0, 2)]
    assert hand_overs == [3]


async def test_without_gathering_each_acknowledgement_is_handed_over_alone(
    hand_overs: list[int],
) -> None:
    acks = await _three_acks(Emitter(KafkaSettings()))
    assert acks == [(0, 0), (0, 1), (0, 2)]
    assert hand_overs == [1, 1, 1]

"""The worker's and the API's producers (streams.emitter) give up a request after
TOCSIN_KAFKA_PRODUCER_SOCKET_TIMEOUT_MS, not the consumers' TOCSIN_KAFKA_SOCKET_TIMEOUT_MS: a
produce in flight to a hung leader holds its partition until then (docs/operations.md)."""

from __future__ import annotations

from typing import Any

import pytest

from base.settings import Settings
from streams import emitter as emitter_module
from streams.emitter import Emitter


class _RecordingProducer:
    """Keeps the configuration librdkafka would have been given."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config


def _producer_config(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> dict[str, Any]:
    made: list[_RecordingProducer] = []

    def make(config: dict[str, Any]) -> _RecordingProducer:
        made.append(_RecordingProducer(config))
        return made[-1]

    monkeypatch.setattr(emitter_module, "Producer", make)
    Emitter(Settings.from_env(env).kafka)
    (producer,) = made
    return producer.config


def test_the_emitters_producer_gives_up_a_request_after_its_own_shorter_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conf = _producer_config(monkeypatch, {})
    assert conf["socket.timeout.ms"] == 4000
    assert conf["enable.idempotence"] is True
    # Every other client keeps the longer one.
    assert Settings.from_env({}).kafka.librdkafka()["socket.timeout.ms"] == 10000


def test_the_producer_timeout_follows_its_own_variable_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    conf = _producer_config(
        monkeypatch,
        {
            "TOCSIN_KAFKA_PRODUCER_SOCKET_TIMEOUT_MS": "2500",
            "TOCSIN_KAFKA_SOCKET_TIMEOUT_MS": "20000",
        },
    )
    assert conf["socket.timeout.ms"] == 2500

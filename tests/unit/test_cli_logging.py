"""What a person running ``tocsin`` sees: progress, not log lines; librdkafka through our logger."""

from __future__ import annotations

import logging
import socket

import pytest
from confluent_kafka import Producer

from base.settings import Settings
from tocsin.cli import log_level_for


def test_commands_a_person_runs_log_from_warning_servers_from_the_setting() -> None:
    assert log_level_for("setup", "INFO", {}) == "WARNING"
    assert log_level_for("demo", "INFO", {}) == "WARNING"
    assert log_level_for("worker", "INFO", {}) == "INFO"
    assert log_level_for("proxy", "DEBUG", {"TOCSIN_LOG_LEVEL": "DEBUG"}) == "DEBUG"
    assert log_level_for("setup", "DEBUG", {"TOCSIN_LOG_LEVEL": "DEBUG"}) == "DEBUG"


def test_librdkafka_logs_go_through_our_logger_not_stderr(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: librdkafka logs its failure
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = Settings.from_env({"TOCSIN_KAFKA_PORT": str(port)}).kafka.librdkafka()
    producer = Producer({**conf, "reconnect.backoff.ms": 10})
    with caplog.at_level(logging.DEBUG, logger="tocsin.librdkafka"):
        for _ in range(50):
            producer.poll(0.1)
            if caplog.records:
                break
    assert any(r.name == "tocsin.librdkafka" for r in caplog.records)
    assert "|FAIL|" not in capfd.readouterr().err

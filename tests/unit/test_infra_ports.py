"""tocsin infra up names every busy port, and the variable that moves it, before any download."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from base.errors import InfraError
from base.settings import Settings
from tocsin import infra


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def busy() -> Iterator[list[int]]:
    """Two listening sockets standing in for processes this stack did not start."""
    socks = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        socks.append(sock)
    yield [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()


def test_up_names_every_taken_port_before_resolving_jars(
    tmp_path: Path, busy: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    controller, storage = busy
    settings = Settings.from_env(
        {
            "TOCSIN_STATE_DIR": str(tmp_path),
            "TOCSIN_KAFKA_PORT": str(_free_port()),
            "TOCSIN_KAFKA_CONTROLLER_PORT": str(controller),
            "TOCSIN_CASSANDRA_PORT": str(_free_port()),
            "TOCSIN_CASSANDRA_STORAGE_PORT": str(storage),
        }
    )
    resolved: list[str] = []
    monkeypatch.setattr(infra, "resolve_jars", lambda name, *a, **k: resolved.append(name))
    with pytest.raises(InfraError) as err:
        infra.Stack(settings).up()
    text = str(err.value)
    assert f"port {controller} (TOCSIN_KAFKA_CONTROLLER_PORT)" in text
    assert f"port {storage} (TOCSIN_CASSANDRA_STORAGE_PORT)" in text
    assert "TOCSIN_PORT_OFFSET" in text
    assert resolved == []

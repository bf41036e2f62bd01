"""tocsin infra signals only the servers it started (no stack needed: plain processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from base.settings import StackSettings
from tocsin import infra


@pytest.fixture
def server(tmp_path: Path) -> infra.KafkaServer:
    srv = infra.KafkaServer(StackSettings(state_dir=tmp_path / "state"))
    srv.home.mkdir(parents=True)
    return srv


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _sleeper(procs: list[subprocess.Popen[bytes]], *args: str) -> subprocess.Popen[bytes]:
    # A process in its own session, as the servers are; extra args end up on its command line.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", *args], start_new_session=True
    )
    procs.append(proc)
    # Wait until the child has exec'd (its command line is python's, not ours).
    deadline = time.monotonic() + 10
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    while b"time.sleep" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_stale_pid_file_of_an_unrelated_process_is_never_signalled(
    server: infra.KafkaServer, spawn: list[subprocess.Popen[bytes]]
) -> None:
    stranger = _sleeper(spawn)  # the pid was reused by a process this stack did not start
    server.pid_file.write_text(f"{stranger.pid}\n")
    assert server.pid() is None and not server.running()
    assert server.stop() is False
    time.sleep(0.2)
    assert stranger.poll() is None, "an unrelated process was signalled"
    assert not server.pid_file.exists()


def test_same_pid_and_command_line_but_another_start_time_is_not_ours(
    server: infra.KafkaServer, spawn: list[subprocess.Popen[bytes]]
) -> None:
    lookalike = _sleeper(spawn, str(server.home))
    ticks = infra._proc_start_ticks(lookalike.pid)
    assert ticks is not None
    server.pid_file.write_text(f"{lookalike.pid} {ticks + 1}\n")
    assert server.pid() is None
    assert server.stop() is False
    assert lookalike.poll() is None


def test_the_server_it_started_is_stopped(
    server: infra.KafkaServer, spawn: list[subprocess.Popen[bytes]]
) -> None:
    ours = _sleeper(spawn, str(server.home))
    server.pid_file.write_text(f"{ours.pid} {infra._proc_start_ticks(ours.pid)}\n")
    assert server.pid() == ours.pid
    assert server.stop(timeout_s=10) is True
    assert ours.wait(10) == -signal.SIGTERM
    assert not server.pid_file.exists()


def test_waits_are_bounded() -> None:
    # Our own pid never goes away: the wait must give up at its deadline, not hang.
    assert infra._wait_gone(os.getpid(), 0.3) is False

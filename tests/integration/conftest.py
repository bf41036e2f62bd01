"""Fixtures that run real scheduler workers (``tocsin worker`` subprocesses) on the stack."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tocsin.settings import REPO_ROOT, Settings

_ports = itertools.count(19500)


class WorkerProcess:
    def __init__(self, settings: Settings, env: dict[str, str], log_path: Path) -> None:
        self.settings = settings
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tocsin.cli", "worker"], env=self.env, cwd=REPO_ROOT,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _env_for(settings: Settings, metrics_port: int, web_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "TOCSIN_TOPIC_PREFIX": settings.topics.prefix,
        "TOCSIN_CASSANDRA_KEYSPACE": settings.cassandra.keyspace,
        "TOCSIN_COMMAND_PARTITIONS": str(settings.topics.command_partitions),
        "TOCSIN_FIRE_PARTITIONS": str(settings.topics.fire_partitions),
        "TOCSIN_METRICS_PORT": str(metrics_port),
        "TOCSIN_WORKER_WEB_PORT": str(web_port),
        "TOCSIN_SESSION_TIMEOUT_S": "10",
        "TOCSIN_LOG_FORMAT": "text",
        "TOCSIN_DEFAULT_MISFIRE_TOLERANCE_S": "3600",
    })
    return env


@pytest.fixture(scope="session")
def tenant(real_stack: Settings) -> str:
    """A registered tenant for this run."""
    from streams.store import Store

    async def register() -> None:
        store = Store(real_stack.cassandra)
        await store.connect()
        try:
            await store.put_tenant("acme", active=True, created_ms=time.time_ns() // 10**6,
                                   config="{}")
            await store.put_tenant("sleepy", active=False, created_ms=time.time_ns() // 10**6,
                                   config="{}")
        finally:
            await store.close()

    asyncio.run(register())
    return "acme"


@pytest.fixture
def worker_factory(real_stack: Settings, tenant: str, tmp_path: Path) -> Iterator[
    type[object]
]:
    """Start workers with ``make()``; all are stopped at the end of the test."""
    started: list[WorkerProcess] = []

    class Factory:
        @staticmethod
        def make(name: str = "w") -> WorkerProcess:
            env = _env_for(real_stack, next(_ports), next(_ports))
            worker = WorkerProcess(real_stack, env, tmp_path / f"{name}-{len(started)}.log")
            started.append(worker)
            return worker.start()

    yield Factory
    for w in started:
        w.stop()

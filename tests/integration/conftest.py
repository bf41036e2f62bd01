"""Fixtures that run real scheduler workers (``tocsin worker`` subprocesses) on the stack.

Worker ownership (which worker fires a partition) is decided by the consumer group of a
topic prefix, and what a worker fires is decided by the keyspace (buckets and fire
checkpoints are keyed by partition number only). So a worker that outlives a test - the
API's session worker - gets a deployment of its own (``isolated_stack``: prefix, consumer
group and keyspace), and so does every test that stops or kills workers and needs to know
that nothing else fires its triggers (``own_stack``). The run's shared deployment
(``real_stack``) only ever has the workers of the test that is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from base.settings import REPO_ROOT, Settings
from topics.signing import new_signing_key

# Worker/API ports for subprocesses; TOCSIN_TEST_PORT_BASE lets two test runs share a machine.
# Moved by TOCSIN_PORT_OFFSET like every other port, so a second checkout's suite on one
# machine does not take the first one's worker ports.
_ports = itertools.count(
    int(os.environ.get("TOCSIN_TEST_PORT_BASE", "19500"))
    + int(os.environ.get("TOCSIN_PORT_OFFSET", "0"))
)


class WorkerProcess:
    def __init__(self, settings: Settings, env: dict[str, str], log_path: Path) -> None:
        self.settings = settings
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tocsin.cli", "worker"],
                env=self.env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
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


def until(check: Callable[[], Any], timeout_s: float = 60, what: str = "") -> Any:
    """``check()``'s first true answer, polled every 0.2 s; AssertionError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def wait_worker_ready(
    settings: Settings,
    tenant: str,
    *,
    worker: WorkerProcess | None = None,
    timeout_s: float = 90.0,
) -> None:
    """A probe create answered means a worker has joined and owns the partitions (the
    failure shows ``worker``'s log tail when given)."""
    from streams.client import CommandClient, ResultWatcher
    from topics.models import CreateCommand, HttpCallback

    client, results = CommandClient(settings), ResultWatcher(settings)
    sid = f"probe-{os.urandom(4).hex()}"
    client.send(
        CreateCommand(
            tenant=tenant,
            schedule_id=sid,
            due_ms=time.time_ns() // 10**6 + 3_600_000,
            callback=HttpCallback(url="https://probe.example/x"),
            misfire_tolerance_s=60,
        )
    )
    client.flush()
    got = results.wait_for([sid], timeout_s=timeout_s)
    results.close()
    tail = f":\n{worker.log_tail()}" if worker is not None else " a probe command"
    assert sid in got, "worker did not answer" + tail


def _env_for(settings: Settings, metrics_port: int, web_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "TOCSIN_TOPIC_PREFIX": settings.topics.prefix,
            "TOCSIN_CASSANDRA_KEYSPACE": settings.cassandra.keyspace,
            "TOCSIN_COMMAND_PARTITIONS": str(settings.topics.command_partitions),
            "TOCSIN_FIRE_PARTITIONS": str(settings.topics.fire_partitions),
            "TOCSIN_METRICS_PORT": str(metrics_port),
            "TOCSIN_WORKER_WEB_PORT": str(web_port),
            "TOCSIN_SESSION_TIMEOUT_S": "10",
            "TOCSIN_LOG_FORMAT": "text",
            "TOCSIN_DEFAULT_MISFIRE_TOLERANCE_S": "3600",
            # The tests' receivers listen on 127.0.0.1, which a deployment refuses by default.
            "TOCSIN_ALLOW_PRIVATE_TARGETS": "true",
        }
    )
    return env


def register_tenants(settings: Settings) -> str:
    """Register the test tenants ("acme" active, "sleepy" inactive) in this keyspace."""
    from streams.store import Store

    async def register() -> None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            await store.put_tenant(
                "acme",
                active=True,
                created_ms=time.time_ns() // 10**6,
                config="{}",
                signing_secret=new_signing_key(),
            )
            await store.put_tenant(
                "sleepy",
                active=False,
                created_ms=time.time_ns() // 10**6,
                config="{}",
                signing_secret=new_signing_key(),
            )
        finally:
            await store.close()

    asyncio.run(register())
    return "acme"


@pytest.fixture(scope="session")
def tenant(real_stack: Settings) -> str:
    """A registered tenant for this run (the same name in every isolated keyspace)."""
    return register_tenants(real_stack)


@contextlib.contextmanager
def isolated_stack(real_stack: Settings, name: str) -> Iterator[Settings]:
    """A deployment of its own inside this run: topic prefix ``<run prefix><name>.`` (so
    its own consumer group, ``<prefix>scheduler``) and keyspace ``<run keyspace>_<name>``,
    migrated, with the test tenants. Both go away at the end.

    A prefix alone is not isolation: a worker of another prefix on the same keyspace reads
    the same bucket partitions and moves the same fire checkpoints, so it fires this
    deployment's triggers onto its own fires topic (and the worker refuses such a keyspace,
    see streams.binding)."""
    from confluent_kafka.admin import AdminClient

    from base.cassandra import make_cluster
    from schema.migrate import migrate
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    settings = replace(
        real_stack,
        topics=replace(real_stack.topics, prefix=f"{real_stack.topics.prefix}{name}."),
        cassandra=replace(real_stack.cassandra, keyspace=f"{real_stack.cassandra.keyspace}_{name}"),
    )
    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    register_tenants(settings)
    try:
        yield settings
    finally:
        admin = AdminClient(settings.kafka.librdkafka())
        names = [
            n for n in admin.list_topics(timeout=10).topics if n.startswith(settings.topics.prefix)
        ]
        for fut in admin.delete_topics(names, operation_timeout=30).values() if names else ():
            with contextlib.suppress(Exception):  # (the session's cleanup catches leftovers)
                fut.result(timeout=30)
        cluster = make_cluster(settings.cassandra)
        try:
            cluster.connect().execute(
                f"DROP KEYSPACE IF EXISTS {settings.cassandra.keyspace}", timeout=60
            )
        finally:
            cluster.shutdown()


_own = itertools.count(1)


@pytest.fixture
def own_stack(real_stack: Settings) -> Iterator[Settings]:
    """A deployment of this test's own, for tests that stop or kill workers: no worker of
    any other test can own its partitions or fire its triggers."""
    with isolated_stack(real_stack, f"own{next(_own)}") as settings:
        yield settings


@pytest.fixture
def worker_factory(real_stack: Settings, tenant: str, tmp_path: Path) -> Iterator[type[object]]:
    """Start workers with ``make()`` (on ``real_stack`` or the ``settings`` given, e.g.
    ``own_stack``); all are stopped at the end of the test."""
    started: list[WorkerProcess] = []

    class Factory:
        @staticmethod
        def make(name: str = "w", settings: Settings | None = None) -> WorkerProcess:
            s = settings or real_stack
            env = _env_for(s, next(_ports), next(_ports))
            worker = WorkerProcess(s, env, tmp_path / f"{name}-{len(started)}.log")
            started.append(worker)
            return worker.start()

    yield Factory
    for w in started:
        w.stop()


# ---- the REST API on the real stack: one worker + one `tocsin api` per session,
# on a deployment of their own ("api"), so this long-lived worker never joins the consumer
# group or reads the keyspace of the tests that start, stop and kill workers.


class ApiServer:
    """A running ``tocsin api`` subprocess plus a worker; ``call`` makes HTTP requests."""

    def __init__(
        self, settings: Settings, base: str, admin_key: str, worker: WorkerProcess | None = None
    ) -> None:
        self.settings = settings
        self.base = base
        self.admin_key = admin_key
        self.worker = worker  # its one worker (a test may pause it; see test_api_security)

    def call(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        body: object = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[int, object]:
        import http.client
        import json
        from urllib.parse import urlsplit

        parts = urlsplit(self.base)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        hdrs = dict(headers or {})
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            hdrs.setdefault("Content-Type", "application/json")
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(text) if text else None
        except ValueError:
            return resp.status, text.decode(errors="replace")


@pytest.fixture(scope="session")
def api_stack(real_stack: Settings) -> Iterator[Settings]:
    with isolated_stack(real_stack, "api") as settings:
        yield settings


_Server = TypeVar("_Server", bound=ApiServer)


@contextlib.contextmanager
def running_api(
    settings: Settings,
    tenant: str,
    env: dict[str, str],
    logs: Path,
    make: Callable[[Settings, str, str, WorkerProcess], _Server] = ApiServer,  # type: ignore[assignment]
) -> Iterator[_Server]:
    """A worker and a ``tocsin api`` on ``settings`` with ``env`` (logs in ``logs``), both
    ready; ``make`` builds the server handed out. At the end the API is stopped, then the
    server's worker (a test may have replaced it with a restarted one)."""
    import socket
    import urllib.request

    worker = WorkerProcess(settings, env, logs / "worker.log").start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    admin = "admin-" + os.urandom(8).hex()
    api_env = dict(
        env,
        TOCSIN_API_PORT=str(port),
        TOCSIN_ADMIN_KEY=admin,
        TOCSIN_METRICS_PORT=str(next(_ports)),
    )
    api_log = logs / "api.log"
    with api_log.open("ab") as out:
        api = subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", "api"],
            env=api_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    server: _Server | None = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if api.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("api did not start:\n" + api_log.read_text()[-3000:])
            time.sleep(0.2)
        wait_worker_ready(settings, tenant, worker=worker)
        server = make(settings, base, admin, worker)
        yield server
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGTERM)
            try:
                api.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(api.pid, signal.SIGKILL)
        (server.worker if server is not None and server.worker is not None else worker).stop()


@pytest.fixture(scope="session")
def api_server(
    api_stack: Settings, tenant: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    logs = tmp_path_factory.mktemp("api")
    env = _env_for(api_stack, next(_ports), next(_ports))
    env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"
    with running_api(api_stack, tenant, env, logs) as server:
        yield server

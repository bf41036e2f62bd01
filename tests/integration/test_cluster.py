"""Smoke test on the local three-node cluster (tocsin/cluster.py): with one Kafka broker
and one Cassandra node dead, a schedule created before and one created during the fault
fire and are delivered. Minutes long, so it runs only with TOCSIN_CLUSTER_TESTS=1; it
starts the cluster if it is not up (and then stops it again) and never touches the
single-node stack."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from base.settings import Settings
from proxy.app import ProxyApp
from streams.client import CommandClient, ResultWatcher
from tests.integration.conftest import (
    WorkerProcess,
    _env_for,
    _ports,
    register_tenants,
    wait_worker_ready,
)
from tests.integration.test_proxy_delivery import Receiver, fast_settings
from tocsin.cluster import CassandraNode, Cluster, KafkaNode
from tocsin.infra import find_java
from topics.models import CreateCommand, HttpCallback

pytestmark = pytest.mark.skipif(
    os.environ.get("TOCSIN_CLUSTER_TESTS") != "1",
    reason="the three-node cluster test runs only with TOCSIN_CLUSTER_TESTS=1",
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """The cluster, started here unless it is up; stopped again only if started here."""
    running = Cluster(Settings.from_env().stack)
    was_up = all(s.ready for s in running.status())
    if not was_up:
        running.up()
    try:
        yield running
    finally:
        if not was_up:
            running.down()


@contextlib.contextmanager
def deployment(cluster: Cluster, state_dir: Path) -> Iterator[tuple[Settings, dict[str, str]]]:
    """A topic prefix and keyspace of this test's own on the cluster (replicated three
    times, min ISR 2), with the test tenants; removed at the end."""
    from confluent_kafka.admin import AdminClient

    from base.cassandra import make_cluster
    from schema.migrate import migrate
    from tocsin.topic_admin import ensure_topics
    from topics.catalog import catalog

    run = uuid.uuid4().hex[:8]
    env = {
        **cluster.plan.client_env(),
        "TOCSIN_TOPIC_PREFIX": f"ctest.{run}.",
        "TOCSIN_CASSANDRA_KEYSPACE": f"ctest_{run}",
        "TOCSIN_COMMAND_PARTITIONS": "4",
        "TOCSIN_FIRE_PARTITIONS": "4",
        "TOCSIN_STATE_DIR": str(state_dir),
    }
    settings = Settings.from_env(env)
    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)
    register_tenants(settings)
    try:
        yield settings, env
    finally:
        admin = AdminClient(settings.kafka.librdkafka())
        names = [n for n in admin.list_topics(timeout=30).topics if n.startswith(f"ctest.{run}.")]
        for fut in admin.delete_topics(names, operation_timeout=30).values() if names else ():
            with contextlib.suppress(Exception):
                fut.result(timeout=30)
        session_cluster = make_cluster(settings.cassandra)
        try:
            session_cluster.connect().execute(
                f"DROP KEYSPACE IF EXISTS {settings.cassandra.keyspace}", timeout=60
            )
        finally:
            session_cluster.shutdown()


def fires_leader(cluster: Cluster, settings: Settings) -> KafkaNode:
    """The broker leading partition 0 of the fires topic."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.librdkafka())
    topic = admin.list_topics(timeout=30).topics[f"{settings.topics.prefix}fires"]
    leader = topic.partitions[0].leader
    return next(k for k in cluster.kafka if k.node_id == leader)


def kill(node: KafkaNode | CassandraNode) -> None:
    pid = node.pid()
    assert pid is not None, f"{node} is not running"
    os.killpg(pid, signal.SIGKILL)


def create(client: CommandClient, tenant: str, url: str, due_in_s: float) -> str:
    sid = f"cluster-{uuid.uuid4().hex[:8]}"
    client.send(
        CreateCommand(
            tenant=tenant,
            schedule_id=sid,
            due_ms=time.time_ns() // 1_000_000 + int(due_in_s * 1000),
            callback=HttpCallback(url=url),
            misfire_tolerance_s=3600,
        )
    )
    client.flush()
    return sid


def wait_delivered(receiver: Receiver, sids: list[str], timeout_s: float) -> set[str]:
    deadline = time.monotonic() + timeout_s
    got: set[str] = set()
    while time.monotonic() < deadline:
        got = {h.headers.get("Tocsin-Schedule-Id", "") for h in receiver.delivered()}
        if set(sids) <= got:
            break
        time.sleep(0.5)
    return got & set(sids)


def test_schedules_fire_and_deliver_with_a_broker_and_a_cassandra_node_dead(
    cluster: Cluster, tmp_path: Path
) -> None:
    with deployment(cluster, tmp_path / "state") as (settings, cluster_env):
        env = _env_for(settings, next(_ports), next(_ports))
        env.update(cluster_env)
        worker = WorkerProcess(settings, env, tmp_path / "worker.log").start()
        receiver = Receiver().start()
        proxy = ProxyApp(
            settings,
            fast_settings(mode="fires", source_topic="", group_id=f"ctest-{uuid.uuid4().hex[:6]}"),
        )
        proxy.start()
        client, results = CommandClient(settings), ResultWatcher(settings)
        broker = fires_leader(cluster, settings)
        cassandra = cluster.cassandra[-1]
        try:
            wait_worker_ready(settings, "acme", worker=worker, timeout_s=180)
            url = f"http://127.0.0.1:{receiver.port}/cluster"
            before = create(client, "acme", url, due_in_s=30)
            assert results.wait_for([before], timeout_s=60)[before].code == "ok"

            kill(broker)
            kill(cassandra)
            during = create(client, "acme", url, due_in_s=5)
            answer = results.wait_for([during], timeout_s=120)
            assert during in answer, "no answer with a broker and a node down\n" + (
                worker.log_tail()
            )
            assert answer[during].code == "ok"

            got = wait_delivered(receiver, [before, during], timeout_s=150)
            assert got == {before, during}, worker.log_tail()

            java = find_java(cluster.stack)
            broker.start(java)
            cassandra.start(java)
            cluster.wait_ready(timeout_s=120)
        finally:
            java = find_java(cluster.stack)
            for node in (broker, cassandra):
                if not node.running():
                    node.start(java)
            results.close()
            proxy.stop(timeout_s=10)
            worker.stop()

"""The local three-node cluster's pure parts: addresses, ports, rendered configs, the
settings that make its topics and keyspace replicated. No server is started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from base.errors import ConfigError, InfraError
from base.settings import Settings, StackSettings, TopicSettings
from tocsin.cluster import (
    CassandraNode,
    ClusterPlan,
    KafkaNode,
    render_cassandra_config,
    render_kafka_config,
    render_rackdc,
)
from tocsin.infra import KafkaServer
from topics.catalog import catalog


def _plan(tmp_path: Path, **env: str) -> ClusterPlan:
    stack = Settings.from_env({"TOCSIN_STATE_DIR": str(tmp_path), **env}).stack
    return ClusterPlan.from_stack(stack)


def test_the_plan_keeps_clear_of_the_single_node_stack(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    single = StackSettings()
    assert plan.state_dir == tmp_path / "cluster"
    assert [plan.host(i) for i in plan.node_ids] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    ours = {
        plan.kafka_port,
        plan.kafka_controller_port,
        plan.cassandra_port,
        plan.cassandra_storage_port,
    }
    assert ours == {29092, 29093, 29042, 27000}
    theirs = {
        single.kafka_port,
        single.kafka_controller_port,
        single.cassandra_port,
        single.cassandra_storage_port,
    }
    assert not ours & theirs
    # Below Linux's ephemeral range, so no client socket can be holding one.
    assert max(ours) < 32768


def test_the_port_offset_moves_the_cluster_too(tmp_path: Path) -> None:
    plan = _plan(tmp_path, TOCSIN_PORT_OFFSET="1000")
    assert (plan.kafka_port, plan.cassandra_port) == (30092, 30042)


def test_every_node_is_a_voter(tmp_path: Path) -> None:
    assert _plan(tmp_path).quorum_voters() == (
        "1@127.0.0.1:29093,2@127.0.0.2:29093,3@127.0.0.3:29093"
    )


def test_a_cluster_has_one_to_nine_nodes(tmp_path: Path) -> None:
    with pytest.raises(InfraError):
        ClusterPlan.from_stack(StackSettings(state_dir=tmp_path), nodes=10)


def _properties(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")
    return {k: v for k, v in pairs}


def test_kafka_node_config(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    conf = _properties(render_kafka_config(plan, 2, tmp_path / "data"))
    assert conf["node.id"] == "2"
    assert conf["process.roles"] == "broker,controller"
    assert conf["controller.quorum.voters"] == plan.quorum_voters()
    assert conf["listeners"] == "PLAINTEXT://127.0.0.2:29092,CONTROLLER://127.0.0.2:29093"
    assert conf["advertised.listeners"] == "PLAINTEXT://127.0.0.2:29092"
    assert conf["log.dirs"] == str(tmp_path / "data")
    assert conf["min.insync.replicas"] == "2"
    assert conf["default.replication.factor"] == "3"
    # The internal topics keep Kafka's replicated defaults (the single node lowers them).
    assert not any(k.startswith(("offsets.topic.replication", "transaction.state")) for k in conf)


def test_cassandra_node_config(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    text = render_cassandra_config(plan, 3, tmp_path / "data")
    lines = [line.strip() for line in text.splitlines() if not line.startswith("#")]
    conf = dict(line.split(": ", 1) for line in lines if ": " in line and line[0] != "-")
    assert conf["listen_address"] == conf["rpc_address"] == "127.0.0.3"
    assert conf["native_transport_port"] == "29042"
    assert conf["storage_port"] == "27000"
    assert '- seeds: "127.0.0.1:27000,127.0.0.2:27000,127.0.0.3:27000"' in lines
    assert conf["endpoint_snitch"] == "GossipingPropertyFileSnitch"
    assert conf["cluster_name"] != "tocsin-local"  # never gossips with the single node
    assert f"- {tmp_path / 'data'}/data" in lines
    assert "$" not in text
    assert render_rackdc(3) == "dc=dc1\nrack=rack3\n"


def test_nodes_live_in_their_own_folders_and_share_the_jars(tmp_path: Path) -> None:
    stack = StackSettings(state_dir=tmp_path)
    plan = ClusterPlan.from_stack(stack)
    from tocsin.cluster import Cluster

    cluster = Cluster(stack)
    assert [n.name for n in cluster.kafka] == ["kafka-1", "kafka-2", "kafka-3"]
    assert [n.home for n in cluster.cassandra] == [
        plan.state_dir / f"cassandra-{i}" for i in (1, 2, 3)
    ]
    node = cluster.cassandra[0]
    assert isinstance(node, CassandraNode)
    assert node.jar_set == "cassandra" and cluster.kafka[0].jar_set == "kafka"
    assert isinstance(cluster.kafka[0], KafkaNode)
    assert cluster.stack.jars_dir == tmp_path / "jars"


def test_client_env_points_tocsin_at_a_replicated_cluster(tmp_path: Path) -> None:
    env = _plan(tmp_path).client_env()
    settings = Settings.from_env(env)
    assert settings.kafka.bootstrap_servers == "127.0.0.1:29092,127.0.0.2:29092,127.0.0.3:29092"
    assert settings.cassandra.contact_points == ("127.0.0.1", "127.0.0.2", "127.0.0.3")
    assert settings.cassandra.port == 29042
    assert settings.cassandra.local_dc == "dc1"
    assert settings.cassandra.replication_cql() == (
        "{'class': 'NetworkTopologyStrategy', 'dc1': 3}"
    )
    topics = catalog(settings.topics)
    for spec in topics.all():
        assert spec.replication_factor == 3
        assert spec.config["min.insync.replicas"] == "2"


def test_min_insync_replicas_setting() -> None:
    assert TopicSettings().min_insync() is None  # the single node: the broker's default
    assert TopicSettings(replication_factor=3).min_insync() == 2
    assert TopicSettings(replication_factor=5, min_insync_replicas=3).min_insync() == 3
    assert "min.insync.replicas" not in catalog(TopicSettings()).fires.config
    spec = catalog(TopicSettings(replication_factor=5, min_insync_replicas=3)).commands
    assert spec.config["min.insync.replicas"] == "3"
    with pytest.raises(ConfigError):
        TopicSettings(replication_factor=1, min_insync_replicas=2).min_insync()
    env = {"TOCSIN_TOPIC_REPLICATION_FACTOR": "3", "TOCSIN_TOPIC_MIN_INSYNC_REPLICAS": "3"}
    assert Settings.from_env(env).topics.min_insync() == 3


class _Starting(KafkaServer):
    """A server whose pid-file check says it is gone and which answers on the second ask."""

    def __init__(self, stack: StackSettings) -> None:
        super().__init__(stack)
        self.asked = 0

    def running(self) -> bool:
        return False

    def ready(self) -> bool:
        self.asked += 1
        return self.asked >= 2


def test_a_server_started_here_is_judged_by_its_own_exit_status(tmp_path: Path) -> None:
    server = _Starting(StackSettings(state_dir=tmp_path, start_timeout_s=20))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert server._wait_ready(time.monotonic(), proc) >= 0
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(InfraError, match="exited during start-up"):
        server._wait_ready(time.monotonic(), proc)


# -- how clients follow a failover (settings -> client configuration) ------------------------


def test_librdkafka_clients_follow_a_failover_within_seconds() -> None:
    from base.settings import Settings

    conf = Settings.from_env({}).kafka.librdkafka()
    assert conf["reconnect.backoff.max.ms"] == 1000
    assert conf["topic.metadata.refresh.interval.ms"] == 1000
    assert conf["socket.timeout.ms"] == 10000
    tuned = Settings.from_env(
        {
            "TOCSIN_KAFKA_RECONNECT_BACKOFF_MAX_MS": "2000",
            "TOCSIN_KAFKA_METADATA_REFRESH_MS": "30000",
            "TOCSIN_KAFKA_SOCKET_TIMEOUT_MS": "20000",
        }
    ).kafka.librdkafka()
    assert (
        tuned["reconnect.backoff.max.ms"],
        tuned["topic.metadata.refresh.interval.ms"],
        tuned["socket.timeout.ms"],
    ) == (2000, 30000, 20000)


def test_cassandra_cluster_speculates_on_idempotent_statements_and_heartbeats_often() -> None:
    from cassandra.policies import ConstantSpeculativeExecutionPolicy

    from base.cassandra import make_cluster
    from base.settings import Settings

    cluster = make_cluster(
        Settings.from_env(
            {
                "TOCSIN_CASSANDRA_SPECULATIVE_DELAY_MS": "400",
                "TOCSIN_CASSANDRA_SPECULATIVE_EXECUTIONS": "1",
                "TOCSIN_CASSANDRA_HEARTBEAT_INTERVAL_S": "1.5",
                "TOCSIN_CASSANDRA_HEARTBEAT_TIMEOUT_S": "2.5",
            }
        ).cassandra
    )
    policy = cluster.profile_manager.default.speculative_execution_policy
    assert isinstance(policy, ConstantSpeculativeExecutionPolicy)
    assert (policy.delay, policy.max_attempts) == (0.4, 1)
    assert (cluster.idle_heartbeat_interval, cluster.idle_heartbeat_timeout) == (1.5, 2.5)


def test_no_speculative_execution_when_turned_off() -> None:
    from cassandra.policies import NoSpeculativeExecutionPolicy

    from base.cassandra import make_cluster
    from base.settings import Settings

    settings = Settings.from_env({"TOCSIN_CASSANDRA_SPECULATIVE_EXECUTIONS": "0"}).cassandra
    policy = make_cluster(settings).profile_manager.default.speculative_execution_policy
    assert isinstance(policy, NoSpeculativeExecutionPolicy)


def test_brokers_keep_the_stock_session_unless_asked(tmp_path: Path) -> None:
    conf = _properties(render_kafka_config(_plan(tmp_path), 1, tmp_path / "data"))
    assert "broker.session.timeout.ms" not in conf
    assert "broker.heartbeat.interval.ms" not in conf


def test_a_shorter_broker_session_comes_with_a_heartbeat_a_third_of_it(tmp_path: Path) -> None:
    stack = Settings.from_env({"TOCSIN_STATE_DIR": str(tmp_path)}).stack
    plan = ClusterPlan.from_stack(stack, broker_session_timeout_ms=3000)
    conf = _properties(render_kafka_config(plan, 1, tmp_path / "data"))
    assert conf["broker.session.timeout.ms"] == "3000"
    assert conf["broker.heartbeat.interval.ms"] == "1000"
    assert conf["node.id"] == "1"
    with pytest.raises(InfraError, match="under 1000 ms"):
        ClusterPlan.from_stack(stack, broker_session_timeout_ms=500)

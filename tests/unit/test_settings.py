from __future__ import annotations

import pytest

from base.errors import ConfigError
from base.settings import CassandraSettings, Settings


def test_defaults_point_at_the_local_stack() -> None:
    s = Settings.from_env({})
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert s.cassandra.contact_points == ("127.0.0.1",)
    conf = s.kafka.librdkafka()
    assert conf.pop("logger").name == "tocsin.librdkafka"
    assert conf == {
        "bootstrap.servers": "127.0.0.1:9092",
        "security.protocol": "PLAINTEXT",
        "socket.nagle.disable": True,
        "reconnect.backoff.max.ms": 1000,
        "topic.metadata.refresh.interval.ms": 1000,
        "socket.timeout.ms": 10000,
    }


def test_cassandra_connections_disable_nagle() -> None:
    """Without TCP_NODELAY a lone request waited ~40 ms for the server's delayed ACK
    (bench/cassandra_latency.py); every cluster the project builds sets it."""
    import socket

    from base.cassandra import make_cluster

    cluster = make_cluster(CassandraSettings())
    try:
        assert (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1) in cluster.sockopts
    finally:
        cluster.shutdown()


def test_cassandra_protocol_version_comes_from_the_settings() -> None:
    from base.cassandra import make_cluster

    assert Settings.from_env({}).cassandra.protocol_version == 4
    for env, want in (({}, 4), ({"TOCSIN_CASSANDRA_PROTOCOL_VERSION": "5"}, 5)):
        cluster = make_cluster(Settings.from_env(env).cassandra)
        try:
            assert cluster.protocol_version == want
            assert cluster._protocol_version_explicit
        finally:
            cluster.shutdown()
    negotiated = make_cluster(CassandraSettings(protocol_version=0))
    try:
        assert not negotiated._protocol_version_explicit
    finally:
        negotiated.shutdown()


def test_existing_clusters_with_sasl_and_tls() -> None:
    s = Settings.from_env(
        {
            "TOCSIN_KAFKA_BOOTSTRAP_SERVERS": "b1:9093,b2:9093",
            "TOCSIN_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "TOCSIN_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "TOCSIN_KAFKA_SASL_USERNAME": "u",
            "TOCSIN_KAFKA_SASL_PASSWORD": "p",
            "TOCSIN_CASSANDRA_CONTACT_POINTS": "c1, c2",
            "TOCSIN_CASSANDRA_REPLICATION": "NetworkTopologyStrategy:dc1=3,dc2=3",
        }
    )
    conf = s.kafka.librdkafka()
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512" and conf["security.protocol"] == "SASL_SSL"
    assert s.cassandra.contact_points == ("c1", "c2")
    assert s.cassandra.replication_cql() == (
        "{'class': 'NetworkTopologyStrategy', 'dc1': 3, 'dc2': 3}"
    )


@pytest.mark.parametrize(
    "replication", ["NetworkTopologyStrategy:dc1", "Bogus:1", "NetworkTopologyStrategy:"]
)
def test_bad_replication_is_a_config_error(replication: str) -> None:
    with pytest.raises(ConfigError):
        CassandraSettings(replication=replication).replication_cql()


def test_non_integer_setting_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="TOCSIN_COMMAND_PARTITIONS"):
        Settings.from_env({"TOCSIN_COMMAND_PARTITIONS": "eight"})


def test_command_batch_wait_and_api_linger_are_read_from_the_environment() -> None:
    default = Settings.from_env({})
    assert default.scheduler.command_batch_wait_ms == 20
    assert default.api.produce_linger_ms == 2
    s = Settings.from_env(
        {"TOCSIN_COMMAND_BATCH_WAIT_MS": "5", "TOCSIN_API_PRODUCE_LINGER_MS": "0"}
    )
    assert s.scheduler.command_batch_wait_ms == 5
    assert s.api.produce_linger_ms == 0


def test_event_loop_and_inline_handover_are_read_from_the_environment() -> None:
    default = Settings.from_env({})
    assert default.event_loop == "uvloop"
    assert default.scheduler.inline_handover is True
    s = Settings.from_env({"TOCSIN_EVENT_LOOP": "asyncio", "TOCSIN_INLINE_HANDOVER": "false"})
    assert s.event_loop == "asyncio"
    assert s.scheduler.inline_handover is False
    with pytest.raises(ConfigError, match="TOCSIN_EVENT_LOOP must be one of uvloop, asyncio"):
        Settings.from_env({"TOCSIN_EVENT_LOOP": "trio"})


def test_use_event_loop_sets_the_loop_of_new_asyncio_loops() -> None:
    import asyncio

    import uvloop

    from tocsin.cli import use_event_loop

    previous = asyncio.get_event_loop_policy()
    try:
        use_event_loop("uvloop")
        loop = asyncio.new_event_loop()
        assert isinstance(loop, uvloop.Loop)
        loop.close()
        use_event_loop("asyncio")
        loop = asyncio.new_event_loop()
        assert not isinstance(loop, uvloop.Loop)
        loop.close()
    finally:
        asyncio.set_event_loop_policy(previous)


def test_boolean_settings_accept_1_true_yes_in_any_case() -> None:
    from proxy.settings import ProxySettings

    assert Settings.from_env({}).scheduler.require_signed_commands is True
    assert ProxySettings.from_env({}).allow_private_targets is False
    for raw, want in (("1", True), ("TRUE", True), ("Yes", True), ("0", False), ("no", False)):
        s = Settings.from_env(
            {"TOCSIN_REQUIRE_SIGNED_COMMANDS": raw, "TOCSIN_INLINE_HANDOVER": raw}
        )
        assert (s.scheduler.require_signed_commands, s.scheduler.inline_handover) == (want, want)
        proxy = ProxySettings.from_env({"TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS": raw})
        assert proxy.allow_private_targets is want


def test_one_switch_allows_private_targets_for_worker_api_and_proxy() -> None:
    from proxy.settings import ProxySettings

    assert Settings.from_env({}).scheduler.allow_private_targets is False
    both = {"TOCSIN_ALLOW_PRIVATE_TARGETS": "true"}
    assert Settings.from_env(both).scheduler.allow_private_targets is True
    assert ProxySettings.from_env(both).allow_private_targets is True
    # The proxy's own variable wins for the proxy, either way.
    proxy_off = ProxySettings.from_env({**both, "TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS": "false"})
    assert proxy_off.allow_private_targets is False
    proxy_on = ProxySettings.from_env({"TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS": "true"})
    assert proxy_on.allow_private_targets is True
    assert (
        Settings.from_env(
            {"TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS": "true"}
        ).scheduler.allow_private_targets
        is False
    )


def test_one_port_offset_moves_every_listening_port() -> None:
    from proxy.settings import ProxySettings

    env = {"TOCSIN_PORT_OFFSET": "100"}
    s = Settings.from_env(env)
    st = s.stack
    assert (st.kafka_port, st.kafka_controller_port) == (9192, 9193)
    assert (st.cassandra_port, st.cassandra_storage_port) == (9142, 7100)
    assert s.kafka.bootstrap_servers == "127.0.0.1:9192" and s.cassandra.port == 9142
    assert (s.scheduler.metrics_port, s.scheduler.worker_web_port) == (9564, 6166)
    assert s.api.port == 8580
    assert ProxySettings.from_env(env).metrics_port == 9565
    # A variable set explicitly wins over the offset.
    assert Settings.from_env({**env, "TOCSIN_KAFKA_PORT": "5000"}).stack.kafka_port == 5000
    with pytest.raises(ConfigError, match="TOCSIN_PORT_OFFSET"):
        Settings.from_env({"TOCSIN_PORT_OFFSET": "60000"})


def test_proxy_metrics_port_zero_means_no_metrics_server() -> None:
    from proxy.settings import ProxySettings

    assert ProxySettings.from_env({"TOCSIN_PROXY_METRICS_PORT": "0"}).metrics_port == 0
    # Only where 0 means "off": a stack port of 0 is still refused.
    with pytest.raises(ConfigError, match="TOCSIN_KAFKA_PORT"):
        Settings.from_env({"TOCSIN_KAFKA_PORT": "0"})

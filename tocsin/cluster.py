"""A local three-node cluster: three KRaft nodes and three Cassandra 5.0 nodes.

``tocsin infra up --nodes 3`` starts it beside the single-node stack, never touching it:
its own loopback addresses (node i on 127.0.0.i), its own ports (the single-node ports
moved by ``CLUSTER_PORT_SHIFT``) and its own state folder (``<state dir>/cluster``). The
jars are the single-node stack's (tocsin.infra.resolve_jars, the same cache).

Each Kafka node is broker and controller; the three are the controller quorum, so they
start together. Cassandra nodes start one after another, each only once the previous one
answers queries: two nodes joining the ring at once may pick clashing tokens.

``ClusterPlan`` and the ``render_*`` functions are pure (addresses, ports, configs), so
they are tested without servers.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template

from base.errors import InfraError
from base.settings import Settings, StackSettings
from tocsin.infra import (
    INFRA_DIR,
    CassandraServer,
    KafkaServer,
    ServerStatus,
    broker_registered,
    cassandra_node_answers,
    find_java,
    kafka_cluster_id,
    port_open,
    ports_taken_message,
    resolve_jars,
)

# Added to the single-node stack's ports (which TOCSIN_PORT_OFFSET moves as well): Kafka
# 29092, its controllers 29093, Cassandra 29042, its storage 27000, all under 32768 so no
# client's ephemeral port can hold one.
CLUSTER_PORT_SHIFT = 20000
CLUSTER_DATA_CENTER = "dc1"
# Whole cluster about 6 GiB resident: three JVMs of each at these heaps plus their
# off-heap memory (Cassandra's memtables, both servers' metaspace and buffers).
CLUSTER_KAFKA_HEAP_MIB = 384
CLUSTER_CASSANDRA_HEAP_MIB = 768


@dataclass(frozen=True, kw_only=True)
class ClusterPlan:
    """Where each node of the cluster lives: node ``i`` (1-based) on 127.0.0.i."""

    nodes: int = 3
    state_dir: Path
    kafka_port: int
    kafka_controller_port: int
    cassandra_port: int
    cassandra_storage_port: int
    # The brokers' broker.session.timeout.ms (None: Kafka's stock 9 s): how long the
    # controller waits for a silent broker before fencing it and moving its partitions'
    # leadership (docs/operations.md weighs a shorter one).
    broker_session_timeout_ms: int | None = None

    @classmethod
    def from_stack(
        cls,
        stack: StackSettings,
        *,
        nodes: int = 3,
        broker_session_timeout_ms: int | None = None,
    ) -> ClusterPlan:
        if not 1 <= nodes <= 9:
            raise InfraError(f"a local cluster has 1 to 9 nodes, not {nodes}")
        if broker_session_timeout_ms is not None and broker_session_timeout_ms < 1000:
            raise InfraError(
                f"a broker session timeout under 1000 ms fences brokers on any pause, "
                f"not {broker_session_timeout_ms}"
            )
        shift = CLUSTER_PORT_SHIFT
        return cls(
            nodes=nodes,
            broker_session_timeout_ms=broker_session_timeout_ms,
            state_dir=stack.state_dir / "cluster",
            kafka_port=stack.kafka_port + shift,
            kafka_controller_port=stack.kafka_controller_port + shift,
            cassandra_port=stack.cassandra_port + shift,
            cassandra_storage_port=stack.cassandra_storage_port + shift,
        )

    def host(self, node_id: int) -> str:
        return f"127.0.0.{node_id}"

    @property
    def node_ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))

    def quorum_voters(self) -> str:
        """KRaft's ``controller.quorum.voters``: every node is a voter."""
        return ",".join(f"{i}@{self.host(i)}:{self.kafka_controller_port}" for i in self.node_ids)

    def kafka_bootstrap(self) -> str:
        return ",".join(f"{self.host(i)}:{self.kafka_port}" for i in self.node_ids)

    def cassandra_seeds(self) -> str:
        return ",".join(f"{self.host(i)}:{self.cassandra_storage_port}" for i in self.node_ids)

    def replication_factor(self) -> int:
        return min(3, self.nodes)

    def client_env(self) -> dict[str, str]:
        """The TOCSIN_* variables that point Tocsin's processes at this cluster, with the
        replicated topics and keyspace it is for."""
        rf = self.replication_factor()
        env = {
            "TOCSIN_KAFKA_BOOTSTRAP_SERVERS": self.kafka_bootstrap(),
            "TOCSIN_CASSANDRA_CONTACT_POINTS": ",".join(self.host(i) for i in self.node_ids),
            "TOCSIN_CASSANDRA_PORT": str(self.cassandra_port),
            "TOCSIN_CASSANDRA_LOCAL_DC": CLUSTER_DATA_CENTER,
            "TOCSIN_CASSANDRA_REPLICATION": f"NetworkTopologyStrategy:{CLUSTER_DATA_CENTER}={rf}",
            "TOCSIN_TOPIC_REPLICATION_FACTOR": str(rf),
        }
        if rf >= 3:
            env["TOCSIN_TOPIC_MIN_INSYNC_REPLICAS"] = "2"
        return env


def fencing_properties(session_timeout_ms: int | None) -> str:
    """The broker properties for a session timeout other than the stock one: the session
    and a heartbeat a third of it, so that two lost heartbeats do not fence a broker."""
    if session_timeout_ms is None:
        return ""
    return (
        f"broker.session.timeout.ms={session_timeout_ms}\n"
        f"broker.heartbeat.interval.ms={max(100, session_timeout_ms // 3)}\n"
    )


def render_kafka_config(plan: ClusterPlan, node_id: int, data_dir: Path) -> str:
    return _substitute(
        INFRA_DIR / "kafka" / "cluster.properties.in",
        node_id=node_id,
        voters=plan.quorum_voters(),
        host=plan.host(node_id),
        port=plan.kafka_port,
        controller_port=plan.kafka_controller_port,
        data_dir=data_dir,
    ) + fencing_properties(plan.broker_session_timeout_ms)


def render_cassandra_config(plan: ClusterPlan, node_id: int, data_dir: Path) -> str:
    return _substitute(
        INFRA_DIR / "cassandra" / "cluster.yaml.in",
        seeds=plan.cassandra_seeds(),
        host=plan.host(node_id),
        port=plan.cassandra_port,
        storage_port=plan.cassandra_storage_port,
        data_dir=data_dir,
    )


def render_rackdc(node_id: int) -> str:
    """GossipingPropertyFileSnitch's file: one data centre, each node its own rack."""
    return f"dc={CLUSTER_DATA_CENTER}\nrack=rack{node_id}\n"


def _substitute(template: Path, **values: object) -> str:
    return Template(template.read_text()).substitute({k: str(v) for k, v in values.items()})


def _node_stack(plan: ClusterPlan, stack: StackSettings) -> StackSettings:
    """The settings each node's server runs with: the cluster's folder and heaps, and the
    single-node stack's jar cache."""
    return dataclasses.replace(
        stack,
        state_dir=plan.state_dir,
        jars_dir=stack.jars_dir or stack.state_dir / "jars",
        kafka_heap_mib=CLUSTER_KAFKA_HEAP_MIB,
        cassandra_heap_mib=CLUSTER_CASSANDRA_HEAP_MIB,
    )


class KafkaNode(KafkaServer):
    """One KRaft broker+controller of the cluster."""

    def __init__(self, plan: ClusterPlan, node_id: int, stack: StackSettings) -> None:
        self.name = f"kafka-{node_id}"
        super().__init__(stack)
        self.plan = plan
        self.node_id = node_id
        self.host = plan.host(node_id)
        self.port = plan.kafka_port

    @property
    def jar_set(self) -> str:
        return "kafka"

    def ports(self) -> list[tuple[int, str]]:
        return [
            (self.plan.kafka_port, "TOCSIN_KAFKA_PORT"),
            (self.plan.kafka_controller_port, "TOCSIN_KAFKA_CONTROLLER_PORT"),
        ]

    def taken_ports(self) -> list[tuple[int, str]]:
        return [(p, v) for p, v in self.ports() if port_open(p, self.host)]

    def _prepare(self, jars: Path) -> None:
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(render_kafka_config(self.plan, self.node_id, self.data_dir))
        (self.home / "config" / "log4j2.properties").write_bytes(
            (INFRA_DIR / "kafka" / "log4j2.properties").read_bytes()
        )
        if (self.data_dir / "meta.properties").exists():
            return
        proc = subprocess.run(
            [
                find_java(self.stack),
                *self._jvm_base(jars),
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id(self.plan)}",
                "-c",
                str(self.config),
            ],
            capture_output=True,
            text=True,
            cwd=self.home,
        )
        if proc.returncode != 0:
            raise InfraError(f"formatting {self.name} storage failed:\n{proc.stdout}{proc.stderr}")

    def ready(self) -> bool:
        """This node is registered as a broker (so a controller quorum exists)."""
        return broker_registered(self.host, self.port, node_id=self.node_id)


def cluster_id(plan: ClusterPlan) -> str:
    """The cluster's KRaft id, made once and kept in its state folder: every node's
    storage is formatted with the same one."""
    path = plan.state_dir / "kafka-cluster.id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(kafka_cluster_id() + "\n")
    return path.read_text().strip()


class CassandraNode(CassandraServer):
    """One Cassandra node of the cluster."""

    def __init__(self, plan: ClusterPlan, node_id: int, stack: StackSettings) -> None:
        self.name = f"cassandra-{node_id}"
        super().__init__(stack)
        self.plan = plan
        self.node_id = node_id
        self.host = plan.host(node_id)
        self.port = plan.cassandra_port
        self.rackdc = self.home / "config" / "cassandra-rackdc.properties"

    @property
    def jar_set(self) -> str:
        return "cassandra"

    def ports(self) -> list[tuple[int, str]]:
        return [
            (self.plan.cassandra_port, "TOCSIN_CASSANDRA_PORT"),
            (self.plan.cassandra_storage_port, "TOCSIN_CASSANDRA_STORAGE_PORT"),
        ]

    def taken_ports(self) -> list[tuple[int, str]]:
        return [(p, v) for p, v in self.ports() if port_open(p, self.host)]

    def _prepare(self, jars: Path) -> None:
        super()._prepare(jars)  # folders, logback, the single-node yaml (replaced below)
        self.config.write_text(render_cassandra_config(self.plan, self.node_id, self.data_dir))
        self.rackdc.write_text(render_rackdc(self.node_id))

    def _command(self, java: str, jars: Path) -> list[str]:
        cmd = super()._command(java, jars)
        at = cmd.index("-cp")
        return [*cmd[:at], f"-Dcassandra-rackdc.properties=file://{self.rackdc}", *cmd[at:]]

    def ready(self) -> bool:
        """This node answers a query itself (not through another node)."""
        return cassandra_node_answers(self.host, self.port)


class Cluster:
    """The cluster's six servers: ``up`` starts the Kafka nodes together (a quorum needs
    two of three) and, meanwhile, the Cassandra nodes one after another."""

    def __init__(
        self, stack: StackSettings, *, nodes: int = 3, broker_session_timeout_ms: int | None = None
    ) -> None:
        self.plan = ClusterPlan.from_stack(
            stack, nodes=nodes, broker_session_timeout_ms=broker_session_timeout_ms
        )
        node_stack = _node_stack(self.plan, stack)
        self.stack = node_stack
        self.kafka = [KafkaNode(self.plan, i, node_stack) for i in self.plan.node_ids]
        self.cassandra = [CassandraNode(self.plan, i, node_stack) for i in self.plan.node_ids]
        self.nodes: list[KafkaNode | CassandraNode] = [*self.kafka, *self.cassandra]

    def up(self) -> dict[str, float]:
        """Start what is not running; each server's seconds-to-ready (0.0: it was)."""
        self.plan.state_dir.mkdir(parents=True, exist_ok=True)
        taken = [
            (port, f"{var} on {node.host}")
            for node in self.nodes
            if not node.running()
            for port, var in node.taken_ports()
        ]
        if taken:
            raise InfraError(ports_taken_message(taken))
        java = find_java(self.stack)
        for name in ("kafka", "cassandra"):
            resolve_jars(name, self.stack.state_dir, self.stack.jars_dir, java=java)
        timings: dict[str, float] = {}
        errors: list[str] = []

        def start_one(node: KafkaNode | CassandraNode) -> bool:
            try:
                timings[node.name] = node.start(java)
                return True
            except Exception as exc:
                errors.append(f"{node.name}: {exc}")
                return False

        def start_cassandra() -> None:
            for node in self.cassandra:
                if not start_one(node):
                    return  # the next node would join a ring missing this one

        threads = [threading.Thread(target=start_one, args=(k,)) for k in self.kafka]
        threads.append(threading.Thread(target=start_cassandra))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise InfraError("\n\n".join(errors))
        return timings

    def down(self) -> list[str]:
        """Stop every node (Cassandra first, then Kafka): nothing of the cluster runs."""
        stopped: list[str] = []
        for node in reversed(self.cassandra):
            if node.stop():
                stopped.append(node.name)

        # Kafka nodes together: the last one stopped alone would wait for a quorum that
        # has gone before it shuts down.
        errors: list[str] = []

        def stop_kafka(node: KafkaNode) -> None:
            try:
                if node.stop():
                    stopped.append(node.name)
            except Exception as exc:
                errors.append(f"{node.name}: {exc}")

        threads = [threading.Thread(target=stop_kafka, args=(k,)) for k in self.kafka]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise InfraError("\n".join(errors))
        return stopped

    def status(self) -> list[ServerStatus]:
        return [node.status() for node in [*self.kafka, *self.cassandra]]

    def node(self, name: str) -> KafkaNode | CassandraNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise InfraError(f"no node {name!r} in this cluster")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every node answers (after a restart or a resumed process)."""
        deadline = time.monotonic() + timeout_s
        pending = [*self.kafka, *self.cassandra]
        while pending and time.monotonic() < deadline:
            pending = [n for n in pending if not n.ready()]
            if pending:
                time.sleep(1.0)
        if pending:
            raise InfraError(
                "not ready after " + f"{timeout_s:.0f}s: " + ", ".join(n.name for n in pending)
            )


def cmd_cluster(action: str, stack: StackSettings, *, nodes: int) -> int:
    """``tocsin infra up|down|status --nodes N``; prints what a person needs next."""
    cluster = Cluster(stack, nodes=nodes)
    if action == "up":
        started = time.monotonic()
        for name, seconds in cluster.up().items():
            print(
                f"{name}: " + ("already running" if seconds == 0.0 else f"ready in {seconds:.1f}s")
            )
        print(f"cluster up in {time.monotonic() - started:.1f}s; point Tocsin at it with:")
        for var, value in cluster.plan.client_env().items():
            print(f"  export {var}={value}")
        return 0
    if action == "down":
        stopped = cluster.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    for s in cluster.status():
        print(f"{s.name:12} pid {s.pid or '-':>8}  running {s.running!s:5}  ready {s.ready}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tocsin.cluster up|down|status`` (what ``make cluster-up`` runs)."""
    parser = argparse.ArgumentParser(prog="python -m tocsin.cluster", description=__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        return cmd_cluster(args.action, Settings.from_env().stack, nodes=args.nodes)
    except InfraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Fault injection on a three-node cluster (``make chaos-cluster``, RELIABILITY.md): the
faults that happen inside a replicated Kafka and Cassandra, while schedules of two
tenants stream through two workers and two proxies into a real counting receiver.

It starts a cluster of its OWN (tocsin.cluster: Kafka 31092/31093 and Cassandra
31042/28000 on 127.0.0.1-3, state under ``.state/chaos-cluster``, jars from
``.state/jars``), never the single-node stack or ``make cluster-up``'s cluster, and stops it
at the end. The machinery (receiver, tally, streams, verdict, ``RESULT`` lines) is
bench/chaos.py's.

Scenarios (``--only``): ``leader_kill`` SIGKILLs the broker leading a fires and a commands
partition mid-firing (back after 30 s); ``broker_hang`` SIGSTOPs a broker (the leader of
fires partition 0) for 30 s; ``coordinator_hang`` SIGSTOPs the broker coordinating the
proxies' group for 30 s, ``worker_coordinator_hang`` the one coordinating the workers';
``cassandra_kill`` SIGKILLs a Cassandra node for 2 minutes, then
starts it (hints); ``cassandra_hang`` SIGSTOPs a Cassandra node for 30 s; ``rolling_brokers``
and ``rolling_cassandra`` restart every node of one cluster, one at a time, under load;
``rolling_tocsin`` restarts the workers and proxies one at a time (SIGTERM: a graceful
hand-over); ``controller_kill`` SIGKILLs the KRaft controller leader (back after 30 s);
``cassandra_quorum`` and ``kafka_quorum`` SIGKILL two nodes of one cluster for 60 s (no
quorum: commands wait and are answered once it is back).

Each prints lost, unanswered, early, order violations (within one commands partition), order
across partitions (said, never failing), duplicates against their bound, and
fire lateness (first delivery minus due time) p50/p99/max for the triggers due during the
fault and after it, as ``RESULT cluster_<scenario>_...`` lines; the totals come last as
``RESULT chaos_cluster_...``. Exit 1 when anything is lost, unanswered, early, out of order
or duplicated past its bound.

    TOCSIN_ALLOW_PRIVATE_TARGETS=true .venv/bin/python -m bench.chaos_cluster
    ... --only leader_kill,cassandra_kill --keep-cluster
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from base.errors import KafkaError
from base.settings import REPO_ROOT, Settings
from bench.chaos import (
    CHAOS_ENV,
    TENANT,
    Receiver,
    Scenario,
    Stream,
    Tally,
    duplicate_bound,
    fmt,
    now_ms,
    percentile,
    say,
    verdict,
)
from tocsin.cluster import CassandraNode, Cluster, KafkaNode

# The single-node ports the cluster's are shifted from (tocsin.cluster.CLUSTER_PORT_SHIFT):
# Kafka 31092, controllers 31093, Cassandra 31042, storage 28000; all apart from the main
# stack (9092...), `make chaos` (19092...) and `make cluster-up` (29092...).
CLUSTER_CHAOS_ENV = {
    **CHAOS_ENV,
    "TOCSIN_STATE_DIR": str(REPO_ROOT / ".state" / "chaos-cluster"),
    # Timestamped lines: a failover is read as a timeline across the four processes' logs
    # (the fault, each group's session loss, revocation and assignment).
    "TOCSIN_LOG_FORMAT": "json",
    "TOCSIN_KAFKA_PORT": "11092",
    "TOCSIN_KAFKA_CONTROLLER_PORT": "11093",
    "TOCSIN_CASSANDRA_PORT": "11042",
    "TOCSIN_CASSANDRA_STORAGE_PORT": "8000",
}
SECOND_TENANT = "chaos-b"
RATE_PER_TENANT = 4  # creates a second each; two tenants
STREAM_S = 90.0
LEAD_MS = (5_000, 20_000)


class ClusterChaos:
    """What bench.chaos.Scenario needs (``env``, ``log_dir``) plus the cluster."""

    def __init__(
        self,
        *,
        broker_session_timeout_ms: int | None = None,
        proxy_session_timeout_s: float | None = None,
    ) -> None:
        from tocsin.infra import find_java

        base = {**os.environ, **CLUSTER_CHAOS_ENV}
        stack = Settings.from_env(base).stack
        self.cluster = Cluster(stack, broker_session_timeout_ms=broker_session_timeout_ms)
        assert self.cluster.plan.kafka_port == 31092, "never another stack's ports"
        self.env = {**base, **self.cluster.plan.client_env()}
        self.java = find_java(self.cluster.stack)
        self.log_dir = self.cluster.plan.state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The proxies' group session (None: the suite's 6 s, bench.chaos.Scenario.proxy).
        self.proxy_env = (
            {"TOCSIN_PROXY_SESSION_TIMEOUT_S": str(proxy_session_timeout_s)}
            if proxy_session_timeout_s
            else {}
        )

    def heal(self) -> None:
        """Every node running and answering (a scenario may have left one down)."""
        for node in self.cluster.nodes:
            if (pid := node.pid()) is not None:
                os.killpg(pid, signal.SIGCONT)
        self.cluster.up()
        self.cluster.wait_ready(180)


# ----------------------------------------------------------------------------- faults


def signal_node(node: KafkaNode | CassandraNode, signum: int) -> None:
    pid = node.pid()
    if pid is None:
        raise RuntimeError(f"{node.name} is not running")
    os.killpg(pid, signum)


def partition_leaders(settings: Settings, topic: str) -> dict[int, int]:
    """partition -> leader broker id of ``topic``."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.librdkafka())
    meta = admin.list_topics(timeout=30).topics[topic]
    return {p: part.leader for p, part in meta.partitions.items()}


def leader_of_both(fires: dict[int, int], commands: dict[int, int]) -> int:
    """A broker that leads a fires and a commands partition, the one leading the most
    partitions of the two topics (pure)."""
    both = set(fires.values()) & set(commands.values())
    if not both:
        raise RuntimeError("no broker leads both a fires and a commands partition")
    counts = list(fires.values()) + list(commands.values())
    return max(sorted(both), key=counts.count)


def controller_leader(cluster: Cluster) -> int:
    """The KRaft quorum's leader as the nodes' quorum-state files record it: the
    highest epoch's leader id."""
    best = (-1, -1)
    for node in cluster.kafka:
        path = node.data_dir / "__cluster_metadata-0" / "quorum-state"
        with contextlib.suppress(OSError, ValueError, KeyError):
            doc = json.loads(path.read_text())
            best = max(best, (int(doc["leaderEpoch"]), int(doc["leaderId"])))
    if best[1] < 0:
        raise RuntimeError("no node's quorum-state names a leader")
    return best[1]


def group_coordinators(settings: Settings) -> dict[str, int]:
    """The broker coordinating each of the scenario's two consumer groups (the workers'
    and the proxies'), by group id."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.librdkafka())
    groups = [f"{settings.topics.prefix}{name}" for name in ("scheduler", "proxy")]
    futures = admin.describe_consumer_groups(groups, request_timeout=10)
    return {group: int(f.result().coordinator.id) for group, f in futures.items()}


def roles_note(cluster: Cluster, settings: Settings) -> str:
    """Which broker leads the KRaft quorum and which coordinates each group: what decides
    what a broker's fault costs (RELIABILITY.md). Never fails a scenario."""
    parts = []
    with contextlib.suppress(Exception):
        parts.append(f"controller leader node {controller_leader(cluster)}")
    with contextlib.suppress(Exception):
        prefix = settings.topics.prefix
        for group, node in group_coordinators(settings).items():
            parts.append(f"{group.removeprefix(prefix)} group on node {node}")
    return ", ".join(parts) or "roles unknown"


def wait_isr_full(settings: Settings, prefix: str, replicas: int, timeout_s: float) -> float:
    """Until every partition of the scenario's topics has all ``replicas`` in sync (what
    an operator waits for between two nodes of a rolling restart); seconds waited."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka.librdkafka())
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(Exception):
            topics = admin.list_topics(timeout=10).topics
            short = [
                (name, p)
                for name, meta in topics.items()
                if name.startswith(prefix)
                for p, part in meta.partitions.items()
                if len(part.isrs) < replicas
            ]
            if not short:
                return time.monotonic() - started
        time.sleep(1.0)
    raise RuntimeError(f"partitions under-replicated after {timeout_s:.0f}s")


# ----------------------------------------------------------------------------- figures


@dataclass
class Window:
    """When the fault began and ended (epoch ms)."""

    start_ms: int = 0
    end_ms: int = 0


def lateness_split(tally: Tally, window: Window) -> dict[str, int]:
    """Fire lateness p50/p99/max of the triggers due during the fault and after it (first
    delivery minus due time, ms) (pure)."""
    with tally.lock:
        due_of = dict(tally.due)
        late = {t: min(tally.seen[t]) - due for t, due in due_of.items() if tally.seen.get(t)}
    during = [v for t, v in late.items() if window.start_ms <= due_of[t] <= window.end_ms]
    after = [v for t, v in late.items() if due_of[t] > window.end_ms]
    out: dict[str, int] = {"due_during": len(during), "due_after": len(after)}
    for name, values in (("during", during), ("after", after)):
        out[f"{name}_p50_ms"] = percentile(values, 0.50)
        out[f"{name}_p99_ms"] = percentile(values, 0.99)
        out[f"{name}_max_ms"] = max(values, default=0)
    return out


def result_lines(r: dict[str, Any]) -> list[str]:
    """One scenario's ``RESULT`` lines (pure)."""
    name = r["scenario"]
    keys = ("lost", "early", "order_violations", "order_across_partitions", "duplicated")
    keys += ("duplicate_bound",)
    keys += ("recurring_runs", "recurring_runs_lost")  # (of those in the figures above)
    lines = [f"RESULT cluster_{name}_{k}={int(r.get(k, 0) or 0)}" for k in keys]
    unanswered = int((r.get("codes") or {}).get("unanswered", 0))
    lines.append(f"RESULT cluster_{name}_unanswered={unanswered} commands")
    for phase in ("during", "after"):
        figures = "/".join(str(r.get(f"{phase}_{q}_ms", 0)) for q in ("p50", "p99", "max"))
        lines.append(f"RESULT cluster_{name}_lateness_{phase}_p50_p99_max_ms={figures}")
    return lines


# ----------------------------------------------------------------------------- scenarios


class RetryingClient:
    """The scenario's command client, as a client that retries uses it: a produce the
    command client gives up on (it tries a passing refusal again for 30 s first) is counted
    and left to the stream's re-send, instead of ending the stream's thread."""

    def __init__(self, client: Any, extra: dict[str, Any]) -> None:
        self._client, self._extra = client, extra

    def send(self, command: Any, **kw: Any) -> None:
        try:
            self._client.send(command, **kw)
        except KafkaError as exc:
            self._extra["send_refused"] = self._extra.get("send_refused", 0) + 1
            self._extra["send_refused_error"] = str(exc)[:160]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@contextlib.contextmanager
def world(chaos: ClusterChaos, name: str) -> Iterator[tuple[Scenario, Receiver, list[Any]]]:
    """A scenario with two workers, two proxies, a second tenant and a receiver."""
    s = Scenario(chaos, name)  # type: ignore[arg-type]
    receiver = Receiver(s.tally).start()
    try:
        s.tenant(SECOND_TENANT)
        procs = [
            s.worker("wa"),
            s.worker("wb"),
            s.proxy("pa", **chaos.proxy_env),
            s.proxy("pb", **chaos.proxy_env),
        ]
        s.wait_ready(180)
        for tenant in (TENANT, SECOND_TENANT):
            s.client.signing_key_of(tenant)
        s._client = RetryingClient(s.client, s.extra)
        time.sleep(10)  # let both groups settle over their two members
        yield s, receiver, procs
    finally:
        receiver.stop()
        s.close()


def run_with_fault(
    chaos: ClusterChaos,
    name: str,
    fault: Callable[[Scenario, list[Any]], tuple[Window, dict[str, Any]]],
    *,
    fault_after_s: float = 20.0,
    seen_timeout_s: float = 240.0,
) -> dict[str, Any]:
    """Two tenants' streams (one-shots and recurring schedules, bench.chaos.Stream);
    ``fault`` runs ``fault_after_s`` into them and returns its window and its
    duplicate-bound arguments; then every acknowledged trigger and expected run is
    awaited."""
    with world(chaos, name) as (s, receiver, procs):
        streams = [
            Stream(s, receiver, seconds=STREAM_S, rate=RATE_PER_TENANT, lead_ms=LEAD_MS,
                   tenant=tenant, prefix=f"{name}-{tenant}")
            for tenant in (TENANT, SECOND_TENANT)
        ]  # fmt: skip
        for st in streams:
            st.start()
        time.sleep(fault_after_s)
        window, bound = fault(s, procs)
        for st in streams:
            st.join(480)
        codes: dict[str, int] = {}
        for st in streams:
            for code, n in st.codes.items():
                codes[code] = codes.get(code, 0) + n
        s.extra["codes"] = codes
        s.wait_all_seen(seen_timeout_s)
        rate = sum(st.due_rate_per_s for st in streams)  # one-shots and recurring runs
        return s.report(
            scheduled=sum(st.scheduled for st in streams),
            **receiver.order_figures(s.settings.topics.command_partitions),
            **lateness_split(s.tally, window),
            duplicate_bound=duplicate_bound(rate_per_s=rate, **bound),
        )


def _outage(
    s: Scenario, node: KafkaNode | CassandraNode, signum: int, hold_s: float, chaos: ClusterChaos
) -> Window:
    """``signum`` to ``node``, ``hold_s`` later SIGCONT or a start; the window from the
    signal until the node answers again."""
    if isinstance(node, KafkaNode):
        # Taken at the fault: a broker back from an earlier fault takes its preferred
        # leaderships back (the groups' coordinators with them) at any moment.
        s.notes.append(f"at the fault: {roles_note(chaos.cluster, s.settings)}")
    window = Window(start_ms=now_ms())
    say(f"{s.name}: signal {signal.Signals(signum).name} to {node.name}")
    signal_node(node, signum)
    time.sleep(hold_s)
    if signum == signal.SIGSTOP:
        signal_node(node, signal.SIGCONT)
    else:
        node.start(chaos.java)
    deadline = time.monotonic() + 180
    while not node.ready() and time.monotonic() < deadline:
        time.sleep(0.5)
    window.end_ms = now_ms()
    s.notes.append(f"{node.name} out {(window.end_ms - window.start_ms) / 1000:.0f}s")
    say(f"{s.name}: {node.name} back")
    return window


def sc_leader_kill(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        p = s.settings.topics.prefix
        leader = leader_of_both(
            partition_leaders(s.settings, f"{p}fires"),
            partition_leaders(s.settings, f"{p}commands"),
        )
        node = chaos.cluster.kafka[leader - 1]
        window = _outage(s, node, signal.SIGKILL, 30, chaos)
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "leader_kill", fault)


def sc_broker_hang(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        p = s.settings.topics.prefix
        leader = partition_leaders(s.settings, f"{p}fires")[0]
        window = _outage(s, chaos.cluster.kafka[leader - 1], signal.SIGSTOP, 30, chaos)
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "broker_hang", fault)


def sc_coordinator_hang(chaos: ClusterChaos) -> dict[str, Any]:
    """SIGSTOP for 30 s the broker coordinating the proxies' consumer group: its members'
    heartbeats and offset commits go unanswered until they find the group's new
    coordinator."""

    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        node = group_coordinators(s.settings)[f"{s.settings.topics.prefix}proxy"]
        window = _outage(s, chaos.cluster.kafka[node - 1], signal.SIGSTOP, 30, chaos)
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "coordinator_hang", fault)


def worker_log_events(s: Scenario, since_ms: int) -> str:
    """What the workers' logs say about their group since ``since_ms``: each assignment
    (a rebalance; its generation) and each move to a new coordinator. Never fails."""
    from datetime import datetime

    assigned: list[str] = []
    moves = 0
    for worker in ("wa", "wb"):
        with contextlib.suppress(OSError):
            for line in (s.logs / f"{worker}.log").read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    rec = json.loads(line)
                    ts = datetime.fromisoformat(rec["ts"]).timestamp() * 1000
                    if ts < since_ms:
                        continue
                    if rec["msg"] == "partitions assigned":
                        assigned.append(f"{worker} gen {rec['generation']}")
                    elif rec["msg"] == "group coordinator moved: leaving the old one":
                        moves += 1
    return (
        f"workers' assignments during the fault: {', '.join(assigned) or 'none'}; "
        f"workers' coordinator moves: {moves}"
    )


def sc_worker_coordinator_hang(chaos: ClusterChaos) -> dict[str, Any]:
    """SIGSTOP for 30 s the broker coordinating the workers' consumer group (the proxies'
    too when one broker holds both): the workers' heartbeats and offset commits go
    unanswered until they find the group's new coordinator, and a worker that finds it
    after the new coordinator has expired its member rebalances the group."""

    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        node = group_coordinators(s.settings)[f"{s.settings.topics.prefix}scheduler"]
        window = _outage(s, chaos.cluster.kafka[node - 1], signal.SIGSTOP, 30, chaos)
        s.notes.append(worker_log_events(s, window.start_ms))
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "worker_coordinator_hang", fault)


def sc_cassandra_kill(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        return _outage(s, chaos.cluster.cassandra[1], signal.SIGKILL, 120, chaos), {}

    return run_with_fault(chaos, "cassandra_kill", fault)


def sc_cassandra_hang(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        return _outage(s, chaos.cluster.cassandra[2], signal.SIGSTOP, 30, chaos), {}

    return run_with_fault(chaos, "cassandra_hang", fault)


def _roll(s: Scenario, nodes: list[Any], chaos: ClusterChaos, *, kafka: bool) -> Window:
    window = Window(start_ms=now_ms())
    for node in nodes:
        say(f"{s.name}: restarting {node.name} (SIGTERM, then start)")
        t0 = time.monotonic()
        node.stop()
        node.start(chaos.java)
        if kafka:
            wait_isr_full(s.settings, s.settings.topics.prefix, 3, 180)
        s.notes.append(f"{node.name} {time.monotonic() - t0:.0f}s")
    window.end_ms = now_ms()
    return window


def sc_rolling_brokers(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        window = _roll(s, chaos.cluster.kafka, chaos, kafka=True)
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "rolling_brokers", fault, fault_after_s=15)


def sc_rolling_cassandra(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        return _roll(s, chaos.cluster.cassandra, chaos, kafka=False), {}

    return run_with_fault(chaos, "rolling_cassandra", fault, fault_after_s=15)


def sc_rolling_tocsin(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        window = Window(start_ms=now_ms())
        for p in procs:
            say(f"{s.name}: SIGTERM {p.name}, then its replacement")
            p.stop()
            if p.name.startswith("w"):
                s.worker(f"{p.name}2")
            else:
                s.proxy(f"{p.name}2", **chaos.proxy_env)
            time.sleep(12)
        window.end_ms = now_ms()
        # Each worker stop hands partitions over and each replacement takes some back.
        return window, {"worker_handovers": 4, "proxy_handovers": 4}

    return run_with_fault(chaos, "rolling_tocsin", fault, fault_after_s=15)


def sc_controller_kill(chaos: ClusterChaos) -> dict[str, Any]:
    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        leader = controller_leader(chaos.cluster)
        s.notes.append(f"controller leader was node {leader}")
        window = _outage(s, chaos.cluster.kafka[leader - 1], signal.SIGKILL, 30, chaos)
        s.notes.append(f"new controller leader node {controller_leader(chaos.cluster)}")
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "controller_kill", fault)


def _quorum_loss(s: Scenario, nodes: list[Any], hold_s: float, chaos: ClusterChaos) -> Window:
    """SIGKILL two nodes of one cluster (its quorum gone), ``hold_s`` later start them
    again one after the other; the window until both answer."""
    window = Window(start_ms=now_ms())
    for node in nodes:
        say(f"{s.name}: SIGKILL {node.name}")
        signal_node(node, signal.SIGKILL)
    time.sleep(hold_s)
    for node in nodes:
        node.start(chaos.java)
    window.end_ms = now_ms()
    s.notes.append(
        f"{' and '.join(n.name for n in nodes)} out {(window.end_ms - window.start_ms) / 1000:.0f}s"
    )
    return window


def sc_cassandra_quorum(chaos: ClusterChaos) -> dict[str, Any]:
    """Two of three Cassandra nodes dead 60 s: no LOCAL_QUORUM; commands must wait, then
    be answered, none lost."""

    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        return _quorum_loss(s, chaos.cluster.cassandra[1:], 60, chaos), {}

    return run_with_fault(chaos, "cassandra_quorum", fault, seen_timeout_s=300)


def sc_kafka_quorum(chaos: ClusterChaos) -> dict[str, Any]:
    """Two of three brokers (and controllers) dead 60 s: no controller quorum and fewer
    in-sync replicas than min.insync.replicas; nothing acknowledged may be lost."""

    def fault(s: Scenario, _procs: list[Any]) -> tuple[Window, dict[str, Any]]:
        window = _quorum_loss(s, chaos.cluster.kafka[1:], 60, chaos)
        return window, {"broker_down_s": (window.end_ms - window.start_ms) / 1000}

    return run_with_fault(chaos, "kafka_quorum", fault, seen_timeout_s=300)


SCENARIOS: dict[str, Callable[[ClusterChaos], dict[str, Any]]] = {
    "leader_kill": sc_leader_kill,
    "broker_hang": sc_broker_hang,
    "coordinator_hang": sc_coordinator_hang,
    "worker_coordinator_hang": sc_worker_coordinator_hang,
    "cassandra_kill": sc_cassandra_kill,
    "cassandra_hang": sc_cassandra_hang,
    "rolling_brokers": sc_rolling_brokers,
    "rolling_cassandra": sc_rolling_cassandra,
    "rolling_tocsin": sc_rolling_tocsin,
    "controller_kill": sc_controller_kill,
    "cassandra_quorum": sc_cassandra_quorum,
    "kafka_quorum": sc_kafka_quorum,
}


def run_all(chaos: ClusterChaos, names: list[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for name in names:
        say(f"=== cluster scenario {name}")
        t = time.monotonic()
        try:
            chaos.heal()
            r = SCENARIOS[name](chaos)
        except Exception as exc:
            traceback.print_exc()
            r = {"scenario": name, "error": repr(exc), "lost": 0, "duplicated": 0}
        r["seconds"] = round(time.monotonic() - t)
        results.append(r)
        say(fmt(r))
        for line in result_lines(r):
            print(line, flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--keep-cluster", action="store_true")
    parser.add_argument(
        "--broker-session-timeout-ms",
        type=int,
        default=None,
        help="the brokers' broker.session.timeout.ms (default: Kafka's stock 9000)",
    )
    parser.add_argument(
        "--proxy-session-timeout-s",
        type=float,
        default=None,
        help="the proxies' consumer group session timeout (default: the suite's 6 s; "
        "TOCSIN_PROXY_SESSION_TIMEOUT_S, 10 s, is the product's default)",
    )
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    if unknown := set(names) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {list(SCENARIOS)}")
    chaos = ClusterChaos(
        broker_session_timeout_ms=args.broker_session_timeout_ms,
        proxy_session_timeout_s=args.proxy_session_timeout_s,
    )

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so every finally: cleans up

    signal.signal(signal.SIGTERM, on_term)
    say("starting the chaos cluster (Kafka 31092, Cassandra 31042, .state/chaos-cluster)")
    try:
        fencing = args.broker_session_timeout_ms or "stock 9000"
        say(f"brokers' broker.session.timeout.ms: {fencing}")
        say(f"proxies' session timeout: {args.proxy_session_timeout_s or 6} s")
        say(f"cluster ready: {chaos.cluster.up()}")
        results = run_all(chaos, names)
    finally:
        if not args.keep_cluster:
            say("stopping the chaos cluster")
            chaos.cluster.down()
    print("\nscenario   figures", flush=True)
    for r in results:
        print(fmt(r))
    v = verdict(results)
    if v.failed:
        print(f"FAILED scenarios: {list(v.failed)}")
    for line in v.breaches:
        print(f"BREACH {line}")
    for line in v.result_lines():
        print(line.replace("RESULT chaos_", "RESULT chaos_cluster_"))
    print(f"RESULT chaos_cluster_duplicates={sum(int(r.get('duplicated', 0)) for r in results)}")
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The cluster fault suite's pure parts (bench/chaos_cluster.py): which broker to kill,
the KRaft leader from the quorum-state files, lateness during and after a fault, and the
RESULT lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from base.settings import StackSettings
from bench.chaos import Tally
from bench.chaos_cluster import (
    Window,
    controller_leader,
    lateness_split,
    leader_of_both,
    result_lines,
)
from tocsin.cluster import Cluster


def test_the_broker_killed_leads_a_fires_and_a_commands_partition() -> None:
    fires = {0: 1, 1: 2, 2: 3, 3: 1}
    commands = {0: 2, 1: 3, 2: 1, 3: 1}
    assert leader_of_both(fires, commands) == 1  # leads four of the eight
    assert leader_of_both({0: 2}, {0: 2, 1: 3}) == 2
    with pytest.raises(RuntimeError):
        leader_of_both({0: 1}, {0: 2})


def test_the_controller_leader_is_the_highest_epochs(tmp_path: Path) -> None:
    cluster = Cluster(StackSettings(state_dir=tmp_path))
    for node, (epoch, leader) in zip(cluster.kafka, [(4, 1), (5, 3), (5, 3)], strict=True):
        folder = node.data_dir / "__cluster_metadata-0"
        folder.mkdir(parents=True)
        (folder / "quorum-state").write_text(
            json.dumps({"leaderId": leader, "leaderEpoch": epoch, "votedId": -1})
        )
    assert controller_leader(cluster) == 3


def test_no_quorum_state_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        controller_leader(Cluster(StackSettings(state_dir=tmp_path)))


def test_lateness_is_split_by_due_time_around_the_fault() -> None:
    tally = Tally()
    for i, (due, seen) in enumerate([(900, 950), (1000, 1400), (1500, 4500), (2500, 2510)]):
        tally.expect(f"t{i}", due)
        tally.saw(f"t{i}", seen)
    tally.saw("t1", 1300)  # a duplicate: the first sighting counts
    tally.expect("lost", 1200)
    split = lateness_split(tally, Window(start_ms=1000, end_ms=2000))
    assert split["due_during"] == 2 and split["due_after"] == 1
    assert split["during_max_ms"] == 3000 and split["during_p50_ms"] == 300
    assert split["after_p99_ms"] == split["after_max_ms"] == 10


def test_result_lines_name_the_scenario_and_every_figure() -> None:
    r = {
        "scenario": "leader_kill",
        "lost": 0,
        "duplicated": 3,
        "duplicate_bound": 120,
        "codes": {"ok": 10, "unanswered": 1},
        "during_p50_ms": 40,
        "during_p99_ms": 900,
        "during_max_ms": 1200,
        "after_p50_ms": 20,
        "after_p99_ms": 60,
        "after_max_ms": 70,
        "recurring_runs": 180,
        "recurring_runs_lost": 0,
    }
    lines = result_lines(r)
    assert "RESULT cluster_leader_kill_duplicated=3" in lines
    assert "RESULT cluster_leader_kill_unanswered=1 commands" in lines
    assert "RESULT cluster_leader_kill_lateness_during_p50_p99_max_ms=40/900/1200" in lines
    assert "RESULT cluster_leader_kill_lateness_after_p50_p99_max_ms=20/60/70" in lines
    assert "RESULT cluster_leader_kill_order_violations=0" in lines
    assert "RESULT cluster_leader_kill_order_across_partitions=0" in lines
    assert "RESULT cluster_leader_kill_recurring_runs=180" in lines
    assert "RESULT cluster_leader_kill_recurring_runs_lost=0" in lines

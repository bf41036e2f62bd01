"""bench.pinning: which process goes to which core, and every thread of it gets there."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from base.errors import ConfigError
from bench import pinning

STACK = {
    "kafka": 11,
    "cassandra": 12,
    "api": 21,
    "worker": 22,
    "worker1": 23,
    "proxy": 24,
    "client": 31,
    "receiver": 32,
    "bench": 33,
}


def test_pinned_with_tocsin_the_servers_get_core_0_and_everything_else_core_1() -> None:
    got = pinning.placement(pinning.WITH_TOCSIN, STACK, {0, 1})
    assert {n for n, c in got.items() if c == {0}} == {"kafka", "cassandra"}
    assert {n for n, c in got.items() if c == {1}} == set(STACK) - {"kafka", "cassandra"}


def test_pinned_with_servers_the_load_shares_the_servers_core_and_tocsin_is_alone() -> None:
    got = pinning.placement(pinning.WITH_SERVERS, STACK, {0, 1})
    assert {n for n, c in got.items() if c == {1}} == {"api", "worker", "worker1", "proxy"}
    assert {n for n, c in got.items() if c == {0}} == {
        "kafka",
        "cassandra",
        "client",
        "receiver",
        "bench",
    }


def test_the_cores_are_the_two_lowest_this_process_may_use() -> None:
    got = pinning.cores(pinning.WITH_TOCSIN, [5, 3, 7])
    assert got[pinning.SERVERS] == {3} and got[pinning.TOCSIN] == {5}


def test_off_places_nothing_and_one_core_cannot_be_split() -> None:
    assert pinning.placement(pinning.OFF, STACK, {0}) == {}
    with pytest.raises(pinning.PinningError):
        pinning.placement(pinning.WITH_TOCSIN, STACK, {0})


@pytest.mark.parametrize(
    ("value", "mode"),
    [("", "off"), ("0", "off"), ("1", "tocsin"), (" Servers ", "servers"), (None, "off")],
)
def test_modes_from_the_environment(value: str | None, mode: str) -> None:
    assert pinning.mode_from(value) == mode


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ConfigError):
        pinning.mode_from("both")


def test_restore_gives_each_thread_its_own_affinity_and_new_threads_the_process_default() -> None:
    saved = {100: frozenset({0, 1}), 101: frozenset({1})}
    got = pinning.restore_plan(saved, [100, 101, 102], frozenset({0, 1}))
    assert got == {100: {0, 1}, 101: {1}, 102: {0, 1}}


def test_spread_counts_threads_per_core_set() -> None:
    text = pinning.spread({1: frozenset({1}), 2: frozenset({1}), 3: frozenset({0, 1})})
    assert text == "2/3 threads on {1}, 1/3 threads on {0,1}"


@pytest.fixture
def threaded() -> Iterator[subprocess.Popen[str]]:
    # A process with four threads that starts a fifth when it reads a line.
    code = (
        "import sys, threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True)\n"
        "sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('more', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield proc
    proc.kill()
    proc.wait(10)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_every_thread_is_pinned_and_a_thread_started_later_inherits_it(
    threaded: subprocess.Popen[str],
) -> None:
    core = frozenset({sorted(os.sched_getaffinity(0))[1]})
    got = pinning.pin_process(threaded.pid, core)
    assert len(got) == 4 and set(got.values()) == {core}
    assert threaded.stdin is not None and threaded.stdout is not None
    threaded.stdin.write("go\n")
    threaded.stdin.flush()
    assert threaded.stdout.readline().strip() == "more"
    deadline = time.monotonic() + 10
    while len(after := pinning.affinities(threaded.pid)) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(after) == 5 and set(after.values()) == {core}

"""Core pinning for the benchmarks: the servers on one core, Tocsin on the other.

Issue 21 asks, for a target out of reach on this machine's two shared cores, for the
figure with the local stack's servers (the Kafka and Cassandra JVMs) pinned to one core
and Tocsin's processes (worker, proxy, API) to the other, so that neither side's CPU
steals the other's time slices and each side's cost can be read against one core's
capacity. ``--pin`` (every issue-21 benchmark takes it; default from ``TOCSIN_BENCH_PIN``,
the Makefile's ``PIN``) chooses:

- ``off``: nothing is pinned, every process may run on every core (the usual figures);
- ``tocsin``: servers on the first core, Tocsin on the second, and the load client (the
  bench process itself: the REST client, the command producer, the reference consumer)
  and the receivers on Tocsin's core. Tocsin then has a core with the load beside it, as a
  client on the same host would be, and the servers' core holds only the servers: the
  figure says what Tocsin reaches when the servers cost it nothing;
- ``servers``: the same, but the load client and receivers on the servers' core, so
  Tocsin's core holds Tocsin alone.

Affinity is set per thread (``/proc/<pid>/task/*``, ``os.sched_setaffinity`` takes a thread
id), since a process's existing threads keep theirs when only its main thread is moved;
threads created later inherit their creator's. The bench process places itself at
``begin``, so its children (workers, proxies, the API, receivers) start on the client's
core; ``place`` moves the Tocsin processes to Tocsin's core as soon as they are started.
Every placement is read back from /proc and printed (``[pin]`` lines). The servers'
threads get back the affinity they had when the bench ends (also on SIGTERM);
``python -m bench.pinning --restore`` gives every server thread every online core, after a
bench killed with SIGKILL.

The JVMs chose their GC and compiler thread counts for two cores at start-up; pinned, those
threads share one core. Other processes on the machine (other engineers' tests) are not
pinned and may run on either core.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from base.errors import ConfigError, InfraError

ENV = "TOCSIN_BENCH_PIN"
OFF, WITH_TOCSIN, WITH_SERVERS = "off", "tocsin", "servers"
MODES = (OFF, WITH_TOCSIN, WITH_SERVERS)
# The values TOCSIN_BENCH_PIN may take besides the mode names (make's PIN=1 and PIN=).
_ALIASES = {"": OFF, "0": OFF, "no": OFF, "false": OFF, "1": WITH_TOCSIN, "yes": WITH_TOCSIN}

SERVERS, TOCSIN, CLIENT = "servers", "tocsin", "client"
# Process names (as the benches label them) by role; a name with a number after it
# (worker0, worker1) has its stem's role. Anything else is a Tocsin process.
_SERVER_NAMES = frozenset({"kafka", "cassandra"})
_CLIENT_NAMES = frozenset({"client", "receiver", "bench"})


class PinningError(InfraError):
    """Pinning cannot be done on this machine (fewer than two cores, no servers found): not
    retriable, the bench stops rather than measure something other than it says."""


def mode_from(value: str | None) -> str:
    """The mode a TOCSIN_BENCH_PIN value (or --pin) names; ConfigError (not retriable)
    for anything else."""
    text = (value or "").strip().lower()
    mode = _ALIASES.get(text, text)
    if mode not in MODES:
        raise ConfigError(f"{ENV}={value!r}: expected one of {', '.join(MODES)} (or 1 / 0)")
    return mode


def _mode_argument(value: str) -> str:
    try:
        return mode_from(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def role(name: str) -> str:
    stem = name.rstrip("0123456789")
    if stem in _SERVER_NAMES:
        return SERVERS
    if stem in _CLIENT_NAMES:
        return CLIENT
    return TOCSIN


def cores(mode: str, allowed: Iterable[int]) -> dict[str, frozenset[int]]:
    """The core of each role in ``mode``, from the cores this process may use: servers on
    the lowest, Tocsin on the next, the client with one of them. Empty when off."""
    if mode == OFF:
        return {}
    ordered = sorted(set(allowed))
    if len(ordered) < 2:
        raise PinningError(f"pinning needs two cores, this process may use {ordered}")
    servers, tocsin = frozenset({ordered[0]}), frozenset({ordered[1]})
    return {SERVERS: servers, TOCSIN: tocsin, CLIENT: tocsin if mode == WITH_TOCSIN else servers}


def placement(
    mode: str, pids: Mapping[str, int], allowed: Iterable[int]
) -> dict[str, frozenset[int]]:
    """Where each named process goes: name -> cores (empty when off)."""
    by_role = cores(mode, allowed)
    if not by_role:
        return {}
    return {name: by_role[role(name)] for name in pids}


def restore_plan(
    saved: Mapping[int, frozenset[int]], tids: Iterable[int], process_default: frozenset[int]
) -> dict[int, frozenset[int]]:
    """What each live thread of a server gets back: the affinity it had when pinned, or, for
    a thread started since (it inherited the pinned core), the process's own as it was."""
    return {tid: saved.get(tid, process_default) for tid in tids}


def spread(per_thread: Mapping[int, frozenset[int]]) -> str:
    """A process's threads' affinities, summarised: '61/61 threads on {1}'."""
    counts: dict[frozenset[int], int] = {}
    for cpus in per_thread.values():
        counts[cpus] = counts.get(cpus, 0) + 1
    total = len(per_thread)
    return ", ".join(
        f"{n}/{total} threads on {{{','.join(map(str, sorted(cpus)))}}}"
        for cpus, n in sorted(counts.items(), key=lambda kv: -kv[1])
    )


# ---- the system calls ------------------------------------------------------------------------


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # the process is gone
        return []


def affinities(pid: int) -> dict[int, frozenset[int]]:
    out: dict[int, frozenset[int]] = {}
    for tid in thread_ids(pid):
        try:
            out[tid] = frozenset(os.sched_getaffinity(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def set_threads(pid: int, plan: Mapping[int, frozenset[int]]) -> None:
    for tid, cpus in plan.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def pin_process(pid: int, cpus: frozenset[int]) -> dict[int, frozenset[int]]:
    """Every thread of ``pid`` on ``cpus``; twice, for a thread started during the first
    pass by one not moved yet. Returns the affinities read back."""
    for _ in range(2):
        set_threads(pid, dict.fromkeys(thread_ids(pid), cpus))
    return affinities(pid)


def cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """User + system CPU seconds (all threads) of each named process still running."""
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def server_pids() -> dict[str, int]:
    """The local stack's Kafka and Cassandra JVMs, as ``tocsin infra`` knows them (pid files
    checked against the process's start time and command line)."""
    from base.settings import Settings
    from tocsin.infra import CassandraServer, KafkaServer

    stack = Settings.from_env(dict(os.environ)).stack
    found = {}
    for server in (KafkaServer(stack), CassandraServer(stack)):
        pid = server.pid()
        if pid is not None:
            found[server.name] = pid
    return found


# ---- the session -----------------------------------------------------------------------------


@dataclass
class Session:
    mode: str
    allowed: frozenset[int]
    servers: dict[str, int] = field(default_factory=dict)
    # Per server pid: its threads' affinities before pinning, and the main thread's.
    saved: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)
    placed: dict[str, int] = field(default_factory=dict)
    restored: bool = False

    def place(self, pids: Mapping[str, int]) -> None:
        for name, cpus in placement(self.mode, pids, self.allowed).items():
            pid = pids[name]
            if role(name) == SERVERS and pid in self.saved:
                continue  # pinned at begin
            got = pin_process(pid, cpus)
            self.placed[name] = pid
            print(f"[pin] {name} pid {pid} ({role(name)}): {spread(got)}", flush=True)

    def restore(self) -> None:
        if self.restored:
            return
        self.restored = True
        for name, pid in self.servers.items():
            saved = self.saved.get(pid, {})
            default = saved.get(pid, self.allowed)
            set_threads(pid, restore_plan(saved, thread_ids(pid), default))
            print(f"[pin] {name} pid {pid} restored: {spread(affinities(pid))}", flush=True)


_SESSION: Session | None = None


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pin",
        type=_mode_argument,
        default=os.environ.get(ENV, OFF),
        help=f"{OFF}: no pinning; {WITH_TOCSIN}: Kafka and Cassandra on core 0, Tocsin and "
        f"the load client on core 1; {WITH_SERVERS}: the load client on core 0 with the "
        f"servers (default from {ENV}; bench/pinning.py)",
    )


def begin(mode: str) -> None:
    """Start pinning for this bench run: the servers to their core, this process (the load
    client, and the default of every child it starts) to the client's. Their affinity comes
    back at exit or SIGTERM. Off: says so and changes nothing."""
    global _SESSION
    mode = mode_from(mode)
    allowed = frozenset(os.sched_getaffinity(0))
    if mode == OFF:
        print(f"[pin] off: every process may run on cores {sorted(allowed)}", flush=True)
        return
    by_role = cores(mode, allowed)
    servers = server_pids()
    if not servers:
        raise PinningError("no Kafka or Cassandra of the local stack is running to pin")
    session = Session(mode, allowed, servers)
    _SESSION = session
    atexit.register(session.restore)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: FrameType | None) -> None:
        session.restore()
        if callable(previous):
            previous(signum, frame)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    print(
        f"[pin] {mode}: servers on {sorted(by_role[SERVERS])}, Tocsin on "
        f"{sorted(by_role[TOCSIN])}, load client and receivers on {sorted(by_role[CLIENT])}",
        flush=True,
    )
    for name, pid in servers.items():
        before = affinities(pid)
        session.saved[pid] = before
        if before.get(pid, allowed) != allowed:
            print(
                f"[pin] note: {name} pid {pid} was already on {sorted(before[pid])}, which "
                "is what it gets back (python -m bench.pinning --restore frees it)",
                flush=True,
            )
        got = pin_process(pid, by_role[SERVERS])
        print(f"[pin] {name} pid {pid} (servers): {spread(got)}", flush=True)
    session.place({"bench": os.getpid()})


def place(pids: Mapping[str, int]) -> Mapping[str, int]:
    """Move the named processes to their role's core (a no-op when pinning is off); returns
    ``pids`` so a call can wrap an expression."""
    if _SESSION is not None:
        _SESSION.place(pids)
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--restore",
        action="store_true",
        help="give every thread of the stack's Kafka and Cassandra every online core",
    )
    args = parser.parse_args()
    if not args.restore:
        parser.print_help()
        return 2
    every = frozenset(range(os.cpu_count() or 1))
    for name, pid in server_pids().items():
        set_threads(pid, dict.fromkeys(thread_ids(pid), every))
        print(f"{name} pid {pid}: {spread(affinities(pid))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

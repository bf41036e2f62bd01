"""A rebalance that gives a partition back, on the real stack: a second worker joins, the
first keeps some partitions (Faust's assignor is sticky) and *resumes* their tickers
(streams.app.Ownership), commands produced while the group rebalances are decided on the
resumed tickers, and the second worker leaving hands its partitions back. What fires is
read from the real fires topic."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import AdminClient

from base.settings import Settings
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.partitioner import partition_for
from tests.integration.conftest import WorkerProcess, wait_worker_ready
from tests.integration.test_scheduler import create, now_ms
from topics.ids import trigger_id
from topics.models import CancelCommand, UpdateCommand

# streams.app.Ownership's log lines, in the workers' text format (base.logs.TextFormatter).
_ASSIGNED = re.compile(
    r"partitions assigned generation=(\d+) resumed=\[([\d, ]*)\] "
    r"started=\[([\d, ]*)\] stopped=\[([\d, ]*)\]"
)
_SUSPENDED = "partitions suspended"


@dataclass(frozen=True)
class Assignment:
    generation: int
    resumed: frozenset[int]
    started: frozenset[int]
    stopped: frozenset[int]

    @property
    def held(self) -> frozenset[int]:
        return self.resumed | self.started


def _ints(text: str) -> frozenset[int]:
    return frozenset(int(n) for n in text.split(",") if n.strip())


def assignments(worker: WorkerProcess) -> list[Assignment]:
    """The worker's assignments so far, oldest first."""
    text = worker.log_path.read_text(errors="replace")
    return [
        Assignment(int(m[1]), _ints(m[2]), _ints(m[3]), _ints(m[4]))
        for m in _ASSIGNED.finditer(text)
    ]


def suspensions(worker: WorkerProcess) -> int:
    return worker.log_path.read_text(errors="replace").count(_SUSPENDED)


class Group:
    """The workers' consumer group as the broker sees it."""

    def __init__(self, settings: Settings) -> None:
        self.name = f"{settings.topics.prefix}scheduler"
        self.admin = AdminClient(settings.kafka.librdkafka())

    def rebalancing(self) -> bool:
        """Whether a member joined or left and the next generation is not yet assigned."""
        group = self.admin.describe_consumer_groups([self.name])[self.name]
        return group.result(timeout=10).state in (
            ConsumerGroupState.PREPARING_REBALANCING,
            ConsumerGroupState.COMPLETING_REBALANCING,
        )


def ids_by_partition(prefix: str, partitions: int, each: int) -> dict[int, list[str]]:
    """``each`` fresh schedule ids on every commands partition."""
    out: dict[int, list[str]] = {p: [] for p in range(partitions)}
    while not all(len(v) >= each for v in out.values()):
        sid = f"{prefix}-{uuid.uuid4().hex[:12]}"
        got = out[partition_for(sid.encode(), partitions)]
        if len(got) < each:
            got.append(sid)
    return out


class Fired:
    """The fires topic read from its start: trigger id -> each emission's time."""

    def __init__(self, fires: FireWatcher) -> None:
        self.fires = fires
        self.seen: dict[str, list[int]] = {}

    def drain(self, until: set[str], timeout_s: float) -> None:
        """Read until every id of ``until`` has fired, or ``timeout_s``; never early."""
        deadline = time.monotonic() + timeout_s
        while not until <= set(self.seen) and time.monotonic() < deadline:
            for trig, _ in self.fires.poll(0.5):
                self.seen.setdefault(trig.trigger_id, []).append(trig.emitted_ms)
                assert trig.emitted_ms >= trig.due_ms, f"{trig.schedule_id} fired early"


class Window:
    """Commands produced on every partition, in rounds at most every 100 ms, until A is
    assigned again; a round is inside the window when the broker has the group
    rebalancing, or A has suspended its tickers, and it is acknowledged before that.

    Each round, on each partition: ``moved`` moves 10 ms later (it fires at its last time
    only) and a new schedule due 8 s later is created. Every other round cancels the
    previous round's new one. Inside the window each round also takes a schedule A's
    ticker holds in memory from ``held``: it cancels it, or in the rounds without cancels
    moves it an hour away, beyond what a ticker keeps offered. A withdrawal skipped there
    (a resumed ticker that missed a command decided while it was suspended) fires it at
    its old time. Rounds alternate because a batch with a cancel of a suspended partition
    is retried before it writes anything (streams.commands: a cancel is decided on its
    ticker), so only a batch without one reaches the withdrawals handed to the next ticker
    (streams.app.Ownership); rounds are paced so that a batch holds about one."""

    def __init__(self, client: CommandClient, tenant: str, partitions: int) -> None:
        self.client, self.tenant, self.partitions = client, tenant, partitions
        self.rounds = 0
        self.in_window = 0  # rounds sent in the window, acknowledged before A's assignment
        self.created: dict[str, int] = {}  # schedule id -> due
        self.cancelled: list[str] = []
        self.moved_to: dict[str, int] = {}  # the moved ones' last due (fired in the test)
        self.moved_away: list[str] = []  # moved an hour away (not fired in the test)
        self.withdrawn: set[tuple[str, int]] = set()  # (id, due) that must never fire
        self.last: dict[int, str] = {}
        self.sent: list[str] = []  # the schedule ids commanded, in order

    def run(
        self,
        a: WorkerProcess,
        group: Group,
        moved: dict[int, str],
        move_base_ms: int,
        held: dict[int, list[str]],
    ) -> int:
        """Rounds until A is assigned again; how many were inside the window."""
        assigned, suspended = len(assignments(a)), suspensions(a)
        inside_before = self.in_window
        deadline = time.monotonic() + 60
        while len(assignments(a)) == assigned:
            assert time.monotonic() < deadline, f"A was not assigned again:\n{a.log_tail(60)}"
            began = time.monotonic()
            inside = group.rebalancing() or suspensions(a) > suspended
            self.round(moved, move_base_ms, held if inside else None)
            if inside and len(assignments(a)) == assigned:
                self.in_window += 1
            time.sleep(max(0.0, began + 0.1 - time.monotonic()))
        return self.in_window - inside_before

    def round(
        self,
        moved: dict[int, str],
        move_base_ms: int,
        held: dict[int, list[str]] | None,
    ) -> None:
        cancels = self.rounds % 2 == 0
        due = now_ms() + 8_000
        fresh = ids_by_partition("new", self.partitions, 1)
        for p in range(self.partitions):
            sid = moved[p]
            if sid in self.moved_to:
                self.withdrawn.add((sid, self.moved_to[sid]))
            self.moved_to[sid] = move_base_ms + 10 * self.rounds
            self.send_move(sid, self.moved_to[sid])
            self.client.send(create(self.tenant, fresh[p][0], due))
            self.created[fresh[p][0]] = due
            self.sent.append(fresh[p][0])
            if cancels and p in self.last:
                self.send_cancel(self.last.pop(p))
            if not cancels:
                self.last[p] = fresh[p][0]
            if held and held[p] and cancels:
                self.send_cancel(held[p].pop())
            elif held and held[p]:
                away = held[p].pop()
                self.send_move(away, due + 3_600_000)
                self.moved_away.append(away)
        self.client.flush()
        self.rounds += 1

    def send_move(self, sid: str, due_ms: int) -> None:
        self.client.send(UpdateCommand(tenant=self.tenant, schedule_id=sid, due_ms=due_ms))
        self.sent.append(sid)

    def send_cancel(self, sid: str) -> None:
        self.client.send(CancelCommand(tenant=self.tenant, schedule_id=sid))
        self.cancelled.append(sid)
        self.sent.append(sid)


@pytest.mark.slow
def test_a_partition_given_back_resumes_its_ticker_with_the_windows_commands(
    worker_factory: Any, own_stack: Settings, tenant: str
) -> None:
    """Worker A owns every partition with schedules loaded and due shortly. Worker B joins:
    A's tickers are suspended, and A is given some partitions back in the next generation,
    whose tickers must resume (not start afresh). B then leaves gracefully: A's kept
    tickers are suspended and resumed again, and B's partitions start afresh on A. Commands
    stream in on every partition (so on those A keeps too) through both rebalances, some
    inside their windows (``Window``): the cancelled ones never fire, the moved ones never
    fire at an earlier time, the one moved last fires at its last time, the new ones fire,
    and every other schedule fires at least once, never early, under its stable trigger
    id."""
    partitions = own_stack.topics.command_partitions
    client, results = CommandClient(own_stack), ResultWatcher(own_stack)
    fires = FireWatcher(own_stack, from_start=True)
    a = worker_factory.make("a", own_stack)
    wait_worker_ready(own_stack, tenant, worker=a)
    first = assignments(a)[-1]
    assert first.held == set(range(partitions)), a.log_tail()

    # Due from 14 s to 40 s from now: some fire before B joins, during the rebalances and
    # after them; the ones the windows' commands change are due late enough to be changed
    # (and within a ticker's memory: streams.ticker's offer window).
    t0 = now_ms()
    plain = ids_by_partition("plain", partitions, 5)
    due: dict[str, int] = {}
    for p, sids in plain.items():
        for i, sid in enumerate(sids):
            due[sid] = t0 + 14_000 + (i * partitions + p) * 1_300
    joining = ids_by_partition("join", partitions, 31)
    leaving = ids_by_partition("leave", partitions, 30)
    moved = {p: sids.pop() for p, sids in joining.items()}
    for sids in [list(moved.values()), *joining.values(), *leaving.values()]:
        due.update(dict.fromkeys(sids, t0 + 40_000))
    for sid, at in due.items():
        client.send(create(tenant, sid, at))
    client.flush()
    answers = results.wait_for(due, timeout_s=30)
    assert {sid: r.code for sid, r in answers.items()} == dict.fromkeys(due, "ok"), a.log_tail()

    # B joins: A is given back what it keeps, in the next generation, and resumes those.
    group, window = Group(own_stack), Window(client, tenant, partitions)
    held = len(assignments(a))
    b = worker_factory.make("b", own_stack)
    inside = window.run(a, group, moved, t0 + 55_000, joining)
    print(f"B joining: rounds {window.rounds}, inside the window {inside}")
    assert inside, f"no command went out inside the window ({window.rounds} rounds)"
    second = assignments(a)[held]
    assert second.generation == first.generation + 1, a.log_tail()
    assert second.resumed and second.resumed < set(range(partitions)), (
        f"A should keep some partitions and resume them: {second}\n{a.log_tail()}"
    )
    assert not second.started, f"a kept partition restarted: {second}"
    answers = results.wait_for(window.sent, timeout_s=45)
    codes = {sid: r.code for sid, r in answers.items()}
    assert codes == dict.fromkeys(window.sent, "ok"), f"{a.log_tail()}\n--- B ---\n{b.log_tail()}"

    # B leaves gracefully: A is assigned every partition, its kept tickers resumed again.
    held, rounds, sent = len(assignments(a)), window.rounds, len(window.sent)
    assert b.proc is not None
    os.killpg(b.proc.pid, signal.SIGTERM)
    inside = window.run(a, group, moved, t0 + 55_000, leaving)
    print(f"B leaving: rounds {window.rounds - rounds}, inside the window {inside}")
    b.stop()
    last = assignments(a)[held]
    assert last.held == set(range(partitions)), f"{last}\n{a.log_tail()}"
    assert second.held <= last.resumed, f"A's kept tickers did not resume again: {last}"
    answers = results.wait_for(window.sent[sent:], timeout_s=45)
    codes = {sid: r.code for sid, r in answers.items()}
    assert codes == dict.fromkeys(window.sent[sent:], "ok"), a.log_tail()

    # trigger id -> what must never fire: (schedule id, due)
    gone = [*window.withdrawn, *((sid, due.pop(sid)) for sid in window.moved_away)]
    gone += [(sid, due[sid]) for sid in moved.values()]
    due.update(window.created)
    due.update(window.moved_to)
    gone += [(sid, due.pop(sid)) for sid in window.cancelled]
    never = {trigger_id(tenant, sid, at): (sid, at) for sid, at in gone}
    want = {trigger_id(tenant, sid, at): sid for sid, at in due.items()}

    fired = Fired(fires)
    fired.drain(set(want), 60)
    seen = fired.seen
    missing = sorted(sid for t, sid in want.items() if t not in seen)
    assert not missing, f"never fired: {missing}\n{a.log_tail()}"
    wrong = sorted(never[t] for t in set(never) & set(seen))
    assert not wrong, f"cancelled, or moved and fired at an earlier time (id, due): {wrong}"
    unexpected = set(seen) - set(want)
    assert not unexpected, f"fires of nothing scheduled: {unexpected}"
    for sid, at in window.moved_to.items():
        assert min(seen[trigger_id(tenant, sid, at)]) >= at

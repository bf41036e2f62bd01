"""The writer with host rate limits and circuit breakers (``proxy.hostlimits``), fake
senders: a limited or failing host's messages wait in its line holding no writer, in key
order, and leave it delivered, dead-lettered or parked, never lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import orjson

from proxy.breaker import BreakerPolicy, BreakerState
from proxy.envelope import Envelope, prepare_fire
from proxy.hostlimits import HostGate, HostLimits, parse_limits
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.parker import ParkingLot
from proxy.retry import AttemptResult, HttpResult
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer
from tests.unit.test_proxy_lanes import RETRIES, AckingOutbox
from tests.unit.test_proxy_writer import FakeOutbox
from topics.codec import decode_trigger

H = "http://api.example"


class HostSender:
    """Answers each attempt with ``answer(env)`` and notes when it came."""

    def __init__(self, answer: Callable[[Envelope], AttemptResult] | None = None) -> None:
        self.answer = answer or (lambda env: HttpResult(status=200))
        self.sent: list[tuple[Envelope, float]] = []
        self.lock = threading.Lock()

    async def send(self, env: Envelope) -> AttemptResult:
        with self.lock:
            self.sent.append((env, time.monotonic()))
        return self.answer(env)

    def of(self, pick: Callable[[Envelope], bool]) -> list[Envelope]:
        with self.lock:
            return [env for env, _ in self.sent if pick(env)]

    def delivered(self, pick: Callable[[Envelope], bool]) -> set[int]:
        with self.lock:
            return {
                env.offset
                for env, _ in self.sent
                if pick(env) and env.attempt_state.last_status == 200
            }


def fire(offset: int, tenant: str, url: str, key: str | None = None) -> Envelope:
    sid = key or f"s{offset}"
    doc = {
        "trigger_id": f"t{offset}",
        "schedule_id": sid,
        "tenant": tenant,
        "due_ms": 1,
        "emitted_ms": 2,
        "attempt": 1,
        "order_key": sid,
        "payload": {"n": offset},
        "callback": {"type": "http", "url": url},
    }
    e = Envelope(
        topic="t",
        partition=0,
        offset=offset,
        key=sid.encode(),
        value=orjson.dumps(doc),
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_fire(e, decode_trigger)
    return e


def make(
    sender: HostSender,
    gate: HostGate,
    *,
    outbox: Any = None,
    lot: ParkingLot | None = None,
    **kw: Any,
) -> tuple[Writer, SharedState, ProxyMetrics]:
    settings = ProxySettings(
        mode="fires",
        metrics_port=0,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.01,
        **{"concurrency": 4, **kw},
    )
    state = SharedState(Bounds())
    state.assign([("t", 0)])
    metrics = ProxyMetrics()
    writer = Writer(
        state=state,
        settings=settings,
        metrics=metrics,
        outbox=outbox or FakeOutbox(),
        dead_letter_topic="dlq",
        deliveries_topic=None,
        http=sender,
        kafka=HostSender(),
        hosts=gate,
        lot=lot,
    )
    return writer, state, metrics


def wait_until(done: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def start(writer: Writer, state: SharedState, envs: list[Envelope]) -> None:
    writer.start()
    state.push(envs)
    writer.notify()


def test_a_tenants_limited_host_waits_without_holding_writers_from_another_tenant() -> None:
    """Tenant slow may send 2 requests/s to H; tenant quick has no limit on the same host.
    With 2 writers in all, quick's messages, read after slow's, all go while slow's wait."""
    gate = HostGate(BreakerPolicy(), parse_limits({"slow": {"hosts": {"api.example": 2}}}, 0.0))
    sender = HostSender()
    writer, state, metrics = make(sender, gate, concurrency=2)
    slow = [fire(i, "slow", f"{H}/s") for i in range(10)]
    quick = [fire(10 + i, "quick", f"{H}/q") for i in range(20)]
    try:
        start(writer, state, slow + quick)
        wait_until(lambda: len(sender.delivered(lambda e: e.tenant == "quick")) == 20)
        assert len(sender.of(lambda e: e.tenant == "slow")) <= 3  # its burst, maybe one more
        assert metrics.registry.get_sample_value("tocsin_proxy_host_held_total", {"reason": "rate"})
    finally:
        writer.drain(1)


def test_a_limited_hosts_requests_are_spaced_at_its_rate() -> None:
    rps, n = 20.0, 30
    gate = HostGate(BreakerPolicy(), HostLimits(default_rps=rps))
    sender = HostSender()
    writer, state, _ = make(sender, gate)
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(n)])
        wait_until(lambda: state.to_commit() == {("t", 0): n})
    finally:
        writer.drain(1)
    times = sorted(t for _, t in sender.sent)
    # A full bucket allows rps at once; each further request needs its own token.
    assert times[-1] - times[0] >= (n - rps) / rps * 0.95


def test_a_key_behind_a_rate_wait_stays_in_order_and_other_keys_go() -> None:
    gate = HostGate(BreakerPolicy(), parse_limits({"a": {"hosts": {"api.example": 1}}}, 0.0))
    sender = HostSender()
    writer, state, _ = make(sender, gate)
    first, second = fire(0, "a", f"{H}/x", key="k"), fire(1, "a", f"{H}/x", key="k")
    other = fire(2, "a", "http://elsewhere.example/x", key="j")
    try:
        start(writer, state, [first, second, other])
        wait_until(lambda: state.to_commit() == {("t", 0): 3})
    finally:
        writer.drain(1)
    order = [env for env, _ in sender.sent]
    assert order.index(first) < order.index(second) and order.index(other) < order.index(second)
    at = {env.offset: t for env, t in sender.sent}
    assert at[1] - at[0] >= 0.95  # one request a second to that host


def test_a_failing_host_is_backed_off_once_for_all_its_messages() -> None:
    """Ten messages to a host that is down: the breaker opens after 3 failures, and from
    then on one probe per open period reaches the host instead of ten retries each time.
    When it comes back, all ten are delivered."""
    open_s = 0.2
    gate = HostGate(BreakerPolicy(failures=3, open_s=open_s, open_max_s=open_s))
    down = threading.Event()
    down.set()
    sender = HostSender(lambda env: HttpResult(status=503 if down.is_set() else 200))
    writer, state, metrics = make(sender, gate, per_host_concurrency=1, max_retry_age_s=0)
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(10)])
        wait_until(lambda: gate.explain("a", H, time.monotonic()).breaker.opened_count >= 4)
        opened = gate.explain("a", H, time.monotonic()).breaker.opened_count
        attempts = [t for _, t in sender.sent]
        # 3 failures open it; each reopening after that took one failed probe (and one
        # more probe may be out now). Without the breaker: 10 messages retried each.
        assert len(attempts) <= 3 + opened
        probes = attempts[3:]
        assert all(b - a >= open_s * 0.95 for a, b in pairwise(probes))
        down.clear()
        wait_until(lambda: state.to_commit() == {("t", 0): 10})
    finally:
        writer.drain(1)
    assert gate.explain("a", H, time.monotonic()).breaker.state is BreakerState.CLOSED
    assert len(sender.delivered(lambda e: True)) == 10
    closed = metrics.registry.get_sample_value(
        "tocsin_proxy_breaker_transitions_total", {"state": "closed"}
    )
    assert closed == 1


def test_one_tenants_open_breaker_leaves_another_on_the_same_host_alone() -> None:
    gate = HostGate(BreakerPolicy(failures=2, open_s=30.0, open_max_s=30.0))
    sender = HostSender(lambda env: HttpResult(status=503 if env.tenant == "bad" else 200))
    writer, state, metrics = make(sender, gate)
    bad = [fire(i, "bad", f"{H}/bad") for i in range(5)]
    good = [fire(5 + i, "good", f"{H}/good") for i in range(20)]
    try:
        start(writer, state, bad)
        wait_until(lambda: gate.explain("bad", H, time.monotonic()).breaker.state.value == "open")
        state.push(good)
        writer.notify()
        wait_until(lambda: len(sender.delivered(lambda e: e.tenant == "good")) == 20)
        assert gate.explain("good", H, time.monotonic()).breaker.state is BreakerState.CLOSED
        # Meanwhile bad's messages were held by its breaker, not retried one by one.
        assert metrics.registry.get_sample_value("tocsin_proxy_host_held_total", {"reason": "open"})
    finally:
        writer.drain(1)


def test_messages_held_by_an_open_breaker_are_dead_lettered_at_their_retry_age() -> None:
    """The host never comes back within the retry age: every message ends in a dead letter
    (most never attempted), and every offset is done."""
    gate = HostGate(BreakerPolicy(failures=1, open_s=1.0, open_max_s=1.0))
    outbox = FakeOutbox()
    sender = HostSender(lambda env: HttpResult(status=503))
    writer, state, metrics = make(sender, gate, outbox=outbox, max_retry_age_s=0.5)
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(5)])
        wait_until(lambda: state.to_commit() == {("t", 0): 5})
    finally:
        writer.drain(1)
    letters = [orjson.loads(r.value) for r in outbox.records if r.topic == "dlq"]
    assert len(letters) == 5
    assert sum("circuit breaker open" in d["reason"] for d in letters) >= 4
    assert len(sender.sent) < 5  # the others were never sent to the dead host
    assert metrics.registry.get_sample_value(
        "tocsin_proxy_dead_letters_total", {"kind": "circuit_open"}
    )


def test_a_revoke_gives_back_the_messages_waiting_for_their_host() -> None:
    gate = HostGate(BreakerPolicy(failures=1, open_s=30.0, open_max_s=30.0))
    sender = HostSender(lambda env: HttpResult(status=503))
    writer, state, metrics = make(sender, gate, max_retry_age_s=0, per_host_concurrency=1)
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(4)])
        wait_until(lambda: state.snapshot(time.monotonic()).in_flight == 4 and sender.sent != [])
        wait_until(lambda: gate.explain("a", H, time.monotonic()).breaker.state.value == "open")
        # All four wait in the host's line: the three behind the first, and the first once
        # its retry comes back.
        wait_until(
            lambda: (
                metrics.registry.get_sample_value(
                    "tocsin_proxy_host_held_total", {"reason": "open"}
                )
                == 4
            )
        )
        assert len(sender.sent) == 1
        state.begin_revoke([("t", 0)])
        writer.freeze({("t", 0)})
        assert state.snapshot(time.monotonic()).in_flight == 0
        assert state.to_commit() == {}  # nothing done: the new owner delivers them
    finally:
        writer.drain(1)


def test_a_long_wait_for_the_host_parks_the_message_and_its_offset_commits() -> None:
    """One request per 10 s to the host, parking after 2 s: the first goes, the next two
    would wait 10 and 20 s, so they leave memory for the retry topic at once."""
    gate = HostGate(BreakerPolicy(), HostLimits(default_rps=0.1))
    sender = HostSender()
    outbox = AckingOutbox()
    writer, state, metrics = make(
        sender, gate, outbox=outbox, lot=ParkingLot(topic=RETRIES), park_after_s=2.0
    )
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(3)])
        wait_until(lambda: state.to_commit() == {("t", 0): 3})
    finally:
        writer.drain(1)
    assert len(sender.sent) == 1
    assert [r.topic for r in outbox.records].count(RETRIES) == 2
    assert (
        metrics.registry.get_sample_value("tocsin_proxy_parked_total", {"reason": "host_wait"}) == 2
    )


def test_a_failed_message_probes_before_fresh_ones_so_a_host_up_again_is_seen() -> None:
    """Every message fails its first attempt and is delivered on its second (a receiver
    that refuses what it sees first): after the breaker opens, the probe must be a message
    that already failed (it goes first in its host's line, having waited longest), which
    is delivered and closes the breaker. Fresh ones at the head would each fail as the
    probe, doubling the open period every time while the host is in fact answering."""
    gate = HostGate(BreakerPolicy(failures=3, open_s=0.1, open_max_s=0.8))
    seen: set[int] = set()
    lock = threading.Lock()

    def answer(env: Envelope) -> AttemptResult:
        with lock:
            first = env.offset not in seen
            seen.add(env.offset)
        return HttpResult(status=503 if first else 200)

    sender = HostSender(answer)
    writer, state, metrics = make(sender, gate, per_host_concurrency=4, max_retry_age_s=0)
    try:
        start(writer, state, [fire(i, "a", f"{H}/x") for i in range(12)])
        wait_until(lambda: state.to_commit() == {("t", 0): 12}, timeout_s=60)
    finally:
        writer.drain(1)
    transitions = {
        s: metrics.registry.get_sample_value("tocsin_proxy_breaker_transitions_total", {"state": s})
        or 0
        for s in ("open", "closed")
    }
    assert transitions["open"] >= 1
    # Every opening ended with its first probe delivered: no probe failed.
    assert transitions["open"] == transitions["closed"], transitions

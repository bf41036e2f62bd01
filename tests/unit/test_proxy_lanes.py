"""Both lanes' parkers sharing one ParkingLot: what one lane's rebalance or a refused park
does to the other lane's lines, and when the main lane parks at all; and the writer that
carries out what its parker says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import Ack, Headers, Outbox, OutRecord, RecordSink
from proxy.parker import Lane, Parker, ParkingLot, ParkReason, Step
from proxy.parking import Origin
from proxy.retry import ConnectFailure
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer
from tests.unit.test_proxy_writer import FakeSender

RETRIES = "retries"


class Msg:
    def __init__(self, partition: int) -> None:
        self._partition = partition

    def partition(self) -> int:
        return self._partition


class AckingOutbox:
    """Acknowledges every record at once, a parked one on retry partition ``partition``."""

    def __init__(self, partition: int = 0) -> None:
        self.partition = partition
        self.records: list[OutRecord] = []

    def send_all(self, records: Sequence[OutRecord], done: Callable[[], None]) -> None:
        for rec in records:
            self.records.append(rec)
            on_written = getattr(rec, "on_written", None)
            if on_written is not None:
                on_written(self.partition)
        done()


def settings(**kw: Any) -> ProxySettings:
    return ProxySettings(
        mode="generic",
        source_topic="t",
        endpoint_url="http://127.0.0.1:9/",
        metrics_port=0,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.01,
        **kw,
    )


def writers(
    outbox: Outbox | AckingOutbox, s: ProxySettings | None = None, bounds: Bounds | None = None
) -> tuple[Writer, Writer, SharedState, ParkingLot]:
    s = s or settings()
    lot = ParkingLot(topic=RETRIES)
    state = SharedState(bounds or Bounds())
    state.assign([("t", 0)])
    common: dict[str, Any] = dict(
        settings=s,
        metrics=ProxyMetrics(),
        outbox=outbox,
        dead_letter_topic="dlq",
        deliveries_topic=None,
        lot=lot,
    )
    main = Writer(state=state, **common)
    retry = Writer(state=SharedState(Bounds()), lane=Lane.RETRY, **common)
    return main, retry, state, lot


def envelope(state: SharedState, offset: int, key: bytes = b"K") -> Envelope:
    e = Envelope(
        topic="t",
        partition=0,
        offset=offset,
        key=key,
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(e, url="http://127.0.0.1:9/", timeout_s=1.0)
    state.push([e])
    return e


@dataclass
class Handed:
    """The writer's side of a parker: what it was woken for and handed back."""

    wakes: int = 0
    back: list[tuple[Envelope, float]] = field(default_factory=list)

    def wake(self) -> None:
        self.wakes += 1

    def hand_back(self, env: Envelope, not_before_s: float) -> None:
        self.back.append((env, not_before_s))


@dataclass
class Lanes:
    main: Parker
    retry: Parker
    state: SharedState
    lot: ParkingLot
    metrics: ProxyMetrics
    handed: Handed

    def evicted(self) -> float | None:
        return self.metrics.registry.get_sample_value("tocsin_proxy_park_lines_evicted_total")


def parkers(
    outbox: RecordSink, s: ProxySettings | None = None, bounds: Bounds | None = None
) -> Lanes:
    lot = ParkingLot(topic=RETRIES)
    state = SharedState(bounds or Bounds())
    state.assign([("t", 0)])
    metrics, handed = ProxyMetrics(), Handed()
    common: dict[str, Any] = dict(
        lot=lot,
        settings=s or settings(),
        metrics=metrics,
        outbox=outbox,
        dead_letter_topic="dlq",
        wake=handed.wake,
        hand_back=handed.hand_back,
    )
    main = Parker(lane=Lane.MAIN, state=state, **common)
    retry = Parker(lane=Lane.RETRY, state=SharedState(Bounds()), **common)
    return Lanes(main, retry, state, lot, metrics, handed)


def later() -> float:
    return time.monotonic() + 60


def test_a_park_hands_the_record_to_kafka_and_settles_the_offset_on_its_ack() -> None:
    outbox = AckingOutbox(partition=0)
    lanes = parkers(outbox)
    a = envelope(lanes.state, 0)
    assert lanes.state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    (rec,) = outbox.records
    assert rec.topic == RETRIES and rec.key == a.key and rec.value == a.value
    assert rec.headers is not None and rec.fallback is not None
    assert [k for k, _ in rec.headers] == ["tocsin-retry"]
    assert rec.fallback.topic == "dlq"  # refused for good: its dead letter instead
    assert lanes.state.to_commit() == {("t", 0): 1} and lanes.handed.wakes == 1
    assert lanes.state.snapshot(time.monotonic()).in_flight == 0


def test_a_record_too_large_to_park_stays_in_memory() -> None:
    outbox = AckingOutbox()
    lanes = parkers(outbox)
    a = envelope(lanes.state, 0)
    a.value = b"x" * 2_000_001
    assert lanes.state.take() is a
    assert not lanes.main.park(a, ParkReason.RETRYING, later())
    assert outbox.records == [] and not lanes.lot.lines.has_line(a.line_key)


def test_a_retry_lane_rebalance_keeps_the_main_lanes_lines_on_other_partitions() -> None:
    lanes = parkers(AckingOutbox(partition=0))
    lanes.retry.assigned({(RETRIES, 0), (RETRIES, 1)})
    a = envelope(lanes.state, 0)
    assert lanes.state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    key, lines = a.line_key, lanes.lot.lines
    assert lines.has_line(key)
    # The retries group rebalances: this proxy's retry lane loses partition 1 only; A sits
    # on partition 0, which it keeps, so B of the same key must still queue behind A.
    lanes.retry.revoked({(RETRIES, 1)})
    assert lines.has_line(key)
    lanes.retry.revoked({(RETRIES, 0)})  # A's own partition goes: its line too
    assert not lines.has_line(key)


def test_a_main_lane_revoke_drops_the_lines_of_its_source_partitions() -> None:
    lanes = parkers(AckingOutbox(partition=0))
    a = envelope(lanes.state, 0)
    assert lanes.state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    lanes.main.revoked({("t", 1)})
    assert lanes.lot.lines.has_line(a.line_key)
    lanes.main.revoked({("t", 0)})
    assert not lanes.lot.lines.has_line(a.line_key)


def test_a_message_behind_a_parked_one_of_its_key_is_parked_behind_it() -> None:
    outbox = AckingOutbox(partition=0)
    lanes = parkers(outbox)
    a, b = envelope(lanes.state, 0), envelope(lanes.state, 1)
    assert lanes.state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    assert lanes.state.take() is b
    assert lanes.main.before_attempt(b, time.monotonic(), tenant_busy=False).step is Step.PARKED
    assert len(outbox.records) == 2 and len(lanes.lot.lines) == 2
    assert lanes.metrics.registry.get_sample_value(
        "tocsin_proxy_parked_total", {"reason": "behind"}
    )


def test_the_retry_lane_attempts_only_the_head_of_a_line_and_waits_for_not_before() -> None:
    outbox = AckingOutbox(partition=0)
    lanes = parkers(outbox)
    key = ("t", 0, b"K")
    lanes.lot.lines.append(key, "head")
    lanes.lot.lines.append(key, "next")
    head, nxt = retry_envelope("head", key), retry_envelope("next", key)
    now = time.monotonic()
    assert lanes.retry.before_attempt(head, now, tenant_busy=False).step is Step.ATTEMPT
    assert lanes.retry.before_attempt(nxt, now, tenant_busy=False).step is Step.PARKED
    # Parked again under a new id, in its old place behind the head.
    assert [r.topic for r in outbox.records] == [RETRIES]
    assert len(lanes.lot.lines) == 2 and not lanes.lot.lines.holds(key, "next")
    assert lanes.lot.lines.is_head(key, "head")
    lanes.retry.finished(head)  # delivered: the one behind it is the head now
    assert len(lanes.lot.lines) == 1 and not lanes.lot.lines.holds(key, "head")
    waiting = retry_envelope("w", ("t", 0, b"W"), not_before_s=now + 5)
    before = lanes.retry.before_attempt(waiting, now, tenant_busy=False)
    assert before.step is Step.WAIT and before.wait_s == 5
    assert lanes.retry.should_park(head, now)  # the retry lane keeps no failure in memory


def retry_envelope(
    park_id: str, key: tuple[str, int, bytes], not_before_s: float | None = None
) -> Envelope:
    e = Envelope(
        topic=RETRIES,
        partition=0,
        offset=0,
        key=key[2],
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(e, url="http://127.0.0.1:9/", timeout_s=1.0)
    e.origin = Origin(topic=key[0], partition=key[1], offset=0, timestamp_ms=None)
    e.park_id = park_id
    e.not_before_s = not_before_s
    return e


def test_a_line_is_kept_only_while_this_proxys_retry_lane_owns_its_records() -> None:
    outbox = AckingOutbox(partition=3)  # the retry partition A of key K lands on
    lanes = parkers(outbox)
    state, lines = lanes.state, lanes.lot.lines
    lanes.retry.assigned({(RETRIES, 0), (RETRIES, 3)})
    a = envelope(state, 0)
    assert state.take() is a
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    assert lines.has_line(a.line_key)  # this proxy finishes A: K's next one waits
    lanes.retry.revoked({(RETRIES, 3)})
    assert not lines.has_line(a.line_key) and len(lines) == 0
    # Partition 3 is another proxy's now: a record parked there is finished unseen here,
    # so no line may wait for it (it would hold every later message of its key for ever).
    b = envelope(state, 1)
    assert state.take() is b
    assert lanes.main.park(b, ParkReason.RETRYING, later())
    assert not lines.has_line(b.line_key) and len(lines) == 0
    c = envelope(state, 2)
    assert state.take() is c
    # Attempted, not parked behind a line that never empties.
    assert lanes.main.before_attempt(c, time.monotonic(), tenant_busy=False).step is Step.ATTEMPT
    assert lanes.evicted() == 1


def test_a_line_parked_before_the_retry_lane_has_partitions_waits_for_its_assignment() -> None:
    outbox = AckingOutbox(partition=3)
    lanes = parkers(outbox)
    state, lines = lanes.state, lanes.lot.lines
    a, b = envelope(state, 0), envelope(state, 1, key=b"L")
    for env in (a, b):
        assert state.take() is env
    assert lanes.main.park(a, ParkReason.RETRYING, later())
    assert lines.has_line(a.line_key)  # the retries group is still forming: kept
    outbox.partition = 0
    assert lanes.main.park(b, ParkReason.RETRYING, later())
    lanes.retry.assigned({(RETRIES, 0)})  # then 3 turns out to be another proxy's
    assert not lines.has_line(a.line_key) and lines.has_line(b.line_key)
    assert lanes.evicted() == 1


class RefusingProducer:
    """A producer whose credentials do not cover the retry topic."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def produce(
        self,
        topic: str,
        *,
        value: bytes,
        key: bytes | None,
        headers: Headers | None,
        on_delivery: Ack,
        partition: int | None = None,
    ) -> None:
        if topic == RETRIES:
            on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), None)  # type: ignore[arg-type]
        else:
            self.written.append(topic)
            on_delivery(None, Msg(0))  # type: ignore[arg-type]


def refusing_outbox() -> tuple[Outbox, RefusingProducer]:
    outbox = Outbox({"bootstrap.servers": "127.0.0.1:1"})
    producer = RefusingProducer()
    outbox.producer = producer  # type: ignore[assignment]
    return outbox, producer


def test_a_refused_retry_topic_switches_parking_off_and_dead_letters_nothing() -> None:
    outbox, producer = refusing_outbox()
    lanes = parkers(outbox)
    state, lot = lanes.state, lanes.lot
    a = envelope(state, 0)
    assert state.take() is a
    not_before = later()
    assert lanes.main.park(a, ParkReason.RETRYING, not_before)
    assert producer.written == []  # no dead letter for a healthy message
    assert lot.refused is not None and not lot.lines.has_line(a.line_key)
    assert lanes.handed.back == [(a, not_before)] and not a.cancelled  # back to its writer
    assert state.snapshot(time.monotonic()).in_flight == 1  # still pending, offset not done
    assert state.to_commit() == {}
    assert lanes.metrics.registry.get_sample_value("tocsin_proxy_parking") == 0
    b = envelope(state, 1, key=b"other")
    assert state.take() is b
    assert not lanes.main.park(b, ParkReason.RETRYING, time.monotonic())  # parking is off
    assert not lanes.retry.park(b, ParkReason.RETRYING, time.monotonic())  # for both lanes


def test_a_writer_whose_park_is_refused_retries_in_memory_until_delivered() -> None:
    outbox, producer = refusing_outbox()
    http = FakeSender([ConnectFailure(detail="refused")])
    state = SharedState(Bounds())
    state.assign([("t", 0)])
    lot = ParkingLot(topic=RETRIES)
    writer = Writer(
        state=state,
        settings=settings(park_after_s=0.0),
        metrics=ProxyMetrics(),
        outbox=outbox,
        dead_letter_topic="dlq",
        deliveries_topic=None,
        lot=lot,
        http=http,
        kafka=FakeSender(),
    )
    a = envelope(state, 0)
    writer.start()
    try:
        writer.notify()
        deadline = time.monotonic() + 10
        while state.to_commit() != {("t", 0): 1} and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        writer.drain(1)
    assert lot.refused is not None  # its park after the failure was refused
    assert http.sent == [a, a] and state.to_commit() == {("t", 0): 1}
    assert producer.written == [] and writer.error is None


def tenant_envelopes(state: SharedState, n: int, tenant: str = "A") -> list[Envelope]:
    envs = []
    for i in range(n):
        e = Envelope(
            topic="t",
            partition=0,
            offset=i,
            key=f"k{i}".encode(),
            value=b"v",
            headers=[],
            timestamp_ms=None,
            read_s=time.monotonic(),
        )
        prepare_generic(e, url="http://127.0.0.1:9/", timeout_s=1.0)
        e.trigger = SimpleNamespace(  # type: ignore[assignment]
            tenant=tenant,
            trigger_id=f"t{i}",
            schedule_id=f"s{i}",
            traceparent=None,
            tracestate=None,
        )
        envs.append(e)
    state.push(envs)
    return envs


def test_a_lone_tenant_over_its_share_is_not_parked_while_the_bounds_have_room() -> None:
    outbox = AckingOutbox()
    lanes = parkers(outbox, bounds=Bounds(max_messages=100))
    tenant_envelopes(lanes.state, 30)  # 30% of the bound: over a 25% share, under half of it
    first = lanes.state.take()
    assert first is not None
    now = time.monotonic()
    # A healthy first attempt goes out, even with every writer of its tenant busy.
    assert lanes.main.before_attempt(first, now, tenant_busy=True).step is Step.ATTEMPT
    first.attempt_state = replace(first.attempt_state, failures=1, first_failure_s=now)
    assert not lanes.main.should_park(first, now)  # a retry stays in memory too
    assert not lanes.main.after_failure(first, now, 0.1)
    assert outbox.records == []


def test_a_tenant_over_its_share_is_parked_once_the_bounds_are_pressed() -> None:
    outbox = AckingOutbox()
    lanes = parkers(outbox, bounds=Bounds(max_messages=100))
    tenant_envelopes(lanes.state, 60)
    fresh = lanes.state.take()
    assert fresh is not None
    now = time.monotonic()
    # Its tenant has writers free: attempt it.
    assert lanes.main.before_attempt(fresh, now, tenant_busy=False).step is Step.ATTEMPT
    fresh.attempt_state = replace(fresh.attempt_state, failures=1, first_failure_s=now)
    assert lanes.main.should_park(fresh, now)  # failing: it leaves memory
    waiting = lanes.state.take()
    assert waiting is not None
    # Every writer its tenant may use is busy: it would only wait in memory, so it is parked.
    assert lanes.main.before_attempt(waiting, now, tenant_busy=True).step is Step.PARKED
    assert [r.topic for r in outbox.records] == [RETRIES]
    assert lanes.metrics.registry.get_sample_value(
        "tocsin_proxy_parked_total", {"reason": "tenant_share"}
    )


def test_a_message_failing_longer_than_park_after_is_parked_on_its_retry() -> None:
    outbox = AckingOutbox()
    lanes = parkers(outbox, settings(park_after_s=30.0))
    a = envelope(lanes.state, 0)
    assert lanes.state.take() is a
    now = time.monotonic()
    a.attempt_state = replace(a.attempt_state, failures=1, first_failure_s=now - 29.0)
    assert not lanes.main.after_failure(a, now, 0.1) and outbox.records == []
    a.attempt_state = replace(a.attempt_state, failures=2, first_failure_s=now - 30.0)
    assert lanes.main.after_failure(a, now, 0.1)
    assert [r.topic for r in outbox.records] == [RETRIES]
    assert lanes.metrics.registry.get_sample_value(
        "tocsin_proxy_parked_total", {"reason": "retrying"}
    )


class ThreadAckingOutbox(AckingOutbox):
    """Acknowledges from another thread, as the real producer's callbacks do."""

    def send_all(self, records: Sequence[OutRecord], done: Callable[[], None]) -> None:
        threading.Timer(0.05, super().send_all, args=(records, done)).start()


def test_a_parked_messages_acknowledgement_lets_its_keys_next_message_go() -> None:
    outbox = ThreadAckingOutbox(partition=0)
    main, retry, state, _lot = writers(outbox, settings(park_after_s=0.0))
    retry.assigned({(RETRIES, 0)})
    for offset in (0, 1):  # A and B of one key; the endpoint refuses connections
        envelope(state, offset)
    main.start()
    try:
        main.notify()
        deadline = time.monotonic() + 10
        while len(outbox.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        main.drain(1)
    # A parked after its failure; once Kafka has it, B (same key) is parked behind it.
    assert len(outbox.records) == 2, "the key's next message was never taken"
    assert state.to_commit() == {("t", 0): 2}

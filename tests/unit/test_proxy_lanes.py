"""Both lanes' writers sharing one ParkingLot: what one lane's rebalance or a refused park
does to the other lane's lines, and when the main lane parks at all."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import Outbox
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Lane, ParkingLot, ParkReason, Writer

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
        self.records: list[Any] = []

    def send_all(self, records: Any, done: Any) -> None:
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
    outbox: Any, s: ProxySettings | None = None, bounds: Bounds | None = None
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


def test_a_retry_lane_rebalance_keeps_the_main_lanes_lines_on_other_partitions() -> None:
    main, retry, state, lot = writers(AckingOutbox(partition=0))
    retry.assigned({(RETRIES, 0), (RETRIES, 1)})
    a = envelope(state, 0)
    assert state.take() is a
    assert main._park(a, ParkReason.RETRYING, time.monotonic() + 60)
    key = a.line_key
    assert lot.lines.has_line(key)
    # The retries group rebalances: this proxy's retry lane loses partition 1 only; A sits
    # on partition 0, which it keeps, so B of the same key must still queue behind A.
    asyncio.run(retry._freeze({(RETRIES, 1)}))
    assert lot.lines.has_line(key)
    asyncio.run(retry._freeze({(RETRIES, 0)}))  # A's own partition goes: its line too
    assert not lot.lines.has_line(key)


def test_a_line_is_kept_only_while_this_proxys_retry_lane_owns_its_records() -> None:
    outbox = AckingOutbox(partition=3)  # the retry partition A of key K lands on
    main, retry, state, lot = writers(outbox)
    retry.assigned({(RETRIES, 0), (RETRIES, 3)})
    a = envelope(state, 0)
    assert state.take() is a
    assert main._park(a, ParkReason.RETRYING, time.monotonic() + 60)
    assert lot.lines.has_line(a.line_key)  # this proxy finishes A: K's next one waits
    asyncio.run(retry._freeze({(RETRIES, 3)}))
    assert not lot.lines.has_line(a.line_key) and len(lot.lines) == 0
    # Partition 3 is another proxy's now: a record parked there is finished unseen here,
    # so no line may wait for it (it would hold every later message of its key for ever).
    b = envelope(state, 1)
    assert state.take() is b
    assert main._park(b, ParkReason.RETRYING, time.monotonic() + 60)
    assert not lot.lines.has_line(b.line_key) and len(lot.lines) == 0
    c = envelope(state, 2)
    assert state.take() is c
    assert not main._hold_back(c)  # attempted, not parked behind a line that never empties
    assert main._metrics.lines_evicted._value.get() == 1


def test_a_line_parked_before_the_retry_lane_has_partitions_waits_for_its_assignment() -> None:
    main, retry, state, lot = writers(AckingOutbox(partition=3))
    a, b = envelope(state, 0), envelope(state, 1, key=b"L")
    for env in (a, b):
        assert state.take() is env
    assert main._park(a, ParkReason.RETRYING, time.monotonic() + 60)
    assert lot.lines.has_line(a.line_key)  # the retries group is still forming: kept
    main._outbox.partition = 0  # type: ignore[attr-defined]
    assert main._park(b, ParkReason.RETRYING, time.monotonic() + 60)
    retry.assigned({(RETRIES, 0)})  # then 3 turns out to be another proxy's
    assert not lot.lines.has_line(a.line_key) and lot.lines.has_line(b.line_key)


class RefusingProducer:
    """A producer whose credentials do not cover the retry topic."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def produce(
        self, topic: str, *, value: bytes, key: bytes | None, headers: Any, on_delivery: Any
    ) -> None:
        if topic == RETRIES:
            on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), None)
        else:
            self.written.append(topic)
            on_delivery(None, Msg(0))


def test_a_refused_retry_topic_switches_parking_off_and_dead_letters_nothing() -> None:
    outbox = Outbox({"bootstrap.servers": "127.0.0.1:1"})
    producer = RefusingProducer()
    outbox.producer = producer  # type: ignore[assignment]
    main, _retry, state, lot = writers(outbox)
    a = envelope(state, 0)

    async def scenario() -> None:
        main._loop = asyncio.get_running_loop()
        assert state.take() is a
        main._park(a, ParkReason.RETRYING, time.monotonic() + 60)
        await asyncio.sleep(0)  # the refusal hands the message back on the writer's loop

    asyncio.run(scenario())
    assert producer.written == []  # no dead letter for a healthy message
    assert lot.refused is not None and not lot.lines.has_line(a.line_key)
    assert a in main._backoff and not a.cancelled  # waiting in memory for its retry
    assert state.snapshot(time.monotonic()).in_flight == 1  # still pending, offset not done
    assert state.to_commit() == {}
    assert main._metrics.parking._value.get() == 0
    b = envelope(state, 1, key=b"other")
    assert state.take() is b
    assert not main._park(b, ParkReason.RETRYING, time.monotonic())  # parking is off


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
            tenant=tenant, trigger_id=f"t{i}", schedule_id=f"s{i}"
        )
        envs.append(e)
    state.push(envs)
    return envs


def test_a_lone_tenant_over_its_share_is_not_parked_while_the_bounds_have_room() -> None:
    outbox = AckingOutbox()
    main, _retry, state, _lot = writers(outbox, bounds=Bounds(max_messages=100))
    tenant_envelopes(state, 30)  # 30% of the bound: over a 25% share, under half of it
    first = state.take()
    assert first is not None
    assert not main._hold_back(first)  # a healthy first attempt goes out
    first.attempt_state = replace(first.attempt_state, failures=1, first_failure_s=time.monotonic())
    assert not main._should_park(first, time.monotonic())  # a retry stays in memory too
    assert outbox.records == []


def test_a_tenant_over_its_share_is_parked_once_the_bounds_are_pressed() -> None:
    outbox = AckingOutbox()
    main, _retry, state, _lot = writers(outbox, bounds=Bounds(max_messages=100))
    tenant_envelopes(state, 60)
    fresh = state.take()
    assert fresh is not None
    assert not main._hold_back(fresh)  # its tenant has writers free: attempt it
    fresh.attempt_state = replace(fresh.attempt_state, failures=1, first_failure_s=time.monotonic())
    assert main._should_park(fresh, time.monotonic())  # failing: it leaves memory
    main._tenant_active["A"] = main._tenant_cap  # every writer A may use is busy
    waiting = state.take()
    assert waiting is not None
    assert main._hold_back(waiting)  # it would only wait in memory: parked
    assert [r.topic for r in outbox.records] == [RETRIES]


class ThreadAckingOutbox(AckingOutbox):
    """Acknowledges from another thread, as the real producer's callbacks do."""

    def send_all(self, records: Any, done: Any) -> None:
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

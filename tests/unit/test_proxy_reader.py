"""The reader's decisions with a fake consumer and writer: at the pending queue's
high-water mark pause the partitions holding pending messages (not the others), resume
under its low-water mark, and what it pushes, skips and marks committed."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.reader import FlowPlan, Reader, consumer_config, flow_plan
from proxy.settings import ProxySettings
from proxy.state import SharedState


def test_the_pause_resume_decision() -> None:
    a, b, c = ("t", 0), ("t", 1), ("t", 2)
    plan = flow_plan(want_paused=True, assigned=[a, b, c], holding={a, b}, paused=set())
    assert plan == FlowPlan(pause=frozenset({a, b}))  # c holds nothing: it is read on
    plan = flow_plan(want_paused=True, assigned=[a, b, c], holding={a, b}, paused={a, b})
    assert plan == FlowPlan()
    plan = flow_plan(want_paused=True, assigned=[a, b, c], holding={b, c}, paused={a, b})
    assert plan == FlowPlan(pause=frozenset({c}), resume=frozenset({a}))  # a drained
    plan = flow_plan(want_paused=False, assigned=[a, b, c], holding={a, b}, paused={a, b})
    assert plan == FlowPlan(resume=frozenset({a, b}))
    assert flow_plan(want_paused=False, assigned=[a], holding={a}, paused=set()) == FlowPlan()


class FakeConsumer:
    def __init__(self, *tps: tuple[str, int]) -> None:
        self.parts = [TopicPartition(t, p) for t, p in tps]
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []

    def assignment(self) -> list[TopicPartition]:
        return list(self.parts)

    def pause(self, parts: list[TopicPartition]) -> None:
        self.calls.append(("pause", [(p.topic, p.partition) for p in parts]))

    def resume(self, parts: list[TopicPartition]) -> None:
        self.calls.append(("resume", [(p.topic, p.partition) for p in parts]))


class FakeWriter:
    def __init__(self) -> None:
        self.notified = 0
        self.assigned_tps: list[set[tuple[str, int]]] = []

    def notify(self) -> None:
        self.notified += 1

    def assigned(self, tps: set[tuple[str, int]]) -> None:
        self.assigned_tps.append(tps)


def reader(state: SharedState, writer: FakeWriter) -> Reader:
    settings = ProxySettings(
        mode="generic", source_topic="t", endpoint_url="http://h/", metrics_port=0
    )

    def prepare(env: Envelope) -> None:
        prepare_generic(env, url="http://h/", timeout_s=1.0)

    return Reader(
        kafka_conf={},
        settings=settings,
        topics=["t"],
        state=state,
        writer=writer,
        outbox=None,
        metrics=ProxyMetrics(),  # type: ignore[arg-type]
        prepare=prepare,
        commit=lambda _c, _p: None,
    )


offsets = itertools.count()


def records(n: int, partition: int = 0) -> list[Message]:
    return [
        Message(
            topic="t",
            partition=partition,
            offset=next(offsets),
            key=b"k%d" % i,
            value=b"v",
            timestamp=(1, 123),
        )
        for i in range(n)
    ]


def drain(state: SharedState, n: int) -> None:
    for _ in range(n):
        env = state.take()
        assert env is not None
        state.release(env)


def test_the_reader_pauses_at_the_high_water_mark_and_resumes_under_the_low() -> None:
    state = SharedState(Bounds(max_messages=4, low_ratio=0.5))
    consumer = FakeConsumer(("t", 0), ("t", 1))
    r = reader(state, FakeWriter())
    r._on_assign(consumer, consumer.assignment())  # type: ignore[arg-type]
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls == []  # nothing pending: no call on the consumer
    r._ingest(records(3))
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls == []
    r._ingest(records(2, partition=1))  # 5: the bound is soft by one batch
    r._backpressure(consumer)  # type: ignore[arg-type]
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls == [("pause", [("t", 0), ("t", 1)])]
    assert r.paused_partitions == 2
    drain(state, 2)  # 3 left: over the low-water mark (2), still paused
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert len(consumer.calls) == 1
    drain(state, 1)
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls[-1] == ("resume", [("t", 0), ("t", 1)])
    assert r.paused_partitions == 0


def test_a_partition_holding_nothing_is_read_while_the_others_hold_the_bound() -> None:
    state = SharedState(Bounds(max_messages=2))
    consumer = FakeConsumer(("t", 0), ("t", 1))
    r = reader(state, FakeWriter())
    r._on_assign(consumer, consumer.assignment())  # type: ignore[arg-type]
    r._ingest(records(2))
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls == [("pause", [("t", 0)])] and r.paused_partitions == 1
    consumer.parts.append(TopicPartition("t", 2))
    r._on_assign(consumer, [TopicPartition("t", 2)])  # arrives unpaused, holding nothing
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert len(consumer.calls) == 1
    r._ingest(records(1, partition=1))
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls[-1] == ("pause", [("t", 1)])
    drain(state, 2)  # partition 0's two are done: 1 held, at the low-water mark
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls[-1] == ("resume", [("t", 0), ("t", 1)])
    assert r.paused_partitions == 0


def test_a_drained_partition_is_resumed_while_the_bound_is_still_full() -> None:
    state = SharedState(Bounds(max_messages=4, low_ratio=0.25))
    consumer = FakeConsumer(("t", 0), ("t", 1))
    r = reader(state, FakeWriter())
    r._on_assign(consumer, consumer.assignment())  # type: ignore[arg-type]
    r._ingest(records(1) + records(3, partition=1))
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls == [("pause", [("t", 0), ("t", 1)])]
    drain(state, 1)  # partition 0's one: 3 held, still over the low mark (1)
    r._backpressure(consumer)  # type: ignore[arg-type]
    assert consumer.calls[-1] == ("resume", [("t", 0)]) and r.paused_partitions == 1


def test_ingest_pushes_new_records_skips_errors_and_repeats_and_wakes_the_writer() -> None:
    state = SharedState(Bounds())
    writer = FakeWriter()
    r = reader(state, writer)
    r._on_assign(None, [TopicPartition("t", 0)])  # type: ignore[arg-type]
    assert writer.assigned_tps == [{("t", 0)}] and r.assignment == {("t", 0)}
    first = records(2)
    eof = Message(topic="t", partition=0, error=KafkaError(KafkaError._PARTITION_EOF))
    r._ingest([*first, eof])
    assert writer.notified == 1
    env = state.take()
    assert env is not None and env.request is not None and env.timestamp_ms == 123
    r._ingest(first)  # read again (a seek back): nothing new, no wake-up
    assert writer.notified == 1
    assert state.snapshot(0.0).held == 2


def test_a_commit_result_marks_only_the_partitions_kafka_accepted() -> None:
    state = SharedState(Bounds())
    state.assign([("t", 0), ("t", 1)])
    r = reader(state, FakeWriter())
    envs: list[Any] = []
    for p in (0, 1):
        e = Envelope(
            topic="t",
            partition=p,
            offset=0,
            key=None,
            value=b"v",
            headers=[],
            timestamp_ms=None,
            read_s=0.0,
        )
        envs.append(e)
    state.push(envs)
    for e in envs:
        assert state.take() is e
        state.release(e)
        state.offset_done(e)
    assert state.to_commit() == {("t", 0): 1, ("t", 1): 1}
    failed = SimpleNamespace(
        topic="t", partition=1, offset=1, error=KafkaError(KafkaError.REBALANCE_IN_PROGRESS)
    )
    unset = TopicPartition("t", 1)  # no offset: nothing was committed for it
    r._on_commit(None, [TopicPartition("t", 0, 1), failed, unset])  # type: ignore[list-item]
    assert state.to_commit() == {("t", 1): 1}


class TrickleConsumer:
    """A consumer whose ``ready`` records are fetched already and whose ``arriving`` ones come
    during a blocking call; it records each call's (num_messages, timeout)."""

    def __init__(self, ready: list[Message], arriving: list[Message]) -> None:
        self.ready, self.arriving = ready, arriving
        self.calls: list[tuple[int, float]] = []
        self.on_consume: Any = None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        self.calls.append((num_messages, timeout))
        if not self.ready and timeout > 0:
            self.ready, self.arriving = self.arriving[:1], self.arriving[1:]
        out, self.ready = self.ready[:num_messages], self.ready[num_messages:]
        if self.on_consume is not None:
            self.on_consume()
        return out

    def close(self) -> None:
        pass


def one_turn(consumer: TrickleConsumer, writer: FakeWriter) -> SharedState:
    """Run the reader's poll loop for one turn on this thread."""
    state = SharedState(Bounds())
    r = reader(state, writer)
    r._on_assign(None, [TopicPartition("t", 0)])  # type: ignore[arg-type]
    consumer.on_consume = r.stop_reading
    consumer.parts = []  # type: ignore[attr-defined]
    consumer.assignment = lambda: []  # type: ignore[attr-defined]
    r.consumer = consumer  # type: ignore[assignment]
    r._may_close.set()
    r._run()
    assert r.error is None
    return state


def test_records_already_fetched_are_read_without_waiting_for_a_full_batch() -> None:
    consumer = TrickleConsumer(ready=records(3), arriving=[])
    writer = FakeWriter()
    state = one_turn(consumer, writer)
    assert consumer.calls == [(500, 0)]
    assert state.snapshot(0.0).held == 3 and writer.notified == 1


def test_with_nothing_fetched_the_reader_waits_for_one_record_then_takes_what_came() -> None:
    consumer = TrickleConsumer(ready=[], arriving=records(1))
    state = one_turn(consumer, FakeWriter())
    # Only the wait for the first record blocks; the rest of the batch is taken as it is.
    assert consumer.calls == [(500, 0), (1, 0.1), (499, 0)]
    assert state.snapshot(0.0).held == 1


def test_the_consumer_finds_a_moved_coordinator_well_within_its_session() -> None:
    # librdkafka gives a heartbeat the whole session to be answered: only a coordinator
    # query tells a member that its hung coordinator has been replaced, and only
    # heartbeats answered often keep most of the session for finding the new one.
    for session_s in (6.0, 10.0, 30.0):
        conf = consumer_config({}, ProxySettings(session_timeout_s=session_s))
        query_ms = conf["coordinator.query.interval.ms"]
        heartbeat_ms = conf["heartbeat.interval.ms"]
        assert query_ms <= 1000
        assert heartbeat_ms <= session_s * 1000 / 5
        # What is left of the session when the coordinator stops answering, less the
        # fencing (the operator's 3 s) and a query interval, still leaves a heartbeat.
        assert session_s * 1000 - heartbeat_ms - 3000 - query_ms >= heartbeat_ms


def test_the_consumer_follows_a_moved_leader_within_a_second_and_never_slower_than_told() -> None:
    # A fetch sent to a hung leader is never answered: only a metadata refresh tells the
    # consumer where its partition went once the controller has fenced that broker.
    conf = consumer_config({"topic.metadata.refresh.interval.ms": 5000}, ProxySettings())
    assert conf["topic.metadata.refresh.interval.ms"] <= 1000
    # An operator's shorter interval for every client is kept.
    conf = consumer_config({"topic.metadata.refresh.interval.ms": 200}, ProxySettings())
    assert conf["topic.metadata.refresh.interval.ms"] == 200

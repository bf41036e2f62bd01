"""The reader's poll loop against a consumer that fetches the way librdkafka does where it
matters for fairness: one partition's fetch per call, always in the same partition order
(as after every resume), and a paused partition's fetched records dropped, fetched again
from its position once it is resumed. A partition whose records keep coming second must
still be read while the first one keeps the pending bound full."""

from __future__ import annotations

from collections.abc import Callable

from confluent_kafka import Message, TopicPartition

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.reader import Reader
from proxy.settings import ProxySettings
from proxy.state import SharedState


class FakeWriter:
    def notify(self) -> None:
        pass

    def assigned(self, tps: set[tuple[str, int]]) -> None:
        pass


def reader(state: SharedState) -> Reader:
    def prepare(env: Envelope) -> None:
        prepare_generic(env, url="http://h/", timeout_s=1.0)

    return Reader(
        kafka_conf={},
        settings=ProxySettings(
            mode="generic", source_topic="t", endpoint_url="http://h/", metrics_port=0
        ),
        topics=["t"],
        state=state,
        writer=FakeWriter(),  # type: ignore[arg-type]
        outbox=None,  # type: ignore[arg-type]
        metrics=ProxyMetrics(),
        prepare=prepare,
        commit=lambda _c, _p: None,
    )


class FetchingConsumer:
    def __init__(self, logs: dict[int, list[Message]], fetch: int) -> None:
        self.logs, self.fetch = logs, fetch
        self.positions = dict.fromkeys(logs, 0)
        self.paused: set[int] = set()
        self.calls = 0
        self.before_consume: Callable[[], None] = lambda: None

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("t", p) for p in sorted(self.logs)]

    def pause(self, parts: list[TopicPartition]) -> None:
        self.paused.update(p.partition for p in parts)

    def resume(self, parts: list[TopicPartition]) -> None:
        self.paused.difference_update(p.partition for p in parts)

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        self.calls += 1
        self.before_consume()
        for p in sorted(self.logs):
            pos = self.positions[p]
            if p in self.paused or pos >= len(self.logs[p]):
                continue
            got = self.logs[p][pos : pos + min(num_messages, self.fetch)]
            self.positions[p] = pos + len(got)
            return got
        return []

    def close(self) -> None:
        pass


def log(partition: int, n: int) -> list[Message]:
    return [
        Message(topic="t", partition=partition, offset=o, key=b"%d-%d" % (partition, o), value=b"v")
        for o in range(n)
    ]


def run(state: SharedState, consumer: FetchingConsumer, calls: int) -> None:
    """The reader's poll loop on this thread until ``calls`` consume calls were made."""
    r = reader(state)
    r._on_assign(None, consumer.assignment())  # type: ignore[arg-type]
    before = consumer.before_consume

    def stop_after() -> None:
        if consumer.calls >= calls:
            r.stop_reading()
        before()

    consumer.before_consume = stop_after
    r.consumer = consumer  # type: ignore[assignment]
    r._may_close.set()
    r._run()
    assert r.error is None


def test_a_partition_fetched_second_is_read_while_the_first_refills_the_bound() -> None:
    """Partition 0 always has more (a failing tenant's messages parked again and again);
    each of its reads fills the bound, and its messages are done before the next turn."""
    state = SharedState(Bounds(max_messages=4, low_ratio=0.5))
    consumer = FetchingConsumer({0: log(0, 1000), 1: log(1, 3)}, fetch=4)
    done: list[Envelope] = []

    def writer_finishes_what_is_held() -> None:
        while (env := state.take()) is not None:
            state.release(env)
            done.append(env)

    consumer.before_consume = writer_finishes_what_is_held
    run(state, consumer, calls=20)
    assert [e.offset for e in done if e.partition == 1] == [0, 1, 2]


def test_a_partition_holding_nothing_is_read_while_another_holds_the_bound() -> None:
    """Nothing is ever done (a tenant failing in memory): partition 1 is read all the same,
    and what is held stays within the bound plus one read of each partition."""
    state = SharedState(Bounds(max_messages=4, low_ratio=0.5))
    consumer = FetchingConsumer({0: log(0, 1000), 1: log(1, 3)}, fetch=4)
    run(state, consumer, calls=20)
    assert consumer.positions == {0: 4, 1: 3}
    assert state.snapshot(0.0).held == 4 + 3

"""The outbox with Kafka down and the producer's local queue full, and the order of the
records it holds (``OutRecord.later``) against those it produces at once.

A flush (a revoke, a stop) must return by its timeout whatever Kafka does: what it leaves
unacknowledged is read again by the next owner, since an offset is done only on Kafka's
acknowledgement, and what it leaves held is produced once Kafka is back. Per-key order on a
topic must hold between held records and records produced at once (a park's dead letter,
a group that may not wait)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from proxy import outbox as outbox_module
from proxy.outbox import Outbox, OutRecord
from tests.fakes import FakeKafkaProducer, FakeMonotonic


def outbox(fake: FakeKafkaProducer) -> Outbox:
    ob = Outbox({"bootstrap.servers": "127.0.0.1:1"})
    ob.producer = fake  # type: ignore[assignment]
    ob.monotonic = fake.clock
    return ob


def held(topic: str, key: bytes, value: bytes) -> OutRecord:
    return OutRecord(topic, key, value, later=True)


def full_and_down(queue_max: int = 3) -> tuple[Outbox, FakeKafkaProducer, list[str]]:
    """An outbox whose local queue is full of ``queue_max`` records, one held group behind
    them, and Kafka down; ``done`` lists the groups Kafka has acknowledged."""
    fake = FakeKafkaProducer(FakeMonotonic(), queue_max=queue_max)
    ob = outbox(fake)
    done: list[str] = []
    for i in range(queue_max):
        name = f"q{i}"
        ob.send_all([OutRecord("out", b"k", name.encode())], lambda n=name: done.append(n))
    fake.down = True
    ob.send_all([held("out", b"k", b"h")], lambda: done.append("h"))
    return ob, fake, done


def back_up(ob: Outbox, fake: FakeKafkaProducer) -> None:
    """Kafka is back: the committer's rounds and polls until nothing is left."""
    fake.down = False
    for _ in range(10):
        ob.send_deferred()
        fake.poll(0)


def test_a_flush_returns_by_its_timeout_with_kafka_down_and_loses_nothing() -> None:
    ob, fake, done = full_and_down()
    t0 = fake.clock()
    left = ob.flush(5.0)
    assert fake.clock() - t0 <= 5.0
    assert left == 4  # three unacknowledged, one still held
    back_up(ob, fake)
    assert [v for _, _, v in fake.written] == [b"q0", b"q1", b"q2", b"h"]
    assert done == ["q0", "q1", "q2", "h"]


def test_a_round_never_waits_for_room_in_the_local_queue() -> None:
    # The committer's round holds the lock a flush waits for: it must not wait on Kafka.
    ob, fake, done = full_and_down()
    ob.send_deferred()
    assert fake.waited_s == 0
    back_up(ob, fake)
    assert done == ["q0", "q1", "q2", "h"]


def test_records_timed_out_on_a_full_queue_are_produced_again_without_waiting() -> None:
    # Past message.timeout.ms each record's delivery callback produces it again while its
    # own room is not yet freed: waiting there for room polls callbacks inside callbacks.
    ob, fake, done = full_and_down()
    left = ob.flush(65.0)  # two message timeouts
    assert left == 4
    back_up(ob, fake)
    assert sorted(v for _, _, v in fake.written) == [b"h", b"q0", b"q1", b"q2"]
    assert sorted(done) == ["h", "q0", "q1", "q2"]


@pytest.mark.parametrize("refused", ["at_produce", "on_ack"])
def test_a_parks_dead_letter_comes_after_the_held_dead_letter_of_its_key(refused: str) -> None:
    fake = FakeKafkaProducer()
    (fake.refuse_at_produce if refused == "at_produce" else fake.refuse_on_ack).add("retries")
    ob = outbox(fake)
    ob.send_all([held("dlq", b"k", b"first dead letter")], lambda: None)
    park = OutRecord(
        "retries", b"k", b"parked", fallback=OutRecord("dlq", b"k", b"second, coordinates")
    )
    ob.send_all([park], lambda: None)
    fake.poll(0)  # Kafka's answer to the park
    back_up(ob, fake)
    assert [v for t, _, v in fake.written if t == "dlq"] == [
        b"first dead letter",
        b"second, coordinates",
    ]


def test_a_group_that_may_not_wait_does_not_overtake_the_held_ones() -> None:
    fake = FakeKafkaProducer()
    ob = outbox(fake)
    ob.send_all([held("dlq", b"k", b"1")], lambda: None)
    ob.send_all([held("dlq", b"k", b"2"), OutRecord("dlq", b"k", b"3")], lambda: None)
    back_up(ob, fake)
    assert [v for _, _, v in fake.written] == [b"1", b"2", b"3"]


def test_records_produced_again_after_a_timeout_keep_their_order() -> None:
    # Each timed-out record's room is freed after its callback: the first record's retry
    # finds the queue full and is held, the second's finds room. It must not go first.
    fake = FakeKafkaProducer(FakeMonotonic(), queue_max=2)
    ob = outbox(fake)
    for value in (b"1", b"2"):
        ob.send_all([OutRecord("dlq", b"k", value)], lambda: None)
    fake.down = True
    ob.flush(35.0)  # one message timeout
    back_up(ob, fake)
    assert [v for _, _, v in fake.written] == [b"1", b"2"]


class _PollsDuringProduce(FakeKafkaProducer):
    """Runs ``between`` on another thread (and waits for it) once a record of value
    ``at`` has been produced: another thread's poll serving a delivery callback while a
    round is between two of its records."""

    def __init__(self, at: bytes, **kwargs: Any) -> None:
        super().__init__(FakeMonotonic(), **kwargs)
        self.at = at
        self.between: Callable[[], object] | None = None

    def produce(self, topic: str, value: bytes | None = None, *a: Any, **kw: Any) -> None:
        super().produce(topic, value, *a, **kw)
        if value == self.at and self.between is not None:
            between, self.between = self.between, None
            other = threading.Thread(target=between)
            other.start()
            other.join()


def test_a_record_produced_again_on_another_thread_does_not_overtake_a_rounds() -> None:
    # Records 1 and 2 time out on a full queue and are held to be produced again; 3 times
    # out while a round (the writer's, or the committer's) has taken 1 and 2 but produced
    # only 1. Its callback, on the thread polling meanwhile, must not produce 3 before 2.
    fake = _PollsDuringProduce(b"1", queue_max=3)
    ob = outbox(fake)
    for value in (b"1", b"2"):
        ob.send_all([OutRecord("dlq", b"k", value)], lambda: None)
    fake.clock.advance(10.0)
    ob.send_all([OutRecord("dlq", b"k", b"3")], lambda: None)
    fake.down = True
    fake.poll(21.0)  # 1 and 2 time out: the queue is full, so both are held
    assert ob.held_records() == 2
    fake.between = lambda: fake.poll(10.0)  # 3 times out, on another thread
    ob.send_deferred()
    back_up(ob, fake)
    assert [v for _, _, v in fake.written] == [b"1", b"2", b"3"]


class _BackOnceWaitedFor(FakeKafkaProducer):
    """Kafka comes back once a caller has waited a second for room."""

    def _wait(self, timeout_s: float) -> None:
        super()._wait(timeout_s)
        if self.waited_s >= 1.0:
            self.down = False


def test_held_groups_stay_within_their_bound_across_rounds_with_kafka_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A round that finds no room puts what it took back; it must stay counted by
    # MAX_DEFERRED, so that past the bound a caller waits for room instead of the held
    # records growing with every round of an outage.
    monkeypatch.setattr(outbox_module, "MAX_DEFERRED", 2)
    fake = _BackOnceWaitedFor(FakeMonotonic(), queue_max=3)
    ob = outbox(fake)
    for i in range(3):
        ob.send_all([OutRecord("out", b"k", b"q%d" % i)], lambda: None)
    fake.down = True
    most = 0
    for i in range(10):
        ob.send_deferred()  # the committer's round, every DEFER_S
        ob.send_all([held("out", b"k", b"x%d" % i)], lambda: None)
        most = max(most, ob.held_records())
    assert fake.waited_s > 0  # a caller past the bound waited for room
    assert most <= 2

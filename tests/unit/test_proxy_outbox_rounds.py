"""Outcome records produced in rounds (``OutRecord.later``): held by the outbox until the
committer's next round or a flush, in the order given, the offset done only on Kafka's
acknowledgement; parks and Kafka callbacks are never held."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from proxy import outbox as outbox_module
from proxy.committer import Committer
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import Outbox, OutRecord
from proxy.retry import DeadLetter, Done, Retry
from proxy.state import SharedState
from tests.unit.test_proxy_outcomes import publisher
from tests.unit.test_proxy_writer import fire


class FakeProducer:
    """Records produce calls (value, delivery callback); ``flush`` reports what is
    unacknowledged and acknowledges nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, Any]] = []
        self.flushed_after: list[int] = []

    def produce(self, topic: str, *, value: bytes, on_delivery: Any, **_: Any) -> None:
        self.calls.append((value, on_delivery))

    def flush(self, timeout: float) -> int:
        self.flushed_after.append(len(self.calls))
        return len(self.calls)


def outbox() -> tuple[Outbox, FakeProducer]:
    ob = Outbox({"bootstrap.servers": "127.0.0.1:1"})
    fake = FakeProducer()
    ob.producer = fake  # type: ignore[assignment]
    return ob, fake


def later(value: bytes) -> OutRecord:
    return OutRecord("out", None, value, later=True)


def test_later_records_wait_for_the_round_and_go_in_the_order_given() -> None:
    ob, fake = outbox()
    done: list[str] = []
    ob.send_all([later(b"a1"), later(b"a2")], lambda: done.append("a"))
    ob.send_all([later(b"b")], lambda: done.append("b"))
    assert fake.calls == []  # held: nothing produced from the caller's thread
    ob.send_deferred()
    assert [v for v, _ in fake.calls] == [b"a1", b"a2", b"b"]
    ob.send_deferred()
    assert len(fake.calls) == 3  # each produced once
    # Done (the source offset) only once Kafka has every record of the group.
    fake.calls[0][1](None, None)
    fake.calls[2][1](None, None)
    assert done == ["b"]
    fake.calls[1][1](None, None)
    assert done == ["b", "a"]


def test_records_someone_waits_for_are_produced_at_once() -> None:
    ob, fake = outbox()
    ob.send_all([OutRecord("retries", b"k", b"parked")], lambda: None)
    # A group with one record that may not wait goes whole, at once.
    ob.send_all([later(b"dead letter"), OutRecord("out", None, b"now")], lambda: None)
    assert [v for v, _ in fake.calls] == [b"parked", b"dead letter", b"now"]


def test_a_flush_produces_what_is_held_before_it_waits() -> None:
    # A revoke flushes the outbox, then commits what is done: held records must be on
    # their way by then, or their messages would be read again by the next owner.
    ob, fake = outbox()
    ob.send_all([later(b"x")], lambda: None)
    assert ob.flush(0.1) == 1
    assert fake.flushed_after == [1]


def test_past_the_bound_a_group_is_produced_at_once_after_those_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(outbox_module, "MAX_DEFERRED", 2)
    ob, fake = outbox()
    for value in (b"1", b"2"):
        ob.send_all([later(value)], lambda: None)
    assert fake.calls == []
    ob.send_all([later(b"3")], lambda: None)
    assert [v for v, _ in fake.calls] == [b"1", b"2", b"3"]


def test_outcome_records_are_marked_for_the_round_and_parks_are_not() -> None:
    pub, sink, offsets, _ = publisher()
    env = fire(0, {"type": "http", "url": "http://r.example/hook"})
    pub.publish(env, Done(status=200), "2xx", time.monotonic())
    pub.publish(env, DeadLetter(reason="HTTP 700: x", status=700), "7xx", time.monotonic())
    pub.attempt_failed(env, Retry(after_s=1.0, reason="HTTP 503"), "5xx")
    assert len(sink.records) == 4
    assert all(rec.later for rec in sink.records)
    # The dead letter's smaller form is written only on a refusal, at once.
    assert all(rec.fallback is None or not rec.fallback.later for rec in sink.records)
    assert offsets.done == []


class RoundsOutbox:
    """What the committer needs of an outbox; counts the rounds it is asked for."""

    def __init__(self) -> None:
        self.rounds = 0
        self.round_done = threading.Event()

    def poll(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.01))

    def send_deferred(self) -> None:
        self.rounds += 1
        if self.rounds >= 3:
            self.round_done.set()


def test_the_committer_thread_produces_the_held_records_round_after_round() -> None:
    ob = RoundsOutbox()
    committer = Committer(
        state=SharedState(Bounds()),
        outbox=ob,  # type: ignore[arg-type]
        metrics=ProxyMetrics(),
        interval_s=5.0,
        request_commit=lambda: None,
        paused=lambda: 0,
    )
    committer.start()
    try:
        assert ob.round_done.wait(10)
    finally:
        committer.stop()
    assert committer.error is None

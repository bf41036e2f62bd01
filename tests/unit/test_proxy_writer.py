"""The writer's slot scheduling with fake senders: which sender each message goes to, what
it does with the verdict, its per-host cap and retries, and that a failing attempt task or
timer is never silent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from proxy.envelope import Envelope, prepare_fire, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import OutRecord
from proxy.retry import AttemptResult, ConnectFailure, HttpResult, KafkaResult, KafkaVerdict
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer
from topics.codec import decode_trigger


class FakeSender:
    """Answers from ``results`` in turn (then ``default``); while ``gate`` is clear every
    attempt waits, so a test can see how many run at once."""

    def __init__(
        self,
        results: Iterable[AttemptResult | Exception] = (),
        default: AttemptResult | None = None,
    ) -> None:
        self.results: deque[AttemptResult | Exception] = deque(results)
        self.default = default or HttpResult(status=200)
        self.sent: list[Envelope] = []
        self.gate = threading.Event()
        self.gate.set()
        self.running = 0
        self.most_running = 0

    async def send(self, env: Envelope) -> AttemptResult:
        self.sent.append(env)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if not self.gate.is_set():
                await asyncio.to_thread(self.gate.wait)
        finally:
            self.running -= 1
        result = self.results.popleft() if self.results else self.default
        if isinstance(result, Exception):
            raise result
        return result


class FakeOutbox:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.records: list[OutRecord] = []

    def send_all(self, records: list[OutRecord], done: Callable[[], None]) -> None:
        if self.fail:
            raise RuntimeError("producer broke")
        self.records.extend(records)
        done()


def make_writer(
    http: FakeSender, kafka: FakeSender | None = None, outbox: FakeOutbox | None = None, **kw: Any
) -> tuple[Writer, SharedState]:
    settings = ProxySettings(
        mode="generic",
        source_topic="t",
        endpoint_url="http://h/",
        metrics_port=0,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.01,
        **kw,
    )
    state = SharedState(Bounds())
    state.assign([("t", 0)])
    writer = Writer(
        state=state,
        settings=settings,
        metrics=ProxyMetrics(),
        outbox=outbox or FakeOutbox(),  # type: ignore[arg-type]
        dead_letter_topic="dlq",
        deliveries_topic="out",
        http=http,
        kafka=kafka or FakeSender(),
    )
    return writer, state


def generic(offset: int, key: bytes = b"k", url: str = "http://h/") -> Envelope:
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
    prepare_generic(e, url=url, timeout_s=1.0)
    return e


def fire(offset: int, callback: dict[str, Any]) -> Envelope:
    doc = {
        "trigger_id": f"t{offset}",
        "schedule_id": f"s{offset}",
        "tenant": "a",
        "due_ms": 1,
        "emitted_ms": 2,
        "attempt": 1,
        "order_key": f"s{offset}",
        "payload": {"n": offset},
        "callback": callback,
    }
    e = Envelope(
        topic="t",
        partition=0,
        offset=offset,
        key=f"s{offset}".encode(),
        value=orjson.dumps(doc),
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_fire(e, decode_trigger)
    return e


def run_until(
    writer: Writer, state: SharedState, envs: list[Envelope], done: Callable[[], bool]
) -> None:
    writer.start()
    try:
        state.push(envs)
        writer.notify()
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        writer.drain(1)


def test_each_message_goes_to_the_sender_of_its_callback_kind() -> None:
    http, kafka = FakeSender(), FakeSender(default=KafkaResult(verdict=KafkaVerdict.ACKED))
    writer, state = make_writer(http, kafka)
    to_http = fire(0, {"type": "http", "url": "http://r.example/hook"})
    to_kafka = fire(1, {"type": "kafka", "topic": "sink"})
    broken = fire(2, {"type": "http", "url": "ftp://r.example/"})
    assert broken.invalid is not None
    run_until(
        writer, state, [to_http, to_kafka, broken], lambda: state.to_commit() == {("t", 0): 3}
    )
    assert http.sent == [to_http] and kafka.sent == [to_kafka]  # the invalid one: neither
    assert state.to_commit() == {("t", 0): 3}


def test_a_delivered_message_publishes_its_outcome_and_its_offset_is_done() -> None:
    outbox = FakeOutbox()
    kafka = FakeSender(default=KafkaResult(verdict=KafkaVerdict.ACKED))
    writer, state = make_writer(FakeSender(), kafka, outbox)
    env = fire(0, {"type": "kafka", "topic": "sink"})
    run_until(writer, state, [env], lambda: state.to_commit() == {("t", 0): 1})
    (rec,) = outbox.records
    doc = orjson.loads(rec.value)
    assert rec.topic == "out" and (doc["outcome"], doc["status_code"]) == ("delivered", 200)


def test_a_failure_is_retried_until_the_sender_delivers() -> None:
    http = FakeSender([HttpResult(status=503), ConnectFailure(detail="refused")])
    writer, state = make_writer(http)
    env = generic(0)
    run_until(writer, state, [env], lambda: state.to_commit() == {("t", 0): 1})
    assert http.sent == [env, env, env]
    assert env.attempt_state.attempts == 3 and env.attempt_state.failures == 2


def test_a_sender_that_raises_is_retried_not_lost() -> None:
    http = FakeSender([ValueError("a bug in a sender")])
    writer, state = make_writer(http)
    run_until(writer, state, [generic(0)], lambda: state.to_commit() == {("t", 0): 1})
    assert len(http.sent) == 2 and writer.error is None


def test_a_7xx_is_dead_lettered_and_its_offset_done() -> None:
    outbox = FakeOutbox()
    writer, state = make_writer(FakeSender([HttpResult(status=700)]), outbox=outbox)
    run_until(writer, state, [generic(0)], lambda: state.to_commit() == {("t", 0): 1})
    assert [r.topic for r in outbox.records] == ["dlq"]


def test_one_host_gets_at_most_its_cap_of_writers() -> None:
    http = FakeSender()
    http.gate.clear()
    writer, state = make_writer(http, concurrency=8, per_host_concurrency=2)
    envs = [generic(i, key=f"k{i}".encode()) for i in range(5)]
    writer.start()
    try:
        state.push(envs)
        writer.notify()
        deadline = time.monotonic() + 10
        while len(http.sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # room for a third attempt to start, which it must not
        assert len(http.sent) == 2
        http.gate.set()
        while state.to_commit() != {("t", 0): 5} and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        writer.drain(1)
    assert http.most_running == 2 and state.to_commit() == {("t", 0): 5}


def test_a_key_waits_for_its_earlier_message_to_finish() -> None:
    http = FakeSender([HttpResult(status=500)])
    writer, state = make_writer(http)
    a, b = generic(0), generic(1)
    run_until(writer, state, [a, b], lambda: state.to_commit() == {("t", 0): 2})
    assert http.sent == [a, a, b]  # b never overtook a's retry


def test_a_failing_attempt_task_marks_the_writer_failed() -> None:
    # 700 is dead-lettered at once; writing the dead letter raises.
    writer, state = make_writer(FakeSender([HttpResult(status=700)]), outbox=FakeOutbox(fail=True))
    run_until(writer, state, [generic(0)], lambda: writer.error is not None)
    assert isinstance(writer.error, RuntimeError)


def test_a_failing_timer_callback_marks_the_writer_failed() -> None:
    writer, _ = make_writer(FakeSender())
    writer.start()
    try:
        assert writer._loop is not None

        def boom() -> None:
            raise ZeroDivisionError("a retry timer broke")

        writer._loop.call_soon_threadsafe(boom)
        deadline = time.monotonic() + 10
        while writer.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert isinstance(writer.error, ZeroDivisionError)
    finally:
        writer.drain(1)

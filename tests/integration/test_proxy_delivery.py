"""The delivery proxy against real Kafka and a real local aiohttp receiver.

Covers per-key order under concurrency and retries, every return-code class, Retry-After,
poison pills, dead-letter contents, backpressure and fires mode. Each test uses its own
topics and consumer group (uuid suffix). No timing assertions: tests wait for outcomes with
generous deadlines and assert on what the receiver and the topics saw.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import pytest
from aiohttp import web
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from base.settings import Settings
from proxy.app import ProxyApp
from proxy.reader import BATCH
from proxy.settings import ProxySettings

pytestmark = pytest.mark.integration

# ---- helpers (also used by test_proxy_resilience.py) ---------------------------------------


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    status: int = 0

    @property
    def key(self) -> str:
        return self.headers.get("Key", "")


Behaviour = Callable[[Hit, int], Any]  # (hit, nth attempt of this body) -> status | tuple


@dataclass
class Receiver:
    """A local HTTP receiver in its own thread; ``behave`` decides each answer.

    ``behave(hit, attempt)`` returns a status, or (status, headers), or (status, headers,
    delay_s); ``attempt`` counts requests with the same body (1-based).
    """

    behave: Behaviour = lambda hit, n: 200
    hits: list[Hit] = field(default_factory=list)
    port: int = 0
    _attempts: dict[bytes, int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Receiver:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(10)
        return self

    def _run(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner
        ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/process"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        hit = Hit(path=request.path, headers=dict(request.headers), body=body, at=time.time())
        with self._lock:
            self._attempts[body] += 1
            n = self._attempts[body]
        answer = self.behave(hit, n)
        if asyncio.iscoroutine(answer):
            answer = await answer
        status, headers, delay = 200, {}, 0.0
        if isinstance(answer, tuple):
            status, headers, *rest = answer
            delay = rest[0] if rest else 0.0
        else:
            status = answer
        if delay:
            await asyncio.sleep(delay)
        hit.status = status
        with self._lock:
            self.hits.append(hit)
        return web.Response(status=status, headers=headers, text=f"answer {status}")

    def delivered(self) -> list[Hit]:
        with self._lock:
            return [h for h in self.hits if 200 <= h.status < 300]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def uid() -> str:
    return uuid.uuid4().hex[:10]


def create_topics(settings: Settings, names: list[str], partitions: int = 1) -> None:
    admin = AdminClient(settings.kafka.librdkafka())
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names]
    )
    for fut in futures.values():
        fut.result(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the metadata shows every partition
        meta = admin.list_topics(timeout=10).topics
        if all(n in meta and len(meta[n].partitions) == partitions for n in names):
            return
        time.sleep(0.1)
    raise AssertionError(f"topics {names} did not appear")


def produce(
    settings: Settings,
    topic: str,
    records: list[tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]],
    partition: int | None = None,
) -> None:
    p = Producer({**settings.kafka.librdkafka(), "linger.ms": 5})
    for key, value, headers in records:
        kw: dict[str, Any] = {"key": key, "value": value, "headers": headers}
        if partition is not None:
            kw["partition"] = partition
        while True:
            try:
                p.produce(topic, **kw)
                break
            except BufferError:
                p.poll(0.1)
    assert p.flush(30) == 0


def read_topic(
    settings: Settings, topic: str, expect: int, timeout_s: float = 30.0, idle_s: float = 1.0
) -> list[Any]:
    """Every record of ``topic`` (at least ``expect``, or what came before the deadline)."""
    c = Consumer(
        {
            **settings.kafka.librdkafka(),
            "group.id": f"reader-{uid()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    last = time.monotonic()
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                if len(out) >= expect and time.monotonic() - last > idle_s:
                    break
                continue
            if m.error():
                continue
            out.append(m)
            last = time.monotonic()
    finally:
        c.close()
    return out


def wait_for(cond: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def fast_settings(**kw: Any) -> ProxySettings:
    base = ProxySettings(
        mode="generic",
        source_topic="unset",
        endpoint_url="http://127.0.0.1:1/unset",
        group_id=f"proxy-{uid()}",
        concurrency=16,
        per_host_concurrency=16,
        retry_base_delay_s=0.02,
        retry_max_delay_s=0.2,
        # The breaker scaled down like the retry delays: a test whose in-flight messages
        # all fail at once (every key blocked on its failing message) looks like a failing
        # host, and the default 1 s doubling to 60 s would take minutes to let them through.
        breaker_open_s=0.02,
        breaker_open_max_s=0.2,
        commit_interval_s=0.3,
        shutdown_timeout_s=5,
        revoke_timeout_s=3,
        session_timeout_s=6,
        metrics_port=0,
        request_timeout_s=5,
        # The receivers listen on 127.0.0.1, which the fires-mode SSRF guard refuses.
        allow_private_targets=True,
    )
    return replace(base, **kw)


def seq_body(key: str, seq: int, extra: str = "") -> bytes:
    return f"{key}:{seq}:{extra}".encode()


def parse_body(body: bytes) -> tuple[str, int, str]:
    key, seq, extra = body.decode().split(":", 2)
    return key, int(seq), extra


@pytest.fixture
def proxies() -> Iterator[list[ProxyApp]]:
    started: list[ProxyApp] = []
    yield started
    for app in started:
        app.stop(timeout_s=5)


def start_proxy(settings: Settings, ps: ProxySettings, registry: list[ProxyApp]) -> ProxyApp:
    app = ProxyApp(settings, ps)
    registry.append(app)
    app.start()
    return app


# ---- tests ---------------------------------------------------------------------------------


def test_generic_mode_contract_and_per_key_order_under_retries(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=4)
    create_topics(stack, [dlq])
    keys, per_key = [f"k{i}" for i in range(20)], 25

    def behave(hit: Hit, n: int) -> Any:
        _, seq, _ = parse_body(hit.body)
        # Every 7th message fails twice (500 then 429) before it succeeds; the rest are
        # slightly slow so many keys are in flight at once.
        if seq % 7 == 3 and n == 1:
            return 500
        if seq % 7 == 3 and n == 2:
            return 429, {"Retry-After": "0"}
        return 200, {}, 0.002 * (seq % 3)

    receiver.behave = behave
    records = [
        (k.encode(), seq_body(k, s), [("trace", f"t-{k}-{s}".encode())])
        for s in range(per_key)
        for k in keys
    ]
    produce(stack, topic, records)
    ps = fast_settings(source_topic=topic, endpoint_url=receiver.url, dead_letter_topic=dlq)
    app = start_proxy(stack, ps, proxies)
    wait_for(lambda: len(receiver.delivered()) >= len(records), 90, "all deliveries")

    seen: dict[str, list[int]] = defaultdict(list)
    attempts: dict[str, list[int]] = defaultdict(list)
    for h in receiver.hits:
        key, seq, _ = parse_body(h.body)
        attempts[key].append(seq)
        if 200 <= h.status < 300:
            seen[key].append(seq)
    for key in keys:
        assert seen[key] == list(range(per_key)), f"order broken for {key}"
        # Not even an attempt may overtake: a retried message blocks its key.
        assert attempts[key] == sorted(attempts[key])
    h = receiver.delivered()[0]
    key, seq, _ = parse_body(h.body)
    assert h.headers["Key"] == key and h.headers["Topic"] == topic
    assert h.headers["trace"] == f"t-{key}-{seq}"
    assert int(h.headers["Partition"]) in range(4) and int(h.headers["Offset"]) >= 0
    assert h.path == "/process"
    # Everything done is committed eventually.
    wait_for(lambda: sum(app.state.offsets.uncommitted().values()) == 0, 30, "commits")


def test_return_code_classes_and_dead_letter_records(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic, dlq])
    plan = {  # body -> statuses answered on successive attempts (last one repeats)
        b"ok": [204],
        b"4xx-then-ok": [404, 400, 200],
        b"5xx-then-ok": [503, 500, 201],
        b"6xx-always": [600],
        b"6xx-then-ok": [650, 200],
        b"7xx": [700],
        b"after-7xx": [200],
    }

    def behave(hit: Hit, n: int) -> Any:
        statuses = plan[hit.body]
        return statuses[min(n, len(statuses)) - 1]

    receiver.behave = behave
    # One key, so the 7xx is also shown not to block its successor once dead-lettered.
    produce(stack, topic, [(b"same-key", body, [("h1", b"v1")]) for body in plan])
    ps = fast_settings(
        source_topic=topic, endpoint_url=receiver.url, dead_letter_topic=dlq, retries_6xx=2
    )
    start_proxy(stack, ps, proxies)
    wait_for(
        lambda: any(h.body == b"after-7xx" and h.status == 200 for h in receiver.hits),
        60,
        "the last message",
    )

    by_body: dict[bytes, list[int]] = defaultdict(list)
    for h in receiver.hits:
        by_body[h.body].append(h.status)
    assert by_body[b"ok"] == [204]
    assert by_body[b"4xx-then-ok"] == [404, 400, 200]
    assert by_body[b"5xx-then-ok"] == [503, 500, 201]
    assert by_body[b"6xx-always"] == [600, 600, 600]  # first try + retries_6xx=2
    assert by_body[b"6xx-then-ok"] == [650, 200]
    assert by_body[b"7xx"] == [700]
    # Per-key order held across all of it.
    assert [h.body for h in receiver.hits if h.status < 300] == [
        b"ok",
        b"4xx-then-ok",
        b"5xx-then-ok",
        b"6xx-then-ok",
        b"after-7xx",
    ]

    dead = read_topic(stack, dlq, expect=2)
    assert len(dead) == 2
    docs = {
        base64.b64decode(orjson.loads(m.value())["original"]["value_b64"]): (
            m,
            orjson.loads(m.value()),
        )
        for m in dead
    }
    m6, d6 = docs[b"6xx-always"]
    assert m6.key() == b"same-key"
    assert d6["status_code"] == 600 and d6["attempts"] == 3
    assert "HTTP 600" in d6["reason"] and "answer 600" in d6["reason"]  # body snippet
    assert d6["first_failure_ms"] <= d6["last_failure_ms"] <= d6["dead_lettered_ms"]
    orig = d6["original"]
    assert orig["topic"] == topic and orig["partition"] == 0 and orig["offset"] == 3
    assert base64.b64decode(orig["key_b64"]) == b"same-key"
    assert orig["headers"] == [["h1", base64.b64encode(b"v1").decode()]]
    assert orig["timestamp_ms"] > 0
    _, d7 = docs[b"7xx"]
    assert d7["status_code"] == 700 and d7["attempts"] == 1 and d7["original"]["offset"] == 5


def test_retry_after_is_honoured(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    """Backoff is 50 ms, so a retry waits seconds only if Retry-After (as seconds and as an
    HTTP date) is obeyed; Retry-After: 0 is delivered on the normal backoff."""
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic, dlq])

    def behave(hit: Hit, n: int) -> Any:
        if n == 1:
            later = email.utils.formatdate(time.time() + 4, usegmt=True)
            return 503, {"Retry-After": {b"secs": "3", b"date": later, b"zero": "0"}[hit.body]}
        return 200

    receiver.behave = behave
    produce(stack, topic, [(b"a", b"secs", None), (b"b", b"date", None), (b"c", b"zero", None)])
    ps = fast_settings(
        source_topic=topic,
        endpoint_url=receiver.url,
        dead_letter_topic=dlq,
        retry_base_delay_s=0.05,
        retry_max_delay_s=0.05,
    )
    start_proxy(stack, ps, proxies)
    wait_for(
        lambda: {h.body for h in receiver.delivered()} == {b"secs", b"date", b"zero"},
        30,
        "all three retried",
    )
    gaps = {}
    for body in (b"secs", b"date", b"zero"):
        first, second = sorted(h.at for h in receiver.hits if h.body == body)[:2]
        gaps[body] = second - first
    # Lower bounds only: the proxy must not retry before the server said it may.
    assert gaps[b"secs"] >= 2.9 and gaps[b"date"] >= 2.0, gaps


def test_poison_pill_is_dead_lettered_and_others_flow(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=2)
    create_topics(stack, [dlq])

    def behave(hit: Hit, n: int) -> Any:
        if hit.body.startswith(b"poison"):
            return 200, {}, 3.0  # never answers within the 0.3 s timeout
        return 200

    receiver.behave = behave
    records: list[tuple[bytes | None, bytes, Any]] = [
        (b"p", b"poison", None),
        (b"p", b"after-poison", None),
    ]
    records += [(f"k{i}".encode(), f"other-{i}".encode(), None) for i in range(50)]
    produce(stack, topic, records)
    ps = fast_settings(
        source_topic=topic,
        endpoint_url=receiver.url,
        dead_letter_topic=dlq,
        request_timeout_s=0.3,
        poison_timeouts=3,
    )
    start_proxy(stack, ps, proxies)
    wait_for(
        lambda: any(h.body == b"after-poison" for h in receiver.delivered()),
        60,
        "the poison pill's successor",
    )
    assert sum(1 for h in receiver.delivered() if h.body.startswith(b"other-")) == 50
    (dead,) = read_topic(stack, dlq, expect=1)
    doc = orjson.loads(dead.value())
    assert "poison pill" in doc["reason"] and doc["attempts"] == 3
    assert doc["status_code"] is None and dead.key() == b"p"


def test_backpressure_pauses_and_resumes(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=2)
    create_topics(stack, [dlq])
    gate = threading.Event()

    async def behave(hit: Hit, n: int) -> Any:
        # The receiver is stuck until the test lets it go.
        await asyncio.get_running_loop().run_in_executor(None, gate.wait)
        return 200

    receiver.behave = behave
    n = 600
    produce(stack, topic, [(f"k{i % 40}".encode(), f"m{i}".encode(), None) for i in range(n)])
    ps = fast_settings(
        source_topic=topic,
        endpoint_url=receiver.url,
        dead_letter_topic=dlq,
        max_pending_messages=50,
        concurrency=8,
        per_host_concurrency=8,
    )
    app = start_proxy(stack, ps, proxies)
    wait_for(lambda: app.reader.paused_partitions > 0, 30, "the reader to pause")
    held = app.state.queue.held_messages
    # Soft bound (docs/proxy.md): at most one consume batch per partition beyond the bound.
    assert held <= 50 + 2 * BATCH
    assert app.metrics.paused._value.get() > 0
    gate.set()
    wait_for(lambda: len(receiver.delivered()) >= n, 60, "everything after resuming")
    wait_for(lambda: app.reader.paused_partitions == 0, 10, "resume")
    assert len({h.body for h in receiver.delivered()}) == n


def test_fires_mode_delivers_each_callback_and_reports_outcomes(
    stack: Settings, receiver: Receiver, proxies: list[ProxyApp]
) -> None:
    fires = f"{stack.topics.prefix}fires-{uid()}"
    deliveries = f"{stack.topics.prefix}deliveries-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    sink = f"{stack.topics.prefix}sink-{uid()}"
    create_topics(stack, [fires], partitions=2)
    create_topics(stack, [deliveries, dlq, sink])

    def behave(hit: Hit, n: int) -> Any:
        return 700 if hit.path == "/reject" else 200

    receiver.behave = behave
    base = f"http://127.0.0.1:{receiver.port}"

    def trigger(sid: str, path: str, **extra: Any) -> bytes:
        doc = {
            "trigger_id": f"t-{sid}",
            "schedule_id": sid,
            "tenant": "acme",
            "due_ms": 1_700_000_000_000,
            "emitted_ms": 1_700_000_000_005,
            "attempt": 1,
            "order_key": sid,
            "payload": {"n": sid},
            "callback": {
                "type": "http",
                "url": base + path,
                "method": "PUT",
                "headers": {"X-Auth": "s3cret"},
                "timeout_s": 5,
            },
        }
        doc.update(extra)
        if "payload_b64" in doc:
            del doc["payload"]  # at most one of the two
        return orjson.dumps(doc)

    # s1 was stored before commands were refused the proxy's own header names: the proxy
    # still sends its own values only.
    forged = {"X-Auth": "s3cret", "Tocsin-Trigger-Id": "forged", "idempotency-key": "forged"}
    s1_callback = {"type": "http", "url": base + "/hook/a", "method": "PUT", "headers": forged}
    records: list[tuple[bytes | None, bytes, Any]] = [
        (b"s1", trigger("s1", "/hook/a", callback=s1_callback), None),
        (b"s2", trigger("s2", "/reject"), None),
        (b"s3", b"{not json", None),
        (b"s4", trigger("s4", "/", callback={"type": "kafka", "topic": sink, "key": "kk"}), None),
        (b"s5", trigger("s5", "/hook/b", payload_b64=base64.b64encode(b"\x00raw").decode()), None),
    ]
    produce(stack, fires, records)
    ps = fast_settings(
        mode="fires",
        source_topic=fires,
        endpoint_url="",
        dead_letter_topic=dlq,
        deliveries_topic=deliveries,
    )
    start_proxy(stack, ps, proxies)
    outcomes = read_topic(stack, deliveries, expect=4, timeout_s=60)
    docs = {orjson.loads(m.value())["schedule_id"]: orjson.loads(m.value()) for m in outcomes}
    assert set(docs) == {"s1", "s2", "s4", "s5"}  # s3 has no schedule id to report under
    assert docs["s1"]["outcome"] == "delivered" and docs["s1"]["status_code"] == 200
    assert docs["s2"]["outcome"] == "dead_lettered" and docs["s2"]["status_code"] == 700
    assert docs["s4"]["outcome"] == "delivered"
    hit_a = next(h for h in receiver.hits if h.path == "/hook/a")
    assert orjson.loads(hit_a.body) == {"n": "s1"}
    assert hit_a.headers["X-Auth"] == "s3cret"
    assert hit_a.headers["Idempotency-Key"] == "t-s1"
    for name in ("tocsin-trigger-id", "idempotency-key"):
        assert [v for k, v in hit_a.headers.items() if k.lower() == name] == ["t-s1"], name
    assert hit_a.headers["Content-Type"] == "application/json"
    hit_b = next(h for h in receiver.hits if h.path == "/hook/b")
    assert hit_b.body == b"\x00raw"
    (sunk,) = read_topic(stack, sink, expect=1)
    assert sunk.key() == b"kk" and orjson.loads(sunk.value()) == {"n": "s4"}
    dead = read_topic(stack, dlq, expect=2)
    reasons = sorted(orjson.loads(m.value())["reason"] for m in dead)
    assert reasons[0].startswith("HTTP 700") and reasons[1].startswith("undecodable trigger")

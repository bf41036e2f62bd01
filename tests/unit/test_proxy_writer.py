"""The writer against a local HTTP server: capped 2xx bodies, no map keyed by the
tenant's timeout, and an attempt task that fails is never silent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.envelope import Envelope, prepare_generic
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.retry import HttpResult
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer


async def endless(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200)
    await resp.prepare(request)
    chunk = b"x" * 65536
    try:
        while True:
            await resp.write(chunk)
    except (ConnectionError, RuntimeError):
        pass
    return resp


async def small(request: web.Request) -> web.Response:
    return web.Response(status=int(request.query.get("status", "200")), text="ok")


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/endless", endless)
    app.router.add_post("/endless", endless)
    app.router.add_post("/small", small)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


class FakeOutbox:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.records: list[Any] = []

    def send_all(self, records: Any, done: Any) -> None:
        if self.fail:
            raise RuntimeError("producer broke")
        self.records.extend(records)
        done()


def make_writer(url: str, outbox: Any = None) -> tuple[Writer, SharedState]:
    settings = ProxySettings(mode="generic", source_topic="t", endpoint_url=url,
                             metrics_port=0, retry_base_delay_s=0.01, retry_max_delay_s=0.01)
    state = SharedState(Bounds())
    writer = Writer(state=state, settings=settings, metrics=ProxyMetrics(),
                    outbox=outbox or FakeOutbox(), dead_letter_topic="dlq",
                    deliveries_topic=None)
    return writer, state


def envelope(url: str, timeout_s: float = 5.0, offset: int = 0) -> Envelope:
    e = Envelope(topic="t", partition=0, offset=offset, key=b"k", value=b"v", headers=[],
                 timestamp_ms=None, read_s=time.monotonic())
    prepare_generic(e, url=url, timeout_s=timeout_s)
    return e


async def test_a_2xx_body_without_end_is_not_read_to_its_end(server: str) -> None:
    writer, _ = make_writer(server)
    async with aiohttp.ClientSession() as session:
        writer._session = session
        result = await writer._send(envelope(f"{server}/endless", timeout_s=3.0))
    assert result == HttpResult(status=200)


async def test_no_writer_map_grows_with_the_tenants_timeout_values(server: str) -> None:
    writer, _ = make_writer(server)

    def sizes() -> int:
        return sum(len(v) for v in vars(writer).values() if isinstance(v, dict | set | list))

    async with aiohttp.ClientSession() as session:
        writer._session = session
        before = sizes()
        for i in range(200):
            result = await writer._send(envelope(f"{server}/small", timeout_s=5 + i / 1000))
            assert result == HttpResult(status=200)
    assert sizes() == before


async def test_a_failing_attempt_task_marks_the_writer_failed(server: str) -> None:
    # 700 is dead-lettered at once; writing the dead letter raises.
    writer, state = make_writer(server, FakeOutbox(fail=True))
    state.assign([("t", 0)])
    writer.start()
    try:
        state.push([envelope(f"{server}/small?status=700")])
        writer.notify()
        for _ in range(500):  # up to 10 s
            if writer.error is not None:
                break
            await asyncio.sleep(0.02)
        assert isinstance(writer.error, RuntimeError)
    finally:
        await asyncio.to_thread(writer.drain, 1)


async def test_a_kafka_callback_into_the_proxys_own_topics_is_undeliverable() -> None:
    import orjson

    from proxy.envelope import _fallback_decode_trigger, prepare_fire
    from proxy.retry import Undeliverable
    from proxy.writer import ParkingLot

    settings = ProxySettings(metrics_port=0)
    writer = Writer(state=SharedState(Bounds()), settings=settings, metrics=ProxyMetrics(),
                    outbox=FakeOutbox(), dead_letter_topic="dlq", deliveries_topic="out",
                    lot=ParkingLot(topic="retries"))  # type: ignore[arg-type]
    for topic in ("retries", "dlq", "out"):
        doc = {"trigger_id": "t", "schedule_id": "s", "tenant": "a", "due_ms": 1,
               "payload": {"forged": True}, "callback": {"type": "kafka", "topic": topic}}
        e = Envelope(topic="fires", partition=0, offset=0, key=b"s",
                     value=orjson.dumps(doc), headers=[], timestamp_ms=None, read_s=0.0)
        prepare_fire(e, _fallback_decode_trigger)
        result = await writer._send(e)
        assert isinstance(result, Undeliverable) and "own topic" in result.detail


def test_a_failing_timer_callback_marks_the_writer_failed() -> None:
    writer, _ = make_writer("http://127.0.0.1:1")
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

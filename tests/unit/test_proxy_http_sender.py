"""The HTTP sender against a local aiohttp server: what it reports for each kind of answer,
capped 2xx bodies, no map keyed by the tenant's timeout, and the SSRF guard."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from aiohttp import web

from proxy.envelope import Envelope, prepare_generic
from proxy.http_sender import HttpSender
from proxy.metrics import ProxyMetrics
from proxy.retry import ConnectFailure, HttpResult, TimeoutResult, Undeliverable
from proxy.settings import ProxySettings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


async def busy(request: web.Request) -> web.Response:
    return web.Response(status=503, text="b" * 4096, headers={"Retry-After": "7"})


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(1)
    return web.Response(status=200)


async def moved(request: web.Request) -> web.Response:
    return web.Response(status=302, headers={"Location": "/small"})


async def echo_attempt(request: web.Request) -> web.Response:
    return web.Response(status=200 + int(request.headers["Tocsin-Delivery-Attempt"]))


@contextlib.asynccontextmanager
async def serving(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """An aiohttp server on a free loopback port answering POSTs to ``routes``; its base
    URL."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[str]:
    routes: dict[str, Handler] = {
        "/endless": endless,
        "/small": small,
        "/busy": busy,
        "/slow": slow,
        "/moved": moved,
        "/attempt": echo_attempt,
    }
    async with serving(routes) as base:
        yield base


SETTINGS = ProxySettings(
    mode="generic",
    source_topic="t",
    endpoint_url="http://x/",
    metrics_port=0,
    body_snippet_bytes=100,
)


def sender(guard: bool = False) -> HttpSender:
    return HttpSender(SETTINGS, ProxyMetrics(), guard=guard)


def envelope(url: str, timeout_s: float = 5.0) -> Envelope:
    e = Envelope(
        topic="t",
        partition=0,
        offset=0,
        key=b"k",
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(e, url=url, timeout_s=timeout_s)
    return e


async def test_a_2xx_body_without_end_is_not_read_to_its_end(server: str) -> None:
    async with sender() as s:
        result = await s.send(envelope(f"{server}/endless", timeout_s=3.0))
    assert result == HttpResult(status=200)


async def test_an_error_answer_reports_its_status_retry_after_and_a_capped_body(
    server: str,
) -> None:
    async with sender() as s:
        result = await s.send(envelope(f"{server}/busy"))
    assert result == HttpResult(status=503, retry_after="7", body_snippet="b" * 100)


async def test_a_redirect_is_reported_not_followed(server: str) -> None:
    async with sender() as s:
        result = await s.send(envelope(f"{server}/moved"))
    assert isinstance(result, HttpResult) and result.status == 302


async def test_no_answer_within_the_timeout_is_a_read_timeout(server: str) -> None:
    async with sender() as s:
        result = await s.send(envelope(f"{server}/slow", timeout_s=0.2))
    assert result == TimeoutResult(detail="no response within 0.2s")


async def test_a_refused_connection_is_a_connect_failure() -> None:
    async with sender() as s:
        result = await s.send(envelope("http://127.0.0.1:1/x"))
    assert isinstance(result, ConnectFailure)


async def test_the_guard_refuses_a_loopback_literal_without_a_request(server: str) -> None:
    async with sender(guard=True) as s:
        result = await s.send(envelope(f"{server}/small"))
    assert isinstance(result, Undeliverable) and "loopback" in result.detail


async def test_each_request_names_its_delivery_attempt(server: str) -> None:
    e = envelope(f"{server}/attempt")
    e.attempt_state = replace(e.attempt_state, attempts=2)
    async with sender() as s:
        result = await s.send(e)
    assert result == HttpResult(status=203)


async def test_no_sender_map_grows_with_the_tenants_timeout_values(server: str) -> None:
    s = sender()

    def sizes() -> int:
        return sum(len(v) for v in vars(s).values() if isinstance(v, dict | set | list))

    async with s:
        before = sizes()
        for i in range(200):
            result = await s.send(envelope(f"{server}/small", timeout_s=5 + i / 1000))
            assert result == HttpResult(status=200)
        assert sizes() == before


async def test_a_sender_that_is_not_open_raises() -> None:
    with pytest.raises(RuntimeError):
        await sender().send(envelope("http://127.0.0.1:1/x"))


async def test_the_pool_does_not_cap_a_host_in_fires_mode() -> None:
    # The writer's slots cap each (tenant, host) in fires mode; a pool cap per host would
    # let one tenant's slow calls take the connections of another's. Five requests to one
    # host are answered only once all five are in at once, over a per-host setting of 3.
    arrived = 0
    all_in = asyncio.Event()

    async def gathered(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 5:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), 5)
        except TimeoutError:
            return web.Response(status=500)
        return web.Response(status=200)

    fires = HttpSender(
        replace(SETTINGS, mode="fires", per_host_concurrency=3), ProxyMetrics(), guard=False
    )
    async with serving({"/gathered": gathered}) as base, fires:
        results = await asyncio.gather(
            *(fires.send(envelope(f"{base}/gathered")) for _ in range(5))
        )
    assert results == [HttpResult(status=200)] * 5

"""Review of the proxy's own HTTP client (410b27c): answers from a hostile receiver that
the client reads without bound, frames wrongly or classifies as the proxy's fault.

Each test failed on 410b27c (seen with --runxfail) and passes on the fixed client.
Framing cases drive ``read_answer`` over a connection whose bytes are all there
already, so what the client decides does not depend on how the kernel splits a write;
the rest use a loopback server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.envelope import Envelope, prepare_generic
from proxy.http_client import (
    MAX_HEAD_BYTES,
    Answer,
    HttpClient,
    ProtocolError,
    _Connection,
    read_answer,
)
from proxy.http_sender import HttpSender
from proxy.metrics import ProxyMetrics
from proxy.retry import ConnectFailure
from proxy.settings import ProxySettings

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[int]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def answer_of(data: bytes) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return handle


async def call(
    client: HttpClient, port: int, headers: list[tuple[str, str]] | None = None
) -> Answer:
    async with asyncio.timeout(5):
        return await client.request(
            "POST",
            f"http://127.0.0.1:{port}/cb",
            headers or [],
            b"{}",
            connect_timeout_s=2,
            cap_2xx=64,
            cap_other=64,
        )


async def read_all_there(data: bytes) -> tuple[Answer, _Connection]:
    """``read_answer`` over a connection that has received ``data`` and then its end."""
    conn = _Connection()
    conn.buf += data
    conn.eof = True
    async with asyncio.timeout(5):
        return await read_answer(conn, "POST", 64, 64), conn


OK_HEAD = b"HTTP/1.1 200 OK\r\n"


async def test_an_idle_connection_does_not_buffer_what_the_receiver_sends_unasked(
    serve: Callable[[Handler], Awaitable[int]],
) -> None:
    flood = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK_HEAD + b"Content-Length: 0\r\n\r\n")
        await flood.wait()  # only once the answer was read and the connection pooled
        writer.write(b"x" * (32 * 1024 * 1024))
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client closes
        writer.close()

    port = await serve(handle)
    client = HttpClient()
    try:
        assert (await call(client, port)).status == 200
        [idle] = list(vars(client)["_idle"].values())
        [conn] = list(idle)
        flood.set()
        for _ in range(300):
            if conn.closed or len(conn.buf) >= 16 * 1024 * 1024:
                break
            await asyncio.sleep(0.01)
        held = 0 if conn.closed else len(conn.buf)
    finally:
        await client.close()
    assert held <= MAX_HEAD_BYTES, held


async def test_a_head_over_the_limit_is_refused_even_when_it_arrived_whole() -> None:
    head = OK_HEAD + b"X-Pad: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\nContent-Length: 0\r\n\r\n"
    with pytest.raises(ProtocolError):
        await read_all_there(head)


async def test_the_number_of_header_lines_is_bounded() -> None:
    head = OK_HEAD + b"a:\r\n" * 1000 + b"Content-Length: 0\r\n\r\n"
    with pytest.raises(ProtocolError):
        await read_all_there(head)


async def test_trailers_are_bounded_like_a_head() -> None:
    data = (
        OK_HEAD
        + b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
        + b"t: x\r\n" * (2 * MAX_HEAD_BYTES // 6)
        + b"\r\n"
    )
    with pytest.raises(ProtocolError):
        await read_all_there(data)


async def test_chunk_data_not_followed_by_crlf_is_a_protocol_error() -> None:
    data = OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nokXY0\r\n\r\n"
    with pytest.raises(ProtocolError):
        await read_all_there(data)


@pytest.mark.parametrize(
    "head",
    [
        b"Transfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"Transfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["chunked-and-length", "gzip-and-length"],
)
async def test_a_framing_conflict_never_leaves_the_connection_for_reuse(head: bytes) -> None:
    try:
        _, conn = await read_all_there(OK_HEAD + head)
    except ProtocolError:
        return
    assert conn.closed


@pytest.mark.parametrize(
    "data",
    [
        OK_HEAD + b"Content-Length: \xb2\r\n\r\nok",
        b"HTTP/1.1 2\xb20 OK\r\nContent-Length: 0\r\n\r\n",
        OK_HEAD + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n",
    ],
    ids=["superscript-length", "superscript-status", "5000-digit-length"],
)
async def test_a_number_int_cannot_read_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        await read_all_there(data)


async def test_an_unreadable_content_length_is_retried_not_dead_lettered(
    serve: Callable[[Handler], Awaitable[int]],
) -> None:
    port = await serve(answer_of(OK_HEAD + b"Content-Length: \xb2\r\n\r\nok"))
    settings = ProxySettings(
        mode="generic", source_topic="t", endpoint_url="http://x/", metrics_port=0
    )
    env = Envelope(
        topic="t",
        partition=0,
        offset=0,
        key=b"k",
        value=b"v",
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_generic(env, url=f"http://127.0.0.1:{port}/cb", timeout_s=5.0)
    async with HttpSender(settings, ProxyMetrics(), guard=False) as sender:
        outcome = await sender.send(env)
    assert isinstance(outcome, ConnectFailure), outcome


async def test_a_header_value_outside_latin_1_is_sent_as_utf_8(
    serve: Callable[[Handler], Awaitable[int]],
) -> None:
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await read_request(reader))
        writer.write(OK_HEAD + b"Content-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    port = await serve(handle)
    client = HttpClient()
    try:
        answer = await call(client, port, [("Tocsin-Schedule-Id", "订单-€1")])
    finally:
        await client.close()
    assert answer.status == 200
    assert "\r\nTocsin-Schedule-Id: 订单-€1\r\n".encode() in got[0]


async def test_an_expired_idle_connection_is_closed_without_a_next_request(
    serve: Callable[[Handler], Awaitable[int]],
) -> None:
    port = await serve(answer_of(OK_HEAD + b"Content-Length: 0\r\n\r\n"))
    client = HttpClient(keepalive_s=0.05)
    try:
        assert (await call(client, port)).status == 200
        [idle] = list(vars(client)["_idle"].values())
        [conn] = list(idle)
        for _ in range(500):  # a receiver that keeps its end open holds it otherwise
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed and client.idle_connections == 0
    finally:
        await client.close()


async def test_a_switching_protocols_answer_never_leaves_the_connection_for_reuse() -> None:
    answer, conn = await read_all_there(
        b"HTTP/1.1 101 Switching\r\nUpgrade: ws\r\nConnection: upgrade\r\n\r\nnot http"
    )
    assert answer.status == 101 and conn.closed

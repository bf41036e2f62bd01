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

import pytest

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
from tests.unit.loopback import Servers, call, fixed, read_request
from tests.unit.test_proxy_http_sender import envelope


async def read_all_there(data: bytes) -> tuple[Answer, _Connection]:
    """``read_answer`` over a connection that has received ``data`` and then its end."""
    conn = _Connection()
    conn.buf += data
    conn.eof = True
    async with asyncio.timeout(5):
        return await read_answer(conn, "POST", 64, 64), conn


OK_HEAD = b"HTTP/1.1 200 OK\r\n"


async def test_an_idle_connection_does_not_buffer_what_the_receiver_sends_unasked(
    loopback: Servers,
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

    port = await loopback.serve(handle)
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
    loopback: Servers,
) -> None:
    port = (await loopback(fixed(OK_HEAD + b"Content-Length: \xb2\r\n\r\nok"))).port
    settings = ProxySettings(
        mode="generic", source_topic="t", endpoint_url="http://x/", metrics_port=0
    )
    env = envelope(f"http://127.0.0.1:{port}/cb", timeout_s=5.0)
    async with HttpSender(settings, ProxyMetrics(), guard=False) as sender:
        outcome = await sender.send(env)
    assert isinstance(outcome, ConnectFailure), outcome


async def test_a_header_value_outside_latin_1_is_sent_as_utf_8(
    loopback: Servers,
) -> None:
    srv = await loopback(fixed(OK_HEAD + b"Content-Length: 0\r\n\r\n"), close_after=True)
    client = HttpClient()
    try:
        answer = await call(client, srv.port, headers=[("Tocsin-Schedule-Id", "订单-€1")])
    finally:
        await client.close()
    assert answer.status == 200
    assert "\r\nTocsin-Schedule-Id: 订单-€1\r\n".encode() in srv.requests[0]


async def test_an_expired_idle_connection_is_closed_without_a_next_request(
    loopback: Servers,
) -> None:
    port = (await loopback(fixed(OK_HEAD + b"Content-Length: 0\r\n\r\n"))).port
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

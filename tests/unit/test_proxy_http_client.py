"""The proxy's HTTP client against a local server that answers with exact bytes: framing
(length, chunked, to the end of the connection), interim answers, which connections are
reused, the bounded idle pool, and what the request carries."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http_client import (
    Answer,
    ConnectError,
    Disconnected,
    HttpClient,
    ProtocolError,
    parse_target,
)
from tests.unit.loopback import Servers, call, fixed


async def test_a_keep_alive_answer_leaves_its_connection_for_the_next_request(
    loopback: Servers,
) -> None:
    srv = await loopback(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    client = HttpClient()
    for _ in range(3):
        assert await call(client, srv.port) == Answer(200, None, b"ok")
    assert srv.connections == 1 and client.idle_connections == 1
    await client.close()


async def test_connection_close_or_http_1_0_is_not_reused(loopback: Servers) -> None:
    closing = await loopback(
        fixed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    )
    old = await loopback(fixed(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"))
    client = HttpClient()
    for srv in (closing, old):
        for _ in range(2):
            assert (await call(client, srv.port)).status == 200
        assert srv.connections == 2
    assert client.idle_connections == 0
    await client.close()


async def read_twice_on_one_connection(loopback: Servers, answer: bytes, want: Answer) -> None:
    """Two requests answered ``answer``: each read as ``want``, the second over the
    connection the first left in the pool."""
    srv = await loopback(fixed(answer))
    client = HttpClient()
    for _ in range(2):
        assert await call(client, srv.port) == want
    assert srv.connections == 1
    await client.close()


async def test_a_chunked_body_is_read_whole_and_the_connection_reused(loopback: Servers) -> None:
    await read_twice_on_one_connection(
        loopback,
        b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\nRetry-After: 7\r\n\r\n"
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n",
        Answer(503, "7", b"abcde"),
    )


async def test_a_body_over_the_cap_gives_its_start_and_the_connection_up(loopback: Servers) -> None:
    srv = await loopback(fixed(b"HTTP/1.1 500 No\r\nContent-Length: 20\r\n\r\n" + b"e" * 20))
    chunked = await loopback(
        fixed(b"HTTP/1.1 500 No\r\nTransfer-Encoding: chunked\r\n\r\n14\r\n" + b"f" * 20)
    )
    client = HttpClient()
    assert await call(client, srv.port) == Answer(500, None, b"e" * 8)
    assert await call(client, chunked.port) == Answer(500, None, b"f" * 8)
    assert client.idle_connections == 0
    await call(client, srv.port)
    assert srv.connections == 2
    await client.close()


async def test_a_body_to_the_end_of_the_connection(loopback: Servers) -> None:
    srv = await loopback(fixed(b"HTTP/1.1 502 Bad\r\n\r\nbad gateway"), close_after=True)
    client = HttpClient()
    for _ in range(2):
        assert await call(client, srv.port) == Answer(502, None, b"bad gate")
    assert client.idle_connections == 0 and srv.connections == 2
    await client.close()


async def test_interim_answers_are_skipped_and_bodiless_statuses_have_no_body(
    loopback: Servers,
) -> None:
    await read_twice_on_one_connection(
        loopback,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\n\r\n",
        Answer(204, None, b""),
    )


async def test_an_answer_cut_short_is_a_disconnection(loopback: Servers) -> None:
    srv = await loopback(
        fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"), close_after=True
    )
    client = HttpClient()
    with pytest.raises(Disconnected):
        await call(client, srv.port)
    assert client.idle_connections == 0
    await client.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"SMTP ready\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\nx",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_what_is_not_http_is_a_protocol_error(loopback: Servers, answer: bytes) -> None:
    srv = await loopback(fixed(answer))
    client = HttpClient()
    with pytest.raises(ProtocolError):
        await call(client, srv.port)
    assert client.idle_connections == 0
    await client.close()


async def test_the_request_carries_host_length_defaults_and_an_encoded_target(
    loopback: Servers,
) -> None:
    srv = await loopback(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    client = HttpClient(user_agent="ua")
    await call(client, srv.port, path="/a b?x=é")
    sent = srv.requests[0]
    assert sent.startswith(b"POST /a%20b?x=%C3%A9 HTTP/1.1\r\n")
    assert f"\r\nHost: 127.0.0.1:{srv.port}\r\n".encode() in sent
    assert b"\r\nContent-Length: 7\r\n" in sent and sent.endswith(b'\r\n\r\n{"a":1}')
    assert b"\r\nUser-Agent: ua\r\n" in sent and b"\r\nAccept: */*\r\n" in sent
    async with asyncio.timeout(5):
        await client.request(
            "PUT",
            f"http://127.0.0.1:{srv.port}/",
            [("user-agent", "mine"), ("Accept", "text/plain")],
            b"",
            connect_timeout_s=2,
            cap_2xx=0,
            cap_other=0,
        )
    second = srv.requests[1].lower()
    assert second.count(b"user-agent:") == 1 and b"user-agent: mine" in second
    assert second.count(b"\r\naccept:") == 1
    await client.close()


async def test_the_idle_pool_is_bounded_across_hosts(loopback: Servers) -> None:
    servers = [
        await loopback(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")) for _ in range(5)
    ]
    client = HttpClient(max_idle=2)
    for srv in servers:
        await call(client, srv.port)
    assert client.idle_connections == 2
    assert len(vars(client)["_idle"]) == 2
    # The two kept are the hosts used last.
    await call(client, servers[-1].port)
    await call(client, servers[-2].port)
    assert servers[-1].connections == 1 and servers[-2].connections == 1
    await client.close()


async def test_an_expired_idle_connection_is_not_reused(loopback: Servers) -> None:
    srv = await loopback(fixed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    client = HttpClient(keepalive_s=0.0)
    await call(client, srv.port)
    await asyncio.sleep(0.01)
    await call(client, srv.port)
    assert srv.connections == 2
    await client.close()


async def test_a_refused_connection_and_an_unresolvable_host_are_connect_errors() -> None:
    client = HttpClient()
    with pytest.raises(ConnectError):
        await call(client, 1)

    async def nothing(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    unresolvable = HttpClient(resolve=nothing)
    with pytest.raises(ConnectError, match="no such host"):
        await call(unresolvable, 80)


def test_targets() -> None:
    t = parse_target("https://Example.com/p?q=1")
    assert (t.scheme, t.host, t.port, t.host_header, t.path) == (
        "https",
        "example.com",
        443,
        "example.com",
        "/p?q=1",
    )
    assert parse_target("http://[::1]:8080").host_header == "[::1]:8080"
    assert parse_target("http://bücher.example/").host == "xn--bcher-kva.example"
    for bad in ("ftp://x/", "http:///nohost", "http://x:99999/"):
        with pytest.raises(ValueError):
            parse_target(bad)

"""An HTTP attempt's request goes out in the turn of the writer's loop that gives it its
slot (``HttpSender.begin``, on an idle connection), not in its task's first step a turn
later; the task only waits for the answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from proxy.http_client import HttpClient
from proxy.http_sender import Begun, HttpSender
from proxy.metrics import ProxyMetrics
from proxy.retry import HttpResult
from tests.fakes import until_true
from tests.unit.loopback import Raw, Servers, fixed
from tests.unit.test_proxy_http_sender import SETTINGS
from tests.unit.test_proxy_writer import generic, make_writer

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


@asynccontextmanager
async def warm_sender(
    loopback: Servers,
) -> AsyncIterator[tuple[Raw, str, HttpSender, HttpClient]]:
    """A sender holding one idle keep-alive connection to a loopback receiver."""
    srv = await loopback(fixed(OK))
    url = f"http://127.0.0.1:{srv.port}/hook"
    async with HttpSender(SETTINGS, ProxyMetrics(), guard=False) as http:
        assert await http.send(generic(0, url=url)) == HttpResult(status=200)
        client = http._client
        assert client is not None and client.idle_connections == 1
        yield srv, url, http, client


async def test_begin_writes_on_an_idle_connection_and_finish_reads_the_answer(
    loopback: Servers,
) -> None:
    async with warm_sender(loopback) as (srv, url, http, client):
        begun = http.begin(generic(1, url=url))
        assert isinstance(begun, Begun)
        assert client.idle_connections == 0 and begun.exchange.conn is not None
        assert await http.finish(begun) == HttpResult(status=200)
        assert client.idle_connections == 1 and srv.connections == 1 and len(srv.requests) == 2


async def test_the_writer_sends_when_it_gives_the_slot_not_a_turn_later(
    loopback: Servers,
) -> None:
    async with warm_sender(loopback) as (srv, url, http, client):
        writer, state = make_writer(http)  # type: ignore[arg-type]
        state.push([generic(1, url=url)])
        env = state.take()
        assert env is not None and writer._slots.admit(env)
        writer._start(env)  # no await between: the loop has not turned
        assert client.idle_connections == 0  # the request is out on the idle connection
        await until_true(lambda: not writer._tasks)
        assert writer.error is None
        assert state.snapshot(0.0).held == 0  # delivered and released
        assert client.idle_connections == 1 and len(srv.requests) == 2

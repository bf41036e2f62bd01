"""Loopback servers for the tests of the proxy's HTTP client (proxy.http_client): a raw
asyncio server answering each request with exact bytes (``Raw``) or running a test's own
handler, started through the ``loopback`` fixture, which closes them all at the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from proxy.http_client import Answer, HttpClient

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request: its head and its Content-Length body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def fixed(text: bytes) -> Callable[[bytes], bytes]:
    """The same answer to every request."""
    return lambda _request: text


@dataclass
class Raw:
    """A server that reads one request (head and Content-Length body) and writes what
    ``answer`` gives for it; it counts the connections it accepted."""

    answer: Callable[[bytes], bytes]
    close_after: bool = False
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await read_request(reader)
                self.requests.append(request)
                writer.write(self.answer(request))
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


class Servers:
    """Starts loopback servers on free ports; ``close`` stops them all."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []

    async def __call__(self, answer: Callable[[bytes], bytes], close_after: bool = False) -> Raw:
        """A ``Raw`` server answering with ``answer``."""
        raw = Raw(answer, close_after)
        raw.port = await self.serve(raw.handle)
        return raw

    async def serve(self, handler: Handler) -> int:
        """A server running ``handler`` for each connection; its port."""
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        self.servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        for server in self.servers:
            server.close()
            await server.wait_closed()


@pytest.fixture
async def loopback() -> AsyncIterator[Servers]:
    servers = Servers()
    yield servers
    await servers.close()


async def call(
    client: HttpClient,
    port: int,
    path: str = "/cb",
    method: str = "POST",
    headers: list[tuple[str, str]] | None = None,
) -> Answer:
    """A JSON request to the loopback server on ``port``; 2xx bodies capped at 64 bytes,
    others at 8."""
    async with asyncio.timeout(5):
        return await client.request(
            method,
            f"http://127.0.0.1:{port}{path}",
            [("Content-Type", "application/json"), *(headers or [])],
            b'{"a":1}',
            connect_timeout_s=2,
            cap_2xx=64,
            cap_other=8,
        )

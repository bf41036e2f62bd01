"""A lean HTTP/1.1 client for the proxy's callbacks: what the proxy needs of one, and no more.

Why not aiohttp's client, which the proxy used before: a callback request through
``aiohttp.ClientSession`` cost 140-270 us of CPU on the development machine (building a
``ClientRequest`` and its response objects, tracing signals, timers, a parser and a stream
reader per request), and with a receiver that answers at once that was most of the
proxy's CPU per delivery (BENCHMARKS.md, Delivery and Proxy). The proxy's requests are all
alike: a method, a URL, headers it built itself (``proxy.envelope``: names checked as
tokens, values without CR/LF) and a body it holds in full; of the answer it keeps the
status, ``Retry-After`` and the start of the body. This client does exactly that over
asyncio protocols on the writer's loop.

What it does:

- one request at a time per connection; idle connections are kept per (scheme, host,
  port) for ``keepalive_s`` and reused, at most ``max_idle`` in all (the oldest closes
  first), so the pool is bounded whatever hosts tenants name; a timer closes those kept
  longer, and an idle connection that receives anything unasked is aborted;
- the body goes with ``Content-Length``; no ``Expect: 100-continue``, no compression
  asked for, no cookies, no proxy, no redirect followed (a 3xx is an answer like any other);
  the head is encoded UTF-8, as aiohttp's writer did;
- the answer is parsed by ``httptools`` (llhttp, the C parser uvicorn uses): strict
  framing (a chunk's CRLF, Transfer-Encoding with Content-Length refused, numbers it can
  read), in less CPU than the parser in Python it replaced (3.6 against 5.6 us for a
  small answer). It has no size limits and cannot end a body framed by the connection's
  end, so this module keeps them: a head (or trailers) over ``MAX_HEAD_BYTES`` or
  ``MAX_HEADER_LINES``, in one read or many, is a ``ProtocolError``; a body without
  Content-Length or chunked coding ends with the connection; interim 1xx answers are
  skipped; the body is read up to a cap, and a connection whose body was not read to its
  end, or that sent bytes after the answer, is closed, never reused;
- TLS with the default verifying context and SNI;
- ``resolve``: the addresses a host name may be connected to (the SSRF guard's filter,
  ``proxy.ssrf``); the client connects only to what it returns.

Errors: ``ConnectError`` (no connection: refused, unreachable, DNS, TLS handshake, the guard
refused every address: ``BlockedAddress``), ``ConnectTimeout``, ``Disconnected`` (the
connection ended before the whole answer), ``ProtocolError`` (an answer that is not HTTP);
the caller's own timeout (``asyncio.timeout``) bounds the whole exchange.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools

from base.errors import TocsinError

# An answer's status line and headers may take at most this much (aiohttp's own limit is
# 8 KiB per line and 128 headers).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_LINES = 128  # aiohttp's client parser allowed as many
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Left as they are in a request target: RFC 3986's reserved and unreserved characters and
# "%" (a target already percent-encoded stays as it is); anything else is percent-encoded.
_TARGET_SAFE = "/?#[]@!$&'()*+,;=-._~:%"

Resolve = Callable[[str, int], Awaitable[Sequence[str]]]


class ConnectError(OSError, TocsinError):
    """No connection to the receiver (retriable). An OSError, like the socket errors it
    stands for; its cause may be the SSRF guard's ``BlockedAddress``, which is not."""

    retriable = True


class ConnectTimeout(ConnectError):
    """The connection was not made within the connect timeout (retriable)."""


class Disconnected(ConnectionError, TocsinError):
    """The connection ended before the whole answer came (retriable)."""

    retriable = True


class ProtocolError(TocsinError):
    """The answer is not HTTP/1.x: the receiver's fault, or a proxy's in between; worth
    another attempt, like a broken connection (retriable)."""

    retriable = True


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    retry_after: str | None
    body: bytes  # the start of the body, at most the cap the request gave


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's request goes, and its request target."""

    scheme: str
    host: str  # as connected to and sent in SNI: IDNA-encoded, IPv6 without brackets
    port: int
    host_header: str
    path: str

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


def parse_target(url: str) -> Target:
    """A URL's connection and request target; ValueError for one that has neither."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in {url!r}")
    port = parts.port or _DEFAULT_PORTS[scheme]  # ValueError for a port out of range
    if not host.isascii():
        host = host.encode("idna").decode("ascii")
    bracketed = f"[{host}]" if ":" in host else host
    host_header = bracketed if port == _DEFAULT_PORTS[scheme] else f"{bracketed}:{port}"
    path = quote(parts.path or "/", safe=_TARGET_SAFE)
    if parts.query:
        path += "?" + quote(parts.query, safe=_TARGET_SAFE)
    return Target(scheme=scheme, host=host, port=port, host_header=host_header, path=path)


async def resolve_any(host: str, port: int) -> Sequence[str]:
    """Every address ``host`` resolves to (no filter)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _Stop(Exception):
    """Raised from a parser callback to stop reading: the answer is complete (HEAD), or
    bytes follow it that nothing asked for."""


class _Connection(asyncio.Protocol):
    """One connection: the bytes received, a future woken when more come, and its parser
    (``httptools``, llhttp) with the answer being read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # received, not yet given to the parser
        self.eof = False
        self.closed = False
        self.busy = False  # a request is using it: only then is what comes read
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self._answer_state("POST", 0, 0)

    def _answer_state(self, method: str, cap_2xx: int, cap_other: int) -> None:
        self.head_only = method == "HEAD"
        self.cap_2xx = cap_2xx
        self.cap_other = cap_other
        self.cap = cap_other
        self.status = 0
        self.interim = False  # the head read is a 1xx one: the final answer follows
        self.headers_done = False  # the final answer's head was read
        self.done = False  # the final answer was read to its end
        self.progress = 0  # heads and body bytes read: what bounds framing bytes
        self.head_bytes = 0
        self.header_lines = 0
        self.retry_after: str | None = None
        self.has_length = False
        self.codings = b""
        self.body = bytearray()
        self.over_cap = False
        self.unasked = False  # bytes came after the answer
        self.keep = False  # the receiver lets the connection carry another request

    # -- protocol callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            # Nothing was asked: the connection is unusable, and reading on would let a
            # receiver fill the proxy's memory through an idle connection.
            self.abort()
            return
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- parser callbacks (httptools calls them from feed_data)
    def on_message_begin(self) -> None:
        if self.done:
            raise _Stop  # a second answer to one request: unsolicited bytes

    def on_status(self, data: bytes) -> None:
        self._count_head(len(data))

    def on_header(self, name: bytes, value: bytes) -> None:
        # Also called for a chunked body's trailers, bounded alike.
        self.header_lines += 1
        if self.header_lines > MAX_HEADER_LINES:
            raise ProtocolError(f"more than {MAX_HEADER_LINES} header lines in an answer")
        self._count_head(len(name) + len(value) + 4)
        if self.headers_done:
            return  # a trailer: nothing in it is kept
        name = name.lower()
        if name == b"retry-after":
            if self.retry_after is None:
                self.retry_after = value.decode("latin-1").strip(" \t")
        elif name == b"content-length":
            self.has_length = True
        elif name == b"transfer-encoding":
            self.codings = value if not self.codings else self.codings + b"," + value

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            raise ProtocolError("answer headers too long")

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        status = self.parser.get_status_code()
        self.progress += 1
        self.head_bytes = self.header_lines = 0  # trailers have a budget of their own
        if 100 <= status < 200 and status != 101:
            # 100 Continue, 103 Early Hints: the final answer follows.
            self.interim = True
            self.retry_after = None
            self.has_length = False
            self.codings = b""
            return
        self.status = status
        self.headers_done = True
        self.cap = self.cap_2xx if 200 <= status < 300 else self.cap_other
        if self.head_only:
            self.done = True  # llhttp cannot be told the answer is to HEAD: no body
            raise _Stop

    def on_body(self, data: bytes) -> None:
        self.progress += len(data)
        room = self.cap - len(self.body)
        if len(data) > room:
            self.over_cap = True
            data = data[:room]
        self.body += data

    def on_chunk_complete(self) -> None:
        self.progress += 1

    def on_message_complete(self) -> None:
        self.progress += 1
        if self.interim:
            self.interim = False
            return
        assert self.parser is not None
        # Asked here: llhttp resets what it tells from once past the answer's end.
        self.keep = self.parser.should_keep_alive()
        self.done = True

    @property
    def ends_with_close(self) -> bool:
        """The body is framed by the connection's end: neither Content-Length nor a
        chunked coding last (RFC 9112 6.3), nor an answer without a body."""
        if self.has_length or self.status in (204, 304):
            return False
        return self.codings.rsplit(b",", 1)[-1].strip().lower() != b"chunked"

    # -- used by the request
    async def more(self) -> None:
        """Wait until more bytes came; Disconnected if none can come any more."""
        if self.eof:
            raise Disconnected("the receiver closed the connection before its whole answer")
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _feed(conn: _Connection, parser: httptools.HttpResponseParser) -> None:
    """Give the parser what came; ProtocolError for what is not an answer. Bytes after the
    answer (or the rest of an upgrade's) end the parse with ``conn.done`` set."""
    try:
        parser.feed_data(conn.buf)
    except httptools.HttpParserUpgrade:
        # 101, or an answer naming an upgrade: what follows is not HTTP, never reused.
        conn.done = conn.unasked = True
    except httptools.HttpParserError as exc:
        if conn.done:
            conn.unasked = True  # bytes after the answer (or a HEAD's): never reused
            return
        cause = exc.__context__
        if isinstance(cause, ProtocolError):
            raise cause from None
        raise ProtocolError(f"not an HTTP answer: {exc}") from None
    finally:
        conn.buf.clear()


def _write(conn: _Connection, data: bytes) -> None:
    transport = conn.transport
    assert transport is not None
    conn.busy = True
    transport.write(data)


async def read_answer(conn: _Connection, method: str, cap_2xx: int, cap_other: int) -> Answer:
    """Read one answer off ``conn``; closes it unless it may carry the next request."""
    parser = conn.parser
    if parser is None:
        parser = conn.parser = httptools.HttpResponseParser(conn)
    conn._answer_state(method, cap_2xx, cap_other)
    stalled = 0  # bytes fed that completed no head and carried no body: heads, trailers,
    # chunk-size lines; the parser holds a header across reads, so this bounds it
    while True:
        if conn.buf:
            fed, before = len(conn.buf), conn.progress
            _feed(conn, parser)
            if conn.done:
                # Bytes nobody asked for, or the receiver said so: never reused.
                if conn.unasked or not conn.keep or conn.over_cap:
                    conn.close()
                break
            if conn.over_cap:
                conn.close()  # the rest of the body is left unread
                break
            stalled = stalled + fed if conn.progress == before else 0
            if stalled > MAX_HEAD_BYTES:
                raise ProtocolError("answer head, trailers or chunk lines too long")
        elif conn.eof:
            if conn.headers_done and conn.ends_with_close:
                conn.close()
                break
            raise Disconnected("the receiver closed the connection before its whole answer")
        else:
            await conn.more()
    return Answer(status=conn.status, retry_after=conn.retry_after, body=bytes(conn.body))


@dataclass(slots=True)
class Exchange:
    """A request begun (``HttpClient.begin``): written on an idle connection at once, or
    waiting for a new one; ``HttpClient.finish`` connects if need be and reads the answer."""

    target: Target
    method: str
    data: bytes
    conn: _Connection | None = None  # the idle connection it was written on
    error: Exception | None = None  # writing failed: ``finish`` raises it
    settled: bool = False  # ``finish`` has taken it over

    def abandon(self) -> None:
        """``finish`` will never run (its attempt was cancelled before it started): the
        connection the request went out on is dropped, since its answer is never read."""
        if not self.settled and self.conn is not None:
            self.settled = True
            self.conn.abort()


class HttpClient:
    """The pool and the requests (on one event loop)."""

    def __init__(
        self,
        *,
        resolve: Resolve = resolve_any,
        keepalive_s: float = 30.0,
        max_idle: int = 100,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "tocsin-proxy",
    ) -> None:
        self._resolve = resolve
        self._keepalive_s = keepalive_s
        self._max_idle = max(1, max_idle)
        self._ssl = ssl_context
        self._user_agent = user_agent
        # Idle connections per (scheme, host, port), newest last. Keyed by the hosts tenants
        # name: an entry leaves when its last connection does, and at most ``max_idle``
        # connections are idle in all, so the map holds at most that many keys.
        self._idle: OrderedDict[tuple[str, str, int], deque[_Connection]] = OrderedDict()
        self._idle_count = 0
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None  # closes expired idle connections

    @property
    def idle_connections(self) -> int:
        return self._idle_count

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def request(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        *,
        connect_timeout_s: float,
        cap_2xx: int,
        cap_other: int,
    ) -> Answer:
        """One exchange. The caller bounds the whole of it (``asyncio.timeout``); a
        cancelled exchange closes its connection."""
        exchange = self.begin(method, url, headers, body)
        return await self.finish(
            exchange, connect_timeout_s=connect_timeout_s, cap_2xx=cap_2xx, cap_other=cap_other
        )

    def begin(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> Exchange:
        """The part of a request that needs no waiting, done now (on the loop's thread): the
        head built and, when an idle connection to the target is there, the request written
        on it, so it leaves in this turn of the loop rather than in a task's first step one
        turn later. ValueError for a URL or method no request can carry."""
        if self._closed:
            raise RuntimeError("the HTTP client is closed")
        target = parse_target(url)
        if not method.isascii() or not method.isalpha():
            raise ValueError(f"bad method {method!r}")
        head = [f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        named = set()
        for name, value in headers:
            head.append(f"{name}: {value}\r\n")
            named.add(name.lower())
        # Defaults a request names unless its own headers do (aiohttp's, less
        # Accept-Encoding: the proxy reads no more of an answer than its start).
        if "user-agent" not in named:
            head.append(f"User-Agent: {self._user_agent}\r\n")
        if "accept" not in named:
            head.append("Accept: */*\r\n")
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        # UTF-8, as aiohttp's writer encodes a request head: a header value may be any
        # text (a schedule id), and latin-1 would refuse most of it.
        exchange = Exchange(target=target, method=method, data="".join(head).encode("utf-8") + body)
        conn = self._take(target.key)
        if conn is not None:
            exchange.conn = conn
            try:
                _write(conn, exchange.data)
            except Exception as exc:
                conn.abort()
                exchange.error = exc
        return exchange

    async def finish(
        self, exchange: Exchange, *, connect_timeout_s: float, cap_2xx: int, cap_other: int
    ) -> Answer:
        """The rest of ``exchange``: a connection made and the request written if ``begin``
        found none idle, then the answer read. A cancelled exchange closes its connection."""
        exchange.settled = True
        if exchange.error is not None:
            raise exchange.error
        conn = exchange.conn
        try:
            if conn is None:
                conn = await self._connect(exchange.target, connect_timeout_s)
                _write(conn, exchange.data)
            answer = await read_answer(conn, exchange.method, cap_2xx, cap_other)
        except BaseException:
            if conn is not None:
                conn.abort()
            raise
        conn.busy = False
        if not conn.closed:
            self._give_back(exchange.target.key, conn)
        return answer

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        conns = self._idle.get(key)
        if conns is None:
            return None
        now = time.monotonic()
        found: _Connection | None = None
        while conns:
            conn = conns.pop()  # the newest: the least likely to be closed by the receiver
            self._idle_count -= 1
            if conn.closed or conn.eof or conn.buf or now - conn.idle_since > self._keepalive_s:
                conn.close()
                continue
            found = conn
            break
        if not conns:
            del self._idle[key]
        return found

    def _give_back(self, key: tuple[str, str, int], conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conns = self._idle.get(key)
        if conns is None:
            conns = self._idle[key] = deque()
        else:
            self._idle.move_to_end(key)
        conns.append(conn)
        self._idle_count += 1
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self._keepalive_s, self._expire)
        while self._idle_count > self._max_idle:
            # The host used longest ago gives up its oldest connection.
            oldest_key, oldest = next(iter(self._idle.items()))
            oldest.popleft().close()
            self._idle_count -= 1
            if not oldest:
                del self._idle[oldest_key]

    def _expire(self) -> None:
        """Close the idle connections kept longer than ``keepalive_s`` (a receiver may keep
        its end open for good), and come back when the next one expires."""
        self._sweep = None
        now = time.monotonic()
        next_s: float | None = None
        for key in list(self._idle):
            conns = self._idle[key]
            while conns and (conns[0].closed or now - conns[0].idle_since >= self._keepalive_s):
                conns.popleft().close()  # oldest first: appended as given back
                self._idle_count -= 1
            if not conns:
                del self._idle[key]
                continue
            due = conns[0].idle_since + self._keepalive_s - now
            next_s = due if next_s is None else min(next_s, due)
        if next_s is not None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(max(next_s, 0.0), self._expire)

    async def _connect(self, target: Target, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = self._ssl_context() if target.scheme == "https" else None
        try:
            async with asyncio.timeout(timeout_s):
                addresses = await self._resolve(target.host, target.port)
                if not addresses:
                    raise ConnectError(f"{target.host!r} resolves to no address")
                last: OSError | None = None
                for address in addresses:
                    try:
                        _, conn = await loop.create_connection(
                            _Connection,
                            host=address,
                            port=target.port,
                            ssl=ssl_context,
                            server_hostname=target.host if ssl_context is not None else None,
                        )
                    except OSError as exc:  # ssl.SSLError is an OSError too
                        last = exc
                        continue
                    return conn
                raise ConnectError(f"cannot connect to {target.host}:{target.port}: {last}")
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {target.host}:{target.port}") from None
        except ConnectError:
            raise
        except OSError as exc:  # resolution failed (socket.gaierror), or the guard refused
            if isinstance(exc, ConnectError | ConnectionError):
                raise
            raise ConnectError(str(exc)) from exc

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._idle_count = 0

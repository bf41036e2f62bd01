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
  first), so the pool is bounded whatever hosts tenants name;
- the body goes with ``Content-Length``; no ``Expect: 100-continue``, no compression
  asked for, no cookies, no proxy, no redirect followed (a 3xx is an answer like any other);
- the answer's body is framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the
  end of the connection; interim 1xx answers are skipped; the body is read up to a cap,
  and a connection whose body was not read to its end is closed, never reused;
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


class _Connection(asyncio.Protocol):
    """One connection: the bytes received, and a future woken when more come."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.closed = False
        self.busy = False  # a request is using it: only then is what comes read
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None

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


async def _read_head(conn: _Connection) -> tuple[int, str, dict[str, str]]:
    """The next final answer's status, version and headers (names in lower case, repeated
    ones joined by ", "), interim 1xx answers skipped."""
    while True:
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            if len(conn.buf) > MAX_HEAD_BYTES:
                raise ProtocolError("answer headers too long")
            await conn.more()
        if end > MAX_HEAD_BYTES:
            raise ProtocolError("answer headers too long")
        head = bytes(conn.buf[:end]).decode("latin-1")
        del conn.buf[: end + 4]
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if (
            not version.startswith("HTTP/1.")
            or len(code) != 3
            or not _digits(code)
            or rest[3:4] not in ("", " ")
        ):
            raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(code)
        if len(lines) > MAX_HEADER_LINES + 1:
            raise ProtocolError("too many answer header lines")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"bad header line: {line[:80]!r}")
            name = name.lower()
            value = value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        if 100 <= status < 200 and status != 101:
            continue  # 100 Continue, 103 Early Hints: the final answer follows
        return status, version, headers


def _digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` takes superscripts and other scripts' digits)."""
    return text.isascii() and text.isdigit()


def _tokens(value: str | None) -> set[str]:
    return {t.strip().lower() for t in value.split(",")} if value else set()


async def _read_exact_prefix(conn: _Connection, length: int, cap: int) -> tuple[bytes, bool]:
    """A body of ``length`` bytes: its first ``cap`` bytes, and whether it was read whole."""
    want = min(length, cap)
    while len(conn.buf) < want:
        await conn.more()
    body = bytes(conn.buf[:want])
    if length > cap:
        return body, False
    del conn.buf[:length]
    return body, True


async def _read_line(conn: _Connection) -> bytes:
    """The next CRLF-ended line (consumed, without its CRLF)."""
    while (eol := conn.buf.find(b"\r\n")) < 0:
        if len(conn.buf) > MAX_HEAD_BYTES:
            raise ProtocolError("line too long in a chunked body")
        await conn.more()
    line = bytes(conn.buf[:eol])
    del conn.buf[: eol + 2]
    return line


def _chunk_size(line: bytes) -> int:
    text = line.split(b";", 1)[0].strip()
    if not text or len(text) > 15 or any(c not in b"0123456789abcdefABCDEF" for c in text):
        raise ProtocolError(f"bad chunk size {text[:20]!r}")
    return int(text, 16)


async def _read_chunked(conn: _Connection, cap: int) -> tuple[bytes, bool]:
    """A chunked body: its first ``cap`` bytes, and whether it was read whole."""
    out = bytearray()
    while True:
        size = _chunk_size(await _read_line(conn))
        if size == 0:
            trailers = 0  # bytes of trailers, up to the empty line that ends the body
            while line := await _read_line(conn):
                trailers += len(line) + 2
                if trailers > MAX_HEAD_BYTES:
                    raise ProtocolError("trailers too long")
            return bytes(out), True
        if len(out) + size > cap:
            # Over the cap: keep what fits, and give the connection up (bytes left unread).
            room = cap - len(out)
            while len(conn.buf) < room:
                await conn.more()
            out += conn.buf[:room]
            return bytes(out), False
        while len(conn.buf) < size + 2:
            await conn.more()
        if conn.buf[size : size + 2] != b"\r\n":
            raise ProtocolError("chunk data not followed by CRLF")
        out += conn.buf[:size]
        del conn.buf[: size + 2]


async def _read_to_close(conn: _Connection, cap: int) -> bytes:
    """A body ended by the connection's end: its first ``cap`` bytes."""
    while len(conn.buf) < cap and not conn.eof:
        await conn.more()
    return bytes(conn.buf[:cap])


async def read_answer(conn: _Connection, method: str, cap_2xx: int, cap_other: int) -> Answer:
    """Read one answer off ``conn``; closes it unless it may carry the next request."""
    status, version, headers = await _read_head(conn)
    cap = cap_2xx if 200 <= status < 300 else cap_other
    keep = version == "HTTP/1.1" and "close" not in _tokens(headers.get("connection"))
    body = b""
    coding = headers.get("transfer-encoding")
    if coding is not None and "content-length" in headers:
        keep = False  # both framings (RFC 9112 6.3): never reuse the connection
    if method == "HEAD" or status in (204, 304):
        whole = True
    elif coding is not None:
        codings = [t.strip().lower() for t in coding.split(",")]
        if codings[-1] == "chunked":
            body, whole = await _read_chunked(conn, cap)
        else:  # not chunked last: the body ends with the connection (RFC 9112 6.3)
            body, whole = await _read_to_close(conn, cap), False
    elif "content-length" in headers:
        lengths = _tokens(headers["content-length"])
        length = next(iter(lengths)) if len(lengths) == 1 else ""
        if not _digits(length) or len(length) > 18:
            raise ProtocolError(f"bad Content-Length {headers['content-length'][:40]!r}")
        body, whole = await _read_exact_prefix(conn, int(length), cap)
    else:
        body, whole = await _read_to_close(conn, cap), False
    if not (keep and whole) or conn.buf:
        conn.close()  # unread bytes, or the receiver said so: never reused
    return Answer(status=status, retry_after=headers.get("retry-after"), body=body)


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
        # UTF-8, as aiohttp sent it: a schedule id in a header may be any text.
        data = "".join(head).encode("utf-8") + body
        conn = self._take(target.key)
        if conn is None:
            conn = await self._connect(target, connect_timeout_s)
        try:
            transport = conn.transport
            assert transport is not None
            conn.busy = True
            transport.write(data)
            answer = await read_answer(conn, method, cap_2xx, cap_other)
        except BaseException:
            conn.abort()
            raise
        conn.busy = False
        if not conn.closed:
            self._give_back(target.key, conn)
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
        while self._idle_count > self._max_idle:
            # The host used longest ago gives up its oldest connection.
            oldest_key, oldest = next(iter(self._idle.items()))
            oldest.popleft().close()
            self._idle_count -= 1
            if not oldest:
                del self._idle[oldest_key]

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
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        self._idle_count = 0

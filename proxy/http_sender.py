"""The HTTP sender: one attempt at an envelope's request over a pooled aiohttp session.

Connections are pooled and kept alive by one ``aiohttp.ClientSession``, opened on the
writer's event loop (``async with HttpSender(...)``) and capped at ``concurrency`` in all
and ``per_host_concurrency`` per receiver (generic mode; in fires mode the writer's slots
cap each tenant and receiver). The answer is reported as it came: an HTTP
status with its Retry-After and the start of its body, a read timeout, a connect failure,
or undeliverable (an invalid request, or a target the SSRF guard refuses).

Each fires-mode attempt is signed here, just before it is sent, so its ``Tocsin-Signature``
timestamp is the attempt's own (proxy.callback_signing).
"""

from __future__ import annotations

import time
from types import TracebackType
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from proxy.callback_signing import SIGNATURE_HEADER, CallbackSigner, SignResult, refusal, signer_for
from proxy.envelope import Envelope, Request
from proxy.metrics import ProxyMetrics
from proxy.retry import ConnectFailure, HttpResult, TimeoutResult, Undeliverable
from proxy.settings import ProxySettings
from proxy.ssrf import GuardedResolver, blocked_reason, literal_refusal
from proxy.tracing import attempt_span, end_attempt

HttpOutcome = HttpResult | TimeoutResult | ConnectFailure | Undeliverable

# A 2xx body is read (so a small one leaves the connection reusable) up to this much; past
# it the connection is closed instead: a receiver cannot make the proxy read without end.
SUCCESS_BODY_MAX_BYTES = 64 * 1024


async def _discard_body(resp: aiohttp.ClientResponse, max_bytes: int) -> None:
    left = max_bytes
    while left > 0:
        chunk = await resp.content.read(min(left, 16 * 1024))
        if not chunk:
            return
        left -= len(chunk)
    # Unread bytes remain: leaving the response context then drops the connection.
    resp.close()


class HttpSender:
    def __init__(
        self,
        settings: ProxySettings,
        metrics: ProxyMetrics,
        *,
        guard: bool,
        signer: CallbackSigner | None = None,
    ) -> None:
        self._s = settings
        self._metrics = metrics
        # Each sender (one per lane, each on its own thread) reads the secrets file itself.
        self._signer = signer if signer is not None else signer_for(settings, metrics)
        self._sign_counts = {r: metrics.signatures.labels(r.value) for r in SignResult}
        # Refuse loopback, private and reserved targets (fires mode: tenants pick the URLs).
        self._guard = guard
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpSender:
        connector = aiohttp.TCPConnector(
            limit=self._s.concurrency,
            limit_per_host=self.pool_limit_per_host(),
            ttl_dns_cache=300,
            keepalive_timeout=30,
            resolver=GuardedResolver() if self._guard else None,
        )
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self

    def pool_limit_per_host(self) -> int:
        """The connection pool's cap per host (0: none). In fires mode the writer's slots
        cap each (tenant, host) (proxy.slots); a pool cap per host alone would make one
        tenant's slow calls hold the connections another tenant needs on the same host, so
        there only ``concurrency`` bounds the pool."""
        return 0 if self._s.mode == "fires" else self._s.per_host_concurrency

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def send(self, env: Envelope) -> HttpOutcome:
        req = env.request
        if req is None or self._session is None:
            raise RuntimeError(f"{env!r}: no HTTP request, or the sender is not open")
        if self._guard:
            refusal = literal_refusal(urlsplit(req.url).hostname or "")
            if refusal is not None:
                return Undeliverable(detail=refusal)
        headers = CIMultiDict(req.headers)
        headers["Tocsin-Delivery-Attempt"] = str(env.attempt_state.attempts + 1)
        unsigned = self._sign(env, req.body, headers)
        if unsigned is not None:
            return unsigned
        span = attempt_span(env, req, headers)  # None unless tracing is on
        if span is None:
            return await self._request(req, headers)
        outcome = await self._request(req, headers)
        end_attempt(span, outcome)
        return outcome

    async def _request(self, req: Request, headers: CIMultiDict[str]) -> HttpOutcome:
        session = self._session
        assert session is not None  # send() checked it
        # Built per request: the timeout is the tenant's choice, so a cache keyed by it
        # would grow with every distinct value, and building one is a few attribute sets.
        timeout = aiohttp.ClientTimeout(
            total=req.timeout_s, sock_connect=min(self._s.connect_timeout_s, req.timeout_s)
        )
        t0 = time.perf_counter()
        try:
            async with session.request(
                req.method,
                req.url,
                headers=headers,
                data=req.body,
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                return await self._answer(resp)
        except aiohttp.ConnectionTimeoutError:
            return ConnectFailure(detail="connect timeout")
        except TimeoutError:  # includes aiohttp.SocketTimeoutError
            return TimeoutResult(detail=f"no response within {req.timeout_s:g}s")
        except (aiohttp.InvalidURL, ValueError) as exc:
            return Undeliverable(detail=f"invalid request: {exc}")
        except (aiohttp.ClientError, OSError) as exc:
            refusal = blocked_reason(exc) if self._guard else None
            if refusal is not None:
                return Undeliverable(detail=refusal)
            return ConnectFailure(detail=f"{type(exc).__name__}: {exc}")
        finally:
            self._metrics.request_latency.observe(time.perf_counter() - t0)

    def _sign(self, env: Envelope, body: bytes, headers: CIMultiDict[str]) -> Undeliverable | None:
        """Put this attempt's signature in ``headers`` (fires mode); an Undeliverable when
        one is required and the tenant has no secret."""
        # Only the proxy signs: a header of that name from the callback's own is dropped.
        headers.popall(SIGNATURE_HEADER, None)
        trigger = env.trigger
        if trigger is None:  # generic mode: no tenant, no trigger id
            return None
        signed = self._signer.sign(trigger.tenant, trigger.trigger_id, body)
        self._sign_counts[signed.result].inc()
        if signed.result is SignResult.REFUSED:
            return Undeliverable(detail=refusal(trigger.tenant))
        if signed.header is not None:
            headers[SIGNATURE_HEADER] = signed.header
        return None

    async def _answer(self, resp: aiohttp.ClientResponse) -> HttpResult:
        if 200 <= resp.status < 300:
            await _discard_body(resp, SUCCESS_BODY_MAX_BYTES)
            return HttpResult(status=resp.status)
        snippet = await resp.content.read(self._s.body_snippet_bytes)
        return HttpResult(
            status=resp.status,
            retry_after=resp.headers.get("Retry-After"),
            body_snippet=snippet.decode("utf-8", "replace"),
        )

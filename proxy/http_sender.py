"""The HTTP sender: one attempt at an envelope's request over the proxy's HTTP client.

Connections are pooled and kept alive by one ``proxy.http_client.HttpClient``, opened on
the writer's event loop (``async with HttpSender(...)``). The pool caps no host: the
writer's slots (``proxy.slots``) cap how many attempts run at once, in all, per receiver
(per tenant and receiver in fires mode) and per tenant, and each running attempt holds one
connection. The answer is reported as it came: an HTTP status with its Retry-After and the
start of its body, a read timeout, a connect failure, or undeliverable (an invalid
request, or a target the SSRF guard refuses).

Each fires-mode attempt is signed here, just before it is sent, so its ``Tocsin-Signature``
timestamp is the attempt's own (proxy.callback_signing).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from multidict import CIMultiDict

from base.tracing import Spanned
from proxy.callback_signing import SIGNATURE_HEADER, CallbackSigner, SignResult, refusal, signer_for
from proxy.envelope import Envelope
from proxy.http_client import (
    ConnectError,
    ConnectTimeout,
    Exchange,
    HttpClient,
    ProtocolError,
    resolve_any,
)
from proxy.metrics import ProxyMetrics
from proxy.retry import ConnectFailure, HttpResult, TimeoutResult, Undeliverable
from proxy.settings import ProxySettings
from proxy.ssrf import blocked_reason, guarded_resolve, literal_refusal
from proxy.tracing import attempt_span, end_attempt

HttpOutcome = HttpResult | TimeoutResult | ConnectFailure | Undeliverable

# A 2xx body is read (so a small one leaves the connection reusable) up to this much; past
# it the connection is closed instead: a receiver cannot make the proxy read without end.
SUCCESS_BODY_MAX_BYTES = 64 * 1024
# How long an idle connection is kept for the next request to its receiver.
KEEPALIVE_S = 30.0


@dataclass(slots=True)
class Begun:
    """An attempt whose request ``HttpSender.begin`` has built, signed and, on an idle
    connection, written; ``HttpSender.finish`` waits for its answer."""

    exchange: Exchange
    timeout_s: float
    deadline: float  # the loop's clock: the attempt's whole timeout runs from its begin
    t0: float  # perf_counter at the begin, for the request latency
    span: Spanned | None


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
        self._client: HttpClient | None = None

    async def __aenter__(self) -> HttpSender:
        self._client = HttpClient(
            resolve=guarded_resolve if self._guard else resolve_any,
            keepalive_s=KEEPALIVE_S,
            max_idle=self._s.concurrency,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def send(self, env: Envelope) -> HttpOutcome:
        begun = self.begin(env)
        if not isinstance(begun, Begun):
            return begun
        return await self.finish(begun)

    def begin(self, env: Envelope) -> Begun | HttpOutcome:
        """The part of an attempt that needs no waiting, done now, on the loop: the request
        refused, signed and, on an idle connection, written (``HttpClient.begin``). An
        outcome when the attempt ends here (refused, unsigned, a request no URL can carry)."""
        req = env.request
        if req is None or self._client is None:
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
        t0 = time.perf_counter()
        try:
            exchange = self._client.begin(req.method, req.url, list(headers.items()), req.body)
        except ValueError as exc:  # a URL or method no request can carry
            self._metrics.request_latency.observe(time.perf_counter() - t0)
            return self._ended(span, Undeliverable(detail=f"invalid request: {exc}"))
        deadline = asyncio.get_running_loop().time() + req.timeout_s
        return Begun(exchange, req.timeout_s, deadline, t0, span)

    async def finish(self, begun: Begun) -> HttpOutcome:
        """The answer to a begun attempt, as it came, within its timeout."""
        return self._ended(begun.span, await self._answer(begun))

    @staticmethod
    def _ended(span: Spanned | None, outcome: HttpOutcome) -> HttpOutcome:
        if span is not None:
            end_attempt(span, outcome)
        return outcome

    async def _answer(self, begun: Begun) -> HttpOutcome:
        client = self._client
        assert client is not None  # begin() checked it
        try:
            async with asyncio.timeout_at(begun.deadline):
                answer = await client.finish(
                    begun.exchange,
                    connect_timeout_s=min(self._s.connect_timeout_s, begun.timeout_s),
                    cap_2xx=SUCCESS_BODY_MAX_BYTES,
                    cap_other=self._s.body_snippet_bytes,
                )
        except ConnectTimeout:
            return ConnectFailure(detail="connect timeout")
        except TimeoutError:
            return TimeoutResult(detail=f"no response within {begun.timeout_s:g}s")
        except ConnectError as exc:
            refusal = blocked_reason(exc) if self._guard else None
            if refusal is not None:
                return Undeliverable(detail=refusal)
            return ConnectFailure(detail=f"{type(exc).__name__}: {exc}")
        except ValueError as exc:  # a URL or method no request can carry
            return Undeliverable(detail=f"invalid request: {exc}")
        except ProtocolError as exc:
            return ConnectFailure(detail=f"not an HTTP answer: {exc}")
        except OSError as exc:  # the connection broke mid-exchange (Disconnected, resets)
            return ConnectFailure(detail=f"{type(exc).__name__}: {exc}")
        finally:
            self._metrics.request_latency.observe(time.perf_counter() - begun.t0)
        if 200 <= answer.status < 300:
            return HttpResult(status=answer.status)
        return HttpResult(
            status=answer.status,
            retry_after=answer.retry_after,
            body_snippet=answer.body.decode("utf-8", "replace"),
        )

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

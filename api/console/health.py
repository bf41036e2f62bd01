"""The console's Health page reads the processes' own Prometheus metrics: the API scrapes
the ``/metrics`` URLs of ``TOCSIN_API_METRICS_URLS`` every ``TOCSIN_API_METRICS_SCRAPE_S``
and keeps, per URL, the last hour of a few aggregates (a bounded ring: 3600 / interval + 1
samples of a handful of numbers each, per-tenant series capped like the worker's own
labels). Nothing is written anywhere; a restarted API starts a new hour.

What is read: fires from ``tocsin_triggers_emitted_total``, fire lateness from the
``tocsin_fire_lateness_seconds`` histogram (emit time less due time), delivery time from
``tocsin_proxy_delivery_seconds`` (the proxy's read to final outcome), the commands topic's
consumer lag from ``tocsin_consumer_lag_messages`` (the worker's own measure), the fires
topic's from ``tocsin_proxy_commit_lag_messages`` (read by the proxy, not yet committed),
and per-tenant quota pressure from ``tocsin_fires_throttled_total``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from base.clock import now_ms

log = logging.getLogger("tocsin.api.console")

HOUR_MS = 3_600_000
MINUTE_MS = 60_000
# Tenants kept per sample; the worker itself names at most 200 (streams.metrics).
MAX_TENANTS = 200
# The shortest scrape interval taken, whatever the setting says.
MIN_SCRAPE_S = 1.0
# One exposition read at most: a worker's with 200 tenants is well under 1 MiB, and a URL
# that answers with more (a wrong URL, a runaway label) must not take the API's memory.
MAX_EXPOSITION_BYTES = 16 * 1024 * 1024

Histogram = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


@dataclass(frozen=True)
class Sample:
    """The aggregates of one scrape of one URL (None: the URL has no such metric)."""

    at_ms: int
    emitted: float | None = None
    fire_lateness: Histogram | None = None
    delivery: Histogram | None = None
    commands_lag: float | None = None
    fires_lag: float | None = None
    throttled: dict[str, float] = field(default_factory=dict)


_EMITTED = "tocsin_triggers_emitted_total"
_FIRE_LATENESS = "tocsin_fire_lateness_seconds_bucket"
_DELIVERY = "tocsin_proxy_delivery_seconds_bucket"
_COMMANDS_LAG = "tocsin_consumer_lag_messages"
_FIRES_LAG = "tocsin_proxy_commit_lag_messages"
_THROTTLED = "tocsin_fires_throttled_total"


def parse_sample(text: str, at_ms: int) -> Sample:
    """The aggregates of one exposition (series summed over partitions and processes)."""
    sums: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {_FIRE_LATENESS: {}, _DELIVERY: {}}
    throttled: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in buckets:
                le = float(s.labels.get("le", "inf"))
                got = buckets[s.name]
                got[le] = got.get(le, 0.0) + s.value
            elif s.name == _THROTTLED:
                tenant = s.labels.get("tenant", "")
                if tenant in throttled or len(throttled) < MAX_TENANTS:
                    throttled[tenant] = throttled.get(tenant, 0.0) + s.value
            elif s.name in (_EMITTED, _COMMANDS_LAG, _FIRES_LAG):
                sums[s.name] = sums.get(s.name, 0.0) + s.value

    def histogram(name: str) -> Histogram | None:
        got = buckets[name]
        return tuple(sorted(got.items())) if got else None

    return Sample(
        at_ms=at_ms,
        emitted=sums.get(_EMITTED),
        fire_lateness=histogram(_FIRE_LATENESS),
        delivery=histogram(_DELIVERY),
        commands_lag=sums.get(_COMMANDS_LAG),
        fires_lag=sums.get(_FIRES_LAG),
        throttled=throttled,
    )


def increase(before: float, after: float) -> float:
    """A counter's increase between two reads; a smaller read is a restarted process."""
    return after - before if after >= before else after


def histogram_increase(before: Histogram, after: Histogram) -> Histogram:
    old = dict(before)
    return tuple((le, increase(old.get(le, 0.0), n)) for le, n in after)


def add_histograms(a: Histogram | None, b: Histogram) -> Histogram:
    if a is None:
        return b
    total = dict(a)
    for le, n in b:
        total[le] = total.get(le, 0.0) + n
    return tuple(sorted(total.items()))


def quantile(q: float, hist: Histogram | None) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolated inside its bucket as
    Prometheus' histogram_quantile does (None without observations)."""
    if not hist or hist[-1][1] <= 0:
        return None
    rank = q * hist[-1][1]
    lower, below = 0.0, 0.0
    for le, count in hist:
        if count >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bound: its value is unknown
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, count
    return lower


@dataclass
class Point:
    """One minute of the hour, all URLs together."""

    minute_ms: int
    fires: float = 0.0
    fire_lateness: Histogram | None = None
    delivery: Histogram | None = None
    commands_lag: float | None = None
    fires_lag: float | None = None


@dataclass
class Summary:
    """What the Health page shows: per-minute points, the hour's quantiles, the latest
    lags and the hour's throttled fires by tenant."""

    points: list[Point]
    fire_lateness: Histogram | None
    delivery: Histogram | None
    commands_lag: float | None
    fires_lag: float | None
    throttled: dict[str, float]
    sources: int


def _add(total: float | None, value: float | None) -> float | None:
    if value is None:
        return total
    return value if total is None else total + value


def _pair_into(point: Point, a: Sample, b: Sample) -> None:
    if a.emitted is not None and b.emitted is not None:
        point.fires += increase(a.emitted, b.emitted)
    if a.fire_lateness and b.fire_lateness:
        point.fire_lateness = add_histograms(
            point.fire_lateness, histogram_increase(a.fire_lateness, b.fire_lateness)
        )
    if a.delivery and b.delivery:
        point.delivery = add_histograms(point.delivery, histogram_increase(a.delivery, b.delivery))


def _ring_into(
    samples: list[Sample], points: dict[int, Point], throttled: dict[str, float]
) -> None:
    """One URL's samples of the hour added to the minutes and the tenants' deferrals."""
    for a, b in itertools.pairwise(samples):
        point = points.get(b.at_ms // MINUTE_MS * MINUTE_MS)
        if point is not None:
            _pair_into(point, a, b)
        for tenant, n in b.throttled.items():
            if tenant in throttled or len(throttled) < MAX_TENANTS:
                throttled[tenant] = throttled.get(tenant, 0.0) + increase(
                    a.throttled.get(tenant, 0.0), n
                )
    # Gauges: the minute's last read of each URL, summed over URLs.
    last_in_minute = {s.at_ms // MINUTE_MS * MINUTE_MS: s for s in samples}
    for minute, s in last_in_minute.items():
        if minute in points:
            points[minute].commands_lag = _add(points[minute].commands_lag, s.commands_lag)
            points[minute].fires_lag = _add(points[minute].fires_lag, s.fires_lag)


def summarize(rings: Iterable[deque[Sample]], *, now: int) -> Summary:
    """The last hour of every URL's samples, by minute."""
    start = (now - HOUR_MS) // MINUTE_MS * MINUTE_MS
    points = {m: Point(m) for m in range(start, now + 1, MINUTE_MS)}
    throttled: dict[str, float] = {}
    lag_c: float | None = None
    lag_f: float | None = None
    sources = 0
    for ring in rings:
        samples = [s for s in ring if s.at_ms >= start]
        if not samples:
            continue
        sources += 1
        _ring_into(samples, points, throttled)
        lag_c = _add(lag_c, samples[-1].commands_lag)
        lag_f = _add(lag_f, samples[-1].fires_lag)
    fire_total: Histogram | None = None
    delivery_total: Histogram | None = None
    for p in points.values():
        if p.fire_lateness:
            fire_total = add_histograms(fire_total, p.fire_lateness)
        if p.delivery:
            delivery_total = add_histograms(delivery_total, p.delivery)
    return Summary(
        points=[points[m] for m in sorted(points)],
        fire_lateness=fire_total,
        delivery=delivery_total,
        commands_lag=lag_c,
        fires_lag=lag_f,
        throttled=throttled,
        sources=sources,
    )


async def _bounded_text(resp: aiohttp.ClientResponse) -> str:
    """The body as UTF-8 text; ValueError past ``MAX_EXPOSITION_BYTES``."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > MAX_EXPOSITION_BYTES:
            raise ValueError(f"the answer is larger than {MAX_EXPOSITION_BYTES} bytes")
    return body.decode("utf-8")


@dataclass
class Source:
    """One scraped URL: its ring of samples and its last error (None when it answered)."""

    url: str
    ring: deque[Sample]
    error: str | None = "not read yet"


class Scraper:
    """Reads every URL each interval into its bounded ring."""

    def __init__(self, urls: Iterable[str], interval_s: float) -> None:
        self.interval_s = max(MIN_SCRAPE_S, interval_s)
        keep = math.ceil(HOUR_MS / 1000 / self.interval_s) + 2
        self.sources = [Source(u, deque(maxlen=keep)) for u in urls]

    def summary(self) -> Summary:
        return summarize((s.ring for s in self.sources), now=now_ms())

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._read(session, s) for s in self.sources))

    async def _read(self, session: aiohttp.ClientSession, source: Source) -> None:
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.interval_s))
        try:
            async with session.get(source.url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await _bounded_text(resp)
            source.ring.append(parse_sample(text, now_ms()))
            source.error = None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # Retriable by nature: the next round reads it again; the page shows the error.
            if source.error is None:
                log.warning("metrics scrape failed", extra={"url": source.url, "error": str(exc)})
            source.error = str(exc) or type(exc).__name__

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.scrape_once(session)
                except Exception:
                    log.exception("metrics scrape round failed")
                await asyncio.sleep(self.interval_s)

    async def lifecycle(self) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``: scrape while the app runs."""
        task = asyncio.create_task(self.run(), name="console-metrics-scraper")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

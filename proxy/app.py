"""The delivery proxy process: wires reader, writer pool, committer and outbox together.

``ProxyApp`` is the in-process handle (tests start two of them in one process); ``run`` is
the process entry point behind ``tocsin proxy``: metrics server, SIGTERM/SIGINT handling and
a graceful stop (stop reading, let in-flight attempts finish within the shutdown timeout,
flush dead letters and outcomes, commit what is done, leave the group).

Threads: ``proxy-reader`` (the consumer; polls only), ``proxy-writer`` (asyncio + aiohttp),
``proxy-committer`` (commits, producer callbacks, gauges). Nothing here may block the reader.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from confluent_kafka import Consumer

from proxy.committer import Committer
from proxy.envelope import Envelope, prepare_fire, prepare_generic, trigger_decoder
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import Outbox
from proxy.reader import Reader, commit_positions
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer
from tocsin.errors import TocsinError
from tocsin.health import Health
from tocsin.health import serve as serve_health
from tocsin.settings import Settings

log = logging.getLogger("tocsin.proxy")


class ProxyApp:
    """One proxy instance: ``start()``, then ``stop()``; safe to run several in a process."""

    def __init__(self, settings: Settings, proxy: ProxySettings,
                 *, metrics: ProxyMetrics | None = None) -> None:
        self.settings = settings
        self.proxy = proxy
        self.metrics = metrics or ProxyMetrics()
        # Topic names are the configured prefix + the catalog name (docs/design.md).
        prefix = settings.topics.prefix
        self.dead_letter_topic = proxy.dead_letter_topic or f"{prefix}dead-letters"
        self.deliveries_topic = (proxy.deliveries_topic or f"{prefix}deliveries"
                                 if proxy.mode == "fires" else None)
        self.topics = proxy.source_topics(f"{prefix}fires")
        kafka_conf = settings.kafka.librdkafka()
        self.state = SharedState(Bounds(max_messages=proxy.max_pending_messages,
                                        max_bytes=proxy.max_pending_bytes,
                                        low_ratio=proxy.resume_ratio))
        self.outbox = Outbox(kafka_conf, self.metrics)
        self.writer = Writer(state=self.state, settings=proxy, metrics=self.metrics,
                             outbox=self.outbox, dead_letter_topic=self.dead_letter_topic,
                             deliveries_topic=self.deliveries_topic)
        self.reader = Reader(
            kafka_conf=kafka_conf, settings=proxy, topics=self.topics, state=self.state,
            writer=self.writer, outbox=self.outbox, metrics=self.metrics,
            prepare=self._preparer(),
            commit=lambda consumer, positions: self._commit_on(consumer, positions),
        )
        self.committer = Committer(
            state=self.state, outbox=self.outbox, metrics=self.metrics,
            interval_s=proxy.commit_interval_s, request_commit=self.reader.request_commit,
            paused=lambda: self.reader.paused_partitions,
        )
        self._started = False
        self._stopped = False

    def _preparer(self) -> Any:
        p = self.proxy
        if p.mode == "generic":
            def generic(env: Envelope) -> None:
                prepare_generic(env, url=p.endpoint_url, timeout_s=p.request_timeout_s)
            return generic
        decode = trigger_decoder()

        def fire(env: Envelope) -> None:
            prepare_fire(env, decode)
        return fire

    def _commit_on(self, consumer: Consumer, positions: dict[tuple[str, int], int]) -> None:
        if commit_positions(consumer, positions, self.metrics):
            self.state.mark_committed(positions)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.writer.start()
        self.reader.start()
        self.committer.start()
        self._started = True
        log.info("proxy started", extra={
            "mode": self.proxy.mode, "topics": self.topics, "group": self.proxy.group_id,
            "concurrency": self.proxy.concurrency,
        })

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful stop; idempotent."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        timeout = self.proxy.shutdown_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        self.reader.stop_reading()
        self.reader.stopped_reading.wait(10)
        self.writer.drain(timeout)
        self.outbox.flush(10)
        self.committer.stop()
        self.reader.close(30)
        self.outbox.close(5)
        log.info("proxy stopped", extra={"seconds": round(time.monotonic() - t0, 3)})

    def failure(self) -> BaseException | None:
        """The error that killed a worker thread, if any (the process should exit)."""
        return self.reader.error or self.writer.error or self.committer.error

    def wait_assigned(self, timeout_s: float = 30.0, partitions: int = 1) -> bool:
        """For tests: wait until at least ``partitions`` partitions are assigned."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.reader.assignment) >= partitions:
                return True
            time.sleep(0.05)
        return False


def run(settings: Settings, proxy_settings: ProxySettings) -> None:
    """Run the proxy until SIGTERM/SIGINT, then stop gracefully."""
    app = ProxyApp(settings, proxy_settings)
    health = Health()
    if proxy_settings.metrics_port:
        serve_health(health, proxy_settings.metrics_port, registry=app.metrics.registry)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal received, stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app.start()
    health.set_ready(True)
    try:
        while not stop.wait(0.5):
            if app.failure() is not None:
                health.set_ready(False, f"failed: {app.failure()!r}")
                break
            health.beat()
    finally:
        app.stop()
    err = app.failure()
    if err is not None:
        raise TocsinError(f"proxy failed: {err}") from err

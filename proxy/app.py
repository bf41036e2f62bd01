"""The delivery proxy process: wires reader, writer pool, committer and outbox together.

``ProxyApp`` is the in-process handle (tests start two of them in one process); ``run`` is
the process entry point behind ``tocsin proxy``: metrics server, SIGTERM/SIGINT handling and
a graceful stop (stop reading, let in-flight attempts finish within the shutdown timeout,
flush dead letters and outcomes, commit what is done, leave the group).

Threads: ``proxy-reader`` (the consumer; polls only), ``proxy-writer`` (asyncio + the HTTP
client), ``proxy-committer`` (commits, producer callbacks, outcome records' rounds, gauges).
Nothing here may block the reader.
The retry lane is a second reader and writer (same classes) on the retry topic, with its
own pending bounds, so parked messages never hold the main lane back (proxy.parking). It is
co-partitioned with the main lane: it joins no group, and reads exactly the retries
partitions of the source partitions the main lane owns (``RetryLayout``), moving with every
main-lane assignment and revoke before that callback returns. Its offsets are committed
under the group ``<group>.retries``, so a partition's next owner resumes where it stopped.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

from confluent_kafka import Consumer, KafkaException
from confluent_kafka import KafkaError as RdKafkaError

from base.clock import now_ms
from base.errors import TocsinError
from base.health import Health
from base.health import serve as serve_health
from base.settings import Settings
from proxy.callback_signing import signer_for
from proxy.committer import Committer
from proxy.envelope import Envelope, prepare_fire, prepare_generic
from proxy.hostlimits import HostGate, HostLimits, HostView, endpoint_host
from proxy.limitsfile import LimitsFile
from proxy.metrics import ProxyMetrics
from proxy.ordering import Bounds
from proxy.outbox import Outbox
from proxy.parker import Lane, ParkingLot
from proxy.parking import RetryLayout, decode_headers, retry_layout
from proxy.reader import Reader, commit_positions
from proxy.settings import ProxySettings
from proxy.state import SharedState
from proxy.writer import Writer
from topics.codec import decode_trigger

# Fills an envelope read from Kafka with its request (or marks it invalid).
Prepare = Callable[[Envelope], None]

log = logging.getLogger("tocsin.proxy")

# The retry lane holds at most this fraction of the pending bounds (on top of the main
# lane's): parked messages are the failing ones, and their memory should stay small.
RETRY_LANE_SHARE = 0.25


def retry_group_id(group_id: str) -> str:
    """The consumer group of the retry lane of the proxies in ``group_id``."""
    return f"{group_id}.retries"


class ProxyApp:
    """One proxy instance: ``start()``, then ``stop()``; safe to run several in a process."""

    def __init__(
        self, settings: Settings, proxy: ProxySettings, *, metrics: ProxyMetrics | None = None
    ) -> None:
        self.settings = settings
        self.proxy = proxy
        self.metrics = metrics or ProxyMetrics()
        # A missing or bad secrets file stops the proxy here, before any thread starts
        # (each lane's HTTP sender then reads the file for itself).
        signer_for(proxy, self.metrics)
        # Topic names are the configured prefix + the catalog name (docs/design.md).
        prefix = settings.topics.prefix
        self.dead_letter_topic = proxy.dead_letter_topic or f"{prefix}dead-letters"
        self.deliveries_topic = (
            proxy.deliveries_topic or f"{prefix}deliveries" if proxy.mode == "fires" else None
        )
        self.topics = proxy.source_topics(f"{prefix}fires")
        self.retry_topic = proxy.retry_topic or f"{prefix}retries"
        kafka_conf = settings.kafka.librdkafka()
        self.state = SharedState(
            Bounds(
                max_messages=proxy.max_pending_messages,
                max_bytes=proxy.max_pending_bytes,
                low_ratio=proxy.resume_ratio,
            )
        )
        self.retry_state = SharedState(
            Bounds(
                max_messages=max(1, int(proxy.max_pending_messages * RETRY_LANE_SHARE)),
                max_bytes=max(1, int(proxy.max_pending_bytes * RETRY_LANE_SHARE)),
                low_ratio=proxy.resume_ratio,
            )
        )
        self.outbox = Outbox(kafka_conf, self.metrics)
        self.lot = ParkingLot(topic=self.retry_topic)
        # One gate for both lanes: a host's rate and breaker count every attempt made to it.
        # A missing or bad limits file stops the proxy here, before any thread starts.
        self.hosts = HostGate(proxy.breaker_policy(), HostLimits(default_rps=proxy.host_rps))
        self.limits_file: LimitsFile | None = None
        if proxy.host_limits_file:
            self.limits_file = LimitsFile(proxy.host_limits_file, proxy.host_rps, self.hosts)
            self.limits_file.load()
        self.metrics.watch_hosts(self.hosts)

        def writer(state: SharedState, lane: Lane) -> Writer:
            # Both lanes write through one outbox, parking lot and set of topics.
            return Writer(
                state=state,
                settings=proxy,
                metrics=self.metrics,
                outbox=self.outbox,
                dead_letter_topic=self.dead_letter_topic,
                deliveries_topic=self.deliveries_topic,
                lot=self.lot,
                lane=lane,
                hosts=self.hosts,
                limits_file=self.limits_file if lane is Lane.MAIN else None,
            )

        self.writer = writer(self.state, Lane.MAIN)
        self.retry_writer = writer(self.retry_state, Lane.RETRY)
        self.reader = Reader(
            kafka_conf=kafka_conf,
            settings=proxy,
            topics=self.topics,
            state=self.state,
            writer=self.writer,
            outbox=self.outbox,
            metrics=self.metrics,
            prepare=self._preparer(),
            commit=lambda consumer, positions: self._commit_on(self.state, consumer, positions),
        )
        self.retry_reader = Reader(
            kafka_conf=kafka_conf,
            settings=replace(proxy, group_id=retry_group_id(proxy.group_id)),
            topics=[self.retry_topic],
            state=self.retry_state,
            writer=self.retry_writer,
            outbox=self.outbox,
            metrics=self.metrics,
            prepare=self._retry_preparer(self._preparer()),
            commit=lambda consumer, positions: self._commit_on(
                self.retry_state, consumer, positions
            ),
            name="proxy-retry-reader",
        )
        self.committer = Committer(
            state=self.state,
            outbox=self.outbox,
            metrics=self.metrics,
            interval_s=proxy.commit_interval_s,
            request_commit=self._request_commits,
            paused=lambda: self.reader.paused_partitions,
        )
        self.retry_lane = True  # off when the retry topic does not exist (see start)
        self._started = False
        self._stopped = False

    def _preparer(self) -> Prepare:
        p = self.proxy
        if p.mode == "generic":

            def generic(env: Envelope) -> None:
                prepare_generic(env, url=p.endpoint_url, timeout_s=p.request_timeout_s)

            return generic

        def fire(env: Envelope) -> None:
            prepare_fire(env, decode_trigger)

        return fire

    @staticmethod
    def _retry_preparer(base: Prepare) -> Prepare:
        def parked(env: Envelope) -> None:
            try:
                info, own = decode_headers(env.headers, now_s=env.read_s, now_ms=now_ms())
            except ValueError as exc:
                env.invalid = f"retry record: {exc}"  # dead-lettered as it is
                return
            env.origin, env.park_id, env.headers = info.origin, info.park_id, own
            env.attempt_state = info.state
            env.not_before_s = env.read_s + max(0.0, (info.not_before_ms - now_ms()) / 1000)
            base(env)

        return parked

    def _request_commits(self) -> None:
        self.reader.request_commit()
        self.retry_reader.request_commit()

    def _commit_on(
        self, state: SharedState, consumer: Consumer, positions: dict[tuple[str, int], int]
    ) -> None:
        if commit_positions(consumer, positions, self.metrics):
            state.mark_committed(positions)

    # ---- lifecycle ---------------------------------------------------------------------

    def _retry_topic_missing(self) -> bool:
        """True only when Kafka says the retry topic does not exist. Unreachable Kafka is no
        answer: the topic is assumed there (``tocsin setup`` creates it)."""
        try:
            meta = self.outbox.producer.list_topics(self.retry_topic, timeout=10)
        except KafkaException as exc:
            log.warning(
                "cannot check the retry topic; assuming it exists",
                extra={"topic": self.retry_topic, "error": str(exc)},
            )
            return False
        topic = meta.topics.get(self.retry_topic)
        return topic is None or (
            topic.error is not None and topic.error.code() == RdKafkaError.UNKNOWN_TOPIC_OR_PART
        )

    def _layout(self) -> RetryLayout | None:
        """The retries topic's co-partitioning with the source topics, or None (logged)."""
        try:
            meta = self.outbox.producer.list_topics(timeout=10)
        except KafkaException as exc:
            log.error(
                "cannot read the topics' partition counts: the retry lane is not "
                "co-partitioned with the main lane, so per-key order across parking "
                "holds only for the keys whose retry partition this proxy happens to "
                "own",
                extra={"error": str(exc)},
            )
            return None
        counts = {t: len(meta.topics[t].partitions) if t in meta.topics else 0 for t in self.topics}
        retry = meta.topics.get(self.retry_topic)
        layout = retry_layout(counts, len(retry.partitions) if retry is not None else 0)
        if layout is None:
            log.error(
                "the retry topic has fewer partitions than the source topics together: "
                "the retry lane is not co-partitioned with the main lane, so per-key "
                "order across parking holds only for the keys whose retry partition "
                "this proxy happens to own; give the retry topic at least as many "
                "partitions",
                extra={"retry_topic": self.retry_topic, "source_partitions": counts},
            )
        return layout

    def _follow_assigned(self, tps: list[tuple[str, int]]) -> None:
        """Main lane assigned ``tps`` (its thread): the retry lane reads their retries
        partitions before the main lane fetches, so no park lands on one it does not read."""
        layout = self.lot.layout
        assert layout is not None
        add = [(self.retry_topic, r) for r in sorted(layout.followed(tps))]
        self.retry_reader.follow(add=add, timeout_s=self._follow_timeout_s())

    def _follow_revoked(self, tps: list[tuple[str, int]], commit: bool) -> None:
        """Main lane let ``tps`` go (its thread): the retry lane lets their retries
        partitions go too, committing what it finished, before the new owner can start."""
        layout = self.lot.layout
        assert layout is not None
        remove = [(self.retry_topic, r) for r in sorted(layout.followed(tps))]
        self.retry_reader.follow(remove=remove, commit=commit, timeout_s=self._follow_timeout_s())

    def _follow_timeout_s(self) -> float:
        # A revoke waits up to revoke_timeout_s for attempts, then flushes and commits.
        return self.proxy.revoke_timeout_s + 30.0

    def start(self) -> None:
        if self._retry_topic_missing():
            # Parking into a topic that does not exist would hold each parked message's
            # produce, and its partition's commit position, until someone creates it.
            log.error(
                "retry topic missing: parking is off, failing messages stay in memory "
                "until the proxy restarts; run 'tocsin setup' (it creates every catalog "
                "topic) or set TOCSIN_PROXY_RETRY_TOPIC",
                extra={"topic": self.retry_topic},
            )
            self.writer.disable_parking()
            self.retry_lane = False
        elif (layout := self._layout()) is not None:
            self.lot.layout = layout
            self.retry_reader.subscribe = False
            self.reader.on_assigned = self._follow_assigned
            self.reader.on_revoked = self._follow_revoked
        self.metrics.parking.set(1 if self.retry_lane else 0)
        self.writer.start()
        if self.retry_lane:
            self.retry_writer.start()
            # First: the main lane's first assignment waits for it to follow.
            self.retry_reader.start()
        self.reader.start()
        self.committer.start()
        self._started = True
        log.info(
            "proxy started",
            extra={
                "mode": self.proxy.mode,
                "topics": self.topics,
                "group": self.proxy.group_id,
                "concurrency": self.proxy.concurrency,
                "retry_topic": self.retry_topic,
                "parking": self.retry_lane,
                "co_partitioned": self.lot.layout is not None,
            },
        )

    def stop(self, timeout_s: float | None = None) -> None:
        """Graceful stop; idempotent."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        timeout = self.proxy.shutdown_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        readers = [self.reader, self.retry_reader] if self.retry_lane else [self.reader]
        writers = [self.writer, self.retry_writer] if self.retry_lane else [self.writer]
        for reader in readers:
            reader.stop_reading()
        for reader in readers:
            reader.stopped_reading.wait(10)
        drains = [threading.Thread(target=w.drain, args=(timeout,), daemon=True) for w in writers]
        for t in drains:
            t.start()
        for t in drains:
            t.join()
        self.outbox.flush(10)
        self.committer.stop()
        for reader in readers:
            reader.close(30)
        self.outbox.close(5)
        log.info("proxy stopped", extra={"seconds": round(time.monotonic() - t0, 3)})

    def failure(self) -> BaseException | None:
        """The error that killed a worker thread, if any (the process should exit)."""
        return (
            self.reader.error
            or self.writer.error
            or self.retry_reader.error
            or self.retry_writer.error
            or self.committer.error
        )

    def host_view(self, tenant: str | None, url: str) -> HostView:
        """The rate limit and circuit breaker this proxy applies to ``tenant``'s callbacks
        to ``url``'s host, now (for an explain view; ``proxy.hostlimits.HostView``)."""
        return self.hosts.explain(tenant, endpoint_host(url), time.monotonic())

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

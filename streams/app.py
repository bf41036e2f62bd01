"""Faust wiring of the scheduler worker (``tocsin worker``).

The consumer group of the commands topic decides ownership: the worker that is assigned
commands partition p runs the command agent for p *and* the ticker of bucket partition p
(this replaces go-scheduler's ringpop). On revocation the ticker is suspended (it stops
emitting, waits briefly for its in-flight triggers and writes its checkpoint, keeping what
it has loaded); if the group's next generation gives the partition back, it resumes from
that state, otherwise it stops and the next owner catches up from the checkpoint
(``Ownership`` says when a partition counts as kept).

Faust acknowledges a batch of commands only after ``CommandProcessor.process_batch``
returns, i.e. after the Cassandra writes and the results are durable, so a crash replays
commands rather than losing them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import faust
from faust.types import TP, AppT, EventT, StreamT
from faust.types.auth import CredentialsT

from base.clock import Clock, now_ms
from base.errors import ConfigError, TocsinError
from base.health import Health
from base.health import serve as serve_health
from base.logs import setup_logging
from base.settings import Settings
from streams import batches, coordinator_watch, drain, fetch_wait, metrics, recovery
from streams.binding import check_keyspace
from streams.commands import CommandProcessor, RawCommand
from streams.deadletter_store import DeadLetterStore, record_dead_letters
from streams.deliveries import BATCH_WAIT_S, parse_outcome, record_outcomes
from streams.emitter import Emitter
from streams.materializer import MaterializerConfig, PartitionMaterializer, min_horizon_s
from streams.store import Store
from streams.ticker import FIRE_ACK_GATHER_S, PartitionTicker, TickerConfig
from topics.admission import keys_of
from topics.catalog import catalog
from topics.signing import TimestampType
from topics.validation import Limits

log = logging.getLogger("tocsin.worker")

# Tries of an agent's batch through retriable errors (backoff 1, 2, 4, 8 s between: about
# 15 s) before it is left uncommitted as a non-retriable failure is (Worker._handle_batch).
BATCH_ATTEMPTS = 5


def faust_broker_credentials(settings: Settings) -> CredentialsT | None:
    """SASL/TLS settings translated to Faust's credential objects (None for PLAINTEXT)."""
    k = settings.kafka
    ctx = None
    if k.security_protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=k.ssl_ca_location)
        if k.ssl_certificate_location:
            ctx.load_cert_chain(k.ssl_certificate_location, k.ssl_key_location)
    if k.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=k.sasl_username,
            password=k.sasl_password,
            mechanism=k.sasl_mechanism or "PLAIN",
            ssl_context=ctx,
        )
    if ctx is not None:
        return faust.SSLCredentials(ctx)
    return None


class Worker:
    """Holds the worker's edges (store, emitter, tickers) and the Faust app using them."""

    def __init__(self, settings: Settings) -> None:
        sched = settings.scheduler
        if sched.kafka_request_timeout_s < sched.session_timeout_s:
            raise ConfigError(
                "TOCSIN_WORKER_KAFKA_REQUEST_TIMEOUT_S must be at least TOCSIN_SESSION_TIMEOUT_S "
                f"({sched.session_timeout_s}), got {sched.kafka_request_timeout_s}"
            )
        if sched.recurring_horizon_s <= min_horizon_s(sched.recurring_interval_s):
            raise ConfigError(
                "TOCSIN_RECURRING_HORIZON_S must be more than 2 x (60 s + "
                f"TOCSIN_RECURRING_INTERVAL_S) = {min_horizon_s(sched.recurring_interval_s):g} "
                f"s, got {sched.recurring_horizon_s:g}: a recurring schedule is extended half "
                "a horizon before its next run, and an extension written by another worker "
                "during a rebalance may be read up to a minute and an interval late"
            )
        self.settings = settings
        self.catalog = catalog(settings.topics)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.store = Store(
            settings.cassandra,
            bucket_read_hook=_observe_bucket_query,
            retention_s=settings.scheduler.fired_retention_s,
            # Several schedules' commit writes per request: the driver's per-request CPU,
            # not Cassandra, bounds ingest on small machines.
            commit_group_size=settings.scheduler.commit_group_size,
        )
        self.emitter = Emitter(
            settings.kafka, client_id=f"tocsin-worker-{os.getpid()}", gather_s=FIRE_ACK_GATHER_S
        )
        # Command results: no linger. The command agent waits for their acknowledgement
        # before its next batch, and each answers a waiting client (the API); the fires
        # keep the shared emitter's linger, which batches burst seconds.
        self.results_emitter = Emitter(
            settings.kafka, client_id=f"tocsin-worker-results-{os.getpid()}", linger_ms=0
        )
        self.tickers: dict[int, PartitionTicker] = {}
        self.ownership = Ownership(
            tickers=self.tickers,
            start=self._new_ticker,
            release_wait_s=sched.ticker_release_wait_ms / 1000,
        )
        self.clock_ms = skewed_clock(sched.clock_skew_ms)
        self.ticker_config = TickerConfig(
            fire_topic=self.catalog.fires.name,
            owner=self.owner,
            bucket_shards=sched.bucket_shards,
            preload_ahead_ms=int(sched.preload_ahead_s * 1000),
            default_misfire_tolerance_s=sched.default_misfire_tolerance_s,
            initial_lookback_ms=sched.default_misfire_tolerance_s * 1000,
            partitions=self.catalog.commands.partitions,
        )
        self.processor = CommandProcessor(
            store=self.store,
            sink=self.emitter,
            results_sink=self.results_emitter,
            tickers=self.tickers,
            results_topic=self.catalog.command_results.name,
            partitions=self.catalog.commands.partitions,
            limits=Limits.from_settings(sched),
            bucket_shards=sched.bucket_shards,
            tenant_ttl_s=settings.api.tenant_cache_ttl_s,
            require_signed=sched.require_signed_commands,
            signed_order_skew_ms=sched.signed_order_skew_ms,
            clock_ms=self.clock_ms,
            fired_retention_s=sched.fired_retention_s,
            admission=keys_of(settings.admission.current, settings.admission.previous),
        )
        self.processor.unwithdrawn = self.ownership.unwithdrawn
        # Recurring schedules: one materialiser per owned partition, next to its ticker.
        self.recurring = self.processor.recurring  # (one RecurringStore per worker)
        self.materializers: dict[int, PartitionMaterializer] = {}
        self.materializer_config = MaterializerConfig(
            horizon_ms=int(sched.recurring_horizon_s * 1000),
            bucket_shards=sched.bucket_shards,
            max_runs_per_step=sched.recurring_max_runs_per_step,
            catchup_per_s=sched.recurring_catchup_per_s,
            interval_s=sched.recurring_interval_s,
        )
        self.processor.materializers = self.materializers
        # Each tenant's dead letters, listed and redriven by the API (api.deadletters).
        self.dead_letters = DeadLetterStore(self.store)
        self.processor.recurring_horizon_ms = self.materializer_config.horizon_ms
        self.app = self._build_app()
        self._started = False
        self._lag_watch: asyncio.Future[None] | None = None
        self._coordinator_watch: coordinator_watch.CoordinatorWatch | None = None
        self._start_lock = asyncio.Lock()
        self.health = Health()
        self.batch_retry_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    def _build_app(self) -> faust.App:
        app = self._faust_app()
        # A seek to the committed offsets slower than the request timeout would leave the
        # streams paused for good (streams.recovery says why resuming is safe).
        recovery.install(app)
        self._add_command_agent(app)
        self._add_delivery_agent(app)
        self._add_lifecycle_handlers(app)
        return app

    def _faust_app(self) -> faust.App:
        s = self.settings
        data_dir = Path(s.stack.state_dir) / "faust"
        data_dir.mkdir(parents=True, exist_ok=True)
        return faust.App(
            f"{s.topics.prefix}scheduler",
            broker=[f"kafka://{b}" for b in s.kafka.bootstrap_servers.split(",")],
            broker_credentials=faust_broker_credentials(s),
            datadir=str(data_dir),
            value_serializer="raw",
            key_serializer="raw",
            web_enabled=True,
            web_port=s.scheduler.worker_web_port,
            web_bind="127.0.0.1",
            topic_allow_declare=False,
            topic_disable_leader=True,
            consumer_auto_offset_reset="earliest",
            broker_session_timeout=s.scheduler.session_timeout_s,
            broker_heartbeat_interval=max(1.0, s.scheduler.session_timeout_s / 5),
            # Bounds a request to a hung group coordinator, a heartbeat's included
            # (settings: kafka_request_timeout_s says why this value).
            broker_request_timeout=s.scheduler.kafka_request_timeout_s,
            broker_commit_interval=1.0,
            # A hung leader answers no fetch, so only a metadata re-read finds its successor
            # (base.settings.KafkaSettings.metadata_refresh_ms).
            consumer_metadata_max_age_ms=s.kafka.metadata_refresh_ms,
            stream_wait_empty=False,
            producer_acks=-1,
        )

    def _add_command_agent(self, app: faust.App) -> None:
        s = self.settings
        commands = app.topic(
            self.catalog.commands.name,
            key_type=bytes,
            value_type=bytes,
            partitions=self.catalog.commands.partitions,
        )
        batch_size = s.scheduler.command_batch_size
        batch_wait_s = max(1, s.scheduler.command_batch_wait_ms) / 1000  # 0 would mean forever
        commands_name = self.catalog.commands.name

        self.processor.assigned = commands_assigned(
            lambda: app.consumer.assignment(), commands_name, self.ownership
        )

        @app.agent(commands, name="commands")
        async def command_agent(stream: StreamT[bytes]) -> None:
            await self._ensure_started()
            # Faust's batching, with no timer armed while nothing is buffered (streams.batches).
            async for events in batches.take_events(_stream(stream), batch_size, batch_wait_s):

                async def handle(events: Sequence[EventT[bytes]] = events) -> None:
                    left = await self.processor.process_until_answered(
                        [_raw_command(e) for e in events]
                    )
                    if left:
                        unanswered = {(m.partition, m.offset) for m in left}
                        for e in events:
                            if (e.message.partition, e.message.offset) in unanswered:
                                # Marked done without reaching the consumer's commit
                                # bookkeeping: never committed here, the new owner replays it.
                                e.message.acked = True
                    self._observe_lag(app, events)

                # (process_until_answered raises nothing but cancellation, by design.)
                await self._handle_batch("commands", events, handle)

    def _add_delivery_agent(self, app: faust.App) -> None:
        deliveries = app.topic(
            self.catalog.deliveries.name,
            key_type=bytes,
            value_type=bytes,
            partitions=self.catalog.deliveries.partitions,
        )
        batch_size = self.settings.scheduler.command_batch_size

        @app.agent(deliveries, name="deliveries")
        async def delivery_agent(stream: StreamT[bytes]) -> None:
            """Record the proxy's final delivery outcomes into each schedule's status."""
            await self._ensure_started()
            async for events in batches.take_events(_stream(stream), batch_size, BATCH_WAIT_S):

                async def handle(events: Sequence[EventT[bytes]] = events) -> None:
                    outcomes = [o for e in events if (o := parse_outcome(e.message.value))]
                    tenants = self.processor.tenants
                    await record_outcomes(self.store, tenants, outcomes)
                    await record_dead_letters(self.dead_letters, tenants, outcomes)

                await self._handle_batch("deliveries", events, handle)

    async def _handle_batch(
        self, agent: str, events: Sequence[EventT[bytes]], handle: Callable[[], Awaitable[None]]
    ) -> None:
        """Run ``handle`` on one batch of ``agent`` until it returns. A retriable error
        (``TocsinError.retriable``: Cassandra or Kafka unavailable for a moment) is retried
        with backoff, ``BATCH_ATTEMPTS`` times in all. Anything else, or the last retriable
        one, must not escape: the batch's generator acks its events whatever the handler
        did (streams.batches, as Faust's), so the batch would be committed unhandled and
        lost, silently, while Faust restarts the agent. Its events are instead marked done
        without reaching the consumer's commit bookkeeping, as the command agent's
        unanswered commands are: the partition's offset is never committed past them, and
        this process's next start (or the partition's next owner) reads them again. The
        error is logged and the worker marked dead (``/healthz`` 503) so that it is
        restarted; the agent goes on meanwhile, committing nothing past the batch."""
        delay = 1.0
        attempt = 0
        while True:
            attempt += 1
            try:
                await handle()
                return
            except asyncio.CancelledError:
                # Stopped mid-batch: the generator's close would ack (commit) the batch
                # unhandled, and an admitted create has no client left to re-send it.
                # Kept out of the commit, the next owner reads it again (a duplicate
                # decides as one).
                for event in events:
                    event.message.acked = True
                raise
            except Exception as exc:
                retriable = isinstance(exc, TocsinError) and exc.retriable
                if not retriable or attempt >= BATCH_ATTEMPTS:
                    failure = exc
                    break
                log.warning(
                    "agent batch failed; retrying it",
                    extra={"agent": agent, "events": len(events), "error": str(exc)},
                )
                await self.batch_retry_sleep(delay)
                delay = min(delay * 2, 30.0)
        for e in events:
            e.message.acked = True
        offsets = sorted((e.message.partition, e.message.offset) for e in events)
        log.error(
            "agent batch failed for good; left uncommitted until the worker restarts",
            exc_info=failure,
            extra={"agent": agent, "events": len(events), "first": offsets[0]},
        )
        self.health.fail(f"{agent} agent", f"{agent} agent: a batch failed: {failure!r}")

    def _add_lifecycle_handlers(self, app: faust.App) -> None:
        s = self.settings

        @app.timer(1.0)  # type: ignore[untyped-decorator]
        async def heartbeat() -> None:
            self.health.beat()

        @app.on_partitions_revoked.connect  # type: ignore[arg-type]
        async def on_revoked(sender: AppT, revoked: set[TP], **kwargs: object) -> None:
            partitions = {tp.partition for tp in revoked if tp.topic == self.catalog.commands.name}
            await self._stop_materializers(partitions)
            await self.ownership.revoked(partitions, member_generation(app))
            metrics.OWNED_PARTITIONS.set(len(self.tickers))

        @app.on_partitions_assigned.connect  # type: ignore[arg-type]
        async def on_assigned(sender: AppT, assigned: set[TP], **kwargs: object) -> None:
            mine = {tp.partition for tp in assigned if tp.topic == self.catalog.commands.name}
            set_fetch_max_wait(
                app, s.scheduler.consumer_fetch_max_wait_ms, s.scheduler.consumer_fetch_min_bytes
            )
            fetch_wait.pace(
                app.consumer,
                busy_wait_ms=s.scheduler.consumer_fetch_max_wait_ms,
                busy_min_bytes=s.scheduler.consumer_fetch_min_bytes,
                idle_wait_ms=s.scheduler.consumer_fetch_idle_wait_ms,
            )
            if s.scheduler.inline_handover:
                drain.install(app.consumer)
            if self._coordinator_watch is None and s.scheduler.coordinator_query_interval_s > 0:
                # Started here, once the consumer's thread runs its loop.
                self._coordinator_watch = coordinator_watch.follow(
                    app.consumer,
                    interval_s=s.scheduler.coordinator_query_interval_s,
                    health=self.health,
                )
            await self._ensure_started()
            await self.ownership.assigned(mine, app.consumer_generation_id)
            # A materialiser hands rows to its own ticker: one whose ticker was replaced or
            # stopped goes too.
            await self._stop_materializers(
                {p for p, m in self.materializers.items() if m.ticker is not self.tickers.get(p)}
            )
            for partition in sorted(set(self.tickers) - set(self.materializers)):
                self._start_materializer(partition)
            metrics.OWNED_PARTITIONS.set(len(self.tickers))
            # Owning no partition is fine (a standby when workers outnumber partitions).
            self.health.set_ready(True)

        @app.on_before_shutdown.connect  # type: ignore[arg-type]
        async def on_shutdown(sender: AppT, **kwargs: object) -> None:
            if self._coordinator_watch is not None:
                self._coordinator_watch.stop()
            await self._stop_materializers(set(self.materializers))
            await self.ownership.stop_all()
            await self.emitter.close()
            await self.results_emitter.close()
            await self.store.close()

    def _new_ticker(self, partition: int) -> PartitionTicker:
        """A started ticker for a commands partition just assigned (Ownership.start)."""
        ticker = PartitionTicker(
            partition,
            store=self.store,
            sink=self.emitter,
            config=self.ticker_config,
            clock_ms=self.clock_ms,
            # The command agent's cache: fire quotas and retention, same TTL.
            tenants=self.processor.tenants,
            health=self.health,
        )
        ticker.start()
        return ticker

    def _start_materializer(self, partition: int) -> None:
        """Start the materialiser of an owned partition, next to its (running) ticker. Always
        a fresh one: it keeps nothing in memory that its store does not (a position, the
        due queue), so a stop and start costs a read, and a step cut short is redone."""
        materializer = PartitionMaterializer(
            partition,
            store=self.recurring,
            ticker=self.tickers[partition],
            config=self.materializer_config,
            clock_ms=self.clock_ms,
        )
        self.materializers[partition] = materializer
        materializer.start()

    def _observe_lag(self, app: faust.App, events: Sequence[EventT[bytes]]) -> None:
        last: dict[TP, int] = {}
        for e in events:
            last[e.message.tp] = max(last.get(e.message.tp, -1), e.message.offset)
        # A batch read before a rebalance can finish after it: a partition given away
        # meanwhile has no highwater (aiokafka asserts it is assigned).
        held = app.consumer.assignment()
        for tp, offset in last.items():
            if tp not in held:
                continue
            high = app.consumer.highwater(tp)
            if high is not None:
                metrics.CONSUMER_LAG.labels(str(tp.partition)).set(max(0, high - offset - 1))

    async def _ensure_started(self) -> None:
        """Connect the edges once, whichever of the agent or the first assignment comes first."""
        async with self._start_lock:
            if not self._started:
                # Faust's worker installs its own handlers on start; ours win afterwards.
                setup_logging(self.settings.log_level, self.settings.log_format)
                await self.store.connect()
                await self.recurring.prepare()
                self.emitter.start()
                self.results_emitter.start()
                metrics.observe_gc_pauses()
                metrics.tune_gc_for_worker()
                self._lag_watch = asyncio.ensure_future(metrics.watch_loop_lag())
                self._started = True
                log.info(
                    "worker edges connected",
                    # The standard loop, always (settings: event_loop says why).
                    extra={"event_loop": type(asyncio.get_running_loop()).__module__},
                )

    async def _stop_materializers(self, partitions: set[int]) -> None:
        """Stop these partitions' materialisers, before their tickers are suspended: a step
        hands rows to its ticker."""
        stopping = [self.materializers.pop(p) for p in partitions if p in self.materializers]
        await asyncio.gather(*(m.stop() for m in stopping))


@dataclass
class Ownership:
    """Which commands partitions' tickers run here, across the consumer group's rebalances.

    Faust's group protocol is eager: a rebalance first revokes every partition of every
    member, then assigns them all again (mostly to the same members: Faust's assignor is
    sticky). A revoked partition's ticker is suspended, not stopped: it emits nothing from
    then on (another worker may be given the partition) but keeps what it has loaded and
    what is in flight. At the assignment, a partition counts as kept, and its ticker
    resumes, only if this member's ownership had no break: it held the partition in
    generation G (its membership still valid when revoked) and is given it in generation
    G + 1, so no generation, and so no other worker, owned it in between. Otherwise (a
    membership lost, an assignment several generations later, the partition given to
    another member) the suspended ticker stops without writing again, and a fresh one
    starts from the stored checkpoint if the partition is assigned here, which is what a
    new owner does.

    The command agent sees only running tickers (``tickers``, the dict it shares), so
    nothing reaches a suspended one, and a suspended partition does not count as assigned
    here (``commands_assigned``): its commands are left unanswered and uncommitted, as a
    revoked partition's are, and replayed from the committed offset by whoever is given
    it next, this worker included (Faust seeks every assigned partition to its committed
    offset after a rebalance). Decided meanwhile, a command would be written with the
    withdrawals it makes from its ticker skipped, and its replay after the resume
    withdraws nothing, so the resumed ticker would fire what it replaced. A batch past
    that check when the revocation came still does so: it hands those withdrawals here
    (``unwithdrawn``), and they are applied to the partition's next ticker on this worker,
    before it emits anything: the resumed one, or a fresh one (whose first bucket read
    may be answered before the command's write lands: the withdrawals' tombstones refuse
    what it replaced). A partition given to another worker drops them: that worker's
    ticker reads the store, or is running when the command is replayed there.
    """

    tickers: dict[int, PartitionTicker]
    # A started ticker for a partition (the worker's ``_new_ticker``).
    start: Callable[[int], PartitionTicker]
    # How long a revoked ticker waits for its in-flight triggers (settings say why).
    release_wait_s: float
    suspended: dict[int, PartitionTicker] = field(default_factory=dict)
    # The generation of the assignment held now; None before the first one.
    generation: int | None = None
    # This member's generation when it was last revoked, while its membership was valid.
    revoked_in: int | None = None
    # Withdrawals owed to a partition's next ticker here (``unwithdrawn``), in order.
    # Keyed by partition; each list holds at most a batch's commands per rebalance (only
    # a batch past its ``assigned`` check adds to it) and is emptied at each assignment.
    owed: dict[int, list[Callable[[PartitionTicker], None]]] = field(default_factory=dict)

    def unwithdrawn(self, partition: int, withdraw: Callable[[PartitionTicker], None]) -> None:
        """A command's withdrawals from ``partition``'s ticker, decided while it had no
        running one here: applied to the next one (``assigned``)."""
        self.owed.setdefault(partition, []).append(withdraw)

    def _pay(self, ticker: PartitionTicker) -> None:
        for withdraw in self.owed.pop(ticker.partition, []):
            withdraw(ticker)

    async def revoked(self, partitions: set[int], member_generation: int | None) -> None:
        """Suspend the tickers of ``partitions``; ``member_generation``: this member's
        generation now (None or below 1: it has lost its membership)."""
        valid = (
            member_generation is not None
            and member_generation > 0
            and member_generation == self.generation
        )
        self.revoked_in = member_generation if valid else None
        going = {p: self.tickers.pop(p) for p in sorted(partitions) if p in self.tickers}
        self.suspended.update(going)
        await asyncio.gather(*(t.suspend(self.release_wait_s) for t in going.values()))
        if going:
            log.info("partitions suspended", extra={"partitions": sorted(going)})

    async def assigned(self, partitions: set[int], generation: int) -> None:
        """Resume, stop and start tickers for the assignment of ``generation``."""
        unbroken = self.revoked_in is not None and generation == self.revoked_in + 1
        # A running ticker was not revoked (a rebalance whose revocation did not reach
        # here): kept only if this assignment is the next generation after its own.
        kept_running = self.generation is not None and generation == self.generation + 1
        self.revoked_in = None
        self.generation = generation
        resume = {p for p in self.suspended if p in partitions and unbroken}
        drop = [self.suspended.pop(p) for p in sorted(set(self.suspended) - resume)]
        drop += [
            self.tickers.pop(p)
            for p in sorted(self.tickers)
            if p not in partitions or not kept_running
        ]
        await asyncio.gather(*(t.stop(self.release_wait_s) for t in drop))
        # Decided after the await above, with no await until the resumes: a ticker is
        # resumed only if it has a state to go on from (it read its checkpoint);
        # otherwise it is stopped and a fresh one starts.
        renew = [self.suspended.pop(p) for p in sorted(resume) if not self.suspended[p].begun]
        resume -= {t.partition for t in renew}
        for p in sorted(resume):
            ticker = self.suspended.pop(p)
            self._pay(ticker)  # before it emits anything
            ticker.resume()
            self.tickers[p] = ticker
        await asyncio.gather(*(t.stop(self.release_wait_s) for t in renew))
        drop += renew
        started = sorted(partitions - set(self.tickers))
        for p in started:
            self.tickers[p] = self.start(p)
            self._pay(self.tickers[p])  # before its loop's first step (no await since)
        # Owed to partitions not assigned here: their owner reads or replays the change.
        self.owed.clear()
        log.info(
            "partitions assigned",
            extra={
                "generation": generation,
                "resumed": sorted(resume),
                "started": started,
                "stopped": sorted(t.partition for t in drop),
            },
        )

    async def stop_all(self) -> None:
        """Stop every ticker, running or suspended (the worker is shutting down)."""
        going = [*self.tickers.values(), *self.suspended.values()]
        self.tickers.clear()
        self.suspended.clear()
        await asyncio.gather(*(t.stop() for t in going))


def commands_assigned(
    assignment: Callable[[], Set[TP]], topic: str, ownership: Ownership
) -> Callable[[int], bool]:
    """Whether a commands partition counts as assigned here (CommandProcessor.assigned):
    the consumer's own view, not the tickers map (between a revocation and the next
    assignment the map lags behind, and a command must be neither answered nor committed
    here once its partition may belong to another worker), and not while its ticker is
    suspended (``Ownership``: its commands wait for the partition's next owner)."""

    def assigned(partition: int) -> bool:
        if partition in ownership.suspended:
            return False
        return TP(topic, partition) in assignment()

    return assigned


def member_generation(app: faust.App) -> int | None:
    """This member's consumer-group generation as aiokafka holds it now: -1 once the
    coordinator no longer knows the member (aiokafka's reset_generation), None if it cannot
    be read (an upgrade that moved it: every rebalance then restarts the tickers, as
    before). The attribute path is private to the pinned aiokafka (constraints.txt)."""
    try:
        generation = app.consumer._thread._consumer._coordinator.generation  # type: ignore[attr-defined]
    except AttributeError as exc:
        log.warning("cannot read the consumer group generation", extra={"error": repr(exc)})
        return None
    return generation if isinstance(generation, int) else None


def set_fetch_max_wait(app: faust.App, ms: int, min_bytes: int = 1) -> None:
    """Give the worker's Kafka consumer a fetch wait of ``ms`` and a fetch minimum of
    ``min_bytes`` (settings.py says why) and publish the wait it now uses as
    ``tocsin_consumer_fetch_max_wait_ms``.

    Faust creates its aiokafka consumer with fetch_max_wait_ms=1500 and no setting for it;
    aiokafka's fetcher reads the value for every request it builds, so setting it once the
    consumer runs (at each assignment) applies from the next fetch. The attribute path is
    private to the pinned faust-streaming and aiokafka (constraints.txt): an upgrade that
    moves it is reported here and by the integration test reading the metric back."""
    try:
        fetcher = app.consumer._thread._consumer._fetcher  # type: ignore[attr-defined]
        # Assigning a renamed attribute would raise nothing and change nothing: check first.
        missing = [a for a in ("_fetch_max_wait_ms", "_fetch_min_bytes") if not hasattr(fetcher, a)]
        if missing:
            raise AttributeError(f"aiokafka's fetcher has no {', '.join(missing)}")
        fetcher._fetch_max_wait_ms = ms
        fetcher._fetch_min_bytes = max(1, min_bytes)
        used = int(fetcher._fetch_max_wait_ms)
    except AttributeError as exc:
        log.warning("cannot set the consumer's fetch wait", extra={"error": repr(exc)})
        return
    metrics.CONSUMER_FETCH_MAX_WAIT.set(used)


# aiokafka's timestamp_type of a record the broker stamped (its batch's attribute bit).
_AIOKAFKA_LOG_APPEND_TIME = 1


def _timestamp_type(value: int | None) -> TimestampType:
    if value == _AIOKAFKA_LOG_APPEND_TIME:
        return TimestampType.LOG_APPEND_TIME
    return TimestampType.CREATE_TIME


def skewed_clock(skew_ms: int) -> Clock:
    """The wall clock in epoch ms, offset by ``skew_ms`` (TOCSIN_CLOCK_SKEW_MS, fault
    injection: a host whose clock runs fast or slow)."""
    if not skew_ms:
        return now_ms
    return lambda: now_ms() + skew_ms


def _observe_bucket_query(seconds: float, rows: int) -> None:
    metrics.BUCKET_QUERIES.inc()
    metrics.BUCKET_ROWS.inc(rows)
    metrics.BUCKET_READ_SECONDS.observe(seconds)


def run_worker(settings: Settings) -> None:
    """Run a worker until SIGTERM/SIGINT (blocking); ConfigError at once if the keyspace
    belongs to another deployment (streams.binding)."""
    # Before joining the consumer group: on another deployment's keyspace this worker
    # would tick that deployment's bucket partitions and move its checkpoints.
    check_keyspace(settings, owner=f"{socket.gethostname()}:{os.getpid()}")
    # The standard loop whatever TOCSIN_EVENT_LOOP says (settings: event_loop, why).
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    worker = Worker(settings)
    serve_health(
        worker.health, settings.scheduler.metrics_port, addr=settings.scheduler.metrics_addr
    )
    faust_worker = faust.Worker(
        worker.app, loglevel=settings.log_level.lower(), quiet=True, redirect_stdouts=False
    )
    faust_worker.execute_from_commandline()


def _stream(stream: StreamT[bytes]) -> faust.Stream[bytes]:
    """The stream an agent is given: a faust.Stream, whose batching (take_events) the
    StreamT interface does not declare."""
    return cast("faust.Stream[bytes]", stream)


def _raw_command(event: EventT[bytes]) -> RawCommand:
    """A Faust event of the commands topic as the command agent takes it."""
    m = event.message
    return RawCommand(
        partition=m.partition,
        offset=m.offset,
        key=m.key,
        value=m.value,
        timestamp_ms=int(m.timestamp * 1000),
        headers=m.headers or (),
        timestamp_type=_timestamp_type(m.timestamp_type),
    )

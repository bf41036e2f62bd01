"""The per-partition tick agent: fires one commands-partition's buckets at their due second.

Exactly one live worker runs the ticker of a partition: the one the consumer group gave
that commands partition to (started on assignment; suspended on revocation, then resumed
if the next generation gives it back, else stopped: streams.app.Ownership). It:

1. reads the durable checkpoint ``fired_before_ms`` (every row due before it was acked on
   the fire topic or recorded as missed), then loads each minute bucket from the
   checkpoint's minute onwards with one paged read, ``preload_ahead_s`` before the minute
   starts: catch-up after downtime is just loading the minutes that passed;
2. pops entries whose due second has come - never before their due time by this clock -
   and records those beyond their misfire tolerance as missed; the others go to a fair
   queue (``streams.pacing``) that emits them round-robin across tenants, each tenant
   within its fire quota (excess fires are deferred, never dropped, and never recorded as
   missed because of the wait);
3. advances the checkpoint only below the earliest trigger not yet acknowledged by Kafka
   and recorded in Cassandra (including those waiting in the fair queue), so a crash
   re-emits at most what was in flight or deferred (duplicates carry the same trigger id;
   nothing is lost).

The command agent of the same worker calls ``hand_over``/``withdraw`` for schedules it
changes, so a schedule created or moved into a minute that is already loaded still fires on
time, and a cancelled one does not. A handed-over row that is already due, or not above the
checkpoint this ticker has read or written, gives the command agent a future to wait for
(Kafka's acknowledgement of its trigger): a successor would start from that checkpoint and
never read the row, so the command must not be answered (nor its offset committed) before.
(One not due yet - below a checkpoint a previous owner's fast clock left - needs no Kafka
acknowledgement: the stored checkpoint is written back below it instead.)
Such a row is emitted like any other, through the timeline: only once the buckets up to its
due time are loaded and after the earlier-due triggers of its order key, so a late create
handed to a ticker still reading its first bucket does not overtake them.

It must never emit a trigger whose bucket row it has not seen or been offered, and never
write a checkpoint past an unacknowledged trigger.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from base.clock import Clock, now_ms
from base.errors import KafkaError, StoreError, TocsinError
from base.supervise import HealthSink, supervise
from streams import metrics
from streams.backfill_stops import (
    BackfillStops,
    Skipped,
    Stop,
    backfilled_run,
    blocks,
    stored_stop,
)
from streams.buckets import BUCKET_MS, minute_ms
from streams.model import BucketRow, FiredMark, trigger_for, trigger_id_of
from streams.pacing import FirePacer
from streams.ports import TenantPolicies, TickerStore
from streams.tenants import TenantConfig
from streams.timeline import Entry, Timeline
from streams.tracing import emit_span
from topics.codec import encode_trigger, trigger_headers

log = logging.getLogger("tocsin.ticker")

T = TypeVar("T")

# Bucket rows held per turn of the loop while a minute loads (about 3-5 ms of CPU).
_HOLD_SLICE = 500
# How long the fires producer's report thread gathers acknowledgements before handing them
# to the event loop (streams.emitter: ``gather_s``). An acknowledgement only lets a fire be
# recorded (``mark_linger_s`` later), the checkpoint move and a command waiting for an
# already-due row be answered; the fire itself is on the topic already. At 1,000 fires/s,
# each sent alone, a hand-over per acknowledgement woke the loop about 1,000 times a second.
FIRE_ACK_GATHER_S = 0.005


class TriggerSink(Protocol):
    def send(
        self,
        topic: str,
        *,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Any]: ...


class Alarm:
    """An ``asyncio.Event`` whose ``wait`` ends at a timeout too: for one waiter at a time
    (the ticker's loop). ``asyncio.wait_for`` on an event's wait makes a task, a timeout
    handle and, when the timeout comes first, a cancellation of that task per wait, and a
    ticker's sleep usually ends by its timeout: at 1,000 fires/s the tickers sleep about
    once per fire. This is one future and one timer handle."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    async def wait(self, timeout_s: float) -> None:
        """Until ``set`` (at once if it is set) or ``timeout_s`` has passed."""
        if self._set:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, _end_wait, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            if self._waiter is waiter:
                self._waiter = None


def _end_wait(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True, kw_only=True)
class TickerConfig:
    fire_topic: str
    owner: str
    bucket_shards: int = 1
    preload_ahead_ms: int = 10_000
    default_misfire_tolerance_s: int = 3600
    # With no checkpoint yet (a brand-new partition), look back this far for rows.
    initial_lookback_ms: int = 3_600_000
    checkpoint_interval_ms: int = 1_000
    mark_group: int = 256  # fired triggers recorded concurrently per round
    # Fired marks wait this long to be grouped into fewer requests (the checkpoint cannot
    # pass an unmarked trigger, so a crash meanwhile only re-fires: at least once). Fires
    # trickling in one by one (jittered recurring runs) otherwise cost a request each.
    mark_linger_s: float = 0.25
    emit_slice: int = 2_000
    # How far beyond the loaded horizon an offer is still kept in memory.
    offer_window_ms: int = 120_000
    # Commands partitions: a tenant's fire quota is split evenly over them (streams.pacing).
    partitions: int = 1
    # How long emission waits to read the config of a tenant it has not seen yet.
    tenant_read_timeout_ms: int = 500


@dataclass
class _InFlight:
    entry: Entry[BucketRow]
    # Time it waited in the fair queue (its turn, its tenant's fire quota): not lateness.
    grace_ms: int = 0
    acked: bool = False  # Kafka has it (being recorded as fired may still be pending)


TriggerKey = tuple[str, str, int]  # (tenant, schedule id, due ms)


class PartitionTicker:
    def __init__(
        self,
        partition: int,
        *,
        store: TickerStore,
        sink: TriggerSink,
        config: TickerConfig,
        clock_ms: Clock = now_ms,
        tenants: TenantPolicies | None = None,
        health: HealthSink | None = None,
    ) -> None:
        self.health = health
        self.partition = partition
        self.store = store
        self.sink = sink
        self.config = config
        self.clock_ms = clock_ms
        self.tenants = tenants  # None: no fire quotas, the global retention
        self.timeline: Timeline[BucketRow] = Timeline()
        # Due entries waiting to be emitted, round-robin across tenants within their quota.
        self.pacer: FirePacer[BucketRow] = FirePacer(
            partitions=config.partitions, order_key_of=_order_key_of
        )
        self.fired_before_ms: int | None = None  # None until the checkpoint is read
        # The highest checkpoint read or handed to the store (a write may still be landing
        # after a restart of the loop re-read a lower one): what a successor may start from.
        self._checkpoint_high_ms = 0
        self._checkpoint_read = asyncio.Event()
        # Hand-overs whose command waits for its trigger's acknowledgement (hand_over).
        self._awaited: dict[TriggerKey, list[asyncio.Future[None]]] = {}
        self._next_minute_ms: int | None = None
        self._inflight: dict[tuple[str, str, int], _InFlight] = {}
        self._firing: dict[tuple[str, str], int] = {}  # in-flight count per schedule
        self._inflight_heap: list[tuple[int, int, tuple[str, str, int]]] = []
        self._seq = itertools.count()
        self._wake = Alarm()
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._to_mark: deque[tuple[tuple[str, str, int], str, int]] = deque()
        self._mark_wake = asyncio.Event()
        self._marker: asyncio.Task[None] | None = None
        self._stopping = False  # stopped or suspended: nothing is sent
        # Suspended (or stopped): the partition may be another worker's, so no checkpoint
        # is written until ``resume``.
        self._checkpoint_frozen = False
        # Set by ``resume``: the loop goes on from the state kept, without re-reading.
        self._resuming = False
        # Triggers whose send failed while suspended: re-sent by ``resume``.
        self._parked: set[TriggerKey] = set()
        # (tenant, order key) -> its triggers whose send failed and that Kafka does not
        # have yet: the key's later triggers are held in the fair queue meanwhile, since a
        # re-send goes out behind them (bounded by the triggers in flight).
        self._resending: dict[tuple[str, str], set[TriggerKey]] = {}
        self._last_checkpoint_ms = 0
        self._written_checkpoint: int | None = None
        # Triggers recorded as fired or missed (and so out of flight): ``_settled`` counts
        # them, ``_fired_at_write`` is that count when the stored checkpoint was computed.
        # Not the count emitted: a trigger is emitted at its ack, while it still holds the
        # checkpoint below it, so a write then counted it without passing it.
        self._settled = 0
        self._fired_at_write = 0
        # When the loop's current sleep ends, unless something wakes it first.
        self.asleep_until_ms: int | None = None
        self.ready = asyncio.Event()  # set once catch-up has loaded up to "now"
        self.emitted = 0
        self.missed = 0
        self._label = str(partition)
        # The partition's series, looked up once: a labels() call per loop turn and per
        # acknowledgement was a measurable share of the loop's CPU at 1,000 fires/s.
        self._timeline_gauge = metrics.TIMELINE_SIZE.labels(self._label)
        self._inflight_gauge = metrics.INFLIGHT.labels(self._label)
        self._deferred_gauge = metrics.FIRES_DEFERRED.labels(self._label)
        self._emitted_counter = metrics.TRIGGERS_EMITTED.labels(self._label)
        self._store_trouble_logged = 0.0
        # Bucket loads and checkpoint writes run beside the loop, not in it: awaiting a slow
        # Cassandra read there held up every trigger of the partition due meanwhile (the
        # next minute is read 10 s ahead, while this minute's runs are still firing).
        self._loader: asyncio.Task[None] | None = None
        self._load_retry_at_ms = 0
        self._checkpointer: asyncio.Task[None] | None = None
        # Bucket rows due before this were fired by whoever wrote the checkpoint read last.
        # Not fired_before_ms, which _rewind_below may lower: that owner's fires stay fired.
        self._load_floor_ms = 0
        # Checkpoint write-backs below rows handed over (_rewind_below): one write covers
        # every row asked for before it started.
        self._rewind_lock = asyncio.Lock()
        self._rewinds_asked = 0
        self._rewinds_written = 0
        # Backfilled runs a pause or cancel stopped (withdraw_backfill, and loads).
        self._backfills = BackfillStops()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        # Supervised: an error restarts the loop (from the stored checkpoint, so nothing is
        # skipped) instead of ending the partition's firing until the next rebalance.
        self._task = asyncio.create_task(
            supervise(f"ticker-{self.partition}", self._run, health=self.health),
            name=f"ticker-{self.partition}",
        )
        self._marker = asyncio.create_task(
            supervise(f"marker-{self.partition}", self._mark_loop, health=self.health),
            name=f"marker-{self.partition}",
        )

    async def suspend(self, wait_s: float) -> None:
        """Stop emitting for a revoked partition, keeping what is loaded (``resume`` goes
        on from it if the partition comes back, ``stop`` ends it otherwise).

        Nothing is sent to Kafka from here on: the loop and a running bucket read are
        cancelled, hand-overs waiting for a trigger fail (their commands are retried, and
        replayed by whoever owns the partition next), and a trigger whose send fails is
        parked instead of re-sent. In-flight triggers are waited for ``wait_s`` at most: the
        consumer group's rebalance waits for this revocation, and an acknowledgement can
        take as long as the brokers need to fence a lost one, so those still in flight are
        left below the checkpoint written here (a new owner re-emits them: duplicates with
        the same trigger id, never a loss). Their acknowledgements still get recorded as
        fired meanwhile (the marker keeps running); no checkpoint is written after this
        one, since the partition may belong to another worker now."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._checkpoint_read.set()  # hand-overs waiting for it give up (_released)
        for task in (self._task, self._loader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = self._loader = None
        # Let acknowledged triggers be recorded (bounded), so the checkpoint covers them.
        deadline = time.monotonic() + wait_s
        while self._inflight and time.monotonic() < deadline:
            self._mark_wake.set()
            await asyncio.sleep(0.05)
        # Hand-overs not acknowledged by now are not answered here: their commands are
        # retried, and replayed by whoever owns the partition next.
        for waiters in list(self._awaited.values()):
            for done in waiters:
                if not done.done():
                    done.set_exception(_released())
        self._awaited.clear()
        if self._checkpointer is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._checkpointer
        with contextlib.suppress(Exception):
            await self._write_checkpoint(force=True)
        self._checkpoint_frozen = True

    def resume(self) -> None:
        """Go on emitting after ``suspend``, from the state kept: only for a partition this
        worker has owned without a break (the consumer group's next generation gave it
        back, so no other worker can have owned it meanwhile; streams.app checks)."""
        if not self._stopping or self._marker is None:
            raise RuntimeError(f"ticker {self.partition} is not suspended")
        self._stopping = False
        self._checkpoint_frozen = False
        # Suspended before its checkpoint was read, there is no state to go on from: the
        # loop reads it first, as a fresh start does (streams.app starts a fresh ticker
        # instead; see ``begun``), and hand-overs wait for that read, not the set
        # ``suspend`` left for its own waiters.
        self._resuming = self.begun
        if not self.begun:
            self._checkpoint_read.clear()
        self._task = asyncio.create_task(
            supervise(f"ticker-{self.partition}", self._run, health=self.health),
            name=f"ticker-{self.partition}",
        )
        # Sends that failed while suspended go out again now, as they would have.
        parked, self._parked = self._parked, set()
        for key in sorted(parked, key=lambda k: k[2]):
            self._redispatch(key)
        self._wake.set()

    @property
    def suspended(self) -> bool:
        return self._stopping

    @property
    def begun(self) -> bool:
        """Whether the checkpoint was read and the loop set up from it (``_begin``): only
        then is there a state that ``resume`` can go on from."""
        return self._next_minute_ms is not None

    async def stop(self, timeout_s: float = 20.0) -> None:
        """Stop firing for good: ``suspend`` (waiting ``timeout_s`` at most for in-flight
        triggers) unless suspended already, then end the marker."""
        await self.suspend(timeout_s)
        if self._marker is not None:
            self._marker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._marker
            self._marker = None
        metrics.TIMELINE_SIZE.labels(self._label).set(0)
        metrics.INFLIGHT.labels(self._label).set(0)
        metrics.FIRES_DEFERRED.labels(self._label).set(0)

    # -- the command agent's side ----------------------------------------------------------

    def offer(self, row: BucketRow) -> None:
        """A schedule was created or moved: keep it in memory if its minute may already be
        loaded (or is about to be), so it fires on time without another bucket read.
        (Only for rows due above the checkpoint and after now; ``hand_over`` checks.)"""
        horizon = max(self.timeline.loaded_until_ms, self.clock_ms()) + self.config.offer_window_ms
        if row.due_ms >= horizon:
            return
        if self._hold(row):
            self._wake.set()

    def withdraw(self, tenant: str, schedule_id: str, version: int) -> None:
        """A schedule was cancelled or moved away (``version`` is its new version)."""
        self.timeline.remove(tenant, schedule_id, version=version, now_ms=self.clock_ms())
        # A trigger deferred by its tenant's fire quota has not fired: it can still go.
        self.pacer.remove(tenant, schedule_id, version=version)
        self._backfills.release(tenant, schedule_id)
        for key in [k for k in self._awaited if k[:2] == (tenant, schedule_id)]:
            if key not in self._inflight:
                self._settle_awaited(key)  # nothing of the withdrawn version fires now

    def withdraw_backfill(self, tenant: str, parent: str, version: int, *, cancelled: bool) -> None:
        """A pause or cancel of ``parent`` (``version``, its new one) stops its backfilled
        runs not emitted yet: those held here are taken out now (from the timeline with a
        tombstone, and from the fair queue) and recorded, and rows of an older version a
        load brings in later are dropped (``BackfillStops``; a later load reads the stop
        stored with the parent). Called before the change is persisted, with no ``await``
        since the decision, like ``withdraw``."""
        now = self.clock_ms()
        stop = Stop(version, cancelled)
        self._backfills.stop(tenant, parent, stop, now_ms=now)
        for run in self._backfills.take_held(tenant, parent):
            entry = self.timeline.get(tenant, run) or self.pacer.get(tenant, run)
            if entry is None or backfilled_run(entry.payload) is None:
                continue  # gone, or a run of the series under the same id (not ours)
            if entry.version >= version:
                self._backfills.hold(entry.payload)  # backfilled after the stop: fires
                continue
            self.timeline.remove(tenant, run, version=version - 1, now_ms=now)
            self.pacer.remove(tenant, run, version=version - 1)
            self._backfills.tally(entry.payload, stop)
        self._record_skips()

    def earliest_unemitted_ms(self, now_ms: int) -> int:
        """No trigger due before this is still to be emitted here: every row below the
        checkpoint was fired, and what waits is in the timeline or the fair queue. Before
        the checkpoint is read, anything this far back may still come
        (``initial_lookback_ms``)."""
        if self.fired_before_ms is None:
            return now_ms - self.config.initial_lookback_ms
        earliest = self.fired_before_ms
        for due in (self.timeline.next_due_ms(), self.pacer.earliest_due_ms()):
            if due is not None:
                earliest = min(earliest, due)
        return earliest

    def may_emit(self, tenant: str, schedule_id: str, due_ms: int) -> bool:
        """Whether the trigger of (tenant, schedule_id) due at ``due_ms`` is not emitted yet:
        its minute is not loaded, or it waits in the timeline or the fair queue. A pause
        decided on this (synchronously, with the withdrawal that follows) leaves nothing of
        the schedule to fire but what is emitted already."""
        if (tenant, schedule_id, due_ms) in self._inflight:
            return False
        if due_ms >= self.timeline.loaded_until_ms:
            return True
        if self.timeline.get(tenant, schedule_id) is not None:
            return True
        return self.pacer.get(tenant, schedule_id) is not None

    def is_firing(self, tenant: str, schedule_id: str) -> bool:
        """True while a trigger of this schedule is emitted but not yet recorded as fired,
        so a cancel arriving now is answered "already fired", not "cancelled"."""
        return self._firing.get((tenant, schedule_id), 0) > 0

    def hand_over(self, row: BucketRow) -> asyncio.Future[None] | None:
        """A schedule's bucket row was written (created, moved, or a replayed command): make
        sure it fires, and say whether its command may be answered now.

        None: it may. Its due time is ahead of this ticker's clock and above every
        checkpoint the ticker has read or written, so it is either held in memory (then the
        checkpoint stays below it until it is acknowledged and recorded) or in a minute not
        read yet; a successor starting from any of those checkpoints reads it too.

        A row due ahead of this clock but not above the checkpoint (a previous owner's
        clock ran ahead): a future that ends once the stored checkpoint is written back
        below it (``_rewind_below``).

        Otherwise a future that ends once Kafka has acknowledged its trigger (or it was
        recorded missed, or a later change of the same batch superseded it); the command
        must not be answered before. That is a row already due, and so at or below the
        checkpoint or about to be. A successor would start past it and never
        read it, so only Kafka can make it durable; it is emitted at its due second by this
        clock (never earlier), in due order with its order key's other triggers (see
        ``_until_acknowledged``), and not paced unless one of those waits in the fair
        queue. Decided by this ticker's clock and checkpoint, not the command batch's: the
        batch's clock is older, and another owner's clock may differ. The future fails with
        a retriable KafkaError if the partition is released first."""
        ceiling = self._checkpoint_ceiling()
        if ceiling is None:  # the checkpoint is not read yet: decide once it is
            return asyncio.ensure_future(self._hand_over_once_read(row))
        if row.due_ms > ceiling and row.due_ms > self.clock_ms():
            self.offer(row)
            return None
        if row.due_ms > self.clock_ms() and not self._stopping:
            return self._rewind_below(row)
        return self._until_acknowledged(row)

    def _rewind_below(self, row: BucketRow) -> asyncio.Future[None]:
        """Hand over a row due ahead of this clock but not above the checkpoint: one left by
        a previous owner whose clock ran ahead. Waiting for its fire would hold its command
        (and every command after it on this worker) until its due time, so instead it is
        held in memory and the stored checkpoint is written back below it; the future ends
        once that write has landed, and a successor then reads its bucket.

        Writing the checkpoint back is always safe: "every row due before it was fired"
        stays true of any lower value. It costs at most a re-emission, after a crash, of
        what the previous owner fired between the two (duplicates carry the same trigger
        id), bounded by its clock's lead. This ticker itself does not fire those again: its
        bucket reads still skip rows below the checkpoint it read (``_load_floor_ms``).
        No checkpoint written afterwards passes the row before it is recorded: the row is
        in the timeline (so ``checkpoint_candidate`` stays at or below it), and
        ``fired_before_ms`` - which every write takes the maximum with - is lowered to it."""
        assert self.fired_before_ms is not None
        if self._hold(row):
            self._wake.set()
        self.fired_before_ms = min(self.fired_before_ms, row.due_ms)
        self._rewinds_asked += 1
        return asyncio.ensure_future(self._write_rewind(self._rewinds_asked))

    async def _write_rewind(self, asked: int) -> None:
        async with self._rewind_lock:
            if self._rewinds_written >= asked:
                return  # a write computed after this row was held has landed
            if self._stopping:
                raise _released()
            # A checkpoint write started before the row was held may still carry the old,
            # higher value: let it land first, so that this write is the later one.
            running = self._checkpointer
            if running is not None and not running.done():
                await asyncio.wait({running})
            if self._stopping:
                raise _released()  # suspended meanwhile: no checkpoint is written now
            covered = self._rewinds_asked
            # Written even if the value looks unchanged: the store may hold a higher one
            # (a write that failed here may still have landed there).
            self._written_checkpoint = None
            await self._write_checkpoint(force=True)
            self._rewinds_written = covered

    async def fire_now(self, row: BucketRow) -> None:
        """Emit a row whose due time has passed (a late recurring run) and wait for Kafka's
        ack (being recorded as fired follows; until then the checkpoint stays below it)."""
        await self._until_acknowledged(row)

    def _checkpoint_ceiling(self) -> int | None:
        """The highest checkpoint this ticker has read or may have written; None until the
        stored one is read."""
        if self.fired_before_ms is None:
            return None
        return max(self.fired_before_ms, self._checkpoint_high_ms)

    async def _hand_over_once_read(self, row: BucketRow) -> None:
        await self._checkpoint_read.wait()
        # Set by ``suspend`` (or ``stop``) rather than by a read: the hand-over fails
        # (retriable, its command is retried) instead of handing over again, which with
        # no checkpoint would wait here again at once, a new task each loop turn.
        if self._stopping or self.fired_before_ms is None:
            raise _released()
        pending = self.hand_over(row)
        if pending is not None:
            await pending

    def _until_acknowledged(self, row: BucketRow) -> asyncio.Future[None]:
        """Emit ``row`` at its due second; the future ends when Kafka has its trigger (see
        ``hand_over``).

        It goes through the timeline even when already due, so ``_admit_due`` emits it in
        due order: not before the buckets up to its due time are loaded (a fresh ticker's
        first read may still be running, holding earlier rows of its order key), and
        behind any trigger of its order key waiting in the fair queue (otherwise it skips
        that queue: its command waits, and the create quota bounds these)."""
        key = (row.tenant, row.schedule_id, row.due_ms)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._stopping:
            done.set_exception(_released())
            return done
        self._awaited.setdefault(key, []).append(done)
        done.add_done_callback(functools.partial(self._unawait, key))
        record = self._inflight.get(key)
        if record is not None:  # emitted already: its ack (or its retry's) settles this
            if record.acked:
                self._settle_awaited(key)
            return done
        queued = self.pacer.get(row.tenant, row.schedule_id)
        if (
            self.timeline.superseded(row.tenant, row.schedule_id, row.version)
            or (queued is not None and queued.version > row.version)
            or self._backfills.stop_of(row, self.clock_ms()) is not None
        ):
            # Cancelled or moved by a later command of the same batch (or a backfilled run
            # a pause or cancel of the batch stopped): nothing to fire.
            self._settle_awaited(key)
            return done
        # Queued already (a replay): taken out, so that it is not held by its tenant's
        # fire quota unless an earlier trigger of its order key is.
        self.pacer.remove(row.tenant, row.schedule_id, version=row.version)
        self.timeline.remove(row.tenant, row.schedule_id)
        self._hold(row)
        self._wake.set()
        return done

    def _hold(self, row: BucketRow) -> bool:
        """Add ``row`` to the timeline; False if refused: a newer or removed version (see
        ``Timeline.add``), or a backfilled run a pause or cancel stopped (recorded here if
        its minute is loaded already: otherwise its load drops and records it)."""
        stop = self._backfills.stop_of(row, self.clock_ms())
        if stop is not None:
            if row.due_ms < self.timeline.loaded_until_ms:
                self._backfills.tally(row, stop)
                self._record_skips()
            return False
        if not self.timeline.add(Entry(row.due_ms, row.tenant, row.schedule_id, row.version, row)):
            return False
        self._backfills.hold(row)
        return True

    def _settle_awaited(self, key: TriggerKey) -> None:
        for done in self._awaited.pop(key, ()):
            if not done.done():
                done.set_result(None)

    def _unawait(self, key: TriggerKey, done: asyncio.Future[None]) -> None:
        waiters = self._awaited.get(key)
        if waiters is not None and done in waiters:
            waiters.remove(done)
            if not waiters:
                del self._awaited[key]

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        if self._resuming:
            # Resumed after a suspension: everything loaded and in flight is still this
            # ticker's, so the loop goes on from it (a restart after an error below
            # re-reads the checkpoint, as a fresh start does).
            self._resuming = False
            log.info("ticker resumed", extra={"partition": self.partition})
        else:
            await self._begin()
        await self._loop()

    async def _begin(self) -> None:
        # Cassandra down at start: wait for it rather than die for good.
        checkpoint = await self._until_stored(
            "reading the checkpoint", lambda: self.store.get_checkpoint(self.partition)
        )
        now = self.clock_ms()
        if checkpoint is None:
            checkpoint = now - self.config.initial_lookback_ms
        # A restart keeps a lower checkpoint of its own (_rewind_below): the one read may be
        # an older, higher value that a write-back still landing replaces.
        previous = self.fired_before_ms
        self.fired_before_ms = checkpoint if previous is None else min(previous, checkpoint)
        self._load_floor_ms = checkpoint
        self._checkpoint_high_ms = max(self._checkpoint_high_ms, checkpoint)
        self._checkpoint_read.set()
        self._written_checkpoint = checkpoint
        self._next_minute_ms = minute_ms(checkpoint)
        log.info(
            "ticker started",
            extra={
                "partition": self.partition,
                "fired_before_ms": checkpoint,
                "catchup_ms": now - checkpoint,
            },
        )

    async def _loop(self) -> None:
        while not self._stopping:
            # A store failure in a load must not end this task (the partition would not
            # fire again until a rebalance): it is retried a second later; what is already
            # loaded keeps firing meanwhile, and the unread minute stays unread (the
            # timeline's loaded horizon and so the checkpoint stay below it), so nothing
            # is skipped.
            self._start_load()
            await self._admit_due(self.clock_ms())
            now = self.clock_ms()
            sent = self._emit_ready(now, limit=self.config.emit_slice)
            self._start_checkpoint(now)
            self._timeline_gauge.set(len(self.timeline))
            self._inflight_gauge.set(len(self._inflight))
            self._deferred_gauge.set(len(self.pacer))
            if sent >= self.config.emit_slice:
                await asyncio.sleep(0)  # more due now: yield to the loop, then go on
                continue
            await self._sleep_until_next(now)

    @contextlib.contextmanager
    def _store_trouble(self, what: str) -> Iterator[None]:
        """Log (at most every 10 s) and swallow a store failure; the loop retries."""
        try:
            yield
        except StoreError as exc:
            now = time.monotonic()
            if now - self._store_trouble_logged > 10:
                self._store_trouble_logged = now
                log.warning(
                    "store unavailable; retrying",
                    extra={"partition": self.partition, "while": what, "error": str(exc)},
                )

    async def _until_stored(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()`` until the store answers (StoreError: retry after a second)."""
        while True:
            with self._store_trouble(what):
                return await call()
            await asyncio.sleep(1.0)

    def _loading(self) -> bool:
        return self._loader is not None and not self._loader.done()

    def _start_load(self) -> None:
        """Start ``_load_due_buckets`` when a minute came within the preload window, unless
        a read is running or failed less than a second ago. (The check is repeated here
        only so that the loop does not start a task each round for nothing.)"""
        assert self._next_minute_ms is not None
        now = self.clock_ms()
        if self._loading() or now < self._load_retry_at_ms:
            return
        if self._next_minute_ms <= minute_ms(now + self.config.preload_ahead_ms):
            self._loader = asyncio.create_task(self._load_in_background())

    async def _load_in_background(self) -> None:
        loaded = False
        try:
            with self._store_trouble("loading buckets"):
                await self._load_due_buckets()
                loaded = True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("loading buckets failed", extra={"partition": self.partition})
        if not loaded:
            self._load_retry_at_ms = self.clock_ms() + 1_000
        self._wake.set()  # the loop may emit what was loaded

    def _start_checkpoint(self, now: int) -> None:
        if now - self._last_checkpoint_ms < self.config.checkpoint_interval_ms:
            return
        if self._checkpointer is not None and not self._checkpointer.done():
            return
        self._checkpointer = asyncio.create_task(self._checkpoint_in_background())

    async def _checkpoint_in_background(self) -> None:
        with self._store_trouble("writing the checkpoint"):
            await self._write_checkpoint()

    async def _load_due_buckets(self) -> None:
        """Read every bucket whose minute starts before now + preload, one paged read each."""
        assert self._next_minute_ms is not None
        while not self._stopping:
            now = self.clock_ms()
            horizon_minute = minute_ms(now + self.config.preload_ahead_ms)
            backlog = (horizon_minute - self._next_minute_ms) // BUCKET_MS + 1
            metrics.CATCHUP_BACKLOG.labels(self._label).set(max(0, backlog - 1))
            if self._next_minute_ms > horizon_minute:
                if not self.ready.is_set():
                    self.ready.set()
                return
            minute = self._next_minute_ms
            rows = await self.store.read_bucket(self.partition, minute, self.config.bucket_shards)
            metrics.BUCKET_LOADS.inc()
            rows = [row for row in rows if row.due_ms >= self._load_floor_ms]
            stops = await self._stored_stops(rows)
            # Held in slices, the loop emitting what is due between them: a minute of 1,000
            # fires/s is 7,500 rows a partition, and holding them in one go stalled every
            # partition's emission for 50-70 ms. No await between a row's stop check and its
            # hold: a stop or cancel told between slices is seen by the later rows
            # (``stop_of``, the timeline's tombstones) and takes the held ones out
            # (``withdraw_backfill``, ``withdraw``), as after a read held in one go. The
            # minute counts as loaded only once every slice is held.
            for start in range(0, len(rows), _HOLD_SLICE):
                if start:
                    await asyncio.sleep(0)
                now = self.clock_ms()
                for row in rows[start : start + _HOLD_SLICE]:
                    stop = self._backfills.stop_of(row, now) or stops.get(
                        (row.tenant, row.schedule_id)
                    )
                    if stop is not None and blocks(stop, row):
                        self._backfills.tally(row, stop)
                    else:
                        self._hold(row)
            self._record_skips()
            self.timeline.mark_loaded(minute + BUCKET_MS)
            self._next_minute_ms = minute + BUCKET_MS
            if backlog > 1:
                # Catching up: fire what this minute held before reading the next one, so a
                # long outage streams out instead of loading every minute into memory first.
                await self._admit_due(self.clock_ms())
                self._emit_ready(self.clock_ms())
                self._start_checkpoint(self.clock_ms())

    async def _sleep_until_next(self, now: int) -> None:
        assert self._next_minute_ms is not None
        # The sleep starts now, not at ``now`` (read before the turn's emission): measured
        # from that reading, the emission's own time (milliseconds for a burst) would be
        # slept again, past the next due time. (A clock stepped back keeps the reading.)
        now = max(now, self.clock_ms())
        wake_at = now + 1_000  # re-check at least once a second (checkpoint, clock jumps)
        if not self._loading():  # (a running load wakes the loop when it is done)
            next_load = max(
                self._load_retry_at_ms, self._next_minute_ms - self.config.preload_ahead_ms
            )
            # Holding nothing, nothing can fall due, be acknowledged or move the checkpoint
            # before the next read; whatever comes sooner wakes the loop (an offer or
            # hand-over, a suspension or resume). The sleep is monotonic time and the read
            # is due at a wall-clock time: after a VM pause (the wall clock goes on, the
            # monotonic one stops) the loop sees the wall clock again within the preload
            # lead, not up to 50 s later, so the read is at most that late after the pause
            # (0.1 wake-ups a second per idle ticker at the default 10 s). A trigger
            # recorded since the stored checkpoint was computed keeps the 1 s re-check
            # until a write passes it: a successor would fire it again meanwhile.
            idle = self._holds_nothing() and self._settled == self._fired_at_write
            # (Never under the 1 s re-check: a preload lead of 0 would spin.)
            idle_wake = min(next_load, now + max(1_000, self.config.preload_ahead_ms))
            wake_at = idle_wake if idle else min(wake_at, next_load)
        next_due = self._next_admissible_ms()
        if next_due is not None:
            wake_at = min(wake_at, next_due)
        token_at = self.pacer.next_token_ms(now, self._fire_quota_of)
        if token_at is not None:  # a deferred tenant's next fire token
            wake_at = min(wake_at, max(token_at, now + 1))
        delay_s = max(0.0, (wake_at - now) / 1000)
        self._wake.clear()
        if delay_s > 0:
            self.asleep_until_ms = wake_at
            try:
                await self._wake.wait(delay_s)
            finally:
                self.asleep_until_ms = None

    def _holds_nothing(self) -> bool:
        """Nothing loaded or offered is waiting, nothing is in flight or deferred, and no
        command waits for a trigger (what an idle partition looks like)."""
        return not (self.timeline or self._inflight or self.pacer or self._awaited)

    # -- the fair queue --------------------------------------------------------------------

    def _next_admissible_ms(self) -> int | None:
        """Due time of the earliest timeline entry ``_admit_due`` takes once it is due. One
        at or beyond the loaded horizon (offered or handed over ahead of its minute's read)
        waits for that read, whose end wakes the loop."""
        next_due = self.timeline.next_due_ms()
        if next_due is None or next_due >= self.timeline.loaded_until_ms:
            return None
        return next_due

    async def _admit_due(self, now: int) -> None:
        """Move every entry due by ``now`` from the timeline into the fair queue (those
        beyond their misfire tolerance are recorded as missed instead). All of a due second
        is moved before it is emitted, so the emission can interleave its tenants.

        Only entries below the loaded horizon are moved: a row handed over ahead of its
        minute's read would otherwise overtake that minute's earlier rows of its order key.
        Entries come oldest first, so an entry that skips the queue (a command waits for it)
        may do so only while nothing of its order key is queued."""
        cold: set[str] = set()
        seen: set[str] = set()
        while True:
            until = min(now, self.timeline.loaded_until_ms - 1)
            due = self.timeline.pop_due(until, limit=self.config.emit_slice)
            for entry in due:
                if now - entry.due_ms > self._tolerance_ms(entry.payload):
                    self._dispatch(entry, now)  # records it as missed
                    continue
                if (
                    self._awaited
                    and (entry.tenant, entry.schedule_id, entry.due_ms) in self._awaited
                    and not self.pacer.holds_order_key_of(entry)
                    and (entry.tenant, _order_key_of(entry)) not in self._resending
                ):
                    self._dispatch(entry, now)  # a command waits for it: not paced
                    continue
                self.pacer.push(entry, now)
                if entry.tenant not in seen:
                    seen.add(entry.tenant)
                    if self.tenants is not None and self.tenants.peek(entry.tenant) is None:
                        cold.add(entry.tenant)
            if len(due) < self.config.emit_slice or self._stopping:
                break
            await asyncio.sleep(0)  # a burst second: move it in slices, letting others run
        if cold:
            # A tenant this worker has not read yet (e.g. after a rebalance): read its fire
            # quota before its first fire rather than emitting unpaced meanwhile - briefly:
            # with Cassandra down, loaded triggers must keep firing (unpaced, then).
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(self._tenant_config(t) for t in cold)),
                    timeout=self.config.tenant_read_timeout_ms / 1000,
                )

    def _emit_ready(self, now: int, limit: int | None = None) -> int:
        """Emit what the fair queue lets out now; returns how many."""
        taken = self.pacer.take(now, self._fire_quota_of, limit=limit)
        for paced in taken:
            entry = paced.entry
            if self._resending and (entry.tenant, _order_key_of(entry)) in self._resending:
                # Its key's send failed earlier in this slice: held again, its wait kept.
                self.pacer.push(entry, now - paced.waited_ms)
                continue
            if paced.throttled:
                metrics.count_throttled(paced.entry.tenant)
            self._dispatch(paced.entry, now, grace_ms=paced.waited_ms)
        return len(taken)

    def _fire_quota_of(self, tenant: str) -> int:
        config = self.tenants.peek(tenant) if self.tenants is not None else None
        return config.fire_quota_per_min if config is not None else 0

    async def _tenant_config(self, tenant: str) -> TenantConfig | None:
        """The tenant's config (cached; None without tenants or when the store fails)."""
        if self.tenants is None:
            return None
        try:
            return await self.tenants.config(tenant)
        except StoreError:
            return self.tenants.peek(tenant)

    async def _retention_of(self, tenant: str) -> int | None:
        config = await self._tenant_config(tenant)
        return config.retention_s if config is not None else None

    def _tolerance_ms(self, row: BucketRow) -> int:
        tolerance_s = row.misfire_tolerance_s
        if tolerance_s is None:
            tolerance_s = self.config.default_misfire_tolerance_s
        return tolerance_s * 1000

    # -- emitting --------------------------------------------------------------------------

    def _dispatch(
        self, entry: Entry[BucketRow], now: int, *, grace_ms: int = 0
    ) -> asyncio.Future[Any] | None:
        """Emit (or record as missed) one entry; returns the Kafka ack future of an emit.
        ``grace_ms``: time it waited in the fair queue, which does not count as late."""
        row = entry.payload
        key = (row.tenant, row.schedule_id, row.due_ms)
        if key in self._inflight:
            return None
        self._backfills.release(row.tenant, row.schedule_id)
        trig_id = trigger_id_of(row)
        self._inflight[key] = _InFlight(entry, grace_ms)
        self._firing[key[:2]] = self._firing.get(key[:2], 0) + 1
        heapq.heappush(self._inflight_heap, (row.due_ms, next(self._seq), key))
        if now - row.due_ms - grace_ms > self._tolerance_ms(row):
            task = asyncio.ensure_future(self._record_missed(row, trig_id, now))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(functools.partial(self._settle_missed, key))
            return None
        try:
            trigger = trigger_for(row, emitted_ms=now, trigger_id=trig_id)
            trigger = emit_span(trigger, row.partition)  # itself unless tracing is on
            ack = self.sink.send(
                self.config.fire_topic,
                key=trigger.order_key.encode(),
                value=encode_trigger(trigger),
                headers=trigger_headers(trigger),
            )
        except Exception as exc:
            # Refused before it was queued. The cluster's state (queue full, brokers away)
            # passes: retried a second later. The record itself refused (larger than the
            # topic takes, a row without a valid callback) never passes: recorded as missed
            # with the reason, so it stops holding the checkpoint.
            if isinstance(exc, TocsinError) and exc.retriable:
                self._send_failed(key, exc)
            else:
                self._give_up(row, trig_id, now, key, exc)
            return None
        # No task per trigger: a burst minute emits tens of thousands. The ack lands in a
        # queue that one marker task records in Cassandra once the burst is out.
        ack.add_done_callback(functools.partial(self._acked, key, trig_id, now))
        return ack

    def _acked(
        self, key: tuple[str, str, int], trig_id: str, emitted_ms: int, ack: asyncio.Future[Any]
    ) -> None:
        record = self._inflight.get(key)
        if record is None:
            return
        if ack.cancelled() or ack.exception() is not None:
            exc = None if ack.cancelled() else ack.exception()
            if isinstance(exc, TocsinError) and not exc.retriable:
                self._give_up(record.entry.payload, trig_id, emitted_ms, key, exc)
            else:
                self._send_failed(key, exc)
            return
        record.acked = True
        self._resent(key, record.entry)  # Kafka has it: its key's later triggers may go
        if key in self._awaited:
            self._settle_awaited(key)  # durable in Kafka: its command may be answered
        self.emitted += 1
        self._emitted_counter.inc()
        metrics.FIRE_LATENESS.observe(max(0, emitted_ms - key[2]) / 1000)
        self._to_mark.append((key, trig_id, emitted_ms))
        self._mark_wake.set()

    async def _mark_loop(self) -> None:
        """Record acknowledged triggers as fired, in groups, after the due ones are out."""
        while True:
            await self._mark_wake.wait()
            if len(self._to_mark) < self.config.mark_group and not self._stopping:
                await asyncio.sleep(self.config.mark_linger_s)
            self._mark_wake.clear()
            while self._to_mark:
                next_due = self._next_admissible_ms()
                if next_due is not None and next_due <= self.clock_ms() and not self._stopping:
                    await asyncio.sleep(0.01)  # emitting comes first; bookkeeping can wait
                    continue
                group = deque(
                    self._to_mark.popleft()
                    for _ in range(min(len(self._to_mark), self.config.mark_group))
                )
                failed = False
                try:
                    tenants = {k[0] for k, _, _ in group}
                    retention = {t: await self._retention_of(t) for t in tenants}
                    outcomes = await self.store.mark_fired_many(
                        [
                            FiredMark(k[0], k[1], trig_id, emitted_ms, k[2], retention[k[0]])
                            for k, trig_id, emitted_ms in group
                        ]
                    )
                    for (key, trig_id, emitted_ms), outcome in zip(
                        list(group), outcomes, strict=True
                    ):
                        group.popleft()
                        if isinstance(outcome, BaseException):
                            # Kafka has it; only the bookkeeping failed: try it again.
                            self._to_mark.append((key, trig_id, emitted_ms))
                            failed = True
                        elif key in self._inflight:
                            self._forget(key)
                            self._settled += 1
                finally:
                    # Taken but not settled (an unexpected error, or cancellation, midway):
                    # back to the front for the restarted loop. Dropped, these triggers
                    # would stay in flight for good, pinning the checkpoint below them.
                    if group:
                        self._to_mark.extendleft(reversed(group))
                        self._mark_wake.set()
                if failed:
                    log.warning(
                        "recording fired triggers failed; retrying",
                        extra={"partition": self.partition},
                    )
                    await asyncio.sleep(1.0)

    def _give_up(
        self,
        row: BucketRow,
        trig_id: str,
        now: int,
        key: tuple[str, str, int],
        exc: BaseException,
    ) -> None:
        metrics.TRIGGERS_UNEMITTABLE.labels(self._label).inc()
        log.error(
            "trigger can never be emitted; recording it as missed",
            extra={"partition": self.partition, "schedule_id": row.schedule_id, "error": str(exc)},
        )
        task = asyncio.ensure_future(
            self._record_missed(row, trig_id, now, detail=f"cannot be emitted: {exc}")
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(functools.partial(self._settle_missed, key))

    async def _record_missed(
        self, row: BucketRow, trig_id: str, now: int, *, detail: str | None = None
    ) -> None:
        self.missed += 1
        metrics.TRIGGERS_MISSED.labels(self._label).inc()
        cause = metrics.MissCause.UNEMITTABLE if detail else metrics.MissCause.TOLERANCE
        metrics.count_missed(row.tenant, cause)
        log.warning(
            "trigger missed",
            extra={
                "tenant": row.tenant,
                "schedule_id": row.schedule_id,
                "due_ms": row.due_ms,
                "late_ms": now - row.due_ms,
                "partition": self.partition,
            },
        )
        await self.store.mark_missed(
            row.tenant,
            row.schedule_id,
            trig_id,
            missed_ms=now,
            due_ms=row.due_ms,
            detail=detail or f"late by {now - row.due_ms} ms, beyond tolerance",
            retention_s=await self._retention_of(row.tenant),
        )

    def _settle_missed(self, key: tuple[str, str, int], task: asyncio.Future[None]) -> None:
        if key not in self._inflight:
            return
        if task.cancelled() or task.exception() is not None:
            self._retry_later(key, None if task.cancelled() else task.exception())
            return
        self._settle_awaited(key)  # recorded missed: that answer is durable too
        self._resent(key, self._inflight[key].entry)  # never to be sent: nothing to wait for
        self._forget(key)
        self._settled += 1

    def _retry_later(self, key: tuple[str, str, int], exc: BaseException | None) -> None:
        # Not acknowledged or not recorded: it stays in flight (holding the checkpoint below
        # it, so even a crash now re-emits it on the next start) and is tried again.
        log.warning(
            "trigger not acknowledged; retrying",
            extra={"partition": self.partition, "schedule_id": key[1], "error": repr(exc)},
        )
        if self._stopping:
            self._parked.add(key)  # re-sent by resume, if the partition comes back
        else:
            asyncio.get_running_loop().call_later(1.0, self._redispatch, key)

    def _send_failed(self, key: TriggerKey, exc: BaseException | None) -> None:
        """A send failed: retried later, and its order key's later triggers wait in the
        fair queue until Kafka has it (sent meanwhile, they would reach the topic first)."""
        record = self._inflight.get(key)
        if record is not None:
            order_key = (key[0], _order_key_of(record.entry))
            failed = self._resending.setdefault(order_key, set())
            if not failed:
                self.pacer.hold(*order_key)
            failed.add(key)
        self._retry_later(key, exc)

    def _resent(self, key: TriggerKey, entry: Entry[BucketRow]) -> None:
        """``key`` is in Kafka or settled otherwise: release its order key once none of the
        key's failed sends is left."""
        if not self._resending:
            return
        order_key = (key[0], _order_key_of(entry))
        failed = self._resending.get(order_key)
        if failed is None or key not in failed:
            return
        failed.discard(key)
        if not failed:
            del self._resending[order_key]
            self.pacer.release(*order_key)
            self._wake.set()

    def _forget(self, key: tuple[str, str, int]) -> None:
        del self._inflight[key]
        left = self._firing.get(key[:2], 0) - 1
        if left > 0:
            self._firing[key[:2]] = left
        else:
            self._firing.pop(key[:2], None)

    def _redispatch(self, key: tuple[str, str, int]) -> None:
        record = self._inflight.get(key)
        if record is None:
            return
        if self._stopping:
            self._parked.add(key)  # re-sent by resume, if the partition comes back
            return
        self._forget(key)
        self._dispatch(record.entry, self.clock_ms(), grace_ms=record.grace_ms)

    # -- stopped backfills -----------------------------------------------------------------

    async def _stored_stops(self, rows: list[BucketRow]) -> dict[tuple[str, str], Stop]:
        """The stops the parents of the backfilled ``rows`` record, by (tenant, run id): one
        read of the parents per tenant. Read after the bucket, so a pause answered before
        the bucket read began is seen; one decided since is ``BackfillStops``'."""
        parents: dict[str, set[str]] = {}
        for row in rows:
            run = backfilled_run(row)
            if run is not None:
                parents.setdefault(row.tenant, set()).add(run[0])
        if not parents:
            return {}
        found = await asyncio.gather(
            *(self.store.get_schedules(tenant, sorted(ids)) for tenant, ids in parents.items())
        )
        by_parent = {
            (tenant, parent): stored_stop(row)
            for tenant, rows_of in zip(parents, found, strict=True)
            for parent, row in rows_of.items()
        }
        stops: dict[tuple[str, str], Stop] = {}
        for row in rows:
            run = backfilled_run(row)
            stop = by_parent.get((row.tenant, run[0])) if run is not None else None
            if stop is not None:
                stops[(row.tenant, row.schedule_id)] = stop
        return stops

    def _record_skips(self) -> None:
        """Record the backfilled runs dropped since the last call: one history event per
        parent (``skipped_paused``, or ``skipped`` for a cancel), in the background."""
        for skipped in self._backfills.take_skipped():
            if not skipped.cancelled:
                metrics.count_skipped(skipped.tenant, metrics.SkipReason.PAUSED, skipped.count)
            task = asyncio.ensure_future(self._write_skipped(skipped))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write_skipped(self, skipped: Skipped) -> None:
        """Retried while the store is unavailable and the ticker runs; else logged: the
        runs stay dropped either way (only their history event is lost)."""
        extra = {"partition": self.partition, "schedule_id": skipped.parent}
        try:
            retention = await self._retention_of(skipped.tenant)
            while True:
                try:
                    await self.store.record_event(
                        skipped.tenant,
                        skipped.parent,
                        skipped.event,
                        at_ms=self.clock_ms(),
                        detail=skipped.detail,
                        retention_s=retention,
                    )
                    return
                except StoreError as exc:
                    if not exc.retriable or self._stopping:
                        raise
                    await asyncio.sleep(1.0)
        except Exception:
            log.exception("stopped backfilled runs not recorded in their history", extra=extra)

    # -- checkpoint ------------------------------------------------------------------------

    def checkpoint_candidate(self, now: int) -> int:
        """Everything due before this is acknowledged and recorded (or never existed)."""
        candidate = now + 1
        loaded = self.timeline.loaded_until_ms
        candidate = min(candidate, loaded) if loaded else candidate
        if self._next_minute_ms is not None:
            # Nothing at or after the first minute not read yet is loaded; this also holds
            # while the first read is still running (nothing loaded at all), or was cut
            # short by a stop, when the timeline's loaded horizon is not set yet.
            candidate = min(candidate, self._next_minute_ms)
        heap = self._inflight_heap
        while heap and heap[0][2] not in self._inflight:
            heapq.heappop(heap)
        if heap:
            candidate = min(candidate, heap[0][0])
        next_due = self.timeline.next_due_ms()
        if next_due is not None:
            candidate = min(candidate, next_due)
        deferred = self.pacer.earliest_due_ms()  # due, neither emitted nor recorded yet
        if deferred is not None:
            candidate = min(candidate, deferred)
        return candidate

    async def _write_checkpoint(self, *, force: bool = False) -> None:
        if self.fired_before_ms is None or self._checkpoint_frozen:
            return
        now = self.clock_ms()
        if not force and now - self._last_checkpoint_ms < self.config.checkpoint_interval_ms:
            return
        candidate = max(self.fired_before_ms, self.checkpoint_candidate(now))
        self.fired_before_ms = candidate
        self._checkpoint_high_ms = max(self._checkpoint_high_ms, candidate)
        self._last_checkpoint_ms = now
        metrics.CHECKPOINT_LAG.labels(self._label).set(max(0, now - candidate) / 1000)
        # Every trigger recorded by now is below ``candidate`` (due by now, below the
        # loaded horizon, out of flight): a stored checkpoint equal to it passes them all.
        fired = self._settled
        if candidate == self._written_checkpoint:
            self._fired_at_write = fired
            return
        if not force and self._checkpoint_still_current(candidate, fired):
            return
        await self.store.set_checkpoint(self.partition, candidate, self.config.owner, now_ms=now)
        self._written_checkpoint = candidate
        self._fired_at_write = fired

    def _checkpoint_still_current(self, candidate: int, fired: int) -> bool:
        """Whether the stored checkpoint may stay as it is although ``candidate`` is higher:
        nothing is held or in flight, no trigger was recorded fired or missed since it was
        computed, and it is in ``candidate``'s minute. A successor starts reading at the
        stored checkpoint's minute (``_begin``: its first bucket read is that minute's,
        from the checkpoint on), which is then ``candidate``'s minute too, so it reads
        every row ``candidate`` would have it read; the rows between the two are none
        that this ticker fired, so it fires nothing twice either. An idle partition then
        writes once a minute, not once a second (8 writes a second per idle worker)."""
        stored = self._written_checkpoint
        return (
            stored is not None
            and stored <= candidate
            and minute_ms(stored) == minute_ms(candidate)
            and fired == self._fired_at_write
            and self._holds_nothing()
        )


def _released() -> KafkaError:
    return KafkaError(
        "the partition was released before the trigger was acknowledged", retriable=True
    )


def _order_key_of(entry: Entry[BucketRow]) -> str:
    return entry.payload.order_key or entry.schedule_id

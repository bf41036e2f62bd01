"""Recurring schedules in the scheduler: the per-partition materialiser, which writes the
runs of recurring schedules ahead, and its metrics.

A recurring schedule is one ``schedules`` row (the *parent*, with a ``recurrence``) whose
runs are written ahead as ordinary one-shot bucket rows with schedule id
``<parent>@<nominal_ms>`` (``streams.recurring.run_id``), so the ticker fires them with
every guarantee of a one-shot: on time, at least once, stable trigger id per run. What a
command does to a parent and what a step writes are decided in ``streams.decisions``.

The parent row is the state of materialisation (migration 003):

* ``materialized_until_ms``: nominal time of the first occurrence not handled yet - every
  earlier one has its bucket row written, or was dropped by the misfire policy;
* ``run_count``: occurrences before it (for ``max_runs``);
* ``materialize_key``: ``partition * 10^13 + when to extend next``. Every write of a key
  also writes an entry of the partition's due queue (``recurring_due``, migration 007: a
  partitioned queue by minute, ordered by due time), which the owner reads forward like
  a bucket; an entry is only a hint, the parent's key decides (entries left behind by a
  later extension are dropped as read).

``PartitionMaterializer`` runs next to each partition's ticker, in the worker that owns
the commands partition. One step, for each parent due: plan the runs
(``streams.decisions.plan_extension``), offer those due soon to the ticker, write their
bucket rows and history rows, fire the past-due ones (catch-up after an outage,
rate-bounded) and wait for Kafka's acks, then commit the parent row with the new
``materialized_until_ms``. A crash anywhere before the commit repeats the step, which
writes identical rows (run ids, due times and tolerances are pure functions of the parent
row); after it nothing is left.

An update or cancel of a parent deletes the bucket rows of its runs not yet due and
withdraws them from the ticker; an update then lets the materialiser write the new runs.
The command agent holds the partition's materialiser ``lock`` for a whole batch, so a
parent is never extended between the command agent reading it and writing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import Counter, Histogram

from base.clock import Clock, now_ms
from base.supervise import supervise
from streams.buckets import BUCKET_MS
from streams.decisions import (
    ParentStep,
    due_entries,
    materialize_key,
    parent_commits,
    plan_extension,
    slot_of,
)
from streams.metrics import SkipReason, count_skipped
from streams.model import BucketRow, ScheduleRow
from streams.recurring_store import RecurringRuns

log = logging.getLogger("tocsin.materializer")

# Metrics of recurring schedules.
PARENTS_EXTENDED = Counter(
    "tocsin_recurring_extended_total", "Materialisation steps of recurring schedules"
)
RUNS_MATERIALIZED = Counter(
    "tocsin_recurring_runs_materialized_total", "Runs of recurring schedules written ahead"
)
RUNS_SKIPPED = Counter(
    "tocsin_recurring_runs_skipped_total", "Misfired runs dropped by the misfire policy"
)
RUNS_CAUGHT_UP = Counter(
    "tocsin_recurring_runs_caught_up_total", "Past-due runs fired by the materialiser"
)
STEP_SECONDS = Histogram(
    "tocsin_recurring_step_seconds",
    "Duration of one materialisation step (a batch of schedules)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)

# The due queue is partitioned by (commands partition, bucket minute): a slot is
# streams.buckets.BUCKET_MS wide, like the fire buckets (streams.decisions.slot_of).
# A minute partition of the due queue is deleted this long after its end, not at once: a
# command applied by another process in a rebalance may still be writing into it.
SLOT_GRACE_MS = 10_000
# The longest monotonic sleep between two reads of the wall clock by an idle materialiser
# (0.1 wake-ups a second per partition, none a query).
MAX_SLEEP_MS = 10_000


def min_horizon_s(interval_s: float) -> float:
    """The shortest ``TOCSIN_RECURRING_HORIZON_S`` that leaves no run unwritten when due
    (the horizon must be more than this). A parent is extended at least half a horizon
    before its first unwritten run (``streams.recurring.extend_at``), and its due-queue
    entry is read up to a minute's end plus an interval late when another worker wrote it
    in a rebalance (no notify wakes this one: ``_next_pass_ms``)."""
    return 2 * (BUCKET_MS / 1000 + interval_s)


class RunTicker(Protocol):
    """What the materialiser asks of its partition's ticker (``PartitionTicker`` is one)."""

    def hand_over(self, row: BucketRow) -> asyncio.Future[None] | None: ...

    async def fire_now(self, row: BucketRow) -> None: ...


@dataclass(frozen=True, kw_only=True)
class MaterializerConfig:
    horizon_ms: int = 600_000
    bucket_shards: int = 1
    max_runs_per_step: int = 500
    parents_per_step: int = 200
    catchup_per_s: float = 200.0
    # At most one pass per this many seconds while entries keep falling due, and the first
    # back-off after a failed one.
    interval_s: float = 1.0


# Seconds of paced catch-up fires one step may take while holding the partition's lock.
_CATCHUP_STEP_S = 2.0


class _Pacer:
    """A token bucket: ``await take()`` at most ``rate`` times per second (burst 1 s)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = max(rate, 0.001)
        self.clock = clock
        self.tokens = self.rate
        self.at = clock()

    async def take(self) -> None:
        while True:
            now = self.clock()
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


class PartitionMaterializer:
    """Writes the runs of one partition's recurring schedules ahead (see module doc).

    ``start()`` / ``stop()`` follow the partition's ticker; ``tick(now_ms)`` is one pass,
    exposed for tests; ``kick()`` asks for a pass now (after a command changed a parent).
    """

    def __init__(
        self,
        partition: int,
        *,
        store: RecurringRuns,
        ticker: RunTicker | None,
        config: MaterializerConfig,
        clock_ms: Clock = now_ms,
    ) -> None:
        self.partition = partition
        self.store = store
        self.ticker = ticker
        self.config = config
        self.clock_ms = clock_ms
        # Held by a step and by the command agent for a whole batch of this partition.
        self.lock = asyncio.Lock()
        self._pacer = _Pacer(config.catchup_per_s)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.extended = 0
        self.runs_written = 0
        self.runs_skipped = 0
        # The due queue's read position: every entry due at or before ``_read_upto_ms``
        # was read (those of minutes before ``_slot_ms`` are deleted, or about to be).
        self._slot_ms: int | None = None
        self._read_upto_ms = 0
        self._saved: tuple[int, int] | None = None  # the position last written to the store
        self._pending: deque[tuple[str, str]] = deque()  # read, not handled yet
        self._hot: dict[tuple[str, str], None] = {}  # changed by a command just now
        self._read_slots: list[int] = []  # read to their end; deleted when handled
        # When the loop's current sleep ends, unless a command's notify or a kick comes.
        self.asleep_until_ms: int | None = None

    def start(self) -> None:
        # Supervised like its ticker (and with its health): an error restarts the loop.
        name = f"materializer-{self.partition}"
        health = getattr(self.ticker, "health", None)
        self._task = asyncio.create_task(supervise(name, self._run, health=health), name=name)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def kick(self) -> None:
        self._wake.set()

    def notify(self, tenant: str, schedule_id: str) -> None:
        """A command just wrote this parent: look at it in the next pass (its due-queue
        entry is the durable record; this only saves waiting for the reader)."""
        self._hot[(tenant, schedule_id)] = None
        self._wake.set()

    def position(self, due_ms: int) -> int:
        """Where a due-queue entry for ``due_ms`` goes so the reader still sees it: not at
        or before what it has read already (a key in the past is due at once). Call with
        ``lock`` held, as the command agent and the steps do."""
        return max(due_ms, self._read_upto_ms + 1)

    async def _run(self) -> None:
        backoff = self.config.interval_s
        while not self._stopping:
            try:
                now = self.clock_ms()
                busy = await self.tick(now)
                backoff = self.config.interval_s
                if not busy:
                    # Before the read below: a notify meanwhile is not lost.
                    self._wake.clear()
                    wake_at = await self._next_pass_ms(now)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("materializer step failed", extra={"partition": self.partition})
                busy = False
                backoff = min(backoff * 2, 30.0)
                self._wake.clear()
                wake_at = self.clock_ms() + int(backoff * 1000)
            if busy:
                await asyncio.sleep(0)
                continue
            self.asleep_until_ms = wake_at
            try:
                await self._sleep_until(wake_at)
            finally:
                self.asleep_until_ms = None

    async def _sleep_until(self, wake_at: int) -> None:
        """Until the wall clock passes ``wake_at`` or a notify or kick wakes the loop. The
        sleep is monotonic time, so it goes in steps of at most ``MAX_SLEEP_MS``, the wall
        clock read again after each: after a VM pause (the wall clock goes on, the
        monotonic one stops) the entries falling due are read at most that much later,
        not up to a minute later. A step that ends early is no pass (no query)."""
        while not self._wake.is_set():
            left_ms = wake_at - self.clock_ms()
            if left_ms <= 0:
                return
            # (1 ms late rather than early: the pass reads the queue up to its own clock.)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), timeout=min(left_ms + 1, MAX_SLEEP_MS) / 1000
                )

    async def _next_pass_ms(self, pass_ms: int) -> int:
        """When the next pass is due, after one at ``pass_ms`` that left nothing to do: at
        the due time of the next entry of the due queue's current minute, or at the
        minute's end (when the next minute's entries start to fall due), but not sooner
        than ``interval_s`` after this pass, so that entries falling due one after another
        are read together as by a poll every ``interval_s`` (and no later). Entries written
        by this worker's command agent come with a ``notify``, which wakes the loop before
        then; one written by another worker into this partition's queue during a
        rebalance is read at the latest at the minute's end."""
        assert self._slot_ms is not None
        wake_at = self._slot_ms + BUCKET_MS
        after = await self.store.next_due(self.partition, self._slot_ms, self._read_upto_ms)
        if after is not None:
            wake_at = min(wake_at, after)
        return max(wake_at, pass_ms + int(self.config.interval_s * 1000))

    async def tick(self, now_ms: int) -> bool:
        """Extend the parents due at ``now_ms`` (up to one batch); True if more may be due."""
        limit = self.config.parents_per_step
        async with self.lock:
            if self._slot_ms is None:
                await self._start(now_ms)
            await self._read_queue(now_ms, limit)
            ids: list[tuple[str, str]] = []
            while self._hot and len(ids) < limit:  # (a step stays bounded after a big batch)
                ids.append(next(iter(self._hot)))
                del self._hot[ids[-1]]
            while self._pending and len(ids) < limit:
                ids.append(self._pending.popleft())
            ids = list(dict.fromkeys(ids))
            cut = False
            try:
                cut = await self._step(ids, now_ms)
            except BaseException:
                # Nothing of this batch is known to be done: handle it all again (the step
                # is idempotent), and do not save a position past it meanwhile.
                self._pending.extendleft(reversed(ids))
                raise
            await self._save_position(now_ms)
        return cut or bool(self._pending) or bool(self._hot) or self._behind(now_ms)

    async def _step(self, ids: list[tuple[str, str]], now_ms: int) -> bool:
        """Extend those of ``ids`` that are due; True if the catch-up budget cut it short
        (the rest go first into the next step)."""
        if not ids:
            return False
        rows = await self.store.get_parents(self.partition, ids)
        lo, hi = materialize_key(self.partition, 0), materialize_key(self.partition, now_ms)
        # Entries are hints: only parents whose key is due now are extended (a later
        # extension or a cancel has moved the key of the others).
        due = [r for r in rows if r.materialize_key is not None and lo <= r.materialize_key <= hi]
        if not due:
            return False
        started = time.perf_counter()
        done = await self._extend(due, now_ms)
        STEP_SECONDS.observe(time.perf_counter() - started)
        # Not reached this step (catch-up budget): first in the next.
        self._pending.extendleft((r.tenant, r.schedule_id) for r in reversed(due[done:]))
        return done < len(due)

    async def _start(self, now_ms: int) -> None:
        """Load the read position; on a keyspace's first start, queue the keyed parents
        (rows written before the due queue existed), due ones at once."""
        saved = await self.store.get_cursor(self.partition)
        if saved is not None:
            self._slot_ms, self._read_upto_ms = saved
            self._saved = saved
            return
        start = slot_of(now_ms)
        self._slot_ms, self._read_upto_ms = start, start - 1
        parents = await self.store.keyed_parents(self.partition)
        hi = materialize_key(self.partition, now_ms)
        self._pending.extend(
            (r.tenant, r.schedule_id)
            for r in parents
            if r.materialize_key is not None and r.materialize_key <= hi
        )
        # The rest get their entry first; the position is saved after them.
        await self.store.put_due(due_entries(parents, {self.partition: self}, now_ms))
        self._saved = None
        await self._save_position(now_ms)

    def _behind(self, now_ms: int) -> bool:
        """True if the reader has whole minutes left to read."""
        return self._slot_ms is not None and self._slot_ms + BUCKET_MS <= now_ms

    async def _read_queue(self, now_ms: int, limit: int) -> None:
        """Read the due queue forward to ``now_ms`` (or until ``limit`` entries wait); after
        an outage up to 16 whole minutes are read at once."""
        assert self._slot_ms is not None
        while len(self._pending) < limit:
            slot = self._slot_ms
            if slot + BUCKET_MS <= now_ms:
                # Whole minutes behind: read several to their end concurrently.
                slots = [
                    slot + i * BUCKET_MS for i in range(16) if slot + (i + 1) * BUCKET_MS <= now_ms
                ]
                reads = await asyncio.gather(
                    *(
                        self.store.read_due(
                            self.partition,
                            s,
                            self._read_upto_ms if s == slot else s - 1,
                            s + BUCKET_MS - 1,
                        )
                        for s in slots
                    )
                )
                for s, entries in zip(slots, reads, strict=True):
                    self._pending.extend(entries)
                    self._read_slots.append(s)
                self._slot_ms = slots[-1] + BUCKET_MS
                self._read_upto_ms = self._slot_ms - 1
                continue
            if now_ms > self._read_upto_ms:
                self._pending.extend(
                    await self.store.read_due(self.partition, slot, self._read_upto_ms, now_ms)
                )
                self._read_upto_ms = now_ms
            return

    async def _save_position(self, now_ms: int) -> None:
        """Once every entry read is handled: delete the minutes read to their end (after a
        grace) and save the position. A crash before then reads them again: at least once."""
        if self._pending or self._hot or self._slot_ms is None:
            return
        old = [s for s in self._read_slots if s + BUCKET_MS + SLOT_GRACE_MS <= now_ms]
        if old:
            await self.store.drop_due(self.partition, old)
            self._read_slots = [s for s in self._read_slots if s not in old]
        position = (self._slot_ms, self._read_upto_ms)
        if position != self._saved and (
            self._saved is None or now_ms - self._saved[1] >= 5_000 or position[0] != self._saved[0]
        ):
            await self.store.set_cursor(self.partition, *position, now_ms)
            self._saved = position

    async def _extend(self, parents: Sequence[ScheduleRow], now_ms: int) -> int:
        """One step over ``parents``; returns how many of them it handled: fewer than all
        if it stopped early to bound the catch-up work done under the lock (the rest stay
        due and come in the next step)."""
        cfg = self.config
        work = plan_extension(
            parents,
            now_ms=now_ms,
            horizon_ms=cfg.horizon_ms,
            shards=cfg.bucket_shards,
            max_runs=cfg.max_runs_per_step,
            # Past-due runs are fired paced while the lock is held (commands of this
            # partition wait), so a step takes at most about this many seconds of them.
            late_budget=max(1, int(cfg.catchup_per_s * _CATCHUP_STEP_S)),
        )
        if work.retired:
            await self.store.commit(work.retired, now_ms=now_ms)
        if not work.steps:
            return work.done
        late, held = self._offer(work.steps, now_ms)
        # The parents' new state (written last, in 4).
        commits = parent_commits(work.steps, now_ms=now_ms, horizon_ms=cfg.horizon_ms)
        # 2. Bucket rows (idempotent; a repeated step writes the same) and the due-queue
        #    entries of the new keys, both before the parents that carry those keys.
        await asyncio.gather(
            self.store.write_runs([r for s in work.steps for r in s.runs], now_ms=now_ms),
            self.store.put_due(
                due_entries([new for new, _ in commits], {self.partition: self}, now_ms)
            ),
        )
        # 3. Catch-up: runs already due fire now, paced, and are acknowledged before the
        #    commit (a crash before it fires them again: at least once).
        await self._catch_up(late)
        if held:
            await asyncio.gather(*held)
        # 4. Commit: the parents' new state.
        await self._commit(work.steps, commits, now_ms)
        return work.done

    def _offer(
        self, steps: Sequence[ParentStep], now_ms: int
    ) -> tuple[list[BucketRow], list[asyncio.Future[None]]]:
        """1. Rows due after now go to the ticker first: its checkpoint then stays below
        them until they fired, whether their minute was loaded or not - unless it is past
        them already (this step's clock is older than the ticker's, or a previous owner's
        clock ran ahead): those are fired and acknowledged before the commit, since the
        parent's new state says they are written and a successor's ticker would start past
        them. Returns the rows already due and the ticker's futures to wait for."""
        late: list[BucketRow] = []
        held: list[asyncio.Future[None]] = []
        for step in steps:
            for row in step.runs:
                if row.due_ms <= now_ms:
                    late.append(row)
                elif self.ticker is not None:
                    pending = self.ticker.hand_over(row)
                    if pending is not None:
                        held.append(pending)
        return late, held

    async def _catch_up(self, late: Sequence[BucketRow]) -> None:
        if not late or self.ticker is None:
            return
        fires = []
        for row in sorted(late, key=lambda r: r.due_ms):
            await self._pacer.take()
            fires.append(asyncio.ensure_future(self.ticker.fire_now(row)))
        await asyncio.gather(*fires)
        RUNS_CAUGHT_UP.inc(len(fires))

    async def _commit(
        self,
        steps: Sequence[ParentStep],
        commits: Sequence[tuple[ScheduleRow, str | None]],
        now_ms: int,
    ) -> None:
        runs = sum(len(s.runs) for s in steps)
        skipped = sum(len(s.plan.skipped) for s in steps)
        self.runs_written += runs
        self.runs_skipped += skipped
        await self.store.commit(commits, now_ms=now_ms, runs=[s.runs for s in steps])
        self.extended += len(commits)
        PARENTS_EXTENDED.inc(len(commits))
        RUNS_MATERIALIZED.inc(runs)
        RUNS_SKIPPED.inc(skipped)
        for step in steps:
            count_skipped(step.parent.tenant, SkipReason.MISFIRE, len(step.plan.skipped))


__all__ = ["MaterializerConfig", "PartitionMaterializer", "RunTicker"]

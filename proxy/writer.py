"""The writer pool: slot scheduling for what the order iterator hands out.

One event loop in its own thread runs the attempts, as many at once as ``proxy.slots``
allows (in all, per receiver, per tenant); a message waiting for a slot keeps its key
blocked but holds none. Between attempts a message waits on a timer (backoff or
Retry-After), still in flight so its key stays blocked; it holds no slot either.
Each attempt is handed to the sender for its callback kind (``proxy.sender``): the HTTP
sender (``proxy.http_sender``, one pooled aiohttp session) or the Kafka sender
(``proxy.kafka_sender``).

The decision after each attempt comes from ``proxy.retry.decide``; this module only
carries it out: a retry waits here, a final outcome goes to ``proxy.outcomes``. With a
``ParkingLot`` the writer's ``proxy.parker.Parker`` says, before an attempt and after a
failure, whether the message leaves memory for the retry topic instead. The loop must never
block (no Kafka calls except non-blocking produce), and no offset is done before the
message's records are acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy.envelope import Envelope, TopicPartition
from proxy.http_sender import HttpSender
from proxy.kafka_sender import KafkaSender
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from proxy.outcomes import OutcomePublisher
from proxy.parker import Lane, Parker, ParkingLot, Step
from proxy.retry import (
    AttemptResult,
    CallbackPolicies,
    ConnectFailure,
    Decision,
    Retry,
    Undeliverable,
    decide,
    status_class,
)
from proxy.sender import Sender
from proxy.settings import ProxySettings
from proxy.slots import Slots
from proxy.state import SharedState

log = logging.getLogger("tocsin.proxy")


class Writer:
    def __init__(
        self,
        *,
        state: SharedState,
        settings: ProxySettings,
        metrics: ProxyMetrics,
        outbox: Outbox,
        dead_letter_topic: str,
        deliveries_topic: str | None,
        rand: Callable[[], float] = random.random,
        lot: ParkingLot | None = None,
        lane: Lane = Lane.MAIN,
        http: Sender | None = None,
        kafka: Sender | None = None,
    ) -> None:
        """``http`` and ``kafka`` replace the real senders (tests); without ``http`` the
        writer opens an ``HttpSender`` on its own loop."""
        own_topics = frozenset(
            t for t in (dead_letter_topic, deliveries_topic, lot.topic if lot else None) if t
        )
        self._http = http
        self._kafka: Sender = kafka or KafkaSender(outbox, own_topics=own_topics)
        self._state = state
        self._s = settings
        self._policies = CallbackPolicies(settings.retry_policy())
        self._metrics = metrics
        self._outcomes = OutcomePublisher(
            outbox=outbox,
            offsets=state,
            metrics=metrics,
            dead_letter_topic=dead_letter_topic,
            deliveries_topic=deliveries_topic,
            group_id=settings.group_id,
        )
        self._parker = (
            None
            if lot is None
            else Parker(
                lot=lot,
                lane=lane,
                state=state,
                settings=settings,
                metrics=metrics,
                outbox=outbox,
                dead_letter_topic=dead_letter_topic,
                wake=self.notify,
                hand_back=self._unpark_later,
            )
        )
        self._rand = rand
        self._slots: Slots[Envelope] = Slots(
            concurrency=settings.concurrency,
            per_host=settings.per_host_concurrency,
            per_tenant=max(1, int(settings.concurrency * settings.tenant_share)),
        )
        self._guard = settings.mode == "fires" and not settings.allow_private_targets
        self._retry_ready: deque[Envelope] = deque()
        self._backoff: set[Envelope] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatching = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._drain_timeout_s = settings.shutdown_timeout_s
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            daemon=True,
            name="proxy-writer" if lane is Lane.MAIN else "proxy-retry-writer",
        )
        self.error: BaseException | None = None

    # ---- lifecycle (called from other threads) -------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(10)

    def disable_parking(self) -> None:
        """Before ``start``: no retry topic, so failing messages stay in memory."""
        self._parker = None

    def notify(self) -> None:
        """New messages were pushed: wake the dispatcher (thread-safe, cheap)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(wake.set)

    def drain(self, timeout_s: float) -> None:
        """Stop dispatching, let running attempts finish within ``timeout_s``, then stop."""
        self._drain_timeout_s = timeout_s
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s + 10)

    def assigned(self, tps: set[TopicPartition]) -> None:
        """The reader was assigned these partitions (on the reader's thread; librdkafka calls
        this on every rebalance, with an empty list when nothing new came)."""
        parker = self._parker
        if parker is not None:
            parker.assigned(tps)

    def freeze(self, tps: set[TopicPartition]) -> None:
        """Revoke, step 1: abandon messages of these partitions that are not mid-attempt.

        ``SharedState.begin_revoke`` already keeps new attempts from starting; this drops
        the ones waiting in backoff or parked, so their keys and bytes are released now.
        """
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self._freeze(tps), loop)
        try:
            fut.result(timeout=10)
        except Exception:  # the loop stopped meanwhile; nothing left to freeze
            log.debug("freeze skipped", exc_info=True)

    async def _freeze(self, tps: set[TopicPartition]) -> None:
        parker = self._parker
        if parker is not None:
            parker.revoked(tps)
        self._abandon_waiting(lambda env: env.tp in tps or env.cancelled)

    def _abandon_waiting(self, drop: Callable[[Envelope], bool]) -> None:
        """Give back the messages waiting for a retry or a slot that ``drop`` picks."""
        for env in [e for e in self._backoff if drop(e)]:
            if env.timer is not None:
                env.timer.cancel()
            self._backoff.discard(env)
            self._abandon(env)
        ready, self._retry_ready = self._retry_ready, deque()
        for env in ready:
            if drop(env):
                self._abandon(env)
            else:
                self._retry_ready.append(env)
        for env in self._slots.drop_waiting(drop):
            self._abandon(env)

    # ---- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by ProxyApp; the thread must not die quietly
            self.error = exc
            log.exception("proxy writer failed")
            self._ready.set()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """A timer or callback raised: the message it carried is stuck, so the writer is
        broken and must say so (``error``) rather than only log."""
        exc = context.get("exception")
        log.error(
            "proxy writer callback failed; the proxy stops",
            extra={"context": context.get("message")},
            exc_info=exc,
        )
        if self.error is None:
            self.error = exc if exc is not None else RuntimeError(str(context.get("message")))

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as senders:
            if self._http is None:
                self._http = await senders.enter_async_context(
                    HttpSender(self._s, self._metrics, guard=self._guard)
                )
            self._ready.set()
            stop_wait = asyncio.ensure_future(self._stop.wait())
            while not self._stop.is_set():
                wake_wait = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({wake_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                wake_wait.cancel()
                self._wake.clear()
                self._pump()
            await self._shutdown()

    async def _shutdown(self) -> None:
        self._dispatching = False
        # Messages waiting for a retry or a slot are not "in-flight work": give them back.
        self._abandon_waiting(lambda env: True)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self._drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "proxy shutdown cancelled unfinished attempts", extra={"attempts": len(pending)}
                )
                await asyncio.wait(pending, timeout=5)

    # ---- dispatch ----------------------------------------------------------------------

    def _pump(self) -> None:
        while self._dispatching and self._slots.has_room():
            env = self._retry_ready.popleft() if self._retry_ready else self._state.take()
            if env is None:
                return
            if self._revoked(env):
                self._abandon(env)
                continue
            if self._parker is not None and self._hold_back(env):
                continue
            if self._slots.admit(env):
                self._start(env)

    def _revoked(self, env: Envelope) -> bool:
        """Its partition was revoked (or is being): its new owner delivers it."""
        return env.cancelled or env.tp in self._state.revoking

    def _start(self, env: Envelope) -> None:
        """Attempt ``env``, which holds a slot."""
        env.attempting = True
        task = asyncio.get_running_loop().create_task(self._attempt(env))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """An attempt task that raised left its message unfinished and its key blocked: the
        writer is then broken, which must show (``error`` turns /healthz red and stops the
        process, whose restart redelivers from the last commit) rather than stall quietly."""
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self.error is None:
            log.error("delivery task failed; the proxy stops", exc_info=exc)
            self.error = exc

    def _slot_freed(self, env: Envelope) -> None:
        self._slots.free(env)
        if self._dispatching:
            for waiting in self._slots.next_up(env, skip=self._abandon_if_revoked):
                self._start(waiting)

    def _abandon_if_revoked(self, env: Envelope) -> bool:
        if self._revoked(env):
            self._abandon(env)
            return True
        return False

    def _abandon(self, env: Envelope) -> None:
        """Give the message back without an outcome (revoke or shutdown): no offset moves."""
        env.cancelled = True
        env.attempting = False
        self._state.release(env)

    # ---- parking (proxy.parker) --------------------------------------------------------

    def _hold_back(self, env: Envelope) -> bool:
        """Park ``env`` or let it wait instead of attempting it now; False: attempt it."""
        parker = self._parker
        assert parker is not None
        busy = self._slots.tenant_full(env.tenant)
        before = parker.before_attempt(env, time.monotonic(), tenant_busy=busy)
        if before.step is Step.WAIT:
            self._wait(env, before.wait_s)
        return before.step is not Step.ATTEMPT

    def _wait(self, env: Envelope, delay_s: float) -> None:
        """Hold ``env`` (in flight, its key blocked, no writer slot) for ``delay_s``."""
        loop = asyncio.get_running_loop()
        env.timer = loop.call_later(delay_s, self._retry_due, env)
        self._backoff.add(env)

    def _unpark_later(self, env: Envelope, not_before_s: float) -> None:
        """``_unparked`` on the writer's loop (called on a producer callback thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # shutting down: the message's offset is not done, so it is read again
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._unparked, env, not_before_s)

    def _unparked(self, env: Envelope, not_before_s: float) -> None:
        """A message whose park was refused waits in memory instead (on the loop)."""
        if not self._dispatching or self._revoked(env):
            self._abandon(env)
            return
        self._wait(env, max(0.0, not_before_s - time.monotonic()))

    def _retry_due(self, env: Envelope) -> None:
        env.timer = None
        self._backoff.discard(env)
        if not self._dispatching or self._revoked(env):
            self._abandon(env)
            return
        self._retry_ready.append(env)
        self._pump()

    # ---- one attempt -------------------------------------------------------------------

    async def _attempt(self, env: Envelope) -> None:
        try:
            now = time.monotonic()
            if env.first_attempt_s is None:
                env.first_attempt_s = now
            result = await self._send(env)
        except asyncio.CancelledError:
            env.attempting = False
            self._slot_freed(env)
            self._abandon(env)
            raise
        except Exception as exc:  # a bug or an unexpected library error: retry, loudly
            log.exception("unexpected delivery error", extra={"record": repr(env)})
            result = ConnectFailure(detail=f"{type(exc).__name__}: {exc}")
        env.attempting = False
        self._slot_freed(env)
        sclass = status_class(result)
        self._metrics.attempt(sclass)
        now = time.monotonic()
        decision, env.attempt_state = decide(
            self._policies.of(env.trigger.callback.retry if env.trigger else None),
            env.attempt_state,
            result,
            now_s=now,
            now_epoch_s=time.time(),
            rand=self._rand,
        )
        self._carry_out(env, decision, sclass, now)
        self._pump()

    async def _send(self, env: Envelope) -> AttemptResult:
        if env.invalid is not None:
            return Undeliverable(detail=env.invalid)
        if env.kafka_target is not None:
            return await self._kafka.send(env)
        if self._http is None:
            raise RuntimeError("the HTTP sender is opened before the first attempt")
        return await self._http.send(env)

    # ---- outcomes ----------------------------------------------------------------------

    def _carry_out(self, env: Envelope, decision: Decision, sclass: str, now: float) -> None:
        if isinstance(decision, Retry):
            self._retry(env, decision, sclass, now)
            return
        if env.cancelled:
            self._state.release(env)  # revoked meanwhile: the new owner decides again
            return
        self._state.release(env)  # unblocks the key before the records are acknowledged
        if self._parker is not None:
            self._parker.finished(env)
        self._outcomes.publish(env, decision, sclass, now)

    def _retry(self, env: Envelope, decision: Retry, sclass: str, now: float) -> None:
        """Wait for the next attempt in memory, or park it in the retry topic."""
        self._metrics.retries.labels(sclass).inc()
        if not self._dispatching or self._revoked(env):
            self._abandon(env)
            return
        if self._parker is not None and self._parker.after_failure(env, now, decision.after_s):
            return
        self._wait(env, decision.after_s)
        log.debug(
            "retry scheduled",
            extra={"record": repr(env), "after_s": decision.after_s, "reason": decision.reason},
        )

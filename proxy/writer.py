"""The writer pool: slot scheduling for what the order iterator hands out.

One event loop in its own thread runs the attempts, as many at once as ``proxy.slots``
allows (in all, per receiver, per tenant); a message waiting for a slot keeps its key
blocked but holds none. Between attempts a message waits on a timer (backoff or
Retry-After), still in flight so its key stays blocked; it holds no slot either.
Each attempt is handed to the sender for its callback kind (``proxy.sender``): the HTTP
sender (``proxy.http_sender``, the proxy's own pooled HTTP client) or the Kafka sender
(``proxy.kafka_sender``).

The decision after each attempt comes from ``proxy.retry.decide``; this module only
carries it out: a retry waits here, a final outcome goes to ``proxy.outcomes``. With a
``ParkingLot`` the writer's ``proxy.parker.Parker`` says, before an attempt and after a
failure, whether the message leaves memory for the retry topic instead. The loop must never
block (no Kafka calls except non-blocking produce), and no offset is done before the
message's records are acknowledged.

With a ``HostGate`` (``proxy.hostlimits``, shared by both lanes) each HTTP attempt first
needs its (tenant, host)'s leave: a token of its rate limit and a breaker that lets it
through. A message refused waits in its (tenant, host)'s line, in order, holding no slot
(its key stays blocked, other keys go on); one timer per line wakes its head when the next
token is due or the breaker may be probed. A message that would wait long leaves memory
for the retry topic instead (``ParkReason.HOST_WAIT``), and one held by an open breaker
is failing as far as its retry age goes (``proxy.retry.held_by_host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.attempts import Held
from proxy.breaker import BreakerState
from proxy.envelope import Envelope, TopicPartition
from proxy.hostlimits import Hold as GateHold
from proxy.hostlimits import HoldReason, HostGate, HostKey, Pass
from proxy.http_sender import Begun, HttpSender
from proxy.kafka_sender import KafkaSender
from proxy.limitsfile import CHECK_EVERY_S, LimitsFile
from proxy.metrics import ProxyMetrics
from proxy.outbox import Outbox
from proxy.outcomes import OutcomePublisher
from proxy.parker import Lane, Parker, ParkingLot, ParkReason, Step
from proxy.retry import (
    AttemptResult,
    CallbackPolicies,
    ConnectFailure,
    DeadLetter,
    Decision,
    HttpResult,
    KafkaResult,
    Retry,
    RetryPolicy,
    Undeliverable,
    decide,
    held_by_host,
    status_class,
)
from proxy.sender import Sender
from proxy.settings import ProxySettings
from proxy.slots import Slots
from proxy.state import SharedState

log = logging.getLogger("tocsin.proxy")

# The status class (metrics, dead-letter kind) of a message dead-lettered while its host's
# breaker was open: it may never have been attempted itself.
CIRCUIT_OPEN = "circuit_open"
# A wait for the host shorter than this never parks: a park costs two Kafka writes and a
# read, and the retry lane would hold the message for about as long.
MIN_HOST_PARK_S = 1.0


@dataclass
class _HostLine:
    """The messages of one (tenant, host) its rate limit or breaker holds back, in order."""

    reason: HoldReason
    due_s: float  # when the head may ask the gate again (monotonic)
    spacing_s: float  # between two of them at the host's full rate (0: no limit)
    envs: deque[Envelope] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None


def _place_in_line(envs: deque[Envelope], env: Envelope) -> int:
    """Where ``env`` joins its host's line: a message that already failed goes before
    those never attempted (after the others that failed). It has waited longest, and it
    makes the honest probe: a fresh message at the head may fail for reasons of its own
    (a receiver refusing what it sees first), and each such failed probe would double the
    open period while the host is in fact answering. Keys are not reordered: a key has
    one message in flight at most."""
    if env.attempt_state.failures == 0:
        return len(envs)
    place = 0
    for waiting in envs:
        if waiting.attempt_state.failures == 0:
            break
        place += 1
    return place


def _detail(result: AttemptResult) -> str:
    """A failed attempt in a few words, for the breaker's last failure."""
    if isinstance(result, HttpResult):
        return f"HTTP {result.status}"
    if isinstance(result, KafkaResult):
        return f"Kafka {result.verdict.value}: {result.detail}"
    return result.detail


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
        hosts: HostGate | None = None,
        limits_file: LimitsFile | None = None,
    ) -> None:
        """``http`` and ``kafka`` replace the real senders (tests); without ``http`` the
        writer opens an ``HttpSender`` on its own loop. ``hosts``: the rate limits and
        breakers every HTTP attempt passes (none: no limit); ``limits_file``: re-read from
        this writer's loop (one lane's writer polls it for both)."""
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
        self._hosts = hosts
        self._limits_file = limits_file
        # Keyed by outside input, but an entry lives only while it holds waiting messages,
        # so the pending bounds bound it; probes are attempts, bounded by the slots.
        self._host_lines: dict[HostKey, _HostLine] = {}
        self._admitted: deque[Envelope] = deque()  # passed the gate, waiting for a slot
        self._probes: dict[Envelope, HostKey] = {}
        self._backoff: set[Envelope] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatching = True
        self._loop: asyncio.AbstractEventLoop | None = None
        # A wake-up is on its way to the loop: further pushes before it runs need none,
        # since the one pump it makes takes everything pushed meanwhile.
        self._wake_pending = False
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
        """New messages were pushed: wake the dispatcher (thread-safe, cheap). At most one
        wake-up is outstanding: while one is on its way, the loop has not pumped yet and
        its pump will take these messages too, so another would only cost the loop's
        self-pipe a write and the loop a turn."""
        loop = self._loop
        if self._wake_pending or loop is None or loop.is_closed():
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._woken)
        except RuntimeError:  # the loop is shutting down
            self._wake_pending = False

    def _woken(self) -> None:
        # Cleared before the pump: a push after this line schedules a new wake-up, and a
        # push before it is taken by this pump.
        self._wake_pending = False
        self._pump()

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
        self._retry_ready = self._sift(self._retry_ready, drop)
        self._admitted = self._sift(self._admitted, drop)
        for key, line in list(self._host_lines.items()):
            line.envs = self._sift(line.envs, drop)
            if not line.envs:
                if line.timer is not None:
                    line.timer.cancel()
                del self._host_lines[key]
        for env in self._slots.drop_waiting(drop):
            self._abandon(env)

    def _sift(self, envs: Iterable[Envelope], drop: Callable[[Envelope], bool]) -> deque[Envelope]:
        """Abandon the messages of ``envs`` that ``drop`` picks; the others, in order."""
        kept: deque[Envelope] = deque()
        for env in envs:
            if drop(env):
                self._abandon(env)
            else:
                kept.append(env)
        return kept

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
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as senders:
            if self._http is None:
                self._http = await senders.enter_async_context(
                    HttpSender(self._s, self._metrics, guard=self._guard)
                )
            # Known to other threads only now: a wake-up pumps, and a pump may send.
            self._loop = loop
            self._ready.set()
            if self._limits_file is not None:
                self._poll_limits()
            self._pump()  # anything pushed before the loop was there to be woken
            await self._stop.wait()
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
            gated = bool(self._admitted)  # these passed the parker and the gate already
            env = self._admitted.popleft() if gated else self._next()
            if env is None:
                return
            if self._revoked(env):
                self._abandon(env)
                continue
            if not gated and self._parker is not None and self._hold_back(env):
                continue
            if not gated and self._hosts is not None and not self._pass_gate(env):
                continue
            if gated and self._host_closed_on(env):
                continue
            if self._slots.admit(env):
                self._start(env)

    def _next(self) -> Envelope | None:
        return self._retry_ready.popleft() if self._retry_ready else self._state.take()

    def _revoked(self, env: Envelope) -> bool:
        """Its partition was revoked (or is being): its new owner delivers it."""
        return env.cancelled or env.tp in self._state.revoking

    def _start(self, env: Envelope) -> None:
        """Attempt ``env``, which holds a slot. An HTTP request goes out now, in this turn of
        the loop (``HttpSender.begin``); the task waits for its answer. Started in the
        task's first step, it would wait for the rest of this turn (a turn that reads many
        answers gives their slots to as many messages) and the next turn's reads."""
        env.attempting = True
        now = time.monotonic()
        if env.first_attempt_s is None:
            env.first_attempt_s = now
        begun = self._begin(env)
        task = asyncio.get_running_loop().create_task(self._attempt(env, now, begun))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        if isinstance(begun, Begun):
            # A task cancelled before its first step never reads the answer.
            task.add_done_callback(lambda _task: begun.exchange.abandon())

    def _begin(self, env: Envelope) -> Begun | AttemptResult | None:
        """``env``'s HTTP request begun now: a ``Begun`` to finish, an outcome when the
        attempt ended there, or None when the task makes the whole attempt (a Kafka
        callback, an undeliverable message, a sender of another kind)."""
        http = self._http
        if env.invalid is not None or env.kafka_target is not None:
            return None
        if not isinstance(http, HttpSender):
            return None
        try:
            return http.begin(env)
        except Exception as exc:  # a bug or an unexpected library error: retry, loudly
            log.exception("unexpected delivery error", extra={"record": repr(env)})
            return ConnectFailure(detail=f"{type(exc).__name__}: {exc}")

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
        if not self._dispatching:
            return
        # A loop, not recursion: each one whose host closed meanwhile frees its slot again.
        started = deque(self._slots.next_up(env, skip=self._abandon_if_revoked))
        while started:
            waiting = started.popleft()
            if self._host_closed_on(waiting):
                self._slots.free(waiting)
                started.extend(self._slots.next_up(waiting, skip=self._abandon_if_revoked))
            else:
                self._start(waiting)

    def _abandon_if_revoked(self, env: Envelope) -> bool:
        if self._revoked(env):
            self._abandon(env)
            return True
        return False

    def _abandon(self, env: Envelope) -> None:
        """Give the message back without an outcome (revoke or shutdown): no offset moves."""
        probe = self._probes.pop(env, None)
        if probe is not None and self._hosts is not None:
            self._hosts.probe_dropped(*probe)  # the next message of its host probes instead
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

    async def _attempt(
        self, env: Envelope, now: float, begun: Begun | AttemptResult | None
    ) -> None:
        try:
            if isinstance(begun, Begun):
                assert isinstance(self._http, HttpSender)  # who began it
                result: AttemptResult = await self._http.finish(begun)
            elif begun is not None:
                result = begun
            else:
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
        started, now = now, time.monotonic()
        # Before the slot goes to the next waiting message: a breaker this result opens
        # must turn that message back rather than let it go to the failing host.
        self._host_result(env, result, now, started)
        self._slot_freed(env)
        sclass = status_class(result)
        self._metrics.attempt(sclass)
        decision, env.attempt_state = decide(
            self._policy_of(env),
            env.attempt_state,
            result,
            now_s=now,
            now_epoch_s=time.time(),
            rand=self._rand,
        )
        self._carry_out(env, decision, sclass, now)
        self._pump()

    def _policy_of(self, env: Envelope) -> RetryPolicy:
        return self._policies.of(env.trigger.callback.retry if env.trigger else None)

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
        self._outcomes.attempt_failed(env, decision, sclass)
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

    # ---- host rate limits and breakers (proxy.hostlimits) ------------------------------

    def _poll_limits(self) -> None:
        """Take a changed limits file, then look again in a while (on the loop)."""
        loop, limits_file = self._loop, self._limits_file
        if loop is None or limits_file is None or not self._dispatching:
            return
        try:
            limits_file.poll(time.monotonic())
        finally:
            loop.call_later(CHECK_EVERY_S, self._poll_limits)

    def _pass_gate(self, env: Envelope) -> bool:
        """True: ``env`` may take a slot now. False: it waits in its host's line, or left
        (parked, or dead-lettered by its retry age under an open breaker)."""
        hosts = self._hosts
        assert hosts is not None
        if env.request is None:
            return True  # a Kafka callback, or undeliverable: no endpoint host
        key: HostKey = (env.tenant, env.host)
        now = time.monotonic()
        if key in self._host_lines:
            self._hold(env, key, None, now)
            return False
        answer = hosts.check(env.tenant, env.host, now)
        if isinstance(answer, Pass):
            if answer.probe:
                self._probes[env] = key
            return True
        self._hold(env, key, answer, now)
        return False

    def _host_closed_on(self, env: Envelope) -> bool:
        """``env`` passed its host's gate, then waited for a writer, and the host's breaker
        opened meanwhile: it waits in its host's line instead (True; the caller gives its
        slot back). Its probe is never turned back."""
        hosts = self._hosts
        if hosts is None or env.request is None or env in self._probes:
            return False
        now = time.monotonic()
        hold = hosts.blocked(env.tenant, env.host, now)
        if hold is None:
            return False
        self._hold(env, (env.tenant, env.host), hold, now)
        return True

    def _hold(self, env: Envelope, key: HostKey, answer: GateHold | None, now: float) -> None:
        """``env`` waits in its host's line, behind those already there (their turn comes
        first), unless it leaves at once; ``answer``: the gate's, for a line not there."""
        line = self._host_lines.get(key)
        if line is not None:
            hold = GateHold(line.reason, max(0.0, line.due_s - now), line.spacing_s)
            place = _place_in_line(line.envs, env)
            if self._stays_held(env, hold, now, position=place, count=True):
                line.envs.insert(place, env)
            return
        assert answer is not None
        if self._stays_held(env, answer, now, position=0, count=True):
            line = _HostLine(answer.reason, now + answer.wait_s, answer.spacing_s)
            line.envs.append(env)
            self._host_lines[key] = line
            self._arm(key, line, now)

    def _stays_held(
        self, env: Envelope, hold: GateHold, now: float, *, position: int, count: bool
    ) -> bool:
        """What a message its host holds back does: wait in memory (True), or leave: be
        dead-lettered (its retry age ran out under an open breaker) or parked (the wait is
        long, or its tenant holds its share of the pending bounds)."""
        wait_s = hold.wait_s + position * hold.spacing_s
        if count:
            self._metrics.host_held.labels(hold.reason.value).inc()
        if hold.reason is HoldReason.OPEN:
            decision, env.attempt_state = held_by_host(
                self._policy_of(env),
                env.attempt_state,
                now_s=now,
                wait_s=wait_s,
                reason=f"circuit breaker open for {env.host}",
            )
            if isinstance(decision, DeadLetter):
                self._carry_out(env, decision, CIRCUIT_OPEN, now)
                return False
        if count:
            self._report_hold(env, hold, wait_s, now)
        parker = self._parker
        if parker is None:
            return True
        if wait_s >= max(self._s.park_after_s, MIN_HOST_PARK_S):
            return not parker.park(env, ParkReason.HOST_WAIT, now + wait_s)
        if parker.crowding(env):
            return not parker.park(env, ParkReason.TENANT_SHARE, now + wait_s)
        return True

    def _report_hold(self, env: Envelope, hold: GateHold, wait_s: float, now: float) -> None:
        """An attempt record for the hold (``proxy.attempts``)."""
        if hold.reason is HoldReason.OPEN:
            held, why = Held.CIRCUIT_OPEN, f"circuit breaker open for {env.host}"
        else:
            held, why = Held.RATE_LIMIT, f"rate limit of {env.host}"
        self._outcomes.held(env, held, wait_s, now, why)

    def _arm(self, key: HostKey, line: _HostLine, now: float) -> None:
        loop = asyncio.get_running_loop()
        line.timer = loop.call_later(max(0.0, line.due_s - now), self._line_due, key)

    def _line_due(self, key: HostKey) -> None:
        """The head of ``key``'s line may ask the gate again (a timer, on the loop)."""
        line = self._host_lines.get(key)
        if line is None:
            return
        if line.timer is not None:
            line.timer.cancel()
            line.timer = None
        now = time.monotonic()
        self._admit_line(key, line, now)
        if not line.envs:
            del self._host_lines[key]
        elif line.timer is None:
            self._arm(key, line, now)
        self._pump()

    def _admit_line(self, key: HostKey, line: _HostLine, now: float) -> None:
        """Let the head of ``line`` go while the gate passes it; else note the new wait."""
        hosts = self._hosts
        assert hosts is not None
        while line.envs:
            env = line.envs[0]
            if not self._dispatching or self._revoked(env):
                self._abandon(line.envs.popleft())
                continue
            answer = hosts.check(env.tenant, env.host, now)
            if isinstance(answer, Pass):
                line.envs.popleft()
                if answer.probe:
                    self._probes[env] = key
                self._admitted.append(env)
                continue
            line.reason, line.spacing_s = answer.reason, answer.spacing_s
            line.due_s = now + answer.wait_s
            if answer.reason is HoldReason.OPEN:
                # The breaker (re)opened: each one waiting is judged again for its wait.
                waiting, line.envs = line.envs, deque()
                for held in waiting:
                    if self._stays_held(held, answer, now, position=len(line.envs), count=False):
                        line.envs.append(held)
            return

    def _host_result(
        self, env: Envelope, result: AttemptResult, now: float, started: float | None = None
    ) -> None:
        """Tell the host's breaker how the attempt went; a line waiting for it moves on once
        it closes."""
        probe = self._probes.pop(env, None)
        hosts = self._hosts
        if hosts is None or env.request is None:
            return
        change = hosts.record(
            env.tenant,
            env.host,
            result,
            now,
            probe=probe is not None,
            detail=_detail(result),
            started_s=started,
        )
        if change is None:
            return
        self._metrics.breaker_transitions.labels(change.after.value).inc()
        log.warning(
            "circuit breaker %s",
            change.after.value,
            extra={"tenant": env.tenant, "host": env.host, "from": change.before.value},
        )
        key: HostKey = (env.tenant, env.host)
        if change.after is BreakerState.CLOSED and key in self._host_lines:
            self._line_due(key)

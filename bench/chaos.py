"""Fault injection (``make chaos``): workers, broker, Cassandra, receivers and proxies fail
while signed schedules stream through, and every trigger is counted (RELIABILITY.md).

The suite runs on a stack of its OWN, never the main one: Kafka 19092/19093 and Cassandra
19042/17000 with state under ``.state/chaos`` (jars shared with ``.state/jars`` through
TOCSIN_JARS_DIR), started and stopped here through ``tocsin.infra``; it restarts that broker
and stops that Cassandra. Every scenario has its own topic prefix, keyspace and tenant,
its own worker/proxy subprocesses (SIGKILLed by pid when the scenario says so) and a real
HTTP receiver on a fixed local port that counts deliveries by trigger id.

Figures per scenario: scheduled, acknowledged (commands answered ``accepted``), triggers
(distinct trigger ids seen), lost (acknowledged but never seen), duplicated (seen more than
once), early (first sighting before the due time, beyond a scenario's stated allowance),
max lateness (first sighting minus due time), unanswered commands, per-key order
violations (out of due order within one commands partition: the promise) and order across
partitions (only the order of writing is promised there: said, never failing), and the
duplicate bound the guarantee allows for the scenario's faults
(RELIABILITY.md, ``duplicate_bound``). The totals come last as ``RESULT chaos_lost=...``,
``chaos_unanswered``, ``chaos_early``, ``chaos_order_violations`` and
``chaos_duplicate_bound_breaches``; the exit code is 1 when any of them is not zero or a
scenario failed (``verdict``).

    .venv/bin/python -m bench.chaos                    # every scenario (~30 min)
    .venv/bin/python -m bench.chaos --only workers,skew
    .venv/bin/python -m bench.chaos --keep-stack       # leave the chaos stack running
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import orjson

from base.settings import REPO_ROOT, Settings

CHAOS_ENV = {
    "TOCSIN_STATE_DIR": str(REPO_ROOT / ".state" / "chaos"),
    "TOCSIN_JARS_DIR": str(REPO_ROOT / ".state" / "jars"),
    "TOCSIN_KAFKA_PORT": "19092",
    "TOCSIN_KAFKA_CONTROLLER_PORT": "19093",
    "TOCSIN_CASSANDRA_PORT": "19042",
    "TOCSIN_CASSANDRA_STORAGE_PORT": "17000",
    "TOCSIN_LOG_FORMAT": "text",
    "TOCSIN_SESSION_TIMEOUT_S": "10",
    "TOCSIN_DEFAULT_MISFIRE_TOLERANCE_S": "3600",
    # The receivers listen on 127.0.0.1, which workers refuse as a callback by default.
    "TOCSIN_ALLOW_PRIVATE_TARGETS": "true",
}
TENANT = "chaos"
_ports = iter(range(19700, 19999))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- processes


class Proc:
    """A ``tocsin worker`` or ``tocsin proxy`` subprocess in its own process group."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO_ROOT
    ) -> None:
        self.name, self.argv, self.env, self.log, self.cwd = name, argv, env, log, cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def kill(self) -> None:
        """SIGKILL (only our own process group)."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss_mib(self) -> int | None:
        """The process's peak resident memory so far (Linux VmHWM), while it runs."""
        if self.proc is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
        return None


# ----------------------------------------------------------------------------- counting


@dataclass
class Tally:
    """Acknowledged schedules versus what a receiver (or the fire topic) saw."""

    due: dict[str, int] = field(default_factory=dict)  # trigger id -> due ms (acknowledged)
    acked_ms: dict[str, int] = field(default_factory=dict)  # trigger id -> when its client
    # learned it was accepted (first time): a later-due trigger emitted before that moment
    # may not have been held back for it
    seen: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # How far before its due time a first sighting may come and not count as early: 0 when
    # the workers and the receiver read the same clock; a skewed worker's skew otherwise.
    early_allowance_ms: int = 0
    runs: set[str] = field(default_factory=set)  # those of ``due`` that are recurring runs

    def expect(self, trigger_id: str, due_ms: int, *, run: bool = False) -> None:
        with self.lock:
            self.due[trigger_id] = due_ms
            self.acked_ms.setdefault(trigger_id, now_ms())
            if run:
                self.runs.add(trigger_id)

    def saw(self, trigger_id: str, at_ms: int) -> None:
        with self.lock:
            self.seen[trigger_id].append(at_ms)

    def missing(self) -> set[str]:
        with self.lock:
            return {t for t in self.due if t not in self.seen}

    def figures(self) -> dict[str, Any]:
        with self.lock:
            got = [t for t in self.due if t in self.seen]
            lateness = [min(self.seen[t]) - self.due[t] for t in got]
            runs_got = [t for t in got if t in self.runs]
            return {
                "acknowledged": len(self.due),
                "triggers": len(got),
                "lost": len(self.due) - len(got),
                "duplicated": sum(len(self.seen[t]) - 1 for t in got),
                "early": sum(1 for late in lateness if late < -self.early_allowance_ms),
                "max_lateness_ms": max(lateness, default=0),
                "min_lateness_ms": min(lateness, default=0),
                # The recurring runs among them (their lost, duplicated and early are in
                # the totals above too).
                "recurring_runs": len(self.runs),
                "recurring_runs_lost": len(self.runs) - len(runs_got),
                "recurring_runs_duplicated": sum(len(self.seen[t]) - 1 for t in runs_got),
            }


# ----------------------------------------------------------------------------- recurring

# The recurring schedules of a load (RELIABILITY.md "The suite"): one rate schedule for each
# of these intervals and one cron schedule every CRON_EVERY_S seconds in CRON_ZONE. The
# zone is UTC+05:45: its hour field read in UTC, or in any whole-hour zone, matches no
# instant of a load, so a zone ignored loses every cron run.
RECURRING_EVERY_S = (2, 3, 5)
CRON_EVERY_S = 4
CRON_ZONE = "Asia/Kathmandu"


@dataclass(frozen=True)
class RunRule:
    """One recurring schedule of the suite and the runs it must deliver, worked out here
    without the product's recurrence code (pure). Rate (``zone`` empty): runs at
    ``start_ms + k * every_s``. Cron (``zone`` set): a run at each whole second from
    ``start_ms`` whose seconds field is a multiple of ``every_s`` (a divisor of 60) and whose
    local hour in ``zone`` is one of ``hours``. The schedules have no end: the suite checks
    the runs up to ``until_ms``."""

    start_ms: int
    until_ms: int
    every_s: int
    zone: str = ""
    hours: tuple[int, ...] = ()

    def recurrence(self) -> Any:
        from topics.models import Recurrence

        if not self.zone:
            return Recurrence(every_s=self.every_s, start_ms=self.start_ms)
        hours = ",".join(str(h) for h in self.hours)
        return Recurrence(
            cron=f"*/{self.every_s} * {hours} * * *", start_ms=self.start_ms, time_zone=self.zone
        )

    def runs(self, acked_ms: int) -> list[int]:
        """The nominal times (epoch ms) of the runs expected of a create acknowledged at
        ``acked_ms``: from then (the worker applied the create before its answer, and a
        schedule's first run is its first occurrence at or after that) to ``until_ms``."""
        lo = max(acked_ms, self.start_ms)
        if not self.zone:
            every = self.every_s * 1000
            first = self.start_ms + max(0, -(-(lo - self.start_ms) // every)) * every
            return list(range(first, self.until_ms + 1, every))
        tz = ZoneInfo(self.zone)
        return [
            second * 1000
            for second in range(-(-lo // 1000), self.until_ms // 1000 + 1)
            if second % 60 % self.every_s == 0
            and datetime.fromtimestamp(second, tz).hour in self.hours
        ]


def local_hours(zone: str, lo_ms: int, hi_ms: int) -> tuple[int, ...]:
    """The local hours of ``zone`` that the instants from ``lo_ms`` to ``hi_ms`` fall in
    (pure; whole-minute offsets, read once a minute and at the end)."""
    tz = ZoneInfo(zone)
    instants = [*range(lo_ms, hi_ms, 60_000), hi_ms]
    return tuple(sorted({datetime.fromtimestamp(ms / 1000, tz).hour for ms in instants}))


def recurring_rules(start_ms: int, until_ms: int) -> list[RunRule]:
    """A load's recurring schedules, first due at ``start_ms`` and checked to ``until_ms``:
    the rate ones of RECURRING_EVERY_S and the cron one (pure)."""
    rules = [RunRule(start_ms, until_ms, every) for every in RECURRING_EVERY_S]
    hours = local_hours(CRON_ZONE, start_ms, until_ms)
    return [*rules, RunRule(start_ms, until_ms, CRON_EVERY_S, CRON_ZONE, hours)]


def runs_per_s(rules: list[RunRule]) -> float:
    """How many runs a second these schedules fall due at (pure)."""
    return sum(1 / r.every_s for r in rules)


def expect_runs(tally: Tally, tenant: str, schedule_id: str, rule: RunRule, acked_ms: int) -> int:
    """The tally expects each run of a recurring create acknowledged at ``acked_ms``
    (``RunRule.runs``), under the trigger id the guarantee gives it: that of the run's
    schedule id ``<schedule_id>@<nominal ms>`` due at its nominal time. A run delivered
    under any other id is lost. Returns how many (no I/O)."""
    from topics.ids import trigger_id

    nominals = rule.runs(acked_ms)
    for nominal in nominals:
        tally.expect(trigger_id(tenant, f"{schedule_id}@{nominal}", nominal), nominal, run=True)
    return len(nominals)


class FireCounter(threading.Thread):
    """Reads the scenario's fire topic from the start; counts each trigger's sightings."""

    def __init__(self, settings: Settings, tally: Tally) -> None:
        super().__init__(daemon=True, name="fire-counter")
        from streams.client import FireWatcher

        self.watcher = FireWatcher(settings, from_start=True)
        self.tally = tally
        self.halt = threading.Event()
        self.emitted_early_ms = 0  # worst (emitted_ms - due) below zero, by the worker clock

    def run(self) -> None:
        while not self.halt.is_set():
            with contextlib.suppress(Exception):
                for trig, got_ms in self.watcher.poll(0.3):
                    self.tally.saw(trig.trigger_id, got_ms)

    def close(self) -> None:
        self.halt.set()
        self.join(10)
        with contextlib.suppress(Exception):
            self.watcher.close()


class Receiver:
    """A real HTTP receiver on a fixed local port: ``mode`` is ok, refuse (the listening
    socket is closed: connection refused), 503, 503-large (503 to a body over
    ``large_bytes``, 2xx to the rest) or huge-body (2xx with a ``huge_body_bytes`` body).
    Counts 2xx deliveries by trigger id and keeps each order key's delivery sequence."""

    _loop: asyncio.AbstractEventLoop  # created by start()

    def __init__(
        self,
        tally: Tally,
        delay_s: float = 0.0,
        *,
        large_bytes: int = 16 * 1024,
        huge_body_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.tally = tally
        self.delay_s = delay_s
        self.large_bytes, self.huge_body_bytes = large_bytes, huge_body_bytes
        self.port = free_port()
        self.mode = "ok"
        self.attempts = 0
        self.largest_body_bytes = 0
        self.huge_bodies_sent = 0  # whole huge bodies written (the client read to the end)
        self.refused_window = 0
        # order key -> (due ms, sequence, trigger id, emitted ms) of each 2xx delivery
        self.by_key: dict[str, list[tuple[int, int, str, int]]] = defaultdict(list)
        # trigger id -> (schedule id, emit attempt, received ms) of its first 2xx delivery:
        # an order violation's report names who emitted what when (the schedule id gives
        # the commands partition, so the ticker and the worker).
        self.first_2xx: dict[str, tuple[str, int, int]] = {}
        self._lock = threading.Lock()
        self._site: Any = None
        self._runner: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/cb"

    def start(self) -> Receiver:
        from aiohttp import web

        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(self._open())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True, name="receiver").start()
        assert ready.wait(10)
        return self

    async def _open(self) -> None:
        from aiohttp import web

        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()

    async def _close(self) -> None:
        if self._site is not None:
            await self._site.stop()
            self._site = None

    def set_mode(self, mode: str) -> None:
        fut: Any = None
        if mode == "refuse" and self._site is not None:
            fut = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        elif mode != "refuse" and self._site is None:
            fut = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
        if fut is not None:
            fut.result(10)
        self.mode = mode

    def stop(self) -> None:
        async def shutdown() -> None:
            await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.read()
        at = now_ms()
        with self._lock:
            self.attempts += 1
            self.largest_body_bytes = max(self.largest_body_bytes, len(body))
        if self.mode == "refuse":
            # The listening socket is closed (new connections are refused); a kept-alive
            # connection opened before is dropped without an answer.
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)
        if self.mode == "503" or (self.mode == "503-large" and len(body) > self.large_bytes):
            return web.Response(status=503, text="down for maintenance")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        tid = request.headers.get("Tocsin-Trigger-Id", "")
        self.tally.saw(tid, at)
        with contextlib.suppress(Exception):
            doc = orjson.loads(body)
            due = int(request.headers.get("Tocsin-Due-Ms", "0"))
            with self._lock:
                emitted = int(request.headers.get("Tocsin-Emitted-Ms", at))
                self.by_key[str(doc["k"])].append((due, int(doc["seq"]), tid, emitted))
                attempt = int(request.headers.get("Tocsin-Emit-Attempt", "0"))
                sid = request.headers.get("Tocsin-Schedule-Id", "")
                self.first_2xx.setdefault(tid, (sid, attempt, at))
        if self.mode == "huge-body":
            return await self._huge_body(request)
        return web.Response(status=200, text="ok")

    async def _huge_body(self, request: Any) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(status=200)
        resp.content_length = self.huge_body_bytes
        await resp.prepare(request)
        chunk = b"x" * (1 << 20)
        with contextlib.suppress(ConnectionError, RuntimeError):  # the client may hang up
            left = self.huge_body_bytes
            while left > 0:
                await resp.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
            await resp.write_eof()
            with self._lock:
                self.huge_bodies_sent += 1
        return resp

    def order_violations(self, command_partitions: int) -> int:
        """First deliveries that came after a later-due trigger of the same order key and
        the same commands partition had been delivered, although the earlier-due one was
        already acknowledged to its client when the later one was emitted (a redelivery of
        a trigger id is a duplicate, not a violation; the runs of a recurring schedule share
        its key, payload and partition). That order is the promise (RELIABILITY.md,
        "Per-key order"); across commands partitions only the order of writing is, and
        ``order_across_partitions`` counts those apart. A create that reached the scheduler
        only after a later-due trigger of its key was emitted (a client's send held up by an
        outage) cannot be put before it: ``late_creates_out_of_order`` counts those."""
        return len(self._violations(command_partitions)[0])

    def order_across_partitions(self, command_partitions: int) -> int:
        return len(self._violations(command_partitions)[1])

    def late_creates_out_of_order(self, command_partitions: int) -> int:
        return self._violations(command_partitions)[2]

    def order_figures(self, command_partitions: int) -> dict[str, int]:
        """A scenario report's order figures; each violation is also said, with its kind
        and the triggers it came after."""
        same, across, late = self._violations(command_partitions)
        for line in same:
            say(f"order violation (same commands partition): {line}")
        for line in across:
            say(f"order across commands partitions (not a violation): {line}")
        return {
            "order_violations": len(same),
            "order_across_partitions": len(across),
            "late_creates_out_of_order": late,
        }

    def _violations(self, command_partitions: int) -> tuple[list[str], list[str], int]:
        """One line for each out-of-order first delivery (the key; the trigger and those
        delivered before it: id, schedule id, commands partition, due, emitted, emit
        attempt, first 2xx ms): those after a later-due trigger of their own commands
        partition (a trigger whose schedule id is unknown counts as such: nothing shows it
        is not), those only after other partitions' triggers; and the late creates."""
        same: list[str] = []
        across: list[str] = []
        late = 0
        with self._lock, self.tally.lock:
            acked = dict(self.tally.acked_ms)
            for key, deliveries in self.by_key.items():
                seen: set[str] = set()
                before: list[tuple[int, int, str]] = []  # (due, emitted, id) of first ones
                for due, _seq, tid, emitted in deliveries:
                    if tid in seen:
                        continue
                    seen.add(tid)
                    if any(d > due for d, _, _ in before):
                        known_ms = acked.get(tid, -1)
                        ahead = [(d, out, t) for d, out, t in before if d > due and out >= known_ms]
                        if ahead:
                            n = command_partitions
                            part = self._partition(tid, n)
                            shown = [self._shown(t, d, out, n) for d, out, t in ahead]
                            line = (
                                f"key {key}: {self._shown(tid, due, emitted, n)} "
                                f"acked {known_ms} after {'; '.join(shown)}"
                            )
                            apart = part is not None and all(
                                self._partition(t, n) not in (part, None) for _, _, t in ahead
                            )
                            (across if apart else same).append(line)
                        else:
                            late += 1
                    before.append((due, emitted, tid))
        return same, across, late

    def _partition(self, tid: str, command_partitions: int) -> int | None:
        """The commands partition of the schedule whose trigger ``tid`` is, as the product
        places it (a recurring run's id names its schedule), or None if not known."""
        from streams.partitioner import partition_for
        from streams.recurring import parse_run_id

        sid = self.first_2xx.get(tid, ("", 0, 0))[0]
        if not sid:
            return None
        run = parse_run_id(sid)
        return partition_for(run[0] if run else sid, command_partitions)

    def _shown(self, tid: str, due: int, emitted: int, command_partitions: int) -> str:
        sid, attempt, got = self.first_2xx.get(tid, ("?", 0, 0))
        part = self._partition(tid, command_partitions)
        return (
            f"{tid} ({sid}, partition {'?' if part is None else part}) due {due} "
            f"emitted {emitted} attempt {attempt} 2xx {got}"
        )


# ----------------------------------------------------------------------------- a scenario


class Scenario:
    """One scenario's world: fresh topics, keyspace, tenant; workers, proxies, client."""

    def __init__(self, chaos: Chaos, name: str) -> None:
        from schema.migrate import migrate
        from tocsin.demo import _register_tenant
        from tocsin.topic_admin import ensure_topics
        from topics.catalog import catalog

        self.chaos, self.name = chaos, name
        run = uuid.uuid4().hex[:6]
        self.env = dict(chaos.env)
        self.env.update(
            {
                "TOCSIN_TOPIC_PREFIX": f"chaos.{name}.{run}.",
                "TOCSIN_CASSANDRA_KEYSPACE": f"chaos_{name}_{run}",
            }
        )
        self.settings = Settings.from_env(self.env)
        self.logs = chaos.log_dir / f"{name}-{run}"
        self.logs.mkdir(parents=True, exist_ok=True)
        ensure_topics(self.settings.kafka, catalog(self.settings.topics).all())
        migrate(self.settings.cassandra)
        _register_tenant(self.settings, TENANT)
        self.procs: list[Proc] = []
        self.tally = Tally()
        self.rules: dict[str, RunRule] = {}  # recurring schedule id -> its rule
        self.recurring_acknowledged: set[str] = set()
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}
        self._client: Any = None
        self._results: Any = None

    # processes
    def worker(self, name: str = "w", **env: str) -> Proc:
        e = dict(
            self.env,
            TOCSIN_METRICS_PORT=str(next(_ports)),
            TOCSIN_WORKER_WEB_PORT=str(next(_ports)),
            **env,
        )
        # CHAOS_WORKER_ROOT: run the workers from another copy of the code (python -m
        # imports from the working directory first), to measure a fix before and after.
        root = Path(os.environ.get("CHAOS_WORKER_ROOT") or REPO_ROOT)
        p = Proc(
            name,
            [sys.executable, "-m", "tocsin.cli", "worker"],
            e,
            self.logs / f"{name}.log",
            cwd=root,
        ).start()
        self.procs.append(p)
        return p

    def proxy(self, name: str = "proxy", **env: str) -> Proc:
        # ``env`` may override any of these (a later key wins in a dict display).
        e = {
            **self.env,
            "TOCSIN_PROXY_MODE": "fires",
            "TOCSIN_PROXY_GROUP_ID": self.settings.topics.prefix + "proxy",
            "TOCSIN_PROXY_METRICS_PORT": "0",
            "TOCSIN_PROXY_ALLOW_PRIVATE_TARGETS": "true",
            "TOCSIN_PROXY_COMMIT_INTERVAL_S": "1",
            "TOCSIN_PROXY_SESSION_TIMEOUT_S": "6",
            "TOCSIN_PROXY_RETRY_MAX_DELAY_S": "5",
            **env,
        }
        argv = [sys.executable, "-m", "tocsin", "proxy"]
        p = Proc(name, argv, e, self.logs / f"{name}.log").start()
        self.procs.append(p)
        return p

    @property
    def client(self) -> Any:
        from streams.client import CommandClient

        if self._client is None:
            self._client = CommandClient(self.settings)
        return self._client

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """A probe create answered: a worker has joined and owns the partitions."""
        from streams.client import ResultWatcher

        watcher = ResultWatcher(self.settings)
        sid = f"probe-{uuid.uuid4().hex[:8]}"
        self.client.send(self.create(sid, now_ms() + 3_600_000, "https://probe.example/x"))
        self.client.flush()
        got = watcher.wait_for([sid], timeout_s=timeout_s)
        watcher.close()
        if sid not in got:
            raise RuntimeError(f"no worker answered a probe within {timeout_s:.0f}s")

    def tenant(self, name: str) -> str:
        """Another signed tenant in this scenario's keyspace."""
        from tocsin.demo import _register_tenant

        _register_tenant(self.settings, name)
        return name

    def create(
        self,
        sid: str,
        due: int,
        url: str,
        key: str = "",
        seq: int = 0,
        *,
        tenant: str = TENANT,
        payload_bytes: int = 0,
    ) -> Any:
        """A create whose JSON payload names its order key and sequence number, padded to
        ``payload_bytes`` when that is larger."""
        from topics.models import CreateCommand, HttpCallback, PayloadType

        return CreateCommand(
            tenant=tenant,
            schedule_id=sid,
            request_id=sid,
            due_ms=due,
            payload=padded_payload(key or sid, seq, payload_bytes),
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url=url),
            order_key=key or sid,
            misfire_tolerance_s=3600,
        )

    def recurring(
        self, sid: str, rule: RunRule, url: str, *, tenant: str = TENANT, payload_bytes: int = 0
    ) -> Any:
        """A create of a recurring schedule on its own order key (its runs' payload names
        that key); ``accepted`` expects its runs by ``rule``."""
        from topics.models import CreateCommand, HttpCallback, PayloadType

        self.rules[sid] = rule
        return CreateCommand(
            tenant=tenant,
            schedule_id=sid,
            request_id=sid,
            payload=padded_payload(sid, 0, payload_bytes),
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url=url),
            order_key=sid,
            misfire_tolerance_s=3600,
            recurrence=rule.recurrence(),
        )

    def accepted(self, create: Any, acked_ms: int) -> str | None:
        """The tally expects what a create answered ``accepted`` at ``acked_ms`` schedules:
        a one-shot's trigger (its id returned), or a recurring schedule's runs."""
        from topics.ids import trigger_id

        rule = self.rules.get(create.schedule_id)
        if rule is None:
            tid = trigger_id(create.tenant, create.schedule_id, create.due_ms)
            self.tally.expect(tid, create.due_ms)
            return tid
        self.recurring_acknowledged.add(create.schedule_id)
        expect_runs(self.tally, create.tenant, create.schedule_id, rule, acked_ms)
        return None

    def send(self, command: Any) -> None:
        """A command through the client, or a ``RawRecord`` as it is (signed)."""
        if isinstance(command, RawRecord):
            from topics.signing import sign_headers

            key = command.schedule_id.encode()
            secret = self.client.signing_key_of(command.tenant)
            headers = sign_headers(secret, signed_at_ms=now_ms(), key=key, value=command.value)
            self.client.send_raw(key, command.value, headers=headers)
        else:
            self.client.send(command)

    def schedule(
        self,
        creates: list[Any],
        *,
        timeout_s: float = 120.0,
        resend_after_s: float = 20.0,
        expect: Callable[[Any], bool] = lambda c: True,
    ) -> dict[str, int]:
        """Send creates (or ``RawRecord``s) in order like a client that retries: unanswered
        ones are sent again every ``resend_after_s``; returns the count of each result
        code. Accepted creates that ``expect`` accepts are expected by the tally. A command
        answered ``internal_error`` is sent again like an unanswered one, but counts as
        unanswered only if no answer came at all."""
        from streams.client import ResultWatcher

        watcher = ResultWatcher(self.settings)
        pending = {c.schedule_id: c for c in creates}
        answered: set[str] = set()
        codes: dict[str, int] = defaultdict(int)
        deadline = time.monotonic() + timeout_s
        last_send = 0.0
        try:
            while pending and time.monotonic() < deadline:
                if time.monotonic() - last_send > resend_after_s:
                    if last_send:
                        say(f"{self.name}: re-sending {len(pending)} commands not yet settled")
                        self.extra["resent"] = self.extra.get("resent", 0) + len(pending)
                    for c in pending.values():
                        self.send(c)
                    self.client.producer.poll(0)
                    last_send = time.monotonic()
                self.client.producer.poll(0)
                for r in watcher.poll(0.2):
                    c = pending.get(r.schedule_id or "")
                    if c is None:
                        continue
                    codes[str(r.code)] += 1
                    answered.add(c.schedule_id)
                    if str(r.status) == "accepted":
                        del pending[c.schedule_id]
                        if not isinstance(c, RawRecord) and expect(c):
                            self.accepted(c, now_ms())
                    elif str(r.code) not in ("internal_error",):
                        del pending[c.schedule_id]  # rejected for good: report it
        finally:
            watcher.close()
        codes["unanswered"] = len(pending.keys() - answered)
        return dict(codes)

    def wait_all_seen(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tally.missing() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # late duplicates still count

    def close(self) -> None:
        for p in self.procs:
            p.stop()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.flush(10)
        with contextlib.suppress(Exception):
            from bench.scheduler import cleanup

            cleanup(self.settings)

    def report(self, **more: Any) -> dict[str, Any]:
        figures = {"scenario": self.name, **self.tally.figures(), **self.extra, **more}
        if self.rules:
            # A recurring create refused or never answered leaves its runs unchecked.
            figures["recurring_schedules"] = len(self.rules)
            figures["ok_recurring_acknowledged"] = self.recurring_acknowledged == set(self.rules)
        if self.notes:
            figures["notes"] = "; ".join(self.notes)
        return figures


def spread(n: int, start_ms: int, over_ms: int) -> list[int]:
    return [start_ms + (i * over_ms) // n for i in range(n)]


@dataclass(frozen=True)
class RawRecord:
    """A commands-topic record sent as it is (malformed or oversized on purpose), keyed by
    ``schedule_id`` so that its rejection is answered under that id."""

    schedule_id: str
    value: bytes
    tenant: str = TENANT


def padded_payload(key: str, seq: int, payload_bytes: int = 0) -> bytes:
    """The receiver's JSON payload ``{"k": key, "seq": seq}``, padded with a ``pad`` field
    to exactly ``payload_bytes`` when that is larger than the bare payload (pure). The pad
    is pseudo-random base64, so that no compression (Kafka's lz4) makes it small."""
    bare = orjson.dumps({"k": key, "seq": seq})
    overhead = len(orjson.dumps({"k": key, "seq": seq, "pad": ""}))
    if payload_bytes <= overhead:
        return bare
    n = payload_bytes - overhead
    noise = base64.b64encode(hashlib.shake_256(f"{key}/{seq}".encode()).digest(n))[:n]
    return orjson.dumps({"k": key, "seq": seq, "pad": noise.decode()})


def ids_on_partition(prefix: str, partition: int, partitions: int, n: int) -> list[str]:
    """``n`` schedule ids ``prefix<i>`` whose commands land on ``partition`` (pure)."""
    from streams.partitioner import partition_for

    out: list[str] = []
    i = 0
    while len(out) < n:
        sid = f"{prefix}{i}"
        if partition_for(sid, partitions) == partition:
            out.append(sid)
        i += 1
    return out


def lateness_ms(tally: Tally, trigger_ids: list[str]) -> list[int]:
    """First sighting minus due time of each of these triggers that was seen (pure)."""
    with tally.lock:
        return [
            min(tally.seen[t]) - tally.due[t]
            for t in trigger_ids
            if tally.seen.get(t) and t in tally.due
        ]


# ----------------------------------------------------------------------------- verdict

# The windows of RELIABILITY.md's duplicate bound, as this suite runs the processes: a
# scheduler worker that dies or hands its partitions over re-emits what it emitted since its
# last checkpoint write (TOCSIN checkpoint interval, 1 s) plus what was in flight (emitted,
# not yet recorded; allowed another second); a proxy re-delivers what it delivered since
# its last commit (TOCSIN_PROXY_COMMIT_INTERVAL_S, 1 s in the suite) plus its in-flight
# attempts (TOCSIN_PROXY_CONCURRENCY, 100 by default); a broker outage may duplicate each
# trigger due while it was down once (re-sent after a produce that timed out but landed).
WORKER_HANDOVER_WINDOW_S = 2.0
PROXY_COMMIT_INTERVAL_S = 1.0
PROXY_IN_FLIGHT = 100


def duplicate_bound(
    *,
    rate_per_s: float,
    worker_handovers: int = 0,
    proxy_handovers: int = 0,
    broker_down_s: float = 0.0,
) -> int:
    """Most duplicates the guarantee allows for a scenario whose triggers fall due at
    ``rate_per_s`` (pure): each worker handover (a worker killed, stopped, or losing
    partitions to a new one) re-emits at most a handover window's worth, each proxy
    handover re-delivers at most a commit interval's worth plus its in-flight attempts, and
    each trigger due while the broker was down may come twice. No fault: no duplicate."""
    per_worker = math.ceil(rate_per_s * WORKER_HANDOVER_WINDOW_S)
    per_proxy = math.ceil(rate_per_s * PROXY_COMMIT_INTERVAL_S) + PROXY_IN_FLIGHT
    broker = math.ceil(rate_per_s * broker_down_s)
    return worker_handovers * per_worker + proxy_handovers * per_proxy + broker


@dataclass(frozen=True)
class Verdict:
    """The suite's totals over its scenarios' reports; anything not zero fails the run."""

    lost: int
    unanswered: int
    early: int
    order_violations: int
    duplicate_bound_breaches: int
    # first deliveries out of due order across commands partitions: only the order of
    # writing is promised there (RELIABILITY.md, "Per-key order"), so said, never failing
    order_across_partitions: int
    # scenarios that raised, whose own ok_* check is false, or that acknowledged nothing of
    # what they scheduled (every create refused: the scenario tested nothing)
    failed: tuple[str, ...]
    breaches: tuple[str, ...]  # which scenario broke what, for the log

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unanswered
            or self.early
            or self.order_violations
            or self.duplicate_bound_breaches
            or self.failed
        )

    def result_lines(self) -> list[str]:
        return [
            f"RESULT chaos_lost={self.lost} triggers",
            f"RESULT chaos_unanswered={self.unanswered} commands",
            f"RESULT chaos_early={self.early} triggers",
            f"RESULT chaos_order_violations={self.order_violations} deliveries",
            f"RESULT chaos_duplicate_bound_breaches={self.duplicate_bound_breaches} scenarios",
            f"RESULT chaos_order_across_partitions={self.order_across_partitions} deliveries",
        ]


def _count(r: dict[str, Any], name: str) -> int:
    value = r.get(name)
    if value is None and name == "unanswered":
        value = (r.get("codes") or {}).get("unanswered")
    return int(value or 0)


def verdict(results: list[dict[str, Any]]) -> Verdict:
    """Totals of lost, unanswered, early and out-of-order, and the scenarios whose
    duplicates exceed their ``duplicate_bound`` (absent: 0, no fault allows none) (pure)."""
    totals = dict.fromkeys(("lost", "unanswered", "early", "order_violations"), 0)
    breaches: list[str] = []
    over_bound = 0
    for r in results:
        for name in totals:
            n = _count(r, name)
            totals[name] += n
            if n:
                breaches.append(f"{r['scenario']}: {name}={n}")
        bound = _count(r, "duplicate_bound")
        if _count(r, "duplicated") > bound:
            over_bound += 1
            breaches.append(f"{r['scenario']}: duplicated={r['duplicated']} > bound {bound}")
    return Verdict(
        **totals,
        duplicate_bound_breaches=over_bound,
        order_across_partitions=sum(_count(r, "order_across_partitions") for r in results),
        failed=tuple(
            r["scenario"]
            for r in results
            if "error" in r
            or any(k.startswith("ok_") and v is False for k, v in r.items())
            or (_count(r, "scheduled") > 0 and _count(r, "acknowledged") == 0)
        ),
        breaches=tuple(breaches),
    )


def percentile(values: list[int], q: float) -> int:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank method; 0 when empty."""
    from streams.status import percentile as nearest_rank

    return nearest_rank(values, q * 100) or 0


# ----------------------------------------------------------------------------- scenarios


def sc_workers(chaos: Chaos) -> dict[str, Any]:
    """Two workers, one SIGKILLed mid-burst; later both SIGKILLed and restarted."""
    s = Scenario(chaos, "workers")
    counter = None
    try:
        a, b = s.worker("a"), s.worker("b")
        s.wait_ready()
        time.sleep(12)  # let the group settle over both workers
        counter = FireCounter(s.settings, s.tally)
        counter.start()
        n, t0 = 800, now_ms() + 15_000
        creates = [
            s.create(f"w-{i}", due, "https://receiver.example/cb")
            for i, due in enumerate(spread(n, t0, 50_000))
        ]
        rules = recurring_rules(t0, t0 + 50_000)
        creates += [
            s.recurring(f"w-rec-{j}", rule, "https://receiver.example/cb")
            for j, rule in enumerate(rules)
        ]
        s.extra["codes"] = s.schedule(creates)
        time.sleep(max(0, (t0 + 8_000 - now_ms()) / 1000))
        say("workers: SIGKILL worker a mid-burst")
        a.kill()
        time.sleep(max(0, (t0 + 30_000 - now_ms()) / 1000))
        say("workers: SIGKILL both")
        b.kill()
        time.sleep(5)
        say("workers: restart both")
        s.worker("a2"), s.worker("b2")
        s.wait_all_seen(150)
        # a dies (its partitions go to b), b dies holding all of them, and the first of a2
        # and b2 to join may hand half over to the second: three handovers.
        return s.report(
            scheduled=len(creates),
            duplicate_bound=duplicate_bound(
                rate_per_s=n / 50 + runs_per_s(rules), worker_handovers=3
            ),
        )
    finally:
        if counter:
            counter.close()
        s.close()


class Stream(threading.Thread):
    """Sends ``rate`` creates a second for ``seconds`` (each due ``lead_ms`` after it is
    sent) through one client that retries: a command with no answer after ``resend_after_s``
    is sent again (same content, so a late first copy answers ``duplicate``). A create is
    acknowledged when its result is ``accepted``; rejections are counted by code. The
    creates are ``tenant``'s, named ``prefix``-<i>, on ``keys`` order keys, with payloads of
    ``payload_bytes``; ``acknowledged`` keeps the acknowledged trigger ids in order.

    With ``recurring``, it also creates ``recurring_rules`` in two waves, as it starts and
    at half its length (first due ``lead_ms[0]`` after they are sent), each on its own order
    key; their runs are checked up to the due time of the last one-shot it may send (its
    start plus ``seconds`` plus the longest lead), and they go on after it."""

    def __init__(
        self,
        s: Scenario,
        receiver: Receiver,
        *,
        seconds: float,
        rate: int,
        lead_ms: tuple[int, int],
        resend_after_s: float = 20.0,
        give_up_s: float = 400.0,
        tenant: str = TENANT,
        prefix: str = "",
        keys: int = 40,
        payload_bytes: int = 0,
        recurring: bool = True,
    ) -> None:
        super().__init__(daemon=True, name="stream")
        from streams.client import ResultWatcher

        self.s, self.receiver = s, receiver
        self.tenant, self.prefix = tenant, prefix or s.name
        self.keys, self.payload_bytes = keys, payload_bytes
        self.acknowledged: list[str] = []  # trigger ids, in the order their answers came
        self.seconds, self.rate, self.lead_ms = seconds, rate, lead_ms
        self.resend_after_s, self.give_up_s = resend_after_s, give_up_s
        self.watcher = ResultWatcher(s.settings)
        self.codes: dict[str, int] = defaultdict(int)
        self.scheduled = 0
        self.waves = [0.0, seconds / 2] if recurring else []

    @property
    def due_rate_per_s(self) -> float:
        """Triggers falling due a second: the one-shots, and at most both waves' runs."""
        per_wave = runs_per_s(recurring_rules(0, 0))
        return self.rate + len(self.waves) * per_wave

    def _wave(self, n: int, until_ms: int, pending: dict[str, tuple[Any, float]]) -> None:
        s, base = self.s, now_ms()
        for j, rule in enumerate(recurring_rules(base + self.lead_ms[0], until_ms)):
            c = s.recurring(
                f"{self.prefix}-rec{n}-{j}",
                rule,
                self.receiver.url,
                tenant=self.tenant,
                payload_bytes=self.payload_bytes,
            )
            s.client.send(c)
            pending[c.schedule_id] = (c, time.monotonic())
            self.scheduled += 1

    def run(self) -> None:
        s = self.s
        pending: dict[str, tuple[Any, float]] = {}
        start = time.monotonic()
        until_ms = now_ms() + int(self.seconds * 1000) + self.lead_ms[1]
        waves = list(self.waves)
        next_chunk = start
        i = 0
        try:
            while True:
                t = time.monotonic()
                if waves and t - start >= waves[0]:
                    self._wave(len(self.waves) - len(waves), until_ms, pending)
                    waves.pop(0)
                if t - start < self.seconds and t >= next_chunk:
                    base = now_ms()
                    lo, hi = self.lead_ms
                    for j in range(self.rate):
                        c = s.create(
                            f"{self.prefix}-{i}",
                            base + lo + (j * (hi - lo)) // self.rate,
                            self.receiver.url,
                            key=f"{self.prefix}-k{i % self.keys}",
                            seq=i,
                            tenant=self.tenant,
                            payload_bytes=self.payload_bytes,
                        )
                        s.client.send(c)
                        pending[c.schedule_id] = (c, t)
                        i += 1
                    next_chunk += 1.0
                elif t - start >= self.seconds and (not pending or t - start > self.give_up_s):
                    break
                for sid, (c, sent) in list(pending.items()):
                    if t - sent > self.resend_after_s:
                        s.client.send(c)
                        pending[sid] = (c, t)
                        self.codes["resent"] += 1
                s.client.producer.poll(0)
                with contextlib.suppress(Exception):
                    for r in self.watcher.poll(0.1):
                        got = pending.get(r.schedule_id or "")
                        if got is None:
                            continue
                        c = got[0]
                        self.codes[str(r.code)] += 1
                        if str(r.status) == "accepted":
                            tid = s.accepted(c, now_ms())
                            if tid is not None:
                                self.acknowledged.append(tid)
                        del pending[c.schedule_id]
        finally:
            self.scheduled += i
            self.codes["unanswered"] = len(pending)
            with contextlib.suppress(Exception):
                self.watcher.close()


def sc_broker(chaos: Chaos) -> dict[str, Any]:
    """The Kafka broker restarted twice while commands stream in and triggers fire."""
    s = Scenario(chaos, "broker")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        stream = Stream(s, receiver, seconds=50, rate=20, lead_ms=(4_000, 15_000))
        stream.start()
        down_s = 0.0
        for pause in (12, 20):
            time.sleep(pause)
            say("broker: restarting Kafka (SIGTERM, then start)")
            t0 = time.monotonic()
            chaos.stack.kafka.stop()
            chaos.stack.kafka.start(chaos.java)
            down_s += time.monotonic() - t0
            s.notes.append(f"broker down {time.monotonic() - t0:.1f}s")
        stream.join(420)
        s.extra["codes"] = dict(stream.codes)
        s.wait_all_seen(180)
        return s.report(
            scheduled=stream.scheduled,
            **receiver.order_figures(s.settings.topics.command_partitions),
            duplicate_bound=duplicate_bound(rate_per_s=stream.due_rate_per_s, broker_down_s=down_s),
        )
    finally:
        receiver.stop()
        s.close()


def sc_cassandra(chaos: Chaos) -> dict[str, Any]:
    """Cassandra stopped for 60 s while commands stream in and triggers fire."""
    s = Scenario(chaos, "cassandra")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        s.client.signing_key_of(TENANT)  # the operator client caches the tenant's key
        stream = Stream(s, receiver, seconds=90, rate=10, lead_ms=(5_000, 25_000))
        stream.start()
        time.sleep(15)
        say("cassandra: stopping Cassandra for 60 s")
        t0 = time.monotonic()
        chaos.stack.cassandra.stop()
        time.sleep(60)
        say("cassandra: starting Cassandra again")
        chaos.stack.cassandra.start(chaos.java)
        s.notes.append(
            f"Cassandra unavailable {time.monotonic() - t0:.0f}s (60 s stopped + start-up)"
        )
        say("cassandra: back")
        stream.join(420)
        s.extra["codes"] = dict(stream.codes)
        s.wait_all_seen(240)
        order = receiver.order_figures(s.settings.topics.command_partitions)
        return s.report(scheduled=stream.scheduled, **order)
    finally:
        receiver.stop()
        s.close()


def sc_receiver(chaos: Chaos) -> dict[str, Any]:
    """The receiver down for two minutes: connection refused 60 s, then 503 for 60 s."""
    s = Scenario(chaos, "receiver")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        n, t0 = 400, now_ms() + 12_000
        creates = [
            s.create(f"r-{i}", due, receiver.url, key=f"k{i % 20}", seq=i)
            for i, due in enumerate(spread(n, t0, 30_000))
        ]
        s.extra["codes"] = s.schedule(creates)
        time.sleep(max(0, (t0 + 5_000 - now_ms()) / 1000))
        say("receiver: refusing connections for 60 s")
        receiver.set_mode("refuse")
        time.sleep(60)
        say("receiver: answering 503 for 60 s")
        receiver.set_mode("503")
        time.sleep(60)
        receiver.set_mode("ok")
        back = now_ms()
        say("receiver: back")
        s.wait_all_seen(120)
        seen = s.tally.figures()
        last = max((min(v) for v in s.tally.seen.values()), default=back)
        return s.report(
            scheduled=n,
            **receiver.order_figures(s.settings.topics.command_partitions),
            attempts=receiver.attempts,
            drained_s_after_recovery=round((last - back) / 1000, 1),
            **{"triggers": seen["triggers"]},
        )
    finally:
        receiver.stop()
        s.close()


def sc_proxy(chaos: Chaos) -> dict[str, Any]:
    """The proxy SIGKILLed mid-delivery; then two proxies through a rebalance."""
    s = Scenario(chaos, "proxy")
    receiver = Receiver(s.tally, delay_s=0.05).start()
    try:
        s.worker("w")
        first = s.proxy("proxy-a")
        s.wait_ready()
        n, t0 = 800, now_ms() + 12_000
        creates = [
            s.create(f"p-{i}", due, receiver.url, key=f"k{i % 40}", seq=i)
            for i, due in enumerate(spread(n, t0, 45_000))
        ]
        s.extra["codes"] = s.schedule(creates)
        time.sleep(max(0, (t0 + 10_000 - now_ms()) / 1000))
        say("proxy: SIGKILL proxy a mid-delivery")
        first.kill()
        time.sleep(2)
        say("proxy: start proxies b and c (rebalance)")
        s.proxy("proxy-b")
        c = s.proxy("proxy-c")
        time.sleep(max(0, (t0 + 32_000 - now_ms()) / 1000))
        say("proxy: stop proxy c gracefully (rebalance)")
        c.stop()
        s.wait_all_seen(150)
        # a killed, b and c joining (one rebalance each), c leaving: four handovers.
        return s.report(
            scheduled=n,
            **receiver.order_figures(s.settings.topics.command_partitions),
            duplicate_bound=duplicate_bound(rate_per_s=n / 45, proxy_handovers=4),
        )
    finally:
        receiver.stop()
        s.close()


def sc_skew(chaos: Chaos) -> dict[str, Any]:
    """A worker whose clock runs 2 s fast: nothing fires more than 2 s early (real time)."""
    skew = 2_000
    s = Scenario(chaos, "skew")
    s.tally.early_allowance_ms = skew
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w", TOCSIN_CLOCK_SKEW_MS=str(skew))
        s.proxy("proxy")
        s.wait_ready()
        counter = FireCounter(s.settings, Tally())
        counter.start()
        n, t0 = 300, now_ms() + 10_000
        creates = [
            s.create(f"s-{i}", due, receiver.url) for i, due in enumerate(spread(n, t0, 20_000))
        ]
        s.extra["codes"] = s.schedule(creates)
        s.wait_all_seen(90)
        counter.close()
        fires = counter.tally.seen
        early = [min(fires[t]) - s.tally.due[t] for t in s.tally.due if t in fires]
        figures = s.report(scheduled=n, skew_ms=skew)
        figures["earliest_fire_ms"] = min(early, default=0)  # real receive time - due
        figures["earliest_delivery_ms"] = figures["min_lateness_ms"]
        figures["ok_skew"] = min(early, default=0) >= -skew
        return figures
    finally:
        receiver.stop()
        s.close()


def sc_state_dir(chaos: Chaos) -> dict[str, Any]:
    """``tocsin infra up`` on a read-only and on a full state folder: a clear error, nothing
    started, nothing changed (real tmpfs mounts when root may mount; else a chmod'ed dir)."""
    results: dict[str, Any] = {
        "scenario": "state_dir",
        "acknowledged": 0,
        "triggers": 0,
        "lost": 0,
        "duplicated": 0,
        "max_lateness_ms": 0,
    }
    base = Path(chaos.env["TOCSIN_STATE_DIR"]) / "fs-probe"
    cases: list[tuple[str, str, Callable[[Path], None]]] = [
        ("read-only", "ro,size=64m", lambda p: None),
        ("small (64 MiB free)", "size=64m", _seed),
        ("full (ENOSPC)", "size=8m", _fill),
    ]
    outcomes = []
    for label, opts, prep in cases:
        mnt = base / label.split()[0]
        mnt.mkdir(parents=True, exist_ok=True)
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True
            ).returncode
            == 0
        )
        try:
            if not mounted:
                outcomes.append(f"{label}: skipped (cannot mount tmpfs here)")
                continue
            prep(mnt)
            before = _tree_digest(mnt)
            env = dict(
                chaos.env,
                TOCSIN_STATE_DIR=str(mnt / "state"),
                TOCSIN_KAFKA_PORT="19192",
                TOCSIN_KAFKA_CONTROLLER_PORT="19193",
                TOCSIN_CASSANDRA_PORT="19142",
                TOCSIN_CASSANDRA_STORAGE_PORT="17100",
            )
            if label.startswith("read-only"):
                env["TOCSIN_STATE_DIR"] = str(mnt)
            t = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "tocsin.cli", "infra", "up"],
                env=env,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            took = time.monotonic() - t
            msg = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            started = any(_port_in_use(p) for p in (19192, 19142))
            unchanged = _tree_digest(mnt) == before
            ok = proc.returncode != 0 and not started and unchanged and took < 60
            outcomes.append(
                f"{label}: exit {proc.returncode} in {took:.1f}s, "
                f"servers started: {started}, state unchanged: {unchanged}, "
                f"message: {msg}"
            )
            results[f"ok_{label.split()[0]}"] = ok
        finally:
            if mounted:
                subprocess.run(["umount", str(mnt)], capture_output=True)
    results["notes"] = "; ".join(outcomes)
    return results


def _seed(path: Path) -> None:
    """Existing state that a failed ``up`` must leave exactly as it was."""
    (path / "state" / "kafka").mkdir(parents=True, exist_ok=True)
    (path / "state" / "kafka" / "meta.properties").write_text("cluster.id=keep-me\n")


def _fill(path: Path) -> None:
    _seed(path)
    fd = os.open(path / "ballast", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 4096, 512):  # until not even 512 bytes fit
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * chunk) == chunk:
                    pass
    finally:
        os.close(fd)


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != "ballast":
            h.update(str(p).encode() + p.read_bytes())
        else:
            h.update(str(p).encode())
    return h.hexdigest()


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex(("127.0.0.1", port)) == 0


# Result codes of a load of valid creates that say nothing went wrong (plus the counters).
ACCEPTED_OR_COUNTED = {"ok", "duplicate", "unanswered", "resent"}


def under_load(
    s: Scenario,
    receiver: Receiver,
    fault: Callable[[], None],
    *,
    fault_after_s: float,
    seen_timeout_s: float,
    **stream: Any,
) -> Stream:
    """A ``Stream`` (``stream`` are its arguments) with ``fault`` run ``fault_after_s``
    into it; returns once the stream is done and every acknowledged trigger was seen (or
    ``seen_timeout_s`` passed)."""
    load = Stream(s, receiver, **stream)
    load.start()
    time.sleep(fault_after_s)
    fault()
    load.join(420)
    s.extra["codes"] = dict(load.codes)
    s.extra["ok_all_accepted"] = set(load.codes) <= ACCEPTED_OR_COUNTED
    s.wait_all_seen(seen_timeout_s)
    return load


def sc_large_payloads(chaos: Chaos) -> dict[str, Any]:
    """Bursts of creates whose payloads reach the stock limit (TOCSIN_MAX_PAYLOAD_BYTES,
    64 KiB) on Cassandra's stock batch thresholds (fail at 50 KiB) and Kafka's stock record
    limit: each answered, each delivered, in order; those one byte over are rejected."""
    s = Scenario(chaos, "large_payloads")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        limit = s.settings.scheduler.max_payload_bytes
        sizes = [limit, limit - 1, 50 * 1024, 40 * 1024, 5 * 1024 + 1, 0]
        n, t0 = 240, now_ms() + 15_000
        creates = [
            s.create(
                f"lp-{i}", due, receiver.url, key=f"k{i % 20}", seq=i, payload_bytes=sizes[i % 6]
            )
            for i, due in enumerate(spread(n, t0, 20_000))
        ]
        over = [
            s.create(f"lp-over-{i}", t0, receiver.url, payload_bytes=limit + 1) for i in range(10)
        ]
        s.extra["codes"] = codes = s.schedule(creates + over)
        s.wait_all_seen(120)
        return s.report(
            scheduled=n + len(over),
            **receiver.order_figures(s.settings.topics.command_partitions),
            largest_body_bytes=receiver.largest_body_bytes,
            ok_over_limit_rejected=codes.get("payload_too_large", 0) == len(over),
            duplicate_bound=0,
        )
    finally:
        receiver.stop()
        s.close()


def sc_hostile_commands(chaos: Chaos) -> dict[str, Any]:
    """Far-future, malformed and oversized commands of one tenant interleaved, one for one,
    with good creates of another tenant on the same commands partition: every command is
    answered, the good ones are delivered in order, and their lateness is reported."""
    from topics.ids import MAX_EPOCH_MS

    s = Scenario(chaos, "hostile_commands")
    good_tenant = s.tenant("chaos-good")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        parts = s.settings.topics.command_partitions
        n, now, t0 = 250, now_ms(), now_ms() + 15_000
        good = ids_on_partition("hc-good-", 0, parts, n)
        bad = ids_on_partition("hc-bad-", 0, parts, n)
        limit = s.settings.scheduler.max_payload_bytes
        year_ms = 365 * 86_400_000
        far_ok: set[str] = set()
        items: list[Any] = []
        for i, (g, b, due) in enumerate(zip(good, bad, spread(n, t0, 30_000), strict=True)):
            items.append(
                s.create(g, due, receiver.url, key=f"k{i % 20}", seq=i, tenant=good_tenant)
            )
            kind = i % 6
            if kind == 0:  # far future, within what Cassandra can keep: accepted, not due
                far_ok.add(b)
                items.append(s.create(b, now + 5 * year_ms, receiver.url))
            elif kind == 1:  # beyond the 20-year TTL, and the last representable instant
                far = MAX_EPOCH_MS if i % 12 == 1 else now + 50 * year_ms
                items.append(s.create(b, far, receiver.url))
            elif kind == 2:  # cut off mid-document
                items.append(RawRecord(b, b'{"type":"create","tenant":"chaos","schedule_id":"'))
            elif kind == 3:  # not JSON at all, and a JSON document of the wrong shape
                items.append(RawRecord(b, b"\xff\xfe\x00garbage" if i % 12 == 3 else b"[1,2,3]"))
            elif kind == 4:  # a payload over the limit
                items.append(s.create(b, due, receiver.url, payload_bytes=limit + 1))
            else:  # a record far over the message cap (Kafka still takes it: < 1 MiB)
                pad = "x" * (700 * 1024)
                doc = {"type": "create", "tenant": TENANT, "schedule_id": b, "pad": pad}
                items.append(RawRecord(b, orjson.dumps(doc)))
        s.extra["codes"] = codes = s.schedule(items, expect=lambda c: c.schedule_id not in far_ok)
        s.wait_all_seen(120)
        late = lateness_ms(s.tally, list(s.tally.due))  # only good creates are expected
        return s.report(
            scheduled=len(items),
            good=n,
            hostile=n,
            **receiver.order_figures(s.settings.topics.command_partitions),
            good_lateness_p50_ms=percentile(late, 0.5),
            good_lateness_p99_ms=percentile(late, 0.99),
            # each hostile command is answered with the code for what is wrong with it
            ok_no_internal_error=codes.get("internal_error", 0) == 0,
            duplicate_bound=0,
        )
    finally:
        receiver.stop()
        s.close()


def sc_hostile_tenant(chaos: Chaos) -> dict[str, Any]:
    """Two tenants through one proxy. The calm tenant's deliveries are timed throughout: 40 s
    alone (quiet), 40 s while the hostile tenant's endpoint answers 503 to its large
    (48 KiB) triggers (a retry storm: each on its own order key, so every one of them is
    retried at once), 40 s while it answers 2xx with a 16 MiB body; then
    the hostile endpoint recovers and everything must arrive. Target: the calm tenant's p99
    lateness in either hostile phase within 1 s of its quiet value."""
    phase_s = 40
    s = Scenario(chaos, "hostile_tenant")
    calm_tenant = s.tenant("chaos-calm")
    hostile = Receiver(s.tally).start()
    calm = Receiver(s.tally).start()
    try:
        s.worker("w")
        proxy = s.proxy("proxy")
        s.wait_ready()
        start = now_ms()
        calm_load = Stream(
            s, calm, seconds=3 * phase_s, rate=10, lead_ms=(3_000, 6_000),
            tenant=calm_tenant, prefix="calm", keys=20,
        )  # fmt: skip
        calm_load.start()
        time.sleep(phase_s - 5)  # its first hostile triggers fall due as the phase begins
        say("hostile_tenant: hostile endpoint answers 503 to large triggers")
        hostile.set_mode("503-large")
        hostile_load = Stream(
            s, hostile, seconds=2 * phase_s, rate=4, lead_ms=(3_000, 6_000),
            prefix="hostile", keys=10_000, payload_bytes=48 * 1024, recurring=False,
        )  # fmt: skip
        hostile_load.start()
        time.sleep(max(0, (start + 2 * phase_s * 1000 - now_ms()) / 1000))
        say("hostile_tenant: hostile endpoint answers 2xx with a 16 MiB body")
        hostile.set_mode("huge-body")
        time.sleep(max(0, (start + 3 * phase_s * 1000 - now_ms()) / 1000) + 6)
        say("hostile_tenant: hostile endpoint recovers")
        hostile.set_mode("ok")
        calm_load.join(420)
        hostile_load.join(420)
        s.extra["codes"] = {
            "calm": dict(calm_load.codes),
            "hostile": dict(hostile_load.codes),
            "unanswered": calm_load.codes["unanswered"] + hostile_load.codes["unanswered"],
        }
        s.extra["ok_all_accepted"] = (
            set(calm_load.codes) | set(hostile_load.codes)
        ) <= ACCEPTED_OR_COUNTED
        s.wait_all_seen(240)
        p99: dict[str, int] = {}
        for i, phase in enumerate(("quiet", "storm", "huge_body")):
            lo, hi = start + i * phase_s * 1000, start + (i + 1) * phase_s * 1000
            ids = [t for t in calm_load.acknowledged if lo <= s.tally.due[t] < hi]
            p99[phase] = percentile(lateness_ms(s.tally, ids), 0.99)
        worst = max(p99["storm"], p99["huge_body"])
        calm_order = calm.order_figures(s.settings.topics.command_partitions)
        hostile_order = hostile.order_figures(s.settings.topics.command_partitions)
        return s.report(
            scheduled=calm_load.scheduled + hostile_load.scheduled,
            **{k: n + hostile_order[k] for k, n in calm_order.items()},
            calm_lateness_p99_quiet_ms=p99["quiet"],
            calm_lateness_p99_storm_ms=p99["storm"],
            calm_lateness_p99_huge_body_ms=p99["huge_body"],
            calm_p99_within_1s_of_quiet=worst - p99["quiet"] <= 1_000,
            hostile_attempts=hostile.attempts,
            hostile_huge_bodies_sent=hostile.huge_bodies_sent,
            proxy_peak_rss_mib=proxy.peak_rss_mib(),
            duplicate_bound=0,
        )
    finally:
        calm.stop()
        hostile.stop()
        s.close()


def sc_cassandra_slow(chaos: Chaos) -> dict[str, Any]:
    """Cassandra slow rather than stopped: its process SIGSTOPped for 20 s (connections stay
    open, requests time out) while 10 creates/s stream in and triggers fire."""
    s = Scenario(chaos, "cassandra_slow")
    receiver = Receiver(s.tally).start()
    try:
        s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        s.client.signing_key_of(TENANT)  # the operator client caches the tenant's key

        def freeze() -> None:
            pid = chaos.stack.cassandra.pid()
            if pid is None:
                raise RuntimeError("the chaos Cassandra is not running")
            say(f"cassandra_slow: SIGSTOP Cassandra (pid {pid}) for 20 s")
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(20)
            finally:
                os.kill(pid, signal.SIGCONT)
            say("cassandra_slow: SIGCONT")

        load = under_load(
            s, receiver, freeze, fault_after_s=15, seen_timeout_s=180,
            seconds=60, rate=10, lead_ms=(5_000, 20_000),
        )  # fmt: skip
        return s.report(
            scheduled=load.scheduled,
            **receiver.order_figures(s.settings.topics.command_partitions),
            duplicate_bound=0,
        )
    finally:
        receiver.stop()
        s.close()


def sc_rolling_restart(chaos: Chaos) -> dict[str, Any]:
    """A graceful rolling restart under load: two workers, each in turn stopped with
    SIGTERM and replaced, 20 s apart, while 10 creates/s stream in through the proxy."""
    s = Scenario(chaos, "rolling_restart")
    receiver = Receiver(s.tally).start()
    try:
        workers = [s.worker("a"), s.worker("b")]
        s.proxy("proxy")
        s.wait_ready()
        time.sleep(12)  # let the group settle over both workers

        def roll() -> None:
            for w in workers:
                say(f"rolling_restart: SIGTERM worker {w.name}, then its replacement")
                t0 = time.monotonic()
                w.stop()
                s.notes.append(f"{w.name} stopped in {time.monotonic() - t0:.1f}s")
                s.worker(f"{w.name}2")
                time.sleep(20)

        load = under_load(
            s, receiver, roll, fault_after_s=10, seen_timeout_s=180,
            seconds=70, rate=10, lead_ms=(4_000, 15_000),
        )  # fmt: skip
        # Each stop hands its partitions over, each replacement takes some: four handovers.
        return s.report(
            scheduled=load.scheduled,
            **receiver.order_figures(s.settings.topics.command_partitions),
            duplicate_bound=duplicate_bound(rate_per_s=load.due_rate_per_s, worker_handovers=4),
        )
    finally:
        receiver.stop()
        s.close()


class ApiClient:
    """A ``tocsin api`` of a scenario, called over HTTP (blocking)."""

    def __init__(self, base: str, admin_key: str) -> None:
        self.base, self.admin_key = base, admin_key

    def call(self, method: str, path: str, key: str, body: object = None) -> tuple[int, Any]:
        data = None if body is None else orjson.dumps(body)
        req = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, orjson.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, orjson.loads(exc.read() or b"null")

    def wait_ready(self, api: Proc, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.base + "/readyz", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            if not api.alive():
                break
            time.sleep(0.3)
        raise RuntimeError("the API did not become ready")


# The admission key of the admitted scenario (topics.admission): the API's and workers'.
ADMISSION_KEY = "chaos-1:" + "c" * 40


def sc_admitted(chaos: Chaos) -> dict[str, Any]:
    """Creates answered 201 at Kafka's acknowledgement (an admission key) while no worker
    runs, their tenant deactivated after the 201s; the worker started as some fall due,
    SIGKILLed while storing and firing them, started again: every 201 fires, none early."""
    from topics.ids import trigger_id

    s = Scenario(chaos, "admitted")
    s.env["TOCSIN_ADMISSION_KEY"] = ADMISSION_KEY
    receiver = Receiver(s.tally).start()
    try:
        w = s.worker("w")
        s.proxy("proxy")
        s.wait_ready()
        port, admin = free_port(), uuid.uuid4().hex
        api_env = dict(
            s.env,
            TOCSIN_API_PORT=str(port),
            TOCSIN_ADMIN_KEY=admin,
            TOCSIN_METRICS_PORT=str(next(_ports)),
        )
        api = Proc("api", [sys.executable, "-m", "tocsin.cli", "api"], api_env, s.logs / "api.log")
        s.procs.append(api.start())
        http = ApiClient(f"http://127.0.0.1:{port}", admin)
        http.wait_ready(api)
        tenant = f"adm-{uuid.uuid4().hex[:6]}"
        st, reg = http.call("POST", "/v1/tenants", admin, {"tenant": tenant})
        if st != 201:
            raise RuntimeError(f"tenant registration answered {st}: {reg}")
        say("admitted: SIGKILL the worker; creates answered by Kafka alone")
        w.kill()
        n, t0 = 300, now_ms() + 10_000
        statuses: dict[str, int] = defaultdict(int)
        for i, due in enumerate(spread(n, t0, 30_000)):
            body = {
                "due": due,
                "payload": {"seq": i},
                "callback": {"type": "http", "url": receiver.url},
                "order_key": f"k{i % 20}",
                "misfire_tolerance_s": 3600,
            }
            st, r = http.call("POST", "/v1/schedules", reg["api_key"], body)
            statuses[str(st)] += 1
            if st == 201 and r.get("message", "").startswith("admitted"):
                s.tally.expect(trigger_id(tenant, r["schedule_id"], due), due)
        say(f"admitted: answers {dict(statuses)}; deactivating the tenant")
        st, _ = http.call("PATCH", f"/v1/tenants/{tenant}", admin, {"active": False})
        s.extra["deactivated"] = st == 200
        time.sleep(max(0, (t0 + 6_000 - now_ms()) / 1000))
        say("admitted: start the worker (some creates are due already)")
        w2 = s.worker("w2")
        time.sleep(12)
        say("admitted: SIGKILL it while it stores and fires them; start another")
        w2.kill()
        time.sleep(3)
        s.worker("w3")
        s.wait_all_seen(150)
        # w killed (nothing owned yet that fires), w2 joining, w2 killed, w3 joining.
        return s.report(
            scheduled=n,
            statuses=dict(statuses),
            **receiver.order_figures(s.settings.topics.command_partitions),
            ok_every_create_admitted=statuses.get("201", 0) == n,
            ok_tenant_deactivated=s.extra.pop("deactivated"),
            duplicate_bound=duplicate_bound(rate_per_s=n / 30, worker_handovers=3),
        )
    finally:
        receiver.stop()
        s.close()


SCENARIOS: dict[str, Callable[[Chaos], dict[str, Any]]] = {
    "workers": sc_workers,
    "broker": sc_broker,
    "cassandra": sc_cassandra,
    "receiver": sc_receiver,
    "proxy": sc_proxy,
    "skew": sc_skew,
    "state_dir": sc_state_dir,
    "large_payloads": sc_large_payloads,
    "hostile_commands": sc_hostile_commands,
    "hostile_tenant": sc_hostile_tenant,
    "cassandra_slow": sc_cassandra_slow,
    "rolling_restart": sc_rolling_restart,
    "admitted": sc_admitted,
}


# ----------------------------------------------------------------------------- the stack


class Chaos:
    def __init__(self) -> None:
        from tocsin.infra import Stack, find_java

        self.env = {**os.environ, **CHAOS_ENV}
        self.settings = Settings.from_env(self.env)
        assert self.settings.stack.kafka_port != 9092, "never the main stack"
        self.stack = Stack(self.settings)
        self.java = find_java(self.settings.stack)
        self.log_dir = self.settings.stack.state_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def up(self) -> None:
        say("starting the chaos stack (Kafka 19092, Cassandra 19042, .state/chaos)")
        timings = self.stack.up()
        say(f"stack ready: {timings}")

    def down(self) -> None:
        say("stopping the chaos stack")
        self.stack.down()


def fmt(r: dict[str, Any]) -> str:
    keys = ["acknowledged", "triggers", "lost", "duplicated", "max_lateness_ms"]
    head = " ".join(f"{k}={r.get(k)}" for k in keys)
    rest = {k: v for k, v in r.items() if k not in (*keys, "scenario")}
    return f"{r['scenario']:<10} {head} {orjson.dumps(rest, default=str).decode()}"


def run_scenario(chaos: Chaos, name: str) -> dict[str, Any]:
    """One scenario's figures; a scenario that raises is reported, not fatal to the run."""
    say(f"=== scenario {name}")
    t = time.monotonic()
    try:
        # The broker or Cassandra may have been left down by a failed scenario.
        if name != "state_dir":
            chaos.stack.up()
        r = SCENARIOS[name](chaos)
    except Exception as exc:
        traceback.print_exc()
        r = {"scenario": name, "error": repr(exc), "lost": 0, "duplicated": 0}
    r["seconds"] = round(time.monotonic() - t)
    say(fmt(r))
    return r


def print_summary(results: list[dict[str, Any]]) -> int:
    """Prints the figures, the breaches and the RESULT lines; the exit status."""
    print("\nscenario   figures", flush=True)
    for r in results:
        print(fmt(r))
    v = verdict(results)
    dups = sum(int(r.get("duplicated", 0)) for r in results)
    if v.failed:
        print(f"FAILED scenarios: {list(v.failed)}")
    for line in v.breaches:
        print(f"BREACH {line}")
    for line in v.result_lines():
        print(line)
    print(f"RESULT chaos_duplicates={dups} triggers")
    return 0 if v.ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--keep-stack", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {list(SCENARIOS)}")
    if shutil.which("mvn") is None and not (REPO_ROOT / ".state" / "jars").exists():
        print("needs Maven or the cached jars in .state/jars", file=sys.stderr)
        return 1
    chaos = Chaos()
    results: list[dict[str, Any]] = []
    needs_stack = any(n != "state_dir" for n in names)

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so every finally: cleans up

    signal.signal(signal.SIGTERM, on_term)
    try:
        if needs_stack:
            chaos.up()
        for name in names:
            results.append(run_scenario(chaos, name))
    finally:
        if needs_stack and not args.keep_stack:
            chaos.down()
    return print_summary(results)


if __name__ == "__main__":
    sys.exit(main())

"""The README's first command: schedule a few thousand triggers and deliver them over HTTP.

Starts a ``tocsin worker`` and a ``tocsin proxy`` (fires mode) as subprocesses against the
local stack and a real HTTP receiver in this process, registers a ``demo`` tenant, creates
``count`` schedules due over the next ``spread_s`` seconds whose callbacks POST to the
receiver, prints progress while they fire and arrive, and a summary: fired, delivered,
missed, and lateness p50/p99 (emit time and receive time minus due time).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from base.clock import now_ms
from base.settings import REPO_ROOT, Settings
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.store import Store
from topics.ids import trigger_id
from topics.models import CommandResult, CreateCommand, HttpCallback, PayloadType, Trigger
from topics.signing import new_signing_key


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _ms(values: list[int], q: float) -> str:
    """A percentile for people: ``-`` before there is anything to measure, never ``nan``."""
    return f"{_percentile(values, q):.0f} ms" if values else "- ms"


def progress_line(
    accepted: int, fired: int, delivered: int, count: int, lateness: list[int]
) -> str:
    return (
        f"[demo] accepted {accepted}/{count}  fired {fired}/{count}  "
        f"delivered {delivered}/{count}  "
        f"emit lateness p50 {_ms(lateness, 0.5)} p99 {_ms(lateness, 0.99)}"
    )


def summary_lines(
    *,
    count: int,
    accepted: int,
    rejected: int,
    fired: int,
    duplicates: int,
    lateness: list[int],
    delivered: int,
    duplicate_deliveries: int,
    delivery_lateness: list[int],
) -> list[str]:
    """The summary the demo ends with (the README shows one from a real run)."""
    early = sum(1 for v in lateness if v < 0)
    return [
        "[demo] summary",
        f"  scheduled  {count} (accepted {accepted}, rejected {rejected})",
        f"  fired      {fired}   duplicates {duplicates}   early {early}",
        f"  missed     {count - fired}",
        f"  lateness   p50 {_ms(lateness, 0.5)}   p99 {_ms(lateness, 0.99)}   "
        f"max {max(lateness, default=0)} ms   (emit time - due time)",
        f"  delivered  {delivered} over HTTP   duplicate deliveries {duplicate_deliveries}",
        f"  delivery   p50 {_ms(delivery_lateness, 0.5)}   p99 {_ms(delivery_lateness, 0.99)}"
        "   (receive time - due time)",
    ]


_ECHO_BYTES = 500


def _register_tenant(settings: Settings, tenant: str) -> None:
    async def go() -> None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            await store.put_tenant(
                tenant,
                active=True,
                created_ms=now_ms(),
                config="{}",
                signing_secret=new_signing_key(),
            )
        finally:
            await store.close()

    asyncio.run(go())


class Receiver:
    """A real HTTP endpoint (aiohttp, own thread) recording each trigger's arrival; with
    ``echo`` it answers any path and method and prints each delivery."""

    def __init__(self, port: int, *, echo: bool = False) -> None:
        self.port = port
        self.echo = echo
        self.arrivals: dict[str, int] = {}
        self.duplicates = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, name="demo-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"demo receiver could not listen on port {port}")

    async def _handle(self, request: web.Request) -> web.Response:
        tid = request.headers.get("Tocsin-Trigger-Id", "")
        body = await request.read()
        if self.echo:
            shown = body[:_ECHO_BYTES].decode("utf-8", "replace")
            more = f" ... ({len(body)} bytes)" if len(body) > _ECHO_BYTES else ""
            print(
                f"[receiver] {request.method} {request.path_qs}  tenant "
                f"{request.headers.get('Tocsin-Tenant', '-')}  schedule "
                f"{request.headers.get('Tocsin-Schedule-Id', '-')}  trigger {tid or '-'}\n"
                f"[receiver]   payload {shown}{more}",
                flush=True,
            )
        if tid in self.arrivals:
            self.duplicates += 1  # same Idempotency-Key: a receiver would drop it
        else:
            self.arrivals[tid] = now_ms()
        return web.Response(status=204)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        if self.echo:
            app.router.add_route("*", "/{path:.*}", self._handle)
        else:
            app.router.add_post("/callback", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        if self._runner is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()


def _start(
    role: str, settings: Settings, extra_env: dict[str, str], *, label: str = "demo"
) -> subprocess.Popen[bytes]:
    log_path = settings.stack.state_dir / f"{label}-{role}.log"
    print(f"[{label}] starting a {role} (log: {log_path})", flush=True)
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", role],
            cwd=REPO_ROOT,
            env={**os.environ, **extra_env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_dev(settings: Settings, *, receiver_port: int) -> int:
    """A worker, a proxy and a receiver that prints what it is sent, until Ctrl-C: what
    the README's first screen schedules against (callbacks to http://localhost:PORT/...).
    Exits 1 when the worker or the proxy stops by itself."""
    # Ctrl-C, and a SIGTERM (make killed, a closed terminal), stop the children too: they
    # run in sessions of their own. SIGINT may arrive ignored from a background shell.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    receiver = Receiver(receiver_port, echo=True)
    # The receiver is on loopback, which a deployment refuses by default.
    private_ok = {"TOCSIN_ALLOW_PRIVATE_TARGETS": "true"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["worker"] = _start("worker", settings, private_ok, label="dev")
        procs["proxy"] = _start(
            "proxy",
            settings,
            {**private_ok, "TOCSIN_PROXY_GROUP_ID": f"{settings.topics.prefix}proxy"},
            label="dev",
        )
        print(
            f"[dev] worker and proxy running; the receiver prints every call to "
            f"http://localhost:{receiver_port}/... (Ctrl-C stops all three)",
            flush=True,
        )
        while True:
            for role, proc in procs.items():
                if proc.poll() is not None:
                    log_path = settings.stack.state_dir / f"dev-{role}.log"
                    print(
                        f"[dev] the {role} exited with code {proc.returncode}; see {log_path}",
                        flush=True,
                    )
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("[dev] stopping", flush=True)
        return 0
    finally:
        for proc in procs.values():
            _stop(proc)
        receiver.close()


def run_demo(
    settings: Settings, *, count: int = 3000, spread_s: int = 120, receiver_port: int = 18765
) -> int:
    tenant = "demo"
    _register_tenant(settings, tenant)
    receiver = Receiver(receiver_port)
    # The receiver is on loopback, which a deployment refuses by default: the worker at
    # create (invalid_url), the proxy at delivery (SSRF guard).
    private_ok = {"TOCSIN_ALLOW_PRIVATE_TARGETS": "true"}
    worker = _start("worker", settings, private_ok)
    proxy = _start(
        "proxy",
        settings,
        {**private_ok, "TOCSIN_PROXY_GROUP_ID": f"{settings.topics.prefix}proxy"},
    )
    try:
        return _drive(settings, tenant, count, spread_s, worker, proxy, receiver)
    finally:
        _stop(proxy)
        _stop(worker)
        receiver.close()


def _drive(
    settings: Settings,
    tenant: str,
    count: int,
    spread_s: int,
    worker: subprocess.Popen[bytes],
    proxy: subprocess.Popen[bytes],
    receiver: Receiver,
) -> int:
    client, results, fires = CommandClient(settings), ResultWatcher(settings), FireWatcher(settings)
    run = uuid.uuid4().hex[:6]
    callback = HttpCallback(url=f"http://127.0.0.1:{receiver.port}/callback", timeout_s=5.0)

    probe = f"demo-{run}-probe"
    if not _probe(client, results, tenant, probe, callback):
        print("[demo] the worker did not answer within 120 s; see its log", flush=True)
        return 1
    due = _send_schedules(client, tenant, run, count, spread_s, callback)
    print(f"[demo] {count} schedules sent, due from +10 s over {spread_s} s", flush=True)

    tally = _Tally(due=due, run=run, probe=probe)
    deadline = time.monotonic() + spread_s + 90
    next_report = time.monotonic() + 5
    while (
        len(tally.seen) < count or tally.delivered(receiver) < count
    ) and time.monotonic() < deadline:
        tally.count_results(results.poll(0.05))
        tally.count_fires(fires.poll(0.2))
        if time.monotonic() >= next_report:
            next_report += 5
            print(tally.progress(receiver, count), flush=True)
        for name, proc in (("worker", worker), ("proxy", proxy)):
            if proc.poll() is not None:
                print(f"[demo] the {name} exited unexpectedly; see its log", flush=True)
                return 1
    arrivals = tally.arrivals(receiver)
    for line in tally.summary(arrivals, receiver.duplicates, count):
        print(line, flush=True)
    for closable in (results, fires):
        closable.close()
    early = sum(1 for v in tally.lateness if v < 0)
    return 0 if len(tally.seen) == count and early == 0 and len(arrivals) == count else 1


def _probe(
    client: CommandClient,
    results: ResultWatcher,
    tenant: str,
    probe: str,
    callback: HttpCallback,
) -> bool:
    """Whether the worker answers a first command (due in an hour) within 120 s."""
    client.send(
        CreateCommand(
            tenant=tenant,
            schedule_id=probe,
            due_ms=now_ms() + 3_600_000,
            callback=callback,
            misfire_tolerance_s=3600,
        )
    )
    client.flush()
    return probe in results.wait_for([probe], timeout_s=120)


def _send_schedules(
    client: CommandClient,
    tenant: str,
    run: str,
    count: int,
    spread_s: int,
    callback: HttpCallback,
) -> dict[str, int]:
    """Send ``count`` schedules due from 10 s on over ``spread_s``; {trigger id: due ms}."""
    start_ms = now_ms() + 10_000
    due: dict[str, int] = {}
    for i in range(count):
        sid = f"demo-{run}-{i}"
        due_ms = start_ms + (i * spread_s * 1000) // count
        due[trigger_id(tenant, sid, due_ms)] = due_ms
        client.send(
            CreateCommand(
                tenant=tenant,
                schedule_id=sid,
                request_id=f"{run}-{i}",
                due_ms=due_ms,
                payload=orjson.dumps({"demo": run, "n": i}),
                payload_type=PayloadType.JSON,
                callback=callback,
                misfire_tolerance_s=300,
            )
        )
    client.flush()
    return due


@dataclass
class _Tally:
    """What the demo has seen of its own schedules: results, fires and deliveries."""

    due: dict[str, int]  # trigger id -> due time (epoch ms)
    run: str
    probe: str
    accepted: int = 0
    rejected: int = 0
    duplicates: int = 0
    lateness: list[int] = field(default_factory=list)  # emit time - due time (ms)
    seen: set[str] = field(default_factory=set)

    def count_results(self, results: list[CommandResult]) -> None:
        for r in results:
            sid = r.schedule_id or ""
            if sid.startswith(f"demo-{self.run}-") and sid != self.probe:
                if str(r.status) == "accepted":
                    self.accepted += 1
                else:
                    self.rejected += 1

    def count_fires(self, fires: Iterable[tuple[Trigger, int]]) -> None:
        for trig, _ in fires:
            if trig.trigger_id not in self.due:
                continue
            if trig.trigger_id in self.seen:
                self.duplicates += 1
                continue
            self.seen.add(trig.trigger_id)
            self.lateness.append(trig.emitted_ms - trig.due_ms)

    def arrivals(self, receiver: Receiver) -> dict[str, int]:
        return {tid: at for tid, at in list(receiver.arrivals.items()) if tid in self.due}

    def delivered(self, receiver: Receiver) -> int:
        return sum(1 for tid in list(receiver.arrivals) if tid in self.due)

    def progress(self, receiver: Receiver, count: int) -> str:
        return progress_line(
            self.accepted, len(self.seen), self.delivered(receiver), count, self.lateness
        )

    def summary(self, arrivals: dict[str, int], duplicate_deliveries: int, count: int) -> list[str]:
        return summary_lines(
            count=count,
            accepted=self.accepted,
            rejected=self.rejected,
            fired=len(self.seen),
            duplicates=self.duplicates,
            lateness=self.lateness,
            delivered=len(arrivals),
            duplicate_deliveries=duplicate_deliveries,
            delivery_lateness=[at - self.due[tid] for tid, at in arrivals.items()],
        )

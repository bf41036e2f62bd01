"""What trace context and OpenTelemetry spans cost on the per-trigger hot paths.

Three paths, each timed per item in one process, with no Kafka or Cassandra (their I/O is
the same whatever tracing does):
  * emit: the ticker's work per trigger (``trigger_for``, ``emit_span``, ``encode_trigger``,
    ``trigger_headers``);
  * deliver: the proxy's per record work before the HTTP request (``prepare_fire`` on a
    record with its headers, the request's header map, ``attempt_span``/``end_attempt``);
  * command: the worker's per command trace handling (``CommandTraces`` over a batch of 500,
    ``stamp``).

Each is run for an untraced item and a traced one (a traceparent on the command), with
tracing off, then with tracing on (spans to a console exporter writing to /dev/null, so
the OTLP exporter's thread sending to a sink process that drops them, as a collector
would), next to the same paths with the tracing calls taken out ("no hooks"). Tracing
off must cost an untraced item nothing measurable, a traced one only the header's parsing
and copying, and import no OpenTelemetry.

    .venv/bin/python -m bench.tracing [--n 20000]

Prints ``RESULT name=value unit`` lines last.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

from multidict import CIMultiDict

from base import tracing
from proxy import envelope
from proxy.envelope import Envelope, prepare_fire
from proxy.retry import HttpResult
from proxy.tracing import attempt_span, end_attempt
from streams.decisions import Decision
from streams.model import BucketRow, ScheduleChange, ScheduleRow, trigger_for
from streams.tracing import CommandTraces, emit_span
from topics.codec import callback_to_json, decode_trigger, encode_trigger, trigger_headers
from topics.codes import Code
from topics.models import CreateCommand, HttpCallback
from topics.tracecontext import NOTHING

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CALLBACK = HttpCallback(url="https://hooks.example.com/x", headers={"X-Api-Key": "k"})


def row(traced: bool) -> BucketRow:
    sched = ScheduleRow(
        tenant="acme",
        schedule_id="bench-0001",
        partition=3,
        state="scheduled",
        due_ms=1_900_000_000_000,
        version=1,
        created_ms=1,
        updated_ms=1,
        callback=callback_to_json(CALLBACK),
        payload=b'{"n":1,"text":"hello"}',
        payload_type="json",
        traceparent=TP if traced else None,
    )
    return BucketRow.for_schedule(sched, shards=16)


def emit_path(traced: bool, hooks: bool = True) -> Callable[[], None]:
    bucket = row(traced)

    def once() -> None:
        trigger = trigger_for(bucket, emitted_ms=1_900_000_000_010)
        if hooks:
            trigger = emit_span(trigger, 3)
        encode_trigger(trigger)
        trigger_headers(trigger)

    return once


def deliver_path(traced: bool, hooks: bool = True) -> Callable[[], None]:
    trigger = trigger_for(row(traced), emitted_ms=1_900_000_000_010)
    value, headers = encode_trigger(trigger), trigger_headers(trigger)
    ok = HttpResult(status=200)

    def once() -> None:
        env = Envelope(
            topic="fires",
            partition=0,
            offset=1,
            key=b"bench-0001",
            value=value,
            headers=headers,
            timestamp_ms=1,
            read_s=0.0,
        )
        prepare_fire(env, decode_trigger)
        assert env.request is not None
        sent = CIMultiDict(env.request.headers)
        if hooks:
            span = attempt_span(env, env.request, sent)
            if span is not None:
                end_attempt(span, ok)

    return once


class Msg:
    def __init__(self, offset: int, traced: bool) -> None:
        self.partition = 0
        self.offset = offset
        self.headers = [("tocsin-signature", b"t=1,v1=ab" * 4)]
        if traced:
            self.headers.append(("traceparent", TP.encode()))


def command_path(traced: bool, batch: int = 500) -> Callable[[], None]:
    msgs = [Msg(i, traced) for i in range(batch)]
    bucket = row(False)
    sched = ScheduleRow(**_plain_row())  # type: ignore[arg-type]
    change = ScheduleChange(row=sched, new_bucket=bucket, old_bucket=None, now_ms=1)
    decision = Decision(code=Code.OK, text="", change=change, hand_over=sched)
    create = CreateCommand(
        tenant="acme", schedule_id="bench-0001", callback=CALLBACK, misfire_tolerance_s=60
    )

    def once() -> None:
        traces = CommandTraces(msgs)
        for msg in msgs:
            traces.stamp(decision, create, msg)
        traces.close()

    return once


def _plain_row() -> dict[str, object]:
    return {
        "tenant": "acme",
        "schedule_id": "bench-0001",
        "partition": 0,
        "state": "scheduled",
        "due_ms": 1_900_000_000_000,
        "version": 1,
        "created_ms": 1,
        "updated_ms": 1,
        "callback": callback_to_json(CALLBACK),
    }


def per_item_us(once: Callable[[], None], n: int, items: int = 1, rounds: int = 3) -> float:
    """The least over ``rounds`` of the time per item, in microseconds: on a shared machine
    the least is the run the neighbours disturbed least."""
    once()  # warm caches (callback parsing, first span's imports)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            once()
        times.append((time.perf_counter() - t0) / (n * items) * 1e6)
    return min(times)


def measure(n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for traced in (False, True):
        kind = "traced" if traced else "untraced"
        out[f"emit_{kind}"] = per_item_us(emit_path(traced), n)
        out[f"deliver_{kind}"] = per_item_us(deliver_path(traced), n)
        out[f"command_{kind}"] = per_item_us(command_path(traced), max(1, n // 500), 500)
    return out


def measure_without_hooks(n: int) -> dict[str, float]:
    """The same paths with the tracing calls taken out: the code as if tracing did not
    exist (the proxy's header reading replaced by "nothing found")."""
    out: dict[str, float] = {}
    real = envelope.from_headers
    envelope.from_headers = lambda headers: NOTHING  # type: ignore[assignment]
    try:
        for traced in (False, True):
            kind = "traced" if traced else "untraced"
            out[f"emit_{kind}"] = per_item_us(emit_path(traced, hooks=False), n)
            out[f"deliver_{kind}"] = per_item_us(deliver_path(traced, hooks=False), n)
            out[f"command_{kind}"] = 0.0
    finally:
        envelope.from_headers = real
    return out


class _Sink:
    """An OTLP/HTTP endpoint in a process of its own that reads and drops what it gets,
    as a collector would take it off the exporter's hands."""

    CODE = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_POST(self):\n"
        "        self.rfile.read(int(self.headers.get('Content-Length', 0)))\n"
        "        self.send_response(200); self.send_header('Content-Length', '0')\n"
        "        self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), H)\n"
        "print(s.server_address[1], flush=True)\n"
        "s.serve_forever()\n"
    )

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.CODE], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        return f"http://127.0.0.1:{self.proc.stdout.readline().strip()}"

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="items per round and path")
    args = parser.parse_args()
    tracing.configure("bench", {})
    # Alternated, each path's least kept: both see the same neighbours.
    without: dict[str, float] = {}
    off: dict[str, float] = {}
    for _ in range(3):
        for into, run in ((without, measure_without_hooks), (off, measure)):
            for name, value in run(args.n).items():
                into[name] = min(value, into.get(name, value))
    loaded_off = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    with _Sink() as url:
        tracing.configure("bench", {"OTEL_EXPORTER_OTLP_ENDPOINT": url})
        on = measure(args.n)
        tracing.configure("bench", {})  # sends what is queued and stops the exporter
    print(f"{'path':<18}{'no hooks':>10}{'off':>10}{'on':>10}   (us per item, least of the runs)")
    for name in off:
        print(f"{name:<18}{without[name]:>10.2f}{off[name]:>10.2f}{on[name]:>10.2f}")
    print(f"opentelemetry modules loaded with tracing off: {loaded_off or 'none'}")
    for name in off:
        print(f"RESULT tracing_nohooks_{name}_us={without[name]:.2f} us")
        print(f"RESULT tracing_off_{name}_us={off[name]:.2f} us")
        print(f"RESULT tracing_on_{name}_us={on[name]:.2f} us")
    print(f"RESULT tracing_off_otel_modules={len(loaded_off)} modules")


if __name__ == "__main__":
    main()

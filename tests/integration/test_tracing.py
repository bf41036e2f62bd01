"""W3C trace context on the real stack: API request or command header -> schedule row ->
trigger -> callback request and dead letter; and, with an OTLP endpoint configured, the
API's, the worker's and the proxy's spans arriving at a local OTLP/HTTP receiver under the
command's trace id.

Tracing off, the callback gets the command's traceparent unchanged (no span, so no new
parent id). Tracing on, every hop is a span and the callback gets the proxy's attempt span
as its parent, still in the command's trace."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest

from base import tracing
from base.settings import REPO_ROOT, Settings
from proxy.app import ProxyApp
from streams.client import CommandClient, ResultWatcher
from tests.integration.conftest import (
    ApiServer,
    WorkerProcess,
    _env_for,
    _ports,
    isolated_stack,
    wait_worker_ready,
)
from tests.integration.test_proxy_delivery import (
    Hit,
    Receiver,
    create_topics,
    fast_settings,
    read_topic,
    wait_for,
)
from topics.codec import encode_command
from topics.models import CreateCommand, HttpCallback
from topics.signing import sign_headers

pytestmark = pytest.mark.integration

TRACE_A = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_B = "0af7651916cd43dd8448eb211c80319c"
TRACE_C = "7d2a61c4e9a35b1f0c8e3f4a4c559e0b"
STATIC = "00-11111111111111111111111111111111-2222222222222222-01"


def tp(trace_id: str, parent: str = "00f067aa0ba902b7") -> str:
    return f"00-{trace_id}-{parent}-01"


@dataclass(frozen=True)
class SpanSeen:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1 that decodes what it is sent."""

    def __init__(self) -> None:
        self.spans: list[SpanSeen] = []
        self.lock = threading.Lock()
        spans, lock = self.spans, self.lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                got = []
                for rs in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            got.append(
                                SpanSeen(
                                    service=attrs.get("service.name", ""),
                                    name=span.name,
                                    trace_id=span.trace_id.hex(),
                                    span_id=span.span_id.hex(),
                                    parent_id=span.parent_span_id.hex(),
                                    attributes={
                                        a.key: a.value.int_value or a.value.string_value
                                        for a in span.attributes
                                    },
                                )
                            )
                with lock:
                    spans.extend(got)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: str) -> list[SpanSeen]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def trace_stack(real_stack: Settings) -> Iterator[Settings]:
    with isolated_stack(real_stack, "trace") as settings:
        yield settings


@contextlib.contextmanager
def running(
    settings: Settings, tmp_path: Path, otel: dict[str, str]
) -> Iterator[tuple[WorkerProcess, ApiServer]]:
    """A worker and a ``tocsin api`` with these OpenTelemetry variables (none: off)."""
    env = _env_for(settings, next(_ports), next(_ports))
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    worker = WorkerProcess(
        settings, {**env, **otel, "OTEL_SERVICE_NAME": "tocsin-worker"}, tmp_path / "w.log"
    ).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    admin = "admin-" + os.urandom(8).hex()
    api_env = {
        **env,
        **otel,
        "OTEL_SERVICE_NAME": "tocsin-api",
        "TOCSIN_API_PORT": str(port),
        "TOCSIN_ADMIN_KEY": admin,
        "TOCSIN_METRICS_PORT": str(next(_ports)),
    }
    log = tmp_path / "api.log"
    with log.open("ab") as out:
        api = subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", "api"],
            env=api_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            with contextlib.suppress(OSError), urllib.request.urlopen(base + "/readyz") as r:
                return bool(r.status == 200)
            assert api.poll() is None, log.read_text()[-3000:]
            return False

        wait_for(ready, 60, "the api")
        wait_worker_ready(settings, "acme", worker=worker)
        yield worker, ApiServer(settings, base, admin, worker)
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGTERM)
            try:
                api.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(api.pid, signal.SIGKILL)
        worker.stop()


def api_key(api: ApiServer) -> tuple[str, str]:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    status, body = api.call("POST", "/v1/tenants", key=api.admin_key, body={"tenant": tenant})
    assert status == 201, body
    return tenant, str(body["api_key"])  # type: ignore[index]


def api_create(api: ApiServer, key: str, url: str, headers: dict[str, str]) -> str:
    sid = f"api-{uuid.uuid4().hex[:8]}"
    body = {
        "schedule_id": sid,
        "due": time.time_ns() // 1_000_000 + 1500,
        "payload": {"sid": sid},
        "callback": {"type": "http", "url": url, "headers": {"traceparent": STATIC}},
    }
    status, answer = api.call("POST", "/v1/schedules", key=key, body=body, headers=headers)
    assert status in (200, 201), answer
    return sid


def kafka_create(settings: Settings, url: str, traceparent: str) -> str:
    """A create produced on the commands topic with a traceparent header of its own."""
    sid = f"kc-{uuid.uuid4().hex[:8]}"
    command = CreateCommand(
        tenant="acme",
        schedule_id=sid,
        due_ms=time.time_ns() // 1_000_000 + 1500,
        callback=HttpCallback(url=url),
        misfire_tolerance_s=600,
    )
    client, results = CommandClient(settings), ResultWatcher(settings)
    key, value = sid.encode(), encode_command(command)
    secret = client.signing_key_of("acme")
    assert secret is not None
    headers = sign_headers(secret, signed_at_ms=time.time_ns() // 1_000_000, key=key, value=value)
    client.send_raw(key, value, headers=[*headers, ("traceparent", traceparent.encode())])
    client.flush()
    got = results.wait_for([sid], timeout_s=60)
    results.close()
    assert got[sid].code == "ok", got[sid]
    return sid


def start_proxy(settings: Settings, dlq: str, deliveries: str) -> ProxyApp:
    app = ProxyApp(
        settings,
        fast_settings(
            mode="fires",
            source_topic="",
            dead_letter_topic=dlq,
            deliveries_topic=deliveries,
            group_id=f"trace-{uuid.uuid4().hex[:6]}",
        ),
    )
    app.start()
    return app


def hit_of(receiver: Receiver, sid: str) -> Hit:
    wait_for(
        lambda: any(h.headers.get("Tocsin-Schedule-Id") == sid for h in receiver.hits),
        60,
        f"the callback of {sid}",
    )
    return next(h for h in receiver.hits if h.headers.get("Tocsin-Schedule-Id") == sid)


def test_the_commands_traceparent_reaches_the_callback_and_the_dead_letter(
    trace_stack: Settings, tmp_path: Path
) -> None:
    tracing.configure("tocsin-proxy", {})  # this process's proxy: tracing off
    receiver = Receiver(behave=lambda hit, n: 700 if hit.path == "/reject" else 200).start()
    dlq = f"{trace_stack.topics.prefix}dlq-{uuid.uuid4().hex[:6]}"
    deliveries = f"{trace_stack.topics.prefix}deliveries-{uuid.uuid4().hex[:6]}"
    create_topics(trace_stack, [dlq, deliveries])
    proxy = start_proxy(trace_stack, dlq, deliveries)
    base = f"http://127.0.0.1:{receiver.port}"
    try:
        with running(trace_stack, tmp_path, {}) as (_worker, api):
            _, key = api_key(api)
            # The REST create's header wins over the callback's own traceparent.
            by_api = api_create(api, key, base + "/ok", {"traceparent": tp(TRACE_A)})
            dead = kafka_create(trace_stack, base + "/reject", tp(TRACE_B))
            invalid = kafka_create(trace_stack, base + "/ok", tp(TRACE_C).upper())
            # No span anywhere: the callback's parent is the command's own.
            assert hit_of(receiver, by_api).headers["traceparent"] == tp(TRACE_A)
            assert hit_of(receiver, dead).headers["traceparent"] == tp(TRACE_B)
            assert "traceparent" not in hit_of(receiver, invalid).headers
            (letter,) = read_topic(trace_stack, dlq, expect=1, timeout_s=60)
            record = orjson.loads(letter.value())
            assert record["schedule_id"] == dead
            assert record["traceparent"] == tp(TRACE_B)
    finally:
        proxy.stop(timeout_s=5)
        receiver.stop()


def test_spans_of_the_api_worker_and_proxy_arrive_under_the_commands_trace(
    trace_stack: Settings, tmp_path: Path
) -> None:
    otlp = OtlpReceiver()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    receiver = Receiver().start()
    dlq = f"{trace_stack.topics.prefix}dlq-{uuid.uuid4().hex[:6]}"
    deliveries = f"{trace_stack.topics.prefix}deliveries-{uuid.uuid4().hex[:6]}"
    create_topics(trace_stack, [dlq, deliveries])
    assert tracing.configure("tocsin-proxy", {**otel, "OTEL_SERVICE_NAME": "tocsin-proxy"})
    proxy = start_proxy(trace_stack, dlq, deliveries)
    base = f"http://127.0.0.1:{receiver.port}"
    try:
        with running(trace_stack, tmp_path, otel) as (_worker, api):
            _, key = api_key(api)
            sid = api_create(api, key, base + "/ok", {"traceparent": tp(TRACE_C)})
            got = hit_of(receiver, sid).headers["traceparent"]
            assert got.startswith(f"00-{TRACE_C}-") and got != tp(TRACE_C)
            tracing.flush()

            want = {"tocsin.command.produce", "tocsin.command", "tocsin.emit", "tocsin.deliver"}
            wait_for(
                lambda: want <= {s.name for s in otlp.of_trace(TRACE_C)},
                60,
                "spans of the api, the worker and the proxy",
            )
            spans = {s.name: s for s in otlp.of_trace(TRACE_C)}
            assert {spans[n].service for n in want} == {
                "tocsin-api",
                "tocsin-worker",
                "tocsin-proxy",
            }
            assert (
                spans["tocsin.command"].service == spans["tocsin.emit"].service == "tocsin-worker"
            )
            deliver = spans["tocsin.deliver"]
            assert deliver.service == "tocsin-proxy"
            assert deliver.attributes["http.response.status_code"] == 200
            # The receiver's parent is the proxy's attempt span, a child of the emit span,
            # a child of the worker's command span, a child of the API's produce span.
            assert got == f"00-{TRACE_C}-{deliver.span_id}-01"
            assert deliver.parent_id == spans["tocsin.emit"].span_id
            assert spans["tocsin.emit"].parent_id == spans["tocsin.command"].span_id
            produce = spans["tocsin.command.produce"]
            assert spans["tocsin.command"].parent_id == produce.span_id
            assert produce.service == "tocsin-api"
            # ... a child of the API's request span, a child of the caller's traceparent.
            server = spans["POST /v1/schedules"]
            assert produce.parent_id == server.span_id
            assert server.parent_id == "00f067aa0ba902b7"
    finally:
        proxy.stop(timeout_s=5)
        receiver.stop()
        tracing.configure("tocsin-proxy", {})
        otlp.close()

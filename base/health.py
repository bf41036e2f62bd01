"""Health and metrics over HTTP for long-running roles (worker, proxy).

    GET /metrics   Prometheus text format
    GET /healthz   liveness: 200 while the role's main loop keeps beating, else 503
    GET /readyz    readiness: 200 once the role says it is ready (connected, assigned)

Served from a daemon thread with the standard library, so a stuck event loop cannot hide
itself: liveness is judged from a heartbeat the loop must keep refreshing.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Health:
    """Shared state read by the HTTP thread; ``beat()`` and ``set_ready()`` are cheap."""

    def __init__(self, *, stale_after_s: float = 30.0) -> None:
        self.stale_after_s = stale_after_s
        self._last_beat = time.monotonic()
        self._ready = False
        self._reason = "starting"
        # Components that keep failing (base.supervise): any one makes the process dead.
        self._failed: dict[str, str] = {}

    def beat(self) -> None:
        self._last_beat = time.monotonic()

    def fail(self, component: str, reason: str) -> None:
        self._failed[component] = reason

    def recover(self, component: str) -> None:
        self._failed.pop(component, None)

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready, self._reason = ready, reason

    def live(self) -> tuple[bool, str]:
        age = time.monotonic() - self._last_beat
        if age > self.stale_after_s:
            return False, f"main loop silent for {age:.0f}s"
        failed = dict(self._failed)
        if failed:
            return False, "; ".join(failed[name] for name in sorted(failed))
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        live, why = self.live()
        if not live:
            return False, why
        return self._ready, "ok" if self._ready else self._reason


def serve(
    health: Health,
    port: int,
    *,
    addr: str = "0.0.0.0",
    registry: CollectorRegistry = REGISTRY,
) -> ThreadingHTTPServer:
    """Start the server on a daemon thread and return it (``shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/metrics"):
                body = generate_latest(registry)
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif self.path.startswith("/healthz"):
                ok, why = health.live()
                self._send(200 if ok else 503, why.encode() + b"\n", "text/plain")
            elif self.path.startswith("/readyz"):
                ok, why = health.ready()
                self._send(200 if ok else 503, why.encode() + b"\n", "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # probes every few seconds would drown the logs

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server

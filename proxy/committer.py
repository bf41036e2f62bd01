"""The offset-commit thread (which also serves the producer and refreshes gauges).

Every ``commit_interval_s`` it has the reader commit, per partition, the highest offset
below which every message is done (the consumer itself is only touched on the reader
thread; see proxy.reader). Between commits it polls the producer so acknowledgements of dead letters
and outcomes arrive (they are what lets offsets advance), every ``DEFER_S`` it produces the
outcome records held for it (``Outbox.send_deferred``), and once a second it copies the
shared state into the gauges. Never touches the pending queue's contents.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from proxy.metrics import ProxyMetrics
from proxy.outbox import DEFER_S, Outbox
from proxy.state import SharedState

log = logging.getLogger("tocsin.proxy")

# The longest wait for a producer event: how soon a stop is seen.
POLL_S = 0.05


class Committer:
    def __init__(
        self,
        *,
        state: SharedState,
        outbox: Outbox,
        metrics: ProxyMetrics,
        interval_s: float,
        request_commit: Callable[[], None],
        paused: Callable[[], int],
    ) -> None:
        self._state = state
        self._outbox = outbox
        self._metrics = metrics
        self._interval_s = interval_s
        self._request_commit = request_commit
        self._paused = paused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy-committer", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop; the reader makes the last commit when it closes the consumer."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        next_commit = time.monotonic() + self._interval_s
        next_gauges = 0.0
        next_send = 0.0
        try:
            while not self._stop.is_set():
                self._outbox.poll(max(0.0, min(POLL_S, next_send - time.monotonic())))
                now = time.monotonic()
                if now >= next_send:
                    self._outbox.send_deferred()
                    next_send = now + DEFER_S
                if now >= next_commit:
                    self._request_commit()
                    next_commit = now + self._interval_s
                if now >= next_gauges:
                    self.refresh_gauges(now)
                    next_gauges = now + 1.0
        except BaseException as exc:
            self.error = exc
            log.exception("proxy committer failed")

    def refresh_gauges(self, now: float) -> None:
        snap = self._state.snapshot(now)
        m = self._metrics
        m.pending.set(snap.waiting)
        m.pending_bytes.set(snap.held_bytes)
        m.in_flight.set(snap.in_flight)
        m.oldest_in_flight.set(snap.oldest_in_flight_s)
        m.paused.set(self._paused())
        for (topic, partition), lag in snap.uncommitted.items():
            m.commit_lag.labels(topic, str(partition)).set(lag)

"""Long-running tasks that never die silently.

``supervise`` runs a task's body, and when it ends with an error (anything but
cancellation) logs the error with its traceback, waits with backoff and runs it again. A
body that keeps failing (``give_up_after`` failures in a row, each within ``window_s`` of
starting) marks the process unhealthy through ``Health.fail``, so ``/healthz`` answers 503
and an orchestrator restarts the process; the supervisor keeps retrying meanwhile, and a
later run that lasts ``window_s`` clears the mark.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger("tocsin.supervise")


class HealthSink(Protocol):
    def fail(self, component: str, reason: str) -> None: ...

    def recover(self, component: str) -> None: ...


async def supervise(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    health: HealthSink | None = None,
    first_delay_s: float = 1.0,
    max_delay_s: float = 30.0,
    give_up_after: int = 5,
    window_s: float = 60.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run ``body`` until it returns normally (or this task is cancelled)."""
    failures = 0
    while True:
        started = clock()
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if clock() - started >= window_s:
                failures = 0
                if health is not None:
                    health.recover(name)
            failures += 1
            delay = min(max_delay_s, first_delay_s * 2 ** (failures - 1))
            log.error(
                "task failed; restarting it",
                exc_info=exc,
                extra={"task": name, "failures": failures, "retry_s": delay},
            )
            if health is not None and failures >= give_up_after:
                health.fail(name, f"{name} failed {failures} times in a row: {exc!r}")
            await sleep(delay)

"""Faust's resumption of the streams after a rebalance, kept from dying of a slow seek.

After each assignment Faust's recovery service (``faust.tables.recovery.Recovery``, which
runs even with no tables) resumes the streams in ``_resume_streams``: it seeks every
assigned partition to its committed offset (an OffsetFetch to the group coordinator),
bounded by ``broker_request_timeout``, and only then resumes the flow. A seek outlasting
that bound makes mode's ``wait_first`` report the service as stopped; Faust's ``_wait``
raises ``ServiceStopped`` and the recovery task ends for good, with the flow still
suspended: the command agent is fed nothing, silently, until the worker restarts. The
worker's request timeout is short (settings: ``kafka_request_timeout_s``), and the seek
queues behind offset commits that took 8-21 s during a broker failover (RELIABILITY.md).

``install(app)`` makes a seek that times out go on to resume the flow instead, with a
warning. Nothing is lost by that: an eager rebalance gives every partition a fresh
position state in aiokafka (``SubscriptionState.assign_from_subscribed``), which its
fetcher sets from the committed offset (retrying until the coordinator answers) before
fetching, and Faust forgot its own read offsets at the revocation; the commands after the
committed offset are read again either way. The seek itself is cancelled; if its request
still lands later, the partition goes back to the committed offset once more, and the
commands read twice are answered as replays (each row records the offset it applied).
A recovery service really stopping or crashing still ends it, and another rebalance
starting still restarts it, as before.

This reaches into Faust's recovery (an instance attribute shadowing ``_resume_streams``,
and ``_wait`` shadowed only while it runs), checked against the pinned faust-streaming
and mode-streaming (constraints.txt); a worker with tables would resume through
``on_recovery_completed`` instead, which this leaves alone (the worker has none).
"""

from __future__ import annotations

import logging
from typing import Any

import faust
from faust.tables.recovery import ServiceStopped

log = logging.getLogger(__name__)


def install(app: faust.App) -> None:
    """Make ``app``'s recovery resume the streams after a seek that timed out."""
    recovery: Any = app.tables.recovery  # type: ignore[attr-defined]
    resume_streams = recovery._resume_streams
    wait = recovery._wait

    # Faust's _wait's own signature, which _resume_streams calls.
    async def wait_for_seek(coro: Any, timeout: float | None = None) -> None:  # noqa: ASYNC109
        try:
            await wait(coro, timeout=timeout)
        except ServiceStopped:
            if timeout is None or recovery.should_stop:
                raise  # the service stops or crashed: not a slow seek
            log.warning(
                "seeking to the committed offsets timed out; resuming the streams anyway "
                "(the consumer starts each partition at its committed offset)",
                extra={"timeout_s": timeout},
            )

    async def patient_resume_streams(generation_id: int = 0) -> None:
        # Its only timed wait is the seek (the sleep before it goes through the
        # recovery task's own _wait, outside this call).
        recovery._wait = wait_for_seek
        try:
            await resume_streams(generation_id=generation_id)
        finally:
            del recovery._wait

    recovery._resume_streams = patient_resume_streams

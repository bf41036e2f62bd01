"""The one interface between the writer and a delivery: send an envelope, say what happened.

The writer schedules attempts (slots, per-host and per-tenant caps, timers, parking) and
hands each one to the sender for its callback kind: ``proxy.http_sender`` for an HTTP
request, ``proxy.kafka_sender`` for a Kafka callback. A sender answers in its own terms
(an HTTP status and Retry-After, or Kafka's verdict); ``proxy.retry`` classifies that
answer. A sender never raises for a failed delivery; an exception is a bug, which the
writer retries loudly.
"""

from __future__ import annotations

from typing import Protocol

from proxy.envelope import Envelope
from proxy.retry import AttemptResult


class Sender(Protocol):
    async def send(self, env: Envelope) -> AttemptResult:
        """One attempt at delivering ``env``; its outcome, never an exception."""
        ...

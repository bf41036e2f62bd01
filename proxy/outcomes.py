"""Outcome publishing: the records a message's final outcome leaves in Kafka.

Once ``proxy.retry.decide`` has said delivered or dead-lettered, the outcome is written: the
dead letter (dead-letters topic) and, in fires mode, the delivery outcome (deliveries
topic). The message's source offset counts as done only once Kafka has every one of them, so
a crash before that reads the message again rather than losing its outcome. Nothing else
waits for these records, so they go out with the outbox's next round (``OutRecord.later``),
not one produce request each.
"""

from __future__ import annotations

import logging
from typing import Protocol

from base.clock import now_ms
from proxy.attempts import Held, attempt_record, attempt_sampled, hold_sampled
from proxy.deadletter import dead_letter_record, delivery_outcome, failure_times_ms
from proxy.envelope import Envelope
from proxy.metrics import ProxyMetrics
from proxy.outbox import OutRecord, RecordSink
from proxy.retry import DeadLetter, Done, Retry
from topics.models import DeliveryOutcome

log = logging.getLogger("tocsin.proxy")


class OffsetSink(Protocol):
    """Where a finished message's offset is marked done (``proxy.state.SharedState``)."""

    def offset_done(self, env: Envelope) -> None: ...


class OutcomePublisher:
    def __init__(
        self,
        *,
        outbox: RecordSink,
        offsets: OffsetSink,
        metrics: ProxyMetrics,
        dead_letter_topic: str,
        deliveries_topic: str | None,
        group_id: str,
    ) -> None:
        self._outbox = outbox
        self._offsets = offsets
        self._metrics = metrics
        self._dlq_topic = dead_letter_topic
        self._deliveries_topic = deliveries_topic
        self._group_id = group_id

    def publish(
        self, env: Envelope, decision: Done | DeadLetter, status_class: str, now_s: float
    ) -> None:
        """Write the outcome's records (dead letter, delivery outcome) of ``env``, decided at
        ``now_s`` (monotonic); its offset is done once Kafka has them all."""
        latency_s = now_s - env.read_s
        self._metrics.latency.observe(latency_s)
        wall_ms = now_ms()
        records: list[OutRecord] = []
        outcome: DeliveryOutcome
        reason: str | None = None
        if isinstance(decision, Done):
            self._metrics.delivery("delivered", status_class)
            outcome = DeliveryOutcome.DELIVERED
        else:
            self._metrics.delivery("dead_lettered", status_class)
            kind = status_class if status_class != "timeout" else "poison"
            self._metrics.dead_letters.labels(kind).inc()
            records.append(self._dead_letter(env, decision, now_s, wall_ms))
            outcome, reason = DeliveryOutcome.DEAD_LETTERED, decision.reason
        if self._deliveries_topic is not None:
            rec = delivery_outcome(
                env,
                outcome=outcome,
                status=decision.status,
                reason=reason,
                latency_ms=int(latency_s * 1000),
                now_ms=wall_ms,
            )
            if rec is not None:
                records.append(OutRecord(self._deliveries_topic, rec[0], rec[1], later=True))
        if records:
            self._outbox.send_all(records, lambda: self._offsets.offset_done(env))
        else:
            self._offsets.offset_done(env)

    def attempt_failed(self, env: Envelope, decision: Retry, status_class: str) -> None:
        """Report a failed attempt that will be retried (sampled: ``proxy.attempts``). The
        record does not hold the message's offset: only the final outcome does."""
        st = env.attempt_state
        if not attempt_sampled(st.attempts):
            return
        self._attempt_record(
            env,
            status_code=st.last_status,
            status_class=status_class,
            result=decision.reason,
            backoff_s=decision.after_s,
            held=None,
        )

    def held(self, env: Envelope, held: Held, wait_s: float, now_s: float, reason: str) -> None:
        """Report a wait its host imposed on ``env`` (sampled: ``proxy.attempts``); a rate
        limit's pacing only for a message that has failed before (pacing alone is normal)."""
        first = env.attempt_state.first_failure_s
        if first is None or not hold_sampled(now_s - first, wait_s):
            return
        self._attempt_record(
            env,
            status_code=None,
            status_class="held",
            result=reason,
            backoff_s=wait_s,
            held=held,
        )

    def _attempt_record(
        self,
        env: Envelope,
        *,
        status_code: int | None,
        status_class: str,
        result: str,
        backoff_s: float,
        held: Held | None,
    ) -> None:
        if self._deliveries_topic is None:
            return
        rec = attempt_record(
            env,
            status_code=status_code,
            status_class=status_class,
            result=result,
            backoff_s=backoff_s,
            held=held,
            now_ms=now_ms(),
        )
        if rec is not None:
            self._outbox.send_all(
                [OutRecord(self._deliveries_topic, rec[0], rec[1], later=True)], _nothing
            )

    def _dead_letter(
        self, env: Envelope, decision: DeadLetter, now_s: float, wall_ms: int
    ) -> OutRecord:
        """The dead-letter record, with its coordinates-only form as the fallback should
        Kafka refuse the whole record for good."""
        st = env.attempt_state
        first_ms, last_ms = failure_times_ms(st, now_s, wall_ms)

        def dead_letter(*, coordinates_only: bool) -> bytes:
            return dead_letter_record(
                env,
                reason=decision.reason,
                status=decision.status,
                first_failure_ms=first_ms,
                last_failure_ms=last_ms,
                now_ms=wall_ms,
                group_id=self._group_id,
                coordinates_only=coordinates_only,
            )

        log.warning(
            "message dead-lettered",
            extra={
                "topic": env.topic,
                "partition": env.partition,
                "offset": env.offset,
                "reason": decision.reason,
                "attempts": st.attempts,
            },
        )
        return OutRecord(
            self._dlq_topic,
            env.key,
            dead_letter(coordinates_only=False),
            fallback=OutRecord(self._dlq_topic, env.key, dead_letter(coordinates_only=True)),
            later=True,
        )


def _nothing() -> None:
    """An attempt record's acknowledgement waits for nothing."""

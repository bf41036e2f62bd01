"""Trace context through the worker: read from a command's Kafka headers, stored with the
schedule its command makes, carried on by each trigger; and, when tracing is on
(``base.tracing``), a span per command and per emitted trigger.

Which commands store a context: a create, an update that carries one (the latest intent
replaces the earlier one; an update without one keeps it) and a trigger command's run. A
pause, resume or cancel changes no stored context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from base import tracing
from base.tracing import SpanKind, Spanned
from streams import metrics
from streams.decisions import Decision
from streams.model import BucketRow, ScheduleChange, ScheduleRow
from topics.models import Command, CommandType, Trigger
from topics.tracecontext import TraceContext, from_headers

# The commands whose context the schedule (or the run) keeps.
_STORED = frozenset({CommandType.CREATE, CommandType.UPDATE, CommandType.TRIGGER})

_dropped_command = metrics.TRACEPARENT_DROPPED.labels("command")


class Record(Protocol):
    """What of a commands-topic record this reads (streams.commands.RawCommand)."""

    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]] | Mapping[str, bytes]: ...


class CommandTraces:
    """One batch of commands: each one's valid incoming context and, tracing on, its span
    (a child of that context), whose context the schedule then stores instead."""

    def __init__(self, batch: Sequence[Record]) -> None:
        self._carried: dict[tuple[int, int], TraceContext] = {}
        self._spans: list[Spanned] = []
        on = tracing.enabled()
        for msg in batch:
            found = from_headers(msg.headers) if msg.headers else None
            if found is not None and found.invalid:
                _dropped_command.inc()
            context = found.context if found is not None else None
            if on:
                span = tracing.start(
                    "tocsin.command",
                    kind=SpanKind.CONSUMER,
                    parent=context.pair if context is not None else None,
                    attributes={
                        "messaging.system": "kafka",
                        "messaging.destination.partition.id": str(msg.partition),
                        "messaging.kafka.message.offset": msg.offset,
                    },
                )
                if span is not None:
                    self._spans.append(span)
                    context = TraceContext(span.traceparent, span.tracestate)
            if context is not None:
                self._carried[(msg.partition, msg.offset)] = context

    def stamp(self, decision: Decision, command: Command, msg: Record) -> Decision:
        """``decision`` with the command's context on the rows it writes and fires."""
        context = self._carried.get((msg.partition, msg.offset))
        if context is None or command.type not in _STORED:
            return decision
        return stamped(decision, context)

    def close(self) -> None:
        for span in self._spans:
            span.end()
        self._spans.clear()


# A batch read without headers (tests, tools): nothing carried, no spans.
NO_TRACES = CommandTraces(())


def stamped(decision: Decision, context: TraceContext) -> Decision:
    """The decision with ``context`` on its schedule row, bucket row, hand-over and run."""
    parent, state = context.pair
    change = decision.change
    if change is not None and change.write_row:
        change = _stamp_change(change, context)
    hand_over = decision.hand_over
    if hand_over is not None:
        hand_over = dataclasses.replace(hand_over, traceparent=parent, tracestate=state)
    fire_now = decision.fire_now
    if fire_now is not None:
        fire_now = dataclasses.replace(fire_now, traceparent=parent, tracestate=state)
    return dataclasses.replace(decision, change=change, hand_over=hand_over, fire_now=fire_now)


def _stamp_change(change: ScheduleChange, context: TraceContext) -> ScheduleChange:
    parent, state = context.pair
    row: ScheduleRow = dataclasses.replace(change.row, traceparent=parent, tracestate=state)
    bucket: BucketRow | None = change.new_bucket
    if bucket is not None:
        bucket = dataclasses.replace(bucket, traceparent=parent, tracestate=state)
    return dataclasses.replace(change, row=row, new_bucket=bucket)


def emit_span(trigger: Trigger, partition: int) -> Trigger:
    """Tracing on and ``trigger`` traced: record its emission as a producer span and return
    the trigger carrying that span's context; otherwise ``trigger`` itself. Untraced
    triggers get no span: a root trace per fire would be noise nobody asked for."""
    if trigger.traceparent is None or not tracing.enabled():
        return trigger
    span = tracing.start(
        "tocsin.emit",
        kind=SpanKind.PRODUCER,
        parent=(trigger.traceparent, trigger.tracestate),
        attributes={
            "messaging.system": "kafka",
            "tocsin.tenant": trigger.tenant,
            "tocsin.schedule_id": trigger.schedule_id,
            "tocsin.trigger_id": trigger.trigger_id,
            "tocsin.emit_attempt": trigger.attempt,
            "tocsin.lateness_ms": max(0, trigger.emitted_ms - trigger.due_ms),
            "messaging.destination.partition.id": str(partition),
        },
    )
    if span is None:
        return trigger
    # The span covers building and queueing the record; the broker's ack is the
    # ticker's business (its own metrics time it).
    span.end()
    return dataclasses.replace(trigger, traceparent=span.traceparent, tracestate=span.tracestate)

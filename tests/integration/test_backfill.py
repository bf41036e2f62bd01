"""Backfill on the real stack with a real worker: a minutely schedule created now and
backfilled over the five minutes before fires the five runs it would have had, each with
the run id, trigger id and due time of its own emission, in nominal order, after the
command was answered (paced by the worker from stored rows). A pause stops the runs of a
backfill not emitted yet, and a resume does not bring them back.

No timing assertions on speed: only what fired, with which ids, in which order.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from base.settings import Settings
from streams.recurring import run_id
from tests.integration.conftest import wait_worker_ready
from tests.integration.test_pause import Stack, now_ms
from topics.codec import decode_result
from topics.ids import trigger_id
from topics.models import (
    BackfillCommand,
    CommandResult,
    CreateCommand,
    HttpCallback,
    PauseCommand,
    PayloadType,
    Recurrence,
    ResumeCommand,
    Trigger,
)


def test_a_backfill_fires_the_windows_runs_with_their_own_ids_in_order(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("backfill")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"backfill-{uuid.uuid4().hex[:8]}"
    create = CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        payload=b'{"n":1}',
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=60),
    )
    assert stack.send(create).code == "ok"
    row = stack.row(tenant, sid)
    assert row is not None and row["anchor_ms"] is not None
    # Its first own run is a minute after the create: nothing of the past fired.
    now = now_ms()
    window = (now - 300_000, now)
    done = stack.send(
        BackfillCommand(tenant=tenant, schedule_id=sid, from_ms=window[0], to_ms=window[1])
    )
    assert done.code == "ok" and done.message.startswith("backfilled 5 runs"), done.message
    # The series keeps its phase back in time: anchor + 60 s + k * 60 s.
    phase = int(row["anchor_ms"]) + 60_000
    nominals = sorted(
        phase - 60_000 * k for k in range(1, 7) if window[0] <= phase - 60_000 * k < window[1]
    )
    assert len(nominals) == 5
    runs = {run_id(sid, n) for n in nominals}
    got = []
    while len(got) < 5:
        more = stack.first(lambda t: t.schedule_id in runs, 30)
        assert more, f"only {len(got)} of 5 backfilled runs fired"
        got.extend(more)
    got.extend(stack.fired(lambda t: t.schedule_id in runs, 2.0))  # nothing more comes
    assert [t.schedule_id for t in got] == [run_id(sid, n) for n in nominals]
    assert [t.due_ms for t in got] == nominals
    assert [t.trigger_id for t in got] == [trigger_id(tenant, run_id(sid, n), n) for n in nominals]
    # Fired from stored rows after the answer, paced: emitted in order, none before it.
    emitted = [t.emitted_ms for t in got]
    assert emitted == sorted(emitted) and emitted[0] >= done.at_ms
    events = [e for e in stack.events(tenant, sid) if e["event"] == "backfilled"]
    assert len(events) == 1 and "backfilled 5 runs" in events[0]["detail"]
    stack.close()


def answered_at(stack: Stack, command: PauseCommand) -> tuple[CommandResult, int]:
    """``command``'s result and its record's Kafka timestamp: the worker produces the
    result after persisting (and so after withdrawing from its ticker)."""
    stack.client.send(command)
    stack.client.flush()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for m in stack.results.consumer.consume(100, 0.5):
            value = m.value()
            if m.error() is None and value is not None:
                result = decode_result(value)
                if result.schedule_id == command.schedule_id:
                    return result, m.timestamp()[1]
    raise AssertionError(f"no result for {command}")


def test_a_pause_stops_a_backfills_runs_not_emitted_yet(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("backfill-pause")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"backfill-pause-{uuid.uuid4().hex[:8]}"
    create = CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        payload=b'{"n":1}',
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=60),
    )
    assert stack.send(create).code == "ok"
    # 120 runs fire over 6 s (20 a second): enough left to stop after the first few.
    now = now_ms()
    done = stack.send(
        BackfillCommand(tenant=tenant, schedule_id=sid, from_ms=now - 7_200_000, to_ms=now)
    )
    assert done.code == "ok" and done.message.startswith("backfilled 120 runs"), done.message

    def ours(t: Trigger) -> bool:
        return t.schedule_id.startswith(sid + "@")

    got: list[Trigger] = []
    while len(got) < 3:
        more = stack.first(ours, 30)
        assert more, f"only {len(got)} backfilled runs fired"
        got.extend(more)
    paused, answer_ms = answered_at(stack, PauseCommand(tenant=tenant, schedule_id=sid))
    assert paused.code == "ok", paused.message
    # Whatever was emitted before the answer may still arrive; after it, nothing is emitted.
    got.extend(stack.fired(ours, 5.0))
    late = [t for t in got if t.emitted_ms > answer_ms]
    assert late == [], f"{len(late)} backfilled runs emitted after the pause was answered"
    assert 3 <= len(got) < 120
    # A resume does not bring them back.
    assert stack.send(ResumeCommand(tenant=tenant, schedule_id=sid)).code == "ok"
    assert stack.fired(ours, 3.0) == []
    deadline = time.monotonic() + 10
    skipped: list[dict[str, Any]] = []
    while not skipped and time.monotonic() < deadline:
        skipped = [
            e
            for e in stack.events(tenant, sid)
            if e["event"] == "skipped_paused" and "backfilled runs not fired" in e["detail"]
        ]
        time.sleep(0.2)
    assert skipped, "the stopped runs are not recorded in the history"
    stopped = sum(int(e["detail"].split()[0]) for e in skipped)
    assert stopped == 120 - len(got)
    stack.close()

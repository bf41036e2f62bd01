"""Pause, resume and trigger-now on the real stack with a real worker: a paused schedule
does not fire; a resumed one fires (or is recorded missed, per its misfire tolerance); a
paused recurring schedule skips its runs and records them; trigger-now fires once, under
an id of its own.

No timing assertions: only what fired, with which ids, relative to the moment (``at_ms``
of the result) the worker applied each command.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson

from base.settings import Settings
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.recurring import parse_run_id
from tests.integration.conftest import wait_worker_ready
from topics.ids import trigger_id
from topics.models import (
    CancelCommand,
    Command,
    CommandResult,
    CreateCommand,
    HttpCallback,
    Misfire,
    PauseCommand,
    PayloadType,
    Recurrence,
    ResumeCommand,
    Trigger,
    TriggerCommand,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Stack:
    """A client, a result watcher and a fire watcher on the real stack."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client = CommandClient(settings)
        self.results = ResultWatcher(settings)
        self.fires = FireWatcher(settings)

    def send(self, command: Command) -> CommandResult:
        self.client.send(command)
        self.client.flush()
        result = self.results.wait_for([command.schedule_id], 30).get(command.schedule_id)
        assert result is not None, f"no result for {command}"
        return result

    def fired(self, match: Any, seconds: float) -> list[Trigger]:
        """Every trigger ``match`` accepts that arrives within ``seconds``."""
        out: list[Trigger] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            out.extend(t for t, _ in self.fires.poll(0.5) if match(t))
        return out

    def first(self, match: Any, timeout_s: float) -> list[Trigger]:
        """Triggers ``match`` accepts, as soon as there is one (or the timeout)."""
        out: list[Trigger] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not out:
            out.extend(t for t, _ in self.fires.poll(0.5) if match(t))
        return out

    def events(self, tenant: str, sid: str) -> list[dict[str, Any]]:
        from streams.store import Store

        async def read() -> list[dict[str, Any]]:
            store = Store(self.settings.cassandra)
            await store.connect()
            try:
                return [dict(e) for e in await store.list_events(tenant, sid)]
            finally:
                await store.close()

        return asyncio.run(read())

    def row(self, tenant: str, sid: str) -> dict[str, Any] | None:
        from streams.store import Store

        async def read() -> dict[str, Any] | None:
            store = Store(self.settings.cassandra)
            await store.connect()
            try:
                got = await store.get_schedule(tenant, sid)
                return dict(got) if got is not None else None
            finally:
                await store.close()

        return asyncio.run(read())

    def close(self) -> None:
        self.fires.close()
        self.results.close()


def one_shot(tenant: str, sid: str, due_ms: int, tolerance_s: int = 60) -> CreateCommand:
    return CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        due_ms=due_ms,
        payload=b'{"n":1}',
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=tolerance_s,
    )


def test_a_paused_one_shot_does_not_fire_and_fires_once_resumed(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("pause")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"paused-{uuid.uuid4().hex[:8]}"
    due = now_ms() + 4_000
    assert stack.send(one_shot(tenant, sid, due)).code == "ok"
    paused = stack.send(PauseCommand(tenant=tenant, schedule_id=sid))
    assert paused.code == "ok", paused.message
    assert paused.at_ms < due  # paused before it came due
    # Past its due time and then some: nothing of it fires.
    while now_ms() < due + 3_000:
        assert stack.fired(lambda t: t.schedule_id == sid, 1.0) == []
    row = stack.row(tenant, sid)
    assert row is not None and row["state"] == "paused"
    assert stack.send(PauseCommand(tenant=tenant, schedule_id=sid)).code == "duplicate"

    resumed = stack.send(ResumeCommand(tenant=tenant, schedule_id=sid))
    assert resumed.code == "ok" and "late" in resumed.message, resumed.message
    got = stack.first(lambda t: t.schedule_id == sid, 30)
    assert len(got) == 1, got
    # Its own trigger: the nominal id of its due time, fired late within its tolerance.
    assert got[0].trigger_id == trigger_id(tenant, sid, due) and got[0].due_ms == due
    assert got[0].emitted_ms >= resumed.at_ms
    events = [e["event"] for e in stack.events(tenant, sid)]
    assert events[:3] == ["created", "paused", "resumed"], events
    stack.close()


def test_a_resume_beyond_the_misfire_tolerance_records_it_missed(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("pause-miss")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"paused-miss-{uuid.uuid4().hex[:8]}"
    due = now_ms() + 3_000
    assert stack.send(one_shot(tenant, sid, due, tolerance_s=1)).code == "ok"
    assert stack.send(PauseCommand(tenant=tenant, schedule_id=sid)).code == "ok"
    while now_ms() < due + 2_500:  # more than its 1 s tolerance past its due time
        time.sleep(0.2)
    resumed = stack.send(ResumeCommand(tenant=tenant, schedule_id=sid))
    assert resumed.code == "ok" and "recorded missed" in resumed.message, resumed.message
    assert stack.fired(lambda t: t.schedule_id == sid, 4.0) == []
    row = stack.row(tenant, sid)
    assert row is not None and row["state"] == "missed"
    missed = [e for e in stack.events(tenant, sid) if e["event"] == "missed"]
    assert len(missed) == 1 and "while paused" in missed[0]["detail"]
    stack.close()


def test_a_paused_recurring_schedule_skips_its_runs_and_goes_on_after_the_resume(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("pause-rec")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"every2-paused-{uuid.uuid4().hex[:8]}"
    start = (now_ms() // 1000 + 3) * 1000

    def run_of(t: Trigger) -> bool:
        parsed = parse_run_id(t.schedule_id)
        return parsed is not None and parsed[0] == sid

    create = CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        payload=orjson.dumps({"r": 1}),
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://receiver.example/cb"),
        misfire_tolerance_s=60,
        recurrence=Recurrence(every_s=2, start_ms=start, misfire=Misfire.FIRE_ALL),
    )
    assert stack.send(create).code == "ok"
    assert stack.first(run_of, 40), "no run fired before the pause"
    paused = stack.send(PauseCommand(tenant=tenant, schedule_id=sid))
    assert paused.code == "ok", paused.message
    # Runs emitted before the pause was applied may still arrive; none due after it.
    during = stack.fired(run_of, 8.0)
    assert all(t.due_ms <= paused.at_ms for t in during), (
        [t.due_ms for t in during],
        paused.at_ms,
    )

    # Triggered now while paused: one extra run with its own id; it stays paused.
    triggered = stack.send(TriggerCommand(tenant=tenant, schedule_id=sid))
    assert triggered.code == "ok", triggered.message
    manual = stack.first(lambda t: t.schedule_id.startswith(f"{sid}@now-"), 30)
    assert len(manual) == 1 and parse_run_id(manual[0].schedule_id) is None
    row = stack.row(tenant, sid)
    assert row is not None and row["state"] == "paused"

    resumed = stack.send(ResumeCommand(tenant=tenant, schedule_id=sid))
    assert resumed.code == "ok" and "skipped while paused" in resumed.message, resumed.message
    after = stack.fired(run_of, 8.0)
    assert after, "no run after the resume"
    # The runs that fell in the pause never fire, whatever the misfire policy (fire_all).
    assert all(t.due_ms > resumed.at_ms for t in after), (
        [t.due_ms for t in after],
        resumed.at_ms,
    )
    events = stack.events(tenant, sid)
    kinds = [e["event"] for e in events]
    assert {"paused", "triggered", "resumed", "skipped_paused"} <= set(kinds), kinds
    skipped = next(e for e in events if e["event"] == "skipped_paused")
    assert "skipped while paused" in skipped["detail"]
    assert stack.send(CancelCommand(tenant=tenant, schedule_id=sid)).code == "ok"
    stack.close()


def test_trigger_now_fires_a_one_shot_once_with_an_id_of_its_own(
    worker_factory: Any, real_stack: Settings, tenant: str
) -> None:
    worker_factory.make("trigger")
    wait_worker_ready(real_stack, tenant)
    stack = Stack(real_stack)
    sid = f"manual-{uuid.uuid4().hex[:8]}"
    due = now_ms() + 3_600_000
    assert stack.send(one_shot(tenant, sid, due)).code == "ok"
    triggered = stack.send(TriggerCommand(tenant=tenant, schedule_id=sid))
    assert triggered.code == "ok" and triggered.message.startswith("triggered"), triggered
    got = stack.fired(lambda t: t.schedule_id.startswith(f"{sid}@"), 6.0)
    assert len({t.trigger_id for t in got}) == 1, got  # once (re-emissions share the id)
    trig = got[0]
    assert trig.schedule_id.startswith(f"{sid}@now-") and trig.order_key == sid
    assert trig.trigger_id != trigger_id(tenant, sid, due)
    assert trig.trigger_id != trigger_id(tenant, trig.schedule_id, trig.due_ms)
    assert orjson.loads(trig.payload) == {"n": 1}
    assert trig.trigger_id in triggered.message
    row = stack.row(tenant, sid)
    assert row is not None and row["state"] == "scheduled"  # its own fire is still ahead
    [event] = [e for e in stack.events(tenant, sid) if e["event"] == "triggered"]
    assert event["trigger_id"] == trig.trigger_id
    assert stack.send(CancelCommand(tenant=tenant, schedule_id=sid)).code == "ok"
    assert stack.send(TriggerCommand(tenant=tenant, schedule_id=sid)).code == "already_cancelled"
    stack.close()

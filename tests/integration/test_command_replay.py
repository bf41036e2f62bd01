"""Replayed signed commands on the real stack: a tenant's signed resume, update and
trigger copied off the commands topic and produced again within the signature window,
after the worker that read the originals was restarted, are refused ``replayed_command``
and change nothing (the schedule stays paused, its payload the later one).

The restarted worker starts past the originals' committed offsets, so its in-memory
record of signatures has never seen them: only the schedule row's signed time refuses the
copies (streams.decisions.check_signed_order)."""

from __future__ import annotations

import os
import time
from typing import Any

import orjson
import pytest

from base.settings import Settings
from streams.client import CommandClient, ResultWatcher
from tests.integration.commands_topic import commands_of, result_of, stored_row
from tests.integration.conftest import wait_worker_ready
from topics.models import (
    CreateCommand,
    HttpCallback,
    PauseCommand,
    PayloadType,
    ResumeCommand,
    TriggerCommand,
    UpdateCommand,
)

pytestmark = pytest.mark.integration


def test_signed_commands_copied_after_a_worker_restart_are_refused(
    own_stack: Settings, worker_factory: Any
) -> None:
    settings = own_stack
    first = worker_factory.make("first", settings)
    wait_worker_ready(settings, "acme", worker=first)
    sid = f"replay-{os.urandom(4).hex()}"
    client, results = CommandClient(settings), ResultWatcher(settings)
    try:
        on_schedule = {"tenant": "acme", "schedule_id": sid}
        commands = [
            CreateCommand(
                **on_schedule,
                due_ms=time.time_ns() // 10**6 + 3_600_000,
                payload=b'{"v":0}',
                payload_type=PayloadType.JSON,
                callback=HttpCallback(url="https://h.example/cb"),
                misfire_tolerance_s=60,
            ),
            UpdateCommand(**on_schedule, payload=b'{"v":1}', payload_type=PayloadType.JSON),
            UpdateCommand(**on_schedule, payload=b'{"v":2}', payload_type=PayloadType.JSON),
            PauseCommand(**on_schedule),
            ResumeCommand(**on_schedule),
            PauseCommand(**on_schedule),
            # Writes no row: its signature goes to signed_without_row (migration 014).
            TriggerCommand(**on_schedule),
        ]
        for command in commands:
            client.send(command)
            client.flush()
            offset = commands_of(settings, sid)[-1].offset()
            assert str(result_of(results, sid, offset).code) == "ok"
        before = stored_row(settings, "acme", sid)
        assert (before["state"], before["payload"]) == ("paused", b'{"v":2}')
        originals = commands_of(settings, sid)
        old_update, resume, trigger = originals[1], originals[4], originals[6]
        assert orjson.loads(resume.value())["type"] == "resume"
        assert orjson.loads(trigger.value())["type"] == "trigger"

        first.stop()  # its offsets committed: the restarted worker starts past the originals
        second = worker_factory.make("second", settings)
        wait_worker_ready(settings, "acme", worker=second)

        # Refused by its kept signature when signed within TOCSIN_SIGNED_ORDER_SKEW_MS of
        # the newest applied, by time otherwise (a slow run).
        either = ("a command already applied", "before the last command applied")
        for original, whys in (
            (resume, either),
            (old_update, either),
            (trigger, ("a command already applied",)),
        ):
            client.send_raw(original.key(), original.value(), headers=original.headers())
            client.flush()
            copy = commands_of(settings, sid)[-1]
            assert copy.value() == original.value() and copy.offset() > original.offset()
            answer = result_of(results, sid, copy.offset())
            assert (str(answer.code), str(answer.status)) == ("replayed_command", "rejected")
            assert any(why in answer.message for why in whys), answer
    finally:
        results.close()
    after = stored_row(settings, "acme", sid)
    assert (after["state"], after["payload"], after["version"]) == (
        "paused",
        b'{"v":2}',
        before["version"],
    )

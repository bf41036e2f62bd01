"""Signers with different clocks on the real stack (H8): an update and then a pause of one
schedule, the pause signed 1 ms before the update (two API replicas whose clocks differ),
both apply in the commands topic's order; after a worker restart (no in-memory record of
their signatures) a copy of either is refused ``replayed_command`` by the signatures the
schedule row keeps in Cassandra (streams.decisions.check_signed_order)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from base.settings import Settings
from streams.client import CommandClient, ResultWatcher
from tests.integration.commands_topic import commands_of, result_of, stored_row
from tests.integration.conftest import wait_worker_ready
from topics.codec import encode_command
from topics.models import (
    Command,
    CreateCommand,
    HttpCallback,
    PauseCommand,
    PayloadType,
    UpdateCommand,
)
from topics.signing import sign_headers

pytestmark = pytest.mark.integration


def test_a_pause_signed_by_a_skewed_signer_applies_and_copies_are_refused(
    own_stack: Settings, worker_factory: Any
) -> None:
    settings = own_stack
    first = worker_factory.make("first", settings)
    wait_worker_ready(settings, "acme", worker=first)
    sid = f"skew-{os.urandom(4).hex()}"
    client, results = CommandClient(settings), ResultWatcher(settings)
    secret = client.signing_key_of("acme")
    assert secret

    def send(command: Command, signed_at_ms: int) -> int:
        key, value = sid.encode(), encode_command(command)
        headers = sign_headers(secret, signed_at_ms=signed_at_ms, key=key, value=value)
        client.send_raw(key, value, headers=headers)
        client.flush()
        return int(commands_of(settings, sid)[-1].offset())

    try:
        on_schedule = {"tenant": "acme", "schedule_id": sid}
        now = time.time_ns() // 10**6
        create = CreateCommand(
            **on_schedule,
            due_ms=now + 3_600_000,
            payload=b'{"v":0}',
            payload_type=PayloadType.JSON,
            callback=HttpCallback(url="https://h.example/cb"),
            misfire_tolerance_s=60,
        )
        assert str(result_of(results, sid, send(create, now)).code) == "ok"
        update = UpdateCommand(**on_schedule, payload=b'{"v":1}', payload_type=PayloadType.JSON)
        assert str(result_of(results, sid, send(update, now + 101)).code) == "ok"
        pause = PauseCommand(**on_schedule)
        skewed = send(pause, now + 100)  # its signer's clock 1 ms behind the update's
        assert str(result_of(results, sid, skewed).code) == "ok"
        before = stored_row(settings, "acme", sid)
        assert (before["state"], before["payload"]) == ("paused", b'{"v":1}')
        originals = commands_of(settings, sid)

        first.stop()  # its offsets committed: the restarted worker starts past the originals
        second = worker_factory.make("second", settings)
        wait_worker_ready(settings, "acme", worker=second)

        for original in (originals[1], originals[2]):
            client.send_raw(original.key(), original.value(), headers=original.headers())
            client.flush()
            copy = commands_of(settings, sid)[-1]
            assert copy.value() == original.value() and copy.offset() > original.offset()
            answer = result_of(results, sid, copy.offset())
            assert str(answer.code) == "replayed_command", answer
            assert "a command already applied" in answer.message, answer
    finally:
        results.close()
    after = stored_row(settings, "acme", sid)
    assert (after["state"], after["payload"], after["version"]) == (
        "paused",
        b'{"v":1}',
        before["version"],
    )

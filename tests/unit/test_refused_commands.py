"""Refused commands of an existing schedule reach its history (bounded); nothing is written
for an unknown schedule, an unproven sender or another tenant's schedule of the same id."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from streams.commands import RawCommand
from streams.partitioner import partition_for
from streams.refusals import Refusal, RefusalBook, record_refusals
from tests.unit.test_fault_properties import (
    NOW,
    PARTITIONS,
    SECRET,
    FakeStore,
    good_record,
)
from tests.unit.test_fault_properties import command_processor as processor
from topics.codec import encode_command
from topics.models import (
    CancelCommand,
    Command,
    CreateCommand,
    HttpCallback,
    PayloadType,
    UpdateCommand,
)
from topics.signing import new_signing_key, sign_headers

OTHER_SECRET = new_signing_key()


def raw(command: Command, offset: int, secret: bytes = SECRET) -> RawCommand:
    value = encode_command(command)
    key = command.schedule_id.encode()
    return replace(
        good_record(offset),
        key=key,
        value=value,
        offset=offset,
        partition=partition_for(key, PARTITIONS),
        headers=sign_headers(secret, signed_at_ms=NOW, key=key, value=value),
    )


def store_with_globex() -> FakeStore:
    store = FakeStore()
    store.tenants["globex"] = {
        "tenant": "globex",
        "active": True,
        "config": "{}",
        "signing_secret": OTHER_SECRET,
    }
    return store


def create(tenant: str, sid: str) -> CreateCommand:
    return CreateCommand(
        tenant=tenant,
        schedule_id=sid,
        due_ms=NOW + 3_600_000,
        payload=b"{}",
        payload_type=PayloadType.JSON,
        callback=HttpCallback(url="https://h.example/cb"),
        misfire_tolerance_s=60,
    )


def refusals(store: FakeStore) -> list[tuple[str, str, str]]:
    return [
        (e["tenant"], e["schedule_id"], str(e["detail"]))
        for e in store.events
        if e["event"] == "command_refused"
    ]


def test_an_update_refused_for_an_existing_schedule_is_in_its_history_only() -> None:
    store = store_with_globex()
    proc = processor(store)

    async def scenario() -> None:
        await proc.process_batch([raw(create("acme", "s1"), 1)])
        await proc.process_batch([raw(CancelCommand(tenant="acme", schedule_id="s1"), 2)])
        later = UpdateCommand(tenant="acme", schedule_id="s1", due_ms=NOW + 7_200_000)
        results = await proc.process_batch(
            [
                raw(later, 3),
                # Unknown to acme: refused, nothing written.
                raw(UpdateCommand(tenant="acme", schedule_id="nope", due_ms=NOW + 1), 4),
                # globex has no s1 (acme's is not globex's): refused, nothing written.
                raw(
                    UpdateCommand(tenant="globex", schedule_id="s1", due_ms=NOW + 1),
                    5,
                    OTHER_SECRET,
                ),
                # Claims acme but signed with globex's key: unproven, nothing written.
                raw(later, 6, OTHER_SECRET),
            ]
        )
        assert all(r.status == "rejected" for r in results)

    asyncio.run(scenario())
    (found,) = refusals(store)
    assert found[:2] == ("acme", "s1")
    assert found[2].startswith("update refused (")
    assert ("globex", "s1") not in store.schedules
    assert not [e for e in store.events if e["schedule_id"] == "nope" or e["tenant"] == "globex"]


def test_refusals_are_bounded_per_schedule_and_count_the_rest() -> None:
    store = FakeStore()
    book = RefusalBook(per_window=2, window_ms=60_000)
    one = Refusal(tenant="acme", schedule_id="s1", command="pause", code="c", message="m")

    async def burst(at_ms: int, n: int) -> int:
        return await record_refusals(store, book, [one] * n, {}, at_ms)

    assert asyncio.run(burst(NOW, 5)) == 2
    # Two in one batch keep a row each (written a millisecond apart).
    assert [e["at_ms"] for e in store.events] == [NOW, NOW + 1]
    assert book.unrecorded == 3
    assert asyncio.run(burst(NOW + 60_000, 1)) == 1
    assert store.events[-1]["detail"] == (
        "pause refused (c): m (3 earlier refusal(s) not recorded one by one)"
    )

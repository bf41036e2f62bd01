"""The worker honours an API's admission (topics.admission): a one-shot create the API
stamped is stored without deciding again what the API decided (the tenant active, its
limits, its quota, its signing key on the worker's clock), while what only the worker can
know (the partition, a copy of a record, a replay) is still decided, and a stamp that does
not verify is decided in full."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import orjson

from base.errors import StoreError
from streams.commands import CommandProcessor, RawCommand
from streams.partitioner import partition_for
from tests.unit.test_fault_properties import (
    NOW,
    PARTITIONS,
    SECRET,
    FakeStore,
    command_processor,
)
from topics.admission import AdmissionKey, AdmissionKeys, stamp
from topics.codec import encode_command
from topics.models import (
    CommandResult,
    CreateCommand,
    HttpCallback,
    PayloadType,
    Recurrence,
)
from topics.signing import TimestampType, new_signing_key, sign_headers

ADMISSION = AdmissionKey("api-1", "a" * 40)
FORGED = AdmissionKey("api-1", "f" * 40)


def create(sid: str, **kw: object) -> CreateCommand:
    fields: dict[str, object] = {
        "tenant": "acme",
        "schedule_id": sid,
        "due_ms": NOW + 3_600_000,
        "payload": b"{}",
        "payload_type": PayloadType.JSON,
        "callback": HttpCallback(url="https://h.example/cb"),
        "misfire_tolerance_s": 60,
    }
    fields.update(kw)
    return CreateCommand(**fields)  # type: ignore[arg-type]


def record(
    command: CreateCommand,
    offset: int,
    *,
    admission: AdmissionKey | None = ADMISSION,
    admitted_at_ms: int = NOW,
    secret: str = SECRET,
    partition: int | None = None,
) -> RawCommand:
    value = encode_command(command)
    key = command.schedule_id.encode()
    headers = sign_headers(secret, signed_at_ms=admitted_at_ms, key=key, value=value)
    if admission is not None:
        headers.append(stamp(admission, admitted_at_ms=admitted_at_ms, record_key=key, value=value))
    return RawCommand(
        partition=partition_for(key, PARTITIONS) if partition is None else partition,
        offset=offset,
        key=key,
        value=value,
        timestamp_ms=admitted_at_ms + 2,
        headers=headers,
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )


def processor(store: FakeStore, keys: AdmissionKeys | None = None) -> CommandProcessor:
    return command_processor(store, AdmissionKeys(current=ADMISSION) if keys is None else keys)


def run(proc: CommandProcessor, *raws: RawCommand) -> list[CommandResult]:
    return asyncio.run(proc.process_batch(list(raws)))


def acme(store: FakeStore, **changes: object) -> None:
    store.tenants["acme"] = {**store.tenants["acme"], **changes}


def codes(results: list[CommandResult]) -> list[str]:
    return [str(r.code) for r in results]


def test_an_admitted_create_of_a_tenant_deactivated_since_is_stored() -> None:
    store = FakeStore()
    acme(store, active=False)
    proc = processor(store)
    results = run(proc, record(create("s1"), 1), record(create("s2"), 2, admission=None))
    assert codes(results) == ["ok", "inactive_tenant"]
    assert ("acme", "s1") in store.schedules and ("acme", "s2") not in store.schedules


def test_an_admitted_create_is_not_judged_again_on_limits_tightened_since() -> None:
    store = FakeStore()
    config = {"allowed_callback_hosts": ["other.example"], "max_payload_bytes": 1}
    acme(store, config=orjson.dumps(config).decode())
    proc = processor(store)
    results = run(proc, record(create("s1"), 1), record(create("s2"), 2, admission=None))
    assert codes(results) == ["ok", "payload_too_large"]


def test_an_admitted_create_signed_with_a_key_retired_since_is_stored() -> None:
    store = FakeStore()
    # The API signed with SECRET; the tenant rotated and retired it before the worker read.
    acme(
        store,
        signing_secret=new_signing_key(),
        previous_signing_secret=SECRET,
        previous_signing_expires_ms=NOW - 1,
    )
    proc = processor(store)
    results = run(proc, record(create("s1"), 1), record(create("s2"), 2, admission=None))
    assert codes(results) == ["ok", "signing_key_retired"]


def test_admitted_creates_debit_the_quota_and_direct_ones_then_wait() -> None:
    store = FakeStore()
    # 8/s over 8 partitions: a bucket of one token per partition.
    acme(store, config=orjson.dumps({"create_quota_per_s": PARTITIONS}).decode())
    proc = processor(store)
    # Three ids on one partition.
    sids = [s for s in (f"q{i}" for i in range(200)) if partition_for(s.encode(), 8) == 0][:3]
    results = run(
        proc,
        record(create(sids[0]), 1),
        record(create(sids[1]), 2),
        record(create(sids[2]), 3, admission=None),
    )
    assert codes(results) == ["ok", "ok", "quota_exceeded"]


def test_a_forged_stamp_is_decided_in_full() -> None:
    store = FakeStore()
    acme(store, config=orjson.dumps({"allowed_callback_hosts": ["other.example"]}).decode())
    proc = processor(store)
    results = run(proc, record(create("s1"), 1, admission=FORGED))
    assert codes(results) == ["callback_not_allowed"]
    acme(store, active=False)
    proc = processor(store)
    assert codes(run(proc, record(create("s2"), 2, admission=FORGED))) == ["inactive_tenant"]


def test_without_admission_keys_a_stamp_is_not_honoured() -> None:
    store = FakeStore()
    acme(store, active=False)
    proc = processor(store, AdmissionKeys())
    assert codes(run(proc, record(create("s1"), 1))) == ["inactive_tenant"]


def test_a_previous_admission_key_is_honoured_during_a_rotation() -> None:
    store = FakeStore()
    acme(store, active=False)
    rotated = AdmissionKeys(current=AdmissionKey("api-2", "b" * 40), previous=ADMISSION)
    assert codes(run(processor(store, rotated), record(create("s1"), 1))) == ["ok"]


def test_a_copy_of_an_admitted_record_is_refused_and_a_redelivery_is_not() -> None:
    store = FakeStore()
    proc = processor(store)
    first = record(create("s1"), 1)
    assert codes(run(proc, first)) == ["ok"]
    # The same record read again (a retried batch, a crash replay): answered again.
    assert codes(run(proc, first)) == ["ok"]
    copy = replace(first, offset=7)
    assert codes(run(proc, copy)) == ["replayed_command"]


def test_an_admitted_create_on_the_wrong_partition_is_refused() -> None:
    store = FakeStore()
    right = partition_for(b"s1", PARTITIONS)
    wrong = record(create("s1"), 1, partition=(right + 1) % PARTITIONS)
    assert codes(run(processor(store), wrong)) == ["wrong_partition"]


def test_a_stamped_recurring_create_is_decided_in_full() -> None:
    store = FakeStore()
    acme(store, active=False)
    recurring = create("r1", due_ms=None, recurrence=Recurrence(cron="* * * * *"))
    assert codes(run(processor(store), record(recurring, 1))) == ["inactive_tenant"]


def test_an_admitted_create_is_judged_at_its_admission_time() -> None:
    store = FakeStore()
    # Due 30 s after its admission, read by a worker 10 min later (an outage): not
    # due_in_past (tolerance 60 s), stored for the ticker to fire or record as missed.
    at = NOW - 600_000
    command = create("late", due_ms=at + 30_000)
    assert codes(run(processor(store), record(command, 1, admitted_at_ms=at))) == ["ok"]
    unadmitted = record(command, 2, admitted_at_ms=at, admission=None)
    assert codes(run(processor(FakeStore()), unadmitted)) == ["due_in_past"]


def test_an_admitted_create_the_store_refuses_is_in_its_history() -> None:
    store = FakeStore()
    store.inject("apply_schedule_changes", StoreError("refused for good", retriable=False))
    proc = processor(store)
    asyncio.run(proc.process_until_answered([record(create("s1"), 1)]))
    (event,) = [e for e in store.events if e["event"] == "command_refused"]
    assert (event["tenant"], event["schedule_id"]) == ("acme", "s1")
    assert "admitted" in str(event["detail"]) and "store_rejected" in str(event["detail"])


def test_a_stamped_command_that_is_not_admitted_gets_no_admission_refusal() -> None:
    store = FakeStore()
    store.inject("apply_schedule_changes", StoreError("refused for good", retriable=False))
    recurring = create("r1", due_ms=None, recurrence=Recurrence(cron="* * * * *"))
    asyncio.run(processor(store).process_until_answered([record(recurring, 1)]))
    assert not [e for e in store.events if e["event"] == "command_refused"]

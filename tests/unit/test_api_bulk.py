"""Bulk cancel and bulk re-fire (api.service): each row's outcome is its own, so one failing
row is reported in the answer and the other rows proceed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from api.service import Service
from base.errors import KafkaError, StoreError
from base.settings import Settings
from streams.commands import TenantCache
from streams.model import ScheduleRow, ScheduleState
from tests.fakes import Call, FakeStore
from topics.catalog import catalog
from topics.codec import callback_to_json
from topics.codes import Code
from topics.models import HttpCallback
from topics.validation import Limits

TENANT = "acme"
DUE_MS = 1_900_000_000_000
IDS = ("a", "b", "c")


@dataclass
class FakeBridge:
    """Answers every command OK and acknowledges every record, except for the schedule ids
    in ``refuse``, whose send raises that error."""

    refuse: dict[str, BaseException] = field(default_factory=dict)
    catalog: Any = field(default_factory=lambda: catalog(Settings().topics))
    commands: list[str] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)

    def new_request_id(self) -> str:
        return f"r{len(self.commands)}"

    async def send_command(
        self,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        *,
        request_id: str,
        expected: Any,
        timeout_s: float,
    ) -> dict[str, object]:
        await asyncio.sleep(0)
        sid = key.decode()
        if sid in self.refuse:
            raise self.refuse[sid]
        self.commands.append(sid)
        doc = orjson.loads(value)
        return {"code": Code.OK, "schedule_id": sid, "request_id": doc["request_id"]}

    async def send_record(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]
    ) -> None:
        await asyncio.sleep(0)
        self.records.append(value)


def service(store: FakeStore, bridge: FakeBridge) -> Service:
    svc = Service.__new__(Service)
    svc.limits = Limits.from_settings(Settings().scheduler)
    svc.store = store  # type: ignore[assignment]
    svc.bridge = bridge  # type: ignore[assignment]
    svc.tenants = TenantCache(store)
    svc.timeout_s = 1.0
    return svc


def store_with(state: ScheduleState) -> FakeStore:
    store = FakeStore()
    store.tenants[TENANT] = {"tenant": TENANT, "active": True}
    for n, sid in enumerate(IDS):
        due = DUE_MS + n
        store.schedules[(TENANT, sid)] = ScheduleRow(
            tenant=TENANT,
            schedule_id=sid,
            partition=0,
            state=state,
            due_ms=due,
            version=1,
            created_ms=DUE_MS - 60_000,
            updated_ms=DUE_MS - 60_000,
            trigger_id=f"t-{sid}" if state != ScheduleState.SCHEDULED else None,
            fired_ms=None,
            payload=b"{}",
            payload_type="json",
            callback=callback_to_json(HttpCallback(url="https://h.example/cb")),
        )
        store.index.setdefault(TENANT, set()).add((due, sid))
    return store


def of(sid: str) -> Callable[[Call], bool]:
    return lambda call: call.args[1] == sid


def test_bulk_cancel_reports_the_row_kafka_refused_and_cancels_the_others() -> None:
    store = store_with(ScheduleState.SCHEDULED)
    bridge = FakeBridge(refuse={"b": KafkaError("message too large", retriable=False)})
    answer = asyncio.run(service(store, bridge).bulk_cancel(TENANT, DUE_MS, DUE_MS + 10))
    assert sorted(bridge.commands) == ["a", "c"]
    assert answer["matched"] == 3
    assert answer["cancelled"] == 2
    assert answer["codes"] == {Code.OK: 2}
    assert answer["failed"] == [
        {"schedule_id": "b", "code": "failed", "message": "message too large", "retriable": False}
    ]


def test_bulk_refire_reports_the_row_the_store_failed_and_refires_the_others() -> None:
    store = store_with(ScheduleState.MISSED)
    store.inject("list_events", StoreError("read timed out"), when=of("b"))
    bridge = FakeBridge()
    answer = asyncio.run(
        service(store, bridge).bulk_refire(
            TENANT, DUE_MS, DUE_MS + 10, frozenset({ScheduleState.MISSED})
        )
    )
    refired = sorted(call.args[1] for call in store.calls_of("record_event"))
    assert refired == ["a", "c"]
    assert len(bridge.records) == 2
    assert answer["matched"] == 3
    assert answer["refired"] == 2
    assert answer["failed"] == [
        {"schedule_id": "b", "code": "unavailable", "message": "read timed out", "retriable": True}
    ]


def test_a_row_failing_with_an_unexpected_error_is_reported_as_internal() -> None:
    store = store_with(ScheduleState.MISSED)
    store.inject("record_event", RuntimeError("bug"), when=of("a"))
    answer = asyncio.run(
        service(store, FakeBridge()).bulk_refire(
            TENANT, DUE_MS, DUE_MS + 10, frozenset({ScheduleState.MISSED})
        )
    )
    assert answer["refired"] == 2
    assert answer["failed"] == [
        {"schedule_id": "a", "code": "internal", "message": "internal error", "retriable": False}
    ]


def test_a_cancel_without_an_answer_in_time_counts_as_no_result() -> None:
    store = store_with(ScheduleState.SCHEDULED)
    bridge = FakeBridge()

    async def silent(key: bytes, *args: Any, **kwargs: Any) -> None:
        return None

    bridge.send_command = silent  # type: ignore[method-assign,assignment]
    answer = asyncio.run(service(store, bridge).bulk_cancel(TENANT, DUE_MS, DUE_MS + 10))
    assert answer["no_result"] == 3
    assert answer["cancelled"] == 0
    assert answer["failed"] == []

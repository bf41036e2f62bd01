"""Second review of the admission change (issue 21): a stamp that exists but cannot be
checked, copy detection that a restart forgets, and a quota debt with no floor.

Each test here failed on the code it was written against (see the commits that fixed it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from api.service import Service
from base.settings import CassandraSettings
from streams import metrics
from streams.model import ScheduleRow, ScheduleState
from streams.store import Store
from streams.tenants import QuotaBook
from tests.unit.test_admission_worker import create, processor, record, run
from tests.unit.test_api_admission import create as api_create
from tests.unit.test_api_admission import service, store
from tests.unit.test_fault_properties import NOW, FakeStore
from topics.admission import AdmissionKey, AdmissionKeys
from topics.signing import MAX_SKEW_MS

# -- 1. a stamp that exists but cannot be checked -------------------------------------------


@dataclass
class AppendBridge:
    """Acknowledges an admitted create with the broker's append time ``append_ms`` (None: a
    topic whose timestamps are the producer's); its worker, deciding it in full, refuses it
    (what a 201 must then not have promised)."""

    append_ms: int | None
    answer_code: str = "callback_not_allowed"
    admitted: list[bytes] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)

    async def send_admitted(
        self, key: bytes, value: bytes, headers: list[tuple[str, bytes]], **kw: Any
    ) -> tuple[int, int, int | None]:
        await asyncio.sleep(0)
        self.admitted.append(value)
        return 3, len(self.admitted), self.append_ms

    async def answer(self, request_id: str, timeout_s: float) -> dict[str, object]:
        self.answered.append(request_id)
        return {"code": self.answer_code, "status": "rejected", "schedule_id": "gen-1"}

    def forget(self, request_id: str) -> None:
        pass


def admit(svc: Service, command: dict[str, object]) -> Any:
    return asyncio.run(svc.send(command, wait=True, admit=True))


@pytest.mark.parametrize("off_ms", [MAX_SKEW_MS + 1_000, -(MAX_SKEW_MS + 1_000), None])
def test_a_stamp_its_workers_will_not_verify_is_answered_by_the_worker(off_ms: int | None) -> None:
    # The API's clock is more than the workers' window off the broker's (or the topic's
    # timestamps are the producer's): every worker decides the create in full, and a 201
    # then would promise what the worker may refuse. The command is produced already: the
    # API waits for its worker's answer, as the synchronous path does.
    now = int(time.time() * 1000)
    bridge = AppendBridge(None if off_ms is None else now + off_ms)
    result = admit(service(store(), bridge), api_create())  # type: ignore[arg-type]
    assert len(bridge.admitted) == 1  # produced once, not again
    assert result["code"] == "callback_not_allowed" and bridge.answered


@pytest.mark.parametrize(
    ("worker_key", "append_after_ms", "outcome"),
    [
        (AdmissionKey("api-2", "b" * 40), 2, "unknown_key"),
        (None, MAX_SKEW_MS + 1_000, "stale"),
    ],
)
def test_a_stamp_the_worker_cannot_check_is_an_alert_by_its_cause(
    caplog: pytest.LogCaptureFixture,
    worker_key: AdmissionKey | None,
    append_after_ms: int,
    outcome: str,
) -> None:
    # A worker without the APIs' key (rollout or rotation out of order) or an API whose
    # clock is off: each 201'd create is decided in full. Counted apart from forgeries and
    # logged at error, so the alert (docs/operations.md) can say which.
    keys = None if worker_key is None else AdmissionKeys(current=worker_key)
    raw = replace(record(create("s1"), 1), timestamp_ms=NOW + append_after_ms)
    counter = metrics.ADMISSIONS.labels(outcome)
    before = counter._value.get()
    with caplog.at_level(logging.WARNING, logger="tocsin"):
        run(processor(FakeStore(), keys), raw)
    assert counter._value.get() == before + 1
    assert any(r.levelno >= logging.ERROR for r in caplog.records)


# -- 2. copy detection that a restart forgets ------------------------------------------------


@pytest.mark.parametrize("state", [ScheduleState.CANCELLED, ScheduleState.FIRED])
def test_a_finished_row_outlives_every_copy_of_its_create(state: str) -> None:
    # A copy of a stamped (or signed) create verifies while its broker time is within the
    # window of the stamp: up to 2 x MAX_SKEW_MS after the original's. The seen-stamp set
    # is in memory, so after a restart or rebalance only the row can make the copy a
    # duplicate; with a retention of 1 s it was gone, and the copy brought the cancelled
    # schedule back.
    st = Store(CassandraSettings(), retention_s=7 * 86_400)
    row = ScheduleRow(
        tenant="acme",
        schedule_id="s1",
        partition=0,
        state=state,
        due_ms=NOW + 3_600_000,
        version=2,
        created_ms=NOW,
        updated_ms=NOW,
    )
    span_s = 2 * MAX_SKEW_MS // 1000
    assert st.schedule_ttl_s(row, NOW, retention_s=1) > span_s  # cancel writes the row
    assert st.keep_s(1) > span_s  # a fire marks it done with this TTL


# -- 3. the quota debt of admitted creates ---------------------------------------------------


def test_the_debt_of_admitted_creates_is_at_most_one_burst() -> None:
    # TOCSIN_API_INSTANCES=1 with 10 APIs admits 10x the quota: the workers' debit of it
    # must not lock the tenant's own-id creates out for minutes (100 over a 10/s quota: 9 s).
    book = QuotaBook(1)
    for _ in range(100):
        book.debit("acme", 0, 10.0, 0.0)
    assert not book.allow("acme", 0, 10.0, 0.0)  # the debt still counts
    assert book.allow("acme", 0, 10.0, 2.5)  # one burst (10) below zero, refilled by 2.5 s

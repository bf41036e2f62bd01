"""Review of the admission change (issue 21, the create half): holes in "every 201 fires or
its refusal is where the tenant sees it" and in keeping the admission secret a secret.

Each test here failed on the code it was written against (see the commits that fixed it).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from api.views import ApiError
from base.errors import ConfigError, StoreError
from base.settings import Settings
from streams import metrics
from streams.commands import ADMITTED_REFUSED
from streams.partitioner import partition_for
from tests.unit.test_admission_worker import ADMISSION, create, processor, record, run
from tests.unit.test_api_admission import FakeBridge, send, service, store
from tests.unit.test_api_admission import create as api_create
from tests.unit.test_fault_properties import PARTITIONS, FakeStore
from topics.admission import Admission, AdmissionKey, AdmissionKeys, keys_of, stamp
from topics.ids import format_iso_ms
from topics.signing import TimestampType
from topics.validation import Limits


def admitted_refusals(store: FakeStore) -> list[str]:
    return [
        str(e["detail"])
        for e in store.events
        if e["event"] == "command_refused" and str(e["detail"]).startswith(ADMITTED_REFUSED)
    ]


def test_the_admission_secret_is_not_in_any_repr() -> None:
    secret = "z" * 40
    key = AdmissionKey("api-1", secret)
    keys = AdmissionKeys(current=key, previous=key)
    for shown in (repr(key), str(key), repr(keys), str(keys), f"{keys!r}"):
        assert secret not in shown and "api-1" in shown


def test_an_admitted_create_its_worker_cannot_decode_is_refused_visibly() -> None:
    # The API admitted it under its limits; this worker's are tighter (a configuration
    # rolled out to the workers first): the 201'd create cannot be stored, so its refusal
    # must be in the schedule's history (GET answers 410), not only on command-results,
    # which nobody reads for an admitted create.
    store = FakeStore()
    proc = processor(store)
    proc.limits = Limits(max_payload_bytes=4)
    results = run(proc, record(create("s1", payload=b'{"n": 123456}'), 1))
    assert [str(r.code) for r in results] == ["payload_too_large"]
    (detail,) = admitted_refusals(store)
    assert "payload_too_large" in detail


def test_an_admitted_record_on_another_partition_is_an_alert_not_a_refusal_in_history() -> None:
    # Either every command of the deployment goes astray (an API with another partition
    # count: the alert) or someone who reads the commands topic copied the record onto
    # another partition. The original is stored on its own: a refusal in its history would
    # make GET answer 410 refused, and its client create it again (a second schedule).
    store = FakeStore()
    right = partition_for(b"s1", PARTITIONS)
    refused = metrics.ADMISSIONS.labels("refused")
    before = refused._value.get()
    results = run(processor(store), record(create("s1"), 1, partition=(right + 1) % PARTITIONS))
    assert [str(r.code) for r in results] == ["wrong_partition"]
    assert refused._value.get() == before + 1
    assert admitted_refusals(store) == []


def test_a_store_outage_while_recording_an_admitted_refusal_retries_the_batch() -> None:
    # Best effort would lose the only trace the tenant gets: a retriable error is raised
    # (process_until_answered waits it out and applies the batch again).
    store = FakeStore()
    store.inject("record_event", StoreError("timeout", retriable=True))
    proc = processor(store)
    proc.limits = Limits(max_payload_bytes=4)
    with pytest.raises(StoreError):
        run(proc, record(create("s1", payload=b'{"n": 123456}'), 1))


def test_a_copy_of_an_admitted_record_leaves_no_refusal_in_its_history() -> None:
    # The original was stored: a copy's refusal is no news for the tenant.
    store = FakeStore()
    proc = processor(store)
    first = record(create("s1"), 1)
    assert [str(r.code) for r in run(proc, first, replace(first, offset=2))] == [
        "ok",
        "replayed_command",
    ]
    assert admitted_refusals(store) == []


def test_a_forged_stamp_leaves_no_refusal_in_the_history() -> None:
    # Only a stamp that verifies proves an API answered 201.
    store = FakeStore()
    proc = processor(store, AdmissionKeys(current=AdmissionKey(ADMISSION.key_id, "f" * 40)))
    proc.limits = Limits(max_payload_bytes=4)
    run(proc, record(create("s1", payload=b'{"n": 123456}'), 1))
    assert admitted_refusals(store) == []


def test_the_api_admits_a_tenant_its_worker_takes_as_active() -> None:
    # The worker refuses only active=False (streams.commands._check_sender): a row whose
    # active column is unset is an active tenant to it, so the API must not say 403.
    s = store()
    s.tenants["acme"]["active"] = None
    bridge = FakeBridge()
    result = send(service(s, bridge), api_create())
    assert result["code"] == "ok" and len(bridge.admitted) == 1
    del s.tenants["acme"]
    with pytest.raises(ApiError) as err:
        send(service(s, FakeBridge()), api_create("gen-2"))
    assert (err.value.status, err.value.code) == (403, "unknown_tenant")


def test_a_504_says_how_to_retry_without_making_a_second_schedule() -> None:
    # The create may still be appended (the producer retries it for up to its message
    # timeout) after the 504 and after a GET answered 404: a re-POST of the body without an
    # id would make a second schedule. The same body with the 504's schedule_id cannot.
    with pytest.raises(ApiError) as err:
        send(service(store(), FakeBridge(timeout=True)), api_create("gen-9"))
    assert err.value.status == 504 and err.value.extra["schedule_id"] == "gen-9"
    assert '"schedule_id": "gen-9"' in err.value.message


@pytest.mark.parametrize("key_id", ["prod.2026", "k=1", "clé", "a b"])
def test_every_key_the_settings_take_makes_stamps_its_workers_verify(key_id: str) -> None:
    # A key id the stamp cannot carry would make every stamp "malformed" at the workers:
    # each admitted create then decided in full after its 201. Refused at start instead.
    try:
        s = Settings.from_env({"TOCSIN_ADMISSION_KEY": f"{key_id}:" + "s" * 40})
    except ConfigError:
        return
    keys = keys_of(s.admission.current, None)
    assert keys.current is not None
    name, value = stamp(keys.current, admitted_at_ms=1_000, record_key=b"k", value=b"v")
    got = keys.verify(
        {name: value},
        record_key=b"k",
        value=b"v",
        record_ms=1_000,
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )
    assert isinstance(got, Admission), got


def test_a_create_that_may_be_missed_before_its_worker_reads_it_waits_for_the_worker() -> None:
    # Due in 1 s with no misfire tolerance: a worker reading it a second later (a batch
    # window, a rebalance) stores it past due + tolerance and its ticker records it missed,
    # never fired, after a 201; the synchronous path answers due_in_past instead.
    soon = format_iso_ms(int(time.time() * 1000) + 1_000)
    bridge = FakeBridge()
    send(service(store(), bridge), api_create("gen-soon", due=soon, misfire_tolerance_s=0))
    assert bridge.admitted == [] and bridge.waited == ["gen-soon"]
    # With room to spare it is admitted.
    later = format_iso_ms(int(time.time() * 1000) + 60_000)
    send(service(store(), bridge), api_create("gen-later", due=later, misfire_tolerance_s=0))
    assert len(bridge.admitted) == 1

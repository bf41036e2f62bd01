"""The API admits a one-shot create it gave the id to (api.service ``_admit``): it decides
what the worker would (the tenant active, its limits, its share of the create quota), stamps
the command with the admission key and answers at Kafka's acknowledgement; everything else
waits for the worker's answer as before."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from api.service import Service
from api.views import ApiError, create_command, http_status
from base.errors import KafkaError
from base.settings import Settings
from streams.commands import ADMITTED_REFUSED, TenantCache
from streams.decisions import own_topics
from streams.tenants import AdmissionQuota
from tests.fakes import FakeStore
from topics.admission import Admission, AdmissionKey, AdmissionKeys
from topics.catalog import catalog
from topics.codes import Code
from topics.ids import format_iso_ms
from topics.signing import TimestampType, header_map, new_signing_key
from topics.validation import Limits

TENANT = "acme"
KEY = AdmissionKey("api-1", "k" * 40)
DUE = format_iso_ms(int(time.time() * 1000) + 3_600_000)


@dataclass
class FakeBridge:
    """Acknowledges admitted creates at (3, n), appended now (or raises ``fail``); answers
    synchronous commands OK."""

    fail: BaseException | None = None
    timeout: bool = False
    catalog: Any = field(default_factory=lambda: catalog(Settings().topics))
    admitted: list[tuple[bytes, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    waited: list[str] = field(default_factory=list)

    async def send_admitted(
        self, key: bytes, value: bytes, headers: list[tuple[str, bytes]], **kw: Any
    ) -> tuple[int, int, int] | None:
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        if self.timeout:
            return None
        self.admitted.append((key, value, headers))
        return 3, len(self.admitted), int(time.time() * 1000)

    def forget(self, request_id: str) -> None:
        pass

    async def send_command(
        self, key: bytes, value: bytes, headers: Any, **kw: Any
    ) -> dict[str, object]:
        self.waited.append(key.decode())
        return {"code": Code.OK, "schedule_id": key.decode(), "command": "create"}


def service(
    store: FakeStore,
    bridge: FakeBridge,
    keys: AdmissionKeys | None = None,
    instances: int = 1,
) -> Service:
    svc = Service.__new__(Service)
    svc.settings = Settings()
    svc.limits = Limits.from_settings(svc.settings.scheduler)
    svc.store = store  # type: ignore[assignment]
    svc.bridge = bridge  # type: ignore[assignment]
    svc.tenants = TenantCache(store)
    svc.timeout_s = 1.0
    svc.admission = AdmissionKeys(current=KEY) if keys is None else keys
    svc.admission_quota = AdmissionQuota(instances)
    svc.internal_topics = own_topics("tocsin.command-results")
    return svc


def store(**config: object) -> FakeStore:
    s = FakeStore()
    s.tenants[TENANT] = {
        "tenant": TENANT,
        "active": True,
        "config": orjson.dumps(config).decode(),
        "signing_secret": new_signing_key(),
    }
    return s


def create(sid: str = "gen-1", **body: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "due": DUE,
        "callback": {"type": "http", "url": "https://h.example/cb"},
    }
    fields.update(body)
    return create_command(fields, tenant=TENANT, schedule_id=sid, request_id="r1")


def send(svc: Service, command: dict[str, object], *, admit: bool = True) -> Any:
    return asyncio.run(svc.send(command, wait=True, admit=admit))


def test_a_generated_one_shot_create_is_answered_at_the_acknowledgement_stamped() -> None:
    bridge = FakeBridge()
    result = send(service(store(), bridge), create())
    assert (result["code"], result["status"], result["partition"]) == ("ok", "accepted", 3)
    assert bridge.waited == []  # no worker answer awaited
    ((key, value, headers),) = bridge.admitted
    got = AdmissionKeys(current=KEY).verify(
        header_map(headers),
        record_key=key,
        value=value,
        record_ms=result["at_ms"],
        timestamp_type=TimestampType.LOG_APPEND_TIME,
    )
    assert isinstance(got, Admission)
    assert "tocsin-signature" in header_map(headers)  # signed by the tenant's key too


@pytest.mark.parametrize(
    ("command", "admit", "keys"),
    [
        (create(), False, None),  # the client's own id: only the store knows it is free
        (create(recurrence={"cron": "* * * * *"}, due=None), True, None),  # recurring
        (create(), True, AdmissionKeys()),  # no admission key configured
    ],
)
def test_everything_else_waits_for_the_worker(
    command: dict[str, object], admit: bool, keys: AdmissionKeys | None
) -> None:
    bridge = FakeBridge()
    command = {k: v for k, v in command.items() if v is not None}
    send(service(store(), bridge, keys), command, admit=admit)
    assert bridge.admitted == [] and bridge.waited == ["gen-1"]


@pytest.mark.parametrize(
    ("config", "body", "code"),
    [
        ({"allowed_callback_hosts": ["other.example"]}, {}, "callback_not_allowed"),
        ({"max_payload_bytes": 2}, {"payload": {"a": 1}}, "payload_too_large"),
        ({"max_horizon_s": 60}, {}, "beyond_horizon"),
    ],
)
def test_the_tenants_limits_refuse_before_anything_is_produced(
    config: dict[str, object], body: dict[str, object], code: str
) -> None:
    bridge = FakeBridge()
    with pytest.raises(ApiError) as err:
        send(service(store(**config), bridge), create(**body))
    assert (err.value.code, err.value.status, bridge.admitted) == (code, http_status(code), [])


def test_a_deactivated_tenant_is_refused() -> None:
    s = store()
    s.tenants[TENANT]["active"] = False
    bridge = FakeBridge()
    with pytest.raises(ApiError) as err:
        send(service(s, bridge), create())
    assert (err.value.status, err.value.code, bridge.admitted) == (403, "inactive_tenant", [])


def test_each_instance_admits_its_share_of_the_quota() -> None:
    # 2/s over 2 instances: one a second here (a bucket of one).
    bridge = FakeBridge()
    svc = service(store(create_quota_per_s=2), bridge, instances=2)
    send(svc, create("a"))
    with pytest.raises(ApiError) as err:
        send(svc, create("b"))
    assert (err.value.status, err.value.code) == (429, "quota_exceeded")
    alone = service(store(create_quota_per_s=2), FakeBridge(), instances=1)
    send(alone, create("a"))
    send(alone, create("b"))  # the whole quota: two at once


def test_the_quota_keeps_a_bounded_number_of_tenants() -> None:
    quota = AdmissionQuota(1, max_tenants=2)
    for tenant in ("a", "b", "c", "a"):
        quota.allow(tenant, 5.0, 0.0)
    assert len(quota) == 2


@pytest.mark.parametrize(
    ("fail", "status", "code"),
    [
        (KafkaError("broker down", retriable=True), 503, "unavailable"),
        (KafkaError("record too large", retriable=False), 500, "kafka_refused"),
    ],
)
def test_a_produce_error_is_classified(fail: KafkaError, status: int, code: str) -> None:
    with pytest.raises(ApiError) as err:
        send(service(store(), FakeBridge(fail=fail)), create())
    assert (err.value.status, err.value.code, err.value.retriable) == (status, code, status == 503)


def test_no_acknowledgement_in_time_is_a_timeout() -> None:
    with pytest.raises(ApiError) as err:
        send(service(store(), FakeBridge(timeout=True)), create())
    assert (err.value.status, err.value.code) == (504, "timeout")


def test_get_of_an_admitted_create_its_worker_refused_says_so() -> None:
    s = store()
    svc = service(s, FakeBridge())
    with pytest.raises(ApiError) as err:
        asyncio.run(svc.get_schedule(TENANT, "gen-1"))
    assert err.value.status == 404
    asyncio.run(
        s.record_event(
            TENANT, "gen-1", "command_refused", at_ms=1, detail=f"{ADMITTED_REFUSED}: x: y"
        )
    )
    with pytest.raises(ApiError) as err:
        asyncio.run(svc.get_schedule(TENANT, "gen-1"))
    assert (err.value.status, err.value.code) == (410, "refused")

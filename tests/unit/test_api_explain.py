"""Who may explain which schedule: a tenant its own only (another tenant's is 404, as if it
did not exist), the admin any tenant's by name."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import pytest

from api.explain import explanation, tenant_of
from api.openapi import openapi_document
from api.service import Principal, Service
from api.views import ApiError
from base.settings import Settings
from streams.model import ScheduleRow, ScheduleState
from tests.fakes import FakeStore


def test_a_tenant_reads_its_own_schedules() -> None:
    assert tenant_of(Principal(tenant="acme"), None, "s1") == "acme"
    assert tenant_of(Principal(tenant="acme"), "acme", "s1") == "acme"


def test_another_tenants_schedule_answers_exactly_like_a_missing_one() -> None:
    store = FakeStore()
    store.schedules[("globex", "s1")] = ScheduleRow(
        tenant="globex",
        schedule_id="s1",
        partition=0,
        state=ScheduleState.SCHEDULED,
        due_ms=1_000,
        version=1,
        created_ms=0,
        updated_ms=0,
    )
    service = cast(Service, SimpleNamespace(store=store, settings=Settings.from_env({})))
    with pytest.raises(ApiError) as missing:
        asyncio.run(explanation(service, "acme", "s1"))  # acme has no s1; globex has
    with pytest.raises(ApiError) as named:
        tenant_of(Principal(tenant="acme"), "globex", "s1")  # acme names globex
    assert missing.value.status == named.value.status == 404
    assert missing.value.body() == named.value.body()
    # The admin reads it.
    found = asyncio.run(
        explanation(service, tenant_of(Principal(tenant=None, admin=True), "globex", "s1"), "s1")
    )
    assert found.tenant == "globex" and found.schedule_id == "s1"


def test_the_admin_names_the_tenant() -> None:
    assert tenant_of(Principal(tenant=None, admin=True), "globex", "s1") == "globex"
    with pytest.raises(ApiError) as caught:
        tenant_of(Principal(tenant=None, admin=True), None, "s1")
    assert caught.value.status == 400


def test_the_route_is_in_the_openapi_document_for_either_key() -> None:
    op = openapi_document()["paths"]["/v1/schedules/{schedule_id}/explain"]["get"]  # type: ignore[index]
    assert op["security"] == [{"apiKey": []}, {"adminKey": []}]
    assert "404" in op["responses"]

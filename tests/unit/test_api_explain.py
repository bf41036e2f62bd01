"""Who may explain which schedule: a tenant its own only (another tenant's is 404, as if it
did not exist), the admin any tenant's by name."""

from __future__ import annotations

import pytest

from api.explain import tenant_of
from api.openapi import openapi_document
from api.service import Principal
from api.views import ApiError


def test_a_tenant_reads_its_own_schedules() -> None:
    assert tenant_of(Principal(tenant="acme"), None) == "acme"
    assert tenant_of(Principal(tenant="acme"), "acme") == "acme"


def test_a_tenant_naming_another_tenant_gets_not_found() -> None:
    with pytest.raises(ApiError) as caught:
        tenant_of(Principal(tenant="acme"), "globex")
    assert caught.value.status == 404 and caught.value.code == "not_found"


def test_the_admin_names_the_tenant() -> None:
    assert tenant_of(Principal(tenant=None, admin=True), "globex") == "globex"
    with pytest.raises(ApiError) as caught:
        tenant_of(Principal(tenant=None, admin=True), None)
    assert caught.value.status == 400


def test_the_route_is_in_the_openapi_document_for_either_key() -> None:
    op = openapi_document()["paths"]["/v1/schedules/{schedule_id}/explain"]["get"]  # type: ignore[index]
    assert op["security"] == [{"apiKey": []}, {"adminKey": []}]
    assert "404" in op["responses"]

"""Pure parts of the API and tenancy: signatures, tenant config, quotas, API keys, SSRF
checks, the API's views and the go-scheduler facade's."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
import pytest

from api import goscheduler_views as gv
from api import views
from api.openapi import openapi_document
from api.views import ApiError
from base.errors import TocsinError
from proxy import ssrf
from proxy.ssrf import BlockedAddress, literal_refusal
from streams.buckets import BucketKey
from streams.decisions import index_changes
from streams.model import BucketRow, ScheduleChange, ScheduleRow
from streams.tenants import (
    QuotaBook,
    TenantConfig,
    TokenBucket,
    check_api_key,
    host_allowed,
    new_api_key,
    split_api_key,
    topic_allowed,
)
from topics.addresses import address_allowed
from topics.codes import Code
from topics.ids import trigger_id
from topics.signing import header_map, new_signing_key, sign_headers, verify

# -- signatures ----------------------------------------------------------------------------


def test_signature_round_trip_and_tampering() -> None:
    secret = new_signing_key()
    value = b'{"type":"cancel","tenant":"a","schedule_id":"s"}'
    headers = header_map(sign_headers(secret, signed_at_ms=1000, key=b"s", value=value))
    assert verify(secret, headers, key=b"s", value=value, record_ms=1000) is None
    assert verify(secret, headers, key=b"s", value=value + b" ", record_ms=1000)
    assert verify(secret, headers, key=b"t", value=value, record_ms=1000)
    assert verify(new_signing_key(), headers, key=b"s", value=value, record_ms=1000)
    assert "missing" in (verify(secret, {}, key=b"s", value=value, record_ms=1000) or "")
    stale = verify(secret, headers, key=b"s", value=value, record_ms=1000 + 10 * 60_000)
    assert stale and "timestamp" in stale


def test_signature_binds_the_key_length() -> None:
    # key "ab" + value "c" must not verify as key "a" + value "bc"
    secret = new_signing_key()
    headers = header_map(sign_headers(secret, signed_at_ms=5, key=b"ab", value=b"c"))
    assert verify(secret, headers, key=b"a", value=b"bc", record_ms=5)


def test_header_map_accepts_lists_and_mappings() -> None:
    assert header_map([("A", b"1"), ("a", b"2"), ("b", "x"), ("bad",)]) == {"a": b"1", "b": b"x"}
    assert header_map({"K": b"v"}) == {"k": b"v"}
    assert header_map(None) == {}


# -- tenant config -------------------------------------------------------------------------


def test_tenant_config_round_trip_and_errors() -> None:
    cfg = TenantConfig.from_dict(
        {"create_quota_per_s": 5, "allowed_callback_hosts": ["*.Example.com"], "max_horizon_s": 60}
    )
    assert cfg.allowed_callback_hosts == ("*.example.com",)
    assert TenantConfig.from_json(cfg.to_json()) == cfg
    assert TenantConfig.from_json("{}") == TenantConfig()
    assert TenantConfig.from_json("not json") == TenantConfig()
    for bad, field in [
        ({"create_quota_per_s": -1}, "create_quota_per_s"),
        ({"max_payload_bytes": 0}, "max_payload_bytes"),
        ({"allowed_callback_hosts": ["a b"]}, "allowed_callback_hosts"),
        ({"quota": 1}, "quota"),
        ({"retry_policy": {"x": 1}}, "retry_policy"),
    ]:
        with pytest.raises(ValueError, match=field):
            TenantConfig.from_dict(bad)
    assert cfg.merged({"max_horizon_s": None}).max_horizon_s is None


def test_host_and_topic_allow_lists() -> None:
    assert host_allowed("anything.test", ())
    assert host_allowed("a.example.com", ("*.example.com",))
    assert host_allowed("A.B.Example.com.", ("*.example.com",))
    assert not host_allowed("example.com", ("*.example.com",))
    assert not host_allowed("evilexample.com", ("*.example.com",))
    assert host_allowed("api.test", ("api.test",))
    assert topic_allowed("acme.x", ("acme.*",)) and not topic_allowed("other", ("acme.*",))
    assert topic_allowed("t", ()) and topic_allowed("t", ("t",))


# -- quotas --------------------------------------------------------------------------------


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, burst=2.0, now_s=0.0)
    assert b.take(0.0) and b.take(0.0) and not b.take(0.0)
    assert b.take(0.5) and not b.take(0.5)
    assert b.take(10.0) and b.take(10.0) and not b.take(10.0)  # capped at burst


def test_quota_book_splits_the_quota_over_partitions() -> None:
    q = QuotaBook(partitions=4)
    assert all(q.allow("t", 0, 0, 0.0) for _ in range(1000))  # 0 = unlimited
    assert q.allow("t", 0, 8, 0.0) and q.allow("t", 0, 8, 0.0)
    assert not q.allow("t", 0, 8, 0.0)  # 8/s over 4 partitions: 2 per second here
    assert q.allow("t", 1, 8, 0.0)  # another partition has its own share
    assert q.allow("u", 0, 8, 0.0)  # and another tenant its own bucket
    assert q.allow("t", 0, 8, 0.5)


# -- API keys ------------------------------------------------------------------------------


def test_api_keys_store_only_a_salted_hash() -> None:
    key = new_api_key()
    assert key.token.startswith("tsk_") and key.key_id in key.token
    parts = split_api_key(key.token)
    assert parts is not None and parts[0] == key.key_id
    assert parts[1].encode() not in key.hash
    assert check_api_key(parts[1], salt=key.salt, expected=key.hash)
    assert not check_api_key(parts[1] + "x", salt=key.salt, expected=key.hash)
    assert split_api_key("tsk_nothex_xxx") is None and split_api_key("") is None
    assert new_api_key().hash != key.hash


# -- SSRF ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.1.2.3",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:127.0.0.1",
        "::",
        "not an ip",
        # IPv6 forms that reach IPv4 or internal networks, whatever the interpreter's is_global
        "64:ff9b::a00:1",
        "64:ff9b::808:808",
        "64:ff9b:1::a00:1",
        "2002:a00:1::1",
        "2002:808:808::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "fec0::1",
        "::10.0.0.1",
        "100::1",
        "2001:db8::1",
    ],
)
def test_internal_addresses_are_refused(address: str) -> None:
    assert not address_allowed(address)


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_allowed(address)


def test_literal_refusal() -> None:
    assert literal_refusal("127.0.0.1") and literal_refusal("[::1]")
    assert literal_refusal("8.8.8.8") is None
    assert literal_refusal("example.com") is None  # names are checked once resolved


def test_guarded_resolve_filters_resolved_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    resolved: list[str] = []

    async def fake_resolve_any(host: str, port: int) -> list[str]:
        return resolved

    monkeypatch.setattr(ssrf, "resolve_any", fake_resolve_any)
    resolved[:] = ["127.0.0.1", "93.184.216.34"]
    assert asyncio.run(ssrf.guarded_resolve("rebind.test", 80)) == ["93.184.216.34"]
    resolved[:] = ["127.0.0.1"]
    with pytest.raises(BlockedAddress, match=r"rebind\.test"):
        asyncio.run(ssrf.guarded_resolve("rebind.test", 80))


# -- views ---------------------------------------------------------------------------------


def test_http_status_mapping() -> None:
    assert views.http_status(Code.OK, created=True) == 201
    assert views.http_status(Code.OK) == 200
    assert views.http_status(Code.DUPLICATE, created=True) == 200
    assert views.http_status(Code.QUOTA_EXCEEDED) == 429
    assert views.http_status(Code.NOT_FOUND) == 404
    assert views.http_status(Code.CONFLICT) == 409
    assert views.http_status(Code.INVALID_FIELD) == 400
    assert views.http_status(Code.CALLBACK_NOT_ALLOWED) == 422


def test_api_errors_are_tocsin_errors_retriable_by_status() -> None:
    quota = ApiError(429, "quota_exceeded", "slow down", schedule_id="s")
    assert isinstance(quota, TocsinError) and quota.retriable
    assert (quota.status, quota.code, str(quota)) == (429, "quota_exceeded", "slow down")
    assert quota.body() == {
        "error": {"code": "quota_exceeded", "message": "slow down", "schedule_id": "s"}
    }
    assert ApiError(504, "timeout", "no result").retriable
    assert ApiError(503, "unavailable", "down").retriable
    assert not ApiError(404, "not_found", "no schedule").retriable
    assert not ApiError(400, "invalid_field", "bad").retriable


def test_body_and_command_building() -> None:
    with pytest.raises(ApiError, match="JSON"):
        views.parse_body(b"{")
    with pytest.raises(ApiError, match="object"):
        views.parse_body(b"[]")
    with pytest.raises(ApiError, match="set by the API"):
        views.create_command(
            {"tenant": "x", "due": 1, "callback": {}}, tenant="a", schedule_id="s", request_id="r"
        )
    with pytest.raises(ApiError, match="paylod"):
        views.create_command({"paylod": 1}, tenant="a", schedule_id="s", request_id="r")
    cmd = views.create_command(
        {"schedule_id": "s", "due": 5, "callback": {}}, tenant="a", schedule_id="s", request_id="r"
    )
    assert cmd == {
        "type": "create",
        "tenant": "a",
        "schedule_id": "s",
        "request_id": "r",
        "due": 5,
        "callback": {},
    }


def test_window_cursor_and_statuses() -> None:
    assert views.parse_window({"from": "1000", "to": "1970-01-02T00:00:00Z"})[0] == 1000
    for bad in [
        {"to": "5"},
        {"from": "5", "to": "4"},
        {"from": "x", "to": "5"},
        {"from": "0", "to": str(400 * 86_400_000)},
    ]:
        with pytest.raises(ApiError):
            views.parse_window(bad)
    c = views.encode_cursor(123, "a/b")
    assert views.decode_cursor(c) == (123, "a/b")
    with pytest.raises(ApiError):
        views.decode_cursor("!!")
    assert views.parse_statuses("scheduled,delivered") == {"scheduled", "delivered"}
    with pytest.raises(ApiError):
        views.parse_statuses("done")
    with pytest.raises(ApiError):
        views.parse_limit("0")


def _row(**kw: Any) -> dict[str, Any]:
    base = {
        "tenant": "a",
        "schedule_id": "s",
        "state": "scheduled",
        "due_ms": 1000,
        "payload": orjson.dumps({"x": 1}),
        "payload_type": "json",
        "callback": '{"type":"kafka","topic":"t","key":null}',
    }
    return {**base, **kw}


def test_schedule_view_and_stale_fire() -> None:

    v = views.schedule_view(_row(), [{"at_ms": 1, "event": "created"}])
    assert orjson.loads(orjson.dumps(v))["payload"] == {"x": 1}
    assert v["history"][0]["event"] == "created" and v["callback"]["topic"] == "t"
    fired = _row(state="fired", trigger_id=trigger_id("a", "s", 1000))
    assert views.effective_state(fired) == "fired"
    stale = _row(state="fired", trigger_id=trigger_id("a", "s", 999))
    assert views.effective_state(stale) == "scheduled"
    assert views.matches(
        _row(state="fired", trigger_id=trigger_id("a", "s", 1000), delivery_outcome="delivered"),
        frozenset({"delivered"}),
    )
    assert not views.matches(_row(), frozenset({"cancelled"}))


def test_index_changes() -> None:
    row = ScheduleRow(
        tenant="a",
        schedule_id="s",
        partition=0,
        state="scheduled",
        due_ms=120_000,
        version=1,
        created_ms=0,
        updated_ms=0,
    )
    new = BucketRow.for_schedule(row, shards=1)
    old = BucketKey(
        partition=0, minute_ms=60_000, shard=0, due_ms=60_000, tenant="a", schedule_id="s"
    )
    create = ScheduleChange(row=row, new_bucket=new, old_bucket=None, now_ms=0)
    move = ScheduleChange(row=row, new_bucket=new, old_bucket=old, now_ms=0)
    same = ScheduleChange(row=row, new_bucket=new, old_bucket=new.key, now_ms=0)
    cancel = ScheduleChange(row=row, new_bucket=None, old_bucket=new.key, now_ms=0)
    assert index_changes([create]) == ([("a", "s", 120_000)], [])
    assert index_changes([move]) == ([("a", "s", 120_000)], [("a", "s", 60_000)])
    assert index_changes([same, cancel]) == ([], [])


def test_openapi_document_is_json_and_lists_codes() -> None:
    doc = orjson.loads(orjson.dumps(openapi_document()))
    codes = doc["components"]["schemas"]["CommandResult"]["properties"]["code"]["enum"]
    assert "quota_exceeded" in codes and "bad_signature" in codes
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert op["responses"], path


def test_openapi_references_resolve_and_enums_are_the_wire_values() -> None:
    doc = orjson.loads(orjson.dumps(openapi_document()))
    schemas = doc["components"]["schemas"]
    refs = set(re.findall(r'"\$ref":"#/components/schemas/(\w+)"', orjson.dumps(doc).decode()))
    assert refs and refs <= set(schemas)
    status = schemas["Schedule"]["properties"]["status"]["enum"]
    assert status == ["scheduled", "fired", "missed", "cancelled", "paused", "completed"]
    mode = doc["paths"]["/v1/schedules"]["post"]["parameters"][0]["schema"]["enum"]
    assert mode == ["sync", "async"]


# -- go-scheduler facade ---------------------------------------------------------------------


def test_go_status_of_rows_and_runs() -> None:
    assert gv.go_status(_row()) == "SCHEDULED"
    assert gv.go_status(_row(state="cancelled")) == "DELETED"
    assert gv.go_status(_row(state="missed")) == "MISS"
    fired = _row(state="fired", trigger_id=trigger_id("a", "s", 1000))
    assert gv.go_status(fired) == "SUCCESS"
    assert gv.go_status({**fired, "delivery_outcome": "dead_lettered"}) == "FAILURE"
    # A fire raced by a reschedule is still scheduled.
    assert gv.go_status(_row(state="fired", trigger_id="older")) == "SCHEDULED"
    run = {"run_id": "p@1", "due_ms": 61_000, "trigger_id": "t"}
    assert gv.go_run(run, _row())["status"] == "SCHEDULED"
    assert (
        gv.go_run({**run, "state": "fired", "delivery": "dead_lettered"}, _row())["status"]
        == "FAILURE"
    )
    assert gv.go_run({**run, "state": "fired"}, _row())["scheduleGroup"] == 60
    assert gv.go_cron_schedule(_row(recurrence='{"every_s": 30}'), "completed")["status"] == (
        "SUCCESS"
    )


def test_go_listing_window_defaults_to_an_hour() -> None:
    hour, now = 3_600_000, 10 * 3_600_000
    assert gv.list_window(None, None, now) == (now - hour, now)
    assert gv.list_window("7200", None, now) == (7_200_000, 7_200_000 + hour)
    assert gv.list_window(None, "7200", now) == (7_200_000 - hour, 7_200_000)
    assert gv.list_window("1970-01-01 01:00:00", "1970-01-01T02:00:00Z", now) == (hour, 2 * hour)
    with pytest.raises(ApiError, match="before start_time"):
        gv.list_window("7200", "3600", now)
    with pytest.raises(ApiError, match="30 days"):
        gv.list_window("0", str(31 * 86_400), now)


def test_go_listing_status_and_tokens() -> None:
    assert gv.list_statuses(None) is None
    assert gv.list_statuses("SUCCESS") == {"delivered", "completed"}
    with pytest.raises(ApiError, match="unknown status"):
        gv.list_statuses("success")
    cursor = (1234, "s-1")
    assert gv.list_cursor(gv.list_token(cursor)) == cursor
    assert gv.list_token(None) == "" and gv.list_cursor("") is None
    with pytest.raises(ApiError, match="Invalid page token"):
        gv.list_cursor("zz")
    assert gv.run_token_ms(gv.run_token(5_000)) == 5_000
    for bad in ("zz", "00ff"):
        with pytest.raises(ApiError, match="Invalid page token"):
            gv.run_token_ms(bad)


def test_go_runs_page() -> None:
    past = [{"nominal_ms": t} for t in (30, 20)]
    future = [{"nominal_ms": t} for t in (40, 50)]
    assert gv.runs_page(gv.When.PAST, past, future, 2) == (past, 20)
    assert gv.runs_page(gv.When.PAST, past, future, 3) == (past, None)
    assert gv.runs_page(gv.When.FUTURE, past, future, 2) == (future, 50)
    both, last = gv.runs_page(gv.When.BOTH, past, future, 3)
    assert [r["nominal_ms"] for r in both] == [50, 40, 30] and last is None
    with pytest.raises(ApiError, match="No cron runs"):
        gv.parse_when("tomorrow")


def test_go_create_body() -> None:
    cb = {"type": "http", "details": {"url": "https://h.example/x", "method": "put"}}
    one = gv.create_body({"scheduleTime": 5, "payload": "hi", "callback": cb}, "UTC")
    assert one == {
        "due": 5000,
        "callback": {"type": "http", "url": "https://h.example/x", "method": "PUT"},
        "payload_b64": "aGk=",
    }
    cron = gv.create_body(
        {"cronExpression": "0 9 1 * MON", "scheduleTime": 0, "callback": cb}, "Asia/Kolkata"
    )
    assert cron["recurrence"] == {
        "cron": "0 9 1 * 1",
        "time_zone": "Asia/Kolkata",
        "ambiguous": "twice",
        "day_match": "all",
    }
    for body, match in [
        ({"scheduleTime": 5, "callback": cb, "x": 1}, "unknown field 'x'"),
        ({"scheduleTime": True, "callback": cb}, "unix seconds"),
        ({"cronExpression": "* * * * *", "scheduleTime": 5, "callback": cb}, "not both"),
        ({"cronExpression": "* * *", "callback": cb}, "5 fields"),
        ({"scheduleTime": 5, "payload": 1, "callback": cb}, "payload must be a string"),
        ({"scheduleTime": 5, "callback": {"type": "kafka"}}, "callback must be"),
    ]:
        with pytest.raises(ApiError, match=match):
            gv.create_body(body, "UTC")


def test_go_error_envelope() -> None:
    body = gv.error_body(ApiError(404, "not_found", "No runs found"))
    assert body == {
        "status": {
            "statusCode": 404,
            "statusMessage": "No runs found",
            "statusType": "Fail",
            "errorCode": "not_found",
        }
    }

"""Request building for both modes, dead-letter and outcome records, proxy settings."""

from __future__ import annotations

import base64

import orjson
import pytest

from base.errors import ConfigError
from proxy.deadletter import dead_letter_record, delivery_outcome
from proxy.envelope import Envelope, prepare_fire, prepare_generic
from proxy.settings import ProxySettings
from topics.codec import decode_trigger


def env(key: bytes | None = b"k1", value: bytes | None = b"v", headers=None) -> Envelope:
    return Envelope(
        topic="t",
        partition=2,
        offset=7,
        key=key,
        value=value,
        headers=headers or [],
        timestamp_ms=123,
        read_s=0.0,
    )


def test_generic_request_follows_the_mps_contract() -> None:
    e = env(
        headers=[
            ("trace", b"abc"),
            ("bad name", b"x"),
            ("Topic", b"spoof"),
            ("multi", b"line1\r\nX-Injected: 1"),
        ]
    )
    prepare_generic(e, url="http://h:8080/process", timeout_s=3)
    req = e.request
    assert req is not None and req.method == "POST" and req.body == b"v"
    h = dict(req.headers)
    assert (h["Key"], h["Topic"], h["Partition"], h["Offset"]) == ("k1", "t", "2", "7")
    assert h["trace"] == "abc"
    assert "bad name" not in h and [v for k, v in req.headers if k == "Topic"] == ["t"]
    assert "\r" not in h["multi"] and "\n" not in h["multi"]  # no header injection
    assert e.host == "http://h:8080" and e.order_key == ("t", 2, b"k1")


def test_keyless_and_tombstone() -> None:
    e = env(key=None, value=None)
    prepare_generic(e, url="http://h/p", timeout_s=1)
    assert e.order_key is None and e.request is not None and e.request.body == b""
    assert "Key" not in dict(e.request.headers)


def trigger_json(**over: object) -> bytes:
    doc: dict[str, object] = {
        "trigger_id": "tid",
        "schedule_id": "s1",
        "tenant": "acme",
        "due_ms": 1,
        "emitted_ms": 2,
        "attempt": 1,
        "order_key": "s1",
        "payload": {"a": 1},
        "callback": {
            "type": "http",
            "url": "https://r.example/hook",
            "method": "PUT",
            "headers": {"Authorization": "Bearer x"},
            "timeout_s": 4,
        },
    }
    doc.update(over)
    return orjson.dumps(doc)


def test_fire_request_from_trigger() -> None:
    e = env(value=trigger_json())
    prepare_fire(e, decode_trigger)
    req = e.request
    assert e.invalid is None and req is not None
    assert (req.method, req.url, req.timeout_s) == ("PUT", "https://r.example/hook", 4)
    assert orjson.loads(req.body) == {"a": 1}
    h = dict(req.headers)
    assert h["Authorization"] == "Bearer x" and h["Idempotency-Key"] == "tid"
    assert h["Content-Type"] == "application/json" and h["Tocsin-Schedule-Id"] == "s1"
    assert (h["Tocsin-Due-Ms"], h["Tocsin-Emitted-Ms"]) == ("1", "2")


def test_a_stored_callback_cannot_send_a_header_the_proxy_sets() -> None:
    # A trigger of a schedule stored before commands were refused these names.
    callback = {
        "type": "http",
        "url": "https://r.example/hook",
        "headers": {
            "Authorization": "Bearer x",
            "Tocsin-Trigger-Id": "forged",
            "idempotency-key": "forged",
            "TOCSIN-TENANT": "forged",
            "Tocsin-Signature": "v1=forged",
            "Tocsin-Delivery-Attempt": "forged",
            "Tocsin-Other": "forged",
        },
    }
    e = env(value=trigger_json(callback=callback))
    prepare_fire(e, decode_trigger)
    assert e.invalid is None and e.request is not None
    sent = [(k.lower(), v) for k, v in e.request.headers]
    assert not [kv for kv in sent if kv[1] == "forged" or kv[1] == "v1=forged"]
    names = [k for k, _ in sent]
    assert len(names) == len(set(names)), names
    h = dict(sent)
    assert (h["tocsin-trigger-id"], h["idempotency-key"], h["tocsin-tenant"]) == (
        "tid",
        "tid",
        "acme",
    )
    assert h["authorization"] == "Bearer x"


def test_fire_request_names_the_order_key() -> None:
    e = env(value=trigger_json(order_key="account-42\r\nX-Injected: 1"))
    prepare_fire(e, decode_trigger)
    assert e.request is not None
    value = dict(e.request.headers)["Tocsin-Order-Key"]
    assert value.startswith("account-42") and "\r" not in value and "\n" not in value


def test_bad_triggers_become_invalid_envelopes() -> None:
    for value in (b"{nope", b"[]", trigger_json(callback={"type": "http", "url": "ftp://x/"})):
        e = env(value=value)
        prepare_fire(e, decode_trigger)
        assert e.invalid is not None and e.request is None


def test_dead_letter_record_keeps_everything() -> None:
    e = env(headers=[("h", b"\x00\xff"), ("n", None)])
    prepare_generic(e, url="http://h/p", timeout_s=1)
    doc = orjson.loads(
        dead_letter_record(
            e,
            reason="HTTP 700: no",
            status=700,
            first_failure_ms=1,
            last_failure_ms=2,
            now_ms=3,
            group_id="g",
        )
    )
    o = doc["original"]
    assert (o["topic"], o["partition"], o["offset"], o["timestamp_ms"]) == ("t", 2, 7, 123)
    assert base64.b64decode(o["key_b64"]) == b"k1" and base64.b64decode(o["value_b64"]) == b"v"
    assert o["headers"] == [["h", base64.b64encode(b"\x00\xff").decode()], ["n", None]]
    assert (doc["reason"], doc["status_code"], doc["first_failure_ms"], doc["last_failure_ms"]) == (
        "HTTP 700: no",
        700,
        1,
        2,
    )
    assert (
        delivery_outcome(e, outcome="delivered", status=200, reason=None, latency_ms=1, now_ms=2)
        is None
    )  # not a trigger: nothing to report


def test_outcome_record_for_a_trigger() -> None:
    e = env(value=trigger_json())
    prepare_fire(e, decode_trigger)
    rec = delivery_outcome(e, outcome="delivered", status=204, reason=None, latency_ms=9, now_ms=10)
    assert rec is not None
    key, value = rec
    doc = orjson.loads(value)
    assert key == b"s1" and doc["outcome"] == "delivered" and doc["status_code"] == 204
    assert doc["fire"] == {"topic": "t", "partition": 2, "offset": 7}


def test_settings_from_env() -> None:
    s = ProxySettings.from_env(
        {
            "TOCSIN_PROXY_MODE": "generic",
            "TOCSIN_PROXY_SOURCE_TOPIC": "a, b",
            "TOCSIN_PROXY_ENDPOINT_URL": "http://h/process",
            "TOCSIN_PROXY_CONCURRENCY": "7",
            "TOCSIN_PROXY_MAX_RETRY_AGE_S": "3600",
            "TOCSIN_PROXY_RETRIES_6XX": "5",
        }
    )
    assert s.source_topics("fires") == ["a", "b"] and s.concurrency == 7
    policy = s.retry_policy()
    assert policy.max_retry_age_s == 3600 and policy.retries_6xx == 5
    assert ProxySettings.from_env({}).source_topics("p.fires") == ["p.fires"]
    with pytest.raises(ConfigError):
        ProxySettings.from_env({"TOCSIN_PROXY_MODE": "generic"})  # no topic / endpoint
    with pytest.raises(ConfigError):
        ProxySettings.from_env({"TOCSIN_PROXY_MODE": "sideways"})
    with pytest.raises(ConfigError):
        ProxySettings.from_env({"TOCSIN_PROXY_CONCURRENCY": "many"})
    with pytest.raises(ConfigError):
        ProxySettings.from_env({"TOCSIN_PROXY_POISON_TIMEOUTS": "0"})

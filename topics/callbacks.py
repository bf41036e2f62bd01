"""A callback's checks: its shape, HTTP URL, method, headers, timeout and retry policy, its
Kafka topic, and which addresses a deployment calls back.

Pure: ``check_target`` judges an IP literal only (``topics.addresses``); a host name is
judged by the proxy once resolved.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import cast
from urllib.parse import urlsplit

from base.errors import CommandRejected
from topics.addresses import refused_literal
from topics.codes import Code
from topics.fields import DEFAULT_LIMITS, Fields, Limits, check_fields, check_text, kind_of, show
from topics.models import (
    HTTP_METHODS,
    Callback,
    DeliveryRetry,
    HttpCallback,
    HttpMethod,
    KafkaCallback,
)

MAX_TIMEOUT_S = 300.0
MAX_URL_LEN = 2048
MAX_TOPIC_LEN = 249  # Kafka's own limit on topic names

CALLBACK_FIELDS: dict[str, Fields] = {
    "http": Fields(required=("type", "url"), optional=("method", "headers", "timeout_s", "retry")),
    "kafka": Fields(required=("type", "topic"), optional=("key", "retry")),
}
RETRY_FIELDS = Fields(required=(), optional=("max_retry_age_s", "retries_6xx"))
# Bounds of a callback's retry policy: ten years of retrying, a thousand 6xx retries.
MAX_RETRY_AGE_S = 10 * 366 * 86_400
MAX_RETRIES_6XX = 1000

_TOPIC = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TOPIC_LEN}}}", re.ASCII)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", re.ASCII)  # RFC 9110 token
# Visible ASCII, space and tab: servers disagree on how to read bytes >= 0x80 in a header.
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*", re.ASCII)
_URL_CHARS = re.compile(r"[\x21-\x7e]+", re.ASCII)
_HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*\.?", re.ASCII)
# Framing and hop-by-hop headers belong to the HTTP client; letting a schedule set them
# could desynchronise the connection or smuggle a second request.
RESERVED_HEADERS: frozenset[str] = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)
# Headers the proxy sets on every delivery itself (trigger id, idempotency key, signature,
# attempt counts, ...): a receiver reading the first of two values would trust the
# tenant's copy, so a callback may not name them. ``Tocsin-`` is a whole namespace so that
# a header the proxy adds later cannot collide with one already stored. ``traceparent`` is
# the caller's to propagate: the proxy does not set it.
PROXY_HEADER_PREFIX = "tocsin-"
PROXY_HEADERS: frozenset[str] = frozenset({"idempotency-key"})


def is_proxy_header(name: str) -> bool:
    """Whether the proxy sets a header of this name (case-insensitive) on deliveries."""
    lowered = name.lower()
    return lowered.startswith(PROXY_HEADER_PREFIX) or lowered in PROXY_HEADERS


def check_url(value: object, field: str = "callback.url") -> str:
    """An absolute http(s) URL with a host, no credentials, ASCII only, bounded."""
    if not isinstance(value, str):
        raise CommandRejected(Code.INVALID_URL, f"{field} must be a string, got {kind_of(value)}")
    if len(value) > MAX_URL_LEN:
        raise CommandRejected(
            Code.INVALID_URL, f"{field} is {len(value)} characters; at most {MAX_URL_LEN}"
        )
    if _URL_CHARS.fullmatch(value) is None:
        raise CommandRejected(
            Code.INVALID_URL,
            f"{field} {show(value)} must be non-empty printable ASCII without spaces "
            "(percent-encode the path, use punycode for the host)",
        )
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise CommandRejected(Code.INVALID_URL, f"{field} {show(value)}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise CommandRejected(Code.INVALID_URL, f"{field} {show(value)} must use http or https")
    if "@" in parts.netloc:
        raise CommandRejected(
            Code.INVALID_URL,
            f"{field} must not carry user info (credentials); send them in callback.headers",
        )
    host = parts.hostname
    if not host:
        raise CommandRejected(Code.INVALID_URL, f"{field} {show(value)} has no host")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise CommandRejected(
                Code.INVALID_URL, f"{field} host {show(host)} is not an IPv6 address"
            ) from None
    elif _HOSTNAME.fullmatch(host) is None:
        raise CommandRejected(
            Code.INVALID_URL, f"{field} host {show(host)} is not a valid host name"
        )
    if port == 0:
        raise CommandRejected(Code.INVALID_URL, f"{field} port 0 cannot be called")
    return value


def check_target(callback: Callback, *, limits: Limits, field: str = "callback.url") -> None:
    """``invalid_url`` for an HTTP callback to an IP literal no callback may reach, unless
    the deployment allows private targets. Applied to commands only: a stored callback or a
    trigger's was accepted under the settings of its day, and the proxy judges it again."""
    if limits.allow_private_targets or not isinstance(callback, HttpCallback):
        return
    address = refused_literal(urlsplit(callback.url).hostname or "")
    if address is not None:
        raise CommandRejected(
            Code.INVALID_URL,
            f"{field} host {address} is a loopback, private, link-local or reserved address, "
            "which this deployment does not call back (TOCSIN_ALLOW_PRIVATE_TARGETS=true "
            "allows it)",
        )


def check_own_headers(callback: Callback, field: str = "callback.headers") -> None:
    """``invalid_callback`` for an HTTP callback that names a header the proxy sets itself.
    Applied to commands only: callbacks stored before the rule still decode, and the proxy
    drops those names from them when it builds the request."""
    if not isinstance(callback, HttpCallback):
        return
    for name in callback.headers:
        if is_proxy_header(name):
            raise CommandRejected(
                Code.INVALID_CALLBACK,
                f"{field}: {name!r} is set by the delivery proxy and not allowed "
                f"(names starting with {PROXY_HEADER_PREFIX!r} and Idempotency-Key are "
                "reserved)",
            )


def _headers(value: object, *, limits: Limits, field: str) -> dict[str, str]:
    code = Code.INVALID_CALLBACK
    if not isinstance(value, dict):
        raise CommandRejected(code, f"{field} must be an object of strings, got {kind_of(value)}")
    if len(value) > limits.max_headers:
        raise CommandRejected(
            code, f"{field} has {len(value)} entries; at most {limits.max_headers} are allowed"
        )
    seen: set[str] = set()
    total = 0
    for name, item in value.items():
        if not isinstance(name, str) or _HEADER_NAME.fullmatch(name) is None:
            raise CommandRejected(code, f"{field}: {show(name)} is not a valid HTTP header name")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS:
            raise CommandRejected(
                code, f"{field}: {name!r} is set by the HTTP client and not allowed"
            )
        if lowered in seen:
            raise CommandRejected(code, f"{field}: {name!r} is given twice (names ignore case)")
        seen.add(lowered)
        if not isinstance(item, str):
            raise CommandRejected(code, f"{field}[{name!r}] must be a string, got {kind_of(item)}")
        if _HEADER_VALUE.fullmatch(item) is None:
            raise CommandRejected(
                code,
                f"{field}[{name!r}] must be printable ASCII (space and tab allowed); "
                "encode other text, e.g. percent-encoding or base64",
            )
        total += len(name) + len(item)
    if total > limits.max_header_bytes:
        raise CommandRejected(
            code,
            f"{field} total {total} bytes; at most {limits.max_header_bytes} are allowed",
        )
    return dict(value)


def _timeout(value: object, field: str) -> float:
    code = Code.INVALID_CALLBACK
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected(code, f"{field} must be a number of seconds, got {kind_of(value)}")
    timeout = float(value)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise CommandRejected(code, f"{field} must be > 0 and <= {MAX_TIMEOUT_S:g}, got {value!r}")
    return timeout


def _method(value: object, field: str) -> HttpMethod:
    if isinstance(value, str) and value in HTTP_METHODS:
        return cast(HttpMethod, value)
    raise CommandRejected(
        Code.INVALID_CALLBACK,
        f"{field} {show(value)} must be one of {', '.join(sorted(HTTP_METHODS))}",
    )


def check_topic(value: object, field: str = "callback.topic") -> str:
    if not isinstance(value, str):
        raise CommandRejected(
            Code.INVALID_CALLBACK, f"{field} must be a string, got {kind_of(value)}"
        )
    if _TOPIC.fullmatch(value) is None or value in (".", ".."):
        raise CommandRejected(
            Code.INVALID_CALLBACK,
            f"{field} {show(value)} is not a legal Kafka topic name (1-{MAX_TOPIC_LEN} "
            "characters of A-Z a-z 0-9 . _ -, not '.' or '..')",
        )
    return value


def parse_callback(
    value: object, *, limits: Limits = DEFAULT_LIMITS, field: str = "callback"
) -> Callback:
    """An HTTP or Kafka callback from its JSON object (``invalid_callback`` / ``invalid_url``)."""
    code = Code.INVALID_CALLBACK
    if not isinstance(value, dict):
        raise CommandRejected(code, f"{field} must be an object, got {kind_of(value)}")
    if "type" not in value:
        raise CommandRejected(code, f"{field}: missing required field 'type' ('http' or 'kafka')")
    kind = value["type"]
    if not isinstance(kind, str) or kind not in CALLBACK_FIELDS:
        raise CommandRejected(code, f"{field}.type must be 'http' or 'kafka', got {show(kind)}")
    check_fields(value, CALLBACK_FIELDS[kind], where=field, code=code)
    if kind == "http":
        return HttpCallback(
            url=check_url(value["url"], f"{field}.url"),
            method=_method(value["method"], f"{field}.method") if "method" in value else "POST",
            headers=(
                _headers(value["headers"], limits=limits, field=f"{field}.headers")
                if "headers" in value
                else {}
            ),
            timeout_s=(
                _timeout(value["timeout_s"], f"{field}.timeout_s") if "timeout_s" in value else 10.0
            ),
            retry=_retry(value["retry"], f"{field}.retry") if "retry" in value else None,
        )
    key = value.get("key")
    return KafkaCallback(
        topic=check_topic(value["topic"], f"{field}.topic"),
        key=None
        if key is None
        else check_text(key, f"{field}.key", max_len=limits.max_id_len, code=code),
        retry=_retry(value["retry"], f"{field}.retry") if "retry" in value else None,
    )


def _retry(value: object, field: str) -> DeliveryRetry:
    """A callback's retry policy; ``null`` fields (or absent ones) keep the proxy's setting."""
    code = Code.INVALID_CALLBACK
    if not isinstance(value, dict):
        raise CommandRejected(code, f"{field} must be an object, got {kind_of(value)}")
    check_fields(value, RETRY_FIELDS, where=field, code=code)
    age = value.get("max_retry_age_s")
    if age is not None:
        if isinstance(age, bool) or not isinstance(age, int | float):
            raise CommandRejected(code, f"{field}.max_retry_age_s must be a number of seconds")
        if not (math.isfinite(age) and 0 <= age <= MAX_RETRY_AGE_S):
            raise CommandRejected(
                code, f"{field}.max_retry_age_s must be within 0..{MAX_RETRY_AGE_S}, got {age!r}"
            )
        age = float(age)
    r6 = value.get("retries_6xx")
    if r6 is not None and (
        isinstance(r6, bool) or not isinstance(r6, int) or not 0 <= r6 <= MAX_RETRIES_6XX
    ):
        raise CommandRejected(
            code, f"{field}.retries_6xx must be an integer within 0..{MAX_RETRIES_6XX}"
        )
    return DeliveryRetry(max_retry_age_s=age, retries_6xx=r6)

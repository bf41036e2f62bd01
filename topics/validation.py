"""Turning untrusted command bytes into a validated ``Command``, or a precise rejection.

Everything a client can get wrong is caught here and raised as
``CommandRejected(code, message)`` naming the offending field, so the scheduler can answer
on the command-results topic instead of crashing or storing garbage. The field parsers
(``parse_due``, ``parse_callback``, ``canonical_json``...) are shared with ``topics.codec``
so a callback means the same thing wherever it is read.

Checks that need stored state (tenant registered, schedule exists, duplicate or conflict,
an update's due against the stored misfire tolerance) belong to the scheduler. This module
must never do I/O, read the clock (``now_ms`` is passed in) or raise anything but
``CommandRejected`` from ``decode_command``; ``salvage_ids`` must never raise at all.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import math
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from importlib import resources
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

import orjson

from base.errors import CommandRejected, ConfigError
from base.settings import SchedulerSettings
from topics.addresses import refused_literal
from topics.codes import Code
from topics.ids import MAX_EPOCH_MS, MIN_EPOCH_MS, format_iso_ms, parse_iso_ms
from topics.models import (
    HTTP_METHODS,
    Ambiguous,
    Callback,
    CancelCommand,
    Command,
    CommandType,
    CreateCommand,
    DayMatch,
    DeliveryRetry,
    HttpCallback,
    HttpMethod,
    KafkaCallback,
    Misfire,
    Nonexistent,
    PayloadType,
    Recurrence,
    UpdateCommand,
)

# The JSON envelope around a payload (ids, callback, headers) fits easily in this much.
ENVELOPE_BYTES = 16 * 1024
MAX_TIMEOUT_S = 300.0
MAX_URL_LEN = 2048
MAX_TENANT_LEN = 64
# misfire_tolerance_s is stored in a Cassandra ``int`` (signed 32 bit).
MAX_MISFIRE_TOLERANCE_S = 2**31 - 1
# orjson refuses to serialise deeper structures, so a deeper payload could be stored but
# never emitted again.
MAX_PAYLOAD_DEPTH = 254
MAX_TOPIC_LEN = 249  # Kafka's own limit on topic names
# A recurring schedule without misfire_tolerance_s: a run more than this late has misfired
# and its ``recurrence.misfire`` policy applies (Quartz's default misfire threshold).
RECURRING_DEFAULT_MISFIRE_TOLERANCE_S = 60
MAX_EVERY_S = 10 * 366 * 86_400
MAX_JITTER_S = 86_400
MAX_ZONE_LEN = 64


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Size bounds of commands; ``max_message_bytes`` None = room for a maximal payload."""

    max_payload_bytes: int = 64 * 1024
    default_misfire_tolerance_s: int = 3600
    max_message_bytes: int | None = None
    max_id_len: int = 256
    max_headers: int = 32
    max_header_bytes: int = 8 * 1024
    # False: a callback host that is a loopback, private, link-local or reserved IP literal
    # is rejected (invalid_url) at create and update; names are judged by the proxy once
    # resolved (topics.addresses).
    allow_private_targets: bool = False

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_id_len", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Limits.{name} must be positive, got {getattr(self, name)}")
        if self.max_headers < 0:
            raise ConfigError(f"Limits.max_headers must be >= 0, got {self.max_headers}")
        if not 0 <= self.default_misfire_tolerance_s <= MAX_MISFIRE_TOLERANCE_S:
            raise ConfigError(
                "Limits.default_misfire_tolerance_s must be within "
                f"0..{MAX_MISFIRE_TOLERANCE_S}, got {self.default_misfire_tolerance_s}"
            )
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ConfigError(
                f"Limits.max_message_bytes must be positive, got {self.max_message_bytes}"
            )

    @property
    def message_cap(self) -> int:
        """Bytes above which a message is rejected unparsed (``too_large``)."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        # A bytes payload travels as base64, 4/3 of its size.
        return -(-self.max_payload_bytes // 3) * 4 + ENVELOPE_BYTES

    @classmethod
    def from_settings(cls, scheduler: SchedulerSettings) -> Limits:
        return cls(
            max_payload_bytes=scheduler.max_payload_bytes,
            default_misfire_tolerance_s=scheduler.default_misfire_tolerance_s,
            allow_private_targets=scheduler.allow_private_targets,
        )


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Fields:
    """The top-level keys a JSON object may carry; anything else is rejected."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    # Computed once: every command and callback is checked against it.
    allowed: frozenset[str] = dataclass_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed", frozenset(self.required + self.optional))


# The single source of the command and callback shapes: the decoder enforces these and the
# unit tests compare them with schema/json/*.schema.json.
COMMAND_FIELDS: dict[CommandType, Fields] = {
    # Exactly one of due (one-shot) and recurrence (recurring) is required as well.
    CommandType.CREATE: Fields(
        required=("type", "tenant", "schedule_id", "callback"),
        optional=(
            "request_id",
            "reply_nonce",
            "due",
            "recurrence",
            "payload",
            "payload_b64",
            "order_key",
            "misfire_tolerance_s",
        ),
    ),
    CommandType.UPDATE: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=(
            "request_id",
            "reply_nonce",
            "due",
            "recurrence",
            "payload",
            "payload_b64",
            "callback",
        ),
    ),
    CommandType.CANCEL: Fields(
        required=("type", "tenant", "schedule_id"),
        optional=("request_id", "reply_nonce"),
    ),
}
RECURRENCE_FIELDS = Fields(
    required=(),
    optional=(
        "cron",
        "every_s",
        "start",
        "end",
        "max_runs",
        "time_zone",
        "nonexistent",
        "ambiguous",
        "jitter_s",
        "misfire",
        "day_match",
    ),
)
CALLBACK_FIELDS: dict[str, Fields] = {
    "http": Fields(
        required=("type", "url"), optional=("method", "headers", "timeout_s", "retry")
    ),
    "kafka": Fields(required=("type", "topic"), optional=("key", "retry")),
}
RETRY_FIELDS = Fields(required=(), optional=("max_retry_age_s", "retries_6xx"))
# Bounds of a callback's retry policy: ten years of retrying, a thousand 6xx retries.
MAX_RETRY_AGE_S = 10 * 366 * 86_400
MAX_RETRIES_6XX = 1000

_TENANT = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TENANT_LEN}}}", re.ASCII)
# C0/C1 controls, lone surrogates, line/paragraph separators and bidi overrides: ids end up
# in logs, Kafka keys and dashboards, where these corrupt or disguise what is shown.
_FORBIDDEN_CHAR = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_REPLY_NONCE = re.compile(r"[A-Za-z0-9_-]{16,128}", re.ASCII)
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


_COMMAND_TYPES = frozenset(t.value for t in CommandType)


class Salvaged(NamedTuple):
    tenant: str | None
    schedule_id: str | None
    request_id: str | None
    command: CommandType | None


def _show(value: object, limit: int = 64) -> str:
    """A short, escaped rendering of client data for messages (never the whole thing)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def load_object(raw: bytes) -> dict[str, Any]:
    """Parse JSON bytes that must hold an object (``malformed_json`` / ``not_an_object``)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CommandRejected(Code.MALFORMED_JSON, f"message is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CommandRejected(
            Code.NOT_AN_OBJECT, f"message must be a JSON object, got {_kind(obj)}"
        )
    return obj


def check_fields(
    obj: dict[str, Any], fields: Fields, *, where: str, code: Code = Code.INVALID_FIELD
) -> None:
    """Reject keys outside ``fields`` (typos would otherwise be silently ignored) and absent
    required keys (``missing_field`` at top level, ``code`` inside a nested object)."""
    unknown = [] if fields.allowed.issuperset(obj) else sorted(set(obj) - fields.allowed)
    if unknown:
        allowed = ", ".join(sorted(fields.allowed))
        raise CommandRejected(
            code, f"{where}: unknown field {_show(unknown[0])}; allowed: {allowed}"
        )
    for name in fields.required:
        if name not in obj:
            missing_code = Code.MISSING_FIELD if code == Code.INVALID_FIELD else code
            raise CommandRejected(missing_code, f"{where}: missing required field {name!r}")


def canonical_json(value: object) -> bytes:
    """The stored form of a JSON payload: compact, object keys sorted.

    Sorting makes equal values equal bytes, so an idempotent retry that re-serialised its
    payload in another key order is still a duplicate and not a conflict.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"payload cannot be stored as JSON ({exc}); it may nest at most "
            f"{MAX_PAYLOAD_DEPTH} levels deep",
        ) from None


def check_text(value: object, field: str, *, max_len: int, code: Code = Code.INVALID_FIELD) -> str:
    """An id-like string: non-empty, at most ``max_len`` UTF-8 bytes, no control chars."""
    if not isinstance(value, str):
        raise CommandRejected(code, f"{field} must be a string, got {_kind(value)}")
    if not value:
        raise CommandRejected(code, f"{field} must not be empty")
    bad = _FORBIDDEN_CHAR.search(value)
    if bad is not None:
        raise CommandRejected(
            code,
            f"{field} contains the control character U+{ord(bad.group()):04X} "
            f"at index {bad.start()}",
        )
    size = len(value.encode("utf-8"))
    if size > max_len:
        raise CommandRejected(code, f"{field} is {size} bytes long; at most {max_len} are allowed")
    return value


def check_tenant(value: object, field: str = "tenant") -> str:
    if not isinstance(value, str):
        raise CommandRejected(Code.INVALID_FIELD, f"{field} must be a string, got {_kind(value)}")
    if _TENANT.fullmatch(value) is None:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"{field} {_show(value)} must be 1-{MAX_TENANT_LEN} characters of A-Z a-z 0-9 . _ -",
        )
    return value


def _integer(value: object, field: str, code: Code) -> int:
    """An integer, also written as an integral float (1.7e12); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected(code, f"{field} must be an integer, got {_kind(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise CommandRejected(code, f"{field} must be an integer, got {value!r}")
        return int(value)
    return value


def parse_due(value: object, field: str = "due") -> int:
    """Epoch ms of a due time given as RFC 3339 text with offset or as integer epoch ms."""
    if isinstance(value, str):
        try:
            due_ms = parse_iso_ms(value)
        except ValueError as exc:
            raise CommandRejected(Code.INVALID_DUE, f"{field} {_show(value)}: {exc}") from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected(
            Code.INVALID_DUE,
            f"{field} must be an ISO-8601 string with an offset or integer epoch ms, "
            f"got {_kind(value)}",
        )
    else:
        due_ms = _integer(value, field, Code.INVALID_DUE)
    if not MIN_EPOCH_MS <= due_ms <= MAX_EPOCH_MS:
        raise CommandRejected(
            Code.INVALID_DUE,
            f"{field} {_show(value)} is outside {format_iso_ms(MIN_EPOCH_MS)} .. "
            f"{format_iso_ms(MAX_EPOCH_MS)} (epoch ms {MIN_EPOCH_MS}..{MAX_EPOCH_MS})",
        )
    return due_ms


def check_not_past(
    due_ms: int, *, now_ms: int, misfire_tolerance_s: int, field: str = "due"
) -> None:
    """``due_in_past`` unless ``due_ms`` is within the misfire tolerance of ``now_ms``.

    Exposed so the scheduler applies the same rule to an update's due with the schedule's
    stored tolerance, which the decoder cannot know.
    """
    oldest_ms = now_ms - misfire_tolerance_s * 1000
    if due_ms < oldest_ms:
        raise CommandRejected(
            Code.DUE_IN_PAST,
            f"{field} {_when(due_ms)} is more than misfire_tolerance_s={misfire_tolerance_s} "
            f"before now ({_when(now_ms)})",
        )


def _when(epoch_ms: int) -> str:
    if MIN_EPOCH_MS <= epoch_ms <= MAX_EPOCH_MS:
        return format_iso_ms(epoch_ms)
    return f"epoch ms {epoch_ms}"


def parse_payload(
    obj: dict[str, Any], *, max_bytes: int | None
) -> tuple[bytes, PayloadType] | tuple[None, None]:
    """The payload of a command or trigger object; ``(None, None)`` when it carries none.

    ``max_bytes`` None skips the size check: readers of triggers trust the scheduler's
    limit, which may be configured above their own.
    """
    has_json = "payload" in obj
    has_b64 = "payload_b64" in obj
    if has_json and has_b64:
        raise CommandRejected(Code.INVALID_FIELD, "give either payload or payload_b64, not both")
    if has_json:
        data = canonical_json(obj["payload"])
        kind = PayloadType.JSON
    elif has_b64:
        text = obj["payload_b64"]
        if not isinstance(text, str):
            raise CommandRejected(
                Code.INVALID_FIELD, f"payload_b64 must be a base64 string, got {_kind(text)}"
            )
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise CommandRejected(
                Code.INVALID_FIELD, f"payload_b64 is not standard padded base64 ({exc})"
            ) from None
        kind = PayloadType.BYTES
    else:
        return None, None
    if max_bytes is not None and len(data) > max_bytes:
        raise CommandRejected(
            Code.PAYLOAD_TOO_LARGE,
            f"{'payload' if has_json else 'payload_b64'} is {len(data)} bytes; "
            f"at most {max_bytes} are allowed",
        )
    return data, kind


def check_url(value: object, field: str = "callback.url") -> str:
    """An absolute http(s) URL with a host, no credentials, ASCII only, bounded."""
    if not isinstance(value, str):
        raise CommandRejected(Code.INVALID_URL, f"{field} must be a string, got {_kind(value)}")
    if len(value) > MAX_URL_LEN:
        raise CommandRejected(
            Code.INVALID_URL, f"{field} is {len(value)} characters; at most {MAX_URL_LEN}"
        )
    if _URL_CHARS.fullmatch(value) is None:
        raise CommandRejected(
            Code.INVALID_URL,
            f"{field} {_show(value)} must be non-empty printable ASCII without spaces "
            "(percent-encode the path, use punycode for the host)",
        )
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise CommandRejected(Code.INVALID_URL, f"{field} {_show(value)}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise CommandRejected(Code.INVALID_URL, f"{field} {_show(value)} must use http or https")
    if "@" in parts.netloc:
        raise CommandRejected(
            Code.INVALID_URL,
            f"{field} must not carry user info (credentials); send them in callback.headers",
        )
    host = parts.hostname
    if not host:
        raise CommandRejected(Code.INVALID_URL, f"{field} {_show(value)} has no host")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise CommandRejected(
                Code.INVALID_URL, f"{field} host {_show(host)} is not an IPv6 address"
            ) from None
    elif _HOSTNAME.fullmatch(host) is None:
        raise CommandRejected(
            Code.INVALID_URL, f"{field} host {_show(host)} is not a valid host name"
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


def _headers(value: object, *, limits: Limits, field: str) -> dict[str, str]:
    code = Code.INVALID_CALLBACK
    if not isinstance(value, dict):
        raise CommandRejected(code, f"{field} must be an object of strings, got {_kind(value)}")
    if len(value) > limits.max_headers:
        raise CommandRejected(
            code, f"{field} has {len(value)} entries; at most {limits.max_headers} are allowed"
        )
    seen: set[str] = set()
    total = 0
    for name, item in value.items():
        if not isinstance(name, str) or _HEADER_NAME.fullmatch(name) is None:
            raise CommandRejected(code, f"{field}: {_show(name)} is not a valid HTTP header name")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS:
            raise CommandRejected(
                code, f"{field}: {name!r} is set by the HTTP client and not allowed"
            )
        if lowered in seen:
            raise CommandRejected(code, f"{field}: {name!r} is given twice (names ignore case)")
        seen.add(lowered)
        if not isinstance(item, str):
            raise CommandRejected(code, f"{field}[{name!r}] must be a string, got {_kind(item)}")
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
        raise CommandRejected(code, f"{field} must be a number of seconds, got {_kind(value)}")
    timeout = float(value)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise CommandRejected(code, f"{field} must be > 0 and <= {MAX_TIMEOUT_S:g}, got {value!r}")
    return timeout


def _method(value: object, field: str) -> HttpMethod:
    if isinstance(value, str) and value in HTTP_METHODS:
        return cast(HttpMethod, value)
    raise CommandRejected(
        Code.INVALID_CALLBACK,
        f"{field} {_show(value)} must be one of {', '.join(sorted(HTTP_METHODS))}",
    )


def check_topic(value: object, field: str = "callback.topic") -> str:
    if not isinstance(value, str):
        raise CommandRejected(
            Code.INVALID_CALLBACK, f"{field} must be a string, got {_kind(value)}"
        )
    if _TOPIC.fullmatch(value) is None or value in (".", ".."):
        raise CommandRejected(
            Code.INVALID_CALLBACK,
            f"{field} {_show(value)} is not a legal Kafka topic name (1-{MAX_TOPIC_LEN} "
            "characters of A-Z a-z 0-9 . _ -, not '.' or '..')",
        )
    return value


def parse_callback(
    value: object, *, limits: Limits = DEFAULT_LIMITS, field: str = "callback"
) -> Callback:
    """An HTTP or Kafka callback from its JSON object (``invalid_callback`` / ``invalid_url``)."""
    code = Code.INVALID_CALLBACK
    if not isinstance(value, dict):
        raise CommandRejected(code, f"{field} must be an object, got {_kind(value)}")
    if "type" not in value:
        raise CommandRejected(code, f"{field}: missing required field 'type' ('http' or 'kafka')")
    kind = value["type"]
    if not isinstance(kind, str) or kind not in CALLBACK_FIELDS:
        raise CommandRejected(code, f"{field}.type must be 'http' or 'kafka', got {_show(kind)}")
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
        raise CommandRejected(code, f"{field} must be an object, got {_kind(value)}")
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


# -- recurrence ---------------------------------------------------------------------------

# Vixie cron's macros, as six fields (seconds first).
CRON_MACROS: dict[str, str] = {
    "@yearly": "0 0 0 1 1 *",
    "@annually": "0 0 0 1 1 *",
    "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *",
    "@midnight": "0 0 0 * * *",
    "@hourly": "0 0 * * * *",
}
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, lowest, highest, names) of the six fields, seconds first.
_CRON_FIELDS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("second", 0, 59, ()),
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
_CRON_ITEM = re.compile(r"(\*|[0-9a-z]+(?:-[0-9a-z]+)?)(?:/([0-9]+))?", re.ASCII)
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)  # February 29 exists


def _cron_value(text: str, low: int, names: tuple[str, ...], what: str, expr: str) -> int:
    if text.isdigit():
        return int(text)
    if text in names:
        return names.index(text) + (1 if low == 1 else 0)
    raise CommandRejected(
        Code.INVALID_FIELD, f"recurrence.cron {_show(expr)}: {text!r} is not a valid {what}"
    )


def _cron_field(
    text: str, spec: tuple[str, int, int, tuple[str, ...]], expr: str
) -> set[int]:
    """The values one field selects; rejects anything outside standard (Vixie) syntax."""
    what, low, high, names = spec
    values: set[int] = set()
    for item in text.split(","):
        match = _CRON_ITEM.fullmatch(item)
        if match is None:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"recurrence.cron {_show(expr)}: {item!r} in the {what} field is not standard "
                "cron syntax (numbers, names, *, ranges a-b, lists a,b and steps /n)",
            )
        base, step_text = match.groups()
        if base == "*":
            first, last = low, high
        elif "-" in base:
            a, b = base.split("-")
            first = _cron_value(a, low, names, what, expr)
            last = _cron_value(b, low, names, what, expr)
        else:
            first = last = _cron_value(base, low, names, what, expr)
            if step_text is not None:
                last = high  # "5/15" means "5-59/15", as in Vixie cron
        step = int(step_text) if step_text is not None else 1
        if not (low <= first <= last <= high) or step < 1:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"recurrence.cron {_show(expr)}: {item!r} is outside {low}-{high} for the "
                f"{what}, or not ascending",
            )
        values.update(range(first, last + 1, step))
    return values


def normalize_cron(value: object, *, day_match: DayMatch = DayMatch.ANY) -> str:
    """Six space-separated fields, seconds first, lower case; macros expanded.

    Accepts standard five-field cron (a seconds field of ``0`` is added), six fields with
    seconds first, and the macros of ``CRON_MACROS``. Rejects an expression that can never
    match (``0 0 30 2 *``; with ``day_match`` all also ``0 0 30 2 mon``).
    """
    if not isinstance(value, str):
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence.cron must be a string, got {_kind(value)}"
        )
    text = " ".join(value.lower().split())
    if text.startswith("@"):
        if text not in CRON_MACROS:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"recurrence.cron {_show(value)} is not one of {', '.join(CRON_MACROS)}",
            )
        text = CRON_MACROS[text]
    parts = text.split(" ")
    if len(parts) == 5:
        parts = ["0", *parts]
    if len(parts) != 6:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"recurrence.cron {_show(value)} must have 5 fields (minute hour day-of-month "
            "month day-of-week) or 6 (seconds first), or be a macro such as @hourly",
        )
    sets = [_cron_field(part, spec, value) for part, spec in zip(parts, _CRON_FIELDS, strict=True)]
    if 7 in sets[5] and not parts[5].startswith("*"):
        # Sunday may be written 7; croniter (seconds field) only takes 0-6.
        parts[5] = ",".join(str(d) for d in sorted({d % 7 for d in sets[5]}))
    days, months = sets[3], sets[4]
    # Vixie: both day fields restricted (neither starting with '*') means either matches,
    # unless the recurrence asks for both (day_match all).
    either = (
        day_match is DayMatch.ANY
        and not parts[3].startswith("*")
        and not parts[5].startswith("*")
    )
    if not either and not any(d <= _MONTH_DAYS[m - 1] for d in days for m in months):
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence.cron {_show(value)} never matches a real date"
        )
    return " ".join(parts)


def check_time_zone(value: object, field: str = "recurrence.time_zone") -> str:
    """An IANA zone name present in the pinned tzdata package (never the host's files)."""
    if not isinstance(value, str):
        raise CommandRejected(Code.INVALID_FIELD, f"{field} must be a string, got {_kind(value)}")
    parts = value.split("/")
    if (
        not 0 < len(value) <= MAX_ZONE_LEN
        or any(not p or p in (".", "..") or not _ZONE_PART.fullmatch(p) for p in parts)
        or not _zone_exists(value)
    ):
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"{field} {_show(value)} is not an IANA time zone name such as Europe/London",
        )
    return value


_ZONE_PART = re.compile(r"[A-Za-z0-9_+-]+", re.ASCII)


def _zone_exists(name: str) -> bool:
    try:
        node = resources.files("tzdata").joinpath("zoneinfo")
        for part in name.split("/"):
            node = node.joinpath(part)
        return node.is_file()
    except (ModuleNotFoundError, OSError):
        return False


def _choice(obj: dict[str, Any], name: str, default: str, allowed: frozenset[str]) -> str:
    value = obj.get(name, default)
    if not isinstance(value, str) or value not in allowed:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"recurrence.{name} {_show(value)} must be one of {', '.join(sorted(allowed))}",
        )
    return value


def _bounded(obj: dict[str, Any], name: str, low: int, high: int) -> int | None:
    if name not in obj:
        return None
    value = _integer(obj[name], f"recurrence.{name}", Code.INVALID_FIELD)
    if not low <= value <= high:
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence.{name} must be within {low}..{high}, got {value}"
        )
    return value


def parse_recurrence(value: object, *, now_ms: int) -> Recurrence:
    """The ``recurrence`` object of a create or update (``invalid_field`` naming the part)."""
    if not isinstance(value, dict):
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence must be an object, got {_kind(value)}"
        )
    check_fields(value, RECURRENCE_FIELDS, where="recurrence")
    if ("cron" in value) == ("every_s" in value):
        raise CommandRejected(
            Code.INVALID_FIELD, "recurrence needs exactly one of cron and every_s"
        )
    day_match = DayMatch(_choice(value, "day_match", "any", _DAY_MATCH))
    if day_match is DayMatch.ALL and "cron" not in value:
        raise CommandRejected(
            Code.INVALID_FIELD, "recurrence.day_match applies to cron expressions only"
        )
    cron = normalize_cron(value["cron"], day_match=day_match) if "cron" in value else None
    every_s = _bounded(value, "every_s", 1, MAX_EVERY_S)
    start_ms = parse_due(value["start"], "recurrence.start") if "start" in value else None
    end_ms = parse_due(value["end"], "recurrence.end") if "end" in value else None
    if end_ms is not None:
        if start_ms is not None and end_ms <= start_ms:
            raise CommandRejected(
                Code.INVALID_FIELD, "recurrence.end must be after recurrence.start"
            )
        if end_ms <= now_ms:
            raise CommandRejected(
                Code.DUE_IN_PAST, f"recurrence.end {_when(end_ms)} is not in the future"
            )
    return Recurrence(
        cron=cron,
        every_s=every_s,
        start_ms=start_ms,
        end_ms=end_ms,
        max_runs=_bounded(value, "max_runs", 1, MAX_MISFIRE_TOLERANCE_S),
        time_zone=check_time_zone(value["time_zone"]) if "time_zone" in value else "UTC",
        nonexistent=Nonexistent(_choice(value, "nonexistent", "skip", _NONEXISTENT)),
        ambiguous=Ambiguous(_choice(value, "ambiguous", "once", _AMBIGUOUS)),
        jitter_s=_bounded(value, "jitter_s", 0, MAX_JITTER_S) or 0,
        misfire=Misfire(_choice(value, "misfire", "fire_latest", _MISFIRE)),
        day_match=day_match,
    )


_NONEXISTENT = frozenset(m.value for m in Nonexistent)
_AMBIGUOUS = frozenset(m.value for m in Ambiguous)
_MISFIRE = frozenset(m.value for m in Misfire)
_DAY_MATCH = frozenset(m.value for m in DayMatch)


def _command_type(obj: dict[str, Any]) -> CommandType:
    if "type" not in obj:
        raise CommandRejected(Code.MISSING_FIELD, "missing required field 'type'")
    value = obj["type"]
    if not isinstance(value, str) or value not in _COMMAND_TYPES:
        raise CommandRejected(
            Code.UNKNOWN_COMMAND_TYPE,
            f"type {_show(value)} is not one of create, update, cancel",
        )
    return CommandType(value)


def _check_key(key: bytes | None, schedule_id: str) -> None:
    if key is not None and key != schedule_id.encode("utf-8"):
        raise CommandRejected(
            Code.KEY_MISMATCH,
            f"Kafka key {_show(key)} differs from schedule_id {_show(schedule_id)}; key "
            "commands by schedule_id so every command of a schedule shares a partition",
        )


def decode_command(raw: bytes, *, key: bytes | None, now_ms: int, limits: Limits) -> Command:
    """The command in a commands-topic message, or ``CommandRejected`` saying what is wrong.

    ``key`` is the Kafka message key; when given it must be the UTF-8 schedule id.
    """
    if len(raw) > limits.message_cap:
        raise CommandRejected(
            Code.TOO_LARGE,
            f"message is {len(raw)} bytes; at most {limits.message_cap} are accepted",
        )
    obj = load_object(raw)
    ctype = _command_type(obj)
    check_fields(obj, COMMAND_FIELDS[ctype], where=f"{ctype} command")
    if ctype is CommandType.CREATE and "due" not in obj and "recurrence" not in obj:
        raise CommandRejected(
            Code.MISSING_FIELD,
            "create command: missing required field 'due' (or 'recurrence' for a recurring "
            "schedule)",
        )
    tenant = check_tenant(obj["tenant"])
    schedule_id = check_text(obj["schedule_id"], "schedule_id", max_len=limits.max_id_len)
    _check_key(key, schedule_id)
    request_id = obj.get("request_id")
    if request_id is not None:
        request_id = check_text(request_id, "request_id", max_len=limits.max_id_len)
    nonce = check_reply_nonce(obj["reply_nonce"]) if "reply_nonce" in obj else None
    if ctype is CommandType.CANCEL:
        return CancelCommand(
            tenant=tenant, schedule_id=schedule_id, request_id=request_id, reply_nonce=nonce
        )
    if ctype is CommandType.CREATE:
        return _create(obj, tenant, schedule_id, request_id, nonce, now_ms=now_ms, limits=limits)
    return _update(obj, tenant, schedule_id, request_id, nonce, now_ms=now_ms, limits=limits)


def check_reply_nonce(value: object) -> str:
    """A command's ``reply_nonce``: 16-128 characters of ``A-Z a-z 0-9 _ -``. At least 16
    so a requester cannot pick one another producer could guess (the API sends 32 hex
    digits of 128 random bits)."""
    if not isinstance(value, str) or not _REPLY_NONCE.fullmatch(value):
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"reply_nonce must be 16-128 characters of A-Z a-z 0-9 _ -, got {_show(value)}",
        )
    return value


def _create(
    obj: dict[str, Any],
    tenant: str,
    schedule_id: str,
    request_id: str | None,
    reply_nonce: str | None,
    *,
    now_ms: int,
    limits: Limits,
) -> CreateCommand:
    recurrence = None
    if "recurrence" in obj:
        if "due" in obj:
            raise CommandRejected(
                Code.INVALID_FIELD,
                "give either due (a one-shot schedule) or recurrence, not both; a recurring "
                "schedule's first run is set by recurrence.start",
            )
        recurrence = parse_recurrence(obj["recurrence"], now_ms=now_ms)
        due_ms = 0
        tolerance = RECURRING_DEFAULT_MISFIRE_TOLERANCE_S
    else:
        due_ms = parse_due(obj["due"])
        tolerance = limits.default_misfire_tolerance_s
    if "misfire_tolerance_s" in obj:
        tolerance = _integer(obj["misfire_tolerance_s"], "misfire_tolerance_s", Code.INVALID_FIELD)
        if not 0 <= tolerance <= MAX_MISFIRE_TOLERANCE_S:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"misfire_tolerance_s must be within 0..{MAX_MISFIRE_TOLERANCE_S}, got {tolerance}",
            )
    if recurrence is None:
        check_not_past(due_ms, now_ms=now_ms, misfire_tolerance_s=tolerance)
    payload, payload_type = parse_payload(obj, max_bytes=limits.max_payload_bytes)
    callback = parse_callback(obj["callback"], limits=limits)
    check_target(callback, limits=limits)
    order_key = schedule_id
    if "order_key" in obj:
        order_key = check_text(obj["order_key"], "order_key", max_len=limits.max_id_len)
    return CreateCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        request_id=request_id,
        reply_nonce=reply_nonce,
        due_ms=due_ms,
        payload=b"" if payload is None else payload,
        payload_type=PayloadType.BYTES if payload_type is None else payload_type,
        callback=callback,
        order_key=order_key,
        misfire_tolerance_s=tolerance,
        recurrence=recurrence,
    )


def _update(
    obj: dict[str, Any],
    tenant: str,
    schedule_id: str,
    request_id: str | None,
    reply_nonce: str | None,
    *,
    now_ms: int,
    limits: Limits,
) -> UpdateCommand:
    if not any(
        name in obj for name in ("due", "recurrence", "payload", "payload_b64", "callback")
    ):
        raise CommandRejected(
            Code.NOTHING_TO_UPDATE,
            "an update must carry at least one of due, recurrence, payload, payload_b64, "
            "callback",
        )
    if "due" in obj and "recurrence" in obj:
        raise CommandRejected(
            Code.INVALID_FIELD,
            "give either due (a one-shot schedule) or recurrence (a recurring one), not both",
        )
    due_ms = parse_due(obj["due"]) if "due" in obj else None
    recurrence = (
        parse_recurrence(obj["recurrence"], now_ms=now_ms) if "recurrence" in obj else None
    )
    payload, payload_type = parse_payload(obj, max_bytes=limits.max_payload_bytes)
    callback = parse_callback(obj["callback"], limits=limits) if "callback" in obj else None
    if callback is not None:
        check_target(callback, limits=limits)
    return UpdateCommand(
        tenant=tenant,
        schedule_id=schedule_id,
        request_id=request_id,
        reply_nonce=reply_nonce,
        due_ms=due_ms,
        payload=payload,
        payload_type=payload_type,
        callback=callback,
        recurrence=recurrence,
    )


def _salvage_text(value: object) -> str | None:
    try:
        return check_text(value, "", max_len=DEFAULT_LIMITS.max_id_len)
    except CommandRejected:
        return None


def salvage_ids(raw: bytes, key: bytes | None) -> Salvaged:
    """Whatever ids a rejected message still yields, to correlate its rejection result.

    Best effort and total: never raises. Values that would not pass validation (too long,
    control characters, malformed tenant) come back as ``None`` rather than be echoed. The
    schedule id falls back to the Kafka key when the body does not give one.
    """
    tenant = schedule_id = request_id = None
    command = None
    try:
        obj = orjson.loads(raw)
    except Exception:  # any garbage at all: fall back to the key alone
        obj = None
    with contextlib.suppress(Exception):  # correlation is optional, the rejection is not
        if isinstance(obj, dict):
            raw_tenant = obj.get("tenant")
            if isinstance(raw_tenant, str) and _TENANT.fullmatch(raw_tenant):
                tenant = raw_tenant
            schedule_id = _salvage_text(obj.get("schedule_id"))
            request_id = _salvage_text(obj.get("request_id"))
            raw_type = obj.get("type")
            if isinstance(raw_type, str) and raw_type in _COMMAND_TYPES:
                command = CommandType(raw_type)
        if schedule_id is None and key is not None:
            schedule_id = _salvage_text(key.decode("utf-8"))
    return Salvaged(tenant=tenant, schedule_id=schedule_id, request_id=request_id, command=command)

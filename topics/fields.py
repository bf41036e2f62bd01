"""What every message shape shares: size limits, the allowed fields of a JSON object, and
the checks of single values (ids, tenant names, due times, payloads).

Each check raises ``CommandRejected(code, message)`` naming the offending field. Pure: no
I/O, no clock (``now_ms`` is passed in).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import orjson

from base.errors import CommandRejected, ConfigError
from base.settings import SchedulerSettings
from topics.codes import Code
from topics.ids import MAX_EPOCH_MS, MIN_EPOCH_MS, format_iso_ms, parse_iso_ms
from topics.models import PayloadType

# The JSON envelope around a payload (ids, callback, headers) fits easily in this much.
ENVELOPE_BYTES = 16 * 1024
MAX_TENANT_LEN = 64
# misfire_tolerance_s is stored in a Cassandra ``int`` (signed 32 bit).
MAX_MISFIRE_TOLERANCE_S = 2**31 - 1
# orjson refuses to serialise deeper structures, so a deeper payload could be stored but
# never emitted again.
MAX_PAYLOAD_DEPTH = 254


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


_TENANT = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TENANT_LEN}}}", re.ASCII)
# C0/C1 controls, lone surrogates, line/paragraph separators and bidi overrides: ids end up
# in logs, Kafka keys and dashboards, where these corrupt or disguise what is shown.
_FORBIDDEN_CHAR = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def show(value: object, limit: int = 64) -> str:
    """A short, escaped rendering of client data for messages (never the whole thing)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind_of(value: object) -> str:
    """What JSON type ``value`` is, for messages ("a string", "an array"...)."""
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


def load_object(raw: bytes) -> dict[str, object]:
    """Parse JSON bytes that must hold an object (``malformed_json`` / ``not_an_object``)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise CommandRejected(Code.MALFORMED_JSON, f"message is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CommandRejected(
            Code.NOT_AN_OBJECT, f"message must be a JSON object, got {kind_of(obj)}"
        )
    return obj


def check_fields(
    obj: dict[str, object], fields: Fields, *, where: str, code: Code = Code.INVALID_FIELD
) -> None:
    """Reject keys outside ``fields`` (typos would otherwise be silently ignored) and absent
    required keys (``missing_field`` at top level, ``code`` inside a nested object)."""
    unknown = [] if fields.allowed.issuperset(obj) else sorted(set(obj) - fields.allowed)
    if unknown:
        allowed = ", ".join(sorted(fields.allowed))
        raise CommandRejected(
            code, f"{where}: unknown field {show(unknown[0])}; allowed: {allowed}"
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
        raise CommandRejected(code, f"{field} must be a string, got {kind_of(value)}")
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
        raise CommandRejected(Code.INVALID_FIELD, f"{field} must be a string, got {kind_of(value)}")
    if _TENANT.fullmatch(value) is None:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"{field} {show(value)} must be 1-{MAX_TENANT_LEN} characters of A-Z a-z 0-9 . _ -",
        )
    return value


def integer(value: object, field: str, code: Code) -> int:
    """An integer, also written as an integral float (1.7e12); never a boolean."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected(code, f"{field} must be an integer, got {kind_of(value)}")
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
            raise CommandRejected(Code.INVALID_DUE, f"{field} {show(value)}: {exc}") from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected(
            Code.INVALID_DUE,
            f"{field} must be an ISO-8601 string with an offset or integer epoch ms, "
            f"got {kind_of(value)}",
        )
    else:
        due_ms = integer(value, field, Code.INVALID_DUE)
    if not MIN_EPOCH_MS <= due_ms <= MAX_EPOCH_MS:
        raise CommandRejected(
            Code.INVALID_DUE,
            f"{field} {show(value)} is outside {format_iso_ms(MIN_EPOCH_MS)} .. "
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
            f"{field} {when(due_ms)} is more than misfire_tolerance_s={misfire_tolerance_s} "
            f"before now ({when(now_ms)})",
        )


def when(epoch_ms: int) -> str:
    """An epoch-ms time for messages: ISO-8601 where it is in range."""
    if MIN_EPOCH_MS <= epoch_ms <= MAX_EPOCH_MS:
        return format_iso_ms(epoch_ms)
    return f"epoch ms {epoch_ms}"


def parse_payload(
    obj: dict[str, object], *, max_bytes: int | None
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
                Code.INVALID_FIELD, f"payload_b64 must be a base64 string, got {kind_of(text)}"
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

"""Stable identifiers and the one time format of the wire contract.

``trigger_id`` must never change: consumers deduplicate re-emitted triggers by it, and a
trigger re-emitted after a failover has to carry the id of its first emission. Times on the
wire are either integer epoch milliseconds or RFC 3339 strings (ISO-8601 with an explicit
offset); this module converts between them. Pure: must never do I/O or read the clock.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta, timezone

# Fixed forever: changing it would change every trigger id.
NAMESPACE = uuid.UUID("00656fcb-ba61-4d92-9ada-684def13749f")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)

MIN_EPOCH_MS = 0
# 9999-12-31T23:59:59.999Z, the last instant datetime (and most clients) can represent.
MAX_EPOCH_MS = 253_402_300_799_999

# RFC 3339 section 5.6 rather than ``datetime.fromisoformat``: the accepted syntax must not
# depend on the Python version, and fromisoformat also takes naive and non-ASCII forms.
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)


def trigger_id(tenant: str, schedule_id: str, due_ms: int) -> str:
    """The id of the trigger a schedule emits for ``due_ms``: 32 lowercase hex digits."""
    return uuid.uuid5(NAMESPACE, f"{tenant}/{schedule_id}/{due_ms}").hex


def parse_iso_ms(text: str) -> int:
    """Epoch ms of an RFC 3339 time such as ``2026-11-21T17:00:05Z`` or ``...+02:00``.

    Sub-millisecond digits are truncated towards the past. Raises ``ValueError`` (with a
    message fit for a client) on a naive time, another syntax, or an impossible date.
    """
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise ValueError(
            "expected an RFC 3339 time with an explicit offset, e.g. 2026-11-21T17:00:05Z "
            "or 2026-11-21T19:00:05.250+02:00"
        )
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if zulu:
        tz = UTC
    else:
        if int(off_h) > 23 or int(off_m) > 59:
            raise ValueError(f"offset {sign}{off_h}:{off_m} is out of range")
        offset = timedelta(hours=int(off_h), minutes=int(off_m))
        tz = timezone(-offset if sign == "-" else offset)
    try:
        moment = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=tz
        )
    except ValueError as exc:
        raise ValueError(f"not a real date/time: {exc}") from exc
    whole_ms = (moment - _EPOCH) // _MS
    frac_ms = int((fraction or "0").ljust(3, "0")[:3])
    return whole_ms + frac_ms


def format_iso_ms(epoch_ms: int) -> str:
    """RFC 3339 UTC form of epoch ms, always with three fraction digits so it sorts as text."""
    if not MIN_EPOCH_MS <= epoch_ms <= MAX_EPOCH_MS:
        raise ValueError(f"{epoch_ms} is outside {MIN_EPOCH_MS}..{MAX_EPOCH_MS}")
    moment = _EPOCH + timedelta(milliseconds=epoch_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"

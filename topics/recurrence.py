"""A recurring schedule's checks: its ``recurrence`` object, cron expressions (standard
Vixie syntax, seconds field optional) and IANA time zones from the pinned tzdata package.

Pure: ``now_ms`` is passed in, and zones are looked up in the installed tzdata package,
never the host's files.
"""

from __future__ import annotations

import re
from importlib import resources

from base.errors import CommandRejected
from topics.codes import Code
from topics.fields import (
    MAX_MISFIRE_TOLERANCE_S,
    Fields,
    check_fields,
    integer,
    kind_of,
    parse_due,
    show,
    when,
)
from topics.models import Ambiguous, DayMatch, Misfire, Nonexistent, Recurrence

# A recurring schedule without misfire_tolerance_s: a run more than this late has misfired
# and its ``recurrence.misfire`` policy applies (Quartz's default misfire threshold).
RECURRING_DEFAULT_MISFIRE_TOLERANCE_S = 60
MAX_EVERY_S = 10 * 366 * 86_400
MAX_JITTER_S = 86_400
MAX_ZONE_LEN = 64

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
        Code.INVALID_FIELD, f"recurrence.cron {show(expr)}: {text!r} is not a valid {what}"
    )


def _cron_field(text: str, spec: tuple[str, int, int, tuple[str, ...]], expr: str) -> set[int]:
    """The values one field selects; rejects anything outside standard (Vixie) syntax."""
    what, low, high, names = spec
    values: set[int] = set()
    for item in text.split(","):
        match = _CRON_ITEM.fullmatch(item)
        if match is None:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"recurrence.cron {show(expr)}: {item!r} in the {what} field is not standard "
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
                f"recurrence.cron {show(expr)}: {item!r} is outside {low}-{high} for the "
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
            Code.INVALID_FIELD, f"recurrence.cron must be a string, got {kind_of(value)}"
        )
    text = " ".join(value.lower().split())
    if text.startswith("@"):
        if text not in CRON_MACROS:
            raise CommandRejected(
                Code.INVALID_FIELD,
                f"recurrence.cron {show(value)} is not one of {', '.join(CRON_MACROS)}",
            )
        text = CRON_MACROS[text]
    parts = text.split(" ")
    if len(parts) == 5:
        parts = ["0", *parts]
    if len(parts) != 6:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"recurrence.cron {show(value)} must have 5 fields (minute hour day-of-month "
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
        day_match is DayMatch.ANY and not parts[3].startswith("*") and not parts[5].startswith("*")
    )
    if not either and not any(d <= _MONTH_DAYS[m - 1] for d in days for m in months):
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence.cron {show(value)} never matches a real date"
        )
    return " ".join(parts)


def check_time_zone(value: object, field: str = "recurrence.time_zone") -> str:
    """An IANA zone name present in the pinned tzdata package (never the host's files)."""
    if not isinstance(value, str):
        raise CommandRejected(Code.INVALID_FIELD, f"{field} must be a string, got {kind_of(value)}")
    parts = value.split("/")
    if (
        not 0 < len(value) <= MAX_ZONE_LEN
        or any(not p or p in (".", "..") or not _ZONE_PART.fullmatch(p) for p in parts)
        or not _zone_exists(value)
    ):
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"{field} {show(value)} is not an IANA time zone name such as Europe/London",
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


def _choice(obj: dict[str, object], name: str, default: str, allowed: frozenset[str]) -> str:
    value = obj.get(name, default)
    if not isinstance(value, str) or value not in allowed:
        raise CommandRejected(
            Code.INVALID_FIELD,
            f"recurrence.{name} {show(value)} must be one of {', '.join(sorted(allowed))}",
        )
    return value


def _bounded(obj: dict[str, object], name: str, low: int, high: int) -> int | None:
    if name not in obj:
        return None
    value = integer(obj[name], f"recurrence.{name}", Code.INVALID_FIELD)
    if not low <= value <= high:
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence.{name} must be within {low}..{high}, got {value}"
        )
    return value


def parse_recurrence(value: object, *, now_ms: int) -> Recurrence:
    """The ``recurrence`` object of a create or update (``invalid_field`` naming the part)."""
    if not isinstance(value, dict):
        raise CommandRejected(
            Code.INVALID_FIELD, f"recurrence must be an object, got {kind_of(value)}"
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
                Code.DUE_IN_PAST, f"recurrence.end {when(end_ms)} is not in the future"
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

"""go-scheduler's ``cronExpression`` read exactly as go-scheduler reads it, and written as
a Tocsin cron expression with the same matches (pure; used by api/goscheduler.py).

go-scheduler (``cron/cron.go``) matches five fields - minute hour day-of-month month
day-of-week - against the minute, with AND across all five, day fields included. Its
grammar differs from Vixie cron in places, and so do the values it selects:

* steps only in minute, hour and day-of-month, only as a whole field (``*/n`` or
  ``a/n``), no ``a-b/n`` and no step inside a list;
* ``a/n`` starts at the first multiple of ``n`` at or after ``a`` (``12/10`` in the
  minute field is 20, 30, 40, 50; Vixie cron: 12, 22, 32, 42, 52);
* day-of-month steps count from 0 and stop before 31 (``*/10`` is the 10th, 20th and
  30th; Vixie cron: 1, 11, 21, 31);
* month and weekday names (``JAN``, ``mon``; any case) only as whole list items, weekday
  0-6 (no 7), no ``?``, ``L``, ``W``, ``#`` or macros.

``translate`` returns the equivalent Tocsin expression and whether both day fields must
match (``DayMatch.ALL`` when both are restricted). As an extension, name ranges
(``MON-FRI``, ``jan-mar``) are accepted: go-scheduler's README shows them, its parser
refuses them. A field selecting nothing (``*/40`` as day of month, which go-scheduler
would treat as "every day") is refused rather than guessed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from topics.models import DayMatch

_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")


class GoCronError(ValueError):
    """The expression is not one go-scheduler accepts (the message says why)."""


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    steps: bool  # steps allowed (minute, hour, day of month)
    names: tuple[str, ...] = ()


_FIELDS = (
    _Field("minute", 0, 59, True),
    _Field("hour", 0, 23, True),
    _Field("day of month", 1, 31, True),
    _Field("month", 1, 12, False, _MONTHS),
    _Field("day of week", 0, 6, False, _DAYS),
)


@dataclass(frozen=True)
class Translated:
    cron: str  # five fields, Tocsin (Vixie) reading, numbers only
    day_match: DayMatch


def _int(text: str, spec: _Field) -> int:
    if not text.isdigit():
        raise GoCronError(f"{text!r} is not a number in the {spec.name} field")
    return int(text)


def _value(text: str, spec: _Field) -> int:
    upper = text.upper()
    if upper in spec.names:
        return spec.names.index(upper) + spec.low
    value = _int(text, spec)
    if not spec.low <= value <= spec.high:
        raise GoCronError(f"{text} is outside {spec.low}-{spec.high} in the {spec.name} field")
    return value


def _step(text: str, spec: _Field) -> set[int]:
    """``*/n`` or ``a/n`` the way go-scheduler's ParseStep reads it."""
    parts = text.split("/")
    if len(parts) != 2:
        raise GoCronError(f"{text!r} is not a valid step in the {spec.name} field")
    increment = _int(parts[1], spec)
    if increment < 1:
        raise GoCronError(f"the step of {text!r} must be at least 1")
    start = 0
    if parts[0] != "*":
        start = _int(parts[0], spec)
        start = (start + increment - 1) // increment * increment  # next multiple
    # go-scheduler's range end (exclusive): 60, 24, and 31 for days, whose 0 is dropped.
    end = spec.high + 1 if spec.low == 0 else spec.high
    if start > end:
        raise GoCronError(f"the start of {text!r} is beyond the {spec.name} range")
    return {v for v in range(start, end, increment) if v >= spec.low}


def _field(text: str, spec: _Field) -> set[int] | None:
    """The values a field selects, None for ``*`` (any)."""
    if text == "*":
        return None
    if "/" in text:
        if not spec.steps:
            raise GoCronError(f"go-scheduler allows no step in the {spec.name} field: {text!r}")
        values = _step(text, spec)
    else:
        values = set()
        for item in text.split(","):
            bounds = item.split("-")
            if len(bounds) == 1:
                values.add(_value(item, spec))
            elif len(bounds) == 2:
                first, last = _value(bounds[0], spec), _value(bounds[1], spec)
                if first > last:
                    raise GoCronError(f"the range {item!r} runs backwards ({spec.name})")
                values.update(range(first, last + 1))
            else:
                raise GoCronError(f"{item!r} is not a valid {spec.name}")
    if not values:
        raise GoCronError(
            f"{text!r} selects no {spec.name} (go-scheduler would read it as any); write * "
            "if that is meant"
        )
    return values


def _render(values: set[int] | None, spec: _Field) -> str:
    """Vixie text selecting exactly ``values``."""
    if values is None or values == set(range(spec.low, spec.high + 1)):
        return "*"
    ordered = sorted(values)
    if len(ordered) >= 3:
        step = ordered[1] - ordered[0]
        if all(b - a == step for a, b in itertools.pairwise(ordered)):
            if ordered == list(range(spec.low, spec.high + 1, step)):
                return f"*/{step}"
            if step == 1:
                return f"{ordered[0]}-{ordered[-1]}"
            return f"{ordered[0]}-{ordered[-1]}/{step}"
    parts: list[str] = []
    run = [ordered[0]]
    for value in ordered[1:]:
        if value == run[-1] + 1:
            run.append(value)
            continue
        parts.append(_span(run))
        run = [value]
    parts.append(_span(run))
    return ",".join(parts)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def translate(expression: object) -> Translated:
    """The Tocsin cron (five fields) and day rule matching what go-scheduler would match."""
    if not isinstance(expression, str):
        raise GoCronError("cronExpression must be a string")
    fields = expression.split()
    if len(fields) != 5:
        raise GoCronError(
            f"cronExpression {expression!r} must have 5 fields (minute hour day-of-month "
            "month day-of-week)"
        )
    values = [_field(text, spec) for text, spec in zip(fields, _FIELDS, strict=True)]
    day_match = DayMatch.ALL if values[2] is not None and values[4] is not None else DayMatch.ANY
    cron = " ".join(_render(v, spec) for v, spec in zip(values, _FIELDS, strict=True))
    return Translated(cron=cron, day_match=day_match)


def display(cron: str) -> str:
    """A stored (six-field, seconds first) cron as go-scheduler's five fields when its
    seconds field is 0, else all six (a schedule created with seconds through /v1)."""
    fields = cron.split(" ")
    return " ".join(fields[1:]) if len(fields) == 6 and fields[0] == "0" else cron


__all__ = ["GoCronError", "Translated", "display", "translate"]

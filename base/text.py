"""Text from outside shown on a terminal."""

from __future__ import annotations

import re

# Controls, line/paragraph separators, bidi overrides and lone surrogates: a terminal acts
# on them (or shows text other than what was recorded) instead of printing them.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with what a terminal would act on escaped (``\\x1b``, ``\\u202e``): a
    receiver's answer, which whoever runs the callback's endpoint chooses, reaches
    operators' terminals through dead letters and schedule histories."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)

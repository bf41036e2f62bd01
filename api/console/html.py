"""A few lines of HTML building with escaping by default: every value that is not ``Safe``
is escaped, so text from outside (schedule ids, payload excerpts, response bodies) can never
become markup. The console's pages are small enough not to need a template library."""

from __future__ import annotations

from collections.abc import Iterable
from html import escape


class Safe(str):
    """Markup built here (already escaped)."""


def esc(value: object) -> Safe:
    """``value`` as text inside HTML (``None`` is empty)."""
    if isinstance(value, Safe):
        return value
    if value is None:
        return Safe("")
    return Safe(escape(str(value), quote=True))


def join(parts: Iterable[object]) -> Safe:
    return Safe("".join(esc(p) for p in parts))


def tag(element: str, /, *content: object, **attrs: object) -> Safe:
    """``<name attrs>content</name>``; an attribute ``class_`` is ``class``, ``True`` is a bare
    attribute, ``None``/``False`` is left out; ``data_x`` is ``data-x``."""
    text = "".join(_attr(k, v) for k, v in attrs.items())
    body = "".join(_content(c) for c in content)
    return Safe(f"<{element}{text}>{body}</{element}>")


def void(element: str, /, **attrs: object) -> Safe:
    """An element without content (``input``, ``meta``; SVG's ``line``, which needs the
    closing slash: inside ``svg`` an unclosed element would hold the ones after it)."""
    return Safe(f"<{element}{''.join(_attr(k, v) for k, v in attrs.items())} />")


def _attr(key: str, value: object) -> str:
    name = key.rstrip("_").replace("_", "-")
    if value is None or value is False:
        return ""
    if value is True:
        return f" {name}"
    return f' {name}="{esc(value)}"'


def _content(value: object) -> str:
    if isinstance(value, str | int | float) or value is None:
        return esc(value)
    if isinstance(value, Iterable):
        return "".join(_content(v) for v in value)
    return esc(value)

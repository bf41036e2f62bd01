"""The console's pages as HTML, from data the routes (api/console/routes.py) read: pure
functions, no I/O. Every page has one h1, a skip link, labelled inputs and native controls
(links, buttons, forms), so it is used with a keyboard as with a mouse."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from api.console import charts
from api.console.health import Source, Summary, quantile
from api.console.html import Safe, join, tag, void
from topics.ids import format_iso_ms

STYLE = """
*{box-sizing:border-box}body{font:15px/1.45 system-ui,sans-serif;margin:0;color:#1b1f24;
background:#f6f7f9}a{color:#0b57d0}a:focus,button:focus,input:focus,select:focus{
outline:3px solid #f9ab00;outline-offset:1px}.skip{position:absolute;left:-999px}
.skip:focus{left:8px;top:8px;background:#fff;padding:6px;z-index:2}
header{background:#1b2a41;color:#fff;padding:0 16px;display:flex;align-items:center;gap:24px;
flex-wrap:wrap}header a{color:#fff;text-decoration:none;padding:12px 4px;display:inline-block}
header a[aria-current=page]{border-bottom:3px solid #f9ab00}header ul{list-style:none;margin:0;
padding:0;display:flex;gap:16px}.who{margin-left:auto;display:flex;gap:12px;align-items:center}
main{padding:16px 24px;max-width:1320px}h1{font-size:1.5rem;margin:8px 0 12px}
h2{font-size:1.15rem;margin:20px 0 8px}table{border-collapse:collapse;width:100%;
background:#fff}th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #dde1e6;
vertical-align:top}th{background:#eef1f4}td.num,th.num{text-align:right}
form.search{display:flex;flex-wrap:wrap;gap:10px 14px;align-items:end;background:#fff;
padding:12px;border:1px solid #dde1e6;margin-bottom:12px}label{display:flex;
flex-direction:column;font-size:.85rem;gap:2px}input,select,button{font:inherit;padding:5px 8px}
button{cursor:pointer;background:#0b57d0;color:#fff;border:1px solid #0b57d0;border-radius:4px}
button.secondary{background:#fff;color:#0b57d0}button.danger{background:#b3261e;
border-color:#b3261e}.actions{display:flex;gap:8px;flex-wrap:wrap;margin:8px 0}
.actions form{display:inline}.note{color:#555;font-size:.9rem}[role=status],[role=alert]{
padding:8px 12px;margin:8px 0;border-radius:4px}[role=status]{background:#e6f4ea}
[role=alert]{background:#fce8e6}dl.facts{display:grid;grid-template-columns:max-content 1fr;
gap:4px 16px;background:#fff;padding:12px;border:1px solid #dde1e6}dl.facts dt{font-weight:600}
dl.facts dd{margin:0}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(400px,1fr));
gap:16px}figure{margin:0;background:#fff;border:1px solid #dde1e6;padding:8px}
figcaption{font-weight:600}code{font-size:.9em}.state{font-weight:600}
pre{white-space:pre-wrap;background:#fff;border:1px solid #dde1e6;padding:8px;margin:0}
.sr{position:absolute;width:1px;height:1px;padding:0;margin:-1px;overflow:hidden;
clip:rect(0,0,0,0);white-space:nowrap;border:0}
"""


class Nav(StrEnum):
    """The console's sections (each a page in the header)."""

    SCHEDULES = "schedules"
    DEAD_LETTERS = "dead-letters"
    HEALTH = "health"
    TENANTS = "tenants"


NAV_TITLES = {
    Nav.SCHEDULES: "Schedules",
    Nav.DEAD_LETTERS: "Deliveries and dead letters",
    Nav.HEALTH: "Health",
    Nav.TENANTS: "Tenants",
}


@dataclass(frozen=True)
class Viewer:
    """Who looks: a tenant, or the admin (who picks a tenant on tenant pages)."""

    tenant: str | None
    admin: bool
    csrf: str


def url(path: str, **query: object) -> str:
    """``path`` with the non-empty ``query`` values."""
    q = {k: str(v) for k, v in query.items() if v not in (None, "")}
    return f"{path}?{urlencode(q)}" if q else path


def segment(value: object) -> str:
    """``value`` as one path segment: a tenant chooses its ids, and a '/' or '..' left as
    is would let one point the admin's button at another route (the browser removes dot
    segments before it posts); the routes decode %2F back into the id."""
    return quote(str(value), safe="")


def schedule_path(schedule_id: object) -> str:
    return f"/console/schedules/{segment(schedule_id)}"


def action_path(action: str, schedule_id: str) -> str:
    return f"/console/actions/{action}/{segment(schedule_id)}"


def _scope(viewer: Viewer, tenant: str) -> str | None:
    """The ``tenant`` query of the admin's links (a tenant key's tenant is its own)."""
    return tenant if viewer.admin else None


def csrf_field(viewer: Viewer) -> Safe:
    return void("input", type="hidden", name="csrf", value=viewer.csrf)


def post_button(
    viewer: Viewer, action: str, label: str, *, style: str = "", names: str | None = None
) -> Safe:
    """A one-button form; ``style``: '' (primary), 'secondary' or 'danger'; ``names``: its
    full accessible name where a page repeats the label (one Redrive per row)."""
    return tag(
        "form",
        csrf_field(viewer),
        tag("button", label, type="submit", class_=style or None, aria_label=names),
        method="post",
        action=action,
    )


def layout(
    title: str,
    body: object,
    *,
    viewer: Viewer | None,
    current: Nav | None = None,
    flash: str | None = None,
    error: str | None = None,
) -> Safe:
    header = _header(viewer, current) if viewer else tag("header", tag("span", "Tocsin console"))
    notices = []
    if flash:
        notices.append(tag("p", flash, role="status"))
    if error:
        notices.append(tag("p", error, role="alert"))
    doc = tag(
        "html",
        tag(
            "head",
            void("meta", charset="utf-8"),
            void("meta", name="viewport", content="width=device-width, initial-scale=1"),
            tag("title", f"{title} · Tocsin console"),
            tag("style", Safe(STYLE)),
        ),
        tag(
            "body",
            tag("a", "Skip to content", href="#main", class_="skip"),
            header,
            tag("main", tag("h1", title), notices, body, id="main", tabindex="-1"),
        ),
        lang="en",
    )
    return Safe("<!doctype html>" + doc)


def _header(viewer: Viewer, current: Nav | None) -> Safe:
    items = [n for n in Nav if n is not Nav.TENANTS or viewer.admin]
    links = [
        tag(
            "li",
            tag(
                "a",
                NAV_TITLES[n],
                href=f"/console/{n.value}",
                aria_current="page" if n is current else None,
            ),
        )
        for n in items
    ]
    who = "admin" if viewer.admin else f"tenant {viewer.tenant}"
    return tag(
        "header",
        tag("strong", "Tocsin console"),
        tag("nav", tag("ul", links), aria_label="Sections"),
        tag(
            "div",
            tag("span", f"Signed in as {who}"),
            post_button(viewer, "/console/logout", "Sign out", style="secondary"),
            class_="who",
        ),
    )


def error_page(title: str, message: str) -> Safe:
    back = tag("p", tag("a", "Back to the console", href="/console"))
    return layout(title, back, viewer=None, error=message)


def login_page(error: str | None = None) -> Safe:
    form = tag(
        "form",
        tag(
            "label",
            "API key (a tenant key, or the admin key)",
            void(
                "input",
                type="password",
                name="key",
                id="key",
                required=True,
                autocomplete="current-password",
                autofocus=True,
                size="60",
            ),
        ),
        tag("p", tag("button", "Sign in", type="submit")),
        method="post",
        action="/console/login",
    )
    note = tag(
        "p",
        "The key is kept in an HttpOnly, SameSite=Strict cookie for this console only; "
        "signing out removes it.",
        class_="note",
    )
    return layout("Sign in", [form, note], viewer=None, error=error)


# -- schedules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """The schedule search form's values, as given (strings)."""

    tenant: str = ""
    id_prefix: str = ""
    status: str = ""
    from_: str = ""
    to: str = ""
    order_key: str = ""


STATUS_CHOICES = (
    "",
    "scheduled",
    "paused",
    "fired",
    "missed",
    "cancelled",
    "delivered",
    "dead_lettered",
    "completed",
)


def _input(label: str, name: str, value: str, *, hint: str = "", kind: str = "text") -> Safe:
    return tag(
        "label",
        label,
        void("input", type=kind, name=name, id=f"f-{name}", value=value, placeholder=hint or None),
    )


def _select(label: str, name: str, value: str, choices: Sequence[str], blank: str) -> Safe:
    opts = [tag("option", c or blank, value=c, selected=(c == value) or None) for c in choices]
    return tag("label", label, tag("select", opts, name=name, id=f"f-{name}"))


def tenant_picker(viewer: Viewer, tenants: Sequence[str], chosen: str) -> Safe:
    if not viewer.admin:
        return Safe("")
    return _select("Tenant", "tenant", chosen, ["", *tenants], "(choose a tenant)")


def search_form(viewer: Viewer, s: Search, tenants: Sequence[str]) -> Safe:
    return tag(
        "form",
        tag("h2", "Search", class_="sr"),
        tenant_picker(viewer, tenants, s.tenant),
        _input("Id prefix", "id_prefix", s.id_prefix),
        _select("State", "status", s.status, STATUS_CHOICES, "(any)"),
        _input("Due from", "from", s.from_, hint="RFC 3339 or epoch ms"),
        _input("Due before", "to", s.to, hint="default: 30 days after"),
        _input("Order key", "order_key", s.order_key),
        tag("button", "Search", type="submit"),
        method="get",
        action="/console/schedules",
        class_="search",
        role="search",
        aria_label="Schedules",
    )


def _delivery(d: object) -> str:
    if not isinstance(d, Mapping):
        return ""
    code = d.get("status_code")
    return f"{d.get('outcome')} ({code})" if code is not None else str(d.get("outcome"))


def schedules_page(
    viewer: Viewer,
    s: Search,
    tenants: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    *,
    window: str,
    more: str | None,
    error: str | None = None,
    flash: str | None = None,
) -> Safe:
    head = tag(
        "tr",
        [tag("th", h, scope="col") for h in ("Schedule", "State", "Due", "Order key", "Delivery")],
    )
    body = [
        tag(
            "tr",
            tag(
                "td",
                tag(
                    "a",
                    r["schedule_id"],
                    href=url(schedule_path(r["schedule_id"]), tenant=s.tenant),
                ),
            ),
            tag(
                "td", r.get("status"), " (recurring)" if r.get("recurring") else "", class_="state"
            ),
            tag("td", r.get("due")),
            tag("td", r.get("order_key")),
            tag("td", _delivery(r.get("delivery"))),
        )
        for r in rows
    ]
    table: object = (
        tag("table", tag("caption", f"{len(rows)} schedule(s), due {window}"), head, body)
        if rows
        else tag("p", f"No schedule matches (due {window}).")
    )
    pager = tag("p", tag("a", "More results", href=more)) if more else ""
    need = (
        tag("p", "Choose a tenant to list its schedules.", class_="note")
        if viewer.admin and not s.tenant
        else ""
    )
    note = tag(
        "p",
        "Schedules carry no labels in Tocsin; search by id prefix (names such as "
        "team/job-... make prefixes work as labels) and order key.",
        class_="note",
    )
    return layout(
        "Schedules",
        [search_form(viewer, s, tenants), need, table, pager, note],
        viewer=viewer,
        current=Nav.SCHEDULES,
        error=error,
        flash=flash,
    )


@dataclass(frozen=True)
class Actions:
    """Which schedule actions this API serves (each button posts to a route that exists)."""

    pause: bool
    trigger: bool


def _facts(doc: Mapping[str, Any]) -> Safe:
    rec = doc.get("recurrence")
    pairs: list[tuple[str, object]] = [
        ("State", doc.get("status")),
        ("Kind", "recurring" if doc.get("recurring") else "one-shot"),
        ("Due" if not doc.get("recurring") else "Next run", doc.get("due") or "none left"),
        ("Recurrence", join([str(rec)]) if rec else None),
        ("Order key", doc.get("order_key")),
        ("Misfire tolerance", f"{doc.get('misfire_tolerance_s')} s"),
        ("Callback", _callback(doc.get("callback"))),
        ("Delivery", _delivery(doc.get("delivery")) or None),
    ]
    items = [(tag("dt", k), tag("dd", v)) for k, v in pairs if v not in (None, "")]
    return tag("dl", items, class_="facts")


def _callback(cb: object) -> str:
    if not isinstance(cb, Mapping):
        return ""
    return str(cb.get("url") or cb.get("topic") or cb.get("type") or "")


def _actions(viewer: Viewer, sid: str, tenant: str, state: str, can: Actions) -> Safe:
    buttons = []
    live = state not in ("cancelled", "completed", "fired", "missed")
    if can.pause and state == "paused":
        buttons.append(
            post_button(
                viewer, url(action_path("resume", sid), tenant=_scope(viewer, tenant)), "Resume"
            )
        )
    elif can.pause and live:
        buttons.append(
            post_button(
                viewer,
                url(action_path("pause", sid), tenant=_scope(viewer, tenant)),
                "Pause",
                style="secondary",
            )
        )
    if can.trigger and state != "cancelled":
        buttons.append(
            post_button(
                viewer,
                url(action_path("trigger", sid), tenant=_scope(viewer, tenant)),
                "Trigger now",
                style="secondary",
            )
        )
    if live or state == "paused":
        buttons.append(
            post_button(
                viewer,
                url(action_path("cancel", sid), tenant=_scope(viewer, tenant)),
                "Cancel schedule",
                style="danger",
            )
        )
    if not buttons:
        return tag("p", "No action applies in this state.", class_="note")
    return tag("div", buttons, class_="actions", role="group", aria_label="Actions")


def _runs_table(caption: str, runs: Sequence[Mapping[str, Any]]) -> Safe:
    if not runs:
        return tag("p", f"{caption}: none.")
    head = tag("tr", [tag("th", h, scope="col") for h in ("Run", "Nominal time", "State")])
    body = [
        tag(
            "tr",
            tag("td", r.get("run_id")),
            tag("td", r.get("nominal") or r.get("due")),
            tag("td", r.get("status")),
        )
        for r in runs
    ]
    return tag("table", tag("caption", caption), head, body)


def _timeline(explained: Mapping[str, Any]) -> Safe:
    entries = explained.get("timeline") or []
    head = tag("tr", [tag("th", h, scope="col") for h in ("When", "Event", "Run", "What")])
    body = [
        tag(
            "tr",
            tag("td", e.get("at")),
            tag("td", e.get("event")),
            tag("td", e.get("schedule_id")),
            tag("td", e.get("text") or e.get("detail")),
        )
        for e in entries
    ]
    parts: list[object] = [
        tag("p", tag("strong", "Why: "), explained.get("reason"), id="why"),
        tag("table", tag("caption", "Timeline, oldest first"), head, body, id="timeline"),
    ]
    notes = list(explained.get("notes") or [])
    if notes:
        parts.append(tag("ul", [tag("li", n) for n in notes], class_="note"))
    missing = explained.get("not_recorded") or []
    if missing:
        parts.append(
            tag(
                "details",
                tag("summary", "What this view cannot show"),
                tag("ul", [tag("li", n) for n in missing]),
            )
        )
    return join(parts)


def schedule_page(
    viewer: Viewer,
    tenant: str,
    doc: Mapping[str, Any],
    explained: Mapping[str, Any],
    can: Actions,
    *,
    flash: str | None = None,
    error: str | None = None,
) -> Safe:
    sid = str(doc["schedule_id"])
    parts: list[object] = [
        tag(
            "p",
            tag(
                "a",
                "← All schedules",
                href=url("/console/schedules", tenant=_scope(viewer, tenant)),
            ),
        ),
        _facts(doc),
        tag("h2", "Actions"),
        _actions(viewer, sid, tenant, str(doc.get("status")), can),
    ]
    if doc.get("recurring"):
        runs = doc.get("runs") or {}
        parts += [
            tag("h2", "Next runs"),
            _runs_table("Next runs", runs.get("next") or []),
            tag("h2", "Recent runs"),
            _runs_table("Newest runs first", runs.get("past") or []),
        ]
    parts += [tag("h2", "Why did it (not) fire?"), _timeline(explained)]
    return layout(
        f"Schedule {sid}",
        parts,
        viewer=viewer,
        current=Nav.SCHEDULES,
        flash=flash,
        error=error,
    )


def not_found_page(viewer: Viewer, what: str) -> Safe:
    return layout(
        "Not found",
        tag("p", f"No {what}."),
        viewer=viewer,
        current=Nav.SCHEDULES,
    )


# -- dead letters ------------------------------------------------------------------------


def endpoint_host(endpoint: object) -> str:
    """The host of a dead letter's endpoint (a URL, or a Kafka topic as is)."""
    text = str(endpoint or "")
    return urlsplit(text).hostname or text or "(none)"


def failures_by_host(letters: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, int]]:
    """(host, status code, dead letters) for the listed ones, most first."""
    counts: dict[tuple[str, str], int] = {}
    for d in letters:
        resp = d.get("response")
        code = str(resp.get("status_code")) if isinstance(resp, Mapping) else "no response"
        key = (endpoint_host(d.get("endpoint")), code)
        counts[key] = counts.get(key, 0) + 1
    return sorted(((h, c, n) for (h, c), n in counts.items()), key=lambda t: (-t[2], t[0], t[1]))


def _letter_row(viewer: Viewer, tenant: str, d: Mapping[str, Any]) -> Safe:
    resp = d.get("response")
    code = resp.get("status_code") if isinstance(resp, Mapping) else None
    excerpt = resp.get("body_excerpt") if isinstance(resp, Mapping) else None
    red = d.get("redriven")
    tid = str(d["trigger_id"])
    action: object = (
        f"redriven {red.get('at')}"
        if isinstance(red, Mapping)
        else post_button(
            viewer,
            url(f"/console/dead-letters/{segment(tid)}/redrive", tenant=_scope(viewer, tenant)),
            "Redrive",
            names=f"Redrive {d.get('schedule_id')} (trigger {tid})",
        )
    )
    return tag(
        "tr",
        tag("td", d.get("dead_lettered_at")),
        tag(
            "td",
            tag(
                "a",
                d.get("schedule_id"),
                href=url(schedule_path(d.get("schedule_id")), tenant=_scope(viewer, tenant)),
            ),
        ),
        tag("td", endpoint_host(d.get("endpoint"))),
        tag("td", code, class_="num"),
        tag(
            "td",
            d.get("reason"),
            Safe("<br>") if excerpt else "",
            tag("code", excerpt) if excerpt else "",
        ),
        tag("td", d.get("attempts"), class_="num"),
        tag("td", action),
    )


def dead_letters_page(
    viewer: Viewer,
    tenant: str,
    tenants: Sequence[str],
    letters: Sequence[Mapping[str, Any]],
    *,
    window: str,
    flash: str | None = None,
    error: str | None = None,
    truncated: bool = False,
) -> Safe:
    """``truncated``: the window holds more dead letters than the ``letters`` listed."""
    parts: list[object] = []
    if viewer.admin:
        parts.append(
            tag(
                "form",
                tenant_picker(viewer, tenants, tenant),
                tag("button", "Show", type="submit"),
                method="get",
                action="/console/dead-letters",
                class_="search",
            )
        )
    grouped = failures_by_host(letters)
    parts.append(tag("h2", f"Recent failures by endpoint host and status code ({window})"))
    if truncated:
        parts.append(
            tag(
                "p",
                f"The window may hold more: only the newest {len(letters)} are listed and counted "
                "(GET /v1/dead-letters pages through them all).",
                role="status",
            )
        )
    if grouped:
        head = tag(
            "tr", [tag("th", h, scope="col") for h in ("Host", "Status code", "Dead letters")]
        )
        body = [
            tag("tr", tag("td", h), tag("td", c), tag("td", n, class_="num")) for h, c, n in grouped
        ]
        parts.append(tag("table", head, body, id="by-host"))
    else:
        parts.append(tag("p", "No dead letters in this window."))
    if letters:
        cols = ("Dead-lettered", "Schedule", "Host", "Status", "Reason", "Attempts", "Redrive")
        head = tag("tr", [tag("th", h, scope="col") for h in cols])
        rows = [_letter_row(viewer, tenant, d) for d in letters]
        parts += [tag("h2", "Dead letters, newest first"), tag("table", head, rows, id="letters")]
    return layout(
        "Deliveries and dead letters",
        parts,
        viewer=viewer,
        current=Nav.DEAD_LETTERS,
        flash=flash,
        error=error,
    )


# -- health ------------------------------------------------------------------------------


def _fmt(value: float | None, unit: str = "", scale: float = 1.0) -> str:
    if value is None:
        return "no data"
    return f"{value * scale:,.1f}{unit}" if value * scale < 100 else f"{value * scale:,.0f}{unit}"


def health_page(
    viewer: Viewer,
    summary: Summary,
    sources: Sequence[Source],
    quotas: Mapping[str, int],
) -> Safe:
    if not sources:
        body = tag(
            "p",
            "No metrics are read: set TOCSIN_API_METRICS_URLS to the workers' and proxies' "
            "/metrics URLs (comma-separated) and restart the API.",
            role="alert",
        )
        return layout("Health", body, viewer=viewer, current=Nav.HEALTH)
    pts = summary.points
    fire_p50 = quantile(0.5, summary.fire_lateness)
    fire_p99 = quantile(0.99, summary.fire_lateness)
    del_p50 = quantile(0.5, summary.delivery)
    del_p99 = quantile(0.99, summary.delivery)
    fires_last = sum(p.fires for p in pts[-2:-1]) if len(pts) > 1 else 0.0
    now_rows = [
        ("Fires in the last full minute", _fmt(fires_last)),
        (
            "Fire lateness p50 / p99 (hour)",
            f"{_fmt(fire_p50, ' ms', 1000)} / {_fmt(fire_p99, ' ms', 1000)}",
        ),
        (
            "Delivery time p50 / p99 (hour)",
            f"{_fmt(del_p50, ' ms', 1000)} / {_fmt(del_p99, ' ms', 1000)}",
        ),
        ("Commands topic consumer lag", _fmt(summary.commands_lag, " messages")),
        ("Fires topic: read, not committed", _fmt(summary.fires_lag, " messages")),
    ]
    table = tag(
        "table",
        tag("caption", "Now"),
        [tag("tr", tag("th", k, scope="row"), tag("td", v, class_="num")) for k, v in now_rows],
        id="now",
    )
    minutes = [p.minute_ms for p in pts]
    grid = tag(
        "div",
        charts.line_chart("Fires per minute", minutes, {"fires": [p.fires for p in pts]}, unit=""),
        charts.line_chart(
            "Fire lateness (ms), per minute",
            minutes,
            {
                "p50": [_q_ms(0.5, p.fire_lateness) for p in pts],
                "p99": [_q_ms(0.99, p.fire_lateness) for p in pts],
            },
            unit=" ms",
        ),
        charts.line_chart(
            "Delivery time, read to outcome (ms), per minute",
            minutes,
            {
                "p50": [_q_ms(0.5, p.delivery) for p in pts],
                "p99": [_q_ms(0.99, p.delivery) for p in pts],
            },
            unit=" ms",
        ),
        charts.line_chart(
            "Consumer lag (messages)",
            minutes,
            {
                "commands": [p.commands_lag for p in pts],
                "fires (uncommitted)": [p.fires_lag for p in pts],
            },
            unit="",
        ),
        class_="grid",
    )
    return layout(
        "Health",
        [table, tag("h2", "Last hour"), grid, _quota_table(summary, quotas), _sources(sources)],
        viewer=viewer,
        current=Nav.HEALTH,
    )


def _q_ms(q: float, hist: Any) -> float | None:
    v = quantile(q, hist)
    return None if v is None else v * 1000


def _quota_table(summary: Summary, quotas: Mapping[str, int]) -> Safe:
    names = sorted(set(quotas) | set(summary.throttled))
    head = tag(
        "tr",
        [
            tag("th", h, scope="col")
            for h in ("Tenant", "Fire quota (fires/min)", "Fires deferred by the quota (hour)")
        ],
    )
    body = [
        tag(
            "tr",
            tag("td", n),
            tag("td", quotas.get(n) or "unlimited", class_="num"),
            tag("td", f"{summary.throttled.get(n, 0.0):,.0f}", class_="num"),
        )
        for n in names
    ]
    note = tag(
        "p",
        "The worker counts fires deferred by a tenant's quota, not each tenant's fires, so "
        "a quota's use shows as deferrals: any number above 0 means the tenant hit its quota.",
        class_="note",
    )
    return join([tag("h2", "Quotas by tenant"), tag("table", head, body, id="quotas"), note])


def _sources(sources: Sequence[Source]) -> Safe:
    rows = [
        tag(
            "tr",
            tag("td", tag("code", s.url)),
            tag("td", s.error or "ok"),
            tag("td", len(s.ring), class_="num"),
        )
        for s in sources
    ]
    head = tag(
        "tr", [tag("th", h, scope="col") for h in ("Metrics URL", "Last read", "Samples kept")]
    )
    return join([tag("h2", "Sources"), tag("table", head, rows, id="sources")])


# -- tenants -----------------------------------------------------------------------------


def tenants_page(
    viewer: Viewer,
    tenants: Sequence[Mapping[str, Any]],
    keys: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    new_key: Mapping[str, str] | None = None,
    flash: str | None = None,
    error: str | None = None,
) -> Safe:
    parts: list[object] = []
    if new_key:
        parts.append(
            tag(
                "div",
                tag("p", f"New key for {new_key.get('tenant')} (shown once; copy it now):"),
                tag("pre", new_key.get("api_key"), id="new-key"),
                role="status",
            )
        )
    parts.append(tag("p", f"{len(tenants)} tenant(s)."))
    for t in tenants:
        parts.append(_tenant_section(viewer, t, keys.get(str(t["tenant"]), ())))
    return layout("Tenants", parts, viewer=viewer, current=Nav.TENANTS, flash=flash, error=error)


def _tenant_section(
    viewer: Viewer, t: Mapping[str, Any], keys: Sequence[Mapping[str, Any]]
) -> Safe:
    name = str(t["tenant"])
    cfg = t.get("config") or {}
    slug = "".join(c if c.isalnum() else "-" for c in name)
    hosts = ", ".join(cfg.get("allowed_callback_hosts") or [])
    form = tag(
        "form",
        csrf_field(viewer),
        tag(
            "label",
            "Fire quota (fires/min, 0 = unlimited)",
            void(
                "input",
                type="number",
                min="0",
                name="fire_quota_per_min",
                value=cfg.get("fire_quota_per_min", 0),
            ),
        ),
        tag(
            "label",
            "Create quota (commands/s, 0 = unlimited)",
            void(
                "input",
                type="number",
                min="0",
                step="any",
                name="create_quota_per_s",
                value=cfg.get("create_quota_per_s", 0),
            ),
        ),
        tag(
            "label",
            "Allowed callback hosts (comma-separated; empty = any public host)",
            void("input", type="text", name="allowed_callback_hosts", value=hosts, size="50"),
        ),
        tag("button", "Save", type="submit", aria_label=f"Save {name}"),
        method="post",
        action=f"/console/tenants/{segment(name)}",
        class_="search",
        aria_label=f"Quotas and hosts of {name}",
    )
    key_rows = [
        tag(
            "tr",
            tag("td", tag("code", k.get("key_id"))),
            tag("td", format_iso_ms(int(k["created_ms"])) if k.get("created_ms") else ""),
            tag("td", "revoked" if k.get("revoked") else "active"),
            tag(
                "td",
                ""
                if k.get("revoked")
                else post_button(
                    viewer,
                    f"/console/tenants/{segment(name)}/keys/{segment(k.get('key_id'))}/revoke",
                    "Revoke",
                    style="danger",
                    names=f"Revoke key {k.get('key_id')} of {name}",
                ),
            ),
        )
        for k in keys
    ]
    head = tag("tr", [tag("th", h, scope="col") for h in ("Key id", "Created", "State", "Action")])
    return tag(
        "section",
        tag(
            "h2",
            name,
            " ",
            tag("span", "(active)" if t.get("active") else "(inactive)", class_="note"),
        ),
        form,
        tag("table", tag("caption", f"API keys of {name}"), head, key_rows),
        tag(
            "div",
            post_button(
                viewer,
                f"/console/tenants/{segment(name)}/keys",
                "Issue a new key",
                names=f"Issue a new key for {name}",
            ),
            tag(
                "span",
                "Rotate: issue a new key, move clients to it, then revoke the old one.",
                class_="note",
            ),
            class_="actions",
        ),
        id=f"tenant-{slug}",
        aria_label=name,
    )


def tenant_health_page(
    viewer: Viewer, tenant: str, quota: int, throttled: Mapping[str, float], scraped: bool
) -> Safe:
    """A tenant's Health page: its own quota only (the deployment's charts count every
    tenant's traffic, so they are the admin's)."""
    rows = [
        ("Fire quota", f"{quota:,} fires/min" if quota else "unlimited"),
        (
            "Fires deferred by the quota in the last hour",
            f"{throttled.get(tenant, 0.0):,.0f}" if scraped else "not measured (no metrics read)",
        ),
    ]
    table = tag(
        "table",
        tag("caption", f"Tenant {tenant}"),
        [tag("tr", tag("th", k, scope="row"), tag("td", v)) for k, v in rows],
        id="quotas",
    )
    note = tag(
        "p",
        "Fires per minute, lateness and consumer lag are the deployment's, with every "
        "tenant's traffic in them: they are shown to the admin key.",
        class_="note",
    )
    return layout("Health", [table, note], viewer=viewer, current=Nav.HEALTH)

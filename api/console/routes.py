"""``/console``: the operators' web console, served by ``tocsin api`` (docs/api.md,
'Web console'). Server-rendered pages over the same service calls as the REST routes,
with the same authentication: the API key, given once on the sign-in form, is kept in an
HttpOnly, SameSite=Strict cookie scoped to /console, and every page authenticates it again
(a revoked key or deactivated tenant is out at its next click). A tenant key sees its own
tenant only: the tenant of every read and action is the key's, never one the request
names, and another tenant's schedule is answered exactly like a missing one. The admin key
sees every tenant (picked on the page), the deployment's health and the tenants page.

Actions are POSTs carrying a token derived from the key (an attacker's page has neither
the cookie - SameSite=Strict - nor the token) and are refused unless Origin, or without
it Referer, names this host."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from api import explain, recurring, recurring_io, views
from api.console import pages
from api.console.health import Scraper
from api.console.pages import Actions, Search, Viewer, url
from api.deadletter_routes import dead_letters
from api.deadletters import dead_letter_view
from api.service import Principal, Service
from api.views import ApiError
from base.clock import now_ms
from base.errors import TocsinError
from streams import tenant_admin
from streams.ports import CqlRow
from streams.tenants import TenantConfig
from topics.ids import format_iso_ms

log = logging.getLogger("tocsin.api.console")

COOKIE = "tocsin_console_key"
PREFIX = "/console"
SCRAPER: web.AppKey[Scraper] = web.AppKey("console_scraper", Scraper)
ACTIONS: web.AppKey[Actions] = web.AppKey("console_actions", Actions)
SERVICE: web.AppKey[Service] = web.AppKey("console_service", Service)

# Listing: rows read per page and pages read per search before offering "More results"
# (an id prefix or order key filters what the window holds).
PAGE_ROWS = 200
MAX_PAGES = 5
SHOW_ROWS = 50
DEFAULT_PAST_MS = 86_400_000
DEFAULT_AHEAD_MS = 30 * 86_400_000
MAX_LETTERS = 500
LETTERS_WINDOW_MS = 86_400_000
# The tenants page lists at most this many tenants (keys are read per tenant).
MAX_TENANTS_SHOWN = 200

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CODE = re.compile(r"[a-z_]{1,40}")


@dataclass(frozen=True)
class Session:
    who: Principal
    viewer: Viewer
    service: Service


def csrf_token(key: str) -> str:
    return hmac.new(key.encode(), b"tocsin-console-csrf", hashlib.sha256).hexdigest()


def html(body: str, status: int = 200) -> web.Response:
    return web.Response(
        text=body,
        status=status,
        content_type="text/html",
        headers={
            "Cache-Control": "no-store",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "same-origin",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
            "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'",
        },
    )


def _service(request: web.Request) -> Service:
    return request.app[SERVICE]


async def session(request: web.Request) -> Session:
    """The signed-in caller, or a redirect to the sign-in page."""
    key = request.cookies.get(COOKIE)
    if not key:
        raise web.HTTPSeeOther(f"{PREFIX}/login")
    service = _service(request)
    try:
        who = await service.authenticate(key)
    except ApiError as exc:
        raise web.HTTPSeeOther(url(f"{PREFIX}/login", error=exc.code)) from None
    return Session(who, Viewer(who.tenant, who.admin, csrf_token(key)), service)


def same_origin(request: web.Request) -> bool:
    source = request.headers.get("Origin") or request.headers.get("Referer")
    return bool(source) and urlsplit(source).netloc == request.host


async def acting(request: web.Request) -> tuple[Session, Mapping[str, str]]:
    """A signed-in POST from this console: its session and its form."""
    if not same_origin(request):
        raise ApiError(403, "cross_origin", "the request does not come from this console")
    got = await session(request)
    form = await request.post()
    token = form.get("csrf")
    if not isinstance(token, str) or not hmac.compare_digest(token, got.viewer.csrf):
        raise ApiError(403, "bad_csrf_token", "the form is stale: reload the page")
    return got, {k: v for k, v in form.items() if isinstance(v, str)}


def tenant_in_scope(who: Principal, request: web.Request) -> str | None:
    """The tenant a page reads: a tenant key's own, whatever the request names; the admin's
    choice (None until chosen)."""
    if who.admin:
        return request.query.get("tenant") or None
    return who.require_tenant()


def page(handler: Handler) -> Handler:
    """Answers a handler's refusals as pages with the error in words (its redirects,
    aiohttp's HTTPSeeOther, go through as they are)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            if exc.status == 404:
                # One page for a missing object and another tenant's: the message names it.
                return html(pages.error_page("Not found", "Not found."), 404)
            if exc.status < 500:
                # The caller's own mistake, in the API's words (they name only what it sent).
                return html(pages.error_page("Error", exc.message), exc.status)
            return backend_failure(request, exc, exc.status)
        except TocsinError as exc:
            return backend_failure(request, exc, 503)

    return wrapped


def backend_failure(request: web.Request, exc: TocsinError, status: int) -> web.Response:
    """A backend failure as a fixed page with a reference the log line carries too: the
    exception's text names hosts, tables and queries, which are not the browser's to read."""
    ref = secrets.token_hex(4)
    log.warning(
        "console backend failure",
        extra={
            "ref": ref,
            "path": request.path,
            "status": status,
            "error_type": type(exc).__name__,
            "error": str(exc),
            "retriable": exc.retriable,
        },
    )
    msg = f"The backend could not answer; try again. Reference: {ref}"
    return html(pages.error_page("Unavailable", msg), status)


async def _tenant_names(s: Session) -> list[str]:
    if not s.who.admin:
        return []
    return [str(r["tenant"]) for r in await s.service.list_tenants()]


# -- sign in -----------------------------------------------------------------------------

LOGIN_ERRORS = {
    "unauthenticated": "That key is not valid.",
    "inactive_tenant": "That key's tenant is deactivated.",
}


async def login_form(request: web.Request) -> web.Response:
    error = LOGIN_ERRORS.get(request.query.get("error", ""))
    return html(pages.login_page(error))


async def login(request: web.Request) -> web.StreamResponse:
    if not same_origin(request):
        return html(pages.login_page("Sign in from this console's own page."), 403)
    form = await request.post()
    key = form.get("key")
    key = key.strip() if isinstance(key, str) else ""
    try:
        await _service(request).authenticate(key)
    except ApiError as exc:
        return html(pages.login_page(LOGIN_ERRORS.get(exc.code, exc.message)), exc.status)
    resp = web.Response(status=303, headers={"Location": f"{PREFIX}/schedules"})
    resp.set_cookie(
        COOKIE, key, path=PREFIX, httponly=True, samesite="Strict", secure=over_tls(request)
    )
    return resp


def over_tls(request: web.Request) -> bool:
    """Whether the browser reached us over TLS: directly, or through a TLS-terminating
    proxy that says so. A forged header can only make the caller's own cookie Secure."""
    if request.secure:
        return True
    proto = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    if proto == "https":
        return True
    forwarded = request.headers.get("Forwarded", "").split(",")[0].lower()
    return any(p.strip() == "proto=https" for p in forwarded.split(";"))


async def logout(request: web.Request) -> web.StreamResponse:
    await acting(request)
    resp = web.Response(status=303, headers={"Location": f"{PREFIX}/login"})
    resp.del_cookie(COOKIE, path=PREFIX)
    return resp


async def root(request: web.Request) -> web.StreamResponse:
    raise web.HTTPSeeOther(f"{PREFIX}/schedules")


# -- schedules ---------------------------------------------------------------------------


def _with_order_key(row: CqlRow) -> dict[str, object]:
    return {**views.schedule_view(row, brief=True), "order_key": row.get("order_key")}


def _parent_with_order_key(
    row: CqlRow, *, status: str, position_ms: int, next_ms: int | None
) -> dict[str, object]:
    view = recurring.parent_brief(row, status=status, position_ms=position_ms, next_ms=next_ms)
    return {**view, "order_key": row.get("order_key")}


def _window(q: Mapping[str, str]) -> tuple[int, int]:
    now = now_ms()
    lo = views.parse_time(q["from"], "from") if q.get("from") else now - DEFAULT_PAST_MS
    hi = views.parse_time(q["to"], "to") if q.get("to") else lo + DEFAULT_PAST_MS + DEFAULT_AHEAD_MS
    return views.parse_window({"from": str(lo), "to": str(hi)})


def _wanted(s: Search, view: Mapping[str, Any]) -> bool:
    return str(view["schedule_id"]).startswith(s.id_prefix) and (
        not s.order_key or view.get("order_key") == s.order_key
    )


async def find_schedules(
    service: Service, tenant: str, s: Search, q: Mapping[str, str]
) -> tuple[list[dict[str, object]], str | None, str]:
    """Matching schedules of the window, at most SHOW_ROWS from MAX_PAGES pages, the cursor
    to go on from, and the window in words."""
    lo, hi = _window(q)
    statuses = views.parse_statuses(s.status or None)
    cursor = views.decode_cursor(q.get("cursor"))
    found: list[dict[str, object]] = []
    for _ in range(MAX_PAGES):
        page_rows, cursor = await recurring_io.list_page(
            service.store,
            service.list_schedules,
            _with_order_key,
            tenant,
            from_ms=lo,
            to_ms=hi,
            statuses=statuses,
            limit=PAGE_ROWS,
            after=cursor,
            now_ms=now_ms(),
            parent_view=_parent_with_order_key,
        )
        found += [v for v in page_rows if _wanted(s, v)]
        if cursor is None or len(found) >= SHOW_ROWS:
            break
    more = views.encode_cursor(*cursor) if cursor else None
    return found, more, f"from {format_iso_ms(lo)} to {format_iso_ms(hi)}"


async def schedules(request: web.Request) -> web.Response:
    s = await session(request)
    q = request.query
    tenant = tenant_in_scope(s.who, request)
    search = Search(
        tenant=(tenant or "") if s.who.admin else "",
        id_prefix=q.get("id_prefix", ""),
        status=q.get("status", ""),
        from_=q.get("from", ""),
        to=q.get("to", ""),
        order_key=q.get("order_key", ""),
    )
    rows: list[dict[str, object]] = []
    more, window, error = None, "", None
    if tenant:
        try:
            rows, cursor, window = await find_schedules(s.service, tenant, search, q)
        except ApiError as exc:
            if exc.status != 400:
                raise
            error = exc.message
        else:
            more = url(f"{PREFIX}/schedules", **{**q, "cursor": cursor}) if cursor else None
    body = pages.schedules_page(
        s.viewer, search, await _tenant_names(s), rows, window=window, more=more, error=error
    )
    return html(body)


async def schedule_doc(service: Service, tenant: str, sid: str) -> dict[str, Any]:
    """The schedule as ``GET /v1/schedules/{id}`` answers it (404 as there)."""
    row, events = await service.get_schedule(tenant, sid)
    if recurring.is_parent(row) or row.get("due_ms") is None:
        return await recurring_io.schedule_json(
            service.store, row, events, now_ms=now_ms(), past=10, upcoming=10
        )
    return views.schedule_view(row, events)


DONE = {
    "cancel": "Cancelled.",
    "pause": "Paused: it does not fire until resumed.",
    "resume": "Resumed.",
    "trigger": "Triggered: one extra run fires now.",
    "redrive": "Sent again through the proxy.",
}


def _outcome(q: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The flash of an action's redirect: (done, error)."""
    done, code = q.get("done", ""), q.get("code")
    if done not in DONE:
        return None, None
    if code and code != "ok":
        # Only a code's shape is shown: a crafted link cannot put sentences on the page.
        shown = code if _CODE.fullmatch(code) else "unknown"
        return None, f"{done.capitalize()} was refused: {shown}"
    return DONE[done], None


async def schedule(request: web.Request) -> web.Response:
    s = await session(request)
    tenant = tenant_in_scope(s.who, request)
    sid = s.service.check_schedule_id(request.match_info["schedule_id"])
    if tenant is None:
        raise ApiError(400, "tenant_required", "choose a tenant on the schedules page first")
    try:
        doc = await schedule_doc(s.service, tenant, sid)
        explained = (await explain.explanation(s.service, tenant, sid)).to_json()
    except ApiError as exc:
        if exc.status != 404:
            raise
        # Another tenant's schedule and a missing one read the same.
        return html(pages.not_found_page(s.viewer, f"schedule {sid!r}"), 404)
    flash, error = _outcome(request.query)
    body = pages.schedule_page(
        s.viewer, tenant, doc, explained, request.app[ACTIONS], flash=flash, error=error
    )
    return html(body)


def _allowed(actions: Actions, kind: str) -> bool:
    return (
        kind == "cancel"
        or (kind in ("pause", "resume") and actions.pause)
        or (kind == "trigger" and actions.trigger)
    )


async def act(request: web.Request) -> web.StreamResponse:
    s, _ = await acting(request)
    kind = request.match_info["action"]
    if not _allowed(request.app[ACTIONS], kind):
        raise ApiError(404, "no_route", f"no action {kind!r}")
    tenant = tenant_in_scope(s.who, request)
    if tenant is None:
        raise ApiError(400, "tenant_required", "choose a tenant first")
    sid = s.service.check_schedule_id(request.match_info["schedule_id"])
    cmd = views.simple_command(
        kind, tenant=tenant, schedule_id=sid, request_id=s.service.bridge.new_request_id()
    )
    try:
        result = await s.service.send(cmd, wait=True)
        code = str(result["code"])
    except ApiError as exc:
        code = exc.code
    back = url(pages.schedule_path(sid), tenant=tenant if s.who.admin else None)
    raise web.HTTPSeeOther(f"{back}{'&' if '?' in back else '?'}done={kind}&code={code}")


# -- dead letters ------------------------------------------------------------------------


async def letters(request: web.Request) -> web.Response:
    s = await session(request)
    tenant = tenant_in_scope(s.who, request)
    found: list[dict[str, object]] = []
    hi = now_ms() + 1
    lo = hi - LETTERS_WINDOW_MS
    more = None
    if tenant:
        page_letters, more = await dead_letters(s.service).list(
            tenant, from_ms=lo, to_ms=hi, limit=MAX_LETTERS, before=None
        )
        found = [dead_letter_view(e) for e in page_letters]
    flash, error = _outcome(request.query)
    body = pages.dead_letters_page(
        s.viewer,
        tenant or "",
        await _tenant_names(s),
        found,
        window="the last 24 hours",
        flash=flash,
        error=error,
        truncated=more is not None,
    )
    return html(body)


async def redrive(request: web.Request) -> web.StreamResponse:
    s, _ = await acting(request)
    tenant = tenant_in_scope(s.who, request)
    if tenant is None:
        raise ApiError(400, "tenant_required", "choose a tenant first")
    tid = request.match_info["trigger_id"]
    try:
        await dead_letters(s.service).redrive(tenant, tid)
        code = "ok"
    except ApiError as exc:
        code = exc.code
    back = url(f"{PREFIX}/dead-letters", tenant=tenant if s.who.admin else None)
    raise web.HTTPSeeOther(f"{back}{'&' if '?' in back else '?'}done=redrive&code={code}")


# -- health ------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    s = await session(request)
    scraper = request.app[SCRAPER]
    if not s.who.admin:
        # Deployment-wide numbers include every tenant's traffic: the admin's view only.
        tenant = s.who.require_tenant()
        row = await s.service.get_tenant(tenant)
        quota = TenantConfig.from_json(row.get("config")).fire_quota_per_min
        summary = scraper.summary()
        mine = {tenant: summary.throttled.get(tenant, 0.0)}
        return html(pages.tenant_health_page(s.viewer, tenant, quota, mine, bool(scraper.sources)))
    quotas = {
        str(r["tenant"]): TenantConfig.from_json(r.get("config")).fire_quota_per_min
        for r in await s.service.list_tenants()
    }
    return html(pages.health_page(s.viewer, scraper.summary(), scraper.sources, quotas))


# -- tenants (admin) ---------------------------------------------------------------------


async def _keys(service: Service, tenant: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for k in await service.store.list_api_keys(tenant):
        row = await service.store.get_api_key(str(k["key_id"]))
        out.append({**k, "revoked": bool(row and row.get("revoked"))})
    return out


async def _tenants_page(
    s: Session, *, new_key: Mapping[str, str] | None = None, flash: str | None = None
) -> web.Response:
    s.who.require_admin()
    rows = (await s.service.list_tenants())[:MAX_TENANTS_SHOWN]
    docs = [
        views.tenant_view(
            r,
            TenantConfig.from_json(r.get("config")).to_dict(),
            tenant_admin.signing_status(r, now_ms()),
        )
        for r in rows
    ]
    keys = {str(r["tenant"]): await _keys(s.service, str(r["tenant"])) for r in rows}
    return html(pages.tenants_page(s.viewer, docs, keys, new_key=new_key, flash=flash))


async def tenants(request: web.Request) -> web.Response:
    s = await session(request)
    s.who.require_admin()
    saved = request.query.get("saved")
    return await _tenants_page(s, flash=f"Saved {saved}." if saved else None)


def _config_change(form: Mapping[str, str]) -> dict[str, object]:
    try:
        fires = int(form.get("fire_quota_per_min") or 0)
        creates = float(form.get("create_quota_per_s") or 0)
    except ValueError:
        raise ApiError(400, "invalid_config", "quotas must be numbers") from None
    hosts = [h.strip() for h in (form.get("allowed_callback_hosts") or "").split(",")]
    return {
        "fire_quota_per_min": fires,
        "create_quota_per_s": creates,
        "allowed_callback_hosts": [h for h in hosts if h],
    }


async def update_tenant(request: web.Request) -> web.StreamResponse:
    s, form = await acting(request)
    s.who.require_admin()
    name = request.match_info["tenant"]
    await s.service.update_tenant(name, config=_config_change(form), active=None)
    raise web.HTTPSeeOther(url(f"{PREFIX}/tenants", saved=name))


async def issue_key(request: web.Request) -> web.Response:
    s, _ = await acting(request)
    s.who.require_admin()
    name = request.match_info["tenant"]
    await s.service.get_tenant(name)
    created = await s.service.new_key(name)
    return await _tenants_page(s, new_key=created)


async def revoke_key(request: web.Request) -> web.StreamResponse:
    s, _ = await acting(request)
    s.who.require_admin()
    name, key_id = request.match_info["tenant"], request.match_info["key_id"]
    await s.service.revoke_key(name, key_id)
    raise web.HTTPSeeOther(url(f"{PREFIX}/tenants", saved=f"{name} (key {key_id} revoked)"))


# -- mounting ----------------------------------------------------------------------------


def served(app: web.Application, method: str, path: str) -> bool:
    """Whether ``app`` has a route for ``method`` on ``path`` (a canonical template)."""
    return any(
        r.method == method and r.resource is not None and r.resource.canonical == path
        for r in app.router.routes()
    )


def add_routes(app: web.Application, key: web.AppKey[Service]) -> None:
    """Serve the console on ``app`` over the service under ``key``."""
    service = app[key]
    app[SERVICE] = service
    scraper = Scraper(service.settings.api.metrics_urls, service.settings.api.metrics_scrape_s)
    app[SCRAPER] = scraper

    async def scraping(app: web.Application) -> AsyncIterator[None]:
        if not scraper.sources:
            yield
            return
        async for _ in scraper.lifecycle():
            yield

    async def actions(app: web.Application) -> None:
        # Buttons only for actions whose REST route this API serves.
        app[ACTIONS] = Actions(
            pause=served(app, "POST", "/v1/schedules/{schedule_id}/pause"),
            trigger=served(app, "POST", "/v1/schedules/{schedule_id}/trigger"),
        )

    app.cleanup_ctx.append(scraping)
    app.on_startup.append(actions)
    r = app.router
    r.add_get(PREFIX, page(root))
    r.add_get(PREFIX + "/", page(root))
    r.add_get(PREFIX + "/login", page(login_form))
    r.add_post(PREFIX + "/login", page(login))
    r.add_post(PREFIX + "/logout", page(logout))
    r.add_get(PREFIX + "/schedules", page(schedules))
    # Schedule ids may hold '/': the id is the rest of the path.
    r.add_get(PREFIX + "/schedules/{schedule_id:.+}", page(schedule))
    r.add_post(PREFIX + "/actions/{action}/{schedule_id:.+}", page(act))
    r.add_get(PREFIX + "/dead-letters", page(letters))
    r.add_post(PREFIX + "/dead-letters/{trigger_id}/redrive", page(redrive))
    r.add_get(PREFIX + "/health", page(health))
    r.add_get(PREFIX + "/tenants", page(tenants))
    r.add_post(PREFIX + "/tenants/{tenant}", page(update_tenant))
    r.add_post(PREFIX + "/tenants/{tenant}/keys", page(issue_key))
    r.add_post(PREFIX + "/tenants/{tenant}/keys/{key_id}/revoke", page(revoke_key))

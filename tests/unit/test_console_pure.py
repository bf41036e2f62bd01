"""The console's pure parts: escaping, the pages' markup, the metrics ring's arithmetic and
the same-origin check (the browser tests are tests/integration/test_console.py)."""

from __future__ import annotations

import logging
import re
from collections import deque

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from api.console import pages
from api.console.health import (
    HOUR_MS,
    MINUTE_MS,
    Sample,
    Scraper,
    increase,
    parse_sample,
    quantile,
    summarize,
)
from api.console.html import Safe, esc, tag, void
from api.console.pages import Actions, Search, Viewer
from api.console.routes import _outcome, csrf_token, same_origin
from api.views import ApiError
from base.errors import StoreError, TocsinError

TENANT = Viewer(tenant="acme", admin=False, csrf="t0ken")
ADMIN = Viewer(tenant=None, admin=True, csrf="t0ken")
HOSTILE = '<script>alert("x")</script>'


def test_text_from_outside_is_escaped_everywhere() -> None:
    assert esc(HOSTILE) == "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
    assert tag("td", HOSTILE) == f"<td>{esc(HOSTILE)}</td>"
    assert void("input", value='" onfocus="x') == '<input value="&quot; onfocus=&quot;x" />'
    assert tag("p", Safe("<b>ok</b>")) == "<p><b>ok</b></p>"
    row = {"schedule_id": HOSTILE, "status": "scheduled", "due": "d", "delivery": None}
    html = pages.schedules_page(TENANT, Search(), [], [row], window="w", more=None)
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_a_schedule_page_offers_the_actions_its_state_allows() -> None:
    doc = {"schedule_id": "a/b", "status": "paused", "callback": {"url": "https://x.example/"}}
    explained = {"reason": "paused", "timeline": [], "notes": [], "not_recorded": []}
    both = Actions(pause=True, trigger=True)
    html = pages.schedule_page(TENANT, "acme", doc, explained, both)
    assert "Resume" in html and ">Pause<" not in html and "Trigger now" in html
    assert 'action="/console/actions/resume/a%2Fb"' in html
    assert 'name="csrf" value="t0ken"' in html
    fired = pages.schedule_page(TENANT, "acme", {**doc, "status": "fired"}, explained, both)
    assert "Cancel schedule" not in fired and ">Pause<" not in fired
    # Without the routes, no button calls them.
    none = pages.schedule_page(
        TENANT, "acme", {**doc, "status": "scheduled"}, explained, Actions(False, False)
    )
    assert "Pause" not in none and "Trigger now" not in none and "Cancel schedule" in none


def test_only_the_admin_gets_the_tenants_section_and_a_tenant_picker() -> None:
    tenant_page = pages.schedules_page(
        TENANT, Search(), ["acme", "other"], [], window="w", more=None
    )
    assert "/console/tenants" not in tenant_page and "other" not in tenant_page
    admin_page = pages.schedules_page(ADMIN, Search(), ["acme", "other"], [], window="w", more=None)
    assert "/console/tenants" in admin_page and '<option value="other"' in admin_page


def test_every_input_of_every_page_has_a_label() -> None:
    html = pages.schedules_page(ADMIN, Search(), ["acme"], [], window="w", more=None)
    html += pages.login_page()
    html += pages.tenants_page(
        ADMIN, [{"tenant": "acme", "active": True, "config": {}}], {"acme": []}
    )
    for chunk in html.split("<input")[1:]:
        attrs = chunk.split(">", 1)[0]
        if 'type="hidden"' in attrs:
            continue
        before = html.split("<input" + chunk.split(">", 1)[0])[0]
        assert before.rfind("<label") > before.rfind("</label>"), attrs


def test_failures_are_grouped_by_endpoint_host_and_status() -> None:
    letters = [
        {"endpoint": "https://a.example/x", "response": {"status_code": 500}},
        {"endpoint": "https://a.example/y", "response": {"status_code": 500}},
        {"endpoint": "https://b.example/", "response": {"status_code": 410}},
        {"endpoint": "https://b.example/", "response": None},
    ]
    assert pages.failures_by_host(letters) == [
        ("a.example", "500", 2),
        ("b.example", "410", 1),
        ("b.example", "no response", 1),
    ]


EXPOSITION = """
# TYPE tocsin_triggers_emitted_total counter
tocsin_triggers_emitted_total{partition="0"} %(e0)s
tocsin_triggers_emitted_total{partition="1"} %(e1)s
# TYPE tocsin_fire_lateness_seconds histogram
tocsin_fire_lateness_seconds_bucket{le="0.01"} %(b1)s
tocsin_fire_lateness_seconds_bucket{le="0.1"} %(b2)s
tocsin_fire_lateness_seconds_bucket{le="+Inf"} %(b2)s
tocsin_fire_lateness_seconds_count %(b2)s
tocsin_fire_lateness_seconds_sum 1.0
# TYPE tocsin_consumer_lag_messages gauge
tocsin_consumer_lag_messages{partition="0"} 3.0
tocsin_consumer_lag_messages{partition="1"} 4.0
# TYPE tocsin_fires_throttled_total counter
tocsin_fires_throttled_total{tenant="acme"} %(t)s
"""


def _expo(e0: float, e1: float, b1: float, b2: float, t: float) -> str:
    return EXPOSITION % {"e0": e0, "e1": e1, "b1": b1, "b2": b2, "t": t}


def test_a_scrape_sums_partitions_and_keeps_the_histogram() -> None:
    s = parse_sample(_expo(10, 5, 1, 4, 2), at_ms=0)
    assert s.emitted == 15 and s.commands_lag == 7 and s.fires_lag is None
    assert s.fire_lateness == ((0.01, 1.0), (0.1, 4.0), (float("inf"), 4.0))
    assert s.throttled == {"acme": 2.0}


def test_the_hour_is_summed_by_minute_across_restarts() -> None:
    now = 10 * HOUR_MS
    t0 = now - 5 * MINUTE_MS
    ring = deque(
        [
            parse_sample(_expo(100, 0, 0, 0, 0), t0),
            parse_sample(_expo(160, 0, 50, 60, 1), t0 + 30_000),
            # The worker restarted: its counters start again from zero.
            parse_sample(_expo(20, 0, 10, 20, 0), t0 + MINUTE_MS + 30_000),
        ]
    )
    summary = summarize([ring], now=now)
    by_minute = {p.minute_ms: p.fires for p in summary.points}
    assert by_minute[t0] == 60 and by_minute[t0 + MINUTE_MS] == 20
    assert summary.commands_lag == 7 and summary.sources == 1
    assert summary.throttled == {"acme": 1.0}
    # 80 lateness observations: 60 at most 10 ms, 20 in (10 ms, 100 ms].
    assert summary.fire_lateness == ((0.01, 60.0), (0.1, 80.0), (float("inf"), 80.0))
    p50 = quantile(0.5, summary.fire_lateness)
    assert p50 is not None and 0 < p50 <= 0.01
    p99 = quantile(0.99, summary.fire_lateness)
    assert p99 is not None and 0.01 < p99 <= 0.1
    assert quantile(0.5, None) is None


def test_samples_older_than_the_hour_are_left_out_and_the_ring_is_bounded() -> None:
    now = 10 * HOUR_MS
    old = Sample(at_ms=now - 2 * HOUR_MS, emitted=0.0)
    new = Sample(at_ms=now - 1000, emitted=5.0)
    summary = summarize([deque([old, new])], now=now)
    assert sum(p.fires for p in summary.points) == 0  # one sample in the hour: no increase
    scraper = Scraper(["http://127.0.0.1:1/metrics"], interval_s=0.01)
    assert scraper.interval_s == 1.0
    assert scraper.sources[0].ring.maxlen == 3602
    assert increase(5, 3) == 3 and increase(3, 5) == 2


@pytest.mark.parametrize(
    ("headers", "ok"),
    [
        ({"Origin": "http://console.example:8480"}, True),
        ({"Referer": "http://console.example:8480/console/schedules"}, True),
        ({"Origin": "https://evil.example"}, False),
        ({"Origin": "null"}, False),
        ({}, False),
    ],
)
def test_actions_come_from_this_host_only(headers: dict[str, str], ok: bool) -> None:
    request = make_mocked_request(
        "POST", "/console/actions/cancel/x", headers={"Host": "console.example:8480", **headers}
    )
    assert same_origin(request) is ok


def test_the_form_token_is_bound_to_the_key() -> None:
    assert csrf_token("key-a") != csrf_token("key-b")
    assert csrf_token("key-a") == csrf_token("key-a")


def test_an_actions_answer_shows_fixed_words_and_a_codes_shape_only() -> None:
    assert _outcome({"done": "pause", "code": "ok"}) == (
        "Paused: it does not fire until resumed.",
        None,
    )
    assert _outcome({"done": "pause", "code": "not_found"}) == (
        None,
        "Pause was refused: not_found",
    )
    assert _outcome({"done": "pause", "code": "Call 555-0100 now"}) == (
        None,
        "Pause was refused: unknown",
    )
    assert _outcome({"done": "Your account is locked", "code": "x"}) == (None, None)


async def test_the_scraper_reads_each_url_and_keeps_a_failing_ones_error() -> None:
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=_expo(1, 2, 0, 0, 0))

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/broken", broken)
    async with TestServer(app) as server:
        good, bad = str(server.make_url("/metrics")), str(server.make_url("/broken"))
        scraper = Scraper([good, bad], interval_s=1)
        async with ClientSession() as session:
            await scraper.scrape_once(session)
            await scraper.scrape_once(session)
    ok, failing = scraper.sources
    assert ok.error is None and [s.emitted for s in ok.ring] == [3.0, 3.0]
    assert failing.error == "HTTP 500" and not failing.ring
    assert scraper.summary().sources == 1


def _form_targets(html: str, page_url: str) -> list[str]:
    """The paths the page's forms post to, as a browser resolves them (dot segments
    removed)."""
    from html import unescape
    from urllib.parse import urljoin, urlsplit

    actions = [chunk.split('"', 1)[0] for chunk in html.split(' action="')[1:]]
    return [urlsplit(urljoin(page_url, unescape(a))).path for a in actions]


def test_an_id_cannot_point_a_button_at_another_route() -> None:
    """A tenant chooses its schedule ids; with '/' and '..' in one, the admin's Redrive or
    Cancel button must still post to that dead letter or schedule, not to a route such as
    another tenant's key revocation."""
    from urllib.parse import unquote

    sid = "../../tenants/alice/keys/k1/revoke?"
    letter = {
        "trigger_id": f"{sid}@1700000000000",
        "schedule_id": sid,
        "endpoint": "https://x.example/",
        "reason": "r",
        "attempts": 1,
    }
    html = pages.dead_letters_page(ADMIN, "mallory", ["mallory"], [letter], window="w")
    own = ("/console/logout", "/console/dead-letters")
    targets = [t for t in _form_targets(html, "http://c/console/dead-letters") if t not in own]
    assert len(targets) == 1, targets
    for t in targets:
        assert t.startswith("/console/dead-letters/") and t.endswith("/redrive"), t
        assert (
            unquote(t.removeprefix("/console/dead-letters/").removesuffix("/redrive"))
            == (letter["trigger_id"])
        )
    doc = {"schedule_id": sid, "status": "scheduled", "callback": None}
    explained = {"reason": "r", "timeline": [], "notes": [], "not_recorded": []}
    page = pages.schedule_page(ADMIN, "mallory", doc, explained, Actions(True, True))
    for t in _form_targets(page, "http://c/console/schedules/x"):
        if t == "/console/logout":
            continue
        assert t.startswith("/console/actions/"), t
        kind, _, rest = t.removeprefix("/console/actions/").partition("/")
        assert kind in ("pause", "trigger", "cancel") and unquote(rest) == sid, t


@pytest.mark.parametrize(
    ("headers", "secure"),
    [
        ({}, False),
        ({"X-Forwarded-Proto": "https"}, True),
        ({"Forwarded": "for=1.2.3.4;proto=https"}, True),
        ({"X-Forwarded-Proto": "http"}, False),
    ],
)
async def test_the_key_cookie_is_secure_when_the_browser_came_over_tls(
    headers: dict[str, str], secure: bool
) -> None:
    """The API serves plain HTTP behind a TLS-terminating ingress: the cookie holding the
    key must still be Secure then, or the browser sends it over any plain-HTTP visit."""
    from http.cookies import SimpleCookie

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from api.console import routes

    class Keys:
        async def authenticate(self, key: str) -> object:
            return object()

    app = web.Application()
    app[routes.SERVICE] = Keys()  # type: ignore[assignment]
    app.router.add_post("/console/login", routes.login)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post(
            "/console/login",
            data={"key": "k"},
            headers={"Origin": str(client.make_url("")).rstrip("/"), **headers},
            allow_redirects=False,
        )
        assert resp.status == 303
        cookie = SimpleCookie(resp.headers["Set-Cookie"])[routes.COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/console"
    assert bool(cookie["secure"]) is secure


async def test_the_scraper_refuses_an_answer_past_its_size_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from api.console import health

    monkeypatch.setattr(health, "MAX_EXPOSITION_BYTES", 100_000)

    async def huge(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        line = b"tocsin_triggers_emitted_total 1\n"
        for _ in range(10_000):  # 320 KB
            await resp.write(line)
        return resp

    app = web.Application()
    app.router.add_get("/metrics", huge)
    async with TestServer(app) as server:
        scraper = Scraper([str(server.make_url("/metrics"))], interval_s=1)
        async with ClientSession() as session:
            await scraper.scrape_once(session)
    (source,) = scraper.sources
    assert source.error is not None and "larger than 100000 bytes" in source.error
    assert not source.ring


def test_a_dead_letter_page_says_when_it_shows_only_the_newest() -> None:
    """The grouping counts the listed dead letters only: past the page's bound the page
    must say so, or the counts read as the window's."""
    letter = {
        "trigger_id": "t@1",
        "schedule_id": "s",
        "endpoint": "https://x.example/",
        "reason": "r",
        "attempts": 1,
    }
    full = pages.dead_letters_page(TENANT, "acme", [], [letter], window="w", truncated=True)
    assert "only the newest 1 are listed and counted" in full
    whole = pages.dead_letters_page(TENANT, "acme", [], [letter], window="w", truncated=False)
    assert "only the newest" not in whole


def test_a_dead_letters_reason_and_excerpt_are_split_by_one_line_break() -> None:
    """``<br></br>`` is read by browsers as two line breaks."""
    letter = {
        "trigger_id": "t@1",
        "schedule_id": "s",
        "endpoint": "https://x.example/",
        "reason": "r",
        "attempts": 1,
        "response": {"status_code": 500, "body_excerpt": "boom"},
    }
    html = pages.dead_letters_page(TENANT, "acme", [], [letter], window="w")
    assert "</br>" not in html
    assert "r<br><code>boom</code>" in html


def test_the_screen_reader_only_class_is_styled_hidden() -> None:
    html = pages.schedules_page(TENANT, Search(), [], [], window="w", more=None)
    assert 'class="sr"' in html
    rule = pages.STYLE.split(".sr{", 1)[1].split("}", 1)[0]
    assert "position:absolute" in rule and "clip:rect(0,0,0,0)" in rule
    assert "overflow:hidden" in rule and "width:1px" in rule


def test_the_due_from_hint_fits_its_input() -> None:
    """A placeholder never wraps: past the input's width (20 characters at 1366x768) it is
    cut off."""
    html = pages.schedules_page(TENANT, Search(), [], [], window="w", more=None)
    hints = re.findall(r'placeholder="([^"]*)"', html)
    assert hints and all(len(h) <= 22 for h in hints), hints


async def _wrapped_answer(exc: Exception) -> tuple[int, str]:
    from api.console import routes

    async def failing(request: web.Request) -> web.StreamResponse:
        raise exc

    resp = await routes.page(failing)(make_mocked_request("GET", "/console/schedules"))
    assert isinstance(resp, web.Response) and isinstance(resp.text, str)
    return resp.status, resp.text


@pytest.mark.parametrize(
    "exc",
    [
        StoreError("Unavailable: cassandra-0.internal:9042 SELECT * FROM tocsin.schedules"),
        ApiError(503, "unavailable", "cassandra-0.internal:9042 timed out"),
    ],
)
async def test_a_backend_failure_page_shows_a_reference_not_the_exception(
    exc: TocsinError, caplog: pytest.LogCaptureFixture
) -> None:
    """The exception names hosts and queries: the page says fixed words and a reference,
    and the operator finds the exception in the log under the same reference."""
    with caplog.at_level(logging.WARNING, logger="tocsin.api.console"):
        status, html = await _wrapped_answer(exc)
    assert status == 503
    assert "cassandra-0" not in html and "9042" not in html
    found = re.search(r"Reference: ([0-9a-f]{8})", html)
    assert found, html
    records = [r for r in caplog.records if getattr(r, "ref", None) == found.group(1)]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "cassandra-0.internal" in str(getattr(records[0], "error", ""))
    assert getattr(records[0], "path", None) == "/console/schedules"


async def test_a_not_found_page_is_one_page_for_a_missing_and_a_foreign_object() -> None:
    missing = await _wrapped_answer(ApiError(404, "not_found", "no tenant 'ghost'"))
    foreign = await _wrapped_answer(ApiError(404, "not_found", "no schedule 'theirs'"))
    assert missing == foreign
    assert missing[0] == 404 and "Not found" in missing[1]
    assert "ghost" not in missing[1] and "Reference" not in missing[1]


async def test_the_callers_own_mistake_is_answered_in_the_apis_words() -> None:
    status, html = await _wrapped_answer(
        ApiError(400, "tenant_required", "choose a tenant on the schedules page first")
    )
    assert status == 400 and "choose a tenant on the schedules page first" in html

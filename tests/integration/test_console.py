"""The web console (``/console``) in a real browser: Debian's chromium, headless, driven by
selenium through chromedriver, against a worker, the proxy, an HTTP receiver and
``tocsin api`` on a deployment of their own.

An operator signs in with a tenant key, finds a one-shot schedule, pauses it and sees it not
fire past its due time, resumes it and sees it delivered, with the explain timeline telling
the story; a recurring schedule shows its next runs and is cancelled; a dead letter is
grouped by host and status code and redriven from the page. Another tenant's key finds
nothing of the first tenant's: the schedule page answers as for a missing id and the lists
are empty. The admin sees Health (charts read from the worker's and the proxy's /metrics)
and Tenants (quotas, allowed hosts, a new key). Every page is checked for labelled inputs,
one h1, no horizontal scrolling at 1366x768 and a working keyboard path.

With TOCSIN_CONSOLE_SHOTS=<dir> (``make console-shots``) a screenshot of each page is
saved there. Waits poll for an outcome with a deadline; nothing asserts a duration."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from api.console.routes import csrf_token
from base.settings import REPO_ROOT, Settings
from proxy.app import ProxyApp
from tests.integration.conftest import (
    ApiServer,
    WorkerProcess,
    _env_for,
    isolated_stack,
    wait_worker_ready,
)
from tests.integration.test_proxy_delivery import Hit, Receiver, fast_settings

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WIDTH, HEIGHT = 1366, 768

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extras")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Polls ``check``; a page replaced while it was read (a form's answer arriving) is
    read again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except WebDriverException:
            # Stale or detached elements, a missing one: the page is being replaced.
            got = None
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def browser(profile: str) -> WebDriver:
    """Headless chromium from Debian's packages, with nothing reaching out of the machine."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        why = (
            "the console's browser tests need Debian's chromium and chromium-driver "
            "(/usr/bin/chromium, /usr/bin/chromedriver): tools/install-browser.sh installs "
            "them as root (make venv runs it); this machine could not"
        )
        # CI runs as root on a fresh clone, so the install step ran there: a browser still
        # missing is a broken install step, which a skip would hide behind a green run.
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_window_size(WIDTH, HEIGHT)
    driver.implicitly_wait(0)
    return driver


@dataclass
class Console:
    settings: Settings
    api: ApiServer
    driver: WebDriver
    receiver: Receiver
    alice: dict[str, Any]
    mallory: dict[str, Any]
    shots: Path | None

    def url(self, path: str) -> str:
        return self.api.base + path

    def open(self, path: str) -> None:
        self.driver.get(self.url(path))

    def loaded(self) -> None:
        """Waits for the page a click or Enter started to finish loading (a form's answer
        is not waited for by the driver)."""
        until(
            lambda: self.driver.execute_script("return document.readyState") == "complete",
            15,
            f"{self.driver.current_url} to load",
        )

    def h1(self) -> str:
        self.loaded()
        found = self.driver.find_elements(By.TAG_NAME, "h1")
        assert found, f"no h1 on {self.driver.current_url}: {self.driver.page_source[:3000]}"
        return str(found[0].text)

    def text(self) -> str:
        self.loaded()
        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def sign_in(self, key: str) -> None:
        """Signs in with the keyboard alone: the key typed, Enter pressed."""
        self.driver.delete_all_cookies()
        self.open("/console")
        assert self.h1() == "Sign in"
        self.check_page()
        field = self.driver.switch_to.active_element  # autofocus puts the caret there
        assert field.get_attribute("name") == "key"
        field.send_keys(key, Keys.ENTER)
        until(lambda: self.h1() != "Sign in", 15, "the first page after signing in")

    def click(self, text: str) -> None:
        self.driver.find_element(By.XPATH, f"//button[normalize-space()='{text}']").click()

    def shot(self, name: str) -> None:
        """The page 1366 px wide and as tall as its content (at most 2,000 px)."""
        if self.shots is None:
            return
        tall = self.driver.execute_script("return document.documentElement.scrollHeight")
        metrics = {"width": WIDTH, "deviceScaleFactor": 1, "mobile": False}
        metrics["height"] = min(2000, max(HEIGHT, int(tall)))
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))
        self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    def check_page(self) -> None:
        """One h1, every visible input labelled, nothing wider than a 1366 px screen."""
        d = self.driver
        assert len(d.find_elements(By.TAG_NAME, "h1")) == 1
        unlabelled = d.execute_script(
            "return [...document.querySelectorAll("
            "'input:not([type=hidden]),select,textarea')]"
            ".filter(e => !e.labels || e.labels.length === 0).map(e => e.name)"
        )
        assert unlabelled == [], unlabelled
        wide = d.execute_script("return document.documentElement.scrollWidth")
        assert wide <= WIDTH, f"the page is {wide} px wide"
        assert d.find_element(By.CSS_SELECTOR, "html").get_attribute("lang") == "en"

    def schedule(self, key: str, body: dict[str, Any]) -> None:
        st, res = self.api.call("POST", "/v1/schedules", key=key, body=body)
        assert st == 201, res


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _free_ports(n: int) -> list[int]:
    """n distinct free ports, all bound at once: ports asked for one at a time can repeat
    (a port released is free again), and one given to a process still starting is not yet
    taken, so the API could be handed the worker's metrics port."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _behave(hit: Hit, n: int) -> int:
    # /broken answers 700 (dead-lettered at once) until the test repairs it; /gone always.
    if hit.path == "/gone":
        return 700
    return 700 if hit.path == "/broken" and not REPAIRED else 200


REPAIRED = False


def _start_api(env: dict[str, str], port: int, admin: str, log: Path) -> subprocess.Popen[bytes]:
    api_env = dict(env, TOCSIN_API_PORT=str(port), TOCSIN_ADMIN_KEY=admin)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tocsin.cli", "api"],
            env=api_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def console(real_stack: Settings, tenant: str) -> Iterator[Console]:
    tmp = Path(tempfile.mkdtemp(prefix="tocsin-console-"))
    shots_dir = os.environ.get("TOCSIN_CONSOLE_SHOTS")
    shots = Path(shots_dir) if shots_dir else None
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as done:
        done.callback(shutil.rmtree, tmp, ignore_errors=True)
        driver = browser(str(tmp / "profile"))
        done.callback(driver.quit)
        receiver = Receiver(behave=_behave).start()
        done.callback(receiver.stop)
        settings = done.enter_context(isolated_stack(real_stack, "console"))
        yield _start(done, settings, tenant, tmp, driver, receiver, shots)


def _start(
    done: contextlib.ExitStack,
    settings: Settings,
    tenant: str,
    tmp: Path,
    driver: WebDriver,
    receiver: Receiver,
    shots: Path | None,
) -> Console:
    """The worker, the proxy (its metrics served here), the API; each stopped by ``done``.
    Ports are free ones: another test run on the machine may hold the numbered ones."""
    from prometheus_client import start_http_server

    metrics_port, proxy_metrics_port, web_port, api_metrics_port, port = _free_ports(5)
    env = _env_for(settings, metrics_port, web_port)
    env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"
    worker = WorkerProcess(settings, env, tmp / "worker.log").start()
    done.callback(worker.stop)
    proxy = ProxyApp(
        settings,
        fast_settings(mode="fires", source_topic="", group_id=f"console-{uuid.uuid4().hex[:6]}"),
    )
    proxy.start()
    done.callback(proxy.stop, timeout_s=5)
    server, _ = start_http_server(
        proxy_metrics_port, addr="127.0.0.1", registry=proxy.metrics.registry
    )
    done.callback(server.server_close)
    done.callback(server.shutdown)
    admin = "admin-" + os.urandom(8).hex()
    env_api = dict(
        env,
        TOCSIN_METRICS_PORT=str(api_metrics_port),
        TOCSIN_API_METRICS_URLS=f"http://127.0.0.1:{metrics_port}/metrics,"
        f"http://127.0.0.1:{proxy_metrics_port}/metrics",
        TOCSIN_API_METRICS_SCRAPE_S="1",
    )
    api_proc = _start_api(env_api, port, admin, tmp / "api.log")
    done.callback(_stop, api_proc)
    base = f"http://127.0.0.1:{port}"
    until(lambda: _ready(base), 60, "the api")
    wait_worker_ready(settings, tenant, worker=worker)
    api = ApiServer(settings, base, admin, worker)
    alice = _register(api, f"alice-{uuid.uuid4().hex[:6]}")
    mallory = _register(api, f"mallory-{uuid.uuid4().hex[:6]}")
    return Console(settings, api, driver, receiver, alice, mallory, shots)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


def _register(api: ApiServer, name: str) -> dict[str, Any]:
    st, body = api.call("POST", "/v1/tenants", key=api.admin_key, body={"tenant": name})
    assert st == 201 and isinstance(body, dict), body
    return body


def _hits(c: Console, path: str) -> list[Hit]:
    return [h for h in c.receiver.hits if h.path == path]


def test_pause_holds_a_schedule_past_its_due_time_and_resume_fires_it(console: Console) -> None:
    c = console
    sid = f"billing/invoice-{uuid.uuid4().hex[:6]}"
    path = f"/paused-{uuid.uuid4().hex[:6]}"
    due = now_ms() + 8_000
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "due": due,
            "order_key": "customer-7",
            "payload": {"invoice": 7},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}{path}"},
        },
    )
    c.sign_in(c.alice["api_key"])
    assert c.h1() == "Schedules"
    c.check_page()
    # Find it by id prefix and order key.
    form = c.driver.find_element(By.CSS_SELECTOR, "form[role=search]")
    form.find_element(By.NAME, "id_prefix").send_keys("billing/")
    form.find_element(By.NAME, "order_key").send_keys("customer-7", Keys.ENTER)
    # The unfiltered page lists the new schedule too: a link found there goes stale when
    # the search's answer replaces the page.
    until(lambda: "order_key=customer-7" in c.driver.current_url, 15, "the search's answer")
    c.loaded()
    link = until(
        lambda: c.driver.find_elements(By.LINK_TEXT, sid), 10, "the schedule in the results"
    )[0]
    c.shot("schedules")
    link.click()
    assert c.h1() == f"Schedule {sid}"
    assert "scheduled" in c.text()
    c.check_page()
    c.click("Pause")
    until(lambda: "Paused" in c.text(), 15, "the pause to be answered")
    assert "paused" in c.driver.find_element(By.CSS_SELECTOR, "dl.facts").text
    # Past its due time (and the worker's next ticks), nothing is delivered.
    time.sleep(max(0.0, (due + 3_000 - now_ms()) / 1000))
    assert _hits(c, path) == [], "a paused schedule fired"
    c.driver.refresh()
    assert "paused" in c.driver.find_element(By.CSS_SELECTOR, "dl.facts").text
    c.click("Resume")
    until(lambda: "Resumed" in c.text(), 15, "the resume to be answered")
    until(lambda: _hits(c, path), 30, "the resumed schedule's delivery")

    def told() -> bool:
        # The fire and the delivery are recorded by separate streams, in either order.
        c.driver.refresh()
        events = c.driver.find_element(By.ID, "timeline").text
        return all(e in events for e in ("created", "paused", "resumed", "fired", "delivered"))

    until(told, 30, "the pause, resume, fire and delivery in the explain timeline")
    assert c.driver.find_element(By.ID, "why").text.startswith("Why: fired at ")
    c.shot("schedule")


def test_a_recurring_schedule_shows_its_next_runs_and_is_cancelled(console: Console) -> None:
    c = console
    sid = f"reports/daily-{uuid.uuid4().hex[:6]}"
    report = f"/report-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "recurrence": {"every_s": 3600},
            "payload": {"report": "daily"},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}{report}"},
        },
    )
    c.sign_in(c.alice["api_key"])
    c.open(f"/console/schedules/{sid}")
    assert c.h1() == f"Schedule {sid}"
    assert "Next runs" in c.text()
    runs = c.driver.find_elements(By.XPATH, "//table[caption='Next runs']//tr[td]")
    assert len(runs) >= 5, c.text()
    c.click("Trigger now")
    until(lambda: "Triggered" in c.text(), 15, "the trigger to be answered")
    until(lambda: _hits(c, report), 30, "the triggered run's delivery")
    # Keyboard: Tab reaches the Cancel button and Enter presses it.
    cancel = c.driver.find_element(By.XPATH, "//button[normalize-space()='Cancel schedule']")
    for _ in range(40):
        ActionChains(c.driver).send_keys(Keys.TAB).perform()
        if c.driver.switch_to.active_element == cancel:
            break
    assert c.driver.switch_to.active_element == cancel, "Cancel is not reachable by Tab"
    cancel.send_keys(Keys.ENTER)
    until(lambda: "Cancelled." in c.text(), 15, "the cancel to be answered")
    assert "cancelled" in c.driver.find_element(By.CSS_SELECTOR, "dl.facts").text


def test_a_dead_letter_is_grouped_by_host_and_status_and_redriven(console: Console) -> None:
    global REPAIRED
    c = console
    sid = f"hooks/broken-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "due": now_ms() + 1_000,
            "payload": {"hook": 1},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}/broken"},
        },
    )
    c.sign_in(c.alice["api_key"])

    def listed() -> bool:
        c.open("/console/dead-letters")
        return sid in c.text()

    until(listed, 40, "the dead letter on the page")
    assert c.h1() == "Deliveries and dead letters"
    by_host = c.driver.find_element(By.ID, "by-host").text
    assert "127.0.0.1 700" in by_host, by_host
    c.check_page()
    c.shot("dead-letters")
    REPAIRED = True
    row = c.driver.find_element(By.XPATH, f"//table[@id='letters']//tr[td//a[text()='{sid}']]")
    row.find_element(By.XPATH, ".//button[normalize-space()='Redrive']").click()
    until(lambda: "Sent again through the proxy." in c.text(), 15, "the redrive answer")
    until(lambda: [h for h in _hits(c, "/broken") if h.status == 200], 30, "the redriven call")
    row = c.driver.find_element(By.XPATH, f"//table[@id='letters']//tr[td//a[text()='{sid}']]")
    assert "redriven" in row.text


def test_another_tenant_sees_nothing_of_alices(console: Console) -> None:
    c = console
    sid = f"secret/plan-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "due": now_ms() + 3_600_000,
            "payload": {"secret": True},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}/secret"},
        },
    )
    # A dead letter of alice's, there before mallory looks.
    gone = f"secret/gone-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": gone,
            "due": now_ms() + 500,
            "payload": {},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}/gone"},
        },
    )

    def dead_lettered() -> bool:
        st, doc = c.api.call("GET", "/v1/dead-letters", key=c.alice["api_key"])
        return st == 200 and gone in str(doc)

    until(dead_lettered, 40, "alice's dead letter")
    c.sign_in(c.mallory["api_key"])
    # Alice's schedule reads exactly like an id that does not exist.
    c.open(f"/console/schedules/{sid}")
    seen = c.text().replace(sid, "<id>")
    missing = f"secret/none-{uuid.uuid4().hex[:6]}"
    c.open(f"/console/schedules/{missing}")
    assert c.text().replace(missing, "<id>") == seen
    assert c.h1() == "Not found"
    c.check_page()
    # Naming alice's tenant changes nothing for a tenant key.
    c.open(f"/console/schedules/{sid}?tenant={c.alice['tenant']}")
    assert c.h1() == "Not found"
    lo, hi = now_ms() - 86_400_000, now_ms() + 300 * 86_400_000
    c.open(f"/console/schedules?from={lo}&to={hi}")
    assert "No schedule matches" in c.text()
    for page in ("/console/schedules", "/console/dead-letters", "/console/health"):
        c.open(page + f"?tenant={c.alice['tenant']}")
        assert c.alice["tenant"] not in c.text(), page
        assert "secret/" not in c.text() and "billing/" not in c.text(), page
        assert "127.0.0.1" not in c.text(), page  # no host of alice's dead letters
    c.open("/console/tenants")
    assert c.h1() == "Error" and c.alice["tenant"] not in c.text()
    # The tenant's own Health page: its quota only.
    c.open("/console/health")
    assert c.mallory["tenant"] in c.text()


def test_the_admin_sees_health_charts_and_manages_tenants(console: Console) -> None:
    c = console
    sid = f"ops/seen-by-admin-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "due": now_ms() + 3_600_000,
            "payload": {},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}/ops"},
        },
    )
    c.sign_in(c.api.admin_key)
    c.open("/console/health")
    assert c.h1() == "Health"

    def scraped() -> bool:
        # Both URLs read, and the worker's lag measured (it is set as commands are read).
        c.driver.refresh()
        sources = c.driver.find_element(By.ID, "sources").text
        lag = c.driver.find_element(By.XPATH, "//tr[th='Commands topic consumer lag']/td").text
        return sources.count(" ok ") == 2 and lag.endswith(" messages")

    until(scraped, 20, "both metrics URLs read")
    assert len(c.driver.find_elements(By.CSS_SELECTOR, "figure svg[role=img]")) == 4
    c.check_page()
    c.shot("health")
    # A chosen tenant's schedules, and one of them with its timeline.
    c.open(f"/console/schedules?tenant={c.alice['tenant']}&id_prefix=ops/")
    c.driver.find_element(By.LINK_TEXT, sid).click()
    assert c.h1() == f"Schedule {sid}"
    assert "created" in c.driver.find_element(By.ID, "timeline").text
    c.click("Pause")  # the admin acts on the chosen tenant's schedule
    until(lambda: "Paused" in c.text(), 15, "the admin's pause to be answered")
    st, doc = c.api.call("GET", f"/v1/schedules/{quote(sid, safe='')}", key=c.alice["api_key"])
    assert st == 200 and isinstance(doc, dict) and doc["status"] == "paused", doc
    # Tenants: quotas and allowed hosts saved, a key issued and usable.
    c.open("/console/tenants")
    assert c.h1() == "Tenants"
    c.check_page()
    section = c.driver.find_element(
        By.XPATH, f"//section[h2[starts-with(., '{c.mallory['tenant']}')]]"
    )
    quota = section.find_element(By.NAME, "fire_quota_per_min")
    quota.clear()
    quota.send_keys("120")
    hosts = section.find_element(By.NAME, "allowed_callback_hosts")
    hosts.clear()
    hosts.send_keys("hooks.example.com, api.example.com", Keys.ENTER)
    until(lambda: f"Saved {c.mallory['tenant']}." in c.text(), 15, "the tenant saved")
    st, doc = c.api.call("GET", f"/v1/tenants/{c.mallory['tenant']}", key=c.api.admin_key)
    assert st == 200 and isinstance(doc, dict)
    assert doc["config"]["fire_quota_per_min"] == 120
    assert doc["config"]["allowed_callback_hosts"] == ["hooks.example.com", "api.example.com"]
    c.shot("tenants")
    section = c.driver.find_element(
        By.XPATH, f"//section[h2[starts-with(., '{c.mallory['tenant']}')]]"
    )
    section.find_element(By.XPATH, ".//button[normalize-space()='Issue a new key']").click()
    new_key = until(lambda: c.driver.find_elements(By.ID, "new-key"), 15, "the new key shown once")[
        0
    ].text
    st, _ = c.api.call("GET", "/v1/schedules?from=0&to=1000", key=new_key)
    assert st == 200


def test_actions_need_the_pages_token_and_origin(console: Console) -> None:
    """A cross-site form post carries neither the SameSite cookie nor the token; even with
    the cookie, a post without the token or from another origin is refused."""
    import http.client

    c = console
    host = c.api.base.removeprefix("http://")

    def post(
        headers: dict[str, str], body: str, path: str = "/console/actions/cancel/x"
    ) -> tuple[int, str]:
        conn = http.client.HTTPConnection(host, timeout=30)
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
        )
        resp = conn.getresponse()
        answer = (resp.status, resp.getheader("Location") or "")
        conn.close()
        return answer

    cookie = {"Cookie": f"tocsin_console_key={c.alice['api_key']}"}
    same = {"Origin": c.api.base}
    assert post({**cookie, "Origin": "https://evil.example"}, "csrf=x")[0] == 403
    assert post({**cookie, **same}, "csrf=wrong")[0] == 403
    assert post(same, "csrf=x")[0] == 303  # no cookie: to the sign-in page
    # Mallory's own valid post on alice's schedule acts on mallory's tenant: not found.
    sid = f"guarded-{uuid.uuid4().hex[:6]}"
    c.schedule(
        c.alice["api_key"],
        {
            "schedule_id": sid,
            "due": now_ms() + 3_600_000,
            "payload": {},
            "callback": {"type": "http", "url": f"http://127.0.0.1:{c.receiver.port}/g"},
        },
    )
    token = csrf_token(c.mallory["api_key"])
    mallory = {"Cookie": f"tocsin_console_key={c.mallory['api_key']}", **same}
    status, where = post(mallory, f"csrf={token}", path=f"/console/actions/cancel/{sid}")
    assert status == 303 and where.endswith("done=cancel&code=not_found"), where
    st, doc = c.api.call("GET", f"/v1/schedules/{sid}", key=c.alice["api_key"])
    assert st == 200 and isinstance(doc, dict) and doc["status"] == "scheduled"

"""Tenant enforcement on the real stack: fire quotas and fairness in the ticker, per-tenant
retention TTLs, the default retry policy applied by the proxy, signing-key rotation.

The worker here runs on a deployment of its own (prefix and keyspace: see
``isolated_stack``), so the quota test sees only its own triggers and the proxy reads only
this module's fires. No speed assertions: the quota is checked as the bounds a token bucket
cannot break (how many may fire at once, how early the last may fire), lateness only
against the misfire tolerance the test gives.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from base.cassandra import make_cluster
from base.settings import REPO_ROOT, Settings
from proxy.app import ProxyApp
from streams.client import CommandClient, FireWatcher, ResultWatcher
from streams.partitioner import partition_for
from streams.store import Store
from tests.integration.conftest import (
    WorkerProcess,
    _env_for,
    _ports,
    isolated_stack,
    wait_worker_ready,
)
from tests.integration.test_proxy_delivery import (
    Hit,
    Receiver,
    fast_settings,
    proxies,  # noqa: F401  (fixture)
    receiver,  # noqa: F401  (fixture)
    start_proxy,
    wait_for,
)
from topics.codes import Code
from topics.models import CancelCommand, CreateCommand, DeliveryRetry, HttpCallback, Trigger
from topics.signing import new_signing_key

pytestmark = pytest.mark.integration

PARTITIONS = 4  # the run's TOCSIN_COMMAND_PARTITIONS (tests/conftest.py)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def uid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


class Stack:
    """This module's worker and the settings its clients use."""

    def __init__(self, settings: Settings, worker: WorkerProcess, metrics_port: int) -> None:
        self.settings = settings
        self.worker = worker
        self.metrics_port = metrics_port

    def store_call(self, fn: Any) -> Any:
        async def run() -> Any:
            store = Store(self.settings.cassandra)
            await store.connect()
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())

    def add_tenant(self, name: str, config: dict[str, Any] | None = None) -> str:
        """Register ``name`` with a signing key; returns the key."""
        key = new_signing_key()
        self.store_call(
            lambda s: s.put_tenant(
                name,
                active=True,
                created_ms=now_ms(),
                config=orjson.dumps(config or {}).decode(),
                signing_secret=key,
            )
        )
        return key

    def metric(self, name: str, labels: dict[str, str]) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10
        ) as r:
            text = r.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def cql(self, query: str, params: tuple[Any, ...]) -> Any:
        cluster = make_cluster(self.settings.cassandra)
        try:
            return cluster.connect().execute(query, params).one()
        finally:
            cluster.shutdown()


@pytest.fixture(scope="module")
def te(real_stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with isolated_stack(real_stack, "te") as own:
        yield from _te_stack(own, tmp_path_factory)


def _te_stack(own: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    metrics_port, web_port = next(_ports), next(_ports)
    env = _env_for(own, metrics_port, web_port)
    env["TOCSIN_TENANT_CACHE_TTL_S"] = "1"  # rotations and retirements apply within 1 s
    settings = Settings.from_env(env)
    worker = WorkerProcess(settings, env, tmp_path_factory.mktemp("te") / "worker.log").start()
    stack = Stack(settings, worker, metrics_port)
    try:
        probe_tenant = uid("probe")
        stack.add_tenant(probe_tenant)
        wait_worker_ready(settings, probe_tenant, worker=worker)
        yield stack
    finally:
        worker.stop()


def send_all(
    settings: Settings, commands: list[CreateCommand], *, signing_key: str | None = None
) -> dict[str, Any]:
    client, results = CommandClient(settings), ResultWatcher(settings)
    try:
        for cmd in commands:
            client.send(cmd, signing_key=signing_key)
        client.flush()
        return results.wait_for([c.schedule_id for c in commands], timeout_s=90)
    finally:
        results.close()


def ids_per_partition(prefix: str, per_partition: int) -> list[str]:
    """Schedule ids with exactly ``per_partition`` on each commands partition (murmur2)."""
    counts: Counter[int] = Counter()
    out = []
    n = 0
    while len(out) < per_partition * PARTITIONS:
        sid = f"{prefix}{n}"
        n += 1
        p = partition_for(sid.encode(), PARTITIONS)
        if counts[p] < per_partition:
            counts[p] += 1
            out.append(sid)
    return out


# -- fire quota and fairness ----------------------------------------------------------------


def test_fire_quota_defers_a_burst_without_losses_and_other_tenants_fire_on_time(
    te: Stack,
) -> None:
    # 480 fires/min over 4 partitions: per partition 120 at once, then 2 a second. Tenant A
    # has 160 per partition due in the same second: 40 of each wait, the last ~20 s.
    quota, per_partition, burst, rate = 480, 160, 120, 2.0
    a, b = uid("qa"), uid("qb")
    te.add_tenant(a, {"fire_quota_per_min": quota})
    te.add_tenant(b)
    due = (now_ms() // 1000 + 15) * 1000
    tolerance_s = 5  # A's triggers wait far longer than this for tokens: still not missed
    cb = HttpCallback(url="https://receiver.example/cb")
    a_ids = ids_per_partition(f"{a}-", per_partition)
    b_ids = [f"{b}-{i}" for i in range(40)]
    commands = [
        CreateCommand(
            tenant=t, schedule_id=sid, due_ms=due, callback=cb, misfire_tolerance_s=tolerance_s
        )
        for t, sids in ((a, a_ids), (b, b_ids))
        for sid in sids
    ]
    fires = FireWatcher(te.settings, from_start=True)
    try:
        results = send_all(te.settings, commands)
        assert {r.code for r in results.values()} == {Code.OK}, Counter(
            r.code for r in results.values()
        )
        assert now_ms() < due, "setup took longer than the lead time; raise it"
        seen: dict[str, Trigger] = {}
        want = set(a_ids) | set(b_ids)
        deadline = time.monotonic() + 120
        while want - set(seen) and time.monotonic() < deadline:
            for trig, _ in fires.poll():
                if trig.schedule_id in want:
                    seen.setdefault(trig.schedule_id, trig)
    finally:
        fires.close()
    missing = want - set(seen)
    assert not missing, f"{len(missing)} never fired:\n{te.worker.log_tail()}"

    # B: every trigger on time, i.e. within its misfire tolerance, despite A's burst.
    b_late = [seen[s].emitted_ms - due for s in b_ids]
    assert max(b_late) <= tolerance_s * 1000, b_late
    # A: the quota held - at most a minute's share per partition (plus what refilled in
    # that second) went out in the due second, and the last cannot have gone before the
    # tokens for it existed.
    a_emits = sorted(seen[s].emitted_ms for s in a_ids)
    assert sum(1 for t in a_emits if t < due + 1000) <= PARTITIONS * (burst + rate)
    earliest_possible_last = due + (per_partition - burst) / rate * 1000
    assert a_emits[-1] >= earliest_possible_last - 1000
    # ... and deferral never became a miss: every schedule of both tenants is fired. The
    # fired marks follow the emits (grouped, 250 ms linger), so the last ones may land a
    # moment after the test saw the last trigger: read until they are all there.
    want_states = Counter({"fired": len(a_ids) + len(b_ids)})
    marks_deadline = time.monotonic() + 30
    while True:
        rows: dict[str, Any] = {}
        for t, sids in ((a, a_ids), (b, b_ids)):
            rows.update(te.store_call(lambda s, t=t, sids=sids: s.get_schedules(t, sids)))
        states = Counter(r["state"] for r in rows.values())
        if states == want_states or time.monotonic() > marks_deadline:
            break
        time.sleep(0.5)
    assert states == want_states, states
    throttled = te.metric("tocsin_fires_throttled_total", {"tenant": a})
    assert throttled >= PARTITIONS * (per_partition - burst) * 0.9, throttled
    assert te.metric("tocsin_fires_throttled_total", {"tenant": b}) == 0


# -- per-tenant retention -------------------------------------------------------------------


def test_tenant_retention_is_the_ttl_of_fired_and_cancelled_rows(te: Stack) -> None:
    short, default = uid("ret"), uid("glob")
    te.add_tenant(short, {"retention_s": 6000})
    te.add_tenant(default)
    due = now_ms() + 2_000
    cb = HttpCallback(url="https://receiver.example/cb")

    def create(tenant: str, sid: str, due_ms: int) -> CreateCommand:
        return CreateCommand(
            tenant=tenant,
            schedule_id=sid,
            due_ms=due_ms,
            callback=cb,
            misfire_tolerance_s=60,
            payload=b"x",
        )

    results = send_all(
        te.settings,
        [
            create(short, "fire-s", due),
            create(default, "fire-d", due),
            create(short, "later", due + 3_600_000),
        ],
    )
    assert [r.code for r in results.values()] == [Code.OK] * 3
    # Scheduled: lives until due + retention (an hour and 2 s ahead, + 6,000 s).
    ks = te.settings.cassandra.keyspace
    row = te.cql(
        f"SELECT TTL(state) AS t FROM {ks}.schedules WHERE tenant=%s AND schedule_id=%s",
        (short, "later"),
    )
    assert 3_600 + 5_900 < row.t <= 3_602 + 6_000, row

    def fired(tenant: str, sid: str) -> bool:
        r = te.store_call(lambda s: s.get_schedule(tenant, sid))
        return r is not None and r["state"] == "fired"

    wait_for(lambda: fired(short, "fire-s") and fired(default, "fire-d"), 60, "both fired")
    for tenant, sid, expect in (
        (short, "fire-s", 6000),
        (default, "fire-d", te.settings.scheduler.fired_retention_s),
    ):
        row = te.cql(
            f"SELECT TTL(state) AS s, TTL(fired_ms) AS f, TTL(payload) AS p FROM "
            f"{ks}.schedules WHERE tenant=%s AND schedule_id=%s",
            (tenant, sid),
        )
        assert expect - 60 < row.s <= expect and expect - 60 < row.f <= expect, (tenant, row)
        assert expect - 60 < row.p <= expect + 10, (tenant, row)  # due + retention
        event = te.cql(
            f"SELECT TTL(trigger_id) AS t FROM {ks}.schedule_events WHERE "
            "tenant=%s AND schedule_id=%s AND event='fired' "
            "ALLOW FILTERING",
            (tenant, sid),
        )
        assert expect - 60 < event.t <= expect, (tenant, event)
    # A cancel is terminal too: the row is kept the tenant's retention from now.
    client, watcher = CommandClient(te.settings), ResultWatcher(te.settings)
    try:
        client.send(CancelCommand(tenant=short, schedule_id="later"))
        client.flush()
        assert watcher.wait_for(["later"], 60)["later"].code == Code.OK
    finally:
        watcher.close()
    row = te.cql(
        f"SELECT TTL(state) AS t FROM {ks}.schedules WHERE tenant=%s AND schedule_id=%s",
        (short, "later"),
    )
    assert 5_940 < row.t <= 6_000


# -- default retry policy ---------------------------------------------------------------------


def test_tenant_default_retry_policy_is_stamped_and_the_proxy_applies_it(
    te: Stack,
    receiver: Receiver,  # noqa: F811
    proxies: list[ProxyApp],  # noqa: F811
) -> None:
    tenant = uid("rp")
    te.add_tenant(tenant, {"retry_policy": {"retries_6xx": 1}})

    def behave(hit: Hit, n: int) -> int:
        return 600  # "try a few times": retried at most retries_6xx times, then dead

    receiver.behave = behave
    base = f"http://127.0.0.1:{receiver.port}"
    due = now_ms() + 2_000
    commands = [
        CreateCommand(
            tenant=tenant,
            schedule_id="default",
            due_ms=due,
            payload=b"default",
            callback=HttpCallback(url=base + "/default"),
            misfire_tolerance_s=60,
        ),
        CreateCommand(
            tenant=tenant,
            schedule_id="own",
            due_ms=due,
            payload=b"own",
            callback=HttpCallback(url=base + "/own", retry=DeliveryRetry(retries_6xx=0)),
            misfire_tolerance_s=60,
        ),
    ]
    results = send_all(te.settings, commands)
    assert {r.code for r in results.values()} == {Code.OK}
    stored = te.store_call(lambda s: s.get_schedules(tenant, ["default", "own"]))
    assert orjson.loads(stored["default"]["callback"])["retry"] == {
        "max_retry_age_s": None,
        "retries_6xx": 1,
    }
    assert orjson.loads(stored["own"]["callback"])["retry"]["retries_6xx"] == 0
    # The proxy's own policy would retry a 6xx three times.
    ps = fast_settings(mode="fires", source_topic="", endpoint_url="", retries_6xx=3)
    start_proxy(te.settings, ps, proxies)

    def outcome(sid: str) -> str | None:
        row = te.store_call(lambda s: s.get_schedule(tenant, sid))
        return row.get("delivery_outcome") if row else None

    wait_for(
        lambda: outcome("default") == "dead_lettered" and outcome("own") == "dead_lettered",
        90,
        "both dead-lettered",
    )
    attempts: dict[str, int] = defaultdict(int)
    for h in receiver.hits:
        attempts[h.path] += 1
    assert attempts["/default"] == 2  # first try + the tenant's retries_6xx=1
    assert attempts["/own"] == 1  # its own retries_6xx=0 wins over the tenant default


# -- signing-key rotation ---------------------------------------------------------------------


def rotate_cli(settings: Settings, tenant: str, *extra: str) -> dict[str, Any]:
    env = dict(
        os.environ,
        TOCSIN_CASSANDRA_KEYSPACE=settings.cassandra.keyspace,
        TOCSIN_TOPIC_PREFIX=settings.topics.prefix,
    )
    out = subprocess.run(
        [sys.executable, "-m", "tocsin.cli", "tenant", "rotate-key", tenant, "--json", *extra],
        env=env,
        cwd=Path(REPO_ROOT),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()
    result: dict[str, Any] = orjson.loads(out.stdout)
    return result


def test_signing_key_rotation_old_key_valid_until_retired(te: Stack) -> None:
    tenant = uid("rot")
    old = te.add_tenant(tenant)
    cb = HttpCallback(url="https://receiver.example/cb")
    due = now_ms() + 3_600_000

    def code_of(sid: str, key: str | None) -> Code:
        cmd = CreateCommand(
            tenant=tenant, schedule_id=sid, due_ms=due, callback=cb, misfire_tolerance_s=60
        )
        return send_all(te.settings, [cmd], signing_key=key)[sid].code

    assert code_of("before", old) == Code.OK
    rotated = rotate_cli(te.settings, tenant)
    new = rotated["signing_key"]
    assert new != old and rotated["previous_key"] and rotated["previous_expires_ms"] is None
    time.sleep(2.5)  # workers cache tenants for TOCSIN_TENANT_CACHE_TTL_S=1
    assert code_of("old-during", old) == Code.OK
    assert code_of("new-during", new) == Code.OK
    assert code_of("client-default", None) == Code.OK  # CommandClient: the current key
    assert code_of("stranger", new_signing_key()) == Code.BAD_SIGNATURE

    retired = rotate_cli(te.settings, tenant, "--retire-previous")
    assert retired["previous_retired_ms"] <= now_ms()
    time.sleep(2.5)
    assert code_of("old-after", old) == Code.SIGNING_KEY_RETIRED
    assert code_of("new-after", new) == Code.OK
    row = te.store_call(lambda s: s.get_tenant(tenant))
    assert row["signing_secret"] == new and row["previous_signing_secret"] == old

    # A tenant from before signing keys gets its first one the same way.
    legacy = uid("legacy")
    te.store_call(lambda s: s.put_tenant(legacy, active=True, created_ms=now_ms(), config="{}"))
    first = rotate_cli(te.settings, legacy)
    assert first["signing_key"] and not first["previous_key"]
    row = te.store_call(lambda s: s.get_tenant(legacy))
    assert row["signing_secret"] == first["signing_key"]
    assert row["previous_signing_secret"] is None


def test_signing_key_rotation_through_the_admin_api(api_server: Any) -> None:
    st, t = api_server.call(
        "POST", "/v1/tenants", key=api_server.admin_key, body={"tenant": uid("apirot")}
    )
    assert st == 201
    name, old = t["tenant"], t["signing_key"]
    path = f"/v1/tenants/{name}/signing-key"
    assert api_server.call("POST", path, key=t["api_key"])[0] == 403  # admin only
    st, rotated = api_server.call(
        "POST", path, key=api_server.admin_key, body={"previous_valid_s": 3600}
    )
    assert st == 201 and rotated["signing_key"] not in (old, None), rotated
    assert rotated["previous_expires_ms"] > now_ms()
    st, view = api_server.call("GET", f"/v1/tenants/{name}", key=api_server.admin_key)
    assert st == 200 and view["signing_key"]["previous_key"] == "valid"
    assert old not in orjson.dumps(view).decode()

    def create(sid: str) -> int:
        status, _ = api_server.call(
            "POST",
            "/v1/schedules",
            key=t["api_key"],
            body={
                "schedule_id": sid,
                "due": now_ms() + 3_600_000,
                "callback": {"type": "http", "url": "https://h.example/x"},
            },
        )
        return int(status)

    assert create("during") == 201  # the API signs with the new key at once
    st, done = api_server.call("DELETE", f"{path}/previous", key=api_server.admin_key)
    assert st == 200 and done["previous_retired_ms"] <= now_ms()
    st, view = api_server.call("GET", f"/v1/tenants/{name}", key=api_server.admin_key)
    assert view["signing_key"]["previous_key"] == "retired"
    st, again = api_server.call("DELETE", f"{path}/previous", key=api_server.admin_key)
    assert st == 409 and again["error"]["code"] == "no_previous_key"
    assert create("after") == 201
    time.sleep(2.5)  # the API's worker caches tenants for 1 s
    cmd = CreateCommand(
        tenant=name,
        schedule_id=uid("old-key-"),
        due_ms=now_ms() + 60_000,
        callback=HttpCallback(url="https://h.example/x"),
        misfire_tolerance_s=60,
    )
    got = send_all(api_server.settings, [cmd], signing_key=old)
    assert got[cmd.schedule_id].code == Code.SIGNING_KEY_RETIRED
    st, _ = api_server.call("POST", "/v1/tenants/nobody-here/signing-key", key=api_server.admin_key)
    assert st == 404

"""``tocsin tenant``: creating a tenant never touches an existing one's keys or limits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from typing import Any

import orjson

from base.settings import REPO_ROOT, Settings
from streams.store import Store


def _tocsin(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        TOCSIN_TOPIC_PREFIX=settings.topics.prefix,
        TOCSIN_CASSANDRA_KEYSPACE=settings.cassandra.keyspace,
        TOCSIN_LOG_LEVEL="WARNING",
    )
    return subprocess.run(
        [sys.executable, "-m", "tocsin.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _tenant_row(settings: Settings, name: str) -> dict[str, Any] | None:
    async def read() -> dict[str, Any] | None:
        store = Store(settings.cassandra)
        await store.connect()
        try:
            return await store.get_tenant(name)
        finally:
            await store.close()

    return asyncio.run(read())


def test_creating_an_existing_tenant_leaves_its_keys_and_limits(real_stack: Settings) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    out = _tocsin(real_stack, "tenant", "register", name, "--create-quota", "7")
    assert out.returncode == 0, out.stderr
    # The signing key producers sign with is printed once.
    assert "signing key  tss_" in out.stdout
    before = _tenant_row(real_stack, name)
    assert before is not None
    assert orjson.loads(before["config"])["create_quota_per_s"] == 7

    # Every way of asking to create it again: refused, or left alone with --exist-ok;
    # never a new signing key nor a reset configuration.
    legacy = _tocsin(real_stack, "tenant", "add", name)
    assert legacy.returncode != 0
    replaced = _tenant_row(real_stack, name)
    assert replaced is not None and replaced["signing_secret"] == before["signing_secret"]
    refused = _tocsin(real_stack, "tenant", "register", name)
    assert refused.returncode == 1
    assert "rotate-key" in refused.stderr
    again = _tocsin(real_stack, "tenant", "register", name, "--exist-ok", "--no-print-keys")
    assert again.returncode == 0, again.stderr
    assert "left unchanged" in again.stdout and "tss_" not in again.stdout

    after = _tenant_row(real_stack, name)
    assert after is not None
    assert after["signing_secret"] == before["signing_secret"]
    assert after["config"] == before["config"]


def test_setup_style_registration_prints_no_keys(real_stack: Settings) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    out = _tocsin(real_stack, "tenant", "register", name, "--exist-ok", "--no-print-keys")
    assert out.returncode == 0, out.stderr
    assert "tss_" not in out.stdout and "tsk_" not in out.stdout
    row = _tenant_row(real_stack, name)
    assert row is not None and row["signing_secret"].startswith("tss_")

"""The proxy under failure: SIGKILL mid-stream and restart; two instances rebalancing.

The promise is at-least-once with per-key order: nothing is ever lost, duplicates are
possible (and counted), and within one proxy's lifetime a key is delivered in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from proxy.app import ProxyApp
from tests.integration.test_proxy_delivery import (
    Hit,
    Receiver,
    create_topics,
    fast_settings,
    parse_body,
    produce,
    seq_body,
    start_proxy,
    uid,
    wait_for,
)
from tocsin.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def first_seen_in_order(hits: list[Hit], keys: list[str], per_key: int) -> dict[str, int]:
    """Assert nothing lost and first deliveries in order; return duplicates per key."""
    seqs: dict[str, list[int]] = defaultdict(list)
    for h in hits:
        key, seq, _ = parse_body(h.body)
        seqs[key].append(seq)
    dups: dict[str, int] = {}
    for key in keys:
        firsts: list[int] = []
        for s in seqs[key]:
            if s not in firsts:
                firsts.append(s)
        assert firsts == list(range(per_key)), f"lost or reordered for {key}: {firsts}"
        dups[key] = len(seqs[key]) - per_key
    return dups


def strictly_increasing_per_key(hits: list[Hit]) -> None:
    seqs: dict[str, list[int]] = defaultdict(list)
    for h in hits:
        key, seq, _ = parse_body(h.body)
        seqs[key].append(seq)
    for key, s in seqs.items():
        assert s == sorted(set(s)), f"order broken within one proxy lifetime for {key}: {s}"


def spawn_proxy(stack: Settings, env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TOCSIN_")},
        "TOCSIN_KAFKA_BOOTSTRAP_SERVERS": stack.kafka.bootstrap_servers,
        "TOCSIN_LOG_LEVEL": "WARNING",
        "TOCSIN_PROXY_MODE": "generic",
        "TOCSIN_PROXY_COMMIT_INTERVAL_S": "0.3",
        "TOCSIN_PROXY_SESSION_TIMEOUT_S": "6",
        "TOCSIN_PROXY_METRICS_PORT": "0",
        "TOCSIN_PROXY_CONCURRENCY": "16",
        "TOCSIN_PROXY_PER_HOST_CONCURRENCY": "16",
        "TOCSIN_PROXY_RETRY_BASE_DELAY_S": "0.02",
        "TOCSIN_PROXY_RETRY_MAX_DELAY_S": "0.2",
        **env_extra,
    }
    return subprocess.Popen([sys.executable, "-m", "proxy"], cwd=REPO, env=env)


def test_sigkill_mid_stream_then_restart_loses_nothing(stack: Settings) -> None:
    topic = f"{stack.topics.prefix}src-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=4)
    create_topics(stack, [dlq])
    keys, per_key = [f"k{i}" for i in range(40)], 50
    receiver = Receiver(behave=lambda hit, n: (500 if n == 1 and hit.body.endswith(b"!")
                                               else (200, {}, 0.003))).start()
    try:
        # Every 10th message fails once, so retries are in flight when the kill lands.
        produce(stack, topic, [(k.encode(), seq_body(k, s, "!" if s % 10 == 0 else ""), None)
                               for s in range(per_key) for k in keys])
        env = {"TOCSIN_PROXY_SOURCE_TOPIC": topic, "TOCSIN_PROXY_ENDPOINT_URL": receiver.url,
               "TOCSIN_PROXY_GROUP_ID": f"proxy-{uid()}",
               "TOCSIN_PROXY_DEAD_LETTER_TOPIC": dlq}
        first = spawn_proxy(stack, env)
        try:
            wait_for(lambda: len(receiver.delivered()) >= 600, 60, "some deliveries")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        time.sleep(0.5)  # let requests the dead process left behind finish on the receiver
        restart_at = time.time()
        second = spawn_proxy(stack, env)
        try:
            total = len(keys) * per_key
            wait_for(lambda: len({h.body for h in receiver.delivered()}) >= total, 120,
                     "every message after the restart")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        hits = receiver.delivered()
        dups = first_seen_in_order(hits, keys, per_key)
        strictly_increasing_per_key([h for h in hits if h.at < restart_at])
        strictly_increasing_per_key([h for h in hits if h.at >= restart_at])
        print(f"\nsigkill: delivered={len(hits)} unique={total} "
              f"duplicates={sum(dups.values())}")
    finally:
        receiver.stop()


def test_two_proxies_rebalance_keeps_order_and_loses_nothing(stack: Settings) -> None:
    topic = f"{stack.topics.prefix}src-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=6)
    create_topics(stack, [dlq])
    keys, per_key = [f"k{i}" for i in range(48)], 40
    receiver = Receiver(behave=lambda hit, n: (200, {}, 0.004)).start()
    apps: list[ProxyApp] = []
    try:
        produce(stack, topic, [(k.encode(), seq_body(k, s), None)
                               for s in range(per_key) for k in keys])
        ps = fast_settings(source_topic=topic, endpoint_url=receiver.url,
                           dead_letter_topic=dlq, concurrency=8, per_host_concurrency=8)
        a = start_proxy(stack, ps, apps)
        wait_for(lambda: len(receiver.delivered()) >= 300, 60, "A delivering")
        b = start_proxy(stack, ps, apps)
        wait_for(lambda: bool(b.reader.assignment), 60, "B to get partitions")
        wait_for(lambda: len(receiver.delivered()) >= 1000, 60, "A and B delivering")
        a.stop()  # graceful leave: a second rebalance hands everything to B
        total = len(keys) * per_key
        wait_for(lambda: len({h.body for h in receiver.delivered()}) >= total, 120,
                 "every message")
        dups = first_seen_in_order(receiver.delivered(), keys, per_key)
        print(f"\nrebalance: delivered={len(receiver.delivered())} unique={total} "
              f"duplicates={sum(dups.values())}")
        assert a.metrics.rebalances.labels("revoked")._value.get() > 0
    finally:
        for app in apps:
            app.stop(timeout_s=5)
        receiver.stop()

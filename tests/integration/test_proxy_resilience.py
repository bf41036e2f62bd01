"""The proxy under failure: SIGKILL mid-stream and restart; two instances rebalancing; a
tenant whose endpoint keeps failing; a message failing long enough to be parked.

The promise is at-least-once with per-key order: nothing is ever lost, duplicates are
possible (and counted), and within one proxy's lifetime a key is delivered in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from base.settings import Settings
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
    return subprocess.Popen([sys.executable, "-m", "tocsin", "proxy"], cwd=REPO, env=env)


def test_sigkill_mid_stream_then_restart_loses_nothing(stack: Settings) -> None:
    topic = f"{stack.topics.prefix}src-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=4)
    create_topics(stack, [dlq])
    keys, per_key = [f"k{i}" for i in range(40)], 50
    receiver = Receiver(
        behave=lambda hit, n: 500 if n == 1 and hit.body.endswith(b"!") else (200, {}, 0.003)
    ).start()
    try:
        # Every 10th message fails once, so retries are in flight when the kill lands.
        produce(
            stack,
            topic,
            [
                (k.encode(), seq_body(k, s, "!" if s % 10 == 0 else ""), None)
                for s in range(per_key)
                for k in keys
            ],
        )
        env = {
            "TOCSIN_PROXY_SOURCE_TOPIC": topic,
            "TOCSIN_PROXY_ENDPOINT_URL": receiver.url,
            "TOCSIN_PROXY_GROUP_ID": f"proxy-{uid()}",
            "TOCSIN_PROXY_DEAD_LETTER_TOPIC": dlq,
        }
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
            wait_for(
                lambda: len({h.body for h in receiver.delivered()}) >= total,
                120,
                "every message after the restart",
            )
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
        hits = receiver.delivered()
        dups = first_seen_in_order(hits, keys, per_key)
        strictly_increasing_per_key([h for h in hits if h.at < restart_at])
        strictly_increasing_per_key([h for h in hits if h.at >= restart_at])
        print(f"\nsigkill: delivered={len(hits)} unique={total} duplicates={sum(dups.values())}")
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
        produce(
            stack, topic, [(k.encode(), seq_body(k, s), None) for s in range(per_key) for k in keys]
        )
        ps = fast_settings(
            source_topic=topic,
            endpoint_url=receiver.url,
            dead_letter_topic=dlq,
            concurrency=8,
            per_host_concurrency=8,
        )
        a = start_proxy(stack, ps, apps)
        wait_for(lambda: len(receiver.delivered()) >= 300, 60, "A delivering")
        b = start_proxy(stack, ps, apps)
        wait_for(lambda: bool(b.reader.assignment), 60, "B to get partitions")
        wait_for(lambda: len(receiver.delivered()) >= 1000, 60, "A and B delivering")
        a.stop()  # graceful leave: a second rebalance hands everything to B
        total = len(keys) * per_key
        wait_for(lambda: len({h.body for h in receiver.delivered()}) >= total, 120, "every message")
        dups = first_seen_in_order(receiver.delivered(), keys, per_key)
        print(
            f"\nrebalance: delivered={len(receiver.delivered())} unique={total} "
            f"duplicates={sum(dups.values())}"
        )
        assert a.metrics.rebalances.labels("revoked")._value.get() > 0
    finally:
        for app in apps:
            app.stop(timeout_s=5)
        receiver.stop()


def committed_offsets(stack: Settings, group: str, topic: str, partitions: int) -> list[int]:
    c = Consumer({**stack.kafka.librdkafka(), "group.id": group, "enable.auto.commit": False})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return [tp.offset for tp in got]
    finally:
        c.close()


def test_a_failing_tenant_neither_pauses_another_nor_pins_the_commit_position(
    stack: Settings,
) -> None:
    """Tenant A's endpoint answers 503 to 200 triggers of 48 KiB (about 20 MB held at the
    proxy's estimate, five times its 4 MiB bound); once they are all being retried, tenant
    B's 300 triggers come on the same partitions. B's all arrive, and the fires topic's
    commit position reaches its end while A is still failing."""
    fires = f"{stack.topics.prefix}fires-{uid()}"
    retries = f"{stack.topics.prefix}retries-{uid()}"
    dlq, deliveries = f"{stack.topics.prefix}dlq-{uid()}", f"{stack.topics.prefix}dl-{uid()}"
    create_topics(stack, [fires, retries], partitions=2)
    create_topics(stack, [dlq, deliveries])
    receiver = Receiver(behave=lambda hit, n: 503 if hit.path == "/a" else 200).start()
    apps: list[ProxyApp] = []
    base = f"http://127.0.0.1:{receiver.port}"

    def trigger(tenant: str, sid: str, path: str, payload: object) -> bytes:
        return orjson.dumps(
            {
                "trigger_id": f"t-{sid}",
                "schedule_id": sid,
                "tenant": tenant,
                "due_ms": 1_700_000_000_000,
                "emitted_ms": 1_700_000_000_005,
                "attempt": 1,
                "order_key": sid,
                "payload": payload,
                "callback": {"type": "http", "url": base + path, "timeout_s": 5},
            }
        )

    pad = "x" * 48 * 1024
    a_ids = [f"a{i}" for i in range(200)]
    b_ids = [f"b{i}" for i in range(300)]
    try:
        produce(
            stack,
            fires,
            [(sid.encode(), trigger("tenant-a", sid, "/a", {"pad": pad}), None) for sid in a_ids],
        )
        ps = fast_settings(
            mode="fires",
            source_topic=fires,
            endpoint_url="",
            dead_letter_topic=dlq,
            deliveries_topic=deliveries,
            retry_topic=retries,
            max_pending_bytes=4 * 1024 * 1024,
            retry_base_delay_s=0.05,
            retry_max_delay_s=0.5,
            park_after_s=1.0,
            # Each message's own retries and parking: a breaker would hold most of A's
            # triggers unattempted (that case is test_proxy_hostlimits').
            breaker_failures=0,
        )
        app = start_proxy(stack, ps, apps)

        def attempted(path: str) -> set[str]:
            with receiver._lock:
                return {h.headers["Tocsin-Schedule-Id"] for h in receiver.hits if h.path == path}

        # Every trigger of A is attempted, its failing ones parked onto the retries topic,
        # before B's are produced: B's must still be read while A keeps failing.
        wait_for(lambda: attempted("/a") == set(a_ids), 90, "every trigger of A attempted")
        produce(
            stack,
            fires,
            [(sid.encode(), trigger("tenant-b", sid, "/b", {"n": sid}), None) for sid in b_ids],
        )
        wait_for(lambda: attempted("/b") >= set(b_ids), 90, "every trigger of tenant B")
        assert {h.headers["Tocsin-Schedule-Id"] for h in receiver.delivered()} == set(b_ids)
        ends = end_offsets(stack, fires, 2)
        wait_for(
            lambda: committed_offsets(stack, ps.group_id, fires, 2) == ends,
            60,
            f"the fires topic committed to its end {ends} while A fails",
        )
        assert not any(h.status == 200 for h in receiver.hits if h.path == "/a")
        assert app.metrics.parked.labels("retrying")._value.get() > 0
        assert app.failure() is None
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()


def end_offsets(stack: Settings, topic: str, partitions: int) -> list[int]:
    c = Consumer({**stack.kafka.librdkafka(), "group.id": f"ends-{uid()}"})
    try:
        return [
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        ]
    finally:
        c.close()


def test_a_long_failing_message_is_parked_and_its_key_stays_in_order(stack: Settings) -> None:
    """Message 0 of a key fails until the source is committed past every message of the
    key (possible only once it is parked, with the 19 after it parked behind it); then the
    receiver recovers and the key arrives in order 0..19."""
    topic, retries = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}rt-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic, retries, dlq])
    recovered = threading.Event()

    def behave(hit: Hit, n: int) -> Any:
        return 503 if hit.body == seq_body("k", 0) and not recovered.is_set() else 200

    receiver = Receiver(behave=behave).start()
    apps: list[ProxyApp] = []
    try:
        produce(
            stack,
            topic,
            [(b"k", seq_body("k", s), None) for s in range(20)]
            + [(b"other", seq_body("other", s), None) for s in range(5)],
        )
        ps = fast_settings(
            source_topic=topic,
            endpoint_url=receiver.url,
            dead_letter_topic=dlq,
            retry_topic=retries,
            retry_base_delay_s=0.05,
            retry_max_delay_s=0.2,
            park_after_s=0.5,
        )
        start_proxy(stack, ps, apps)
        wait_for(
            lambda: committed_offsets(stack, ps.group_id, topic, 1) == [25],
            60,
            "the source committed past the failing message",
        )
        assert not any(h.key == "k" and h.status == 200 for h in receiver.hits)
        recovered.set()
        wait_for(
            lambda: len({h.body for h in receiver.delivered()}) == 25,
            60,
            "every message once the receiver recovered",
        )
        firsts: list[int] = []
        for h in receiver.delivered():
            key, seq, _ = parse_body(h.body)
            if key == "k" and seq not in firsts:
                firsts.append(seq)
        assert firsts == list(range(20))
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()


def test_two_proxies_keep_each_parked_keys_order(stack: Settings) -> None:
    """Two proxies share a group over 2 source partitions and a retries topic of 3. Message
    0 of each of 12 keys fails until every source message is committed (so each was parked,
    the 4 after it parked behind it); then the receiver recovers, and every key arrives in
    order 0..4 whichever proxy owns its partition. (The retries topic has another partition
    count than the source so that Kafka's partitioner would put a key's parked records on a
    retries partition unrelated to its source partition.)"""
    topic, retries = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}rt-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic], partitions=2)
    create_topics(stack, [retries], partitions=3)
    create_topics(stack, [dlq])
    keys = [f"k{i}" for i in range(12)]
    heads = {seq_body(k, 0) for k in keys}
    recovered = threading.Event()
    receiver = Receiver(
        behave=lambda hit, n: 503 if hit.body in heads and not recovered.is_set() else 200
    ).start()
    apps: list[ProxyApp] = []
    try:
        ps = fast_settings(
            source_topic=topic,
            endpoint_url=receiver.url,
            dead_letter_topic=dlq,
            retry_topic=retries,
            retry_base_delay_s=0.05,
            retry_max_delay_s=0.2,
            park_after_s=0.3,
        )
        one, two = start_proxy(stack, ps, apps), start_proxy(stack, ps, apps)
        wait_for(
            lambda: (
                all(len(a.reader.assignment) == 1 for a in (one, two))
                and sum(len(a.retry_reader.assignment) for a in (one, two)) == 3
                and all(a.retry_reader.assignment for a in (one, two))
            ),
            60,
            "both proxies holding a source and a retries partition",
        )
        produce(stack, topic, [(k.encode(), seq_body(k, s), None) for s in range(5) for k in keys])
        wait_for(
            lambda: sum(committed_offsets(stack, ps.group_id, topic, 2)) == 60,
            90,
            "the source committed past every failing message",
        )
        recovered.set()
        wait_for(
            lambda: len({h.body for h in receiver.delivered()}) == 60,
            90,
            "every message once the receiver recovered",
        )
        firsts: dict[str, list[int]] = defaultdict(list)
        for h in receiver.delivered():
            key, seq, _ = parse_body(h.body)
            if seq not in firsts[key]:
                firsts[key].append(seq)
        assert {k: firsts[k] for k in keys} == {k: list(range(5)) for k in keys}
        assert all(a.metrics.parked.labels("behind")._value.get() > 0 for a in apps)
        assert all(a.failure() is None for a in apps)
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()


def test_without_a_retry_topic_parking_is_off_and_delivery_goes_on(stack: Settings) -> None:
    topic, dlq = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic, dlq])
    receiver = Receiver(behave=lambda hit, n: 503 if n == 1 else 200).start()
    apps: list[ProxyApp] = []
    try:
        produce(stack, topic, [(b"k", seq_body("k", s), None) for s in range(5)])
        ps = fast_settings(
            source_topic=topic,
            endpoint_url=receiver.url,
            dead_letter_topic=dlq,
            retry_topic=f"{stack.topics.prefix}missing-{uid()}",
            park_after_s=0,
        )
        app = start_proxy(stack, ps, apps)
        assert not app.retry_lane and app.metrics.parking._value.get() == 0
        wait_for(lambda: len({h.body for h in receiver.delivered()}) == 5, 60, "every message")
        assert app.metrics.parked.labels("retrying")._value.get() == 0
        assert app.failure() is None
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()


def test_a_failing_record_near_kafkas_default_limit_is_parked_too(stack: Settings) -> None:
    """950 KB, under a default topic's limit: parking it must not need more than that."""
    topic, retries = f"{stack.topics.prefix}src-{uid()}", f"{stack.topics.prefix}rt-{uid()}"
    dlq = f"{stack.topics.prefix}dlq-{uid()}"
    create_topics(stack, [topic, retries, dlq])
    big = b"x" * 950_000
    recovered = threading.Event()
    receiver = Receiver(
        behave=lambda hit, n: 503 if hit.body == big and not recovered.is_set() else 200
    ).start()
    apps: list[ProxyApp] = []
    try:
        produce(stack, topic, [(b"big", big, None), (b"small", b"s", None)])
        ps = fast_settings(
            source_topic=topic,
            endpoint_url=receiver.url,
            dead_letter_topic=dlq,
            retry_topic=retries,
            park_after_s=0.3,
        )
        start_proxy(stack, ps, apps)
        wait_for(
            lambda: committed_offsets(stack, ps.group_id, topic, 1) == [2],
            60,
            "the source committed past the failing 950 KB record",
        )
        recovered.set()
        wait_for(
            lambda: any(h.body == big for h in receiver.delivered()),
            60,
            "the big record delivered from the retry topic",
        )
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()


def test_a_slow_tenant_does_not_hold_back_another(stack: Settings) -> None:
    """Tenant A's endpoint takes 2 s per answer for 300 triggers of 48 KiB (about 30 MB at
    the proxy's estimate against a 4 MiB bound; 8 writers for A, so over a minute of work);
    tenant B's 200 triggers, produced once A is under way, all arrive while most of A's are
    still waiting."""
    fires = f"{stack.topics.prefix}fires-{uid()}"
    retries = f"{stack.topics.prefix}retries-{uid()}"
    dlq, deliveries = f"{stack.topics.prefix}dlq-{uid()}", f"{stack.topics.prefix}dl-{uid()}"
    create_topics(stack, [fires, retries], partitions=2)
    create_topics(stack, [dlq, deliveries])
    receiver = Receiver(behave=lambda hit, n: (200, {}, 2.0) if hit.path == "/a" else 200).start()
    apps: list[ProxyApp] = []
    base = f"http://127.0.0.1:{receiver.port}"

    def trigger(tenant: str, sid: str, path: str, payload: object) -> bytes:
        return orjson.dumps(
            {
                "trigger_id": f"t-{sid}",
                "schedule_id": sid,
                "tenant": tenant,
                "due_ms": 1_700_000_000_000,
                "emitted_ms": 1_700_000_000_005,
                "attempt": 1,
                "order_key": sid,
                "payload": payload,
                "callback": {"type": "http", "url": base + path, "timeout_s": 10},
            }
        )

    pad = "x" * 48 * 1024
    b_ids = [f"b{i}" for i in range(200)]
    try:
        produce(
            stack,
            fires,
            [
                (f"a{i}".encode(), trigger("tenant-a", f"a{i}", "/a", {"pad": pad}), None)
                for i in range(300)
            ],
        )
        ps = fast_settings(
            mode="fires",
            source_topic=fires,
            endpoint_url="",
            dead_letter_topic=dlq,
            deliveries_topic=deliveries,
            retry_topic=retries,
            max_pending_bytes=4 * 1024 * 1024,
        )
        start_proxy(stack, ps, apps)
        wait_for(lambda: len(receiver.delivered()) >= 1, 30, "A under way")
        produce(
            stack,
            fires,
            [(sid.encode(), trigger("tenant-b", sid, "/b", {"n": sid}), None) for sid in b_ids],
        )

        def b_delivered() -> set[str]:
            return {h.headers["Tocsin-Schedule-Id"] for h in receiver.delivered() if h.path == "/b"}

        wait_for(lambda: b_delivered() == set(b_ids), 60, "every trigger of tenant B")
        a_done = sum(1 for h in receiver.delivered() if h.path == "/a")
        assert a_done < 150, f"B waited for A: {a_done} of A's 300 were done first"
    finally:
        for a in apps:
            a.stop(timeout_s=5)
        receiver.stop()

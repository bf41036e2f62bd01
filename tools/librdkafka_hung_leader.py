"""What an idempotent librdkafka producer does with a produce in flight to a leader that
stops answering (RELIABILITY.md, "a produce in flight to a hung leader").

It drives librdkafka's own mock cluster (the library bundled with confluent-kafka, through
ctypes): a producer like the worker's writes one record every ``--interval`` s round the
partitions; at ``--hang-at`` broker 1 stops answering (its answers are delayed
``--hang-rtt`` ms, the requests stay in flight), and ``--fence-after`` s later its
partitions move to broker 2 and, with ``--fence remove``, broker 1 leaves the metadata (what
KRaft does with a fenced broker). It prints when librdkafka gave requests up and how late
the records sent after the hang were acknowledged.

The mock checks producer sequences only for transactional producers, so its count of
duplicates in the log says nothing about an idempotent one (Kafka keeps one copy).

    .venv/bin/python tools/librdkafka_hung_leader.py --socket-timeout-ms 4000 --leaders 1,1,1,1
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import logging
import os
import sys
import threading
import time
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, Producer, TopicPartition

TOPIC = b"fires"
LOG_KEYS = ("REQTMOUT", "Timed out", "DRAIN", "FATAL", "fatal", "Epoch:1", "DESTROY")


def _library() -> ctypes.CDLL:
    here = os.path.dirname(confluent_kafka.__file__)
    (path,) = glob.glob(os.path.join(here, "..", "confluent_kafka.libs", "librdkafka-*.so*"))
    lib = ctypes.CDLL(path)
    vp, cp, i32 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32
    lib.rd_kafka_conf_new.restype = vp
    lib.rd_kafka_new.restype = vp
    lib.rd_kafka_new.argtypes = [ctypes.c_int, vp, cp, ctypes.c_size_t]
    lib.rd_kafka_mock_cluster_new.restype = vp
    lib.rd_kafka_mock_cluster_new.argtypes = [vp, ctypes.c_int]
    lib.rd_kafka_mock_cluster_bootstraps.restype = cp
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [vp]
    lib.rd_kafka_mock_topic_create.argtypes = [vp, cp, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_partition_set_leader.argtypes = [vp, cp, i32, i32]
    lib.rd_kafka_mock_broker_set_rtt.argtypes = [vp, i32, ctypes.c_int]
    lib.rd_kafka_mock_broker_remove_from_metadata.argtypes = [vp, i32]
    return lib


def _faults(a: argparse.Namespace, el: float, done: set[str]) -> list[str]:
    """The fault events due at ``el`` s that have not happened yet."""
    due = {"hang": a.hang_at, "fence": a.hang_at + a.fence_after}
    if a.unhang_at > 0:
        due["unhang"] = a.unhang_at
    if a.purge_after >= 0:
        due["purge"] = a.hang_at + a.fence_after + a.purge_after
    if a.fence == "none":
        due.pop("fence")
        due.pop("purge", None)
    events = [e for e, at in sorted(due.items(), key=lambda x: x[1]) if at <= el and e not in done]
    done.update(events)
    return events


def _inject(
    event: str, a: argparse.Namespace, lib: ctypes.CDLL, mc: int, leaders: list[int], producer: Any
) -> None:
    if event == "hang":
        lib.rd_kafka_mock_broker_set_rtt(mc, 1, a.hang_rtt)
    elif event == "unhang":
        lib.rd_kafka_mock_broker_set_rtt(mc, 1, 0)
    elif event == "fence":
        for i, leader in enumerate(leaders):
            if leader == 1:
                lib.rd_kafka_mock_partition_set_leader(mc, TOPIC, i, 2)
        if a.fence == "remove":
            lib.rd_kafka_mock_broker_remove_from_metadata(mc, 1)
    elif event == "purge":
        producer.purge(in_queue=False, in_flight=True, blocking=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket-timeout-ms", type=int, default=10000)
    ap.add_argument("--fence", choices=["remove", "leader-only", "none"], default="remove")
    ap.add_argument("--leaders", default="1,2,3,1,2,3,1,2", help="each partition's leader")
    ap.add_argument("--hang-rtt", type=int, default=60000)
    ap.add_argument("--hang-at", type=float, default=2.0)
    ap.add_argument("--fence-after", type=float, default=3.0)
    ap.add_argument("--unhang-at", type=float, default=-1.0, help="broker 1 answers again")
    ap.add_argument("--purge-after", type=float, default=-1.0, help="purge(in_flight) then")
    ap.add_argument("--run", type=float, default=16.0)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--extra", default="", help="more librdkafka settings, k=v,k=v")
    a = ap.parse_args()

    lib = _library()
    errstr = ctypes.create_string_buffer(512)
    rk = lib.rd_kafka_new(0, lib.rd_kafka_conf_new(), errstr, 512)
    mc = lib.rd_kafka_mock_cluster_new(rk, 3)
    boot = lib.rd_kafka_mock_cluster_bootstraps(mc).decode()
    leaders = [int(x) for x in a.leaders.split(",")]
    parts = len(leaders)
    assert lib.rd_kafka_mock_topic_create(mc, TOPIC, parts, 3) == 0
    for i, leader in enumerate(leaders):
        lib.rd_kafka_mock_partition_set_leader(mc, TOPIC, i, leader)

    t0 = time.monotonic()

    def ts() -> str:
        return f"{time.monotonic() - t0:7.3f}"

    class _Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            if any(k in message for k in LOG_KEYS):
                record.msg, record.args = f"{ts()} {message[:240]}", ()
                return True
            return False

    logging.basicConfig(level=logging.DEBUG, format="%(message)s", stream=sys.stdout)
    log = logging.getLogger("librdkafka")
    log.addFilter(_Keep())
    conf: dict[str, Any] = {
        "bootstrap.servers": boot,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 1,
        "topic.metadata.refresh.interval.ms": 1000,
        "reconnect.backoff.max.ms": 1000,
        "socket.timeout.ms": a.socket_timeout_ms,
        "message.timeout.ms": 120000,
        "debug": "eos",
        "logger": log,
    }
    for kv in filter(None, a.extra.split(",")):
        key, value = kv.split("=")
        conf[key] = value
    producer = Producer(conf)

    sent: dict[int, float] = {}
    acked: list[tuple[float, int, int]] = []  # (at, key, partition)
    failed = 0

    def report(err: Any, msg: Any) -> None:
        nonlocal failed
        key = int(msg.key())
        if err:
            failed += 1
            print(f"{ts()} not delivered: key {key} {err.name()}")
        else:
            acked.append((time.monotonic() - t0, key, msg.partition()))

    stop = threading.Event()
    poller = threading.Thread(
        target=lambda: [producer.poll(0.05) for _ in iter(stop.is_set, True)], daemon=True
    )
    poller.start()
    done: set[str] = set()
    n = 0
    while (el := time.monotonic() - t0) < a.run:
        for event in _faults(a, el, done):
            _inject(event, a, lib, mc, leaders, producer)
            print(f"{ts()} {event}")
        sent[n] = time.monotonic() - t0
        producer.produce(
            TOPIC.decode(), key=str(n).encode(), value=b"x", partition=n % parts, callback=report
        )
        producer.poll(0)
        n += 1
        time.sleep(a.interval)
    lib.rd_kafka_mock_broker_set_rtt(mc, 1, 0)  # let the count below read broker 1 too
    left = producer.flush(30)
    stop.set()
    print(f"sent {n}, acknowledged {len(acked)}, not delivered {failed}, left {left}")
    for p in range(parts):
        late = sorted(at - sent[k] for at, k, pp in acked if pp == p and sent[k] >= a.hang_at)
        if late:
            print(f"partition {p} (leader {leaders[p]}): sent after the hang {len(late)}, ack")
            print(f"  p50 {late[len(late) // 2]:.3f} s, max {late[-1]:.3f} s")

    keys = _read_log(boot, parts)
    print(f"records in the log {len(keys)}, distinct {len(set(keys))}")


def _read_log(boot: str, parts: int) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": boot, "group.id": "count"})
    consumer.assign([TopicPartition(TOPIC.decode(), p, 0) for p in range(parts)])
    keys: list[bytes] = []
    idle = 0
    while idle < 3:
        batch = consumer.consume(1000, 1.0)
        idle = 0 if batch else idle + 1
        keys += [m.key() for m in batch if m.error() is None]
    consumer.close()
    return keys


if __name__ == "__main__":
    main()

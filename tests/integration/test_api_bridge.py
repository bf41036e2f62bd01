"""The API's request-reply over Kafka (api/bridge.py) on the real Kafka, without a worker.

The test plays the worker itself (reads the commands topic, answers on command-results),
so it can check what a real worker cannot be made to do on demand: answers that never
come (504), answers for other API instances mixed in, many requests in flight at once.
Topics live under their own prefix, so the session's worker never sees these commands.
No timing assertions: the only timeouts are the ones under test and generous deadlines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from api.bridge import CommandBridge, Expected, new_reply_nonce
from api.service import Service
from api.views import ApiError, create_command
from base.settings import Settings
from streams.partitioner import partition_for
from tocsin.topic_admin import ensure_topics
from topics.catalog import catalog

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_topics(real_stack: Settings) -> Iterator[Settings]:
    """The stack's settings with a topic prefix of this module's own (topics created)."""
    from confluent_kafka.admin import AdminClient

    prefix = f"{real_stack.topics.prefix}bridge{uuid.uuid4().hex[:6]}."
    settings = dataclasses.replace(
        real_stack, topics=dataclasses.replace(real_stack.topics, prefix=prefix)
    )
    ensure_topics(settings.kafka, catalog(settings.topics).all())
    yield settings
    admin = AdminClient(settings.kafka.librdkafka())
    names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(prefix)]
    if names:
        for fut in admin.delete_topics(names, operation_timeout=30).values():
            fut.result(timeout=30)


class Responder:
    """Plays the worker: answers every command on command-results with its request id and
    reply_nonce, after a result for a request id nobody waits for (another API instance's).
    With ``forge``, first what another producer can provoke: a result with the request's
    id (echoed for a record it wrote) but without its nonce, or under its own tenant."""

    def __init__(self, settings: Settings, *, forge: bool = False) -> None:
        self.forge = forge
        cat = catalog(settings.topics)
        self.commands, self.results = cat.commands.name, cat.command_results.name
        self.consumer = Consumer(
            {
                **settings.kafka.librdkafka(),
                "group.id": f"responder-{uuid.uuid4().hex[:6]}",
                "enable.auto.commit": False,
            }
        )
        meta = self.consumer.list_topics(self.commands, timeout=10)
        tps = []
        for p in meta.topics[self.commands].partitions:
            _, high = self.consumer.get_watermark_offsets(
                TopicPartition(self.commands, p), timeout=10
            )
            tps.append(TopicPartition(self.commands, p, high))
        self.consumer.assign(tps)
        self.producer = Producer({**settings.kafka.librdkafka(), "linger.ms": 1})
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Responder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.producer.flush(10)
        self.consumer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self.consumer.poll(0.1)
            if m is None or m.error() is not None:
                continue
            cmd = orjson.loads(m.value())
            self.seen.append(cmd)
            answers: list[tuple[str, str, str | None, str]] = [
                (f"api-someone-else-{len(self.seen)}", cmd["tenant"], cmd.get("reply_nonce"), "ok"),
            ]
            if self.forge:
                answers += [
                    (cmd["request_id"], cmd["tenant"], None, "forged"),
                    (cmd["request_id"], cmd["tenant"], new_reply_nonce(), "forged"),
                    (cmd["request_id"], "mallory", cmd.get("reply_nonce"), "forged"),
                ]
            answers.append((cmd["request_id"], cmd["tenant"], cmd.get("reply_nonce"), "ok"))
            for rid, tenant, nonce, message in answers:
                doc = {
                    "schedule_id": cmd["schedule_id"],
                    "tenant": tenant,
                    "request_id": rid,
                    "command": cmd["type"],
                    "status": "accepted",
                    "code": "ok",
                    "message": message,
                    "at_ms": 0,
                    "partition": m.partition(),
                    "offset": m.offset(),
                }
                if nonce is not None:
                    doc["reply_nonce"] = nonce
                self.producer.produce(self.results, key=m.key(), value=orjson.dumps(doc))
            self.producer.poll(0)


def _command(bridge: CommandBridge, n: int) -> tuple[bytes, bytes, str, Expected]:
    sid = f"b-{uuid.uuid4().hex[:8]}-{n}"
    rid = bridge.new_request_id()
    expected = Expected(reply_nonce=new_reply_nonce(), tenant="acme", schedule_id=sid)
    value = orjson.dumps(
        {
            "type": "create",
            "tenant": "acme",
            "schedule_id": sid,
            "request_id": rid,
            "reply_nonce": expected.reply_nonce,
        }
    )
    return sid.encode(), value, rid, expected


async def test_each_request_gets_its_own_result(own_topics: Settings) -> None:
    bridge = CommandBridge(own_topics)
    await bridge.start()
    try:
        with Responder(own_topics) as responder:
            commands = [_command(bridge, n) for n in range(300)]
            answers = await asyncio.gather(
                *(
                    bridge.send_command(
                        key, value, [], request_id=rid, expected=expected, timeout_s=60
                    )
                    for key, value, rid, expected in commands
                )
            )
        for (key, _value, rid, _), answer in zip(commands, answers, strict=True):
            assert answer is not None, f"no result for {rid}"
            assert answer["request_id"] == rid and answer["schedule_id"] == key.decode()
            # Produced to the partition the workers expect (murmur2 of the key).
            assert answer["partition"] == partition_for(key, bridge.partitions)
        assert len(responder.seen) == 300
        assert bridge._pending == {}  # every waiting request cleaned up
    finally:
        await bridge.close()


async def test_a_forged_reply_does_not_answer_a_waiting_request(own_topics: Settings) -> None:
    """Before each true answer come results with the request's id that another producer
    can provoke: without the nonce, with a guessed one, under another tenant. The request
    gets the true answer (message "ok"), never a forged one."""
    bridge = CommandBridge(own_topics)
    await bridge.start()
    try:
        with Responder(own_topics, forge=True):
            commands = [_command(bridge, n) for n in range(20)]
            answers = await asyncio.gather(
                *(
                    bridge.send_command(
                        key, value, [], request_id=rid, expected=expected, timeout_s=60
                    )
                    for key, value, rid, expected in commands
                )
            )
        for (_key, _value, rid, expected), answer in zip(commands, answers, strict=True):
            assert answer is not None, f"no result for {rid}"
            assert answer["message"] == "ok", answer
            assert answer["reply_nonce"] == expected.reply_nonce
            assert answer["tenant"] == "acme"
        assert bridge._pending == {}
    finally:
        await bridge.close()


async def test_no_result_in_time_is_none_and_the_command_was_still_produced(
    own_topics: Settings,
) -> None:
    bridge = CommandBridge(own_topics)
    await bridge.start()
    try:
        key, value, rid, expected = _command(bridge, 0)
        consumer = Consumer(
            {
                **own_topics.kafka.librdkafka(),
                "group.id": f"check-{uuid.uuid4().hex[:6]}",
                "enable.auto.commit": False,
            }
        )
        topic = bridge.catalog.commands.name
        part = partition_for(key, bridge.partitions)
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
        answer = await bridge.send_command(
            key, value, [], request_id=rid, expected=expected, timeout_s=1.0
        )
        assert answer is None
        assert bridge._pending == {}
        consumer.assign([TopicPartition(topic, part, high)])
        got = None
        for _ in range(100):
            got = consumer.poll(0.2)
            if got is not None and got.error() is None and got.key() == key:
                break
        consumer.close()
        assert got is not None and got.key() == key and got.value() == value
    finally:
        await bridge.close()


async def test_service_answers_504_with_the_ids_when_no_result_comes(
    own_topics: Settings,
    tenant: str,
) -> None:
    service = Service(own_topics)
    await service.start()
    try:
        sid = f"s-{uuid.uuid4().hex[:8]}"
        cmd = create_command(
            {
                "due": 4_000_000_000_000,
                "payload": {"x": 1},
                "callback": {"type": "http", "url": "https://receiver.example/hook"},
            },
            tenant=tenant,
            schedule_id=sid,
            request_id=service.bridge.new_request_id(),
        )
        with pytest.raises(ApiError) as caught:
            await service.send(cmd, wait=True, timeout_s=1.0)
        assert caught.value.status == 504 and caught.value.code == "timeout"
        assert caught.value.extra == {"schedule_id": sid, "request_id": cmd["request_id"]}
    finally:
        await service.close()


async def test_a_command_kafka_refuses_fails_with_kafka_error_not_a_timeout(
    own_topics: Settings,
) -> None:
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
    )

    from base.errors import KafkaError

    bridge = CommandBridge(own_topics)
    admin = AdminClient(own_topics.kafka.librdkafka())
    topic = bridge.catalog.commands.name

    def set_max_bytes(value: str | None) -> None:
        op = AlterConfigOpType.SET if value is not None else AlterConfigOpType.DELETE
        resource = ConfigResource(
            "topic",
            topic,
            incremental_configs=[ConfigEntry("max.message.bytes", value, incremental_operation=op)],
        )
        for fut in admin.incremental_alter_configs([resource]).values():
            fut.result(30)

    set_max_bytes("2048")
    await bridge.start()
    try:
        key, _, rid, expected = _command(bridge, 0)
        big = orjson.dumps(
            {
                "type": "create",
                "tenant": "acme",
                "schedule_id": key.decode(),
                "request_id": rid,
                "payload": "x" * 10_000,
            }
        )
        with pytest.raises(KafkaError):
            await bridge.send_command(key, big, [], request_id=rid, expected=expected, timeout_s=60)
        assert bridge._pending == {}
    finally:
        await bridge.close()
        set_max_bytes(None)

"""Request-reply over Kafka for the API: produce a command, wait for its result.

The pattern of the DataStax inventory design (seeds/datastax-scalable-inventory.txt): the
HTTP layer puts the request on a queue and parks a future; the worker that owns the key
answers on a response queue; the future is completed by correlation id. Here the request
queue is the commands topic (keyed by schedule id, so the owning worker gets it), the
response queue is command-results, and the correlation id is the command's ``request_id``
(``api-<instance>-<n>``).

Every API instance reads every partition of command-results from the end (the watermarks
are taken before the first request, so no answer can be missed) and ignores results whose
request id it is not waiting for. That is cheap for a handful of API instances; with many,
give each instance its own results topic (see docs/api.md).

Threads: ``api-results`` polls the consumer, ``api-producer`` serves delivery callbacks;
both hand over to the event loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from streams.partitioner import partition_for
from tocsin.errors import KafkaError
from tocsin.settings import Settings
from topics.catalog import catalog

log = logging.getLogger("tocsin.api")


class CommandBridge:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = catalog(settings.topics)
        self.partitions = self.catalog.commands.partitions
        self.instance = f"{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self.ready = False
        self.producer = Producer({
            **settings.kafka.librdkafka(),
            "client.id": f"tocsin-api-{os.getpid()}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 1,
            "queue.buffering.max.messages": 500_000,
        })
        self.consumer = Consumer({
            **settings.kafka.librdkafka(),
            "group.id": f"tocsin-api-{self.instance}",  # never commits; assign() only
            "enable.auto.commit": False,
            "auto.offset.reset": "latest",
            "fetch.wait.max.ms": 5,
            "fetch.min.bytes": 1,
        })
        self._threads = [
            threading.Thread(target=self._read_results, name="api-results", daemon=True),
            threading.Thread(target=self._serve_producer, name="api-producer", daemon=True),
        ]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._assign)
        for t in self._threads:
            t.start()
        self.ready = True

    def _assign(self) -> None:
        topic = self.catalog.command_results.name
        try:
            meta = self.consumer.list_topics(topic, timeout=10)
            partitions = sorted(meta.topics[topic].partitions)
            tps = []
            for p in partitions:
                _, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                tps.append(TopicPartition(topic, p, max(high, 0)))
        except (KafkaException, KeyError) as exc:
            raise KafkaError(f"cannot read topic {topic}: {exc}", retriable=True) from exc
        if not partitions:
            raise KafkaError(f"topic {topic} does not exist; run `tocsin setup`")
        self.consumer.assign(tps)

    async def close(self) -> None:
        self.ready = False
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                await asyncio.to_thread(t.join, 5)
        await asyncio.to_thread(self.producer.flush, 10)
        await asyncio.to_thread(self.consumer.close)

    # -- requests --------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"api-{self.instance}-{next(self._ids)}"

    async def send_command(
        self,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        *,
        request_id: str,
        wait_result: bool,
        timeout_s: float,
    ) -> dict[str, Any] | None:
        """Produce a command. With ``wait_result``, return its result (None on timeout);
        otherwise return None once Kafka acknowledged the command."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[dict[str, Any]] | None = None
        if wait_result:
            result = loop.create_future()
            self._pending[request_id] = result
        acked: asyncio.Future[Any] = loop.create_future()
        try:
            self._produce(
                self.catalog.commands.name, key, value, headers, acked,
                partition=partition_for(key, self.partitions),
            )
            err = await asyncio.wait_for(acked, timeout_s)
            if err is not None:
                raise KafkaError(f"command not accepted by Kafka: {err}", retriable=True)
            if result is None:
                return None
            return await asyncio.wait_for(result, timeout_s)
        except TimeoutError:
            return None
        finally:
            self._pending.pop(request_id, None)

    async def send_record(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]],
        *, timeout_s: float = 30.0,
    ) -> None:
        """Produce one record (any topic, default partitioner) and wait for the ack."""
        acked: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._produce(topic, key, value, headers, acked, partition=None)
        err = await asyncio.wait_for(acked, timeout_s)
        if err is not None:
            raise KafkaError(f"record not accepted by Kafka: {err}", retriable=True)

    def _produce(
        self, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]],
        acked: asyncio.Future[Any], *, partition: int | None,
    ) -> None:
        loop = asyncio.get_running_loop()

        def on_delivery(err: Any, _msg: Any) -> None:
            def settle() -> None:
                if not acked.done():
                    acked.set_result(err)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        kwargs: dict[str, Any] = {"key": key, "value": value, "headers": headers,
                                  "on_delivery": on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self.producer.produce(topic, **kwargs)
                return
            except BufferError:
                time.sleep(0.005)  # the local queue is full: rare, and brief

    # -- threads ---------------------------------------------------------------------------

    def _serve_producer(self) -> None:
        while not self._stop.is_set():
            self.producer.poll(0.05)

    def _read_results(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop.is_set():
            try:
                msgs = self.consumer.consume(1000, 0.1)
            except KafkaException:
                log.exception("reading command results failed")
                time.sleep(0.5)
                continue
            for m in msgs:
                if m.error() is not None or not self._pending:
                    continue
                value = m.value()
                if not value:
                    continue
                try:
                    doc = orjson.loads(value)
                except orjson.JSONDecodeError:
                    continue
                rid = doc.get("request_id") if isinstance(doc, dict) else None
                if isinstance(rid, str) and rid in self._pending:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._resolve, rid, doc)

    def _resolve(self, request_id: str, doc: dict[str, Any]) -> None:
        fut = self._pending.get(request_id)
        if fut is not None and not fut.done():
            fut.set_result(doc)

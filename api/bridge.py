"""Request-reply over Kafka for the API: produce a command, wait for its result.

The HTTP layer puts the request on a queue and parks a future; the worker that owns the
key answers on a response queue; the future is completed by correlation id. Here the request
queue is the commands topic (keyed by schedule id, so the owning worker gets it), the
response queue is command-results, and the correlation id is the command's ``request_id``
(``api-<instance>-<n>``).

A request id is no secret: it is sequential and anyone reading the commands topic sees it,
and a worker echoes it even for a command it refuses as unsigned or another tenant's. So a
result is only taken as the answer when it also carries the request's ``reply_nonce`` (128
random bits in the signed command, echoed by a worker only for a command whose signature
verified) and names the request's tenant and schedule (``Expected.matches``): another
producer can neither guess the nonce nor get a worker to echo one it copied under the
requester's tenant without the tenant's signing key.

Every API instance reads every partition of command-results from the end (the watermarks
are taken before the first request, so no answer can be missed) and ignores results whose
request id it is not waiting for. That is cheap for a handful of API instances; with many,
give each instance its own results topic (see docs/api.md).

Per request the API does as little as it can, because on a small machine its CPU is what
bounds synchronous creates: the command goes to the shared producer (``streams.emitter``,
a few ms of linger so a busy second is a few produce requests, not one per command), a
synchronous request waits for its result only (one deadline; a refusal by Kafka fails it
through the acknowledgement's callback), and the two background threads hand their work
to the event loop in batches (one wake-up per poll round, not one per record).

Threads: ``api-results`` polls the consumer (blocking for the first record, then taking
whatever else is already fetched without waiting), the emitter's thread serves delivery
reports; both hand over to the event loop with one ``call_soon_threadsafe`` per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NotRequired, TypedDict, TypeVar, cast

import orjson
from confluent_kafka import Consumer, KafkaException, TopicPartition

from api.tracing import command_headers
from base.errors import KafkaError
from base.settings import Settings
from streams.emitter import Appended, Emitter, Position
from streams.partitioner import partition_for
from topics.catalog import catalog

log = logging.getLogger("tocsin.api")

_Acked = TypeVar("_Acked")


def new_reply_nonce() -> str:
    """A command's reply_nonce: 32 hex digits of 128 random bits."""
    return secrets.token_hex(16)


class ResultDoc(TypedDict):
    """A command result as the commands' worker writes it (``topics.codec.encode_result``)."""

    schedule_id: str | None
    tenant: str | None
    request_id: str | None
    command: str | None
    status: str
    code: str
    message: str
    at_ms: int
    partition: int
    offset: int
    reply_nonce: NotRequired[str]


@dataclass(frozen=True, slots=True)
class Expected:
    """What the answer to one request must carry."""

    reply_nonce: str
    tenant: str
    schedule_id: str

    def matches(self, doc: Mapping[str, object]) -> bool:
        """Whether a result document answers this request (its request id already does)."""
        nonce = doc.get("reply_nonce")
        return (
            isinstance(nonce, str)
            and hmac.compare_digest(nonce.encode(), self.reply_nonce.encode())
            and doc.get("tenant") == self.tenant
            and doc.get("schedule_id") == self.schedule_id
        )


class CommandBridge:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.catalog = catalog(settings.topics)
        self.partitions = self.catalog.commands.partitions
        self.instance = f"{uuid.uuid4().hex[:8]}"
        self._ids = itertools.count(1)
        self._pending: dict[str, tuple[asyncio.Future[ResultDoc], Expected]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self.ready = False
        # The default partitioner for send_record (fires keep the worker's partitioning);
        # commands get their murmur2 partition explicitly (streams.partitioner).
        self.producer = Emitter(
            settings.kafka,
            client_id=f"tocsin-api-{os.getpid()}",
            linger_ms=settings.api.produce_linger_ms,
            compression="none",  # one small command per request: compressing costs CPU only
        )
        self.consumer = Consumer(
            {
                **settings.kafka.librdkafka(),
                "group.id": f"tocsin-api-{self.instance}",  # never commits; assign() only
                "enable.auto.commit": False,
                "auto.offset.reset": "latest",
                # The broker answers a fetch as soon as one result is there (min bytes 1); the
                # wait only bounds empty fetches (at 5 ms an idle API would send 200 a second).
                "fetch.wait.max.ms": 100,
                "fetch.min.bytes": 1,
            }
        )
        self._reader = threading.Thread(target=self._read_results, name="api-results", daemon=True)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._assign)
        self.producer.start()
        self._reader.start()
        self.ready = True

    def _assign(self, retry_s: float = 30.0) -> None:
        topic = self.catalog.command_results.name
        deadline = time.monotonic() + retry_s
        while True:
            try:
                meta = self.consumer.list_topics(topic, timeout=10)
                partitions = sorted(meta.topics[topic].partitions)
                tps = []
                for p in partitions:
                    _, high = self.consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=10
                    )
                    tps.append(TopicPartition(topic, p, max(high, 0)))
                break
            except KafkaException as exc:
                # A just created topic answers "not leader" for a moment (not flagged as
                # retriable by the client): try again for a while before giving up.
                if time.monotonic() > deadline:
                    raise KafkaError(f"cannot read topic {topic}: {exc}", retriable=True) from exc
                time.sleep(0.5)
            except KeyError as exc:
                raise KafkaError(f"cannot read topic {topic}: {exc}", retriable=True) from exc
        if not partitions:
            raise KafkaError(f"topic {topic} does not exist; run `tocsin setup`")
        self.consumer.assign(tps)

    async def close(self) -> None:
        self.ready = False
        self._stop.set()
        if self._reader.is_alive():
            await asyncio.to_thread(self._reader.join, 5)
        await self.producer.close(10)
        await asyncio.to_thread(self.consumer.close)

    # -- requests --------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"api-{self.instance}-{next(self._ids)}"

    def _produce(
        self,
        send: Callable[..., asyncio.Future[_Acked]],
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
    ) -> asyncio.Future[_Acked]:
        """``send`` (one of the producer's) to the commands topic, on the key's partition,
        with the serving request's trace context (api.tracing) added to ``headers``:
        signatures cover key and value only, so these headers change no signature."""
        trace, span = command_headers()
        acked = send(
            self.catalog.commands.name,
            key=key,
            value=value,
            headers=[*headers, *trace] if trace else headers,
            partition=partition_for(key, self.partitions),
        )
        if span is not None:
            acked.add_done_callback(lambda _: span.end())
        return acked

    async def send_command(
        self,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        *,
        request_id: str,
        expected: Expected | None,
        timeout_s: float,
    ) -> ResultDoc | None:
        """Produce a command. With ``expected`` (the reply_nonce the command carries, its
        tenant and schedule id), return its result (None when no result arrived within
        ``timeout_s``, which bounds the whole exchange); otherwise return None once Kafka
        acknowledged the command. Raises KafkaError when Kafka refused it."""
        result: asyncio.Future[ResultDoc] | None = None
        if expected is not None:
            result = asyncio.get_running_loop().create_future()
            self._pending[request_id] = (result, expected)
        try:
            acked = self._produce(self.producer.send, key, value, headers)
            async with asyncio.timeout(timeout_s):
                if result is None:
                    await acked
                    return None
                # Wait for the result only (one wake-up of this request instead of two); a
                # refusal by Kafka fails the result with the KafkaError.
                acked.add_done_callback(functools.partial(_fail_unless_acked, result))
                return await result
        except TimeoutError:
            return None
        finally:
            if result is not None:
                del self._pending[request_id]

    async def send_admitted(
        self,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        *,
        timeout_s: float,
        request_id: str | None = None,
        expected: Expected | None = None,
    ) -> Appended | None:
        """Produce a command an API admitted (topics.admission) and return where and when
        Kafka stored it once acknowledged (acks=all); None when no acknowledgement came
        within ``timeout_s`` (the command may still be appended). Raises KafkaError when
        Kafka refused it. With ``expected`` its result is caught too, from before it is
        produced: the caller then takes it with ``answer`` or drops it with ``forget``."""
        if expected is not None and request_id is not None:
            result: asyncio.Future[ResultDoc] = asyncio.get_running_loop().create_future()
            self._pending[request_id] = (result, expected)
        acked = self._produce(self.producer.send_appended, key, value, headers)
        return await _within(acked, timeout_s)

    async def answer(self, request_id: str, timeout_s: float) -> ResultDoc | None:
        """The result of a command sent with ``send_admitted(expected=...)``; None when it
        did not come within ``timeout_s``."""
        waiting = self._pending.get(request_id)
        try:
            if waiting is None:
                return None
            async with asyncio.timeout(timeout_s):
                return await waiting[0]
        except TimeoutError:
            return None
        finally:
            self._pending.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Stop waiting for the result of a command sent with ``send_admitted``."""
        self._pending.pop(request_id, None)

    async def send_record(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]],
        *,
        timeout_s: float = 30.0,
    ) -> None:
        """Produce one record (any topic, default partitioner) and wait for the ack."""
        async with asyncio.timeout(timeout_s):
            await self.producer.send(topic, key=key, value=value, headers=headers)

    # -- threads ---------------------------------------------------------------------------

    def _read_results(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stop.is_set():
            try:
                # Block for the first record only, then take what is already fetched:
                # consume(n, t) alone would hold every answer until n arrive or t passes.
                first = self.consumer.poll(0.1)
                if first is None:
                    continue
                msgs = [first, *self.consumer.consume(1000, 0)]
            except KafkaException:
                log.exception("reading command results failed")
                time.sleep(0.5)
                continue
            pending = self._pending
            found: list[tuple[asyncio.Future[ResultDoc], ResultDoc]] = []
            for m in msgs:
                if not pending or m.error() is not None:
                    continue
                value = m.value()
                if not value:
                    continue
                try:
                    doc = orjson.loads(value)
                except orjson.JSONDecodeError:
                    continue
                rid = doc.get("request_id") if isinstance(doc, dict) else None
                waiting = pending.get(rid) if isinstance(rid, str) else None
                if waiting is not None and waiting[1].matches(doc):
                    # A worker wrote it (the nonce matched, and only a verified command's
                    # result carries one): it has the shape encode_result gives.
                    found.append((waiting[0], cast(ResultDoc, doc)))
            if found:
                with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                    loop.call_soon_threadsafe(_resolve_all, found)


async def _within(fut: asyncio.Future[_Acked], timeout_s: float) -> _Acked | None:
    """``fut``'s result, or None (``fut`` cancelled) when it is not done within
    ``timeout_s``. One timer handle instead of ``asyncio.timeout``'s context manager: about
    6 us less on every admitted create, a few per cent of the API's event loop. A
    cancellation of the awaiting task, or of ``fut`` by anyone else, is raised as before."""
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        fut.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await fut
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if expired and (task is None or task.cancelling() == 0):
            return None
        raise
    finally:
        timer.cancel()


def _fail_unless_acked(result: asyncio.Future[ResultDoc], acked: asyncio.Future[Position]) -> None:
    """Kafka refused the command: its result will never come."""
    if acked.cancelled():
        return
    err = acked.exception()  # also marks it retrieved
    if err is not None and not result.done():
        result.set_exception(err)


def _resolve_all(found: list[tuple[asyncio.Future[ResultDoc], ResultDoc]]) -> None:
    """On the event loop: complete the futures of one poll round's results."""
    for fut, doc in found:
        if not fut.done():
            fut.set_result(doc)

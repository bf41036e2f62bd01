"""``tocsin`` subcommands of the scheduler: worker, tenant, schedule, demo."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

import orjson

from tocsin.settings import Settings


async def _with_store(settings: Settings, fn: Any) -> Any:
    from streams.store import Store

    store = Store(settings.cassandra)
    await store.connect()
    try:
        return await fn(store)
    finally:
        await store.close()


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from streams.app import run_worker

    run_worker(settings)
    return 0


def cmd_tenant(args: argparse.Namespace, settings: Settings) -> int:
    from tocsin.cli import EXIT_OK, _emit

    if args.action == "add":

        async def add(store: Any) -> None:
            import time

            await store.put_tenant(
                args.name, active=True, created_ms=time.time_ns() // 10**6, config="{}"
            )

        asyncio.run(_with_store(settings, add))
        print(f"tenant {args.name} registered")
        return EXIT_OK
    rows = asyncio.run(_with_store(settings, lambda s: s.list_tenants()))
    _emit(
        args, [{"tenant": r["tenant"], "active": r["active"]} for r in rows], ["tenant", "active"]
    )
    return EXIT_OK


def cmd_schedule(args: argparse.Namespace, settings: Settings) -> int:
    from tocsin.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_REJECTED, _emit
    from topics.ids import format_iso_ms

    if args.action == "get":

        async def get(store: Any) -> tuple[Any, Any]:
            row = await store.get_schedule(args.tenant, args.schedule_id)
            events = await store.list_events(args.tenant, args.schedule_id) if row else []
            return row, events

        row, events = asyncio.run(_with_store(settings, get))
        if row is None:
            print(f"no schedule {args.schedule_id!r} for tenant {args.tenant!r}")
            return EXIT_NOT_FOUND
        view = {
            "tenant": row["tenant"],
            "schedule_id": row["schedule_id"],
            "state": row["state"],
            "due": format_iso_ms(row["due_ms"]),
            "version": row["version"],
            "fired": format_iso_ms(row["fired_ms"]) if row.get("fired_ms") else "",
            "trigger_id": row.get("trigger_id") or "",
            "delivery": row.get("delivery_outcome") or "",
        }
        if args.json:
            view["events"] = [{k: v for k, v in e.items()} for e in events]
            print(orjson.dumps(view, option=orjson.OPT_INDENT_2).decode())
        else:
            for k, v in view.items():
                print(f"{k:12s} {v}")
            for e in events:
                print(f"  {format_iso_ms(e['at_ms'])}  {e['event']:14s} {e.get('detail') or ''}")
        return EXIT_OK

    from streams.client import CommandClient, ResultWatcher
    from topics.ids import parse_iso_ms
    from topics.models import CancelCommand, CreateCommand, HttpCallback, KafkaCallback, PayloadType

    rid = uuid.uuid4().hex
    command: Any
    if args.action == "create":
        due_ms = int(args.due) if args.due.isdigit() else parse_iso_ms(args.due)
        callback: Any = (
            HttpCallback(url=args.url)
            if args.url
            else KafkaCallback(topic=args.topic or "tocsin.callbacks", key=None)
        )
        payload = orjson.dumps(orjson.loads(args.payload)) if args.payload else b""
        command = CreateCommand(
            tenant=args.tenant,
            schedule_id=args.schedule_id,
            request_id=rid,
            due_ms=due_ms,
            payload=payload,
            payload_type=PayloadType.JSON if args.payload else PayloadType.BYTES,
            callback=callback,
            misfire_tolerance_s=settings.scheduler.default_misfire_tolerance_s,
        )
    else:
        command = CancelCommand(tenant=args.tenant, schedule_id=args.schedule_id, request_id=rid)
    watcher = ResultWatcher(settings)
    client = CommandClient(settings)
    client.send(command)
    client.flush()
    results = watcher.wait_for([args.schedule_id], timeout_s=args.timeout_s)
    watcher.close()
    result = results.get(args.schedule_id)
    if result is None:
        print(f"no result within {args.timeout_s}s (is a worker running?)")
        return 1
    _emit(
        args,
        [
            {
                "schedule_id": result.schedule_id,
                "status": str(result.status),
                "code": str(result.code),
                "message": result.message,
            }
        ],
        ["schedule_id", "status", "code", "message"],
    )
    return EXIT_OK if str(result.status) == "accepted" else EXIT_REJECTED


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from streams.demo import run_demo

    return run_demo(settings, count=args.count, spread_s=args.spread_s)


def register(sub: Any) -> None:
    worker = sub.add_parser("worker", help="run a scheduler worker (command agent + tickers)")
    worker.set_defaults(func=cmd_worker)

    tenant = sub.add_parser("tenant", help="register and list tenants")
    tenant.add_argument("action", choices=["add", "list"])
    tenant.add_argument("name", nargs="?")
    tenant.set_defaults(func=cmd_tenant)

    schedule = sub.add_parser("schedule", help="create, cancel and inspect schedules")
    schedule.add_argument("action", choices=["create", "cancel", "get"])
    schedule.add_argument("tenant")
    schedule.add_argument("schedule_id")
    schedule.add_argument("--due", default="", help="ISO-8601 UTC or epoch ms (create)")
    schedule.add_argument("--url", help="HTTP callback URL (create)")
    schedule.add_argument("--topic", help="Kafka callback topic (create)")
    schedule.add_argument("--payload", help="JSON payload (create)")
    schedule.add_argument("--timeout-s", type=float, default=30.0)
    schedule.set_defaults(func=cmd_schedule)

    demo = sub.add_parser("demo", help="start a worker, schedule triggers, watch them fire")
    demo.add_argument("--count", type=int, default=3000)
    demo.add_argument("--spread-s", type=int, default=120)
    demo.set_defaults(func=cmd_demo)

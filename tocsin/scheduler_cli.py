"""``tocsin`` commands of the scheduler: worker, demo, dev and status; the tenant and
schedule commands are ``tocsin.tenant_cli`` and ``tocsin.schedule_cli``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from base import tracing
from base.clock import now_ms
from base.errors import KafkaError
from base.settings import Settings
from streams.status import HOUR_MS, Report, Tally, Window, render
from streams.status_io import collect, consumer_lags, lag_pairs
from tocsin import schedule_cli, tenant_cli
from tocsin.output import EXIT_OK, EXIT_USAGE, SubParsers
from tocsin.store_session import with_store
from tocsin.topic_admin import ensure_topics
from topics.catalog import catalog

if TYPE_CHECKING:
    from streams.store import Store


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from streams.app import run_worker  # loads Faust, which only the worker needs

    tracing.configure("tocsin-worker")  # the service name unless OTEL_SERVICE_NAME says
    run_worker(settings)
    return 0


def _prerequisites(settings: Settings) -> None:
    """The demo and dev commands bring their own topics and schema up to date (idempotent)."""
    from schema.migrate import migrate  # loads the Cassandra driver

    ensure_topics(settings.kafka, catalog(settings.topics).all())
    migrate(settings.cassandra)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from tocsin.demo import run_demo  # loads aiohttp, which only demo and dev need

    _prerequisites(settings)
    return run_demo(settings, count=args.count, spread_s=args.spread_s)


def cmd_dev(args: argparse.Namespace, settings: Settings) -> int:
    from tocsin.demo import run_dev  # loads aiohttp, which only demo and dev need

    _prerequisites(settings)
    return run_dev(settings, receiver_port=args.receiver_port)


def register(sub: SubParsers) -> None:
    """The scheduler's commands: worker, tenant, schedule, demo and dev."""
    worker = sub.add_parser("worker", help="run a scheduler worker (command agent + tickers)")
    worker.set_defaults(func=cmd_worker)

    tenant_cli.register(sub)
    schedule_cli.register(sub)

    demo = sub.add_parser("demo", help="start a worker, schedule triggers, watch them fire")
    demo.add_argument("--count", type=int, default=3000)
    demo.add_argument("--spread-s", type=int, default=120)
    demo.set_defaults(func=cmd_demo)

    dev = sub.add_parser(
        "dev",
        help="run a worker, a proxy and a receiver that prints each delivery (Ctrl-C stops)",
        description="For trying Tocsin locally: private callback targets are allowed, so "
        "schedules may call back http://localhost:RECEIVER_PORT/anything.",
    )
    dev.add_argument("--receiver-port", type=int, default=18766)
    dev.set_defaults(func=cmd_dev)


def cmd_status(args: argparse.Namespace, settings: Settings, *, proxy_group: str) -> int:
    """``tocsin status``: per tenant, what is scheduled, due in the next hour, fired and
    delivered in the last hour, lateness; and the consumers' lag (streams.status)."""
    lookback_s = (
        args.lookback_s
        if args.lookback_s is not None
        else HOUR_MS // 1000 + settings.scheduler.default_misfire_tolerance_s
    )
    if lookback_s < 0 or args.horizon_s < 0 or args.max_rows < 1:
        print("error: --lookback-s and --horizon-s must be >= 0, --max-rows >= 1", file=sys.stderr)
        return EXIT_USAGE
    window = Window(
        now_ms=now_ms(),
        lookback_ms=lookback_s * 1000,
        horizon_ms=args.horizon_s * 1000,
    )

    async def gather(store: Store) -> Tally:
        return await collect(
            store,
            window,
            partitions=settings.topics.command_partitions,
            shards=settings.scheduler.bucket_shards,
            tenant=args.tenant,
            max_rows=args.max_rows,
        )

    tally = asyncio.run(with_store(settings, gather))
    problems = []
    try:
        lags = consumer_lags(settings.kafka, lag_pairs(settings, proxy_group))
    except KafkaError as exc:
        lags, problems = [], [f"consumer lag not read: {exc}"]
    report = Report(window=window, tenants=tally.figures(), lags=lags, problems=problems)
    if getattr(args, "json", False):
        print(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        sys.stdout.write(render(report))
    return EXIT_OK


def register_status(sub: SubParsers, func: Callable[[argparse.Namespace, Settings], int]) -> None:
    """``tocsin status`` (``func`` supplies the proxy's consumer group; tocsin.cli)."""
    status = sub.add_parser(
        "status",
        help="per tenant: scheduled, due in the next hour, fired/delivered/dead-lettered in "
        "the last hour, lateness p50/p99; consumer lag (the stack itself: tocsin infra status)",
        description="Reads the store by time window only (bucket rows due from LOOKBACK ago "
        "to an hour ahead, each tenant's one-shots due within HORIZON and its recurring "
        "schedules), and the committed offsets of the worker's and the proxy's consumer "
        "groups. docs/operations.md#status.",
    )
    status.add_argument("--tenant", help="only this tenant")
    status.add_argument(
        "--lookback-s",
        type=int,
        help="read triggers due this far back to find those fired and delivered in the last "
        "hour (default: 1 h + TOCSIN_DEFAULT_MISFIRE_TOLERANCE_S)",
    )
    status.add_argument(
        "--horizon-s",
        type=int,
        default=7 * 24 * 3600,
        help="one-shot schedules due within this count as scheduled (default 7 days)",
    )
    status.add_argument(
        "--max-rows",
        type=int,
        default=100_000,
        help="read at most this many index entries (and recurring schedules) per tenant "
        "for the scheduled count; more shows as >=N",
    )
    status.add_argument(
        "--proxy-group", help="the proxy's consumer group (default: TOCSIN_PROXY_GROUP_ID)"
    )
    status.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    status.set_defaults(func=func)

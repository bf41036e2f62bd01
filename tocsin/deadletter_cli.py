"""``tocsin deadletter``: list a tenant's dead letters and redrive them (api.deadletters),
straight on the deployment's Cassandra and Kafka like ``tocsin schedule``.

    tocsin deadletter list TENANT [--from T] [--to T] [--limit N] [--json]
    tocsin deadletter get TENANT TRIGGER_ID [--json]
    tocsin deadletter redrive TENANT TRIGGER_ID... [--force] [--json]
    tocsin deadletter redrive TENANT --from T --to T [--cursor C] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import orjson

from api.views import ApiError, parse_time
from base.clock import now_ms
from base.settings import Settings
from base.text import printable
from tocsin.output import (
    EXIT_FAIL,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    SubParsers,
    emit,
)
from tocsin.store_session import with_store

if TYPE_CHECKING:
    from api.deadletters import DeadLetters
    from streams.store import Store

T = TypeVar("T")


def _shown(value: object) -> str:
    """``value`` for a terminal: a dead letter's reason, body excerpt and endpoint hold what
    the callback's receiver answered or was given."""
    return "" if value is None else printable(str(value))


_LIST_COLUMNS = ["trigger_id", "schedule_id", "dead_lettered_at", "status", "reason", "redriven"]
_REDRIVE_COLUMNS = ["trigger_id", "schedule_id", "result", "attempt", "message"]


def cmd_deadletter(args: argparse.Namespace, settings: Settings) -> int:
    try:
        if args.action == "list":
            return _list(args, settings)
        if args.action == "get":
            return _get(args, settings)
        return _redrive(args, settings)
    except ApiError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.status == 404:
            return EXIT_NOT_FOUND
        return EXIT_USAGE if exc.status == 400 else EXIT_REJECTED


def _run(settings: Settings, work: Callable[[DeadLetters], Awaitable[T]]) -> T:
    """``work`` on the dead letters over a connected store, with a producer to the fires
    topic (the worker's own kind, so a redrive lands on its key's partition)."""
    from api.deadletters import DeadLetters  # loads the Cassandra driver, as with_store
    from streams.emitter import Emitter
    from topics.catalog import catalog

    fires = catalog(settings.topics).fires.name

    async def go(store: Store) -> T:
        emitter = Emitter(settings.kafka, client_id="tocsin-deadletter", linger_ms=0)
        emitter.start()

        async def emit_fire(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
            await emitter.send(fires, key=key, value=value, headers=headers)

        try:
            return await work(DeadLetters(store, emit_fire))
        finally:
            await emitter.close()

    return asyncio.run(with_store(settings, go))


def _window(args: argparse.Namespace, *, required: bool) -> tuple[int, int]:
    if required and not (args.from_ and args.to):
        raise ApiError(400, "missing_parameter", "give --from and --to (or trigger ids)")
    hi = parse_time(args.to, "to") if args.to else now_ms() + 1
    lo = parse_time(args.from_, "from") if args.from_ else hi - 7 * 86_400_000
    return lo, hi


def _list(args: argparse.Namespace, settings: Settings) -> int:
    from api.deadletters import dead_letter_view

    if not 1 <= args.limit <= 1000:
        raise ApiError(400, "invalid_parameter", "--limit must be in 1..1000")
    lo, hi = _window(args, required=False)
    page, _ = _run(settings, lambda d: d.list(args.tenant, from_ms=lo, to_ms=hi, limit=args.limit))
    views = [dead_letter_view(e) for e in page]
    if getattr(args, "json", False):
        print(orjson.dumps(views, option=orjson.OPT_INDENT_2).decode())
        return EXIT_OK
    rows: list[dict[str, object]] = []
    for v in views:
        response = v["response"]
        redriven = v["redriven"]
        row: dict[str, object] = {
            **v,
            "status": response["status_code"] if isinstance(response, dict) else "",
            "reason": str(v["reason"] or "")[:60],
            "redriven": redriven["at"] if isinstance(redriven, dict) else "",
        }
        rows.append({k: _shown(x) for k, x in row.items()})
    emit(args, rows, _LIST_COLUMNS)
    return EXIT_OK


def _get(args: argparse.Namespace, settings: Settings) -> int:
    from api.deadletters import dead_letter_view

    if len(args.trigger_ids) != 1:
        print("tocsin deadletter get needs one trigger id", file=sys.stderr)
        return EXIT_USAGE
    entry, _ = _run(settings, lambda d: d.get(args.tenant, args.trigger_ids[0]))
    view = dead_letter_view(entry)
    if getattr(args, "json", False):
        print(orjson.dumps(view, option=orjson.OPT_INDENT_2).decode())
    else:
        for k, v in view.items():
            print(f"{k:18s} {_shown(v)}")
    return EXIT_OK


def _redrive(args: argparse.Namespace, settings: Settings) -> int:
    if args.trigger_ids and (args.from_ or args.to or args.cursor):
        print("give trigger ids or --from/--to (--cursor), not both", file=sys.stderr)
        return EXIT_USAGE
    if args.trigger_ids:
        ids = list(args.trigger_ids)
        answer = _run(settings, lambda d: d.redrive_many(args.tenant, ids, force=args.force))
    else:
        if args.force:
            print("--force applies to trigger ids only", file=sys.stderr)
            return EXIT_USAGE
        lo, hi = _window(args, required=True)
        answer = _run(
            settings,
            lambda d: d.redrive_window(args.tenant, from_ms=lo, to_ms=hi, cursor=args.cursor),
        )
    if getattr(args, "json", False):
        print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())
    else:
        done, failed = answer["redriven"], answer["failed"]
        assert isinstance(done, list) and isinstance(failed, list)
        rows = [{**r, "result": "redriven", "message": ""} for r in done]
        rows += [{**f, "result": f["code"], "attempt": ""} for f in failed]
        emit(args, rows, _REDRIVE_COLUMNS)
        if answer["truncated"]:
            print(
                f"more are left (at most {answer['limit']} per run): run it again with "
                f"--cursor {answer['next_cursor']}"
            )
    return EXIT_FAIL if answer["failed"] else EXIT_OK


def register(sub: SubParsers) -> None:
    dl = sub.add_parser(
        "deadletter",
        help="list a tenant's dead letters and redrive them",
        description="list: newest first, with reason and last response (window default: "
        "the last 7 days, at most 32). redrive: send dead-lettered triggers again through "
        "the fires topic (same trigger id, next attempt, per-key order), by trigger id or "
        "every one of a window not redriven yet (at most 500 per run). See docs/api.md.",
    )
    dl.add_argument("action", choices=["list", "get", "redrive"])
    dl.add_argument("tenant")
    dl.add_argument("trigger_ids", nargs="*", help="get/redrive: trigger ids")
    dl.add_argument("--from", dest="from_", help="window start (ISO-8601 or epoch ms)")
    dl.add_argument("--to", help="window end, exclusive (ISO-8601 or epoch ms)")
    dl.add_argument("--limit", type=int, default=100, help="list: at most this many")
    dl.add_argument("--force", action="store_true", help="redrive even if redriven/delivered")
    dl.add_argument("--cursor", help="window redrive: go on from a truncated run's next_cursor")
    dl.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    dl.set_defaults(func=cmd_deadletter)

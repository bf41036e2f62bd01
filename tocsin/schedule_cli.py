"""``tocsin schedule``: create, cancel and inspect schedules (one-shot and recurring)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson

from api.views import (
    BULK_TOGGLES,
    ApiError,
    decode_cursor,
    encode_cursor,
    matches,
    parse_bulk_scope,
    parse_statuses,
    parse_window,
    schedule_view,
)
from base.clock import now_ms
from base.errors import CommandRejected
from base.settings import Settings
from streams.client import CommandClient, ResultWatcher
from streams.ports import CqlRow
from tocsin.explain_cli import schedule_explain
from tocsin.output import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Action,
    SubParsers,
    emit,
    run_action,
)
from tocsin.store_session import with_store
from topics.ids import format_iso_ms
from topics.models import (
    CancelCommand,
    Command,
    CommandResult,
    PauseCommand,
    ResumeCommand,
    SimpleCommand,
    TriggerCommand,
)
from topics.validation import Limits, decode_command

if TYPE_CHECKING:
    from streams.store import Store


def cmd_schedule(args: argparse.Namespace, settings: Settings) -> int:
    actions: dict[str, Action] = {
        "list": _schedule_list,
        "runs": _schedule_runs,
        "get": _schedule_get,
        "create": _schedule_send,
        "cancel": _schedule_send,
        "explain": schedule_explain,
        "pause": _schedule_control,
        "resume": _schedule_control,
        "trigger": _schedule_send,
        "backfill": _schedule_send,
    }
    bulk = args.action in _BULK_ACTIONS and getattr(args, "all", False)
    given = "*" if bulk and not args.schedule_id else args.schedule_id
    return run_action(
        args, settings, actions, command="schedule", subject="schedule id", given=given
    )


# The actions that name only their schedule, and the command each sends.
_SIMPLE_ACTIONS: dict[str, type[SimpleCommand]] = {
    "cancel": CancelCommand,
    "pause": PauseCommand,
    "resume": ResumeCommand,
    "trigger": TriggerCommand,
}
# Actions that may act on every matching schedule of the tenant (``--all``).
_BULK_ACTIONS = ("pause", "resume")


_RESULT_COLUMNS = ["schedule_id", "status", "code", "message"]


def _schedule_get(args: argparse.Namespace, settings: Settings) -> int:
    async def get(store: Store) -> tuple[CqlRow | None, list[CqlRow]]:
        row = await store.get_schedule(args.tenant, args.schedule_id)
        events = await store.list_events(args.tenant, args.schedule_id) if row else []
        return row, events

    row, events = asyncio.run(with_store(settings, get))
    if row is None:
        print(f"no schedule {args.schedule_id!r} for tenant {args.tenant!r}")
        return EXIT_NOT_FOUND
    if row.get("recurrence") is not None or row.get("due_ms") is None:
        return _recurring_get(args, settings, row, events)
    view: dict[str, object] = {
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


def _schedule_send(args: argparse.Namespace, settings: Settings) -> int:
    """``tocsin schedule create|cancel``: send the command, print the worker's answer."""
    rid = uuid.uuid4().hex
    command: Command
    decoded = _DECODED_ACTIONS.get(args.action)
    if decoded is not None:
        try:
            command = decoded(args, settings, rid)
        except _Usage as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except CommandRejected as exc:
            # The decoder every worker runs: the answer a worker would give, without sending.
            rejected: dict[str, object] = {
                "schedule_id": args.schedule_id,
                "status": "rejected",
                "code": str(exc.code),
                "message": exc.message,
            }
            emit(args, [rejected], _RESULT_COLUMNS)
            return EXIT_REJECTED
    else:
        command = _SIMPLE_ACTIONS[args.action](
            tenant=args.tenant, schedule_id=args.schedule_id, request_id=rid
        )
    result = _send_and_wait(args, settings, command)
    if result is None:
        print(f"no result within {args.timeout_s}s (is a worker running?)", file=sys.stderr)
        return EXIT_TIMEOUT
    row: dict[str, object] = {
        "schedule_id": result.schedule_id,
        "status": str(result.status),
        "code": str(result.code),
        "message": result.message,
    }
    emit(args, [row], _RESULT_COLUMNS)
    accepted = str(result.status) == "accepted"
    recurring = args.action == "create" and getattr(command, "recurrence", None) is not None
    if accepted and recurring and not getattr(args, "json", False):
        print(f"next runs: tocsin schedule runs {args.tenant} {args.schedule_id}")
    return EXIT_OK if accepted else EXIT_REJECTED


def _schedule_control(args: argparse.Namespace, settings: Settings) -> int:
    """``tocsin schedule pause|resume TENANT ID``, or with ``--all`` every schedule of the
    tenant it applies to (``--id-prefix``, ``--from``/``--to`` for one-shots' due times:
    the API's bulk pause/resume, docs/api.md): one command each, a summary of the answers."""
    if args.schedule_id and getattr(args, "all", False):
        print("error: give a schedule id or --all, not both", file=sys.stderr)
        return EXIT_USAGE
    if args.schedule_id:
        return _schedule_send(args, settings)
    try:
        lo, hi, prefix = parse_bulk_scope(
            _bulk_body(args), now_ms=now_ms(), default_span_ms=365 * 86_400_000
        )
        cursor = decode_cursor(getattr(args, "cursor", None))
    except ApiError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    from api.service import toggle_targets  # loads the Cassandra driver

    state, done = BULK_TOGGLES[args.action]
    rows, stopped_at = asyncio.run(
        with_store(
            settings,
            lambda store: toggle_targets(
                store, args.tenant, state, from_ms=lo, to_ms=hi, id_prefix=prefix, cursor=cursor
            ),
        )
    )
    ids = [str(r["schedule_id"]) for r in rows]
    results = _send_all(args, settings, ids) if ids else {}
    codes = Counter(str(r.code) for r in results.values())
    failed = [
        {"schedule_id": sid, "code": str(r.code), "message": r.message}
        for sid, r in results.items()
        if str(r.status) != "accepted"
    ]
    summary: dict[str, object] = {
        "matched": len(ids),
        done: codes.get("ok", 0),
        "codes": dict(codes),
        "no_result": len(ids) - len(results),
        "failed": failed,
        "truncated": stopped_at is not None,
        "next_cursor": encode_cursor(*stopped_at) if stopped_at is not None else None,
    }
    if getattr(args, "json", False):
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        for key, value in summary.items():
            print(f"{key:10s} {value}")
        if stopped_at is not None:
            print(f"more may be left: run it again with --cursor {summary['next_cursor']}")
    return EXIT_OK if not failed and len(results) == len(ids) else EXIT_REJECTED


def _bulk_body(args: argparse.Namespace) -> dict[str, object]:
    body: dict[str, object] = {"id_prefix": args.id_prefix or ""}
    for name, value in (("from", args.from_), ("to", args.to)):
        if value:
            body[name] = value
    return body


def _send_all(
    args: argparse.Namespace, settings: Settings, ids: list[str]
) -> dict[str, CommandResult]:
    """Send ``args.action`` for every id (signed with the tenant's key); the results that
    came within ``--timeout-s``."""
    tenant_row = asyncio.run(with_store(settings, lambda s: s.get_tenant(args.tenant)))
    key = (tenant_row or {}).get("signing_secret")
    watcher = ResultWatcher(settings)
    client = CommandClient(settings)
    kind = _SIMPLE_ACTIONS[args.action]
    for sid in ids:
        client.send(
            kind(tenant=args.tenant, schedule_id=sid, request_id=uuid.uuid4().hex),
            signing_key=key,
        )
    client.flush()
    results = watcher.wait_for(ids, timeout_s=args.timeout_s)
    watcher.close()
    return results


def _send_and_wait(
    args: argparse.Namespace, settings: Settings, command: Command
) -> CommandResult | None:
    """Send ``command`` signed with its tenant's key; the worker's result, or None when none
    comes within ``--timeout-s``."""
    tenant_row = asyncio.run(with_store(settings, lambda s: s.get_tenant(args.tenant)))
    watcher = ResultWatcher(settings)
    client = CommandClient(settings)
    client.send(command, signing_key=(tenant_row or {}).get("signing_secret"))
    client.flush()
    results = watcher.wait_for([args.schedule_id], timeout_s=args.timeout_s)
    watcher.close()
    return results.get(args.schedule_id)


class _Usage(Exception):
    """A command line that cannot make a command (exit code 2)."""


def _create_command(args: argparse.Namespace, settings: Settings, request_id: str) -> Command:
    """The create command of ``tocsin schedule create``, decoded by the wire contract's own
    decoder (so a bad cron or zone gets the code a worker would answer)."""
    timings = [name for name in ("due", "cron", "every_s") if getattr(args, name, None)]
    if len(timings) != 1:
        raise _Usage("give exactly one of --due (one-shot), --cron or --every-s (recurring)")
    if bool(args.url) == bool(args.topic):
        raise _Usage("give exactly one of --url (HTTP callback) and --topic (Kafka callback)")
    recurring_flags = {
        "time_zone": args.time_zone,
        "start": args.start,
        "end": args.end,
        "max_runs": args.max_runs,
        "jitter_s": args.jitter_s,
        "misfire": args.misfire,
        "nonexistent": args.dst_gap,
        "ambiguous": args.dst_overlap,
        "day_match": args.day_match,
    }
    given = {k: v for k, v in recurring_flags.items() if v is not None}
    body: dict[str, object] = {
        "type": "create",
        "tenant": args.tenant,
        "schedule_id": args.schedule_id,
        "request_id": request_id,
        "callback": {"type": "http", "url": args.url}
        if args.url
        else {"type": "kafka", "topic": args.topic},
    }
    if args.due:
        if given:
            flags = ", ".join("--" + _FLAG_OF.get(k, k).replace("_", "-") for k in given)
            raise _Usage(f"{flags} only apply to recurring schedules (--cron or --every-s)")
        body["due"] = int(args.due) if args.due.isdigit() else args.due
    else:
        rec: dict[str, object] = {"cron": args.cron} if args.cron else {"every_s": args.every_s}
        for name in ("start", "end"):
            if name in given:
                value = given.pop(name)
                given[name] = int(value) if value.isdigit() else value
        body["recurrence"] = {**rec, **given}
    if args.payload is not None:
        try:
            body["payload"] = orjson.loads(args.payload)
        except orjson.JSONDecodeError as exc:
            raise _Usage(f"--payload is not JSON: {exc}") from None
    if args.misfire_tolerance_s is not None:
        body["misfire_tolerance_s"] = args.misfire_tolerance_s
    elif args.due:
        body["misfire_tolerance_s"] = settings.scheduler.default_misfire_tolerance_s
    limits = Limits.from_settings(settings.scheduler)
    return decode_command(
        orjson.dumps(body),
        key=args.schedule_id.encode(),
        now_ms=now_ms(),
        limits=limits,
    )


def _backfill_command(args: argparse.Namespace, settings: Settings, request_id: str) -> Command:
    """The backfill command of ``tocsin schedule backfill TENANT ID --from --to``, decoded
    by the wire contract's decoder."""
    if not args.from_ or not args.to:
        raise _Usage("backfill needs --from and --to (ISO-8601 with offset or epoch ms)")
    body: dict[str, object] = {
        "type": "backfill",
        "tenant": args.tenant,
        "schedule_id": args.schedule_id,
        "request_id": request_id,
    }
    for name, value in (("from", args.from_), ("to", args.to)):
        body[name] = int(value) if value.isdigit() else value
    return decode_command(
        orjson.dumps(body),
        key=args.schedule_id.encode(),
        now_ms=now_ms(),
        limits=Limits.from_settings(settings.scheduler),
    )


# The actions whose command is built from flags and checked by the wire decoder first.
_DECODED_ACTIONS = {"create": _create_command, "backfill": _backfill_command}


# Recurrence field -> the flag that sets it, where the names differ.
_FLAG_OF = {"time_zone": "tz", "nonexistent": "dst_gap", "ambiguous": "dst_overlap"}


def _recurring_get(
    args: argparse.Namespace, settings: Settings, row: CqlRow, events: list[CqlRow]
) -> int:
    """``tocsin schedule get`` of a recurring schedule (or of one of its runs)."""
    from api.recurring_io import schedule_json  # loads the Cassandra driver (see _with_store)

    async def view(store: Store) -> dict[str, Any]:
        return await schedule_json(store, row, events, now_ms=now_ms(), past=5, upcoming=5)

    try:
        out = asyncio.run(with_store(settings, view))
    except ApiError:
        print(f"no schedule {args.schedule_id!r} for tenant {args.tenant!r}")
        return EXIT_NOT_FOUND
    if getattr(args, "json", False):
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return EXIT_OK
    skip = ("history", "runs", "payload", "payload_b64", "callback", "recurrence")
    for key, value in out.items():
        if key not in skip:
            print(f"{key:16s} {'' if value is None else value}")
    if "recurrence" in out:
        print(f"{'recurrence':16s} {orjson.dumps(out['recurrence']).decode()}")
        for run in out["runs"]["next"]:
            print(f"  next  {run['nominal']}  due {run['due']}")
        for run in out["runs"]["past"]:
            print(f"  past  {run['nominal']}  {run['status']:9s} {run.get('delivery') or ''}")
    for e in out.get("history", []):
        print(f"  {e['at']}  {e['event']:14s} {e.get('detail') or ''}")
    return EXIT_OK


def _schedule_list(args: argparse.Namespace, settings: Settings) -> int:
    try:
        lo, hi = parse_window({"from": args.from_, "to": args.to})
        statuses = parse_statuses(args.status)
    except ApiError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE

    from api.recurring_io import parents_in_window  # loads the Cassandra driver

    one_statuses = None if statuses is None else statuses - {"completed"}

    async def collect(store: Store) -> list[dict[str, object]]:
        out: list[tuple[tuple[int, str], dict[str, object]]] = []
        after = None
        while len(out) < args.limit and one_statuses != frozenset():
            page = await store.read_index(args.tenant, from_ms=lo, to_ms=hi, after=after, limit=500)
            if not page:
                break
            rows = await store.get_schedules(args.tenant, [sid for _, sid in page])
            for due, sid in page:
                row = rows.get(sid)
                if row is not None and int(row["due_ms"]) == due and matches(row, one_statuses):
                    out.append(((due, sid), schedule_view(row, brief=True)))
            after = page[-1]
        # Recurring schedules: once each, at their first run in the window (docs/api.md).
        out.extend(
            await parents_in_window(
                store,
                args.tenant,
                from_ms=lo,
                to_ms=hi,
                statuses=statuses,
                after=None,
                now_ms=now_ms(),
            )
        )
        out.sort(key=lambda item: item[0])
        return [view for _, view in out[: args.limit]]

    views = asyncio.run(with_store(settings, collect))
    for v in views:
        delivery = v["delivery"]
        v["delivery"] = delivery.get("outcome", "") if isinstance(delivery, dict) else ""
        v["next_run"] = v.get("next_run") or ""
        v["recurring"] = "yes" if v.get("recurring") else ""
    emit(args, views, ["schedule_id", "status", "due", "delivery", "recurring", "next_run"])
    return EXIT_OK


def _schedule_runs(args: argparse.Namespace, settings: Settings) -> int:
    """``tocsin schedule runs TENANT ID [--next N] [--past N]``: a recurring schedule's
    past runs (newest first, with fire and delivery state) and its next runs."""
    from api.recurring_io import runs  # loads the Cassandra driver

    view = asyncio.run(
        with_store(
            settings,
            lambda store: runs(
                store,
                args.tenant,
                args.schedule_id,
                now_ms=now_ms(),
                past=args.past,
                upcoming=args.next,
            ),
        )
    )
    if view is None:
        print(f"no recurring schedule {args.schedule_id!r} for tenant {args.tenant!r}")
        return EXIT_NOT_FOUND
    if getattr(args, "json", False):
        print(orjson.dumps(view, option=orjson.OPT_INDENT_2).decode())
        return EXIT_OK
    print(f"{view['schedule_id']}  state {view['state']}  version {view['version']}")
    print(f"recurrence {view['recurrence']}")
    print(f"past runs ({len(view['past'])}, newest first):")
    for run in view["past"]:
        fired_ms = run.get("fired_ms")
        fired = format_iso_ms(fired_ms) if fired_ms else ""
        print(
            f"  {format_iso_ms(run['nominal_ms'])}  due {format_iso_ms(run['due_ms'])}  "
            f"{run['state']:9s} {fired:24s} {run.get('delivery') or ''}  {run['trigger_id']}"
        )
    print(f"next runs ({len(view['next'])}):")
    for run in view["next"]:
        print(
            f"  {format_iso_ms(run['nominal_ms'])}  due {format_iso_ms(run['due_ms'])}  "
            f"{run['trigger_id']}"
        )
    return EXIT_OK


def register(sub: SubParsers) -> None:
    schedule = sub.add_parser("schedule", help="create, cancel and inspect schedules")
    schedule.add_argument(
        "action",
        choices=[
            "create",
            "cancel",
            "get",
            "list",
            "runs",
            "explain",
            "pause",
            "resume",
            "trigger",
            "backfill",
        ],
    )
    schedule.add_argument("tenant")
    schedule.add_argument("schedule_id", nargs="?")
    schedule.add_argument(
        "--from",
        dest="from_",
        help="list: due from; backfill: runs from (ISO-8601 or epoch ms)",
    )
    schedule.add_argument(
        "--to", help="list: due before; backfill: runs before (ISO-8601 or epoch ms)"
    )
    schedule.add_argument(
        "--all",
        action="store_true",
        help="pause/resume: every schedule of the tenant it applies to (one-shots due in "
        "--from/--to, default a day ago to a year ahead; recurring ones all), at most 10,000",
    )
    schedule.add_argument(
        "--cursor", help="pause/resume --all: go on from a truncated run's next_cursor"
    )
    schedule.add_argument("--id-prefix", help="pause/resume --all: only ids with this prefix")
    schedule.add_argument("--status", help="list: comma-separated statuses")
    schedule.add_argument("--limit", type=int, default=100, help="list: at most this many")
    schedule.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    schedule.add_argument("--due", default="", help="ISO-8601 with offset or epoch ms (create)")
    schedule.add_argument("--url", help="HTTP callback URL (create)")
    schedule.add_argument("--topic", help="Kafka callback topic (create)")
    schedule.add_argument("--payload", help="JSON payload (create)")
    schedule.add_argument(
        "--misfire-tolerance-s",
        type=int,
        help="create: how late a run may still fire (default 3600 one-shot, 60 recurring)",
    )
    _add_recurrence_flags(schedule)
    schedule.add_argument("--timeout-s", type=float, default=30.0)
    schedule.add_argument("--next", type=int, default=10, help="runs: how many future runs")
    schedule.add_argument("--past", type=int, default=10, help="runs: how many past runs")
    schedule.add_argument(
        "--runs",
        type=int,
        default=10,
        help="explain: how many of a recurring schedule's newest runs",
    )
    schedule.set_defaults(func=cmd_schedule)


def _add_recurrence_flags(schedule: argparse.ArgumentParser) -> None:
    """The create flags of a recurring schedule."""
    rec = schedule.add_argument_group(
        "recurring schedules (create; docs/wire-contract.md#recurring-schedules)"
    )
    rec.add_argument("--cron", help="cron: 5 fields, 6 with seconds first, or @daily etc.")
    rec.add_argument("--every-s", type=int, dest="every_s", help="a fixed rate in seconds")
    rec.add_argument("--tz", dest="time_zone", help="IANA zone of the cron fields (UTC)")
    rec.add_argument("--start", help="first instant a run may have (ISO-8601 or epoch ms)")
    rec.add_argument("--end", help="last instant a run may have (ISO-8601 or epoch ms)")
    rec.add_argument("--max-runs", type=int, help="at most this many runs")
    rec.add_argument(
        "--jitter-s",
        "--window-s",
        type=int,
        dest="jitter_s",
        help="flexible window: fire each run within [nominal, nominal + N s)",
    )
    rec.add_argument(
        "--misfire",
        choices=["fire_all", "fire_latest", "skip"],
        help="runs later than the misfire tolerance (fire_latest)",
    )
    rec.add_argument(
        "--dst-gap",
        "--nonexistent",
        dest="dst_gap",
        choices=["skip", "shift_forward"],
        help="a local time a DST change skips (skip)",
    )
    rec.add_argument(
        "--dst-overlap",
        "--ambiguous",
        dest="dst_overlap",
        choices=["once", "twice"],
        help="a local time a DST change repeats (once)",
    )
    rec.add_argument(
        "--day-match",
        choices=["any", "all"],
        help="both day fields restricted: either matches (any) or both must (all)",
    )

"""The ``tocsin`` command line.

Exit codes scripts can rely on: 0 success, 1 failure (error printed on stderr), 2 usage
error, 3 not found, 4 rejected by the scheduler, 5 no answer in time (is a worker running?).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence

import uvloop

from base.errors import TocsinError
from base.logs import setup_logging
from base.settings import REPO_ROOT, Settings
from proxy.settings import ProxySettings
from tocsin import api_cli, deadletter_cli, proxy_cli, scheduler_cli
from tocsin import settings_doc as sd
from tocsin.cluster import cmd_cluster
from tocsin.infra import Stack
from tocsin.output import EXIT_FAIL, EXIT_OK, emit
from tocsin.settings_doc import Process
from tocsin.topic_admin import ensure_topics
from topics.catalog import catalog

# ----------------------------------------------------------------------------- infra


def cmd_infra(args: argparse.Namespace, settings: Settings) -> int:
    if args.nodes > 1:
        return cmd_cluster(args.action, settings.stack, nodes=args.nodes)
    stack = Stack(settings)
    if args.action == "up":
        started = time.monotonic()
        timings = stack.up()
        for name, seconds in timings.items():
            state = "already running" if seconds == 0.0 else f"ready in {seconds:.1f}s"
            print(f"{name}: {state}")
        print(
            f"stack up in {time.monotonic() - started:.1f}s "
            f"(kafka 127.0.0.1:{settings.stack.kafka_port}, "
            f"cassandra 127.0.0.1:{settings.stack.cassandra_port})"
        )
        return EXIT_OK
    if args.action == "down":
        stopped = stack.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return EXIT_OK
    statuses = stack.status()
    emit(
        args,
        [
            {
                "server": s.name,
                "pid": s.pid or "-",
                "running": s.running,
                "ready": s.ready,
                "port": s.port,
            }
            for s in statuses
        ],
        ["server", "pid", "running", "ready", "port"],
    )
    return EXIT_OK if all(s.ready for s in statuses) else EXIT_FAIL


def cmd_topics(args: argparse.Namespace, settings: Settings) -> int:
    specs = catalog(settings.topics).all()
    outcome = ensure_topics(settings.kafka, specs)
    emit(
        args,
        [
            {"topic": s.name, "partitions": s.partitions, "state": outcome[s.name], "key": s.key}
            for s in specs
        ],
        ["topic", "partitions", "state", "key"],
    )
    return EXIT_OK


def cmd_db(args: argparse.Namespace, settings: Settings) -> int:
    from schema.migrate import migrate  # loads the Cassandra driver, which most commands skip

    applied = migrate(settings.cassandra)
    print(
        f"keyspace {settings.cassandra.keyspace}: "
        + (f"applied {', '.join(applied)}" if applied else "up to date")
    )
    return EXIT_OK


def cmd_setup(args: argparse.Namespace, settings: Settings) -> int:
    from streams.binding import check_keyspace  # loads the Cassandra driver (see cmd_db)

    cmd_topics(args, settings)
    code = cmd_db(args, settings)
    # Bind the keyspace to this prefix (or fail here, before any worker rolls out, if it
    # belongs to another deployment: streams.binding).
    check_keyspace(settings, owner="tocsin setup")
    print(
        f"keyspace {settings.cassandra.keyspace}: deployment {settings.topics.prefix!r} "
        f"({settings.topics.command_partitions} commands partitions)"
    )
    return code


def cmd_settings(args: argparse.Namespace, settings: Settings) -> int:
    processes = [sd.Process(args.process)] if args.process else list(sd.Process)
    if args.write:
        for page in sorted({sd.TABLE_PAGES[p] for p in processes}):
            path = REPO_ROOT / page
            text = path.read_text()
            for process in processes:
                if sd.TABLE_PAGES[process] == page:
                    text = replace_block(text, process)
            path.write_text(text)
            print(f"{page}: settings tables written")
        return EXIT_OK
    for process in processes:
        if args.markdown:
            print(f"### {process.value}\n\n{sd.markdown_table(process)}\n")
        else:
            for s in sd.of(process):
                print(f"{process.value:7s} {s.variable:40s} {s.default:18s} {s.meaning}")
    return EXIT_OK


def replace_block(text: str, process: Process) -> str:
    """``text`` with the generated settings block of ``process`` brought up to date."""
    begin = text.find(sd.begin_marker(process))
    end = text.find(sd.END_MARKER, begin)
    if begin < 0 or end < 0:
        raise TocsinError(f"no {sd.begin_marker(process)} ... {sd.END_MARKER} block to replace")
    return text[:begin] + sd.block(process) + text[end + len(sd.END_MARKER) :]


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    """``tocsin status`` (tocsin.scheduler_cli.cmd_status), with the proxy's consumer group read
    from the proxy's own settings unless ``--proxy-group`` names it."""
    group = args.proxy_group or ProxySettings.from_env(os.environ).group_id
    return scheduler_cli.cmd_status(args, settings, proxy_group=group)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tocsin", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)

    infra = sub.add_parser("infra", help="the local single-node Kafka + Cassandra stack")
    infra.add_argument("action", choices=["up", "down", "status"])
    infra.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="3: a three-node Kafka and Cassandra cluster beside the single-node stack "
        "(its own addresses, ports and state folder; docs/operations.md)",
    )
    infra.set_defaults(func=cmd_infra)

    topics = sub.add_parser("topics", help="create missing topics and verify existing ones")
    topics.add_argument("action", choices=["create"])
    topics.set_defaults(func=cmd_topics)

    db = sub.add_parser("db", help="Cassandra schema")
    db.add_argument("action", choices=["migrate"])
    db.set_defaults(func=cmd_db)

    setup = sub.add_parser(
        "setup", help="topics create + db migrate + bind the keyspace to this prefix"
    )
    setup.set_defaults(func=cmd_setup)

    settings_cmd = sub.add_parser(
        "settings", help="every TOCSIN_* variable by process, with its default and meaning"
    )
    settings_cmd.add_argument("--markdown", action="store_true", help="as Markdown tables")
    settings_cmd.add_argument("--process", choices=[p.value for p in Process])
    settings_cmd.add_argument(
        "--write", action="store_true", help="bring the docs pages' generated tables up to date"
    )
    settings_cmd.set_defaults(func=cmd_settings)

    scheduler_cli.register(sub)
    # The schedules' view; the local Kafka and Cassandra servers are `tocsin infra status`.
    scheduler_cli.register_status(sub, cmd_status)
    api_cli.register(sub)
    proxy_cli.register(sub)
    deadletter_cli.register(sub)
    return parser


def use_event_loop(name: str) -> None:
    """Make ``name`` ("uvloop" or "asyncio") the loop of every asyncio loop this process
    creates from now on: aiohttp's ``run_app``, the proxy's writer threads and each
    ``asyncio.run``. The worker sets the standard loop again before it starts (settings:
    ``event_loop`` says why). (cassandra-driver runs its own libev loop, librdkafka its own
    threads: neither is affected.)"""
    if name == "uvloop":
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())


# Long-running servers log structured lines at INFO for a log pipeline; the commands a
# person runs print their own progress, so their log lines show from WARNING up (unless
# TOCSIN_LOG_LEVEL says otherwise).
_SERVERS = frozenset({"worker", "proxy", "api"})


def log_level_for(command: str, configured: str, env: Mapping[str, str]) -> str:
    if command in _SERVERS or "TOCSIN_LOG_LEVEL" in env:
        return configured
    return "WARNING"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        level = log_level_for(args.command, settings.log_level, os.environ)
        setup_logging(level, settings.log_format)
        if args.command not in _SERVERS and "TOCSIN_LOG_LEVEL" not in os.environ:
            # librdkafka warns of conditions it retries by itself (GETPID while a new
            # broker loads its coordinator); a person needs only what it gives up on.
            logging.getLogger("tocsin.librdkafka").setLevel(logging.ERROR)
        use_event_loop(settings.event_loop)
        result: int = args.func(args, settings)
        return result
    except TocsinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""What every ``tocsin`` command shares: its exit codes, how it prints rows, and the type of
the sub-command table each command module adds its parsers to.

Exit codes scripts can rely on: 0 success, 1 failure (error printed on stderr), 2 usage
error, 3 not found, 4 rejected by the scheduler, 5 no answer in time (is a worker running?).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import orjson

from base.settings import Settings

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_REJECTED = 0, 1, 2, 3, 4
EXIT_TIMEOUT = 5

# A string: the class is not subscriptable at run time.
SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

Action = Callable[[argparse.Namespace, Settings], int]


def print_table(rows: list[dict[str, object]], columns: Sequence[str]) -> None:
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


def emit(args: argparse.Namespace, rows: list[dict[str, object]], columns: Sequence[str]) -> None:
    """``rows`` as indented JSON with ``--json``, else as a table of ``columns``."""
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_table(rows, columns)


def run_action(
    args: argparse.Namespace,
    settings: Settings,
    actions: Mapping[str, Action],
    *,
    command: str,
    subject: str,
    given: str | None,
) -> int:
    """Run ``args.action`` from ``actions``; every action but ``list`` acts on one
    ``subject`` (e.g. "schedule id"), so without it (``given``) that is a usage error."""
    if args.action != "list" and not given:
        print(f"tocsin {command} {args.action} needs a {subject}", file=sys.stderr)
        return EXIT_USAGE
    return actions[args.action](args, settings)

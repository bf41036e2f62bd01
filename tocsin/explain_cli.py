"""``tocsin schedule explain TENANT ID [--json] [--runs N]``: why a schedule did or did not
fire, read straight from Cassandra (``streams.explain``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

import orjson

from base.clock import now_ms
from base.settings import Settings
from streams.explain import Facts, explain, render
from streams.explain_io import MAX_RUNS, read_facts
from tocsin.output import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from tocsin.store_session import with_store

if TYPE_CHECKING:
    from streams.store import Store


def schedule_explain(args: argparse.Namespace, settings: Settings) -> int:
    runs = int(getattr(args, "runs", 10))
    if not 0 <= runs <= MAX_RUNS:
        print(f"--runs must be in 0..{MAX_RUNS}", file=sys.stderr)
        return EXIT_USAGE

    async def read(store: Store) -> Facts | None:
        return await read_facts(
            store,
            args.tenant,
            args.schedule_id,
            now_ms=now_ms(),
            default_tolerance_s=settings.scheduler.default_misfire_tolerance_s,
            runs=runs,
        )

    facts = asyncio.run(with_store(settings, read))
    if facts is None:
        print(f"no schedule {args.schedule_id!r} for tenant {args.tenant!r}")
        return EXIT_NOT_FOUND
    found = explain(facts)
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(found.to_json(), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(found))
    return EXIT_OK

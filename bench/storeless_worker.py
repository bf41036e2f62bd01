"""A ``tocsin worker`` whose command agent skips Cassandra: the create path's floor.

Used only by ``python -m bench.api --worker-store none`` to measure what the rest of the
create path costs on this machine: the API, request-reply over Kafka, Faust's consumer and
the command agent's own decode, validation and result. Everything is the real worker
except two calls of the command processor, patched in this process only:

- ``load_schedule_rows`` answers "no row" without reading (every create is new);
- ``CommandProcessor._persist`` returns without writing (no bucket, index or schedule row);
  it also skips handing new schedules to the ticker, which the benchmark's creates (due an
  hour ahead) would not reach anyway.

Commands are answered ``ok`` and **nothing is stored**, so this is never a scheduler: it
exists so the benchmark can show how far the targets are from the path's floor. Tenants are
still read from Cassandra (once, then cached), as in the real worker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


async def _no_rows(store: Any, keys: Iterable[tuple[str, str]]) -> dict[Any, Any]:
    for _ in keys:  # consume the generator as the real call does
        pass
    return {}


async def _no_writes(self: Any, decisions: Any, now: int, policies: Any) -> None:
    return None


def main() -> int:
    import streams.commands
    from tocsin.cli import main as tocsin_main

    # Patching a name the command agent no longer uses would silently measure the real
    # worker: refuse to start instead.
    for owner, name in (
        (streams.commands, "load_schedule_rows"),
        (streams.commands.CommandProcessor, "_persist"),
    ):
        if not callable(getattr(owner, name, None)):
            raise SystemExit(f"bench.storeless_worker: {owner.__name__}.{name} is gone; update it")
    streams.commands.load_schedule_rows = _no_rows  # type: ignore[assignment]
    streams.commands.CommandProcessor._persist = _no_writes  # type: ignore[method-assign]
    return tocsin_main(["worker"])


if __name__ == "__main__":
    sys.exit(main())

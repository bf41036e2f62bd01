"""bench.storeless_worker patches two names of the command agent; a rename must fail here
(the benchmark would otherwise refuse to start, or worse, measure the real worker)."""

from __future__ import annotations

import asyncio
import inspect

import streams.commands
from bench import storeless_worker


def test_the_patched_names_exist_with_the_signatures_the_patches_replace() -> None:
    real_load = inspect.signature(streams.commands.load_schedule_rows)
    real_persist = inspect.signature(streams.commands.CommandProcessor._persist)
    patched_load = inspect.signature(storeless_worker._no_rows)
    assert list(real_load.parameters) == list(patched_load.parameters)
    assert list(real_persist.parameters) == list(
        inspect.signature(storeless_worker._no_writes).parameters
    )


def test_the_command_agent_still_reads_and_writes_through_the_patched_names() -> None:
    # Otherwise the patches would be dead and bench-api-floor would measure the real worker.
    used = set(streams.commands.CommandProcessor._process_batch.__code__.co_names)
    assert {"load_schedule_rows", "_persist"} <= used
    for real, patched in (
        (streams.commands.load_schedule_rows, storeless_worker._no_rows),
        (streams.commands.CommandProcessor._persist, storeless_worker._no_writes),
    ):
        assert inspect.iscoroutinefunction(real) and inspect.iscoroutinefunction(patched)


def test_the_storeless_read_finds_nothing_and_consumes_its_keys() -> None:
    keys = iter([("t", "a"), ("t", "b")])
    assert asyncio.run(storeless_worker._no_rows(object(), keys)) == {}
    assert list(keys) == []

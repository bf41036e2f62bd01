"""A connected ``Store`` for one command: the scheduler's Cassandra tables, opened and
closed around the work a ``tocsin`` command does with them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from base.settings import Settings

if TYPE_CHECKING:
    from streams.store import Store

T = TypeVar("T")


async def with_store(settings: Settings, fn: Callable[[Store], Awaitable[T]]) -> T:
    """``fn`` run on a connected store, closed afterwards whatever ``fn`` does."""
    from streams.store import Store  # loads the Cassandra driver, which --help never needs

    store = Store(settings.cassandra)
    await store.connect()
    try:
        return await fn(store)
    finally:
        await store.close()

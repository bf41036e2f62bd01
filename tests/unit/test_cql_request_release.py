"""A settled Cassandra request is freed by reference counting: ``_Paged`` lets go of the
driver's future, and of the timer that the future and the timer's callback keep in a
cycle. Left in cycles, every request's statements and values (about 90 objects for a batch
of 16 groups) waited for the garbage collector: at 1,000 fires/s, a young collection of
the worker about every second."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cassandra.cluster import ResponseFuture

from streams.cql import _Paged


class _Timer:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.canceled = False

    def cancel(self) -> None:
        self.canceled = True


class _DriverFuture:
    """What ``_Paged`` sees of the driver's ResponseFuture, with its timer kept after the
    result as the driver keeps it (cancelled, its callback a bound method of the future)."""

    has_more_pages = False

    def __init__(self) -> None:
        self._timer: _Timer | None = _Timer(self._on_timeout)
        self._callbacks: list[tuple[Callable[[Any], None], Callable[[BaseException], None]]] = []

    def _on_timeout(self) -> None:
        raise AssertionError("a settled request timed out")

    def add_callbacks(
        self, callback: Callable[[Any], None], errback: Callable[[BaseException], None]
    ) -> None:
        self._callbacks.append((callback, errback))

    def answer(self, page: Any) -> None:
        assert self._timer is not None
        self._timer.cancel()
        for callback, _ in self._callbacks:
            callback(page)

    def fail(self, exc: BaseException) -> None:
        assert self._timer is not None
        self._timer.cancel()
        for _, errback in self._callbacks:
            errback(exc)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_driver_keeps_the_timer_this_releases() -> None:
    # A driver upgrade that renamed it would leave every request in a cycle again.
    assert "_timer" in vars(ResponseFuture)


@pytest.mark.parametrize("outcome", ["answered", "failed"])
async def test_a_settled_request_is_freed_without_a_collection(
    no_collector: None, outcome: str
) -> None:
    paged = _Paged("record_delivery", asyncio.get_running_loop(), lambda name, pages: None)
    future = _DriverFuture()
    paged.start(future)  # type: ignore[arg-type]
    if outcome == "answered":
        future.answer(None)
    else:
        future.fail(RuntimeError("unavailable"))
    await asyncio.gather(paged.done, return_exceptions=True)
    freed = weakref.ref(future)
    del future
    assert freed() is None

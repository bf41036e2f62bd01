"""streams.app.set_fetch_max_wait: the worker's consumer gets its fetch wait and fetch
minimum from the settings (Faust offers no setting for either)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import faust

from base.settings import Settings
from streams import metrics
from streams.app import set_fetch_max_wait


def app_with_fetcher(fetcher: SimpleNamespace) -> faust.App:
    consumer = SimpleNamespace(_thread=SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher)))
    return cast(faust.App, SimpleNamespace(consumer=consumer))


def test_wait_and_minimum_reach_the_fetcher_and_the_wait_is_published() -> None:
    fetcher = SimpleNamespace(_fetch_max_wait_ms=1500, _fetch_min_bytes=1)
    set_fetch_max_wait(app_with_fetcher(fetcher), 15, 16384)
    assert (fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes) == (15, 16384)
    gauge: Any = metrics.CONSUMER_FETCH_MAX_WAIT
    assert gauge._value.get() == 15


def test_a_minimum_below_one_byte_is_one() -> None:
    fetcher = SimpleNamespace(_fetch_max_wait_ms=1500, _fetch_min_bytes=50)
    set_fetch_max_wait(app_with_fetcher(fetcher), 100, 0)
    assert fetcher._fetch_min_bytes == 1


def test_the_minimum_is_read_from_the_environment() -> None:
    env = {"TOCSIN_CONSUMER_FETCH_MIN_BYTES": "1"}
    assert Settings.from_env(env).scheduler.consumer_fetch_min_bytes == 1


def test_a_fetcher_without_the_attributes_is_left_alone_and_not_published() -> None:
    gauge: Any = metrics.CONSUMER_FETCH_MAX_WAIT
    gauge.set(-1)
    fetcher = SimpleNamespace(max_wait_ms=1500)  # the private names moved in an upgrade
    set_fetch_max_wait(app_with_fetcher(fetcher), 15, 16384)
    assert vars(fetcher) == {"max_wait_ms": 1500}
    assert gauge._value.get() == -1

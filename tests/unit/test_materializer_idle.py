"""The materialiser's loop between passes: it sleeps until the next entry of its due queue
falls due (or the queue's minute ends), not a second at a time, and a command's notify
wakes it. Time is a fake clock; what is asserted is when the loop plans its next pass and
what that pass reads, never how long anything took."""

from __future__ import annotations

from streams.decisions import DueEntry
from streams.materializer import MaterializerConfig, PartitionMaterializer
from tests.fakes import FakeStore
from tests.fakes import until_true as until
from tests.unit.test_streams_materializer import FakeTicker

MINUTE = 60_000
NOW = 1_800_000_000_000  # a minute's start
P = 3


def started(store: FakeStore, now: list[int], interval_s: float = 1.0) -> PartitionMaterializer:
    m = PartitionMaterializer(
        P,
        store=store,
        ticker=FakeTicker(),
        config=MaterializerConfig(interval_s=interval_s),
        clock_ms=lambda: now[0],
    )
    m.start()
    return m


def parents_asked(store: FakeStore) -> list[tuple[str, str]]:
    return [key for call in store.calls_of("get_parents") for key in call.args[1]]


async def test_an_empty_queue_is_read_again_at_its_minutes_end() -> None:
    now = [NOW + 5_000]
    store = FakeStore()
    m = started(store, now)
    await until(lambda: m.asleep_until_ms is not None)
    assert m.asleep_until_ms == NOW + MINUTE
    assert store.count("read_due") == 1
    await m.stop()


async def test_an_entry_due_later_in_the_minute_is_read_at_its_due_time() -> None:
    now = [NOW + 5_000]
    store = FakeStore()
    await store.put_due([DueEntry(P, NOW + 5_050, "t", "q")])
    m = started(store, now, interval_s=0.01)
    await until(lambda: m.asleep_until_ms is not None)
    assert m.asleep_until_ms == NOW + 5_050
    assert parents_asked(store) == []
    now[0] = NOW + 5_050
    await until(lambda: parents_asked(store) == [("t", "q")])
    # Nothing left in the minute: the next pass is at its end.
    await until(lambda: m.asleep_until_ms == NOW + MINUTE)
    await m.stop()


async def test_entries_falling_due_together_are_read_at_most_once_an_interval() -> None:
    now = [NOW + 5_000]
    store = FakeStore()
    await store.put_due([DueEntry(P, NOW + 5_010, "t", f"q{i}") for i in range(3)])
    m = started(store, now, interval_s=1.0)
    await until(lambda: m.asleep_until_ms is not None)
    assert m.asleep_until_ms == NOW + 6_000  # as a poll every second would read them
    await m.stop()


async def test_a_commands_notify_wakes_the_sleeping_loop() -> None:
    now = [NOW + 5_000]
    store = FakeStore()
    m = started(store, now)
    await until(lambda: m.asleep_until_ms == NOW + MINUTE)
    now[0] += 2_000
    m.notify("t", "new")  # a command just wrote this parent (and its entry)
    await until(lambda: parents_asked(store) == [("t", "new")])
    await until(lambda: m.asleep_until_ms == NOW + MINUTE)
    await m.stop()

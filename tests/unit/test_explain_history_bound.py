"""explain reads a bounded history: the newest events of each schedule id, and says when
older ones exist."""

from __future__ import annotations

from streams.explain import explain, render
from streams.explain_io import MAX_EVENTS, read_facts
from streams.model import ScheduleRow, ScheduleState
from tests.fakes import FakeStore

T0 = 1_795_000_000_000


def _store(events: int) -> FakeStore:
    store = FakeStore()
    store.schedules[("acme", "s1")] = ScheduleRow(
        tenant="acme",
        schedule_id="s1",
        partition=0,
        state=ScheduleState.SCHEDULED,
        due_ms=T0 + 10**9,
        version=1,
        created_ms=T0,
        updated_ms=T0,
    )
    for i in range(events):
        store.events.append(
            {
                "tenant": "acme",
                "schedule_id": "s1",
                "at_ms": T0 + i,
                "event": "command_refused",
                "trigger_id": None,
                "due_ms": None,
                "detail": f"update refused {i}",
            }
        )
    return store


async def test_a_long_history_is_read_newest_first_up_to_the_bound() -> None:
    store = _store(MAX_EVENTS + 50)
    facts = await read_facts(store, "acme", "s1", now_ms=T0, default_tolerance_s=60)
    assert facts is not None
    assert len(facts.events) == MAX_EVENTS
    # The newest ones, oldest of them first.
    assert facts.events[0]["at_ms"] == T0 + 50
    assert facts.events[-1]["at_ms"] == T0 + MAX_EVENTS + 49
    ex = explain(facts)
    assert ex.older_events is True
    assert ex.to_json()["older_events"] is True
    assert any("older ones exist for s1" in n for n in ex.notes)
    assert "older ones exist for s1" in render(ex)


async def test_a_short_history_is_read_whole_without_the_note() -> None:
    store = _store(MAX_EVENTS)
    facts = await read_facts(store, "acme", "s1", now_ms=T0, default_tolerance_s=60)
    assert facts is not None and len(facts.events) == MAX_EVENTS
    ex = explain(facts)
    assert ex.older_events is False
    assert not any("older" in n for n in ex.notes)

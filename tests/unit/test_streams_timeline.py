"""The per-partition due queue: ordering, replacement by version, removal, tombstones,
horizon and compaction."""

from __future__ import annotations

import random

import pytest

from streams.timeline import Entry, Timeline

T0 = 1_763_744_400_000


def entry(due_ms: int, sid: str, version: int = 1, tenant: str = "t") -> Entry[str]:
    return Entry(due_ms=due_ms, tenant=tenant, schedule_id=sid, version=version, payload=sid)


def ids(entries: list[Entry[str]]) -> list[str]:
    return [e.schedule_id for e in entries]


def test_pop_due_returns_due_entries_in_due_order() -> None:
    tl: Timeline[str] = Timeline()
    for due, sid in [(T0 + 3000, "c"), (T0 + 1000, "a"), (T0 + 2000, "b"), (T0 + 9000, "z")]:
        assert tl.add(entry(due, sid))
    assert tl.next_due_ms() == T0 + 1000
    assert tl.pop_due(T0 + 999) == []
    assert ids(tl.pop_due(T0 + 3000)) == ["a", "b", "c"]  # due_ms == now is due
    assert len(tl) == 1
    assert tl.next_due_ms() == T0 + 9000


def test_same_due_keeps_insertion_order() -> None:
    tl: Timeline[str] = Timeline()
    for sid in ["x", "y", "z"]:
        tl.add(entry(T0, sid))
    assert ids(tl.pop_due(T0)) == ["x", "y", "z"]


def test_pop_due_limit_slices_a_burst() -> None:
    tl: Timeline[str] = Timeline()
    for i in range(10):
        tl.add(entry(T0 + i, f"s{i}"))
    assert ids(tl.pop_due(T0 + 100, limit=4)) == ["s0", "s1", "s2", "s3"]
    assert ids(tl.pop_due(T0 + 100, limit=4)) == ["s4", "s5", "s6", "s7"]
    assert ids(tl.pop_due(T0 + 100)) == ["s8", "s9"]
    assert tl.pop_due(T0 + 100) == []


def test_newer_version_replaces_older() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0 + 1000, "a", version=1))
    assert tl.add(entry(T0 + 5000, "a", version=2))  # reschedule later
    assert len(tl) == 1
    assert tl.pop_due(T0 + 1000) == []  # the old due time no longer fires
    assert tl.next_due_ms() == T0 + 5000
    [fired] = tl.pop_due(T0 + 5000)
    assert fired.version == 2


def test_older_version_and_duplicate_are_refused() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0 + 1000, "a", version=3))
    assert not tl.add(entry(T0 + 500, "a", version=2))  # stale row from an older version
    assert not tl.add(entry(T0 + 1000, "a", version=3))  # same row read twice
    assert len(tl) == 1
    assert ids(tl.pop_due(T0 + 2000)) == ["a"]
    assert tl.pop_due(T0 + 2000) == []  # fired once only


def test_tenants_do_not_collide() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0, "s", tenant="a"))
    tl.add(entry(T0, "s", tenant="b"))
    assert len(tl) == 2
    assert ("a", "s") in tl
    assert tl.get("b", "s") is not None


def test_remove() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0, "a"))
    tl.add(entry(T0 + 1, "b"))
    assert tl.remove("t", "a")
    assert not tl.remove("t", "a")
    assert not tl.remove("t", "missing")
    assert len(tl) == 1
    assert tl.next_due_ms() == T0 + 1
    assert ids(tl.pop_due(T0 + 10)) == ["b"]
    assert tl.next_due_ms() is None


def test_tombstone_refuses_a_stale_read_until_it_expires() -> None:
    tl: Timeline[str] = Timeline(tombstone_ttl_ms=10_000)
    tl.pop_due(T0)
    # Cancel (version 2) before an in-flight bucket read delivers the version-1 row.
    assert not tl.remove("t", "a", version=2, now_ms=T0)
    assert not tl.add(entry(T0 + 5000, "a", version=1))
    assert not tl.add(entry(T0 + 5000, "a", version=2))
    # A later version (re-create after cancel) is accepted at once.
    assert tl.add(entry(T0 + 6000, "a", version=3))
    tl.remove("t", "a")
    tl.pop_due(T0 + 10_000)  # tombstone expired
    assert tl.add(entry(T0 + 20_000, "a", version=1))


def test_remove_with_version_needs_now() -> None:
    tl: Timeline[str] = Timeline()
    with pytest.raises(ValueError):
        tl.remove("t", "a", version=1)


def test_horizon_only_moves_forward() -> None:
    tl: Timeline[str] = Timeline(loaded_until_ms=T0)
    assert tl.covers(T0 - 1)
    assert not tl.covers(T0)
    tl.mark_loaded(T0 + 60_000)
    tl.mark_loaded(T0)  # a late, smaller mark is ignored
    assert tl.loaded_until_ms == T0 + 60_000
    assert tl.covers(T0 + 59_999)
    assert not tl.covers(T0 + 60_000)


def test_clear_forgets_everything() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0, "a"))
    tl.remove("t", "b", version=1, now_ms=T0)
    tl.mark_loaded(T0 + 60_000)
    tl.clear()
    assert len(tl) == 0
    assert tl.loaded_until_ms == 0
    assert tl.next_due_ms() is None
    assert tl.add(entry(T0, "b", version=1))


def test_heap_is_compacted_under_churn() -> None:
    tl: Timeline[str] = Timeline()
    tl.add(entry(T0, "keep"))
    for version in range(1, 5000):
        tl.add(entry(T0 + 1000 + version, "churn", version=version))
    assert len(tl) == 2
    assert len(tl._heap) < 2100  # dead items do not accumulate without bound
    assert ids(tl.pop_due(T0 + 100_000)) == ["keep", "churn"]
    assert tl.pop_due(T0 + 100_000) == []


def test_random_operations_match_a_simple_model() -> None:
    rng = random.Random(7)
    tl: Timeline[str] = Timeline()
    model: dict[str, tuple[int, int]] = {}  # sid -> (due_ms, version)
    versions: dict[str, int] = {}
    now = T0
    fired: list[tuple[int, str]] = []
    for _ in range(5000):
        op = rng.random()
        sid = f"s{rng.randrange(200)}"
        if op < 0.6:
            versions[sid] = versions.get(sid, 0) + 1
            due = now + rng.randrange(-1000, 20_000)
            tl.add(entry(due, sid, version=versions[sid]))
            model[sid] = (due, versions[sid])
        elif op < 0.75:
            tl.remove("t", sid)
            model.pop(sid, None)
        else:
            now += rng.randrange(0, 3000)
            got = tl.pop_due(now)
            expected = sorted((d, s) for s, (d, _) in model.items() if d <= now)
            assert sorted((e.due_ms, e.schedule_id) for e in got) == expected
            assert [e.due_ms for e in got] == sorted(e.due_ms for e in got)
            for e in got:
                assert model.pop(e.schedule_id) == (e.due_ms, e.version)
            fired.extend((e.due_ms, e.schedule_id) for e in got)
        assert len(tl) == len(model)
        expected_next = min((d for d, _ in model.values()), default=None)
        assert tl.next_due_ms() == expected_next
    assert fired

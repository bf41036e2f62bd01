"""The fair fire queue: round-robin across tenants, per-tenant fire quotas (deferral, never
loss), and what it tells the ticker's checkpoint."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from streams.pacing import FirePacer, Paced
from streams.timeline import Entry

Q = dict[str, int]


def entry(tenant: str, sid: str, due_ms: int = 1_000, version: int = 1) -> Entry[None]:
    return Entry(due_ms, tenant, sid, version, None)


def quotas(q: Q) -> Callable[[str], int]:
    return lambda tenant: q.get(tenant, 0)


def ids(taken: list[Paced[None]]) -> list[str]:
    return [p.entry.schedule_id for p in taken]


def test_one_tenants_burst_does_not_go_before_other_tenants_of_the_same_second() -> None:
    pacer: FirePacer[None] = FirePacer()
    for i in range(1000):  # stored order: all of big's rows first ("big" < "small")
        pacer.push(entry("big", f"b{i}"), 1_000)
    pacer.push(entry("small", "s0"), 1_000)
    pacer.push(entry("tiny", "t0"), 1_000)
    first = pacer.take(1_000, quotas({}), limit=3)
    assert sorted(ids(first)) == ["b0", "s0", "t0"]  # one each, not three of big's
    rest = pacer.take(1_000, quotas({}))
    assert len(rest) == 999 and len(pacer) == 0


def test_each_tenant_goes_in_due_order() -> None:
    pacer: FirePacer[None] = FirePacer()
    pacer.push(entry("a", "late", due_ms=3_000), 5_000)
    pacer.push(entry("a", "early", due_ms=1_000), 5_000)
    pacer.push(entry("a", "mid", due_ms=2_000), 5_000)
    assert ids(pacer.take(5_000, quotas({}))) == ["early", "mid", "late"]


def test_quota_defers_excess_fires_and_lets_them_out_as_tokens_come() -> None:
    # 120 fires/min over 2 partitions: 1 token/s per partition, a minute's share (60) at once.
    pacer: FirePacer[None] = FirePacer(partitions=2)
    q = quotas({"a": 120})
    for i in range(70):
        pacer.push(entry("a", f"a{i}"), 0)
    pacer.push(entry("b", "b0"), 0)
    now = 0
    out = pacer.take(now, q)
    assert len(out) == 61 and "b0" in ids(out)  # 60 of a's, and b is not held up
    assert len(pacer) == 10  # deferred, not dropped
    assert pacer.next_token_ms(now, q) == 1_000
    assert pacer.take(999, q) == []
    later = pacer.take(1_000, q)
    assert ids(later) == ["a60"] and later[0].throttled and later[0].waited_ms == 1_000
    out_all = []
    for now in range(2_000, 20_000, 1_000):
        out_all += pacer.take(now, q)
    assert len(out_all) == 9 and len(pacer) == 0
    assert all(p.throttled for p in out_all)
    assert not any(p.throttled for p in out if p.entry.tenant == "b")


def test_unthrottled_entries_are_not_counted_as_throttled() -> None:
    pacer: FirePacer[None] = FirePacer()
    pacer.push(entry("a", "x"), 0)
    (taken,) = pacer.take(0, quotas({"a": 600}))
    assert not taken.throttled and taken.waited_ms == 0


def test_quota_smaller_than_the_partitions_still_lets_one_fire_through() -> None:
    pacer: FirePacer[None] = FirePacer(partitions=12)
    q = quotas({"a": 6})  # half a fire per partition per minute
    for i in range(3):
        pacer.push(entry("a", f"a{i}"), 0)
    assert len(pacer.take(0, q)) == 1
    wait = pacer.next_token_ms(0, q)
    assert wait == 120_000  # 6 / 60 / 12 tokens a second: one every 120 s
    assert len(pacer.take(wait, q)) == 1


def test_earliest_due_covers_deferred_entries_for_the_checkpoint() -> None:
    pacer: FirePacer[None] = FirePacer()
    q = quotas({"a": 1})
    pacer.push(entry("a", "first", due_ms=500), 1_000)
    pacer.push(entry("a", "second", due_ms=700), 1_000)
    pacer.push(entry("b", "other", due_ms=900), 1_000)
    assert pacer.earliest_due_ms() == 500
    taken = pacer.take(1_000, q)
    assert sorted(ids(taken)) == ["first", "other"]
    assert pacer.earliest_due_ms() == 700  # "second" waits for a token: still not fired
    pacer.take(61_000, q)
    assert pacer.earliest_due_ms() is None


def test_remove_drops_a_deferred_entry_only_up_to_the_given_version() -> None:
    pacer: FirePacer[None] = FirePacer()
    pacer.push(entry("a", "x", version=3), 0)
    assert not pacer.remove("a", "x", version=2)  # an older change: the entry stays
    assert pacer.get("a", "x") is not None
    assert pacer.remove("a", "x", version=3)
    assert pacer.take(0, quotas({})) == [] and pacer.earliest_due_ms() is None


def test_a_replaced_entry_fires_once_in_its_new_version() -> None:
    pacer: FirePacer[None] = FirePacer()
    pacer.push(entry("a", "x", version=1), 0)
    pacer.push(entry("a", "x", version=2), 0)
    taken = pacer.take(0, quotas({}))
    assert [p.entry.version for p in taken] == [2]


def test_raising_the_quota_releases_the_backlog() -> None:
    pacer: FirePacer[None] = FirePacer()
    limits = {"a": 1}
    for i in range(5):
        pacer.push(entry("a", f"a{i}"), 0)
    assert len(pacer.take(0, quotas(limits))) == 1
    limits["a"] = 0  # the tenant's quota was lifted (config change)
    assert len(pacer.take(1, quotas(limits))) == 4


@settings(max_examples=200, deadline=None)
@given(
    pushes=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 30), st.integers(0, 5_000)),
        max_size=60,
    ),
    quota=st.integers(0, 120),
    steps=st.lists(st.integers(0, 20_000), min_size=1, max_size=10),
)
def test_nothing_is_lost_or_doubled_and_the_quota_holds(
    pushes: list[tuple[str, int, int]], quota: int, steps: list[int]
) -> None:
    """Every queued entry comes out exactly once once enough time passes, and no tenant
    gets more than its burst plus what its rate refilled."""
    pacer: FirePacer[None] = FirePacer(partitions=2)
    q = quotas({"a": quota, "b": quota})
    live: dict[tuple[str, str], int] = {}
    for tenant, n, due in pushes:
        pacer.push(entry(tenant, f"s{n}", due_ms=due), 0)
        live[(tenant, f"s{n}")] = due
    out: list[tuple[str, str]] = []
    per_tenant: dict[str, int] = {}
    now = 0
    for step in steps:
        now += step
        for p in pacer.take(now, q, limit=7):
            out.append(p.entry.key)
            per_tenant[p.entry.tenant] = per_tenant.get(p.entry.tenant, 0) + 1
    if quota:
        burst = max(1.0, quota / 2)
        for tenant in ("a", "b"):
            assert per_tenant.get(tenant, 0) <= burst + now / 1000 * quota / 120 + 1e-9
    now += 10**9  # long enough for every token
    while len(pacer):
        out += [p.entry.key for p in pacer.take(now, q)]
        now += 10**6
    assert sorted(out) == sorted(live)


def test_it_knows_which_order_keys_it_holds_and_forgets_them() -> None:
    # Order key: the schedule id's prefix before "-" (tenant-scoped, as on the fires topic).
    pacer: FirePacer[None] = FirePacer(order_key_of=lambda e: e.schedule_id.split("-")[0])
    pacer.push(entry("a", "k-1", 1_000), 1_000)
    pacer.push(entry("a", "k-2", 2_000), 2_000)
    pacer.push(entry("a", "k-2", 2_000, version=2), 2_000)  # replaces, still one of k-2
    assert pacer.holds_order_key_of(entry("a", "k-3"))
    assert not pacer.holds_order_key_of(entry("b", "k-3"))  # another tenant's k
    assert not pacer.holds_order_key_of(entry("a", "j-1"))
    pacer.remove("a", "k-1")
    assert pacer.holds_order_key_of(entry("a", "k-3"))
    assert ids(pacer.take(3_000, quotas({}))) == ["k-2"]
    assert not pacer.holds_order_key_of(entry("a", "k-3"))
    assert pacer._order_keys == {}  # nothing kept for keys no longer queued


def test_a_held_order_key_is_not_taken_until_released_and_stays_queued() -> None:
    # Order key = schedule id's first letter: "k1", "k2" share key "k".
    pacer: FirePacer[None] = FirePacer(order_key_of=lambda e: e.schedule_id[0])
    pacer.push(entry("t", "k2", 2_000), 2_000)
    pacer.push(entry("t", "o1", 1_500), 2_000)
    pacer.hold("t", "k")
    pacer.push(entry("t", "k1", 1_000), 2_000)  # pushed while held: waits too
    pacer.push(entry("t", "k3", 3_000), 2_000)
    assert pacer.earliest_due_ms() == 1_000  # the checkpoint stays below held ones
    assert pacer.next_token_ms(2_000, quotas({})) == 2_000  # o1 may go
    assert ids(pacer.take(2_000, quotas({}))) == ["o1"]
    assert pacer.next_token_ms(2_000, quotas({})) is None  # only held ones: no wake-up
    assert len(pacer) == 3 and pacer.holds_order_key_of(entry("t", "k9"))
    assert pacer.remove("t", "k3")  # a cancel still finds it
    pacer.release("t", "k")
    assert ids(pacer.take(5_000, quotas({}))) == ["k1", "k2"]  # due order, k3 gone
    assert len(pacer) == 0 and pacer.earliest_due_ms() is None

"""Writer slots: the caps in all, per host and per tenant, who waits in which line, and who
goes when a slot frees."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.slots import Slots


@dataclass(eq=False)
class Msg:
    host: str
    tenant: str | None = None
    revoked: bool = False


def never(_m: Msg) -> bool:
    return False


def test_a_host_gets_at_most_its_cap_and_a_freed_slot_goes_to_its_longest_waiting() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=2, per_tenant=10)
    a, b, c, d = (Msg("h") for _ in range(4))
    other = Msg("o")
    assert [slots.admit(m) for m in (a, b, c, d, other)] == [True, True, False, False, True]
    assert slots.active == 3 and slots.waiting() == 2
    slots.free(a)
    assert slots.next_up(a, never) == [c]  # c waited longest; d still waits
    slots.free(other)
    assert slots.next_up(other, never) == []  # o's slot is no help to h's line
    assert slots.waiting() == 1 and slots.active == 2  # b and c


def test_a_tenant_gets_at_most_its_share_and_waits_in_its_own_line() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=10, per_tenant=2)
    a1, a2, a3 = (Msg(f"h{i}", "A") for i in range(3))
    b1 = Msg("h0", "B")
    assert [slots.admit(m) for m in (a1, a2, a3, b1)] == [True, True, False, True]
    assert slots.tenant_full("A") and not slots.tenant_full("B")
    assert not slots.tenant_full(None)  # no tenant (generic mode): never capped
    slots.free(a1)
    assert not slots.tenant_full("A")
    assert slots.next_up(a1, never) == [a3] and slots.tenant_full("A")


def test_one_tenants_slow_host_leaves_the_same_host_free_for_another_tenant() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=2, per_tenant=10)
    a1, a2, a3 = (Msg("h", "A") for _ in range(3))
    b1 = Msg("h", "B")
    assert [slots.admit(m) for m in (a1, a2, a3)] == [True, True, False]  # A's cap on h
    assert slots.admit(b1)  # B's cap on the same host is its own
    slots.free(b1)
    assert slots.next_up(b1, never) == []  # B's freed slot is no help to A's line on h
    slots.free(a1)
    assert slots.next_up(a1, never) == [a3] and slots.waiting() == 0


def test_a_freed_slot_goes_to_its_tenant_and_host_line_before_its_tenants_line() -> None:
    slots: Slots[Msg] = Slots(concurrency=3, per_host=1, per_tenant=2)
    a1, c, a2, a3 = Msg("h", "A"), Msg("h", "A"), Msg("y", "A"), Msg("z", "A")
    assert [slots.admit(m) for m in (a1, c, a2, a3)] == [True, False, True, False]
    assert slots.admit(Msg("x", "B")) and not slots.has_room()
    slots.free(a1)
    # The freed slot goes to (A, h)'s line (c); A's line (a3) then finds A at its share.
    assert slots.next_up(a1, never) == [c]
    assert not slots.has_room() and slots.waiting() == 1


def test_a_message_over_its_tenants_share_moves_from_its_hosts_line_to_its_tenants() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=1, per_tenant=2)
    blocker, m, other = Msg("h", "A"), Msg("h", "A"), Msg("x", "A")
    assert slots.admit(blocker)
    assert not slots.admit(m)  # (A, h) is at its cap: that line
    assert slots.admit(other)  # now A is at its share too
    slots.free(blocker)
    late = Msg("y", "A")
    assert slots.admit(late)  # A's freed share is taken before h's line is served
    assert slots.next_up(blocker, never) == []  # h is free, but A is not: A's line
    assert slots.waiting() == 1
    slots.free(other)
    assert slots.next_up(other, never) == [m]
    assert slots.waiting() == 0


def test_a_revoked_waiting_message_is_skipped_and_dropped_from_its_line() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=1, per_tenant=10)
    running, gone, next_one = Msg("h"), Msg("h", revoked=True), Msg("h")
    for m in (running, gone, next_one):
        slots.admit(m)
    skipped: list[Msg] = []

    def skip(m: Msg) -> bool:
        if m.revoked:
            skipped.append(m)
        return m.revoked

    slots.free(running)
    assert slots.next_up(running, skip) == [next_one] and skipped == [gone]
    assert slots.waiting() == 0


def test_dropping_waiting_messages_empties_their_lines() -> None:
    slots: Slots[Msg] = Slots(concurrency=10, per_host=1, per_tenant=2)
    msgs = [Msg("h", "A"), Msg("h", "A"), Msg("x", "A"), Msg("y", "A"), Msg("h", "A", True)]
    assert [slots.admit(m) for m in msgs] == [True, False, True, False, False]
    assert slots.waiting() == 3  # one in (A, h)'s line, two in A's
    assert slots.drop_waiting(lambda m: m.revoked) == [msgs[4]]
    assert sorted(m.host + str(m.tenant) for m in slots.drop_waiting(lambda m: True)) == [
        "hA",
        "yA",
    ]
    assert slots.waiting() == 0
    slots.free(msgs[0])
    assert slots.active == 1 and slots.admit(Msg("h", "A"))

"""The fault-injection suite's counting (bench/chaos.py): what counts as lost, duplicated
and late, and what breaks per-key order."""

from __future__ import annotations

from bench.chaos import Receiver, Tally, spread


def test_tally_counts_lost_duplicates_and_lateness() -> None:
    t = Tally()
    for tid, due in (("a", 1_000), ("b", 2_000), ("c", 3_000)):
        t.expect(tid, due)
    t.saw("a", 1_050)
    t.saw("a", 1_400)  # a duplicate: lateness counts the first sighting
    t.saw("b", 1_990)  # early (negative lateness)
    t.saw("zz", 5_000)  # never acknowledged: ignored
    f = t.figures()
    assert f == {"acknowledged": 3, "triggers": 2, "lost": 1, "duplicated": 1,
                 "max_lateness_ms": 50, "min_lateness_ms": -10}
    assert t.missing() == {"c"}


def test_order_violations_count_first_deliveries_only() -> None:
    r = Receiver(Tally())
    # key k: due 1, 2, then 1 again (a redelivery: fine), then 3; key j: 5 before 4 (bad)
    r.by_key["k"] = [(1, 0), (2, 1), (1, 0), (3, 2)]
    r.by_key["j"] = [(5, 1), (4, 0)]
    assert r.order_violations() == 1


def test_spread() -> None:
    assert spread(4, 100, 40) == [100, 110, 120, 130]

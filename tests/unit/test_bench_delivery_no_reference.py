"""bench.delivery --no-reference: without the reference consumer, lateness and the due ->
emitted hop are still measured, and the hops only that consumer can see are left empty."""

from __future__ import annotations

from bench.delivery import NoReference, hops


def test_without_a_reference_only_the_workers_hop_is_measured() -> None:
    rx = {"a": [1_000, 1_004, 1_020], "b": [2_000, 2_003, 2_011]}
    lateness, per_hop = hops(rx, NoReference())
    assert sorted(lateness) == [11, 20]
    assert sorted(per_hop["due -> emitted"]) == [3, 4]
    assert all(not v for k, v in per_hop.items() if k != "due -> emitted")

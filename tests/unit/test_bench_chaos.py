"""The fault-injection suite's counting (bench/chaos.py): what counts as lost, duplicated
and late, and what breaks per-key order, for one-shot triggers and recurring runs."""

from __future__ import annotations

import zlib
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import orjson

from bench.chaos import (
    CRON_ZONE,
    Receiver,
    RunRule,
    Tally,
    duplicate_bound,
    expect_runs,
    ids_on_partition,
    lateness_ms,
    local_hours,
    padded_payload,
    percentile,
    recurring_rules,
    runs_per_s,
    spread,
    verdict,
)
from streams.partitioner import partition_for
from streams.recurring import first_run, occurrences
from topics.ids import trigger_id


def test_tally_counts_lost_duplicates_and_lateness() -> None:
    t = Tally()
    for tid, due in (("a", 1_000), ("b", 2_000), ("c", 3_000)):
        t.expect(tid, due)
    t.saw("a", 1_050)
    t.saw("a", 1_400)  # a duplicate: lateness counts the first sighting
    t.saw("b", 1_990)  # early (negative lateness)
    t.saw("zz", 5_000)  # never acknowledged: ignored
    f = t.figures()
    assert f == {
        "acknowledged": 3,
        "triggers": 2,
        "lost": 1,
        "duplicated": 1,
        "early": 1,
        "max_lateness_ms": 50,
        "min_lateness_ms": -10,
        "recurring_runs": 0,
        "recurring_runs_lost": 0,
        "recurring_runs_duplicated": 0,
    }
    assert t.missing() == {"c"}


def test_early_allowance_forgives_a_stated_skew_only() -> None:
    t = Tally(early_allowance_ms=2_000)
    t.expect("a", 10_000)
    t.expect("b", 10_000)
    t.saw("a", 8_000)  # exactly the allowance: not early
    t.saw("b", 7_999)
    assert t.figures()["early"] == 1


def clean(name: str, **more: Any) -> dict[str, Any]:
    return {
        "scenario": name,
        "acknowledged": 10,
        "triggers": 10,
        "lost": 0,
        "duplicated": 0,
        "early": 0,
        "codes": {"ok": 10, "unanswered": 0},
        "order_violations": 0,
        **more,
    }


def test_a_clean_run_passes() -> None:
    v = verdict([clean("a"), clean("b", duplicated=5, duplicate_bound=5)])
    assert v.ok and not v.breaches
    assert v.result_lines() == [
        "RESULT chaos_lost=0 triggers",
        "RESULT chaos_unanswered=0 commands",
        "RESULT chaos_early=0 triggers",
        "RESULT chaos_order_violations=0 deliveries",
        "RESULT chaos_duplicate_bound_breaches=0 scenarios",
        "RESULT chaos_order_across_partitions=0 deliveries",
    ]


def test_each_kind_of_wrong_fails_the_run_on_its_own() -> None:
    wrong = {
        "lost": clean("x", lost=1),
        "unanswered": clean("x", codes={"ok": 9, "unanswered": 1}),
        "early": clean("x", early=2),
        "order_violations": clean("x", order_violations=3),
        "duplicate_bound_breaches": clean("x", duplicated=6, duplicate_bound=5),
    }
    for field, report in wrong.items():
        v = verdict([clean("a"), report])
        assert not v.ok, field
        assert getattr(v, field) > 0, field
        nonzero = [line for line in v.result_lines() if not line.split("=")[1].startswith("0 ")]
        assert len(nonzero) == 1 and nonzero[0].startswith(f"RESULT chaos_{field}="), field
        assert v.breaches and v.breaches[0].startswith("x: ")


def test_duplicates_without_a_stated_bound_are_a_breach() -> None:
    v = verdict([clean("receiver", duplicated=1)])
    assert v.duplicate_bound_breaches == 1 and not v.ok


def test_a_failed_scenario_or_a_false_check_fails_the_run() -> None:
    assert verdict([{"scenario": "s", "error": "RuntimeError()", "lost": 0}]).failed == ("s",)
    v = verdict([clean("state_dir", **{"ok_read-only": False, "ok_full": True})])
    assert v.failed == ("state_dir",) and not v.ok


def test_a_scenario_that_acknowledged_nothing_fails_the_run() -> None:
    refused = clean(
        "cassandra_slow",
        scheduled=600,
        acknowledged=0,
        triggers=0,
        codes={"invalid_url": 600, "unanswered": 0},
    )
    v = verdict([refused])
    assert v.failed == ("cassandra_slow",) and not v.ok


def test_totals_add_up_over_scenarios() -> None:
    v = verdict([clean("a", lost=2, unanswered=1), clean("b", lost=3, order_violations=4)])
    assert (v.lost, v.unanswered, v.order_violations) == (5, 1, 4)


def test_duplicate_bound() -> None:
    assert duplicate_bound(rate_per_s=20) == 0  # no fault: no duplicate allowed
    assert duplicate_bound(rate_per_s=16, worker_handovers=3) == 3 * 32
    assert duplicate_bound(rate_per_s=10, proxy_handovers=2) == 2 * (10 + 100)
    assert duplicate_bound(rate_per_s=20, broker_down_s=15.5) == 310


def test_percentile() -> None:
    assert percentile([], 0.99) == 0
    assert percentile([5], 0.99) == 5
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile(list(range(100, 0, -1)), 0.5) == 50


def test_order_violations_count_first_deliveries_only() -> None:
    r = Receiver(Tally())
    # key k: due 1, 2, then 1 again (a redelivery: fine), then 3; key j: 5 before 4 (bad)
    r.by_key["k"] = [(1, 0, "a", 10), (2, 1, "b", 11), (1, 0, "a", 12), (3, 2, "c", 13)]
    r.by_key["j"] = [(5, 1, "e", 10), (4, 0, "d", 11)]
    assert r.order_violations(8) == 1


def test_a_create_acknowledged_after_a_later_due_delivery_is_not_a_violation() -> None:
    tally = Tally()
    r = Receiver(tally)
    # d (due 4) was acknowledged at 20, after e (due 5) was emitted at 10: the scheduler
    # could not have held e back for it. g (due 6) was acknowledged at 5, before h (due 7)
    # was emitted at 10: delivering it after h breaks order.
    tally.acked_ms.update({"d": 20, "e": 1, "g": 5, "h": 1})
    r.by_key["j"] = [(5, 1, "e", 10), (4, 0, "d", 21)]
    r.by_key["m"] = [(7, 1, "h", 10), (6, 0, "g", 11)]
    assert (r.order_violations(8), r.late_creates_out_of_order(8)) == (1, 1)


def test_an_order_violation_is_reported_with_the_triggers_delivered_before_it() -> None:
    tally = Tally()
    r = Receiver(tally)
    tally.acked_ms.update({"x": 5, "y": 6, "z": 7})
    # x (due 100) first reached the receiver after y (due 110), but before z (due 90,
    # itself after both): x came after y, z after y and x.
    r.by_key["k"] = [(110, 1, "y", 60), (100, 0, "x", 50), (90, 2, "z", 40)]
    y, x, z = ids_on_partition("s-", 3, 8, 3)
    r.first_2xx.update({"y": (y, 1, 61), "x": (x, 1, 70), "z": (z, 2, 80)})
    bad, across, late = r._violations(8)
    assert (across, late) == ([], 0)
    assert bad == [
        f"key k: x ({x}, partition 3) due 100 emitted 50 attempt 1 2xx 70 acked 5 after "
        f"y ({y}, partition 3) due 110 emitted 60 attempt 1 2xx 61",
        f"key k: z ({z}, partition 3) due 90 emitted 40 attempt 2 2xx 80 acked 7 after "
        f"y ({y}, partition 3) due 110 emitted 60 attempt 1 2xx 61; "
        f"x ({x}, partition 3) due 100 emitted 50 attempt 1 2xx 70",
    ]
    assert r.order_figures(8) == {
        "order_violations": 2,
        "order_across_partitions": 0,
        "late_creates_out_of_order": 0,
    }


def out_of_order_pair(first_sid: str, second_sid: str) -> Receiver:
    """A receiver that saw, on key k, a trigger of ``first_sid`` due 110 and then one of
    ``second_sid`` due 100, both acknowledged before either was emitted."""
    tally = Tally()
    r = Receiver(tally)
    tally.acked_ms.update({"late": 1, "early": 1})
    r.by_key["k"] = [(110, 1, "late", 60), (100, 0, "early", 50)]
    r.first_2xx.update({"late": (first_sid, 1, 61), "early": (second_sid, 1, 70)})
    return r


def test_out_of_order_within_one_commands_partition_is_a_violation_and_fails_the_run(
    capsys: Any,
) -> None:
    a, b = ids_on_partition("same-", 5, 8, 2)
    figures = out_of_order_pair(a, b).order_figures(8)
    assert (figures["order_violations"], figures["order_across_partitions"]) == (1, 0)
    assert "order violation (same commands partition): key k: early" in capsys.readouterr().out
    v = verdict([clean("broker_hang", **figures)])
    assert not v.ok
    assert "RESULT chaos_order_violations=1 deliveries" in v.result_lines()
    assert "RESULT chaos_order_across_partitions=0 deliveries" in v.result_lines()


def test_out_of_order_across_commands_partitions_is_counted_apart_and_passes(
    capsys: Any,
) -> None:
    (a,) = ids_on_partition("one-", 1, 8, 1)
    (b,) = ids_on_partition("other-", 6, 8, 1)
    figures = out_of_order_pair(a, b).order_figures(8)
    assert (figures["order_violations"], figures["order_across_partitions"]) == (0, 1)
    said = capsys.readouterr().out
    assert "order across commands partitions (not a violation): key k: early" in said
    assert f"({a}, partition 1)" in said and f"({b}, partition 6)" in said
    v = verdict([clean("broker_hang", **figures), clean("kafka_quorum", **figures)])
    assert v.ok and not v.breaches
    assert (v.order_violations, v.order_across_partitions) == (0, 2)
    assert "RESULT chaos_order_across_partitions=2 deliveries" in v.result_lines()


def test_a_trigger_of_unknown_schedule_out_of_order_counts_as_a_violation() -> None:
    (a,) = ids_on_partition("one-", 1, 8, 1)
    r = out_of_order_pair(a, "")  # no schedule id header: nothing shows another partition
    assert (r.order_violations(8), r.order_across_partitions(8)) == (1, 0)


def test_runs_of_one_recurring_schedule_are_one_commands_partition() -> None:
    # A schedule whose run ids, hashed as they are, land on different partitions: the
    # runs are its schedule's, fired by its partition's ticker.
    sid = next(
        f"rec-{i}"
        for i in range(1_000)
        if len({partition_for(f"rec-{i}@{n}", 8) for n in (1_000, 2_000)}) == 2
    )
    r = out_of_order_pair(f"{sid}@2000", f"{sid}@1000")
    assert (r.order_violations(8), r.order_across_partitions(8)) == (1, 0)


def test_spread() -> None:
    assert spread(4, 100, 40) == [100, 110, 120, 130]


def test_padded_payload_has_the_exact_size_and_keeps_key_and_seq() -> None:
    for size in (65_536, 65_537, 51_200, 100):
        body = padded_payload("k3", 17, size)
        assert len(body) == size
        doc = orjson.loads(body)
        assert (doc["k"], doc["seq"]) == ("k3", 17)
    assert padded_payload("k3", 17) == b'{"k":"k3","seq":17}'  # no size: the bare payload
    big = padded_payload("k3", 17, 65_536)
    assert len(zlib.compress(big)) > 40_000  # incompressible: lz4 cannot shrink it away
    assert padded_payload("k3", 17, 65_536) == big  # pure


def test_ids_on_partition() -> None:
    ids = ids_on_partition("hc-", 5, 8, 20)
    assert len(set(ids)) == 20
    assert {partition_for(i, 8) for i in ids} == {5}


def test_lateness_counts_seen_acknowledged_triggers_only() -> None:
    t = Tally()
    t.expect("a", 1_000)
    t.expect("b", 2_000)
    t.saw("a", 1_300)
    t.saw("a", 1_100)  # the first sighting counts
    t.saw("c", 9_000)  # never acknowledged
    assert lateness_ms(t, ["a", "b", "c"]) == [100]


# -- recurring runs


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp() * 1000)


def test_a_rate_rule_expects_its_runs_from_the_acknowledgement_to_the_end_of_the_check() -> None:
    rule = RunRule(start_ms=10_000, until_ms=20_000, every_s=3)
    assert rule.runs(acked_ms=12_500) == [13_000, 16_000, 19_000]
    assert rule.runs(acked_ms=13_000) == [13_000, 16_000, 19_000]  # a run at the ack counts
    assert rule.runs(acked_ms=2_000) == [10_000, 13_000, 16_000, 19_000]  # from the start
    assert RunRule(start_ms=10_000, until_ms=19_000, every_s=3).runs(0)[-1] == 19_000


def test_a_cron_rule_runs_by_the_local_hour_of_its_zone() -> None:
    # 10:14:50 UTC is 15:59:50 in Kathmandu (UTC+05:45); its hour 16 begins at 10:15 UTC.
    lo, hi = ms("2026-11-27T10:14:50"), ms("2026-11-27T10:15:10")
    only_15 = RunRule(lo, hi, 4, CRON_ZONE, (15,))
    assert only_15.runs(lo) == [ms("2026-11-27T10:14:52"), ms("2026-11-27T10:14:56")]
    both = replace(only_15, hours=local_hours(CRON_ZONE, lo, hi))
    assert both.hours == (15, 16)
    assert [t - lo for t in both.runs(lo)] == [2_000, 6_000, 10_000, 14_000, 18_000]


def test_the_suite_expects_exactly_the_runs_the_product_schedules() -> None:
    start = ms("2026-11-27T10:14:03.250")
    for rule in recurring_rules(start, start + 110_000):
        rec = rule.recurrence()
        for acked in (start - 4_000, start + 7_777):
            product = []
            for t in occurrences(rec, first_run(rec, acked), anchor_ms=acked):
                if t > rule.until_ms:
                    break
                product.append(t)
            assert rule.runs(acked) == product and product, rule


def test_a_cron_rule_read_in_utc_would_run_never() -> None:
    # The zone is UTC+05:45: a worker that ignored it would fire no cron run at all.
    start = ms("2026-11-27T10:14:03")
    (cron,) = [r for r in recurring_rules(start, start + 110_000) if r.zone]
    rec = replace(cron.recurrence(), time_zone="UTC")
    assert next(occurrences(rec, start, anchor_ms=start)) > cron.until_ms
    assert cron.runs(start)


def test_runs_per_s() -> None:
    assert runs_per_s(recurring_rules(0, 1)) == 1 / 2 + 1 / 3 + 1 / 5 + 1 / 4


def report_of(t: Tally) -> dict[str, Any]:
    return {"scenario": "x", **t.figures(), "codes": {"ok": 4, "unanswered": 0}}


def test_a_missing_run_is_lost_and_fails_the_run() -> None:
    t = Tally()
    rule = RunRule(start_ms=10_000, until_ms=20_000, every_s=2)
    assert expect_runs(t, "ten", "rec-1", rule, acked_ms=9_000) == 6
    for nominal in (10_000, 12_000, 14_000, 18_000, 20_000):  # 16_000 never comes
        t.saw(trigger_id("ten", f"rec-1@{nominal}", nominal), nominal + 30)
    f = t.figures()
    assert (f["lost"], f["recurring_runs"], f["recurring_runs_lost"]) == (1, 6, 1)
    assert t.missing() == {trigger_id("ten", "rec-1@16000", 16_000)}
    v = verdict([report_of(t)])
    assert not v.ok and v.lost == 1 and v.breaches == ("x: lost=1",)


def test_a_run_under_another_trigger_id_is_lost() -> None:
    t = Tally()
    expect_runs(t, "ten", "rec-1", RunRule(10_000, 10_000, 2), acked_ms=0)
    t.saw(trigger_id("ten", "rec-1", 10_000), 10_010)  # the parent's id, not the run's
    t.saw(trigger_id("ten", "rec-1@10000", 10_001), 10_010)  # another due time
    assert t.figures()["recurring_runs_lost"] == 1 and not verdict([report_of(t)]).ok


def test_run_duplicates_count_against_the_bound_and_an_early_run_fails() -> None:
    t = Tally()
    expect_runs(t, "ten", "rec-1", RunRule(10_000, 12_000, 2), acked_ms=0)
    t.saw(trigger_id("ten", "rec-1@10000", 10_000), 10_000)
    t.saw(trigger_id("ten", "rec-1@10000", 10_000), 10_500)
    t.saw(trigger_id("ten", "rec-1@12000", 12_000), 11_999)  # 1 ms early
    f = t.figures()
    assert (f["duplicated"], f["recurring_runs_duplicated"], f["early"]) == (1, 1, 1)
    v = verdict([{**report_of(t), "early": 0, "duplicate_bound": 1}])
    assert v.ok  # one duplicate within a bound of one
    assert verdict([{**report_of(t), "early": 0}]).duplicate_bound_breaches == 1
    assert verdict([report_of(t) | {"duplicate_bound": 1}]).early == 1


def test_runs_of_one_recurring_schedule_are_told_apart_by_trigger_id_in_the_order_check() -> None:
    tally = Tally()
    r = Receiver(tally)
    tally.acked_ms.update({"r1": 1, "r2": 1, "r3": 1})
    # The runs of one schedule share its key and payload (the same seq): a later run
    # delivered before an earlier one breaks order; a run delivered again does not.
    r.by_key["rec"] = [(2_000, 0, "r2", 2_000), (1_000, 0, "r1", 2_001), (2_000, 0, "r2", 2_500)]
    r.by_key["fine"] = [(1_000, 0, "r1", 1_000), (2_000, 0, "r2", 2_000), (1_000, 0, "r1", 2_100)]
    assert r.order_violations(8) == 1

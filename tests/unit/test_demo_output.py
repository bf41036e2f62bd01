"""The demo's terminal output: readable from the first line, and the README shows its shape."""

from __future__ import annotations

import argparse
import re

from streams.cli import register
from streams.demo import progress_line, summary_lines
from tocsin.settings import REPO_ROOT


def _readme_summary() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"```\n(\[demo\] summary\n.*?)```", text, re.DOTALL)
    assert block, "README has no demo summary block"
    return block.group(1).rstrip("\n").split("\n")


def _shape(line: str) -> str:
    return re.sub(r"-?\d+", "N", line)


def test_progress_before_any_fire_says_no_value_not_nan() -> None:
    line = progress_line(0, 0, 0, 3000, [])
    assert "nan" not in line and "p50 - ms" in line


def test_readme_sample_has_the_summary_shape_and_the_demo_default_count() -> None:
    sample = _readme_summary()
    produced = summary_lines(
        count=3000, accepted=3000, rejected=0, fired=3000, duplicates=0, lateness=[1, 2, 30],
        delivered=3000, duplicate_deliveries=0, delivery_lateness=[50, 60, 110],
    )
    assert [_shape(x) for x in sample] == [_shape(x) for x in produced]
    # The count the sample shows is the one `make run` schedules.
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    count = parser.parse_args(["demo"]).count
    assert f"scheduled  {count} " in sample[1]

"""The demo's terminal output: readable from the first line, and the README shows its shape."""

from __future__ import annotations

import argparse
import re

import pytest

from base.settings import REPO_ROOT
from tocsin.demo import progress_line, summary_lines
from tocsin.scheduler_cli import register


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
        count=3000,
        accepted=3000,
        rejected=0,
        fired=3000,
        duplicates=0,
        lateness=[1, 2, 30],
        delivered=3000,
        duplicate_deliveries=0,
        delivery_lateness=[50, 60, 110],
    )
    assert [_shape(x) for x in sample] == [_shape(x) for x in produced]
    # The count the sample shows is the one `make run` schedules.
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    count = parser.parse_args(["demo"]).count
    assert f"scheduled  {count} " in sample[1]


def test_the_dev_receiver_prints_each_call_on_any_path(capsys: pytest.CaptureFixture[str]) -> None:
    import socket
    import urllib.request

    from tocsin.demo import Receiver

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    receiver = Receiver(port, echo=True)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/my/hook?x=1",
            data=b'{"hello":"world"}',
            method="POST",
            headers={"Tocsin-Trigger-Id": "t1", "Tocsin-Schedule-Id": "s1", "Tocsin-Tenant": "me"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 204
    finally:
        receiver.close()
    out = capsys.readouterr().out
    assert "POST /my/hook?x=1  tenant me  schedule s1  trigger t1" in out
    assert 'payload {"hello":"world"}' in out
    assert receiver.arrivals.keys() == {"t1"}

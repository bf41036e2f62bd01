"""Small hooks for fault injection: a shared jar cache, a skewed worker
clock, and a state-folder check that leaves nothing behind when the disk is full."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from base.errors import InfraError
from base.settings import Settings
from streams.app import skewed_clock
from tocsin.infra import Stack, resolve_jars


def test_jars_dir_and_clock_skew_settings(tmp_path: Path) -> None:
    s = Settings.from_env(
        {
            "TOCSIN_STATE_DIR": str(tmp_path / "st"),
            "TOCSIN_JARS_DIR": str(tmp_path / "jars"),
            "TOCSIN_CLOCK_SKEW_MS": "-2000",
        }
    )
    assert s.stack.jars_dir == tmp_path / "jars"
    assert s.scheduler.clock_skew_ms == -2000
    d = Settings.from_env({})
    assert d.stack.jars_dir is None and d.scheduler.clock_skew_ms == 0


def test_resolve_jars_uses_the_shared_cache(tmp_path: Path) -> None:
    shared = tmp_path / "jars"
    # A completed cache entry under jars_dir is used as it is (no Maven run).
    import hashlib

    from tocsin.infra import INFRA_DIR

    digest = hashlib.sha256((INFRA_DIR / "kafka" / "pom.xml").read_bytes()).hexdigest()[:12]
    target = shared / f"kafka-{digest}"
    target.mkdir(parents=True)
    (target / ".complete").write_text("ok")
    assert resolve_jars("kafka", tmp_path / "state", shared) == target
    assert not (tmp_path / "state").exists()


def test_skewed_clock_runs_ahead() -> None:
    plain, fast = skewed_clock(0), skewed_clock(2_000)
    assert 1_990 <= fast() - plain() <= 2_100


def test_full_disk_leaves_no_probe_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    real_write = Path.write_bytes

    def enospc(self: Path, data: bytes) -> int:
        real_write(self, data[:10])  # the file is created, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", enospc)
    stack = Stack(Settings.from_env({"TOCSIN_STATE_DIR": str(state)}))
    with pytest.raises(InfraError, match=r"not writable.*No space left"):
        stack._check_state_dir()
    assert list(state.iterdir()) == []

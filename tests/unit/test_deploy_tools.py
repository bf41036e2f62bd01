"""tools/install-deploy-tools.sh without Go: a developer's machine skips the deploy checks
with a message, CI (CI=true) fails. Nothing is built or downloaded here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from base.settings import REPO_ROOT

INSTALLER = REPO_ROOT / "tools" / "install-deploy-tools.sh"
# What the installer runs before it would need Go.
COMMANDS = ("dirname", "mkdir", "cat", "rm", "mktemp")


def run_without_go(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    for name in COMMANDS:
        found = shutil.which(name)
        assert found is not None, name
        (bin_dir / name).symlink_to(found)
    bash = shutil.which("bash")
    assert bash is not None
    base = {
        "PATH": str(bin_dir),
        "GOBIN": str(tmp_path / "gobin"),  # empty: no tool is installed
        "TOCSIN_K8S_SCHEMAS": str(tmp_path / "schemas"),
        "HOME": str(tmp_path),
    }
    return subprocess.run(
        [bash, str(INSTALLER)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(os.name != "posix", reason="the installer is a bash script")
def test_without_go_a_local_run_skips_the_deploy_checks_and_says_so(tmp_path: Path) -> None:
    out = run_without_go(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "SKIPPED" in out.stderr and "Go" in out.stderr and "CI runs them" in out.stderr
    assert not list((tmp_path / "gobin").iterdir())  # nothing was attempted


@pytest.mark.skipif(os.name != "posix", reason="the installer is a bash script")
def test_without_go_ci_fails(tmp_path: Path) -> None:
    out = run_without_go(tmp_path, CI="true")
    assert out.returncode == 1
    assert "Go toolchain (go) is not on PATH" in out.stderr

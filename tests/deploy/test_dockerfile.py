"""Static checks of the Dockerfile (no Docker engine runs here or in CI, so it is never
built by the tests): one slim, multi-stage, non-root image for every role, installed with
constraints.txt, whose COPY sources exist and are not excluded by .dockerignore."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from .conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORE = [
    line.strip()
    for line in (ROOT / ".dockerignore").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def ignored(path: str) -> bool:
    return any(
        fnmatch.fnmatch(path, p.rstrip("/")) or fnmatch.fnmatch(path, p.lstrip("*/"))
        for p in IGNORE
    )


def test_multi_stage_from_slim_python_311() -> None:
    froms = [args for op, args in instructions() if op == "FROM"]
    assert len(froms) >= 2
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", DOCKERFILE, re.MULTILINE)
    assert all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    assert froms[-1].endswith("AS runtime")
    assert any(op == "COPY" and args.startswith("--from=build") for op, args in instructions())


def test_runs_as_a_numeric_non_root_user_with_the_tocsin_entrypoint() -> None:
    ops = instructions()
    runtime = ops[max(i for i, (op, _) in enumerate(ops) if op == "FROM") :]
    users = [args for op, args in runtime if op == "USER"]
    assert users, "the runtime stage must switch to an unprivileged user"
    args = dict(re.findall(r"^ARG (TOCSIN_[UG]ID)=(\d+)$", DOCKERFILE, re.MULTILINE))
    uid = users[-1].split(":")[0].replace("${TOCSIN_UID}", args["TOCSIN_UID"])
    assert uid.isdigit() and int(uid) != 0
    entry = [json.loads(a) for op, a in runtime if op == "ENTRYPOINT"]
    assert entry == [["tocsin"]]  # exec form: tocsin is PID 1 and gets SIGTERM
    assert not any(op == "HEALTHCHECK" for op, _ in ops)  # Kubernetes probes instead
    assert "TOCSIN_STATE_DIR=/var/lib/tocsin" in DOCKERFILE


def test_installs_with_the_constraints_file_and_only_runtime_dependencies() -> None:
    runs = [args for op, args in instructions() if op == "RUN" and "pip install" in args]
    assert runs and all("-c constraints.txt" in r for r in runs)
    assert not any(".[dev]" in r or "-e " in r for r in runs)


def test_copies_every_package_and_nothing_ignored() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # A subpackage (api.console) travels inside its top-level package's folder.
    packages = {name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]}
    sources: list[str] = []
    for op, args in instructions():
        if op == "COPY" and not args.startswith("--from"):
            sources += args.split()[:-1]
    copied = {s.rstrip("/") for s in sources}
    assert packages <= copied, f"packages not copied into the image: {packages - copied}"
    for s in copied:
        assert (ROOT / s).exists(), s
        assert not ignored(s), f"{s} is copied but excluded by .dockerignore"
    assert project["project"]["readme"] in copied  # setuptools reads it at build time
    for heavy in (".state", ".venv", ".git"):
        assert ignored(heavy), heavy

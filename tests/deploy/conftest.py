"""Fixtures of the deploy checks: the pinned helm, kubeconform and yq, and rendering.

The tools live in .state/bin, installed by tools/install-deploy-tools.sh (`make
deploy-tools`, which `make test` runs first). A missing tool fails the run in CI
(CI=true) and skips these tests elsewhere, with the command that installs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tocsin"
PROD_VALUES = CHART / "values-production.yaml"
INSTALLER = ROOT / "tools" / "install-deploy-tools.sh"
BIN = Path(os.environ.get("GOBIN") or ROOT / ".state" / "bin")
SCHEMAS = Path(os.environ.get("TOCSIN_K8S_SCHEMAS") or ROOT / ".state" / "k8s-schemas")
RELEASE = "tocsin"
NAMESPACE = "scheduling"


def pins() -> dict[str, str]:
    """The pinned versions, read from the installer (the one place they are written)."""
    text = INSTALLER.read_text()
    return dict(re.findall(r'^([A-Z0-9_]+)="([^"]*)"$', text, re.MULTILINE))


def _missing(what: str) -> None:
    hint = f"{what} is missing: run `make deploy-tools` (tools/install-deploy-tools.sh)"
    if shutil.which("go") is None:
        hint += "; it builds them with Go, which is not on PATH (CI runs these checks)"
    if os.environ.get("CI") == "true":
        pytest.fail(hint)
    pytest.skip(hint)


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubeconform: Path
    yq: Path
    schemas: Path
    k8s_versions: tuple[str, ...]


@pytest.fixture(scope="session")
def tools() -> Tools:
    found = {name: BIN / name for name in ("helm", "kubeconform", "yq")}
    for name, path in found.items():
        if not os.access(path, os.X_OK):
            _missing(f"{path} ({name})")
    versions = tuple(pins()["K8S_SCHEMA_VERSIONS"].split())
    for v in versions:
        if not (SCHEMAS / f"{v}-strict" / "deployment-apps-v1.json").is_file():
            _missing(f"the Kubernetes {v} JSON schemas under {SCHEMAS}")
    return Tools(found["helm"], found["kubeconform"], found["yq"], SCHEMAS, versions)


def run(
    args: Iterable[str | Path], *, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Rendered:
    """One `helm template` output: the YAML text and its documents as dicts."""

    def __init__(self, text: str, docs: list[dict[str, Any]]) -> None:
        self.text = text
        self.docs = docs

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("kind") == kind]

    def one(self, kind: str, name_suffix: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind("Deployment") + self.of_kind("Job")


def helm_template(
    tools: Tools, *args: str, kube_version: str | None = None
) -> subprocess.CompletedProcess[str]:
    cmd: list[str | Path] = [tools.helm, "template", RELEASE, CHART, "--namespace", NAMESPACE]
    if kube_version:
        cmd += ["--kube-version", kube_version.lstrip("v")]
    return run([*cmd, *args])


def to_docs(tools: Tools, text: str) -> list[dict[str, Any]]:
    """YAML stream -> JSON documents (one per line, by yq), skipping empty documents."""
    out = run([tools.yq, "-o=json", "-I=0", "."], stdin=text)
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [d for d in docs if d]


@pytest.fixture(scope="session")
def render(tools: Tools) -> Callable[..., Rendered]:
    cache: dict[tuple[str, ...], Rendered] = {}

    def _render(*args: str, kube_version: str | None = None) -> Rendered:
        key = (*args, kube_version or "")
        if key not in cache:
            out = helm_template(tools, *args, kube_version=kube_version)
            assert out.returncode == 0, f"helm template {' '.join(args)} failed:\n{out.stderr}"
            cache[key] = Rendered(out.stdout, to_docs(tools, out.stdout))
        return cache[key]

    return _render


# The scenarios every property test runs on: the defaults, the production example, and
# inline credentials (chart-made hook Secrets) with Kafka mTLS and a generic-mode proxy.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "default": (),
    "production": ("-f", str(PROD_VALUES)),
    "inline-secrets": (
        "--set",
        "kafka.securityProtocol=SASL_SSL",
        "--set",
        "kafka.sasl.username=svc-tocsin",
        "--set",
        "kafka.sasl.password=not-a-real-password",
        "--set",
        "kafka.tls.enabled=true",
        "--set",
        "kafka.tls.existingSecret=kafka-client-tls",
        "--set",
        "kafka.tls.certKey=tls.crt",
        "--set",
        "kafka.tls.keyKey=tls.key",
        "--set",
        "cassandra.auth.username=tocsin",
        "--set",
        "cassandra.auth.password=not-a-real-password",
        "--set",
        "setup.tenants={acme,beta.corp}",
        "--set",
        "proxy.mode=generic",
        "--set",
        r"proxy.sourceTopic=orders\,payments",
        "--set",
        "proxy.endpointUrl=http://receiver.apps.svc:8080/hook",
        "--set",
        "proxy.autoscaling.enabled=false",
        "--set",
        "api.metrics.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "grafanaDashboard.enabled=true",
    ),
}


@pytest.fixture(params=sorted(SCENARIOS), scope="session")
def scenario(request: pytest.FixtureRequest, render: Callable[..., Rendered]) -> Rendered:
    return render(*SCENARIOS[request.param])

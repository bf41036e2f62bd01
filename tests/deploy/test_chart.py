"""The Helm chart (helm/tocsin): lint, schema validation and the properties that matter.

Rendering succeeding proves little, so besides `helm lint` and kubeconform (strict
Kubernetes schemas of the chart's minimum and newest supported versions) these tests
check what an operator relies on: probes on the real health endpoints, resources,
non-root pods, the setup hook, grace periods matching the shutdown paths, PDBs, HPAs, and
that every TOCSIN_* variable the chart sets is one the code reads and parses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from base.errors import ConfigError
from base.settings import ApiSettings, SchedulerSettings, Settings
from proxy.settings import ProxySettings
from tocsin.settings_doc import names_read_by_code

from .conftest import CHART, PROD_VALUES, ROOT, SCENARIOS, Rendered, Tools, helm_template, pins, run

CRD_KINDS = {"ServiceMonitor"}  # monitoring.coreos.com: no schema in the Kubernetes set


# ------------------------------------------------------------------------ helpers


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def literal_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the process would see it (secrets as placeholders)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = f"<secret {ref['name']}/{ref['key']}>"
    return env


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def code_setting_names() -> set[str]:
    """Every TOCSIN_* variable the code reads through the settings helpers."""
    return names_read_by_code(ROOT)


def kubeconform(tools: Tools, text: str, version: str) -> None:
    """Strict validation; CRD documents (no schema here) checked apart, and only those skipped."""
    docs = [d for d in re.split(r"^---\s*$", text, flags=re.MULTILINE) if d.strip()]
    is_crd = [
        bool(re.search(rf"^kind:\s*({'|'.join(CRD_KINDS)})\s*$", d, re.MULTILINE)) for d in docs
    ]
    location = str(tools.schemas) + (
        "/{{ .NormalizedKubernetesVersion }}-strict/{{ .ResourceKind }}{{ .KindSuffix }}.json"
    )
    base = [
        tools.kubeconform,
        "-strict",
        "-summary",
        "-kubernetes-version",
        version.lstrip("v"),
        "-schema-location",
        location,
    ]
    core = "\n---\n".join(d for d, crd in zip(docs, is_crd, strict=True) if not crd)
    out = run([*base, "-"], stdin=core)
    assert out.returncode == 0, f"kubeconform {version}:\n{out.stdout}{out.stderr}"
    assert "Invalid: 0, Errors: 0, Skipped: 0" in out.stdout, out.stdout
    crds = [d for d, crd in zip(docs, is_crd, strict=True) if crd]
    if crds:
        out = run([*base, "-ignore-missing-schemas", "-"], stdin="\n---\n".join(crds))
        assert out.returncode == 0, f"kubeconform {version} (CRDs):\n{out.stdout}{out.stderr}"
        assert f"Skipped: {len(crds)}" in out.stdout, out.stdout


# ------------------------------------------------------------- tools and validation


def test_tools_are_the_pinned_versions(tools: Tools) -> None:
    p = pins()
    helm = run([tools.helm, "version", "--short"])
    assert helm.stdout.startswith(p["HELM_VERSION"]), helm.stdout
    kc = run([tools.kubeconform, "-v"])
    assert kc.stdout.strip() == p["KUBECONFORM_VERSION"], kc.stdout
    # helm built with its Makefile's Kubernetes version (not the 1.20 fallback).
    caps = run([tools.helm, "template", "x", str(CHART), "--show-only", "templates/NOTES.txt"])
    assert "1.20" not in caps.stderr


@pytest.mark.parametrize("values", ["default", "production"])
def test_helm_lint_strict(tools: Tools, values: str) -> None:
    extra = ["-f", str(PROD_VALUES)] if values == "production" else []
    out = run([tools.helm, "lint", "--strict", str(CHART), *extra])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rendered_manifests_pass_kubeconform(
    tools: Tools, render: Callable[..., Rendered], name: str
) -> None:
    for version in tools.k8s_versions:
        rendered = render(*SCENARIOS[name], kube_version=version)
        kubeconform(tools, rendered.text, version)


def test_kubeconform_rejects_an_invalid_manifest(
    tools: Tools, render: Callable[..., Rendered]
) -> None:
    """The validation really bites: an unknown field in a container is an error."""
    text = render().text.replace('args: ["worker"]', 'args: ["worker"]\n          bogusField: 1', 1)
    with pytest.raises(AssertionError, match="bogusField"):
        kubeconform(tools, text, tools.k8s_versions[0])


# ------------------------------------------------------------------ pod properties


def test_every_long_running_container_probes_the_real_health_endpoints(scenario: Rendered) -> None:
    deployments = scenario.of_kind("Deployment")
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in deployments} == {
        "worker",
        "proxy",
        "api",
    }
    for d in deployments:
        for c in containers(d):
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe, path in (
                ("startupProbe", "/healthz"),
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
            ):
                get = c[probe]["httpGet"]
                assert get["path"] == path, (d["metadata"]["name"], probe)
                assert get["port"] in ports, (d["metadata"]["name"], probe, get["port"])
            assert (
                c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] >= 20
            )


def test_health_ports_are_the_ones_the_code_serves_on(scenario: Rendered) -> None:
    for role, setting in (
        ("worker", "TOCSIN_METRICS_PORT"),
        ("proxy", "TOCSIN_PROXY_METRICS_PORT"),
        ("api", "TOCSIN_API_PORT"),
    ):
        c = containers(scenario.one("Deployment", f"-{role}"))[0]
        port = int(literal_env(c)[setting])
        assert port in {p["containerPort"] for p in c["ports"]}, (role, port)


def test_default_ports_and_timeouts_match_the_code_defaults(
    render: Callable[..., Rendered],
) -> None:
    rendered = render()
    worker = literal_env(containers(rendered.one("Deployment", "-worker"))[0])
    proxy = literal_env(containers(rendered.one("Deployment", "-proxy"))[0])
    # The chart's scheduler defaults are the code's (no silent drift between the two).
    assert Settings.from_env(worker).scheduler == SchedulerSettings()
    code = ProxySettings()
    chart = ProxySettings.from_env(proxy)
    assert (chart.metrics_port, chart.shutdown_timeout_s, chart.concurrency) == (
        code.metrics_port,
        code.shutdown_timeout_s,
        code.concurrency,
    )
    assert (chart.max_pending_messages, chart.max_pending_bytes) == (
        code.max_pending_messages,
        code.max_pending_bytes,
    )
    assert chart.allow_private_targets is code.allow_private_targets  # SSRF guard stays on
    api = Settings.from_env(literal_env(containers(rendered.one("Deployment", "-api"))[0])).api
    assert api.port == ApiSettings().port
    assert api.host == "0.0.0.0"  # reachable by the kubelet's probes and the Service


def test_every_container_has_resources(scenario: Rendered) -> None:
    for d in scenario.workloads():
        for c in containers(d):
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), d["metadata"]["name"]
            assert "memory" in res["limits"], d["metadata"]["name"]


def test_pods_run_as_non_root_with_a_read_only_root(scenario: Rendered) -> None:
    for d in scenario.workloads():
        name = d["metadata"]["name"]
        spec = pod_spec(d)
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True, name
        assert psc["runAsUser"] != 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for c in containers(d):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert "ALL" in sc["capabilities"]["drop"], name
            # ... and so the only writable places are mounted volumes.
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/var/lib/tocsin"} <= mounts, name
            assert literal_env(c)["TOCSIN_STATE_DIR"] == "/var/lib/tocsin", name


def test_grace_periods_cover_the_graceful_shutdown_paths(
    scenario: Rendered, render: Callable[..., Rendered]
) -> None:
    worker = pod_spec(scenario.one("Deployment", "-worker"))
    # Worker: stop tickers (in-flight triggers, checkpoints), flush, leave the group: ~30 s.
    assert worker["terminationGracePeriodSeconds"] >= 40
    proxy_doc = scenario.one("Deployment", "-proxy")
    proxy = ProxySettings.from_env(literal_env(containers(proxy_doc)[0]))
    # Proxy: running attempts get shutdown_timeout_s, then flush + commit + leave.
    assert pod_spec(proxy_doc)["terminationGracePeriodSeconds"] >= proxy.shutdown_timeout_s + 10
    api = pod_spec(scenario.one("Deployment", "-api"))
    pre_stop = containers(scenario.one("Deployment", "-api"))[0]["lifecycle"]["preStop"]
    assert api["terminationGracePeriodSeconds"] > int(pre_stop["exec"]["command"][1]) + 10
    # The proxy's grace period follows its shutdown timeout.
    longer = render("--set", "proxy.shutdownTimeoutS=50")
    assert pod_spec(longer.one("Deployment", "-proxy"))["terminationGracePeriodSeconds"] == 65


# --------------------------------------------------------------------- environment


def test_every_tocsin_variable_is_one_the_code_reads(scenario: Rendered) -> None:
    known = code_setting_names()
    assert "TOCSIN_KAFKA_BOOTSTRAP_SERVERS" in known and "TOCSIN_PROXY_MODE" in known
    for d in scenario.workloads():
        for c in containers(d):
            unknown = {n for n in literal_env(c) if n.startswith("TOCSIN_")} - known
            assert not unknown, f"{d['metadata']['name']}: {sorted(unknown)} are read by no code"


def test_environment_parses_into_settings(scenario: Rendered) -> None:
    for d in scenario.workloads():
        for c in containers(d):
            env = literal_env(c)
            try:
                settings = Settings.from_env(env)
                if c["name"] == "proxy":
                    ProxySettings.from_env(env)
            except ConfigError as exc:  # e.g. a number rendered as 6.7108864e+07
                pytest.fail(f"{d['metadata']['name']}: {exc}")
            assert settings.topics.command_partitions >= 1
            for key in ("SSL_CA_LOCATION", "SSL_CERTIFICATE_LOCATION", "SSL_KEY_LOCATION"):
                for system in ("KAFKA", "CASSANDRA"):
                    path = env.get(f"TOCSIN_{system}_{key}")
                    if path:  # every TLS file lives in a mounted Secret volume
                        mounts = [m["mountPath"] for m in c["volumeMounts"]]
                        assert any(path.startswith(m + "/") for m in mounts), path


def test_production_values_use_existing_secrets(render: Callable[..., Rendered]) -> None:
    rendered = render("-f", str(PROD_VALUES))
    assert rendered.of_kind("Secret") == []  # nothing secret in the release itself
    env = {e["name"]: e for e in containers(rendered.one("Deployment", "-worker"))[0]["env"]}
    assert env["TOCSIN_KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
    assert (
        env["TOCSIN_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]
        == "tocsin-kafka-sasl"
    )
    assert (
        env["TOCSIN_CASSANDRA_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]
        == "tocsin-cassandra-auth"
    )
    settings = Settings.from_env(literal_env(containers(rendered.one("Deployment", "-worker"))[0]))
    assert settings.cassandra.replication_cql().startswith("{'class': 'NetworkTopologyStrategy'")
    assert settings.cassandra.ssl_ca_location == "/etc/tocsin/cassandra-tls/ca.crt"


def test_inline_credentials_become_hook_secrets_created_before_the_setup_job(
    render: Callable[..., Rendered],
) -> None:
    rendered = render(*SCENARIOS["inline-secrets"])
    secrets = rendered.of_kind("Secret")
    assert len(secrets) == 2
    job = rendered.one("Job", "-setup")
    job_weight = int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
    for s in secrets:
        ann = s["metadata"]["annotations"]
        assert "pre-install" in ann["helm.sh/hook"] and "pre-upgrade" in ann["helm.sh/hook"]
        assert int(ann["helm.sh/hook-weight"]) < job_weight
    names = {s["metadata"]["name"] for s in secrets}
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in containers(job)[0]["env"]
        if "valueFrom" in e
    }
    assert refs == names


# ---------------------------------------------------------------------- setup hook


def test_setup_job_is_a_pre_install_and_pre_upgrade_hook(scenario: Rendered) -> None:
    job = scenario.one("Job", "-setup")
    ann = job["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in ann["helm.sh/hook-delete-policy"].split(",")
    spec = job["spec"]
    assert spec["backoffLimit"] >= 1 and spec["activeDeadlineSeconds"] > 0
    assert pod_spec(job)["restartPolicy"] == "Never"
    # Same configuration as the workers: it migrates what they will use.
    worker = literal_env(containers(scenario.one("Deployment", "-worker"))[0])
    assert literal_env(containers(job)[0]) == worker


def test_setup_job_runs_setup_then_registers_the_tenants(render: Callable[..., Rendered]) -> None:
    plain = containers(render().one("Job", "-setup"))[0]
    assert plain["args"] == ["setup"] and "command" not in plain  # entrypoint: tocsin
    prod = containers(render("-f", str(PROD_VALUES)).one("Job", "-setup"))[0]
    assert prod["command"] == ["/bin/sh", "-ec"]
    script = [line.strip() for line in prod["args"][0].splitlines() if line.strip()]
    assert script == [
        "tocsin setup",
        "tocsin tenant register 'acme' --exist-ok --no-print-keys",
        "tocsin tenant register 'globex' --exist-ok --no-print-keys",
        "tocsin tenant register 'initech' --exist-ok --no-print-keys",
    ]


# --------------------------------------------------- availability and scaling


def test_every_deployment_has_a_matching_pdb(scenario: Rendered) -> None:
    pdbs = scenario.of_kind("PodDisruptionBudget")
    for d in scenario.of_kind("Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        found = [p for p in pdbs if matches(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(found) == 1, d["metadata"]["name"]
        assert found[0]["spec"]["maxUnavailable"] == 1


def test_proxy_and_api_autoscale_and_workers_never_do(scenario: Rendered) -> None:
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in scenario.of_kind("HorizontalPodAutoscaler")
    }
    worker = scenario.one("Deployment", "-worker")
    assert worker["metadata"]["name"] not in hpas
    for d in scenario.of_kind("Deployment"):
        if d["metadata"]["name"] in hpas:  # the HPA owns the replica count
            assert "replicas" not in d["spec"], d["metadata"]["name"]
    fire_partitions = int(literal_env(containers(worker)[0])["TOCSIN_FIRE_PARTITIONS"])
    for name, hpa in hpas.items():
        assert name.endswith(("-proxy", "-api")), name
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        if name.endswith("-proxy"):
            assert hpa["spec"]["maxReplicas"] <= fire_partitions


def test_worker_replicas_never_exceed_command_partitions(scenario: Rendered) -> None:
    worker = scenario.one("Deployment", "-worker")
    partitions = int(literal_env(containers(worker)[0])["TOCSIN_COMMAND_PARTITIONS"])
    assert 1 <= worker["spec"]["replicas"] <= partitions


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "worker.replicas=9"), "topics.commandPartitions (8)"),
        (("--set", "proxy.autoscaling.maxReplicas=9"), "topics.firePartitions (8)"),
        (("--set", "kafka.securityProtocol=SASL_SSL"), "kafka.sasl.existingSecret"),
        (("--set", "kafka.securityProtocol=TLS"), "kafka.securityProtocol must be"),
        (("--set", "kafka.tls.enabled=true"), "kafka.tls.existingSecret is required"),
        (("--set", "setup.tenants={bad name}"), "not a valid tenant name"),
        (("--set", "proxy.mode=generic"), "proxy.sourceTopic and proxy.endpointUrl"),
    ],
)
def test_unworkable_values_fail_at_render_time(
    tools: Tools, args: tuple[str, ...], message: str
) -> None:
    out = helm_template(tools, *args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_idle_worker_replicas_can_be_allowed_explicitly(render: Callable[..., Rendered]) -> None:
    rendered = render("--set", "worker.replicas=10", "--set", "worker.allowIdleReplicas=true")
    assert rendered.one("Deployment", "-worker")["spec"]["replicas"] == 10


# ----------------------------------------------------------- services and monitoring


def test_services_select_pods_and_name_their_ports(scenario: Rendered) -> None:
    deployments = scenario.of_kind("Deployment")
    for svc in scenario.of_kind("Service"):
        targets = [
            d
            for d in deployments
            if matches(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(targets) == 1, svc["metadata"]["name"]
        port_names = {p["name"] for c in containers(targets[0]) for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, svc["metadata"]["name"]


def test_service_monitors_are_optional_and_scrape_real_ports(
    scenario: Rendered, render: Callable[..., Rendered]
) -> None:
    assert render().of_kind("ServiceMonitor") == []
    monitors = scenario.of_kind("ServiceMonitor")
    if not monitors:
        return
    services = scenario.of_kind("Service")
    components = set()
    for sm in monitors:
        sel = sm["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if matches(sel, s["metadata"]["labels"])]
        assert chosen, sm["metadata"]["name"]
        for endpoint in sm["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in chosen)
        components.add(sel["app.kubernetes.io/component"])
    assert {"worker", "proxy"} <= components


def metric_names() -> set[str]:
    """Sample names the worker and the proxy export (from their real registries)."""
    from prometheus_client import REGISTRY

    import streams.metrics  # noqa: F401 - registers the worker's metrics
    from proxy.metrics import ProxyMetrics

    names: set[str] = set()
    for registry in (REGISTRY, ProxyMetrics().registry):
        for family in registry.collect():
            if not family.name.startswith("tocsin_"):
                continue
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count", ""],
                "gauge": [""],
            }.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


def test_dashboard_ships_in_a_labelled_configmap_and_queries_real_metrics(
    render: Callable[..., Rendered],
) -> None:
    assert render().of_kind("ConfigMap") == []  # optional, off by default
    cm = render("-f", str(PROD_VALUES)).one("ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["tocsin.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "tocsin.json").read_text())
    exprs = list(dashboard_exprs(dashboard))
    used = {m for e in exprs for m in re.findall(r"\btocsin_[a-z_]+", e)}
    unknown = used - metric_names()
    assert not unknown, f"the dashboard queries metrics nothing exports: {sorted(unknown)}"
    # What an operator watches: fire lateness, throughput, lag, dead letters, pending queue.
    for needed in (
        "tocsin_fire_lateness_seconds_bucket",
        "tocsin_triggers_emitted_total",
        "tocsin_commands_total",
        "tocsin_consumer_lag_messages",
        "tocsin_proxy_commit_lag_messages",
        "tocsin_proxy_dead_letters_total",
        "tocsin_proxy_pending_messages",
        "tocsin_proxy_deliveries_total",
    ):
        assert needed in used, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_chart_files_are_documented(tools: Tools) -> None:
    """docs/operations.md and the README name the chart, its values and the checks."""
    ops = (ROOT / "docs" / "operations.md").read_text()
    for phrase in (
        "helm/tocsin",
        "values-production.yaml",
        "commandPartitions",
        "make deploy-check",
    ):
        assert phrase in ops, phrase
    assert Path(ROOT / "README.md").read_text().count("helm/tocsin") >= 1

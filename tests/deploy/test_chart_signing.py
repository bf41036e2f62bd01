"""The chart's callback signing: the delivery secrets file comes from an existing Secret,
mounted as a directory (so a rotation reaches running proxies), its path and the required
flag reach the proxy's settings, and nothing of it is rendered without the Secret."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.settings import ProxySettings

from .conftest import Rendered, Tools, helm_template
from .test_chart import containers, literal_env, pod_spec


def proxy_container(rendered: Rendered) -> dict[str, Any]:
    (c,) = [c for c in containers(rendered.one("Deployment", "-proxy")) if c["name"] == "proxy"]
    return c


def test_no_secret_no_signing(render: Callable[..., Rendered]) -> None:
    rendered = render()
    env = literal_env(proxy_container(rendered))
    assert "TOCSIN_PROXY_SIGNING_SECRETS_FILE" not in env
    volumes = pod_spec(rendered.one("Deployment", "-proxy"))["volumes"]
    assert all(v["name"] != "callback-signing" for v in volumes)


def test_the_secrets_file_is_mounted_from_the_secret_as_a_directory(
    render: Callable[..., Rendered],
) -> None:
    rendered = render(
        "--set", "proxy.signing.existingSecret=callback-secrets",
        "--set", "proxy.signing.key=tenants.json",
        "--set", "proxy.signing.required=true",
    )  # fmt: skip
    deployment = rendered.one("Deployment", "-proxy")
    c = proxy_container(rendered)
    env = literal_env(c)
    settings = ProxySettings.from_env(env)
    assert settings.require_signature
    (volume,) = [v for v in pod_spec(deployment)["volumes"] if v["name"] == "callback-signing"]
    assert volume["secret"]["secretName"] == "callback-secrets"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "callback-signing"]
    # A subPath mount is never updated by the kubelet: rotations would need a restart.
    assert "subPath" not in mount and mount["readOnly"] is True
    assert settings.signing_secrets_file == f"{mount['mountPath']}/tenants.json"
    for other in ("-worker", "-api"):
        for d in rendered.of_kind("Deployment"):
            if d["metadata"]["name"].endswith(other):
                assert "callback-signing" not in str(pod_spec(d))


def test_required_signing_without_a_secret_fails_at_render_time(tools: Tools) -> None:
    out = helm_template(tools, "--set", "proxy.signing.required=true")
    assert out.returncode != 0
    assert "proxy.signing.required needs proxy.signing.existingSecret" in out.stderr

"""The chart's admission key (docs/api.md): from a Secret to the API and worker pods only
(never the proxy's), the API's quota share from its replica count, nothing without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .conftest import Rendered
from .test_chart import containers


def env_of(rendered: Rendered, suffix: str) -> dict[str, dict[str, Any]]:
    (c,) = containers(rendered.one("Deployment", suffix))[:1]
    return {e["name"]: e for e in c.get("env", [])}


def test_no_admission_key_by_default(render: Callable[..., Rendered]) -> None:
    rendered = render()
    for suffix in ("-api", "-worker", "-proxy"):
        assert "TOCSIN_ADMISSION_KEY" not in env_of(rendered, suffix)


def test_the_key_reaches_the_api_and_workers_from_the_secret(
    render: Callable[..., Rendered],
) -> None:
    rendered = render(
        "--set", "admission.existingSecret=tocsin-admission",
        "--set", "api.autoscaling.enabled=false",
        "--set", "api.replicas=3",
    )  # fmt: skip
    for suffix in ("-api", "-worker"):
        env = env_of(rendered, suffix)
        ref = env["TOCSIN_ADMISSION_KEY"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("tocsin-admission", "admission-key")
        previous = env["TOCSIN_ADMISSION_PREVIOUS_KEY"]["valueFrom"]["secretKeyRef"]
        assert previous["optional"] is True
    assert "TOCSIN_ADMISSION_KEY" not in env_of(rendered, "-proxy")
    assert env_of(rendered, "-api")["TOCSIN_API_INSTANCES"]["value"] == "3"
    assert not [s for s in rendered.of_kind("Secret") if "admission" in s["metadata"]["name"]]


def test_an_inline_key_is_rendered_into_a_hook_secret(render: Callable[..., Rendered]) -> None:
    rendered = render("--set", "admission.key=k1:" + "s" * 40)
    (secret,) = [s for s in rendered.of_kind("Secret") if "admission" in s["metadata"]["name"]]
    assert secret["stringData"]["admission-key"] == "k1:" + "s" * 40
    ref = env_of(rendered, "-worker")["TOCSIN_ADMISSION_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    # Autoscaled (the default): the API's quota share assumes its most replicas.
    assert env_of(rendered, "-api")["TOCSIN_API_INSTANCES"]["value"] == "10"

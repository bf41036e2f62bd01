#!/usr/bin/env bash
# Install what the deploy checks (tests/deploy, `make deploy-check`) need, pinned and
# project-local, under .state/ (git-ignored):
#
#   .state/bin/helm          helm.sh/helm/v3            `go install` from the Go module proxy
#   .state/bin/kubeconform   github.com/yannh/kubeconform  `go install` from the Go module proxy
#   .state/bin/yq            github.com/mikefarah/yq/v4    `go install` (rendered YAML -> JSON)
#   .state/k8s-schemas/      Kubernetes JSON schemas (strict) for kubeconform, taken from the
#                            kubernetes-validate wheel on PyPI (pip download, hash-checked):
#                            kubeconform's default schema location is a web site this
#                            machine and CI cannot reach.
#
# Idempotent and cached: each part is redone only when its stamp (pin + build flags) differs
# or its files are missing, so a warm run takes well under a second. Run it directly or via
# `make deploy-tools`. Bump a pin here only; tests/deploy/test_chart.py reads them from here.
set -euo pipefail

HELM_VERSION="v3.22.0"
# Kubernetes minor that helm v3.22.0 is built against (its go.mod: k8s.io/client-go
# v0.37.0 -> 1.37). helm's own Makefile passes it as ldflags; a plain `go install` would
# leave helm believing it targets Kubernetes 1.20 (capabilities, lint deprecations).
HELM_K8S_MINOR="37"
KUBECONFORM_VERSION="v0.7.0"
# yq turns the rendered YAML into JSON for the Python assertions (the venv has no YAML
# parser, and the project's dependencies are not the deploy checks' to change).
YQ_VERSION="v4.53.6"
K8S_SCHEMAS_PACKAGE="kubernetes-validate==1.37.0"
K8S_SCHEMAS_SHA256="85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9"
# The Kubernetes versions the chart is validated against: its minimum (Chart.yaml
# kubeVersion) and the newest the schema package carries.
K8S_SCHEMA_VERSIONS="v1.30.0 v1.37.0"

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="$ROOT/.state"
export GOBIN="${GOBIN:-$STATE/bin}"
SCHEMAS="${TOCSIN_K8S_SCHEMAS:-$STATE/k8s-schemas}"
mkdir -p "$GOBIN" "$SCHEMAS"

if [ "${1:-}" = "--print-pins" ]; then
    echo "helm=$HELM_VERSION kubeconform=$KUBECONFORM_VERSION yq=$YQ_VERSION schemas=$K8S_SCHEMAS_PACKAGE k8s=$K8S_SCHEMA_VERSIONS"
    exit 0
fi

# ------------------------------------------------------------------------ Go tools

HELM_PKG="helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
HELM_LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$HELM_K8S_MINOR \
-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$HELM_K8S_MINOR"
KUBECONFORM_PKG="github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
KUBECONFORM_LDFLAGS="-s -w -X main.version=$KUBECONFORM_VERSION"
YQ_PKG="github.com/mikefarah/yq/v4@$YQ_VERSION"
YQ_LDFLAGS="-s -w"

tool_current() {  # name, package@version, ldflags
    local bin="$GOBIN/$1" stamp="$GOBIN/.$1.stamp"
    [ -x "$bin" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$2 $3" ]
}

# Go is only needed to build the three tools. Without it a developer's machine skips the
# deploy checks (tests/deploy then skips too, saying why); CI must run them, so there a
# missing Go fails the run.
if ! command -v go >/dev/null 2>&1 \
    && ! { tool_current helm "$HELM_PKG" "$HELM_LDFLAGS" \
        && tool_current kubeconform "$KUBECONFORM_PKG" "$KUBECONFORM_LDFLAGS" \
        && tool_current yq "$YQ_PKG" "$YQ_LDFLAGS"; }; then
    if [ "${CI:-}" = "true" ]; then
        echo "install-deploy-tools: the Go toolchain (go) is not on PATH; CI (CI=true) must" \
            "build helm, kubeconform and yq to run the deploy checks" >&2
        exit 1
    fi
    echo "install-deploy-tools: SKIPPED: the Go toolchain (go) is not on PATH, so the" \
        "deploy checks (helm lint/template and kubeconform on helm/tocsin) are skipped on" \
        "this machine; CI runs them. To run them here, install Go (https://go.dev/dl/)" \
        "and run \`make deploy-check\`." >&2
    exit 0
fi

install_tool() {  # name, package@version, ldflags
    local name="$1" pkg="$2" ldflags="$3"
    local stamp="$GOBIN/.$name.stamp"
    local want="$pkg $ldflags"
    if tool_current "$name" "$pkg" "$ldflags"; then
        echo "install-deploy-tools: $name ${pkg##*@} is up to date in $GOBIN"
        return 0
    fi
    echo "install-deploy-tools: go install $pkg (first build takes a few minutes)"
    local start=$SECONDS
    rm -f "$stamp"
    # -buildvcs=false: nothing to stamp; CGO off: static binaries, no C toolchain needed.
    CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--buildvcs=false}" \
        go install -trimpath -ldflags "$ldflags" "$pkg"
    echo "$want" > "$stamp"
    echo "install-deploy-tools: $name ${pkg##*@} installed in $((SECONDS - start))s"
}

install_tool helm "$HELM_PKG" "$HELM_LDFLAGS"
install_tool kubeconform "$KUBECONFORM_PKG" "$KUBECONFORM_LDFLAGS"
install_tool yq "$YQ_PKG" "$YQ_LDFLAGS"

# ------------------------------------------------------------ Kubernetes schemas

SCHEMA_STAMP="$SCHEMAS/.stamp"
WANT_SCHEMAS="$K8S_SCHEMAS_PACKAGE $K8S_SCHEMAS_SHA256 $K8S_SCHEMA_VERSIONS"
if [ -f "$SCHEMA_STAMP" ] && [ "$(cat "$SCHEMA_STAMP")" = "$WANT_SCHEMAS" ]; then
    echo "install-deploy-tools: Kubernetes schemas ($K8S_SCHEMA_VERSIONS) are up to date in $SCHEMAS"
    exit 0
fi

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "$K8S_SCHEMAS_PACKAGE --hash=sha256:$K8S_SCHEMAS_SHA256" > "$TMP/requirements.txt"
echo "install-deploy-tools: pip download $K8S_SCHEMAS_PACKAGE (schemas only, not installed)"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes -r "$TMP/requirements.txt" -d "$TMP"
rm -f "$SCHEMA_STAMP"
"$PY" "$ROOT/tools/k8s_schemas.py" "$TMP"/kubernetes_validate-*.whl "$SCHEMAS" $K8S_SCHEMA_VERSIONS
echo "$WANT_SCHEMAS" > "$SCHEMA_STAMP"

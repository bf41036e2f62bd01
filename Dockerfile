# syntax=docker/dockerfile:1
#
# One image for every Tocsin role. The entrypoint is the `tocsin` command, so the role is
# the first argument:
#
#   docker run IMAGE worker      # scheduler worker   (health + /metrics on :9464)
#   docker run IMAGE proxy       # delivery proxy     (health + /metrics on :9465)
#   docker run IMAGE api         # REST API           (:8480, /healthz and /readyz)
#   docker run IMAGE setup       # create/verify topics, migrate Cassandra (a Job)
#
# Configuration is environment only (TOCSIN_*; see README.md and docs/operations.md).
# There is no HEALTHCHECK on purpose: Kubernetes probes the real endpoints instead
# (helm/tocsin), and a Docker HEALTHCHECK would only duplicate them with other timings.
#
# Build:  docker build -t tocsin:0.1.0 .
# Every Python package is pinned by constraints.txt, and every dependency ships a
# manylinux wheel (the pure-Python sdists build without a compiler), so no compiler or
# -dev package is needed in either stage.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# The virtual environment is copied whole into the runtime stage; both stages share the
# base image, so its interpreter path (/usr/local/bin/python3.11) is the same.
RUN python -m venv /opt/tocsin
ENV PATH=/opt/tocsin/bin:$PATH

WORKDIR /src

# Dependencies first, in their own layer: it is rebuilt only when the pins change.
# The runtime dependencies are read from pyproject.toml (not the dev extras) and every
# version, transitive ones included, is fixed by constraints.txt.
COPY pyproject.toml constraints.txt ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > requirements.txt \
    && pip install -c constraints.txt -r requirements.txt

# Then the project itself (a regular, non-editable install; no dependency resolution).
COPY README.md ./
COPY base ./base
COPY tocsin ./tocsin
COPY topics ./topics
COPY streams ./streams
COPY proxy ./proxy
COPY schema ./schema
COPY api ./api
RUN pip install --no-deps -c constraints.txt . \
    && tocsin --help > /dev/null

# -------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

ARG TOCSIN_UID=10001
ARG TOCSIN_GID=10001

LABEL org.opencontainers.image.title="tocsin" \
      org.opencontainers.image.description="Kafka-native distributed scheduler with an HTTP delivery proxy" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric, unprivileged user: Kubernetes' runAsNonRoot can verify a numeric USER.
RUN groupadd --system --gid "${TOCSIN_GID}" tocsin \
    && useradd --system --uid "${TOCSIN_UID}" --gid "${TOCSIN_GID}" \
        --home-dir /var/lib/tocsin --no-create-home --shell /usr/sbin/nologin tocsin \
    && mkdir -p /var/lib/tocsin \
    && chown "${TOCSIN_UID}:${TOCSIN_GID}" /var/lib/tocsin

COPY --from=build /opt/tocsin /opt/tocsin

# TOCSIN_STATE_DIR: the worker's Faust data directory lives under it. It is the only
# place Tocsin writes to, so the root filesystem can be mounted read-only (the chart
# mounts an emptyDir here and on /tmp).
ENV PATH=/opt/tocsin/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOCSIN_STATE_DIR=/var/lib/tocsin \
    TOCSIN_LOG_FORMAT=json

USER ${TOCSIN_UID}:${TOCSIN_GID}
WORKDIR /var/lib/tocsin

# api, worker metrics/health, proxy metrics/health
EXPOSE 8480 9464 9465

# Exec form: `tocsin` is PID 1 and receives SIGTERM directly (graceful shutdown).
ENTRYPOINT ["tocsin"]
CMD ["--help"]

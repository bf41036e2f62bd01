# Tocsin: the two commands are `make run` (the local stack and the demo) and `make test`.
# Everything below uses the project's own virtual environment and local stack; nothing
# needs to be installed or started by hand beyond Python 3.11+ and Java 17 (Maven is
# fetched when absent; Go only builds the deploy checks' tools, skipped locally without it).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOCSIN := $(BIN)/tocsin
PYTEST_ARGS ?=

.PHONY: run test check lint typecheck unit integration venv up down status setup worker proxy dev \
        demo bench bench-scheduler bench-proxy bench-delivery bench-cron bench-api bench-api-floor bench-worker-idle bench-cassandra chaos api clean deploy-tools deploy-check

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required, found " + sys.version' 
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@bash tools/install-browser.sh
	@touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(TOCSIN) infra up

down: $(STAMP)
	$(TOCSIN) infra down

status: $(STAMP)
	$(TOCSIN) infra status

# A three-node cluster beside the single-node stack (tocsin/cluster.py, docs/operations.md):
# three KRaft brokers and three Cassandra 5.0 nodes on 127.0.0.1-3, ports 29092/29093/
# 29042/27000, state in .state/cluster, about 6 GiB. Not used by `make run` or `make test`.
.PHONY: cluster-up cluster-down
cluster-up: $(STAMP)
	$(BIN)/python -m tocsin.cluster up

cluster-down: $(STAMP)
	$(BIN)/python -m tocsin.cluster down

setup: up
	$(TOCSIN) setup

# The first command: a local single-node stack that schedules and delivers real triggers.
run: setup
	$(TOCSIN) demo

demo: run

# A worker, a proxy and a receiver on localhost:18766 that prints each delivery (README).
dev: setup
	$(TOCSIN) dev

worker: setup
	$(TOCSIN) worker

proxy: setup
	$(TOCSIN) proxy

api: setup
	$(TOCSIN) api

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest tests/unit -q $(PYTEST_ARGS)

integration: up
	$(BIN)/pytest tests/integration -q $(PYTEST_ARGS)

# The second command: every check, the same locally and in CI (.ci/run calls exactly this).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(MAKE) --no-print-directory deploy-check
	$(TOCSIN) infra up
	$(BIN)/pytest -q --ignore=tests/deploy $(PYTEST_ARGS)

# Kubernetes deployment (helm/tocsin, Dockerfile): pinned helm, kubeconform and yq built
# with `go install` into .state/bin plus strict Kubernetes schemas (cached; minutes the
# first time, instant after), then helm lint, helm template and kubeconform in pytest.
deploy-tools:
	bash tools/install-deploy-tools.sh

deploy-check: $(STAMP) deploy-tools
	$(BIN)/pytest -q tests/deploy $(PYTEST_ARGS)

# Issue 21's pinned-core figures (bench/pinning.py, BENCHMARKS.md): PIN=tocsin (or 1) runs
# bench-scheduler, -proxy, -delivery, -api and -worker-idle with Kafka and Cassandra on core 0
# and Tocsin's processes, the load client and the receivers on core 1; PIN=servers puts the
# load client and receivers on core 0 with the servers; PIN=off (the default, or
# TOCSIN_BENCH_PIN's value) pins nothing. SCHEDULER_ARGS, PROXY_ARGS, DELIVERY_ARGS,
# API_ARGS and IDLE_ARGS pass flags to each bench (e.g. shorter phases).
PIN ?= $(TOCSIN_BENCH_PIN)

bench-scheduler: setup
	TOCSIN_BENCH_PIN=$(PIN) $(BIN)/python -m bench.scheduler $(SCHEDULER_ARGS)

bench-proxy: up
	TOCSIN_BENCH_PIN=$(PIN) $(BIN)/python -m bench.proxy $(PROXY_ARGS)

# A steady 1,000 fires/s through a worker and the proxy to a local receiver: lateness due ->
# callback, per hop, and CPU per fire (bench/delivery.py).
bench-delivery: setup
	TOCSIN_ALLOW_PRIVATE_TARGETS=true TOCSIN_BENCH_PIN=$(PIN) $(BIN)/python -m bench.delivery $(DELIVERY_ARGS)

# 100,000 recurring schedules firing every minute (bench/cron.py).
bench-cron: setup
	$(BIN)/python -m bench.cron

# REST API: synchronous creates through `tocsin api` (docs/api.md).
bench-api: setup
	TOCSIN_BENCH_PIN=$(PIN) $(BIN)/python -m bench.api $(API_ARGS)

# The same with workers that skip Cassandra (bench/storeless_worker.py): the create path's
# floor on this machine, for BENCHMARKS.md's analysis; nothing is stored.
bench-api-floor: setup
	$(BIN)/python -m bench.api --worker-store none

# One worker owning the 8 commands partitions with nothing due and nothing arriving: its
# CPU s/s and Kafka's and Cassandra's over 60 s (bench/worker_idle.py).
bench-worker-idle: setup
	TOCSIN_BENCH_PIN=$(PIN) flock /tmp/bench.lock $(BIN)/python -m bench.worker_idle $(IDLE_ARGS)

# Cassandra round trip with and without TCP_NODELAY, and the driver's CPU per request with
# protocol v4 and v5 (bench/cassandra_latency.py).
bench-cassandra: up
	$(BIN)/python -m bench.cassandra_latency

bench: bench-scheduler bench-proxy

# Fault injection (bench/chaos.py, RELIABILITY.md): workers SIGKILLed or rolled, the broker
# restarted, Cassandra stopped or frozen, receivers and proxies down, a skewed clock, a
# read-only/full state folder, maximal payloads, hostile commands and a hostile tenant; exits
# 1 on anything lost, unanswered, early, out of order or duplicated past its bound. It starts
# its OWN stack (Kafka 19092, Cassandra 19042, state in .state/chaos) and never touches the
# main one. ~30 min, so not part of `make test` (its property tests are).
# Its receivers listen on 127.0.0.1, which workers and proxies refuse by default.
chaos: $(STAMP)
	TOCSIN_ALLOW_PRIVATE_TARGETS=true $(BIN)/python -m bench.chaos $(CHAOS_ARGS)

# Fault injection on a three-node cluster of its own (bench/chaos_cluster.py, RELIABILITY.md):
# brokers SIGKILLed (a partition leader, the KRaft controller leader) or SIGSTOPped, Cassandra
# nodes SIGKILLed 2 min or SIGSTOPped, rolling restarts of brokers, Cassandra nodes, workers
# and proxies, two nodes of either cluster lost 60 s, under two tenants' load. Kafka 31092,
# Cassandra 31042 on 127.0.0.1-3, state in .state/chaos-cluster; ~6 GiB and ~40 min; exits 1
# on anything lost, unanswered, early, out of order or duplicated past its bound.
.PHONY: chaos-cluster
chaos-cluster: $(STAMP)
	TOCSIN_ALLOW_PRIVATE_TARGETS=true $(BIN)/python -m bench.chaos_cluster $(CHAOS_ARGS)

clean: down
	rm -rf .state $(VENV) .mypy_cache .ruff_cache .pytest_cache

# A screenshot of each page of the web console (/console) at 1366x768, into docs/console/,
# taken by its browser tests on the local stack (tests/integration/test_console.py).
.PHONY: console-shots
console-shots: up
	TOCSIN_CONSOLE_SHOTS=docs/console $(BIN)/pytest -q tests/integration/test_console.py

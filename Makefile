# kappa -- Kappa-architecture reference platform. `make` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .cache/venv
PY := $(VENV)/bin/python
KAPPA := bin/kappa
# each checkout keeps its tests' temporary folders under its own .cache/tmp: pytest prunes all but the last 3 runs'
# folders of a root, so two checkouts' runs sharing /tmp would delete each other's brokers and stores mid-run
PYTEST := mkdir -p $(CURDIR)/.cache/tmp && PYTEST_DEBUG_TEMPROOT=$(CURDIR)/.cache/tmp $(PY) -m pytest -p no:cacheprovider

.PHONY: help setup run down status test test-smoke smoke-prep test-long test-deploy test-cluster test-nodes test-production bench bench-live bench-ceiling bench-verify bench-lake bench-soak bench-commits bench-log bench-sql clean lock k8s-build k8s-up k8s-down \
	images cluster-up cluster-monitoring cluster-down objectstore-build objectstore-up objectstore-down prometheus-build

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "} {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

setup: ## install everything (venv, Kafka broker + Spark/Delta jars) into .cache/ -- fast when done
	@bash infra/local/bootstrap.sh all

run: setup ## start the platform (broker, topics, 6 views, a live producer, Airflow, the analysts' SQL service); returns once every view has rows
	@$(KAPPA) up

down: ## stop everything `make run` started (data is kept in .kappa/)
	@if [ -x $(VENV)/bin/kappa ]; then $(KAPPA) down; fi

status: ## what runs, where its metrics are
	@$(KAPPA) status

# make test: the suite on two pytest-xdist workers (each file's tests on one of them, so its module fixtures start
# once), then alone the files whose bounds are seconds of wall time: the first-hour walk (make run's longest silence)
# and the driver lease (a TTL of seconds); each part keeps every test's seconds in its JUnit XML
TEST_MARKS := not slow and not bench and not cluster and not smoke and not nodes and not production
SERIAL_TESTS := tests/test_first_hour.py tests/test_driver_lease.py
test: setup k8s-build objectstore-build prometheus-build ## the test suite (real Kafka, Spark, Delta, Airflow, an S3-API object store, a real Kubernetes API server; Helm checks; the alerts under promtool)
	@$(PYTEST) -n 2 --dist loadfile -m "$(TEST_MARKS)" $(SERIAL_TESTS:%=--ignore=%) --durations=60 --junitxml=reports/test.xml tests
	@$(PYTEST) -m "$(TEST_MARKS)" --durations=10 --junitxml=reports/test-serial.xml $(SERIAL_TESTS)

test-smoke: setup k8s-build smoke-prep ## the cluster smoke: docs/deploy.md section 5 verbatim on a real node it brings up and tears down (root; 28-51 min warm, 35 with the SQL service's checks, 56 min cold)
	@$(PYTEST) -m smoke -rP tests

# the cluster smoke (tests/cluster/test_smoke.py, marker smoke, make test-smoke) runs docs/deploy.md section 5, whose first block brings
# the node up, builds the images and loads them: built here first (cached: seconds when nothing changed). Where no
# node can run (not root, no cgroups) nothing is built and the smoke fails saying why; a failed build leaves the
# smoke to fail with it too.
smoke-prep: ## the node's binaries and the images the cluster smoke needs (where a node can run)
	@if bash infra/k8s/node.sh check 2>/dev/null; then \
		{ bash infra/k8s/build.sh node >/dev/null && bash infra/images/build.sh; } \
			|| echo "smoke-prep: building the node or the images failed (above): the cluster smoke will fail" >&2; \
	else echo "smoke-prep: $$(bash infra/k8s/node.sh check 2>&1 | tail -1): the cluster smoke will fail" >&2; fi

test-long: setup ## long soak / fault loops (>= 50 SIGKILLs of running view jobs; broker killed and frozen)
	@$(PYTEST) -m slow -rP tests

test-deploy: setup ## only the offline Kubernetes checks (helm lint/template, schemas, policies)
	@bash infra/verify-offline.sh && $(PYTEST) -m deploy tests

bench: setup ## benchmark: raw log-read ceiling vs replay vs live latency; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench

bench-live: setup ## benchmark: what live views cost - make run's view host, CPU-s per micro-batch idle and at 200 events/s, beside fc054fe; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_live

bench-ceiling: setup ## benchmark: the live ceiling - the highest rate at which campaign_window_counts keeps p99 <= 5 s for 5 minutes, beside the engine's floor and the peer; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_ceiling

bench-soak: setup ## benchmark: day two compressed - the stack's tables, queries and memory over an hour with its upkeep every 5 min, beside an hour without; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_soak

bench-commits: setup ## benchmark: day two at 20,000 commits per table - the views' live commit path and its keeper alone (no Kafka, no micro-batch), beside the keeper without compaction as writers go and no upkeep; files a reader lists, query, change feed and commit seconds; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_commits

bench-log: setup objectstore-build ## benchmark: what a live commit costs as a table's _delta_log grows (50, 2,000, 20,000 commits), on a local disk and on the object store, with delta-rs' post-commit hooks and without, and a writer's handle as it ages; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_log

bench-sql: setup ## benchmark: the analysts' SQL service beside make run's views - connect and first answer, point queries, 1 and 8 analysts scanning the largest view, the views' lag meanwhile; JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_sql

bench-verify: setup ## benchmark: a strict verification of a version that followed a live stream for an hour (and again 10 min later); JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_verify

bench-lake: setup objectstore-build ## benchmark: the lake on the object store beside a local disk (replay, live, one commit, S3 requests); JSON + PNG in reports/
	@$(PY) -m kappa.front.bench_lake

images: ## build the images (view-job, airflow, kafka, postgres) with podman from Debian, no registry needed; cached
	@bash infra/images/build.sh

prometheus-build: ## build the pinned promtool once (Go module proxy; cached in ~/.cache/kappa): the chart's alerts are unit-tested with it
	@bash infra/prometheus/build.sh >/dev/null

k8s-build: ## build the pinned Kubernetes control plane once (Go module proxy; cached in ~/.cache/kappa, ~15 min cold)
	@bash infra/k8s/build.sh >/dev/null

k8s-up: k8s-build ## start a Kubernetes API server + KWOK nodes on loopback (.kappa/k8s); prints the KUBECONFIG export
	@bash infra/k8s/cluster.sh up

k8s-down: ## stop it (its state stays in .kappa/k8s)
	@bash infra/k8s/cluster.sh down

objectstore-build: ## build the pinned SeaweedFS once (Go module proxy; cached in ~/.cache/kappa, minutes cold)
	@bash infra/objectstore/build.sh >/dev/null

objectstore-up: setup objectstore-build ## an S3-API object store on 127.0.0.1:8333, bucket kappa (SeaweedFS, built once from the Go module proxy, minutes cold; .kappa/objectstore); S3_BIND=0.0.0.0: its S3 gateway for pods too
	@$(PY) -m kappa.objectstore up$(if $(S3_BIND), --s3-bind $(S3_BIND))

objectstore-down: ## stop it (its data stays in .kappa/objectstore)
	@if [ -x $(PY) ]; then $(PY) -m kappa.objectstore down; fi

cluster-up: k8s-build ## a real node on this machine: control plane + kubelet/containerd/runc, CNI, kube-proxy, CoreDNS (root; .kappa/cluster); NODES=3 for three, each in a network namespace of its own
	@$(if $(NODES),KAPPA_CLUSTER_NODES=$(NODES) )bash infra/k8s/node.sh up

cluster-monitoring: ## the Prometheus operator + a Prometheus on the real node, reading every release's PodMonitor and PrometheusRule (built once from the Go module proxy; needs make cluster-up)
	@bash infra/k8s/node.sh monitoring

cluster-down: ## stop the real node and its pods (state stays in .kappa/cluster)
	@bash infra/k8s/node.sh down

test-cluster: setup ## the platform in real pods (builds the images when absent; needs make cluster-up)
	@$(MAKE) --no-print-directory images
	@bash infra/k8s/node.sh load
	@$(PYTEST) -m cluster -rP --durations=0 tests

test-nodes: setup ## more than one node: pod networking, NetworkPolicies and a lost node across three real nodes (needs make cluster-up NODES=3)
	@$(MAKE) --no-print-directory images
	@bash infra/k8s/node.sh load
	@$(PYTEST) -m nodes -rP --durations=0 tests

test-production: setup ## the production example on three real nodes: brokers RF 3, the lake on the object store from pods, executors off their driver's node, Airflow's external database, dynamic volumes (docs/deploy.md; needs make cluster-up NODES=3)
	@$(MAKE) --no-print-directory images
	@$(PYTEST) -m production -rP --durations=0 tests

lock: ## regenerate requirements.lock from infra/versions.env pins
	@bash infra/local/bootstrap.sh lock

clean: down ## remove runtime state (.kappa/); keeps the .cache/ downloads
	@if [ -f .kappa/cluster/run/kubelet.pid ]; then bash infra/k8s/node.sh down; fi
	@if [ -d .kappa/objectstore ] && [ -x $(PY) ]; then $(PY) -m kappa.objectstore down; fi
	rm -rf .kappa

"""The production example on three real nodes (marker ``production``, ``make test-production``; needs ``make
cluster-up NODES=3``): docs/deploy.md "The production example on three nodes", its blocks verbatim, then what the
example promises checked on what runs - three brokers on three nodes with every topic replicated three times and in
sync, volumes provisioned dynamically on their pods' nodes, each view's executor on another node than its driver,
the views' tables on the object store (read from the host, not through the platform's pods), Airflow's tables in the
external database, and the PodMonitor's targets up in Prometheus.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.cluster.conftest import ROOT, Node
from tests.cluster.test_nodes import NODES, ready
from tests.cluster.test_platform import _run_shell
from tests.docs_blocks import shell_block

pytestmark = [pytest.mark.production, pytest.mark.timeout(3600)]

NS, DB_NS, RELEASE = "kappa", "kappa-db", "kappa"
VIEWS = {"campaign_window_counts": 1, "ad_events_archive": 1}
REPORT = ROOT / "reports" / "production.json"


@dataclass
class Production:
    node: Node
    timings: dict[str, object] = field(default_factory=dict)

    def record(self, name: str, value: object) -> None:
        self.timings[name] = value
        print(f"{name}: {value}")
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text(json.dumps(self.timings, indent=2, default=str))

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return self.node.get("pods", "-n", namespace, "-l", selector)["items"]


@pytest.fixture(scope="module")
def production(node: Node) -> Iterator[Production]:
    """The three nodes Ready, then the install block verbatim from a clean slate (what it does before the
    ``helm install`` is idempotent: a cluster already up, images loaded, a store running)."""
    names = sorted(n["metadata"]["name"] for n in node.get("nodes")["items"])
    if names != NODES or any(ready(node, n) != "True" for n in NODES):
        raise RuntimeError(f"nodes {names} (want {NODES}, all Ready): run `make cluster-down` then "
                           "`make cluster-up NODES=3` first (as root)")
    node.clean_slate(RELEASE, NS, DB_NS)  # the claims go with them: the provisioner removes its folders
    install = shell_block("-f infra/k8s/production/values.yaml --wait")
    prod = Production(node=node)
    started = time.monotonic()
    res = _run_shell(node, install.text, install.where, timeout=3000)
    prod.record("install block (nodes up, provisioner, monitoring, store, prerequisites, helm install) s",
                round(time.monotonic() - started, 1))
    print(res.stderr[-3000:])
    yield prod


def test_three_brokers_on_three_nodes_and_every_topic_replicated_three_times_in_sync(production: Production) -> None:
    brokers = production.pods(NS, "app.kubernetes.io/name=kappa-kafka")
    where = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in brokers}
    production.record("brokers", where)
    assert len(where) == 3 and sorted(where.values()) == sorted(NODES), where
    out = production.node.kubectl("exec", "-n", NS, "kappa-kafka-0", "-c", "kafka", "--", "bash", "-c",
                                  "kafka-topics.sh --bootstrap-server localhost:9092 --describe "
                                  "--exclude-internal").stdout
    topics = re.findall(r"^Topic: (\S+)\s.*ReplicationFactor: (\d+)\s.*Configs: (.*)$", out, re.M)
    assert topics, out
    default_min_isr = _broker_min_isr(production)  # what a topic without its own setting gets
    for topic, rf, configs in topics:
        assert rf == "3", (topic, rf)
        assert "min.insync.replicas=2" in configs or default_min_isr == "2", (topic, configs, default_min_isr)
    partitions = re.findall(r"^\s*Topic: (\S+)\s+Partition: (\d+)\s+Leader: (\d+)\s+Replicas: (\S+)\s+Isr: (\S+)",
                            out, re.M)
    assert partitions, out
    for topic, part, _leader, replicas, isr in partitions:
        assert len(replicas.split(",")) == 3 and sorted(isr.split(",")) == sorted(replicas.split(",")), \
            f"{topic}-{part}: replicas {replicas}, in sync {isr}"
    production.record("topics", {t: rf for t, rf, _ in topics})


def _broker_min_isr(production: Production) -> str:
    """The brokers' default ``min.insync.replicas`` (what a topic without its own setting gets)."""
    out = production.node.kubectl("exec", "-n", NS, "kappa-kafka-0", "-c", "kafka", "--", "bash", "-c",
                                  "kafka-configs.sh --bootstrap-server localhost:9092 --describe "
                                  "--entity-type brokers --entity-name 0 --all").stdout
    found = re.search(r"\bmin\.insync\.replicas=(\d+)", out)
    return found.group(1) if found else ""


def test_every_claim_is_a_volume_the_provisioner_made_on_its_pods_node(production: Production) -> None:
    claims = {}
    for ns in (NS, DB_NS):
        for pvc in production.node.get("pvc", "-n", ns)["items"]:
            assert pvc["status"]["phase"] == "Bound", pvc["metadata"]["name"]
            assert pvc["spec"]["storageClassName"] == "local-path", pvc["metadata"]["name"]
            pv = production.node.get("pv", pvc["spec"]["volumeName"])
            assert pv["metadata"]["annotations"].get("pv.kubernetes.io/provisioned-by") == "rancher.io/local-path"
            terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
            pv_node = terms[0]["matchExpressions"][0]["values"][0]
            claims[f"{ns}/{pvc['metadata']['name']}"] = pv_node
            users = [p for p in production.node.get("pods", "-n", ns)["items"]
                     if any(v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
                            for v in p["spec"].get("volumes", []))]
            assert users and all(p["spec"]["nodeName"] == pv_node for p in users), (pvc["metadata"]["name"], pv_node)
    production.record("claims", claims)
    assert len([c for c in claims if c.startswith(f"{NS}/")]) >= 3 and any(c.startswith(DB_NS) for c in claims)


def test_each_views_executor_runs_on_another_node_than_its_driver(production: Production) -> None:
    """Each driver's executors - once its Spark application runs (a driver waits for its topics first; a lost
    executor is replaced) - on other nodes than the driver."""
    placed: dict[str, dict] = {}
    deadline = time.monotonic() + 600
    for view, version in VIEWS.items():
        labels = f"kappa.io/view={view},kappa.io/view-version={version}"
        while True:
            drivers = production.pods(NS, f"app.kubernetes.io/component=view,{labels}")
            executors = [p for p in production.pods(NS, f"app.kubernetes.io/component=spark-executor,{labels}")
                         if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
            if len(drivers) == 1 and executors:
                break
            assert time.monotonic() < deadline, (view, [p["metadata"]["name"] for p in drivers + executors])
            time.sleep(5)
        driver_node = drivers[0]["spec"]["nodeName"]
        placed[view] = {"driver": driver_node, "executors": [p["spec"]["nodeName"] for p in executors]}
        assert all(n != driver_node for n in placed[view]["executors"]), placed[view]
    production.record("drivers and executors", placed)


def test_the_views_tables_are_on_the_object_store_with_rows(production: Production) -> None:
    """The docs' block: the pods and their nodes, then the view read from the host with the store's read-only key
    (delta-rs and DuckDB over S3; nothing of the release is asked)."""
    block = shell_block("KAPPA_LAKE_URI=s3://kappa/production bin/kappa query")
    deadline = time.monotonic() + 600
    while True:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], capture_output=True, text=True,
                             env={**production.node.env(), "PATH": f"{production.node.bin}:{os.environ['PATH']}"},
                             cwd=ROOT, timeout=300)
        rows = re.findall(r"│\s*(\d+)\s*│", res.stdout)
        if res.returncode == 0 and rows and int(rows[-1]) > 0:
            break
        assert time.monotonic() < deadline, f"{block.where}: no rows after 10 minutes:\n{res.stdout}\n{res.stderr}"
        time.sleep(15)
    print(res.stdout)
    production.record("campaign_window_counts windows (first read with rows)", int(rows[-1]))


def test_airflow_keeps_its_tables_in_the_external_database(production: Production) -> None:
    out = production.node.kubectl("exec", "-n", DB_NS, "airflow-db-0", "--", "psql", "-U", "airflow", "-d", "airflow",
                                  "-Atc", "SELECT dag_id FROM dag ORDER BY dag_id").stdout.split()
    assert {"kappa_replay", "kappa_rollback"} <= set(out), out
    assert not production.node.get("statefulsets", "-n", NS, "-l", "app.kubernetes.io/name=kappa-postgresql")["items"]


def test_prometheus_scrapes_every_driver_the_pod_monitor_selects(production: Production) -> None:
    """Every driver is an up target of the Prometheus of ``make cluster-monitoring`` (its API asked from the host,
    which routes the pods' network): the chart's PodMonitor selects them and its NetworkPolicies admit the scrape."""
    ip = production.node.get("pod", "prometheus-prometheus-0", "-n", "monitoring")["status"]["podIP"]
    deadline = time.monotonic() + 300
    while True:
        targets = json.loads(subprocess.run(["curl", "-s", f"http://{ip}:9090/api/v1/targets"], capture_output=True,
                                            text=True, timeout=30).stdout or "{}")
        active = [t for t in targets.get("data", {}).get("activeTargets", [])
                  if t["labels"].get("namespace") == NS]
        up = {t["labels"].get("pod", "?"): t["health"] for t in active}
        drivers = {p["metadata"]["name"] for p in production.pods(NS, "app.kubernetes.io/component=view")}
        if drivers and drivers <= {p for p, h in up.items() if h == "up"}:
            break
        assert time.monotonic() < deadline, f"targets after 5 minutes: {up}; drivers {drivers}"
        time.sleep(10)
    production.record("targets up", up)

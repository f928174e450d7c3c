"""Scale-out for real: a view driver in Spark-on-Kubernetes mode (``viewJobs.spark.mode=kubernetes``) creates its
executor pods through the API server with the chart's Role, the executors run the tasks, and the view equals the
same view computed in local mode and by the plain-Python oracle (``kappa verify``, run as a pod in local mode).

A release of its own (namespace ``kappa-exec``): one KRaft broker, one view version (campaign_window_counts v1: a
windowed aggregation with a lookup join, so its stages shuffle between the executors), no Airflow, no producer;
a fixed number of events is written by a Job built from the driver's own pod template. The main release of
test_platform.py is scaled to zero meanwhile (two cores) and scaled back afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.conftest import ROOT, Node, job_like, run_job

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NS = "kappa-exec"
NAME = "kx"  # fullnameOverride: short object names
VIEW, VERSION = "campaign_window_counts", 1
DRIVER = f"{NAME}-view-campaign-window-counts-v{VERSION}"
EVENTS = 60_000
EXECUTORS = 2
VALUES = [ROOT / "helm" / "kappa" / "examples" / "local.yaml", ROOT / "infra" / "images" / "local-values.yaml"]


def _overrides() -> dict:
    views = yaml.safe_load((ROOT / "kappa" / "platform.yaml").read_text())["views"]
    return {
        "fullnameOverride": NAME,
        "producer": {"enabled": False},
        "airflow": {"enabled": False},
        "kafka": {"persistence": {"size": "1Gi"}},
        "lake": {"persistence": {"size": "2Gi"}},
        "views": {v: {"versions": [VERSION] if v == VIEW else []} for v in views},
        "viewJobs": {
            "grouping": "perView",
            "resources": {"requests": {"cpu": "250m", "memory": "1536Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
            "spark": {"mode": "kubernetes", "executor": {
                "instances": EXECUTORS, "cores": 1, "memory": "768m", "memoryOverhead": "384m",
                "requestCores": "250m", "limitCores": "1"}},
        },
    }


@pytest.fixture(scope="module")
def scale_out(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # two cores: the main release (test_platform.py) pauses while this one runs
    paused = _pause(node, "kappa")
    node.clean_slate(NAME, NS)
    node.restricted_namespace(NS)
    values = tmp_path_factory.mktemp("exec") / "exec-values.yaml"
    values.write_text(yaml.safe_dump(_overrides()))
    started = time.monotonic()
    args = [a for v in [*VALUES, values] for a in ("-f", str(v))]
    node.run("helm", "install", NAME, str(ROOT / "helm" / "kappa"), "-n", NS, *args, "--wait", "--wait-for-jobs",
             "--timeout", "20m", timeout=1500)
    print(f"helm install (Spark on Kubernetes) -> Ready: {time.monotonic() - started:.0f} s")
    try:
        yield node
    finally:
        node.run("helm", "uninstall", NAME, "-n", NS, "--wait", check=False, timeout=600)
        node.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        _resume(node, "kappa", paused)


def _pause(node: Node, ns: str) -> dict[str, int]:
    """Scale every Deployment/StatefulSet of ``ns`` to 0; returns what to restore."""
    replicas: dict[str, int] = {}
    if node.kubectl("get", "namespace", ns, check=False).returncode != 0:
        return replicas
    for kind in ("deployment", "statefulset"):
        for item in node.get(kind, "-n", ns)["items"]:
            replicas[f"{kind}/{item['metadata']['name']}"] = item["spec"].get("replicas", 1)
    if replicas:
        node.kubectl("scale", "-n", ns, "--replicas=0", *replicas)
    return replicas


def _resume(node: Node, ns: str, replicas: dict[str, int]) -> None:
    for obj, n in replicas.items():
        node.kubectl("scale", "-n", ns, f"--replicas={n}", obj, check=False)


def _executors(node: Node) -> list[dict]:
    return node.get("pods", "-n", NS, "-l", f"spark-role=executor,kappa.io/view={VIEW}")["items"]


def _lake(node: Node) -> Path:
    pvc = node.get("pvc", f"{NAME}-lake", "-n", NS)
    return Path(node.get("pv", pvc["spec"]["volumeName"])["spec"]["local"]["path"])


def test_the_driver_creates_its_executor_pods_with_the_chart_role(scale_out: Node) -> None:
    deadline = time.monotonic() + 600
    while True:
        pods = _executors(scale_out)
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        if len(running) == EXECUTORS:
            break
        assert time.monotonic() < deadline, f"executors: {[(p['metadata']['name'], p['status'].get('phase')) for p in pods]}"
        time.sleep(5)
    selector = scale_out.get("deployment", DRIVER, "-n", NS)["spec"]["selector"]["matchLabels"]
    driver = scale_out.get("pods", "-n", NS, "-l", ",".join(f"{k}={v}" for k, v in selector.items()))["items"][0]
    for pod in running:
        owners = pod["metadata"].get("ownerReferences") or []
        assert [o["name"] for o in owners] == [driver["metadata"]["name"]], "owned by (collected with) the driver pod"
        assert pod["metadata"]["name"].startswith(f"{DRIVER}-exec-")
        sc = pod["spec"]["containers"][0]["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
    print(f"executor pods: {[p['metadata']['name'] for p in running]} (driver {driver['metadata']['name']})")


def test_the_executors_run_the_view_and_it_equals_local_mode_and_the_oracle(scale_out: Node) -> None:
    """EVENTS events through a Job; the executors' logs show the tasks; then `kappa verify` in local mode (its
    recompute of the same micro-batches and the plain-Python oracle over the raw records) equals the table."""
    from deltalake import DeltaTable

    started = time.monotonic()
    run_job(scale_out, job_like(scale_out, NS, DRIVER, f"{NAME}-produce",
                                ["kappa", "produce", "--count", str(EVENTS), "--seed", "7"], {}))
    print(f"produced {EVENTS} events: {time.monotonic() - started:.0f} s")
    table = _lake(scale_out) / "views" / VIEW / f"v{VERSION}" / "table"
    deadline = time.monotonic() + 900
    versions: list[int] = []
    while True:  # the driver commits micro-batches until the log's end; then only empty batches or none
        if DeltaTable.is_deltatable(str(table)):
            versions.append(DeltaTable(str(table)).version())
            if len(versions) > 6 and versions[-1] == versions[-6] and versions[-1] > 0:
                break
        assert time.monotonic() < deadline, f"{table}: Delta versions {versions[-10:]}"
        time.sleep(10)
    print(f"caught up after {time.monotonic() - started:.0f} s at Delta version {versions[-1]}")

    tasks = {}
    for pod in _executors(scale_out):
        log = scale_out.kubectl("logs", "-n", NS, pod["metadata"]["name"], "--tail=-1").stdout
        tasks[pod["metadata"]["name"]] = log.count("Running task ")
    print(f"tasks run per executor: {tasks}")
    assert len(tasks) == EXECUTORS and all(n > 0 for n in tasks.values()), tasks

    started = time.monotonic()
    logs = run_job(scale_out, job_like(scale_out, NS, DRIVER, f"{NAME}-verify",
                                       ["kappa", "verify", VIEW, "--version", str(VERSION)],
                                       {"KAPPA_SPARK_MASTER": "local[2]"}, memory="3Gi"))
    print(f"kappa verify (local mode, in a pod): {time.monotonic() - started:.0f} s\n{logs[-1500:]}")
    import re

    found = re.search(r"campaign_window_counts@v1: ([\d,]+) rows equal the recompute and the oracle", logs)
    assert found and int(found.group(1).replace(",", "")) > 0, logs[-3000:]

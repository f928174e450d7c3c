"""The whole platform in real containers on the real node: ``helm install`` of the local example with the images
built here, then the pods' own work - rows in every view's Delta table - read from outside the cluster.

The tests of this module run in order and share one release (module fixture ``release``): install, rows, analyst
query. Timings are printed (``-rP``) and saved to ``reports/cluster.json``; nothing here asserts a duration.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kappa.catalog import load_catalog
from kappa.config import Settings
from tests.cluster.conftest import ROOT, Node
from tests.docs_blocks import cluster_blocks

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NS = "kappa"
RELEASE = "kappa"
VALUES = [str(ROOT / "helm" / "kappa" / "examples" / "local.yaml"), str(ROOT / "infra" / "images" / "local-values.yaml")]
REPORT = ROOT / "reports" / "cluster.json"


@dataclass
class Release:
    node: Node
    installed_at: float
    timings: dict[str, float] = field(default_factory=dict)

    def lake(self) -> Path:
        """The lake PVC's volume on the node's disk (a local PersistentVolume): where an analyst outside reads."""
        pvc = self.node.get("pvc", f"{RELEASE}-lake", "-n", NS)
        pv = self.node.get("pv", pvc["spec"]["volumeName"])
        return Path(pv["spec"]["local"]["path"])

    def settings(self) -> Settings:
        """Settings of an analyst on the host: the lake is the PV's folder; nothing else is needed to query."""
        import os

        return Settings.from_env({**os.environ, "KAPPA_LAKE_URI": str(self.lake())})

    def record(self, name: str, seconds: float) -> None:
        self.timings[name] = round(seconds, 1)
        print(f"{name}: {seconds:.1f} s")
        REPORT.parent.mkdir(exist_ok=True)
        old = json.loads(REPORT.read_text()) if REPORT.exists() else {}
        REPORT.write_text(json.dumps({**old, **self.timings}, indent=2))


@pytest.fixture(scope="module")
def release(node: Node) -> Release:
    if os.environ.get("KAPPA_CLUSTER_REUSE") == "1" and node.run("helm", "status", RELEASE, "-n", NS,
                                                                 check=False).returncode == 0:
        # iterating on one test: keep the installed release (its install timings are not measured again)
        return Release(node=node, installed_at=time.monotonic())
    # a clean slate: no release, no namespace, every volume free
    node.run("helm", "uninstall", RELEASE, "-n", NS, "--wait", check=False, timeout=600)
    node.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=300s", check=False, timeout=400)
    subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), "recycle"], check=True, capture_output=True)
    node.kubectl("apply", "-f", str(ROOT / "infra" / "cluster" / "namespace.yaml"))
    started = time.monotonic()
    install = cluster_blocks()[0]  # docs/deploy.md "Run it on one machine", verbatim: images, load, helm install
    assert "helm install" in install.text and all(v.replace(f"{ROOT}/", "") in install.text for v in VALUES), \
        install.where
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", install.text], cwd=ROOT, capture_output=True, text=True,
                         timeout=3000)
    assert res.returncode == 0, f"{install.where} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rel = Release(node=node, installed_at=started)
    rel.record("helm install -> every pod Ready, topics Job done", time.monotonic() - started)
    return rel


def test_every_pod_is_ready_and_runs_as_its_chart_user(release: Release) -> None:
    pods = release.node.get("pods", "-n", NS)["items"]
    running = [p for p in pods if p["status"]["phase"] == "Running"]
    names = {p["metadata"]["labels"].get("app.kubernetes.io/name") for p in running}
    for expected in ("kappa-kafka", "kappa-views", "kappa-producer", "kappa-postgresql", "kappa-airflow-api-server",
                     "kappa-airflow-scheduler", "kappa-airflow-dag-processor", "kappa-airflow-triggerer"):
        assert expected in names, f"{expected} not running: {sorted(n for n in names if n)}"
    for p in running:
        ready = {c["type"]: c["status"] for c in p["status"]["conditions"]}
        assert ready.get("Ready") == "True", f"{p['metadata']['name']}: {p['status']['conditions']}"
        for c in p["status"]["containerStatuses"]:
            assert c["restartCount"] <= 3, f"{p['metadata']['name']}/{c['name']} restarted {c['restartCount']} times"


def _counts(release: Release) -> dict[str, int]:
    """Rows of every view's serving table, read on the host through the registry's serving alias."""
    from kappa.front.query import QueryError, run_query

    counts = {}
    for view in load_catalog().views:
        try:
            counts[view] = int(run_query(f"SELECT count(*) FROM {view}", settings=release.settings()).rows[0][0])
        except QueryError:  # no serving table, or no commit yet
            counts[view] = 0
    return counts


def test_every_view_gets_rows_written_by_the_pods(release: Release) -> None:
    views = list(load_catalog().views)
    deadline = time.monotonic() + 900
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = _counts(release)
        if all(counts.get(v, 0) > 0 for v in views):
            break
        time.sleep(5)
    print(f"rows per view: {counts}")
    assert all(counts.get(v, 0) > 0 for v in views), counts
    release.record("helm install -> rows in every view", time.monotonic() - release.installed_at)


def test_an_analyst_outside_the_cluster_queries_the_views(release: Release) -> None:
    """`bin/kappa query` on the host, pointed at the lake volume (DuckDB over delta-rs, the serving versions): the
    docs' block, verbatim, in the shell the install block left (its KUBECONFIG and pinned kubectl)."""
    query = cluster_blocks()[1]
    assert "bin/kappa query" in query.text, query.where
    env = {**release.node.env(), "PATH": f"{release.node.bin}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", query.text], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, f"{query.where}: {res.stderr}"
    print(res.stdout)
    assert "campaign_window_counts: serving v1" in res.stdout, res.stdout
    assert res.stdout.count("│") > 10, "rows printed"


@contextlib.contextmanager
def _port_forward(node: Node, target: str, remote: int) -> Iterator[str]:
    """``kubectl port-forward`` to a Service of the release: the way an operator outside the cluster reaches it."""
    from kappa.log.broker import free_port

    port = free_port()
    proc = subprocess.Popen([str(node.bin / "kubectl"), "port-forward", "-n", NS, target, f"{port}:{remote}"],
                            env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else "port-forward exited"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _airflow(release: Release, url: str):
    from kappa.front.airflow_client import AirflowAPI

    secret = release.node.get("secret", f"{RELEASE}-airflow", "-n", NS)
    password = base64.b64decode(secret["data"]["admin-password"]).decode()
    return AirflowAPI(url, "admin", password)


def _serving(release: Release, view: str) -> int:
    from kappa.front.query import run_query

    return run_query(f"SELECT count(*) FROM {view}", settings=release.settings()).freshness[view].serving_version


def test_a_replay_through_the_in_cluster_airflow_runs_verifies_and_promotes(release: Release) -> None:
    """kappa_replay triggered through the in-cluster Airflow's REST API: the Kubernetes runner starts the new
    version's driver pod, it catches up, the recompute runs in the Airflow worker, the alias switches."""
    view, version = "campaign_window_counts", 2
    deployment = f"{RELEASE}-view-campaign-window-counts-v{version}"
    assert _serving(release, view) == 1
    # two cores run five live views, Airflow, the broker and now a replay: with the producer at 200 events/s the new
    # version's batches (a minute each here) never get within max_lag of the head. Paused, it catches up; the live
    # rate such a node sustains is for the benchmark, not this test.
    release.node.kubectl("scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=0")
    with contextlib.ExitStack() as undo, _port_forward(release.node, f"svc/{RELEASE}-airflow-api-server", 8080) as url:
        undo.callback(release.node.kubectl, "scale", "-n", NS, f"deploy/{RELEASE}-producer", "--replicas=1")
        api = _airflow(release, url)
        started = time.monotonic()
        run_id = api.trigger("kappa_replay", {"view": view, "version": version, "auto_promote": True,
                                              "watch_minutes": 0})
        seen: list[str] = []

        def progress(state) -> None:
            line = f"{time.monotonic() - started:6.0f} s {state.state}: " + ", ".join(
                f"{t}={s}" for t, s in state.tasks.items())
            seen.append(line)
            print(line)

        state = api.wait("kappa_replay", run_id, timeout=2700, poll=10, on_change=progress)
    assert state.state == "success", "\n".join(seen)
    release.record("kappa_replay trigger -> promoted (in-cluster Airflow)", time.monotonic() - started)

    driver = release.node.get("deployment", deployment, "-n", NS)
    assert driver["status"].get("readyReplicas") == 1, driver["status"]
    assert _serving(release, view) == version

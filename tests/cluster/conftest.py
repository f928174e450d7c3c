"""What runs in real containers (marker ``cluster``, ``make test-cluster``): the images ``make images`` builds
(test_images_run.py, with podman) and the platform on a real node (``make cluster-up``).

``node`` (session) is the node ``infra/k8s/node.sh up`` started - the control plane plus a kubelet running real
containers with containerd and runc - found through its state folder (``KAPPA_CLUSTER_HOME``, default
``.kappa/cluster``). The tests never start it themselves: ``make cluster-up`` does, once, as root, and
``make test-cluster`` builds the images and loads them into the node first. A node that is not running fails
every test that needs it with that instruction; it is never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import deploy_helpers as h  # noqa: E402
from kappa.config import Settings  # noqa: E402
from tests.docs_blocks import cluster_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NODE_NAME = "kappa-node"


def pytest_configure(config: pytest.Config) -> None:
    # declared in pyproject.toml as well; registered here so this folder collects under --strict-markers on its own
    config.addinivalue_line("markers", "cluster: containers of the images built here (make images); make test-cluster")
    config.addinivalue_line("markers", "smoke: docs/deploy.md section 5 verbatim on a real node; make test-smoke")
    config.addinivalue_line("markers", "nodes: three real nodes (make cluster-up NODES=3); make test-nodes")
    config.addinivalue_line("markers", "production: the production example on three real nodes; make test-production")


def image(name: str) -> str:
    """A project image as make images tags it (``localhost/kappa/<name>:<KAPPA_VERSION>``)."""
    return f"localhost/kappa/{name}:{h.versions()['KAPPA_VERSION']}"


@dataclass(frozen=True)
class Node:
    """The running real node: its kubeconfig and the tools that talk to it."""

    home: Path
    bin: Path
    helm: Path

    @property
    def kubeconfig(self) -> Path:
        return self.home / "admin.kubeconfig"

    def env(self) -> dict[str, str]:
        helm_home = self.home / "helm"
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(helm_home / "cache"),
                "HELM_CONFIG_HOME": str(helm_home / "config"), "HELM_DATA_HOME": str(helm_home / "data")}

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 600.0,
            input: str | None = None) -> subprocess.CompletedProcess:
        exe = str(self.helm) if tool == "helm" else str(self.bin / tool)
        res = subprocess.run([exe, *args], capture_output=True, text=True, env=self.env(), cwd=ROOT,
                             timeout=timeout, input=input)
        if check and res.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *args: str, check: bool = True, timeout: float = 600.0,
                input: str | None = None) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, check=check, timeout=timeout, input=input)

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json`` as a dict."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: str, *args: str) -> subprocess.CompletedProcess:
        return self.kubectl("apply", "-f", "-", *args, input=manifest)

    def clean_slate(self, release: str, *namespaces: str) -> None:
        """No ``release`` (in the first namespace) and none of ``namespaces``: the claims go with them, and the local
        volumes they left ``Released`` are offered again (``node.sh recycle``)."""
        self.run("helm", "uninstall", release, "-n", namespaces[0], "--wait", check=False, timeout=600)
        for namespace in namespaces:
            self.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=300s", check=False, timeout=400)
        subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), "recycle"], check=True, capture_output=True)

    def restricted_namespace(self, name: str) -> str:
        """A namespace that enforces Pod Security ``restricted`` (infra/cluster/namespace.yaml's labels)."""
        manifest = (ROOT / "infra" / "cluster" / "namespace.yaml").read_text().replace("name: kappa", f"name: {name}")
        self.apply(manifest)
        return name

    def wait_pod(self, namespace: str, name: str, phase: str = "Running", timeout: float = 180.0) -> dict:
        """Wait until the pod reaches ``phase`` (``Running`` also waits for Ready); fails with its events."""
        deadline = time.monotonic() + timeout
        pod: dict = {}
        while time.monotonic() < deadline:
            pod = self.get("pod", name, "-n", namespace)
            status = pod.get("status", {})
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
            if status.get("phase") == phase and (phase != "Running" or ready):
                return pod
            if status.get("phase") == "Failed" and phase != "Failed":
                break
            time.sleep(0.5)
        events = self.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                              check=False).stdout
        logs = self.kubectl("logs", "-n", namespace, name, "--all-containers", check=False)
        raise AssertionError(f"pod {namespace}/{name} not {phase} after {timeout:.0f} s: "
                             f"{json.dumps(pod.get('status', {}))[:2000]}\n{events}\n{logs.stdout[-2000:]}{logs.stderr[-500:]}")


def job_like(node: Node, namespace: str, deployment: str, name: str, args: list[str], env: dict[str, str],
             memory: str | None = None) -> dict:
    """A Job running ``args`` in the pod of ``deployment`` (image, env, lake volume, security context) with Spark in
    the ``env`` given (e.g. ``KAPPA_SPARK_MASTER=local[2]``): no Service selects it, no probe restarts it, no API
    token is mounted; ``memory`` replaces its memory request and limit."""
    pod = json.loads(json.dumps(node.get("deployment", deployment, "-n", namespace)["spec"]["template"]))
    labels = pod["metadata"]["labels"]
    labels["app.kubernetes.io/name"] = name
    for key in ("kappa.io/view", "kappa.io/view-version"):
        labels.pop(key, None)
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"
    spec["automountServiceAccountToken"] = False
    c = spec["containers"][0]
    c["args"] = args
    c["env"] = [e for e in c.get("env", []) if e["name"] not in {"PYSPARK_SUBMIT_ARGS", "COLUMNS", *env}]
    c["env"] += [{"name": k, "value": v} for k, v in {"COLUMNS": "400", **env}.items()]  # unwrapped output
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        c.pop(probe, None)
    c["ports"] = []
    if memory:
        c["resources"] = {"requests": {**c["resources"]["requests"], "memory": memory},
                          "limits": {**c["resources"]["limits"], "memory": memory}}
    spec["volumes"] = [v for v in spec["volumes"] if "projected" not in v or v["name"] != "kube-api-access"]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] in {v["name"] for v in spec["volumes"]}]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": namespace},
            "spec": {"backoffLimit": 0, "template": pod}}


def run_job(node: Node, job: dict, timeout: float = 1200) -> str:
    """Create the Job (replacing one of the same name), wait until it completes; its logs. Fails with them."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    node.kubectl("delete", "job", name, "-n", namespace, "--wait=true", check=False)
    node.apply(json.dumps(job))
    deadline = time.monotonic() + timeout
    while True:
        status = node.get("job", name, "-n", namespace).get("status", {})
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        if conditions.get("Complete") == "True" or conditions.get("Failed") == "True":
            break
        assert time.monotonic() < deadline, f"job/{name} still running after {timeout:.0f} s: {status}"
        time.sleep(5)
    logs = node.kubectl("logs", "-n", namespace, f"job/{name}", "--tail=-1", check=False).stdout
    assert conditions.get("Complete") == "True", f"job/{name} failed:\n{logs[-4000:]}"
    return logs


@pytest.fixture(scope="session")
def node() -> Node:
    home = Path(os.environ.get("KAPPA_CLUSTER_HOME", ROOT / ".kappa" / "cluster"))
    cp_bin = Path(subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "build.sh")], capture_output=True, text=True,
                                 check=True).stdout.strip())
    found = Node(home=home, bin=cp_bin, helm=h.helm_binary())
    if not found.kubeconfig.exists():
        raise RuntimeError(f"no real node at {home}: run `make cluster-up` first (as root)")
    res = found.kubectl("get", "node", NODE_NAME, "-o", "json", check=False, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"the real node is not running ({res.stderr.strip()[:300]}): run `make cluster-up`")
    return found


@pytest.fixture()
def namespace(node: Node) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security ``restricted``, deleted (with its pods) after the test."""
    name = node.restricted_namespace(f"t-{uuid.uuid4().hex[:8]}")
    yield name
    node.kubectl("delete", "namespace", name, "--wait=false", check=False)


# ------------------------------------------------------------------------------------------ the platform release
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
        return Settings.from_env({**os.environ, "KAPPA_LAKE_URI": str(self.lake())})

    def record(self, name: str, seconds: float) -> None:
        self.timings[name] = round(seconds, 1)
        print(f"{name}: {seconds:.1f} s")
        REPORT.parent.mkdir(exist_ok=True)
        old = json.loads(REPORT.read_text()) if REPORT.exists() else {}
        REPORT.write_text(json.dumps({**old, **self.timings}, indent=2))

    def record_detail(self, name: str, detail: Any) -> None:
        """A measurement that is not one duration (saved beside the timings)."""
        REPORT.parent.mkdir(exist_ok=True)
        old = json.loads(REPORT.read_text()) if REPORT.exists() else {}
        REPORT.write_text(json.dumps({**old, name: detail}, indent=2, default=str))


@pytest.fixture(scope="session")
def release(node: Node) -> Release:
    """The local example installed on the node with the images built here (docs/deploy.md's install block,
    verbatim), shared by test_platform.py and test_platform_faults.py, in that order."""
    if os.environ.get("KAPPA_CLUSTER_REUSE") == "1" and node.run("helm", "status", RELEASE, "-n", NS,
                                                                 check=False).returncode == 0:
        # iterating on one test: keep the installed release (its install timings are not measured again)
        return Release(node=node, installed_at=time.monotonic())
    # a clean slate: no release, no namespace, every volume free
    node.clean_slate(RELEASE, NS)
    node.kubectl("apply", "-f", str(ROOT / "infra" / "cluster" / "namespace.yaml"))
    started = time.monotonic()
    install = cluster_block("helm install")  # docs/deploy.md "Run it on one machine", verbatim: images, load, helm install
    assert "helm install" in install.text and all(v.replace(f"{ROOT}/", "") in install.text for v in VALUES), \
        install.where
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", install.text], cwd=ROOT, capture_output=True, text=True,
                         timeout=3000)
    assert res.returncode == 0, f"{install.where} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rel = Release(node=node, installed_at=started)
    rel.record("helm install -> every pod Ready, topics Job done", time.monotonic() - started)
    return rel

"""A real Kubernetes API server for the chart's tests (every module here is marked ``k8s``: ``pytestmark``).

``cluster`` (session) starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK on loopback
with ``infra/k8s/cluster.sh`` (binaries built once from the Go module proxy and cached per version, see
``infra/k8s/build.sh``) in a temporary folder on free ports, and stops them at the end. KWOK fakes the nodes:
pods are scheduled and marked Running/Ready (Jobs' pods Succeeded) without any container running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kappa.log.broker import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import deploy_helpers as h  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Cluster:
    """The running control plane: its kubeconfig and the tools that talk to it."""

    kubeconfig: Path
    bin: Path
    helm: Path
    home: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(self.home / "helm-cache"),
                "HELM_CONFIG_HOME": str(self.home / "helm-config"), "HELM_DATA_HOME": str(self.home / "helm-data")}

    def run(self, tool: str, *args: str, check: bool = True, timeout: float = 600.0) -> subprocess.CompletedProcess:
        exe = str(self.helm) if tool == "helm" else str(self.bin / tool)
        res = subprocess.run([exe, *args], capture_output=True, text=True, env=self.env(), cwd=ROOT,
                             timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("kubectl", *args, check=check)

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json`` as a dict."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def restricted_namespace(self, name: str) -> str:
        """A namespace that enforces Pod Security ``restricted`` (infra/cluster/namespace.yaml's labels)."""
        manifest = (ROOT / "infra" / "cluster" / "namespace.yaml").read_text().replace("name: kappa", f"name: {name}")
        subprocess.run([str(self.bin / "kubectl"), "apply", "-f", "-"], input=manifest, text=True, check=True,
                       capture_output=True, env=self.env())
        return name


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("k8s")
    env = {**os.environ, "KAPPA_K8S_HOME": str(home), "KAPPA_K8S_PORT": str(free_port()),
           "KAPPA_K8S_ETCD_PORT": str(_two_free_ports())}
    up = subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "cluster.sh"), "up"], capture_output=True, text=True,
                        env=env, timeout=3600)
    try:
        if up.returncode != 0:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((home / "logs").glob("*.log")))
            raise RuntimeError(f"the control plane did not start:\n{up.stderr[-3000:]}\n{logs}")
        bin_dir = Path(subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "build.sh")], capture_output=True,
                                      text=True, check=True).stdout.strip())
        yield Cluster(kubeconfig=home / "admin.kubeconfig", bin=bin_dir, helm=h.helm_binary(), home=home)
    finally:
        subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "cluster.sh"), "down"], capture_output=True, env=env,
                       timeout=120)


def _two_free_ports() -> int:
    """A port whose successor is free too (etcd's client and peer ports)."""
    for _ in range(50):
        port = free_port()
        if port < 65535:
            import socket

            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")

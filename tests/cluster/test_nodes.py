"""More than one real node on this machine (``make cluster-up NODES=3``, marker ``nodes``, ``make test-nodes``).

Node 0 is the host's own network; nodes 1 and 2 each run their own kubelet, containerd, kube-proxy and kube-router
in a network namespace of their own (infra/k8s/node.sh). What a single node cannot show: pods on different nodes
reach each other by their own addresses, directly and through Services, NetworkPolicies hold between nodes, and a
node lost as a machine is lost goes NotReady while its pods come back on another node - the Deployment's by
themselves, the StatefulSet's once the operator says the node is gone (docs/deploy.md's blocks, verbatim).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.cluster.conftest import ROOT, Node
from tests.cluster.test_node import pod
from tests.cluster.test_platform import _run_shell
from tests.docs_blocks import shell_block

pytestmark = pytest.mark.nodes

NODES = ["kappa-node", "kappa-node-1", "kappa-node-2"]

ECHO = r"""
import http.server, os
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{self.client_address[0]} {os.environ['NODE']}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("", 8080), Echo).serve_forever()
"""

FETCH = r"""
import json, os, sys, urllib.request
out = {"ip": os.environ["POD_IP"], "node": os.environ["NODE"]}
for url in sys.argv[1:]:
    try:
        out[url] = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError as exc:
        out[url] = type(exc).__name__
print(json.dumps(out))
"""

DOWNWARD = [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def on(spec: dict, node_name: str) -> dict:
    """``spec`` (a pod) scheduled on ``node_name``, with its node and address in its environment."""
    spec["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node_name}
    spec["spec"]["containers"][0]["env"] += DOWNWARD
    return spec


def ready(node: Node, name: str) -> str:
    """The node's Ready condition: True, False or Unknown (its kubelet stopped reporting)."""
    conditions = node.get("node", name)["status"]["conditions"]
    return next(c["status"] for c in conditions if c["type"] == "Ready")


@pytest.fixture(scope="module")
def nodes(node: Node) -> Node:
    """The cluster, with the three nodes Ready (``make cluster-up NODES=3``; it is never started here)."""
    names = sorted(n["metadata"]["name"] for n in node.get("nodes")["items"])
    if names != NODES or any(ready(node, n) != "True" for n in NODES):
        raise RuntimeError(f"nodes {names} (want {NODES}, all Ready): run `make cluster-down` then "
                           "`make cluster-up NODES=3` first (as root)")
    return node


def test_three_nodes_each_with_its_own_address_runtime_and_pod_network(nodes: Node) -> None:
    listed = subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), "nodes"], capture_output=True,
                            text=True, check=True, env={**os.environ, "KAPPA_CLUSTER_HOME": str(nodes.home)}).stdout
    rows = [line.split() for line in listed.splitlines()]
    print(listed)
    assert [r[0] for r in rows] == NODES and all(r[3] == "running" for r in rows), listed
    assert [r[2] for r in rows] == ["10.244.0.0/24", "10.244.1.0/24", "10.244.2.0/24"], listed
    for name, (_, address, _, _) in zip(NODES, rows):
        found = nodes.get("node", name)
        internal = [a["address"] for a in found["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == [address], (name, found["status"]["addresses"])
        assert found["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert len({r[1] for r in rows}) == 3, "each node has an address of its own"


def test_pods_on_different_nodes_reach_each_other_by_their_own_addresses(nodes: Node, namespace: str) -> None:
    """A server on each node answers with the address it saw; a client on each node calls every server by pod IP and
    through its Service (by DNS name: CoreDNS runs on one node): no hop rewrites a pod's address."""
    items = []
    for i, name in enumerate(NODES):
        items.append(on(pod(f"echo-{i}", ["python", "-c", ECHO], labels={"app": f"echo-{i}"}, port=8080,
                            cpu_request="50m"), name))
        items.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"echo-{i}"},
                      "spec": {"selector": {"app": f"echo-{i}"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    nodes.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), "-n", namespace)
    ips = {i: nodes.wait_pod(namespace, f"echo-{i}")["status"]["podIP"] for i in range(len(NODES))}
    urls = [u for i in ips for u in (f"http://{ips[i]}:8080/", f"http://echo-{i}/")]
    for i, name in enumerate(NODES):
        nodes.apply(json.dumps(on(pod(f"fetch-{i}", ["python", "-c", FETCH, *urls], restart="Never",
                                      cpu_request="50m"), name)), "-n", namespace)
    for i, name in enumerate(NODES):
        nodes.wait_pod(namespace, f"fetch-{i}", phase="Succeeded")
        out = json.loads(nodes.kubectl("logs", "-n", namespace, f"fetch-{i}").stdout.strip().splitlines()[-1])
        print(f"client on {name}: {out}")
        assert out["node"] == name
        for j, server in enumerate(NODES):
            expected = f"{out['ip']} {server}"
            assert out[f"http://{ips[j]}:8080/"] == expected, f"{name} -> {server} by pod IP: {out}"
            assert out[f"http://echo-{j}/"] == expected, f"{name} -> {server} through its Service: {out}"


PROBE = r"""
import json, socket, sys, time
host, port, until = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=4).close()
        print(json.dumps("open"))
        break
    except OSError as exc:
        if time.monotonic() > until:
            print(json.dumps(type(exc).__name__))
            break
        time.sleep(1)
"""


def test_a_network_policy_holds_between_nodes(nodes: Node, namespace: str) -> None:
    """A policy on a server of kappa-node-2 admitting only role=client: clients on the two other nodes get in, a pod
    without the label on either does not (its address is its own, so the policy can tell)."""
    nodes.apply(json.dumps(on(pod("guarded", ["python", "-c", ECHO], labels={"app": "guarded"}, port=8080,
                                  cpu_request="50m"), "kappa-node-2")), "-n", namespace)
    ip = nodes.wait_pod(namespace, "guarded")["status"]["podIP"]
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "guarded"},
              "spec": {"podSelector": {"matchLabels": {"app": "guarded"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                                    "ports": [{"port": 8080, "protocol": "TCP"}]}]}}
    nodes.apply(json.dumps(policy), "-n", namespace)
    applied = time.monotonic()
    probes = {}
    for role, wait in (("client", 60), ("other", 0)):
        for name in ("kappa-node", "kappa-node-1"):
            probe = f"{role}-{name}"
            spec = on(pod(probe, ["python", "-c", PROBE, ip, "8080", str(wait)], restart="Never",
                          labels={"role": role}, cpu_request="50m"), name)
            nodes.apply(json.dumps(spec), "-n", namespace)
            probes[probe] = spec
    results = {}
    for probe in probes:
        nodes.wait_pod(namespace, probe, phase="Succeeded", timeout=300)
        results[probe] = json.loads(nodes.kubectl("logs", "-n", namespace, probe).stdout.strip().splitlines()[-1])
    print(f"policy applied {time.monotonic() - applied:.0f} s ago: {results}")
    assert results["client-kappa-node"] == "open" and results["client-kappa-node-1"] == "open", results
    assert results["other-kappa-node"] != "open" and results["other-kappa-node-1"] != "open", results


def _on_node(nodes: Node, namespace: str, selector: str) -> dict[str, str]:
    """The pods matching ``selector``: name -> "<node> <Ready|not ready>[ deleting]"."""
    out = {}
    for p in nodes.get("pods", "-n", namespace, "-l", selector)["items"]:
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        out[p["metadata"]["name"]] = (f"{p['spec'].get('nodeName')} {'Ready' if ok else 'not ready'}"
                                      + (" deleting" if p["metadata"].get("deletionTimestamp") else ""))
    return out


def _until(what: str, timeout: float, check) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"{what}: not after {timeout:.0f} s"
        time.sleep(2)
    return time.monotonic()


@pytest.mark.timeout(1800)
def test_a_lost_node_goes_not_ready_and_its_pods_come_back_elsewhere(nodes: Node, namespace: str) -> None:
    """docs/deploy.md's blocks, verbatim: ``node.sh lose 2`` (unplugged, everything on it killed); the node goes
    NotReady; a Deployment's pod starts on another node by itself (taint-based eviction, 300 s); a StatefulSet's
    stays the lost node's until the operator taints it out-of-service, then starts elsewhere; ``make cluster-up
    NODES=3`` brings the node back Ready and it runs pods again."""
    workers = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["kappa-node"]}]}]}}

    def template(app: str) -> dict:
        spec = pod(app, ["python", "-c", ECHO], labels={"app": app}, port=8080, cpu_request="50m")
        spec["spec"]["containers"][0]["env"] += DOWNWARD[:1]
        spec["spec"]["affinity"] = {"nodeAffinity": workers}
        spec["spec"]["terminationGracePeriodSeconds"] = 5
        return {"metadata": {"labels": {"app": app}}, "spec": spec["spec"]}

    def workload(kind: str, app: str) -> dict:
        spec = {"replicas": 1, "selector": {"matchLabels": {"app": app}}, "template": template(app)}
        if kind == "StatefulSet":
            spec["serviceName"] = app
        return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": app}, "spec": spec}

    # both land on kappa-node-2: kappa-node-1 cordoned while they are placed
    nodes.kubectl("cordon", "kappa-node-1")
    try:
        nodes.apply(json.dumps({"apiVersion": "v1", "kind": "List",
                                "items": [workload("Deployment", "stateless"), workload("StatefulSet", "stateful")]}),
                    "-n", namespace)
        _until("both on kappa-node-2 and Ready", 300, lambda: sorted(
            _on_node(nodes, namespace, "app in (stateless,stateful)").values()) == ["kappa-node-2 Ready"] * 2)
    finally:
        nodes.kubectl("uncordon", "kappa-node-1")

    lose = shell_block("node.sh lose 2")
    t0 = time.monotonic()
    print(_run_shell(nodes, lose.text, lose.where, timeout=120).stderr.strip())
    t_not_ready = _until("kappa-node-2 not Ready", 300, lambda: ready(nodes, "kappa-node-2") != "True")
    print(f"kappa-node-2 Ready={ready(nodes, 'kappa-node-2')} {t_not_ready - t0:.0f} s after it was lost")

    def moved(app: str) -> bool:
        return "kappa-node-1 Ready" in _on_node(nodes, namespace, f"app={app}").values()

    t_stateless = _until("the Deployment's pod Ready on kappa-node-1", 900, lambda: moved("stateless"))
    stateful = _on_node(nodes, namespace, "app=stateful")
    print(f"Deployment's pod Ready on kappa-node-1 {t_stateless - t0:.0f} s after the loss; "
          f"the StatefulSet's: {stateful}")
    assert list(stateful) == ["stateful-0"] and stateful["stateful-0"].startswith("kappa-node-2"), \
        f"a StatefulSet's pod is not started twice while its node may still run it: {stateful}"

    gone = shell_block("node.kubernetes.io/out-of-service=nodeshutdown:NoExecute\n")
    t_taint = time.monotonic()
    _run_shell(nodes, gone.text, gone.where, timeout=60)
    t_stateful = _until("the StatefulSet's pod Ready on kappa-node-1", 600, lambda: moved("stateful"))
    print(f"StatefulSet's pod Ready on kappa-node-1 {t_stateful - t_taint:.0f} s after the out-of-service taint")

    back = shell_block("nodeshutdown:NoExecute-")
    t_up = time.monotonic()
    print(_run_shell(nodes, back.text, back.where, timeout=900).stderr.strip()[-1500:])
    t_ready = _until("kappa-node-2 Ready again", 300, lambda: ready(nodes, "kappa-node-2") == "True")
    taints = [t["key"] for t in nodes.get("node", "kappa-node-2")["spec"].get("taints", [])]
    assert "node.kubernetes.io/out-of-service" not in taints, taints
    nodes.apply(json.dumps(on(pod("after", ["python", "-c", ECHO], labels={"app": "after"}, port=8080,
                                  cpu_request="50m"), "kappa-node-2")), "-n", namespace)
    nodes.wait_pod(namespace, "after")
    print(f"kappa-node-2 Ready {t_ready - t_up:.0f} s after make cluster-up; figures: NotReady "
          f"{t_not_ready - t0:.0f} s, Deployment's pod elsewhere {t_stateless - t0:.0f} s, StatefulSet's "
          f"{t_stateful - t_taint:.0f} s after the taint")

"""The real node itself (infra/k8s/node.sh): real containers, pod networking, Services, DNS, the API from a pod.

What KWOK cannot show: a container starts from our image as the chart's user under Pod Security ``restricted``,
gets its cgroup limits, resolves cluster names, reaches another pod directly and through a Service (kube-proxy's
rules), reaches the API server with its service-account token, and ``kubectl logs`` / ``exec`` reach the kubelet.
"""

from __future__ import annotations

import json
import uuid

import pytest

from tests.cluster.conftest import NODE_NAME, Node, h, image

pytestmark = pytest.mark.cluster

RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}

CLIENT = r"""
import json, os, socket, ssl, urllib.request
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
ctx = ssl.create_default_context(cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
api = urllib.request.Request("https://kubernetes.default.svc/version", headers={"Authorization": "Bearer " + token})
cg = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
print(json.dumps({
    "uid": os.getuid(),
    "service_ip": socket.gethostbyname(f"web.{ns}.svc.cluster.local"),
    "via_service": urllib.request.urlopen("http://web/token", timeout=10).read().decode().strip(),
    "via_pod_ip": urllib.request.urlopen(f"http://{os.environ['SERVER_IP']}:8080/token", timeout=10).read().decode().strip(),
    "api_version": json.load(urllib.request.urlopen(api, context=ctx, timeout=10))["gitVersion"],
    "memory_limit": int(open(cg).read()) if os.path.exists(cg) else None,
}))
"""


def pod(name: str, command: list[str], *, env: dict[str, str] | None = None, restart: str = "Always",
        token: bool = False, labels: dict[str, str] | None = None, port: int | None = None,
        cpu_request: str = "250m", image_name: str = "view-job") -> dict:
    """A pod of the view-job image (or ``image_name``) under Pod Security ``restricted``. ``cpu_request``: below the
    250m limit for a pod that must fit beside a running release (the local example requests 1.8 of the node's 2 CPUs
    after a rollback)."""
    container: dict = {
        "name": "main", "image": image(image_name), "imagePullPolicy": "Never", "command": command,
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
        "securityContext": {**RESTRICTED, "readOnlyRootFilesystem": True},
        # Guaranteed QoS by default: requests == limits, enforced by the node's cgroups
        "resources": {"requests": {"cpu": cpu_request, "memory": "256Mi"},
                      "limits": {"cpu": "250m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if port:
        container["ports"] = [{"containerPort": port, "name": "http"}]
        container["readinessProbe"] = {"tcpSocket": {"port": port}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"restartPolicy": restart, "automountServiceAccountToken": token, "enableServiceLinks": False,
                     "securityContext": POD_SECURITY, "containers": [container],
                     "volumes": [{"name": "tmp", "emptyDir": {}}]}}


def test_the_node_runs_the_pinned_kubelet_and_containerd(node: Node) -> None:
    found = node.get("node", NODE_NAME)
    pins = h.versions()
    info = found["status"]["nodeInfo"]
    assert info["kubeletVersion"] == pins["K8S_VERSION"]
    assert info["containerRuntimeVersion"] == f"containerd://{pins['CONTAINERD_VERSION'].removeprefix('v')}"
    assert "kwok.x-k8s.io/node" not in found["metadata"].get("annotations", {}), "a real node, not a KWOK one"
    ready = {c["type"]: c["status"] for c in found["status"]["conditions"]}
    assert ready["Ready"] == "True", found["status"]["conditions"]


def test_pods_reach_pods_services_dns_and_the_api(node: Node, namespace: str) -> None:
    token = uuid.uuid4().hex
    server = pod("web", ["sh", "-c", f"echo {token} > /tmp/token && cd /tmp && exec python -m http.server 8080"],
                 labels={"app": "web"}, port=8080)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    node.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [server, service]}), "-n", namespace)
    server_ip = node.wait_pod(namespace, "web")["status"]["podIP"]
    node.apply(json.dumps(pod("client", ["python", "-c", CLIENT], env={"SERVER_IP": server_ip}, restart="Never",
                              token=True)), "-n", namespace)
    node.wait_pod(namespace, "client", phase="Succeeded")
    out = json.loads(node.kubectl("logs", "-n", namespace, "client").stdout.strip().splitlines()[-1])

    assert out["uid"] == 10001, "the view-job image runs as the chart's user"
    assert out["service_ip"] == node.get("service", "web", "-n", namespace)["spec"]["clusterIP"]
    assert out["via_service"] == token, "ClusterIP Service routing (kube-proxy)"
    assert out["via_pod_ip"] == token, "pod to pod over the bridge"
    assert out["api_version"] == h.versions()["K8S_VERSION"], "the API through the kubernetes Service"
    assert out["memory_limit"] == 256 * 1024 * 1024, "the container's cgroup carries its memory limit"

    # the API server reaches the kubelet: exec (logs already did)
    assert node.kubectl("exec", "-n", namespace, "web", "--", "id", "-u").stdout.strip() == "10001"


def test_restricted_pod_security_is_enforced(node: Node, namespace: str) -> None:
    bad = pod("bad", ["sleep", "60"])
    bad["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True}
    res = node.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert res.returncode != 0
    assert 'violates PodSecurity "restricted' in res.stderr, res.stderr


PROBE = r"""
import json, os, socket, sys, time
until = time.monotonic() + float(os.environ.get("PROBE_UNTIL_OPEN", "0"))
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=4).close()
            out[target] = "open"
            break
        except OSError as exc:
            out[target] = type(exc).__name__
        if time.monotonic() > until:
            break
        time.sleep(1)
print(json.dumps(out))
"""


def probe_pod(node: Node, namespace: str, name: str, labels: dict[str, str], targets: list[str],
              until_open: float = 0) -> dict[str, str]:
    """A pod with ``labels`` that tries a TCP connection to each ``host:port``; what each attempt gave.
    ``until_open``: seconds it tries a target again while it is not open - for a pod a policy admits, as the
    node's policy controller adds a new pod's address to the policy's set a few seconds after the pod starts."""
    spec = pod(name, ["python", "-c", PROBE, *targets], restart="Never", labels=labels, cpu_request="50m",
               env={"PROBE_UNTIL_OPEN": str(until_open)})
    node.apply(json.dumps(spec), "-n", namespace)
    node.wait_pod(namespace, name, phase="Succeeded", timeout=300)
    return json.loads(node.kubectl("logs", "-n", namespace, name).stdout.strip().splitlines()[-1])


def test_network_policies_are_enforced(node: Node, namespace: str) -> None:
    """kube-router's firewall controller (node.sh, KAPPA_CLUSTER_NETPOL): a policy admitting only role=client
    lets that pod in and keeps another one out, by pod IP and through the Service; without a policy both get in."""
    import time

    server = pod("web", ["sh", "-c", "cd /tmp && exec python -m http.server 8080"], labels={"app": "web"}, port=8080)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    node.apply(json.dumps({"apiVersion": "v1", "kind": "List", "items": [server, service]}), "-n", namespace)
    ip = node.wait_pod(namespace, "web")["status"]["podIP"]
    targets = [f"{ip}:8080", "web:80"]
    assert set(probe_pod(node, namespace, "before", {"role": "other"}, targets).values()) == {"open"}

    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "web"},
              "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                                    "ports": [{"port": 8080, "protocol": "TCP"}]}]}}
    applied = time.monotonic()
    node.apply(json.dumps(policy), "-n", namespace)
    # the controller syncs on the policy's and the new pods' events: retry until it has (or give up)
    for attempt in range(20):
        denied = probe_pod(node, namespace, f"other-{attempt}", {"role": "other"}, targets)
        allowed = probe_pod(node, namespace, f"client-{attempt}", {"role": "client"}, targets)
        if "open" not in denied.values() and set(allowed.values()) == {"open"}:
            break
        assert time.monotonic() - applied < 180, f"not enforced after 180 s: allowed {allowed}, denied {denied}"
    print(f"policy applied -> enforced on attempt {attempt + 1}, {time.monotonic() - applied:.1f} s: "
          f"allowed {allowed}, denied {denied}")
    assert set(allowed.values()) == {"open"}, allowed
    assert "open" not in denied.values(), f"a pod outside the policy got in: {denied}"

"""The chart installed for real on a Kubernetes API server (not rendered offline): admission (Pod Security
``restricted``), the API's own validation, hook ordering, ``--wait`` on Deployments/StatefulSets/Jobs (KWOK marks
pods Ready and Jobs' pods Succeeded), upgrade, rollback and uninstall.

Not covered here, because no container runs: images, probes, the processes inside the pods.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.k8s.conftest import ROOT, Cluster

pytestmark = pytest.mark.k8s

CHART = str(ROOT / "helm" / "kappa")


def test_control_plane_serves_the_pinned_version_with_fake_nodes(cluster: Cluster):
    from tests.k8s.conftest import h

    raw = cluster.kubectl("get", "--raw", "/version").stdout
    assert f'"gitVersion": "{h.versions()["K8S_VERSION"]}"' in raw, raw
    nodes = cluster.get("nodes")["items"]
    assert nodes and all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
                         for n in nodes)


EXAMPLES = {
    # example: (value changed by the upgrade, the Deployment it changes, the text that shows it in the container)
    "local": ("viewJobs.groupedDriverMemory=1536m", "kappa-views", "1536m"),
    "production": ("viewJobs.resources.limits.memory=5Gi", "kappa-view-campaign-window-counts-v1", "5Gi"),
    "external-kafka": ("viewJobs.resources.limits.memory=7Gi", "kappa-view-events-raw-v1", "7Gi"),
}


def _prerequisites(cluster: Cluster, example: str, ns: str) -> set[tuple[str, str]]:
    """What docs/deploy.md asks to create before installing the example; returns the Secrets created."""
    secrets: dict[str, list[str]] = {}
    if example == "production":
        cluster.kubectl("apply", "-f", str(ROOT / "infra" / "cluster" / "monitoring-namespace.yaml"))  # dashboard
        _storage(cluster, "gp3", 3, ns)
        secrets = {"kappa-airflow-secrets": ["fernet-key", "api-secret-key", "jwt-secret", "admin-password"],
                   "kappa-airflow-db": ["connection"]}
    if example == "external-kafka":
        _storage(cluster, "efs-sc", 1, ns)  # the lake's RWX StorageClass
        secrets = {"kappa-kafka-credentials": ["username", "password"], "kappa-kafka-ca": ["ca.crt"]}
    for name, keys in secrets.items():
        cluster.kubectl("create", "secret", "generic", name, "-n", ns, *[f"--from-literal={k}=x" for k in keys])
    return {("Secret", name) for name in secrets}


def _container_text(cluster: Cluster, ns: str, deployment: str) -> str:
    c = cluster.get("deployment", deployment, "-n", ns)["spec"]["template"]["spec"]["containers"][0]
    return json.dumps({"args": c.get("args"), "env": c.get("env"), "resources": c.get("resources")})


def _kept_by_design(manifest: str) -> set[tuple[str, str]]:
    """What the release's manifest says survives an uninstall: objects annotated helm.sh/resource-policy: keep,
    and the claims of every StatefulSet's volumeClaimTemplates (Kubernetes does not delete those)."""
    kept = set()
    for doc in yaml.safe_load_all(manifest):
        if not doc:
            continue
        if (doc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
            kept.add((doc["kind"], doc["metadata"]["name"]))
        if doc["kind"] == "StatefulSet":
            for template in doc["spec"].get("volumeClaimTemplates") or []:
                for i in range(doc["spec"].get("replicas", 1)):
                    kept.add(("PersistentVolumeClaim", f"{template['metadata']['name']}-{doc['metadata']['name']}-{i}"))
    return kept


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_installs_upgrades_rolls_back_and_uninstalls(cluster: Cluster, example: str):
    """helm install --wait --wait-for-jobs into a namespace enforcing Pod Security restricted, an upgrade with a
    changed value, a rollback to the first revision, an uninstall that leaves exactly what is kept by design."""
    ns = cluster.restricted_namespace(f"kappa-{example}")
    ours = _prerequisites(cluster, example, ns)
    values = str(ROOT / "helm" / "kappa" / "examples" / f"{example}.yaml")
    change, deployment, shows = EXAMPLES[example]
    install = cluster.run("helm", "install", "kappa", CHART, "-n", ns, "-f", values, "--wait", "--wait-for-jobs",
                          "--timeout", "3m", "--debug")
    assert "STATUS: deployed" in install.stdout, install.stdout
    # order (Helm's own log): every workload Ready and the Airflow migrate Job complete, then the topics hook
    # Job, deleted once it succeeded
    log = install.stdout + install.stderr
    waited = log.index("wait for resources succeeded")
    hook = log.index("Watching for changes to Job kappa-topics")
    assert waited < hook < log.rindex('Starting delete for "kappa-topics" Job'), log[-3000:]
    if example == "production":  # an S3 lake: its check ran as a pre-install hook, before any workload
        check = log.index("Watching for changes to Job kappa-lake-check")
        assert check < log.rindex('Starting delete for "kappa-lake-check" Job') < waited, log[-3000:]
    assert "kappa-airflow-migrate" in cluster.run("helm", "get", "manifest", "kappa", "-n", ns).stdout
    deployments = cluster.get("deployments", "-n", ns)["items"]
    assert deployments and all(d["status"].get("readyReplicas") == d["spec"]["replicas"] for d in deployments)
    for s in cluster.get("statefulsets", "-n", ns)["items"]:
        assert s["status"].get("readyReplicas") == s["spec"]["replicas"], s["metadata"]["name"]
    pvcs = cluster.get("pvc", "-n", ns)["items"]
    assert all(p["status"]["phase"] == "Bound" for p in pvcs), [p["status"] for p in pvcs]
    assert "topics" not in json.dumps([j["metadata"]["name"] for j in cluster.get("jobs", "-n", ns)["items"]]), \
        "the topics hook Job is deleted once it succeeded"

    token = _sql_token(cluster, ns)
    assert token, "the SQL service runs in every example"

    upgrade = cluster.run("helm", "upgrade", "kappa", CHART, "-n", ns, "-f", values, "--set", change, "--wait",
                          "--wait-for-jobs", "--timeout", "3m")
    assert "has been upgraded" in upgrade.stdout, upgrade.stdout
    assert shows in _container_text(cluster, ns, deployment)
    assert _sql_token(cluster, ns) == token, "an upgrade keeps the SQL service's generated token (lookup)"
    cluster.run("helm", "rollback", "kappa", "1", "-n", ns, "--wait", "--timeout", "3m")
    history = json.loads(cluster.run("helm", "history", "kappa", "-n", ns, "-o", "json").stdout)
    assert [(h["revision"], h["status"]) for h in history][-1] == (3, "deployed"), history
    assert shows not in _container_text(cluster, ns, deployment)
    assert _sql_token(cluster, ns) == token

    kept = _kept_by_design(cluster.run("helm", "get", "manifest", "kappa", "-n", ns).stdout)
    cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m")
    cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", ns, "--timeout=120s")  # garbage collection
    left = _leftovers(cluster, ns)
    assert left - ours == kept, f"left: {sorted(left - ours)}, kept by design: {sorted(kept)}"


def _sql_token(cluster: Cluster, ns: str) -> str | None:
    """The SQL service's generated token (Secret kappa-sql), once its Deployment is Ready; None without the service."""
    if cluster.kubectl("get", "deployment", "kappa-sql", "-n", ns, check=False).returncode != 0:
        return None
    deployment = cluster.get("deployment", "kappa-sql", "-n", ns)
    assert deployment["status"].get("readyReplicas") == 1, deployment["status"]
    ref = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "KAPPA_SQL_TOKEN", "valueFrom": {"secretKeyRef": {"name": "kappa-sql", "key": "token"}}} in ref
    data = cluster.get("secret", "kappa-sql", "-n", ns)["data"]
    assert set(data) == {"token"} and len(data["token"]) >= 48, "48 random characters, base64"
    return data["token"]


def _leftovers(cluster: Cluster, ns: str) -> set[tuple[str, str]]:
    """Every object left in the namespace, except what Kubernetes itself puts in every namespace."""
    kinds = "deployments,statefulsets,jobs,pods,services,configmaps,secrets,serviceaccounts,roles,rolebindings," \
            "persistentvolumeclaims,networkpolicies,poddisruptionbudgets"
    items = cluster.get(kinds, "-n", ns)["items"]
    builtin = {("ConfigMap", "kube-root-ca.crt"), ("ServiceAccount", "default")}
    return {(o["kind"], o["metadata"]["name"]) for o in items} - builtin


def _monitoring_crds(cluster: Cluster) -> list[str]:
    """The prometheus-operator CRD manifests of the pinned module (the ones the offline checks validate with)."""
    import json as _json
    import subprocess

    from tests.k8s.conftest import h

    version = h.versions()["PROMETHEUS_OPERATOR_VERSION"]
    out = subprocess.run(["go", "mod", "download", "-json", f"github.com/prometheus-operator/prometheus-operator@{version}"],
                         capture_output=True, text=True, check=True, env={**cluster.env(), "GOFLAGS": "-mod=mod"})
    folder = _json.loads(out.stdout)["Dir"] + "/example/prometheus-operator-crd"
    return [f"{folder}/monitoring.coreos.com_{kind}.yaml" for kind in ("podmonitors", "prometheusrules")]


def _storage(cluster: Cluster, storage_class: str, count: int, ns: str) -> None:
    """PersistentVolumes of a StorageClass the example asks for (there is no provisioner)."""
    docs = [f"""apiVersion: v1
kind: PersistentVolume
metadata: {{name: {storage_class}-{ns}-pv-{i}}}
spec:
  storageClassName: {storage_class}
  capacity: {{storage: 2Ti}}
  accessModes: [ReadWriteOnce, ReadWriteMany]
  hostPath: {{path: /tmp/{storage_class}-{ns}-pv-{i}}}
""" for i in range(count)]
    import subprocess

    subprocess.run([str(cluster.bin / "kubectl"), "apply", "-f", "-"], input="---\n".join(docs), text=True,
                   check=True, capture_output=True, env=cluster.env())


def test_production_example_without_then_with_the_prometheus_operator(cluster: Cluster):
    """production.yaml on a cluster without the monitoring CRDs installs and says so; once they are served an
    upgrade creates the PodMonitor and PrometheusRule, validated by the API server against the CRDs."""
    ns = cluster.restricted_namespace("kappa-prod-monitoring")
    _prerequisites(cluster, "production", ns)
    production = str(ROOT / "helm" / "kappa" / "examples" / "production.yaml")
    install = cluster.run("helm", "install", "kappa", CHART, "-n", ns, "-f", production, "--wait",
                          "--wait-for-jobs", "--timeout", "3m")
    assert "the Prometheus operator API (monitoring.coreos.com/v1) was not found" in install.stdout, install.stdout
    assert not cluster.kubectl("get", "podmonitors", "-n", ns, check=False).returncode == 0
    for crd in _monitoring_crds(cluster):
        cluster.kubectl("apply", "--server-side", "-f", crd)
    cluster.kubectl("wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com",
                    "crd/prometheusrules.monitoring.coreos.com", "--timeout=60s")
    upgrade = cluster.run("helm", "upgrade", "kappa", CHART, "-n", ns, "-f", production, "--wait",
                          "--wait-for-jobs", "--timeout", "3m")
    assert "not found" not in upgrade.stdout
    assert cluster.get("podmonitors", "-n", ns)["items"] and cluster.get("prometheusrules", "-n", ns)["items"]
    sets = {s["metadata"]["name"]: s for s in cluster.get("statefulsets", "-n", ns)["items"]}
    assert sets["kappa-kafka"]["status"].get("readyReplicas") == 3
    cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m")

"""The chart installed for real on a Kubernetes API server (not rendered offline): admission (Pod Security
``restricted``), the API's own validation, hook ordering, ``--wait`` on Deployments/StatefulSets/Jobs (KWOK marks
pods Ready and Jobs' pods Succeeded), upgrade, rollback and uninstall.

Not covered here, because no container runs: images, probes, the processes inside the pods.
"""

from __future__ import annotations

import pytest

from tests.k8s.conftest import ROOT, Cluster

pytestmark = pytest.mark.k8s

CHART = str(ROOT / "helm" / "kappa")
LOCAL = str(ROOT / "helm" / "kappa" / "examples" / "local.yaml")


def test_control_plane_serves_the_pinned_version_with_fake_nodes(cluster: Cluster):
    from tests.k8s.conftest import h

    raw = cluster.kubectl("get", "--raw", "/version").stdout
    assert f'"gitVersion": "{h.versions()["K8S_VERSION"]}"' in raw, raw
    nodes = cluster.get("nodes")["items"]
    assert nodes and all(any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
                         for n in nodes)


def test_local_example_installs_upgrades_rolls_back_and_uninstalls(cluster: Cluster):
    ns = cluster.restricted_namespace("kappa-local")
    install = cluster.run("helm", "install", "kappa", CHART, "-n", ns, "-f", LOCAL, "--wait", "--wait-for-jobs",
                          "--timeout", "3m")
    assert "STATUS: deployed" in install.stdout, install.stdout
    deployments = {d["metadata"]["name"]: d for d in cluster.get("deployments", "-n", ns)["items"]}
    assert "kappa-views" in deployments, sorted(deployments)
    assert all(d["status"].get("readyReplicas") == d["spec"]["replicas"] for d in deployments.values())
    jobs = cluster.get("jobs", "-n", ns)["items"]
    sets = {s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]}
    assert {"kappa-kafka", "kappa-postgresql"} <= sets, sets
    pvcs = cluster.get("pvc", "-n", ns)["items"]
    assert pvcs and all(p["status"]["phase"] == "Bound" for p in pvcs), [p["status"] for p in pvcs]
    print("jobs after install:", [j["metadata"]["name"] for j in jobs])

    upgrade = cluster.run("helm", "upgrade", "kappa", CHART, "-n", ns, "-f", LOCAL, "--set",
                          "viewJobs.groupedDriverMemory=1g", "--wait", "--wait-for-jobs", "--timeout", "3m")
    assert "has been upgraded" in upgrade.stdout, upgrade.stdout
    args = cluster.get("deployment", "kappa-views", "-n", ns)["spec"]["template"]["spec"]["containers"][0]
    assert "1g" in " ".join(args.get("args", []) + [e.get("value", "") for e in args.get("env", [])]), args

    cluster.run("helm", "rollback", "kappa", "1", "-n", ns, "--wait", "--timeout", "3m")
    history = cluster.run("helm", "history", "kappa", "-n", ns, "-o", "json").stdout
    assert '"revision":3' in history.replace(" ", "") and '"status":"deployed"' in history.replace(" ", "")
    args = cluster.get("deployment", "kappa-views", "-n", ns)["spec"]["template"]["spec"]["containers"][0]
    assert "1g" not in " ".join(args.get("args", []) + [e.get("value", "") for e in args.get("env", [])])

    cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m")
    # what stays is what docs/deploy.md says stays: the generated Secrets (helm.sh/resource-policy: keep) and the
    # StatefulSets' data PVCs (Kubernetes keeps volumeClaimTemplates' claims); local.yaml drops the lake PVC
    assert _leftovers(cluster, ns) == {
        ("Secret", "kappa-airflow"), ("Secret", "kappa-kafka-kraft"), ("Secret", "kappa-postgresql"),
        ("PersistentVolumeClaim", "data-kappa-kafka-0"), ("PersistentVolumeClaim", "data-kappa-postgresql-0")}


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


def _storage(cluster: Cluster, storage_class: str, count: int) -> None:
    """PersistentVolumes of a StorageClass the example asks for (there is no provisioner)."""
    docs = [f"""apiVersion: v1
kind: PersistentVolume
metadata: {{name: {storage_class}-pv-{i}}}
spec:
  storageClassName: {storage_class}
  capacity: {{storage: 2Ti}}
  accessModes: [ReadWriteOnce, ReadWriteMany]
  hostPath: {{path: /tmp/{storage_class}-pv-{i}}}
""" for i in range(count)]
    import subprocess

    subprocess.run([str(cluster.bin / "kubectl"), "apply", "-f", "-"], input="---\n".join(docs), text=True,
                   check=True, capture_output=True, env=cluster.env())


def test_production_example_without_then_with_the_prometheus_operator(cluster: Cluster):
    """production.yaml on a cluster without the monitoring CRDs installs and says so; once they are served an
    upgrade creates the PodMonitor and PrometheusRule, validated by the API server against the CRDs."""
    ns = cluster.restricted_namespace("kappa-prod")
    cluster.kubectl("apply", "-f", str(ROOT / "infra" / "cluster" / "monitoring-namespace.yaml"))  # dashboard
    _storage(cluster, "gp3", 4)
    for name in ("kappa-airflow-secrets", "kappa-airflow-db"):  # the example's prerequisites (docs/deploy.md)
        cluster.kubectl("create", "secret", "generic", name, "-n", ns, "--from-literal=connection=postgresql://x",
                        "--from-literal=fernet-key=x", "--from-literal=api-secret-key=x",
                        "--from-literal=jwt-secret=x", "--from-literal=admin-password=x")
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


def test_external_kafka_example_installs_without_brokers(cluster: Cluster):
    ns = cluster.restricted_namespace("kappa-ext")
    _storage(cluster, "efs-sc", 1)  # the example's RWX StorageClass for the lake
    cluster.kubectl("create", "secret", "generic", "kappa-kafka-credentials", "-n", ns,
                    "--from-literal=username=kappa", "--from-literal=password=x")
    cluster.kubectl("create", "secret", "generic", "kappa-kafka-ca", "-n", ns, "--from-literal=ca.crt=x")
    example = str(ROOT / "helm" / "kappa" / "examples" / "external-kafka.yaml")
    cluster.run("helm", "install", "kappa", CHART, "-n", ns, "-f", example, "--wait", "--wait-for-jobs",
                "--timeout", "3m")
    sets = {s["metadata"]["name"] for s in cluster.get("statefulsets", "-n", ns)["items"]}
    assert "kappa-kafka" not in sets, "an external cluster: no bundled brokers"
    cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m")

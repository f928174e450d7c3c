"""The production example as this machine's three nodes install it (``helm/kappa/examples/production.yaml`` then
``infra/k8s/production/values.yaml``, docs/deploy.md "The production example on three nodes"), rendered: the values
replace only what cannot exist here - registry, storage class, IRSA, sizes - and keep what production.yaml promises.
``make test-production`` installs the same on the nodes.
"""

from __future__ import annotations

import re

import pytest
import yaml

import deploy_helpers as h
from kappa.objectstore import DEFAULT_PORTS

pytestmark = pytest.mark.deploy

HERE = h.ROOT / "infra" / "k8s" / "production"
OPERATOR_API = ["monitoring.coreos.com/v1"]


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    return h.render(h.CHART / "examples" / "production.yaml", HERE / "values.yaml", api_versions=OPERATOR_API)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_image_is_one_built_here_and_never_pulled(objs: list[dict]) -> None:
    for w in h.workloads(objs):
        spec = h.pod_spec(w)
        assert not spec.get("imagePullSecrets"), w["metadata"]["name"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            assert c["image"].startswith("localhost/kappa/"), (w["metadata"]["name"], c["image"])
            assert c["imagePullPolicy"] == "Never", (w["metadata"]["name"], c["name"])


def test_three_brokers_on_dynamic_volumes_with_production_replication(objs: list[dict]) -> None:
    kafka = h.named(objs, "StatefulSet", "kappa-kafka")
    assert kafka["spec"]["replicas"] == 3
    spread = h.pod_spec(kafka)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert spread == [{"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {
        k: v for k, v in h.pod_labels(kafka).items() if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}}}]
    assert [t["spec"]["storageClassName"] for t in kafka["spec"]["volumeClaimTemplates"]] == ["local-path"]
    config = "\n".join(h.named(objs, "ConfigMap", "kappa-kafka")["data"].values())
    assert "min.insync.replicas=2" in config
    topics = "\n".join(h.named(objs, "ConfigMap", "kappa-topics")["data"].values())
    assert re.findall(r"replication_factor: (\d+)", topics) and set(re.findall(r"replication_factor: (\d+)", topics)) == {"3"}


def test_the_lake_is_the_object_store_of_the_host_with_a_credential_secret_not_a_role(objs: list[dict]) -> None:
    values = yaml.safe_load((HERE / "values.yaml").read_text())
    node_sh = (h.ROOT / "infra" / "k8s" / "node.sh").read_text()
    bridge = re.search(r"NODES_NET=(\d+\.\d+\.\d+);", node_sh).group(1)
    assert values["lake"]["s3"]["endpoint"] == f"http://{bridge}.1:{DEFAULT_PORTS.s3}", \
        "the host's address on the nodes' bridge, the store's S3 port"
    for sa in h.by_kind(objs, "ServiceAccount"):
        assert "eks.amazonaws.com/role-arn" not in sa["metadata"].get("annotations", {}), sa["metadata"]["name"]
    platform = h.named(objs, "ConfigMap", "kappa-platform-env")["data"]
    assert platform["AWS_ENDPOINT_URL"] == values["lake"]["s3"]["endpoint"] and platform["AWS_ALLOW_HTTP"] == "true"
    assert platform["KAPPA_LAKE_URI"] == "s3a://kappa/production"
    drivers = [d for d in h.by_kind(objs, "Deployment") if h.pod_labels(d).get("app.kubernetes.io/component") == "view"]
    assert sorted(h.pod_labels(d)["kappa.io/view"] for d in drivers) == ["ad_events_archive", "campaign_window_counts"]
    for d in drivers:
        container = h.pod_spec(d)["containers"][0]
        assert {"configMapRef": {"name": "kappa-platform-env"}} in container["envFrom"]
        assert _env(container)["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "kappa-lake-s3"


def test_each_executor_is_kept_off_its_own_drivers_node(objs: list[dict]) -> None:
    spark = h.named(objs, "ConfigMap", "kappa-spark-conf")
    template = yaml.safe_load(spark["data"]["executor-pod-template.yaml"])
    terms = template["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{"topologyKey": "kubernetes.io/hostname",
                      "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "view"}},
                      "matchLabelKeys": ["kappa.io/view", "kappa.io/view-version"]}]
    drivers = [d for d in h.by_kind(objs, "Deployment") if h.pod_labels(d).get("app.kubernetes.io/component") == "view"]
    assert drivers
    for d in drivers:  # what matchLabelKeys takes from an executor: the labels its driver gives it and wears itself
        labels, text = h.pod_labels(d), yaml.safe_dump(d)
        for key in ("kappa.io/view", "kappa.io/view-version"):
            assert f"spark.kubernetes.executor.label.{key}={labels[key]}" in text, (d["metadata"]["name"], key)


def test_airflow_uses_the_external_database_and_the_secret_made_beforehand(objs: list[dict]) -> None:
    assert not [s for s in h.by_kind(objs, "StatefulSet") if "postgresql" in s["metadata"]["name"]]
    scheduler = h.named(objs, "Deployment", "kappa-airflow-scheduler")
    refs = yaml.safe_dump(h.pod_spec(scheduler))
    assert "kappa-airflow-db" in refs and "kappa-airflow-secrets" in refs


def test_the_external_database_runs_restricted_on_a_dynamic_volume() -> None:
    docs = list(yaml.safe_load_all((HERE / "airflow-database.yaml").read_text()))
    ns = next(d for d in docs if d["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    local = yaml.safe_load((h.ROOT / "infra" / "images" / "local-values.yaml").read_text())
    image = local["airflow"]["postgresql"]["image"]
    assert container["image"] == f"{image['registry']}/{image['repository']}:{image['tag']}", \
        "the image the chart's own PostgreSQL runs"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "local-path"
    service = next(d for d in docs if d["kind"] == "Service")
    script = (HERE / "prerequisites.sh").read_text()
    assert f"@{service['metadata']['name']}.{ns['metadata']['name']}.svc:5432/airflow" in script

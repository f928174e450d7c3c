"""Render tests of helm/kappa: selectors, one driver per view version, security, topics, schema, NOTES."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import deploy_helpers as h

pytestmark = pytest.mark.deploy

SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance"}
REQUIRED_LABELS = SELECTOR_KEYS | {
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
}


# ------------------------------------------------------------------------------------------ lint / symlink
def test_files_platform_yaml_is_the_symlink_to_kappa_platform_yaml() -> None:
    link = h.CHART / "files" / "platform.yaml"
    assert link.is_symlink(), "helm/kappa/files/platform.yaml must be a symlink (one list of topics/views)"
    assert Path(link.readlink()).as_posix() == "../../../kappa/platform.yaml"
    assert link.resolve() == h.PLATFORM.resolve()


@pytest.mark.parametrize("values", [None, *h.EXAMPLES], ids=lambda v: "defaults" if v is None else v.stem)
def test_helm_lint_strict(helm: Path, values: Path | None) -> None:
    out = h.lint(*(["-f", str(values)] if values else []))
    assert "0 chart(s) failed" in out


def test_helm_follows_the_platform_symlink(default_objs: list[dict]) -> None:
    # the topics ConfigMap carries the file's content: helm read through the link
    data = h.configmap_data(default_objs, "kappa-topics")["platform.yaml"]
    assert yaml.safe_load(data) == h.platform()


# ------------------------------------------------------------------------------------------ labels/selectors
def test_every_object_has_the_standard_labels(all_renders: dict[str, list[dict]]) -> None:
    for case, objs in all_renders.items():
        for o in objs:
            labels = o["metadata"].get("labels", {})
            missing = REQUIRED_LABELS - labels.keys()
            assert not missing, f"{case}: {o['kind']}/{o['metadata']['name']} lacks {sorted(missing)}"
            assert labels["app.kubernetes.io/instance"] == h.RELEASE
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["app.kubernetes.io/part-of"] == "kappa"


def test_selectors_use_only_name_and_instance_and_are_unique(all_renders: dict[str, list[dict]]) -> None:
    for case, objs in all_renders.items():
        seen: dict[tuple, str] = {}
        for o in h.workloads(objs):
            if o["kind"] == "Job":
                continue  # Jobs get a controller-generated selector
            sel = o["spec"]["selector"]
            assert set(sel) == {"matchLabels"}, f"{case}: {o['metadata']['name']}: matchExpressions in selector"
            ml = sel["matchLabels"]
            assert set(ml) == SELECTOR_KEYS, f"{case}: {o['metadata']['name']} selector keys {sorted(ml)}"
            assert ml.items() <= h.pod_labels(o).items(), f"{case}: {o['metadata']['name']}: selector does not match pods"
            key = tuple(sorted(ml.items()))
            assert key not in seen, f"{case}: {o['metadata']['name']} and {seen[key]} share a selector"
            seen[key] = o["metadata"]["name"]
        for svc in h.by_kind(objs, "Service"):
            assert set(svc["spec"]["selector"]) == SELECTOR_KEYS, f"{case}: Service {svc['metadata']['name']}"
        for pdb in h.by_kind(objs, "PodDisruptionBudget"):
            assert set(pdb["spec"]["selector"]["matchLabels"]) == SELECTOR_KEYS


def test_selectors_do_not_change_across_versions(helm: Path) -> None:
    # selectors are immutable: they must not contain the chart or app version
    a = h.render()
    b = h.render(sets=["image.tag=9.9.9"])
    sel = {o["metadata"]["name"]: o["spec"]["selector"] for o in h.workloads(a) if o["kind"] != "Job"}
    assert sel == {o["metadata"]["name"]: o["spec"]["selector"] for o in h.workloads(b) if o["kind"] != "Job"}
    for s in sel.values():
        assert "app.kubernetes.io/version" not in s["matchLabels"]
        assert "helm.sh/chart" not in s["matchLabels"]


def test_every_service_selects_a_rendered_workload(all_renders: dict[str, list[dict]]) -> None:
    for case, objs in all_renders.items():
        pods = [h.pod_labels(w) for w in h.workloads(objs)]
        for svc in h.by_kind(objs, "Service"):
            sel = svc["spec"]["selector"]
            assert any(sel.items() <= p.items() for p in pods), f"{case}: Service {svc['metadata']['name']} selects nothing"


# ------------------------------------------------------------------------------------------ view drivers
def test_one_driver_per_declared_default_version(default_objs: list[dict]) -> None:
    views = h.platform()["views"]
    drivers = h.view_deployments(default_objs)
    got = sorted((d["metadata"]["labels"]["kappa.io/view"], d["metadata"]["labels"]["kappa.io/view-version"]) for d in drivers)
    assert got == sorted((v, str(decl["default_version"])) for v, decl in views.items())
    for d in drivers:
        assert d["spec"]["replicas"] == 1
        assert d["spec"]["strategy"] == {"type": "Recreate"}, "a rolling update would run two drivers on one checkpoint"
        c = h.pod_spec(d)["containers"][0]
        view, version = d["metadata"]["labels"]["kappa.io/view"], d["metadata"]["labels"]["kappa.io/view-version"]
        assert c["args"][:6] == ["kappa", "view", "run", view, "--version", version]
        assert c["args"][c["args"].index("--metrics-port") + 1] == "9400"
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]


def _platform_with_versions(**versions: list[int]) -> dict:
    p = h.platform()
    for view, vs in versions.items():
        module = next(iter(p["views"][view]["versions"].values()))["module"]
        p["views"][view]["versions"] = {v: {"module": module.replace(".v1", f".v{v}")} for v in vs}
    return p


def test_view_versions_override_runs_one_driver_each(helm: Path, tmp_path: Path) -> None:
    chart = h.chart_copy_with_platform(tmp_path, _platform_with_versions(user_sessions=[1, 2, 3]))
    objs = h.render({"views": {"user_sessions": {"versions": [1, 3], "starting": "latest"}, "events_raw": {"versions": []}}},
                    chart=chart, tmp_dir=tmp_path)
    drivers = {(d["metadata"]["labels"]["kappa.io/view"], d["metadata"]["labels"]["kappa.io/view-version"]): d
               for d in h.view_deployments(objs)}
    assert ("user_sessions", "1") in drivers and ("user_sessions", "3") in drivers
    assert ("user_sessions", "2") not in drivers, "only the versions listed in values run"
    assert not any(v == "events_raw" for v, _ in drivers), "versions: [] runs no driver"
    assert len(drivers) == len(h.view_deployments(objs)), "one Deployment per view version"
    names = [d["metadata"]["name"] for d in drivers.values()]
    assert len(set(names)) == len(names)
    assert drivers[("user_sessions", "3")]["metadata"]["name"] == "kappa-view-user-sessions-v3"
    args = h.pod_spec(drivers[("user_sessions", "3")])["containers"][0]["args"]
    assert args[args.index("--starting") + 1] == "latest"


def test_duplicate_or_undeclared_versions_are_refused(helm: Path, tmp_path: Path) -> None:
    chart = h.chart_copy_with_platform(tmp_path, _platform_with_versions(user_sessions=[1, 2]))
    err = h.render_error({"views": {"user_sessions": {"versions": [3]}}}, chart=chart, tmp_dir=tmp_path)
    assert "version 3 is not declared" in err
    # duplicates are rejected by the values schema (uniqueItems) before any template runs
    err = h.render_error({"views": {"user_sessions": {"versions": [2, 2]}}}, chart=chart, tmp_dir=tmp_path)
    assert "views/user_sessions/versions" in err
    err = h.render_error({"views": {"no_such_view": {"versions": [1]}}}, tmp_dir=tmp_path)
    assert "no such view in kappa/platform.yaml" in err


def test_spark_kubernetes_mode(all_renders: dict[str, list[dict]]) -> None:
    objs = all_renders["spark-kubernetes"]
    drivers = h.view_deployments(objs)
    services = {s["metadata"]["name"]: s for s in h.by_kind(objs, "Service")}
    for d in drivers:
        name = d["metadata"]["name"]
        svc = services[f"{name}-driver"]
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        c = h.pod_spec(d)["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        submit = env["PYSPARK_SUBMIT_ARGS"]["value"]
        assert f"spark.driver.host={name}-driver.kappa.svc.cluster.local" in submit
        assert "spark.kubernetes.driver.pod.name=$(POD_NAME)" in submit and submit.endswith("pyspark-shell")
        assert list(env).index("POD_NAME") < list(env).index("PYSPARK_SUBMIT_ARGS"), "$(POD_NAME) needs POD_NAME first"
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts, "the driver calls the API"
    env_cm = h.configmap_data(objs, "kappa-platform-env")
    assert env_cm["KAPPA_SPARK_MASTER"].startswith("k8s://https://kubernetes.default.svc")
    role = h.named(objs, "Role", "kappa-spark-driver")
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"pods", "configmaps"}
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])
    conf = h.configmap_data(objs, "kappa-spark-conf")
    template = yaml.safe_load(conf["executor-pod-template.yaml"])
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    assert template["spec"]["automountServiceAccountToken"] is False
    _assert_restricted_container(template["spec"]["containers"][0], "executor template")
    assert "spark.kubernetes.executor.podTemplateFile" in conf["spark-defaults.conf"]
    defaults = dict(line.split(None, 1) for line in conf["spark-defaults.conf"].splitlines()
                    if line.strip() and not line.lstrip().startswith("#"))
    # Spark would delete Services at stop (not granted: a 403 at ERROR) and time out on the driver's readiness at 1 s
    assert defaults["spark.kubernetes.driver.service.deleteOnTermination"] == "false"
    assert defaults["spark.kubernetes.allocation.driver.readinessTimeout"] == "90s"
    # local mode: no Role, no driver Service, no API token in the driver
    local = all_renders["defaults"]
    assert not h.by_kind(local, "Role") or all(r["metadata"]["name"] != "kappa-spark-driver" for r in h.by_kind(local, "Role"))
    assert not [s for s in h.by_kind(local, "Service") if s["metadata"]["name"].endswith("-driver")]
    assert h.configmap_data(local, "kappa-platform-env")["KAPPA_SPARK_MASTER"] == "local[2]"
    # drivers bind /metrics on loopback unless told otherwise; a pod must be scrapeable on its IP
    assert h.configmap_data(local, "kappa-platform-env")["KAPPA_METRICS_ADDR"] == "0.0.0.0"


# ------------------------------------------------------------------------------------------ pod security
def _assert_restricted_container(c: dict, where: str) -> None:
    sc = c.get("securityContext", {})
    assert sc.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: capabilities.drop"
    assert not sc.get("capabilities", {}).get("add"), f"{where}: capabilities.add"
    assert sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot"
    assert sc.get("privileged") is not True, f"{where}: privileged"
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{where}: seccompProfile"
    assert sc.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem"


def test_every_container_is_restricted_with_resources_and_probes(all_renders: dict[str, list[dict]]) -> None:
    checked = 0
    for case, objs in all_renders.items():
        for w in h.workloads(objs):
            spec = h.pod_spec(w)
            where = f"{case}: {w['kind']}/{w['metadata']['name']}"
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, where
            assert psc["seccompProfile"]["type"] == "RuntimeDefault", where
            assert spec["automountServiceAccountToken"] is False, f"{where}: tokens are mounted explicitly only"
            assert spec.get("serviceAccountName"), f"{where}: runs as the namespace's default ServiceAccount"
            for key in ("hostNetwork", "hostPID", "hostIPC"):
                assert not spec.get(key), f"{where}: {key}"
            for vol in spec.get("volumes", []):
                assert "hostPath" not in vol, f"{where}: hostPath volume {vol['name']}"
            for c in spec.get("initContainers", []) + spec["containers"]:
                cw = f"{where}/{c['name']}"
                _assert_restricted_container(c, cw)
                res = c.get("resources", {})
                for part in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(res.get(part, {})), f"{cw}: resources.{part}"
                assert ":" in c["image"] or "@sha256:" in c["image"], f"{cw}: unpinned image {c['image']}"
                assert not c["image"].endswith(":latest"), cw
                for e in c.get("env", []):
                    assert not (e["name"].endswith(("PASSWORD", "SECRET", "SECRET_KEY", "JWT_SECRET", "FERNET_KEY", "SECRET_ACCESS_KEY"))
                                and "value" in e), f"{cw}: {e['name']} given as a literal instead of a secretKeyRef"
                checked += 1
            # probes: long-running containers only (a Job runs to completion; init containers are one-shot)
            if w["kind"] != "Job":
                for c in spec["containers"]:
                    assert "livenessProbe" in c, f"{where}/{c['name']}: probes"
                    # readiness where a Service may route to it; Airflow's dag processor and triggerer serve
                    # nothing (liveness: `airflow jobs check`)
                    if w["metadata"]["name"].endswith(("-airflow-dag-processor", "-airflow-triggerer")):
                        assert "readinessProbe" not in c and "jobs" in c["livenessProbe"]["exec"]["command"], \
                            f"{where}/{c['name']}"
                    else:
                        assert "readinessProbe" in c, f"{where}/{c['name']}: probes"
    assert checked > 50


def _millicores(quantity: str | int | float) -> int:
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def test_the_local_example_fits_a_2_core_node_with_two_replays_beside_it(all_renders: dict[str, list[dict]]) -> None:
    """docs/deploy.md section 5 installs examples/local.yaml on one 2-core node: the CPU requests of every
    long-running pod, two replay drivers (a replay and the one its cascade starts) and the node's CoreDNS (50m,
    infra/k8s/node.sh) fit its 2 cores - a driver that does not fit stays Pending - and the scheduler, where a
    replay's verification runs its local Spark, has the largest share of a busy node (at 100m it got 0.13 cores
    beside the views and a replay's driver, and a check of 76,000 records starved)."""
    values = yaml.safe_load((h.CHART / "examples" / "local.yaml").read_text())
    driver = _millicores(values["viewJobs"]["resources"]["requests"]["cpu"])
    requests: dict[str, int] = {}
    for w in h.workloads(all_renders["local"]):
        if w["kind"] in ("Deployment", "StatefulSet"):
            replicas = w["spec"].get("replicas", 1)
            requests[w["metadata"]["name"]] = replicas * sum(
                _millicores(c["resources"]["requests"]["cpu"]) for c in h.pod_spec(w)["containers"])
    total = sum(requests.values()) + 2 * driver + 50
    assert total <= 2000, f"{total}m requested on a 2-core node: {requests}, drivers 2 x {driver}m, CoreDNS 50m"
    scheduler = next(v for k, v in requests.items() if k.endswith("-airflow-scheduler"))
    assert scheduler == max(requests.values()) and scheduler > driver, requests


def test_api_token_only_where_needed(all_renders: dict[str, list[dict]]) -> None:
    objs = all_renders["defaults"]
    with_token = sorted(
        w["metadata"]["name"] for w in h.workloads(objs)
        if any(v.get("projected", {}).get("sources", [{}])[0].get("serviceAccountToken") for v in h.pod_spec(w).get("volumes", []))
    )
    assert with_token == ["kappa-airflow-scheduler", "kappa-airflow-triggerer"]


def test_no_default_passwords(all_renders: dict[str, list[dict]]) -> None:
    a = h.render()
    b = h.render(sets=["commonLabels.render=second"])  # a second render: generated secrets differ (random, not fixed)
    for name in ("kappa-airflow", "kappa-postgresql"):
        sa, sb = h.named(a, "Secret", name), h.named(b, "Secret", name)
        assert sa["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        for key, value in sa["data"].items():
            assert value != sb["data"][key], f"Secret {name}/{key} is a fixed default"
            assert len(value) >= 24
    prod = all_renders["production"]
    assert not [s for s in h.by_kind(prod, "Secret") if s["metadata"]["name"] in ("kappa-airflow", "kappa-postgresql")], \
        "existing Secrets are used as given"


# ------------------------------------------------------------------------------------------ topics
def test_topics_configmap_matches_platform_yaml_exactly(all_renders: dict[str, list[dict]]) -> None:
    raw = h.PLATFORM.read_text()
    for case in ("defaults", "local"):
        data = h.configmap_data(all_renders[case], "kappa-topics")["platform.yaml"]
        assert data.rstrip("\n") == raw.rstrip("\n"), f"{case}: the topics ConfigMap must be kappa/platform.yaml verbatim"


def test_topics_replication_factor_override_changes_only_that(all_renders: dict[str, list[dict]]) -> None:
    declared = h.platform()
    rendered = yaml.safe_load(h.configmap_data(all_renders["production"], "kappa-topics")["platform.yaml"])
    assert set(rendered["topics"]) == set(declared["topics"])
    for name, topic in declared["topics"].items():
        got = rendered["topics"][name]
        assert got["replication_factor"] == 3
        assert {k: v for k, v in got.items() if k != "replication_factor"} == \
               {k: v for k, v in topic.items() if k != "replication_factor"}
    assert rendered["views"] == declared["views"]


def test_topics_job_is_a_hook_that_mounts_the_declarations(default_objs: list[dict]) -> None:
    job = h.named(default_objs, "Job", "kappa-topics")
    ann = job["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"post-install", "post-upgrade"}
    spec = h.pod_spec(job)
    c = spec["containers"][0]
    assert c["args"] == ["kappa", "topics", "ensure"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "platform")
    assert mount["mountPath"] == "/opt/kappa/kappa/platform.yaml" and mount["subPath"] == "platform.yaml"
    vol = next(v for v in spec["volumes"] if v["name"] == "platform")
    assert vol["configMap"]["name"] == "kappa-topics"
    env = h.configmap_data(default_objs, "kappa-platform-env")
    assert env["KAPPA_KAFKA_BOOTSTRAP"] == "kappa-kafka.kappa.svc.cluster.local:9092"


def test_bundled_topics_must_fit_the_broker_count(helm: Path, tmp_path: Path) -> None:
    err = h.render_error({"kafka": {"topics": {"replicationFactor": 3}}}, tmp_dir=tmp_path)
    assert "needs replication factor 3 but kafka.replicas=1" in err


# ------------------------------------------------------------------------------------------ Kafka
def test_kafka_kraft_statefulset(all_renders: dict[str, list[dict]]) -> None:
    one = h.named(all_renders["defaults"], "StatefulSet", "kappa-kafka")
    three = h.named(all_renders["production"], "StatefulSet", "kappa-kafka")
    assert one["spec"]["replicas"] == 1 and three["spec"]["replicas"] == 3
    assert three["spec"]["podManagementPolicy"] == "Parallel"
    assert h.pod_spec(three)["containers"][0]["image"] == f"docker.io/apache/kafka:{h.versions()['KAFKA_VERSION']}"
    assert three["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "500Gi"
    props = h.configmap_data(all_renders["production"], "kappa-kafka")["server.properties"]
    voters = next(line for line in props.splitlines() if line.startswith("controller.quorum.voters="))
    assert voters.count("@") == 3 and "kappa-kafka-2.kappa-kafka-headless.kappa.svc.cluster.local:9093" in voters
    assert "min.insync.replicas=2" in props and "auto.create.topics.enable=false" in props
    assert "min.insync.replicas=1" in h.configmap_data(all_renders["defaults"], "kappa-kafka")["server.properties"]
    headless = h.named(all_renders["production"], "Service", "kappa-kafka-headless")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert h.named(all_renders["production"], "PodDisruptionBudget", "kappa-kafka")["spec"]["maxUnavailable"] == 1


def test_external_kafka_has_no_brokers_and_credentials_from_secrets(all_renders: dict[str, list[dict]]) -> None:
    objs = all_renders["external-kafka"]
    assert not h.by_kind(objs, "StatefulSet") or all(s["metadata"]["name"] != "kappa-kafka" for s in h.by_kind(objs, "StatefulSet"))
    env = h.configmap_data(objs, "kappa-platform-env")
    assert env["KAPPA_KAFKA_BOOTSTRAP"].startswith("b-1.kafka.example.com:9096")
    assert env["KAPPA_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["KAPPA_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["KAPPA_KAFKA_SSL_CA_LOCATION"] == "/etc/kappa/kafka-ca/ca.crt"
    for d in h.view_deployments(objs) + [h.named(objs, "Job", "kappa-topics")]:
        c = h.pod_spec(d)["containers"][0]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]}
        assert refs["KAPPA_KAFKA_SASL_PASSWORD"] == {"name": "kappa-kafka-credentials", "key": "password"}
        assert any(m["mountPath"] == "/etc/kappa/kafka-ca" for m in c["volumeMounts"])


# ------------------------------------------------------------------------------------------ network policies
def _selected(policy: dict, labels: dict) -> bool:
    sel = policy["spec"]["podSelector"]
    if not sel.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in sel.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_every_pod_is_covered_by_a_network_policy(all_renders: dict[str, list[dict]]) -> None:
    for case, objs in all_renders.items():
        policies = h.by_kind(objs, "NetworkPolicy")
        for w in h.workloads(objs):
            assert any(_selected(p, h.pod_labels(w)) for p in policies), f"{case}: {w['metadata']['name']} has no NetworkPolicy"


def test_kafka_reachable_only_from_the_release_workloads(default_objs: list[dict]) -> None:
    pol = h.named(default_objs, "NetworkPolicy", "kappa-kafka")
    rules = {r["ports"][0]["port"]: r["from"] for r in pol["spec"]["ingress"]}
    assert set(rules) == {9092, 9093}
    assert rules[9092] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "kappa", "app.kubernetes.io/instance": "kappa"}}}]
    assert rules[9093] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kappa-kafka", "app.kubernetes.io/instance": "kappa"}}}]
    for w in h.workloads(default_objs):  # every platform pod may talk to Kafka
        assert rules[9092][0]["podSelector"]["matchLabels"].items() <= h.pod_labels(w).items()


def test_metrics_only_from_prometheus_and_the_release_s_airflow_scheduler(default_objs: list[dict],
                                                                          tmp_path: Path) -> None:
    """Prometheus scrapes the drivers' metrics; the release's Airflow scheduler reads them too (the replay's watch
    task judges a promoted version on them: without it every in-cluster watch saw the metrics unreachable)."""
    scheduler = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kappa-airflow-scheduler",
                                                 "app.kubernetes.io/instance": "kappa"}}}
    pol = h.named(default_objs, "NetworkPolicy", "kappa-view")
    assert pol["spec"]["ingress"] == [{
        "ports": [{"port": "metrics", "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}, scheduler],
    }]
    scheduler_pod = next(d for d in default_objs if d["kind"] == "Deployment"
                         and d["metadata"]["name"] == "kappa-airflow-scheduler")
    labels = scheduler_pod["spec"]["template"]["metadata"]["labels"]
    assert scheduler["podSelector"]["matchLabels"].items() <= labels.items(), "the peer selects the scheduler's pods"
    without = h.named(h.render({"airflow": {"enabled": False}}, tmp_dir=tmp_path), "NetworkPolicy", "kappa-view")
    assert scheduler not in without["spec"]["ingress"][0]["from"], "no Airflow, no peer"


# ------------------------------------------------------------------------------------------ lake
def test_lake_pvc_and_s3(all_renders: dict[str, list[dict]]) -> None:
    local = all_renders["defaults"]
    pvc = h.named(local, "PersistentVolumeClaim", "kappa-lake")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert h.configmap_data(local, "kappa-platform-env")["KAPPA_LAKE_URI"] == "/data/lake"
    for d in h.view_deployments(local):  # RWO: co-located with every other lake pod
        term = h.pod_spec(d)["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["labelSelector"]["matchLabels"] == {"kappa.io/lake-claim": "kappa-lake"}
        assert h.pod_labels(d)["kappa.io/lake-claim"] == "kappa-lake"
    prod = all_renders["production"]
    assert not h.by_kind(prod, "PersistentVolumeClaim")
    assert h.configmap_data(prod, "kappa-platform-env")["KAPPA_LAKE_URI"] == "s3a://example-kappa-lake/prod"
    sa = h.named(prod, "ServiceAccount", "kappa-view")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/kappa-prod-jobs")
    assert "DefaultCredentialsProvider" in h.configmap_data(prod, "kappa-spark-conf")["spark-defaults.conf"]


# ------------------------------------------------------------------------------------------ values schema
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kafka": {"replica": 3}}, "additional properties 'replica' not allowed"),
        ({"bogus": True}, "additional properties 'bogus' not allowed"),
        ({"kafka": {"replicas": "3"}}, "got string, want integer"),
        ({"kafka": {"replicas": 2}}, "kafka/replicas"),
        ({"viewJobs": {"spark": {"mode": "yarn"}}}, "viewJobs/spark/mode"),
        ({"viewJobs": {"resources": {"limits": None}}}, "missing property 'limits'"),
        ({"viewJobs": {"resources": {"limits": {"cpu": "2", "memory": "lots"}}}}, "viewJobs/resources/limits/memory"),
        ({"lake": {"type": "nfs"}}, "lake/type"),
        ({"views": {"user_sessions": {"versions": ["1"]}}}, "got string, want integer"),
        ({"views": {"user_sessions": {"replicas": 2}}}, "additional properties 'replicas' not allowed"),
        ({"kafka": {"tolerations": [{"key": "a", "effekt": "NoSchedule"}]}}, "additional properties 'effekt' not allowed"),
        ({"viewJobs": {"starting": "yesterday"}}, "viewJobs/starting"),
        ({"viewJobs": {"grouping": "perview"}}, "viewJobs/grouping"),
        ({"viewJobs": {"groupedResources": {"limits": {"cpu": "2", "memory": "4 GB"}}}}, "viewJobs/groupedResources/limits/memory"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else "",
)
def test_values_schema_rejects_bad_values(helm: Path, tmp_path: Path, values: dict, message: str) -> None:
    err = h.render_error(values, tmp_dir=tmp_path)
    assert "values don't meet the specifications of the schema" in err or "schema" in err.lower()
    assert message in err


def test_values_schema_is_strict_and_documented() -> None:
    schema = json.loads((h.CHART / "values.schema.json").read_text())
    values = yaml.safe_load((h.CHART / "values.yaml").read_text())
    text = (h.CHART / "values.yaml").read_text()

    def walk(node: dict, path: str) -> None:
        if "$ref" in node:
            return
        if node.get("type") == "object":
            assert "additionalProperties" in node, f"{path or '<root>'}: additionalProperties missing"
            assert node["additionalProperties"] is not True, path
            if isinstance(node["additionalProperties"], dict):
                walk(node["additionalProperties"], f"{path}.*")
        for key, child in node.get("properties", {}).items():
            assert child.get("description"), f"{path}.{key}: no description"
            walk(child, f"{path}.{key}" if path else key)

    walk(schema, "")
    for name, definition in schema["definitions"].items():
        walk(definition, f"#/definitions/{name}")

    def leaves(node: dict, path: str = ""):
        for k, v in node.items():
            p = f"{path}.{k}" if path else k
            if isinstance(v, dict) and v and p not in ("views",) and not k.endswith(("resources", "Resources", "affinity", "Selector", "labels", "annotations", "config", "extraConf", "commonLabels", "nodeSelector", "podAnnotations")):
                yield from leaves(v, p)
            else:
                yield p

    for p in leaves(values):
        assert f"## @param {p} " in text, f"values.yaml: {p} is not documented with ## @param"
    # generated from values.yaml: stale schemas are caught
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(h.ROOT / "infra/deploy/gen_values_schema.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------------------ NOTES / fail
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kafka": {"external": {"enabled": True}}}, "requires kafka.external.bootstrapServers"),
        ({"kafka": {"external": {"enabled": True, "bootstrapServers": "k:9092", "securityProtocol": "SASL_SSL",
                                 "sasl": {"mechanism": "PLAIN"}}}}, "requires kafka.external.sasl.existingSecret"),
        ({"kafka": {"external": {"enabled": True, "bootstrapServers": "k:9092", "securityProtocol": "SASL_SSL",
                                 "sasl": {"existingSecret": "s"}}}}, "requires kafka.external.sasl.mechanism"),
        ({"kafka": {"external": {"enabled": True, "bootstrapServers": "k:9092", "tls": {"existingSecret": "ca"}}}},
         "does not use TLS"),
        ({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa"}}}, "requires credentials"),
        ({"lake": {"type": "s3", "s3": {"existingSecret": "creds"}}}, "requires lake.s3.uri"),
        ({"airflow": {"postgresql": {"enabled": False}}}, "requires airflow.externalDatabase.existingSecret"),
        ({"viewJobs": {"spark": {"mode": "kubernetes"}}, "lake": {"persistence": {"colocatePods": False}}},
         "ReadWriteOnce lake PVC"),
        ({"viewJobs": {"grouping": "grouped", "spark": {"mode": "kubernetes"}}},
         "viewJobs.grouping=grouped runs every view in one driver with Spark local mode"),
    ],
)
def test_notes_fail_on_invalid_combinations(helm: Path, tmp_path: Path, values: dict, message: str) -> None:
    err = h.render_error(values, tmp_dir=tmp_path)
    assert "NOTES.txt" in err, err
    assert message in err


def test_valid_s3_combinations_render(helm: Path, tmp_path: Path) -> None:
    uri = "s3a://lake-bucket/kappa"
    for s3 in ({"uri": uri, "existingSecret": "creds"}, {"uri": uri, "irsaRoleArn": "arn:aws:iam::1:role/r"}):
        objs = h.render({"lake": {"type": "s3", "s3": s3}}, tmp_dir=tmp_path)
        assert h.configmap_data(objs, "kappa-platform-env")["KAPPA_LAKE_URI"] == uri
    objs = h.render({"lake": {"type": "s3", "s3": {"uri": uri, "existingSecret": "creds"}}}, tmp_dir=tmp_path)
    env = {e["name"]: e for e in h.pod_spec(h.view_deployments(objs)[0])["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "AWS_SECRET_ACCESS_KEY"}


def test_a_non_aws_store_reaches_every_reader_of_the_lake(helm: Path, tmp_path: Path) -> None:
    """lake.s3.endpoint/region become the standard AWS variables the platform's code reads: Spark's s3a settings
    (kappa.runtime.spark.s3a_conf) and the delta-rs/obstore environment (plain HTTP allowed for an http:// store)."""
    from kappa.runtime.spark import s3a_conf

    endpoint = "http://seaweedfs.store.svc:8333"
    objs = h.render({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "existingSecret": "creds",
                                                   "endpoint": endpoint, "region": "us-east-1"}}}, tmp_dir=tmp_path)
    env = h.configmap_data(objs, "kappa-platform-env")
    assert (env["AWS_ENDPOINT_URL"], env["AWS_ALLOW_HTTP"], env["AWS_REGION"]) == (endpoint, "true", "us-east-1")
    conf = s3a_conf(env)
    assert conf["spark.hadoop.fs.s3a.endpoint"] == endpoint
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert conf["spark.hadoop.fs.s3a.endpoint.region"] == "us-east-1"
    tls = h.configmap_data(h.render({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/k", "existingSecret": "creds",
                                                                    "endpoint": "https://s3.example.com"}}},
                                    tmp_dir=tmp_path), "kappa-platform-env")
    assert tls["AWS_ENDPOINT_URL"] == "https://s3.example.com" and "AWS_ALLOW_HTTP" not in tls
    assert s3a_conf(tls)["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "true"


def _hook(obj: dict) -> tuple[str, int, str]:
    ann = obj["metadata"]["annotations"]
    return ann["helm.sh/hook"], int(ann["helm.sh/hook-weight"]), ann["helm.sh/hook-delete-policy"]


def test_an_s3_lake_is_checked_before_install_and_upgrade(all_renders: dict[str, list[dict]], helm: Path,
                                                          tmp_path: Path) -> None:
    """With lake.type=s3 a pre-install/pre-upgrade hook Job runs `kappa lake check` with exactly the lake settings
    the release's pods get (inline: the ConfigMap does not exist yet), under a hook ServiceAccount created before it
    with the lake's IAM role; a PVC lake, or the check turned off, renders none."""
    prod = all_renders["production"]
    job, sa = h.named(prod, "Job", "kappa-lake-check"), h.named(prod, "ServiceAccount", "kappa-lake-check")
    assert _hook(job)[0] == _hook(sa)[0] == "pre-install,pre-upgrade"
    assert _hook(sa)[1] < _hook(job)[1], "the ServiceAccount must exist before the Job"
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/kappa-prod-jobs")
    spec = h.pod_spec(job)
    assert spec["serviceAccountName"] == "kappa-lake-check" and job["spec"]["backoffLimit"] == 0
    container = spec["containers"][0]
    assert container["args"] == ["kappa", "lake", "check"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    pods = h.configmap_data(prod, "kappa-platform-env")
    assert {k: v for k, v in env.items() if k == "KAPPA_LAKE_URI" or k.startswith("AWS_")} == \
        {k: v for k, v in pods.items() if k == "KAPPA_LAKE_URI" or k.startswith("AWS_")}

    static = h.render({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "existingSecret": "creds",
                                                     "endpoint": "http://store.svc:8333"}}}, tmp_dir=tmp_path)
    env = {e["name"]: e for e in h.pod_spec(h.named(static, "Job", "kappa-lake-check"))["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://store.svc:8333" and env["AWS_ALLOW_HTTP"]["value"] == "true"
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "AWS_ACCESS_KEY_ID"}
    assert "eks.amazonaws.com/role-arn" not in h.named(static, "ServiceAccount", "kappa-lake-check")["metadata"][
        "annotations"]
    off = h.render({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "existingSecret": "creds"},
                             "check": {"enabled": False}}}, tmp_dir=tmp_path)
    for objs in (all_renders["defaults"], off):
        assert not [o for o in objs if o["metadata"]["name"] == "kappa-lake-check"]

# ------------------------------------------------------------------------------------------ Airflow
def test_airflow_components_and_runner_rbac(all_renders: dict[str, list[dict]]) -> None:
    objs = all_renders["defaults"]
    names = {d["metadata"]["name"] for d in h.by_kind(objs, "Deployment")}
    assert {"kappa-airflow-api-server", "kappa-airflow-scheduler", "kappa-airflow-dag-processor", "kappa-airflow-triggerer"} <= names
    assert h.named(objs, "StatefulSet", "kappa-postgresql")
    role = h.named(objs, "Role", "kappa-airflow-runner")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules[(("apps",), ("deployments",))] == {"get", "list", "watch", "create", "delete"}
    assert not any("secrets" in res for _, res in rules), "the runner never reads Secrets"
    cm_rule = next(r for r in role["rules"] if r["resources"] == ["configmaps"])
    assert cm_rule["resourceNames"] == ["kappa-view-template"]
    binding = h.named(objs, "RoleBinding", "kappa-airflow-runner")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kappa-airflow", "namespace": "kappa"}]
    sched = h.named(objs, "Deployment", "kappa-airflow-scheduler")
    c = h.pod_spec(sched)["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["KAPPA_RUNNER"]["value"] == "kubernetes"
    assert env["KAPPA_VIEW_TEMPLATE_DIR"]["value"] == "/etc/kappa/view-template"
    assert any(v.get("configMap", {}).get("name") == "kappa-view-template" for v in h.pod_spec(sched)["volumes"])
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]["value"].startswith("postgresql+psycopg2://airflow:$(KAPPA_AIRFLOW_DB_PASSWORD)@")
    # a task waits for the API server as long in the cluster as in the local stack (tests/test_airflow_client.py)
    from kappa.front.stack import AIRFLOW_EXECUTION_API_RETRY

    assert {k: env[k]["value"] for k in AIRFLOW_EXECUTION_API_RETRY} == AIRFLOW_EXECUTION_API_RETRY
    prod = all_renders["production"]
    pc = h.pod_spec(h.named(prod, "Deployment", "kappa-airflow-scheduler"))["containers"][0]
    penv = {e["name"]: e for e in pc["env"]}
    assert penv["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]["valueFrom"]["secretKeyRef"] == {"name": "kappa-airflow-db", "key": "connection"}
    assert penv["AIRFLOW__CORE__FERNET_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kappa-airflow-secrets"
    assert not [s for s in h.by_kind(prod, "StatefulSet") if s["metadata"]["name"] == "kappa-postgresql"]


def test_airflow_migrations_job_is_per_revision(default_objs: list[dict]) -> None:
    job = h.named(default_objs, "Job", "kappa-airflow-migrate-1")
    assert h.pod_spec(job)["containers"][0]["args"] == ["airflow", "db", "migrate"]
    assert "helm.sh/hook" not in job["metadata"].get("annotations", {})


# ------------------------------------------------------------------------------------------ monitoring
def test_prometheus_operator_objects_follow_the_capability(all_renders: dict[str, list[dict]]) -> None:
    assert not h.by_kind(all_renders["defaults"], "PodMonitor")
    assert not h.by_kind(all_renders["defaults"], "PrometheusRule")
    with_api = all_renders["defaults-prometheus-operator"]
    pm = h.by_kind(with_api, "PodMonitor")[0]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "view"
    for d in h.view_deployments(with_api):
        assert pm["spec"]["selector"]["matchLabels"].items() <= h.pod_labels(d).items()
    forced = h.render(sets=["monitoring.prometheusOperator=enabled"])
    assert h.by_kind(forced, "PrometheusRule")
    off = h.render(sets=["monitoring.prometheusOperator=disabled"], api_versions=[h.MONITORING_API])
    assert not h.by_kind(off, "PodMonitor")


def test_dashboard_configmap(default_objs: list[dict]) -> None:
    cm = h.named(default_objs, "ConfigMap", "kappa-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kappa-views.json"])
    assert dash["uid"] == "kappa-views" and dash["panels"]


def _notes(tmp_path: Path, *values: dict) -> str:
    """NOTES.txt as helm renders it: a chart copy where it is wrapped into a ConfigMap (helm template hides NOTES)."""
    import shutil
    import tempfile

    chart = Path(tempfile.mkdtemp(dir=tmp_path)) / "chart"

    shutil.copytree(h.CHART, chart, symlinks=False, ignore=shutil.ignore_patterns("examples"))
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    body = "\n".join("    " + line for line in notes.splitlines())
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n  labels: {}\ndata:\n  notes: |\n    NOTES:\n" + body + "\n")
    objs = h.render(*values, chart=chart, tmp_dir=tmp_path)
    return h.named(objs, "ConfigMap", "notes")["data"]["notes"]


def test_notes_print_next_steps(helm: Path, tmp_path: Path) -> None:
    text = _notes(tmp_path)
    assert "kappa-kafka.kappa.svc.cluster.local:9092 (1 KRaft node(s))" in text
    assert "deployment/kappa-view-campaign-window-counts-v1" in text
    assert "port-forward svc/kappa-airflow-api-server 8080:8080" in text
    assert "get secret kappa-airflow -o jsonpath='{.data.admin-password}'" in text
    assert "airflow dags trigger kappa_replay" in text
    assert "monitoring.coreos.com/v1) was not found" in text
    ext = _notes(tmp_path, {"kafka": {"external": {"enabled": True, "bootstrapServers": "k1:9093", "securityProtocol": "SSL"}},
                            "airflow": {"enabled": False}})
    assert "k1:9093 (external, SSL)" in ext and "airflow dags trigger" not in ext
    grouped = _notes(tmp_path, {"viewJobs": {"grouping": "grouped"}})
    assert "6 view version(s) in ONE driver, deployment/kappa-views (grouped)" in grouped
    assert "campaign_window_counts v1  (metrics port 9403, container port m-3)" in grouped
    assert "port-forward deploy/kappa-views 9400 9401 9402 9403 9404 9405 4040" in grouped
    assert "deployment/kappa-view-" not in grouped


def test_pods_sharing_the_lake_share_its_group(all_renders: dict[str, list[dict]]) -> None:
    for case in ("defaults", "local", "spark-kubernetes"):
        objs = all_renders[case]
        sharing = [w for w in h.workloads(objs)
                   if any(v.get("persistentVolumeClaim", {}).get("claimName") == "kappa-lake" for v in h.pod_spec(w).get("volumes", []))]
        assert {w["metadata"]["name"] for w in sharing} >= {"kappa-airflow-scheduler"} | {d["metadata"]["name"] for d in h.view_deployments(objs)}
        groups = {h.pod_spec(w)["securityContext"]["fsGroup"] for w in sharing}
        assert groups == {10001}, f"{case}: lake volume mounted with fsGroups {groups} (ownership would flip-flop)"
    executor = yaml.safe_load(h.configmap_data(all_renders["spark-kubernetes"], "kappa-spark-conf")["executor-pod-template.yaml"])
    assert executor["spec"]["securityContext"]["fsGroup"] == 10001

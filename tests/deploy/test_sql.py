"""Render tests of the analysts' SQL service in helm/kappa (templates/sql): `kappa sql serve` in the view-job image,
its token Secret, the lake read-only, restricted, reachable only from sql.networkPolicy.from."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

import deploy_helpers as h

pytestmark = pytest.mark.deploy

NAME = "kappa-sql"
S3 = {"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "existingSecret": "creds"}}}


def _sql_objects(objs: list[dict]) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["metadata"]["name"]) for o in objs
                  if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "sql")


def _container(objs: list[dict]) -> dict:
    return h.pod_spec(h.named(objs, "Deployment", NAME))["containers"][0]


def _env(objs: list[dict]) -> dict[str, dict]:
    return {e["name"]: e for e in _container(objs)["env"]}


def _option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ------------------------------------------------------------------------------------------ the Deployment
def test_the_deployment_runs_kappa_sql_serve_from_the_view_job_image(default_objs: list[dict]) -> None:
    deploy = h.named(default_objs, "Deployment", NAME)
    assert deploy["spec"]["replicas"] == 1
    c = _container(default_objs)
    driver = h.pod_spec(h.view_deployments(default_objs)[0])["containers"][0]
    assert c["image"] == driver["image"] == f"kappa/view-job:{h.versions()['KAPPA_VERSION']}"
    assert "command" not in c, "the image's entrypoint (tini) stays"
    args = c["args"]
    assert args[:3] == ["kappa", "sql", "serve"]
    assert {flag: _option(args, flag) for flag in ("--host", "--jdbc-port", "--connect-port", "--cores", "--memory",
                                                    "--poll")} == {
        "--host": "0.0.0.0", "--jdbc-port": "10000", "--connect-port": "15002", "--cores": "1", "--memory": "1g",
        "--poll": "5"}
    assert all(isinstance(a, str) for a in args), args
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"jdbc": 10000, "connect": 15002}
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
    # probes on the endpoints themselves; Spark's start is slow, so the startup probe allows minutes
    assert c["startupProbe"]["tcpSocket"] == {"port": "jdbc"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 240
    assert c["readinessProbe"]["tcpSocket"]["port"] in ("jdbc", "connect")
    assert c["livenessProbe"]["tcpSocket"]["port"] in ("jdbc", "connect")


def test_values_reach_the_command_line(helm: Path, tmp_path: Path) -> None:
    objs = h.render({"sql": {"cores": 2, "driverMemory": "1536m", "poll": 2.5, "jdbcPort": 10010, "connectPort": 15010,
                             "extraEnv": [{"name": "KAPPA_SPARK_LOG_LEVEL", "value": "INFO"}]}}, tmp_dir=tmp_path)
    c = _container(objs)
    assert (_option(c["args"], "--cores"), _option(c["args"], "--memory"), _option(c["args"], "--poll")) == \
        ("2", "1536m", "2.5")
    assert (_option(c["args"], "--jdbc-port"), _option(c["args"], "--connect-port")) == ("10010", "15010")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"jdbc": 10010, "connect": 15010}
    assert _env(objs)["KAPPA_SPARK_LOG_LEVEL"]["value"] == "INFO"
    svc = h.named(objs, "Service", NAME)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == \
        {"jdbc": (10010, "jdbc"), "connect": (15010, "connect")}
    policy = h.named(objs, "NetworkPolicy", NAME)
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": 10010, "protocol": "TCP"}, {"port": 15010, "protocol": "TCP"}]


def test_env_the_platform_s_settings_and_the_token_from_the_secret(default_objs: list[dict]) -> None:
    c = _container(default_objs)
    assert c["envFrom"] == [{"configMapRef": {"name": "kappa-platform-env"}}], "the ConfigMap the view drivers use"
    driver = h.pod_spec(h.view_deployments(default_objs)[0])["containers"][0]
    assert driver["envFrom"] == c["envFrom"]
    env = _env(default_objs)
    assert env["KAPPA_SQL_TOKEN"] == {"name": "KAPPA_SQL_TOKEN",
                                      "valueFrom": {"secretKeyRef": {"name": NAME, "key": "token"}}}
    assert env["HOME"]["value"] == "/tmp"
    platform = h.configmap_data(default_objs, "kappa-platform-env")
    assert platform["KAPPA_HOME"].startswith("/tmp/"), "the service's catalog and ready file: a writable place"
    assert not [e for e in env.values() if "value" in e and "TOKEN" in e["name"]], "never a literal token"
    # the Secret exists, under that key, with a long random token
    secret = h.named(default_objs, "Secret", NAME)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token.isalnum()
    # a change of the platform's settings restarts the service (as it does the drivers)
    ann = h.named(default_objs, "Deployment", NAME)["spec"]["template"]["metadata"]["annotations"]
    assert ann["checksum/platform-env"] == \
        h.view_deployments(default_objs)[0]["spec"]["template"]["metadata"]["annotations"]["checksum/platform-env"]


def test_the_generated_token_is_random_and_kept_across_upgrades(helm: Path, tmp_path: Path) -> None:
    """A fresh render draws a new token (no default); an upgrade reuses the stored one: the template reads the
    Secret it renders back from the cluster (lookup) - the API server test checks it on a real upgrade."""
    a = h.named(h.render(), "Secret", NAME)["data"]["token"]
    b = h.named(h.render(sets=["commonLabels.render=second"]), "Secret", NAME)["data"]["token"]
    assert a != b, "the token is a fixed default"
    template = (h.CHART / "templates" / "sql" / "secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert "get $old $key | default (randAlphaNum" in template
    # the key renamed: the Secret and the reference follow
    objs = h.render({"sql": {"auth": {"secretKey": "password"}}}, tmp_dir=tmp_path)
    assert set(h.named(objs, "Secret", NAME)["data"]) == {"password"}
    assert _env(objs)["KAPPA_SQL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": NAME, "key": "password"}


def test_an_existing_secret_is_used_as_given(helm: Path, tmp_path: Path) -> None:
    objs = h.render({"sql": {"auth": {"existingSecret": "analysts", "secretKey": "jdbc-password"}}}, tmp_dir=tmp_path)
    assert ("Secret", NAME) not in _sql_objects(objs), "no generated Secret beside an existing one"
    assert _env(objs)["KAPPA_SQL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "analysts", "key": "jdbc-password"}


# ------------------------------------------------------------------------------------------ the lake
def test_a_pvc_lake_is_mounted_read_only_next_to_the_drivers(default_objs: list[dict]) -> None:
    deploy = h.named(default_objs, "Deployment", NAME)
    spec = h.pod_spec(deploy)
    c = spec["containers"][0]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "lake")
    assert mount == {"name": "lake", "mountPath": "/data/lake", "readOnly": True}
    volume = next(v for v in spec["volumes"] if v["name"] == "lake")
    assert volume["persistentVolumeClaim"]["claimName"] == "kappa-lake"
    # the only writable place is /tmp (an emptyDir)
    assert [m for m in c["volumeMounts"] if not m.get("readOnly")] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert next(v for v in spec["volumes"] if v["name"] == "tmp")["emptyDir"] == {"sizeLimit": "2Gi"}
    # a ReadWriteOnce lake: on the node of every other pod mounting it
    assert h.pod_labels(deploy)["kappa.io/lake-claim"] == "kappa-lake"
    terms = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"kappa.io/lake-claim": "kappa-lake"}}} in terms
    assert spec["securityContext"]["fsGroup"] == 10001, "the lake's group, as the drivers"
    # no S3 credentials for a PVC lake
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(_env(default_objs))


def test_an_existing_claim_and_a_user_affinity_are_kept(helm: Path, tmp_path: Path) -> None:
    node = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["analytics"]}]}]}}}
    objs = h.render({"lake": {"persistence": {"existingClaim": "lake-claim"}}, "sql": {"affinity": node}},
                    tmp_dir=tmp_path)
    spec = h.pod_spec(h.named(objs, "Deployment", NAME))
    assert next(v for v in spec["volumes"] if v["name"] == "lake")["persistentVolumeClaim"]["claimName"] == "lake-claim"
    assert spec["affinity"]["nodeAffinity"] == node["nodeAffinity"]
    assert spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"] == \
        {"matchLabels": {"kappa.io/lake-claim": "lake-claim"}}


def test_an_s3_lake_gets_the_drivers_credentials_and_no_volume(helm: Path, tmp_path: Path) -> None:
    objs = h.render(S3, tmp_dir=tmp_path)
    env = _env(objs)
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "AWS_SECRET_ACCESS_KEY"}
    driver = {e["name"]: e for e in h.pod_spec(h.view_deployments(objs)[0])["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"] == driver["AWS_SECRET_ACCESS_KEY"]
    spec = h.pod_spec(h.named(objs, "Deployment", NAME))
    assert [v["name"] for v in spec["volumes"]] == ["tmp"]
    assert "affinity" not in spec and "kappa.io/lake-claim" not in h.pod_labels(h.named(objs, "Deployment", NAME))


def test_irsa_the_service_account_carries_the_lake_s_role(all_renders: dict[str, list[dict]], helm: Path,
                                                          tmp_path: Path) -> None:
    prod = all_renders["production"]
    sa = h.named(prod, "ServiceAccount", NAME)
    assert sa["automountServiceAccountToken"] is False
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/kappa-prod-jobs")
    assert h.pod_spec(h.named(prod, "Deployment", NAME))["serviceAccountName"] == NAME
    own = "arn:aws:iam::1:role/kappa-sql-read-only"
    objs = h.render({"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "irsaRoleArn": "arn:aws:iam::1:role/r"}},
                     "sql": {"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": own}}}}, tmp_dir=tmp_path)
    assert h.named(objs, "ServiceAccount", NAME)["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": own}
    assert "annotations" not in h.named(all_renders["defaults"], "ServiceAccount", NAME)["metadata"]


def test_external_kafka_credentials_stay_out_and_the_settings_still_load(all_renders: dict[str, list[dict]]) -> None:
    """The service never talks to Kafka: it gets none of its credentials, and the platform's settings (which
    refuse SASL without them) must still load from the pod's environment."""
    from kappa.config import Settings

    objs = all_renders["external-kafka"]
    c = _container(objs)
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {NAME}, refs
    assert not any(m["mountPath"] == "/etc/kappa/kafka-ca" for m in c["volumeMounts"])
    env = dict(h.configmap_data(objs, "kappa-platform-env"))
    env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
    env["KAPPA_SQL_TOKEN"] = "x" * 48
    settings = Settings.from_env(env)
    assert settings.security_protocol is None and settings.sql_token == "x" * 48
    assert settings.lake_uri == env["KAPPA_LAKE_URI"]
    # what the drivers get instead would not load without the credentials
    with pytest.raises(Exception, match="SASL"):
        Settings.from_env(dict(h.configmap_data(objs, "kappa-platform-env")))


# ------------------------------------------------------------------------------------------ security
def test_restricted_pod_without_an_api_token(default_objs: list[dict]) -> None:
    spec = h.pod_spec(h.named(default_objs, "Deployment", NAME))
    psc = spec["securityContext"]
    assert (psc["runAsNonRoot"], psc["runAsUser"], psc["runAsGroup"]) == (True, 10001, 10001)
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == NAME
    assert spec["enableServiceLinks"] is False
    sc = spec["containers"][0]["securityContext"]
    assert sc == {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "privileged": False,
                  "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                  "seccompProfile": {"type": "RuntimeDefault"}}
    assert not any("projected" in v for v in spec["volumes"]), "no Kubernetes API token"
    sa = h.named(default_objs, "ServiceAccount", NAME)
    assert sa["automountServiceAccountToken"] is False
    assert not [b for b in h.by_kind(default_objs, "RoleBinding")
                if any(s.get("name") == NAME for s in b.get("subjects", []))], "no Role for the service"


# ------------------------------------------------------------------------------------------ network
def _policy(objs: list[dict]) -> dict:
    return h.named(objs, "NetworkPolicy", NAME)


def test_network_policy_default_peers_both_ports_only(default_objs: list[dict]) -> None:
    pol = _policy(default_objs)
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= \
        h.pod_labels(h.named(default_objs, "Deployment", NAME)).items()
    assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert pol["spec"]["ingress"] == [{
        "ports": [{"port": 10000, "protocol": "TCP"}, {"port": 15002, "protocol": "TCP"}],
        "from": [{"podSelector": {"matchLabels": {"kappa.io/sql-client": "true"}}},
                 {"namespaceSelector": {"matchLabels": {"kappa.io/sql-clients": "true"}}}],
    }]
    # no other policy of the release admits anything to the service's pod
    labels = h.pod_labels(h.named(default_objs, "Deployment", NAME))
    for other in h.by_kind(default_objs, "NetworkPolicy"):
        if other is pol:
            continue
        sel = other["spec"]["podSelector"]
        if sel.get("matchLabels", {}).items() <= labels.items() and not sel.get("matchExpressions"):
            assert not other["spec"].get("ingress"), f"{other['metadata']['name']} admits traffic to the SQL pod"
    # egress: DNS only with a PVC lake (no Kafka, no API server)
    assert pol["spec"]["egress"] == [{"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}]


def test_network_policy_peers_overridden_or_none(helm: Path, tmp_path: Path) -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "bi"}},
              "podSelector": {"matchLabels": {"app": "superset"}}},
             {"ipBlock": {"cidr": "10.20.0.0/16"}}]
    pol = _policy(h.render({"sql": {"networkPolicy": {"from": peers}}}, tmp_dir=tmp_path))
    assert [r["from"] for r in pol["spec"]["ingress"]] == [peers]
    # an empty list admits nobody (an ingress rule without `from` would admit everybody)
    pol = _policy(h.render({"sql": {"networkPolicy": {"from": []}}}, tmp_dir=tmp_path))
    assert pol["spec"]["ingress"] == [] and "Ingress" in pol["spec"]["policyTypes"]


@pytest.mark.parametrize(("s3", "lake_to", "want"), [
    ({"endpoint": "http://seaweedfs.store.svc:8333"}, [], [8333]),
    ({"endpoint": "http://minio.minio"}, [], [80]),
    ({"endpoint": "https://s3.example.com"}, [], [443]),
    ({}, [], [443]),                                          # AWS
    ({"irsaRoleArn": "arn:aws:iam::1:role/r"}, [], [443]),     # AWS + IRSA: STS on the same port
    ({"endpoint": "http://minio.minio:9000", "irsaRoleArn": "arn:aws:iam::1:role/r"},
     [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "minio"}}}], [9000, 443]),
], ids=["custom-port", "http", "https", "aws", "aws-irsa", "in-cluster-store-irsa"])
def test_network_policy_egress_to_an_s3_lake(helm: Path, tmp_path: Path, s3: dict, lake_to: list, want: list) -> None:
    values = {"lake": {"type": "s3", "s3": {"uri": "s3a://lake-bucket/kappa", "existingSecret": "creds", **s3}},
              "sql": {"networkPolicy": {"lakeTo": lake_to}}}
    egress = _policy(h.render(values, tmp_dir=tmp_path))["spec"]["egress"]
    assert egress[0] == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    rules = egress[1:]
    assert [p["port"] for r in rules for p in r["ports"]] == want
    assert all(p["protocol"] == "TCP" for r in rules for p in r["ports"])
    if lake_to:
        assert rules[0]["to"] == lake_to and "to" not in rules[1], "STS is AWS's, wherever the store is"
    else:
        assert all("to" not in r for r in rules)


# ------------------------------------------------------------------------------------------ switches, schema
def test_disabled_renders_nothing_of_it(helm: Path, tmp_path: Path, default_objs: list[dict]) -> None:
    assert _sql_objects(default_objs) == [("Deployment", NAME), ("NetworkPolicy", NAME), ("Secret", NAME),
                                          ("Service", NAME), ("ServiceAccount", NAME)]
    off = h.render({"sql": {"enabled": False}}, tmp_dir=tmp_path)
    assert _sql_objects(off) == []
    assert not [o for o in off if o["metadata"]["name"].startswith(NAME)]
    assert "sql" not in json.dumps([h.pod_spec(w)["containers"][0].get("args", []) for w in h.workloads(off)])
    no_policies = h.render({"networkPolicy": {"enabled": False}}, tmp_dir=tmp_path)
    assert ("NetworkPolicy", NAME) not in _sql_objects(no_policies) and ("Deployment", NAME) in _sql_objects(no_policies)


@pytest.mark.parametrize(("values", "message"), [
    ({"sql": {"cores": "x"}}, "sql/cores"),
    ({"sql": {"cores": 0}}, "sql/cores"),
    ({"sql": {"enabled": "yes"}}, "sql/enabled"),
    ({"sql": {"driverMemory": "1 GB"}}, "sql/driverMemory"),
    ({"sql": {"jdbcPort": 80}}, "sql/jdbcPort"),
    ({"sql": {"poll": 0}}, "sql/poll"),
    ({"sql": {"service": {"type": "ExternalName"}}}, "sql/service/type"),
    ({"sql": {"networkPolicy": {"from": [{"podSelektor": {}}]}}}, "additional properties 'podSelektor' not allowed"),
    ({"sql": {"tokn": "x"}}, "additional properties 'tokn' not allowed"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else "")
def test_the_schema_rejects_bad_sql_values(helm: Path, tmp_path: Path, values: dict, message: str) -> None:
    err = h.render_error(values, tmp_dir=tmp_path)
    assert "schema" in err.lower() and message in err, err


def test_every_example_s_choice(all_renders: dict[str, list[dict]]) -> None:
    """Every example runs the service; the local one (one 2-core node) with a small CPU request and a longer start."""
    for example in ("production", "external-kafka", "local"):
        assert ("Deployment", NAME) in _sql_objects(all_renders[example]), example
    local = next(w for w in h.workloads(all_renders["local"]) if w["metadata"]["name"] == NAME)
    container = h.pod_spec(local)["containers"][0]
    assert container["resources"]["requests"]["cpu"] == "100m"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600


def test_notes_say_how_to_connect(helm: Path, tmp_path: Path) -> None:
    from test_chart import _notes

    text = _notes(tmp_path)
    assert "kubectl -n kappa port-forward svc/kappa-sql 10000 15002" in text
    assert "kubectl -n kappa get secret kappa-sql -o jsonpath='{.data.token}' | base64 -d" in text
    assert 'sc://localhost:15002/;token=' in text
    assert "kappa.io/sql-client=true" in text
    assert "jdbc:hive2://kappa-sql.kappa.svc.cluster.local:10000/analytics" in text
    other = _notes(tmp_path, {"sql": {"auth": {"existingSecret": "analysts", "secretKey": "pw"}}})
    assert "get secret analysts -o jsonpath='{.data.pw}'" in other
    assert "kappa-sql" not in _notes(tmp_path, {"sql": {"enabled": False}})

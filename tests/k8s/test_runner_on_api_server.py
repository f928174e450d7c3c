"""The Kubernetes runner of replays and the chart's RBAC, against a real API server, as the Airflow
ServiceAccount the runner runs under in the cluster (a token from the TokenRequest API, no impersonation).

Covered: what the runner asks of the API (create/read/delete Deployments, Jobs, the view template), what the
API server admits (Pod Security ``restricted``, RBAC), idempotent starts, stop, bounded replays as Jobs that
complete (KWOK completes their pods). Not covered (no container runs): the driver process itself.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from kappa.runtime.driver import JobSpec
from tests.k8s.conftest import ROOT, Cluster

pytestmark = pytest.mark.k8s

NS = "kappa-runner"
SA = "kappa-airflow"


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[str]:
    ns = cluster.restricted_namespace(NS)
    cluster.run("helm", "install", "kappa", str(ROOT / "helm" / "kappa"), "-n", ns, "--wait", "--wait-for-jobs",
                "--timeout", "3m")
    yield ns
    cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m", check=False)


@pytest.fixture(scope="module")
def as_runner(cluster: Cluster, release: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig holding a token of the Airflow ServiceAccount (the identity of the runner in the cluster)."""
    token = cluster.kubectl("create", "token", SA, "-n", release, "--duration=1h").stdout.strip()
    path = tmp_path_factory.mktemp("sa") / "kubeconfig"
    server = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "runner",
        "clusters": [{"name": "c", "cluster": server}],
        "users": [{"name": SA, "user": {"token": token}}],
        "contexts": [{"name": "runner", "context": {"cluster": "c", "user": SA, "namespace": release}}]}))
    return path


def _upgrade(cluster: Cluster, ns: str, *values: str) -> None:
    cluster.run("helm", "upgrade", "kappa", str(ROOT / "helm" / "kappa"), "-n", ns, "--reuse-values", *values,
                "--wait", "--timeout", "3m")


def _manifest(cluster: Cluster, ns: str) -> str:
    return cluster.run("helm", "get", "manifest", "kappa", "-n", ns).stdout


def _can(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    res = subprocess.run([str(cluster.bin / "kubectl"), "--kubeconfig", str(kubeconfig), "auth", "can-i", *args],
                         capture_output=True, text=True)
    return res.stdout.strip() == "yes"


def test_the_runner_account_may_do_what_replays_need_and_nothing_else(cluster: Cluster, release: str,
                                                                       as_runner: Path):
    allowed = [("create", "deployments.apps"), ("delete", "deployments.apps"), ("get", "deployments.apps"),
               ("create", "jobs.batch"), ("delete", "jobs.batch"), ("create", "services"), ("get", "pods"),
               ("get", "pods", "--subresource=log"), ("get", "configmap/kappa-view-template"),
               ("patch", "configmap/kappa-view-state")]
    denied = [("get", "secrets"), ("list", "secrets"), ("get", "configmap/kappa-airflow-config"),
              ("patch", "configmap/kappa-view-template"), ("create", "configmaps"),
              ("create", "pods"), ("create", "pods", "--subresource=exec"), ("patch", "deployments.apps"),
              ("create", "roles.rbac.authorization.k8s.io"), ("create", "rolebindings.rbac.authorization.k8s.io")]
    for verb, *what in allowed:
        assert _can(cluster, as_runner, verb, *what, "-n", release), f"the runner needs {verb} {what}"
    for verb, *what in denied:
        assert not _can(cluster, as_runner, verb, *what, "-n", release), f"the runner must not {verb} {what}"
    # nothing in other namespaces, nothing cluster-scoped
    for verb, what, ns in [("create", "deployments.apps", "default"), ("get", "secrets", "kube-system"),
                           ("list", "pods", "default")]:
        assert not _can(cluster, as_runner, verb, what, "-n", ns), f"{verb} {what} in {ns}"
    for verb, what in [("create", "namespaces"), ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
                       ("patch", "nodes"), ("delete", "persistentvolumes")]:
        assert not _can(cluster, as_runner, verb, what), f"cluster-scoped {verb} {what}"


def test_pods_that_break_restricted_are_refused(cluster: Cluster, release: str):
    def create(name: str, container: dict) -> str:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": release},
               "spec": {"containers": [{"name": "c", "image": "busybox", **container}]}}
        res = subprocess.run([str(cluster.bin / "kubectl"), "apply", "-f", "-"], input=json.dumps(pod), text=True,
                             capture_output=True, env=cluster.env())
        assert res.returncode != 0, f"{name} was admitted"
        return res.stderr

    # privileged containers are off for the whole API server (--allow-privileged=false)
    assert "disallowed by cluster policy" in create("privileged", {"securityContext": {"privileged": True}})
    # a pod without the restricted profile's securityContext is refused by the PodSecurity admission
    refused = create("plain", {})
    assert 'violates PodSecurity "restricted:latest"' in refused and "runAsNonRoot" in refused, refused


def test_runner_starts_stops_and_bounds_drivers_as_the_airflow_account(cluster: Cluster, release: str,
                                                                       as_runner: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    from kappa.control.runners.kubernetes import KubernetesRunner

    data = cluster.get("configmap", "kappa-view-template", "-n", release)["data"]
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("KUBECONFIG", str(as_runner))
    monkeypatch.setenv("KAPPA_K8S_NAMESPACE", release)
    runner = KubernetesRunner.from_env(tmp_path)

    live = JobSpec("campaign_window_counts", 2, starting="earliest")
    assert runner.status(live.view, live.version).state == "stopped"
    started = runner.start(live, wait=True, timeout=120)
    assert started.state == "running" and started.detail.endswith(" ready"), started
    name = "kappa-view-campaign-window-counts-v2"
    first = cluster.get("deployment", name, "-n", release)
    assert first["spec"]["replicas"] == 1 and first["spec"]["strategy"]["type"] == "Recreate"
    # starting a version that runs creates nothing (one driver per checkpoint)
    assert runner.start(live).state == "running"
    assert cluster.get("deployment", name, "-n", release)["metadata"]["uid"] == first["metadata"]["uid"]
    assert len([d for d in cluster.get("deployments", "-n", release)["items"] if d["metadata"]["name"] == name]) == 1
    # stop removes exactly that driver; the release's own drivers stay
    before = {d["metadata"]["name"] for d in cluster.get("deployments", "-n", release)["items"]}
    runner.stop(live.view, live.version, wait=True, timeout=120)
    after = {d["metadata"]["name"] for d in cluster.get("deployments", "-n", release)["items"]}
    assert before - after == {name} and runner.status(live.view, live.version).state == "stopped"

    # the chart's own driver of user_sessions v1 runs: a bounded run of that version must not start beside it
    runner.start(JobSpec("user_sessions", 1, starting="earliest", end_timestamp_ms=1_700_000_000_000))
    assert "NotFound" in cluster.kubectl("get", "job", "kappa-view-user-sessions-v1", "-n", release, check=False).stderr

    bounded = JobSpec("campaign_window_counts", 2, starting="earliest", end_timestamp_ms=1_700_000_000_000,
                      max_offsets_per_trigger=5000)
    runner.start(bounded)
    job = cluster.get("job", name, "-n", release)
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-4:] == ["--end-ts", "1700000000000", "--max-offsets-per-trigger", "5000"], args
    finished = runner.wait(bounded.view, bounded.version, timeout=120, poll=1)
    assert finished.state == "finished", finished
    runner.stop(bounded.view, bounded.version, wait=True, timeout=120)
    assert runner.status(bounded.view, bounded.version).state == "stopped"


def test_promote_rollback_and_retire_act_on_the_right_drivers(cluster: Cluster, release: str, as_runner: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The replay steps (kappa.control.replay) with the Kubernetes runner: promote stops the replaced version's driver,
    rollback starts the kept one again and stops the other, retire stops nothing that serves. The registry and
    alias are a local lake with two tiny tables (no Spark); the drivers are real Deployments."""
    import duckdb
    from deltalake import write_deltalake

    from kappa.control import replay
    from kappa.config import Settings
    from kappa.control.registry import Registry, utcnow
    from kappa.control.runners.kubernetes import KubernetesRunner

    for name, text in cluster.get("configmap", "kappa-view-template", "-n", release)["data"].items():
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("KUBECONFIG", str(as_runner))
    monkeypatch.setenv("KAPPA_K8S_NAMESPACE", release)
    runner = KubernetesRunner.from_env(tmp_path)
    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_LAKE_URI": str(tmp_path / "lake")})
    registry = Registry(settings.lake_uri)
    view = "campaign_window_counts"
    names = {v: f"kappa-view-campaign-window-counts-v{v}" for v in (1, 2)}

    def drivers() -> set[str]:
        return {d["metadata"]["name"] for d in cluster.get("deployments", "-n", release)["items"]} & set(names.values())

    for version in (1, 2):
        table = replay.ViewVersion.resolve(view, version, settings).paths.table
        write_deltalake(table, duckdb.sql(f"SELECT {version} AS v"))
        registry.register(view, version, code_module=f"jobs.campaign_window_counts.v{version}", table_path=table,
                          app_id="kappa:t", starting="earliest", triggered_by="test")
        for state in ("caught_up", "verified"):
            registry.set_state(view, version, state, by="test")
    replay.promote(view, 1, settings, runner, by="test")
    assert drivers() == {names[1]}, "the chart runs v1 (default version)"
    runner.start(JobSpec(view, 2, starting="earliest"))
    assert drivers() == {names[1], names[2]}

    replay.promote(view, 2, settings, runner, by="test", keep_hours=1)
    cluster.kubectl("wait", "--for=delete", f"deployment/{names[1]}", "-n", release, "--timeout=120s")
    assert drivers() == {names[2]}

    # helm upgrade after the promote: v1 (the chart's default version) is not started again, v2 is adopted as the
    # runner created it - same object, same pod template (generation), now part of the release
    before = cluster.get("deployment", names[2], "-n", release)["metadata"]
    _upgrade(cluster, release)
    after = cluster.get("deployment", names[2], "-n", release)["metadata"]
    assert drivers() == {names[2]}, "the upgrade must keep serving the promoted version"
    assert (after["uid"], after["generation"]) == (before["uid"], before["generation"])
    assert f"name: {names[2]}" in _manifest(cluster, release) and f"name: {names[1]}" not in _manifest(cluster, release)

    replay.rollback(view, 1, settings, runner, by="test", keep_hours=1)
    cluster.kubectl("wait", "--for=delete", f"deployment/{names[2]}", "-n", release, "--timeout=120s")
    assert drivers() == {names[1]} and runner.status(view, 1).state == "running"
    _upgrade(cluster, release)
    assert drivers() == {names[1]}, "the upgrade after a rollback keeps the rolled-back version, and only it"
    recorded = json.loads(cluster.get("configmap", "kappa-view-state", "-n", release)["data"]["views.json"])
    assert {v: e["state"] for v, e in recorded[view].items()} == {"1": "running", "2": "stopped"}

    deleted = replay.retire_expired(settings, runner, by="test", now=utcnow() + timedelta(hours=2))
    assert [(r.version, r.deleted) for r in deleted] == [(2, True)]
    assert drivers() == {names[1]}, "retiring v2 leaves the serving v1's driver alone"


def test_grouped_release_hands_versions_over_and_upgrades_keep_them(cluster: Cluster, as_runner: Path,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """viewJobs.grouping=grouped (the local example): the chart's versions run in deployment/kappa-views. A promote
    stops one of them through the record (the grouped Deployment is not touched: the other views go on), the next
    upgrade renders the grouped driver without it; a rollback starts it in a Deployment of its own, which the
    following upgrade adopts while the grouped driver still leaves it alone."""
    from kappa.control.runners.kubernetes import KubernetesRunner

    ns = cluster.restricted_namespace("kappa-grouped")
    cluster.run("helm", "install", "kappa", str(ROOT / "helm" / "kappa"), "-n", ns, "--set", "viewJobs.grouping=grouped",
                "--wait", "--wait-for-jobs", "--timeout", "3m")
    try:
        token = cluster.kubectl("create", "token", SA, "-n", ns, "--duration=1h").stdout.strip()
        config = yaml.safe_load(as_runner.read_text())
        config["users"][0]["user"]["token"] = token
        config["contexts"][0]["context"]["namespace"] = ns
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
        for name, text in cluster.get("configmap", "kappa-view-template", "-n", ns)["data"].items():
            (tmp_path / name).write_text(text)
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
        monkeypatch.setenv("KAPPA_K8S_NAMESPACE", ns)
        runner = KubernetesRunner.from_env(tmp_path)

        def hosted() -> list[str]:
            return cluster.get("deployment", "kappa-views", "-n", ns)["metadata"]["annotations"]["kappa.io/views"].split(",")

        def args() -> list[str]:
            return cluster.get("deployment", "kappa-views", "-n", ns)["spec"]["template"]["spec"]["containers"][0]["args"]

        ref, own = "campaign_window_counts@v1", "kappa-view-campaign-window-counts-v1"
        assert ref in hosted() and runner.status("campaign_window_counts", 1).state == "running"
        # its metrics: the grouped driver's port m-<i>, i its place among the versions the driver hosts
        assert runner.status("campaign_window_counts", 1).metrics_url == _metrics_endpoint(
            cluster, ns, "kappa-views", f"m-{hosted().index(ref)}")
        generation = cluster.get("deployment", "kappa-views", "-n", ns)["metadata"]["generation"]
        runner.stop("campaign_window_counts", 1)
        assert cluster.get("deployment", "kappa-views", "-n", ns)["metadata"]["generation"] == generation
        assert runner.status("campaign_window_counts", 1).state == "stopped"

        _upgrade(cluster, ns)
        assert ref not in hosted() and ref not in args() and len(hosted()) >= 1
        assert "NotFound" in cluster.kubectl("get", "deployment", own, "-n", ns, check=False).stderr

        runner.start("campaign_window_counts", 1, "earliest")  # what a rollback does
        uid = cluster.get("deployment", own, "-n", ns)["metadata"]["uid"]
        _upgrade(cluster, ns)
        assert cluster.get("deployment", own, "-n", ns)["metadata"]["uid"] == uid
        assert ref not in hosted(), "one driver per view version: the grouped driver does not take it back"
        assert f"name: {own}" in _manifest(cluster, ns)
    finally:
        cluster.run("helm", "uninstall", "kappa", "-n", ns, "--wait", "--timeout", "3m", check=False)


def _runner(cluster: Cluster, release: str, as_runner: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The runner as Airflow builds it in the release: the mounted view template, the Airflow account's token."""
    from kappa.control.runners.kubernetes import KubernetesRunner

    template = tmp_path / "view-template"
    template.mkdir()
    for name, text in cluster.get("configmap", "kappa-view-template", "-n", release)["data"].items():
        (template / name).write_text(text)
    monkeypatch.setenv("KUBECONFIG", str(as_runner))
    monkeypatch.setenv("KAPPA_K8S_NAMESPACE", release)
    return KubernetesRunner.from_env(template)


def _metrics_endpoint(cluster: Cluster, ns: str, deployment: str, port_name: str = "metrics") -> str:
    """``http://<pod IP>:<port>/metrics`` of the Deployment's Ready pod, read from the API (KWOK gives pods an IP)."""
    selector = cluster.get("deployment", deployment, "-n", ns)["spec"]["selector"]["matchLabels"]
    pods = cluster.get("pods", "-n", ns, "-l", ",".join(f"{k}={v}" for k, v in selector.items()))["items"]
    (pod,) = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                     for c in p["status"].get("conditions", []))]
    (port,) = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
               if p["name"] == port_name]
    return f"http://{pod['status']['podIP']}:{port}/metrics"


def test_a_running_driver_s_status_names_its_pod_s_metrics_endpoint(cluster: Cluster, release: str,
                                                                     as_runner: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """What the watch after an in-cluster promotion reads: the Ready driver pod's IP and its `metrics` container
    port - the chart's own drivers and the ones the runner starts alike; none once stopped."""
    runner = _runner(cluster, release, as_runner, tmp_path, monkeypatch)
    chart = runner.status("user_sessions", 1)  # the chart's driver of user_sessions v1
    assert chart.state == "running" and chart.metrics_url == _metrics_endpoint(
        cluster, release, "kappa-view-user-sessions-v1"), chart

    spec = JobSpec("campaign_window_counts", 3, starting="earliest")
    try:
        started = runner.start(spec, wait=True, timeout=120)
        assert started.metrics_url == _metrics_endpoint(cluster, release, "kappa-view-campaign-window-counts-v3")
        assert started.metrics_url.endswith(":9400/metrics"), started  # viewJobs.metricsPort
    finally:
        stopped = runner.stop(spec.view, spec.version, wait=True, timeout=120)
    assert stopped.state == "stopped" and stopped.metrics_url is None


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_an_in_cluster_promotion_stays_serving_when_the_watch_cannot_reach_the_metrics(
        cluster: Cluster, release: str, as_runner: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        spark, lake):
    """The kappa_replay DAG's watch after a promotion in the cluster: the new version's driver runs (a real
    Deployment, its pod Ready), but its metrics endpoint does not answer from where the watch runs - here because
    KWOK's pod IPs lead nowhere, in a cluster because the view drivers' NetworkPolicy admits only Prometheus. With
    the DAG's default watch parameters (a shorter window and poll) the version stays serving, judged on its
    checkpoint (the real job's, over the real log), and the result says the metrics were not available; once its
    checkpoint falls behind the log by more than max_lag, the same watch rolls it back."""
    import dataclasses

    import duckdb
    from deltalake import write_deltalake

    from kappa.control import replay
    from kappa.control.registry import Registry
    from kappa.control.replay.watch import watch
    from kappa.control.serving import ServingAlias
    from kappa.log import generator
    from tests.helpers import run_to_end

    settings, view = lake, "campaign_window_counts"
    runner = _runner(cluster, release, as_runner, tmp_path, monkeypatch)
    names = {v: f"kappa-view-campaign-window-counts-v{v}" for v in (1, 2)}

    def drivers() -> set[str]:
        return {d["metadata"]["name"] for d in cluster.get("deployments", "-n", release)["items"]} & set(names.values())

    # the log, and v2's run over it: the real job, in this process's Spark session, as its driver pod would run it
    u = generator.universe(seed=41, campaigns=4, users=50)
    generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    assert generator.produce(settings, settings.topic("ad-events"),
                             generator.events(300, seed=41, universe=u, start_ms=1_700_000_000_000)).delivered == 300
    run_to_end(spark, settings, "jobs.campaign_window_counts.v2")

    registry = Registry(settings.lake_uri)
    for version in (1, 2):
        vv = replay.ViewVersion.resolve(view, version, settings)
        if version == 1:  # the version serving before: only its registry row and a table to switch back to
            write_deltalake(vv.paths.table, duckdb.sql("SELECT 1 AS v"))
        registry.register(view, version, code_module=vv.module, table_path=vv.paths.table,
                          app_id=vv.app_id() or "kappa:t", starting="earliest", triggered_by="test")
        for state in ("caught_up", "verified"):
            registry.set_state(view, version, state, by="test")
    try:
        replay.promote(view, 1, settings, runner, by="test")
        runner.start(JobSpec(view, 2, starting="earliest"), wait=True, timeout=120)
        switched = replay.promote(view, 2, settings, runner, by="test", keep_hours=1)
        assert switched.previous_version == 1
        cluster.kubectl("wait", "--for=delete", f"deployment/{names[1]}", "-n", release, "--timeout=120s")
        assert runner.status(view, 2).metrics_url, "the runner names v2's metrics endpoint"

        # the DAG's defaults (ReplayRequest = the DAG's Params), in a 30 s window polled every second
        policy = dataclasses.replace(replay.ReplayRequest(view=view, version=2, triggered_by="test").watch_policy(1.0),
                                     minutes=0.5)
        assert (policy.max_lag, policy.max_quarantine_rate, policy.strikes) == (50_000, 0.05, 3)
        result = watch(view, 2, settings, runner, previous_version=1, policy=policy, by="test")
        assert result.healthy and result.rolled_back_to is None, result.message
        assert result.polls >= policy.strikes, result  # as many checks as would have rolled it back
        assert result.metrics is False and "metrics not available" in result.reason, result.message
        assert "judged on its checkpoint" in result.reason and "lag 0" in result.reason, result.message
        assert ServingAlias(settings.lake_uri).target(view).version == 2
        assert registry.get(view, 2).state == "serving" and drivers() == {names[2]}

        # the log moves on while v2's driver commits nothing (no container runs under KWOK): its checkpoint lags
        assert generator.produce(settings, settings.topic("ad-events"), generator.events(
            40, seed=42, universe=u, start_ms=1_700_000_100_000)).delivered == 40
        broke = watch(view, 2, settings, runner, previous_version=1, by="test",
                      policy=dataclasses.replace(policy, max_lag=10, minutes=3))
        assert not broke.healthy and broke.rolled_back_to == 1, broke.message
        assert "its checkpoint lags 40 records behind the log" in broke.reason, broke.message
        assert ServingAlias(settings.lake_uri).target(view).version == 1
        cluster.kubectl("wait", "--for=delete", f"deployment/{names[2]}", "-n", release, "--timeout=120s")
        assert drivers() == {names[1]}
    finally:  # the release as the other tests expect it: the chart's v1 runs, v2 does not
        runner.stop(view, 2, wait=True, timeout=120)
        runner.start(JobSpec(view, 1, starting="earliest"))

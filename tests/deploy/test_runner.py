"""kappa.control.runners.kubernetes: the manifest it submits is exactly what the chart renders; API calls on a fake."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import deploy_helpers as h
from kappa.control.runners.kubernetes import KubernetesRunner, KubernetesRunnerError, validate_starting, view_slug

pytestmark = pytest.mark.deploy


def runner_from(objs: list[dict], **kwargs: Any) -> KubernetesRunner:
    """The runner as Airflow builds it: from the chart's view-template ConfigMap (mounted files)."""
    return KubernetesRunner.from_configmap(h.configmap_data(objs, "kappa-view-template"), **kwargs)


def chart_driver(objs: list[dict], view: str, version: int) -> dict:
    return h.named(objs, "Deployment", f"kappa-view-{view_slug(view)}-v{version}")


CASES = {
    "defaults": lambda tmp: h.render(),
    "spark-kubernetes": lambda tmp: h.render(sets=["viewJobs.spark.mode=kubernetes"]),
    "production": lambda tmp: h.render(h.CHART / "examples" / "production.yaml"),
    "external-kafka": lambda tmp: h.render(h.CHART / "examples" / "external-kafka.yaml"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_equals_the_chart_render_for_every_running_view(helm: Path, tmp_path: Path, case: str) -> None:
    objs = CASES[case](tmp_path)
    runner = runner_from(objs)
    drivers = h.view_deployments(objs)
    assert drivers
    for rendered in drivers:
        view = rendered["metadata"]["labels"]["kappa.io/view"]
        version = int(rendered["metadata"]["labels"]["kappa.io/view-version"])
        starting = rendered["metadata"]["annotations"]["kappa.io/starting"]
        built = runner.manifest(view, version, starting)
        # field by field first (readable failures), then the whole object
        for path in (("metadata", "labels"), ("spec", "selector"), ("spec", "strategy"), ("spec", "replicas"),
                     ("spec", "template", "metadata", "labels"), ("spec", "template", "spec", "securityContext")):
            a, b = built, rendered
            for key in path:
                a, b = a[key], b[key]
            assert a == b, f"{case} {view} v{version}: {'.'.join(path)}"
        bc, rc = h.pod_spec(built)["containers"][0], h.pod_spec(rendered)["containers"][0]
        for key in ("image", "args", "env", "envFrom", "ports", "securityContext", "resources", "livenessProbe",
                    "readinessProbe", "startupProbe", "volumeMounts"):
            assert bc.get(key) == rc.get(key), f"{case} {view} v{version}: container {key}"
        assert built == rendered, f"{case} {view} v{version}: manifests differ"
        service = runner.service_manifest(view, version)
        if h.configmap_data(objs, "kappa-platform-env")["KAPPA_SPARK_MASTER"].startswith("k8s://"):
            assert service == h.named(objs, "Service", f"{rendered['metadata']['name']}-driver")
        else:
            assert service is None


def test_manifest_for_versions_the_chart_does_not_run(helm: Path, tmp_path: Path) -> None:
    # a replay starts v2 next to v1: the runner's v2 must equal what the chart renders once v2 is pinned
    p = h.platform()
    p["views"]["campaign_window_counts"]["versions"][2] = {"module": "jobs.campaign_window_counts.v2"}
    chart = h.chart_copy_with_platform(tmp_path, p)
    offsets = json.dumps({"ad-events": {"0": 42, "1": 7}, "campaigns": {"0": 0}})
    before = h.render(chart=chart, tmp_dir=tmp_path)
    assert not [d for d in h.view_deployments(before) if d["metadata"]["name"].endswith("-v2")]
    after = h.render({"views": {"campaign_window_counts": {"versions": [1, 2], "starting": offsets}}},
                     chart=chart, tmp_dir=tmp_path)
    built = runner_from(before).manifest("campaign_window_counts", 2, offsets)
    assert built == chart_driver(after, "campaign_window_counts", 2)
    args = h.pod_spec(built)["containers"][0]["args"]
    assert args[args.index("--starting") + 1] == offsets, "JSON offsets survive as one argument"


def test_manifest_invariants(default_objs: list[dict]) -> None:
    m = runner_from(default_objs).manifest("user_sessions", 12, "ts:1700000000000")
    assert m["metadata"]["name"] == "kappa-view-user-sessions-v12"
    assert m["spec"]["replicas"] == 1 and m["spec"]["strategy"] == {"type": "Recreate"}
    assert m["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "kappa-view-user-sessions-v12",
                                                    "app.kubernetes.io/instance": "kappa"}
    assert m["metadata"]["labels"]["kappa.io/view"] == "user_sessions"
    assert m["metadata"]["labels"]["kappa.io/view-version"] == "12"
    assert "__KAPPA_" not in json.dumps(m)
    # pure: the template is not modified by a call
    again = runner_from(default_objs)
    again.manifest("events_raw", 3)
    assert again.manifest("user_sessions", 12, "ts:1700000000000") == m


@pytest.mark.parametrize(
    ("view", "version", "starting", "message"),
    [
        ("user_sessions", 0, "latest", "positive integer"),
        ("user_sessions", True, "latest", "positive integer"),
        ("User Sessions", 1, "latest", "DNS label"),
        ("user_sessions", 1, "yesterday", "invalid starting position"),
        ("user_sessions", 1, "ts:abc", "invalid starting position"),
        ("user_sessions", 1, "[1, 2]", "invalid starting position"),
        ("a_really_long_view_name_that_cannot_fit_in_a_label_value_at_all", 1, "latest", "63 characters"),
    ],
)
def test_manifest_rejects_bad_requests(default_objs: list[dict], view: str, version: Any, starting: str, message: str) -> None:
    with pytest.raises(KubernetesRunnerError, match=message):
        runner_from(default_objs).manifest(view, version, starting)


def test_starting_positions() -> None:
    for ok in ("earliest", "latest", "ts:0", '{"t": {"0": 1}}'):
        assert validate_starting(ok) == ok


def test_from_dir_reads_the_mounted_configmap(default_objs: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, text in h.configmap_data(default_objs, "kappa-view-template").items():
        (tmp_path / key).write_text(text)
    monkeypatch.setenv("KAPPA_VIEW_TEMPLATE_DIR", str(tmp_path))
    monkeypatch.setenv("KAPPA_K8S_NAMESPACE", "other")
    runner = KubernetesRunner.from_env()
    assert runner.namespace == "other"
    assert runner.manifest("events_raw", 1, "earliest") == chart_driver(default_objs, "events_raw", 1)
    monkeypatch.setenv("KAPPA_VIEW_TEMPLATE_DIR", str(tmp_path / "missing"))
    with pytest.raises(KubernetesRunnerError, match="view-template ConfigMap"):
        KubernetesRunner.from_env()


def test_missing_kubernetes_client_is_one_clear_error(default_objs: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_kubernetes(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "kubernetes" or name.startswith("kubernetes."):
            raise ImportError("No module named 'kubernetes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "kubernetes", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_kubernetes)
    runner = runner_from(default_objs)
    runner.manifest("events_raw", 1)  # pure: works without the client
    with pytest.raises(KubernetesRunnerError) as err:
        runner.status("events_raw", 1)
    assert str(err.value) == "the Kubernetes runner needs the official client: pip install kubernetes"


# ------------------------------------------------------------------------------------------ fake API
class ApiError(Exception):
    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class FakeApps:
    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple] = []

    def read_namespaced_deployment(self, name: str, namespace: str) -> dict:
        self.calls.append(("read", name, namespace))
        try:
            return self.deployments[(namespace, name)]
        except KeyError:
            raise ApiError(404, "Not Found") from None

    def create_namespaced_deployment(self, namespace: str, body: dict) -> dict:
        self.calls.append(("create", body["metadata"]["name"], namespace))
        key = (namespace, body["metadata"]["name"])
        if key in self.deployments:
            raise ApiError(409, "Conflict")
        self.deployments[key] = {**body, "status": {"ready_replicas": None}}
        return body

    def delete_namespaced_deployment(self, name: str, namespace: str, propagation_policy: str | None = None) -> None:
        self.calls.append(("delete", name, namespace, propagation_policy))
        if self.deployments.pop((namespace, name), None) is None:
            raise ApiError(404, "Not Found")


class FakeBatch:
    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple] = []

    def read_namespaced_job(self, name: str, namespace: str) -> dict:
        self.calls.append(("read", name, namespace))
        try:
            return self.jobs[(namespace, name)]
        except KeyError:
            raise ApiError(404, "Not Found") from None

    def create_namespaced_job(self, namespace: str, body: dict) -> dict:
        self.calls.append(("create", body["metadata"]["name"], namespace))
        key = (namespace, body["metadata"]["name"])
        if key in self.jobs:
            raise ApiError(409, "Conflict")
        self.jobs[key] = {**body, "status": {}}
        return body

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str | None = None) -> None:
        self.calls.append(("delete", name, namespace, propagation_policy))
        if self.jobs.pop((namespace, name), None) is None:
            raise ApiError(404, "Not Found")


class FakeCore:
    def __init__(self, configmaps: dict[str, dict] | None = None) -> None:
        self.services: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        # the view-state ConfigMap as the chart renders it (runner records land here), with a resourceVersion
        self.configmaps = {name: {**cm, "metadata": {**cm["metadata"], "resourceVersion": "1"}}
                           for name, cm in (configmaps or {}).items()}

    def read_namespaced_config_map(self, name: str, namespace: str) -> dict:
        if name not in self.configmaps:
            raise ApiError(404, "Not Found")
        return self.configmaps[name]

    def patch_namespaced_config_map(self, name: str, namespace: str, body: dict) -> dict:
        current = self.read_namespaced_config_map(name, namespace)
        if body["metadata"].get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
            raise ApiError(409, "Conflict")
        rv = str(int(current["metadata"]["resourceVersion"]) + 1)
        self.configmaps[name] = {"metadata": {**current["metadata"], "resourceVersion": rv},
                                 "data": {**current.get("data", {}), **body.get("data", {})}}
        return self.configmaps[name]

    def record(self) -> dict:
        return json.loads(self.configmaps["kappa-view-state"]["data"]["views.json"])

    def create_namespaced_service(self, namespace: str, body: dict) -> dict:
        self.services[(namespace, body["metadata"]["name"])] = body
        return body

    def delete_namespaced_service(self, name: str, namespace: str) -> None:
        if self.services.pop((namespace, name), None) is None:
            raise ApiError(404, "Not Found")

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
        self.last_selector = label_selector
        return SimpleNamespace(to_dict=lambda: {"items": self.pods})


def fake_core(objs: list[dict]) -> FakeCore:
    """A fake core API holding the release's view-state ConfigMap as rendered."""
    return FakeCore({"kappa-view-state": h.named(objs, "ConfigMap", "kappa-view-state")})


def test_start_stop_status_on_a_fake_api(helm: Path) -> None:
    objs = h.render(sets=["viewJobs.spark.mode=kubernetes"])
    apps, core = FakeApps(), fake_core(objs)
    runner = runner_from(objs, apps_api=apps, core_api=core, batch_api=FakeBatch())
    assert runner.namespace == "kappa"
    assert core.record() == {}, "nothing recorded at install"
    assert runner.status("user_sessions", 2).state == "stopped"

    st = runner.start("user_sessions", 2, "earliest")
    assert (st.ref, st.state) == ("user_sessions@v2", "running")
    assert "starting" in st.detail
    created = apps.deployments[("kappa", "kappa-view-user-sessions-v2")]
    assert {k: v for k, v in created.items() if k != "status"} == runner.manifest("user_sessions", 2, "earliest")
    assert ("kappa", "kappa-view-user-sessions-v2-driver") in core.services
    # recorded for the next helm upgrade: the chart renders exactly this start (kappa.runningViews)
    entry = core.record()["user_sessions"]["2"]
    assert {k: entry[k] for k in ("state", "starting", "args", "env")} == \
        {"state": "running", "starting": "earliest", "args": [], "env": {}}

    # start is idempotent: a driver that exists is never created twice
    runner.start("user_sessions", 2, "latest")
    assert [c for c in apps.calls if c[0] == "create"] == [("create", "kappa-view-user-sessions-v2", "kappa")]

    created["status"] = {"ready_replicas": 1}
    assert runner.status("user_sessions", 2).detail.endswith(" ready")
    assert core.last_selector == "app.kubernetes.io/name=kappa-view-user-sessions-v2,app.kubernetes.io/instance=kappa"

    core.pods = [{"status": {"container_statuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "restart_count": 5}]}}]
    assert runner.status("user_sessions", 2).state == "failed"
    # running again after exiting with an error: once is a restart, twice a crash loop (whatever the look's timing)
    exited = {"state": {"running": {}}, "last_state": {"terminated": {"exit_code": 1, "reason": "Error"}}}
    core.pods = [{"status": {"container_statuses": [{**exited, "restart_count": 1}]}}]
    assert runner.status("user_sessions", 2).state == "running"
    core.pods = [{"status": {"container_statuses": [{**exited, "restart_count": 2}]}}]
    st = runner.status("user_sessions", 2)
    assert (st.state, st.detail) == ("failed", "deployment/kappa-view-user-sessions-v2: restarted 2 times, last exit "
                                               "code 1 (Error)"), st
    core.pods = [{"status": {"container_statuses": [{"state": {"running": {}}, "restart_count": 3, "last_state": {
        "terminated": {"exit_code": 0, "reason": "Completed"}}}]}}]
    assert runner.status("user_sessions", 2).state == "running", "a clean exit (a stop) is no crash"
    core.pods = []

    st = runner.stop("user_sessions", 2)
    assert st.state == "stopped"
    assert core.record()["user_sessions"]["2"]["state"] == "stopped"
    assert ("delete", "kappa-view-user-sessions-v2", "kappa", "Foreground") in apps.calls
    assert not core.services
    assert runner.stop("user_sessions", 2).state == "stopped", "stopping a stopped driver is fine"


def test_start_accepts_a_job_spec(helm: Path) -> None:
    from kappa.control.runners.base import JobStatus
    from kappa.runtime.driver import JobSpec

    objs = h.render()
    apps, core, batch = FakeApps(), fake_core(objs), FakeBatch()
    runner = runner_from(objs, apps_api=apps, core_api=core, batch_api=batch)
    status = runner.start(JobSpec("events_raw", 4, starting="earliest", max_offsets_per_trigger=5000,
                                  env={"X": "1", "A": "2"}))
    assert isinstance(status, JobStatus)
    body = apps.deployments[("kappa", "kappa-view-events-raw-v4")]
    c = h.pod_spec(body)["containers"][0]
    assert c["args"][-2:] == ["--max-offsets-per-trigger", "5000"]
    assert c["args"][c["args"].index("--starting") + 1] == "earliest"
    assert c["env"][-2:] == [{"name": "A", "value": "2"}, {"name": "X", "value": "1"}], "sorted, as the chart renders"
    entry = core.record()["events_raw"]["4"]
    assert (entry["args"], entry["env"]) == (["--max-offsets-per-trigger", "5000"], {"A": "2", "X": "1"})
    assert not batch.jobs, "a live run is a Deployment"
    assert not core.services, "Spark local mode: no driver Service"


def test_bounded_replay_is_a_job_with_the_chart_pod_template(helm: Path) -> None:
    """A bounded driver exits by itself: under a Deployment the kubelet would restart it forever."""
    from kappa.runtime.driver import JobSpec

    objs = h.render(sets=["viewJobs.spark.mode=kubernetes"])
    apps, core, batch = FakeApps(), fake_core(objs), FakeBatch()
    runner = runner_from(objs, apps_api=apps, core_api=core, batch_api=batch)
    spec = JobSpec("campaign_window_counts", 2, starting="earliest", end_timestamp_ms=1700000000000)
    assert runner.start(spec).state == "running"
    assert not apps.deployments, "no Deployment for a bounded run"
    assert core.record() == {}, "a Job ends by itself: nothing for an upgrade to keep"
    job = batch.jobs[("kappa", "kappa-view-campaign-window-counts-v2")]
    deployment = runner.manifest("campaign_window_counts", 2, "earliest")

    # the pod is the chart's pod, except that a clean exit completes it instead of restarting it
    pod = job["spec"]["template"]
    assert pod["spec"].pop("restartPolicy") == "OnFailure"
    assert "restartPolicy" not in deployment["spec"]["template"]["spec"]
    container, chart_container = pod["spec"]["containers"][0], deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == chart_container["args"] + ["--end-ts", "1700000000000"]
    container["args"] = chart_container["args"]
    assert pod == deployment["spec"]["template"]
    assert job["spec"]["backoffLimit"] >= 1 and job["spec"]["ttlSecondsAfterFinished"] > 0
    assert "selector" not in job["spec"], "the Job controller generates its selector"
    assert job["metadata"]["labels"] == deployment["metadata"]["labels"]
    assert job["metadata"]["annotations"]["kappa.io/bounded"] == "true"
    assert not any(k.startswith("meta.helm.sh/") for k in job["metadata"]["annotations"])
    assert ("kappa", "kappa-view-campaign-window-counts-v2-driver") in core.services

    # idempotent: neither a second Job nor a Deployment
    runner.start(spec)
    runner.start("campaign_window_counts", 2, "earliest")
    assert [c for c in batch.calls if c[0] == "create"] == [("create", "kappa-view-campaign-window-counts-v2", "kappa")]
    assert not [c for c in apps.calls if c[0] == "create"]

    job["status"] = {"ready": 1, "active": 1}
    assert runner.status("campaign_window_counts", 2).detail == "job/kappa-view-campaign-window-counts-v2 ready"
    # a bounded driver's pod retries under the Job's backoffLimit: its restarts alone are no failure
    core.pods = [{"status": {"container_statuses": [{"state": {"running": {}}, "restart_count": 3, "last_state": {
        "terminated": {"exit_code": 1, "reason": "Error"}}}]}}]
    assert runner.status("campaign_window_counts", 2).state == "running"
    core.pods = []
    job["status"] = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    assert runner.status("campaign_window_counts", 2).state == "finished"
    assert runner.wait("campaign_window_counts", 2, ready=True, timeout=1, poll=0.01).state == "finished"
    job["status"] = {"failed": 7, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                  "message": "Job has reached the specified backoff limit"}]}
    st = runner.status("campaign_window_counts", 2)
    assert (st.state, st.detail) == ("failed", "job/kappa-view-campaign-window-counts-v2: BackoffLimitExceeded "
                                               "Job has reached the specified backoff limit")

    assert runner.stop("campaign_window_counts", 2).state == "stopped"
    assert ("delete", "kappa-view-campaign-window-counts-v2", "kappa", "Foreground") in batch.calls
    assert not batch.jobs and not core.services


def test_the_runner_role_allows_exactly_what_the_runner_calls(default_objs: list[dict]) -> None:
    role = h.named(default_objs, "Role", "kappa-airflow-runner")
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    for group, resource in (("apps", "deployments"), ("batch", "jobs"), ("", "services")):
        assert {"get", "create", "delete"} <= rules[(group, resource)], (group, resource)
    assert ("", "secrets") not in rules and ("", "pods/exec") not in rules
    # ConfigMaps: read the view template, read and patch the view-state record; by name only
    cms = {name: set(rule["verbs"]) for rule in role["rules"] if rule["resources"] == ["configmaps"]
           for name in rule["resourceNames"]}
    assert cms == {"kappa-view-template": {"get", "watch"}, "kappa-view-state": {"get", "update", "patch"}}


def test_api_errors_become_one_line_runner_errors(default_objs: list[dict]) -> None:
    class Forbidden(FakeApps):
        def read_namespaced_deployment(self, name: str, namespace: str) -> dict:
            raise ApiError(403, "Forbidden")

    runner = runner_from(default_objs, apps_api=Forbidden(), core_api=fake_core(default_objs), batch_api=FakeBatch())
    with pytest.raises(KubernetesRunnerError, match="read deployment/kappa-view-events-raw-v1 failed: 403 Forbidden"):
        runner.status("events_raw", 1)


def test_template_must_be_a_view_deployment() -> None:
    with pytest.raises(KubernetesRunnerError, match="not a Deployment"):
        KubernetesRunner(yaml.safe_dump({"kind": "Service"}))
    with pytest.raises(KubernetesRunnerError, match="placeholder"):
        KubernetesRunner(yaml.safe_dump({"kind": "Deployment", "metadata": {"name": "x"}}))


def test_grouped_versions_are_taken_over_by_record(helm: Path, tmp_path: Path) -> None:
    """grouping=grouped: the chart's versions run in deployment/kappa-views; the runner reports them running there,
    and stopping one (a promote replaced it) records it stopped (the host and the next upgrade drop it) without
    touching the grouped Deployment."""
    objs = h.render(h.CHART / "examples" / "local.yaml", tmp_dir=tmp_path)
    apps, core = FakeApps(), fake_core(objs)
    host = h.named(objs, "Deployment", "kappa-views")
    apps.deployments[("kappa", "kappa-views")] = {**host, "status": {"ready_replicas": 1}}
    runner = runner_from(objs, apps_api=apps, core_api=core, batch_api=FakeBatch())
    hosted = host["metadata"]["annotations"]["kappa.io/views"].split(",")
    assert "campaign_window_counts@v1" in hosted
    st = runner.status("campaign_window_counts", 1)
    assert (st.state, st.detail) == ("running", "hosted by deployment/kappa-views ready")
    assert runner.status("campaign_window_counts", 2).state == "stopped", "not hosted, no deployment"

    st = runner.stop("campaign_window_counts", 1)
    assert st.state == "stopped" and "deployment/kappa-views stops it" in st.detail, st.detail
    assert core.record() == {"campaign_window_counts": {"1": core.record()["campaign_window_counts"]["1"]}}
    assert core.record()["campaign_window_counts"]["1"]["state"] == "stopped"
    assert ("kappa", "kappa-views") in apps.deployments, "the other hosted views go on"
    assert runner.wait("campaign_window_counts", 1, ready=False, timeout=1, poll=0.01).state == "stopped"

    # a rollback starts it again, in a Deployment of its own (the record says so; the host does not take it back)
    runner.start("campaign_window_counts", 1, "earliest")
    assert ("kappa", "kappa-view-campaign-window-counts-v1") in apps.deployments
    assert core.record()["campaign_window_counts"]["1"]["state"] == "running"


def test_records_survive_a_concurrent_writer(helm: Path) -> None:
    """Two runners (two Airflow tasks) record at once: the loser of the resourceVersion race re-reads and
    re-applies, so neither entry is lost."""
    objs = h.render()
    core = fake_core(objs)
    a = runner_from(objs, apps_api=FakeApps(), core_api=core, batch_api=FakeBatch())
    real_patch = core.patch_namespaced_config_map
    raced = []

    def racing_patch(name: str, namespace: str, body: dict) -> dict:
        if not raced:  # another writer commits between our read and our patch
            raced.append(True)
            real_patch(name, namespace, {"metadata": {}, "data": {"views.json": json.dumps(
                {"user_sessions": {"3": {"state": "running"}}})}})
        return real_patch(name, namespace, body)

    core.patch_namespaced_config_map = racing_patch
    a._record("events_raw", 2, {"state": "stopped"})
    assert raced and core.record()["user_sessions"] == {"3": {"state": "running"}}
    assert core.record()["events_raw"]["2"]["state"] == "stopped"


def test_a_release_without_the_record_is_refused_in_one_line(helm: Path) -> None:
    objs = h.render()
    runner = runner_from(objs, apps_api=FakeApps(), core_api=FakeCore(), batch_api=FakeBatch())
    with pytest.raises(KubernetesRunnerError, match="configmap/kappa-view-state not found: the chart creates it"):
        runner.start("user_sessions", 2, "earliest")

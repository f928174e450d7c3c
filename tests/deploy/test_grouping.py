"""viewJobs.grouping: one driver per view version (perView, default) or ONE grouped driver (`kappa host run`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import deploy_helpers as h
from kappa.control.runners.kubernetes import KubernetesRunner

pytestmark = pytest.mark.deploy

GROUPED = {"viewJobs": {"grouping": "grouped"}}


def _defaults() -> dict:
    return yaml.safe_load((h.CHART / "values.yaml").read_text())["viewJobs"]


def _running(platform: dict | None = None) -> list[tuple[str, str]]:
    """(view, version) of every default version, in the chart's order (views sorted by name)."""
    views = (platform or h.platform())["views"]
    return [(v, str(views[v]["default_version"])) for v in sorted(views)]


def _grouped(objs: list[dict]) -> dict:
    drivers = h.view_deployments(objs)
    assert [d["metadata"]["name"] for d in drivers] == ["kappa-views"], "grouped: exactly one view Deployment"
    return drivers[0]


def _hosted(args: list[str]) -> list[tuple[str, str]]:
    """(view@vN, starting) pairs of a `kappa host run` command line."""
    return [(args[i + 1], args[i + 3]) for i, a in enumerate(args) if a == "--view"]


def _container(d: dict) -> dict:
    return h.pod_spec(d)["containers"][0]


# ------------------------------------------------------------------------------------------ the grouped driver
def test_grouped_renders_one_driver_hosting_every_running_version(helm: Path, tmp_path: Path) -> None:
    objs = h.render(GROUPED, tmp_dir=tmp_path)
    d = _grouped(objs)
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}
    c = _container(d)
    running = _running()
    args = c["args"]
    assert args[:3] == ["kappa", "host", "run"]
    assert _hosted(args) == [(f"{v}@v{n}", "earliest") for v, n in running]
    assert args[args.index("--metrics-port") + 1] == "9400"
    assert args[args.index("--driver-memory") + 1] == _defaults()["groupedDriverMemory"]
    # one named metrics port per hosted view version, base + i, names valid IANA service names (<= 15 chars)
    metrics = [p for p in c["ports"] if p["name"].startswith("m-")]
    assert metrics == [{"name": f"m-{i}", "containerPort": 9400 + i, "protocol": "TCP"} for i in range(len(running))]
    assert all(len(p["name"]) <= 15 for p in c["ports"])
    assert "metrics" not in {p["name"] for p in c["ports"]}
    assert c["resources"] == _defaults()["groupedResources"]
    assert d["metadata"]["annotations"]["kappa.io/views"] == ",".join(f"{v}@v{n}" for v, n in running)
    # no per-view driver is rendered beside it
    assert not [o for o in h.by_kind(objs, "Deployment") if o["metadata"]["name"].startswith("kappa-view-")]


def test_grouped_and_per_view_drivers_share_the_pod_spec(helm: Path, tmp_path: Path) -> None:
    per_view = h.view_deployments(h.render())[0]
    grouped = _grouped(h.render(GROUPED, tmp_dir=tmp_path))
    a, b = h.pod_spec(per_view), h.pod_spec(grouped)
    for key in ("serviceAccountName", "automountServiceAccountToken", "enableServiceLinks", "securityContext",
                "affinity", "terminationGracePeriodSeconds"):
        assert a.get(key) == b.get(key), key
    # the grouped driver mounts, in addition, the runner's view-state record (views it must hand over)
    state = {"name": "view-state", "configMap": {"name": "kappa-view-state", "optional": True}}
    assert b["volumes"] == a["volumes"] + [state] and state not in a["volumes"]
    ca, cb = a["containers"][0], b["containers"][0]
    for key in ("name", "image", "imagePullPolicy", "env", "envFrom", "securityContext"):
        assert ca[key] == cb[key], key
    mount = {"name": "view-state", "mountPath": "/etc/kappa/view-state", "readOnly": True}
    assert cb["volumeMounts"] == ca["volumeMounts"] + [mount]
    assert cb["args"][cb["args"].index("--handed-over") + 1] == "/etc/kappa/view-state/views.json"
    assert per_view["spec"]["template"]["metadata"]["annotations"] == grouped["spec"]["template"]["metadata"]["annotations"]
    for label in ("app.kubernetes.io/component", "app.kubernetes.io/part-of", "kappa.io/lake-claim"):
        assert h.pod_labels(per_view)[label] == h.pod_labels(grouped)[label], label


def test_grouped_follows_the_view_overrides(helm: Path, tmp_path: Path) -> None:
    p = h.platform()
    module = next(iter(p["views"]["user_sessions"]["versions"].values()))["module"]
    p["views"]["user_sessions"]["versions"] = {v: {"module": module.replace(".v1", f".v{v}")} for v in (1, 2, 3)}
    chart = h.chart_copy_with_platform(tmp_path, p)
    objs = h.render(GROUPED, {"views": {"user_sessions": {"versions": [1, 3], "starting": "latest"},
                                        "events_raw": {"versions": []}}}, chart=chart, tmp_dir=tmp_path)
    args = _container(_grouped(objs))["args"]
    assert _hosted(args) == [("ad_events_archive@v1", "earliest"), ("campaign_catalog@v1", "earliest"),
                             ("campaign_hourly_totals@v1", "earliest"), ("campaign_window_counts@v1", "earliest"),
                             ("user_sessions@v1", "latest"), ("user_sessions@v3", "latest")]
    assert [p["containerPort"] for p in _container(_grouped(objs))["ports"] if p["name"].startswith("m-")] == \
        [9400, 9401, 9402, 9403, 9404, 9405]
    # nothing to host: no grouped driver at all
    none = h.render(GROUPED, {"views": {v: {"versions": []} for v in p["views"]}}, chart=chart, tmp_dir=tmp_path)
    assert not h.view_deployments(none)


def test_the_host_cli_maps_each_view_to_its_container_port(helm: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered command line, parsed by the real `kappa host run`: i-th --view -> metrics port base + i."""
    from typer.testing import CliRunner

    import kappa.runtime.host
    from kappa.front.cli import app

    hosted: dict = {}

    class FakeHost:  # records what the CLI asks for; no Spark
        def __init__(self, settings, *, driver_memory, static, handed_over):
            hosted.update(driver_memory=driver_memory, static=static, handed_over=handed_over)

        def run(self) -> None:
            pass

    monkeypatch.setattr(kappa.runtime.host, "ViewHost", FakeHost)
    objs = h.render(GROUPED, {"views": {"user_sessions": {"starting": "ts:1700000000000"}}}, tmp_dir=tmp_path)
    c = _container(_grouped(objs))
    assert c["args"][0] == "kappa"
    result = CliRunner().invoke(app, c["args"][1:])
    assert result.exit_code == 0, result.output + repr(result.exception)
    ports = {p["containerPort"] for p in c["ports"] if p["name"].startswith("m-")}
    assert [(s.ref, s.starting, s.metrics_port) for s in hosted["static"]] == [
        (f"{v}@v{n}", "ts:1700000000000" if v == "user_sessions" else "earliest", 9400 + i)
        for i, (v, n) in enumerate(_running())]
    assert {s.metrics_port for s in hosted["static"]} == ports
    assert hosted["handed_over"] == "/etc/kappa/view-state/views.json"
    assert hosted["driver_memory"] == _defaults()["groupedDriverMemory"]
    # without --metrics-port every view keeps a random port, as before
    CliRunner().invoke(app, ["host", "run", "--view", "events_raw"])
    assert [s.metrics_port for s in hosted["static"]] == [0]


# ------------------------------------------------------------------------------------------ probes
def _probe(c: dict, kind: str) -> list[str]:
    return c[kind]["exec"]["command"]


def test_grouped_probes_check_every_view_port(helm: Path, tmp_path: Path) -> None:
    """readiness: every view's /metrics answers; startup/liveness: at least one (a failed view is stopped alone).
    A version the Kubernetes runner took over (the mounted view-state file records it: a rollback left the pod
    0/1 Ready until uninstall when its closed port was still checked) is not checked."""
    import json

    from prometheus_client import CollectorRegistry, start_http_server

    from kappa.log.broker import free_port

    c = _container(_grouped(h.render(GROUPED, tmp_dir=tmp_path)))
    ports = [str(p["containerPort"]) for p in c["ports"] if p["name"].startswith("m-")]
    refs = _grouped(h.render(GROUPED, tmp_dir=tmp_path))["metadata"]["annotations"]["kappa.io/views"].split(",")
    state = "/etc/kappa/view-state/views.json"
    mount = {m["mountPath"] for m in c["volumeMounts"]}
    assert state.rsplit("/", 1)[0] in mount, "the probe reads the view-state file the host reads"
    for kind, mode in (("startupProbe", "any"), ("livenessProbe", "any"), ("readinessProbe", "all")):
        cmd = _probe(c, kind)
        assert cmd[:2] == ["python", "-c"] and cmd[3:] == [state, mode, *(f"{r}={p}" for r, p in zip(refs, ports))], \
            kind
        assert c[kind]["timeoutSeconds"] >= 5, f"{kind}: the check's per-port timeout is 3 s"

    # run the check itself against real metrics endpoints: two up, one closed
    servers = [start_http_server(free_port(), addr="127.0.0.1", registry=CollectorRegistry()) for _ in range(2)]
    record = tmp_path / "views.json"
    try:
        up = [f"view{i}@v1={s.server_port}" for i, (s, _thread) in enumerate(servers)]
        down = f"closed@v1={free_port()}"

        def check(mode: str, *targets: str) -> int:
            script = _probe(c, "readinessProbe")[2]
            return subprocess.run([sys.executable, "-c", script, str(record), mode, *targets], timeout=30).returncode

        assert check("all", *up) == 0 and check("any", *up) == 0, "no view-state file mounted yet"
        assert check("all", *up, down) == 1, "one view down: the pod is not Ready"
        assert check("any", *up, down) == 0, "one view down: the others keep the pod alive"
        assert check("any", down) == 1, "no view left: liveness restarts the host"
        record.write_text(json.dumps({"closed": {"1": {"state": "stopped"}}}))
        assert check("all", *up, down) == 0, "a version handed over to the runner is not the host's to answer"
        assert check("any", down) == 0, "every version handed over: nothing to restart the host for"
        record.write_text(json.dumps({"view0": {"1": {"state": "running"}}}))
        assert check("all", *up, down) == 1, "the closed port is still the host's"
        record.write_text("{not json")
        assert check("all", *up, down) == 1, "a bad file is ignored, as the host ignores it"
    finally:
        for server, _thread in servers:
            server.shutdown()
            server.server_close()


# ------------------------------------------------------------------------------------------ monitoring
def test_monitoring_scrapes_every_grouped_port(helm: Path, tmp_path: Path) -> None:
    objs = h.render(GROUPED, tmp_dir=tmp_path, api_versions=[h.MONITORING_API])
    d = _grouped(objs)
    names = {p["name"] for p in _container(d)["ports"] if p["name"].startswith("m-")}
    pm = h.by_kind(objs, "PodMonitor")[0]
    endpoints = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert endpoints == names | {"metrics"}, "every hosted view + the replay drivers the runner starts"
    assert all(e["path"] == "/metrics" for e in pm["spec"]["podMetricsEndpoints"])
    assert pm["spec"]["selector"]["matchLabels"].items() <= h.pod_labels(d).items()
    pol = h.named(objs, "NetworkPolicy", "kappa-view")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= h.pod_labels(d).items()
    metrics_rule = pol["spec"]["ingress"][0]
    assert {p["port"] for p in metrics_rule["ports"]} == names | {"metrics"}
    assert metrics_rule["from"] == h.named(h.render(), "NetworkPolicy", "kappa-view")["spec"]["ingress"][0]["from"]
    # perView: only the `metrics` port, as before
    per_view = h.by_kind(h.render(api_versions=[h.MONITORING_API]), "PodMonitor")[0]
    assert [e["port"] for e in per_view["spec"]["podMetricsEndpoints"]] == ["metrics"]


# ------------------------------------------------------------------------------------------ replays
def test_replays_keep_their_own_driver_in_grouped_mode(helm: Path, tmp_path: Path) -> None:
    """The runner's template is the per-view Deployment in both modes and never names or selects the grouped one."""
    per_view, grouped = h.render(), h.render(GROUPED, tmp_dir=tmp_path)
    template = h.configmap_data(grouped, "kappa-view-template")
    same = lambda data: {k: yaml.safe_load(v) for k, v in data.items() if k not in ("placeholders.json", "runner.json")}  # noqa: E731
    assert same(template) == same(h.configmap_data(per_view, "kappa-view-template"))
    # only the grouped release names a driver the runner may take versions over from
    assert json.loads(template["runner.json"]) == {"stateConfigMap": "kappa-view-state", "groupedDeployment": "kappa-views"}
    assert json.loads(h.configmap_data(per_view, "kappa-view-template")["runner.json"])["groupedDeployment"] == ""
    runner = KubernetesRunner.from_configmap(template)
    assert (runner.state_configmap, runner.grouped_deployment) == ("kappa-view-state", "kappa-views")
    host = _grouped(grouped)
    for view, version in [*_running(), ("campaign_window_counts", "2")]:
        built = runner.manifest(view, int(version), "earliest")
        assert built["metadata"]["name"] == f"kappa-view-{view.replace('_', '-')}-v{version}" != host["metadata"]["name"]
        assert built["spec"]["selector"] != host["spec"]["selector"]
        assert not built["spec"]["selector"]["matchLabels"].items() <= h.pod_labels(host).items()
        assert not host["spec"]["selector"]["matchLabels"].items() <= h.pod_labels(built).items()
        assert _container(built)["args"][:3] == ["kappa", "view", "run"]
    # the runner's drivers are scraped and reachable exactly as in perView mode
    assert "metrics" in json.dumps(h.named(grouped, "NetworkPolicy", "kappa-view")["spec"]["ingress"][0]["ports"])

"""The chart's monitoring objects read by a real Prometheus: the Prometheus operator and a Prometheus on the node
(``infra/k8s/node.sh monitoring``: kube-prometheus-stack's part the chart uses, built from the Go module proxy), the
release test_platform.py installed upgraded with docs/deploy.md's upgrade block so that its PodMonitor and
PrometheusRule render (``monitoring.prometheusOperator: auto``: the CRDs came after the install).

Runs after test_platform.py and test_platform_faults.py on their release. What is checked against what: the targets
Prometheus scrapes against the named ports of the view pods the Kubernetes API lists (the PodMonitor's selection
computed apart from Prometheus), through the chart's NetworkPolicies as kube-router enforces them; the series of every
hosted view version; the chart's rule groups loaded and evaluated; a view whose driver cannot start firing
``KappaViewDown`` within its ``for:`` plus one evaluation and one scrape interval, and clearing once fixed; and a
traffic surge the views cannot follow firing ``KappaConsumerLagGrowing`` (its thresholds tuned as docs/deploy.md
tells an operator) within its ``for:`` plus one evaluation interval of the moment Prometheus' own evaluation of its
expression first holds, and clearing once the surge ends and the views drain what it left.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from tests.cluster.conftest import NS, RELEASE, ROOT, Release
from tests.docs_blocks import shell_block

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

PROM_NS, PROM_POD = "monitoring", "prometheus-prometheus-0"
#: the Prometheus CR's intervals (infra/k8s/node.sh monitoring) and the PodMonitor's default (values.yaml)
EVALUATION_S, SCRAPE_S = 30, 30
VIEW_DOWN_FOR_S = 300
#: the producer's rate during the surge: above what the six views of the grouped driver follow on the node's 2 cores
#: (each view's batches read it in full: 4 of them read ad-events), within what the producer's 500m make
SURGE_RATE = 5000


def _api(url: str, path: str, **params: str) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture(scope="module")
def prometheus(release: Release) -> str:
    """The operator and Prometheus up on the node, the release upgraded so its PodMonitor and rules exist; the
    Prometheus API's address (the pod's, reached from the node's host as any pod address is)."""
    from tests.cluster.test_platform import _run_block, _upgrade

    block = shell_block("make cluster-monitoring")  # docs/deploy.md, verbatim, with section 5's pinned kubectl
    started = time.monotonic()
    _run_block(release, block, timeout=2400)
    release.record("make cluster-monitoring (operator + Prometheus ready; builds when absent)",
                   time.monotonic() - started)
    _upgrade(release)
    kinds = release.node.kubectl("get", "podmonitor,prometheusrule", "-n", NS, "-o", "name").stdout.split()
    assert sorted(k.split("/")[0] for k in kinds) == ["podmonitor.monitoring.coreos.com",
                                                      "prometheusrule.monitoring.coreos.com"], kinds
    ip = release.node.get("pod", PROM_POD, "-n", PROM_NS)["status"]["podIP"]
    return f"http://{ip}:9090"


def _expected_targets(release: Release) -> set[tuple[str, str]]:
    """(pod, port name) the PodMonitor selects, from the Kubernetes API alone: every running view pod of the release
    and each of its container ports named ``metrics`` or ``m-<i>`` (helm/kappa/templates/monitoring/podmonitor.yaml)."""
    pods = release.node.get("pods", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE},"
                                                   "app.kubernetes.io/component=view")["items"]
    return {(p["metadata"]["name"], port["name"]) for p in pods if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
            for c in p["spec"]["containers"] for port in c.get("ports", [])
            if re.fullmatch(r"metrics|m-\d+", port.get("name", ""))}


def _targets(url: str) -> dict[tuple[str, str], str]:
    """(pod, endpoint) -> health of the active targets of the release's PodMonitor."""
    active = _api(url, "targets", state="active")["activeTargets"]
    return {(t["labels"].get("pod", ""), t["labels"].get("endpoint", "")): t["health"] for t in active
            if t["scrapePool"].startswith(f"podMonitor/{NS}/")}


def test_prometheus_scrapes_every_view_driver_and_evaluates_the_chart_rules(release: Release, prometheus: str) -> None:
    """Every (pod, port) the PodMonitor selects is a target that is up - the chart's NetworkPolicy admits Prometheus
    from namespace monitoring under kube-router - every hosted view version's series arrives, and the chart's rule
    group is loaded and evaluated without error, no alert firing on the healthy release."""
    expected = _expected_targets(release)
    assert expected, "no running view pod"
    deadline = time.monotonic() + 360  # the operator's config reaches Prometheus through a mounted Secret (~1-2 min)
    while (seen := _targets(prometheus)) != {t: "up" for t in expected}:
        assert time.monotonic() < deadline, f"targets {seen} != every one of {sorted(expected)} up"
        time.sleep(10)
        expected = _expected_targets(release)
    print(f"targets up: {sorted(seen)}")
    # every view version the drivers host reports through Prometheus (independently: the drivers' annotations)
    hosted = set()
    for d in release.node.get("deployments", "-n", NS, "-l", "app.kubernetes.io/component=view")["items"]:
        views = d["metadata"].get("annotations", {}).get("kappa.io/views", "")
        hosted |= {tuple(v.split("@v")) for v in views.split(",") if "@v" in v}
    assert hosted, "no view version hosted"
    deadline = time.monotonic() + 120  # a target just up: its gauges are set at the driver's next poll and scrape
    while True:
        series = _api(prometheus, "query", query=f'kappa_last_delta_version{{namespace="{NS}"}}')["result"]
        reported = {(s["metric"]["view"], s["metric"]["version"]) for s in series}
        if hosted <= reported:
            break
        assert time.monotonic() < deadline, (sorted(hosted), sorted(reported))
        time.sleep(10)
    deadline = time.monotonic() + 180
    while True:
        groups = {g["name"]: g for g in _api(prometheus, "rules", type="alert")["groups"]}
        rules = groups.get("kappa.views", {}).get("rules", [])
        if rules and all(r["health"] == "ok" for r in rules):
            break
        assert time.monotonic() < deadline, json.dumps(groups)[:3000]
        time.sleep(10)
    rendered = release.node.get("prometheusrule", f"{RELEASE}-alerts", "-n", NS)
    names = [r["alert"] for g in rendered["spec"]["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(names)
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert not firing, f"alerts firing on the healthy release: {firing}"


def _view_deployment(release: Release) -> str:
    """A driver that runs one view version (a replay's or a rollback's own Deployment), else the grouped driver."""
    names = [d["metadata"]["name"] for d in
             release.node.get("deployments", "-n", NS, "-l", "app.kubernetes.io/component=view")["items"]]
    own = sorted(n for n in names if n != f"{RELEASE}-views")
    return own[0] if own else f"{RELEASE}-views"


def _alert(url: str, name: str) -> dict | None:
    return next((a for a in _api(url, "alerts")["alerts"] if a["labels"].get("alertname") == name), None)


def test_a_view_whose_driver_cannot_start_fires_view_down_and_clears(release: Release, prometheus: str) -> None:
    """A bad JVM option in one driver's Deployment (an operator's mistake: the JVM refuses to start, the pod crash
    loops; Recreate has stopped the old driver): KappaViewDown fires for that pod within its 5-minute ``for:`` plus one
    evaluation and one scrape interval after its first failed scrape, and clears after ``kubectl rollout undo``."""
    deployment = _view_deployment(release)
    release.node.kubectl("-n", NS, "set", "env", f"deploy/{deployment}", "JAVA_TOOL_OPTIONS=-XX:+KappaNoSuchOption")
    broken_at = time.time()
    try:
        deadline = time.monotonic() + VIEW_DOWN_FOR_S + 600
        while not ((alert := _alert(prometheus, "KappaViewDown")) and alert["state"] == "firing"):
            assert time.monotonic() < deadline, f"KappaViewDown not firing: {_api(prometheus, 'alerts')}"
            time.sleep(5)
        fired_at = time.time()
        pod = alert["labels"]["pod"]
        assert pod.startswith(deployment), alert
        # the symptom's start, from Prometheus' own samples: the pod's first failed scrape
        samples = _api(prometheus, "query_range", query=f'up{{namespace="{NS}",pod="{pod}"}}', start=str(broken_at),
                       end=str(fired_at), step="5")["result"]
        first_down = min(float(t) for s in samples for t, v in s["values"] if v == "0")
        delay = fired_at - first_down
        release.record("KappaViewDown: first failed scrape -> firing", delay)
        release.record("KappaViewDown: bad Deployment -> firing", fired_at - broken_at)
        assert delay <= VIEW_DOWN_FOR_S + EVALUATION_S + SCRAPE_S + 30, (delay, alert)
    finally:
        release.node.kubectl("-n", NS, "rollout", "undo", f"deploy/{deployment}")
    fixed_at = time.monotonic()
    release.node.kubectl("-n", NS, "rollout", "status", f"deploy/{deployment}", "--timeout=900s", timeout=960)
    while _alert(prometheus, "KappaViewDown"):
        assert time.monotonic() - fixed_at < 900, _api(prometheus, "alerts")
        time.sleep(5)
    release.record("KappaViewDown: rollout undo -> cleared", time.monotonic() - fixed_at)
    while any(health != "up" for health in _targets(prometheus).values()):
        assert time.monotonic() - fixed_at < 900, f"{deployment} fixed, its targets not up: {_targets(prometheus)}"
        time.sleep(10)


def _helm_block(release: Release, text: str, timeout: float = 1800) -> None:
    from tests.cluster.test_platform import _run_shell

    _run_shell(release.node, text, text.splitlines()[0], timeout)


def _seconds(duration: str) -> int:
    """A Prometheus duration of the chart's values (``2m``, ``15m``, ``90s``, ``1h``) in seconds."""
    m = re.fullmatch(r"(\d+)([smh])", duration)
    assert m, duration
    return int(m[1]) * {"s": 1, "m": 60, "h": 3600}[m[2]]


def test_a_surge_the_views_cannot_follow_fires_lag_growing_and_clears(release: Release, prometheus: str) -> None:
    """The operator tunes the lag alert to the platform's traffic with docs/deploy.md's block (verbatim); Prometheus
    loads the re-rendered rule; the producer's rate is raised beyond what the views follow (``producer.rate``, a
    traffic surge); ``KappaConsumerLagGrowing`` fires within its ``for:`` plus one evaluation interval of the first
    instant at which Prometheus' own evaluation of the rule's expression (``query_range`` over the same samples)
    holds, for a view whose lag the broker's end offsets confirm; back at 200 events/s the views drain the backlog
    and the alert clears. The section's upgrade block restores the install's values after."""
    tune = shell_block("lagRecords=")  # docs/deploy.md, "Alerts on the node", verbatim
    records = int(re.search(r"lagRecords=(\d+)", tune.text)[1])
    lag_for = re.search(r"lagFor=(\w+)", tune.text)[1]
    _helm_block(release, tune.text)
    rule = next(r for g in release.node.get("prometheusrule", f"{RELEASE}-alerts", "-n", NS)["spec"]["groups"]
                for r in g["rules"] if r.get("alert") == "KappaConsumerLagGrowing")
    assert f"> {records}" in rule["expr"] and rule["for"] == lag_for, rule
    deadline = time.monotonic() + 300  # the operator re-renders Prometheus' rule files; its reloader reloads them
    while not any(r["name"] == "KappaConsumerLagGrowing" and f"> {records}" in r["query"]
                  for g in _api(prometheus, "rules", type="alert")["groups"] for r in g["rules"]):
        assert time.monotonic() < deadline, "Prometheus did not load the tuned rule"
        time.sleep(5)
    assert _alert(prometheus, "KappaConsumerLagGrowing") is None, "lag alert before the surge"
    helm = str(release.node.helm)
    surge = (f"{helm} upgrade {RELEASE} ./helm/kappa -n {NS} --reuse-values --set producer.rate={SURGE_RATE} "
             "--wait --timeout 10m")
    surged_at = time.time()
    try:
        _helm_block(release, surge)
        deadline = time.monotonic() + 1200
        while not ((alert := _alert(prometheus, "KappaConsumerLagGrowing")) and alert["state"] == "firing"):
            assert time.monotonic() < deadline, f"KappaConsumerLagGrowing not firing: {_api(prometheus, 'alerts')}"
            time.sleep(5)
        fired_at = time.time()
        labels = alert["labels"]
        view, version = labels["view"], labels["version"]
        # the symptom's start: the rule's own expression as Prometheus evaluates it over the same samples
        held = _api(prometheus, "query_range", query=rule["expr"], start=str(surged_at), end=str(fired_at),
                    step="5")["result"]
        first = min(float(t) for s in held if (s["metric"].get("view"), s["metric"].get("version")) == (view, version)
                    for t, _v in s["values"])
        delay = fired_at - first
        release.record("KappaConsumerLagGrowing: producer surge -> firing", fired_at - surged_at)
        release.record("KappaConsumerLagGrowing: expression holds -> firing", delay)
        assert delay <= _seconds(lag_for) + EVALUATION_S + 30, (delay, alert)
        # the lag is real: the broker's own end offsets of the view's topic, read first, against the offsets the
        # view reports it processed in its first scrape after that (they only grow: the difference can only be
        # less than the lag at the broker's answer)
        from tests.cluster.test_platform_faults import _end_offsets

        sel = f'namespace="{NS}",view="{view}",version="{version}"'
        offsets = "kappa_partition_processed_offset"
        topic = _api(prometheus, "query", query=f"{offsets}{{{sel}}}")["result"][0]["metric"]["topic"]
        ends, read_at = _end_offsets(release, topic), time.time()
        time.sleep(SCRAPE_S + 15)
        samples = _api(prometheus, "query", query=f'{offsets}{{{sel},topic="{topic}"}}[2m]')["result"]
        processed = {int(s["metric"]["partition"]): min((float(v) for t, v in s["values"] if float(t) > read_at),
                                                        default=float("inf")) for s in samples}
        behind = sum(ends.values()) - sum(processed.values())
        release.record_detail("KappaConsumerLagGrowing: the firing view's records behind the broker's end offsets",
                              {"view": f"{view}@v{version}", "topic": topic, "behind": behind})
        assert set(processed) == set(ends) and behind > records, (behind, ends, processed, alert)
    finally:
        _helm_block(release, surge.replace(f"producer.rate={SURGE_RATE}", "producer.rate=200"))
    ended_at = time.monotonic()
    while _alert(prometheus, "KappaConsumerLagGrowing"):
        assert time.monotonic() - ended_at < 1800, _api(prometheus, "alerts")
        time.sleep(10)
    release.record("KappaConsumerLagGrowing: surge ended -> cleared", time.monotonic() - ended_at)
    from tests.cluster.test_platform import _upgrade

    _upgrade(release)  # the install's values again (the tuned thresholds and the rate back to the example's)


#: A new version with a bug that real records trigger: v1's windows plus the campaign id as a number - the ids are
#: UUIDs, and Spark's ANSI mode refuses the cast in every micro-batch that has a window to write
BUGGY_VERSION = 4
BUGGY_MODULE = '''"""campaign_window_counts v4: v1 with the campaign id as a number (a bug: campaign ids are UUIDs)."""

from dataclasses import replace

from pyspark.sql import functions as F

from jobs.campaign_window_counts import v1


def transform(events, campaigns):
    return v1.transform(events, campaigns).withColumn("campaign_number", F.col("campaign_id").cast("int"))


VIEW = replace(v1.VIEW, version=4, transform=transform, publish=None,
               description="v1 with a numeric campaign id (fails on every window)")
'''


def _podman(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTAINERS_CONF": str(ROOT / ".cache" / "images" / "containers.conf")}
    res = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == 0, f"podman {' '.join(args)}: {res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


def _images_with_the_new_version(tmp_path, tag: str) -> None:
    """The view-job and Airflow images of the release plus jobs/campaign_window_counts/v4.py and its line in
    kappa/platform.yaml - what a team's own build of a new version ships - tagged ``tag``, in the node's runtime."""
    from tests.cluster.conftest import image

    (tmp_path / "v4.py").write_text(BUGGY_MODULE)
    platform = (ROOT / "kappa" / "platform.yaml").read_text()
    line = "      3: {module: jobs.campaign_window_counts.v3}"
    assert line in platform
    (tmp_path / "platform.yaml").write_text(platform.replace(
        line, f"{line}\n      {BUGGY_VERSION}: {{module: jobs.campaign_window_counts.v{BUGGY_VERSION}}}", 1))
    for name in ("view-job", "airflow"):
        (tmp_path / "Containerfile").write_text(
            f"FROM {image(name)}\n"
            f"COPY v4.py /opt/kappa/jobs/campaign_window_counts/v{BUGGY_VERSION}.py\n"
            "COPY platform.yaml /opt/kappa/kappa/platform.yaml\n")
        _podman("build", "--quiet", "-t", f"localhost/kappa/{name}:{tag}", "-f", str(tmp_path / "Containerfile"),
                str(tmp_path))
    res = subprocess.run(["bash", str(ROOT / "infra" / "k8s" / "node.sh"), "load"], capture_output=True, text=True,
                         timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_replay_of_a_failing_version_fires_batches_failing_fails_and_clears(release: Release, prometheus: str,
                                                                              tmp_path) -> None:
    """A new version whose code fails on real records reaches the cluster as a team ships one (images with the
    version, ``helm upgrade`` to their tag) and is replayed through the in-cluster Airflow with the DAG's defaults.
    Its driver restarts the failing query in process, so ``KappaBatchesFailing`` fires within its ``for:`` plus one
    evaluation and one scrape interval of the first failed micro-batch Prometheus saw; the replay run fails with
    the job's error in one line, the registry marks the version ``failed``, the version serving is untouched, the
    runner stops the crash-looping driver, and the alert clears. docs/deploy.md's upgrade block restores the images.
    """
    from kappa.control.registry import Registry
    from tests.cluster.conftest import h
    from tests.cluster.test_platform import _airflow, _port_forward, _serving, _upgrade

    view, version = "campaign_window_counts", BUGGY_VERSION
    tag = f"{h.versions()['KAPPA_VERSION']}-v{version}"
    deployment = f"{RELEASE}-view-campaign-window-counts-v{version}"
    serving = _serving(release, view)
    started = time.monotonic()
    _images_with_the_new_version(tmp_path, tag)
    release.record("a new version's images built and loaded", time.monotonic() - started)
    try:
        started = time.monotonic()
        _helm_block(release, f"{release.node.helm} upgrade {RELEASE} ./helm/kappa -n {NS} --reuse-values "
                             f"--set image.tag={tag} --set airflow.image.tag={tag} --wait --timeout 20m", 1800)
        release.record("helm upgrade to the new version's images", time.monotonic() - started)
        with _port_forward(release.node, f"svc/{RELEASE}-airflow-api-server", 8080) as url:
            api = _airflow(release, url)
            triggered_at = time.time()
            run_id = api.trigger("kappa_replay", {"view": view, "version": version})
            deadline = time.monotonic() + 1500
            while not ((alert := _alert(prometheus, "KappaBatchesFailing")) and alert["state"] == "firing"
                       and alert["labels"].get("version") == str(version)):
                run = api.state("kappa_replay", run_id)
                assert not run.finished, (f"the replay ended ({run.state}: {api.failure_reasons(run)}) before "
                                          f"KappaBatchesFailing fired: {_api(prometheus, 'alerts')}")
                assert time.monotonic() < deadline, f"KappaBatchesFailing not firing: {_api(prometheus, 'alerts')}"
                time.sleep(5)
            fired_at = time.time()
            assert alert["labels"]["view"] == view and alert["labels"]["namespace"] == NS, alert
            failed = _api(prometheus, "query_range", start=str(triggered_at), end=str(fired_at), step="5", query=(
                f'kappa_batches_failed_total{{namespace="{NS}",view="{view}",version="{version}"}} > 0'))["result"]
            first = min(float(t) for s in failed for t, _v in s["values"])
            delay = fired_at - first
            release.record("KappaBatchesFailing: replay triggered -> firing", fired_at - triggered_at)
            release.record("KappaBatchesFailing: first failed batch scraped -> firing", delay)
            assert delay <= 300 + EVALUATION_S + SCRAPE_S + 30, (delay, alert)
            state = api.wait("kappa_replay", run_id, timeout=2400, poll=10)
            release.record("kappa_replay of a failing version: triggered -> run failed", time.time() - triggered_at)
            reasons = api.failure_reasons(state)
        print(f"run {state.state}: {reasons}")
        assert state.state == "failed", (state.state, state.tasks)
        reason = " ".join(reasons.values())
        assert "before catching up" in reason and "its driver is stopped" in reason, reasons
        assert all("\n" not in r for r in reasons.values()), reasons
        assert Registry(str(release.lake())).get(view, version).state == "failed"
        assert _serving(release, view) == serving, "the version serving is untouched"
        gone = release.node.kubectl("get", "deployment", deployment, "-n", NS, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stdout
        stopped_at = time.monotonic()
        while _alert(prometheus, "KappaBatchesFailing"):
            assert time.monotonic() - stopped_at < 1200, _api(prometheus, "alerts")
            time.sleep(10)
        release.record("KappaBatchesFailing: failed driver stopped -> cleared", time.monotonic() - stopped_at)
    finally:
        _upgrade(release)  # the install's values: the release's own images again
        for name in ("view-job", "airflow"):
            _podman("rmi", f"localhost/kappa/{name}:{tag}")

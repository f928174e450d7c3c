"""The chart's monitoring objects read by a real Prometheus: the Prometheus operator and a Prometheus on the node
(``infra/k8s/node.sh monitoring``: kube-prometheus-stack's part the chart uses, built from the Go module proxy), the
release test_platform.py installed upgraded with docs/deploy.md's upgrade block so that its PodMonitor and
PrometheusRule render (``monitoring.prometheusOperator: auto``: the CRDs came after the install).

Runs after test_platform.py and test_platform_faults.py on their release. What is checked against what: the targets
Prometheus scrapes against the named ports of the view pods the Kubernetes API lists (the PodMonitor's selection
computed apart from Prometheus), through the chart's NetworkPolicies as kube-router enforces them; the series of every
hosted view version; the chart's rule groups loaded and evaluated; and a view whose driver cannot start firing
``KappaViewDown`` within its ``for:`` plus one evaluation and one scrape interval, and clearing once fixed.
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
    from tests.cluster.test_platform import _upgrade

    block = shell_block("make cluster-monitoring")  # docs/deploy.md, verbatim
    started = time.monotonic()
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=ROOT, capture_output=True, text=True,
                         timeout=2400, env={**release.node.env(),  # the docs' pinned kubectl (section 5's export)
                                            "PATH": f"{release.node.bin}:{os.environ['PATH']}"})
    assert res.returncode == 0, f"{block.where} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
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
    series = _api(prometheus, "query", query=f'kappa_last_delta_version{{namespace="{NS}"}}')["result"]
    reported = {(s["metric"]["view"], s["metric"]["version"]) for s in series}
    assert hosted and hosted <= reported, (sorted(hosted), sorted(reported))
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

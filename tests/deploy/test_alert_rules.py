"""The chart's alerts, evaluated by Prometheus itself: ``promtool test rules`` (the pinned Prometheus,
infra/prometheus/build.sh) over the PrometheusRule the chart renders with its default thresholds, with the unit
tests of tests/deploy/alerts/ - each alert fires with its labels and annotations, not before its ``for:``, and
stays quiet where it should."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

import deploy_helpers as h

pytestmark = pytest.mark.deploy

TESTS = h.ROOT / "tests" / "deploy" / "alerts" / "kappa-alerts.test.yaml"


@pytest.fixture(scope="module")
def promtool() -> Path:
    res = subprocess.run(["bash", str(h.ROOT / "infra" / "prometheus" / "build.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return Path(res.stdout.strip()) / "promtool"


def _rules(tmp_path: Path, *sets: str) -> Path:
    """The rendered PrometheusRule's groups as a Prometheus rule file, beside a copy of the unit tests."""
    rule = h.by_kind(h.render(sets=list(sets), api_versions=[h.MONITORING_API]), "PrometheusRule")[0]
    (tmp_path / "kappa-alerts.rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    (tmp_path / TESTS.name).write_text(TESTS.read_text())
    return tmp_path / TESTS.name


def _promtool(promtool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not(tmp_path: Path) -> None:
    rendered = yaml.safe_load(_rules(tmp_path).with_name("kappa-alerts.rules.yaml").read_text())
    alerts = {r["alert"] for g in rendered["groups"] for r in g["rules"]}
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert alerts and alerts <= fires, f"no case fires {sorted(alerts - fires)}"
    assert alerts <= quiet, f"no case where {sorted(alerts - quiet)} stays quiet"


def test_the_rules_pass_promtools_checks_and_unit_tests(promtool: Path, tmp_path: Path) -> None:
    tests = _rules(tmp_path)
    checked = _promtool(promtool, "check", "rules", "kappa-alerts.rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    res = _promtool(promtool, "test", "rules", tests.name, cwd=tmp_path)
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout + res.stderr


def test_the_unit_tests_follow_the_thresholds(promtool: Path, tmp_path: Path) -> None:
    """The same unit tests against a rule rendered with another lag threshold fail where that threshold shows: the
    tests read the rendered rule, not a copy of it."""
    tests = _rules(tmp_path, "monitoring.prometheusRule.thresholds.lagRecords=500000")
    res = _promtool(promtool, "test", "rules", tests.name, cwd=tmp_path)
    assert res.returncode != 0
    failed = res.stdout + res.stderr
    assert "KappaConsumerLagGrowing" in failed and "KappaBatchesFailing" not in failed, failed

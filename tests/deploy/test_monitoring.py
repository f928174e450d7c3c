"""Alert rules and the Grafana dashboard reference the metrics the drivers really export."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import deploy_helpers as h

pytestmark = pytest.mark.deploy

sys.path.insert(0, str(h.ROOT / "infra" / "deploy"))
from exported_metrics import exported_metrics  # noqa: E402

BRIEF_METRICS = {
    "kappa_partition_lag_records", "kappa_batch_duration_seconds", "kappa_batches_failed_total",
    "kappa_quarantined_records_total", "kappa_replay_progress_ratio", "kappa_watermark_delay_seconds",
    "kappa_input_rows_per_second", "kappa_processed_rows_per_second", "kappa_last_delta_version",
    "kappa_end_to_end_latency_seconds",
}


def metrics_in(expr: str) -> set[str]:
    return {m for m in re.findall(r"\bkappa_[a-z0-9_]+", expr)}


def base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_exported_metrics_are_read_from_the_code() -> None:
    exported = set(exported_metrics())
    assert BRIEF_METRICS <= exported, f"kappa/runtime/metrics.py lacks {sorted(BRIEF_METRICS - exported)}"
    # counters are exposed with _total, histograms by base name
    assert exported_metrics('Counter("kappa_x", "d")\nHistogram(\n  "kappa_h", "d")') == ["kappa_h", "kappa_x_total"]


def test_alert_rules(helm: Path) -> None:
    objs = h.render(api_versions=[h.MONITORING_API])
    rule = h.by_kind(objs, "PrometheusRule")[0]
    rules = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"KappaConsumerLagGrowing", "KappaBatchesFailing", "KappaQuarantineRateHigh", "KappaReplayStalled",
            "KappaWatermarkStuck", "KappaViewDown"} <= set(rules)
    exported = set(exported_metrics())
    for name, r in rules.items():
        used = {base(m) for m in metrics_in(r["expr"])}
        # every alert reads what the drivers export, but the one that sees a driver not answering its scrapes
        assert used or r["expr"].startswith("max by (namespace, pod, endpoint) (up{"), f"{name}: reads no kappa metric"
        assert used <= exported, f"{name}: unknown metrics {sorted(used - exported)}"
        assert 'namespace="kappa"' in r["expr"], f"{name}: not scoped to the release namespace"
        assert r["labels"]["severity"] in ("warning", "critical")
        if "by (namespace, view, version)" in r["expr"]:  # a view's alert names it: Go templates survive helm's
            assert "{{ $labels.view }}" in r["annotations"]["summary"], f"{name}: Go-template escaping broken"
    # a driver down: the scrape targets of the chart's own PodMonitor (job <namespace>/<PodMonitor name>)
    monitor = h.by_kind(objs, "PodMonitor")[0]["metadata"]
    assert f'job="{monitor["namespace"]}/{monitor["name"]}"' in rules["KappaViewDown"]["expr"]
    # thresholds are values, not constants
    tuned = h.render(sets=["monitoring.prometheusRule.thresholds.lagRecords=777"], api_versions=[h.MONITORING_API])
    lag = next(r for g in h.by_kind(tuned, "PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]
               if r["alert"] == "KappaConsumerLagGrowing")
    assert "> 777" in lag["expr"]


def test_dashboard_queries_use_exported_metrics() -> None:
    dash = json.loads((h.CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {base(m) for e in exprs for m in metrics_in(e)}
    assert BRIEF_METRICS <= used, f"dashboard does not chart {sorted(BRIEF_METRICS - used)}"
    assert used <= set(exported_metrics()), f"dashboard queries unknown metrics {sorted(used - set(exported_metrics()))}"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace", "view", "version"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_promql_parses(helm: Path, tmp_path: Path) -> None:
    import subprocess

    lint = h.TOOLS / "promql-lint"
    if not lint.exists():
        subprocess.run(["bash", str(h.ROOT / "infra" / "verify-offline.sh"), "--tools", "all"], check=True, cwd=h.ROOT,
                       capture_output=True)
    rendered = tmp_path / "rules.yaml"
    import yaml

    rendered.write_text(yaml.safe_dump_all(h.by_kind(h.render(api_versions=[h.MONITORING_API]), "PrometheusRule")))
    res = subprocess.run([str(lint), "-metrics", ",".join(exported_metrics()), "-dashboard",
                          str(h.CHART / "files" / "grafana-dashboard.json"), str(rendered)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"promql-lint: (\d+) expressions parsed, 0 problems", res.stdout)

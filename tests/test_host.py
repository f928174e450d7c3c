"""The view host: several view versions in one Spark application, added and removed while it runs."""

from __future__ import annotations

import time

import psutil
import pytest

from kappa import generator
from kappa.host import host_pid, stop_host
from kappa.job import ViewPaths
from kappa.runners.base import JobSpec
from kappa.runners.local import LocalRunner

pytestmark = pytest.mark.integration


def _rows(spark, settings, view: str) -> int:
    from delta.tables import DeltaTable

    path = ViewPaths(settings.lake_uri, view, 1).table
    return spark.read.format("delta").load(path).count() if DeltaTable.isDeltaTable(spark, path) else 0


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_host_runs_views_in_one_jvm_and_stops_one_alone(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=5, campaigns=5, users=50)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    first = generator.produce(lake, lake.topic("ad-events"), generator.events(1500, seed=5, universe=u,
                                                                               malformed_fraction=0.02))
    runner = LocalRunner(lake, mode="host")
    try:
        for view in ("events_raw", "campaign_window_counts"):
            status = runner.start(JobSpec(view, 1, starting="earliest", metrics_port=0))
            assert status.state == "running", status
        pid = host_pid(lake)
        assert pid is not None
        valid = first.kinds["valid"]
        _wait(lambda: _rows(spark, lake, "events_raw") == valid, 300, f"events_raw to hold {valid} rows")
        _wait(lambda: _rows(spark, lake, "campaign_window_counts") > 0, 300, "campaign_window_counts rows")
        jvms = [p for p in psutil.Process(pid).children(recursive=True)
                if "java" in p.name() and "SparkSubmit" in " ".join(p.cmdline())]
        assert len(jvms) == 1, f"expected one Spark JVM for both views, found {len(jvms)}"

        # stopping one view version leaves the other running in the same host
        assert runner.stop("campaign_window_counts", 1).state == "stopped"
        assert runner.status("campaign_window_counts", 1).state == "stopped"
        assert runner.status("events_raw", 1).state == "running"
        more = generator.produce(lake, lake.topic("ad-events"), generator.events(
            500, seed=6, universe=u, start_ms=1_700_000_900_000))
        _wait(lambda: _rows(spark, lake, "events_raw") == valid + more.kinds["valid"], 300, "the second load")
        assert host_pid(lake) == pid
        # an auto-mode runner (what `kappa replay` uses) joins the running host
        assert LocalRunner(lake).status("events_raw", 1).state == "running"
    finally:
        stop_host(lake)
    assert host_pid(lake) is None
    assert runner.status("events_raw", 1).state == "stopped"

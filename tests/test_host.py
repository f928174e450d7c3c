"""The view host: several view versions in one Spark application, added and removed while it runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest

from kappa.log import generator
from kappa.runtime.host import host_pid, stop_host
from kappa.identity import ViewPaths
from kappa.runtime.driver import JobSpec
from kappa.control.runners.local import LocalRunner

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


def _spark_jvms(pid: int) -> list[psutil.Process]:
    """The Spark JVMs under a process; a child that exits while it is looked at (a short-lived helper) is skipped."""
    jvms = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "java" in child.name() and "SparkSubmit" in " ".join(child.cmdline()):
                jvms.append(child)
        except psutil.NoSuchProcess:
            continue
    return jvms


def test_host_runs_views_in_one_jvm_restarts_a_failing_query_alone_and_stops_one_alone(
        spark, kafka, declared_topics, lake, monkeypatch):
    """Two views in one host JVM. A real storage fault (events_raw's Delta log replaced by a file, the one fake
    here: nothing else makes a commit fail on demand) fails that view's query; the host restarts it alone after a
    backoff, while the other view in the same JVM keeps committing; once the log is back the view catches up
    exactly once. Then one view version is stopped alone and the other goes on in the same host."""
    import os
    import shutil

    from delta.tables import DeltaTable

    monkeypatch.setenv("KAPPA_HOST_RESTART_BACKOFF_SECONDS", "2")
    monkeypatch.setenv("KAPPA_HOST_MAX_RESTARTS", "50")
    u = generator.universe(seed=8, campaigns=5, users=50)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    first = generator.produce(lake, lake.topic("ad-events"), generator.events(1000, seed=8, universe=u,
                                                                               malformed_fraction=0.02))
    runner = LocalRunner(lake, mode="host")
    windows = ViewPaths(lake.lake_uri, "campaign_window_counts", 1).table
    log = ViewPaths(lake.lake_uri, "events_raw", 1).table + "/_delta_log"
    try:
        for view in ("events_raw", "campaign_window_counts"):
            status = runner.start(JobSpec(view, 1, starting="earliest", metrics_port=0))
            assert status.state == "running", status
        pid = host_pid(lake)
        assert pid is not None
        _wait(lambda: _rows(spark, lake, "events_raw") == first.kinds["valid"], 300, "events_raw's first load")
        _wait(lambda: _rows(spark, lake, "campaign_window_counts") > 0, 300, "campaign_window_counts rows")
        jvms = _spark_jvms(pid)
        assert len(jvms) == 1, f"expected one Spark JVM for both views, found {len(jvms)}"
        # the host's stateful query started with one state store (shuffle partition), kept in its checkpoint
        first_batch = Path(ViewPaths(lake.lake_uri, "campaign_window_counts", 1).checkpoint) / "main" / "offsets" / "0"
        conf = json.loads(first_batch.read_text().splitlines()[1])["conf"]
        assert conf["spark.sql.shuffle.partitions"] == "1", conf

        # a failing query is restarted alone; the other keeps committing in the same JVM
        os.rename(log, log + ".away")
        with open(log, "w") as fh:
            fh.write("not a directory")
        before = DeltaTable.forPath(spark, windows).history(1).collect()[0]["version"]
        more = generator.produce(lake, lake.topic("ad-events"), generator.events(
            400, seed=9, universe=u, start_ms=1_700_000_900_000))
        _wait(lambda: "restarting" in runner.status("events_raw", 1).detail, 300, "events_raw to be restarting")
        _wait(lambda: DeltaTable.forPath(spark, windows).history(1).collect()[0]["version"] > before, 300,
              "campaign_window_counts to go on committing")
        assert host_pid(lake) == pid
        os.remove(log)
        shutil.move(log + ".away", log)
        total = first.kinds["valid"] + more.kinds["valid"]
        _wait(lambda: _rows(spark, lake, "events_raw") == total, 300, f"events_raw to hold {total} rows")
        _wait(lambda: runner.status("events_raw", 1).detail.startswith("host pid"), 60, "events_raw running again")
        raw = spark.read.format("delta").load(ViewPaths(lake.lake_uri, "events_raw", 1).table)
        assert raw.select("partition", "offset").distinct().count() == total  # nothing twice

        # stopping one view version leaves the other running in the same host
        assert runner.stop("campaign_window_counts", 1).state == "stopped"
        assert runner.status("campaign_window_counts", 1).state == "stopped"
        assert runner.status("events_raw", 1).state == "running"
        last = generator.produce(lake, lake.topic("ad-events"), generator.events(
            300, seed=6, universe=u, start_ms=1_700_001_800_000))
        _wait(lambda: _rows(spark, lake, "events_raw") == total + last.kinds["valid"], 300, "the last load")
        assert host_pid(lake) == pid
        # an auto-mode runner (what `kappa replay` uses) joins the running host
        assert LocalRunner(lake).status("events_raw", 1).state == "running"
    finally:
        if os.path.isfile(log):
            os.remove(log)
            shutil.move(log + ".away", log)
        stop_host(lake)
    assert host_pid(lake) is None
    assert runner.status("events_raw", 1).state == "stopped"


def test_static_versions_handed_over_to_the_kubernetes_runner_are_not_run(tmp_path):
    """The grouped driver in a cluster: its --view versions are fixed by its arguments; a version the Kubernetes
    runner recorded in the mounted view-state file (stopped by a promote, or started in a Deployment of its own by a
    rollback) is no longer the host's to run. No Spark: the reconcile loop starts exactly what _desired() lists."""
    import json

    from kappa.config import Settings
    from kappa.runtime.host import ViewHost

    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_LAKE_URI": str(tmp_path / "lake")})
    record = tmp_path / "view-state" / "views.json"
    static = [JobSpec("campaign_window_counts", 1, starting="earliest"), JobSpec("user_sessions", 1)]
    host = ViewHost(settings, static=static, handed_over=record)
    assert set(host._desired()) == {"campaign_window_counts@v1", "user_sessions@v1"}, "no record mounted yet"
    record.parent.mkdir()
    record.write_text("{}")
    assert set(host._desired()) == {"campaign_window_counts@v1", "user_sessions@v1"}
    record.write_text(json.dumps({"campaign_window_counts": {"1": {"state": "stopped"}, "2": {"state": "running"}}}))
    assert set(host._desired()) == {"user_sessions@v1"}
    record.write_text(json.dumps({"user_sessions": {"1": {"state": "running"}}}))
    assert set(host._desired()) == {"campaign_window_counts@v1"}, "running in a Deployment of its own"
    record.write_text("{not json")
    assert set(host._desired()) == {"campaign_window_counts@v1", "user_sessions@v1"}, "a bad file is ignored"


def test_requests_are_read_again_only_when_their_file_changes(tmp_path, monkeypatch):
    """The host looks at ``desired/`` every second: a request's file is parsed when it appears or changes (a new
    request replaces it), not at every look; a removed request is no longer desired, a bad file is ignored until
    it is fixed. No Spark."""
    from kappa.config import Settings
    from kappa.runtime import host as host_module
    from kappa.runtime.host import ViewHost, desire, undesire

    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_LAKE_URI": str(tmp_path / "lake")})
    host = ViewHost(settings)
    assert host._desired() == {}, "no desired folder yet"
    parsed = []
    loads = host_module.json.loads
    monkeypatch.setattr(host_module.json, "loads", lambda text: parsed.append(text) or loads(text))
    desire(settings, JobSpec("events_raw", 1, starting="latest"))
    desire(settings, JobSpec("user_sessions", 1))
    assert {ref: spec.starting for ref, spec in host._desired().items()} == {
        "events_raw@v1": "latest", "user_sessions@v1": JobSpec("user_sessions", 1).starting}
    assert len(parsed) == 2
    for _ in range(5):
        assert set(host._desired()) == {"events_raw@v1", "user_sessions@v1"}
    assert len(parsed) == 2, "unchanged files are not parsed again"
    desire(settings, JobSpec("events_raw", 1, starting="earliest"))
    assert host._desired()["events_raw@v1"].starting == "earliest"
    assert len(parsed) == 3, "only the replaced file is parsed again"
    assert undesire(settings, "user_sessions@v1")
    assert set(host._desired()) == {"events_raw@v1"}
    bad = host.dir / "desired" / "campaign_window_counts@v1.json"
    bad.write_text("{not json")
    assert set(host._desired()) == {"events_raw@v1"}, "a bad file is ignored"
    desire(settings, JobSpec("campaign_window_counts", 1))
    assert set(host._desired()) == {"events_raw@v1", "campaign_window_counts@v1"}, "... until it is fixed"


def test_a_host_asked_for_more_micro_batches_than_it_plans_for_lengthens_the_short_triggers(tmp_path):
    """The six declared views (four 2 s triggers, 10 s, the archive's 30 s: 2.13 micro-batches/s) fit the host's
    plan of 3 a second: each keeps its own trigger. Three more live versions ask 3.23 a second: each 2 s version
    started then gets the common trigger that fits the plan, 6 / (3 - 1/10 - 1/10 - 1/30) s, while the versions
    declared slower keep theirs; a bounded run has no trigger and does not count; the stretch stops at
    MAX_STRETCH; a plan of 0 never stretches; the default plan (3.5 a second) fits the 3.23. No Spark."""
    from kappa.config import Settings
    from kappa.runtime.host import MAX_STRETCH, ViewHost, desire, planned_trigger

    def host(budget: str | None = "3") -> ViewHost:  # None: the default plan (3.5 a second)
        env = {"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_LAKE_URI": str(tmp_path / "lake")}
        return ViewHost(Settings.from_env({**env, **({"KAPPA_HOST_BATCHES_PER_SECOND": budget} if budget else {})}))

    declared = [JobSpec(v, 1) for v in ("campaign_window_counts", "user_sessions", "campaign_catalog",
                                         "ad_events_archive", "events_raw", "campaign_hourly_totals")]
    settings = host().settings
    for spec in declared:
        desire(settings, spec)
    assert [host().trigger_seconds(spec) for spec in declared] == [None] * 6
    desire(settings, JobSpec("campaign_window_counts", 3, end_timestamp_ms=1_700_000_000_000))  # bounded
    for view, version in (("campaign_window_counts", 2), ("events_raw", 2), ("campaign_hourly_totals", 2)):
        desire(settings, JobSpec(view, version))
    common = 6 / (3 - 2 * 0.1 - 1 / 30)
    assert host().trigger_seconds(JobSpec("events_raw", 2)) == pytest.approx(common)
    assert host().trigger_seconds(JobSpec("user_sessions", 1)) == pytest.approx(common)
    assert host().trigger_seconds(JobSpec("campaign_hourly_totals", 2)) is None  # 10 s: slower than the common one
    assert host().trigger_seconds(JobSpec("ad_events_archive", 1)) is None
    assert host().trigger_seconds(JobSpec("campaign_window_counts", 3, end_timestamp_ms=1)) is None
    assert host("0.1").trigger_seconds(JobSpec("user_sessions", 1)) == pytest.approx(2 * MAX_STRETCH)
    assert host("0").trigger_seconds(JobSpec("user_sessions", 1)) is None
    assert host(None).trigger_seconds(JobSpec("events_raw", 2)) is None, "3.23 a second fit the default plan of 3.5"
    # the plan a bench reports for each version (kappa.front.bench_live) is the same function of the triggers
    assert planned_trigger(2.0, [2.0] * 6 + [10.0, 10.0, 30.0], 3) == pytest.approx(common)
    assert planned_trigger(10.0, [2.0] * 6 + [10.0, 10.0, 30.0], 3) == 10.0
    assert planned_trigger(2.0, [2.0] * 6 + [10.0, 10.0, 30.0], 0) == 2.0


def test_a_hosted_version_waits_for_its_topics_never_gives_up_and_does_not_hold_the_others(spark, kafka, lake):
    """The grouped driver in a cluster starts before the topics Job (a post-install hook that runs once every pod is
    Ready) created the topics. A version whose topic is missing waits - its metrics endpoint up (the pod's probes
    pass) and saying which topic it waits for - while a version whose topics exist runs; it is not counted as a
    failure however long it waits (here more polls than the restart limit), and starts once its topic exists."""
    import urllib.request

    from kappa.log.broker import free_port
    from kappa.log.topics import declared_topics, ensure_topics
    from kappa.runtime.host import ViewHost, hosted_status

    from pathlib import Path

    settings = lake.replace(topic_prefix=f"late-{lake.topic_prefix}", home=Path(lake.lake_uri).parent / "home",
                            host_max_restarts=1, host_restart_backoff_seconds=1.0)
    topics = {spec.name: spec for spec in declared_topics(settings)}
    ensure_topics(settings, [topics[settings.topic("ad-events")]])  # campaigns (the window view's lookup) missing
    u = generator.universe(seed=4, campaigns=3, users=20)
    sent = generator.produce(settings, settings.topic("ad-events"), generator.events(300, seed=4, universe=u))
    ports = {"events_raw@v1": free_port(), "campaign_window_counts@v1": free_port()}
    host = ViewHost(settings, static=[JobSpec(ref.split("@")[0], 1, starting="earliest", metrics_port=port)
                                      for ref, port in ports.items()])
    host._spark = spark

    def scrape(ref: str) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{ports[ref]}/metrics", timeout=5).read().decode()

    def waiting_line() -> str | None:
        """The value of kappa_waiting_for_topic{topic=<campaigns>} on the window view's endpoint."""
        for line in scrape("campaign_window_counts@v1").splitlines():
            if line.startswith("kappa_waiting_for_topic{") and f'topic="{settings.topic("campaigns")}"' in line:
                return line.rsplit(" ", 1)[1]
        return None

    try:
        for _ in range(settings.host_max_restarts + 4):  # more polls than a failing version would be allowed
            host.reconcile()
            time.sleep(settings.host_restart_backoff_seconds)
        waiting = hosted_status(settings, "campaign_window_counts@v1")
        assert waiting["state"] == "waiting", waiting
        assert settings.topic("campaigns") in waiting["detail"] and "topics ensure" in waiting["detail"], waiting
        assert "campaign_window_counts@v1" in host.waiting and "campaign_window_counts@v1" not in host.jobs
        assert waiting_line() == "1.0", "its endpoint (its pod's readiness) says what it waits for"
        assert hosted_status(settings, "events_raw@v1")["state"] == "running"
        _wait(lambda: (host.reconcile(), _rows(spark, settings, "events_raw"))[1] == sent.kinds["valid"], 300,
              "events_raw's rows while the other version waits")

        ensure_topics(settings, [topics[settings.topic("campaigns")]])
        generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
        _wait(lambda: (host.reconcile(), hosted_status(settings, "campaign_window_counts@v1")["state"])[1]
              == "running", 180, "the waiting version to start once its topic exists")
        assert not host.waiting and host._failures.get("campaign_window_counts@v1", 0) == 0
        assert host.jobs["campaign_window_counts@v1"].bound_port == ports["campaign_window_counts@v1"]
        _wait(lambda: (host.reconcile(), _rows(spark, settings, "campaign_window_counts"))[1] > 0, 300,
              "campaign_window_counts rows")
        assert waiting_line() == "0.0"
    finally:
        for ref in [*host.jobs, *host.waiting]:
            host._stop_job(ref, "stopped", "test over")

"""Any view version is verifiable without a second implementation: the recompute of its own transform.

A team's view is written only as a transform, in a module of its own on ``PYTHONPATH``, and declared in its own
copy of the platform file (``KAPPA_PLATFORM``) - nothing in ``kappa/`` changes and no oracle exists for it:

* v1's real job runs over the log in micro-batches; ``verify`` checks it strictly (recompute of the same
  transform over the exact micro-batches the table holds) and ``promote`` serves it; the table is also checked
  here against a plain-Python count of the raw Kafka records;
* three faulty runs of later versions, each through a fake sink that injects one fault the real sink cannot
  produce on purpose - one batch dropped, one batch applied twice, one value corrupted - fail verification
  with a message naming the first differing key; the serving version stays v1;
* ``kappa replay --promote`` builds v2 from the CLI while v1 serves: verified, diff-reported against v1 (JSON +
  PNG), promoted; ``kappa verify`` of a faulty version names the first differing key and exits 1;
* every verification against a serving version writes the diff report, which shows the faults too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from kappa.control import replay
from kappa.log import generator
from kappa.verify import oracle
from kappa.config import Settings
from kappa.control.registry import Registry
from kappa.control.serving import ServingAlias
from tests.conftest import subprocess_env

VIEW = "ad_type_counts"
T0 = 1_700_000_000_000
WINDOW_MS = 10_000
REPO = Path(__file__).resolve().parents[1]

#: The team's view: nothing but a transform and its declaration (a tumbling window emitted once final).
MODULE = '''
"""ad_type_counts - events and clicks per ad type per 10 s event-time window, written once the window closed."""

from pyspark.sql import functions as F

from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import ViewDefinition, tumbling_window_end


def transform(events):
    return (
        events.withWatermark("event_ts", "10 seconds")
        .groupBy(F.window("event_ts", "10 seconds").alias("w"), "ad_type")
        .agg(F.count("*").alias("events"),
             F.count(F.when(F.col("event_type") == "click", True)).alias("clicks"),
             F.max("event_ts").alias("last_event_time"))
        .select("ad_type", F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                "events", "clicks", "last_event_time")
    )


VIEW = ViewDefinition(name="ad_type_counts", version={version}, description="Events and clicks per ad type per 10 s",
                      stream_topic="ad-events", stream_format=AD_EVENTS, transform=transform,
                      output_mode="append", write="append", keys=("ad_type", "window_start"), stateful=True,
                      latency_column="last_event_time", late_bound=lambda: tumbling_window_end("event_ts", 10))
'''


CHECKED_VIEW = "checked_events"
#: A stateless view with expectations: purchases are counted (warn, limit {rate}), mobile ads dropped, {fail}.
CHECKED = '''
"""checked_events - every valid event, with data-quality expectations."""

from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import Expectation, ViewDefinition


def transform(events):
    return events.select("user_id", "ad_id", "ad_type", "event_type", "event_ts", "partition", "offset")


VIEW = ViewDefinition(
    name="checked_events", version={version}, description="Valid events, checked", stream_topic="ad-events",
    stream_format=AD_EVENTS, transform=transform, write="append", keys=("partition", "offset"),
    latency_column="event_ts",
    expectations=(Expectation("not_a_purchase", "event_type <> 'purchase'", "warn", max_violation_rate={rate}),
                  Expectation("no_mobile_ads", "ad_type <> 'mobile'", "drop"),{fail}))
'''
CHECKED_VERSIONS = {
    1: ("0.5", ""),   # within its limits
    2: ("0.1", ""),   # about a third of the events are purchases: over the 10 % limit
    3: ("None", "\n                  Expectation(\"no_mobile_ever\", \"ad_type <> 'mobile'\", \"fail\")"),
}


@pytest.fixture
def team_view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The team's package (versions 1-4 of the same transform) and its platform file, seen by every process."""
    root = tmp_path / "team"
    package = root / "teamviews"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for version in range(1, 5):
        (package / f"ad_type_counts_v{version}.py").write_text(MODULE.replace("{version}", str(version)))
    for version, (rate, fail) in CHECKED_VERSIONS.items():
        (package / f"checked_events_v{version}.py").write_text(
            CHECKED.replace("{version}", str(version)).replace("{rate}", rate).replace("{fail}", fail))
    platform = yaml.safe_load((REPO / "kappa" / "platform.yaml").read_text())
    platform["views"][VIEW] = {
        "description": "Events and clicks per ad type per 10 s event-time window (a team's view).",
        "topics": ["ad-events"], "default_version": 1,
        "versions": {v: {"module": f"teamviews.ad_type_counts_v{v}"} for v in range(1, 5)}}
    platform["views"][CHECKED_VIEW] = {
        "description": "Valid events with data-quality expectations (a team's view).",
        "topics": ["ad-events"], "default_version": 1,
        "versions": {v: {"module": f"teamviews.checked_events_v{v}"} for v in CHECKED_VERSIONS}}
    (root / "platform.yaml").write_text(yaml.safe_dump(platform, sort_keys=False))
    monkeypatch.setenv("KAPPA_PLATFORM", str(root / "platform.yaml"))
    monkeypatch.setenv("PYTHONPATH", f"{root}:{REPO}")
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in [m for m in sys.modules if m.startswith("teamviews")]:
        del sys.modules[name]


def _platform_env(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    for key, value in subprocess_env(settings).items():
        if key.startswith("KAPPA_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("KAPPA_RUNNER", "local")


def _produce(settings: Settings, seed: int) -> int:
    """Events in time order (no late ones), 5 % malformed; returns the cut: every event is before it."""
    u = generator.universe(seed=seed, campaigns=4, users=300)
    events = generator.events(1500, seed=seed, universe=u, start_ms=T0, rate_per_s=20, late_fraction=0.0,
                              malformed_fraction=0.05)
    assert generator.produce(settings, settings.topic("ad-events"), events).delivered == 1500
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    return cut


def _plain_python_counts(settings: Settings) -> dict[tuple[str, int], tuple[int, int]]:
    """(ad_type, window start ms) -> (events, clicks), from the raw records validated with jsonschema."""
    records = oracle.read_log(settings, settings.topic("ad-events"))
    valid = [v.value for v in oracle.validate_records(records, "ad_event", key_field="user_id") if v.error is None]
    events = Counter((e["ad_type"], e["event_time"] // WINDOW_MS * WINDOW_MS) for e in valid)
    clicks = Counter((e["ad_type"], e["event_time"] // WINDOW_MS * WINDOW_MS) for e in valid
                     if e["event_type"] == "click")
    return {k: (n, clicks[k]) for k, n in events.items()}


def _dag(dag_id: str) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return bag.dags[dag_id]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_view_written_only_as_a_transform_is_replayed_verified_and_promoted(
        kafka, lake, spark, team_view, tmp_path, monkeypatch):
    from deltalake import DeltaTable

    from kappa.control.runners.local import LocalRunner

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    cut = _produce(settings, seed=41)
    runner = LocalRunner(settings)
    registry, alias = Registry(settings.lake_uri), ServingAlias(settings.lake_uri)
    assert oracle.oracle_for(VIEW, 1) is None

    # v1: the team's real job over the log in micro-batches of 400 (registered caught up as a replay leaves it),
    # verified by the recompute of its own transform alone (no oracle exists), promoted
    assert _run_version(spark, settings, 1, cut) is None
    verification = replay.verify(VIEW, 1, settings, "strict", by="test")
    assert verification.passed and verification.oracle is None, verification
    recomputed = verification.recompute
    assert recomputed["passed"] and recomputed["details"]["batches"] >= 4, recomputed
    assert recomputed["details"]["quarantine_expected"] > 30, "the malformed records were checked too"
    assert "equal the recompute" in verification.message, verification.message
    # the note records the check's size and time: later verifications here get an ETA from it
    checked = re.search(r"; ([\d,]+) records checked in [\d.]+ s\)", verification.message)
    assert checked and int(checked[1].replace(",", "")) == sum(verification.end_offsets.values()) - sum(
        verification.start_offsets.values()), verification.message
    assert replay.promote(VIEW, 1, settings, runner, by="test").changed
    assert registry.get(VIEW, 1).state == "serving"
    table_path = replay.ViewVersion.resolve(VIEW, 1, settings).paths.table
    assert alias.resolve(VIEW) == table_path

    # independent of the transform: a plain-Python count of the raw records agrees on every window written
    rows = replay.table_rows(DeltaTable(table_path))[1]
    expected = _plain_python_counts(settings)
    got = {(r["ad_type"], int(r["window_start"].timestamp() * 1000)): (r["events"], r["clicks"]) for r in rows}
    assert len(got) == len(rows) > 20
    assert {k: expected.get(k) for k in got} == got
    last_start = max(start for _t, start in expected)
    assert {k for k in expected if k[1] < last_start - 60_000} <= got.keys(), "every closed window is written"

    # v2 (the same transform) from the CLI while v1 serves: verified, diff-reported against v1, promoted
    env = {**subprocess_env(settings), "KAPPA_PLATFORM": str(team_view / "platform.yaml"),
           "PYTHONPATH": f"{team_view}:{REPO}", "KAPPA_RUNNER": "local"}
    try:
        out = subprocess.run([str(REPO / "bin" / "kappa"), "replay", VIEW, "--version", "2", "--end", f"ts:{cut}",
                              "--max-offsets-per-trigger", "400", "--promote", "--watch-minutes", "0"],
                             capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    finally:
        runner.stop(VIEW, 2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rows equal the recompute" in out.stdout, out.stdout
    # before the check: its size, and no made-up ETA (v1's few thousand records are too few to measure a rate)
    assert re.search(rf"verifying {VIEW}@v2: \d+ recorded micro-batches, [\d,]+ records; ETA unknown \(no "
                     rf"verification of {VIEW} with >= 10,000 records measured here yet\): the re-run logs its "
                     r"progress",
                     out.stdout), out.stdout
    assert "diff v2 vs serving v1: 0 keys added, 0 removed, 0 changed" in out.stdout, out.stdout
    png = replay.ViewVersion.resolve(VIEW, 2, settings).report_dir() / "diff-v2-vs-v1.png"
    assert f"plot {png}" in out.stdout and png.read_bytes()[:4] == b"\x89PNG", out.stdout
    assert alias.resolve(VIEW) == replay.ViewVersion.resolve(VIEW, 2, settings).paths.table
    assert registry.get(VIEW, 1).state == "retired"


class _FirstBatchWithRows:
    """Fake sinks (``kappa.runtime.sink.DeltaSink`` subclasses) injecting one fault into the first batch that has output
    rows - faults the real sink never produces, which verification must catch."""

    fault = ""

    @classmethod
    def make(cls, fault: str) -> type:
        from pyspark.sql import functions as F

        from kappa.runtime.sink import DeltaSink, _append_once, table_columns

        class Faulty(DeltaSink):
            touched: list[tuple[str, Any]] = []

            def write(self, batch: Any, batch_id: int, **kwargs: Any) -> str:
                if Faulty.touched or batch.count() == 0:
                    return super().write(batch, batch_id, **kwargs)
                # the fault is made on the batch's DataFrame: the rows the handler collected for a delta-rs commit
                # are those of the unfaulted batch, so this batch is written from the DataFrame (the Spark path)
                kwargs = {**kwargs, "collected": None}
                first = batch.orderBy("ad_type", "window_start").first()
                Faulty.touched.extend((r["ad_type"], r["window_start"]) for r in batch.collect())
                Faulty.touched.sort()
                if fault == "drop":  # the batch's commit lands, without its rows
                    return super().write(batch.limit(0), batch_id, **{**kwargs, "rows": 0})
                if fault == "corrupt":  # one value of one row off by one
                    hit = (F.col("ad_type") == first["ad_type"]) & (F.col("window_start") == first["window_start"])
                    return super().write(batch.withColumn("events", F.col("events") + F.when(hit, 1).otherwise(0)),
                                         batch_id, **kwargs)
                done = super().write(batch, batch_id, **kwargs)  # "twice": applied again under another app id
                again = batch.select(*table_columns(self.view, batch.schema).fieldNames())
                _append_once(again, self.path, f"{self.app_id}/again", batch_id)
                return done

        return Faulty


def _run_version(spark: Any, settings: Settings, version: int, cut: int, *, view_name: str = VIEW,
                 on_done: Any = None, max_offsets: int = 400) -> str | None:
    """Run the version's real job, bounded, in this process; register it caught up as a replay would.
    Returns the job's failure (None when it completed); ``on_done(job)`` runs before the job stops."""
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view

    module = f"teamviews.{view_name}_v{version}"
    view = load_view(module)
    job = ViewJob(view, settings, spark=spark, starting="earliest", available_now=True, end_timestamp_ms=cut,
                  max_offsets_per_trigger=max_offsets, metrics_port=0 if on_done else None)
    try:
        job.start()
        assert job.await_termination(300)
        failure = job.failure()
        if on_done is not None:
            on_done(job)
    finally:
        job.stop()
    if failure:
        return failure
    registry = Registry(settings.lake_uri)
    registry.register(view_name, version, code_module=module,
                      table_path=replay.ViewVersion.resolve(view_name, version, settings).paths.table,
                      app_id=job.app_id, starting="earliest", triggered_by="test",
                      start_offsets=json.dumps({str(p): o for p, o in (job.start_offsets or {}).items()}))
    registry.set_state(view_name, version, "caught_up", by="test")
    return None


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_dropped_doubled_or_corrupted_batches_fail_verification_naming_the_first_differing_key(
        kafka, lake, spark, team_view, tmp_path, monkeypatch, capsys):
    import kappa.runtime.job

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    cut = _produce(settings, seed=43)
    registry, alias = Registry(settings.lake_uri), ServingAlias(settings.lake_uri)

    assert _run_version(spark, settings, 1, cut) is None
    good = replay.verify(VIEW, 1, settings, "strict", by="test", end_timestamp_ms=cut)
    assert good.passed, good.message
    # a windowed count that declares its late bound is re-run coalesced: the faults below are caught that way
    assert good.recompute["details"]["rerun"].startswith("coalesced: "), good.recompute["details"]
    alias.promote(VIEW, 1, by="test")
    serving = alias.resolve(VIEW)

    for version, fault in ((2, "drop"), (3, "twice"), (4, "corrupt")):
        sink = _FirstBatchWithRows.make(fault)
        with monkeypatch.context() as patched:
            patched.setattr(kappa.runtime.job, "DeltaSink", sink)
            assert _run_version(spark, settings, version, cut) is None
        first_type, first_start = sink.touched[0]
        key = f"(ad_type={first_type!r}, window_start={first_start.isoformat(sep=' ')!r})"

        result = replay.verify(VIEW, version, settings, "strict", by="test", end_timestamp_ms=cut)
        assert not result.passed, (fault, result.message)
        assert result.recompute["details"]["rerun"].startswith("coalesced: "), result.recompute["details"]
        assert result.first_difference.startswith(key), (fault, key, result.first_difference)
        assert key in result.message, (fault, result.message)
        what = {"drop": "missing from the table", "twice": "2 rows in the table",
                "corrupt": "events table="}[fault]
        assert what in result.first_difference, (fault, result.first_difference)
        counts = {"drop": result.missing, "twice": result.duplicates, "corrupt": result.different}[fault]
        assert counts == (1 if fault == "corrupt" else len(sink.touched)), (fault, result)
        assert registry.get(VIEW, version).state == "failed"
        assert alias.resolve(VIEW) == serving, "serving is untouched"
        # the diff report against the serving v1 shows the same damage, as readers would see it
        report = result.report
        assert report["serving_version"] == 1 and report["bucket_by"].startswith("window_start per "), report
        assert sum(b["added"] + b["removed"] + b["changed"] for b in report["buckets"]) == sum(
            report[k] for k in ("added", "removed", "changed")), report
        assert Path(report["json_path"]).is_file() and json.loads(Path(report["json_path"]).read_text())["view"] == VIEW
        assert Path(report["png_path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        kinds = (report["added"], report["removed"], report["changed"])
        assert kinds == {"drop": (0, len(sink.touched), 0), "twice": (0, 0, 0), "corrupt": (0, 0, 1)}[fault], kinds
        if fault == "corrupt":  # serving v1 holds the true count, v4 one more
            (example,) = report["examples"]["changed"]
            prefix = f"(ad_type={first_type}, window_start={first_start}) events: "
            assert example.startswith(prefix), example
            old_value, new_value = map(int, example.removeprefix(prefix).split(" -> "))
            assert new_value == old_value + 1, example

    # the CLI says the same and exits non-zero (in this process, so it reuses the Spark session; bin/kappa in a
    # process of its own is the first test's replay of v2)
    from kappa.front.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["verify", VIEW, "--version", "4", "--end-ts", str(cut)])
    bad = capsys.readouterr()
    assert exited.value.code == 1 and "first differing key (ad_type=" in bad.out, bad.out + bad.err
    assert "diff v4 vs serving v1: 0 keys added, 0 removed, 1 changed" in bad.out, bad.out
    assert "Traceback" not in bad.out + bad.err


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_many_small_batches_with_late_rows_verify_coalesced_as_one_at_a_time_does(kafka, lake, spark, team_view,
                                                                                   tmp_path, monkeypatch):
    """A run of many micro-batches whose watermark dropped late rows in several of them. The coalesced re-run
    (runs of recorded batches as one micro-batch, the rows the original dropped left out when staging) finds the
    table the run wrote, as the re-run of one recorded batch at a time does, in fewer micro-batches. Without the
    rows left out (a late bound that never drops) the coalesced re-run differs: the cuts it gave up mattered only
    through them."""
    import dataclasses

    from deltalake import DeltaTable
    from pyspark.sql import functions as F

    from kappa.runtime import rerun
    from kappa.runtime.late import LATE_REASON
    from kappa.runtime.view import load_view
    from kappa.verify.recompute import recompute

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    u = generator.universe(seed=47, campaigns=4, users=300)
    events = generator.events(2400, seed=47, universe=u, start_ms=T0, rate_per_s=20, late_fraction=0.1,
                              max_lateness_ms=60_000, malformed_fraction=0.02)
    assert generator.produce(settings, settings.topic("ad-events"), events).delivered == 2400
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    assert _run_version(spark, settings, 1, cut, max_offsets=150) is None  # 16 micro-batches of the 2,400 records

    vv = replay.ViewVersion.resolve(VIEW, 1, settings)
    late = spark.read.format("delta").load(vv.paths.quarantine).where(F.col("error").startswith(LATE_REASON)).count()
    assert late > 20, f"only {late} late records: the test needs the watermark to drop rows in many batches"

    monkeypatch.setattr(rerun, "COALESCE_RECORDS", 500)  # several coalesced steps: each one's watermark is checked
    coalesced = replay.verify(VIEW, 1, settings, "strict", by="test", end_timestamp_ms=cut)
    details = coalesced.recompute["details"]
    assert coalesced.passed, coalesced.message
    assert details["rerun"].startswith("coalesced: ") and details["batches"] >= 16, details
    assert details["batches_run"] <= details["batches"] // 2, details

    table = DeltaTable(vv.paths.table)
    app_id = vv.app_id() or Registry(settings.lake_uri).get(VIEW, 1).app_id
    batches = vv.batch_boundaries(table, app_id, table.transaction_version(app_id))
    start = replay.offsets_from_json(Registry(settings.lake_uri).get(VIEW, 1).start_offsets)
    args = dict(table_path=vv.paths.table, delta_version=table.version(), batches=batches, start=start,
                end_timestamp_ms=cut, quarantine_path=vv.paths.quarantine, spark=spark)
    view = load_view(f"teamviews.{VIEW}_v1")
    one_at_a_time = recompute(view, settings, coalesce=False, **args)
    assert one_at_a_time.passed, one_at_a_time.message
    assert one_at_a_time.details["rerun"] == "one recorded batch at a time: coalescing off", one_at_a_time.details
    assert one_at_a_time.rows == coalesced.rows and one_at_a_time.details["batches_run"] > details["batches_run"]

    never_late = dataclasses.replace(view, late_bound=lambda: F.lit(None).cast("timestamp"))
    unfiltered = recompute(never_late, settings, **args)
    assert unfiltered.details["rerun"].startswith("coalesced: "), unfiltered.details
    assert not unfiltered.passed and unfiltered.different + unfiltered.extra > 0, unfiltered.message


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_verifying_again_reads_only_the_batches_recorded_since_and_still_catches_a_wrong_row(
        kafka, lake, spark, team_view, tmp_path, monkeypatch):
    """A version verified, then following the stream further, is verified again: the records the first check staged
    are reused and only the batches recorded since are read; the outcome is the one a check reading everything
    again gives; a row changed by hand afterwards is caught by the next check, which reads nothing new."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from kappa.log.topics import partition_offsets
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view
    from kappa.verify.stagecache import cache_root

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    topic = settings.topic("ad-events")
    u = generator.universe(seed=53, campaigns=4, users=300)

    def follow(count: int, seed: int, start_ms: int) -> int:
        """Produce ``count`` events (late and malformed ones among them); the total records the log holds."""
        events = generator.events(count, seed=seed, universe=u, start_ms=start_ms, rate_per_s=20, late_fraction=0.05,
                                  max_lateness_ms=20_000, malformed_fraction=0.03)
        assert generator.produce(settings, topic, events).delivered == count
        return sum(high - low for low, high in partition_offsets(settings, topic).values())

    first_records = follow(1200, 53, T0)
    assert _run_version(spark, settings, 1, None, max_offsets=150) is None
    first = replay.verify(VIEW, 1, settings, "strict", by="test")
    assert first.passed, first.message
    assert first.recompute["details"]["staged_before"] == {"batches": 0, "records": 0}, first.recompute
    assert (cache_root(settings) / f"{VIEW}_v1" / "_manifest.json").is_file()

    all_records = follow(600, 54, T0 + 60_000)  # the version follows the stream further: same checkpoint, same run
    job = ViewJob(load_view(f"teamviews.{VIEW}_v1"), settings, spark=spark, starting="earliest", available_now=True,
                  max_offsets_per_trigger=150)
    try:
        job.start()
        assert job.await_termination(300) and job.failure() is None, job.failure()
    finally:
        job.stop()

    again = replay.verify(VIEW, 1, settings, "strict", by="test")
    assert again.passed, again.message
    staged = again.recompute["details"]["staged_before"]
    # every record the first check read is reused (a no-data batch at its end, nothing staged, starts the next run)
    assert staged["records"] == first_records and first.recompute["details"]["batches"] - staged["batches"] in (0, 1)
    assert again.recompute["details"]["batches"] > staged["batches"], again.recompute
    assert f"{all_records:,} records checked" in again.message and f"{first_records:,} of them staged" in again.message
    everything = replay.verify(VIEW, 1, settings.replace(verify_cache_mb=0), "strict", by="test")
    assert everything.passed and everything.recompute["details"]["staged_before"]["records"] == 0, everything.message
    assert (everything.rows, everything.expected_rows) == (again.rows, again.expected_rows)

    table = replay.ViewVersion.resolve(VIEW, 1, settings).paths.table
    row = spark.read.format("delta").load(table).orderBy("ad_type", "window_start").first()
    spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.appendOnly' = 'false')")  # a change by hand
    DeltaTable.forPath(spark, table).update(
        (F.col("ad_type") == F.lit(row["ad_type"])) & (F.col("window_start") == F.lit(row["window_start"])),
        {"events": F.col("events") + F.lit(1)})
    caught = replay.verify(VIEW, 1, settings, "strict", by="test")
    assert not caught.passed and caught.different == 1, caught.message
    assert f"first differing key (ad_type='{row['ad_type']}'" in caught.message, caught.message
    assert caught.recompute["details"]["staged_before"]["records"] == all_records, caught.recompute


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_expectations_warn_drop_fail_are_counted_and_block_promotion(kafka, lake, spark, team_view, tmp_path,
                                                                    monkeypatch):
    import urllib.request

    from deltalake import DeltaTable

    from kappa.control.runners.local import LocalRunner

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    cut = _produce(settings, seed=47)
    records = oracle.read_log(settings, settings.topic("ad-events"))
    valid = [v for v in oracle.validate_records(records, "ad_event", key_field="user_id") if v.error is None]
    purchases = sum(v.value["event_type"] == "purchase" for v in valid)
    mobile = {(v.record.partition, v.record.offset) for v in valid if v.value["ad_type"] == "mobile"}
    assert purchases > 300 and len(mobile) > 150, (purchases, len(mobile))
    scraped: dict[str, str] = {}

    def scrape(job: Any) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{job.bound_port}/metrics", timeout=10) as resp:
            scraped["text"] = resp.read().decode()

    assert _run_version(spark, settings, 1, cut, view_name=CHECKED_VIEW, on_done=scrape) is None
    # metrics (a real scrape of the job's endpoint): every valid event checked once, violations per rule and action
    text = scraped["text"]
    assert _metric(text, "kappa_expectation_rows_checked_total", CHECKED_VIEW) == len(valid), text
    assert _metric(text, "kappa_expectation_violations_total", 'expectation="not_a_purchase"',
                   'action="warn"') == purchases, text
    assert _metric(text, "kappa_expectation_violations_total", 'expectation="no_mobile_ads"',
                   'action="drop"') == len(mobile), text

    # drop: the mobile events are not in the table but in the quarantine, once each, with the rule as reason
    paths = replay.ViewVersion.resolve(CHECKED_VIEW, 1, settings).paths
    table = replay.table_rows(DeltaTable(paths.table))[1]
    assert {(r["partition"], r["offset"]) for r in table} == {(v.record.partition, v.record.offset)
                                                              for v in valid} - mobile
    quarantine = replay.table_rows(DeltaTable(paths.quarantine))[1]
    kept = [r for r in quarantine if r["view"] == CHECKED_VIEW and r["error"].startswith("expectation ")]
    assert {r["error"] for r in kept} == {"expectation no_mobile_ads: ad_type <> 'mobile'"}
    rows = [json.loads(bytes(r["raw_value"])) for r in kept]
    assert sorted((r["partition"], r["offset"]) for r in rows) == sorted(mobile), "each dropped row kept once"

    # verification: equal to the recompute (which drops the same rows); counts and limits reported and audited
    first = replay.verify(CHECKED_VIEW, 1, settings, "strict", by="test", end_timestamp_ms=cut)
    assert first.passed, first.message
    assert first.expectations["details"]["violations"] == {"not_a_purchase": purchases, "no_mobile_ads": len(mobile)}
    assert first.expectations["details"]["rows"] == len(valid)
    note = next(e.note for e in Registry(settings.lake_uri).events(CHECKED_VIEW, 1) if e.to_state == "verified")
    assert f"not_a_purchase (warn) {purchases:,} of {len(valid):,} rows" in note, note

    # a rate over the declared limit: not verified, and not promotable either
    assert _run_version(spark, settings, 2, cut, view_name=CHECKED_VIEW) is None
    second = replay.verify(CHECKED_VIEW, 2, settings, "strict", by="test", end_timestamp_ms=cut)
    assert not second.passed and "expectations over their limit: not_a_purchase (warn)" in second.message
    assert "max 10.0%" in second.message, second.message
    with pytest.raises(replay.ReplayError, match=r"cannot be promoted: expectations over their limit"):
        replay.promote(CHECKED_VIEW, 2, settings, LocalRunner(settings), by="test")

    # fail: the job stops at the first batch with a mobile ad, naming the rule and a row; nothing of it lands
    failure = _run_version(spark, settings, 3, cut, view_name=CHECKED_VIEW)
    assert failure is not None and "expectation no_mobile_ever (ad_type <> 'mobile') failed on" in failure, failure
    third = DeltaTable(replay.ViewVersion.resolve(CHECKED_VIEW, 3, settings).paths.table)
    assert third.scan().read_all().num_rows == 0


def _metric(text: str, name: str, *labels: str) -> float:
    """The value of the sample of ``name`` whose labels contain every one of ``labels``."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample of {name} with {labels}")


@pytest.mark.integration
@pytest.mark.airflow
@pytest.mark.timeout(900)
def test_a_promoted_version_that_breaks_is_rolled_back_automatically(kafka, lake, airflow_home, team_view, tmp_path,
                                                                     monkeypatch):
    """v1 serves live; the kappa_replay DAG builds v2 live, promotes it and watches it. Right after the switch the
    log turns bad (every new record malformed): v2 quarantines far more than the watch allows, so the watch task
    rolls back to v1 (its job running again), records why and fails the run."""
    import threading

    from kappa.log.broker import free_port
    from kappa.runtime.driver import JobSpec
    from kappa.control.runners.local import LocalRunner

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    # the versions run in the view host, as under `make run`: one JVM for v1, v2 and v1 again after the rollback
    monkeypatch.setenv("KAPPA_LOCAL_DRIVER", "host")
    _produce(settings, seed=53)
    runner = LocalRunner(settings, mode="host")
    registry, alias = Registry(settings.lake_uri), ServingAlias(settings.lake_uri)
    paths = {v: replay.ViewVersion.resolve(VIEW, v, settings).paths.table for v in (1, 2)}
    stop = threading.Event()
    bursts: list[int] = []

    def break_after_the_switch() -> None:
        from deltalake import DeltaTable

        while not stop.is_set():
            try:
                switched = alias.target(VIEW).version == 2 and DeltaTable.is_deltatable(paths[2])
            except Exception:  # noqa: BLE001 - no alias yet
                switched = False
            if switched:
                break
            stop.wait(0.5)
        seed = 100
        while not stop.is_set() and len(bursts) < 30:  # a steady stream of malformed records
            seed += 1
            bad = generator.events(100, seed=seed, start_ms=T0 + 600_000, rate_per_s=50, malformed_fraction=1.0)
            bursts.append(generator.produce(settings, settings.topic("ad-events"), bad).delivered)
            stop.wait(2.0)

    breaker = threading.Thread(target=break_after_the_switch, daemon=True)
    try:
        runner.start(JobSpec(VIEW, 1, starting="earliest", metrics_port=free_port()))
        deadline = time.monotonic() + 240
        while not __import__("deltalake").DeltaTable.is_deltatable(paths[1]) and time.monotonic() < deadline:
            time.sleep(1)
        breaker.start()
        conf = {"view": VIEW, "version": 2, "start": "earliest", "verify": "strict", "auto_promote": True,
                "max_lag": 0, "watch_minutes": 3, "watch_max_quarantine_rate": 0.2}
        run = _dag("kappa_replay").test(run_conf=conf)
        states = {ti.task_id: str(ti.state) for ti in run.get_task_instances()}
        assert states["promote"] == "success" and states["watch"] == "failed", states
        assert bursts, "the log turned bad after the switch"
        # before the switch, the verify task had diff-reported v2 against the serving v1 (XCom + files)
        verification = next(ti for ti in run.get_task_instances() if ti.task_id == "verify").xcom_pull(
            task_ids="verify")
        report = verification["report"]
        assert verification["passed"] and report["serving_version"] == 1, verification
        assert (report["added"], report["removed"], report["changed"]) == (0, 0, 0), report
        assert Path(report["png_path"]).is_file() and Path(report["json_path"]).is_file()

        # rolled back: v1 serves again with its job running, v2 is retired and its job stopped; the audit says why
        assert alias.resolve(VIEW) == paths[1]
        assert (registry.get(VIEW, 1).state, registry.get(VIEW, 2).state) == ("serving", "retired")
        assert runner.status(VIEW, 1).state == "running" and runner.status(VIEW, 2).state == "stopped"
        why = next(e.note for e in reversed(registry.events(VIEW, 2)) if e.note and "automatically" in e.note)
        assert why.startswith("rolled back to v1 automatically: ") and "went to the quarantine" in why, why
    finally:
        stop.set()
        breaker.join(timeout=10)
        for version in (1, 2):
            runner.stop(VIEW, version)
        from kappa.runtime.host import stop_host

        stop_host(settings)

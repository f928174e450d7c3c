"""Every live view table keeps itself (``kappa.runtime.upkeep``): compaction and VACUUM between the job's commits.

Real broker, Spark and Delta: two views run live side by side while records keep arriving, their upkeep every few
seconds - ``events_raw`` (appends: a small file per micro-batch, which OPTIMIZE compacts between its appends) and
``campaign_window_counts`` v1 (MERGE: each micro-batch replaces the files it touches, and the view publishes its
final windows). Nothing fails; each table equals an independent computation over the raw Kafka records; the
append view's files are compacted; VACUUM removes the replaced files once they are past the table's retention
(set to zero once the views stopped); compaction commits are no change to the change feed (no window published
twice); and each view's partition of the shared quarantine is compacted too, every bad record in it once.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from kappa.identity import ViewPaths
from kappa.log import generator
from kappa.log.topics import partition_offsets
from kappa.runtime.deltars import read_rows
from kappa.runtime.job import ViewJob
from kappa.runtime.late import LATE_REASON
from kappa.runtime.upkeep import vacuum
from kappa.runtime.view import load_view
from kappa.verify import oracle
from tests.helpers import delta_log
from tests.test_views import _equals_window_oracle, _operations

pytestmark = pytest.mark.integration


def _wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
        time.sleep(0.5)


def _data_files_on_disk(table: str) -> set[str]:
    root = Path(table)
    return {p.relative_to(root).as_posix() for p in root.rglob("*.parquet")
            if "_delta_log" not in p.parts and "_change_data" not in p.parts}


def _snapshot_files(table: str) -> set[str]:
    return {Path(u.removeprefix("file://")).relative_to(table).as_posix() for u in DeltaTable(table).file_uris()}


def _read_up_to(settings, paths: ViewPaths) -> int:
    """Records of ad-events the view's checkpoint committed, over all partitions."""
    from kappa.runtime.checkpoint import last_commit

    offsets, _batch = last_commit(f"{paths.checkpoint}/main", settings.topic("ad-events"))
    return sum(offsets.values())


@pytest.mark.timeout(600)
def test_live_tables_compacted_and_vacuumed_between_their_batches_lose_and_repeat_nothing(spark, kafka,
                                                                                         declared_topics, lake):
    settings = lake.replace(upkeep_seconds=4.0)
    u = generator.universe(seed=21, campaigns=6, users=100)
    generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    events = list(generator.events(2400, seed=21, universe=u, start_ms=1_700_000_000_000, rate_per_s=20,
                                   late_fraction=0.1, max_lateness_ms=20_000, malformed_fraction=0.05))
    topic = settings.topic("ad-events")
    views = {name: load_view(f"jobs.{name}.v1") for name in ("campaign_window_counts", "events_raw")}
    paths = {name: ViewPaths(settings.lake_uri, name, 1) for name in views}
    jobs = {name: ViewJob(view, settings, spark=spark, starting="earliest", trigger_seconds=1.0).start()
            for name, view in views.items()}
    try:
        # waves of records every 1.5 s - many micro-batches, several upkeeps - going on after events_raw's first
        # compaction, so that its later micro-batches append beside the compacted files
        waves = [events[i:i + 100] for i in range(0, len(events), 100)]
        after_compaction = 0
        while waves:
            generator.produce(settings, topic, waves.pop(0))
            time.sleep(1.5)
            if after_compaction or "OPTIMIZE" in _operations(paths["events_raw"].table):
                after_compaction += 1
                if after_compaction == 3:  # the rest at once
                    generator.produce(settings, topic, [e for wave in waves for e in wave])
                    waves = []
        end = sum(high for _low, high in partition_offsets(settings, topic).values())
        for name, job in jobs.items():
            _wait(f"{name} to read every record", lambda: _read_up_to(settings, paths[name]) >= end, 240)
            last = job.keeper.last
            _wait(f"an upkeep of {name} after its last micro-batch", lambda: job.keeper.last is not last, 60)
            assert job.failure() is None, job.failure()
            assert job.keeper.failures == 0, f"an upkeep of {name} failed"
        window = paths["campaign_window_counts"]
        finals = spark.read.format("delta").load(window.table).where("is_final").count()
        published: list = []

        def all_published() -> bool:
            nonlocal published
            published = oracle.read_log(settings, settings.topic("campaign-windows.v1"))
            return len(published) >= finals

        _wait("the final windows to be published", all_published, 60)
    finally:
        for job in jobs.values():
            job.stop()
    # nothing lost or repeated: the window view equals the oracle over the raw records and the recorded batches,
    # events_raw holds every valid record once
    _equals_window_oracle(spark, settings, "campaign_window_counts", 1)
    validated = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")
    raw = paths["events_raw"]
    rows = [(r["partition"], r["offset"]) for r in read_rows(DeltaTable(raw.table))]
    assert sorted(rows) == sorted((v.record.partition, v.record.offset) for v in validated if v.error is None)

    # events_raw: OPTIMIZE between its appends, few files left of many micro-batches
    ops = _operations(raw.table)
    optimized = [i for i, op in enumerate(ops) if op == "OPTIMIZE"]
    assert optimized and "WRITE" in ops[optimized[0]:], ops
    # what is left is the last compaction's file and the appends after it: every file an append wrote before the
    # last OPTIMIZE was rewritten (how many appends there were depends on the machine's speed, not asserted)
    log = sorted(delta_log(raw.table).items())
    last_optimize = max(v for v, actions in log if any(a.get("commitInfo", {}).get("operation") == "OPTIMIZE"
                                                        for a in actions))
    added = {v: {a["add"]["path"] for a in actions if "add" in a} for v, actions in log}
    before = set().union(*(paths_ for v, paths_ in added.items() if v < last_optimize))
    left = _snapshot_files(raw.table)
    assert before and not left & before, (ops, left)
    assert left <= added[last_optimize] | set().union(*(p for v, p in added.items() if v > last_optimize)), left
    assert ops.count("WRITE") > len(left), (ops, left)
    assert _operations(window.table).count("MERGE") > len(_snapshot_files(window.table))

    # each view's partition of the quarantine, compacted beside the appends: every bad record once, in one file
    bad = {(v.record.partition, v.record.offset) for v in validated if v.error is not None}
    quarantine = DeltaTable(raw.quarantine)
    for name in views:
        kept = [(r["partition"], r["offset"]) for r in read_rows(quarantine)
                if r["view"] == name and not r["error"].startswith(LATE_REASON)]
        assert bad and sorted(kept) == sorted(bad), (name, len(kept), len(bad))
        assert len([f for f in quarantine.file_uris() if f"view={name}/" in f]) == 1, quarantine.file_uris()
    assert "OPTIMIZE" in [h["operation"] for h in quarantine.history()]

    # compaction commits are no change: each final window was published once (delta-rs' change feed skips them)
    assert finals > 0 and len(published) == finals, (len(published), finals)
    assert any(a.get("dataChange") is False for actions in delta_log(raw.table).values() for a in
               (x.get("add") for x in actions) if a), "OPTIMIZE's files are added as no data change"

    # the tables' retentions at zero now that nothing writes (the defaults keep replaced files 7 days - the
    # time-travel promise - and commits 30 days; Delta refuses a VACUUM under 7 days unless its check is off), a
    # checkpoint (a live table writes one every 20 commits; this short run made fewer), then one more upkeep each
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    for name, p in paths.items():
        spark.sql(f"ALTER TABLE delta.`{p.table}` SET TBLPROPERTIES ('delta.deletedFileRetentionDuration' = "
                  "'interval 0 seconds', 'delta.logRetentionDuration' = 'interval 0 seconds')")
        DeltaTable(p.table).create_checkpoint()
        committed = {a["path"] for actions in delta_log(p.table).values() for x in actions
                     for a in (x.get("add"),) if a}
        rows_before = len(read_rows(DeltaTable(p.table)))
        assert len(_data_files_on_disk(p.table)) > len(_snapshot_files(p.table)), f"{name} replaced no file"
        jobs[name].keeper.step()  # a LITE VACUUM: the first upkeep of a job was the full one
        # every file a commit replaced (compaction's, each MERGE's) is gone from the disk; what is left beside the
        # snapshot was never committed (an empty batch's write), which the daily full VACUUM deletes
        assert not (_data_files_on_disk(p.table) - _snapshot_files(p.table)) & committed, name
        vacuum(spark, p.table, full=True)
        assert _data_files_on_disk(p.table) == _snapshot_files(p.table), name
        # the log: no commit file before the last checkpoint is left, and the table reads the same rows
        checkpoint = json.loads(Path(p.table, "_delta_log", "_last_checkpoint").read_text())["version"]
        assert min(delta_log(p.table)) >= checkpoint, (name, sorted(delta_log(p.table)), checkpoint)
        assert len(read_rows(DeltaTable(p.table))) == rows_before, name


@pytest.mark.timeout(600)
def test_a_table_is_compacted_as_writers_go_between_upkeeps(spark, kafka, declared_topics, lake):
    """``KAPPA_COMPACT_FILES``: with the hourly upkeep an hour away, the keeper's look compacts ``events_raw`` and
    its partition of the quarantine once either references more than 5 small files - no VACUUM - and nothing is
    lost or repeated: the table holds every valid record once, the quarantine every bad one."""
    settings = lake.replace(upkeep_seconds=3600.0, compact_files=5)
    u = generator.universe(seed=23, campaigns=4, users=50)
    events = list(generator.events(1500, seed=23, universe=u, start_ms=1_700_000_000_000, rate_per_s=20,
                                   malformed_fraction=0.05))
    topic = settings.topic("ad-events")
    paths = ViewPaths(settings.lake_uri, "events_raw", 1)
    job = ViewJob(load_view("jobs.events_raw.v1"), settings, spark=spark, starting="earliest",
                  trigger_seconds=1.0).start()
    try:
        waves = [events[i:i + 30] for i in range(0, len(events), 30)]
        quarantine = paths.quarantine

        def compacted() -> bool:
            return ("OPTIMIZE" in _operations(paths.table)
                    and "OPTIMIZE" in [h["operation"] for h in DeltaTable(quarantine).history()])

        while waves and not (compacted() and len(waves) < 25):  # appends before and after the compactions
            generator.produce(settings, topic, waves.pop(0))
            time.sleep(1.5)
        generator.produce(settings, topic, [e for wave in waves for e in wave])
        _wait("a compaction of the table and of its quarantine partition", compacted, 120)
        end = sum(high for _low, high in partition_offsets(settings, topic).values())
        _wait("events_raw to read every record", lambda: _read_up_to(settings, paths) >= end, 240)
        assert job.failure() is None, job.failure()
        assert job.keeper.last is None, "the hourly upkeep did not run"
        assert job.keeper.compactions >= 1 and job.keeper.failures == 0, (job.keeper.compactions,
                                                                           job.keeper.failures)
    finally:
        job.stop()
    validated = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")
    rows = [(r["partition"], r["offset"]) for r in read_rows(DeltaTable(paths.table))]
    assert sorted(rows) == sorted((v.record.partition, v.record.offset) for v in validated if v.error is None)
    bad = sorted((v.record.partition, v.record.offset) for v in validated if v.error is not None)
    kept = sorted((r["partition"], r["offset"]) for r in read_rows(DeltaTable(paths.quarantine))
                  if r["view"] == "events_raw")
    assert bad and kept == bad, (len(kept), len(bad))
    ops = _operations(paths.table)
    assert ops.count("WRITE") > len(_snapshot_files(paths.table)), (ops, _snapshot_files(paths.table))

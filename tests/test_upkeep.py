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
    lost or repeated: the table holds every valid record once, the quarantine every bad one. With a history of one
    minute (``KAPPA_HISTORY_HOURS``), the look also removes the log's commits older than it, from both tables."""
    settings = lake.replace(upkeep_seconds=3600.0, compact_files=5, history_hours=1 / 60)
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

        def first_commit(path: str) -> int:
            return min(int(f.name.split(".")[0]) for f in Path(path, "_delta_log").glob("*.json"))

        _wait("the log's commits older than the history to leave both tables",
              lambda: first_commit(paths.table) > 0 and first_commit(paths.quarantine) > 0, 150)
        assert job.keeper.failures == 0
    finally:
        job.stop()
    for path in (paths.table, paths.quarantine):
        config = DeltaTable(path).metadata().configuration
        assert config["delta.logRetentionDuration"] == config["delta.deletedFileRetentionDuration"] == \
            "interval 1 minutes", (path, config)
        latest = DeltaTable(path).version()
        assert DeltaTable(path, version=latest - 1).version() == latest - 1
        with pytest.raises(Exception):
            DeltaTable(path, version=0)  # beyond the history
    validated = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")
    rows = [(r["partition"], r["offset"]) for r in read_rows(DeltaTable(paths.table))]
    assert sorted(rows) == sorted((v.record.partition, v.record.offset) for v in validated if v.error is None)
    bad = sorted((v.record.partition, v.record.offset) for v in validated if v.error is not None)
    kept = sorted((r["partition"], r["offset"]) for r in read_rows(DeltaTable(paths.quarantine))
                  if r["view"] == "events_raw")
    assert bad and kept == bad, (len(kept), len(bad))
    ops = _operations(paths.table)
    assert ops.count("WRITE") > len(_snapshot_files(paths.table)), (ops, _snapshot_files(paths.table))


def test_a_short_history_is_cleaned_at_every_look_unless_a_publisher_holds_it(tmp_path):
    """``KAPPA_HISTORY_HOURS``: the keeper's look removes the table's and the quarantine's expired log (commits
    older than the history, before a checkpoint), not only the hourly upkeep; while the version's publisher is
    behind (``hold``), the table's log stays. The commits' age is set on their files (the clean-up reads it there),
    and what is left is read back by delta-rs: time travel reaches the kept versions, not the removed ones."""
    import os

    from kappa.runtime import deltars
    from kappa.runtime.sink import QUARANTINE_COLUMNS
    from kappa.runtime.upkeep import compact_between, history_properties

    columns = (("id", deltars.I64),)
    table, quarantine = str(tmp_path / "table"), str(tmp_path / "quarantine")
    assert history_properties(1.0) == {"delta.logRetentionDuration": "interval 60 minutes",
                                       "delta.deletedFileRetentionDuration": "interval 60 minutes"}
    assert history_properties(1.0, quarantine=True)["delta.logRetentionDuration"] == "interval 15 minutes"
    assert history_properties(None) == {}
    deltars.create_table(table, columns, properties=history_properties(1.0))
    deltars.create_table(quarantine, QUARANTINE_COLUMNS, partition_by=("view",),
                         properties=history_properties(1.0, quarantine=True))
    for path, rows in ((table, [{"id": 1}]), (quarantine, [{"view": "events_raw", "offset": 1}])):
        handle = DeltaTable(path)
        data = deltars.arrow_rows(columns if path == table else QUARANTINE_COLUMNS, rows)
        for batch in range(45):  # checkpoints at versions 20 and 40
            deltars.append_once(handle, data, "app", batch, last=batch - 1)
        two_hours_ago = time.time() - 7200
        for log_file in Path(path, "_delta_log").iterdir():
            if log_file.name.split(".")[0].isdigit() and int(log_file.name.split(".")[0]) <= 42:
                os.utime(log_file, (two_hours_ago, two_hours_ago))

    def versions(path: str) -> list[int]:
        return sorted(int(f.name.split(".")[0]) for f in Path(path, "_delta_log").glob("*.json"))

    held = compact_between(None, table, quarantine, "events_raw", limit=10**6, clean=True, hold=lambda: True,
                           handles={})
    assert held is None  # nothing compacted
    assert versions(table)[0] == 0, "a held table's log was cleaned"
    assert versions(quarantine)[0] == 40  # the commits before its last checkpoint older than its history left
    compact_between(None, table, quarantine, "events_raw", limit=10**6, clean=True, hold=lambda: False, handles={})
    assert versions(table)[0] == 40 and versions(table)[-1] == 45
    assert DeltaTable(table, version=43).version() == 43  # within the history: time travel reaches it
    with pytest.raises(Exception):
        DeltaTable(table, version=10)  # before it: gone
    assert len(read_rows(DeltaTable(table))) == 45  # the table itself is whole
    # what a reader asking for more is told, in one line
    from kappa.control.changefeed import ChangeFeedError, read_changes
    from kappa.control.registry import AsOfError, open_delta

    for reader, error in ((lambda: open_delta(table, as_of=10), AsOfError),
                          (lambda: read_changes(table, 10), ChangeFeedError)):
        with pytest.raises(error, match="older than the table's history") as caught:
            reader()
        assert "\n" not in str(caught.value)


def test_a_tables_history_is_set_on_tables_made_before_it(spark, tmp_path):
    """A lake made under another history (Delta's own, or another ``KAPPA_HISTORY_HOURS``): the job's start sets
    the view table's (through Spark, before its query runs) and the quarantine's (through delta-rs) once, and a
    start that finds them set commits nothing. An archive keeps Delta's own."""
    from kappa.runtime.sink import create_view_tables

    table, quarantine = str(tmp_path / "table"), str(tmp_path / "quarantine")
    view = load_view("jobs.events_raw.v1")
    output = spark.createDataFrame([], "user_id STRING, n BIGINT").schema
    create_view_tables(spark, view, output, table, quarantine, "r1")
    for path in (table, quarantine):
        assert "delta.logRetentionDuration" not in DeltaTable(path).metadata().configuration
    create_view_tables(spark, view, output, table, quarantine, "r1", history_hours=2.0)
    assert DeltaTable(table).metadata().configuration["delta.deletedFileRetentionDuration"] == "interval 120 minutes"
    assert DeltaTable(quarantine).metadata().configuration["delta.logRetentionDuration"] == "interval 15 minutes"
    versions = DeltaTable(table).version(), DeltaTable(quarantine).version()
    create_view_tables(spark, view, output, table, quarantine, "r1", history_hours=2.0)
    assert (DeltaTable(table).version(), DeltaTable(quarantine).version()) == versions
    archive = str(tmp_path / "archive")
    create_view_tables(spark, load_view("jobs.ad_events_archive.v1"),
                       spark.createDataFrame([], "partition INT, offset BIGINT").schema, archive, quarantine, "r1",
                       history_hours=2.0)
    assert "delta.logRetentionDuration" not in DeltaTable(archive).metadata().configuration


def test_a_publisher_behind_its_table_holds_the_tables_history(tmp_path):
    """A publishing version's keeper leaves its table's VACUUM and log alone while the publisher is more than
    PUBLISH_HOLD_COMMITS commits behind (the change data it has still to publish), and not when it keeps up."""
    import json
    from types import SimpleNamespace

    from kappa.config import Settings
    from kappa.runtime import deltars
    from kappa.runtime.job import PUBLISH_HOLD_COMMITS
    from kappa.runtime.publish import PROGRESS_FILE, Publisher

    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path)})
    paths = ViewPaths(settings.lake_uri, "campaign_window_counts", 1)
    publisher = Publisher(load_view("jobs.campaign_window_counts.v1"), settings, paths)
    columns = (("id", deltars.I64),)
    deltars.create_table(paths.table, columns)
    table = DeltaTable(paths.table)
    for batch in range(PUBLISH_HOLD_COMMITS + 10):
        deltars.append_once(table, deltars.arrow_rows(columns, [{"id": batch}]), "app", batch, last=batch - 1)
    job = SimpleNamespace(publisher=publisher)
    assert publisher.behind() == 0 and not ViewJob._history_held(job)  # before its first publish
    publisher._table = DeltaTable(paths.table)  # what its last publish opened
    Path(paths.checkpoint).mkdir(parents=True)
    for done, held in ((5, True), (table.version() - 3, False)):
        Path(paths.checkpoint, PROGRESS_FILE).write_text(json.dumps({"delta_version": done}))
        assert publisher.behind() == table.version() - done
        assert ViewJob._history_held(job) is held, done
    assert not ViewJob._history_held(SimpleNamespace(publisher=None))


def test_a_look_compacts_the_small_files_and_leaves_the_growing_one_to_the_upkeep(spark, tmp_path):
    """Between upkeeps a look rewrites only the files under LOOK_BELOW_BYTES (the micro-batches' own), not a
    compacted file on its way to COMPACT_BELOW_BYTES, which the hourly upkeep alone rewrites; the rows stay."""
    import os

    from kappa.runtime import deltars
    from kappa.runtime.sink import QUARANTINE_COLUMNS
    from kappa.runtime.upkeep import COMPACT_BELOW_BYTES, LOOK_BELOW_BYTES, compact, compact_between

    table, quarantine = str(tmp_path / "table"), str(tmp_path / "quarantine")
    columns = (("id", deltars.I64), ("blob", deltars.STR))
    deltars.create_table(table, columns)
    deltars.create_table(quarantine, QUARANTINE_COLUMNS, partition_by=("view",))
    rs = DeltaTable(table)
    # a file of random hex (incompressible enough) past the look's threshold, then six micro-batches' files
    big = [{"id": i, "blob": os.urandom(2_500).hex()} for i in range(2_000)]
    deltars.append_once(rs, deltars.arrow_rows(columns, big), "app", 0, last=-1)
    for batch in range(1, 7):
        deltars.append_once(rs, deltars.arrow_rows(columns, [{"id": 10_000 + batch, "blob": "x"}]), "app", batch,
                            last=batch - 1)

    def sizes() -> dict[str, int]:
        actions = DeltaTable(table).get_add_actions(flatten=True)
        return dict(zip(actions.column(actions.column_names.index("path")).to_pylist(),
                        actions.column(actions.column_names.index("size_bytes")).to_pylist()))

    before = sizes()
    grown = [path for path, size in before.items() if size >= LOOK_BELOW_BYTES]
    assert len(grown) == 1 and before[grown[0]] < COMPACT_BELOW_BYTES and len(before) == 7, before
    rows = sorted(r["id"] for r in read_rows(DeltaTable(table)))

    done = compact_between(spark, table, deltars.rs_uri(quarantine), "v", limit=5)
    after = sizes()
    assert done is not None and (done.table.files_removed, done.table.files_added) == (6, 1), done
    assert grown[0] in after and len(after) == 2, after  # the growing file untouched, the six into one
    assert compact_between(spark, table, deltars.rs_uri(quarantine), "v", limit=5) is None  # nothing due
    assert sorted(r["id"] for r in read_rows(DeltaTable(table))) == rows

    hourly = compact(spark, table)
    assert (hourly.files_removed, hourly.files_added) == (2, 1) and grown[0] not in sizes(), hourly
    assert sorted(r["id"] for r in read_rows(DeltaTable(table))) == rows


def test_the_quarantines_upkeep_removes_replaced_files_whose_removal_the_log_forgot(tmp_path):
    """A short history: the quarantine's checkpoints and log clean-up forget a compacted file's removal within
    minutes; the hourly upkeep's VACUUM still deletes it from the disk (a full one), and nothing referenced."""
    import os

    from kappa.runtime import deltars
    from kappa.runtime.sink import QUARANTINE_COLUMNS
    from kappa.runtime.upkeep import compact_quarantine

    path = str(tmp_path / "quarantine")
    deltars.create_table(path, QUARANTINE_COLUMNS, partition_by=("view",),
                         properties={"delta.deletedFileRetentionDuration": "interval 0 seconds",
                                     "delta.logRetentionDuration": "interval 0 seconds"})
    table = DeltaTable(path)
    for batch in range(6):
        deltars.append_once(table, deltars.arrow_rows(QUARANTINE_COLUMNS, [
            {"topic": "t", "partition": 0, "offset": batch, "kafka_timestamp": 0, "raw_key": b"k",
             "raw_value": b"v", "error": "e", "view": "v", "version": 1, "batch_id": batch,
             "quarantined_at": 0}]), "app", batch, last=batch - 1)
    assert compact_quarantine(deltars.rs_uri(path), "v", keep=False).files_removed == 6  # a look: no VACUUM
    table = DeltaTable(path)
    table.create_checkpoint()
    table.cleanup_metadata()  # the removals are gone from the log: only the disk holds the six files
    on_disk = lambda: {p.name for p in Path(path).rglob("*.parquet") if "_delta_log" not in p.parts}  # noqa: E731
    live = {os.path.basename(u) for u in DeltaTable(path).file_uris()}
    assert len(on_disk() - live) == 6 and not DeltaTable(path).vacuum(dry_run=True)  # what a lite VACUUM sees
    done = compact_quarantine(deltars.rs_uri(path), "v")
    assert done.vacuumed and on_disk() == live
    assert len(deltars.read_rows(DeltaTable(path))) == 6

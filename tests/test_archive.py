"""The lake's archive of a topic and replays older than the log's retention (``kappa.runtime.archive``).

Real broker, real Spark, real Delta: the archive view's job copies every record (checked byte for byte against the
log read with a plain consumer); retention then drops half of each partition (``delete_records``, what retention
does to old segments); a replay from offset 0 - refused before the archive existed - reads the gone half from the
archive and the 600 records it has not copied yet from the log, through the replay API, the local runner and strict verification. A stateful
view (user sessions, with late events) gives the same table as the same range replayed from the log alone, and the
plain-Python oracle's table.
"""

from __future__ import annotations

from typing import Any

import pytest
from deltalake import DeltaTable

from jobs.ad_events_archive.oracle import ORACLES as ARCHIVE_ORACLES
from jobs.user_sessions.oracle import expected_sessions
from kappa.control import replay
from kappa.control.registry import Registry
from kappa.control.replay import ReplayError, ReplayRequest
from kappa.log import generator
from kappa.log.topics import partition_offsets
from kappa.runtime.job import ViewJob
from kappa.runtime.view import load_view
from kappa.verify import oracle
from kappa.verify.oracle import OracleInput
from tests.conftest import subprocess_env

from tests.test_replay import T0, _delete_records, _platform_env, _wait_for


def _run(view: Any, settings: Any, spark: Any) -> None:
    job = ViewJob(view, settings, spark=spark, starting="earliest", available_now=True).start()
    try:
        assert job.await_termination(300), f"{view.ref} did not finish"
        assert job.failure() is None, job.failure()
    finally:
        job.stop()


def _rows(table: str) -> list[dict]:
    from kappa.control.replay.verification import table_rows

    return table_rows(DeltaTable(table))[1]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_replay_older_than_retention_reads_the_archive_then_the_log(spark, kafka, lake, tmp_path, monkeypatch):
    from kappa.control.runners.local import LocalRunner
    from kappa.identity import ViewPaths

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    topic = settings.topic("ad-events")
    u = generator.universe(seed=41, campaigns=4, users=300)
    events = generator.events(3000, seed=41, universe=u, start_ms=T0, rate_per_s=20, late_fraction=0.05,
                              max_lateness_ms=60_000, malformed_fraction=0.03)
    assert generator.produce(settings, topic, events).delivered == 3000
    ends = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}

    # the archive: every record, valid or not, byte for byte as the log holds it
    _run(load_view("jobs.ad_events_archive.v1"), settings, spark)
    archive = ViewPaths(settings.lake_uri, "ad_events_archive", 1).table
    spec = ARCHIVE_ORACLES[1]
    archived = dict(spec.adapt(r) for r in _rows(archive))
    first = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")
    assert archived == spec.compute(OracleInput(events=first))
    assert len(archived) == 3000 and sum(invalid for *_rest, invalid in archived.values()) > 30
    # records the archive has not copied yet: the replay reads them from the log
    more = generator.events(600, seed=42, universe=u, start_ms=T0 + 150_000, rate_per_s=20, late_fraction=0.05,
                            max_lateness_ms=60_000)
    assert generator.produce(settings, topic, more).delivered == 600
    log_end = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}
    validated = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")

    # the reference: the same range replayed from the log alone (a version of its own, one micro-batch)
    sessions = load_view("jobs.user_sessions.v1")
    from dataclasses import replace

    from_log = replace(sessions, version=7)
    _run(from_log, settings, spark)
    reference = _rows(ViewPaths(settings.lake_uri, "user_sessions", 7).table)
    assert len(reference) > 100

    # the log still holds it all: source=archive reads what the archive holds anyway; auto does once the archive
    # serves ARCHIVE_FASTER_RECORDS (measured faster than the log from there on)
    from kappa.control.replay import planning

    runner = LocalRunner(settings)
    whole = ReplayRequest(view="user_sessions", version=1, start="offsets", triggered_by="test:archive",
                          start_offsets={str(p): 0 for p in ends}, source="archive")
    pre = replay.preflight(whole, settings, runner)
    assert {int(p): o for p, o in pre.archive["handover"].items()} == ends and pre.archived_records == 3000
    auto = replace(whole, source="auto")
    assert replay.preflight(auto, settings, runner).archive is None, "3,600 records: the log reads them"
    monkeypatch.setattr(planning, "ARCHIVE_FASTER_RECORDS", 3000)
    assert replay.preflight(auto, settings, runner).archived_records == 3000
    monkeypatch.setattr(planning, "ARCHIVE_FASTER_RECORDS", 3001)  # the archive serves 3,000: the log reads all
    assert replay.preflight(auto, settings, runner).archive is None

    # retention drops the first half of every partition
    half = {p: o // 2 for p, o in ends.items()}
    _delete_records(settings, topic, half)
    with pytest.raises(ReplayError) as refused:  # source=log never reads the archive
        replay.preflight(replace(whole, source="log"), settings, runner)
    assert "\n" not in str(refused.value) and "no longer retains the start of user_sessions@v1" in str(refused.value) \
        and "source=log does not read the archive (ad_events_archive holds ad-events: source=auto reads what it " \
            "holds)" in str(refused.value), refused.value
    # the CLI says how far back a replay can start: the archive's start, not the log's
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "kappa.front.cli", "topics", "archives"], text=True, timeout=120,
                           capture_output=True, env=subprocess_env(settings, COLUMNS="200"))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stdout.startswith("ad-events: archived by ad_events_archive@v1"), shown.stdout
    assert "; keeps records for 730 d (upkeep every 1 h)\n" in shown.stdout, shown.stdout
    for p, end in ends.items():
        assert (f"partition {p}: archive 0-{end:,} ({end:,} records); log {end // 2:,}-{log_end[p]:,}; a replay can "
                "start at 0") in shown.stdout, shown.stdout

    req = ReplayRequest(view="user_sessions", version=1, start="offsets", triggered_by="test:archive",
                        start_offsets={str(p): 0 for p in ends})
    pre = replay.preflight(req, settings, runner)
    assert pre.archive is not None and pre.archive["view"] == "ad_events_archive"
    # the archive is used as far as it reaches, the log for the rest
    assert {int(p): o for p, o in pre.archive["handover"].items()} == ends and pre.target_offsets == log_end
    assert pre.archived_records == 3000 and "3,000 of them from the archive ad_events_archive" in pre.summary()
    assert any("from the archive ad_events_archive" in step for step in pre.plan())
    try:
        replay.launch(req, settings, runner, pre)
        _wait_for(lambda: replay.caught_up("user_sessions", 1, settings, runner, by="test"), 420,
                  "the archive replay to catch up")
        table = replay.ViewVersion.resolve("user_sessions", 1, settings).paths.table

        def key(row: dict) -> tuple:
            return tuple(sorted((k, str(v)) for k, v in row.items()))

        assert sorted(map(key, _rows(table))) == sorted(map(key, reference)), \
            "archive + log replayed a different table than the log alone"
        # and the plain-Python oracle (one batch over every record: the handover is invisible)
        expected = expected_sessions(validated, closed_only=True)
        got = {(r["user_id"], int(r["session_start"].timestamp() * 1000)) for r in _rows(table)}
        assert got == {(user, start) for user, start in expected}, "sessions differ from the oracle's"
        check = replay.verify("user_sessions", 1, settings, "strict", by="test")
        assert check.passed, check.message
        assert Registry(settings.lake_uri).get("user_sessions", 1).state == "verified"
    finally:
        runner.stop("user_sessions", 1)

    # a record the archive holds twice would be counted twice: refused, named
    spark.read.format("delta").load(archive).where("partition = 0 AND offset = 0").write.format("delta") \
        .mode("append").save(archive)
    twice = ReplayRequest(view="campaign_window_counts", version=2, start="offsets", triggered_by="test",
                          start_offsets={str(p): 0 for p in ends})
    with pytest.raises(ReplayError) as refused:
        replay.preflight(twice, settings, runner)
    assert "\n" not in str(refused.value) and "partition 0: 1 records of [0, " in str(refused.value) \
        and "held twice" in str(refused.value), refused.value


@pytest.mark.integration
def test_an_archive_with_a_gap_is_refused_naming_it(spark, kafka, lake, tmp_path):
    """The archive ends before the log starts: preflight names the records in neither."""
    from kappa.control.runners.local import LocalRunner

    settings = lake.replace(home=tmp_path / "home")
    topic = settings.topic("ad-events")
    assert generator.produce(settings, topic, generator.events(400, seed=5)).delivered == 400
    _run(load_view("jobs.ad_events_archive.v1"), settings, spark)  # archives these 400
    assert generator.produce(settings, topic, generator.events(400, seed=6, start_ms=T0 + 10**7)).delivered == 400
    ends = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}
    _delete_records(settings, topic, ends)  # the log keeps nothing, the archive only the first 400
    req = ReplayRequest(view="user_sessions", version=1, start="offsets", triggered_by="test",
                        start_offsets={str(p): 0 for p in ends})
    with pytest.raises(ReplayError) as refused:
        replay.preflight(req, settings, LocalRunner(settings))
    message = str(refused.value)
    assert "\n" not in message and "no longer retains" in message and "records in neither" in message, message

    # a data file the archive lists is gone: refused in one line naming the archive, never replayed with a hole
    from pathlib import Path

    from kappa.identity import ViewPaths

    table = Path(ViewPaths(settings.lake_uri, "ad_events_archive", 1).table)
    next(table.rglob("*.parquet")).unlink()
    with pytest.raises(ReplayError) as broken:
        replay.preflight(req, settings, LocalRunner(settings))
    message = str(broken.value)
    assert "\n" not in message and f"archive {table}: cannot read its files" in message, message


@pytest.mark.integration
def test_records_the_archive_lost_after_preflight_refuse_the_launch(spark, kafka, lake, tmp_path):
    """The archive's retention removes records between preflight and launch (its keeper runs when it runs): the
    launch takes the topic's lease first - from then on the keeper deletes nothing of it - then finds the hole,
    releases the lease and refuses in one line; nothing is registered, no job starts."""
    from kappa.control.leases import leases
    from kappa.control.runners.local import LocalRunner
    from kappa.identity import ViewPaths

    settings = lake.replace(home=tmp_path / "home")
    topic = settings.topic("ad-events")
    assert generator.produce(settings, topic, generator.events(400, seed=7)).delivered == 400
    _run(load_view("jobs.ad_events_archive.v1"), settings, spark)
    _delete_records(settings, topic, {p: hi // 2 for p, (_lo, hi) in partition_offsets(settings, topic).items()})
    runner = LocalRunner(settings)
    req = ReplayRequest(view="user_sessions", version=1, start="offsets", triggered_by="test",
                        start_offsets={str(p): 0 for p in range(4)})
    pre = replay.preflight(req, settings, runner)
    assert pre.archive is not None and pre.archived_records > 0
    table = ViewPaths(settings.lake_uri, "ad_events_archive", 1).table
    DeltaTable(table).delete('"partition" = 0 AND "offset" < 5')  # what the keeper's retention deletes: a prefix
    with pytest.raises(ReplayError) as refused:
        replay.launch(req, settings, runner, pre)
    message = str(refused.value)
    assert "\n" not in message and "the archive ad_events_archive no longer holds partition 0 [0, " in message \
        and "replay again" in message, message
    assert Registry(settings.lake_uri).get("user_sessions", 1) is None
    taken = [lease for lease in leases(settings) if (lease.view, lease.version) == ("user_sessions", 1)]
    assert taken and all(lease.released_at is not None for lease in taken), taken
    assert runner.status("user_sessions", 1).state != "running"


@pytest.mark.integration
@pytest.mark.slow  # make test-long: a fault injection at two instants of the archive hand-over (two kills, three
# driver starts); make test's SIGKILL proof is tests/test_exactly_once.py, the hand-over itself runs in the test above
@pytest.mark.timeout(900)
def test_a_driver_killed_in_the_archive_part_resumes_without_losing_or_repeating_a_row(spark, kafka, lake, tmp_path,
                                                                                       monkeypatch):
    """SIGKILL (fault injection, ``KAPPA_FAULT``: a real crash cannot be timed to these instants) between the Delta
    commit of the archive + log batch and its checkpoint commit, then after that commit but before the checkpoint
    is switched to the log: the restart switches it, the view's query reads new records with the state the archive
    part built, and the table equals the replay from the log alone."""
    from dataclasses import replace

    from kappa.control.runners.local import LocalRunner
    from kappa.identity import ViewPaths

    settings = lake.replace(home=tmp_path / "home")
    _platform_env(monkeypatch, settings)
    topic = settings.topic("ad-events")
    u = generator.universe(seed=51, campaigns=4, users=200)
    assert generator.produce(settings, topic, generator.events(1500, seed=51, universe=u, start_ms=T0, rate_per_s=20,
                                                               late_fraction=0.05)).delivered == 1500
    _run(load_view("jobs.ad_events_archive.v1"), settings, spark)
    assert generator.produce(settings, topic, generator.events(300, seed=52, universe=u, start_ms=T0 + 75_000,
                                                               rate_per_s=20)).delivered == 300
    _run(replace(load_view("jobs.user_sessions.v1"), version=7), settings, spark)
    reference = _rows(ViewPaths(settings.lake_uri, "user_sessions", 7).table)
    _delete_records(settings, topic, {p: hi // 2 for p, (_lo, hi) in partition_offsets(settings, topic).items()})

    runner = LocalRunner(settings)
    req = ReplayRequest(view="user_sessions", version=1, start="offsets", triggered_by="test:archive-kill",
                        start_offsets={str(p): 0 for p in range(4)})
    main = f"{ViewPaths(settings.lake_uri, 'user_sessions', 1).checkpoint}/main"
    try:
        for fault in ("between_commits@0", "before_switch@0"):
            monkeypatch.setenv("KAPPA_FAULT", fault)
            replay.launch(req, settings, runner, replay.preflight(req, settings, runner, resume=True))
            _wait_for(lambda: runner.status("user_sessions", 1).state != "running", 300, f"the kill at {fault}")
            offsets = open(f"{main}/offsets/0").read()
            assert "reservoirId" in offsets, f"killed at {fault}: the checkpoint must not be switched yet"
        assert open(f"{main}/commits/0").read(), "before_switch@0 runs after batch 0 committed"
        monkeypatch.delenv("KAPPA_FAULT")
        replay.launch(req, settings, runner, replay.preflight(req, settings, runner, resume=True))
        _wait_for(lambda: "reservoirId" not in open(f"{main}/offsets/0").read(), 300,
                  "the restart to switch the checkpoint to the log")
        # the view's own query goes on from the log with the state the archive part built
        assert generator.produce(settings, topic, generator.events(300, seed=53, universe=u, start_ms=T0 + 90_000,
                                                                   rate_per_s=20)).delivered == 300
        log_end = {p: hi for p, (_lo, hi) in partition_offsets(settings, topic).items()}
        vv = replay.ViewVersion.resolve("user_sessions", 1, settings)
        _wait_for(lambda: vv.committed_offsets()[0] == log_end and vv.pending_watermark() is None, 300,
                  "the switched query to read the new records")
        _run(replace(load_view("jobs.user_sessions.v1"), version=7), settings, spark)  # the reference goes on too
        before, reference = reference, _rows(ViewPaths(settings.lake_uri, "user_sessions", 7).table)
        assert len(reference) > len(before), "the new records' watermark closed more sessions"

        def key(row: dict) -> tuple:
            return tuple(sorted((k, str(v)) for k, v in row.items()))

        assert sorted(map(key, _rows(vv.paths.table))) == sorted(map(key, reference))
        _wait_for(lambda: replay.caught_up("user_sessions", 1, settings, runner, by="test"), 120, "caught up")
        check = replay.verify("user_sessions", 1, settings, "strict", by="test")
        assert check.passed, check.message
    finally:
        runner.stop("user_sessions", 1)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_archive_keeps_itself_retention_removes_old_prefixes_never_under_a_lease(spark, kafka, lake, tmp_path):
    """The archive's job applies its declared retention (730 d) and compacts its small files on its own thread:
    while a replay's lease holds the topic nothing leaves; then whole prefixes of records older than the retention
    leave each partition - a young record amid old ones stays, and so does everything after it - and each partition
    is left in one file."""
    import time

    from kappa.control import leases
    from kappa.identity import ViewPaths
    from kappa.runtime.archive import coverage

    settings = lake.replace(home=tmp_path / "home", upkeep_seconds=3.0)
    topic = settings.topic("ad-events")
    now = int(time.time() * 1000)
    old, young = now - 800 * 86_400_000, now
    values = iter(generator.events(200, seed=61))
    producer = generator.make_producer(settings)
    # per partition: 10 old records, (partition 0 only: one young record), 5 old, 5 young - Kafka timestamps
    for p in range(4):
        for ts in [old] * 10 + ([young] if p == 0 else []) + [old] * 5 + [young] * 5:
            key, value, _meta = next(values)
            producer.produce(topic, key=key, value=value, partition=p, timestamp=ts)
    assert producer.flush(30) == 0
    leases.take(settings, topic, "user_sessions", 9, by="test")  # a replay reads the topic

    archive = load_view("jobs.ad_events_archive.v1")
    table = ViewPaths(settings.lake_uri, "ad_events_archive", 1).table
    job = ViewJob(archive, settings, spark=spark, starting="earliest", trigger_seconds=1.0).start()
    try:
        _wait_for(lambda: len(_rows(table)) == 81, 120, "the archive to copy the 81 records")
        for p in range(4):  # another micro-batch: a second small file in every partition
            key, value, _meta = next(values)
            producer.produce(topic, key=key, value=value, partition=p, timestamp=young)
        assert producer.flush(30) == 0
        _wait_for(lambda: len(_rows(table)) == 85, 180, "the archive to copy 4 more records")
        assert len(DeltaTable(table).file_uris()) == 8
        held = _wait_for(lambda: job.keeper.last and job.keeper.last.table, 180, "the archive's first upkeep")
        assert held.held_by == ("user_sessions@v9",) and held.removed == {}, held
        assert len(_rows(table)) == 85, "nothing leaves while a lease holds the topic"

        leases.release(settings, "user_sessions", 9, by="test", note="caught up", converge=False)
        kept = _wait_for(lambda: job.keeper.last.table if job.keeper.last.table.removed else None, 180, "the retention")
        assert kept.removed == {0: (0, 10), 1: (0, 15), 2: (0, 15), 3: (0, 15)}, kept
        assert "retention removed partition 0 offsets 0-9, partition 1 offsets 0-14" in kept.line(), kept.line()
        rows = _rows(table)
        assert len(rows) == 85 - 10 - 3 * 15
        assert {(r["partition"], r["offset"]) for r in rows} == {(0, o) for o in range(10, 22)} | {
            (p, o) for p in (1, 2, 3) for o in range(15, 21)}, "whole prefixes only: offsets 10-14 of partition 0 stay"
        held_now = coverage(table)
        assert all(c.contiguous for c in held_now.values()) and held_now[0].low == 10 and held_now[3].low == 15
        files = DeltaTable(table).file_uris()
        assert sorted(f.split("partition=")[1].split("/")[0] for f in files) == ["0", "1", "2", "3"], files
    finally:
        job.stop()

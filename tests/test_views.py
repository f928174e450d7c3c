"""The four views, run by the real plumbing on the real broker, equal an independent recomputation.

Includes the bad-input flood: 30 % malformed records (invalid JSON, wrong types, missing fields, oversized
values, null keys, unknown enum values) never stop a job and land exactly once in quarantine.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from typing import Any

import pytest

from jobs.campaign_window_counts.oracle import late_window_records
from jobs.user_sessions.oracle import expected_sessions_batched, late_session_records
from kappa.log import generator
from kappa.verify import oracle
from kappa.verify.oracle import OracleInput
from kappa.identity import ViewPaths
from kappa.runtime.job import ViewJob
from kappa.runtime.late import LATE_REASON
from kappa.runtime.view import load_view
from tests.helpers import commit_infos, committed_batches, delta_log, delta_txns, finish, recorded_batches, run_to_end
from tests.views_oracle import assert_views_match

pytestmark = pytest.mark.integration

VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")


def _run_all(spark, settings, bounds: dict[str, int] | None = None) -> None:
    for name in VIEWS:
        run_to_end(spark, settings, f"jobs.{name}.v1", batch=(bounds or {}).get(name))


def test_views_match_oracle_with_30_percent_bad_records(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=11, campaigns=20, users=400)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    # KTable semantics: a remap and a tombstone after the first value; plus bad mapping records
    ads = list(mapping)
    generator.publish_campaigns(lake, {ads[0]: u.campaigns[-1], ads[1]: None}, topic=lake.topic("campaigns"))
    generator.produce(lake, lake.topic("campaigns"), [(None, b'{"campaign_id": "x"}'), (ads[2].encode(), b"{nope")])
    stream = generator.events(6000, seed=11, universe=u, start_ms=1_700_000_000_000, rate_per_s=25,
                              late_fraction=0.1, max_lateness_ms=5000, malformed_fraction=0.3)
    result = generator.produce(lake, lake.topic("ad-events"), stream)
    assert result.delivered == 6000

    _run_all(spark, lake)
    stats = assert_views_match(spark, lake)
    # a bounded run of a stateful merge view writes its table once: the batch that read the log is staged, and the
    # no-data batch after it (which finalises the windows the watermark passed) compacts it in one append, no MERGE
    paths = ViewPaths(lake.lake_uri, "campaign_window_counts", 1)
    assert _batch_commits(paths.table) == [("CREATE TABLE", None), ("WRITE", 1)], _batch_commits(paths.table)
    assert [b for _op, b in _batch_commits(paths.staging) if b is not None] == [0]
    # the flood really was a flood, and nothing was lost: valid + quarantined == consumed
    assert stats["valid"] + stats["quarantined"] == stats["consumed"]
    assert stats["quarantined"] >= 0.25 * stats["consumed"]
    assert stats["final_windows"] > 0 and stats["sessions"] > 0
    reasons = {r.error for r in spark.read.format("delta").load(ViewPaths(lake.lake_uri, "events_raw", 1).quarantine)
               .where("view = 'events_raw'").select("error").distinct().collect()}
    assert {"null key", "malformed JSON"} <= reasons or len(reasons) >= 4, reasons

    # running again over the same log is a no-op: the checkpoint is complete, nothing is duplicated
    _run_all(spark, lake)
    assert assert_views_match(spark, lake) == stats


def _batch_commits(table: str) -> list[tuple[str, int | None]]:
    """(operation, micro-batch of its lineage) of a Delta table's commits, oldest first."""
    return [(info["operation"], json.loads(info.get("userMetadata") or "{}").get("kappa", {}).get("batch"))
            for info in commit_infos(table)]


def _operations(table: str) -> list[str]:
    """Operations of a Delta table's commits, oldest first."""
    return [info["operation"] for info in commit_infos(table)]


def test_bounded_catch_up_stages_batches_and_writes_the_table_once(spark, kafka, declared_topics, lake):
    """A run catching up in bounded micro-batches appends them to its staging table and writes its view table
    once, without MERGE; the result equals the oracle; after catching up the run merges as usual."""
    u = generator.universe(seed=12, campaigns=8, users=120)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    ads = list(mapping)
    generator.publish_campaigns(lake, {ads[0]: u.campaigns[-1], ads[1]: None}, topic=lake.topic("campaigns"))
    stream = generator.events(2000, seed=12, universe=u, start_ms=1_700_000_000_000, rate_per_s=25,
                              late_fraction=0.1, max_lateness_ms=5000, malformed_fraction=0.05)
    generator.produce(lake, lake.topic("ad-events"), stream)

    _run_all(spark, lake, bounds={"events_raw": 500, "campaign_catalog": 20, "campaign_window_counts": 400,
                                  "user_sessions": 500})
    stats = assert_views_match(spark, lake)
    for name in ("campaign_window_counts", "campaign_catalog"):
        paths = ViewPaths(lake.lake_uri, name, 1)
        staged = {r[0] for r in spark.read.format("delta").load(paths.staging).select("_kappa_batch").collect()}
        batches = committed_batches(f"{paths.checkpoint}/main")
        assert len(staged) >= 3, f"{name}: only batches {sorted(staged)} were staged"
        assert max(staged) < batches[-1], f"{name}: the last batch must not be staged"
        # (operation, micro-batch) of each commit: the table is created, then written once, by the batch that
        # caught up (the compaction of the staged ones); a batch after it in the same run (a no-data batch that
        # moves the watermark) commits as the run does once caught up
        commits = _batch_commits(paths.table)
        caught_up = max(staged) + 1
        assert commits[:2] == [("CREATE TABLE", None), ("WRITE", caught_up)], f"{name}: {commits}"
        assert all(batch > caught_up for _op, batch in commits[2:]), f"{name} merged while catching up: {commits}"
        app = next(a for a in delta_txns(paths.table) if a.startswith(f"kappa:{name}@v1:") and "/" not in a)
        assert delta_txns(paths.table)[app] == batches[-1]
        assert not (set(_operations(paths.staging)) - {"WRITE", "CREATE TABLE"})

    # the run caught up: new records are merged into the table (updates, finality), still equal to the oracle
    generator.produce(lake, lake.topic("ad-events"), generator.events(
        600, seed=13, universe=u, start_ms=1_700_000_000_000 + 2000 * 40, rate_per_s=25))
    # a catalog change no event refers to (a remap of a used ad would change old windows in the oracle only)
    generator.publish_campaigns(lake, {"00000000-0000-4000-8000-000000000001": u.campaigns[0]},
                                topic=lake.topic("campaigns"))
    _run_all(spark, lake)
    after = assert_views_match(spark, lake)
    assert after["valid"] > stats["valid"]
    for name in ("campaign_window_counts", "campaign_catalog"):
        assert "MERGE" in _operations(ViewPaths(lake.lake_uri, name, 1).table), name


def test_second_driver_for_same_version_is_refused(spark, kafka, declared_topics, lake):
    from kappa.runtime.lock import DriverAlreadyRunning

    view = load_view("jobs.events_raw.v1")
    first = ViewJob(view, lake, spark=spark, starting="latest")
    first.start()
    try:
        with pytest.raises(DriverAlreadyRunning, match="already running"):
            ViewJob(view, lake, spark=spark, starting="latest").start()
    finally:
        first.stop()
    # once the first one stopped, a new driver may take over the same checkpoint
    again = ViewJob(view, lake, spark=spark, starting="latest")
    again.start()
    again.stop()


def _equals_window_oracle(spark, settings, view: str, version: int) -> tuple[Any, OracleInput, dict]:
    """The window view's table equals its oracle over the raw records and the batches the run recorded, every
    column, no window twice; returns the oracle, its input and what it expected."""
    batches = recorded_batches(settings, view, version)
    assert [b.batch_id for b in batches] == list(range(len(batches)))
    spec = oracle.oracle_for(view, version)
    validated = oracle.validate_records(oracle.read_log(settings, settings.topic("ad-events")), "ad_event",
                                        key_field="user_id")
    campaigns = oracle.validate_records(oracle.read_log(settings, settings.topic("campaigns")), "campaign",
                                        key_field=None, tombstones=True)
    given = OracleInput(events=validated, lookups={"campaigns": campaigns}, batches=batches)
    expected = spec.compute(given)
    rows = [r.asDict() for r in spark.read.format("delta").load(ViewPaths(settings.lake_uri, view, version).table)
            .collect()]
    actual = dict(spec.adapt(r) for r in rows)
    assert len(actual) == len(rows), "a window is stored twice"
    assert actual == expected, [(k, actual.get(k), expected.get(k)) for k in sorted(set(actual) | set(expected),
                                key=str) if actual.get(k) != expected.get(k)][:5]
    return spec, given, expected


def test_window_view_merging_run_by_run_equals_the_batch_aware_oracle(spark, kafka, declared_topics, lake):
    """The live write path (MERGE per batch, pruned to the open windows; rows moved to the final partition only
    when a stored window closes) over runs whose events arrive past the watermark: Spark drops them, the table
    equals the oracle that replays the recorded batch boundaries and watermarks, the drops are counted, and every
    dropped record is kept once in the quarantine (reason `late`)."""
    u = generator.universe(seed=14, campaigns=6, users=100)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    events = list(generator.events(2400, seed=14, universe=u, start_ms=1_700_000_000_000, rate_per_s=20,
                                   late_fraction=0.15, max_lateness_ms=90_000))
    view = load_view("jobs.campaign_window_counts.v1")
    dropped_by_spark = counted = kept = 0
    start = 0
    # tiny runs move the event-time maximum without closing a window (no finality clause); the others close some
    for size in (900, 4, 500, 3, 700, 293):
        produced = generator.produce(lake, lake.topic("ad-events"), events[start:start + size])
        start += size
        job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True)
        job.start()
        try:
            finish(job)
            progress = job.queries[0].recentProgress
            # each record computed once (the first run's batch is kept for its jobs, the next ones' are collected
            # in one pass): a batch computed again would count its records - and its late rows - twice
            assert sum(p["numInputRows"] for p in progress) == produced.delivered
            spark_dropped = sum(op["numRowsDroppedByWatermark"] for p in progress for op in p["stateOperators"])
            # late records were looked for in exactly the batches that dropped some (no re-read otherwise)
            assert job.late_batches == [p["batchId"] for p in progress
                                        if any(op["numRowsDroppedByWatermark"] for op in p["stateOperators"])]
            def metric() -> float:
                return job.metrics.registry.get_sample_value("kappa_late_rows_dropped_total", job.metrics.labels) or 0

            deadline = time.monotonic() + 15  # progress events reach the listener asynchronously
            while metric() < spark_dropped and time.monotonic() < deadline:
                time.sleep(0.2)
            dropped_by_spark += spark_dropped
            counted += metric()
            kept += job.metrics.registry.get_sample_value("kappa_late_records_kept_total", job.metrics.labels) or 0
        finally:
            job.stop()

    paths = ViewPaths(lake.lake_uri, view.name, 1)
    ops = _operations(paths.table)
    assert ops.count("MERGE") >= 4, ops
    # the table keeps final windows apart (partitioned by is_final): a MERGE that closes windows writes them there
    closing = [any(a["add"]["partitionValues"].get("is_final") == "true" for a in actions if "add" in a)
               for actions in delta_log(paths.table).values()
               if any(a.get("commitInfo", {}).get("operation") == "MERGE" for a in actions)]
    assert True in closing and False in closing, f"windows closed per MERGE: {closing}"
    spec, given, expected = _equals_window_oracle(spark, lake, view.name, 1)
    validated, campaigns, batches = given.events, given.lookups["campaigns"], given.batches
    # the run really had events past the watermark: the oracle drops some, and so did Spark (counted)
    unbatched = spec.compute(OracleInput(events=validated, lookups={"campaigns": campaigns}, batches=None))
    assert sum(v[1] for v in unbatched.values()) > sum(v[1] for v in expected.values())  # view counts
    assert dropped_by_spark > 0 and counted == dropped_by_spark
    # ... and kept every one of them in the quarantine (reason `late`, raw bytes), each once
    late = [r for r in spark.read.format("delta").load(paths.quarantine).where(f"view = '{view.name}'").collect()
            if r.error.startswith(LATE_REASON)]
    expected_late = late_window_records(OracleInput(events=validated, batches=batches), counted=("view",),
                                               window_ms=10_000)
    assert expected_late and len(late) == len({(r.partition, r.offset) for r in late})
    assert {(r.partition, r.offset) for r in late} == expected_late and kept == len(late)
    raw = {(v.record.partition, v.record.offset): v.record.value for v in validated}
    assert all(bytes(r.raw_value) == raw[(r.partition, r.offset)] for r in late)
    assert any(final for *_, final in expected.values()) and not all(final for *_, final in expected.values())


def test_hopping_dedupe_view_equals_the_oracle_with_injected_duplicates(spark, kafka, declared_topics, lake):
    """campaign_window_counts v3 (60 s windows every 10 s, dedupe by event_id within the watermark) over a log in
    which 20 % of the events were sent twice, some of them late, read in two runs of small micro-batches:
    its table equals the oracle over the raw records and the recorded batches, every column; the same oracle
    without the event ids (each record counted) differs, so the duplicates were there and were dropped; the
    late records are in the quarantine, each once."""
    import dataclasses

    from jobs.campaign_window_counts.oracle import late_event_records

    u = generator.universe(seed=23, campaigns=5, users=80)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    events = list(generator.events(1200, seed=23, universe=u, start_ms=1_700_000_000_000, rate_per_s=10,
                                   late_fraction=0.1, max_lateness_ms=60_000, duplicate_fraction=0.2,
                                   max_duplicate_distance=40, malformed_fraction=0.02))
    assert sum(e.meta.duplicate for e in events) > 150
    view = load_view("jobs.campaign_window_counts.v3")
    start = 0
    for size in (900, len(events) - 900):  # the second run resumes the first one's checkpoint and state
        generator.produce(lake, lake.topic("ad-events"), events[start:start + size])
        start += size
        job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True, max_offsets_per_trigger=300)
        job.start()
        try:
            finish(job)
        finally:
            job.stop()

    paths = ViewPaths(lake.lake_uri, view.name, 3)
    spec, given, expected = _equals_window_oracle(spark, lake, view.name, 3)
    validated, campaigns, batches = given.events, given.lookups["campaigns"], given.batches
    assert len(batches) >= 4
    # counted without their ids, the copies would have raised the counts: the dedupe had work to do
    anonymous = [dataclasses.replace(v, value={k: x for k, x in v.value.items() if k != "event_id"})
                 if v.value else v for v in validated]
    undeduped = spec.compute(OracleInput(events=anonymous, lookups={"campaigns": campaigns}, batches=batches))
    assert sum(v[1] + v[2] for v in undeduped.values()) > sum(v[1] + v[2] for v in expected.values())
    assert any(final for *_, final in expected.values()) and not all(final for *_, final in expected.values())
    late = [(r.partition, r.offset) for r in spark.read.format("delta").load(paths.quarantine)
            .where(f"view = '{view.name}' and version = 3").collect() if r.error.startswith(LATE_REASON)]
    expected_late = late_event_records(OracleInput(events=validated, batches=batches), counted=("view", "click"))
    assert expected_late and sorted(late) == sorted(expected_late)


def test_session_view_drops_late_events_row_by_row_like_the_oracle(spark, tmp_path):
    """Spark filters late input of a session window row by row, before merging sessions: an event whose own
    window ``[t, t + gap)`` the previous watermark passed is dropped even when another event of the same batch
    would have merged it into a live session. The user_sessions transform runs on the real engine here, one
    micro-batch per file, and its output equals ``expected_sessions_batched`` over the watermarks Spark used."""
    from pyspark.sql import functions as F

    from jobs.user_sessions.v1 import VIEW
    from kappa.runtime.lineage import BatchBoundary
    from kappa.verify.oracle import LogRecord, OracleInput, Validated

    s = 1_000
    plan = [[("v", 200 * s)], [("v", 201 * s)],                      # the watermark reaches 170 s, then 171 s
            [("u", 135 * s), ("u", 150 * s), ("w", 100 * s)],        # 135 s: late alone, covered by 150 s once merged
            [("v", 300 * s)], [("v", 301 * s)]]                      # the watermark passes every session
    folder = tmp_path / "in"
    folder.mkdir()
    for i, rows in enumerate(plan):
        path = folder / f"{i:03d}.json"
        path.write_text("".join(json.dumps({"user_id": u, "t": t, "ad_id": f"{u}{t}"}) + "\n" for u, t in rows))
        os.utime(path, (1_000 + i, 1_000 + i))  # the file source takes files oldest first
    events = (spark.readStream.schema("user_id STRING, t BIGINT, ad_id STRING").option("maxFilesPerTrigger", 1)
              .json(str(folder)).withColumn("event_ts", F.timestamp_millis("t")))
    query = (VIEW.transform(events).writeStream.format("memory").queryName("sessions_late_rows").outputMode("append")
             .option("checkpointLocation", str(tmp_path / "checkpoint")).trigger(availableNow=True).start())
    try:
        query.awaitTermination(300)
        progress = [p for p in query.recentProgress if p["numInputRows"]]
        got = {(r.user_id, int(r.session_start.timestamp() * 1000)):
               (int(r.session_end.timestamp() * 1000), r.event_count, r.distinct_ads)
               for r in spark.table("sessions_late_rows").collect()}
    finally:
        query.stop()
    assert [p["numInputRows"] for p in progress] == [len(rows) for rows in plan]
    watermarks = [int(datetime.fromisoformat(p["eventTime"]["watermark"].replace("Z", "+00:00")).timestamp() * 1000)
                  for p in progress]
    offsets = [sum(len(rows) for rows in plan[: i + 1]) for i in range(len(plan))]
    records = [Validated(LogRecord("t", 0, o, 0, u.encode(), b"{}"),
                         {"user_id": u, "event_time": t, "ad_id": f"{u}{t}", "event_type": "view"}, None)
               for o, (u, t) in enumerate(row for rows in plan for row in rows)]
    inp = OracleInput(records, {}, [BatchBoundary(i, {0: end}, wm) for i, (end, wm) in enumerate(zip(offsets, watermarks))])
    expected = {k: v[:3] for k, v in expected_sessions_batched(inp).items()}
    assert got == expected, (got, expected)
    assert ("u", 150 * s) in got and ("u", 135 * s) not in got  # the covered late event was dropped, not merged
    assert late_session_records(inp) == {(0, 2), (0, 4)}  # u@135 s and w@100 s
    assert sum(op["numRowsDroppedByWatermark"] for p in progress for op in p["stateOperators"]) == 2

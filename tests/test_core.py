"""The fast core's parts on the real broker and Spark: one read per stateful view, cached lookups, batch statistics."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from kappa.log import generator
from kappa.runtime.batch import latency_buckets
from kappa.runtime.job import RunMismatch, ViewJob
from kappa.runtime.lookups import CAMPAIGN_OF_AD, LookupCache
from kappa.runtime.metrics import LATENCY_BUCKETS
from kappa.runtime.view import load_view

pytestmark = pytest.mark.integration


@contextmanager
def _bounded_run_without_no_data_batches(spark, lake, view) -> Iterator[ViewJob]:
    """``view`` run from earliest to the log's end (availableNow) with Spark's no-data batches off; yields the job
    once its query ended without failure, before it is stopped."""
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True)
        job.start()
        try:
            assert job.await_termination(300) and job.failure() is None, job.failure()
            yield job
        finally:
            job.stop()
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")


def test_stateful_view_reads_and_decodes_its_topic_once_per_batch(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=3, campaigns=5, users=50)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    generator.produce(lake, lake.topic("ad-events"), generator.events(2000, seed=3, universe=u,
                                                                      malformed_fraction=0.1))
    view = load_view("jobs.campaign_window_counts.v1")
    # without no-data batches the last execution is the data batch, whose plan we inspect
    with _bounded_run_without_no_data_batches(spark, lake, view) as job:
        plan = job.queries[0]._jsq.explainInternal(False)
    # one scan of the topic feeds both the aggregation and the quarantine (the second branch reuses the exchange)
    assert plan.count("MicroBatchScan") == 1, plan
    assert "ReusedExchange" in plan, plan
    assert "InMemoryTableScan" in plan, "the campaigns lookup was re-read instead of taken from the cache"
    quarantined = (spark.read.format("delta").load(job.paths.quarantine)
                   .where(f"view = '{view.name}'").select("partition", "offset").distinct().count())
    assert quarantined == spark.read.format("delta").load(job.paths.quarantine).where(f"view = '{view.name}'").count()
    assert quarantined > 100  # ~10 % of 2,000, each once
    assert not job.paths.local("quarantine").exists(), "a second (quarantine) query ran"


def test_a_bounded_run_whose_last_batch_was_staged_writes_it_when_its_query_ends(spark, kafka, declared_topics,
                                                                                 lake):
    """A bounded run of a stateful view stages a batch that wrote rows, expecting the no-data batch after it to
    compact it; when none follows (no-data batches off here), the job writes the staged rows to the view table as
    soon as its query ended - before it is stopped - in one append keyed by that batch."""
    from tests.helpers import delta_txns

    u = generator.universe(seed=5, campaigns=4, users=40)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    generator.produce(lake, lake.topic("ad-events"), generator.events(1500, seed=5, universe=u,
                                                                      start_ms=1_700_000_000_000, rate_per_s=10))
    with _bounded_run_without_no_data_batches(spark, lake, load_view("jobs.campaign_window_counts.v1")) as job:
        staged = spark.read.format("delta").load(job.paths.staging)
        table = spark.read.format("delta").load(job.paths.table)
        assert {r[0] for r in staged.select("_kappa_batch").distinct().collect()} == {0}
        assert staged.count() > 20 and table.count() == staged.count(), "the staged batch is not in the table"
        # nothing followed batch 0, so no window is final yet (as a MERGE of it alone would have written)
        assert table.where("is_final").count() == 0
        assert table.drop("is_final").exceptAll(staged.drop("_kappa_batch")).isEmpty()
        assert delta_txns(job.paths.table)[job.app_id] == 0


def test_lookup_is_reread_only_when_its_topic_moves(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=4, campaigns=3, users=10)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    cache = LookupCache(spark, lake)
    try:
        first = cache.frame(CAMPAIGN_OF_AD)
        assert first.count() == len(mapping)
        assert cache.refresh([CAMPAIGN_OF_AD]) == []  # nothing moved: no re-read
        ad = next(iter(mapping))
        generator.publish_campaigns(lake, {ad: None}, topic=lake.topic("campaigns"))  # a tombstone
        assert cache.refresh([CAMPAIGN_OF_AD]) == ["campaigns"]
        assert cache.frame(CAMPAIGN_OF_AD) is first
        assert cache.frames({"by_ad": CAMPAIGN_OF_AD}) == {"by_ad": first}  # the name is the view's own
        assert first.count() == len(mapping) - 1
        assert sum(cache.offsets(CAMPAIGN_OF_AD).values()) == len(mapping) + 1
    finally:
        cache.close()


def test_checkpoint_of_the_two_query_layout_is_refused_with_one_line(spark, kafka, declared_topics, lake):
    view = dataclasses.replace(load_view("jobs.user_sessions.v1"))
    job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True)
    job.paths.local("quarantine").mkdir(parents=True)
    with pytest.raises(RunMismatch, match="older kappa") as info:
        job.start()
    assert "\n" not in str(info.value)


def test_latency_buckets_from_event_time_groups():
    now = 1_700_000_100.0
    groups = ((int((now - 0.25) * 1000), 3, 3 * int((now - 0.25) * 1000)),   # 100 ms bucket, 0.25 s old
              (int((now - 40) * 1000), 2, 2 * int((now - 40) * 1000)),       # 40 s old
              (-1, 1, int((now - 7200) * 1000)))                              # older than an hour
    counts, total = latency_buckets(groups, now)
    index = {b: i for i, b in enumerate(LATENCY_BUCKETS)}
    assert dict(counts) == {0: 3, index[30] + 1: 2, len(LATENCY_BUCKETS): 1}
    assert total == pytest.approx(3 * 0.25 + 2 * 40 + 7200, abs=0.01)


def test_tumbling_window_end_is_sparks_window_end_and_keeps_null_times(spark):
    """The late bound's window end equals Spark's own ``window()`` end (boundaries, before 1970 included), and a
    row without event time stays a row (``window()`` in a projection would filter it out)."""
    from pyspark.sql import functions as F

    from kappa.runtime.view import tumbling_window_end

    micros = [0, 1, 9_999_999, 10_000_000, 1_700_000_123_456_789, -1, -10_000_000, -10_000_001]
    rows = spark.createDataFrame([(m,) for m in micros] + [(None,)], "us BIGINT").select(
        F.timestamp_micros("us").alias("event_ts"))
    ours = rows.select(tumbling_window_end("event_ts", 10).alias("end")).collect()
    assert len(ours) == len(micros) + 1 and sum(r.end is None for r in ours) == 1
    theirs = rows.select(F.window("event_ts", "10 seconds").end.alias("end")).collect()
    assert sorted(r.end for r in ours if r.end is not None) == sorted(r.end for r in theirs)


def test_quarantine_appends_are_idempotent_concurrent_and_readable_by_spark(spark, tmp_path):
    """The quarantine is appended through delta-rs by every view's driver: a re-run batch is skipped by its Delta
    application transaction, concurrent writers of the shared table lose nothing, and Spark (which created the
    table and checkpointed it) still reads it after delta-rs rewrote the checkpoint pointer."""
    import threading

    from pyspark.sql import functions as F

    from kappa.runtime.deltars import local_path
    from kappa.runtime.sink import QUARANTINE_SCHEMA, QuarantineSink, ensure_table

    path = str(tmp_path / "quarantine")
    ensure_table(spark, path, QUARANTINE_SCHEMA, partition_by=("view",), properties={"delta.checkpointInterval": "5"})
    # a Spark checkpoint first (it leaves Hadoop's checksum sidecar beside _last_checkpoint)
    for n in range(5):
        spark.range(1).select(F.lit("spark").alias("view"), F.lit(n).cast("bigint").alias("batch_id")).write \
            .format("delta").mode("append").save(path)
    assert (tmp_path / "quarantine" / "_delta_log" / "._last_checkpoint.crc").exists()

    def side(view: str, batch_id: int, n: int):
        return spark.range(n).select(
            F.lit(f"t-{view}").alias("topic"), F.lit(0).alias("partition"), (F.col("id") + batch_id * 100).alias("offset"),
            F.timestamp_millis(F.lit(1_700_000_000_123) + F.col("id")).alias("kafka_timestamp"),
            F.lit(None).cast("binary").alias("raw_key"), F.expr("encode(concat('raw-', id), 'utf-8')").alias("raw_value"),
            F.lit("bad").alias("error"))

    views = {name: load_view(f"jobs.{name}.v1") for name in ("events_raw", "user_sessions", "campaign_window_counts")}
    frames = {(name, b): side(name, b, 3 + b % 4).persist() for name in views for b in range(8)}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            sink = QuarantineSink(views[name], path, f"kappa:{name}@v1:test/quarantine")
            for b in range(8):
                assert sink.write(frames[(name, b)], b) == 3 + b % 4
            # the driver crashed after the commit and before Spark's checkpoint: the batch runs again
            assert sink.write(frames[(name, 7)], 7) == 3 + 7 % 4
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    table = spark.read.format("delta").load(path).where("view <> 'spark'")
    expected = sum(3 + b % 4 for b in range(8))
    for name in views:
        rows = table.where(f"view = '{name}'")
        assert rows.count() == expected
        assert rows.select("batch_id", "offset").distinct().count() == expected, "a batch was appended twice"
    row = (table.where("view = 'events_raw' AND batch_id = 2 AND offset = 201")
           .select("*", F.unix_millis("kafka_timestamp").alias("ms")).collect()[0])
    assert (row.version, row.topic, bytes(row.raw_value), row.raw_key, row.ms) == (
        1, "t-events_raw", b"raw-1", None, 1_700_000_000_124)
    # delta-rs checkpointed (interval 5) and the stale Hadoop sidecar is gone: Spark reads without a checksum error
    checkpoints = sorted(p.name for p in Path(local_path(path), "_delta_log").glob("*.checkpoint.parquet"))
    assert len(checkpoints) > 1, checkpoints
    assert not (tmp_path / "quarantine" / "_delta_log" / "._last_checkpoint.crc").exists()
    jvm = spark.sparkContext._jvm
    jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    txns = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, path).update(
        False, jvm.scala.Option.empty(), jvm.scala.Option.empty()).transactions()
    assert int(txns.get("kappa:events_raw@v1:test/quarantine").get()) == 7


def test_a_quarantine_append_lists_nothing_it_knows_and_asks_after_an_error(tmp_path, monkeypatch):
    """A quarantine sink asks the table for its last batch once, then trusts its own commits (nothing listed before
    each append); a driver restarted after a commit (a new sink) asks and skips it; an append that landed and then
    raised (injected after the real commit: a fake, the store does not fail on demand) is asked about again at
    the batch's next attempt and not appended twice. Counted by reading the table's log."""
    from deltalake import DeltaTable

    from kappa.runtime import deltars
    from kappa.runtime.sink import QUARANTINE_COLUMNS, QuarantineSink
    from tests.helpers import delta_txns

    path = str(tmp_path / "quarantine")
    deltars.create_table(path, QUARANTINE_COLUMNS, partition_by=("view",))
    view = load_view("jobs.events_raw.v1")
    app = "kappa:events_raw@v1:test/quarantine"

    def records(batch_id: int) -> list[dict]:
        return [{"topic": "t", "partition": 0, "offset": batch_id * 10 + i, "raw_value": b"x", "error": "bad"}
                for i in range(3)]

    sink = QuarantineSink(view, path, app)
    listed = []
    real_committed = deltars.committed
    monkeypatch.setattr(deltars, "committed", lambda *a: listed.append(a[2]) or real_committed(*a))
    for b in range(4):
        assert sink.append(records(b), b) == 3
    assert listed == [0], listed  # asked once, at its first batch
    restarted = QuarantineSink(view, path, app)
    restarted.append(records(3), 3)  # the batch Spark runs again after the restart: skipped
    real_after = deltars.after_commit

    def failing(table):
        real_after(table)
        monkeypatch.setattr(deltars, "after_commit", real_after)
        raise OSError("injected: the store failed after the commit landed")

    monkeypatch.setattr(deltars, "after_commit", failing)
    with pytest.raises(OSError, match="injected"):
        restarted.append(records(4), 4)
    restarted.append(records(4), 4)  # the batch's next attempt: the table holds it
    restarted.append(records(5), 5)
    assert listed == [0, 3, 4], listed
    offsets = sorted(r["offset"] for r in deltars.read_rows(DeltaTable(path)))
    assert offsets == sorted(b * 10 + i for b in range(6) for i in range(3)), offsets
    assert delta_txns(path)[app] == 5


def test_a_driver_waits_for_its_topics_with_its_metrics_up(spark, kafka, lake):
    """In a cluster the topics Job runs once the release's pods are Ready: a driver started before its topics exist
    waits, alive (its metrics endpoint answers, so its pod turns Ready), and starts once they exist."""
    import threading
    import urllib.request

    from kappa.log.broker import free_port
    from kappa.log.topics import declared_topics, ensure_topics

    settings = lake.replace(topic_prefix=f"late-{lake.topic_prefix}")  # nothing exists under this prefix yet
    job = ViewJob(load_view("jobs.campaign_window_counts.v1"), settings, spark=spark, starting="earliest",
                  metrics_port=free_port())
    started = threading.Thread(target=job.start, kwargs={"wait_for_topics": True}, daemon=True)
    started.start()
    try:
        url = f"http://127.0.0.1:{job.metrics_port}/metrics"
        for _ in range(60):
            try:
                if urllib.request.urlopen(url, timeout=2).status == 200:
                    break
            except OSError:
                pass
            started.join(0.5)
        assert urllib.request.urlopen(url, timeout=2).status == 200, "no metrics while waiting for the topics"
        started.join(3)
        assert started.is_alive() and not job.queries, "the driver did not wait for its topics"
        ensure_topics(settings, declared_topics(settings))
        started.join(180)
        assert not started.is_alive() and job.queries and job.queries[0].isActive, job.failure()
        assert job.bound_port == job.metrics_port, "one metrics endpoint, served from the start"
    finally:
        job.stop()


def _tasks_per_stage(spark, group: str) -> list[int]:
    """Tasks of every stage of the jobs Spark ran in job group ``group`` (a streaming query's run id)."""
    tracker = spark.sparkContext.statusTracker()
    stages = {s for j in tracker.getJobIdsForGroup(group) for s in (tracker.getJobInfo(j).stageIds if
                                                                      tracker.getJobInfo(j) else [])}
    return [tracker.getStageInfo(s).numTasks for s in sorted(stages) if tracker.getStageInfo(s) is not None]


def test_a_small_stateless_batch_is_read_by_one_task_and_a_big_one_by_every_partition(spark, kafka, declared_topics,
                                                                                        lake):
    """A live micro-batch of a few hundred records costs a task per Kafka partition for nothing: a stateless view's
    batch of at most ONE_TASK_RECORDS records (counted from the offset log) is read by one task; a bigger one (a
    catch-up, a replay) by one task per partition. Counted in the stages Spark ran for each run's query."""
    from kappa.runtime.batch import ONE_TASK_RECORDS

    u = generator.universe(seed=12, campaigns=5, users=50)
    topic = lake.topic("ad-events")
    small = generator.produce(lake, topic, generator.events(800, seed=12, universe=u))
    view = load_view("jobs.events_raw.v1")
    job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True).start()
    try:
        assert job.await_termination(300) and job.failure() is None, job.failure()
        group, batch = str(job.queries[0].runId), job._next_batch() - 1
        assert job._batch_records(spark, batch) == small.delivered  # what the offset log says the batch read
        # each record was computed once, though the batch's output and its bad records are read by two jobs
        assert sum(p["numInputRows"] for p in job.queries[0].recentProgress) == small.delivered
    finally:
        job.stop()
    assert max(_tasks_per_stage(spark, group)) == 1, _tasks_per_stage(spark, group)
    # the in-batch progress tracker reads the group's jobs in two calls into the JVM: the same ids as PySpark's
    from kappa.runtime.inflight import ReadTracker

    tracker = spark.sparkContext.statusTracker()
    ids = ReadTracker(tracker, group, batch_range=lambda b: ({}, {}), next_batch=lambda: 0)._group_jobs()
    assert ids and ids == set(tracker.getJobIdsForGroup(group)), ids

    big = generator.produce(lake, topic, generator.events(ONE_TASK_RECORDS + 2000, seed=13, universe=u,
                                                          start_ms=1_700_000_900_000))
    job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True).start()
    try:
        assert job.await_termination(300) and job.failure() is None, job.failure()
        group = str(job.queries[0].runId)
        assert job._batch_records(spark, job._next_batch() - 1) == big.delivered
    finally:
        job.stop()
    assert max(_tasks_per_stage(spark, group)) == declared_topics["ad-events"], _tasks_per_stage(spark, group)
    rows = spark.read.format("delta").load(job.paths.table)
    assert rows.count() == small.kinds["valid"] + big.kinds["valid"]
    assert rows.select("partition", "offset").distinct().count() == rows.count()


def test_a_frame_computed_once_is_computed_once_and_its_blocks_are_freed(spark):
    """``computed_once``: the actions in the block see the same rows - computed by the first, a non-deterministic
    column proves it - and the blocks that kept them are gone once it ends; nothing goes through Spark's cache."""
    import random

    from pyspark.sql import functions as F

    from kappa.runtime.spark import computed_once

    draw = F.udf(lambda _: random.random(), "double", useArrow=False).asNondeterministic()
    frame = spark.range(0, 200, numPartitions=3).withColumn("draw", draw("id"))
    assert frame.collect() != frame.collect()  # the column really differs from one computation to the next

    def kept_partitions(rdd: int) -> int:
        return sum(i.numCachedPartitions() for i in spark.sparkContext._jsc.sc().getRDDStorageInfo() if i.id() == rdd)

    cached = spark._jsparkSession.sharedState().cacheManager().numCachedEntries()
    with computed_once(frame) as kept:
        first = kept.collect()
        assert kept.where("draw < 0.5").collect() == [r for r in first if r.draw < 0.5]
        assert kept.count() == 200 and kept.collect() == first
        rdd = kept._jdf.logicalPlan().rdd().id()
        assert kept_partitions(rdd) == 3
        assert spark._jsparkSession.sharedState().cacheManager().numCachedEntries() == cached
    assert kept_partitions(rdd) == 0


def _compilations(spark) -> int:
    """Generated classes Spark compiled in this JVM so far (a source found in its code cache is not compiled)."""
    return spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME().getCount()


@pytest.mark.parametrize("module", ["jobs.events_raw.v1", "jobs.campaign_window_counts.v1"])
def test_live_micro_batches_reuse_the_code_spark_compiled_for_the_first(spark, kafka, declared_topics, lake, module):
    """Spark compiles a plan's generated code once per distinct source text. A literal that changes from one
    micro-batch to the next (a random seed, which a streaming query draws anew at every batch; a timestamp) makes
    every batch compile its plan again: CPU, classes and code cache for each batch of each view. After two warm-up
    batches, four live micro-batches - each with new records whose event times stay within the first batches'
    (the watermark, a literal of Spark's own eviction code, does not move) - compile nothing new."""
    u = generator.universe(seed=21, campaigns=5, users=50)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    topic = lake.topic("ad-events")
    rounds = [list(generator.events(300, seed=21 + i, universe=u, malformed_fraction=0.05)) for i in range(6)]
    job = ViewJob(load_view(module), lake, spark=spark, starting="earliest", trigger_seconds=0.5)
    job.start()
    try:
        counts = []
        for records in rounds:
            generator.produce(lake, topic, records)
            job.process_all_available()
            counts.append(_compilations(spark))
        assert job.failure() is None, job.failure()
    finally:
        job.stop()
    compiled = counts[-1] - counts[1]
    assert compiled == 0, f"{compiled} classes compiled over 4 micro-batches after the first two (totals {counts})"


def test_a_platform_session_builds_dataframes_without_recording_python_call_sites(spark):
    """PySpark's call-site capture (four JVM calls and a walk of the Python stack for every Column and DataFrame
    call) is off in the sessions the platform builds: what it saves is measured by ``make bench-live``."""
    from pyspark.errors.utils import is_debugging_enabled
    from pyspark.sql import functions as F

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    spark.range(1).select(F.col("id")).collect()
    assert is_debugging_enabled() is False  # what PySpark's wrapper of every call reads (cached per process)


def test_the_rows_a_watermark_dropped_are_counted_in_one_jvm_call_as_the_plan_walk_counts_them(spark, tmp_path):
    """A view that keeps late rows asks, in each micro-batch, how many rows its watermark dropped: the JVM helper
    (kappa/runtime/java, one call) gives what walking the executed plan from Python gives, and what Spark reports
    in the batch's progress - a batch past the watermark drops its late rows, the others none."""
    import json
    import os

    from pyspark.sql import functions as F

    from kappa.runtime import late

    folder = tmp_path / "events"
    folder.mkdir()
    # the third file: three rows late, each in a window of its own (Spark counts partially aggregated rows)
    seconds = [list(range(100, 110)), [200, 201], [50, 61, 72, 205], [206]]
    for i, batch in enumerate(seconds):
        path = folder / f"{i}.json"
        path.write_text("\n".join(json.dumps({"ts": s}) for s in batch))
        os.utime(path, (1_700_000_000 + i * 10, 1_700_000_000 + i * 10))  # the source reads files oldest first
    name = "late-rows-counted"
    counted: dict[int, tuple[int | None, int]] = {}

    def each(frame, batch_id: int) -> None:
        frame.collect()  # the batch computed: its plan's metrics are final
        counted[batch_id] = (late._plan_sum(spark, name), late._plan_walk(spark, name))

    stream = (spark.readStream.schema("ts long").option("maxFilesPerTrigger", 1).json(str(folder))
              .select(F.timestamp_seconds("ts").alias("at")).withWatermark("at", "10 seconds")
              .groupBy(F.window("at", "10 seconds")).count())
    query = (stream.writeStream.queryName(name).outputMode("update").foreachBatch(each)
             .trigger(availableNow=True).option("checkpointLocation", str(tmp_path / "ckpt")).start())
    try:
        query.awaitTermination(180)
        assert query.exception() is None, query.exception()
        progress = {p["batchId"]: sum(op["numRowsDroppedByWatermark"] for op in p["stateOperators"])
                    for p in query.recentProgress}
    finally:
        query.stop()
    assert counted and all(helper == walk for helper, walk in counted.values()), counted
    assert {b: helper for b, (helper, _walk) in counted.items()} == {b: progress[b] for b in counted}
    assert [progress[b] for b in range(4)] == [0, 0, 3, 0] and sum(progress.values()) == 3, progress
    assert late._plan_sum(spark, name) == -1, "no such active query any more"


def test_an_append_on_a_handle_older_than_a_metadata_change_is_tried_again(tmp_path):
    """A live sink appends on the table handle it had (nothing listed before the write); when a commit since that
    handle's version changed the table's metadata (an ALTER, a repair's swap), delta-rs refuses the blind append and
    it is tried once more on the table brought up to date: the batch lands once, after the change."""
    from deltalake import DeltaTable

    from kappa.runtime import deltars
    from tests.helpers import delta_txns

    path = str(tmp_path / "t")
    columns = (("id", deltars.I64),)
    deltars.create_table(path, columns)
    sink_handle, other = DeltaTable(path), DeltaTable(path)
    assert deltars.append_once(sink_handle, deltars.arrow_rows(columns, [{"id": 0}]), "app", 0, last=-1)
    other.alter.set_table_properties({"delta.logRetentionDuration": "interval 2 hours"})
    assert deltars.append_once(sink_handle, deltars.arrow_rows(columns, [{"id": 1}]), "app", 1, last=0)
    assert sorted(r["id"] for r in deltars.read_rows(DeltaTable(path))) == [0, 1]
    assert delta_txns(path)["app"] == 1
    assert DeltaTable(path).metadata().configuration["delta.logRetentionDuration"] == "interval 2 hours"


def test_a_writer_that_checkpoints_starts_again_from_its_checkpoint_and_stays_current(tmp_path, caplog):
    """Two long-lived handles append to one table in turn, as two views' quarantine sinks do: the one whose commits
    land on the checkpoint versions writes them and starts again from each (``deltars.start_from_checkpoint``);
    both handles stay the table as a fresh reader sees it - version, files, each writer's txn - and a start that
    cannot load the version before its checkpoint (the log's clean-up removed it) leaves the handle current."""
    import os

    from deltalake import DeltaTable

    from kappa.runtime import deltars

    path = str(tmp_path / "t")
    columns = (("id", deltars.I64), ("by", deltars.STR))
    deltars.create_table(path, columns)
    handles = {"a": DeltaTable(path), "b": DeltaTable(path)}

    def state(table: DeltaTable) -> tuple:
        return (table.version(), sorted(table.file_uris()), table.transaction_version("a"),
                table.transaction_version("b"))

    for batch in range(3 * deltars.CHECKPOINT_INTERVAL // 2 + 3):
        for by, table in handles.items():
            assert deltars.append_once(table, deltars.arrow_rows(columns, [{"id": batch, "by": by}]), by, batch,
                                       last=batch - 1)
            assert state(table) == state(DeltaTable(path)), (by, batch)
    log = Path(path, "_delta_log")
    assert sorted(p.name for p in log.glob("*.checkpoint.parquet")) == [
        f"{v:020d}.checkpoint.parquet" for v in range(deltars.CHECKPOINT_INTERVAL, handles["a"].version() + 1,
                                                       deltars.CHECKPOINT_INTERVAL)]
    # the load of the version before fails: its commit and every checkpoint before it are gone
    writer = DeltaTable(path)
    batch = 0
    while writer.version() % deltars.CHECKPOINT_INTERVAL:  # up to the next checkpoint, which it writes
        deltars.append_once(writer, deltars.arrow_rows(columns, [{"id": batch, "by": "c"}]), "c", batch)
        batch += 1
    version = writer.version()
    assert (log / f"{version:020d}.checkpoint.parquet").exists()
    for name in os.listdir(log):
        if name[:20].isdigit() and int(name[:20]) < version:
            os.unlink(log / name)
    with caplog.at_level("DEBUG", logger="kappa.runtime.deltars"):
        deltars.start_from_checkpoint(writer, version)
    assert f"not started again from checkpoint {version}" in caplog.text
    assert state(writer) == state(DeltaTable(path))
    assert deltars.append_once(writer, deltars.arrow_rows(columns, [{"id": -1, "by": "c"}]), "c", batch)
    assert state(writer) == state(DeltaTable(path)) and writer.version() == version + 1

"""The fast core's parts on the real broker and Spark: one read per stateful view, cached lookups, batch statistics."""

from __future__ import annotations

import dataclasses

import pytest

from kappa import generator
from kappa.batch import latency_buckets
from kappa.job import RunMismatch, ViewJob
from kappa.lookups import LookupCache
from kappa.metrics import LATENCY_BUCKETS
from kappa.view import load_view

pytestmark = pytest.mark.integration


def test_stateful_view_reads_and_decodes_its_topic_once_per_batch(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=3, campaigns=5, users=50)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    generator.produce(lake, lake.topic("ad-events"), generator.events(2000, seed=3, universe=u,
                                                                      malformed_fraction=0.1))
    view = load_view("jobs.campaign_window_counts.v1")
    # without no-data batches the last execution is the data batch, whose plan we inspect
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        job = ViewJob(view, lake, spark=spark, starting="earliest", available_now=True)
        job.start()
        try:
            assert job.await_termination(300) and job.failure() is None, job.failure()
            plan = job.queries[0]._jsq.explainInternal(False)
        finally:
            job.stop()
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")
    # one scan of the topic feeds both the aggregation and the quarantine (the second branch reuses the exchange)
    assert plan.count("MicroBatchScan") == 1, plan
    assert "ReusedExchange" in plan, plan
    assert "InMemoryTableScan" in plan, "the campaigns lookup was re-read instead of taken from the cache"
    quarantined = (spark.read.format("delta").load(job.paths.quarantine)
                   .where(f"view = '{view.name}'").select("partition", "offset").distinct().count())
    assert quarantined == spark.read.format("delta").load(job.paths.quarantine).where(f"view = '{view.name}'").count()
    assert quarantined > 100  # ~10 % of 2,000, each once
    assert not job.paths.local("quarantine").exists(), "a second (quarantine) query ran"


def test_lookup_is_reread_only_when_its_topic_moves(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=4, campaigns=3, users=10)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    cache = LookupCache(spark, lake)
    try:
        first = cache.frame("campaigns")
        assert first.count() == len(mapping)
        assert cache.refresh(["campaigns"]) == []  # nothing moved: no re-read
        ad = next(iter(mapping))
        generator.publish_campaigns(lake, {ad: None}, topic=lake.topic("campaigns"))  # a tombstone
        assert cache.refresh(["campaigns"]) == ["campaigns"]
        assert cache.frame("campaigns") is first
        assert first.count() == len(mapping) - 1
        assert sum(cache.offsets("campaigns").values()) == len(mapping) + 1
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

    from kappa.view import tumbling_window_end

    micros = [0, 1, 9_999_999, 10_000_000, 1_700_000_123_456_789, -1, -10_000_000, -10_000_001]
    rows = spark.createDataFrame([(m,) for m in micros] + [(None,)], "us BIGINT").select(
        F.timestamp_micros("us").alias("event_ts"))
    ours = rows.select(tumbling_window_end("event_ts", 10).alias("end")).collect()
    assert len(ours) == len(micros) + 1 and sum(r.end is None for r in ours) == 1
    theirs = rows.select(F.window("event_ts", "10 seconds").end.alias("end")).collect()
    assert sorted(r.end for r in ours if r.end is not None) == sorted(r.end for r in theirs)

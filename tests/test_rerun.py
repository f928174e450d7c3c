"""The re-run engine's plan for a coalesced recompute (kappa.runtime.rerun): which views may feed runs of recorded
micro-batches as one, and how the recorded batches are grouped. The recompute itself, coalesced and one batch at a
time, against real runs with late rows and injected faults: tests/test_verify_any_view.py."""

from __future__ import annotations

import dataclasses

import pytest

from kappa.runtime.lineage import BatchBoundary
from kappa.runtime.rerun import coalesce_steps, coalescable, plan_steps, step_records


def _recorded(ends_per_batch: list[dict[int, int]], watermarks: list[int]) -> list[BatchBoundary]:
    return [BatchBoundary(batch_id=i, end_offsets=e, watermark_ms=w)
            for i, (e, w) in enumerate(zip(ends_per_batch, watermarks))]


def test_runs_of_recorded_batches_become_one_step_each_and_the_last_data_batch_stays_as_recorded():
    # 8 batches over 2 partitions, 100 records each; batch 3 read nothing (a no-data batch), batch 7 too
    ends, at = [], {0: 0, 1: 0}
    for i in range(8):
        if i not in (3, 7):
            at = {0: at[0] + 50, 1: at[1] + 50}
        ends.append(dict(at))
    steps, per_partition = plan_steps(_recorded(ends, [1000 * i for i in range(8)]), {0: 0, 1: 0})
    assert [s.data for s in steps] == [True, True, True, False, True, True, True, False]
    assert [s.watermark_ms for s in steps] == [1000 * i for i in range(8)]

    merged, merged_ends = coalesce_steps(steps, per_partition, {0: 0, 1: 0}, max_records=250)
    # before the last data batch (6): runs of >= 250 records; then 6 and the trailing no-data batch 7 as recorded
    assert [s.covers for s in merged] == [(0, 1, 2), (3, 4, 5), (6,), (7,)]
    assert [s.pos for s in merged] == [2, 5, 6, 7] and [s.data for s in merged] == [True, True, True, False]
    # a run re-runs with the watermark its first recorded batch ran with (the feeder checks it)
    assert [s.watermark_ms for s in merged] == [0, 3000, 6000, 7000]
    assert merged_ends == {0: [150, 250, 300, 300], 1: [150, 250, 300, 300]}
    assert step_records(merged, merged_ends, {0: 0, 1: 0}) == [300, 200, 100, 0]
    # every recorded batch is re-run exactly once
    assert [pos for s in merged for pos in s.covers] == list(range(8))

    # one run of everything before the last data batch when the budget allows
    merged, _ = coalesce_steps(steps, per_partition, {0: 0, 1: 0}, max_records=10_000)
    assert [s.covers for s in merged] == [(0, 1, 2, 3, 4, 5), (6,), (7,)]
    # a single recorded batch: nothing to coalesce
    one, _ = coalesce_steps(steps[:1], {0: [50], 1: [50]}, {0: 0, 1: 0})
    assert one == steps[:1] and one[0].covers == (0,)

    # the runs an earlier re-run staged come first as they were (a run of two, then batch 2, that re-run's last
    # data batch, as recorded), the rest is grouped anew; every recorded batch still exactly once
    merged, merged_ends = coalesce_steps(steps, per_partition, {0: 0, 1: 0}, max_records=250,
                                         fixed=[[0, 1], [2]])
    assert [s.covers for s in merged] == [(0, 1), (2,), (3, 4, 5), (6,), (7,)]
    assert merged[1] == steps[2] and [s.watermark_ms for s in merged] == [0, 2000, 3000, 6000, 7000]
    assert merged_ends[0] == [100, 150, 250, 300, 300]
    with pytest.raises(ValueError, match="consecutive"):
        coalesce_steps(steps, per_partition, {0: 0, 1: 0}, fixed=[[0, 2]])
    with pytest.raises(ValueError, match="before the last data batch"):
        coalesce_steps(steps, per_partition, {0: 0, 1: 0}, fixed=[[0, 1, 2, 3, 4, 5, 6]])


@pytest.mark.integration
def test_only_an_aggregation_that_declares_its_late_bound_is_coalesced(spark):
    from pyspark.sql import functions as F

    from kappa.runtime.view import load_view, tumbling_window_end

    stream = spark.readStream.format("rate").load().withColumnRenamed("timestamp", "event_ts")
    windowed = load_view("jobs.campaign_window_counts.v1")
    assert windowed.late_bound is not None
    counts = lambda: (stream.withWatermark("event_ts", "10 seconds")  # noqa: E731
                      .groupBy(F.window("event_ts", "10 seconds")).count())
    assert coalescable(windowed, counts()) is None

    sessions = stream.withWatermark("event_ts", "10 seconds").groupBy(F.session_window("event_ts", "5 seconds")).count()
    assert coalescable(windowed, sessions) == "it aggregates over session windows"
    deduped = stream.withWatermark("event_ts", "10 seconds").dropDuplicatesWithinWatermark(["value"])
    assert coalescable(windowed, deduped) == "its plan has a DeduplicateWithinWatermark operator"
    two = counts().withColumn("event_ts", F.col("window.end")).withWatermark("event_ts", "1 second") \
        .groupBy(F.window("event_ts", "1 minute")).count()
    assert coalescable(windowed, two) == "its plan has 2 streaming aggregations (one is coalesced)"
    unbounded = dataclasses.replace(windowed, late_bound=None)
    assert coalescable(unbounded, counts()).startswith("the view declares no late_bound")
    stateless = dataclasses.replace(windowed, stateful=False, late_bound=lambda: tumbling_window_end("event_ts", 10))
    assert coalescable(stateless, stream) == "a stateless view"


@pytest.mark.integration
def test_the_built_in_window_counts_are_coalesced_the_session_and_deduplicating_views_are_not(spark, tmp_path):
    from kappa.runtime.lookups import latest_values
    from kappa.runtime.parsing import decode, valid_rows
    from kappa.runtime.testing import _raw
    from kappa.runtime.view import load_view

    (tmp_path / "feed").mkdir()

    def plan(ref: str):
        view = load_view(ref)
        schema = valid_rows(decode(_raw(spark, view.stream_topic, view.stream_format, [[]]), view.stream_format)).schema
        lookups = {name: latest_values(_raw(spark, lookup.topic, lookup.format, [[]]), lookup)
                   for name, lookup in view.lookups.items()}
        return view, view.transform(spark.readStream.schema(schema).parquet(str(tmp_path / "feed")), **lookups)

    assert coalescable(*plan("jobs.campaign_window_counts.v1")) is None
    assert coalescable(*plan("jobs.campaign_window_counts.v2")) is None
    # the hourly totals deduplicate the window rows they read before they sum them: one batch at a time
    assert coalescable(*plan("jobs.campaign_hourly_totals.v1")) == "its plan has a DeduplicateWithinWatermark operator"
    assert coalescable(*plan("jobs.user_sessions.v1")) == "it aggregates over session windows"

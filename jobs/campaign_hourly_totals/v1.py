"""campaign_hourly_totals v1 - views per campaign per hour, over the final windows of campaign_window_counts v1.

A view of a view (Samza's pattern, docs/replay.md "Views of views"): campaign_window_counts v1 publishes each
10 s window once the watermark passed it to the compacted, one-partition topic ``campaign-windows.v1``
(:class:`kappa.runtime.view.Publish`); this view reads that topic like any other and sums the windows of each
hour. Its event time is the window's start.

- **Copies**: a window is published at least once (again after a crash of the upstream job, always with the same
  count). ``dropDuplicatesWithinWatermark`` on ``(campaign_id, window_start)`` keeps the first copy; a copy arriving
  after the watermark passed the window is dropped as late (kept in the quarantine, reason ``late``).
- **Order**: windows are published in event-time order, so the 60 s watermark drops nothing but copies.
- ``is_final`` once the watermark passed the hour's end: the hour's total never changes again.
- A micro-batch every 10 s (its input is a few windows a second).

``v2`` is the same logic over ``campaign_window_counts`` v2 (60 s windows, topic ``campaign-windows.v2``): a
cascading replay of the upstream (``kappa replay campaign_window_counts --version 2 --cascade``) builds both and
switches readers to the pair in one alias commit.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kappa.runtime.parsing import CAMPAIGN_WINDOWS
from kappa.runtime.view import Finality, ViewDefinition

HOUR_SECONDS = 3600
WATERMARK_SECONDS = 60
#: The upstream window a record stands for (one per campaign and window start).
WINDOW_KEY = ("campaign_id", "window_start")


def transform(windows: DataFrame) -> DataFrame:
    """Views per campaign per hour: the sum of the hour's distinct final windows (pure)."""
    return (
        windows.withWatermark("event_ts", f"{WATERMARK_SECONDS} seconds")
        .dropDuplicatesWithinWatermark(list(WINDOW_KEY))
        .groupBy(F.window("event_ts", f"{HOUR_SECONDS} seconds").alias("h"), "campaign_id")
        .agg(F.sum("view_count").alias("view_count"), F.count("*").alias("windows"),
             F.max("event_ts").alias("last_window_start"))
        .select("campaign_id", F.col("h.start").alias("hour_start"), F.col("h.end").alias("hour_end"),
                "view_count", "windows", "last_window_start")
    )


def late_bound() -> Column:
    """The deduplication drops a window whose start the previous micro-batch's watermark reached."""
    return F.col("event_ts")


def over(upstream_version: int, *, version: int) -> ViewDefinition:
    """This logic as ``version`` of the view, over the windows ``campaign_window_counts`` v``upstream_version``
    publishes (each version reads one upstream version: one start, one topic)."""
    return ViewDefinition(
        name="campaign_hourly_totals",
        version=version,
        description=f"Views per campaign per hour over campaign_window_counts v{upstream_version}'s final windows",
        stream_topic=f"campaign-windows.v{upstream_version}",
        stream_format=CAMPAIGN_WINDOWS,
        transform=transform,
        output_mode="update",
        write="merge",
        keys=("campaign_id", "hour_start"),
        finality=Finality(window_end_column="hour_end", event_max_column="last_window_start",
                          delay_seconds=WATERMARK_SECONDS),
        latency_column="last_window_start",
        stateful=True,
        late_bound=late_bound,
        trigger_seconds=10.0,  # hourly totals need no second-fresh rows: a batch every 10 s, not every 2 s
    )


VIEW = over(1, version=1)

"""campaign_window_counts v1 - the Yahoo Streaming Benchmark query.

Keep ``view`` events, join ad -> campaign (latest mapping from the compacted ``campaigns`` topic), count per
campaign per 10 s tumbling event-time window. Watermark 30 s: late events inside it update their window; a row's
``is_final`` turns true once the watermark passes the window end, after which it never changes.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kappa.runtime.lookups import CAMPAIGN_OF_AD
from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import Finality, Publish, ViewDefinition, tumbling_window_end

WINDOW_SECONDS = 10
WINDOW = f"{WINDOW_SECONDS} seconds"
WATERMARK_SECONDS = 30


def transform(events: DataFrame, campaigns: DataFrame) -> DataFrame:
    """View events per campaign per 10 s window (pure: DataFrames in, DataFrame out)."""
    views = events.where(F.col("event_type") == "view").join(campaigns, "ad_id")
    return (
        views.withWatermark("event_ts", f"{WATERMARK_SECONDS} seconds")
        .groupBy(F.window("event_ts", WINDOW).alias("w"), "campaign_id")
        .agg(F.count("*").alias("view_count"), F.max("event_ts").alias("last_event_time"))
        .select(
            "campaign_id",
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "view_count",
            "last_event_time",
        )
    )


def late_bound() -> Column:
    """When the watermark drops a ``view`` event: once it passed the end of the event's window."""
    return F.when(F.col("event_type") == "view", tumbling_window_end("event_ts", WINDOW_SECONDS))


VIEW = ViewDefinition(
    name="campaign_window_counts",
    version=1,
    description="View events per campaign per 10 s event-time window (YSB), watermark 30 s",
    stream_topic="ad-events",
    stream_format=AD_EVENTS,
    transform=transform,
    lookups={"campaigns": CAMPAIGN_OF_AD},
    output_mode="update",
    write="merge",
    keys=("campaign_id", "window_start"),
    finality=Finality(window_end_column="window_end", event_max_column="last_event_time",
                      delay_seconds=WATERMARK_SECONDS),
    latency_column="last_event_time",
    stateful=True,
    late_bound=late_bound,
    # views over this one (campaign_hourly_totals v1) read its final windows (kappa.runtime.publish)
    publish=Publish(topic="campaign-windows.v1", key=("campaign_id", "window_start"), where="is_final",
                    order_by=("window_end",)),
)

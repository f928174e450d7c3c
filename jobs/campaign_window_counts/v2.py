"""campaign_window_counts v2 - views AND clicks per campaign per 60 s tumbling event-time window.

The business-logic change over v1 (10 s windows, views only): windows are one minute long and each row counts
``view`` and ``click`` events separately. Same inputs (ad events joined to the latest ad -> campaign mapping of
the compacted ``campaigns`` topic), same watermark (30 s: late events inside it update their window) and the
same finality rule (``is_final`` turns true once the watermark passes ``window_end``; a final row never changes).

It gets its own table, checkpoint and Delta appId (``views/campaign_window_counts/v2/``), is built by replaying
the retained log (``kappa replay campaign_window_counts --version 2``) and only serves once verified against
``jobs.campaign_window_counts.oracle.expected_window_counts_v2``.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kappa.runtime.lookups import CAMPAIGN_OF_AD
from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import Finality, Publish, ViewDefinition, tumbling_window_end

WINDOW_SECONDS = 60
WINDOW = f"{WINDOW_SECONDS} seconds"
WATERMARK_SECONDS = 30
COUNTED = ("view", "click")


def transform(events: DataFrame, campaigns: DataFrame) -> DataFrame:
    """View and click events per campaign per 60 s window (pure: DataFrames in, DataFrame out)."""
    counted = events.where(F.col("event_type").isin(*COUNTED)).join(campaigns, "ad_id")
    return (
        counted.withWatermark("event_ts", f"{WATERMARK_SECONDS} seconds")
        .groupBy(F.window("event_ts", WINDOW).alias("w"), "campaign_id")
        .agg(
            F.count(F.when(F.col("event_type") == "view", True)).alias("view_count"),
            F.count(F.when(F.col("event_type") == "click", True)).alias("click_count"),
            F.max("event_ts").alias("last_event_time"),
        )
        .select(
            "campaign_id",
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "view_count",
            "click_count",
            "last_event_time",
        )
    )


def late_bound() -> Column:
    """When the watermark drops a counted event: once it passed the end of the event's window."""
    return F.when(F.col("event_type").isin(*COUNTED), tumbling_window_end("event_ts", WINDOW_SECONDS))


VIEW = ViewDefinition(
    name="campaign_window_counts",
    version=2,
    description="View and click events per campaign per 60 s event-time window, watermark 30 s",
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
    # views over this one (campaign_hourly_totals v2) read its final windows (kappa.runtime.publish)
    publish=Publish(topic="campaign-windows.v2", key=("campaign_id", "window_start"), where="is_final",
                    order_by=("window_end",)),
)

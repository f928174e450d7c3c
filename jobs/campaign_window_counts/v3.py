"""campaign_window_counts v3 - views and clicks per campaign per 60 s event-time window sliding every 10 s,
counting each event once even when its producer sent it twice.

The business-logic change over v2 (60 s tumbling windows):

- **Hopping windows**: a window starts every 10 s and lasts 60 s, so each event counts in the six windows that
  cover it and the table holds a minute-long moving count refreshed every 10 s (``window(event_ts, "60 seconds",
  "10 seconds")``). The key stays ``(campaign_id, window_start)``: one row per window.
- **Record-id dedupe within the watermark**: producers that retry without idempotence write the same event twice
  (schema ``ad_event`` v2 gives each event an ``event_id``). ``dropDuplicatesWithinWatermark`` keeps the first
  record of an ``event_id`` and drops copies that arrive while the id is remembered - until the watermark passes
  the first copy's event time plus the 30 s delay; a copy arriving later than that is behind the watermark and
  dropped as late anyway. A record without an ``event_id`` (a v1 producer) is keyed by its own log position, so
  it is never merged with another record.

Late records: the deduplication drops a record whose event time the previous micro-batch's watermark reached
(``event_ts <= watermark``); every window of a record that passes ends after the watermark, so the windows never
drop one on their own. ``late_bound`` is therefore the record's event time, and those records go to the
quarantine with reason ``late``.

Same inputs (ad events joined to the latest ad -> campaign mapping), same watermark (30 s) and finality rule as
v2. Replayed into its own table (``kappa replay campaign_window_counts --version 3``) and verified against
``jobs.campaign_window_counts.oracle.expected_window_counts_v3`` before it may serve.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kappa.runtime.lookups import CAMPAIGN_OF_AD
from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import Finality, ViewDefinition

WINDOW_SECONDS = 60
SLIDE_SECONDS = 10
WATERMARK_SECONDS = 30
COUNTED = ("view", "click")
#: The deduplication key: the producer's event id, else the record's own log position (never a duplicate).
DEDUPE_KEY = "_dedupe_key"


def dedupe_key() -> Column:
    """``event_id`` when the record has one, else ``topic:partition:offset`` (a UUID never looks like that)."""
    return F.coalesce(F.col("event_id"), F.concat_ws(":", "topic", "partition", "offset"))


def transform(events: DataFrame, campaigns: DataFrame) -> DataFrame:
    """Distinct view and click events per campaign per 60 s window sliding by 10 s (pure)."""
    counted = (events.where(F.col("event_type").isin(*COUNTED)).join(campaigns, "ad_id")
               .withColumn(DEDUPE_KEY, dedupe_key()))
    return (
        counted.withWatermark("event_ts", f"{WATERMARK_SECONDS} seconds")
        .dropDuplicatesWithinWatermark([DEDUPE_KEY])
        .groupBy(F.window("event_ts", f"{WINDOW_SECONDS} seconds", f"{SLIDE_SECONDS} seconds").alias("w"),
                 "campaign_id")
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
    """When the watermark drops a counted record: once it reached the record's event time (the deduplication
    filters ``event_ts <= watermark``; every window of a later record ends after the watermark)."""
    return F.when(F.col("event_type").isin(*COUNTED), F.col("event_ts"))


VIEW = ViewDefinition(
    name="campaign_window_counts",
    version=3,
    description="Distinct view and click events per campaign per 60 s window sliding every 10 s, "
                "deduplicated by event_id within the 30 s watermark",
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
)

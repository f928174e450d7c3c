"""user_sessions v1 - per-user session windows with a 30 s gap.

A session closes 30 s after its last event; it is written once, when the watermark (30 s) has passed its end,
with start, end, number of events and number of distinct ads. Events that arrive after the watermark passed
their own session window are kept in the quarantine with reason ``late``.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import ViewDefinition

GAP = "30 seconds"
WATERMARK_SECONDS = 30


def transform(events: DataFrame) -> DataFrame:
    """Closed sessions per user (pure)."""
    return (
        events.withWatermark("event_ts", f"{WATERMARK_SECONDS} seconds")
        .groupBy(F.session_window("event_ts", GAP).alias("s"), "user_id")
        .agg(
            F.count("*").alias("event_count"),
            F.size(F.collect_set("ad_id")).alias("distinct_ads"),
            F.max("event_ts").alias("last_event_time"),
        )
        .select(
            "user_id",
            F.col("s.start").alias("session_start"),
            F.col("s.end").alias("session_end"),
            "event_count",
            "distinct_ads",
            "last_event_time",
        )
    )


def late_bound() -> Column:
    """When the watermark drops an event: once it passed the end of the event's own session window
    ``[event_ts, event_ts + gap)`` - Spark filters late input row by row, before merging sessions."""
    return F.col("event_ts") + F.expr(f"INTERVAL {GAP}")


VIEW = ViewDefinition(
    name="user_sessions",
    version=1,
    description="Closed per-user sessions (30 s gap): start, end, events, distinct ads",
    stream_topic="ad-events",
    stream_format=AD_EVENTS,
    transform=transform,
    output_mode="append",
    write="append",
    keys=("user_id", "session_start"),
    latency_column="last_event_time",
    stateful=True,
    late_bound=late_bound,
)

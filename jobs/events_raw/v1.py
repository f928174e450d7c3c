"""events_raw v1 - append-only table of every valid ad event with its Kafka coordinates, for analysts.

(The replay source for history the log no longer holds is ``ad_events_archive``: every record, valid or not.)
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import ViewDefinition

COLUMNS = ("user_id", "page_id", "ad_id", "ad_type", "event_type", "event_time", "ip", "event_ts",
           "topic", "partition", "offset", "kafka_timestamp")


def transform(events: DataFrame) -> DataFrame:
    """Every valid event, unchanged, with topic/partition/offset (pure)."""
    return events.select(*COLUMNS)


VIEW = ViewDefinition(
    name="events_raw",
    version=1,
    description="Append-only archive of valid ad events with topic/partition/offset",
    stream_topic="ad-events",
    stream_format=AD_EVENTS,
    transform=transform,
    write="append",
    latency_column="event_ts",
)

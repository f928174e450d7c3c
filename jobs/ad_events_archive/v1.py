"""ad_events_archive v1 - every record of ad-events, valid or not, as the log holds it.

Raw key and value bytes, partition, offset and Kafka timestamp, the decoded columns and ``error`` (why a record
is invalid; NULL when valid). Partitioned by Kafka partition. A replay whose start the log no longer retains reads
this history from here, then the rest from the log (:mod:`kappa.runtime.archive`); its decoded columns spare
that replay the JSON decoding.
"""

from __future__ import annotations

from pyspark.sql import DataFrame

from kappa.runtime.parsing import AD_EVENTS
from kappa.runtime.view import ViewDefinition


def transform(records: DataFrame) -> DataFrame:
    """Every record, unchanged (pure)."""
    return records


VIEW = ViewDefinition(
    name="ad_events_archive",
    version=1,
    description="Every ad-events record (valid or not): raw bytes, Kafka coordinates, decoded columns",
    stream_topic="ad-events",
    stream_format=AD_EVENTS,
    transform=transform,
    write="append",
    partition_by=("partition",),
    latency_column="kafka_timestamp",
    keep_invalid=True,
)

"""campaign_catalog v1 - the latest ad -> campaign mapping as a table (KTable semantics).

Each record of the compacted ``campaigns`` topic upserts its key; a tombstone (null value) deletes the row.
Within a micro-batch the record with the highest offset of a key wins.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from kappa.runtime.parsing import CAMPAIGNS
from kappa.runtime.view import ViewDefinition


def transform(records: DataFrame) -> DataFrame:
    """Project the mapping records (pure); the sink applies upsert/delete by ``ad_id``."""
    return records.select(
        "ad_id",
        "campaign_id",
        "is_tombstone",
        F.col("partition").alias("source_partition"),
        F.col("offset").alias("source_offset"),
        F.col("kafka_timestamp").alias("updated_at"),
    )


VIEW = ViewDefinition(
    name="campaign_catalog",
    version=1,
    description="Latest ad -> campaign mapping; tombstones delete",
    stream_topic="campaigns",
    stream_format=CAMPAIGNS,
    transform=transform,
    write="upsert_delete",
    keys=("ad_id",),
    order_column="source_offset",
    latency_column="updated_at",
)

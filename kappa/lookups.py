"""Lookups: small, compacted topics a view joins against (e.g. ad -> campaign), cached between micro-batches.

A lookup is the latest valid value per key of a compacted topic (tombstones remove the key). It is read once,
kept in memory (``persist``) and broadcast to the join; before each micro-batch the cache asks Kafka for the
topic's end offsets and re-reads the topic only when they moved. Spark's cache manager substitutes the cached
data wherever the lookup's plan appears - in the streaming plan of a stateful view too - so an unchanged lookup
costs one offsets request per micro-batch instead of a Kafka read and a decode.

The offsets a lookup was read at are reported with every batch (:mod:`kappa.lineage`), so an audit can say
which mapping a batch joined against.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kappa.parsing import CAMPAIGNS, RecordFormat, decode, valid_rows

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

    from pyspark.sql import DataFrame, SparkSession

    from kappa.config import Settings

__all__ = ["Lookup", "LOOKUPS", "LookupCache", "lookup_frame"]

log = logging.getLogger("kappa.lookups")


@dataclass(frozen=True)
class Lookup:
    """A static input read from a compacted topic: latest valid value per key (the first column)."""

    topic: str
    format: RecordFormat
    columns: tuple[str, ...]


#: Lookups a view may declare by name.
LOOKUPS: dict[str, Lookup] = {
    "campaigns": Lookup(topic="campaigns", format=CAMPAIGNS, columns=("ad_id", "campaign_id")),
}


class LookupCache:
    """The cached, broadcast DataFrame of each lookup, refreshed only when its topic's end offsets move.

    One cache serves every view of a Spark application (views of one host share the campaigns mapping).
    """

    def __init__(self, spark: "SparkSession", settings: "Settings") -> None:
        self.spark = spark
        self.settings = settings
        self._frames: dict[str, "DataFrame"] = {}  # what views join: the cached data with a broadcast hint
        self._cached: dict[str, "DataFrame"] = {}  # the cached data itself
        self._offsets: dict[str, dict[int, int]] = {}
        self._lock = threading.Lock()

    def frame(self, name: str) -> "DataFrame":
        """The lookup's DataFrame (cached, broadcast); the same object on every call."""
        with self._lock:
            if name not in self._frames:
                from pyspark.sql import functions as F

                self._cached[name] = self._build(LOOKUPS[name])
                self._frames[name] = F.broadcast(self._cached[name])
                self._materialize(name)
            return self._frames[name]

    def frames(self, names: "tuple[str, ...] | list[str]") -> dict[str, "DataFrame"]:
        return {name: self.frame(name) for name in names}

    def offsets(self, name: str) -> dict[int, int]:
        """End offsets of the lookup topic when it was last read."""
        return dict(self._offsets.get(name, {}))

    def refresh(self, names: "tuple[str, ...] | list[str]") -> list[str]:
        """Re-read those of ``names`` whose topic moved since they were read; returns the names refreshed."""
        refreshed = []
        for name in names:
            with self._lock:
                if name not in self._frames:
                    continue
                ends = self._end_offsets(name)
                if ends == self._offsets.get(name):
                    continue
                self._cached[name].unpersist()
                self._materialize(name, ends)
                refreshed.append(name)
        return refreshed

    def close(self) -> None:
        with self._lock:
            for frame in self._cached.values():
                try:
                    frame.unpersist()
                except Exception:  # noqa: BLE001 - the JVM may be gone already
                    pass
            self._frames.clear()
            self._cached.clear()

    # ---------------------------------------------------------------------------------------------------
    def _end_offsets(self, name: str) -> dict[int, int]:
        from kappa.topics import partition_offsets

        return {p: high for p, (_low, high) in partition_offsets(
            self.settings, self.settings.topic(LOOKUPS[name].topic)).items()}

    def _materialize(self, name: str, ends: dict[int, int] | None = None) -> None:
        ends = self._end_offsets(name) if ends is None else ends
        frame = self._cached[name]
        frame.persist()
        rows = frame.count()  # read now, so the next micro-batch finds it in memory
        self._offsets[name] = ends
        log.info("lookup %s: %d keys at offsets %s", name, rows, ends)

    def _build(self, lookup: Lookup) -> "DataFrame":
        return lookup_frame(self.spark, self.settings, lookup)


def lookup_frame(spark: "SparkSession", settings: "Settings", lookup: "Lookup | str",
                 ends: "Mapping[int, int] | None" = None) -> "DataFrame":
    """A lookup's latest valid value per key, as of the topic's end offsets ``ends`` (default: the log end now).

    With ``ends`` it is the mapping a micro-batch joined against, as its lineage recorded it (:mod:`kappa.lineage`):
    the verification by recompute (:mod:`kappa.replay.recompute`) joins exactly that.
    """
    import json

    from pyspark.sql import Window
    from pyspark.sql import functions as F

    lookup = LOOKUPS[lookup] if isinstance(lookup, str) else lookup
    topic = settings.topic(lookup.topic)
    ending = json.dumps({topic: {str(p): int(o) for p, o in ends.items()}}) if ends else "latest"
    reader = spark.read.format("kafka").options(**settings.spark_kafka_options())
    if ends:
        reader = reader.option("assign", json.dumps({topic: sorted(int(p) for p in ends)}))
    else:
        reader = reader.option("subscribe", topic)
    raw = (reader.option("startingOffsets", "earliest").option("endingOffsets", ending)
           .option("failOnDataLoss", "false").load())
    decoded = valid_rows(decode(raw, lookup.format))
    key = lookup.columns[0]
    latest = (decoded.withColumn("_rn", F.row_number().over(
        Window.partitionBy(key).orderBy(F.col("partition").desc(), F.col("offset").desc())))
        .where("_rn = 1"))
    return latest.where(~F.col("is_tombstone")).select(*lookup.columns).coalesce(1)

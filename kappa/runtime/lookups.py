"""Lookups: small, compacted topics a view joins against (e.g. ad -> campaign), cached between micro-batches.

A view declares the lookups its transform joins (``ViewDefinition.lookups``: the name the transform receives it
under -> a :class:`Lookup`: topic, record format, columns). A lookup is the latest valid value per key of a
compacted topic (tombstones remove the key). It is read once,
kept in memory (``persist``) and broadcast to the join; before each micro-batch the cache asks Kafka for the
topic's end offsets and re-reads the topic only when they moved. Spark's cache manager substitutes the cached
data wherever the lookup's plan appears - in the streaming plan of a stateful view too - so an unchanged lookup
costs one offsets request per micro-batch instead of a Kafka read and a decode.

The offsets a lookup was read at are reported with every batch (:mod:`kappa.runtime.lineage`), so an audit can say
which mapping a batch joined against.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from kappa.runtime.parsing import CAMPAIGNS, RecordFormat, decode, valid_rows

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

    from pyspark.sql import DataFrame, SparkSession

    from kappa.config import Settings

__all__ = ["CAMPAIGN_OF_AD", "Lookup", "LookupCache", "latest_values", "lookup_frame"]

log = logging.getLogger("kappa.runtime.lookups")


@dataclass(frozen=True)
class Lookup:
    """A static input read from a compacted topic: latest valid value per key (the first column).

    Attributes:
        topic: The compacted topic (platform name, without the deployment's prefix).
        format: How its records are decoded and validated.
        columns: The columns the transform receives, the key first.
    """

    topic: str
    format: RecordFormat
    columns: tuple[str, ...]


#: The campaign of each ad (``campaigns`` topic), joined by the campaign views.
CAMPAIGN_OF_AD = Lookup(topic="campaigns", format=CAMPAIGNS, columns=("ad_id", "campaign_id"))


class LookupCache:
    """The cached, broadcast DataFrame of each lookup, refreshed only when its topic's end offsets move.

    One cache serves every view of a Spark application: views declaring the same lookup share its data.
    """

    def __init__(self, spark: "SparkSession", settings: "Settings") -> None:
        self.spark = spark
        self.settings = settings
        self._frames: dict[Lookup, "DataFrame"] = {}  # what views join: the cached data with a broadcast hint
        self._cached: dict[Lookup, "DataFrame"] = {}  # the cached data itself
        self._offsets: dict[Lookup, dict[int, int]] = {}
        self._unread: set[Lookup] = set()  # frames handed out before their data was read (see frame())
        self._lock = threading.Lock()

    def frame(self, lookup: Lookup, *, read: bool = True) -> "DataFrame":
        """The lookup's DataFrame (cached, broadcast); the same object on every call.

        ``read=False``: its data is read later, by :meth:`read` (a driver plans its query meanwhile: the plan needs
        the DataFrame, not its rows); a lineage names the offsets read, so :meth:`read` must be done before a batch.
        """
        with self._lock:
            if lookup not in self._frames:
                from pyspark.sql import functions as F

                self._cached[lookup] = lookup_frame(self.spark, self.settings, lookup)
                self._frames[lookup] = F.broadcast(self._cached[lookup])
                self._unread.add(lookup)
            if read and lookup in self._unread:
                self._materialize(lookup)
                self._unread.discard(lookup)
            return self._frames[lookup]

    def frames(self, declared: "Mapping[str, Lookup]", *, read: bool = True) -> dict[str, "DataFrame"]:
        """A view's declared lookups as the keyword arguments of its transform (name -> DataFrame)."""
        return {name: self.frame(lookup, read=read) for name, lookup in declared.items()}

    def read(self, lookups: "Iterable[Lookup]") -> None:
        """Read the data of those of ``lookups`` handed out unread (``frame(read=False)``)."""
        for lookup in lookups:
            self.frame(lookup)

    def offsets(self, lookup: Lookup) -> dict[int, int]:
        """End offsets of the lookup topic when it was last read."""
        return dict(self._offsets.get(lookup, {}))

    def refresh(self, lookups: Iterable[Lookup]) -> list[str]:
        """Re-read those of ``lookups`` whose topic moved since they were read; returns the topics refreshed."""
        refreshed = []
        for lookup in lookups:
            with self._lock:
                if lookup not in self._frames or lookup in self._unread:
                    continue
                ends = self._end_offsets(lookup)
                if ends == self._offsets.get(lookup):
                    continue
                self._cached[lookup].unpersist()
                self._materialize(lookup, ends)
                refreshed.append(lookup.topic)
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
            self._unread.clear()

    # ---------------------------------------------------------------------------------------------------
    def _end_offsets(self, lookup: Lookup) -> dict[int, int]:
        from kappa.log.topics import partition_offsets

        return {p: high for p, (_low, high) in partition_offsets(
            self.settings, self.settings.topic(lookup.topic)).items()}

    def _materialize(self, lookup: Lookup, ends: dict[int, int] | None = None) -> None:
        ends = self._end_offsets(lookup) if ends is None else ends
        frame = self._cached[lookup]
        frame.persist()
        rows = frame.count()  # read now, so the next micro-batch finds it in memory
        self._offsets[lookup] = ends
        log.info("lookup %s: %d keys at offsets %s", lookup.topic, rows, ends)


def lookup_frame(spark: "SparkSession", settings: "Settings", lookup: Lookup,
                 ends: "Mapping[int, int] | None" = None) -> "DataFrame":
    """A lookup's latest valid value per key, as of the topic's end offsets ``ends`` (default: the log end now).

    With ``ends`` it is the mapping a micro-batch joined against, as its lineage recorded it (:mod:`kappa.runtime.lineage`):
    the verification by recompute (:mod:`kappa.verify.recompute`) joins exactly that.
    """
    import json

    topic = settings.topic(lookup.topic)
    ending = json.dumps({topic: {str(p): int(o) for p, o in ends.items()}}) if ends else "latest"
    reader = spark.read.format("kafka").options(**settings.spark_kafka_options())
    if ends:
        reader = reader.option("assign", json.dumps({topic: sorted(int(p) for p in ends)}))
    else:
        reader = reader.option("subscribe", topic)
    raw = (reader.option("startingOffsets", "earliest").option("endingOffsets", ending)
           .option("failOnDataLoss", "false").load())
    return latest_values(raw, lookup)


def latest_values(raw: "DataFrame", lookup: Lookup) -> "DataFrame":
    """What a lookup is, given its topic's raw records (Kafka's columns: key, value, partition, offset...): the
    latest valid record per key in log order, tombstoned keys removed, the declared columns only."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    decoded = valid_rows(decode(raw, lookup.format))
    key = lookup.columns[0]
    latest = (decoded.withColumn("_rn", F.row_number().over(
        Window.partitionBy(key).orderBy(F.col("partition").desc(), F.col("offset").desc())))
        .where("_rn = 1"))
    if lookup.format.tombstones:
        latest = latest.where(~F.col("is_tombstone"))
    return latest.select(*lookup.columns).coalesce(1)

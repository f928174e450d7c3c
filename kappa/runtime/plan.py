"""A view version's streaming plan: one query that reads and decodes its topic once per micro-batch.

Stateless views hand the decoded micro-batch to ``foreachBatch``; the transform runs there, bad records are
split off the same batch.

A stateful view's transform (watermarked windows, sessions) must run inside the streaming plan, where Spark
keeps its state; its output no longer contains the records that failed validation. So the plan is the union of
two branches, tagged by a ``_kind`` column, that ``foreachBatch`` splits again:

.. code-block:: text

    Kafka -> decode/validate -> Exchange ─┬─ valid -> transform (stateful) ─┐
                                          └─ invalid (raw bytes, reason) ───┴─ union -> foreachBatch

Both branches start from *one* shuffle exchange of the decoded rows; Spark reuses an identical exchange instead
of computing it twice (``ReusedExchange``), so the topic is read and decoded once. For the two subtrees to be
identical the optimizer must not prune them differently: a projection above the exchange references every
column through a non-deterministic expression (``_side_barrier``), and both filters reference it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kappa.runtime.parsing import BARRIER, INTERNAL_COLUMNS, KAFKA_META_COLUMNS, barrier
from kappa.runtime.spark import per_jvm

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame

__all__ = ["KIND", "OUT", "SIDE", "side_schema", "stateful_plan", "split_batch", "SIDE_COLUMNS"]

#: Column telling the rows of the two branches apart.
KIND = "_kind"
OUT, SIDE = "out", "side"
#: What a side row (a record to quarantine) carries, as in the quarantine table.
SIDE_COLUMNS = ("topic", "partition", "offset", "kafka_timestamp", "raw_key", "raw_value", "error")
_SIDE_BARRIER = "_side_barrier"


def side_schema() -> str:
    return ("struct<topic:string,partition:int,offset:bigint,kafka_timestamp:timestamp,raw_key:binary,"
            "raw_value:binary,error:string>")


def _shared(decoded: "DataFrame", partitions: int) -> "DataFrame":
    """The decoded rows after one exchange, with a barrier column that keeps every column alive below it."""
    from pyspark.sql import functions as F

    # valid rows need no raw bytes downstream: do not shuffle them
    slim = decoded.withColumn("raw_value", F.when(F.col("_error").isNotNull(), F.col("raw_value"))) \
                  .withColumn("raw_key", F.when(F.col("_error").isNotNull(), F.col("raw_key")))
    columns = [F.col(c) for c in slim.columns if c != BARRIER]
    # hashed by record coordinates: deterministic on a re-run, no sort (a round-robin repartition sorts first)
    exchanged = slim.repartition(partitions, "partition", "offset")
    # barrier() >= 0 always; the hash only references every column, so both branches keep the same columns
    side_barrier = barrier() + F.lit(0.0) * F.xxhash64(*columns).cast("double")
    return exchanged.withColumn(_SIDE_BARRIER, side_barrier)


def stateful_plan(decoded: "DataFrame", transform_valid, *, partitions: int) -> "DataFrame":
    """The single streaming plan of a stateful view: transform output rows and side rows, tagged by ``_kind``.

    Args:
        decoded: :func:`kappa.runtime.parsing.decode` output of the view's stream.
        transform_valid: ``valid rows -> output`` (the view's transform with its lookups bound).
        partitions: shuffle partitions of the shared exchange.

    Output columns: ``_kind``, ``out`` (struct of the transform's output, null on side rows) and ``side``
    (struct of :data:`SIDE_COLUMNS`, null on output rows).
    """
    from pyspark.sql import functions as F

    shared = _shared(decoded, partitions)
    keep = F.col(_SIDE_BARRIER) >= F.lit(0.0)
    valid = shared.where(F.col("_error").isNull() & keep).drop(*INTERNAL_COLUMNS, _SIDE_BARRIER)
    invalid = shared.where(F.col("_error").isNotNull() & keep)
    output = transform_valid(valid)
    out_type = output.schema.simpleString()
    outs = output.select(F.lit(OUT).alias(KIND), F.struct(*[F.col(f"`{c}`") for c in output.columns]).alias("out"),
                         F.lit(None).cast(side_schema()).alias("side"))
    sides = invalid.select(F.lit(SIDE).alias(KIND), F.lit(None).cast(out_type).alias("out"),
                           F.struct(*KAFKA_META_COLUMNS, "raw_key", "raw_value",
                                    F.col("_error").alias("error")).alias("side"))
    return outs.unionByName(sides)


def split_batch(batch: "DataFrame", output_columns: "Sequence[str]") -> "tuple[DataFrame, DataFrame]":
    """(transform output, side rows) of one micro-batch of :func:`stateful_plan` (persist ``batch`` first)."""
    is_out, out_columns, is_side = _split_columns(tuple(output_columns))
    return batch.where(is_out).select(*out_columns), batch.where(is_side).select("side.*")


@per_jvm
def _split_columns(output_columns: tuple[str, ...]) -> "tuple[Column, list[Column], Column]":
    from pyspark.sql import functions as F

    return F.col(KIND) == OUT, [F.col(f"out.`{c}`").alias(c) for c in output_columns], F.col(KIND) == SIDE

"""Late rows: what a stateful view's watermark dropped from a micro-batch, found again and kept.

Spark drops a row from a watermarked aggregation when the watermark of the *previous* micro-batch had already
passed its window (``end <= watermark``; for session windows the row's own window ``[t, t + gap)``, before any
merging), and only counts it (``numRowsDroppedByWatermark``, of partially
aggregated rows). A view that declares ``late_bound`` (:class:`kappa.runtime.view.ViewDefinition`) keeps those records:

.. code-block:: text

    micro-batch N computed ──> dropped-by-watermark count of N's executed plan (SQL metrics, no extra job)
        │ 0 (almost every batch): nothing more to do, no cost
        └ > 0: re-read N's offset range of the topic (offset log N-1 .. N), decode, keep the valid rows whose
               late bound <= batchWatermarkMs of offset log N-1, and append them to the quarantine in the same
               idempotent commit as N's bad records (reason ``late: ...``, raw bytes, topic/partition/offset)

The re-read is exact (the same records, the same watermark as Spark's filter, both from the checkpoint), and a
batch re-run after a crash finds the same rows and the same commit (appId ``/quarantine``, txnVersion N), so each
late record is kept exactly once. Its cost is paid only by batches that dropped something.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kappa.errors import one_line
from kappa.runtime.plan import SIDE_COLUMNS

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = ["LATE_REASON", "dropped_by_watermark", "late_records"]

log = logging.getLogger("kappa.runtime.late")

#: Quarantine reason of a valid record the watermark had passed (followed by that watermark).
LATE_REASON = "late: the watermark had passed its event time"
_METRIC = "numRowsDroppedByWatermark"


def dropped_by_watermark(spark: "SparkSession", query_name: str) -> int | None:
    """Rows the stateful operators of ``query_name``'s running micro-batch dropped as late, read from the SQL
    metrics of the batch's executed plan (call it from ``foreachBatch`` once the batch was computed).

    None when it cannot be told (no such active query, an internal API that moved): callers then look for late
    rows anyway, which is slower but never loses one.
    """
    try:
        summed = _plan_sum(spark, query_name)
        if summed is None:
            summed = _plan_walk(spark, query_name)
        return None if summed < 0 else summed
    except Exception as exc:  # noqa: BLE001 - not knowing only costs a re-read
        log.warning("%s: cannot read the late-row count of the running batch (%s); looking for late rows anyway",
                    query_name, one_line(exc))
        return None


def _plan_walk(spark: "SparkSession", query_name: str) -> int:
    """:func:`_plan_sum` without the JVM helper: the plan walked from Python, several JVM calls for each node."""
    active = [q for q in spark._jsparkSession.streams().active() if q.name() == query_name]
    if not active:
        return -1
    plan = active[0].streamingQuery().lastExecution().executedPlan()
    total, stack = 0, [plan]
    while stack:
        node = stack.pop()
        metrics = node.metrics()
        if metrics.contains(_METRIC):
            total += int(metrics.apply(_METRIC).value())
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))
    return total


#: The JVM helper that sums a metric over a running query's plan in one call (kappa/runtime/java, in the jar
#: ``make setup`` builds and local drivers put on their class path); False once it was found missing.
_HELPER = "kappa.spark.PlanMetrics"
_helper_missing = False


def _plan_sum(spark: "SparkSession", query_name: str) -> int | None:
    """:data:`_METRIC` summed by :data:`_HELPER` (-1: no such active query, or no micro-batch yet); None without
    the helper - the plan is then walked from Python, node by node (several calls into the JVM for each)."""
    global _helper_missing
    if _helper_missing:
        return None
    from py4j.java_gateway import JavaClass

    from kappa.runtime.spark import jvm_class

    helper = jvm_class(spark.sparkContext._jvm, _HELPER)
    if not isinstance(helper, JavaClass):  # a JavaPackage: the class is not on the driver's class path
        _helper_missing = True
        return None
    return int(helper.activeQuerySum(spark._jsparkSession, query_name, _METRIC))


def late_records(decoded: "DataFrame", bound: "Column", watermark_ms: int) -> "DataFrame":
    """The valid records of ``decoded`` (:func:`kappa.runtime.parsing.decode` output) whose ``bound`` the watermark
    ``watermark_ms`` had passed, with the columns of the quarantine (:data:`kappa.runtime.plan.SIDE_COLUMNS`)."""
    from pyspark.sql import functions as F

    watermark = F.timestamp_millis(F.lit(int(watermark_ms)))
    reason = F.concat(F.lit(LATE_REASON + " ("), watermark.cast("string"), F.lit(")"))
    # the bound first: the validation checks then run only for the few rows it lets through (~20 % faster)
    return (decoded.where(F.coalesce(bound <= watermark, F.lit(False)) & F.col("_error").isNull())
            .withColumn("error", reason).select(*SIDE_COLUMNS))

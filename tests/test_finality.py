"""Window finality of the Delta sink against the rows Spark can still emit (kappa.runtime.sink, **Finality**).

Spark filters micro-batch ``k``'s late rows with the watermark batch ``k - 1`` ran with and evicts state one batch
later, so right after a batch that moved the event-time maximum far ahead, the next batch may still update a
window that maximum already passed. That is what a driver killed during its first batch met at its restart
(the restart compacted batch 0 alone, then batch 1 updated a window the compaction had stored as final). Here
the batches' outputs are written as Spark emitted them in that case, with the batches Spark runs again after a
crash or a failure - the batch ids, rows and order are the fault's, the rows are hand-written because a real
query emits them only under that timing - through the real sink into a real Delta table, and every expectation
is derived from the rows written, not from the sink.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from jobs.campaign_window_counts.v1 import VIEW, WATERMARK_SECONDS
from kappa.runtime.batch import batch_stats
from kappa.runtime.sink import DeltaSink, ensure_table, table_columns

pytestmark = pytest.mark.integration

SCHEMA = ("campaign_id STRING, window_start TIMESTAMP, window_end TIMESTAMP, view_count BIGINT, "
          "last_event_time TIMESTAMP")
T0 = datetime(2026, 1, 1, 12, 0, 0)


def _window(campaign: str, start_s: int, count: int, last_s: float) -> tuple:
    return (campaign, T0 + timedelta(seconds=start_s), T0 + timedelta(seconds=start_s + 10), count,
            T0 + timedelta(seconds=last_s))


def _write(spark, sink: DeltaSink, batch_id: int, rows: list[tuple], *, catching_up: bool = False) -> str:
    out = spark.createDataFrame(rows, SCHEMA)
    side = spark.createDataFrame([], "x INT")
    stats = batch_stats(out, side, latency_column=None, event_max_column="last_event_time",
                        window_end_column="window_end")
    return sink.write(out, batch_id, rows=stats.rows, batch_event_max=stats.event_max,
                      window_ends=stats.window_ends, catching_up=catching_up)


def _table(spark, path: str) -> list[tuple]:
    return sorted((r.campaign_id, (r.window_start - T0).total_seconds(), r.view_count, r.is_final)
                  for r in spark.read.format("delta").load(path).collect())


def _expected(batches: list[list[tuple]]) -> list[tuple]:
    """The table after ``batches`` in plain Python: the last row per key; final when its window ends at or before
    the maximum event time of every batch but the last, minus the watermark delay."""
    latest: dict[tuple, tuple] = {}
    for rows in batches:
        for row in rows:
            latest[(row[0], row[1])] = row
    before = [row[4] for rows in batches[:-1] for row in rows]
    bound = max(before) - timedelta(seconds=WATERMARK_SECONDS) if before else None
    return sorted((c, (start - T0).total_seconds(), n, bound is not None and end <= bound)
                  for (c, start), (_c, _s, end, n, _last) in latest.items())


# batch 0 reaches far ahead (its maximum passes the first window by 95 s); batch 1 - filtered by the watermark
# batch 0 ran with, none yet - still counts a late view of that window; batch 2 has no row, and the maximum of
# batch 1 closes the window that ends at 110 s; batch 3 has no row and closes nothing
BATCHES = [
    [_window("c1", 0, 1, 5), _window("c2", 100, 1, 105)],
    [_window("c1", 0, 2, 6), _window("c1", 140, 1, 145)],
    [],
    [],
]


@pytest.mark.parametrize("path", ["merge", "compact"])
def test_a_window_updated_after_the_watermark_jumped_is_stored_once(spark, tmp_path, path):
    table = str(tmp_path / "table")
    ensure_table(spark, table, table_columns(VIEW, spark.createDataFrame([], SCHEMA).schema))
    app = "kappa-test-finality"
    sink = DeltaSink(VIEW, table, app, staging=str(tmp_path / "staging") if path == "compact" else None)
    done = []
    for batch_id, rows in enumerate(BATCHES):
        if path == "compact" and batch_id == 0:
            # a catch-up batch is staged; the driver is killed; the restarted one compacts it alone, then Spark
            # runs batch 0 again (its checkpoint commit was lost with the first driver)
            done.append(_write(spark, sink, 0, rows, catching_up=True))
            sink = DeltaSink(VIEW, table, app, staging=str(tmp_path / "staging"))
            assert sink.pending(spark) == 0
            sink.compact(spark, 0, None)
            done.append(_write(spark, sink, 0, rows))
        elif path == "merge" and batch_id == 0:
            # batch 0 merged; the driver is killed before its checkpoint commit; the restarted one runs it again
            done.append(_write(spark, sink, 0, rows))
            sink = DeltaSink(VIEW, table, app)
            done.append(_write(spark, sink, 0, rows))
        else:
            if batch_id == 1 and path == "compact":  # a restart: a fresh sink that reads the table once
                sink = DeltaSink(VIEW, table, app)
            done.append(_write(spark, sink, batch_id, rows))
            if batch_id == 1:  # a failure after the commit, in the same driver: Spark runs the batch again
                done.append(_write(spark, sink, batch_id, rows))
        got = _table(spark, table)
        assert len({(c, s) for c, s, _n, _f in got}) == len(got), f"a key stored twice after batch {batch_id}: {got}"
        assert got == _expected(BATCHES[:batch_id + 1]), (batch_id, got)
    first = ["stage", "skip"] if path == "compact" else ["merge", "skip"]
    assert done == [*first, "merge", "skip", "close", "empty"]

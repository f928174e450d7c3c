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
from kappa.runtime.sink import DeltaSink, collect_rows, ensure_table, table_columns
from tests.helpers import commit_infos, delta_log

pytestmark = pytest.mark.integration

SCHEMA = ("campaign_id STRING, window_start TIMESTAMP, window_end TIMESTAMP, view_count BIGINT, "
          "last_event_time TIMESTAMP")
T0 = datetime(2026, 1, 1, 12, 0, 0)


def _window(campaign: str, start_s: int, count: int, last_s: float) -> tuple:
    return (campaign, T0 + timedelta(seconds=start_s), T0 + timedelta(seconds=start_s + 10), count,
            T0 + timedelta(seconds=last_s))


def _write(spark, sink: DeltaSink, batch_id: int, rows: list[tuple], *, catching_up: bool = False,
           live: bool = False) -> str:
    """One micro-batch's output through the sink as the job hands it over; ``live``: collected to the driver
    (committed through delta-rs), else through delta-spark."""
    out = spark.createDataFrame(rows, SCHEMA)
    side = spark.createDataFrame([], "x INT")
    stats = batch_stats(out, side, latency_column=None, event_max_column="last_event_time",
                        window_end_column="window_end")
    return sink.write(out, batch_id, rows=stats.rows, batch_event_max=stats.event_max,
                      window_ends=stats.window_ends, catching_up=catching_up,
                      collected=collect_rows(out) if live else None)


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


def _create(spark, table: str) -> None:
    ensure_table(spark, table, table_columns(VIEW, spark.createDataFrame([], SCHEMA).schema),
                 partition_by=VIEW.table_partitions)


@pytest.mark.parametrize("path", ["merge", "live", "compact"])
def test_a_window_updated_after_the_watermark_jumped_is_stored_once(spark, tmp_path, path):
    table = str(tmp_path / "table")
    _create(spark, table)
    live = path == "live"
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
        elif batch_id == 0:
            # batch 0 merged; the driver is killed before its checkpoint commit; the restarted one runs it again
            done.append(_write(spark, sink, 0, rows, live=live))
            sink = DeltaSink(VIEW, table, app)
            done.append(_write(spark, sink, 0, rows, live=live))
        else:
            if batch_id == 1 and path == "compact":  # a restart: a fresh sink that reads the table once
                sink = DeltaSink(VIEW, table, app)
            done.append(_write(spark, sink, batch_id, rows, live=live))
            if batch_id == 1:  # a failure after the commit, in the same driver: Spark runs the batch again
                done.append(_write(spark, sink, batch_id, rows, live=live))
        got = _table(spark, table)
        assert len({(c, s) for c, s, _n, _f in got}) == len(got), f"a key stored twice after batch {batch_id}: {got}"
        assert got == _expected(BATCHES[:batch_id + 1]), (batch_id, got)
    first = ["stage", "skip"] if path == "compact" else ["merge", "skip"]
    assert done == [*first, "merge", "skip", "close", "empty"]


def _log_actions(table: str) -> list[tuple[int, str, str]]:
    """(commit version, ``add``/``remove``, file path) of every data file action in the table's Delta log."""
    return [(version, kind, a[kind]["path"]) for version, actions in delta_log(table).items() for a in actions
            for kind in ("add", "remove") if kind in a]


def test_live_commits_write_a_final_window_once_and_never_rewrite_it(spark, tmp_path):
    """A windowed MERGE view's table keeps its open windows apart from its final ones (partitioned by the flag):
    each live micro-batch rewrites the files of the windows it updates or closes, and a window's row lands in the
    final partition once, in the commit that closes it - so the bytes a batch writes do not grow with the table.
    Counted from the Delta log and checked against the rows in plain Python."""
    table = str(tmp_path / "table")
    _create(spark, table)
    sink = DeltaSink(VIEW, table, "kappa-test-final-once")
    batches = []
    for batch_id in range(14):  # a 2 s trigger over 10 s windows: each batch counts one more view per campaign
        now = 2 * batch_id
        start = now - now % 10
        batches.append([_window(c, start, now % 10 // 2 + 1, now) for c in ("c1", "c2")])
    batches += [[], [_window("c1", 100, 1, 100)], []]  # the watermark jumps: every earlier window closes
    results = []
    for batch_id, rows in enumerate(batches):
        results.append(_write(spark, sink, batch_id, rows, live=True))
        assert _table(spark, table) == _expected(batches[:batch_id + 1]), batch_id
    assert set(results) <= {"merge", "close", "empty"} and "close" in results, results
    final_now = [row for row in _table(spark, table) if row[3]]
    assert len(final_now) == 6, final_now  # windows 0, 10, 20 of c1 and c2 closed; the one at 100 s is open
    actions = _log_actions(table)
    assert not [a for a in actions if a[1] == "remove" and a[2].startswith("is_final=true/")], actions
    final_files = [a for a in actions if a[1] == "add" and a[2].startswith("is_final=true/")]
    closing_commits = {version for version, _kind, _path in final_files}
    assert 1 <= len(closing_commits) <= len(final_files) <= 3, final_files  # windows close in at most 3 commits
    assert all(a[2].startswith(("is_final=false/", "is_final=true/")) for a in actions), actions
    # the last batch's one window is new: its MERGE read no stored file (the files' window_end statistics)
    last = commit_infos(table)[-2]
    assert last["operation"] == "MERGE" and last["operationMetrics"]["num_target_files_scanned"] == 0, last


def test_a_live_commit_that_raised_after_it_landed_is_not_applied_again(spark, tmp_path, monkeypatch):
    """A live (delta-rs) commit can land and still raise - a checkpoint or a listing after the commit file was
    written fails. delta-rs checks no application transaction itself, so the sink must not trust what it knew:
    the batch's next attempt asks the table, finds the commit and skips it, and the batches after it merge as
    before. The error is injected (a fake: the real store does not fail on demand) after the real commit."""
    from kappa.runtime import deltars

    table = str(tmp_path / "table")
    _create(spark, table)
    sink = DeltaSink(VIEW, table, "kappa-test-landed")
    batches = [[_window("c1", 0, 1, 1), _window("c2", 0, 1, 2)], [_window("c1", 0, 2, 3)],
               [_window("c1", 10, 1, 12), _window("c2", 20, 1, 25)], [], [_window("c1", 40, 1, 41)]]
    real = deltars.after_commit
    failed: list[int] = []

    def after_commit(t):
        real(t)
        if not failed:
            failed.append(t.version())
            raise OSError("injected: the store failed after the commit landed")

    for batch_id, rows in enumerate(batches):
        if batch_id == 2:
            monkeypatch.setattr(deltars, "after_commit", after_commit)
            with pytest.raises(OSError, match="injected"):
                _write(spark, sink, batch_id, rows, live=True)
            monkeypatch.setattr(deltars, "after_commit", real)
            assert _write(spark, sink, batch_id, rows, live=True) == "skip"  # Spark runs the batch again
        else:
            _write(spark, sink, batch_id, rows, live=True)
        assert _table(spark, table) == _expected(batches[:batch_id + 1]), batch_id
    commits = [c for c in commit_infos(table) if c.get("operation") in ("MERGE", "WRITE")]
    assert len(commits) == len(batches), commits  # one commit per batch: batch 2's landed once

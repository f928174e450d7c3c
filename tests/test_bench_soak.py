"""``make bench-soak``'s counting: the files a Delta table holds on disk, as delta-rs itself accounts for them
through appends, a compaction, a VACUUM and a checkpoint; and the summary's growth figures."""

from __future__ import annotations

import duckdb
from deltalake import DeltaTable, write_deltalake

from kappa.front.bench_soak import active_files, slope_per_hour, summarize, table_stats


def test_table_stats_counts_what_delta_rs_writes_and_removes(tmp_path):
    path = tmp_path / "t"
    for i in range(3):
        write_deltalake(str(path), duckdb.connect().sql(f"SELECT * FROM (VALUES ({i}), ({i + 10})) t(id)"), mode="append",
                        configuration={"delta.enableChangeDataFeed": "true"})
    st = table_stats(path)
    dt = DeltaTable(str(path))
    assert st["version"] == dt.version() == 2 and st["commits"] == 3
    assert st["data"] == len(dt.file_uris()) == active_files(path) == 3 and st["cdc"] == 0 and st["checkpoints"] == 0
    dt.optimize.compact()
    dt = DeltaTable(str(path))
    assert table_stats(path)["data"] == 3 + 1  # the compacted file beside the three it replaced, until a VACUUM
    assert active_files(path) == 1  # what a reader lists
    dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    dt.create_checkpoint()
    st = table_stats(path)
    assert st["data"] == len(DeltaTable(str(path)).file_uris()) == 1
    assert st["checkpoints"] == 1 and st["version"] == DeltaTable(str(path)).version()
    assert st["bytes"] > 0
    assert active_files(tmp_path / "missing") == 0
    assert table_stats(tmp_path / "missing") == {"data": 0, "cdc": 0, "commits": 0, "checkpoints": 0, "bytes": 0,
                                                 "version": -1, "active": 0}


def _sample(t: float, files: int, version: int, query_s: float, rss: float) -> dict:
    return {"t": t, "tables": {"v": {"data": files, "cdc": 0, "commits": 0, "checkpoints": 0, "bytes": 1,
                                     "version": version, "active": files}},
            "query_s": {"v": query_s}, "rss_mb_total": rss}


def test_summary_compares_the_peaks_of_two_windows_and_projects_their_growth():
    # files grow by 1 a minute, RSS by 10 MiB a minute (600 MiB/h); windows of 10 min: [10, 20) and (20, 30]
    samples = [_sample(60.0 * m, 100 + m, 50 * m, 0.1 + 0.01 * m, 1000 + 10 * m) for m in range(31)]
    s = summarize(samples, 600.0)
    t = s["tables"]["v"]
    assert s["from_t"] == 600.0 and s["to_t"] == 1800.0
    assert (t["files_from"], t["files_to"], t["commits_from"], t["commits_to"]) == (119, 130, 500, 1500)
    assert abs(t["query_s_from"] - 0.25) < 1e-9 and abs(t["query_s_to"] - 0.36) < 1e-9  # the windows' medians
    assert abs(t["files_ratio"] - 130 / 119) < 1e-9 and abs(t["query_ratio"] - 0.36 / 0.25) < 1e-9
    # the peaks grew 11 files between the windows' centres (14.5 and 25.5 min): 1 a minute
    assert t["files_30_days"] == round(130 + (30 * 86_400 - 1800) / 60)
    assert abs(s["rss_mb_per_hour"] - 600.0) < 1e-6
    # a sawtooth (compacted to 10 every 5 min, +20 a minute between) is flat: its peaks do not grow
    saw = summarize([_sample(60.0 * m, 10 + 20 * (m % 5), m, 0.1, 1000) for m in range(31)], 600.0)
    assert (saw["tables"]["v"]["files_from"], saw["tables"]["v"]["files_to"]) == (90, 90)
    assert saw["tables"]["v"]["files_ratio"] == 1.0 and saw["tables"]["v"]["files_30_days"] == 90
    assert saw["rss_mb_per_hour"] == 0.0
    # a leg shorter than two windows compares its last sample with itself, saying no growth it did not see
    short = summarize([_sample(60.0 * m, 100 + m, m, 0.1, 1000) for m in range(5)], 600.0)
    assert short["tables"]["v"]["files_ratio"] == 1.0
    assert slope_per_hour([(0.0, 1.0)]) is None

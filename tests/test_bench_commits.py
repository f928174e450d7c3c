"""``make bench-commits``: its template's batches move on in time by whole cycles, its summary compares the peaks of
two windows of commits, and a small run commits every batch once into real tables through the views' own sinks,
the upkeep leg's tables compacted and the other's not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from kappa.front.bench_commits import BATCH_SECONDS, Template, summarize
from tests.docs_blocks import ROOT


def test_a_template_batch_moves_on_by_whole_cycles():
    t0 = datetime(2027, 1, 15, 8, 0, 0)
    tmpl = Template(view=None, schema=None, columns=(("id", "string"), ("window_start", "timestamp"), ("n", "bigint")),
                    batches=[[{"id": "a", "window_start": t0, "n": 1}], [{"id": "b", "window_start": None, "n": 2}]],
                    bad=[[{"offset": 7, "kafka_timestamp": 1_000}], []])
    micros = int((t0 - datetime(1970, 1, 1)).total_seconds()) * 1_000_000
    cycle = int(2 * BATCH_SECONDS * 1_000_000)  # two batches a cycle
    assert tmpl.rows(0) == ([("a", micros, 1)], [{"offset": 7, "kafka_timestamp": 1_000}])
    assert tmpl.rows(1) == ([("b", None, 2)], [])
    assert tmpl.rows(4) == ([("a", micros + 2 * cycle, 1)],
                            [{"offset": 2_000_007, "kafka_timestamp": 1_000 + 2 * cycle}])


def _sample(commit: int, files: int, query_s: float, commit_s: float) -> dict:
    return {"commit": commit, "rss_mb": 100.0,
            "tables": {"v": {"data": files, "cdc": 0, "commits": commit, "checkpoints": 0, "bytes": 1,
                             "version": commit, "active": files}},
            "query_s": {"v": query_s}, "changes_s": {"v": query_s}, "commit_s": {"v": {"median": commit_s,
                                                                                         "p95": commit_s}}}


def test_summary_compares_the_peaks_of_two_windows_of_commits():
    # a file a commit, sampled every 100 commits; windows of 400 commits: [200, 600) and (1600, 2000]
    samples = [_sample(c, c, 0.1 + c / 10_000, 0.02) for c in range(100, 2001, 100)]
    t = summarize(samples, 200, 400)["tables"]["v"]
    assert (t["files_from"], t["files_to"], t["commits_from"], t["commits_to"]) == (500, 2000, 200, 2000)
    assert t["files_ratio"] == 4.0 and t["commit_ratio"] == 1.0
    assert (t["query_s_from"], t["query_s_to"]) == (0.1 + 350 / 10_000, 0.1 + 1850 / 10_000)  # the medians
    month = int(30 * 86_400 / BATCH_SECONDS)
    assert t["files_30_days"] == round(2000 + (month - 2000))  # grew a file a commit between the windows' centres
    # a sawtooth (compacted every 500 commits) is flat: its peaks do not grow
    saw = summarize([_sample(c, 10 + (c % 500), 0.1, 0.02) for c in range(100, 2001, 100)], 200, 1000)
    assert saw["tables"]["v"]["files_ratio"] == 1.0 and saw["tables"]["v"]["files_30_days"] == 410


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_small_run_commits_every_batch_once_and_the_upkeep_leg_compacts(tmp_path):
    from deltalake import DeltaTable

    out = tmp_path / "reports"
    env = {**os.environ, "KAPPA_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}  # no broker: none is read
    run = subprocess.run([sys.executable, "-m", "kappa.front.bench_commits", "--commits", "12", "--sample-every", "4",
                          "--upkeep-every", "6", "--template-batches", "3", "--from-commit", "4",
                          "--changes-commits", "4", "--views", "events_raw,campaign_window_counts",
                          "--legs", "upkeep,no-upkeep", "--grace-minutes", "10",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "bench-commits.json").read_text())
    assert [r["label"] for r in results] == ["upkeep", "no upkeep"] and (out / "bench-commits.png").stat().st_size
    # 2 views, after commits 6 and 12 (no look between them: the keeper looks every 15 micro-batches)
    assert [u["kind"] for u in results[0]["upkeeps"]] == ["upkeep"] * 4 and not results[1]["upkeeps"]
    lakes = sorted((tmp_path / "home" / "bench-commits").iterdir())
    assert [p.name.split("-", 1)[1] for p in lakes] == ["no-upkeep", "upkeep"]
    tables = {p.name.split("-", 1)[1]: {v: DeltaTable(str(p / "lake" / "views" / v / "v1" / "table"))
                                        for v in ("events_raw", "campaign_window_counts")} for p in lakes}
    for leg, by_view in tables.items():
        for view, table in by_view.items():
            # every batch id committed once, in order, by the view's sink (its Delta txn), whatever upkeep did
            txns = [json.loads(c["userMetadata"])["kappa"]["batch"] for c in table.history()
                    if c.get("userMetadata")]
            assert sorted(txns) == list(range(12)), (leg, view, txns)
    def rows(table: DeltaTable, *names: str) -> list[tuple]:
        data = table.scan().read_all()  # arro3: the Arrow table delta-rs reads, no pyarrow
        columns = [data.column(data.column_names.index(n)).to_pylist() for n in names or data.column_names]
        return sorted(zip(*columns), key=repr)

    raw = {leg: len(rows(by_view["events_raw"])) for leg, by_view in tables.items()}
    assert raw["upkeep"] == raw["no-upkeep"] > 0, raw
    counts = {leg: rows(by_view["campaign_window_counts"], "campaign_id", "window_start", "view_count", "is_final")
              for leg, by_view in tables.items()}
    assert counts["upkeep"] == counts["no-upkeep"] and counts["upkeep"], "the same rows, compacted or not"
    files = {leg: len(by_view["events_raw"].file_uris()) for leg, by_view in tables.items()}
    assert files["upkeep"] < files["no-upkeep"] == 12, files
    assert Path(lakes[0] / "lake" / "quarantine").is_dir()
    # a commit's time split between the table's write and the quarantine's append (the batches with bad records)
    for r in results:
        for s in r["samples"]:
            for view, c in s["commit_s"].items():
                assert c["table_mean"] > 0 and c["quarantine_mean"] >= 0, (view, c)
                assert abs(c["table_mean"] + c["quarantine_mean"] - c["mean"]) < 0.002, (view, c)
    assert any(c["quarantine_mean"] > 0 for r in results for s in r["samples"] for c in s["commit_s"].values())
    assert "the quarantine's append" in run.stdout


def test_a_run_stopped_early_is_reported_to_its_last_sample(tmp_path, capsys):
    import argparse

    from kappa.front.bench_commits import report

    for leg, upto in (("upkeep", 2000), ("hourly", 1200)):
        (tmp_path / f"bench-commits-{leg}.json").write_text(json.dumps({
            "label": leg, "commits": upto, "asked": 20_000, "stopped": "", "minutes": 1.0, "from_commit": 200,
            "upkeep_every": 400, "samples": [_sample(c, c, 0.1, 0.02) for c in range(100, upto + 1, 100)],
            "upkeeps": [{"view": "v", "kind": "upkeep", "seconds": 1.5, "line": "-"}]}))
    args = argparse.Namespace(out=tmp_path, from_commit=200, upkeep_every=200, window=0)
    report(args, ["upkeep", "hourly", "no-upkeep"], [0, 0, 1])
    results = json.loads((tmp_path / "bench-commits.json").read_text())
    assert [(r["label"], r["stopped"]) for r in results] == [("upkeep", "at commit 2,000 of 20,000"),
                                                             ("hourly", "at commit 1,200 of 20,000")]
    assert results[1]["summary"]["tables"]["v"]["files_to"] == 1200 and (tmp_path / "bench-commits.png").is_file()
    out = capsys.readouterr().out
    assert "the no-upkeep leg exited 1: it measured nothing" in out and "stopped at commit 1,200 of 20,000" in out

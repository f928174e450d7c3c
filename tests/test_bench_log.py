"""``make bench-log``: the tables it builds hold the log it says - N commits read back by delta-rs from their last
checkpoint, the appends it times landed - and every measure is reported."""

from __future__ import annotations

import json
import subprocess
import sys

from kappa.front.bench_log import MEASURES, build, measure
from tests.docs_blocks import ROOT


def _rows(table) -> int:
    return table.scan().read_all().num_rows


def test_a_built_table_holds_its_commits_and_the_measured_appends(tmp_path):
    from deltalake import DeltaTable

    path = tmp_path / "t"

    def put(key: str, data: bytes) -> None:
        (path / key).write_bytes(data)

    table = build(str(path), 45, put, lambda key: (path / key).read_bytes())
    assert table.version() == 45
    log = path / "_delta_log"
    assert len(list(log.glob("*.json"))) == 46  # version 0 (the table's creation) to 45
    assert (log / f"{40:020}.checkpoint.parquet").exists() and (log / f"{45:020}.checkpoint.parquet").exists()
    assert _rows(DeltaTable(str(path))) == 100  # version 1's rows; the commits after it add none
    result = measure(str(path), table, 2)
    assert set(result) == set(MEASURES) and all(ms > 0 for ms in result.values()), result
    fresh = DeltaTable(str(path))
    assert fresh.version() > 45 and fresh.transaction_version("bench") == 2  # append_once committed batches 1, 2
    assert _rows(fresh) == 100 * (1 + fresh.version() - 45)


def test_the_bench_runs_and_reports(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kappa.front.bench_log", "--lengths", "3,30", "--stores", "local",
                           "--repeat", "2", "--age-commits", "25", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench-log.json").read_text())
    assert [(r["store"], r["commits"]) for r in report["results"]] == [("local", 3), ("local", 30)]
    # two writers' 25 appends each, as delta-rs keeps a handle and started again from each checkpoint
    assert [(a["store"], a["rebase"]) for a in report["age"]] == [("local", False), ("local", True)]
    assert all(len(a["ms"][w]) == 25 and a[f"{w}_last_ms"] > 0 for a in report["age"] for w in ("a", "b"))
    assert done.stdout.count("age local") == 2
    assert (tmp_path / "bench-log.png").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "kappa.front.bench_log", "--stores", "disk"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--stores takes local and/or s3" in bad.stderr and "Traceback" not in bad.stderr

"""The analysts' no-server path (docs/analysts.md, "No server: the lake's files, with a read-only key"): delta-rs and
DuckDB in the analysts' venv - nothing of the platform importable there - over a lake on the real object store,
with the store's read-only key.

The lake is made by the platform's own code with the store's full credential: two versions of
``campaign_window_counts`` (v2 promoted through :class:`kappa.control.serving.ServingAlias`, the alias commit every
promotion makes) and ``events_raw`` v1, never switched. The docs' block runs verbatim; what it prints is checked
against sums computed here from the rows written, and it must have resolved v2 and v1 as the platform's readers do.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from arro3.core import DataType
from deltalake import DeltaTable, write_deltalake

from kappa.control.registry import Registry
from kappa.control.serving import ServingAlias
from kappa.front.venvs import ensure_venv
from kappa.identity import ViewPaths
from kappa.objectstore import LocalObjectStore
from kappa.runtime.deltars import I64, STR, TS, arrow_rows, read_rows
from tests.docs_blocks import shell_block

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


_WINDOW = (("campaign_id", STR), ("window_start", TS), ("view_count", I64), ("is_final", DataType.bool()))


def _windows(scale: int) -> list[dict]:
    start = datetime(2026, 12, 1, tzinfo=UTC)
    return [{"campaign_id": f"c{c:02d}", "window_start": start + timedelta(seconds=10 * w),
             "view_count": scale * (c * 7 + w), "is_final": w < 3} for c in range(12) for w in range(4)]


@pytest.fixture(scope="module")
def lake(object_store: LocalObjectStore) -> dict:
    uri = f"s3://kappa/reader-{uuid.uuid4().hex[:8]}"
    opts = object_store.delta_rs_options()
    tables = {}
    for view, version, columns, rows in (
            ("campaign_window_counts", 1, _WINDOW, _windows(1)), ("campaign_window_counts", 2, _WINDOW, _windows(3)),
            ("events_raw", 1, (("offset", I64),), [{"offset": i} for i in range(1234)])):
        path = ViewPaths(uri, view, version).table
        write_deltalake(path, arrow_rows(columns, rows), storage_options=opts)
        tables[(view, version)] = (path, rows)
    registry = Registry(uri, storage_options=opts)
    path = tables[("campaign_window_counts", 2)][0]
    registry.register("campaign_window_counts", 2, code_module="jobs.campaign_window_counts.v2", table_path=path,
                      app_id="reader-test", starting="earliest", triggered_by="test")
    for state, before in (("caught_up", "building"), ("verified", "caught_up")):
        registry.set_state("campaign_window_counts", 2, state, by="test", expected={before})
    ServingAlias(uri, registry=registry, storage_options=opts).promote("campaign_window_counts", 2, by="test")
    return {"uri": uri, "tables": tables}


def test_the_docs_block_reads_every_serving_view_with_the_read_only_key(object_store: LocalObjectStore,
                                                                        lake: dict) -> None:
    python = ensure_venv(ROOT, "analyst-venv", "infra/local/requirements-analyst.lock")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KAPPA_"))}
    env.update(object_store.reader_env(), KAPPA_LAKE_URI=lake["uri"].replace("s3://", "s3a://", 1),
               PATH=f"{python.parent}:{env['PATH']}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    block = shell_block("DeltaTable(f\"{lake}/_registry/serving\")").text
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"campaign_window_counts: serving v2, {lake['tables'][('campaign_window_counts', 2)][0]}" in out, out
    assert f"events_raw: serving v1, {lake['tables'][('events_raw', 1)][0]}" in out, out
    # independently: the final windows of v2 (the serving version), summed per campaign, top five
    sums: dict[str, int] = {}
    for row in lake["tables"][("campaign_window_counts", 2)][1]:
        if row["is_final"]:
            sums[row["campaign_id"]] = sums.get(row["campaign_id"], 0) + row["view_count"]
    top = sorted(sums.items(), key=lambda kv: -kv[1])[:5]
    for campaign, total in top:
        assert re.search(rf"│\s*{campaign}\s*│\s*{total}\s*│", out), f"{campaign} {total} not in:\n{out}"
    assert re.search(r"│\s*1234\s*│", out), out


def test_the_read_only_key_cannot_change_the_lake(object_store: LocalObjectStore, lake: dict) -> None:
    path, _data = lake["tables"][("events_raw", 1)]
    full = object_store.delta_rs_options()
    before = DeltaTable(path, storage_options=full)
    version, files = before.version(), sorted(before.file_uris())
    reader = object_store.reader_env()
    with pytest.raises(Exception, match=r"(?i)403|access ?denied|forbidden"):
        write_deltalake(path, arrow_rows((("offset", I64),), [{"offset": 1}]), mode="append",
                        storage_options=reader)
    with pytest.raises(Exception, match=r"(?i)403|access ?denied|forbidden"):
        DeltaTable(path, storage_options=reader).delete()
    after = DeltaTable(path, storage_options=full)
    assert (after.version(), sorted(after.file_uris())) == (version, files)
    # and the key reads: the same table through it
    assert len(read_rows(DeltaTable(path, storage_options=reader))) == 1234


def test_reader_env_prints_the_read_only_key(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KAPPA_"))}, "KAPPA_HOME": str(tmp_path)}
    block = shell_block("kappa.objectstore reader-env   # export lines").text
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", f"eval \"$({block.strip().split('#')[0]})\"; env"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    printed = dict(line.split("=", 1) for line in run.stdout.splitlines() if line.startswith("AWS_"))
    store = LocalObjectStore(tmp_path / "objectstore")
    assert printed == store.reader_env()
    assert printed["AWS_ACCESS_KEY_ID"] != store.credentials()[0]

"""The verification cache's bookkeeping (kappa.verify.stagecache) on real folders: what is reused, what is
removed, the lock and the disk budget. The Spark side - records staged once and reused by the next check of the
run - runs in tests/test_verify_any_view.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from kappa.config import Settings
from kappa.verify.stagecache import MANIFEST, Staging, cache_root, prune, staged_records, staging

VIEW = SimpleNamespace(name="counts", version=3, ref="counts@v3")


def _settings(tmp_path: Path, mb: int = 4096) -> Settings:
    return Settings.from_env({"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_VERIFY_CACHE_MB": str(mb)})


def _entries(*ends: int) -> list[dict]:
    """Recorded batches of one partition ending at ``ends`` (an end equal to the one before: a no-data batch)."""
    lows = (0, *ends[:-1])
    return Staging.entries([(i, {0: (lo, hi)} if hi > lo else {}, 1000 * i)
                            for i, (lo, hi) in enumerate(zip(lows, ends))])


def _stage(staged: Staging, entries: list[dict], units: list[list[int]], size: int = 10) -> None:
    """What kappa.runtime.rerun.stage_batches leaves: a folder per unit (a step of the re-run: its last batch's
    position) and kind, here a file of ``size`` bytes where the unit read records."""
    incoming = staged.incoming()
    for unit in units:
        if any(entries[pos]["read"] for pos in unit):
            folder = incoming / f"_kappa_batch={unit[-1]}" / "_kappa_kind=valid"
            folder.mkdir(parents=True)
            (folder / "part-0.parquet").write_bytes(b"x" * size)
    staged.adopt(incoming, [{"pos": unit[-1], "batches": [entries[pos] for pos in unit]} for unit in units])


def _batches(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("_kappa_batch="))


def test_a_later_check_reuses_the_leading_units_that_are_unchanged_and_stages_the_rest(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    key = {"run": "table-id:app", "start": {"0": 0}}
    first = _entries(10, 20, 30, 40, 40)  # a coalesced re-run: [0, 1, 2] as one step, 3 as recorded, 4 (no data)
    with staging(settings, VIEW, key, str(tmp_path)) as staged:
        assert staged.kept and staged.reuse(first) == []
        _stage(staged, first, [[0, 1, 2], [3], [4]])
    folder = cache_root(settings) / "counts_v3"
    assert _batches(folder) == ["_kappa_batch=2", "_kappa_batch=3"]
    assert staged_records(settings, VIEW, "table-id:app") == 40 and staged_records(settings, VIEW, "other") == 0

    # the same run, two batches more: both data units reused; the no-data batch at the end starts the next run
    more = _entries(10, 20, 30, 40, 40, 50, 60)
    with staging(settings, VIEW, key, str(tmp_path)) as staged:
        assert staged.reuse(more) == [[0, 1, 2], [3]] and staged.records() == 40
        _stage(staged, more, [[4, 5], [6]])
    assert len(json.loads((folder / MANIFEST).read_text())["units"]) == 4
    # re-run one batch at a time: only units of one batch count - the first is a run of three
    with staging(settings, VIEW, key, str(tmp_path)) as staged:
        assert staged.reuse(more, single=True) == [] and _batches(folder) == []

    # batch 1 recorded otherwise (another cut): unit [0] stays, everything after it goes; a stray folder of a
    # check killed while staging (not in the manifest) goes too
    with staging(settings, VIEW, key, str(tmp_path)) as staged:
        staged.reuse(more, single=True)
        _stage(staged, more, [[0], [1], [2]])
    (folder / "_kappa_batch=9").mkdir()
    (folder / ".incoming").mkdir()
    with staging(settings, VIEW, key, str(tmp_path)) as staged:
        assert staged.reuse(_entries(10, 25, 30), single=True) == [[0]] and staged.records() == 10
        assert _batches(folder) == ["_kappa_batch=0"] and not (folder / ".incoming").exists()
    assert json.loads((folder / MANIFEST).read_text())["units"] == [{"pos": 0, "batches": _entries(10)}]

    # another key (another run, format or start): nothing is reused, nothing of the old one stays
    with staging(settings, VIEW, {**key, "run": "table-id:another-app"}, str(tmp_path)) as staged:
        assert staged.reuse(_entries(10, 20)) == [] and _batches(folder) == []


def test_a_second_check_of_the_version_at_once_stages_in_scratch_and_no_cache_means_scratch(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    with staging(settings, VIEW, {"run": "r"}, str(tmp_path)) as held:
        with staging(settings, VIEW, {"run": "r"}, str(tmp_path)) as other:
            assert held.kept and not other.kept and other.root.parent.parent == tmp_path
            _stage(other, _entries(10), [[0]])
            assert other.reuse(_entries(10)) == []  # scratch keeps no manifest
        assert not other.root.parent.exists()  # removed afterwards
    for no_cache in (staging(_settings(tmp_path, 0), VIEW, {"run": "r"}, str(tmp_path)),
                     staging(settings, VIEW, None, str(tmp_path))):
        with no_cache as staged:
            assert not staged.kept


def test_the_cache_keeps_to_its_budget_least_recently_used_first_never_one_in_use(tmp_path: Path) -> None:
    settings = _settings(tmp_path, mb=1)
    root = cache_root(settings)
    for age, name in enumerate(("old_v1", "older_v1", "new_v1")):
        view = SimpleNamespace(name=name.split("_v")[0], version=1, ref=name)
        with staging(settings, view, {"run": "r"}, str(tmp_path)) as staged:
            _stage(staged, _entries(10), [[0]], size=400 * 1024)
        when = time.time() - {"old_v1": 200, "older_v1": 300, "new_v1": 100}[name]
        os.utime(root / name, (when, when))
    # the third check's end pruned the cache: 1.2 MB -> 0.8 MB, the least recently used version's folder gone
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["new_v1", "old_v1"]
    assert prune(settings) == []
    with staging(settings, SimpleNamespace(name="old", version=1, ref="old@v1"), {"run": "r"}, str(tmp_path)):
        assert prune(_settings(tmp_path, mb=0)) == [root / "new_v1"]  # old_v1 is in use
    assert prune(_settings(tmp_path, mb=0)) == [root / "old_v1"]

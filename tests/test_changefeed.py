"""Change data feed of the views: ``kappa watch`` notifications, ``table_changes`` in ``kappa query``.

The update semantics are checked on a table written by delta-spark (the writer of every view table: appends and
MERGEs, as :class:`kappa.runtime.sink.DeltaSink` does) and read back through delta-rs; following the serving alias
across a promotion and a rollback on delta-rs tables and the real registry / alias. Each expectation is derived
from the writes the test made, never from the feed itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pytest
from deltalake import DeltaTable, write_deltalake

from kappa.config import Settings
from kappa.control.changefeed import ChangeFeedError, follow_changes, notifications, read_changes
from kappa.control.registry import Registry
from kappa.control.serving import ServingAlias
from kappa.front.query import QueryError, run_query
from kappa.identity import ViewPaths
from kappa.runtime.sink import CHANGE_FEED, enable_change_feed, ensure_table

ROOT = Path(__file__).resolve().parents[1]
CWC = "campaign_window_counts"


def _write(spark, path: str, sql: str) -> None:
    spark.sql(sql.format(T=f"delta.`{path}`"))


def test_adds_changes_and_removes_of_a_merged_table_follow_the_where_condition(spark, tmp_path):
    path = str(tmp_path / "t")
    ensure_table(spark, path, "id STRING, n BIGINT", properties={CHANGE_FEED: "true"})  # version 0
    _write(spark, path, "INSERT INTO {T} VALUES ('a', 1), ('b', 2), ('c', 3)")  # 1
    _write(spark, path, "MERGE INTO {T} t USING (SELECT * FROM VALUES ('a', 10), ('b', 2), ('d', 4) AS s(id, n)) s "
                        "ON t.id = s.id WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *")  # 2
    _write(spark, path, "MERGE INTO {T} t USING (SELECT * FROM VALUES ('c', 0, true), ('d', 40, false) "
                        "AS s(id, n, gone)) s ON t.id = s.id WHEN MATCHED AND s.gone THEN DELETE "
                        "WHEN MATCHED THEN UPDATE SET t.n = s.n")  # 3

    def seen(where):
        return [(c.commit, c.kind, c.row["id"], c.row["n"], c.before and c.before["n"])
                for c in notifications("t", 1, read_changes(path, 1), keys=("id",), where=where)]

    assert seen(None) == [(1, "add", "a", 1, None), (1, "add", "b", 2, None), (1, "add", "c", 3, None),
                          (2, "change", "a", 10, 1), (2, "add", "d", 4, None),  # b: 2 -> 2 is no change
                          (3, "remove", "c", 3, None), (3, "change", "d", 40, 4)]
    assert seen("n >= 3") == [(1, "add", "c", 3, None),
                              (2, "add", "a", 10, None),  # updated into the result
                              (2, "add", "d", 4, None),
                              (3, "remove", "c", 3, None), (3, "change", "d", 40, 4)]
    assert seen("n < 3") == [(1, "add", "a", 1, None), (1, "add", "b", 2, None),
                             (2, "remove", "a", 1, None)]  # updated out of the result: its last matching row

    # folding every notification gives the table as it is (read independently, by a plain scan)
    state: dict[str, int] = {}
    for c in notifications("t", 1, read_changes(path, 0), keys=("id",)):
        if c.kind == "remove":
            del state[c.row["id"]]
        else:
            state[c.row["id"]] = c.row["n"]
    scan = DeltaTable(path).scan().read_all()
    assert state == dict(zip(scan.column("id").to_pylist(), scan.column("n").to_pylist())) == {
        "a": 10, "b": 2, "d": 40}

    with pytest.raises(ChangeFeedError, match=r"versions 5\.\.3 are outside"):
        read_changes(path, 5)
    with pytest.raises(ChangeFeedError, match="--where 'no_such_column > 1'"):
        notifications("t", 1, read_changes(path, 1), where="no_such_column > 1")


def test_a_table_created_without_the_feed_gets_it_from_then_on(spark, tmp_path):
    path = str(tmp_path / "old")
    ensure_table(spark, path, "id STRING, n BIGINT")
    _write(spark, path, "INSERT INTO {T} VALUES ('a', 1)")  # 1: before the feed
    assert enable_change_feed(spark, path) is True  # 2
    assert enable_change_feed(spark, path) is False
    _write(spark, path, "INSERT INTO {T} VALUES ('b', 2)")  # 3
    assert [c.row["id"] for c in notifications("old", 1, read_changes(path, 2))] == ["b"]
    # delta-rs would make inserts up from the files of a commit without a feed: refused, saying where it starts
    with pytest.raises(ChangeFeedError, match="change feed of .* starts at version 2, not 1"):
        read_changes(path, 1)


# ------------------------------------------------------------------------------------------- following
@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    return Settings.from_env()


def _windows(path: str, counts: dict[str, int]) -> None:
    """campaign_window_counts rows (one window per campaign), appended by delta-rs with the feed on."""
    values = ", ".join(f"('{c}', {n})" for c, n in counts.items())
    rel = duckdb.connect().sql(
        "SELECT campaign_id, TIMESTAMPTZ '2024-05-01 12:00:00+00' AS window_start, "
        "TIMESTAMPTZ '2024-05-01 12:00:10+00' AS window_end, n::BIGINT AS view_count, "
        "TIMESTAMPTZ '2024-05-01 12:00:05+00' AS last_event_time, false AS is_final "
        f"FROM (VALUES {values}) t(campaign_id, n)")
    write_deltalake(path, rel, mode="append", configuration={CHANGE_FEED: "true"})


def _register(settings: Settings, version: int) -> None:
    reg = Registry(settings.lake_uri)
    reg.register(CWC, version, code_module=f"jobs.{CWC}.v{version}",
                 table_path=ViewPaths(settings.lake_uri, CWC, version).table, app_id=f"kappa:{CWC}@v{version}:t",
                 starting="earliest", triggered_by="test")
    for state in ("caught_up", "verified"):
        reg.set_state(CWC, version, state, by="test")


def test_watch_follows_the_serving_alias_across_a_promotion_and_a_rollback(settings):
    v1, v2 = (ViewPaths(settings.lake_uri, CWC, v).table for v in (1, 2))
    _windows(v1, {"c0": 1})  # before the watch starts: not reported (it starts at "now")
    alias = ServingAlias(settings.lake_uri)
    _register(settings, 1)
    alias.promote(CWC, 1, by="test")
    got: list = []
    step = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        for change in follow_changes(settings, CWC, where="view_count >= 2", poll=0.05,
                                     until=lambda: (step.set(), stop.is_set())[1]):
            got.append(change)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def settle() -> None:  # two full looks of the watcher after a write
        for _ in range(2):
            step.clear()
            assert step.wait(30)

    settle()
    _windows(v1, {"c1": 2, "c2": 1})  # c2 does not match the where
    settle()
    _windows(v2, {"c1": 5})  # v2 built beside v1: not served yet, not reported
    settle()
    _register(settings, 2)
    alias.promote(CWC, 2, by="test")
    settle()
    _windows(v1, {"c3": 7})  # the old version after the switch: readers no longer see it
    _windows(v2, {"c4": 9})
    settle()
    alias.rollback(CWC, 1, by="test")
    settle()
    _windows(v1, {"c5": 3})
    settle()
    stop.set()
    thread.join(30)

    summary = [(c.kind, c.version, c.previous_version, c.row.get("campaign_id"), c.row.get("view_count"))
               for c in got]
    assert summary == [("add", 1, None, "c1", 2),
                       ("switch", 2, 1, None, None),
                       ("add", 2, None, "c4", 9),
                       ("switch", 1, 2, None, None),
                       ("add", 1, None, "c5", 3)], summary
    # each switch starts at the snapshot readers saw first: v2's only commit; v1's commit of c3 (made while v2
    # served, so never reported) - c5 is the commit after it
    assert (got[1].commit, got[3].commit, got[4].commit) == (0, 2, 3)
    assert got[3].committed_at == alias.alias(CWC).switched_at
    print(json.dumps([json.loads(c.to_json()) for c in got], indent=1))


def test_table_changes_in_a_query_reads_the_serving_table_s_feed(settings):
    v1 = ViewPaths(settings.lake_uri, CWC, 1).table
    _windows(v1, {"c1": 2})
    _windows(v1, {"c2": 3, "c3": 4})
    res = run_query(f"SELECT campaign_id, _change_type, _commit_version FROM table_changes('{CWC}', 1, 1) "
                    "ORDER BY campaign_id", settings=settings)
    assert res.rows == [("c2", "insert", 1), ("c3", "insert", 1)]
    assert CWC not in res.freshness  # only the feed was read, not the whole table
    (fresh,) = res.freshness.values()
    assert (fresh.serving_version, fresh.delta_version) == (1, 1)
    both = run_query(f"SELECT count(*) FROM table_changes('{CWC}', 0) c JOIN {CWC} v USING (campaign_id)",
                     settings=settings)
    assert both.rows == [(3,)]
    with pytest.raises(QueryError, match="not a declared view"):
        run_query("SELECT * FROM table_changes('nope', 0)", settings=settings)
    with pytest.raises(QueryError, match="outside"):
        run_query(f"SELECT * FROM table_changes('{CWC}', 9)", settings=settings)


def test_watch_misuse_gets_one_line(settings, tmp_path):
    _windows(ViewPaths(settings.lake_uri, CWC, 1).table, {"c1": 2})
    env = {"KAPPA_HOME": str(settings.home), "KAPPA_LAKE_URI": settings.lake_uri, "PATH": "/usr/bin:/bin"}
    for args, expected in ((["watch", "nope", "--for", "1"], "nope"),
                           (["watch", CWC, "--where", "no_such_column = 1", "--for", "5"], "no_such_column")):
        proc = subprocess.run([sys.executable, "-m", "kappa.front.cli", *args], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and expected in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # and a working one: everything since version 0, then it stops by itself
    proc = subprocess.run([sys.executable, "-m", "kappa.front.cli", "watch", CWC, "--from", "0", "--max-events", "1"],
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout)
    assert (line["kind"], line["version"], line["commit"], line["row"]["campaign_id"]) == ("add", 1, 0, "c1")
    assert datetime.fromisoformat(line["committed_at"]).tzinfo == timezone.utc


def test_a_watch_that_matched_nothing_says_so_in_one_line(settings):
    """The docs' ``watch ... --where ... --for S`` when no row qualifies: not silence, one line on stderr (stdout
    stays JSON lines) naming the condition, the time and the commits it read."""
    path = ViewPaths(settings.lake_uri, CWC, 1).table
    _windows(path, {"c1": 2})
    _windows(path, {"c2": 3})
    env = {"KAPPA_HOME": str(settings.home), "KAPPA_LAKE_URI": settings.lake_uri, "PATH": "/usr/bin:/bin"}

    def watch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kappa.front.cli", "watch", CWC, *args], cwd=ROOT, env=env,
                              text=True, capture_output=True, timeout=120)

    proc = watch("--where", "view_count >= 20", "--from", "0", "--for", "1")
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"no change of {CWC} matched `view_count >= 20` in "), proc.stderr
    assert proc.stderr.rstrip().endswith(f"(read {CWC}@v1's Delta versions 0..1)"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = watch("--for", "1")  # from now on: nothing committed while it watched
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith(f"no change of {CWC} in ") and \
        proc.stderr.rstrip().endswith(f"({CWC}@v1 committed nothing after Delta version 1)"), proc.stderr
    proc = watch("--where", "view_count >= 3", "--from", "0", "--for", "1")  # it matches: JSON only, no summary
    assert [json.loads(line)["row"]["campaign_id"] for line in proc.stdout.splitlines()] == ["c2"]
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

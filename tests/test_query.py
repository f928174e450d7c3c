"""``kappa.front.query.run_query``: SQL over the serving views with delta-rs + DuckDB, on real Delta tables."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import duckdb
import pytest
from deltalake import write_deltalake

from kappa.config import Settings
from kappa.identity import ViewPaths
from kappa.front.query import QueryError, parse_as_of, run_query
from kappa.control.registry import Registry, utcnow
from kappa.control.serving import ServingAlias

CWC = "campaign_window_counts"
SESSIONS = "user_sessions"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    return Settings.from_env()


def table(settings: Settings, view: str, version: int = 1) -> str:
    return ViewPaths(settings.lake_uri, view, version).table


def write_windows(path: str, counts: dict[str, int], *, last_event: datetime = T0, mode: str = "append") -> None:
    """campaign_window_counts rows: one 10 s window per campaign."""
    values = ", ".join(f"('{c}', {n})" for c, n in counts.items())
    rel = duckdb.connect().sql(
        f"SELECT campaign_id, TIMESTAMPTZ '2024-05-01 12:00:00+00' AS window_start, "
        f"TIMESTAMPTZ '2024-05-01 12:00:10+00' AS window_end, n::BIGINT AS view_count, "
        f"TIMESTAMPTZ '{last_event.isoformat()}' AS last_event_time, false AS is_final "
        f"FROM (VALUES {values}) t(campaign_id, n)"
    )
    write_deltalake(path, rel, mode=mode)


def write_sessions(path: str, last_events: list[datetime]) -> None:
    values = ", ".join(f"('u{i}', TIMESTAMPTZ '{ts.isoformat()}')" for i, ts in enumerate(last_events))
    rel = duckdb.connect().sql(
        f"SELECT user_id, last_event_time - INTERVAL 5 SECOND AS session_start, "
        f"last_event_time + INTERVAL 30 SECOND AS session_end, 3::BIGINT AS event_count, "
        f"2::BIGINT AS distinct_ads, last_event_time FROM (VALUES {values}) t(user_id, last_event_time)"
    )
    write_deltalake(path, rel, mode="append")


def promote(settings: Settings, view: str, version: int) -> None:
    """Register ``version`` of ``view`` (its table must exist), verify it and point the alias at it."""
    reg = Registry(settings.lake_uri)
    reg.register(view, version, code_module=f"jobs.{view}.v1", table_path=table(settings, view, version),
                 app_id=f"kappa:{view}@v{version}:t", starting="earliest", triggered_by="test")
    for state in ("caught_up", "verified"):
        reg.set_state(view, version, state, by="test")
    ServingAlias(settings.lake_uri, registry=reg).promote(view, version, by="test")


# ------------------------------------------------------------------------------------------------ answers
def test_query_reads_the_default_version_with_freshness(settings: Settings):
    before = utcnow() - timedelta(seconds=1)
    write_windows(table(settings, CWC), {"c1": 3, "c2": 5}, last_event=T0 + timedelta(seconds=40))

    res = run_query(f"SELECT campaign_id, view_count, last_event_time FROM {CWC} ORDER BY campaign_id")

    assert res.columns == ["campaign_id", "view_count", "last_event_time"]
    assert res.rows == [("c1", 3, T0 + timedelta(seconds=40)), ("c2", 5, T0 + timedelta(seconds=40))]
    assert res.rows[0][2].tzinfo is not None  # timestamps come back timezone-aware (UTC)
    fresh = res.freshness[CWC]
    assert (fresh.serving_version, fresh.delta_version, fresh.path) == (1, 0, table(settings, CWC))
    assert before <= fresh.last_commit <= utcnow()
    assert fresh.watermark == T0 + timedelta(seconds=10)  # max(last_event_time) - 30 s
    assert set(res.freshness) == {CWC}  # tables the SQL does not mention are not loaded


def test_user_sessions_watermark_is_the_latest_event(settings: Settings):
    write_sessions(table(settings, SESSIONS), [T0, T0 + timedelta(seconds=7)])

    res = run_query(f"select count(*) from {SESSIONS.upper()}")

    assert res.rows == [(2,)]
    assert res.freshness[SESSIONS].watermark == T0 + timedelta(seconds=7)


def test_query_follows_the_serving_alias(settings: Settings):
    write_windows(table(settings, CWC, 1), {"old": 1})
    write_windows(table(settings, CWC, 2), {"new": 2})
    assert run_query(f"SELECT campaign_id FROM {CWC}").rows == [("old",)]

    promote(settings, CWC, 2)

    res = run_query(f"SELECT campaign_id, view_count FROM {CWC}")
    assert res.rows == [("new", 2)]
    assert res.freshness[CWC].serving_version == 2


def test_registry_quarantine_and_events_are_queryable(settings: Settings):
    assert run_query("SELECT count(*) FROM registry").rows == [(0,)]  # no version registered yet: empty
    write_windows(table(settings, CWC, 1), {"c": 1})
    promote(settings, CWC, 1)
    rel = duckdb.connect().sql(
        "SELECT 'user_sessions' AS view, 1 AS version, 'ad-events' AS topic, 'not json' AS error"
    )
    write_deltalake(f"{settings.lake_uri}/quarantine", rel)

    assert run_query("SELECT view, version, state FROM registry").rows == [(CWC, 1, "serving")]
    assert run_query("SELECT error FROM quarantine").rows == [("not json",)]
    states = run_query('SELECT to_state FROM registry_events ORDER BY "at"').rows
    assert states == [("building",), ("caught_up",), ("verified",), ("serving",)]


# ------------------------------------------------------------------------------------------------ as of
def test_as_of_version(settings: Settings):
    path = table(settings, CWC)
    write_windows(path, {"c1": 1})
    write_windows(path, {"c2": 2})

    assert run_query(f"SELECT count(*) FROM {CWC}").rows == [(2,)]
    old = run_query(f"SELECT campaign_id FROM {CWC}", as_of="0")
    assert old.rows == [("c1",)] and old.freshness[CWC].delta_version == 0 and old.as_of == "0"
    with pytest.raises(QueryError, match=rf"^{CWC} has no Delta version 5 \(latest is 1\)$"):
        run_query(f"SELECT * FROM {CWC}", as_of="5")


def test_as_of_timestamp_time_travels_tables_and_the_alias(settings: Settings):
    write_windows(table(settings, CWC, 1), {"v1-a": 1})
    time.sleep(0.05)
    between = utcnow()
    time.sleep(0.05)
    write_windows(table(settings, CWC, 1), {"v1-b": 1})
    write_windows(table(settings, CWC, 2), {"v2": 1})
    promote(settings, CWC, 2)

    res = run_query(f"SELECT campaign_id FROM {CWC}", as_of=between.isoformat())

    assert res.rows == [("v1-a",)]  # before the promote the alias pointed to v1, at its first commit
    assert (res.freshness[CWC].serving_version, res.freshness[CWC].delta_version) == (1, 0)
    assert run_query(f"SELECT campaign_id FROM {CWC}").rows == [("v2",)]
    with pytest.raises(QueryError, match=rf"^{CWC} did not exist yet at 2000-01-01T00:00:00\+00:00"):
        run_query(f"SELECT * FROM {CWC}", as_of="2000-01-01T00:00:00Z")


def test_as_of_version_needs_a_single_table(settings: Settings):
    write_windows(table(settings, CWC), {"c": 1})
    write_sessions(table(settings, SESSIONS), [T0])
    with pytest.raises(QueryError, match="is a Delta version, which is per table; .* use an ISO timestamp"):
        run_query(f"SELECT * FROM {CWC}, {SESSIONS}", as_of="0")
    with pytest.raises(QueryError, match="expected a Delta version number or an ISO timestamp"):
        run_query(f"SELECT * FROM {CWC}", as_of="yesterday")
    assert parse_as_of("2024-05-01T12:00:00") == T0  # naive means UTC


# ------------------------------------------------------------------------------------------------ errors
def test_view_without_data_gives_a_hint(settings: Settings):
    with pytest.raises(QueryError) as info:
        run_query(f"SELECT * FROM {SESSIONS}")
    assert str(info.value) == f"view {SESSIONS} has no data yet: is its job running? (`make run`)"
    with pytest.raises(QueryError, match=r"^quarantine has no data yet"):
        run_query("SELECT * FROM quarantine")
    # a mention that DuckDB does not need (a comment) is not an error
    write_windows(table(settings, CWC), {"c": 1})
    assert run_query(f"SELECT count(*) FROM {CWC} -- unlike {SESSIONS}").rows == [(1,)]


def test_sql_errors_are_one_line(settings: Settings):
    with pytest.raises(QueryError) as info:
        run_query("SELEC 1")
    assert str(info.value).startswith("Parser Error: syntax error at or near") and "\n" not in str(info.value)

    with pytest.raises(QueryError) as info:
        run_query("SELECT * FROM campaigns_by_window")
    msg = str(info.value)
    assert "campaigns_by_window does not exist" in msg and f"queryable tables are {CWC}" in msg
    assert "\n" not in msg

    with pytest.raises(QueryError, match="empty query"):
        run_query("  ")


def test_queries_cannot_read_files(settings: Settings, tmp_path: Path):
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")
    with pytest.raises(QueryError, match="disabled"):
        run_query(f"SELECT * FROM read_csv('{secret}')")


# ------------------------------------------------------------------------------------------------ the CLI
def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from kappa.front import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_the_query_command_says_when_it_shows_fewer_rows_than_the_answer_has(settings: Settings, capsys):
    write_windows(table(settings, CWC), {f"c{i:02d}": i for i in range(60)})
    sql = f"SELECT campaign_id, view_count FROM {CWC} ORDER BY campaign_id"

    def shown(out: str) -> list[str]:
        return [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]

    code, out, _ = _cli(["query", sql], capsys)  # the default limit stays 50
    assert code == 0 and shown(out) == [f"c{i:02d}" for i in range(50)], out
    assert "50 of 60 rows shown (--limit N / --all)" in out.splitlines()
    code, out, _ = _cli(["query", sql, "--limit", "7"], capsys)
    assert code == 0 and len(shown(out)) == 7 and "7 of 60 rows shown (--limit N / --all)" in out, out
    code, out, _ = _cli(["query", sql, "--all"], capsys)
    assert code == 0 and shown(out) == [f"c{i:02d}" for i in range(60)] and "rows shown" not in out, out
    code, out, _ = _cli(["query", f"{sql} LIMIT 50"], capsys)  # the whole answer fits: nothing to say
    assert code == 0 and len(shown(out)) == 50 and "rows shown" not in out, out
    code, out, err = _cli(["query", sql, "--limit", "0"], capsys)  # misuse: one line, no traceback
    assert code == 2 and out == "" and err.startswith("error: ") and "--limit" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_query_command_shows_long_values_whole_and_the_platform_tables_without_a_version(
        settings: Settings, capsys):
    long_id = "campaign-" + "x" * 150 + "-end"  # wider than any terminal the table is drawn for
    write_windows(table(settings, CWC), {long_id: 3, "c1": 1})
    sql = f"SELECT campaign_id, view_count FROM {CWC} ORDER BY view_count DESC"
    code, out, _ = _cli(["query", sql], capsys)
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert code == 0 and "".join(cells).startswith(long_id + "c1"), out  # folded inside its cell, never cut
    code, out, _ = _cli(["query", sql, "--format", "csv"], capsys)
    assert code == 0 and out.splitlines() == ["campaign_id,view_count", f"{long_id},3", "c1,1"], out
    code, out, _ = _cli(["query", sql, "--format", "json"], capsys)
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == [
        {"campaign_id": long_id, "view_count": 3}, {"campaign_id": "c1", "view_count": 1}], out
    code, out, err = _cli(["query", sql, "--format", "xml"], capsys)  # misuse: one line
    assert code == 2 and err.startswith("error: ") and "--format" in err and len(err.strip().splitlines()) == 1, err
    write_deltalake(f"{settings.lake_uri}/quarantine", duckdb.connect().sql(
        "SELECT 'user_sessions' AS view, 1 AS version, 'ad-events' AS topic, 'not json' AS error"))
    code, out, _ = _cli(["query", "SELECT count(*) AS n FROM quarantine"], capsys)
    footer = [line for line in out.splitlines() if line.startswith("quarantine:")]
    assert code == 0 and footer and "vNone" not in out and "serving" not in footer[0], out

"""The analysts' SQL service (``bin/kappa sql serve``), driven by real clients as an analyst runs them: PyHive over
the JDBC/HiveServer2 endpoint and pyspark-client over Spark Connect, from their own venv
(``infra/local/requirements-analyst.lock``), and Spark's beeline. The lake's tables are written here with delta-rs,
so every expected answer is what was written, not what any code of the platform computed.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pytest
from deltalake import DeltaTable, write_deltalake

from kappa.config import Settings
from kappa.control.registry import Registry
from kappa.control.serving import ServingAlias
from kappa.front.venvs import ensure_venv
from kappa.identity import ViewPaths
from kappa.log.broker import free_port
from tests.sql_client import Client

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
VIEW = "campaign_window_counts"
V1_FIRST = {"c1": 3, "c2": 5}
V1_SECOND = {"c3": 7}
V2 = {"c1": 30, "c2": 50, "c3": 70, "c4": 90}
READ = f"SELECT campaign_id, view_count FROM analytics.{VIEW} ORDER BY campaign_id"


def _windows(path: str, counts: dict[str, int], *, extra: bool = False) -> None:
    values = ", ".join(f"('{c}', {n})" for c, n in counts.items())
    rel = duckdb.connect().sql(
        "SELECT campaign_id, TIMESTAMPTZ '2024-05-01 12:00:00+00' AS window_start, "
        "TIMESTAMPTZ '2024-05-01 12:00:10+00' AS window_end, n::BIGINT AS view_count, "
        "TIMESTAMPTZ '2024-05-01 12:00:40+00' AS last_event_time, false AS is_final"
        + (", 'v2'::VARCHAR AS note" if extra else "") + f" FROM (VALUES {values}) t(campaign_id, n)")
    # the views' tables record their change feed (an append's rows are its inserts)
    write_deltalake(path, rel, mode="append", configuration={"delta.enableChangeDataFeed": "true"})


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sql")
    env = {**os.environ, "KAPPA_HOME": str(root / "home"), "KAPPA_LAKE_URI": str(root / "lake")}
    env.pop("KAPPA_SQL_TOKEN", None)
    settings = Settings.from_env(env)
    v1 = ViewPaths(settings.lake_uri, VIEW, 1).table
    _windows(v1, V1_FIRST)
    _windows(v1, V1_SECOND)
    _windows(ViewPaths(settings.lake_uri, VIEW, 2).table, V2, extra=True)
    jdbc, connect = free_port(), free_port()
    log = open(root / "sql.log", "w")
    proc = subprocess.Popen([str(ROOT / "bin" / "kappa"), "sql", "serve", "--jdbc-port", str(jdbc),
                             "--connect-port", str(connect), "--poll", "1", "--nice", "7"], env=env, cwd=ROOT,
                            stdout=log,
                            stderr=subprocess.STDOUT)
    python = ensure_venv(ROOT, "analyst-venv", "infra/local/requirements-analyst.lock")
    ready = Path(settings.home) / "sql" / "ready"
    deadline = time.monotonic() + 600
    while not ready.exists():
        assert proc.poll() is None, f"the service exited ({proc.returncode}): {(root / 'sql.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the service did not listen within 600 s"
        time.sleep(1)
    token = (Path(settings.home) / "sql" / "token").read_text().strip()
    clients: list[Client] = []

    def open_client(kind: str, secret: str | None = None) -> Client:
        client = Client(python, kind, jdbc if kind == "jdbc" else connect, token if secret is None else secret)
        clients.append(client)
        return client

    yield {"settings": settings, "open": open_client, "jdbc": jdbc, "token": token, "v1": v1, "log": root / "sql.log",
           "pid": proc.pid}
    for client in clients:
        client.close()
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _promote(settings: Settings, version: int) -> None:
    reg = Registry(settings.lake_uri)
    if reg.get(VIEW, version) is None:
        reg.register(VIEW, version, code_module=f"jobs.{VIEW}.v1", table_path=ViewPaths(settings.lake_uri, VIEW,
                     version).table, app_id=f"kappa:{VIEW}@v{version}:t", starting="earliest", triggered_by="test")
        for state in ("caught_up", "verified"):
            reg.set_state(VIEW, version, state, by="test")
    ServingAlias(settings.lake_uri, registry=reg).promote(VIEW, version, by="test")


def _until(client: Client, sql: str, want: list[list[Any]], timeout: float = 60.0) -> float:
    began = time.monotonic()
    while (got := client.rows(sql)) != want:
        assert time.monotonic() - began < timeout, f"{sql}: still {got}, want {want}"
        time.sleep(0.5)
    return time.monotonic() - began


def test_both_endpoints_answer_from_the_serving_version_and_follow_a_promotion_in_open_sessions(service):
    jdbc, connect = service["open"]("jdbc"), service["open"]("connect")
    assert jdbc.opened == {"ready": True} and connect.opened == {"ready": True}, (jdbc.opened, connect.opened)
    v1 = sorted([c, n] for c, n in {**V1_FIRST, **V1_SECOND}.items())
    assert jdbc.rows(READ) == v1 and connect.rows(READ) == v1
    assert [VIEW] == [r[1] for r in jdbc.rows("SHOW TABLES IN analytics")]

    settings = service["settings"]
    _promote(settings, 1)  # v1 registered and serving: a rollback target once v2 serves
    _promote(settings, 2)
    v2 = sorted([c, n] for c, n in V2.items())
    took = _until(jdbc, READ, v2)
    _until(connect, READ, v2)
    print(f"promotion seen by an open JDBC session after {took:.1f} s")
    assert jdbc.rows(f"SELECT DISTINCT note FROM analytics.{VIEW}") == [["v2"]]  # v2's own column

    ServingAlias(settings.lake_uri).rollback(VIEW, by="test")
    _until(jdbc, READ, v1)
    _until(connect, READ, v1)


def test_time_travel_change_feed_and_freshness(service):
    jdbc = service["open"]("jdbc")
    table = DeltaTable(service["v1"])
    if ServingAlias(service["settings"].lake_uri).target(VIEW).version != 1:
        pytest.skip("another test left v2 serving")  # the promotion test rolls back; never reached in order
    first = sorted([c, n] for c, n in V1_FIRST.items())
    assert jdbc.rows(f"SELECT campaign_id, view_count FROM analytics.{VIEW} VERSION AS OF 0 ORDER BY 1") == first
    changes = jdbc.rows(f"SELECT campaign_id, _change_type, _commit_version FROM table_changes('analytics.{VIEW}', 1)")
    assert changes == [["c3", "insert", 1]], changes

    _until(jdbc, "SELECT view, serving_version, delta_version FROM kappa.freshness", [[VIEW, 1, table.version()]])
    (row,) = jdbc.rows("SELECT last_commit, watermark FROM kappa.freshness")
    committed = datetime.fromtimestamp(table.history(1)[0]["timestamp"] / 1000, timezone.utc)
    assert row[0].startswith(committed.strftime("%Y-%m-%d %H:%M:%S")), (row, committed)
    # the view's watermark: max(window_end) - 10 s of delay, from the files' statistics
    assert row[1].startswith("2024-05-01 12:00:"), row


WRITES = [
    f"INSERT INTO analytics.{VIEW} SELECT * FROM analytics.{VIEW}",
    f"DELETE FROM analytics.{VIEW} WHERE true",
    f"UPDATE analytics.{VIEW} SET view_count = 0",
    f"MERGE INTO analytics.{VIEW} t USING analytics.{VIEW} s ON t.campaign_id = s.campaign_id "
    "WHEN MATCHED THEN DELETE",
    f"DROP TABLE analytics.{VIEW}",
    f"ALTER TABLE analytics.{VIEW} SET LOCATION '/tmp'",
    "CREATE TABLE stolen USING delta LOCATION '{lake}/stolen' AS SELECT 1 AS a",
    "CREATE VIEW analytics.mine AS SELECT 1 AS a",
    f"OPTIMIZE analytics.{VIEW}",
    f"VACUUM analytics.{VIEW}",
    f"CACHE TABLE analytics.{VIEW}",
    "ADD JAR /tmp/x.jar",
    "CREATE FUNCTION f AS 'x.Y'",
    "SELECT reflect('java.lang.System', 'getenv', 'HOME')",
    "SELECT * FROM text.`/etc/hostname`",
    "SELECT TRANSFORM(campaign_id) USING 'cat' FROM analytics.campaign_window_counts",
]


def test_writes_and_reads_outside_the_lake_are_refused_and_change_nothing(service):
    jdbc, connect = service["open"]("jdbc"), service["open"]("connect")
    lake = service["settings"].lake_uri
    before = {p: DeltaTable(p).version() for p in (service["v1"], ViewPaths(lake, VIEW, 2).table)}
    listing = sorted(str(p) for p in Path(lake).rglob("*"))
    for statement in WRITES:
        answer = jdbc.ask(sql=statement.format(lake=lake))
        assert "kappa sql is read-only" in answer.get("error", ""), f"{statement}: {answer}"
    assert "kappa sql is read-only" in connect.ask(sql=WRITES[0])["error"]
    for op, extra in (("write", {"path": f"{lake}/stolen"}), ("read_file", {"path": "/etc/hostname"}),
                      ("python_udf", {}), ("add_artifact", {})):
        answer = connect.ask(op=op, **extra)
        assert "kappa sql is read-only" in answer.get("error", ""), f"{op}: {answer}"
    assert {p: DeltaTable(p).version() for p in before} == before
    assert sorted(str(p) for p in Path(lake).rglob("*")) == listing  # not a file added, none removed
    # still serving, and the session survived its refusals
    assert jdbc.rows(f"SELECT count(*) FROM analytics.{VIEW}")[0][0] > 0
    # SPARK-58658: the Config RPC would return the token if it were in the Spark conf; it is not there
    assert connect.ask(op="token_conf") == {"rows": [[None]]}


def test_a_client_without_the_token_is_refused(service):
    for kind in ("jdbc", "connect"):
        for secret in ("", "not-the-token"):
            client = service["open"](kind, secret)
            assert "error" in client.opened and "ready" not in client.opened, (kind, secret, client.opened)


def test_beeline_reads_with_the_token(service):
    beeline = ROOT / ".cache" / "venv" / "bin" / "beeline"  # pyspark's: its venv first on PATH, as when activated
    env = {**os.environ, "PATH": f"{beeline.parent}{os.pathsep}{os.environ['PATH']}"}
    url = f"jdbc:hive2://127.0.0.1:{service['jdbc']}/"
    ok = subprocess.run([str(beeline), "-u", url, "-n", "analyst", "-p", service["token"], "--outputformat=csv2",
                         "-e", f"SELECT count(*) AS n FROM analytics.{VIEW}"], capture_output=True, text=True,
                        timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:] + "\nthe service's log:\n" + service["log"].read_text()[-4000:]
    serving = DeltaTable(ServingAlias(service["settings"].lake_uri).target(VIEW).table_path)
    rows = sum(serving.get_add_actions(flatten=True).column("num_records").to_pylist())
    # the csv2 header and its one row; beeline's JVM may log after it (a slow exit on a busy machine)
    assert re.search(rf"\bn\n{rows}\n", ok.stdout + "\n"), ok.stdout
    refused = subprocess.run([str(beeline), "-u", url, "-n", "analyst", "-p", "wrong", "-e", "SELECT 1"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode != 0 and "Error validating the login" in refused.stdout + refused.stderr


def test_the_token_command_prints_and_rotates_the_local_token(service):
    settings = service["settings"]
    env = {**os.environ, "KAPPA_HOME": str(settings.home), "KAPPA_LAKE_URI": settings.lake_uri}
    env.pop("KAPPA_SQL_TOKEN", None)

    def token(*args: str) -> str:
        out = subprocess.run([str(ROOT / "bin" / "kappa"), "sql", "token", *args], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert token() == service["token"]
    rotated = token("--rotate")
    assert rotated != service["token"] and len(rotated) >= 40
    assert (Path(settings.home) / "sql" / "token").read_text().strip() == rotated
    assert oct((Path(settings.home) / "sql" / "token").stat().st_mode & 0o777) == "0o600"
    refused = subprocess.run([str(ROOT / "bin" / "kappa"), "sql", "token", "--rotate"],
                             env={**env, "KAPPA_SQL_TOKEN": "from-a-secret"}, cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "KAPPA_SQL_TOKEN" in refused.stderr and "Traceback" not in refused.stderr


def test_the_service_and_its_jvm_run_at_the_priority_asked(service):
    """`--nice` (make run's stack passes kappa.front.stack.SQL_NICE): the analysts' queries yield the cores to the
    views. The service's process and the JVM it started both run at the lowered priority."""
    import psutil

    proc = psutil.Process(service["pid"])
    jvms = [c for c in proc.children(recursive=True) if c.name() == "java"]
    assert jvms, [c.name() for c in proc.children(recursive=True)]
    assert {p.nice() for p in (proc, *jvms)} == {os.getpriority(os.PRIO_PROCESS, 0) + 7}

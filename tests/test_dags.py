"""The DAGs in dags/ parse cleanly, offline and light, and their Params are typed JSON-schema inputs.

Also: a bad request fails the replay DAG at its first task in one line, without retries and without touching
anything (the end-to-end replay through ``dag.test()`` is in ``test_replay.py``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.airflow

REPO = Path(__file__).resolve().parents[1]
DAGS = REPO / "dags"
#: Modules a DAG file must not import at parse time (Spark, the job plumbing, Kafka/Delta clients).
HEAVY = ("pyspark", "kappa.runtime.job", "kappa.control.replay", "kappa.control.registry", "confluent_kafka", "deltalake", "jobs")


def _no_network(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("network access while parsing DAGs")


def _dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_dagbag_imports_without_errors_and_without_network(airflow_home, monkeypatch):
    # the DAGs' own (Task SDK) timetable class since Airflow 3.2
    from airflow.sdk.definitions.timetables.simple import NullTimetable

    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    bag = _dagbag()
    assert bag.import_errors == {}
    assert set(bag.dags) == {p.stem for p in DAGS.glob("*.py")} == {"kappa_replay", "kappa_retire",
                                                                     "kappa_rollback"}
    for dag_id, dag in bag.dags.items():
        assert Path(dag.fileloc).stem == dag_id
        assert dag.doc_md and dag_id in dag.doc_md
        assert dag.is_paused_upon_creation is False, f"{dag_id}: must run without being unpaused first"
        if dag_id == "kappa_retire":  # the only scheduled one: hourly, never catching up on missed hours
            assert (dag.timetable.expression, dag.catchup, dag.max_active_runs) == ("0 * * * *", False, 1)
            # its first run is at the next full hour, not when Airflow starts (before its API server answers)
            from datetime import UTC, datetime

            from airflow.serialization.decoders import decode_timetable
            from airflow.serialization.encoders import encode_timetable
            from airflow.timetables.base import TimeRestriction

            scheduled = decode_timetable(encode_timetable(dag.timetable))  # as the scheduler reads it
            first = scheduled.next_dagrun_info(last_automated_data_interval=None, restriction=TimeRestriction(
                earliest=dag.start_date, latest=None, catchup=False))
            assert first.run_after > datetime.now(UTC) and first.run_after.minute == 0, first
        else:
            assert isinstance(dag.timetable, NullTimetable), f"{dag_id} must only run when triggered"


def test_dag_files_import_nothing_heavy_at_parse_time(airflow_home):
    code = (
        "import json, socket, sys\n"
        "def no(*a, **k): raise AssertionError('network at parse time')\n"
        "socket.socket.connect = no; socket.create_connection = no\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r})\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'errors': {k: str(v)[:300] for k, v in bag.import_errors.items()}, 'heavy': heavy, "
        "'dags': sorted(bag.dags)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"errors": {}, "heavy": [], "dags": ["kappa_replay", "kappa_retire", "kappa_rollback"]}


def test_replay_params_are_typed_with_json_schema_constraints(airflow_home):
    from kappa.catalog import load_catalog

    dag = _dagbag().dags["kappa_replay"]
    schema = {name: dag.params.get_param(name).schema for name in dag.params}
    assert set(schema) == {"view", "version", "start", "start_timestamp_ms", "start_offsets", "end",
                           "end_timestamp_ms", "upgrade", "verify", "auto_promote", "keep_hours", "max_offsets_per_trigger",
                           "max_lag", "watch_minutes", "watch_max_quarantine_rate", "watch_max_lag", "cascade",
                           "dry_run", "source"}
    assert schema["view"]["enum"] == sorted(load_catalog().views)
    assert schema["version"]["type"] == "integer" and schema["version"]["minimum"] == 1
    assert schema["start"]["enum"] == ["earliest", "timestamp", "offsets"]
    assert schema["end"]["enum"] == ["live", "timestamp"]
    assert schema["verify"]["enum"] == ["strict", "none"]
    assert schema["upgrade"]["enum"] == [None, "replay", "continue"]
    assert schema["source"]["enum"] == ["auto", "log", "archive"] and dag.params["source"] == "auto"
    assert schema["auto_promote"]["type"] == "boolean" and schema["dry_run"]["type"] == "boolean"
    assert schema["cascade"]["type"] == "boolean" and dag.params["cascade"] is False
    assert schema["keep_hours"]["type"] == "number" and schema["keep_hours"]["minimum"] == 0
    assert schema["start_timestamp_ms"]["type"] == ["null", "integer"]
    sensor = dag.task_dict["wait_caught_up"]
    assert sensor.mode == "reschedule"
    assert list(dag.task_dict) == ["preflight", "launch", "wait_caught_up", "wait_chain", "verify",
                                   "promote_requested", "promote", "watch"]
    assert dag.task_dict["wait_chain"].mode == "reschedule"
    assert dag.task_dict["promote"].upstream_task_ids == {"promote_requested", "verify"}
    assert dag.task_dict["watch"].upstream_task_ids == {"promote"}
    assert schema["watch_minutes"]["minimum"] == 0 and schema["watch_max_quarantine_rate"]["maximum"] == 1

    rollback = _dagbag().dags["kappa_rollback"]
    assert {n: rollback.params.get_param(n).schema.get("type") for n in rollback.params} == {
        "view": "string", "to_version": "integer", "keep_hours": "number", "cascade": "boolean"}
    assert rollback.params.get_param("to_version").schema["minimum"] == 1


def test_invalid_params_are_refused_before_any_task_runs(airflow_home):
    from airflow.sdk.exceptions import ParamValidationError

    dag = _dagbag().dags["kappa_replay"]
    with pytest.raises(ParamValidationError, match="less than the minimum of 1"):
        dag.test(run_conf={"view": "campaign_window_counts", "version": 0})
    with pytest.raises(ParamValidationError, match="is not one of"):
        dag.test(run_conf={"view": "nope", "version": 2})


def test_inconsistent_params_fail_the_first_task_in_one_line_without_retries(airflow_home, tmp_path, monkeypatch,
                                                                             capfd):
    """start=timestamp without start_timestamp_ms passes the schema but not ReplayRequest.validate()."""
    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    dag = _dagbag().dags["kappa_replay"]
    run = dag.test(run_conf={"view": "campaign_window_counts", "version": 2, "start": "timestamp"})
    states = {ti.task_id: (ti.state, ti.try_number) for ti in run.get_task_instances()}
    assert run.state == "failed"
    assert states["preflight"] == ("failed", 1)  # AirflowFailException: no retry
    assert {states[t][0] for t in ("launch", "wait_caught_up", "verify", "promote")} == {"upstream_failed"}
    assert not (tmp_path / "lake").exists()  # nothing registered, nothing started
    logged = capfd.readouterr()
    assert "start=timestamp needs start_timestamp_ms (epoch milliseconds >= 0)" in logged.out + logged.err


def test_rollback_dag_refuses_a_version_that_never_served(airflow_home, tmp_path, monkeypatch):
    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    dag = _dagbag().dags["kappa_rollback"]
    run = dag.test(run_conf={"view": "campaign_window_counts", "to_version": 3})
    (ti,) = run.get_task_instances()
    assert run.state == "failed" and (ti.state, ti.try_number) == ("failed", 1)


def test_retire_dag_and_cli_delete_exactly_the_versions_past_their_keep(airflow_home, tmp_path, monkeypatch, capsys):
    """Real registry, alias and Delta tables: v1 replaced by v2 is kept 7 days by default (nothing to delete);
    rolled back to v1 with no keep period, v2 expires at once. A dry run deletes nothing; the DAG deletes v2
    (table and checkpoint) and marks it so it can never serve again; the serving v1 stays; a second run and
    `kappa retire` find nothing left to do."""
    import duckdb
    from deltalake import write_deltalake

    from kappa.control import replay
    from kappa.front.cli import main
    from kappa.config import DEFAULT_KEEP_HOURS, Settings
    from kappa.control.registry import Registry, utcnow
    from tests.helpers import FakeRunner

    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    monkeypatch.setenv("KAPPA_RUNNER", "local")
    settings = Settings.from_env()
    registry, view = Registry(settings.lake_uri), "campaign_window_counts"
    folders = {}
    for version in (1, 2):
        vv = replay.ViewVersion.resolve(view, version, settings)
        write_deltalake(vv.paths.table, duckdb.sql(f"SELECT {version} AS v"))
        Path(vv.paths.checkpoint, "main").mkdir(parents=True)
        folders[version] = Path(vv.paths.table).parent
        registry.register(view, version, code_module=vv.module, table_path=vv.paths.table, app_id="kappa:t",
                          starting="earliest", triggered_by="test")
        for state in ("caught_up", "verified"):
            registry.set_state(view, version, state, by="test")
    runner = FakeRunner(running={1, 2})  # the DAG's own runner is the real local one
    replay.promote(view, 1, settings, runner, by="test")
    replay.promote(view, 2, settings, runner, by="test")  # v1 retired, kept the default period
    v1 = registry.get(view, 1)
    assert abs((v1.delete_after - utcnow()).total_seconds() - DEFAULT_KEEP_HOURS * 3600) < 120

    dag = _dagbag().dags["kappa_retire"]
    hours = iter(range(1, 10))

    def run_dag(**conf: Any) -> Any:  # each run an hour of its own, as the scheduler would run them
        from datetime import UTC, datetime, timedelta

        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=next(hours))
        return dag.test(run_conf=conf, logical_date=hour)

    first = run_dag(dry_run=True)
    ti = first.get_task_instances()[0]
    assert first.state == "success" and ti.xcom_pull(task_ids="retire_expired") == []
    assert ti.xcom_pull(task_ids="end_expired_leases") == []  # no replay took a lease here
    assert ti.xcom_pull(task_ids="clean_airflow_history")["dry_run"] is True

    replay.rollback(view, 1, settings, runner, by="test", keep_hours=0)  # v2: expired at once
    dry = run_dag(dry_run=True)
    ti = dry.get_task_instances()[0]
    assert dry.state == "success" and [r["version"] for r in ti.xcom_pull(task_ids="retire_expired")] == [2]
    assert folders[2].is_dir() and registry.get(view, 2).deleted_at is None

    run = run_dag(dry_run=False)  # explicit: dag.test() keeps the previous run_conf in the DAG's params
    ti = run.get_task_instances()[0]
    assert run.state == "success", [t.state for t in run.get_task_instances()]
    (deleted,) = ti.xcom_pull(task_ids="retire_expired")
    assert (deleted["version"], deleted["deleted"]) == (2, True), deleted["message"]
    assert not folders[2].exists() and folders[1].is_dir()
    # (its `airflow db clean` as the scheduler runs it: tests/test_airflow_client.py)
    # the registry's tables: compacted and checkpointed (each state change above was a commit of its own)
    from deltalake import DeltaTable

    from kappa.identity import registry_table

    kept = ti.xcom_pull(task_ids="keep_registry")
    assert {"versions", "events", "serving"} <= set(kept), kept
    versions = DeltaTable(registry_table(settings.lake_uri, "versions"))
    assert len(versions.file_uris()) == 1 and "compacted" in kept["events"], (versions.file_uris(), kept)
    assert any(p.name.endswith(".checkpoint.parquet")
               for p in Path(registry_table(settings.lake_uri, "events"), "_delta_log").iterdir())
    assert registry.get(view, 2).deleted_at is not None and registry.get(view, 1).state == "serving"
    with pytest.raises(replay.ReplayError, match="cannot roll back"):
        replay.rollback(view, 2, settings, runner, by="test")

    again = run_dag(dry_run=False)
    ti = again.get_task_instances()[0]
    assert again.state == "success" and ti.xcom_pull(task_ids="retire_expired") == []
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["retire"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "nothing to retire: no retired version is past its keep period"

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
HEAVY = ("pyspark", "kappa.job", "kappa.replay", "kappa.registry", "confluent_kafka", "deltalake", "jobs")


def _no_network(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("network access while parsing DAGs")


def _dagbag() -> Any:
    from airflow.models.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS), include_examples=False)


def test_dagbag_imports_without_errors_and_without_network(airflow_home, monkeypatch):
    from airflow.timetables.simple import NullTimetable

    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    bag = _dagbag()
    assert bag.import_errors == {}
    assert set(bag.dags) == {p.stem for p in DAGS.glob("*.py")} == {"kappa_replay", "kappa_rollback"}
    for dag_id, dag in bag.dags.items():
        assert Path(dag.fileloc).stem == dag_id
        assert dag.doc_md and dag_id in dag.doc_md
        assert isinstance(dag.timetable, NullTimetable), f"{dag_id} must only run when triggered (schedule=None)"
        assert dag.is_paused_upon_creation is False, f"{dag_id}: a trigger from the UI must run without unpausing"


def test_dag_files_import_nothing_heavy_at_parse_time(airflow_home):
    code = (
        "import json, socket, sys\n"
        "def no(*a, **k): raise AssertionError('network at parse time')\n"
        "socket.socket.connect = no; socket.create_connection = no\n"
        "from airflow.models.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r}, include_examples=False)\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'errors': {k: str(v)[:300] for k, v in bag.import_errors.items()}, 'heavy': heavy, "
        "'dags': sorted(bag.dags)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"errors": {}, "heavy": [], "dags": ["kappa_replay", "kappa_rollback"]}


def test_replay_params_are_typed_with_json_schema_constraints(airflow_home):
    from kappa.catalog import load_catalog

    dag = _dagbag().dags["kappa_replay"]
    schema = {name: dag.params.get_param(name).schema for name in dag.params}
    assert set(schema) == {"view", "version", "start", "start_timestamp_ms", "start_offsets", "end",
                           "end_timestamp_ms", "verify", "auto_promote", "keep_hours", "max_offsets_per_trigger",
                           "max_lag", "watch_minutes", "watch_max_quarantine_rate", "watch_max_lag", "dry_run"}
    assert schema["view"]["enum"] == sorted(load_catalog().views)
    assert schema["version"]["type"] == "integer" and schema["version"]["minimum"] == 1
    assert schema["start"]["enum"] == ["earliest", "timestamp", "offsets"]
    assert schema["end"]["enum"] == ["live", "timestamp"]
    assert schema["verify"]["enum"] == ["strict", "none"]
    assert schema["auto_promote"]["type"] == "boolean" and schema["dry_run"]["type"] == "boolean"
    assert schema["keep_hours"]["type"] == "number" and schema["keep_hours"]["minimum"] == 0
    assert schema["start_timestamp_ms"]["type"] == ["null", "integer"]
    sensor = dag.task_dict["wait_caught_up"]
    assert sensor.mode == "reschedule"
    assert list(dag.task_dict) == ["preflight", "launch", "wait_caught_up", "verify", "promote_requested", "promote",
                                   "watch"]
    assert dag.task_dict["promote"].upstream_task_ids == {"promote_requested", "verify"}
    assert dag.task_dict["watch"].upstream_task_ids == {"promote"}
    assert schema["watch_minutes"]["minimum"] == 0 and schema["watch_max_quarantine_rate"]["maximum"] == 1

    rollback = _dagbag().dags["kappa_rollback"]
    assert {n: rollback.params.get_param(n).schema.get("type") for n in rollback.params} == {
        "view": "string", "to_version": "integer", "keep_hours": "number"}
    assert rollback.params.get_param("to_version").schema["minimum"] == 1


def test_invalid_params_are_refused_before_any_task_runs(airflow_home):
    from airflow.exceptions import ParamValidationError

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

"""A view version's run, resolved once (kappa.runtime.checkpoint.open_run) for the job and the control plane.

Real Delta tables through delta-rs and real checkpoint folders; the object-store case runs on the project's S3-API
store (the ``object_store`` fixture).
"""

from __future__ import annotations

import json

import pytest
from deltalake import DeltaTable, write_deltalake

from kappa.identity import RUN_ID_PROPERTY, ViewPaths
from kappa.runtime.checkpoint import RunMismatch, current_run_id, open_run, run_info, save_run_info
from kappa.runtime.deltars import I64, arrow_rows, arrow_schema

COLUMNS = (("n", I64),)


def _table(paths: ViewPaths, run_id: str, *, rows: int) -> None:
    """The view table as the job creates it (run id in its properties), with ``rows`` appended after."""
    DeltaTable.create(paths.table, arrow_schema(COLUMNS), configuration={RUN_ID_PROPERTY: run_id},
                      raise_if_key_not_exists=False)
    if rows:
        write_deltalake(paths.table, arrow_rows(COLUMNS, [{"n": i} for i in range(rows)]), mode="append")


def test_a_new_run_is_recorded_once_and_resumed_after(tmp_path) -> None:
    paths = ViewPaths(str(tmp_path), "clicks", 3)
    assert current_run_id(paths) is None
    first = open_run(paths, starting="earliest")
    assert first["view"] == "clicks" and first["version"] == 3 and first["starting"] == "earliest"
    assert json.loads((tmp_path / "views/clicks/v3/checkpoint/run.json").read_text())["run_id"] == first["run_id"]
    assert open_run(paths, starting="latest")["run_id"] == first["run_id"]  # a resumed run keeps its id
    assert current_run_id(paths) == first["run_id"]


def test_a_registered_run_id_is_kept_and_the_table_s_id_wins_over_the_checkpoint_s(tmp_path) -> None:
    paths = ViewPaths(str(tmp_path), "clicks", 1)
    assert open_run(paths, run_id="abc123")["run_id"] == "abc123"
    _table(paths, "abc123", rows=0)
    assert current_run_id(paths) == "abc123"


def test_an_empty_table_lends_its_run_id_to_a_lost_checkpoint(tmp_path) -> None:
    paths = ViewPaths(str(tmp_path), "clicks", 1)
    _table(paths, "feed01", rows=0)  # created, nothing written: safe to adopt
    assert open_run(paths, run_id="other")["run_id"] == "feed01"


def test_a_table_with_data_of_a_run_whose_checkpoint_is_gone_is_refused(tmp_path) -> None:
    paths = ViewPaths(str(tmp_path), "clicks", 1)
    _table(paths, "feed01", rows=3)
    with pytest.raises(RunMismatch, match="checkpoint is gone"):
        open_run(paths)
    assert run_info(paths.checkpoint) == {}  # nothing recorded for a refused run


def test_a_checkpoint_of_another_run_than_the_table_s_is_refused(tmp_path) -> None:
    paths = ViewPaths(str(tmp_path), "clicks", 1)
    open_run(paths, run_id="aaaa")
    _table(paths, "bbbb", rows=1)
    with pytest.raises(RunMismatch, match="checkpoint run aaaa does not match the table's run bbbb"):
        open_run(paths)


def test_run_json_is_written_and_read_on_an_object_store_lake_too(object_store, monkeypatch) -> None:
    # before, run.json was only written on local lakes: a restarted driver on S3 found no checkpoint run and
    # refused its own table (the "checkpoint is gone" branch)
    import uuid

    for key, value in object_store.delta_rs_options().items():
        monkeypatch.setenv(key, value)
    paths = ViewPaths(f"s3a://kappa/run-identity-{uuid.uuid4().hex[:8]}", "clicks", 2)
    save_run_info(paths.checkpoint, {"run_id": "s3run", "view": "clicks", "version": 2})
    assert run_info(paths.checkpoint)["run_id"] == "s3run"


def test_a_job_reaches_its_run_json_through_its_spark_session_on_any_store(spark, tmp_path) -> None:
    # what a view job on an object store does (HadoopFiles: the session's file system and credentials); here
    # the store is Hadoop's file: one, the same code path as s3a://
    from kappa.runtime.spark import HadoopFiles

    files = HadoopFiles(spark)
    paths = ViewPaths(f"file://{tmp_path}", "clicks", 4)
    assert files.read(f"{paths.checkpoint}/run.json") is None
    first = open_run(paths, files=files, starting="earliest")
    on_disk = json.loads((tmp_path / "views/clicks/v4/checkpoint/run.json").read_text())
    assert on_disk["run_id"] == first["run_id"] and on_disk["starting"] == "earliest"
    assert open_run(paths, files=files)["run_id"] == first["run_id"]
    assert run_info(paths.checkpoint)["run_id"] == first["run_id"]  # and the control plane reads the same file

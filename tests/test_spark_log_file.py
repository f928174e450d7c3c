"""A command's own Spark session logs to a file, not the terminal (``Settings.spark_log_file``: the CLI's replay,
verify and repair use ``<home>/logs/spark-cli.log``): its JVM's warnings do not interleave with the command's
output, and neither do the JVM's own notices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (its own JVM) from the repository; it must exit 0."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.timeout(300)
def test_a_session_with_a_log_file_keeps_the_jvm_log_off_the_terminal(tmp_path):
    log_file = tmp_path / "logs" / "spark-cli.log"
    env = {**os.environ, "KAPPA_HOME": str(tmp_path / "home"), "KAPPA_SPARK_LOG_FILE": str(log_file)}
    code = ("from kappa.config import Settings\n"
            "from kappa.runtime.spark import build_spark\n"
            "spark = build_spark('log-file-test', Settings.from_env())\n"
            "spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getLogger('kappa.test').warn('marker 42')\n"
            "print('rows', spark.range(3).count())\n"
            # the state store object stop_spark stops before Spark (reachable through py4j: a typo is silent there)
            "state = spark.sparkContext._jvm.org.apache.spark.sql.execution.streaming.state\n"
            "print('maintenance', getattr(getattr(state, 'StateStore$'), 'MODULE$').isMaintenanceRunning())\n"
            "from kappa.runtime.spark import stop_spark\n"
            "stop_spark(spark)\n")
    proc = _python(code, env)
    assert proc.stdout.strip().splitlines()[-2:] == ["rows 3", "maintenance False"], proc.stdout
    logged = log_file.read_text()
    assert "WARN test: marker 42" in logged, logged[-2000:]
    # Spark's start-up chatter and the JVM's own notices went to the file; the terminal got none of it
    assert proc.stderr == "", proc.stderr[-3000:]
    assert "WARNING: Using incubator modules" in logged, logged[:2000]


@pytest.mark.timeout(300)
def test_an_airflow_tasks_spark_logs_each_line_at_its_own_level_and_its_jvm_ends_before_the_process(tmp_path):
    """An Airflow task's stderr is logged as *error* by the task runner: a session started after
    ``jvm_output_to_logging()`` (what every DAG task does) prints into Python logging instead - a warning as a
    warning, an error and its stack trace as an error, the JVM's own notices as info - and nothing onto stderr.
    ``end_jvm()`` leaves no JVM behind when the process ends (its shutdown hooks ran to their end)."""
    env = {**os.environ, "KAPPA_HOME": str(tmp_path / "home")}
    env.pop("KAPPA_SPARK_LOG_FILE", None)
    code = ("import logging, sys\n"
            "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(levelname)s|%(name)s|%(message)s')\n"
            "from kappa.config import Settings\n"
            "from kappa.runtime.spark import build_spark, end_jvm, jvm_output_to_logging, stop_spark\n"
            "jvm_output_to_logging()\n"
            "spark = build_spark('log-level-test', Settings.from_env())\n"
            "jvm = spark.sparkContext._jvm\n"
            "logger = jvm.org.apache.logging.log4j.LogManager.getLogger('kappa.test')\n"
            "logger.warn('marker 42')\n"
            "logger.error('marker 43', jvm.java.lang.IllegalStateException('boom'))\n"
            "print('rows', spark.range(3).count(), flush=True)\n"
            "pid = spark.sparkContext._gateway.proc.pid\n"
            "stop_spark(spark)\n"
            "end_jvm()\n"
            "import psutil\n"
            "print('jvm alive', psutil.pid_exists(pid) and psutil.Process(pid).status() != 'zombie', flush=True)\n")
    proc = _python(code, env)
    lines = proc.stdout.splitlines()
    assert "rows 3" in lines and lines[-1] == "jvm alive False", proc.stdout[-3000:]
    assert "WARNING|spark|test: marker 42" in lines, proc.stdout[-3000:]
    at = lines.index("ERROR|spark|test: marker 43")
    assert lines[at + 1] == "ERROR|spark|java.lang.IllegalStateException: boom", lines[at:at + 4]
    assert lines[at + 2].startswith("ERROR|spark|\tat "), lines[at:at + 4]  # the stack at the error's level
    assert any(line.startswith("INFO|spark|WARNING: Using incubator modules") for line in lines), proc.stdout[:3000]
    assert proc.stderr == "", proc.stderr[-3000:]

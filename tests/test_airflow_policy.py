"""The platform's Airflow policy plugin (kappa/front/airflow_policy.py, this package's ``airflow.policy`` entry
point): every Airflow process loads it at its start, and a LocalExecutor worker's HTTP error then reaches the
scheduler instead of killing it (apache/airflow#64476)."""

from __future__ import annotations

import subprocess
import sys

#: A LocalExecutor's path, in miniature: a forked worker puts the exception a failed execution API call raised on a
#: multiprocessing queue; the scheduler process reads it (LocalExecutor._read_results).
SCRIPT = """
import multiprocessing, sys
import httpx
if sys.argv[1] == "airflow":
    import airflow  # noqa: F401 - Airflow's settings load the policy entry points, as every Airflow process does
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()

def worker():
    try:
        request = httpx.Request("PATCH", "http://api-server:8080/execution/task-instances/x/run")
        httpx.Response(400, request=request, text="conflict").raise_for_status()
    except Exception as exc:
        queue.put(("key", "failed", exc))

child = ctx.Process(target=worker)
child.start()
try:
    key, state, exc = queue.get(timeout=60)
    print(state, type(exc).__name__, exc)
except Exception as exc:
    print("scheduler crashed:", type(exc).__name__, exc)
child.join()
"""


def _run(mode: str, tmp_path) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={"AIRFLOW_HOME": str(tmp_path / "airflow"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_a_workers_http_error_reaches_the_scheduler_as_a_plain_error(tmp_path) -> None:
    # the fault, without Airflow's settings loaded: what crashed the scheduler
    assert _run("plain", tmp_path).startswith("scheduler crashed: TypeError HTTPStatusError.__init__() missing 2")
    # in an Airflow process: the plugin was loaded at its start, the error arrives with its message
    line = _run("airflow", tmp_path)
    assert line.startswith("failed RuntimeError HTTPStatusError: Client error '400 Bad Request' for url "
                           "'http://api-server:8080/execution/task-instances/x/run'"), line


def test_the_plugin_is_declared_where_airflow_looks_for_it() -> None:
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="airflow.policy") if ep.value == "kappa.front.airflow_policy"]
    assert len(found) == 1, list(entry_points(group="airflow.policy"))

"""Loaded by every Airflow process at its start (this package's ``airflow.policy`` entry point, the plugin group
Airflow's settings load before anything else: the scheduler, its LocalExecutor workers, the API server, the DAG
processor, the triggerer - the local stack's and the chart's alike). It sets no policy; it keeps the scheduler up.

**A task's HTTP error no longer kills the scheduler** (apache/airflow#64476, Airflow 3.3.2). A LocalExecutor worker
that fails to start a task - its call to the execution API answered 4xx/5xx without a JSON body, or a conflict after
a restart - puts the exception on a ``multiprocessing`` queue for the scheduler. ``httpx.HTTPStatusError`` takes
``request`` and ``response`` as keyword-only arguments, which pickle cannot pass back, so unpickling it in the
scheduler raised ``TypeError: HTTPStatusError.__init__() missing 2 required keyword-only arguments`` and the
scheduler exited - twice during one in-cluster replay, each restart resetting the replay's queued task. Here the
error pickles as a plain ``RuntimeError`` with the same message (the scheduler only logs it and marks the task
failed; Airflow's task retries run it again).
"""

from __future__ import annotations

import httpx

__all__ = ["picklable_http_errors"]


def _as_runtime_error(kind: str, message: str) -> RuntimeError:
    return RuntimeError(f"{kind}: {message}")


def _reduce(self: httpx.HTTPStatusError) -> tuple:
    return _as_runtime_error, (type(self).__name__, str(self))


def picklable_http_errors() -> None:
    """Make ``httpx.HTTPStatusError`` (and its subclasses) pickle as a ``RuntimeError`` carrying its message."""
    httpx.HTTPStatusError.__reduce__ = _reduce  # type: ignore[method-assign]


picklable_http_errors()

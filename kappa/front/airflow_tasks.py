"""What the platform's DAG tasks (``dags/``) leave for ``kappa airflow trigger --wait``: why a task failed, in one line.

A task that fails writes its reason - the one line of the platform's refusal (a :class:`kappa.errors.KappaError`,
turned into ``AirflowFailException`` by the DAG) or of whatever else stopped it - to the XCom
:data:`FAILURE_XCOM_KEY` of its task instance before the exception leaves it, while the task still runs (the task
SDK sends it through the execution API at once). Airflow clears a task's XComs when a try starts, so what is read
after the run is the reason of the task's last try. :class:`kappa.front.airflow_client.AirflowAPI` reads it through
the REST API, and the command line prints it instead of the bare "failed (tasks ...)".

Nothing here imports Airflow at module level: the DAG files import it when they are parsed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kappa.errors import KappaError, one_line

__all__ = ["FAILURE_XCOM_KEY", "PROGRESS_XCOM_KEY", "progress_from_logs", "reason_of", "record_progress",
           "records_failure"]

#: XCom key of a failed task's one-line reason.
FAILURE_XCOM_KEY = "kappa_failure"
#: XCom key of a waiting task's latest progress line (what it logs at each poke), for ``kappa airflow trigger --wait``.
PROGRESS_XCOM_KEY = "kappa_progress"

log = logging.getLogger("kappa.front.airflow_tasks")

F = TypeVar("F", bound=Callable[..., Any])


def _not_a_failure(exc: BaseException) -> bool:
    """Skips and reschedules are how a task says "not now" or "nothing to do": no reason to record."""
    from airflow.sdk.exceptions import AirflowRescheduleException, AirflowSkipException

    return isinstance(exc, (AirflowSkipException, AirflowRescheduleException))


def reason_of(exc: BaseException) -> str:
    """One line: the message of a refusal (``AirflowFailException``, a :class:`kappa.errors.KappaError`: written to
    be read as is), the type and message of anything else (``KafkaException: ...``)."""
    from airflow.sdk.exceptions import AirflowFailException

    if isinstance(exc, (AirflowFailException, KappaError)):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)}" if str(exc).strip() else type(exc).__name__


def _record(reason: str) -> None:
    from airflow.sdk import get_current_context

    get_current_context()["ti"].xcom_push(key=FAILURE_XCOM_KEY, value=reason[:2000])


def record_progress(line: str) -> None:
    """Record a waiting task's latest progress line (each poke of a sensor), so that ``kappa airflow trigger
    --wait`` shows what the task log shows: the same line, not only the task's state."""
    from airflow.sdk import get_current_context

    get_current_context()["ti"].xcom_push(key=PROGRESS_XCOM_KEY, value=line[:2000])


class _ProgressLines(logging.Handler):
    """Each line logged at INFO or above becomes the task's progress line (:func:`record_progress`)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record_progress(record.getMessage())
        except Exception:  # noqa: BLE001 - progress is a courtesy: the task's work goes on without it
            pass


@contextlib.contextmanager
def progress_from_logs(*loggers: str) -> Iterator[None]:
    """While the block runs, what ``loggers`` log at INFO is also the task's progress line, so ``kappa airflow
    trigger --wait`` shows a long task's way (a verification: its ETA, its re-run's batches, each comparison)
    as its log does, instead of only "running"."""
    handler = _ProgressLines(level=logging.INFO)
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)


def records_failure(fn: F) -> F:
    """Decorate a DAG task's function (below ``@task``): an exception leaving it first records its one-line reason
    in the task instance's XCom :data:`FAILURE_XCOM_KEY`, then goes on as it was (retries, failure).

    A Spark session the task starts prints into the task's log at each line's own level
    (:func:`kappa.runtime.spark.jvm_output_to_logging`). The wrapper keeps the function's signature
    (``functools.wraps``), so Airflow still passes the context arguments it declares (``params``, ``run_id``...)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from kappa.runtime.spark import jvm_output_to_logging

        jvm_output_to_logging()  # Spark's own lines at their level, not as the task's stderr (logged as errors)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not _not_a_failure(exc):
                try:
                    _record(reason_of(exc))
                except Exception as push:  # noqa: BLE001 - the task's own failure is what matters
                    log.warning("could not record the failure reason: %s", one_line(push))
            raise

    return wrapper  # type: ignore[return-value]

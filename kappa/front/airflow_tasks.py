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

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from kappa.errors import KappaError, one_line

__all__ = ["FAILURE_XCOM_KEY", "reason_of", "records_failure"]

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


def records_failure(fn: F) -> F:
    """Decorate a DAG task's function (below ``@task``): an exception leaving it first records its one-line reason
    in the task instance's XCom :data:`FAILURE_XCOM_KEY`, then goes on as it was (retries, failure).

    The wrapper keeps the function's signature (``functools.wraps``), so Airflow still passes the context
    arguments it declares (``params``, ``run_id``...)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
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

"""The local Airflow's REST API (v2) for operators: trigger a DAG with its Params and follow the run.

``kappa airflow trigger kappa_replay --conf '{...}'`` is the documented way to start a replay through Airflow from
a shell: it logs in with the stack's ``admin`` user, triggers the run (Airflow validates the conf against the DAG's
Params) and prints the run's URL in the UI. ``--wait`` follows the run's task states until it ends. It needs no
Airflow on the client side, and answers in one line when Airflow is not up or refuses the request.

The calls go through the official client, ``apache-airflow-client`` (``airflow_client.client``: ``DAGApi``,
``DagRunApi``, ``TaskInstanceApi``), released in step with Airflow and generated from its OpenAPI spec. What the
library lacks is kept here, and only that:

- the login: Airflow 3's simple auth manager hands out a JWT at ``POST /auth/token`` (outside ``/api/v2``); the
  client only takes the token (``Configuration(access_token=...)``), so this module asks for it - with urllib3, the
  library's own HTTP stack - and asks again once when Airflow rejects an expired one;
- one-line errors: the library raises ``ApiException`` subclasses (status, reason, JSON body) for answers and
  urllib3's ``MaxRetryError`` when nothing answers; both become :class:`AirflowError` with Airflow's detail;
- the polling loop of ``--wait`` (the library's ``wait_dag_run_until_finished`` is an experimental stream without
  the task states the CLI prints), which outlasts an API server that stops answering for a while;
- why a run failed: the one-line reason each failed task of the platform's DAGs records in its XCom
  ``kappa_failure`` (:mod:`kappa.front.airflow_tasks`), read back by :meth:`AirflowAPI.failure_reasons`.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import urllib3
from airflow_client import client as af
from airflow_client.client.exceptions import ApiException, ForbiddenException, UnauthorizedException

from kappa.errors import KappaError

__all__ = ["AirflowAPI", "AirflowError", "RunState"]

#: Run states after which nothing changes any more.
FINISHED = frozenset({"success", "failed"})
#: Task states in which a task may record progress (a sensor between two pokes, or poking).
_WAITING = frozenset({"running", "up_for_reschedule", "queued", "scheduled"})
#: Task instances listed per request (a platform DAG has about ten tasks).
_TASKS_PAGE = 100
#: Seconds in a row ``--wait`` keeps polling an Airflow that stopped answering: the chart's API server container is
#: restarted after 5 missed liveness checks 30 s apart and takes 1-2 minutes to start again on 2 busy cores.
UNREACHABLE_PATIENCE = 600.0

T = TypeVar("T")


class AirflowError(KappaError, RuntimeError):
    """Airflow is unreachable or refused the request (one line); ``status`` is Airflow's HTTP answer, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RunState:
    """A DAG run's state and its tasks' states."""

    dag_id: str
    run_id: str
    state: str
    tasks: dict[str, str]
    #: the latest progress line of each task that waits (a sensor's poke: :func:`kappa.front.airflow_tasks.record_progress`)
    progress: dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class AirflowAPI:
    """Airflow 3's REST API (``/api/v2``) through ``apache-airflow-client``, with a token from ``/auth/token``."""

    def __init__(self, base_url: str, username: str, password: str, *, timeout: float = 30.0,
                 unreachable_hint: str = "is the URL right, and the port-forward (if any) running?") -> None:
        self.base_url = base_url.rstrip("/")
        self.username, self.password = username, password
        self.timeout = timeout
        self.unreachable_hint = unreachable_hint
        self._token: str | None = None
        self._client: af.ApiClient | None = None

    @classmethod
    def local(cls, settings: Any) -> AirflowAPI:
        """The local stack's Airflow (``make run``): its URL and the generated ``admin`` password."""
        from kappa.front.stack import airflow_password, airflow_url

        password = airflow_password(settings)
        if password is None:
            raise AirflowError(f"no Airflow password under {settings.home}/airflow yet: is Airflow running "
                               f"(`make run`, `{settings.cli} status`)?")
        return cls(airflow_url(settings), "admin", password, unreachable_hint="start it with `make run`")

    # ------------------------------------------------------------------------------------------- HTTP
    def _unreachable(self, exc: Exception) -> AirflowError:
        reason = getattr(exc, "reason", None) or exc
        return AirflowError(f"Airflow is not reachable at {self.base_url} ({reason}); {self.unreachable_hint}")

    def token(self) -> str:
        """A JWT for the API (cached for this client): ``POST /auth/token``, which the library does not wrap."""
        if self._token is None:
            try:
                resp = urllib3.request("POST", f"{self.base_url}/auth/token", retries=1, timeout=self.timeout,
                                       json={"username": self.username, "password": self.password})
            except urllib3.exceptions.HTTPError as exc:
                raise self._unreachable(exc) from None
            if resp.status not in (200, 201):
                raise AirflowError(f"Airflow answered {resp.status} to POST /auth/token: "
                                   f"{_detail(resp.data.decode(errors='replace'), resp.reason)}", resp.status)
            self._token = str(resp.json()["access_token"])
        return self._token

    def _api(self) -> af.ApiClient:
        if self._client is None:
            self._client = af.ApiClient(af.Configuration(host=self.base_url, access_token=self.token(), retries=1))
        return self._client

    def _call(self, what: str, call: Callable[[af.ApiClient], T]) -> T:
        """``call`` with the library's API client; Airflow's refusals and silence become one-line errors."""
        for attempt in (1, 2):
            try:
                return call(self._api())
            except (UnauthorizedException, ForbiddenException) as exc:
                if attempt == 1 and "token" in str(exc.body or "").lower():  # expired: log in again, once
                    self._token = self._client = None
                    continue
                raise self._answered(what, exc) from None
            except ApiException as exc:
                raise self._answered(what, exc) from None
            except urllib3.exceptions.HTTPError as exc:
                raise self._unreachable(exc) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _answered(what: str, exc: ApiException) -> AirflowError:
        return AirflowError(f"Airflow answered {exc.status} to {what}: {_detail(exc.body, exc.reason)}", exc.status)

    # ------------------------------------------------------------------------------------------- runs
    def has_dag(self, dag_id: str) -> bool:
        """Whether Airflow has parsed ``dag_id`` (it can be triggered)."""
        try:
            self._call(f"GET dag {dag_id}", lambda c: af.DAGApi(c).get_dag(dag_id, _request_timeout=self.timeout))
        except AirflowError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def run_url(self, dag_id: str, run_id: str) -> str:
        """The run's page in the Airflow UI."""
        return f"{self.base_url}/dags/{urllib.parse.quote(dag_id)}/runs/{urllib.parse.quote(run_id, safe='')}"

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, *, note: str | None = None) -> str:
        """Trigger ``dag_id`` now with ``conf`` (checked against its Params by Airflow); returns the run id."""
        body = af.TriggerDAGRunPostBody(logical_date=None, conf=dict(conf or {}), note=note)
        run = self._call(f"trigger {dag_id}", lambda c: af.DagRunApi(c).trigger_dag_run(
            dag_id, body, _request_timeout=self.timeout))
        return str(run.dag_run_id)

    def state(self, dag_id: str, run_id: str) -> RunState:
        """The run's state and the state of each of its tasks."""
        info = self._call(f"GET {dag_id} run {run_id}", lambda c: af.DagRunApi(c).get_dag_run(
            dag_id, run_id, _request_timeout=self.timeout))
        tasks = self._call(f"GET {dag_id} run {run_id} tasks", lambda c: af.TaskInstanceApi(c).get_task_instances(
            dag_id, run_id, limit=_TASKS_PAGE, _request_timeout=self.timeout))
        return RunState(dag_id, run_id, _value(info.state), {
            t.task_id: _value(t.state) for t in tasks.task_instances})

    def failure_reasons(self, state: RunState) -> dict[str, str]:
        """Why the failed tasks of a finished run failed: ``{task: one line}`` from the XCom each of the platform's
        tasks records when it fails (:mod:`kappa.front.airflow_tasks`). A task that recorded nothing (killed, timed
        out outside its code, a DAG that does not record) is left out; so is one whose XCom cannot be read."""
        from kappa.front.airflow_tasks import FAILURE_XCOM_KEY

        return self._lines(state, [t for t, st in state.tasks.items() if st == "failed"], FAILURE_XCOM_KEY)

    def _lines(self, state: RunState, tasks: Iterable[str], key: str) -> dict[str, str]:
        """``{task: one line}`` of the XCom ``key`` each of ``tasks`` recorded in the run; a task that recorded
        nothing (404), or whose XCom cannot be read, is left out."""
        out: dict[str, str] = {}
        for task_id in tasks:
            try:
                entry = self._call(f"GET {state.dag_id} run {state.run_id} task {task_id} XCom {key}",
                                   lambda c, t=task_id: af.XComApi(c).get_xcom_entry(
                                       state.dag_id, t, state.run_id, key, deserialize=True,
                                       stringify=False, _request_timeout=self.timeout))
            except AirflowError:
                continue
            value = getattr(getattr(entry, "actual_instance", entry), "value", None)
            if value is not None and str(value).strip():
                out[task_id] = " ".join(str(value).split())
        return out

    def progress(self, state: RunState, tasks: Iterable[str] | None = None) -> dict[str, str]:
        """The latest progress line each of ``tasks`` (default: the run's waiting tasks) recorded (``{task: line}``);
        a task that recorded none, or whose XCom cannot be read, is left out."""
        from kappa.front.airflow_tasks import PROGRESS_XCOM_KEY

        waiting = [t for t, st in state.tasks.items() if st in _WAITING]
        return self._lines(state, waiting if tasks is None else tasks, PROGRESS_XCOM_KEY)

    def wait(self, dag_id: str, run_id: str, *, timeout: float = 3600.0, poll: float = 5.0,
             on_change: Callable[[RunState], None] | None = None, patience: float = UNREACHABLE_PATIENCE,
             on_silence: Callable[[str], None] | None = None) -> RunState:
        """Poll until the run has finished (success or failed); ``on_change`` sees every new state, with the
        progress lines of its waiting tasks (:meth:`progress`).

        The run goes on in Airflow whatever this poller meets: an API server that stops answering for a while (a
        busy node, its container restarted by its liveness probe) is polled again until it answers, for up to
        ``patience`` seconds in a row; ``on_silence`` gets one line when it stops answering and one when it answers
        again. Past ``patience`` the unreachable error is raised, saying the run goes on."""
        deadline = time.monotonic() + timeout
        last: RunState | None = None
        ended: dict[str, str] = {}  # the last line of each task that succeeded, read once
        asked: set[str] = set()
        silent_since: float | None = None
        while True:
            try:
                current = self.state(dag_id, run_id)
                done = [t for t, st in current.tasks.items() if st == "success" and t not in asked]
                ended.update(self.progress(current, done))
                asked.update(done)
                current = replace(current, progress={**ended, **self.progress(current)})
            except AirflowError as exc:
                if exc.status is not None:  # Airflow answered, and refused: nothing to wait for
                    raise
                now = time.monotonic()
                if silent_since is None:
                    silent_since = now
                    if on_silence is not None:
                        on_silence(f"Airflow is not answering ({exc}); polling again for up to {patience:.0f} s - "
                                   "the run goes on in Airflow meanwhile")
                if now - silent_since > patience or now > deadline:
                    raise AirflowError(f"{exc}; for {now - silent_since:.0f} s in a row - the run goes on in "
                                       f"Airflow: see {self.run_url(dag_id, run_id)}") from None
                time.sleep(poll)
                continue
            if silent_since is not None:
                if on_silence is not None:
                    on_silence(f"Airflow answers again (silent for {time.monotonic() - silent_since:.0f} s)")
                silent_since = None
            if on_change is not None and current != last:
                on_change(current)
            last = current
            if current.finished:
                return current
            if time.monotonic() > deadline:
                raise AirflowError(f"{dag_id} run {run_id} still {current.state} after {timeout:.0f} s; "
                                   f"see {self.run_url(dag_id, run_id)}")
            time.sleep(poll)


def _value(state: Any) -> str:
    """A state enum of the library as Airflow spells it (``str()`` of the enum gives ``DagRunState.QUEUED``);
    a task not scheduled yet has none."""
    return "none" if state is None else str(getattr(state, "value", state))


def _detail(body: str | bytes | None, reason: str | None) -> str:
    """Airflow's error detail, one line."""
    try:
        detail = json.loads(body or "").get("detail")
    except (ValueError, AttributeError):
        detail = None
    if not detail:
        return reason or "error"
    if isinstance(detail, list):  # pydantic validation errors
        detail = "; ".join(str(d.get("msg", d)) for d in detail if isinstance(d, dict)) or str(detail)
    return " ".join(str(detail).split())

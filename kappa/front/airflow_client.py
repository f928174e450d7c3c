"""The local Airflow's REST API (v2) for operators: trigger a DAG with its Params and follow the run.

``kappa airflow trigger kappa_replay --conf '{...}'`` is the documented way to start a replay through Airflow from
a shell: it logs in with the stack's ``admin`` user (``POST /auth/token`` of Airflow's simple auth manager; the
password Airflow generated at first start), triggers the run (``POST /api/v2/dags/<dag>/dagRuns``; Airflow
validates the conf against the DAG's Params) and prints the run's URL in the UI. ``--wait`` follows the run's
task states until it ends. It needs no Airflow on the client side - only HTTP - and answers in one line when
Airflow is not up or refuses the request.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kappa.errors import KappaError

__all__ = ["AirflowAPI", "AirflowError", "RunState"]

#: Run states after which nothing changes any more.
FINISHED = frozenset({"success", "failed"})


class AirflowError(KappaError, RuntimeError):
    """Airflow is unreachable or refused the request (one line)."""


@dataclass(frozen=True)
class RunState:
    """A DAG run's state and its tasks' states."""

    dag_id: str
    run_id: str
    state: str
    tasks: dict[str, str]

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


class AirflowAPI:
    """A small client of Airflow 3's REST API (``/api/v2``) with a token from ``/auth/token``."""

    def __init__(self, base_url: str, username: str, password: str, *, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.username, self.password = username, password
        self.timeout = timeout
        self._token: str | None = None

    @classmethod
    def local(cls, settings: Any) -> AirflowAPI:
        """The local stack's Airflow (``make run``): its URL and the generated ``admin`` password."""
        from kappa.front.stack import airflow_password, airflow_url

        password = airflow_password(settings)
        if password is None:
            raise AirflowError(f"no Airflow password under {settings.home}/airflow yet: is Airflow running "
                               f"(`make run`, `{settings.cli} status`)?")
        return cls(airflow_url(settings), "admin", password)

    # ------------------------------------------------------------------------------------------- HTTP
    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                 auth: bool = True) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise AirflowError(f"Airflow answered {exc.code} to {method} {path}: {_detail(exc)}") from None
        except OSError as exc:
            raise AirflowError(f"Airflow is not reachable at {self.base_url} ({exc}); start it with `make run`"
                               ) from None
        return json.loads(text) if text else {}

    def token(self) -> str:
        """A JWT for the API (cached for this client)."""
        if self._token is None:
            answer = self._request("POST", "/auth/token", {"username": self.username, "password": self.password},
                                   auth=False)
            self._token = str(answer["access_token"])
        return self._token

    # ------------------------------------------------------------------------------------------- runs
    def has_dag(self, dag_id: str) -> bool:
        """Whether Airflow has parsed ``dag_id`` (it can be triggered)."""
        try:
            self._request("GET", f"/api/v2/dags/{urllib.parse.quote(dag_id)}")
        except AirflowError as exc:
            if " 404 " in str(exc):
                return False
            raise
        return True

    def run_url(self, dag_id: str, run_id: str) -> str:
        """The run's page in the Airflow UI."""
        return f"{self.base_url}/dags/{urllib.parse.quote(dag_id)}/runs/{urllib.parse.quote(run_id, safe='')}"

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, *, note: str | None = None) -> str:
        """Trigger ``dag_id`` now with ``conf`` (checked against its Params by Airflow); returns the run id."""
        body: dict[str, Any] = {"logical_date": None, "conf": dict(conf or {})}
        if note:
            body["note"] = note
        answer = self._request("POST", f"/api/v2/dags/{urllib.parse.quote(dag_id)}/dagRuns", body)
        return str(answer["dag_run_id"])

    def state(self, dag_id: str, run_id: str) -> RunState:
        """The run's state and the state of each of its tasks."""
        dag, run = urllib.parse.quote(dag_id), urllib.parse.quote(run_id, safe="")
        info = self._request("GET", f"/api/v2/dags/{dag}/dagRuns/{run}")
        tasks = self._request("GET", f"/api/v2/dags/{dag}/dagRuns/{run}/taskInstances")
        return RunState(dag_id, run_id, str(info.get("state")), {
            t["task_id"]: str(t.get("state")) for t in tasks.get("task_instances", [])})

    def wait(self, dag_id: str, run_id: str, *, timeout: float = 3600.0, poll: float = 5.0,
             on_change: Callable[[RunState], None] | None = None) -> RunState:
        """Poll until the run has finished (success or failed); ``on_change`` sees every new state."""
        deadline = time.monotonic() + timeout
        last: RunState | None = None
        while True:
            current = self.state(dag_id, run_id)
            if on_change is not None and current != last:
                on_change(current)
            last = current
            if current.finished:
                return current
            if time.monotonic() > deadline:
                raise AirflowError(f"{dag_id} run {run_id} still {current.state} after {timeout:.0f} s; "
                                   f"see {self.run_url(dag_id, run_id)}")
            time.sleep(poll)


def _detail(exc: urllib.error.HTTPError) -> str:
    """Airflow's error detail, one line."""
    try:
        detail = json.loads(exc.read().decode()).get("detail")
    except (ValueError, OSError, AttributeError):
        return exc.reason or "error"
    if isinstance(detail, list):  # pydantic validation errors
        detail = "; ".join(str(d.get("msg", d)) for d in detail if isinstance(d, dict)) or str(detail)
    return " ".join(str(detail).split())

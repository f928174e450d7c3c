"""`kappa airflow trigger` when no Airflow answers or the command lacks what it needs: one line that says so, quickly
(the calls with a real Airflow - trigger, follow, a refused conf, an unknown DAG through --url - are in the
first-hour walk, tests/test_first_hour.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kappa.front.airflow_client import AirflowAPI, AirflowError
from kappa.log.broker import free_port


def test_an_airflow_that_does_not_answer_is_one_line_that_says_where_and_what_to_do() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    api = AirflowAPI(url, "admin", "secret", timeout=5, unreachable_hint="start it with `make run`")
    started = time.monotonic()
    with pytest.raises(AirflowError) as caught:
        api.trigger("kappa_replay", {"view": "campaign_window_counts", "version": 2})
    message = str(caught.value)
    assert message.startswith(f"Airflow is not reachable at {url} ("), message
    assert message.endswith("start it with `make run`") and "\n" not in message, message
    assert caught.value.status is None
    assert time.monotonic() - started < 10  # one retry, no backoff minutes


def _cli(env: dict[str, str], *args: str) -> str:
    """The CLI's only line (it must fail)."""
    proc = subprocess.run([sys.executable, "-m", "kappa.front.cli", "airflow", "trigger", *args],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


def test_the_cli_says_it_in_one_line_too(tmp_path) -> None:
    home = tmp_path / "home"
    (home / "airflow").mkdir(parents=True)
    # the password file Airflow's simple auth manager writes at its first start: the CLI finds it, Airflow is down
    (home / "airflow" / "simple_auth_manager_passwords.json.generated").write_text(json.dumps({"admin": "x"}))
    port = free_port()
    line = _cli({"KAPPA_HOME": str(home), "KAPPA_AIRFLOW_PORT": str(port)}, "kappa_replay")
    assert f"Airflow is not reachable at http://127.0.0.1:{port} (" in line, line
    assert line.endswith("start it with `make run`"), line  # the local stack's Airflow is started that way


def test_another_airflow_is_reached_with_url_and_the_password_from_the_environment_only(tmp_path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {"KAPPA_HOME": str(tmp_path / "home")}  # no local stack: no password file
    line = _cli(env, "kappa_replay", "--url", url)
    assert line == f"error: --url {url}: set KAPPA_AIRFLOW_PASSWORD to admin's password (it is never taken from " \
                   "the command line)", line
    line = _cli({**env, "KAPPA_AIRFLOW_PASSWORD": "secret"}, "kappa_replay", "--url", url, "--user", "ops")
    assert f"Airflow is not reachable at {url} (" in line, line
    assert "make run" not in line and line.endswith("port-forward (if any) running?"), line  # not the local stack

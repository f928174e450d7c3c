"""`kappa airflow trigger` when no Airflow answers or the command lacks what it needs: one line that says so, quickly
(the calls with a real Airflow - trigger, follow, a refused conf, an unknown DAG through --url - are in the
first-hour walk, tests/test_first_hour.py); and, against a real Airflow standalone (the local stack's, alone),
a run whose task the platform refuses: the reason the task recorded, in the command's one line; and the hourly
upkeep DAG as the scheduler runs it, Airflow's own history cleaned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.mark.timeout(180)
def test_a_task_started_before_the_api_server_listens_waits_for_it(tmp_path) -> None:
    """Standalone starts its scheduler beside its API server, which takes minutes on 2 busy cores; a task the
    scheduler starts meanwhile (kappa_retire's hourly run when Airflow starts just before a full hour) calls the
    execution API through Airflow's own task client. With the local stack's Airflow environment it waits for the
    server; with Airflow's defaults (5 calls within 15 s) it failed and logged a traceback per task. The fault - a
    server that is not listening yet - is a plain HTTP listener opened LATE seconds after the first call."""
    from kappa.config import Settings
    from kappa.front import stack

    late = 35
    port = free_port()
    settings = Settings.from_env({"KAPPA_HOME": str(tmp_path / "home"), "KAPPA_LAKE_URI": str(tmp_path / "lake")})
    env = {**stack.airflow_env(settings), "AIRFLOW_HOME": str(tmp_path / "airflow")}
    call = ("import sys, time; from airflow.sdk.api.client import Client\n"
            f"c = Client(base_url='http://127.0.0.1:{port}/execution/', token='t')\n"
            "print('calling', flush=True); t = time.monotonic()\n"
            "r = c.get('health')\n"
            "print(r.status_code, round(time.monotonic() - t))")
    client = subprocess.Popen([sys.executable, "-c", call], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    (tmp_path / "execution").mkdir()
    (tmp_path / "execution" / "health").write_text("{}")
    try:
        seen = []  # (the client's own log lines may come first; its imports take seconds)
        while not seen or seen[-1] != "calling":
            seen.append(client.stdout.readline().strip())
            assert seen[-1] or client.poll() is None, (seen, client.communicate())
        time.sleep(late)
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                   "--directory", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            out, err = client.communicate(timeout=120)
        finally:
            server.kill()
    finally:
        client.kill()
    assert client.returncode == 0, err[-3000:]
    status, waited = out.strip().splitlines()[-1].split()  # (the client logs its retries before)
    assert status == "200" and int(waited) >= late - 1, out + err[-3000:]


@pytest.fixture(scope="module")
def local_airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The local stack's Airflow (standalone, started as `make run` starts it, alone: no broker, no views), ready
    with the platform's DAGs; yields its KAPPA_HOME. The module's tests run their commands in its environment."""
    from kappa.config import Settings
    from kappa.front import stack
    from kappa.process import Daemon

    root = tmp_path_factory.mktemp("local-airflow")
    with pytest.MonkeyPatch.context() as patch:
        for key in list(os.environ):  # another test's Airflow settings (the airflow_home fixture) must not leak in
            if key.startswith("AIRFLOW") or key.startswith("KAPPA_"):
                patch.delenv(key)
        env = {"KAPPA_HOME": str(root / "home"), "KAPPA_LAKE_URI": str(root / "lake"),
               "KAPPA_AIRFLOW_PORT": str(free_port()), "KAPPA_RUNNER": "local"}
        for key, value in env.items():
            patch.setenv(key, value)
        settings = Settings.from_env()
        daemon = stack.start_airflow(settings)
        try:
            deadline = time.monotonic() + 600
            while not (stack.airflow_ready(settings) and AirflowAPI.local(settings).has_dag("kappa_rollback")
                       and AirflowAPI.local(settings).has_dag("kappa_retire")):
                assert daemon.pid() is not None, f"Airflow exited; see {daemon.log_file}"
                assert time.monotonic() < deadline, f"Airflow not ready after 600 s; see {daemon.log_file}"
                time.sleep(3)
            yield root / "home"
        finally:
            Daemon("airflow", settings).stop(timeout=60)


def _trigger(dag_id: str, conf: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`kappa airflow trigger DAG --conf ... --wait`, as an operator types it, against the local Airflow."""
    return subprocess.run([sys.executable, "-m", "kappa.front.cli", "airflow", "trigger", dag_id,
                           "--conf", json.dumps(conf), "--wait", "--timeout", "300"],
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=400)


@pytest.mark.integration
@pytest.mark.airflow
@pytest.mark.timeout(900)  # Airflow standalone's first start migrates its database: 1-3 min on 2 busy cores
def test_a_failed_run_says_why_in_one_line(local_airflow: Path) -> None:
    """The local Airflow runs kappa_rollback for a version nothing ever registered: the task refuses, and
    `kappa airflow trigger --wait` prints that refusal - the platform's own one line, as the task recorded it - in
    its one error line, exit 2, no traceback."""
    from kappa.config import Settings
    from kappa.control import replay
    from tests.helpers import FakeRunner

    proc = _trigger("kappa_rollback", {"view": "campaign_window_counts", "to_version": 2})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1, out
    # what the platform says to the same request, in this process (an empty registry either way)
    with pytest.raises(replay.ReplayError) as refused:
        replay.rollback("campaign_window_counts", 2, Settings.from_env(), FakeRunner(set()), by="test")
    reason = str(refused.value)
    assert reason and "\n" not in reason
    line = errors[0]
    assert line.startswith("error: kappa_rollback run "), line
    assert f" failed (tasks rollback): rollback: {reason}; see http://127.0.0.1:" in line, line


@pytest.mark.integration
@pytest.mark.airflow
@pytest.mark.timeout(900)
def test_the_hourly_upkeep_run_by_the_scheduler_cleans_airflow_history(local_airflow: Path) -> None:
    """kappa_retire as the local scheduler runs it every hour (its task processes, which Airflow 3 keeps away from
    the metadata database): a run made 40 days old is removed by its `airflow db clean`, the recent ones stay, and
    every task succeeds - nothing in the scheduler's or the tasks' logs at level error."""
    import sqlite3
    from datetime import UTC, datetime, timedelta

    database = local_airflow / "airflow" / "airflow.db"
    first = _trigger("kappa_retire", {"dry_run": True})
    assert first.returncode == 0 and re.search(r"^success ", first.stdout, re.M), first.stdout + first.stderr
    old_run = re.search(r"^kappa_retire: run (\S+)", first.stdout, re.M).group(1)
    with sqlite3.connect(database, timeout=60) as db:
        month_ago = (datetime.now(UTC) - timedelta(days=40)).strftime("%Y-%m-%d %H:%M:%S.000000")
        db.execute("UPDATE dag_run SET start_date = ? WHERE run_id = ?", (month_ago, old_run))
        db.execute("UPDATE task_instance SET start_date = ? WHERE run_id = ?", (month_ago, old_run))

    done = _trigger("kappa_retire", {})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(r"^success\s+retire_expired success\s+end_expired_leases success\s+"
                     r"clean_airflow_history success\s+keep_registry success", out, re.M), out
    new_run = re.search(r"^kappa_retire: run (\S+)", done.stdout, re.M).group(1)
    with sqlite3.connect(database, timeout=60) as db:
        runs = [run for (run,) in db.execute("SELECT run_id FROM dag_run WHERE dag_id = 'kappa_retire'")]
    assert old_run not in runs and new_run in runs, runs
    # (the other test's kappa_rollback run failed on purpose: only kappa_retire's lines count here)
    logs = [line for path in sorted(local_airflow.rglob("*.log")) for line in path.read_text().splitlines()
            if re.search(r'\[(error|critical)\s*\]|"level": ?"(error|critical)"', line) and
            ("kappa_retire" in line or "dag_id=kappa_retire" in str(path))]
    assert not logs, "\n".join(logs[:10])


class _SilentProxy:
    """A plain HTTP reverse proxy in front of a real Airflow that, once asked to, stops answering for ``silence``
    seconds: each request meanwhile hangs until the silence ends, then its connection is closed without an answer
    (the fault: an API server that stops answering - a busy node, its container restarted - which the real Airflow
    cannot be made to do on cue). Before and after, every request is forwarded as it came."""

    def __init__(self, target: str, silence: float) -> None:
        import http.server
        import threading

        import urllib3

        self.target, self.silence = target, silence
        self.quiet_until = 0.0
        self.dropped = 0
        http_pool = urllib3.PoolManager()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                wait = proxy.quiet_until - time.monotonic()
                if wait > 0:
                    proxy.dropped += 1
                    time.sleep(wait)
                    self.close_connection = True
                    return
                resp = http_pool.request(self.command, proxy.target + self.path, body=body or None,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"},
                                         redirect=False, preload_content=True)
                self.send_response(resp.status)
                for key, value in resp.headers.items():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(resp.data)))
                self.end_headers()
                self.wfile.write(resp.data)

            do_GET = do_POST = do_PATCH = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def go_quiet(self) -> None:
        self.quiet_until = time.monotonic() + self.silence

    def close(self) -> None:
        self.server.shutdown()


@pytest.mark.integration
@pytest.mark.airflow
@pytest.mark.timeout(900)
def test_wait_outlasts_an_api_server_that_stops_answering_for_a_while(local_airflow: Path) -> None:
    """`kappa airflow trigger ... --wait` as the docs run it against the chart's Airflow through a port-forward: the
    API server stopped answering for more than its 30 s read timeout right after the trigger (a busy node; seen
    in the cluster smoke), and `--wait` failed at its first silent poll although the run went on. Now it polls
    again until Airflow answers, says so, and reports the run's end: exit 0, the run's success line."""
    import threading

    from kappa.config import Settings
    from kappa.front.stack import airflow_password, airflow_url

    settings = Settings.from_env()
    proxy = _SilentProxy(airflow_url(settings), silence=45)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kappa.front.cli", "airflow", "trigger", "kappa_retire", "--url", proxy.url,
             "--conf", json.dumps({"dry_run": True}), "--wait", "--timeout", "600"],
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                 "KAPPA_AIRFLOW_PASSWORD": airflow_password(settings)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("kappa_retire: run "):
                    proxy.go_quiet()  # the run exists: the API server falls silent under the waiting command

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        proc.wait(timeout=700)
        reader.join(timeout=10)
        out, err = "".join(lines), proc.stderr.read()
    finally:
        proxy.close()
    assert proxy.dropped >= 1, out + err  # the fault happened: a poll met the silence
    assert proc.returncode == 0, out + err
    assert "Airflow is not answering (" in out and "the run goes on in Airflow" in out, out
    assert re.search(r"^Airflow answers again \(silent for \d+ s\)$", out, re.M), out
    assert re.search(r"^success ", out, re.M), out
    assert "Traceback" not in out + err, out + err

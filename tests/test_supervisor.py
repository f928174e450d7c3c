"""The local stack's supervisor (kappa.front.supervisor) with real processes: the live producer against the real
broker, killed with SIGKILL as a crash would end it. It comes back with backoff, `kappa status` says that it was
restarted and why, a producer stopped on purpose stays stopped, and one that dies at every start is left stopped
after a crash loop, said in one line. (The view host's restart: `make test-long`, tests/test_supervisor.py's slow
test - a JVM start and six views resuming.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kappa.front import stack, supervisor
from kappa.log.topics import partition_offsets
from kappa.process import Daemon, child_env

pytestmark = pytest.mark.integration


def _status(settings) -> str:
    """`kappa status`, as typed, in this home; its table's rows joined (rich wraps the 'where' column)."""
    done = subprocess.run([sys.executable, "-m", "kappa.front.cli", "status"], capture_output=True, text=True,
                          env={**os.environ, **child_env(settings), "COLUMNS": "2000"}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _wait(what: str, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


@pytest.mark.timeout(600)
def test_a_killed_producer_is_restarted_with_backoff_said_in_status_and_a_crash_loop_stops(lake, tmp_path,
                                                                                         monkeypatch):
    settings = lake.replace(home=tmp_path / "home")
    for key, value in child_env(settings).items():
        monkeypatch.setenv(key, value)
    # a quicker rhythm than the defaults (5 s polls, 5 s first backoff): the same code, a shorter test
    monkeypatch.setenv("KAPPA_SUPERVISE_POLL_SECONDS", "0.5")
    monkeypatch.setenv("KAPPA_SUPERVISE_BACKOFF_SECONDS", "0.5")
    producer = Daemon("producer", settings)
    try:
        first = stack.start_producer(settings, rate=20).pid()
        supervisor.want(settings, "producer", rate=20)
        watcher = supervisor.start(settings)
        assert watcher.pid() and first
        _wait("the supervisor saw it", lambda: getattr(supervisor.records(settings).get("producer"), "pid", 0) == first)

        # ---- a crash: killed by SIGKILL (started by `up`, not the supervisor's child: its status is not known)
        os.kill(first, signal.SIGKILL)
        second = _wait("the producer runs again", lambda: (producer.pid() or 0) not in (0, first) and producer.pid())
        out = _status(settings)
        assert re.search(rf"producer\s+running\s+.*restarted 1x, last [\d-]+ [\d:]+ UTC: pid {first} was gone", out), out
        assert re.search(r"supervisor\s+running", out), out
        # the supervisor's own child this time: how it ended is known
        os.kill(second, signal.SIGKILL)
        third = _wait("the producer runs again", lambda: (producer.pid() or 0) not in (0, second) and producer.pid())
        out = _status(settings)
        assert re.search(r"producer\s+running\s+.*restarted 2x, last .*: killed by SIGKILL", out), out
        record = supervisor.records(settings)["producer"]
        assert (record.restarts, record.failures) == (2, 2), record  # the second waited twice the first's backoff
        # and the restarted producer produces: the topic's end offsets grow
        topic = settings.topic("ad-events")
        produced = sum(high for _low, high in partition_offsets(settings, topic).values())
        _wait("the restarted producer produces",
              lambda: sum(high for _low, high in partition_offsets(settings, topic).values()) > produced + 20)

        # ---- stopped on purpose (`kappa producer stop`): it stays stopped
        done = subprocess.run([sys.executable, "-m", "kappa.front.cli", "producer", "stop"], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and "producer stopped" in done.stdout, done.stdout + done.stderr
        time.sleep(4)  # eight polls
        assert producer.pid() is None and supervisor.records(settings)["producer"].restarts == 2
        assert re.search(r"producer\s+stopped", _status(settings))

        # ---- `kappa producer start` while the supervisor runs: watched again; then it dies at every start
        done = subprocess.run([sys.executable, "-m", "kappa.front.cli", "producer", "start", "--rate", "20"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        killed = {third}
        deadline = time.monotonic() + 120
        while not supervisor.records(settings)["producer"].gave_up:
            pid = producer.pid()
            if pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            assert time.monotonic() < deadline, supervisor.records(settings)["producer"]
            time.sleep(0.1)
        time.sleep(2)  # it is left stopped
        assert producer.pid() is None
        out = _status(settings)
        line = re.search(r"producer\s+crash loop\s+(.*)", out)
        assert line, out
        assert re.search(rf"crash loop: producer stopped 6 times in a row, left stopped \(last .*: killed by "
                         rf"SIGKILL.*\); see .*producer\.log, then `{re.escape(settings.cli)} up`", line.group(1)), out
    finally:
        supervisor.stop(settings)
        producer.stop()
    assert Daemon("supervisor", settings).pid() is None
    assert "supervisor stopped" in (Path(settings.home) / "logs" / "supervisor.log").read_text()


def test_logs_under_the_home_are_bounded_while_their_writer_goes_on(tmp_path, monkeypatch):
    """A process log past the bound is moved aside and emptied in place while its writer (a real process, started
    as the platform starts its processes: its output appended to the log) goes on writing: its next lines land at
    the start of the emptied file, not after a hole of the old size; the previous content is in `<log>.1`.
    Airflow's task logs past 30 days are removed, the recent ones kept."""
    from kappa.config import Settings
    from kappa.process import spawn, terminate_group

    settings = Settings.from_env().replace(home=tmp_path / "home", log_max_mb=1 / 16)  # 64 KiB
    log_file = Path(settings.home) / "logs" / "writer.log"
    writer = spawn([sys.executable, "-u", "-c", "import itertools, time\n"
                    "for n in itertools.count():\n    print(f'line {n} ' + 'x' * 100); time.sleep(0.001)"],
                   log_file=log_file, settings=settings)
    try:
        _wait("the log is past the bound", lambda: log_file.stat().st_size > 128 * 1024)
        done = supervisor.keep_logs(settings)
        assert len(done) == 1 and done[0].startswith("logs/writer.log: ") and "moved to writer.log.1" in done[0]
        time.sleep(0.5)
    finally:
        terminate_group(writer.pid, 10)
    previous = (log_file.parent / "writer.log.1").read_text()
    now = log_file.read_bytes()
    assert len(previous) > 128 * 1024 and previous.startswith("line 0 ")
    assert now and not now.startswith(b"\0") and now.startswith(b"line "), now[:40]  # no hole: appended from 0
    last_before = int(previous.rstrip("\n").rsplit("\n", 1)[-1].split()[1])
    first_after = int(now.split(b"\n", 1)[0].split()[1])
    assert first_after > last_before  # the writer went on where it was (a line or two may fall between)

    task_logs = Path(settings.home) / "airflow" / "logs" / "dag_id=kappa_retire"
    old, recent = task_logs / "run_id=old" / "attempt=1.log", task_logs / "run_id=new" / "attempt=1.log"
    for path in (old, recent):
        path.parent.mkdir(parents=True)
        path.write_text("{}\n")
    month = time.time() - 31 * 86400
    os.utime(old, (month, month))
    assert supervisor.keep_logs(settings) == ["airflow/logs: 1 files older than 30 days removed"]
    assert not old.parent.exists() and recent.exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_view_host_is_restarted_and_every_view_goes_on(lake, tmp_path):
    """`bin/kappa up` (no Airflow), then the view host killed with SIGKILL: the supervisor starts it again, every
    view commits micro-batches after the restart, `bin/kappa status` says so, and `bin/kappa down` stops it all.
    (`make test-long`: a view host's JVM start and six views resuming, 2-4 minutes.)"""
    from tests.conftest import subprocess_env

    from kappa.runtime.checkpoint import batch_ids
    from kappa.runtime.host import host_pid
    from kappa.identity import ViewPaths

    settings = lake.replace(home=tmp_path / "home")
    env = subprocess_env(settings)
    root = Path(__file__).resolve().parents[1]
    up = subprocess.run(["bin/kappa", "up", "--no-airflow", "--rate", "50"], cwd=root, env=env, capture_output=True,
                        text=True, timeout=900)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "supervisor restarts what stopped" in up.stdout, up.stdout
        views = [ref.split("@v")[0] for ref in (p.stem for p in (Path(settings.home) / "run" / "host" / "desired")
                                                .glob("*.json"))]
        assert len(views) >= 5, views

        def batches() -> dict[str, int]:
            return {v: max(batch_ids(f"{ViewPaths(settings.lake_uri, v, 1).checkpoint}/main/commits"), default=-1)
                    for v in views}

        killed = host_pid(settings)
        os.kill(killed, signal.SIGKILL)
        before = batches()
        _wait("the view host runs again", lambda: (host_pid(settings) or killed) != killed, timeout=120)
        # every view that reads a live topic commits again (the catalog view only when its topic changes)
        _wait("the views commit after the restart",
              lambda: all(n > before[v] for v, n in batches().items() if v != "campaign_catalog"), timeout=600)
        status = subprocess.run(["bin/kappa", "status"], cwd=root, env={**env, "COLUMNS": "400"},
                                capture_output=True, text=True, timeout=120).stdout
        assert re.search(rf"view host\s+running\s+pid \d+, one JVM; restarted 1x, last .*: pid {killed} was gone",
                         status), status
    finally:
        down = subprocess.run(["bin/kappa", "down"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert down.returncode == 0 and "stopped supervisor" in down.stdout, down.stdout + down.stderr
    assert host_pid(settings) is None and Daemon("producer", settings).pid() is None

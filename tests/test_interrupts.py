"""A command interrupted by SIGTERM (``make`` interrupted, ``timeout``, a CI cancel) stops what it started and says
so in one line, as Ctrl-C does (kappa.process.interrupt_on_termination). ``make run`` interrupted is walked in
tests/test_first_hour.py and the CLI's replay in tests/test_replay.py; here ``make bench`` and the handler itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from kappa.process import interrupt_on_termination
from tests.helpers import processes_mentioning

ROOT = Path(__file__).resolve().parents[1]


def test_sigterm_unwinds_like_ctrl_c_inside_the_block_only():
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interrupt_on_termination():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here, in the main thread
            finally:
                cleaned.append(True)
                os.kill(os.getpid(), signal.SIGTERM)  # a second one during the clean-up is ignored
                time.sleep(0.1)
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_killed_process_another_process_has_not_reaped_yet_counts_as_exited():
    """`make down` in one terminal while `make run` still waits in another: the broker `make run` started dies as a
    zombie of that command until it reaps it. Stopping it is done then, not a failure after a long wait."""
    import sys

    from kappa.process import wait_exit

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "child = subprocess.Popen(['sleep', '300'])\n"
                               "print(child.pid, flush=True)\n"
                               "time.sleep(300)  # never reaps it"], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        assert not wait_exit(child, None, 0.5), "a live process is not counted as exited"
        child.kill()
        assert wait_exit(child, None, 30.0), "a zombie is counted as a live process"
        assert child.status() == psutil.STATUS_ZOMBIE  # still unreaped: the case under test
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_make_bench_interrupted_stops_its_broker(tmp_path):
    """The bench starts a KRaft broker of its own; SIGTERM to ``make bench`` (GNU make passes it to the
    command) while it runs leaves nothing of it running."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAPPA_KAFKA")}  # its own broker
    env.update({"KAPPA_HOME": str(home), "KAPPA_BENCH_EVENTS": "200000"})
    make = subprocess.Popen(["make", "--no-print-directory", "bench"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    from kappa.log.broker import LocalBroker

    pid_file = LocalBroker(home / "bench" / "broker", port=1, controller_port=2).pid_file
    try:
        deadline = time.monotonic() + 180
        while not (pid_file.is_file() and pid_file.read_text().strip()):
            assert make.poll() is None, make.communicate()
            assert time.monotonic() < deadline, "the bench started no broker"
            time.sleep(0.5)
        broker = psutil.Process(int(pid_file.read_text()))
        time.sleep(3)  # the broker is starting or serving the bench's producer
        make.send_signal(signal.SIGTERM)
        out, err = make.communicate(timeout=120)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
    assert make.returncode != 0
    assert "bench interrupted (SIGTERM): stopped the broker and every process it had started" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not broker.is_running() or broker.status() == psutil.STATUS_ZOMBIE
    assert processes_mentioning(home) == []

"""One driver per view version across machines, on an object-store lake: the driver lease
(kappa.runtime.lock.LakeLease) on the project's real S3-API store (``object_store`` fixture).

Each holder is its own process (tests/lease_holder.py). "Another machine" is a process in a UTS namespace of its own
(``unshare --uts``, its own hostname, as a pod has), the only thing that tells machines apart to the lease besides
the store it shares; a lost node is a holder SIGKILLed on that other machine, and a paused one is SIGSTOPped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TTL = 4.0


class Holder:
    def __init__(self, uri: str, env: dict[str, str], *, host: str | None = None, hold: float = 600.0) -> None:
        cmd = [sys.executable, "-m", "tests.lease_holder", uri, str(TTL), str(hold)]
        if host is not None:  # another machine: its own hostname
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def next_event(self, timeout: float = 60.0) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no event from the holder in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the holder exited ({self.proc.wait()}): {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            # under unshare, `exec` made the holder the process itself
            os.kill(self.proc.pid, sig)


@pytest.fixture
def lease_env(object_store) -> tuple[str, dict[str, str]]:
    uri = f"s3a://kappa/lease-{uuid.uuid4().hex[:8]}/views/events_raw/v1/checkpoint/driver.lease"
    env = {**os.environ, **object_store.delta_rs_options(), "PYTHONPATH": str(ROOT)}
    return uri, env


def test_one_holder_across_machines_crashes_and_pauses(lease_env):
    uri, env = lease_env
    holders: list[Holder] = []
    try:
        a = Holder(uri, env)
        holders.append(a)
        assert a.next_event()["event"] == "held"

        # a driver on another machine while A lives: refused once it saw A renew (within a third of the TTL)
        b = Holder(uri, env, host="machine-b")
        holders.append(b)
        refused = b.next_event(timeout=TTL * 3)
        assert refused["event"] == "refused", refused
        assert "events_raw@v1 is already running" in refused["message"], refused
        assert f"pid {a.proc.pid} on " in refused["message"] and "renews its lease" in refused["message"], refused
        assert refused["after"] < TTL, refused
        figures = {"a live holder's lease refused after": refused["after"]}
        assert b.proc.wait(timeout=30) == 3

        # A crashes: a driver started on the same machine takes over at once (A's process is gone)
        a.kill()
        a.proc.wait(timeout=30)
        c = Holder(uri, env)
        holders.append(c)
        held = c.next_event()
        assert held["event"] == "held" and held["took_over"].startswith(f"pid {a.proc.pid} on "), held
        assert held["after"] < TTL / 2, held
        figures["taken over on its own machine after"] = held["after"]

        # C's machine is lost (C killed there is the same to the others): another machine takes over after a TTL
        c.kill()
        d = Holder(uri, env, host="machine-d")
        holders.append(d)
        held = d.next_event(timeout=TTL * 4)
        assert held["event"] == "held" and held["took_over"].startswith(f"pid {c.proc.pid} on "), held
        assert TTL * 0.9 <= held["after"] < TTL * 3, held
        figures["taken over from another machine after"] = held["after"]

        # D pauses longer than its TTL (a stalled process, a partition): E takes over; D, resumed, stops committing
        time.sleep(TTL / 2)
        d.kill(signal.SIGSTOP)
        e = Holder(uri, env, host="machine-e")
        holders.append(e)
        held = e.next_event(timeout=TTL * 4)
        assert held["event"] == "held" and "machine-d" in held["took_over"], held
        d.kill(signal.SIGCONT)
        lost = d.next_event(timeout=TTL * 2)
        assert lost["event"] == "lost", lost
        assert d.proc.wait(timeout=30) == 4

        # E stops cleanly: its lease is released, and a driver anywhere takes it at once
        e.kill(signal.SIGTERM)
        assert e.next_event()["event"] == "released" and e.proc.wait(timeout=30) == 0
        f = Holder(uri, env, host="machine-f")
        holders.append(f)
        held = f.next_event()
        assert held["event"] == "held" and held["took_over"] is None and held["after"] < TTL / 2, held
        print(f"TTL {TTL:.0f} s: " + "; ".join(f"{name} {seconds:.2f} s" for name, seconds in figures.items())
              + f"; after a release {held['after']:.2f} s")
    finally:
        for holder in holders:
            holder.kill(signal.SIGCONT)
            holder.kill()

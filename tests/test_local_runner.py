"""Process-group termination of the local runner and the stack (real processes, no mocks)."""

from __future__ import annotations

import subprocess
import time

from kappa.process import group_members, terminate_group


def test_terminate_group_leaves_no_process_of_the_group_behind():
    """A child that ignores SIGTERM and outlives its leader (as Airflow standalone's scheduler did) is killed."""
    leader = subprocess.Popen(["bash", "-c", "(trap '' TERM; exec sleep 300) & exec sleep 300"],
                              start_new_session=True)
    deadline = time.monotonic() + 10
    while len(group_members(leader.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(leader.pid)) == 2
    started = time.monotonic()
    terminate_group(leader.pid, 5, grace=1)
    leader.wait(timeout=5)
    assert group_members(leader.pid) == []
    assert time.monotonic() - started < 5, "the leader stops on SIGTERM; only the stray child waits for the grace"

"""A process that takes a view version's driver lease on the lake (kappa.runtime.lock.LakeLease) and holds it, as a
driver would, printing what happens as JSON lines: ``held`` (with whose lease it took over), ``refused`` (the
one-line message), ``lost`` (its renewal found the lease taken, or :meth:`check` - what a driver calls before each
commit - refused), ``released``. Run by tests/test_driver_lease.py, some under ``unshare --uts`` with a hostname of
their own: another machine, as far as the lease can tell.

    python -m tests.lease_holder <lease uri> <ttl seconds> <hold seconds>
"""

from __future__ import annotations

import json
import signal
import sys
import time

from kappa.runtime.lock import DriverAlreadyRunning, DriverLeaseLost, LakeLease


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


def main(uri: str, ttl: float, hold: float) -> int:
    lease = LakeLease(uri, owner="events_raw@v1", ttl_seconds=ttl)
    started = time.monotonic()
    try:
        lease.acquire()
    except DriverAlreadyRunning as exc:
        say("refused", message=str(exc), after=time.monotonic() - started)
        return 3
    say("held", took_over=lease.took_over, after=time.monotonic() - started)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))  # a driver's clean stop
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline and not stopping:
        try:
            lease.check()  # what a driver does before each micro-batch commit
        except DriverLeaseLost as exc:
            say("lost", message=str(exc))
            return 4
        time.sleep(0.1)
    lease.release()
    say("released")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))

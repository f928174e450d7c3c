"""One driver per checkpoint: an exclusive, crash-safe lock next to the checkpoint.

``fcntl.flock`` is released by the kernel when the holder dies (even by SIGKILL), so a crashed driver never
leaves a stale lock, while a second live driver is refused with who holds it. On object storage (s3a) there is
no local lock file; there the deployment guarantees a single driver (Kubernetes Deployment, Recreate, 1 replica).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from kappa.errors import KappaError

__all__ = ["DriverLock", "DriverAlreadyRunning"]


class DriverAlreadyRunning(KappaError, RuntimeError):
    """Another driver already runs this view version."""


class DriverLock:
    def __init__(self, path: Path, *, owner: str) -> None:
        self.path = Path(path)
        self.owner = owner
        self._fd: int | None = None

    def holder(self) -> dict | None:
        """Who holds the lock (pid, host, owner, since), or None when it is free."""
        if not self.path.exists():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(self.path.read_text() or "{}")
            except (OSError, ValueError):
                return {}
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            info = self.holder() or {}
            raise DriverAlreadyRunning(
                f"{self.owner} is already running (pid {info.get('pid', '?')} on {info.get('host', '?')} "
                f"since {info.get('since', '?')}); stop it first - two drivers on one checkpoint corrupt it"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "owner": self.owner,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DriverLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

"""Side venvs of client programs kept apart from the platform's own (``.cache/venv``): each is installed from
its own lock file under ``infra/local/`` on first use, and again only when that file changes.

* ``peer-venv`` (``requirements-peer.lock``): the benchmark's peer, Quix Streams + delta-rs;
* ``analyst-venv`` (``requirements-analyst.lock``): what an analyst's laptop installs - to reach the SQL service,
  the Spark Connect client (``pyspark-client``, no JVM) and PyHive for the JDBC/HiveServer2 endpoint; to read the
  lake's files with no server, delta-rs and DuckDB.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from kappa.errors import KappaError

__all__ = ["VenvError", "ensure_venv"]


class VenvError(KappaError, RuntimeError):
    """A side venv could not be installed (the message carries pip's stderr)."""


def ensure_venv(repo_root: Path, name: str, lock_file: str, *, timeout: float = 900.0) -> Path:
    """Create/refresh ``.cache/<name>`` from ``<repo_root>/<lock_file>`` if needed; return its interpreter.

    Idempotent and cheap once done: a stamp file holds the hash of the lock the venv was installed from.
    Concurrent callers serialize on a file lock.
    """
    lock = repo_root / lock_file
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    venv = repo_root / ".cache" / name
    stamp = venv / ".kappa-lock.sha256"
    python = venv / "bin" / "python"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{name}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
            return python
        base = shutil.which("python3.11") or sys.executable
        steps = []
        if not python.exists():
            steps.append([base, "-m", "venv", str(venv)])
        steps.append([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", str(lock)])
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise VenvError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        stamp.write_text(digest + "\n")
    return python

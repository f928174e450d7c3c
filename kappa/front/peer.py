"""The benchmark peer: the YSB windowed count as a user would build it *without* Spark.

``campaign_window_counts`` v1 (keep ``view`` events, ad -> campaign from the compacted ``campaigns`` topic, count per
campaign per 10 s tumbling event-time window, 30 s lateness) done with **Quix Streams** reading Kafka and
**delta-rs** (``deltalake``) writing the Delta table -- the pure-Python alternative ``make bench`` compares the
Spark replay with. The pipeline itself is :mod:`kappa.front.peer_app` (see its docstring for every design choice).

Quix Streams 3.28.1 requires ``confluent-kafka<2.13`` while ``requirements.lock`` pins 2.16.1, so the peer lives
in its own venv, ``.cache/peer-venv`` (exact versions: ``infra/local/requirements-peer.lock``), created on first use by
:func:`ensure_peer_venv`; :func:`run_peer` runs the worker there as a subprocess and parses its JSON result.

Example:
    >>> from kappa.front.peer import run_peer                                   # doctest: +SKIP
    >>> run_peer(settings, "ad-events", "campaigns", "/tmp/peer-table", expected_events=2_000_000)
    {'events': 2000000, 'seconds': ..., 'events_per_s': ..., 'impl': 'quixstreams 3.28.1 + deltalake 1.6.6',
     'windows': ..., ...}
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kappa.errors import KappaError

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["PEER_IMPL", "PeerError", "ensure_peer_venv", "peer_python", "run_peer"]

#: What the peer runs on (the pins of ``infra/local/requirements-peer.lock``).
PEER_IMPL = "quixstreams 3.28.1 + deltalake 1.6.6"
_RESULT_PREFIX = "PEER_RESULT "  # kappa.front.peer_app.RESULT_PREFIX (not imported: that module needs quixstreams)
_LOCK_FILE = "infra/local/requirements-peer.lock"


class PeerError(KappaError, RuntimeError):
    """The peer could not be installed or its run failed (the message carries the tail of its stderr)."""


def _venv_dir(repo_root: Path) -> Path:
    return repo_root / ".cache" / "peer-venv"


def peer_python(repo_root: Path) -> Path:
    """Interpreter of the peer's venv."""
    return _venv_dir(repo_root) / "bin" / "python"


def ensure_peer_venv(repo_root: Path, *, timeout: float = 900.0) -> Path:
    """Create/refresh ``.cache/peer-venv`` from ``infra/local/requirements-peer.lock`` if needed; return its interpreter.

    Idempotent and cheap once done: a stamp file holds the hash of the lock the venv was installed from.
    Concurrent callers serialize on a file lock.
    """
    lock = repo_root / _LOCK_FILE
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    venv = _venv_dir(repo_root)
    stamp = venv / ".kappa-peer-lock.sha256"
    python = peer_python(repo_root)
    if python.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".peer-venv.lock", "w") as guard:
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
                raise PeerError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        stamp.write_text(digest + "\n")
    return python


def run_peer(settings: "Settings", topic: str, campaigns_topic: str, table_path: str, *, expected_events: int,
             timeout: float = 900, commit_interval: float = 5.0, validator: str = "compiled",
             consumer_config: dict[str, Any] | None = None, grace_ms: int = 30_000) -> dict[str, Any]:
    """Run the Quix Streams peer over the whole ``topic`` (from earliest) and write its window counts to Delta.

    Args:
        settings: Cluster (security settings included) and repository root.
        topic: Ad-events topic (read from the earliest offset with a fresh consumer group).
        campaigns_topic: Compacted ad -> campaign topic, read to its end before the stream starts.
        table_path: New Delta table (columns campaign_id STRING, window_start/window_end TIMESTAMP UTC,
            view_count BIGINT); must not exist yet.
        expected_events: Records of ``topic`` to consume (valid + invalid) before the run ends.
        timeout: Seconds the run may take (the worker stops with an error after it).
        commit_interval: Quix checkpoint interval: windows closed since the last checkpoint are appended then.
        validator: ``compiled`` (the schema's rules precompiled, same verdicts as jsonschema, default) or
            ``jsonschema`` (Quix's plain ``JSONDeserializer(schema=...)`` path, ~2.5x slower end to end).
        consumer_config: Extra librdkafka consumer settings for the Quix application.
        grace_ms: Window grace (the view's 30 s watermark). Quix processes records in arrival order and cannot
            align the partitions of one topic on event time, so a multi-partition *replay* drops views whose
            partition was read behind the others by more than the grace (``late_dropped`` in the result; 15-22 %
            of the views on ``make bench``'s 4-partition topic). A grace longer than the replayed event-time
            span makes the result equal the Spark replay's (every window then closes at the end, from state).

    Returns:
        ``{"events", "seconds", "events_per_s", "impl", "windows", ...}``: ``seconds`` is the wall time from the
        first record consumed to the commit of the last window; extra keys say how many windows closed in the
        stream vs. came from the final state, invalid and late records, Delta commits, lookup time.

    Raises:
        PeerError: The worker failed or timed out (with its stderr tail).
    """
    repo_root = Path(settings.repo_root)
    python = ensure_peer_venv(repo_root)
    spec = {
        "client_config": settings.kafka_client_config(),
        "topic": topic,
        "campaigns_topic": campaigns_topic,
        "table_path": str(table_path),
        "expected_events": int(expected_events),
        "timeout": float(timeout),
        "commit_interval": float(commit_interval),
        "schemas_dir": str(settings.schemas_dir),
        "validator": validator,
        "consumer_config": dict(consumer_config or {}),
        "grace_ms": int(grace_ms),
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"PYTHONPATH": str(repo_root), "PYTHONUNBUFFERED": "1"})
    started = time.monotonic()
    # the spec goes through stdin: it may hold SASL credentials, which must not show in the process list
    proc = subprocess.Popen([str(python), "-m", "kappa.front.peer_app"], cwd=repo_root, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(json.dumps(spec), timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(Exception):
            out, err = proc.communicate(timeout=30)
        raise PeerError(f"peer did not finish within {timeout + 120:.0f}s") from None
    except BaseException:  # interrupted (Ctrl-C, SIGTERM through kappa.process.interrupt_on_termination)
        proc.kill()
        proc.wait(30)
        raise
    lines = [line for line in out.splitlines() if line.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise PeerError(f"peer exited with {proc.returncode} after {time.monotonic() - started:.1f}s:\n"
                        f"{err[-4000:]}")
    return json.loads(lines[-1][len(_RESULT_PREFIX):])


def main(argv: list[str] | None = None) -> None:
    """``python -m kappa.front.peer setup``: create the peer's venv (what :func:`run_peer` does on first use)."""
    import argparse

    from kappa.config import Settings

    parser = argparse.ArgumentParser(description="benchmark peer (Quix Streams + delta-rs)")
    parser.add_argument("command", choices=["setup"])
    parser.parse_args(argv)
    print(ensure_peer_venv(Settings.from_env().repo_root))


if __name__ == "__main__":
    main()

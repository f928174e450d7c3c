"""The benchmark peer: the YSB windowed count as a user would build it *without* Spark.

``campaign_window_counts`` v1 (keep ``view`` events, ad -> campaign from the compacted ``campaigns`` topic, count per
campaign per 10 s tumbling event-time window, 30 s lateness) done with **Quix Streams** reading Kafka and
**delta-rs** (``deltalake``) writing the Delta table -- the pure-Python alternative ``make bench`` compares the
Spark replay with. The pipeline itself is :mod:`kappa.front.peer_app` (see its docstring for every design choice).

Quix Streams 3.28.1 requires ``confluent-kafka<2.13`` while ``requirements.lock`` pins 2.16.1, so the peer lives
in its own venv, ``.cache/peer-venv`` (exact versions: ``infra/local/requirements-peer.lock``), created on first use by
:func:`ensure_peer_venv`; :func:`run_peer` runs the worker there as a subprocess and parses its JSON result.

:func:`start_peer_live` runs the worker's *live* mode for a latency benchmark: it starts the worker, returns once the
worker consumes from the end of the topic (the caller then starts producing), and the returned :class:`LivePeer`'s
``wait()`` gives the end-to-end latency percentiles (``commit wall time - last_event_time`` per upserted window row,
the platform's measure) after a fixed run time.

Example:
    >>> from kappa.front.peer import run_peer                                   # doctest: +SKIP
    >>> run_peer(settings, "ad-events", "campaigns", "/tmp/peer-table", expected_events=2_000_000)
    {'events': 2000000, 'seconds': ..., 'events_per_s': ..., 'impl': 'quixstreams 3.28.1 + deltalake 1.6.6',
     'windows': ..., ...}
    >>> peer = start_peer_live(settings, "ad-events", "campaigns", "/tmp/peer-live", seconds=60)  # doctest: +SKIP
    >>> ...  # produce at the rate under test
    >>> peer.wait()["steady_p99_s"]                                              # doctest: +SKIP
    1.42
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kappa.errors import KappaError

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["PEER_IMPL", "LivePeer", "PeerError", "ensure_peer_venv", "peer_python", "run_peer",
           "start_peer_live"]

#: What the peer runs on (the pins of ``infra/local/requirements-peer.lock``).
PEER_IMPL = "quixstreams 3.28.1 + deltalake 1.6.6"
_RESULT_PREFIX = "PEER_RESULT "  # kappa.front.peer_app.RESULT_PREFIX (not imported: that module needs quixstreams)
_READY_LINE = "PEER_READY"  # kappa.front.peer_app.READY_LINE
_LOCK_FILE = "infra/local/requirements-peer.lock"


class PeerError(KappaError, RuntimeError):
    """The peer could not be installed or its run failed (the message carries the tail of its stderr)."""


def peer_python(repo_root: Path) -> Path:
    """Interpreter of the peer's venv."""
    return repo_root / ".cache" / "peer-venv" / "bin" / "python"


def ensure_peer_venv(repo_root: Path, *, timeout: float = 900.0) -> Path:
    """Create/refresh ``.cache/peer-venv`` from ``infra/local/requirements-peer.lock`` if needed; return its
    interpreter (:func:`kappa.front.venvs.ensure_venv`)."""
    from kappa.front.venvs import VenvError, ensure_venv

    try:
        return ensure_venv(repo_root, "peer-venv", _LOCK_FILE, timeout=timeout)
    except VenvError as exc:
        raise PeerError(str(exc)) from None


def _worker_env(repo_root: Path) -> dict[str, str]:
    """The worker's environment: this one without the platform venv's Python settings, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"PYTHONPATH": str(repo_root), "PYTHONUNBUFFERED": "1"})
    return env


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
    env = _worker_env(repo_root)
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


class LivePeer:
    """A live-mode worker started by :func:`start_peer_live`, consuming from the end of its topic.

    Attributes:
        proc: The worker process.
        deadline_s: Seconds after ready at which the worker stops by itself (``seconds + drain``).
        ready_at: ``time.monotonic()`` when the worker reported ready.
    """

    def __init__(self, proc: subprocess.Popen, lines: "queue.Queue[str | None]", stderr: Any,
                 deadline_s: float) -> None:
        self.proc = proc
        self.deadline_s = deadline_s
        self._lines = lines
        self._stderr = stderr
        self.ready_at = time.monotonic()

    def stderr_tail(self, chars: int = 4000) -> str:
        """The end of the worker's stderr so far."""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        # pread: the file offset is shared with the worker's stderr, a seek would move where it writes
        return os.pread(fd, chars, max(0, size - chars)).decode("utf-8", "replace")

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The worker's result, once it stopped by itself (``seconds + drain`` after ready, plus its shutdown).

        Args:
            timeout: Seconds to wait from now; default: until ``seconds + drain + 120`` s after ready.

        Returns:
            The ``PEER_RESULT`` dict of the live mode (see :func:`start_peer_live`).

        Raises:
            PeerError: The worker failed, or did not finish in time (it is killed then, as on an interrupt).
        """
        if timeout is None:
            timeout = max(0.0, self.ready_at + self.deadline_s + 120.0 - time.monotonic())
        deadline = time.monotonic() + timeout
        result: str | None = None
        try:
            while True:
                try:
                    line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    self.kill()
                    raise PeerError(f"live peer did not finish within {timeout:.0f}s:\n{self.stderr_tail()}") \
                        from None
                if line is None:  # stdout closed: the worker is exiting
                    break
                if line.startswith(_RESULT_PREFIX):
                    result = line
            returncode = self.proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise PeerError(f"live peer did not exit within {timeout:.0f}s:\n{self.stderr_tail()}") from None
        except BaseException:  # interrupted (Ctrl-C, SIGTERM through kappa.process.interrupt_on_termination)
            self.kill()
            raise
        if returncode != 0 or result is None:
            raise PeerError(f"live peer exited with {returncode}:\n{self.stderr_tail()}")
        self._stderr.close()
        return json.loads(result[len(_RESULT_PREFIX):])

    def kill(self) -> None:
        """Kill the worker (no result; its consumer group's internal topics are left behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(30)


def start_peer_live(settings: "Settings", topic: str, campaigns_topic: str, table_path: str, *, seconds: float,
                    warmup: float = 20.0, commit_interval: float = 1.0, drain: float = 10.0,
                    ready_timeout: float = 120.0, validator: str = "compiled",
                    consumer_config: dict[str, Any] | None = None, grace_ms: int = 30_000) -> LivePeer:
    """Start the Quix Streams peer in live mode and return once it consumes every record produced from now on.

    The worker reads the campaigns topic, starts a fresh consumer group positioned at the end of ``topic`` and
    reports ready; it then upserts the current value of every changed window at each checkpoint (one delta-rs
    MERGE) and records each row's end-to-end latency, ``commit wall time - last_event_time``, like the platform's
    ``update``-mode view (:mod:`kappa.front.peer_app`, :func:`kappa.front.peer_app.run_live`). It stops by itself
    ``seconds + drain`` after ready.

    Args:
        settings: Cluster (security settings included) and repository root.
        topic: Ad-events topic, consumed from its end.
        campaigns_topic: Compacted ad -> campaign topic, read to its end before the stream starts.
        table_path: New Delta table (columns campaign_id STRING, window_start/window_end TIMESTAMP UTC,
            view_count BIGINT, last_event_time TIMESTAMP UTC); must not exist yet.
        seconds: Run time after ready (the producer's run time plus margin).
        warmup: Seconds after the first record whose commits are left out of the ``steady_*`` figures.
        commit_interval: Quix checkpoint interval: the changed windows are MERGEd that often.
        drain: Seconds to keep running after ``seconds``, for the last records to be committed.
        ready_timeout: Seconds to wait for ready (lookup, topic setup and partition assignment).
        validator: ``compiled`` or ``jsonschema`` (see :func:`run_peer`).
        consumer_config: Extra librdkafka consumer settings for the Quix application.
        grace_ms: Window grace (the view's 30 s watermark): views for a window closed longer ago are dropped.

    Returns:
        A :class:`LivePeer`; its ``wait()`` returns ``{"impl", "mode": "live", "events", "seconds",
        "events_per_s", "rows_committed", "delta_commits", "p50_s", "p99_s", "steady_p50_s", "steady_p99_s",
        "steady_max_s", "buckets", "steady_buckets", "late_dropped", "invalid", "cpu_seconds", "max_rss_mb", ...}``:
        ``seconds`` from the first record to the stop; ``p50_s``/``p99_s`` interpolated from the histogram of all
        rows (``histogram_quantile``), the ``steady_*`` ones exact; buckets as cumulative ``[upper bound, count]``
        pairs on the platform's ``LATENCY_BUCKETS``, the last bound ``"+Inf"``.

    Raises:
        PeerError: The worker exited or was not ready within ``ready_timeout`` (it is killed; stderr tail).
    """
    repo_root = Path(settings.repo_root)
    python = ensure_peer_venv(repo_root)
    spec = {
        "mode": "live",
        "client_config": settings.kafka_client_config(),
        "topic": topic,
        "campaigns_topic": campaigns_topic,
        "table_path": str(table_path),
        "seconds": float(seconds),
        "warmup": float(warmup),
        "commit_interval": float(commit_interval),
        "drain": float(drain),
        "ready_timeout": float(ready_timeout),
        "schemas_dir": str(settings.schemas_dir),
        "validator": validator,
        "consumer_config": dict(consumer_config or {}),
        "grace_ms": int(grace_ms),
    }
    # stderr goes to a temporary file: nothing reads it while the run lasts, and a full pipe would block the worker
    stderr = tempfile.TemporaryFile(prefix="kappa-peer-live-", suffix=".stderr")
    # the spec goes through stdin: it may hold SASL credentials, which must not show in the process list
    proc = subprocess.Popen([str(python), "-m", "kappa.front.peer_app"], cwd=repo_root, env=_worker_env(repo_root),
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    lines: "queue.Queue[str | None]" = queue.Queue()

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    peer = LivePeer(proc, lines, stderr, float(seconds) + float(drain))
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        threading.Thread(target=read_stdout, name="kappa-peer-live-stdout", daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                peer.kill()
                raise PeerError(f"live peer not ready within {ready_timeout:.0f}s:\n{peer.stderr_tail()}") from None
            if line is None:  # stdout closed: the worker is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
                peer.kill()
                raise PeerError(f"live peer exited with {proc.returncode} before ready:\n{peer.stderr_tail()}")
            if line == _READY_LINE:
                break
    except BaseException:  # interrupted, or the errors above
        peer.kill()
        raise
    peer.ready_at = time.monotonic()
    return peer


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

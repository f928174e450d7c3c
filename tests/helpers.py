"""Test helpers that read results without going through the code under test."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["FakeRunner", "Walk", "committed_batches", "delta_log", "delta_txns", "finish", "processes_mentioning",
           "read_table", "recorded_batches", "run_to_end"]


def processes_mentioning(path: Path) -> list[str]:
    """Live processes whose command line mentions ``path`` (what a command left behind), as ``pid: cmdline``."""
    import psutil

    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if str(path) in line and proc.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid}: {line[:200]}")
        except psutil.Error:
            continue
    return out


def read_table(spark: Any, path: str) -> list[Any]:
    """All rows of a Delta table (Spark's reader; the writer path is what is under test)."""
    return spark.read.format("delta").load(path).collect()


def _names_and_read(folder: str) -> tuple[list[str], Any]:
    """(names in a lake folder, read(name) -> text): a local path, or an object store through plain obstore reads
    (``s3a://`` / ``s3://``, credentials from the standard AWS environment)."""
    if "://" not in folder or folder.startswith("file:"):
        path = Path(folder.removeprefix("file:"))
        names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        return names, lambda name: (path / name).read_text()
    import obstore
    from obstore.store import from_url

    bucket, _, key = folder.split("://", 1)[1].partition("/")
    store = from_url(f"s3://{bucket}")
    names = sorted(o["path"].rsplit("/", 1)[-1] for batch in obstore.list(store, f"{key.rstrip('/')}/")
                   for o in batch if "/" not in o["path"][len(key.rstrip("/")) + 1:])
    return names, lambda name: bytes(obstore.get(store, f"{key.rstrip('/')}/{name}").bytes()).decode()


def delta_log(table: str) -> dict[int, list[dict]]:
    """Delta version -> the actions of its JSON commit file (plain file / object reading, not through Delta)."""
    names, read = _names_and_read(f"{table.rstrip('/')}/_delta_log")
    return {int(name[:20]): [json.loads(line) for line in read(name).splitlines() if line.strip()]
            for name in names if re.fullmatch(r"\d{20}\.json", name)}


def commit_infos(table: str) -> list[dict]:
    """``commitInfo`` of each of the table's JSON commits, oldest first (plain reading, :func:`delta_log`)."""
    return [a["commitInfo"] for actions in delta_log(table).values() for a in actions if "commitInfo" in a]


def delta_txns(table: str) -> dict[str, int]:
    """appId -> highest txnVersion recorded in the table's _delta_log JSON commits (plain file reading)."""
    out: dict[str, int] = {}
    for _version, actions in sorted(delta_log(table).items()):
        for action in actions:
            if "txn" in action:
                app, version = action["txn"]["appId"], int(action["txn"]["version"])
                out[app] = max(out.get(app, -1), version)
    return out


def committed_batches(checkpoint: str) -> list[int]:
    """Batch ids committed in a Spark checkpoint (its commits/ folder)."""
    names, _read = _names_and_read(f"{checkpoint.rstrip('/')}/commits")
    return sorted(int(name) for name in names if name.isdigit())


def recorded_batches(settings: Any, view: str, version: int) -> list[Any]:
    """The micro-batch boundaries a version's run recorded in its Delta commits (the staging table's too: a bulk
    catch-up stages its batches there), oldest first."""
    from deltalake import DeltaTable

    from kappa.identity import ViewPaths
    from kappa.runtime import lineage

    paths = ViewPaths(settings.lake_uri, view, version)
    app = next(a for a in delta_txns(paths.table) if a.startswith(f"kappa:{view}@v{version}:") and "/" not in a)
    history = DeltaTable(paths.table).history()
    if DeltaTable.is_deltatable(paths.staging):
        history += DeltaTable(paths.staging).history()
    return lineage.batches_from_history(history, app)


def run_to_end(spark: Any, settings: Any, module: str, *, batch: int | None = None, timeout: float = 600.0) -> None:
    """Run a view version module's real job in this process's Spark session, from its checkpoint (earliest for a
    new one) to the end of the log, then stop it; ``batch``: records per micro-batch; ``timeout``: see
    :func:`finish` (the long tests' drains after their kills use the whole 600 s)."""
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view

    job = ViewJob(load_view(module), settings, spark=spark, starting="earliest", available_now=True,
                  max_offsets_per_trigger=batch)
    job.start()
    try:
        finish(job, timeout, what=module)
    finally:
        job.stop()


def finish(job: Any, timeout: float = 420.0, what: str = "the run") -> None:
    """Wait for a bounded run to end without a failure. A run still going after ``timeout`` (kept below the
    per-test ceiling, so the caller's ``job.stop()`` still runs and the shared Spark session stays usable) fails
    with where each query stood: its status and its last progress."""
    if not job.await_termination(timeout):
        def stood(query: Any) -> str:
            last = query.lastProgress or {}
            return (f"{query.name}: {query.status.get('message')}, last batch {last.get('batchId')} at "
                    f"{last.get('timestamp')} ({last.get('numInputRows')} rows)")
        raise AssertionError(f"{what} did not finish in {timeout:.0f} s; " + "; ".join(map(stood, job.queries)))
    assert job.failure() is None, job.failure()


class FakeRunner:
    """A runner that records what the replay functions ask of it and starts nothing: for tests about the registry
    and the alias, where a real job would only cost time (the real runners have tests of their own)."""

    def __init__(self, running: set[int]) -> None:
        self.running = set(running)
        self.calls: list[tuple[str, int]] = []

    def start(self, spec: Any) -> Any:
        from kappa.control.runners.base import JobStatus

        self.calls.append(("start", spec.version))
        self.running.add(spec.version)
        return JobStatus(spec.ref, "running")

    def stop(self, view: str, version: int) -> Any:
        from kappa.control.runners.base import JobStatus

        self.calls.append(("stop", version))
        self.running.discard(version)
        return JobStatus(f"{view}@v{version}", "stopped")

    def status(self, view: str, version: int) -> Any:
        from kappa.control.runners.base import JobStatus

        return JobStatus(f"{view}@v{version}", "running" if version in self.running else "stopped")


_REPO = Path(__file__).resolve().parents[1]


class Walk:
    """Runs shell commands as a user of the checkout would (bash, repository folder), keeps a transcript and, per
    command, the longest time it went without printing a line (``silences``: from its start to its first line,
    between two lines, from its last line to its end - stdout and stderr alike, as a terminal shows them)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.transcript: list[str] = []
        self.silences: dict[str, float] = {}

    def run(self, script: str, *, where: str, timeout: float = 900.0, ok: bool = True) -> str:
        """Run ``script``; ``ok=False``: it must fail (one-line refusal, no trace), and its output is returned."""
        import threading

        started = time.monotonic()
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=_REPO, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stamps: list[float] = [started]
        streams: dict[str, list[str]] = {"out": [], "err": []}

        def read(pipe: Any, into: list[str]) -> None:
            for line in pipe:
                stamps.append(time.monotonic())
                into.append(line)

        readers = [threading.Thread(target=read, args=(proc.stdout, streams["out"]), daemon=True),
                   threading.Thread(target=read, args=(proc.stderr, streams["err"]), daemon=True)]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for reader in readers:
                reader.join(10)
        ended = time.monotonic()
        marks = sorted([*stamps, ended])
        self.silences[where] = max(b - a for a, b in zip(marks, marks[1:]))
        stdout, stderr = "".join(streams["out"]), "".join(streams["err"])
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        took = ended - started
        self.transcript.append(f"$ {script.strip()}   [{where}, {took:.0f} s, exit {proc.returncode}]\n{proc.stdout}")
        out = proc.stdout + proc.stderr
        if ok:
            assert proc.returncode == 0, f"{where} failed (exit {proc.returncode}):\n{script}\n{out[-4000:]}"
        else:  # a refusal: it fails, and what it says is returned (stdout and stderr)
            assert proc.returncode != 0, f"{where} should have been refused:\n{script}\n{out[-4000:]}"
        assert "Traceback (most recent call last)" not in out, f"{where} printed a stack trace:\n{out[-4000:]}"
        return proc.stdout if ok else out


def alias_pairs(settings: Any, upstream: str, downstream: str) -> list[tuple[int, int]]:
    """(upstream version, downstream version) a reader of the serving alias resolved at every Delta version of the
    alias table (1 while a view has no row: its default version)."""
    from deltalake import DeltaTable

    from kappa.control.serving import ServingAlias
    from kappa.runtime.deltars import read_rows

    uri = ServingAlias(settings.lake_uri).uri
    pairs = []
    for version in range(DeltaTable(uri).version() + 1):
        rows = {r["view"]: r["version"] for r in read_rows(DeltaTable(uri, version=version))}
        pairs.append((rows.get(upstream, 1), rows.get(downstream, 1)))
    return pairs

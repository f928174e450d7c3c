"""Test helpers that read results without going through the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["FakeRunner", "committed_batches", "delta_txns", "processes_mentioning", "read_table", "recorded_batches",
           "run_to_end"]


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


def delta_txns(table: str) -> dict[str, int]:
    """appId -> highest txnVersion recorded in the table's _delta_log JSON commits (plain file reading)."""
    out: dict[str, int] = {}
    for commit in sorted(Path(table, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                app, version = action["txn"]["appId"], int(action["txn"]["version"])
                out[app] = max(out.get(app, -1), version)
    return out


def committed_batches(checkpoint: str) -> list[int]:
    """Batch ids committed in a Spark checkpoint (its commits/ folder)."""
    folder = Path(checkpoint, "commits")
    return sorted(int(p.name) for p in folder.glob("[0-9]*")) if folder.exists() else []


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


def run_to_end(spark: Any, settings: Any, module: str, *, batch: int | None = None) -> None:
    """Run a view version module's real job in this process's Spark session, from its checkpoint (earliest for a
    new one) to the end of the log, then stop it; ``batch``: records per micro-batch."""
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view

    job = ViewJob(load_view(module), settings, spark=spark, starting="earliest", available_now=True,
                  max_offsets_per_trigger=batch)
    job.start()
    try:
        assert job.await_termination(600), f"{module} did not finish"
        assert job.failure() is None, job.failure()
    finally:
        job.stop()


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

"""SIGKILL running view drivers at random moments and at named phases, restart them, check exactly-once.

Phases (fault injection through ``KAPPA_FAULT``, the only fake here: a real crash cannot be timed to an
instant): ``before_write`` (batch read, nothing written), ``between_commits`` (view table committed,
quarantine not), ``after_commit`` (all Delta commits done, checkpoint commit not). Random kills hit whatever
the driver is doing: starting, reading Kafka, running the transform, writing Delta.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kappa.config import Settings
from kappa.identity import ViewPaths
from tests.conftest import subprocess_env
from tests.helpers import committed_batches, delta_txns, run_to_end

VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")
PHASES = ("before_write", "between_commits", "after_commit")


@dataclass
class CrashReport:
    kills: int = 0
    random_kills: int = 0
    phase_kills: dict[str, int] = field(default_factory=dict)
    skipped_replays: int = 0  # after_commit kills whose batch Delta then had to skip on restart
    log: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, line: str, *, phase: str | None = None, random_kill: bool = False,
               skipped: bool = False) -> None:
        with self.lock:
            self.kills += 1
            self.random_kills += int(random_kill)
            if phase:
                self.phase_kills[phase] = self.phase_kills.get(phase, 0) + 1
            self.skipped_replays += int(skipped)
            self.log.append(line)


def _start(settings: Settings, view: str, log: Path, **env: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "kappa.runtime.driver", "view", view, "--version", "1", "--starting", "earliest",
            "--metrics-port", "0", "--trigger-seconds", "0.5", "--max-offsets-per-trigger", os.environ.get("KAPPA_CRASH_BATCH", "400")]
    with open(log, "ab") as fh:
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=subprocess_env(settings, **env), start_new_session=True)


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _wait_batches(checkpoint: str, at_least: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(committed_batches(checkpoint)) >= at_least:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def _catalog_churn(settings: Settings, rng: random.Random) -> None:
    """New mappings and tombstones for ads no event refers to, so the catalog view has batches to crash in
    without changing what the window view joins."""
    import uuid

    from kappa.log.generator import publish_campaigns

    ads = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(30)]
    campaign = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    publish_campaigns(settings, {ad: campaign for ad in ads}, topic=settings.topic("campaigns"))
    publish_campaigns(settings, {ad: None for ad in ads[:10]}, topic=settings.topic("campaigns"))


def _kill_once(settings: Settings, workdir: Path, view: str, i: int, rng: random.Random,
               report: CrashReport) -> None:
    """Start ``view``'s driver and SIGKILL it once: at a named phase of its next batch, or at a random moment."""
    paths = ViewPaths(settings.lake_uri, view, 1)
    ckpt = f"{paths.checkpoint}/main"
    done = committed_batches(ckpt)
    log = workdir / f"{view}.log"
    if view == "campaign_catalog":
        _catalog_churn(settings, rng)
    if rng.random() < 0.6:
        phase = PHASES[(i // len(VIEWS) + i) % len(PHASES)]
        batch = done[-1] + 1 if done else 0
        proc = _start(settings, view, log, KAPPA_FAULT=f"{phase}@{batch}")
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:  # no data left for that batch: kill it anyway
            _killpg(proc)
            report.record(f"{view}: no batch {batch} to fault, killed instead", random_kill=True)
            return
        assert proc.returncode == -signal.SIGKILL, f"{view} exited {proc.returncode}, see {log}"
        skipped = False
        if phase == "after_commit":
            txns = delta_txns(paths.table)
            app = next((a for a in txns if a.startswith(f"kappa:{view}@v1:") and "/" not in a), None)
            # Delta holds the batch, the checkpoint does not: the restart must skip it
            assert batch not in committed_batches(ckpt)
            skipped = app is not None and txns[app] == batch
        report.record(f"{view}: SIGKILL at {phase} of batch {batch}", phase=phase, skipped=skipped)
    else:
        proc = _start(settings, view, log)
        _wait_batches(ckpt, len(done) + 1, proc, timeout=240)
        time.sleep(rng.uniform(0.0, 2.5))
        _killpg(proc)
        report.record(f"{view}: SIGKILL at a random moment after {len(committed_batches(ckpt))} batches",
                      random_kill=True)


def crash_loop(settings: Settings, workdir: Path, *, kills: int, seed: int, spark: Any = None) -> CrashReport:
    """Kill view drivers ``kills`` times, then drain and let every view finish the log.

    Rounds kill the four views' drivers concurrently (one thread each, independent random choices), so the
    drivers also crash while others are starting, reading or writing. The drain restarts every view from the
    checkpoint its last killed driver left, to the end of the log, in several micro-batches (events that arrive
    after the watermark passed their window are dropped - and kept - only between batches): in ``spark`` (this
    process's session: no JVM to start) when given, else in drivers of their own, two at a time.
    """
    from concurrent.futures import ThreadPoolExecutor

    report = CrashReport()
    rounds = -(-kills // len(VIEWS))
    with ThreadPoolExecutor(max_workers=len(VIEWS)) as pool:
        for r in range(rounds):
            views = VIEWS[: kills - r * len(VIEWS)] if r == rounds - 1 else VIEWS
            futures = [pool.submit(_kill_once, settings, workdir, view, r * len(VIEWS) + k,
                                   random.Random(f"{seed}-{r}-{view}"), report) for k, view in enumerate(views)]
            for future in futures:
                future.result()
    batch = int(os.environ.get("KAPPA_CRASH_DRAIN_BATCH", "1000"))
    if spark is not None:
        for view in VIEWS:
            run_to_end(spark, settings, f"jobs.{view}.v1", batch=batch)
        return report

    def drain(view: str) -> None:
        log = workdir / f"{view}.log"
        args = [sys.executable, "-m", "kappa.runtime.driver", "view", view, "--version", "1", "--starting",
                "earliest", "--metrics-port", "0", "--available-now", "--max-offsets-per-trigger", str(batch)]
        with open(log, "ab") as fh:
            proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=subprocess_env(settings), timeout=600, start_new_session=True)
        assert proc.returncode == 0, f"draining {view} failed, see {log}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(drain, VIEWS))
    return report

"""The view host: many view versions in one Spark application (one JVM), each its own query and checkpoint.

On a small machine one JVM per view costs more than the views themselves (four drivers of 1.3-1.7 GiB each);
the host runs every live view version of ``make run`` in one SparkSession instead. Nothing about a view's
guarantees changes: each view version still has its own streaming query, checkpoint, Delta appId and driver
lock (a second copy of a version is refused in the host as anywhere else), and runs in its own FAIR scheduler
pool, so a view with a large backlog (a replay joining the host) cannot starve the others. A query that fails
is restarted alone, from its checkpoint (exactly-once makes that safe), after a backoff that doubles with each
consecutive failure (``KAPPA_HOST_RESTART_BACKOFF_SECONDS``, reset after :data:`HEALTHY_SECONDS` of running);
after ``KAPPA_HOST_MAX_RESTARTS`` consecutive failures it is stopped and reported ``failed`` while the others go on. A
view's own driver (``kappa view run``) follows the same policy in its process, then exits 1 for its pod to restart.

The host is driven by files, so the local runner (and through it ``kappa replay`` and the Airflow DAGs) can add
and remove view versions while it runs:

.. code-block:: text

    <home>/run/host/host.json             the host process (pid, start time); host.lock: one host per home
    <home>/run/host/desired/<ref>.json    a JobSpec the host must run (written by LocalRunner.start)
    <home>/run/host/status/<ref>.json     what the host did with it: waiting | running | restarting | finished |
                                          failed | stopped

A version whose topic does not exist yet (in a cluster the chart's topics Job, a post-install hook, creates them
only once every pod of the release is Ready) is ``waiting``: its metrics endpoint is up (the pod's probes pass,
``kappa_waiting_for_topic{topic} 1`` says what it waits for) and it starts at the first poll that finds its
topics. Waiting is not a failure: it never gives up, and the other versions start meanwhile.

Removing a desired file stops that view version (``LocalRunner.stop``).

Every live micro-batch costs the host a fixed share of CPU whatever it carries (planning, state, commits: about a
third of a CPU-second, docs/performance.md), so a host asked for more micro-batches per second than its cores
give falls behind without bound. It plans for ``KAPPA_HOST_BATCHES_PER_SECOND`` (3.5, about one core): when the
live versions it is asked for declare triggers that add up to more (the six declared views: 2.1 a second; twenty
versions: about 9), each version it starts runs no more often than the shortest common trigger that fits the plan
(:func:`common_trigger`; a version declared slower keeps its own), at most :data:`MAX_STRETCH` times its own
trigger: fewer, larger micro-batches, each view a few seconds later instead of ever later. A running version keeps
the trigger it started with; the host logs the stretch and the version's ``kappa_trigger_seconds`` metric says it.

In a cluster the host is the grouped driver Deployment (``viewJobs.grouping=grouped``); its view versions are fixed
by its arguments (``static``), and the Kubernetes runner takes them over: a version it stopped (a promote replaced
it) or started in a Deployment of its own (a rollback) is recorded in the view-state ConfigMap, which the chart
mounts into the host's pod. ``handed_over`` is that file (``views.json``: ``{view: {version: {"state": ...}}}``):
a static version named there is no longer the host's to run, and the host stops it at its next poll after the
kubelet refreshed the mounted file (about a minute).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kappa.errors import one_line
from kappa.process import pid_alive, spawn, terminate_group
from kappa.runtime.driver import JobSpec, host_command

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.runtime.job import ViewJob

__all__ = ["ViewHost", "common_trigger", "host_dir", "desire", "undesire", "hosted_status", "host_pid", "restart_delay",
           "start_host", "stop_host"]

log = logging.getLogger("kappa.runtime.host")

#: The longest wait before restarting a failed query (the backoff doubles with each consecutive failure).
MAX_BACKOFF_SECONDS = 300.0
#: A query running this long without failing starts counting its failures from zero again.
HEALTHY_SECONDS = 300.0
#: The most a host under load lengthens a live version's trigger (times the declared one).
MAX_STRETCH = 5.0


def host_dir(settings: "Settings") -> Path:
    return Path(settings.home) / "run" / "host"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # readers never see half a file


class ViewHost:
    """Runs the view versions listed in ``<home>/run/host/desired`` in one SparkSession until SIGTERM."""

    def __init__(self, settings: "Settings", *, driver_memory: str | None = None,
                 static: list[JobSpec] | None = None,
                 handed_over: str | Path | None = None) -> None:
        self.settings = settings
        self.static = {spec.ref: spec for spec in static or []}  # always desired (e.g. a grouped deployment)
        self.handed_over = Path(handed_over) if handed_over else None
        self.dir = host_dir(settings)
        self.driver_memory = driver_memory or settings.host_driver_memory  # the JVM's heap ceiling
        self.jobs: dict[str, "ViewJob"] = {}
        self.waiting: dict[str, "ViewJob"] = {}  # versions whose topics do not exist yet (their metrics are up)
        self.specs: dict[str, JobSpec] = {}
        self._stop = threading.Event()
        self._spark: Any = None
        self._lookups: Any = None
        self._failures: dict[str, int] = {}  # consecutive failures per view version
        self._restart_at: dict[str, float] = {}  # monotonic time a failed version may start again
        self._started_at: dict[str, float] = {}
        # desired/<file> -> ((inode, size, mtime), its spec or None when unreadable): read again once it changed
        self._read_requests: dict[str, tuple[tuple[int, int, int], JobSpec | None]] = {}

    # ---------------------------------------------------------------------------------------------------
    @property
    def spark(self) -> Any:
        if self._spark is None:
            from kappa.runtime.spark import build_spark, view_shuffle_partitions

            self._spark = build_spark(
                "kappa-view-host", self.settings, driver_memory=self.driver_memory,
                shuffle_partitions=view_shuffle_partitions(self.settings), extra_conf={"spark.scheduler.mode": "FAIR"})
        return self._spark

    def _handed_over(self) -> dict[str, str]:
        """The static versions the Kubernetes runner took over: ref -> what it recorded (running | stopped)."""
        if self.handed_over is None:
            return {}
        try:
            recorded = json.loads(self.handed_over.read_text() or "{}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.handed_over, exc)
            return {}
        out: dict[str, str] = {}
        for view, versions in (recorded.items() if isinstance(recorded, dict) else ()):
            for version, rec in (versions.items() if isinstance(versions, dict) else ()):
                if str(version).isdigit():
                    out[f"{view}@v{int(version)}"] = str((rec or {}).get("state", "")) if isinstance(rec, dict) else ""
        return out

    def _desired(self) -> dict[str, JobSpec]:
        taken = self._handed_over()
        out: dict[str, JobSpec] = {ref: spec for ref, spec in self.static.items() if ref not in taken}
        for ref in self.static.keys() & taken.keys():
            if ref in self.jobs or ref in self._restart_at:
                log.info("%s: handed over to the Kubernetes runner (recorded %s in %s); stopping it here", ref,
                         taken[ref] or "?", self.handed_over)
        out.update(self._requested())
        return out

    def _requested(self) -> dict[str, JobSpec]:
        """The specs of ``desired/*.json``, each file read again only when it changed (its inode, size or
        modification time: a request replaces its file by a rename); the host looks every second."""
        seen: dict[str, tuple[int, int, int]] = {}
        try:
            with os.scandir(self.dir / "desired") as entries:
                for entry in entries:
                    if entry.name.endswith(".json") and entry.is_file():
                        st = entry.stat()
                        seen[entry.name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            pass
        specs: dict[str, JobSpec] = {}
        for name in sorted(seen):
            cached = self._read_requests.get(name)
            if cached is not None and cached[0] == seen[name]:
                if cached[1] is not None:
                    specs[name[:-len(".json")]] = cached[1]
                continue
            path = self.dir / "desired" / name
            spec: JobSpec | None = None
            try:
                spec = JobSpec(**json.loads(path.read_text()))
                specs[name[:-len(".json")]] = spec
            except FileNotFoundError:  # removed meanwhile: not desired
                continue
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring %s: %s", path, exc)
            self._read_requests[name] = (seen[name], spec)
        for name in self._read_requests.keys() - seen.keys():
            del self._read_requests[name]
        return specs

    def _status(self, ref: str, state: str, detail: str = "", metrics_url: str | None = None) -> None:
        _write_json(self.dir / "status" / f"{ref}.json", {
            "ref": ref, "state": state, "detail": detail, "metrics_url": metrics_url, "pid": os.getpid(),
            "updated": time.time()})

    def _start(self, spec: JobSpec) -> None:
        from kappa.runtime.job import ViewJob
        from kappa.runtime.lookups import LookupCache

        view = _definition(spec)
        spark = self.spark  # the first start builds the session: ~15 s on 2 cores, a stop may arrive meanwhile
        if self._stop.is_set():
            return
        if self._lookups is None:
            self._lookups = LookupCache(spark, self.settings)
        job = self.waiting.get(spec.ref) or ViewJob(
            view, self.settings, spark=spark, starting=spec.starting, available_now=spec.end_timestamp_ms is not None,
            end_timestamp_ms=spec.end_timestamp_ms, max_offsets_per_trigger=spec.max_offsets_per_trigger,
            metrics_port=spec.metrics_port, lookups=self._lookups, trigger_seconds=self.trigger_seconds(spec))
        missing = job.missing_topics()
        if missing:  # not a failure: it starts at the first poll that finds them (never blocking the others)
            try:
                job.serve_metrics()
            except OSError as exc:
                self._failed(spec.ref, f"cannot serve its metrics: {one_line(exc)}")
                return
            detail = (f"waiting for topic(s) {', '.join(missing)} (created by `{self.settings.cli} topics ensure`; "
                      "in a cluster by the release's topics Job)")
            if spec.ref not in self.waiting:
                log.warning("%s: %s", spec.ref, detail)
            self.waiting[spec.ref] = job
            self._status(spec.ref, "waiting", detail, self._url(job))
            return
        self.waiting.pop(spec.ref, None)
        # the pool is a property of the thread that starts the query; Spark's stream thread inherits it
        spark.sparkContext.setLocalProperty("spark.scheduler.pool", spec.ref)
        try:
            job.start()
        except Exception as exc:  # noqa: BLE001 - one view failing to start must not stop the others
            self._failed(spec.ref, f"cannot start: {one_line(exc)}")
            return
        finally:
            spark.sparkContext.setLocalProperty("spark.scheduler.pool", None)
        self.jobs[spec.ref], self.specs[spec.ref] = job, spec
        self._started_at[spec.ref] = time.monotonic()
        url = self._url(job)
        log.info("%s running in the host (app id %s, pool %s, metrics %s)", spec.ref, job.app_id, spec.ref, url)
        self._status(spec.ref, "running", f"host pid {os.getpid()}, app id {job.app_id}", url)

    def trigger_seconds(self, spec: JobSpec) -> float | None:
        """The trigger of live version ``spec`` in this host: its own (None) unless the live versions the host is
        asked for declare more micro-batches per second than ``KAPPA_HOST_BATCHES_PER_SECOND``; then the shortest
        trigger that fits them all (:func:`common_trigger`) when its own is shorter, at most :data:`MAX_STRETCH`
        times its own (see the module doc)."""
        budget = self.settings.host_batches_per_second
        if spec.end_timestamp_ms is not None or budget <= 0:  # a bounded run has no trigger
            return None
        from kappa.catalog import load_catalog
        from kappa.runtime.job import live_trigger_seconds

        desired = self._desired()
        desired.setdefault(spec.ref, spec)
        catalog = load_catalog()
        triggers: dict[str, float] = {}
        for ref, other in desired.items():
            if other.end_timestamp_ms is not None:
                continue
            try:
                triggers[ref] = live_trigger_seconds(_definition(other, catalog), catalog)
            except Exception:  # noqa: BLE001 - a version that cannot load fails at its own start, not here
                continue
        own = triggers.get(spec.ref)
        if own is None:
            return None
        stretched = planned_trigger(own, list(triggers.values()), budget)
        if stretched == own:
            return None
        log.info("%s: trigger %.3g s -> %.3g s: the host's %d live version(s) ask %.3g micro-batches/s, it plans for "
                 "%.3g (KAPPA_HOST_BATCHES_PER_SECOND)", spec.ref, own, stretched, len(triggers),
                 sum(1.0 / t for t in triggers.values()), budget)
        return stretched

    @staticmethod
    def _url(job: "ViewJob") -> str | None:
        return f"http://127.0.0.1:{job.bound_port}/metrics" if job.bound_port else None

    def _stop_job(self, ref: str, state: str, detail: str) -> None:
        job = self.jobs.pop(ref, None) or self.waiting.pop(ref, None)
        self.specs.pop(ref, None)
        if job is not None:
            job.stop()
            log.info("%s %s in the host: %s", ref, state, detail)
        self._status(ref, state, detail)

    def reconcile(self) -> None:
        """Start what is desired and not running, stop what runs and is no longer desired, check failures."""
        desired = self._desired()
        for ref in [*self.jobs, *self.waiting]:
            if ref not in desired:
                self._stop_job(ref, "stopped", "stopped by request")
        for ref in [r for r in self._restart_at if r not in desired]:  # waiting for a restart, then withdrawn
            self._restart_at.pop(ref)
            self._failures.pop(ref, None)
            self._status(ref, "stopped", "stopped by request")
        for ref, spec in desired.items():
            if ref not in self.jobs:
                status = self.dir / "status" / f"{ref}.json"
                previous = json.loads(status.read_text()) if status.exists() else {}
                # a version that finished or failed stays so until it is asked for again (a new desired file)
                desired_file = self.dir / "desired" / f"{ref}.json"
                desired_at = desired_file.stat().st_mtime if desired_file.exists() else 0.0
                if previous.get("state") in ("finished", "failed") and previous.get("updated", 0) >= desired_at:
                    continue
                if time.monotonic() < self._restart_at.get(ref, 0.0):
                    continue
                if self._stop.is_set():  # SIGTERM while versions start: start no more (each start takes seconds)
                    return
                self._restart_at.pop(ref, None)
                self._start(spec)
        for ref, job in list(self.jobs.items()):
            if time.monotonic() - self._started_at.get(ref, 0.0) > HEALTHY_SECONDS:
                self._failures.pop(ref, None)
            if not job.ended_maybe():  # no query of the session ended since the last look (listener events)
                continue
            failure = job.failure()
            if failure:
                if not job.recover():
                    self._failed(ref, failure)
                continue
            if all(not q.isActive for q in job.queries):
                bounded = self.specs[ref].end_timestamp_ms is not None
                self._stop_job(ref, "finished" if bounded else "stopped", "bounded run completed" if bounded
                               else "query ended")

    def _failed(self, ref: str, failure: str) -> None:
        """Stop a failed query; restart it after a backoff, or leave it ``failed`` after too many in a row."""
        failures = self._failures.get(ref, 0) + 1
        self._failures[ref] = failures
        first_line = one_line(failure)
        if failures > self.settings.host_max_restarts:
            log.error("%s failed %s times in a row, left stopped: %s", ref, failures, first_line)
            self._stop_job(ref, "failed", failure)
            return
        delay = restart_delay(self.settings.host_restart_backoff_seconds, failures)
        log.error("%s failed (%s of %s): %s; restarting it from its checkpoint in %.0f s", ref, failures,
                  self.settings.host_max_restarts, first_line, delay)
        self._restart_at[ref] = time.monotonic() + delay
        self._stop_job(ref, "restarting", f"failure {failures} of {self.settings.host_max_restarts}, restart in {delay:.0f} s: "
                                          f"{first_line}")

    def run(self) -> None:
        """Reconcile every ``settings.host_poll_seconds`` until SIGTERM/SIGINT, then stop every view version."""
        from kappa.runtime.lock import DriverLock

        lock = DriverLock(self.dir / "host.lock", owner="view-host")
        lock.acquire()  # one host per KAPPA_HOME
        _write_json(self.dir / "host.json", {"pid": os.getpid(), "started": time.time()})

        def _term(signum: int, _frame: Any) -> None:
            log.info("signal %s: stopping the view host", signum)
            self._stop.set()

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
        try:
            while not self._stop.is_set():
                self.reconcile()
                self._stop.wait(self.settings.host_poll_seconds)
        finally:
            # every version drains its micro-batch in flight at the same time: one after another, a host of five
            # busy views took the sum of five batches to stop
            refs = [*self.jobs, *self.waiting]
            if refs:
                with ThreadPoolExecutor(max_workers=len(refs), thread_name_prefix="host-stop") as pool:
                    list(pool.map(lambda ref: self._stop_job(ref, "stopped", "host stopped"), refs))
            if self._lookups is not None:
                self._lookups.close()
            if self._spark is not None:
                from kappa.runtime.spark import stop_spark

                stop_spark(self._spark)
            lock.release()


def restart_delay(first: float, failures: int) -> float:
    """Seconds before the restart that follows the ``failures``-th consecutive failure of a query: ``first``
    (``KAPPA_HOST_RESTART_BACKOFF_SECONDS``) doubling with each failure, at most :data:`MAX_BACKOFF_SECONDS` - the
    host's policy and a view's own driver's.

    >>> [restart_delay(5.0, n) for n in (1, 2, 5, 10)]
    [5.0, 10.0, 80.0, 300.0]
    """
    return min(MAX_BACKOFF_SECONDS, first * 2 ** (failures - 1))


def planned_trigger(own: float, triggers: list[float], budget: float) -> float:
    """The trigger (seconds) a live version declared with ``own`` gets in a host whose live versions declare
    ``triggers`` (its own among them) and that plans for ``budget`` micro-batches a second: its own, or the
    :func:`common_trigger` when that is longer, at most :data:`MAX_STRETCH` times its own.

    >>> round(planned_trigger(2, [2] * 17 + [10, 30], 3), 2), planned_trigger(30, [2] * 17 + [10, 30], 3)
    (5.93, 30)
    """
    shortest = common_trigger(triggers, budget) if budget > 0 else None
    if shortest is None or own >= shortest:
        return own
    return min(shortest, own * MAX_STRETCH)


def common_trigger(triggers: list[float], budget: float) -> float | None:
    """The shortest trigger ``T`` such that versions with ``triggers`` (seconds), each running every
    ``max(its own, T)``, run at most ``budget`` micro-batches a second; None when their own triggers already do.
    Versions declared slower than ``T`` keep their triggers.

    >>> common_trigger([2, 2, 2, 2, 10, 30], 3)  # the six declared views: 2.13 a second
    >>> round(common_trigger([2] * 16 + [10, 10, 30], 3), 2)  # 16 fast versions share what the 3 slow leave
    5.78
    """
    if sum(1.0 / t for t in triggers) <= budget:
        return None
    ordered = sorted(triggers)
    for fast in range(1, len(ordered) + 1):  # the `fast` shortest run every T, the others at their own
        rest = sum(1.0 / t for t in ordered[fast:])
        if rest >= budget:
            continue
        shortest = fast / (budget - rest)
        if fast == len(ordered) or shortest <= ordered[fast]:
            return shortest
    return None  # pragma: no cover - the last step always returns


def _definition(spec: JobSpec, catalog: Any = None) -> Any:
    """The view version ``spec`` runs (its module, as ``catalog`` - default: platform.yaml read now - names it)."""
    from kappa.catalog import load_catalog
    from kappa.runtime.view import load_view

    return load_view((catalog or load_catalog()).views[spec.view].versions[spec.version])


def desire(settings: "Settings", spec: JobSpec) -> None:
    """Ask the host to run ``spec`` (replaces an earlier request for the same view version)."""
    _write_json(host_dir(settings) / "desired" / f"{spec.ref}.json", asdict(spec))


def undesire(settings: "Settings", ref: str) -> bool:
    path = host_dir(settings) / "desired" / f"{ref}.json"
    existed = path.exists()
    path.unlink(missing_ok=True)
    return existed


def hosted_status(settings: "Settings", ref: str) -> dict[str, Any] | None:
    path = host_dir(settings) / "status" / f"{ref}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def host_pid(settings: "Settings") -> int | None:
    """Pid of the running view host of this KAPPA_HOME, if any."""
    try:
        pid = int(json.loads((host_dir(settings) / "host.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid if pid_alive(pid) else None


def start_host(settings: "Settings", *, timeout: float = 60.0) -> int:
    """Start the view host in the background (:func:`kappa.runtime.driver.host_command`) unless it runs; returns
    its pid."""
    pid = host_pid(settings)
    if pid:
        return pid
    log_file = Path(settings.home) / "logs" / "view-host.log"
    (host_dir(settings) / "host.json").unlink(missing_ok=True)
    proc = spawn(host_command(), log_file=log_file, settings=settings)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = host_pid(settings)
        if pid:
            return pid
        if proc.poll() is not None:
            raise RuntimeError(f"the view host exited with {proc.returncode}; see {log_file}")
        time.sleep(0.2)
    raise RuntimeError(f"the view host did not start within {timeout:.0f} s; see {log_file}")


def stop_host(settings: "Settings", *, timeout: float = 120.0) -> bool:
    """Stop the view host (it drains and stops every view version it runs); False if none ran."""
    pid = host_pid(settings)
    if pid is None:
        return False
    terminate_group(pid, timeout)
    return True

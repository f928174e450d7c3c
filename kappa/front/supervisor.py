"""The local stack's supervisor: what ``kappa up`` started is started again when it dies, as the kubelet restarts a
pod's containers - with backoff, a restart recorded with its reason, and a crash loop that stops and says so.

``kappa up`` records what it started (``$KAPPA_HOME/run/supervisor/wanted.json``: the object store, the broker, the
view host, the producer and its rate, Airflow) and starts this process (``python -m kappa.front.supervisor``, a
:class:`~kappa.process.Daemon` named ``supervisor``). Every ``KAPPA_SUPERVISE_POLL_SECONDS`` (5) it looks at each
wanted component in that order (a store and a broker before what reads them); one that is not running is started
again with the same function ``kappa up`` used, after a backoff that doubles with each consecutive failure (from
``KAPPA_SUPERVISE_BACKOFF_SECONDS``, 5 s; at most :data:`MAX_BACKOFF_SECONDS`). A component that ran
:data:`HEALTHY_SECONDS` counts its failures from zero again; one that failed :data:`GIVE_UP_AFTER` times in a row is
left stopped, and ``kappa status`` says so in one line (``kappa up`` starts it again). Each restart and its reason -
the exit status where this process was its parent, else that its pid was gone, and the last error line of its log -
is in ``state.json`` beside, which ``kappa status`` reads. ``kappa producer stop`` and ``kappa down`` take their
components out of ``wanted.json`` first (``down`` stops this process before anything else), so nothing stopped on
purpose comes back.

It also keeps the logs under ``$KAPPA_HOME`` bounded (:func:`keep_logs`): a process log moved aside past
``KAPPA_LOG_MAX_MB`` (64), Airflow's task logs removed after 30 days.

The supervisor itself is not supervised (as nothing restarts a kubelet but the machine's init system); its own log
is ``$KAPPA_HOME/logs/supervisor.log``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kappa.config import Settings
from kappa.errors import one_line
from kappa.process import Daemon, interrupt_on_termination

__all__ = ["Component", "Record", "check", "components", "forget", "keep_logs", "records", "run", "start", "stop",
           "want"]

log = logging.getLogger("kappa.front.supervisor")

#: The longest wait between two restarts (the kubelet's is 5 minutes).
MAX_BACKOFF_SECONDS = 160.0
#: A component running this long counts its failures from zero again (the kubelet resets after 10 minutes).
HEALTHY_SECONDS = 600.0
#: Consecutive failures after which a component is left stopped: a crash loop (5 s + 10 + 20 + 40 + 80 of backoff).
GIVE_UP_AFTER = 6
#: Airflow's task logs older than this are removed (its metadata is kept as long: kappa_retire's default).
AIRFLOW_LOG_DAYS = 30
#: The order components start in: each one after what it needs.
ORDER = ("object store", "kafka", "view host", "producer", "airflow", "sql")

#: A line of a log that says what went wrong: Python's and log4j's levels, Airflow's, an exception, the kernel's kill.
_ERROR_LINE = re.compile(r"\b(ERROR|FATAL|CRITICAL)\b|\[(error|critical)\s*\]|\w+(Error|Exception)\b|\bKilled\b")


def _dir(settings: Settings) -> Path:
    return Path(settings.home) / "run" / "supervisor"


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


# ---------------------------------------------------------------------------------- what is wanted
def want(settings: Settings, name: str, **args: Any) -> None:
    """Record that ``name`` should run (with the arguments its start takes, e.g. the producer's rate); a component
    left stopped after a crash loop is given a fresh start (its failures count from zero again)."""
    wanted = _read(_dir(settings) / "wanted.json")
    wanted[name] = {**args, "wanted_at": time.time()}
    _write(_dir(settings) / "wanted.json", wanted)


def forget(settings: Settings, name: str | None = None) -> None:
    """Take ``name`` (every component when None) out of what should run: stopped on purpose, it stays stopped."""
    if name is None:
        (_dir(settings) / "wanted.json").unlink(missing_ok=True)
        return
    wanted = _read(_dir(settings) / "wanted.json")
    if wanted.pop(name, None) is not None:
        _write(_dir(settings) / "wanted.json", wanted)


# ---------------------------------------------------------------------------------- the components
@dataclass
class Component:
    """One supervised process: its pid while it runs, how to start it, its log."""

    name: str
    pid: Callable[[], int | None]
    start: Callable[[], int | None]
    log_file: Path


def components(settings: Settings, wanted: dict[str, Any] | None = None) -> dict[str, Component]:
    """Every component ``kappa up`` may start here, by name, started by the same functions it uses (no broker
    where the platform uses an external Kafka, no object store where the lake is elsewhere)."""
    from kappa.front import stack
    from kappa.objectstore import LocalObjectStore, on_platform_store
    from kappa.runtime.host import host_pid, start_host

    wanted = _read(_dir(settings) / "wanted.json") if wanted is None else wanted
    logs = Path(settings.home) / "logs"
    rate = float((wanted.get("producer") or {}).get("rate", 200.0))
    comps = {
        "view host": Component("view host", lambda: host_pid(settings), lambda: start_host(settings),
                               logs / "view-host.log"),
        "producer": Component("producer", Daemon("producer", settings).pid,
                              lambda: stack.start_producer(settings, rate=rate).pid(), logs / "producer.log"),
        "airflow": Component("airflow", Daemon("airflow", settings).pid,
                             lambda: stack.start_airflow(settings).pid(), logs / "airflow.log"),
        "sql": Component("sql", Daemon("sql", settings).pid, lambda: stack.start_sql(settings).pid(),
                         logs / "sql.log"),
    }
    if settings.local_broker:
        from kappa.log.broker import LocalBroker

        broker = LocalBroker.from_settings(settings)
        comps["kafka"] = Component("kafka", lambda: broker.pid, lambda: broker.start().pid, broker.log_file)
    if on_platform_store(settings):
        store = LocalObjectStore.from_settings(settings)
        comps["object store"] = Component("object store", store.pid, lambda: store.start().pid(), store.log_file())
    return comps


@dataclass
class Record:
    """What the supervisor knows of one component (``state.json``)."""

    restarts: int = 0  # restarts it made, over the stack's life
    failures: int = 0  # consecutive ones: reset after HEALTHY_SECONDS of running
    pid: int | None = None  # the pid it last saw running
    started_at: float | None = None  # when it (re)started it
    last_at: str | None = None  # when it last found the component gone (ISO, UTC)
    why: str | None = None  # what it knows of that end
    next_at: float | None = None  # when it starts it again (epoch s), while it waits
    gave_up: str | None = None  # the one line of a crash loop: left stopped
    wanted_at: float | None = None  # the want it follows: a new one (`kappa up`, `producer start`) starts afresh

    def line(self, name: str) -> str | None:
        """What ``kappa status`` says of this component, if anything happened to it."""
        if self.gave_up:
            return self.gave_up
        if self.next_at:
            return (f"{name} stopped {self.last_at}: {self.why}; starting it again in "
                    f"{max(0.0, self.next_at - time.time()):.0f} s")
        if self.restarts:
            return f"restarted {self.restarts}x, last {self.last_at}: {self.why}"
        return None


def records(settings: Settings) -> dict[str, Record]:
    """The supervisor's record of each component it watched."""
    return {name: Record(**data) for name, data in _read(_dir(settings) / "state.json").items()}


def _backoff(settings: Settings, failures: int) -> float:
    return min(MAX_BACKOFF_SECONDS, settings.supervise_backoff_seconds * 2 ** max(0, failures - 1))


def _exit_status(pid: int | None) -> str | None:
    """How child ``pid`` of this process ended (it is reaped), or None when it is not this process' child."""
    if not pid:
        return None
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if done != pid:
        return None
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def _last_error(log_file: Path) -> str | None:
    """The last error-looking line of the last 64 KiB of ``log_file``."""
    try:
        with open(log_file, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if _ERROR_LINE.search(line):
            return line.strip()[:240]
    return None


def _why(comp: Component, pid: int | None) -> str:
    status = _exit_status(pid) or (f"pid {pid} was gone" if pid else "it was not running")
    error = _last_error(comp.log_file)
    return f"{status}" + (f"; last error in {comp.log_file.name}: {error}" if error else
                          f"; no error line in {comp.log_file.name}")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# ---------------------------------------------------------------------------------- the loop
def _failed(settings: Settings, name: str, comp: Component, rec: Record, why: str, now: float) -> None:
    """One more failure of ``name`` in a row: wait the backoff before the next start, or give up on a crash loop."""
    rec.failures, rec.last_at, rec.why, rec.pid = rec.failures + 1, _now(), why, None
    if rec.failures >= GIVE_UP_AFTER:
        rec.next_at = None
        rec.gave_up = (f"crash loop: {name} stopped {rec.failures} times in a row, left stopped (last "
                       f"{rec.last_at}: {rec.why}); see {comp.log_file}, then `{settings.cli} up`")
        log.error("%s", rec.gave_up)
        return
    rec.next_at = now + _backoff(settings, rec.failures)
    log.warning("%s stopped: %s; starting it again in %.0f s", name, rec.why, rec.next_at - now)


def check(settings: Settings, recs: dict[str, Record]) -> dict[str, Record]:
    """One look at every wanted component: note a healthy one, restart a stopped one whose backoff is over."""
    wanted = _read(_dir(settings) / "wanted.json")
    comps = components(settings, wanted)
    now = time.time()
    for name in ORDER:
        if name not in wanted or name not in comps:
            continue
        comp, rec = comps[name], recs.setdefault(name, Record())
        if rec.wanted_at != wanted[name].get("wanted_at"):
            rec.wanted_at, rec.failures, rec.gave_up, rec.next_at = wanted[name].get("wanted_at"), 0, None, None
        pid = comp.pid()
        if pid:
            if rec.started_at and rec.failures and now - rec.started_at >= HEALTHY_SECONDS:
                rec.failures = 0
            rec.pid, rec.next_at = pid, None
            continue
        if rec.gave_up:
            continue
        if rec.next_at is None:  # found gone
            _failed(settings, name, comp, rec, _why(comp, rec.pid), now)
            continue
        if now < rec.next_at:
            continue
        try:
            rec.pid = comp.start()
        except Exception as exc:  # noqa: BLE001 - a failed start is one more failure, said in one line
            _failed(settings, name, comp, rec, f"could not start it: {one_line(exc)}", time.time())
            continue
        rec.restarts, rec.started_at, rec.next_at = rec.restarts + 1, time.time(), None
        log.warning("%s started again (pid %s, restart %d)", name, rec.pid, rec.restarts)
    return recs


# ---------------------------------------------------------------------------------- the logs
def keep_logs(settings: Settings, *, now: float | None = None) -> list[str]:
    """Bound the logs under ``$KAPPA_HOME``: a process log (``logs/*.log``, the object store's) past
    ``KAPPA_LOG_MAX_MB`` is copied to ``<name>.1`` (replacing the one before) and emptied in place - its writer
    appends (``O_APPEND``) and goes on at the new end, as logrotate's ``copytruncate`` (a line written between the copy
    and the emptying is lost); Airflow's task and DAG-processor logs older than :data:`AIRFLOW_LOG_DAYS` are removed,
    as the official chart's log groomer does. (The broker's log4j rolls its own: 4 files of 50 MB.) Returns what it
    did, one line each."""
    home = Path(settings.home)
    done = []
    for path in sorted([*home.glob("logs/*.log"), *home.glob("objectstore/logs/*.log")]):
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size > settings.log_max_mb * 2**20:
            previous = path.with_name(path.name + ".1")
            with open(path, "rb") as src, open(previous.with_suffix(".tmp"), "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            previous.with_suffix(".tmp").replace(previous)
            os.truncate(path, 0)
            done.append(f"{path.relative_to(home)}: {size / 2**20:.0f} MiB moved to {previous.name}")
    cutoff = (now or time.time()) - AIRFLOW_LOG_DAYS * 86400
    removed = 0
    for root, dirs, files in os.walk(home / "airflow" / "logs", topdown=False):
        for name in files:
            path = Path(root, name)
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
        for name in dirs:
            with contextlib.suppress(OSError):
                Path(root, name).rmdir()  # only when empty
    if removed:
        done.append(f"airflow/logs: {removed} files older than {AIRFLOW_LOG_DAYS} days removed")
    return done


def run(settings: Settings) -> None:
    """Watch until SIGTERM (``kappa down``); keep the logs bounded meanwhile (:func:`keep_logs`, every minute)."""
    recs = records(settings)
    kept = 0.0
    with interrupt_on_termination():
        try:
            while True:
                recs = check(settings, recs)
                _write(_dir(settings) / "state.json", {name: asdict(rec) for name, rec in recs.items()})
                if time.monotonic() - kept >= 60:
                    for line in keep_logs(settings):
                        log.info("logs: %s", line)
                    kept = time.monotonic()
                time.sleep(settings.supervise_poll_seconds)
        except KeyboardInterrupt:
            log.info("supervisor stopped")


def start(settings: Settings) -> Daemon:
    """Start the supervisor of this home unless it runs (its past records are cleared: a new stack's life)."""
    daemon = Daemon("supervisor", settings)
    if daemon.pid() is None:
        (_dir(settings) / "state.json").unlink(missing_ok=True)
        daemon.start([sys.executable, "-m", "kappa.front.supervisor"])
    return daemon


def stop(settings: Settings) -> bool:
    """Stop the supervisor (first of all in ``kappa down``) and forget what was wanted."""
    forget(settings)
    return Daemon("supervisor", settings).stop(timeout=20)


if __name__ == "__main__":  # pragma: no cover - the Daemon's command
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(Settings.from_env())

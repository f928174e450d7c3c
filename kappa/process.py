"""Starting and stopping the platform's background processes: one home for every process group it spawns.

Every long-running part the platform starts on this machine - a view driver, the view host, the producer,
Airflow - runs as the leader of a process group of its own (``start_new_session``), logs to a file under
``$KAPPA_HOME/logs`` and is stopped group-wide: SIGTERM to the leader (which shuts its children down itself),
then whatever is left of the group. A :class:`Daemon` adds a pid file under ``$KAPPA_HOME/run``.

Example:
    >>> from kappa.config import Settings  # doctest: +SKIP
    >>> d = Daemon("producer", Settings.from_env())  # doctest: +SKIP
    >>> d.start([sys.executable, "-m", "kappa.log.generator", "--rate", "200"])  # doctest: +SKIP
    >>> d.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import psutil

    from kappa.config import Settings

__all__ = ["Daemon", "child_env", "group_members", "interrupt_on_termination", "log_tails", "owned_process",
           "pid_alive", "port_open", "spawn", "terminate_group", "wait_exit"]


@contextlib.contextmanager
def interrupt_on_termination() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`KeyboardInterrupt` in the main thread, as Ctrl-C (SIGINT)
    does; the previous handlers come back after it.

    A command's ``finally`` blocks then stop what it started: ``make`` interrupted, a closed terminal, ``timeout``
    and a CI cancel send SIGTERM, which otherwise ends Python at once and leaves the processes it started (each in
    a process group of its own, so the terminal's signal never reaches them) running. A second signal while the
    clean-up runs is ignored (SIGKILL still ends it); the processes it starts inherit none of this. Outside the
    main thread (where Python cannot set handlers) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def _interrupt(signum: int, _frame: object) -> None:
        if seen:
            return
        seen.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return True


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp after the command name
            out.append(int(stat.parent.name))
    return out


def terminate_group(pid: int, timeout: float, *, grace: float = 10.0) -> None:
    """SIGTERM the process-group leader ``pid`` (it shuts its children down itself), wait up to ``timeout`` s,
    then SIGTERM whatever is left of its group and SIGKILL what is still there after ``grace`` s (a child the
    leader left behind, e.g. Airflow standalone's scheduler, must not outlive it). SIGKILL at once if the leader
    itself did not stop. Returns once no live process of the group is left (or 5 s after the SIGKILL)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL if pid_alive(pid) else signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously: return once the group is gone
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def child_env(settings: "Settings") -> dict[str, str]:
    """Environment that makes a child process (driver, host, producer, Airflow) see the same home, lake, topics,
    Kafka, and name the command line in its messages as this process does (``KAPPA_CLI``)."""
    env = {"KAPPA_HOME": str(settings.home), "KAPPA_LAKE_URI": settings.lake_uri, "PYTHONUNBUFFERED": "1",
           "KAPPA_TOPIC_PREFIX": settings.topic_prefix,
           "KAPPA_CLI": settings.cli}  # its messages (a DAG's hints) spell the command line as this one does
    if not settings.local_broker:
        env["KAPPA_KAFKA_BOOTSTRAP"] = settings.kafka_bootstrap
    return env


def spawn(args: Sequence[str], *, log_file: Path, settings: "Settings", env: Mapping[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start ``args`` as the leader of a new process group, stdin closed, stdout and stderr appended to
    ``log_file``, in the environment of this process plus :func:`child_env` plus ``env``; from the repository
    root unless ``cwd`` says otherwise."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **child_env(settings), **(env or {})},
                                cwd=str(cwd or settings.repo_root), start_new_session=True)


@dataclass
class Daemon:
    """A background process group with a pid file (``$KAPPA_HOME/run/<name>.pid``) and a log file
    (``$KAPPA_HOME/logs/<name>.log``)."""

    name: str
    settings: "Settings"

    @property
    def pid_file(self) -> Path:
        return Path(self.settings.home) / "run" / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return Path(self.settings.home) / "logs" / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def start(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> int:
        """Start ``args`` unless the daemon runs; returns its pid."""
        running = self.pid()
        if running:
            return running
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        proc = spawn(args, log_file=self.log_file, settings=self.settings, env=env, cwd=cwd)
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the process group; False if it did not run."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate_group(pid, timeout)  # the leader shuts its children down itself
        self.pid_file.unlink(missing_ok=True)
        return True


# ------------------------------------------------------------------ local servers (broker, object store)
def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def owned_process(pid_file: Path, is_ours: "Callable[[list[str]], bool]") -> "psutil.Process | None":
    """The live process whose pid ``pid_file`` holds, if its command line passes ``is_ours`` (a guard against pid
    reuse); None when there is none, it is a zombie, or the pid now belongs to another program."""
    import psutil

    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        cmdline = proc.cmdline()
    except psutil.Error:
        return None
    return proc if is_ours(cmdline) else None


def wait_exit(proc: "psutil.Process", own: subprocess.Popen | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit; through ``own`` (the Popen that started it, if this process
    did) so that it is reaped, not left a zombie. True once it is gone."""
    import psutil

    if own is not None and own.pid == proc.pid:
        try:
            own.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    # not our child: gone, or a zombie its own parent has not reaped yet (e.g. the broker of a `make run` still
    # waiting in another terminal) - dead either way; waiting for the pid to vanish would wait for that parent
    deadline = time.monotonic() + timeout
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
            proc.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            return True
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            if time.monotonic() >= deadline:
                return False


def log_tails(files: "Iterable[Path]", lines: int) -> str:
    """The last ``lines`` lines of each existing, non-empty file, each under a ``--- <file>`` header (for error
    messages); empty when there is none."""
    parts: list[str] = []
    for f in files:
        if f.exists():
            text = f.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
            if text:
                parts.append(f"--- {f} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(parts)

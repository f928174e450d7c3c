"""Runs view versions locally: in the view host (one JVM for many views, :mod:`kappa.host`) or each in its
own driver process (``kappa view run``, one process group each).

Which one: ``mode="host"`` always uses the host (starting it when needed; ``make run`` does this), ``"own"``
always starts a driver process, ``"auto"`` (the default, ``KAPPA_LOCAL_DRIVER``) joins the host when one runs
and starts a driver process otherwise - so a replay triggered while ``make run`` is up joins the running host.

State of driver processes lives under ``$KAPPA_HOME/run`` (``<view>@v<N>.json``: pid, spec, metrics URL, exit file) and logs under
``$KAPPA_HOME/logs``. Starting a job that already runs is a no-op; the driver itself also refuses a second copy
through its checkpoint lock, so even two runners cannot start two drivers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

from kappa.config import Settings
from kappa.identity import view_ref
from kappa.runners.base import JobSpec, JobStatus

__all__ = ["LocalRunner", "MODES", "METRICS_BASE_PORT", "child_env", "group_members", "metrics_port", "pid_alive",
           "terminate_group"]

#: Metrics port of version 1 of the first view declared in kappa/platform.yaml (see :func:`metrics_port`).
METRICS_BASE_PORT = 9401


def metrics_port(view: str, version: int) -> int:
    """The local stack's stable metrics port of a view version.

    The i-th view of ``kappa/platform.yaml`` (from 0) serves version N on ``9401 + i + 10 * (N - 1)``: with the
    shipped views campaign_window_counts v1 on 9401, user_sessions 9402, campaign_catalog 9403, events_raw 9404,
    campaign_window_counts v2 on 9411. A version keeps its URL across restarts and promotions, so a dashboard or a
    bookmark made for it stays valid.
    """
    from kappa.catalog import load_catalog

    names = list(load_catalog().views)
    index = names.index(view) if view in names else len(names)
    stride = 10 if len(names) < 10 else 100
    return METRICS_BASE_PORT + index + stride * (version - 1)


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


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


def child_env(settings: Settings) -> dict[str, str]:
    """Environment that makes a child process (driver, host, producer) see the same home, lake, topics, Kafka."""
    env = {"KAPPA_HOME": str(settings.home), "KAPPA_LAKE_URI": settings.lake_uri, "PYTHONUNBUFFERED": "1",
           "KAPPA_TOPIC_PREFIX": settings.topic_prefix}
    if not settings.local_broker:
        env["KAPPA_KAFKA_BOOTSTRAP"] = settings.kafka_bootstrap
    return env


MODES = ("auto", "host", "own")


class LocalRunner:
    def __init__(self, settings: Settings | None = None, *, mode: str | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.run_dir = Path(self.settings.home) / "run"
        self.log_dir = Path(self.settings.home) / "logs"
        self.mode = mode or os.environ.get("KAPPA_LOCAL_DRIVER", "auto")
        if self.mode not in MODES:
            raise ValueError(f"KAPPA_LOCAL_DRIVER={self.mode!r}: use one of {', '.join(MODES)}")

    # the view host -------------------------------------------------------------------------------------
    def _hosted(self, ref: str) -> bool:
        """Whether ``ref`` is (to be) run by the host: a desired file exists for it."""
        from kappa.host import host_dir

        return (host_dir(self.settings) / "desired" / f"{ref}.json").exists()

    def _use_host(self) -> bool:
        from kappa.host import host_pid

        return self.mode == "host" or (self.mode == "auto" and host_pid(self.settings) is not None)

    def _host_start(self, spec: JobSpec, timeout: float = 300.0) -> JobStatus:
        from kappa import host

        host.start_host(self.settings)
        asked = time.time()
        host.desire(self.settings, spec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the host picks it up within a poll; starting takes a while
            st = host.hosted_status(self.settings, spec.ref)
            if st and st.get("updated", 0) >= asked and st.get("state") in ("running", "failed", "finished"):
                return self._hosted_status(spec.ref)
            if host.host_pid(self.settings) is None:
                break
            time.sleep(0.5)
        return self._hosted_status(spec.ref)

    def _hosted_status(self, ref: str) -> JobStatus:
        from kappa import host

        st = host.hosted_status(self.settings, ref) or {}
        alive = host.host_pid(self.settings) is not None
        state = st.get("state") or "stopped"
        if state == "running" and not alive:
            return JobStatus(ref, "stopped", f"the view host is not running (last: {st.get('detail', '')})")
        if state == "restarting" and alive:  # a failed query the host restarts after a backoff (kappa.host)
            return JobStatus(ref, "running", f"restarting in the view host: {st.get('detail', '')}")
        if state == "running" or (alive and self._hosted(ref) and not st):
            return JobStatus(ref, "running", st.get("detail") or "starting in the view host", st.get("metrics_url"))
        if state not in ("stopped", "failed", "finished"):
            state = "stopped"
        return JobStatus(ref, state, st.get("detail", ""), None)

    def _host_stop(self, ref: str, timeout: float = 120.0) -> JobStatus:
        from kappa import host

        asked = time.time()
        host.undesire(self.settings, ref)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and host.host_pid(self.settings) is not None:
            st = host.hosted_status(self.settings, ref) or {}
            if st.get("state") != "running" or st.get("updated", 0) >= asked:
                break
            time.sleep(0.5)
        status = self._hosted_status(ref)
        return JobStatus(ref, "stopped", status.detail or "stopped by request")

    def _state_file(self, view: str, version: int) -> Path:
        return self.run_dir / f"{view_ref(view, version)}.json"

    def log_file(self, view: str, version: int) -> Path:
        return self.log_dir / f"{view_ref(view, version)}.log"

    def _read(self, view: str, version: int) -> dict | None:
        path = self._state_file(view, version)
        return json.loads(path.read_text()) if path.exists() else None

    def start(self, spec: JobSpec) -> JobStatus:
        current = self.status(spec.view, spec.version)
        if current.state == "running":
            return current
        if spec.metrics_port is None:  # the version's stable port; another one if something else holds it
            port = metrics_port(spec.view, spec.version)
            if not _port_free(port):
                from kappa.broker import free_port

                port = free_port()
            spec = replace(spec, metrics_port=port)
        if self._use_host():
            return self._host_start(spec)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        exit_file = self.run_dir / f"{spec.ref}.exit"
        exit_file.unlink(missing_ok=True)
        log = open(self.log_file(spec.view, spec.version), "ab")
        env = {**os.environ, **spec.env, **child_env(self.settings), "KAPPA_EXIT_FILE": str(exit_file)}
        proc = subprocess.Popen([sys.executable, "-m", "kappa.cli", *spec.args()], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, cwd=str(self.settings.repo_root))
        log.close()
        state = {"pid": proc.pid, "spec": asdict(spec), "started": time.time(),
                 "metrics_url": f"http://127.0.0.1:{spec.metrics_port}/metrics"}
        self._state_file(spec.view, spec.version).write_text(json.dumps(state, indent=2))
        return JobStatus(spec.ref, "running", f"pid {proc.pid}", state["metrics_url"])

    def stop(self, view: str, version: int, *, timeout: float = 60.0) -> JobStatus:
        state = self._read(view, version)
        ref = view_ref(view, version)
        if self._hosted(ref):
            return self._host_stop(ref)
        if not state or not pid_alive(state["pid"]):
            return self.status(view, version)
        pid = state["pid"]
        state["stopped"] = time.time()  # a graceful stop also exits 0: status must not call it "finished"
        self._state_file(view, version).write_text(json.dumps(state, indent=2))
        terminate_group(pid, timeout)  # the driver stops its queries and its JVM child itself
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return JobStatus(ref, "stopped", f"pid {pid} stopped")

    def status(self, view: str, version: int) -> JobStatus:
        ref = view_ref(view, version)
        if self._hosted(ref):
            return self._hosted_status(ref)
        state = self._read(view, version)
        if not state:
            return JobStatus(ref, "stopped", "never started here")
        if pid_alive(state["pid"]):
            return JobStatus(ref, "running", f"pid {state['pid']}", state.get("metrics_url"))
        if state.get("stopped"):
            return JobStatus(ref, "stopped", f"pid {state['pid']} stopped by request")
        exit_file = self.run_dir / f"{ref}.exit"
        if exit_file.exists():
            code = exit_file.read_text().strip()
            if code == "0" and (state.get("spec") or {}).get("end_timestamp_ms") is not None:
                return JobStatus(ref, "finished", "bounded run completed")
            if code == "0":
                return JobStatus(ref, "stopped", f"pid {state['pid']} exited 0")
            return JobStatus(ref, "failed", f"exit {code}; see {self.log_file(view, version)}")
        return JobStatus(ref, "stopped", f"pid {state['pid']} not running; see {self.log_file(view, version)}")

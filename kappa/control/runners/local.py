"""Runs view versions locally: in the view host (one JVM for many views, :mod:`kappa.runtime.host`) or each in its
own driver process (:mod:`kappa.runtime.driver`, one process group each).

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
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

from kappa.config import LOCAL_DRIVER_MODES, Settings
from kappa.identity import view_ref
from kappa.control.runners.base import JobStatus
from kappa.process import pid_alive, spawn, terminate_group
from kappa.runtime.driver import JobSpec

__all__ = ["LocalRunner", "METRICS_BASE_PORT", "metrics_port"]

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


class LocalRunner:
    def __init__(self, settings: Settings | None = None, *, mode: str | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.run_dir = Path(self.settings.home) / "run"
        self.log_dir = Path(self.settings.home) / "logs"
        self.mode = mode or self.settings.local_driver
        if self.mode not in LOCAL_DRIVER_MODES:
            raise ValueError(f"mode {self.mode!r}: use one of {', '.join(LOCAL_DRIVER_MODES)}")

    @classmethod
    def from_settings(cls, settings: Settings) -> "LocalRunner":
        """The runner ``KAPPA_RUNNER=local`` names (:func:`kappa.control.runners.runner_for`)."""
        return cls(settings)

    # the view host -------------------------------------------------------------------------------------
    def _hosted(self, ref: str) -> bool:
        """Whether ``ref`` is (to be) run by the host: a desired file exists for it."""
        from kappa.runtime.host import host_dir

        return (host_dir(self.settings) / "desired" / f"{ref}.json").exists()

    def _use_host(self) -> bool:
        from kappa.runtime.host import host_pid

        return self.mode == "host" or (self.mode == "auto" and host_pid(self.settings) is not None)

    def _host_start(self, spec: JobSpec, timeout: float = 300.0, *, wait: bool = True) -> JobStatus:
        from kappa.runtime import host

        host.start_host(self.settings)
        asked = time.time()
        host.desire(self.settings, spec)
        if not wait:
            return JobStatus(spec.ref, "running", "asked of the view host (it starts it at its next poll)",
                             f"http://127.0.0.1:{spec.metrics_port}/metrics")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the host picks it up within a poll; starting takes a while
            st = host.hosted_status(self.settings, spec.ref)
            if st and st.get("updated", 0) >= asked and st.get("state") in ("running", "waiting", "failed",
                                                                            "finished"):
                return self._hosted_status(spec.ref)
            if host.host_pid(self.settings) is None:
                break
            time.sleep(0.5)
        return self._hosted_status(spec.ref)

    def _hosted_status(self, ref: str) -> JobStatus:
        from kappa.runtime import host

        st = host.hosted_status(self.settings, ref) or {}
        alive = host.host_pid(self.settings) is not None
        state = st.get("state") or "stopped"
        if state == "running" and not alive:
            return JobStatus(ref, "stopped", f"the view host is not running (last: {st.get('detail', '')})")
        if state == "restarting" and alive:  # a failed query the host restarts after a backoff (kappa.runtime.host)
            return JobStatus(ref, "running", f"restarting in the view host: {st.get('detail', '')}")
        if state == "waiting" and alive:  # its topics do not exist yet; it starts once they do
            return JobStatus(ref, "running", f"in the view host, {st.get('detail', '')}", st.get("metrics_url"))
        if state == "running" or (alive and self._hosted(ref) and not st):
            return JobStatus(ref, "running", st.get("detail") or "starting in the view host", st.get("metrics_url"))
        if state not in ("stopped", "failed", "finished"):
            state = "stopped"
        return JobStatus(ref, state, st.get("detail", ""), None)

    def _host_stop(self, ref: str, timeout: float = 120.0) -> JobStatus:
        from kappa.runtime import host

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

    def start(self, spec: JobSpec, *, wait: bool = True) -> JobStatus:
        """Start ``spec``; in the view host, ``wait=False`` only asks the host (which starts it at its next poll)
        instead of waiting until it runs - what ``kappa up`` does for all its views at once, then follows them."""
        current = self.status(spec.view, spec.version)
        if current.state == "running":
            return current
        if spec.metrics_port is None:  # the version's stable port; another one if something else holds it
            port = metrics_port(spec.view, spec.version)
            if not _port_free(port):
                from kappa.log.broker import free_port

                port = free_port()
            spec = replace(spec, metrics_port=port)
        if self._use_host():
            return self._host_start(spec, wait=wait)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        exit_file = self.run_dir / f"{spec.ref}.exit"
        exit_file.unlink(missing_ok=True)
        proc = spawn(spec.command(), log_file=self.log_file(spec.view, spec.version), settings=self.settings,
                     env={**spec.env, "KAPPA_EXIT_FILE": str(exit_file)})
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

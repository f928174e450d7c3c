"""The local stack behind ``make run``: broker, topics, the four views, a live producer and Airflow.

Everything runs as background process groups recorded under ``$KAPPA_HOME/run`` (pid files) with logs in
``$KAPPA_HOME/logs``; ``kappa down`` stops them all. The data (Kafka log, Delta tables, checkpoints, Airflow's
database) stays in ``$KAPPA_HOME`` so ``make run`` after ``make down`` continues where it stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kappa.config import Settings
from kappa.runners.local import child_env, terminate_group
from kappa.runners.local import pid_alive as _alive

__all__ = ["Daemon", "up", "down", "status", "VIEW_METRICS_PORTS", "AIRFLOW_PORT"]

#: Metrics port of each view's default version in the local stack.
VIEW_METRICS_PORTS = {"events_raw": 9401, "campaign_catalog": 9402, "campaign_window_counts": 9403,
                      "user_sessions": 9404}
AIRFLOW_PORT = int(os.environ.get("KAPPA_AIRFLOW_PORT", "8080"))


@dataclass
class Daemon:
    """A background process group with a pid file and a log file."""

    name: str
    settings: Settings

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
        return pid if _alive(pid) else None

    def start(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        running = self.pid()
        if running:
            return running
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, cwd=str(cwd or self.settings.repo_root),
                                    start_new_session=True)
        self.pid_file.write_text(str(proc.pid))
        return proc.pid

    def stop(self, timeout: float = 60.0) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate_group(pid, timeout)  # the leader shuts its children down itself
        self.pid_file.unlink(missing_ok=True)
        return True


def airflow_env(settings: Settings) -> dict[str, str]:
    """Environment of the local Airflow: its home under KAPPA_HOME, the repo's dags/, no examples."""
    home = Path(settings.home) / "airflow"
    return {
        **child_env(settings),
        # standalone starts its components as `airflow ...` subprocesses: use this environment's one
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(Path(settings.repo_root) / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__API__PORT": str(AIRFLOW_PORT),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # an idle Airflow on a 2-core machine: a few executor slots instead of 32 idle LocalExecutor workers,
        # one DAG parsing process, a scheduler that sleeps between empty loops
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "60",
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "5",
    }


def airflow_password(settings: Settings) -> str | None:
    path = Path(settings.home) / "airflow" / "simple_auth_manager_passwords.json.generated"
    try:
        return json.loads(path.read_text()).get("admin")
    except (OSError, ValueError):
        return None


def up(settings: Settings, *, rate: float = 200.0, airflow: bool = True, echo=print) -> None:
    """Start (or continue) the whole local stack; idempotent."""
    from kappa.catalog import load_catalog
    from kappa.generator import campaign_records, publish_campaigns, universe
    from kappa.runners.base import JobSpec
    from kappa.runners.local import LocalRunner
    from kappa.topics import declared_topics, ensure_topics, partition_offsets

    if settings.local_broker:
        from kappa.broker import LocalBroker

        broker = LocalBroker.from_settings(settings).start()
        echo(f"kafka      {broker.bootstrap}  (KRaft, data in {broker.data_dir})")
    else:
        echo(f"kafka      {settings.kafka_bootstrap}  (external)")
    catalog = load_catalog()
    for change in ensure_topics(settings, declared_topics(settings)):
        echo(f"topic      {change}")
    campaigns = settings.topic("campaigns")
    if sum(high for _low, high in partition_offsets(settings, campaigns).values()) == 0:
        publish_campaigns(settings, campaign_records(universe(seed=0)), topic=campaigns)
        echo("campaigns  published 1000 ad -> campaign mappings (100 campaigns)")

    runner = LocalRunner(settings, mode="host")  # every live view in one Spark application (kappa.host)
    for name, spec in catalog.views.items():
        port = VIEW_METRICS_PORTS.get(name, 9410)
        status = runner.start(JobSpec(name, spec.default_version, starting="earliest", metrics_port=port))
        echo(f"view       {status.ref:<28} {status.state:<8} metrics {status.metrics_url}")

    producer = Daemon("producer", settings)
    producer.start([sys.executable, "-m", "kappa.cli", "produce", "--live", "--rate", str(rate),
                    "--count", "0", "--no-campaigns", "--late-fraction", "0.05", "--malformed-fraction", "0.01"],
                   env=child_env(settings))
    echo(f"producer   {rate:g} events/s into ad-events (log {producer.log_file})")

    if airflow:
        daemon = Daemon("airflow", settings)
        daemon.start([sys.executable, "-m", "airflow", "standalone"], env=airflow_env(settings))
        echo(f"airflow    http://127.0.0.1:{AIRFLOW_PORT}  (login admin / see `kappa status`; log {daemon.log_file})")


def down(settings: Settings, *, echo=print) -> None:
    """Stop everything ``up`` started; data stays."""
    from kappa.runners.local import LocalRunner

    for name in ("producer", "airflow"):
        if Daemon(name, settings).stop():
            echo(f"stopped {name}")
    from kappa.host import stop_host

    runner = LocalRunner(settings, mode="own")
    run_dir = Path(settings.home) / "run"
    for state in sorted(run_dir.glob("*@v*.json")):
        view, version = state.stem.split("@v")
        if runner.status(view, int(version)).state == "running":
            status = runner.stop(view, int(version))
            echo(f"stopped {status.ref}")
    if stop_host(settings):  # it drains and stops every view version it runs; they restart with the next `up`
        echo("stopped view host")
    if settings.local_broker:
        from kappa.broker import LocalBroker

        if LocalBroker.from_settings(settings).stop():
            echo("stopped kafka")


def status(settings: Settings) -> list[tuple[str, str, str]]:
    """(component, state, detail) rows for ``kappa status``."""
    from kappa.runners.local import LocalRunner

    rows: list[tuple[str, str, str]] = []
    if settings.local_broker:
        from kappa.broker import LocalBroker

        broker = LocalBroker.from_settings(settings)
        rows.append(("kafka", "running" if broker.is_running() else "stopped", broker.bootstrap))
    from kappa.host import host_dir, host_pid

    runner = LocalRunner(settings)
    run = Path(settings.home) / "run"
    pid = host_pid(settings)
    rows.append(("view host", "running" if pid else "stopped", f"pid {pid}, one JVM" if pid else ""))
    refs = {p.stem for p in run.glob("*@v*.json")} | {p.stem for p in (host_dir(settings) / "desired").glob("*.json")}
    for ref in sorted(refs):
        view, version = ref.split("@v")
        st = runner.status(view, int(version))
        rows.append((st.ref, st.state, st.metrics_url or st.detail))
    producer = Daemon("producer", settings)
    rows.append(("producer", "running" if producer.pid() else "stopped", str(producer.log_file)))
    airflow = Daemon("airflow", settings)
    password = airflow_password(settings)
    rows.append(("airflow", "running" if airflow.pid() else "stopped",
                 f"http://127.0.0.1:{AIRFLOW_PORT} admin/{password or '(being generated)'}"))
    return rows

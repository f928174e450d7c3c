"""The local stack behind ``make run``: broker, topics, the views (default versions), a live producer and Airflow.

Everything runs as background process groups recorded under ``$KAPPA_HOME/run`` (pid files) with logs in
``$KAPPA_HOME/logs``; ``kappa down`` stops them all. The data (Kafka log, Delta tables, checkpoints, Airflow's
database) stays in ``$KAPPA_HOME`` so ``make run`` after ``make down`` continues where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kappa.config import Settings
from kappa.errors import KappaError, one_line
from kappa.front import supervisor
from kappa.identity import view_ref
from kappa.process import Daemon, child_env

__all__ = ["Readiness", "StackError", "airflow_ready", "airflow_url", "down",
           "stack_views", "start_airflow", "start_producer", "status", "stop_producer", "up", "wait_ready"]

class StackError(KappaError, RuntimeError):
    """The local stack did not come up (one line: who, why, which log)."""


#: The local Airflow's SQLite database: a connection waits up to 60 s for another's write lock instead of
#: Python's default 5 s - a task started while the scheduler and a replay's tasks write would otherwise fail to
#: start ("database is locked"). Named by import path in Airflow's settings, for its sync and async engines.
AIRFLOW_SQLITE_CONNECT_ARGS = {"timeout": 60}


#: How long a task waits for Airflow's execution API (its API server) before it fails: tenacity's random
#: exponential wait inside Airflow's task client, here at least 10 s between 20 calls. The chart sets the same.
AIRFLOW_EXECUTION_API_RETRY = {
    "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": "20",
    "AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MIN": "10",
    "AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX": "20",
}


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
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": f"{__name__}.AIRFLOW_SQLITE_CONNECT_ARGS",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": f"{__name__}.AIRFLOW_SQLITE_CONNECT_ARGS",
        "AIRFLOW__API__PORT": str(settings.airflow_port),
        "AIRFLOW__API__HOST": "127.0.0.1",  # loopback, like every other service of the local stack
        # the UI's links and the tasks' execution API calls go to that address (the default, localhost:8080,
        # may resolve to ::1 or name another port)
        "AIRFLOW__API__BASE_URL": airflow_url(settings),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{airflow_url(settings)}/execution/",
        # standalone starts its scheduler and its API server side by side, and the API server takes 1-3 min on
        # 2 busy cores: a task the scheduler starts meanwhile (kappa_retire's hourly run, when Airflow starts
        # just before a full hour) waits for it - 20 calls 10-20 s apart, >= 190 s - instead of failing after
        # Airflow's default 5 calls within 15 s and logging a traceback per task
        **AIRFLOW_EXECUTION_API_RETRY,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # an idle Airflow on a 2-core machine: a few executor slots instead of 32 idle LocalExecutor workers,
        # one DAG parsing process
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "60",
        # the scheduler's sleep between empty loops is the gap between one task's end and the next one's start:
        # 1 s (Airflow's default) instead of 5 s takes ~20 s off a replay run of 8 tasks, and the whole idle
        # Airflow used 2.8 % of one core with it against 2.3 % (60 s samples, 2 cores)
        "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "1",
        # a replay's sensor reports progress every 10 s here (the DAG's default, 60 s, suits a cluster)
        "KAPPA_REPLAY_POKE_SECONDS": str(settings.replay_poke_seconds or 10),
    }


def airflow_password(settings: Settings) -> str | None:
    path = Path(settings.home) / "airflow" / "simple_auth_manager_passwords.json.generated"
    try:
        return json.loads(path.read_text()).get("admin")
    except (OSError, ValueError):
        return None


def start_producer(settings: Settings, *, rate: float = 200.0) -> Daemon:
    """Start the live producer (YSB events at ``rate`` events/s, 5 % late, 1 % malformed) unless it runs; while
    the supervisor runs, it is started again if it dies."""
    producer = Daemon("producer", settings)
    producer.start([sys.executable, "-m", "kappa.front.cli", "produce", "--live", "--rate", str(rate),
                    "--count", "0", "--no-campaigns", "--late-fraction", "0.05", "--malformed-fraction", "0.01"],
                   env=child_env(settings))
    return producer


def stop_producer(settings: Settings) -> bool:
    """Stop the live producer; the views keep running (False if it did not run); the supervisor leaves it
    stopped."""
    supervisor.forget(settings, "producer")
    return Daemon("producer", settings).stop()


@dataclass
class Readiness:
    """Where one view version of the stack is on its way to its first committed micro-batch."""

    ref: str
    state: str = "starting"
    detail: str = "waiting for the view host"
    ready_after: float | None = None  # seconds since the wait began

    @property
    def ready(self) -> bool:
        return self.ready_after is not None


def stack_views(settings: Settings) -> list[tuple[str, int]]:
    """(view, default version) of every declared view: what ``up`` runs."""
    from kappa.catalog import load_catalog

    return [(name, spec.default_version) for name, spec in load_catalog().views.items()]


def wait_ready(settings: Settings, *, timeout: float = 600.0, poll: float = 1.0,
               on_change: Callable[[list[Readiness]], None] | None = None,
               heartbeat: float | None = None) -> list[Readiness]:
    """Block until every view of the stack runs, has committed a micro-batch that covers its topic as it was
    when the wait began (after a restart: it has caught up with what was there) and has rows in its table (a view
    writing closed sessions or windows only has one once the watermark closed the first: the detail says so).
    ``on_change`` sees the rows whenever one changes, and every ``heartbeat`` seconds when none did.

    Raises:
        StackError: A view failed, or ``timeout`` seconds passed (the message names who is not ready and where
            its log is).
    """
    from kappa.control.replay import committed_offsets, stream_topic
    from kappa.control.runners.local import LocalRunner
    from kappa.log.topics import partition_offsets

    runner = LocalRunner(settings, mode="host")
    began = time.monotonic()
    views = stack_views(settings)
    targets = {view_ref(v, n): {p: hi for p, (_lo, hi) in partition_offsets(settings, settings.topic(
        stream_topic(v, n))).items()} for v, n in views}
    rows = {view_ref(v, n): Readiness(view_ref(v, n)) for v, n in views}
    last: list[tuple[str, str]] = []
    told = began
    while True:
        for view, version in views:
            row = rows[view_ref(view, version)]
            if row.ready:
                continue
            job = runner.status(view, version)
            if job.state == "failed":
                raise StackError(f"{row.ref} failed: {one_line(job.detail)}; see {Path(settings.home) / 'logs'}"
                                 "/view-host.log")
            if job.state != "running":
                row.state, row.detail = "starting", job.detail or "waiting for the view host"
                continue
            if job.metrics_url is None:  # asked of the host, which has not reported it yet (its Spark starts first)
                row.state, row.detail = "starting", "in the view host, whose Spark session starts first"
                continue
            offsets, batch = committed_offsets(settings, view, version, settings.topic(stream_topic(view, version)))
            behind = sum(max(0, end - offsets.get(p, 0)) for p, end in targets[row.ref].items())
            rows_now = _table_rows(settings, view, version) if batch is not None and not behind else 0
            if batch is None:
                row.state, row.detail = "running", "query started, first micro-batch under way"
            elif behind:
                row.state, row.detail = "running", f"batch {batch} committed, {behind:,} records to catch up"
            elif not rows_now:  # read everything, written nothing yet: say what it waits for
                why = _no_rows_yet(view, version)
                row.state, row.detail = "running", f"batch {batch} committed, no row yet ({why})"
            else:
                row.state, row.detail = "ready", f"batch {batch} committed, {rows_now:,} rows"
                row.ready_after = time.monotonic() - began
        snapshot = [(r.state, r.detail) for r in rows.values()]
        if on_change is not None and (snapshot != last or (heartbeat is not None
                                                           and time.monotonic() - told >= heartbeat)):
            on_change(list(rows.values()))
            told = time.monotonic()
        last = snapshot
        if all(r.ready for r in rows.values()):
            return list(rows.values())
        if time.monotonic() - began > timeout:
            waiting = ", ".join(f"{r.ref} ({r.detail})" for r in rows.values() if not r.ready)
            raise StackError(f"not ready after {timeout:.0f} s: {waiting}; see {Path(settings.home) / 'logs'}"
                             "/view-host.log")
        time.sleep(poll)


def _table_rows(settings: Settings, view: str, version: int) -> int:
    """Rows in the version's Delta table now (its files' record counts; 0 before its first commit)."""
    from kappa.control.registry import open_delta
    from kappa.identity import ViewPaths

    try:  # the stack's lake is a local folder
        table = open_delta(ViewPaths(settings.lake_uri, view, version).table.removeprefix("file:"))
        counts = table.get_add_actions(flatten=True).column("num_records").to_pylist()
    except Exception:  # noqa: BLE001 - no table yet (or not readable yet): no rows to show
        return 0
    return int(sum(n or 0 for n in counts))


def _no_rows_yet(view: str, version: int) -> str:
    """Why a view that read its whole topic has no row yet, from its definition."""
    from kappa.runtime.view import declared_view

    definition = declared_view(view, version)
    if definition.stateful and definition.output_mode == "append":
        return "it writes a row once the watermark closes it: a session after its gap, a window after its delay"
    return f"it read all of {definition.stream_topic} so far and had nothing to write from it yet"


def airflow_ready(settings: Settings, timeout: float = 2.0) -> bool:
    """Whether the local Airflow is usable: the API server answers, the scheduler reports healthy and the
    platform's DAGs are parsed (a replay can be triggered)."""
    return airflow_awaited(settings, timeout) is None


def airflow_awaited(settings: Settings, timeout: float = 2.0) -> str | None:
    """What the local Airflow is not ready with yet (None when it is usable, :func:`airflow_ready`)."""
    from kappa.front.airflow_client import AirflowAPI, AirflowError

    try:
        with urllib.request.urlopen(f"{airflow_url(settings)}/api/v2/monitor/health", timeout=timeout) as resp:
            health = json.loads(resp.read())
    except (OSError, ValueError):
        return "its API server to answer (Airflow starts its scheduler, DAG processor, triggerer and API server)"
    scheduler = (health.get("scheduler") or {}).get("status")
    if scheduler != "healthy":
        return f"its scheduler to report healthy (now: {scheduler or 'no heartbeat yet'})"
    try:
        if AirflowAPI.local(settings).has_dag("kappa_replay"):
            return None
    except AirflowError:
        pass
    return "its DAG processor to parse the platform's DAGs (kappa_replay)"


def airflow_url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.airflow_port}"


def start_airflow(settings: Settings) -> Daemon:
    """Start Airflow standalone for the stack unless it runs (its first start migrates its database: a minute)."""
    daemon = Daemon("airflow", settings)
    daemon.start([sys.executable, "-m", "airflow", "standalone"], env=airflow_env(settings))
    return daemon


def sql_ready_file(settings: Settings) -> Path:
    """Written by the SQL service once both endpoints listen (:func:`kappa.front.sql.server.serve`)."""
    return Path(settings.home) / "sql" / "ready"


#: how much lower the local SQL service's CPU priority is than the views' (``kappa sql serve --nice``): on the
#: stack's shared cores an analyst's scan waits for the views' micro-batches, as the chart's CPU requests make it
SQL_NICE = 10


def start_sql(settings: Settings) -> Daemon:
    """Start the analysts' SQL service (JDBC and Spark Connect on 127.0.0.1, :func:`sql_endpoints`) unless it runs,
    at a lower CPU priority (:data:`SQL_NICE`); its token is ``$KAPPA_HOME/sql/token`` (made once)."""
    from kappa.front.sql.server import ensure_token

    ensure_token(settings)
    daemon = Daemon("sql", settings)
    if daemon.pid() is None:
        sql_ready_file(settings).unlink(missing_ok=True)
    daemon.start([sys.executable, "-m", "kappa.front.cli", "sql", "serve", "--nice", str(SQL_NICE)],
                 env=child_env(settings))
    return daemon


def sql_endpoints(settings: Settings) -> str:
    """The SQL service's addresses for a client, and where its token is."""
    return (f"jdbc:hive2://127.0.0.1:{settings.sql_jdbc_port}/ and sc://localhost:{settings.sql_connect_port}/ "
            f"(password / token: `{settings.cli} sql token`)")


def up(settings: Settings, *, rate: float = 200.0, echo=print) -> None:
    """Start (or continue) the broker, the topics, the live producer and every view (in the view host);
    idempotent. Returns once the view host runs and has been asked for every view (:func:`wait_ready` follows
    them to their first rows; :func:`start_airflow` adds Airflow, started meanwhile)."""
    from kappa.log.generator import campaign_records, publish_campaigns, universe
    from kappa.runtime.driver import JobSpec
    from kappa.control.runners.local import LocalRunner
    from kappa.control.leases import converge_topics
    from kappa.log.topics import partition_offsets

    from kappa.objectstore import use_platform_store
    from kappa.runtime.checkpoint import check_lake

    store = use_platform_store(settings, start=True)  # a lake on the platform's object store (KAPPA_LAKE_URI=s3a://)
    check_lake(settings.lake_uri)  # a wrong endpoint, bucket or credential: one line, before anything starts
    if store is not None:
        echo(f"lake       {settings.lake_uri}  (object store {store.endpoint}, data in {_short(store.home)})")
    if settings.local_broker:
        from kappa.log.broker import LocalBroker

        broker = LocalBroker.from_settings(settings).start()
        echo(f"kafka      {broker.bootstrap}  (KRaft, data in {broker.data_dir})")
    else:
        echo(f"kafka      {settings.kafka_bootstrap}  (external)")
    for change in converge_topics(settings):  # declared configs, plus the retention leases of replays in flight
        echo(f"topic      {change}")
    campaigns = settings.topic("campaigns")
    if sum(high for _low, high in partition_offsets(settings, campaigns).values()) == 0:
        publish_campaigns(settings, campaign_records(universe(seed=0)), topic=campaigns)
        echo("campaigns  published 1000 ad -> campaign mappings (100 campaigns)")

    # the producer first: the views' first micro-batches then hold rows
    producer = start_producer(settings, rate=rate)
    echo(f"producer   {rate:g} events/s into {settings.topic('ad-events')} (log {_short(producer.log_file)})")
    runner = LocalRunner(settings, mode="host")  # every live view in one Spark application (kappa.runtime.host)
    views = stack_views(settings)
    echo(f"views      starting {len(views)} view versions in the view host (log "
         f"{_short(Path(settings.home) / 'logs' / 'view-host.log')})")
    for name, version in views:  # asked at once; wait_ready follows them (the host's JVM starts meanwhile)
        runner.start(JobSpec(name, version, starting="earliest"), wait=False)
    # what runs now is started again if it dies (kappa.front.supervisor); Airflow is added once it is started
    wanted: list[tuple[str, dict]] = [("view host", {}), ("producer", {"rate": rate})]
    if settings.local_broker:
        wanted.insert(0, ("kafka", {}))
    if store is not None:
        wanted.insert(0, ("object store", {}))
    for component, args in wanted:
        supervisor.want(settings, component, **args)
    daemon = supervisor.start(settings)
    echo(f"supervisor restarts what stopped (log {_short(daemon.log_file)})")


def down(settings: Settings, *, echo=print) -> None:
    """Stop everything ``up`` started; data stays."""
    from kappa.control.runners.local import LocalRunner

    if supervisor.stop(settings):  # first: nothing stopped here may be started again
        echo("stopped supervisor")

    for name in ("producer", "airflow", "sql"):
        if Daemon(name, settings).stop():
            echo(f"stopped {name}")
    from kappa.runtime.host import stop_host

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
        from kappa.log.broker import LocalBroker

        if LocalBroker.from_settings(settings).stop():
            echo("stopped kafka")
    from kappa.objectstore import LocalObjectStore, on_platform_store

    if on_platform_store(settings) and LocalObjectStore.from_settings(settings).stop():
        echo("stopped object store")


def _short(path: Path) -> str:
    """A path relative to the working directory when it is below it (what a user types), else absolute."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def status(settings: Settings) -> list[tuple[str, str, str]]:
    """(component, state, where) rows for ``kappa status``: the broker, the view host, every view version the
    local runner knows (with its metrics URL while it runs), the producer and Airflow."""
    from kappa.runtime.host import host_dir, host_pid
    from kappa.control.runners.local import LocalRunner

    rows: list[tuple[str, str, str]] = []
    from kappa.objectstore import LocalObjectStore, on_platform_store

    if on_platform_store(settings):
        store = LocalObjectStore.from_settings(settings)
        rows.append(("object store", "running" if store.is_running() else "stopped",
                     f"{store.endpoint}, lake {settings.lake_uri}"))
    if settings.local_broker:
        from kappa.log.broker import LocalBroker

        broker = LocalBroker.from_settings(settings)
        rows.append(("kafka", "running" if broker.is_running() else "stopped", broker.bootstrap))
    runner = LocalRunner(settings)
    run = Path(settings.home) / "run"
    pid = host_pid(settings)
    rows.append(("view host", "running" if pid else "stopped", f"pid {pid}, one JVM" if pid else ""))
    refs = {p.stem for p in run.glob("*@v*.json")} | {p.stem for p in (host_dir(settings) / "desired").glob("*.json")}
    for ref in sorted(refs):
        view, version = ref.split("@v")
        st = runner.status(view, int(version))
        rows.append((st.ref, st.state, st.metrics_url if st.state == "running" and st.metrics_url else st.detail))
    producer = Daemon("producer", settings)
    rows.append(("producer", "running" if producer.pid() else "stopped", f"log {_short(producer.log_file)}"))
    airflow = Daemon("airflow", settings)
    password = airflow_password(settings)
    rows.append(("airflow", "running" if airflow.pid() else "stopped",
                 f"{airflow_url(settings)} admin/{password or '(being generated)'}"))
    sql = Daemon("sql", settings)
    if sql.pid() or sql_ready_file(settings).parent.exists():
        state = "stopped" if not sql.pid() else "running" if sql_ready_file(settings).exists() else "starting"
        rows.append(("sql", state, sql_endpoints(settings)))
    watching = Daemon("supervisor", settings)
    rows.append(("supervisor", "running" if watching.pid() else "stopped",
                 f"restarts what stopped; log {_short(watching.log_file)}"))
    return _with_restarts(rows, supervisor.records(settings))


def _with_restarts(rows: list[tuple[str, str, str]],
                   records: dict[str, "supervisor.Record"]) -> list[tuple[str, str, str]]:
    """Each component's row with what the supervisor did to it: its restarts and why, a restart it waits for, a
    crash loop it gave up on."""
    out = []
    for component, state, where in rows:
        record = records.get(component)
        line = record.line(component) if record else None
        if line:
            if record.gave_up:
                state = "crash loop"
            elif record.next_at and state != "running":
                state = "restarting"
            where = f"{where}; {line}" if where else line
        out.append((component, state, where))
    return out

"""``kappa``: the platform's command line (the DAGs call the same Python API).

Errors a user can cause (bad arguments, a second driver, a missing prerequisite) print one line, not a trace.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from kappa.config import DEFAULT_KEEP_HOURS
from kappa.errors import KappaError, one_line

__all__ = ["app", "main", "UserError"]

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

app = typer.Typer(help="Kappa platform: Kafka log -> Spark views on Delta.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
view_app = typer.Typer(help="Run and manage view-version drivers.", no_args_is_help=True)
broker_app = typer.Typer(help="The local KRaft broker.", no_args_is_help=True)
topics_app = typer.Typer(help="Topics declared in kappa/platform.yaml.", no_args_is_help=True)
host_app = typer.Typer(help="The view host: many view versions in one Spark application.", no_args_is_help=True)
producer_app = typer.Typer(help="The live producer of the local stack.", no_args_is_help=True)
app.add_typer(producer_app, name="producer")
airflow_app = typer.Typer(help="Airflow through its REST API: the local stack's, or any other with --url.",
                          no_args_is_help=True)
app.add_typer(airflow_app, name="airflow")
app.add_typer(view_app, name="view")
app.add_typer(host_app, name="host")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
lake_app = typer.Typer(help="The lake (KAPPA_LAKE_URI).", no_args_is_help=True)
app.add_typer(lake_app, name="lake")
sql_app = typer.Typer(help="The analysts' SQL service: JDBC and Spark Connect over the serving views, read-only.",
                      no_args_is_help=True)
app.add_typer(sql_app, name="sql")


class UserError(KappaError):
    """A mistake the user can fix; printed as one line."""


def _settings():
    from kappa.config import Settings

    return Settings.from_env()


def _tool_settings():
    """Settings of a command that may start a Spark session of its own (replay's and verify's recompute, repair):
    the JVM's log goes to ``<home>/logs/spark-cli.log`` (``KAPPA_SPARK_LOG_FILE`` overrides), not the terminal."""
    settings = _settings()
    return settings.replace(spark_log_file=settings.spark_log_file or str(Path(settings.home) / "logs" /
                                                                             "spark-cli.log"))


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'you asked for something impossible' or 'a part said no', shown without a traceback:
    the platform's own (:class:`kappa.errors.KappaError`) and the builtin ones a bad argument raises."""
    return (KappaError, ValueError, FileNotFoundError, KeyError)


# -------------------------------------------------------------------------------------------- views
def _load_view(name: str, version: int | None):
    from kappa.runtime.view import declared_view

    return declared_view(name, version)


@view_app.command("run")
def view_run(
    view: str = typer.Argument(..., help="View name (kappa/platform.yaml)."),
    version: Optional[int] = typer.Option(None, help="View version (default: the view's default_version)."),
    starting: str = typer.Option("latest", help="earliest | latest | ts:<epoch ms> | JSON offsets (new runs)."),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus /metrics port (0 = any free port; default "
                                               "KAPPA_METRICS_PORT, 9400)."),
    trigger_seconds: Optional[float] = typer.Option(
        None, help="Processing-time trigger interval of live runs (default: the view's `trigger` in platform.yaml, "
                   "else its module's, else 2 s)."),
    available_now: bool = typer.Option(False, "--available-now", help="Process what the log holds, then stop."),
    end_ts: Optional[int] = typer.Option(None, help="Bounded backfill: stop at this Kafka timestamp (ms)."),
    max_offsets_per_trigger: Optional[int] = typer.Option(None, help="Bound micro-batch size."),
) -> None:
    """Run one view-version driver in the foreground until SIGTERM (or until a bounded run ends)."""
    from kappa.runtime.driver import run_view

    settings = _settings()
    run_view(settings, view, version, starting=starting,
             metrics_port=settings.metrics_port if metrics_port is None else metrics_port,
             trigger_seconds=trigger_seconds, available_now=available_now, end_ts=end_ts,
             max_offsets_per_trigger=max_offsets_per_trigger,
             echo=lambda line: console.print(line, highlight=False))


@view_app.command("start")
def view_start(
    view: str,
    version: Optional[int] = typer.Option(None),
    starting: str = typer.Option("latest"),
    metrics_port: Optional[int] = typer.Option(None, help="Prometheus port (default: the version's stable port)."),
) -> None:
    """Start a view-version driver in the background (the runner KAPPA_RUNNER names: local by default)."""
    from kappa.control.runners import runner_for
    from kappa.runtime.driver import JobSpec

    definition = _load_view(view, version)
    status = runner_for(_settings()).start(JobSpec(view, definition.version, starting=starting,
                                                   metrics_port=metrics_port))
    console.print(f"{status.ref}: {status.state} ({status.detail}) {status.metrics_url or ''}", highlight=False)


@view_app.command("stop")
def view_stop(view: str, version: Optional[int] = typer.Option(None)) -> None:
    """Stop a background view-version driver (the runner KAPPA_RUNNER names: local by default). A replay under
    way stops with it: its retention lease ends here (the same command without --start resumes it)."""
    from kappa.control.leases import release
    from kappa.control.registry import Registry
    from kappa.control.runners import runner_for

    settings = _settings()
    definition = _load_view(view, version)
    status = runner_for(settings).stop(view, definition.version)
    console.print(f"{status.ref}: {status.state} ({status.detail})", highlight=False)
    rec = Registry(settings.lake_uri).get(view, definition.version)
    if rec is not None and rec.state == "building":  # asked to stop: its lease goes now, not when it expires
        for lease in release(settings, view, definition.version, by=_by(), note="its job was stopped (view stop)"):
            console.print(f"{lease.ref}: retention lease released (the topic's declared retention is back)",
                          highlight=False)
        console.print(f"{status.ref} stays registered as building, its job stopped: resume it with `{settings.cli} "
                      f"replay {view} --version {definition.version}`", highlight=False)


@host_app.command("run")
def host_run(
    view: list[str] = typer.Option([], "--view", help="Always run this view: name or name@vN (repeatable)."),
    starting: list[str] = typer.Option(["earliest"], "--starting", help="Start position of new checkpoints of "
                                       "the --view versions: once for all, or once per --view in the same order."),
    driver_memory: str = typer.Option("", help="Heap ceiling of the host's Spark driver JVM (default: "
                                      "KAPPA_HOST_DRIVER_MEMORY, 768m)."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, max=65535, help="Prometheus port of the first "
                                     "--view; the i-th --view (from 0) gets this + i. 0: any free port for each."),
    handed_over: str = typer.Option("", "--handed-over", metavar="FILE", help="The Kubernetes runner's view-state "
                                    "record (views.json, mounted from its ConfigMap): a --view version named there "
                                    "was stopped or moved by a promote/rollback and is not run here."),
) -> None:
    """Run the view host in the foreground: the --view versions plus those asked for under
    $KAPPA_HOME/run/host/desired (by the local runner), each its own query in one Spark application."""
    from kappa.runtime.driver import host_specs, run_host

    run_host(_settings(), host_specs(view, starting, metrics_port), driver_memory=driver_memory or None,
             handed_over=handed_over or None)


# -------------------------------------------------------------------------------------------- sql
@sql_app.command("serve")
def sql_serve(
    host: str = typer.Option("127.0.0.1", help="Address both endpoints listen on (0.0.0.0 in a pod)."),
    jdbc_port: int = typer.Option(0, "--jdbc-port", min=0, max=65535,
                                  help="JDBC/ODBC endpoint (HiveServer2 protocol); 0: KAPPA_SQL_JDBC_PORT or 10000."),
    connect_port: int = typer.Option(0, "--connect-port", min=0, max=65535,
                                     help="Spark Connect endpoint; 0: KAPPA_SQL_CONNECT_PORT or 15002."),
    cores: int = typer.Option(1, min=1, help="Tasks the analysts' queries run at once."),
    memory: str = typer.Option("1g", help="Heap of the service's JVM."),
    poll: float = typer.Option(5.0, min=0.5, help="Seconds between two looks at the serving aliases."),
    nice: int = typer.Option(0, min=0, max=19, help="Lower the service's CPU priority by this much (its JVM too): "
                             "analysts' queries then take the cores the views leave."),
) -> None:
    """Serve analytics.<view> (the serving versions, following promotions), kappa.freshness and the platform's
    tables over JDBC and Spark Connect, read-only; the token is KAPPA_SQL_TOKEN, else $KAPPA_HOME/sql/token."""
    from kappa.process import interrupt_on_termination
    from kappa.front.sql.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if nice:
        os.nice(nice)  # before the JVM starts: it inherits it
    with interrupt_on_termination():
        try:
            serve(_settings(), host=host, jdbc_port=jdbc_port or None, connect_port=connect_port or None, poll=poll,
                  cores=cores, memory=memory)
        except KeyboardInterrupt:
            pass


@sql_app.command("token")
def sql_token(
    rotate: bool = typer.Option(False, "--rotate", help="Make a new token (the old one stops working) and restart "
                                "the local service if it runs: open sessions end, clients reconnect with the new one."),
) -> None:
    """Print the local SQL service's token: the password of its JDBC endpoint (any user name), the token of its
    Spark Connect endpoint."""
    from kappa.front import stack
    from kappa.front.sql.server import ensure_token, token_path
    from kappa.process import Daemon

    settings = _settings()
    if settings.sql_token:
        if rotate:
            raise UserError("the token is KAPPA_SQL_TOKEN here (set by whoever started the service): change it there "
                            "and restart the service")
        console.print(settings.sql_token, highlight=False)
        return
    if rotate:
        token_path(settings).unlink(missing_ok=True)
        ensure_token(settings)
        daemon = Daemon("sql", settings)
        if daemon.pid() is not None:
            daemon.stop()
            stack.start_sql(settings)
            err.print(f"sql        restarted with the new token (log {daemon.log_file})", highlight=False)
    console.print(ensure_token(settings), highlight=False)


# -------------------------------------------------------------------------------------------- broker
@broker_app.command("start")
def broker_start() -> None:
    """Start the local KRaft broker (data survives restarts)."""
    from kappa.log.broker import LocalBroker

    settings = _settings()
    if not settings.local_broker:
        raise UserError(f"KAPPA_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} points at an external cluster; "
                        "no local broker to start")
    broker = LocalBroker.from_settings(settings).start()
    console.print(f"broker running at {broker.bootstrap} (data in {broker.data_dir})", highlight=False)


@broker_app.command("stop")
def broker_stop() -> None:
    """Stop the local broker."""
    from kappa.log.broker import LocalBroker

    LocalBroker.from_settings(_settings()).stop()
    console.print("broker stopped")


@broker_app.command("status")
def broker_status() -> None:
    from kappa.log.broker import LocalBroker

    broker = LocalBroker.from_settings(_settings())
    console.print(f"broker {'running' if broker.is_running() else 'stopped'} at {broker.bootstrap}",
                  highlight=False)


# -------------------------------------------------------------------------------------------- topics
@topics_app.command("ensure")
def topics_ensure() -> None:
    """Create or update every declared topic (idempotent); a topic under a replay's retention lease keeps the
    lease's retention until it ends."""
    from kappa.control.leases import converge_topics

    changes = converge_topics(_settings())
    for change in changes:
        console.print(str(change), highlight=False)
    if not changes:
        console.print("topics up to date")


@topics_app.command("leases")
def topics_leases() -> None:
    """The replays' retention leases: which hold a topic now, which ended and why (expired ones end here)."""
    from kappa.control.leases import active_leases, leases

    settings = _settings()
    holding = {(lease.topic, lease.view, lease.version) for lease in active_leases(settings)}
    everything = leases(settings)
    # one line per lease, nothing cut: a table narrower than its names hid the version ("campaign_win…") or
    # dropped whole columns
    for lease in everything:
        held = (lease.topic, lease.view, lease.version) in holding
        state = ("holds retention" if held else f"ended {lease.released_at:%Y-%m-%d %H:%M:%S}: {lease.note}"
                 if lease.released_at else "ended")
        console.print(f"{lease.ref}: {state} (taken {lease.taken_at:%Y-%m-%d %H:%M:%S} by {lease.by})",
                      highlight=False, markup=False)
    if not everything:
        console.print("no retention leases: no replay has taken one", highlight=False)


@topics_app.command("archives")
def topics_archives() -> None:
    """What the lake's archive of each stream topic holds beside what the log still holds, per partition: how far
    back a replay can start (kappa.runtime.archive)."""
    from kappa.catalog import load_catalog
    from kappa.identity import ViewPaths
    from kappa.log.topics import partition_offsets
    from kappa.runtime.archive import coverage

    settings = _settings()
    archived = [spec for spec in load_catalog().views.values() if spec.archives]
    for spec in archived:
        table = ViewPaths(settings.lake_uri, spec.name, spec.default_version).table
        topic = settings.topic(spec.archives or "")
        held, log = coverage(table), partition_offsets(settings, topic)  # errors: one line (KappaError)
        kept = "keeps every record" if spec.retention_ms is None else \
            f"keeps records for {_duration(spec.retention_ms / 1000)}"
        console.print(f"{spec.archives}: archived by {spec.name}@v{spec.default_version} ({table}); {kept} "
                      f"(upkeep every {_duration(settings.upkeep_seconds)})", highlight=False, markup=False)
        for p, (low, high) in sorted(log.items()):
            got = held.get(p)
            gaps = [f"{n:,} {what}" for n, what in ((got.high - got.low - got.rows, "missing"),
                                                    (got.records - got.rows, "held twice")) if n] if got else []
            kept = (f"archive {got.low:,}-{got.high:,} ({got.rows:,} records" + "".join(f", {g}" for g in gaps) + ")"
                    if got else "archive empty")
            reach = got.low if got and got.contiguous and got.high >= low else low
            console.print(f"  partition {p}: {kept}; log {low:,}-{high:,}; a replay can start at {reach:,}",
                          highlight=False, markup=False)
    if not archived:
        console.print("no view archives a topic (platform.yaml: `archives: <topic>`)", highlight=False)


def _duration(seconds: float) -> str:
    """``seconds`` in the largest of d, h, min, s that it is a whole number of (platform.yaml's units)."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:g} s"


@lake_app.command("check")
def lake_check() -> None:
    """Whether the lake's object store answers with this bucket and the environment's credential (the standard
    AWS_* variables): one listing of the lake's prefix, nothing created. Exit 0, or 2 with one line naming what is
    wrong - the endpoint, the bucket, the access key or the secret. The chart runs it before it installs or
    upgrades a release whose lake is on S3."""
    from kappa.objectstore import LocalObjectStore, on_platform_store
    from kappa.runtime.checkpoint import check_lake, lake_endpoint
    from kappa.runtime.deltars import is_local_uri

    settings = _settings()
    if is_local_uri(settings.lake_uri):
        console.print(f"lake {settings.lake_uri}: a local directory, nothing to check", highlight=False)
        return
    try:
        check_lake(settings.lake_uri)
    except KappaError:
        store = LocalObjectStore.from_settings(settings)
        # no endpoint named and this home has run the platform's store (never so in a pod on AWS): it is down
        if on_platform_store(settings) and store.home.exists() and not store.is_running():
            raise UserError(f"the lake {settings.lake_uri} is on the platform's own object store (no "
                            "AWS_ENDPOINT_URL names another), which is not running: `make objectstore-up` or "
                            "`make run` starts it") from None
        raise
    console.print(f"lake {settings.lake_uri}: the store at {lake_endpoint()} lists it with the credential given",
                  highlight=False)


# -------------------------------------------------------------------------------------------- data
@app.command("produce")
def produce(
    count: int = typer.Option(100_000, help="Events to produce (0 with --live: until stopped)."),
    rate: Optional[float] = typer.Option(None, help="Events/s (paced); default: as fast as possible."),
    live: bool = typer.Option(False, "--live", help="Stamp events with the wall clock (demo) instead of a "
                              "reproducible synthetic clock."),
    seed: int = typer.Option(0, help="Seed of the entities and the event stream."),
    campaigns: int = typer.Option(100, help="Number of campaigns (10 ads each)."),
    late_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help="Share of late/out-of-order events."),
    max_lateness_ms: int = typer.Option(5000, min=0, help="Maximum lateness of late events."),
    malformed_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help="Share of malformed records."),
    duplicate_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help="Share of valid records sent twice "
                                             "(a producer retrying without idempotence; same event_id)."),
    no_campaigns: bool = typer.Option(False, "--no-campaigns", help="Do not (re)publish the ad->campaign map."),
    topic: str = typer.Option("ad-events"),
    heartbeat: Optional[Path] = typer.Option(None, help="With --live: touch this file after every acknowledged chunk "
                                             "(what a liveness probe checks)."),
) -> None:
    """Write Yahoo Streaming Benchmark ad events with the idempotent producer."""
    from kappa.log import generator

    settings = _settings()
    u = generator.universe(seed=seed, campaigns=campaigns)
    topic = settings.topic(topic)  # a declared name; KAPPA_TOPIC_PREFIX makes it the physical one
    if live and count == 0:  # a long-running producer (the chart's) may start before the topics exist
        _wait_for_topics(settings, [topic] + ([] if no_campaigns else [settings.topic("campaigns")]), heartbeat)
    if not no_campaigns:
        generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    if live and count == 0:
        if not rate:
            raise UserError("--live --count 0 needs --rate")
        chunk, i = max(1, int(rate * 5)), 0
        producer = generator.make_producer(settings)
        while True:  # until SIGTERM (kappa down)
            generator.produce(settings, topic, generator.events(
                chunk, seed=seed + i, universe=u, late_fraction=late_fraction, max_lateness_ms=max_lateness_ms,
                malformed_fraction=malformed_fraction, duplicate_fraction=duplicate_fraction, live=True), rate=rate,
                producer=producer)
            if heartbeat is not None:
                heartbeat.parent.mkdir(parents=True, exist_ok=True)
                heartbeat.touch()
            i += 1
    if count <= 0:
        raise UserError("--count must be positive (or 0 together with --live --rate)")
    result = generator.produce(settings, topic, generator.events(
        count, seed=seed, universe=u, rate_per_s=rate or 1000.0, late_fraction=late_fraction,
        max_lateness_ms=max_lateness_ms, malformed_fraction=malformed_fraction, duplicate_fraction=duplicate_fraction,
        live=live), rate=rate)
    console.print_json(json.dumps(result.as_dict()))


def _wait_for_topics(settings, names: list[str], heartbeat: Optional[Path]) -> None:
    """Wait (alive: the heartbeat is touched) until every topic exists (:func:`kappa.log.topics.wait_for_topics`)."""
    from kappa.log.topics import wait_for_topics

    def alive() -> None:
        if heartbeat is not None:
            heartbeat.parent.mkdir(parents=True, exist_ok=True)
            heartbeat.touch()

    wait_for_topics(settings, names, say=lambda line: console.print(line, highlight=False), alive=alive)


# -------------------------------------------------------------------------------------------- stack
@app.command("up")
def up(
    rate: float = typer.Option(200.0, help="Live producer rate (events/s)."),
    airflow: bool = typer.Option(True, help="Also start Airflow standalone."),
    sql: bool = typer.Option(True, help="Also start the analysts' SQL service (JDBC and Spark Connect)."),
    wait: float = typer.Option(600.0, min=0.0, help="Seconds to wait for every view's first rows (0: do not "
                               "wait)."),
) -> None:
    """Start the local platform (broker, topics, views, producer, Airflow); return once it is usable."""
    from kappa.front import stack, supervisor

    settings = _settings()
    began = time.monotonic()
    # a fresh broker answers the first idempotent producer with "coordinator load in progress, retrying":
    # librdkafka's warning of a retry that succeeds, not something to act on
    logging.getLogger("kappa.log.generator").setLevel(logging.ERROR)
    running_before = [name for name, state, _where in stack.status(settings) if state == "running"]
    try:
        stack.up(settings, rate=rate, echo=lambda m: console.print(m, highlight=False))
        # Airflow (the longest start: ~90 s on 2 cores) starts while the view host does: up asks the host for every
        # view without waiting for each (ready in 98 s instead of 156 s; docs/performance.md)
        if airflow:
            daemon = stack.start_airflow(settings)
            supervisor.want(settings, "airflow")
            console.print(f"airflow    {stack.airflow_url(settings)}  (log {daemon.log_file})", highlight=False)
        if wait:
            _wait_views(settings, timeout=wait)
            console.print(f"first rows after {time.monotonic() - began:.0f} s: every view has read its topic and "
                          "has rows in its table", highlight=False)
        if sql:  # once the views run: its JVM's start would otherwise share the 2 cores with theirs
            daemon = stack.start_sql(settings)
            supervisor.want(settings, "sql")
            console.print(f"sql        {stack.sql_endpoints(settings)}  (log {daemon.log_file})", highlight=False)
        if wait:
            if airflow:
                _wait_airflow(settings, timeout=wait)
            if sql:
                _wait_sql(settings, timeout=wait)
    except KeyboardInterrupt as exc:
        if running_before:  # not this command's to stop: it only continued a platform that was running
            raise _interrupted(exc, f"the platform was running before this command ({', '.join(running_before)}) "
                                    "and is left running; `make down` stops it") from None
        stack.down(settings, echo=lambda m: None)
        raise _interrupted(exc, f"stopped everything it had started (data stays in {_data_place(settings)})") \
            from None
    if wait:
        console.print(f"\nready in {time.monotonic() - began:.0f} s: every view has committed rows"
                      + (", Airflow's DAGs can be triggered" if airflow else ""), highlight=False)
    console.print(next_hint(settings, _version_step(settings)), highlight=False)


#: What locates a platform: a shell without them finds another one (or none) - the Next hint exports them.
_LOCATING = ("KAPPA_HOME", "KAPPA_LAKE_URI", "KAPPA_KAFKA_BOOTSTRAP", "KAPPA_TOPIC_PREFIX")


def _data_place(settings) -> str:
    """Where a stopped platform's data stays: its home (as the user would type it) and a lake outside it."""
    from kappa.front.stack import _short

    home = _short(Path(settings.home))
    lake = settings.lake_uri
    inside = "://" not in lake and Path(lake).resolve().is_relative_to(Path(settings.home).resolve())
    return f"{home}/" if inside else f"{home}/ and {lake}"


def next_hint(settings, version_steps: list[str]) -> str:
    """The Next block ``up`` prints: commands that run as printed from a fresh shell in this folder - so when this
    platform was located by variables (``KAPPA_HOME``, a lake on an object store...), an ``export`` of them first."""
    import shlex

    cli = settings.cli
    located = [f"{name}={shlex.quote(os.environ[name])}" for name in _LOCATING if os.environ.get(name)]
    return ("\n[bold]Next[/bold] (from this folder" + ("; a new shell needs the export first" if located else "") + ")\n"
            + (f"  export {' '.join(located)}\n" if located else "")
            + f"  {cli} status\n"
            f"  {cli} query \"SELECT * FROM campaign_window_counts ORDER BY window_start DESC LIMIT 10\"\n"
            + "".join(f"  {step}\n" for step in version_steps)
            + f"  {cli + ' producer stop':<26} pause the live producer (the views keep running)\n"
            f"  {'make down':<26} stop everything (data stays in {_data_place(settings)})")


#: What `replay <view> --version N` (no --start) does for a version in these registry states.
_ATTACH = {"building": "under way: follow it", "caught_up": "caught up: verify it", "failed": "failed: run it again"}


def _version_step(settings) -> list[str]:
    """The version command the Next hint of `up` suggests, for what the registry holds now: follow a replay under
    way, else replay a declared version never built (the first view that has one), else roll back to a kept one
    - never a version that is retired, deleted or serving (that command would be refused)."""
    from kappa.catalog import load_catalog
    from kappa.control.registry import Registry
    from kappa.control.serving import ServingAlias

    registry, alias, cli = Registry(settings.lake_uri), ServingAlias(settings.lake_uri), settings.cli
    records = {(r.view, r.version): r for r in registry.list()}
    building, fresh, kept = [], [], []
    for view, spec in load_catalog().views.items():
        serving = alias.target(view).version
        for version in sorted(spec.versions):
            rec = records.get((view, version))
            if version == serving:
                continue
            if rec is None:
                fresh.append(f"{cli} replay {view} --version {version} --start earliest")
            elif rec.state == "verified":
                building.append(f"{cli} promote {view} --version {version}       # verified: serve it")
            elif rec.state in _ATTACH:
                building.append(f"{cli} replay {view} --version {version}       # {_ATTACH[rec.state]}")
            elif rec.state == "retired" and rec.deleted_at is None:
                kept.append(f"{cli} rollback {view} --to {version}       # serve the kept v{version} again")
    return (building or fresh or kept)[:1]


#: A wait printed line by line says something at least this often, also when nothing changed.
_HEARTBEAT_SECONDS = 15.0


def _wait_views(settings, *, timeout: float) -> None:
    """Show each view's way to its first rows (a live table on a terminal, with the time so far; one line per
    change otherwise, and a line every :data:`_HEARTBEAT_SECONDS` when nothing changed) until every view has read
    its topic and has rows in its table (kappa.front.stack.wait_ready)."""
    from rich.live import Live

    from kappa.front import stack

    began = time.monotonic()

    def table(rows) -> Table:
        t = Table("view", "state", "detail", box=None, caption=f"{time.monotonic() - began:.0f} s so far",
                  caption_justify="left")
        for r in rows:
            t.add_row(r.ref, r.state if not r.ready else f"ready {r.ready_after:.0f} s", r.detail)
        return t

    if console.is_terminal:
        with Live(table([]), console=console, refresh_per_second=4) as live:
            stack.wait_ready(settings, timeout=timeout, on_change=lambda rows: live.update(table(rows)),
                             heartbeat=1.0)
    else:
        seen: dict[str, str] = {}

        def lines(rows) -> None:
            changed = False
            for r in rows:
                text = f"{r.state} ({r.detail})" + (f" after {r.ready_after:.0f} s" if r.ready else "")
                if seen.get(r.ref) != text:
                    seen[r.ref], changed = text, True
                    console.print(f"view       {r.ref:<28} {text}", highlight=False)
            if not changed:  # the heartbeat: nothing moved for a while - say what is still awaited
                waiting = [r.ref for r in rows if not r.ready]
                console.print(f"views      {time.monotonic() - began:.0f} s so far; still waiting for "
                              f"{', '.join(waiting)} (as above)", highlight=False)

        stack.wait_ready(settings, timeout=timeout, on_change=lines, heartbeat=_HEARTBEAT_SECONDS)


def _wait_airflow(settings, *, timeout: float) -> None:
    """Wait until Airflow's API answers, its scheduler is healthy and the DAGs are parsed."""
    from kappa.front import stack

    began = time.monotonic()
    said, told = None, began
    with console.status("waiting for Airflow") as spinner:
        while (awaited := stack.airflow_awaited(settings)) is not None:
            now = time.monotonic()
            if now - began > timeout:
                raise UserError(f"Airflow did not answer on {stack.airflow_url(settings)} within {timeout:.0f} s "
                                f"(waiting for {awaited}); see {Path(settings.home) / 'logs' / 'airflow.log'}")
            spinner.update(f"waiting for Airflow: {awaited} ({now - began:.0f} s so far)")
            if not console.is_terminal and (awaited != said or now - told >= _HEARTBEAT_SECONDS):
                console.print(f"airflow    waiting for {awaited} ({now - began:.0f} s so far)", highlight=False)
                said, told = awaited, now
            time.sleep(2)
    console.print(f"airflow    ready (login admin/{stack.airflow_password(settings)})", highlight=False)


def _wait_sql(settings, *, timeout: float) -> None:
    """Wait until the SQL service listens (its ready file), failing with its log's place if it stopped; says what it
    waits for at least every heartbeat when the output is not a terminal (a log, CI), as the other waits do."""
    from kappa.front import stack
    from kappa.process import Daemon

    began = told = time.monotonic()
    log_file = Path(settings.home) / "logs" / "sql.log"
    with console.status("waiting for the SQL service") as spinner:
        while not stack.sql_ready_file(settings).exists():
            now = time.monotonic()
            if Daemon("sql", settings).pid() is None:
                raise UserError(f"the SQL service stopped while starting; see {log_file}")
            if now - began > timeout:
                raise UserError(f"the SQL service did not listen within {timeout:.0f} s; see {log_file}")
            spinner.update(f"waiting for the SQL service: its Spark application starts ({now - began:.0f} s so far)")
            if not console.is_terminal and now - told >= _HEARTBEAT_SECONDS:
                console.print(f"sql        waiting for its Spark application to start and listen "
                              f"({now - began:.0f} s so far)", highlight=False)
                told = now
            time.sleep(2)
    console.print(f"sql        ready after {time.monotonic() - began:.0f} s more", highlight=False)


@app.command("down")
def down() -> None:
    """Stop everything `kappa up` started (data stays)."""
    from kappa.front import stack

    stack.down(_settings(), echo=lambda m: console.print(m, highlight=False))


@producer_app.command("start")
def producer_start(rate: float = typer.Option(200.0, help="Events/s.")) -> None:
    """Start the live producer of the local stack (no-op if it runs)."""
    from kappa.front import stack, supervisor
    from kappa.process import Daemon

    settings = _settings()
    daemon = stack.start_producer(settings, rate=rate)
    if Daemon("supervisor", settings).pid():  # the stack's supervisor starts it again if it dies
        supervisor.want(settings, "producer", rate=rate)
    console.print(f"producer running (pid {daemon.pid()}, log {daemon.log_file})", highlight=False)


@producer_app.command("stop")
def producer_stop() -> None:
    """Stop the live producer; the views keep running and catch up."""
    from kappa.front import stack

    console.print("producer stopped" if stack.stop_producer(_settings()) else "producer was not running")


@app.command("status")
def status() -> None:
    """Processes of the local stack, and the registry of view versions (fits 80 columns: notes are wrapped)."""
    from kappa.front import stack

    settings = _settings()
    table = Table("component", "state", box=None)
    table.add_column("where", overflow="fold")
    for component, state, where in stack.status(settings):
        table.add_row(component, state, where)
    console.print(table)
    try:
        from kappa.control.registry import Registry

        records = Registry(settings.lake_uri).list()
    except Exception as exc:  # noqa: BLE001 - registry not created yet
        console.print(f"registry: {one_line(exc) or 'empty'}", highlight=False)
        return
    if not records:
        console.print("registry: no replays yet (each view serves its default version)")
        return
    console.print()
    reg = Table(box=None)  # the version in full on any terminal (a cut "campaign_window_c…" hides which one)
    reg.add_column("version", no_wrap=True, min_width=max(len(r.ref) for r in records))
    reg.add_column("state", overflow="fold")
    reg.add_column("since (UTC)", overflow="fold")
    jobs = _building_jobs(settings, records)
    for r in records:
        job = jobs.get(r.ref)
        state = r.state if job is None or job.state == "running" else f"building, job {job.state}"
        reg.add_row(r.ref, state, str(r.updated_at)[:19])
    console.print(reg)
    for r in records:  # the notes in full, wrapped: a replay's progress, why it caught up, a failure
        note = r.note or "-"
        if r.ref in jobs and jobs[r.ref].state == "running":
            note = _progress_now(settings, r, jobs[r.ref]) or note
        console.print(f"{r.ref} ({r.state_changed_by}): {note}", highlight=False, soft_wrap=False)


def _building_jobs(settings, records) -> dict:
    """The job status of every version being built (a replay whose job no longer runs - stopped with `view stop`,
    or its driver gone - is shown so instead of looking under way)."""
    building = [r for r in records if r.state == "building"]
    if not building:
        return {}
    from kappa.control.runners import runner_for

    runner = runner_for(settings)
    return {r.ref: runner.status(r.view, r.version) for r in building}


def _progress_now(settings, rec, job) -> str | None:
    """A running replay's progress sampled now - from its checkpoint, the log and what its running micro-batch has
    read (its metrics), as the DAG's sensor and `kappa replay` show it - rather than the note recorded at the last
    sample (which may be minutes old); None when it cannot be sampled (the note is shown then)."""
    from kappa.control import replay

    try:
        sample = replay.with_reading(replay.progress(rec.view, rec.version, settings), job.metrics_url)
    except Exception as exc:  # noqa: BLE001 - the recorded note still says something
        logging.getLogger(__name__).debug("progress of %s not sampled: %s", rec.ref, exc)
        return None
    return f"{sample.summary()} (now)"


@app.command("views")
def views_cmd() -> None:
    """The declared views, their versions, what each reads and publishes, and what serves (the dependency
    graph of views of views: a version over another reads the topic that one publishes)."""
    from kappa.catalog import load_catalog
    from kappa.control.replay.cascade import graph, graph_problems
    from kappa.control.serving import ServingAlias
    from kappa.runtime.view import load_view

    settings = _settings()
    alias = ServingAlias(settings.lake_uri)
    over = {(e.view, e.version): e for e in graph()}
    table = Table("version", "reads", "publishes", "serves", box=None)
    serving_versions = {view: target.version for view, target in alias.targets().items()}
    for name, spec in load_catalog().views.items():
        serving = serving_versions[name]
        for version, module in spec.versions.items():
            definition = load_view(module)
            table.add_row(f"{name}@v{version}", definition.stream_topic,
                          definition.publish.topic if definition.publish else "-", "yes" if version == serving else "")
    console.print(table)
    if over:
        console.print("views of views (reader <- topic <- publisher):")
        for edge in over.values():
            console.print(f"  {edge}", highlight=False, soft_wrap=True)
    problems = graph_problems()
    for problem in problems:
        console.print(f"problem: {problem}", highlight=False)
    if problems:
        raise typer.Exit(1)


@app.command("query")
def query(
    sql: str = typer.Argument(..., help="SQL over the serving views (campaign_window_counts, ...)."),
    as_of: Optional[str] = typer.Option(None, "--as-of", help="Delta version (int) or ISO timestamp."),
    limit: int = typer.Option(50, min=1, help="Rows to print (the line under the table says how many the answer "
                              "has when it has more)."),
    all_rows: bool = typer.Option(False, "--all", help="Print every row of the answer."),
    fmt: str = typer.Option("table", "--format", help="table (long values wrap, never cut), csv or json (one "
                            "object per line): csv and json print every row, whole, and no freshness lines."),
) -> None:
    """Answer SQL over the serving views without Spark (DuckDB over delta-rs), with freshness."""
    from kappa.front.query import run_query

    if fmt not in ("table", "csv", "json"):
        raise typer.BadParameter(f"--format {fmt!r}: one of table, csv, json")
    result = run_query(sql, as_of=as_of, settings=_settings())
    if fmt != "table":  # for scripts: every row, values whole, nothing else on stdout
        import csv

        if fmt == "csv":
            writer = csv.writer(sys.stdout, lineterminator="\n")
            writer.writerow(result.columns)
            writer.writerows(["" if v is None else v for v in row] for row in result.rows)
        else:
            for row in result.rows:
                print(json.dumps(dict(zip(result.columns, row)), default=str))
        return
    shown = result.rows if all_rows else result.rows[:limit]
    table = Table()
    for column in result.columns:
        table.add_column(column, overflow="fold")  # a long value wraps inside its cell, it is never cut
    for row in shown:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)
    if len(shown) < len(result.rows):
        console.print(_truncation_note(len(shown), len(result.rows)), highlight=False)
    for name, f in result.freshness.items():
        watermark = f", watermark {f.watermark}" if f.watermark is not None else ""  # windowed views' tables only
        served = f"serving v{f.serving_version}, " if f.serving_version is not None else ""  # quarantine, registry
        console.print(f"{name}: {served}delta version {f.delta_version}, last commit {f.last_commit}{watermark}",
                      highlight=False)


@app.command("watch")
def watch_cmd(
    view: str = typer.Argument(..., help="A declared view (its serving version is followed across promotions)."),
    where: Optional[str] = typer.Option(None, "--where", help="SQL condition over the view's columns (DuckDB)."),
    start: Optional[int] = typer.Option(None, "--from", min=0,
                                        help="First Delta version of the serving table to report (default: now)."),
    seconds: Optional[float] = typer.Option(None, "--for", min=0, help="Stop after this many seconds."),
    max_events: Optional[int] = typer.Option(None, "--max-events", min=1, help="Stop after this many notifications."),
    poll: float = typer.Option(1.0, "--poll", min=0.05, help="Seconds between looks at the table and the alias."),
) -> None:
    """Stream the serving version's changes as they commit, one JSON line each: add / change / remove, and
    switch when a promotion or rollback moves the alias (Delta change data feed)."""
    from kappa.control.changefeed import follow_changes

    settings = _settings()
    began = time.monotonic()
    deadline = None if seconds is None else began + seconds
    seen = 0
    before = _serving_table_version(settings, view)
    for change in follow_changes(settings, view, where=where, start=start, poll=poll,
                                 until=lambda: deadline is not None and time.monotonic() >= deadline):
        print(change.to_json(), flush=True)
        seen += 1
        if max_events is not None and seen >= max_events:
            return
    if not seen:  # said on stderr: stdout stays JSON lines
        err.print(_watch_nothing(view, where, start, time.monotonic() - began, before,
                                 _serving_table_version(settings, view)), highlight=False, markup=False)


def _serving_table_version(settings, view: str) -> tuple[int, int | None]:
    """(serving version, its table's Delta version; None before its first commit)."""
    from kappa.control.registry import TableMissing, open_delta
    from kappa.control.serving import ServingAlias

    target = ServingAlias(settings.lake_uri).target(view)
    try:
        return target.version, open_delta(target.table_path).version()
    except TableMissing:
        return target.version, None


def _watch_nothing(view: str, where: str | None, start: int | None, elapsed: float,
                   before: tuple[int, int | None], after: tuple[int, int | None]) -> str:
    """The one line of a watch that reported nothing: what it looked for, how long, and what committed."""
    what = f"no change of {view}" + (f" matched `{where}`" if where else "")
    (version, was), (_same, now) = before, after  # a switch is a notification: the version did not move
    first = start if start is not None else (was + 1 if was is not None else 0)
    if now is None:
        read = f"{view}@v{version} has no table yet"
    elif now < first:
        read = f"{view}@v{version} committed nothing after Delta version {now}"
    else:
        read = f"read {view}@v{version}'s Delta version{'s' if now > first else ''} " + (
            f"{first}..{now}" if now > first else str(now))
    took = f"{elapsed:.0f} s" if elapsed >= 10 else f"{elapsed:.1f} s"
    return f"{what} in {took} ({read})"


def _truncation_note(shown: int, total: int) -> str:
    """The line under a table that shows fewer rows than the answer has."""
    return f"{shown:,} of {total:,} rows shown (--limit N / --all)"


# -------------------------------------------------------------------------------------------- replays
def _by() -> str:
    import getpass

    return f"cli:{getpass.getuser()}"


def _replay_request(view: str, version: int, **fields):
    from kappa.control.replay import ReplayRequest

    return ReplayRequest(view=view, version=version, triggered_by=_by(), **fields).validate()


@app.command("replay")
def replay_cmd(
    view: str = typer.Argument(..., help="View name (kappa/platform.yaml)."),
    version: int = typer.Option(..., help="Version to build (declared under the view's versions)."),
    start: Optional[str] = typer.Option(None, help="earliest | ts:<epoch ms> | JSON offsets '{\"0\": 120, ...}'. "
                                        "Default: earliest for a new version; a version under way keeps its start."),
    end: str = typer.Option("live", help="live (then keep following the log) | ts:<epoch ms> (bounded)."),
    upgrade: Optional[str] = typer.Option(None, help="replay (rebuild from --start) | continue (seed with the "
                                          "serving version's rows, start where it got; stateless versions only). "
                                          "Default: what the version declares."),
    verify: str = typer.Option("strict", help="strict (must equal a recompute of its own transform over the same "
                               "micro-batches, and the plain-Python oracle where one exists) | none."),
    promote: bool = typer.Option(False, "--promote/--no-promote", help="Switch readers to it once verified."),
    keep_hours: float = typer.Option(DEFAULT_KEEP_HOURS, min=0.0, help="Keep the replaced version's table this long."),
    watch_minutes: float = typer.Option(10.0, min=0.0, help="With --promote: watch the new version this long and "
                                        "roll back if it breaks (0: no watch)."),
    max_offsets_per_trigger: Optional[int] = typer.Option(None, min=1, help="Bound the replay's micro-batches."),
    max_lag: int = typer.Option(2000, min=0, help="Live: caught up once at most this many records lag behind."),
    timeout: float = typer.Option(0.0, min=0.0, help="Stop waiting after this many seconds (0: no limit)."),
    detach: bool = typer.Option(False, "--detach", help="Return once the job runs; the same command without "
                                "--start attaches again (progress, verify, promote)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Preflight and the plan of steps only: change nothing."),
    cascade: bool = typer.Option(False, "--cascade", help="Also rebuild the views over this one against the new "
                                 "version (their declared versions over it), verify them all and switch readers "
                                 "to the whole chain in one alias commit."),
    source: str = typer.Option("auto", help="Where history is read: auto (the topic's archive for what the log no "
                               "longer holds, or where it serves 1M+ records - faster than the log there) | log "
                               "(never the archive) | archive (as far as it reaches from the start)."),
) -> None:
    """Replay the retained log into a new view version: preflight, launch, wait, verify, (promote).

    Interrupting the wait (Ctrl-C) or --detach leaves the job running; rerunning the command follows it."""
    from kappa.control import replay
    from kappa.control.replay import cascade as cascading
    from kappa.control.runners import runner_for

    settings = _tool_settings()
    req = _replay_request(view, version, **replay.parse_start(start or "earliest"), **replay.parse_end(end),
                          upgrade=upgrade, verify=verify, auto_promote=promote, keep_hours=keep_hours,
                          max_offsets_per_trigger=max_offsets_per_trigger, max_lag=max_lag,
                          watch_minutes=watch_minutes, cascade=cascade, source=source)
    runner = runner_for(settings)
    # rerunning the command follows a replay that is already under way (it never starts a second driver); an
    # explicit --start must match the one it runs from
    pre = replay.preflight(req, settings, runner, resume=True, check_start=start is not None)
    chain = cascading.chain(view, version) if cascade else []
    console.print(pre.summary(), highlight=False)
    if dry_run:
        console.print("dry run - nothing registered, started or written; a replay would:", highlight=False)
        plan = pre.plan()
        if chain:  # the cascade switches the whole chain in one commit: that step replaces the version's own
            plan = plan[:-1]
        for i, step in enumerate([*plan, *_cascade_steps(req, chain, settings)], 1):
            console.print(f"  {i}. {step}", highlight=False)
        return
    rec = replay.launch(req, settings, runner, pre)
    job = runner.status(view, version)
    console.print(f"{req.ref}: {rec.state}, job {job.state} (app id {rec.app_id})"
                  + (f", metrics {job.metrics_url}" if job.metrics_url else ""), highlight=False)
    for dep in cascading.launch_chain(req, settings, runner) if cascade else []:
        console.print(f"{dep.ref}: {dep.state} over {req.ref} (cascade, app id {dep.app_id})", highlight=False)
    if detach:
        console.print(f"detached; follow it with: {settings.cli} replay {view} --version {version}"
                      + (" --cascade" if cascade else "") + (" --promote" if promote else ""), highlight=False)
        return
    try:
        _follow(req, settings, runner, timeout=timeout)
    except KeyboardInterrupt as exc:  # the replay is the platform's job now, not this command's process
        raise _interrupted(exc, f"{req.ref} keeps replaying in its own job; follow it again with `{settings.cli} "
                                f"replay {view} --version {version}`, stop it with `{settings.cli} view stop {view} "
                                f"--version {version}`") from None
    if cascade:
        published = cascading.table_version(replay.ViewVersion.resolve(view, version, settings))
        caught = cascading.follow_chain(req, settings, runner, published=published, timeout=timeout,
                                        on_wait=lambda why: console.print(f"  waiting: {why}", highlight=False))
        console.print(f"{', '.join(f'{v}@v{n}' for v, n in chain)} caught up: {caught.reason}", highlight=False)
    for ref_view, ref_version in [(view, version), *chain]:
        result = replay.verify(ref_view, ref_version, settings, req.verify, by=req.triggered_by, on_wait=_say,
                               on_start=_say, end_timestamp_ms=req.end_timestamp_ms)
        _print_verification(result)
        if not result.passed:
            raise UserError(f"{ref_view}@v{ref_version} failed verification; serving unchanged")
    if req.auto_promote:
        switched = replay.promote_chain([(view, version), *chain], settings, runner, by=req.triggered_by,
                                        keep_hours=keep_hours)
        for one in switched:
            console.print(one.message, highlight=False)
        if cascade:
            console.print(f"switched together: {', '.join(f'{s.view} v{s.version}' for s in switched)} "
                          "(one alias commit)", highlight=False)
        _watch(req, settings, runner, switched[0].previous_version)
    else:
        pairs = " ".join(f"{v}@v{n}" for v, n in [(view, version), *chain])
        console.print(f"promote it with: {settings.cli} promote {view} --version {version}"
                      + (f" --cascade (switches {pairs} together)" if cascade else ""), highlight=False)


def _cascade_steps(req, chain: list[tuple[str, int]], settings) -> list[str]:
    """The dry run's steps of a cascade (kappa.control.replay.cascade)."""
    from kappa.runtime.view import declared_view

    steps = [f"build {v}@v{n} over {req.ref} from the earliest offset of {declared_view(v, n).stream_topic} "
             "(what the new version publishes), verify it" for v, n in chain]
    if chain:
        what = ", ".join([req.ref, *(f"{v}@v{n}" for v, n in chain)])
        steps.append(f"switch readers to {what} in one alias commit"
                     + ("" if req.auto_promote else f" (with --promote, or `{settings.cli} promote {req.view} "
                                                     f"--version {req.version} --cascade` later)"))
    return steps


def _watch(req, settings, runner, previous: int | None) -> None:
    """The watch window after a switch (kappa.control.replay.watch): roll back when the new version breaks."""
    from kappa.control.replay.watch import watch

    policy = req.watch_policy()
    if policy.minutes == 0 or previous in (None, req.version):
        return
    console.print(f"watching {req.ref} for {policy.minutes:g} min (rolls back to v{previous} if it breaks; "
                  "Ctrl-C stops watching, the switch stays)", highlight=False)
    result = watch(req.view, req.version, settings, runner, previous_version=previous, policy=policy,
                   by=req.triggered_by, cascade=req.cascade)
    console.print(result.message, highlight=False)
    if not result.healthy:
        raise UserError(result.message)


def _follow(req, settings, runner, *, timeout: float) -> None:
    """Progress bar until the replay has caught up (the job keeps running if this is interrupted)."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from kappa.control import replay

    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(req.ref, total=None, detail="starting")

        def show(sample) -> None:
            reading = f"  (~{sample.reading:,} read, not committed yet)" if sample.reading else ""
            bar.update(task, total=max(sample.total, 1), completed=sample.done + sample.reading,
                       detail=f"lag {sample.lag:,}  ETA {sample.eta_text}{reading}")

        caught = replay.follow(req, settings, runner, timeout=timeout, on_sample=show)
        bar.update(task, detail="caught up")
        bar.console.print(f"{req.ref} caught up: {caught.reason}", highlight=False)


@app.command("verify")
def verify_cmd(
    view: str = typer.Argument(..., help="View name."),
    version: int = typer.Option(..., help="Version to check (must have caught up)."),
    mode: str = typer.Option("strict", help="strict (equal to a recompute of its own transform, and to the "
                             "plain-Python oracle where one exists) | none."),
    end_ts: Optional[int] = typer.Option(None, help="Bounded replays: their end timestamp (ms)."),
) -> None:
    """Check a caught-up version: recompute of its own transform, plus the oracle if any (-> verified or failed)."""
    from kappa.control import replay

    result = replay.verify(view, version, _tool_settings(), mode, by=_by(), end_timestamp_ms=end_ts, on_wait=_say,
                           on_start=_say)
    _print_verification(result)
    if not result.passed:
        raise typer.Exit(1)


def _print_verification(result) -> None:
    """The verification's line, its differences and the diff report against the serving version (paths)."""
    from kappa.verify.diffreport import DiffReport

    console.print(result.message, highlight=False)
    for example in result.examples:
        console.print(f"  {example}", highlight=False)
    if result.report:
        report = DiffReport(**result.report)
        console.print(report.summary(), highlight=False)
        for line in report.lines():
            console.print(f"  {line}", highlight=False)


@app.command("promote")
def promote_cmd(
    view: str = typer.Argument(..., help="View name."),
    version: int = typer.Option(..., help="Verified version to serve."),
    keep_hours: float = typer.Option(DEFAULT_KEEP_HOURS, min=0.0, help="Keep the replaced version's table this long."),
    cascade: bool = typer.Option(False, "--cascade", help="Also switch the views over it to their versions over "
                                 "this one (built by `replay --cascade`, verified), in the same alias commit."),
) -> None:
    """Switch the view's serving alias to a verified version (atomic, idempotent); stop the old job."""
    from kappa.control import replay
    from kappa.control.replay.cascade import chain
    from kappa.control.runners import runner_for

    settings = _settings()
    results = replay.promote_chain([(view, version), *(chain(view, version) if cascade else [])], settings,
                                   runner_for(settings), by=_by(), keep_hours=keep_hours)
    for result in results:
        console.print(result.message, highlight=False)


def _time_ms(text: str, option: str) -> int:
    """Epoch milliseconds, or an ISO 8601 time (UTC unless it names its zone)."""
    from datetime import UTC, datetime

    value = text.strip()
    if value.isdigit():
        return int(value)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise UserError(f"{option} {text!r}: expected epoch milliseconds or an ISO 8601 time "
                        "(e.g. 2026-11-24T10:00:00)") from None
    return int((when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp() * 1000)


@app.command("repair")
def repair_cmd(
    view: str = typer.Argument(..., help="View name (its serving version is repaired)."),
    start: str = typer.Option(..., "--from", help="First window start of the range (epoch ms or ISO 8601, UTC)."),
    end: str = typer.Option(..., "--to", help="End of the range, exclusive (epoch ms or ISO 8601, UTC)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Recompute, stage and verify; do not swap."),
    wait: float = typer.Option(300.0, "--wait", min=0.0, help="Object-store lakes: seconds to wait for the live "
                               "job to commit the swap it is handed (exit 3 when it has not yet)."),
) -> None:
    """Recompute the serving version's windows that start in [--from, --to) from the whole log (every record on
    time), verify them against the oracle and swap exactly those windows into the serving table in one Delta
    commit (readers see the old range or the new one). On an object-store lake the live job commits the swap."""
    from kappa.control.replay.repair import repair_range

    settings = _tool_settings()
    result = repair_range(view, settings, start_ms=_time_ms(start, "--from"), end_ms=_time_ms(end, "--to"),
                          by=_by(), dry_run=dry_run, wait_seconds=wait)
    console.print(result.message, highlight=False)
    if result.verified is False:
        raise typer.Exit(1)
    if result.waiting:
        raise typer.Exit(3)


@app.command("rollback")
def rollback_cmd(
    view: str = typer.Argument(..., help="View name."),
    to: Optional[int] = typer.Option(None, "--to", help="Version to serve again (default: the previous one)."),
    keep_hours: float = typer.Option(DEFAULT_KEEP_HOURS, min=0.0, help="Keep the replaced version's table this long."),
    cascade: bool = typer.Option(False, "--cascade", help="Also switch the views over it back to their kept "
                                 "versions over the target, in the same alias commit."),
) -> None:
    """Serve a kept earlier version again: switch the alias back, restart its job, stop the other one."""
    from kappa.control import replay
    from kappa.control.runners import runner_for

    settings = _settings()
    result = replay.rollback(view, to, settings, runner_for(settings), by=_by(), keep_hours=keep_hours,
                             cascade=cascade, say=_say)
    console.print(result.message, highlight=False)


@app.command("retire")
def retire_cmd(
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list the versions past their keep period."),
) -> None:
    """Delete the tables and checkpoints of retired versions past their keep period (their jobs are stopped
    first); the scheduled ``kappa_retire`` DAG does the same."""
    from kappa.control import replay
    from kappa.control.runners import runner_for

    settings = _settings()
    if dry_run:
        due = replay.alias_of(settings).expired()
        for rec in due:
            console.print(f"{rec.ref}: retired, kept until {rec.delete_after:%Y-%m-%d %H:%M} UTC: would be deleted "
                          f"({rec.table_path})", highlight=False)
        if not due:
            console.print("nothing to retire: no retired version is past its keep period", highlight=False)
        return
    results = replay.retire_expired(settings, runner_for(settings), by=_by())
    for result in results:
        console.print(result.message, highlight=False)
    if not results:
        console.print("nothing to retire: no retired version is past its keep period", highlight=False)
    if any(not r.deleted for r in results):
        raise typer.Exit(1)


# -------------------------------------------------------------------------------------------- airflow
@airflow_app.command("trigger")
def airflow_trigger(
    dag: str = typer.Argument(..., help="DAG id: kappa_replay | kappa_rollback | kappa_retire."),
    conf: str = typer.Option("{}", help="The run's Params as JSON, e.g. '{\"view\": \"campaign_window_counts\", "
                             "\"version\": 2}'."),
    wait: bool = typer.Option(False, "--wait", help="Follow the run's tasks until it ends (a failed run exits non-zero)."),
    timeout: float = typer.Option(3600.0, min=1.0, help="With --wait: give up after this many seconds."),
    url: str = typer.Option("", help="Another Airflow than the local stack's (e.g. the chart's, through "
                            "`kubectl port-forward`): its base URL; the password is read from KAPPA_AIRFLOW_PASSWORD."),
    user: str = typer.Option("admin", help="With --url: the user to log in as."),
) -> None:
    """Trigger a DAG with Params and print the run's URL (REST API, no Airflow CLI)."""
    from kappa.front.airflow_client import AirflowAPI

    try:
        params = json.loads(conf)
    except ValueError as exc:
        raise UserError(f"--conf is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise UserError("--conf must be a JSON object of Params")
    if url:
        password = _settings().airflow_password
        if not password:
            raise UserError(f"--url {url}: set KAPPA_AIRFLOW_PASSWORD to {user}'s password (it is never taken from "
                            "the command line)")
        api = AirflowAPI(url, user, password)
    else:
        api = AirflowAPI.local(_settings())
    run_id = api.trigger(dag, params, note=f"triggered by {_by()}")
    console.print(f"{dag}: run {run_id}\n{api.run_url(dag, run_id)}", highlight=False)
    if not wait:
        return

    shown: dict[str, Any] = {"tasks": None, "progress": {}}

    def show(state) -> None:
        """A line of task states when they change; a waiting task's progress line (what its log says at each
        poke: percent, lag, ETA, why it is not done) when that changes."""
        if (state.state, state.tasks) != shown["tasks"]:
            shown["tasks"] = (state.state, state.tasks)
            tasks = "  ".join(f"{task} {st}" for task, st in state.tasks.items())
            console.print(f"{state.state:<8} {tasks}", highlight=False, markup=False, soft_wrap=True)
        for task, line in state.progress.items():
            if shown["progress"].get(task) != line:
                shown["progress"][task] = line
                console.print(f"         {task}: {line}", highlight=False, markup=False, soft_wrap=True)

    final = api.wait(dag, run_id, timeout=timeout, on_change=show,
                     on_silence=_say)
    if final.state != "success":
        failed = [t for t, st in final.tasks.items() if st in ("failed", "upstream_failed")]
        reasons = api.failure_reasons(final)  # what the failed tasks recorded: the reason, not only the task name
        why = "; ".join(f"{task}: {reason}" for task, reason in reasons.items())
        raise UserError(f"{dag} run {run_id} {final.state} (tasks {', '.join(failed) or '-'})"
                        + (f": {why}" if why else "") + f"; see {api.run_url(dag, run_id)}")


def _say(line: str) -> None:
    """One plain line on stdout (no markup, no highlighting, never wrapped)."""
    console.print(line, highlight=False, markup=False, soft_wrap=True)


def _signal_name(exc: BaseException) -> str:
    """SIGTERM/SIGHUP (kappa.process.interrupt_on_termination names it), else Ctrl-C."""
    return exc.args[0] if isinstance(exc, KeyboardInterrupt) and exc.args else "SIGINT"


def _interrupted(exc: KeyboardInterrupt, line: str) -> KeyboardInterrupt:
    """Print what an interrupted command did about it (one line); main() then exits 130 without a second line."""
    err.print(f"interrupted ({_signal_name(exc)}): {line}", highlight=False, markup=False)
    exc.explained = True  # type: ignore[attr-defined]
    return exc


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kappa`` console script."""
    from kappa.objectstore import use_platform_store
    from kappa.process import interrupt_on_termination

    code = 0
    try:
        use_platform_store(_settings())  # a lake on the platform's running object store: its credential
        with interrupt_on_termination():  # SIGTERM/SIGHUP unwind like Ctrl-C: a command stops what it started
            returned = app(args=argv, standalone_mode=False)
        if isinstance(returned, int):  # typer.Exit(n) outside standalone mode is returned, not raised
            code = returned
    except SystemExit as exc:  # typer/click exits (help, usage errors already printed)
        code = exc.code if isinstance(exc.code, int) else 1
    except (typer.Abort, KeyboardInterrupt) as exc:
        if not getattr(exc, "explained", False):  # a command that cleaned up said what it left
            err.print(f"interrupted ({_signal_name(exc)})", highlight=False, markup=False)
        code = 130
    except Exception as exc:  # noqa: BLE001 - one line for user errors, full trace otherwise
        import click

        usage = (click.ClickException, getattr(typer, "TyperException", click.ClickException))  # typer's own click
        if isinstance(exc, usage) and hasattr(exc, "format_message"):
            # a usage error (an unknown option, a value out of range): one line, like every other refusal
            message = " ".join(exc.format_message().split())
            err.print(f"error: {message} (--help lists the options)", highlight=False, markup=False)
            code = getattr(exc, "exit_code", 2)
        elif isinstance(exc, _user_errors()):
            msg = one_line(exc)
            err.print(f"error: {msg}", highlight=False, markup=False)
            code = 2
        else:
            code = 1
            raise
    sys.exit(code)


if __name__ == "__main__":
    main()

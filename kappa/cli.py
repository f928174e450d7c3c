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
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kappa.errors import one_line

__all__ = ["app", "main", "UserError"]

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

app = typer.Typer(help="Kappa platform: Kafka log -> Spark views on Delta.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
view_app = typer.Typer(help="Run and manage view-version drivers.", no_args_is_help=True)
broker_app = typer.Typer(help="The local KRaft broker.", no_args_is_help=True)
topics_app = typer.Typer(help="Topics declared in kappa/platform.yaml.", no_args_is_help=True)
host_app = typer.Typer(help="The view host: many view versions in one Spark application.", no_args_is_help=True)
app.add_typer(view_app, name="view")
app.add_typer(host_app, name="host")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")


class UserError(Exception):
    """A mistake the user can fix; printed as one line."""


def _settings():
    from kappa.config import Settings

    return Settings.from_env()


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'you asked for something impossible', shown without a traceback."""
    from kappa.config import ConfigError
    from kappa.job import RunMismatch
    from kappa.lock import DriverAlreadyRunning
    from kappa.spark import MissingJarsError

    errors: list[type[BaseException]] = [UserError, ConfigError, RunMismatch, DriverAlreadyRunning,
                                         MissingJarsError, ValueError, FileNotFoundError, KeyError]
    try:
        from kappa.catalog import CatalogError

        errors.append(CatalogError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


# -------------------------------------------------------------------------------------------- views
def _load_view(name: str, version: int | None):
    from kappa.catalog import load_catalog
    from kappa.view import load_view

    catalog = load_catalog()
    if name not in catalog.views:
        raise UserError(f"unknown view {name!r}; declared views: {', '.join(sorted(catalog.views))}")
    spec = catalog.views[name]
    version = version or spec.default_version
    if version not in spec.versions:
        raise UserError(f"{name} has no version {version}; versions: {sorted(spec.versions)}")
    return load_view(spec.versions[version])


@view_app.command("run")
def view_run(
    view: str = typer.Argument(..., help="View name (kappa/platform.yaml)."),
    version: Optional[int] = typer.Option(None, help="View version (default: the view's default_version)."),
    starting: str = typer.Option("latest", help="earliest | latest | ts:<epoch ms> | JSON offsets (new runs)."),
    metrics_port: int = typer.Option(int(os.environ.get("KAPPA_METRICS_PORT", "9400")),
                                     help="Prometheus /metrics port (0 = any free port)."),
    trigger_seconds: float = typer.Option(2.0, help="Processing-time trigger interval of live runs."),
    available_now: bool = typer.Option(False, "--available-now", help="Process what the log holds, then stop."),
    end_ts: Optional[int] = typer.Option(None, help="Bounded backfill: stop at this Kafka timestamp (ms)."),
    max_offsets_per_trigger: Optional[int] = typer.Option(None, help="Bound micro-batch size."),
) -> None:
    """Run one view-version driver in the foreground until SIGTERM (or until a bounded run ends)."""
    from kappa.job import ViewJob

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    definition = _load_view(view, version)
    job = ViewJob(definition, _settings(), starting=starting, trigger_seconds=trigger_seconds,
                  available_now=available_now or end_ts is not None, end_timestamp_ms=end_ts,
                  max_offsets_per_trigger=max_offsets_per_trigger, metrics_port=metrics_port)
    job.start()
    console.print(f"{definition.ref} running (app id {job.app_id}); metrics on "
                  f"http://127.0.0.1:{job.bound_port}/metrics", highlight=False)
    job.run_forever()


@view_app.command("start")
def view_start(
    view: str,
    version: Optional[int] = typer.Option(None),
    starting: str = typer.Option("latest"),
    metrics_port: int = typer.Option(9400),
) -> None:
    """Start a view-version driver in the background (local runner)."""
    from kappa.runners.base import JobSpec
    from kappa.runners.local import LocalRunner

    definition = _load_view(view, version)
    status = LocalRunner(_settings()).start(JobSpec(view, definition.version, starting=starting,
                                                    metrics_port=metrics_port))
    console.print(f"{status.ref}: {status.state} ({status.detail}) {status.metrics_url or ''}", highlight=False)


@view_app.command("stop")
def view_stop(view: str, version: Optional[int] = typer.Option(None)) -> None:
    """Stop a background view-version driver (local runner)."""
    from kappa.runners.local import LocalRunner

    definition = _load_view(view, version)
    status = LocalRunner(_settings()).stop(view, definition.version)
    console.print(f"{status.ref}: {status.state} ({status.detail})", highlight=False)


@host_app.command("run")
def host_run(
    view: list[str] = typer.Option([], "--view", help="Always run this view: name or name@vN (repeatable)."),
    starting: list[str] = typer.Option(["earliest"], "--starting", help="Start position of new checkpoints of "
                                       "the --view versions: once for all, or once per --view in the same order."),
    driver_memory: str = typer.Option("2g", help="Heap of the host's Spark driver JVM."),
    metrics_port: int = typer.Option(0, "--metrics-port", min=0, max=65535, help="Prometheus port of the first "
                                     "--view; the i-th --view (from 0) gets this + i. 0: any free port for each."),
) -> None:
    """Run the view host in the foreground: the --view versions plus those asked for under
    $KAPPA_HOME/run/host/desired (by the local runner), each its own query in one Spark application."""
    from kappa.host import ViewHost
    from kappa.runners.base import JobSpec

    if len(starting) not in (1, len(view)):
        raise UserError(f"give --starting once (for every --view) or once per --view: {len(starting)} "
                        f"--starting for {len(view)} --view")
    if metrics_port and metrics_port + len(view) - 1 > 65535:
        raise UserError(f"--metrics-port {metrics_port} + {len(view)} views goes beyond port 65535")
    static: list[JobSpec] = []
    for i, item in enumerate(view):
        name, _, version = item.partition("@v")
        definition = _load_view(name, int(version) if version.isdigit() else None)
        if any(spec.ref == definition.ref for spec in static):
            raise UserError(f"--view {definition.ref} is given twice: one query per view version")
        static.append(JobSpec(definition.name, definition.version, starting=starting[i if len(starting) > 1 else 0],
                              metrics_port=metrics_port + i if metrics_port else 0))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    ViewHost(_settings(), driver_memory=driver_memory, static=static).run()


# -------------------------------------------------------------------------------------------- broker
@broker_app.command("start")
def broker_start() -> None:
    """Start the local KRaft broker (data survives restarts)."""
    from kappa.broker import LocalBroker

    settings = _settings()
    if not settings.local_broker:
        raise UserError(f"KAPPA_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} points at an external cluster; "
                        "no local broker to start")
    broker = LocalBroker.from_settings(settings).start()
    console.print(f"broker running at {broker.bootstrap} (data in {broker.data_dir})", highlight=False)


@broker_app.command("stop")
def broker_stop() -> None:
    """Stop the local broker."""
    from kappa.broker import LocalBroker

    LocalBroker.from_settings(_settings()).stop()
    console.print("broker stopped")


@broker_app.command("status")
def broker_status() -> None:
    from kappa.broker import LocalBroker

    broker = LocalBroker.from_settings(_settings())
    console.print(f"broker {'running' if broker.is_running() else 'stopped'} at {broker.bootstrap}",
                  highlight=False)


# -------------------------------------------------------------------------------------------- topics
@topics_app.command("ensure")
def topics_ensure() -> None:
    """Create or update every declared topic (idempotent)."""
    from kappa.topics import declared_topics, ensure_topics

    settings = _settings()
    changes = ensure_topics(settings, declared_topics(settings))
    for change in changes:
        console.print(str(change), highlight=False)
    if not changes:
        console.print("topics up to date")


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
    no_campaigns: bool = typer.Option(False, "--no-campaigns", help="Do not (re)publish the ad->campaign map."),
    topic: str = typer.Option("ad-events"),
) -> None:
    """Write Yahoo Streaming Benchmark ad events with the idempotent producer."""
    from kappa import generator

    settings = _settings()
    u = generator.universe(seed=seed, campaigns=campaigns)
    topic = settings.topic(topic)  # a declared name; KAPPA_TOPIC_PREFIX makes it the physical one
    if not no_campaigns:
        generator.publish_campaigns(settings, generator.campaign_records(u), topic=settings.topic("campaigns"))
    if live and count == 0:
        if not rate:
            raise UserError("--live --count 0 needs --rate")
        chunk, i = max(1, int(rate * 5)), 0
        while True:  # until SIGTERM (kappa down)
            generator.produce(settings, topic, generator.events(
                chunk, seed=seed + i, universe=u, late_fraction=late_fraction, max_lateness_ms=max_lateness_ms,
                malformed_fraction=malformed_fraction, live=True), rate=rate)
            i += 1
    if count <= 0:
        raise UserError("--count must be positive (or 0 together with --live --rate)")
    result = generator.produce(settings, topic, generator.events(
        count, seed=seed, universe=u, rate_per_s=rate or 1000.0, late_fraction=late_fraction,
        max_lateness_ms=max_lateness_ms, malformed_fraction=malformed_fraction, live=live),
        rate=rate)
    console.print_json(json.dumps(result.as_dict()))


# -------------------------------------------------------------------------------------------- stack
@app.command("up")
def up(
    rate: float = typer.Option(200.0, help="Live producer rate (events/s)."),
    airflow: bool = typer.Option(True, help="Also start Airflow standalone."),
) -> None:
    """Start the local platform (broker, topics, views, producer, Airflow) and print where things are."""
    from kappa import stack

    settings = _settings()
    stack.up(settings, rate=rate, airflow=airflow, echo=lambda m: console.print(m, highlight=False))
    console.print(
        "\n[bold]Next[/bold]\n"
        "  kappa status                          what runs, metrics URLs, Airflow login\n"
        "  kappa query \"SELECT * FROM campaign_window_counts ORDER BY window_start DESC LIMIT 10\"\n"
        "  kappa replay campaign_window_counts --version 2 --start earliest\n"
        "  make down                             stop everything (data stays in .kappa/)")


@app.command("down")
def down() -> None:
    """Stop everything `kappa up` started (data stays)."""
    from kappa import stack

    stack.down(_settings(), echo=lambda m: console.print(m, highlight=False))


@app.command("status")
def status() -> None:
    """Processes of the local stack, and the registry of view versions."""
    from kappa import stack

    settings = _settings()
    table = Table("component", "state", "where")
    for row in stack.status(settings):
        table.add_row(*row)
    console.print(table)
    try:
        from kappa.registry import Registry

        records = Registry(settings.lake_uri).list()
    except Exception as exc:  # noqa: BLE001 - registry not created yet
        console.print(f"registry: {str(exc).splitlines()[0] if str(exc) else 'empty'}", highlight=False)
        return
    reg = Table("view", "version", "state", "by", "updated", "note")
    for r in records:
        reg.add_row(r.view, str(r.version), r.state, r.state_changed_by, str(r.updated_at)[:19], r.note or "")
    console.print(reg)


@app.command("query")
def query(
    sql: str = typer.Argument(..., help="SQL over the serving views (campaign_window_counts, ...)."),
    as_of: Optional[str] = typer.Option(None, "--as-of", help="Delta version (int) or ISO timestamp."),
    limit: int = typer.Option(50, help="Rows to print."),
) -> None:
    """Answer SQL over the serving views without Spark (DuckDB over delta-rs), with freshness."""
    from kappa.query import run_query

    result = run_query(sql, as_of=as_of, settings=_settings())
    table = Table(*result.columns)
    for row in result.rows[:limit]:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)
    for name, f in result.freshness.items():
        console.print(f"{name}: serving v{f.serving_version}, delta version {f.delta_version}, last commit "
                      f"{f.last_commit}, watermark {f.watermark}", highlight=False)


# -------------------------------------------------------------------------------------------- replays
def _by() -> str:
    import getpass

    return f"cli:{getpass.getuser()}"


def _replay_request(view: str, version: int, **fields):
    from kappa.replay import ReplayRequest

    return ReplayRequest(view=view, version=version, triggered_by=_by(), **fields).validate()


@app.command("replay")
def replay_cmd(
    view: str = typer.Argument(..., help="View name (kappa/platform.yaml)."),
    version: int = typer.Option(..., help="Version to build (declared under the view's versions)."),
    start: str = typer.Option("earliest", help="earliest | ts:<epoch ms> | JSON offsets '{\"0\": 120, ...}'."),
    end: str = typer.Option("live", help="live (then keep following the log) | ts:<epoch ms> (bounded)."),
    verify: str = typer.Option("strict", help="strict (must equal the plain-Python oracle) | none."),
    promote: bool = typer.Option(False, "--promote/--no-promote", help="Switch readers to it once verified."),
    keep_hours: float = typer.Option(24.0, min=0.0, help="Keep the replaced version's table this long."),
    max_offsets_per_trigger: Optional[int] = typer.Option(None, min=1, help="Bound the replay's micro-batches."),
    max_lag: int = typer.Option(2000, min=0, help="Live: caught up once at most this many records lag behind."),
    timeout: float = typer.Option(0.0, min=0.0, help="Stop waiting after this many seconds (0: no limit)."),
) -> None:
    """Replay the retained log into a new view version: preflight, launch, wait, verify, (promote)."""
    from kappa import replay

    settings = _settings()
    req = _replay_request(view, version, **replay.parse_start(start), **replay.parse_end(end), verify=verify,
                          auto_promote=promote, keep_hours=keep_hours,
                          max_offsets_per_trigger=max_offsets_per_trigger, max_lag=max_lag)
    runner = replay.runner_from_env(settings)
    # rerunning the command follows a replay that is already under way (it never starts a second driver)
    pre = replay.preflight(req, settings, runner, resume=True)
    console.print(pre.summary(), highlight=False)
    rec = replay.launch(req, settings, runner, pre)
    console.print(f"{req.ref}: {rec.state} (app id {rec.app_id})", highlight=False)
    _follow(req, settings, runner, timeout=timeout)
    result = replay.verify(view, version, settings, req.verify, by=req.triggered_by,
                           end_timestamp_ms=req.end_timestamp_ms)
    console.print(result.message, highlight=False)
    if not result.passed:
        raise UserError(f"{req.ref} failed verification; serving unchanged")
    if req.auto_promote:
        switched = replay.promote(view, version, settings, runner, by=req.triggered_by, keep_hours=keep_hours)
        console.print(switched.message, highlight=False)
    else:
        console.print(f"promote it with: kappa promote {view} --version {version}", highlight=False)


def _follow(req, settings, runner, *, timeout: float, poll: float = 2.0, record_every: float = 10.0) -> None:
    """Progress bar until the replay has caught up (the job keeps running if this is interrupted)."""
    from collections import deque

    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from kappa import replay

    samples: deque = deque(maxlen=10)
    deadline = time.monotonic() + timeout if timeout else None
    last_record = 0.0
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(req.ref, total=None, detail="starting")
        while True:
            record = time.monotonic() - last_record >= record_every
            sample = replay.progress(req.view, req.version, settings, end_timestamp_ms=req.end_timestamp_ms,
                                     previous=samples[0] if samples else None, record=record, by=req.triggered_by)
            if record:
                last_record = time.monotonic()
            samples.append(sample)
            bar.update(task, total=max(sample.total, 1), completed=sample.done,
                       detail=f"lag {sample.lag:,}  ETA {sample.eta_text}")
            if replay.caught_up(req.view, req.version, settings, runner, by=req.triggered_by,
                                end_timestamp_ms=req.end_timestamp_ms, max_lag=req.max_lag, sample=sample):
                bar.update(task, completed=max(sample.total, 1), detail=f"caught up (lag {sample.lag:,})")
                return
            if deadline is not None and time.monotonic() > deadline:
                raise UserError(f"{req.ref} not caught up after {timeout:.0f}s ({sample.summary()}); the job keeps "
                                "running - run `kappa verify` / `kappa promote` once it has")
            time.sleep(poll)


@app.command("verify")
def verify_cmd(
    view: str = typer.Argument(..., help="View name."),
    version: int = typer.Option(..., help="Version to check (must have caught up)."),
    mode: str = typer.Option("strict", help="strict (equal to the plain-Python oracle) | none."),
    end_ts: Optional[int] = typer.Option(None, help="Bounded replays: their end timestamp (ms)."),
) -> None:
    """Check a caught-up version against the independent oracle (-> verified or failed)."""
    from kappa import replay

    result = replay.verify(view, version, _settings(), mode, by=_by(), end_timestamp_ms=end_ts)
    console.print(result.message, highlight=False)
    for example in result.examples:
        console.print(f"  {example}", highlight=False)
    if not result.passed:
        raise typer.Exit(1)


@app.command("promote")
def promote_cmd(
    view: str = typer.Argument(..., help="View name."),
    version: int = typer.Option(..., help="Verified version to serve."),
    keep_hours: float = typer.Option(24.0, min=0.0, help="Keep the replaced version's table this long."),
) -> None:
    """Switch the view's serving alias to a verified version (atomic, idempotent); stop the old job."""
    from kappa import replay

    settings = _settings()
    result = replay.promote(view, version, settings, replay.runner_from_env(settings), by=_by(),
                            keep_hours=keep_hours)
    console.print(result.message, highlight=False)


@app.command("rollback")
def rollback_cmd(
    view: str = typer.Argument(..., help="View name."),
    to: Optional[int] = typer.Option(None, "--to", help="Version to serve again (default: the previous one)."),
    keep_hours: float = typer.Option(24.0, min=0.0, help="Keep the replaced version's table this long."),
) -> None:
    """Serve a kept earlier version again: switch the alias back, restart its job, stop the other one."""
    from kappa import replay

    settings = _settings()
    result = replay.rollback(view, to, settings, replay.runner_from_env(settings), by=_by(), keep_hours=keep_hours)
    console.print(result.message, highlight=False)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kappa`` console script."""
    exit_file = os.environ.get("KAPPA_EXIT_FILE")
    code = 0
    try:
        app(args=argv, standalone_mode=False)
    except SystemExit as exc:  # typer/click exits (help, usage errors already printed)
        code = exc.code if isinstance(exc.code, int) else 1
    except typer.Abort:
        code = 130
    except Exception as exc:  # noqa: BLE001 - one line for user errors, full trace otherwise
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            code = exc.exit_code
        elif isinstance(exc, _user_errors()):
            msg = one_line(exc)
            err.print(f"error: {msg}", highlight=False, markup=False)
            code = 2
        else:
            code = 1
            raise
    finally:
        if exit_file:
            Path(exit_file).write_text(str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()

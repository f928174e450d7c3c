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

__all__ = ["app", "main", "UserError"]

console = Console()
err = Console(stderr=True)

app = typer.Typer(help="Kappa platform: Kafka log -> Spark views on Delta.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
view_app = typer.Typer(help="Run and manage view-version drivers.", no_args_is_help=True)
broker_app = typer.Typer(help="The local KRaft broker.", no_args_is_help=True)
topics_app = typer.Typer(help="Topics declared in kappa/platform.yaml.", no_args_is_help=True)
app.add_typer(view_app, name="view")
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
    from kappa.catalog import load_catalog
    from kappa.topics import ensure_topics

    changes = ensure_topics(_settings(), list(load_catalog().topics.values()))
    for change in changes:
        console.print(str(change), highlight=False)
    if not changes:
        console.print("topics up to date")


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
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
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

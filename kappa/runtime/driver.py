"""The view driver: the process a runner starts to run view versions.

Two forms, both in the foreground until SIGTERM (or until a bounded run ends):

.. code-block:: text

    python -m kappa.runtime.driver view <view> [--version N] [--starting S] [--metrics-port P] [--end-ts MS]
                                               [--max-offsets-per-trigger N] [--trigger-seconds S] [--available-now]
        one view version, one streaming query, its own JVM (kappa.runtime.job.ViewJob)
    python -m kappa.runtime.driver host [--view NAME[@vN] ...] [--starting S ...] [--driver-memory 2g]
                                        [--metrics-port P]
        the view host: many view versions in one JVM (kappa.runtime.host.ViewHost)

A :class:`JobSpec` is what a runner asks for; :meth:`JobSpec.command` is the command line that runs it. The
operators' CLI (``kappa view run`` / ``kappa host run``, the chart's containers) calls the same
:func:`run_view` / :func:`run_host`. When ``KAPPA_EXIT_FILE`` is set the driver writes its exit code there (the
local runner tells a finished bounded run from a failed one by it). A refusal (unknown view, a second copy of a
running version, ...) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from kappa.errors import KappaError, one_line
from kappa.identity import view_ref

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["DriverError", "JobSpec", "host_specs", "main", "run_host", "run_view"]

MODULE = "kappa.runtime.driver"


class DriverError(KappaError, ValueError):
    """A driver asked for something impossible (one line)."""


@dataclass(frozen=True)
class JobSpec:
    """What to run: one view version from a start position, live or bounded.

    Attributes:
        view: view name.
        version: view version.
        starting: ``earliest`` | ``latest`` | ``ts:<epoch ms>`` | JSON offsets (new checkpoints only).
        end_timestamp_ms: bounded backfill - process records before this Kafka timestamp, then stop.
        max_offsets_per_trigger: micro-batch size bound (replays).
        metrics_port: Prometheus port of the driver (None: the runner's choice - the local runner gives every
            view version a stable port, :func:`kappa.control.runners.local.metrics_port`).
        env: extra environment for the driver.
    """

    view: str
    version: int
    starting: str = "latest"
    end_timestamp_ms: int | None = None
    max_offsets_per_trigger: int | None = None
    metrics_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return view_ref(self.view, self.version)

    def args(self) -> list[str]:
        """The driver's arguments for this spec (after ``python -m kappa.runtime.driver``)."""
        out = ["view", self.view, "--version", str(self.version), "--starting", self.starting]
        if self.metrics_port is not None:
            out += ["--metrics-port", str(self.metrics_port)]
        return out + self.run_options()

    def command(self) -> list[str]:
        """The whole command line of a driver of its own for this spec."""
        return [sys.executable, "-m", MODULE, *self.args()]

    def run_options(self) -> list[str]:
        """The options of a bounded or batch-size-limited run (what a runner adds to a driver template)."""
        out: list[str] = []
        if self.end_timestamp_ms is not None:
            out += ["--end-ts", str(self.end_timestamp_ms)]
        if self.max_offsets_per_trigger:
            out += ["--max-offsets-per-trigger", str(self.max_offsets_per_trigger)]
        return out




def host_command() -> list[str]:
    """The command line of a view host that runs what the local runner asks for."""
    return [sys.executable, "-m", MODULE, "host"]


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)


def run_view(settings: "Settings", view: str, version: int | None = None, *, starting: str = "latest",
             metrics_port: int = 9400, trigger_seconds: float | None = None, available_now: bool = False,
             end_ts: int | None = None, max_offsets_per_trigger: int | None = None,
             echo: Callable[[str], None] = print) -> None:
    """Run one view version (default: the view's default version) until SIGTERM or the end of a bounded run."""
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import declared_view

    _logging()
    definition = declared_view(view, version)
    job = ViewJob(definition, settings, starting=starting, trigger_seconds=trigger_seconds,
                  available_now=available_now or end_ts is not None, end_timestamp_ms=end_ts,
                  max_offsets_per_trigger=max_offsets_per_trigger, metrics_port=metrics_port)
    job.start(wait_for_topics=True)
    echo(f"{definition.ref} running (app id {job.app_id}); metrics on http://127.0.0.1:{job.bound_port}/metrics")
    job.run_forever()


def host_specs(views: Sequence[str], starting: Sequence[str], metrics_port: int = 0) -> list[JobSpec]:
    """The ``--view`` versions of a host (``name`` or ``name@vN``), each with its start position (once for all or
    once per view) and metrics port (the i-th gets ``metrics_port + i``; 0: any free port)."""
    starting = list(starting) or ["earliest"]
    if len(starting) not in (1, len(views)):
        raise DriverError(f"give --starting once (for every --view) or once per --view: {len(starting)} "
                          f"--starting for {len(views)} --view")
    if metrics_port and metrics_port + len(views) - 1 > 65535:
        raise DriverError(f"--metrics-port {metrics_port} + {len(views)} views goes beyond port 65535")
    from kappa.runtime.view import declared_view

    specs: list[JobSpec] = []
    for i, item in enumerate(views):
        name, _, version = item.partition("@v")
        definition = declared_view(name, int(version) if version.isdigit() else None)
        if any(spec.ref == definition.ref for spec in specs):
            raise DriverError(f"--view {definition.ref} is given twice: one query per view version")
        specs.append(JobSpec(definition.name, definition.version, starting=starting[i if len(starting) > 1 else 0],
                             metrics_port=metrics_port + i if metrics_port else 0))
    return specs


def run_host(settings: "Settings", specs: Sequence[JobSpec] = (), *,
             driver_memory: str | None = None,
             handed_over: str | None = None) -> None:
    """Run the view host: ``specs`` (but those ``handed_over`` names), plus the versions the local runner asks for,
    until SIGTERM. ``driver_memory``: its JVM's heap ceiling (default: ``KAPPA_HOST_DRIVER_MEMORY``)."""
    from kappa.runtime.host import ViewHost

    _logging()
    ViewHost(settings, driver_memory=driver_memory, static=list(specs), handed_over=handed_over).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="form", required=True)
    v = sub.add_parser("view", help="one view version in its own driver")
    v.add_argument("view")
    v.add_argument("--version", type=int, default=None)
    v.add_argument("--starting", default="latest")
    v.add_argument("--metrics-port", type=int, default=None)
    v.add_argument("--trigger-seconds", type=float, default=None,
                   help="how often live micro-batches run (default: the view's trigger in platform.yaml, else 2 s)")
    v.add_argument("--available-now", action="store_true")
    v.add_argument("--end-ts", type=int, default=None)
    v.add_argument("--max-offsets-per-trigger", type=int, default=None)
    h = sub.add_parser("host", help="the view host: many view versions in one JVM")
    h.add_argument("--view", action="append", default=[])
    h.add_argument("--starting", action="append", default=[])
    h.add_argument("--driver-memory", default=None, help="heap ceiling (default: KAPPA_HOST_DRIVER_MEMORY, 768m)")
    h.add_argument("--metrics-port", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns (and, run as a module, exits with) the exit code."""
    from kappa.config import Settings

    args = _parser().parse_args(argv)
    settings = Settings.from_env()
    code = 0
    try:
        from kappa.runtime.checkpoint import check_lake

        check_lake(settings.lake_uri)  # a wrong endpoint, bucket or credential: one line, before Spark starts
        if args.form == "view":
            port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
            run_view(settings, args.view, args.version, starting=args.starting, metrics_port=port,
                     trigger_seconds=args.trigger_seconds, available_now=args.available_now, end_ts=args.end_ts,
                     max_offsets_per_trigger=args.max_offsets_per_trigger)
        else:
            run_host(settings, host_specs(args.view, args.starting, args.metrics_port),
                     driver_memory=args.driver_memory)
    except (KappaError, ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        code = 2
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException:
        code = 1
        raise
    finally:
        from kappa.runtime.spark import end_jvm

        end_jvm()  # its shutdown hooks end before this process does (its group is signalled once it is gone)
        if settings.exit_file:
            Path(settings.exit_file).write_text(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main())

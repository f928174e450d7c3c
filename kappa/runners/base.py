"""The interface every view-job runner implements (local processes, Kubernetes workloads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from kappa.identity import view_ref

__all__ = ["JobSpec", "JobStatus", "Runner"]


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
            view version a stable port, :func:`kappa.runners.local.metrics_port`).
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
        """Arguments of ``kappa view run`` for this spec."""
        out = ["view", "run", self.view, "--version", str(self.version), "--starting", self.starting]
        if self.metrics_port is not None:
            out += ["--metrics-port", str(self.metrics_port)]
        return out + self.run_options()

    def run_options(self) -> list[str]:
        """The options of a bounded or batch-size-limited run (what a runner adds to a driver template)."""
        out: list[str] = []
        if self.end_timestamp_ms is not None:
            out += ["--end-ts", str(self.end_timestamp_ms)]
        if self.max_offsets_per_trigger:
            out += ["--max-offsets-per-trigger", str(self.max_offsets_per_trigger)]
        return out


@dataclass(frozen=True)
class JobStatus:
    ref: str
    state: Literal["running", "stopped", "failed", "finished"]
    detail: str = ""
    metrics_url: str | None = None


@runtime_checkable
class Runner(Protocol):
    """Starts, stops and reports view-version drivers; ``start`` of a running job is a no-op."""

    def start(self, spec: JobSpec) -> JobStatus: ...

    def stop(self, view: str, version: int) -> JobStatus: ...

    def status(self, view: str, version: int) -> JobStatus: ...

"""The interface every view-job runner implements (local processes, Kubernetes workloads); what a runner runs is a
:class:`kappa.runtime.driver.JobSpec`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from kappa.runtime.driver import JobSpec

__all__ = ["JobStatus", "Runner"]


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

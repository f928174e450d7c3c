"""kappa -- a Kappa-architecture reference platform.

Kafka is the retained log; Spark Structured Streaming jobs (``jobs/``) maintain Delta Lake views from it; a new
view version is a replay of the log, verified and switched in atomically. The package is layered; a layer imports
only from the layers above it in this list, never from one below:

=====================  ==========================================================================================
``kappa``              the core: settings (``config``), errors, a view version's identity, the platform
                       declaration (``catalog``), pinned versions, process start/stop (``process``)
``kappa.log``          the retained log: the local broker, topics, event schemas, the event generator
``kappa.runtime``      the stream runtime: view definitions, the driver, the job and the view host, decoding,
                       lookups, the micro-batch, Delta sinks, lineage, checkpoints, metrics, the re-run engine, the
                       view authors' testing kit
``kappa.verify``       verification: comparing tables, the recompute, the plain-Python oracle, the diff report
``kappa.control``      the control plane: the version registry, the serving alias, replay steps, runners
``kappa.front``        front ends: the CLI, analyst queries, the local stack, the benchmark
=====================  ==========================================================================================

What a user needs is exported here (imported on first use, so ``import kappa`` stays cheap):

    >>> from kappa import ViewDefinition, Settings, run_view  # doctest: +SKIP
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping

__all__ = ["Expectation", "Finality", "KappaError", "Lookup", "Registry", "ReplayRequest", "Settings",
           "ViewDefinition", "declared_view", "run_view"]

_EXPORTS = {
    "Expectation": "kappa.runtime.view",
    "Finality": "kappa.runtime.view",
    "ViewDefinition": "kappa.runtime.view",
    "declared_view": "kappa.runtime.view",
    "Lookup": "kappa.runtime.lookups",
    "run_view": "kappa.runtime.testing",
    "KappaError": "kappa.errors",
    "Settings": "kappa.config",
    "Registry": "kappa.control.registry",
    "ReplayRequest": "kappa.control.replay.request",
}


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that imports ``exports[name]`` on first access and returns its
    ``name``: how every ``kappa`` package exports its public API without importing it eagerly."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)

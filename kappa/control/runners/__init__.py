"""View-job runners: who starts, stops and reports view-version drivers.

``KAPPA_RUNNER`` picks one from :data:`RUNNERS`: ``local`` (processes or the view host on this machine,
:class:`~kappa.control.runners.local.LocalRunner`) or ``kubernetes`` (a Deployment per version from the chart's
view template, :class:`~kappa.control.runners.kubernetes.KubernetesRunner`). Both implement
:class:`~kappa.control.runners.base.Runner`; what they run is a :class:`kappa.runtime.driver.JobSpec`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from kappa.control.runners.base import JobStatus, Runner

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["RUNNERS", "JobStatus", "Runner", "runner_for"]

#: ``KAPPA_RUNNER`` value -> the runner class (built with its ``from_settings``); imported only when chosen (the
#: Kubernetes client is not installed everywhere). kappa.config.RUNNERS lists the same names for validation.
RUNNERS = {
    "local": "kappa.control.runners.local:LocalRunner",
    "kubernetes": "kappa.control.runners.kubernetes:KubernetesRunner",
}


def runner_for(settings: "Settings") -> Runner:
    """The runner ``settings.runner`` (``KAPPA_RUNNER``) names."""
    module, _, name = RUNNERS[settings.runner].partition(":")
    return getattr(import_module(module), name).from_settings(settings)

"""The control plane: which view versions exist, which one serves, and how a new one replaces it.

``registry`` (versions and their states, audit events: Delta tables) · ``serving`` (the serving alias, switched
in one commit) · ``replay`` (the replay steps: preflight, launch, follow, verify, promote, watch, rollback,
retire) · ``runners`` (who runs view drivers: local processes or Kubernetes Deployments).
"""

from kappa import lazy_exports

__all__ = ["Registry", "ReplayRequest", "ServingAlias", "runner_for"]

__getattr__ = lazy_exports(__name__, {
    "Registry": "kappa.control.registry",
    "ServingAlias": "kappa.control.serving",
    "ReplayRequest": "kappa.control.replay.request",
    "runner_for": "kappa.control.runners",
})

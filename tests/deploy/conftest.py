"""Fixtures of the offline deployment tests (every module is marked ``deploy``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deploy_helpers as h  # noqa: E402


@pytest.fixture(scope="session")
def helm() -> Path:
    return h.helm_binary()


@pytest.fixture(scope="session")
def default_objs(helm: Path) -> list[dict]:
    """The chart rendered with its defaults (no Prometheus operator API)."""
    return h.render()


@pytest.fixture(scope="session")
def all_renders(helm: Path) -> dict[str, list[dict]]:
    """Every value set the chart is verified with: defaults, defaults + operator API, each example, k8s mode."""
    out = {
        "defaults": h.render(),
        "defaults-prometheus-operator": h.render(api_versions=[h.MONITORING_API]),
        "spark-kubernetes": h.render(sets=["viewJobs.spark.mode=kubernetes"]),
    }
    for example in h.EXAMPLES:
        out[example.stem] = h.render(example, api_versions=[h.MONITORING_API])
    return out

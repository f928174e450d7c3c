"""Tests of what runs in real containers: the images `make images` builds (marker ``cluster``, `make test-cluster`)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # declared in pyproject.toml as well; registered here so this folder collects under --strict-markers on its own
    config.addinivalue_line("markers", "cluster: containers of the images built here (make images); make test-cluster")

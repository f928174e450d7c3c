"""Pins of the deployment tooling: infra/versions.env is the single source of truth."""

from __future__ import annotations

import re

import pytest

import deploy_helpers as h

pytestmark = pytest.mark.deploy


def requirements(path: str) -> dict[str, str]:
    out = {}
    for line in (h.ROOT / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: {line} is not pinned with =="
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def test_versions_env_keeps_its_format() -> None:
    from kappa.versions import parse_versions

    pins = parse_versions((h.ROOT / "infra" / "versions.env").read_text())
    assert pins == h.versions()
    for key, value in pins.items():
        assert re.fullmatch(r"[A-Za-z0-9_.,:+-]+", value), f"{key}={value!r} is not shell/Make-safe"


def test_helm_version_is_a_helm3_release() -> None:
    assert re.fullmatch(r"v3\.\d+\.\d+", h.versions()["HELM_VERSION"])


def test_python_tool_pins() -> None:
    pins = h.versions()
    deploy = requirements("infra/requirements-deploy.txt")
    assert deploy["kubernetes-validate"] == pins["KUBERNETES_VALIDATE_VERSION"]
    assert deploy["python-hcl2"] == pins["PYTHON_HCL2_VERSION"]
    assert requirements("infra/requirements-checkov.txt") == {"checkov": pins["CHECKOV_VERSION"]}
    # libraries the project venv already has: exactly the tested versions of requirements.lock
    lock = {}
    for line in (h.ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            lock[name.strip().lower().replace("_", "-")] = version.strip()
    for name, version in deploy.items():
        if name in lock:
            assert version == lock[name], f"{name}=={version} but requirements.lock has {lock[name]}"


@pytest.mark.parametrize(("tool", "module", "key"), [
    ("deploy/dockerfile-lint", "github.com/moby/buildkit", "BUILDKIT_VERSION"),
    ("deploy/promql-lint", "github.com/prometheus/prometheus", "PROMETHEUS_VERSION"),
    ("prometheus", "github.com/prometheus/prometheus", "PROMETHEUS_VERSION"),
    ("prometheus/operator", "github.com/prometheus-operator/prometheus-operator", "PROMETHEUS_OPERATOR_VERSION"),
])
def test_go_tool_pins(tool: str, module: str, key: str) -> None:
    gomod = (h.ROOT / "infra" / tool / "go.mod").read_text()
    m = re.search(rf"^\s*{re.escape(module)} (v\S+)", gomod, re.M)
    assert m and m.group(1) == h.versions()[key], f"{tool}/go.mod requires {module} {m and m.group(1)}"
    assert (h.ROOT / "infra" / tool / "go.sum").exists(), f"{tool}: go.sum pins the dependency graph"


def test_schema_versions_cover_129_and_the_newest_bundled() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -r infra/requirements-deploy.txt")
    wanted = h.versions()["K8S_SCHEMA_VERSIONS"].split(",")
    assert wanted[0].startswith("1.29.")
    newest = kv.utils.latest_version()  # e.g. "1.37.0"
    assert wanted[-1] == newest, f"K8S_SCHEMA_VERSIONS should end with the newest bundled schema {newest}"
    assert all(v in kv.utils.all_versions() for v in wanted), "every version must have bundled schemas"

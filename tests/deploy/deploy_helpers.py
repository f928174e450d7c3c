"""Helpers of the offline deployment tests (tests/deploy): render the chart with the pinned helm binary.

helm is the one ``infra/verify-offline.sh`` builds into ``.cache/tools/helm`` (installed on first use with
``bash infra/verify-offline.sh --tools``). Renders are cached per argument set.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kappa"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
TOOLS = ROOT / ".cache" / "tools"
HELM = TOOLS / "helm"
PLATFORM = ROOT / "kappa" / "platform.yaml"
KUBE_VERSION = "1.29.0"
RELEASE = "kappa"
NAMESPACE = "kappa"
MONITORING_API = "monitoring.coreos.com/v1"


class HelmError(RuntimeError):
    """helm exited non-zero; ``str(err)`` is its stderr."""


def versions() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (ROOT / "infra" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("'\"")
    return out


@functools.cache
def helm_binary() -> Path:
    """The pinned helm, installed through the verify script when missing (fails loudly if that is impossible)."""
    want = versions()["HELM_VERSION"]

    def current() -> str:
        if not HELM.exists():
            return ""
        res = subprocess.run([str(HELM), "version", "--template", "{{.Version}}"], capture_output=True, text=True)
        return res.stdout.strip()

    if current() != want:
        res = subprocess.run(["bash", str(ROOT / "infra" / "verify-offline.sh"), "--tools", "all"], capture_output=True,
                             text=True, cwd=ROOT)
        if res.returncode != 0 or current() != want:
            raise RuntimeError(f"cannot install helm {want}: {res.stderr.strip() or res.stdout.strip()}")
    return HELM


def _run(args: list[str]) -> str:
    res = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise HelmError(res.stderr.strip())
    return res.stdout


@functools.cache
def _template(chart: str, values_files: tuple[str, ...], sets: tuple[str, ...], api_versions: tuple[str, ...],
              kube_version: str) -> str:
    args = ["template", RELEASE, chart, "--namespace", NAMESPACE, "--kube-version", kube_version]
    for f in values_files:
        args += ["-f", f]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return _run(args)


def render(*values: str | Path | dict[str, Any], sets: Iterable[str] = (), api_versions: Iterable[str] = (),
           chart: Path = CHART, kube_version: str = KUBE_VERSION, tmp_dir: Path | None = None) -> list[dict[str, Any]]:
    """helm template -> list of objects (deep copies; safe to mutate). Dict values are written to tmp files."""
    files: list[str] = []
    for i, v in enumerate(values):
        if isinstance(v, dict):
            digest = abs(hash(json.dumps(v, sort_keys=True)))
            target = (tmp_dir or Path(tempfile.gettempdir())) / f"kappa-values-{digest}-{i}.yaml"
            target.write_text(yaml.safe_dump(v))
            files.append(str(target))
        else:
            files.append(str(v))
    out = _template(str(chart), tuple(files), tuple(sets), tuple(api_versions), kube_version)
    return [copy.deepcopy(d) for d in yaml.safe_load_all(out) if isinstance(d, dict)]


def render_error(*values: str | Path | dict[str, Any], sets: Iterable[str] = (), chart: Path = CHART,
                 tmp_dir: Path | None = None) -> str:
    """Render expecting failure; returns helm's error text (raises AssertionError if it rendered)."""
    try:
        render(*values, sets=sets, chart=chart, tmp_dir=tmp_dir)
    except HelmError as exc:
        return str(exc)
    raise AssertionError(f"helm template succeeded for {values} {list(sets)}, expected a failure")


def lint(*args: str) -> str:
    return _run(["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION, *args])


# ------------------------------------------------------------------------------------------- objects
def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objs:
        if o.get("kind") == kind and o["metadata"]["name"] == name:
            return o
    raise KeyError(f"{kind}/{name} not rendered (have: {sorted(o['kind'] + '/' + o['metadata']['name'] for o in objs)})")


WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "DaemonSet", "CronJob")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") in WORKLOAD_KINDS]


def view_deployments(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in by_kind(objs, "Deployment") if o["metadata"]["labels"].get("app.kubernetes.io/component") == "view"]


def configmap_data(objs: list[dict[str, Any]], name: str) -> dict[str, str]:
    return named(objs, "ConfigMap", name)["data"]


def chart_copy_with_platform(tmp_path: Path, platform: dict[str, Any]) -> Path:
    """A copy of the chart whose files/platform.yaml is ``platform`` (e.g. more view versions)."""
    dst = tmp_path / "chart"
    shutil.copytree(CHART, dst, symlinks=False, ignore=shutil.ignore_patterns("examples"))
    target = dst / "files" / "platform.yaml"
    target.unlink(missing_ok=True)
    target.write_text(yaml.safe_dump(platform, sort_keys=False))
    return dst


def platform() -> dict[str, Any]:
    return yaml.safe_load(PLATFORM.read_text())

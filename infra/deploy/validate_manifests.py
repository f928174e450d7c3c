#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests offline against JSON schemas.

* Core/apps/batch/networking/policy/rbac objects: the Kubernetes OpenAPI schemas bundled in the
  ``kubernetes-validate`` package (strict variant: unknown fields are errors), for every version given.
* Prometheus-operator objects (PodMonitor, ServiceMonitor, PrometheusRule): the ``openAPIV3Schema`` of the
  CRDs shipped in the prometheus-operator Go module (``example/prometheus-operator-crd``), made strict the
  same way (``additionalProperties: false`` unless the CRD preserves unknown fields). Without ``--crd-dir``
  those objects are reported as skipped.
* Manifests embedded in ConfigMaps (the chart's view-workload template, filled with sample values, and the
  bounded-replay Job the Kubernetes runner builds from it; the Spark executor pod template) are extracted and
  validated like the others (``--extract DIR`` also writes
  them out, e.g. for the policy check).

Usage:
    validate_manifests.py --k8s 1.29.0,1.37.0 [--crd-dir DIR] [--extract DIR] rendered.yaml...
Prints one line per file and a summary; exits 1 if any object is invalid.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

SAMPLE = {"__KAPPA_VIEW__": "sample_view", "__KAPPA_VIEW_SLUG__": "sample-view", "__KAPPA_VERSION__": "7",
          "__KAPPA_STARTING__": "earliest"}


#: CRD files (monitoring.coreos.com_<plural>.yaml) the chart can render objects of
CRD_KINDS = ("podmonitors", "servicemonitors", "prometheusrules")


@dataclass
class Report:
    objects: int = 0
    passed: int = 0
    crd_passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads a bare ``=`` (YAML 1.1 "value" tag, used in CRD enums) as a string."""


_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(path.read_text(encoding="utf-8"), Loader=_Loader) if isinstance(d, dict)]


def _fill(node: Any) -> Any:
    if isinstance(node, str):
        return re.sub(r"__KAPPA_[A-Z_]+?__", lambda m: SAMPLE.get(m.group(0), m.group(0)), node)
    if isinstance(node, dict):
        return {_fill(k): _fill(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v) for v in node]
    return node


def embedded(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Kubernetes objects carried as YAML inside ConfigMap data (view template, executor pod template)."""
    if doc.get("kind") != "ConfigMap":
        return
    for key, text in (doc.get("data") or {}).items():
        if not key.endswith(".yaml") or "apiVersion:" not in text or "kind:" not in text:
            continue
        try:
            inner = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(inner, dict) and "apiVersion" in inner and "kind" in inner:
            inner = _fill(inner)
            inner.setdefault("metadata", {}).setdefault("name", f"{doc['metadata']['name']}-{key.removesuffix('.yaml')}")
            yield f"{doc['metadata']['name']}[{key}]", inner
            if inner["kind"] == "Deployment" and "__KAPPA_VERSION__" in text:
                yield f"{doc['metadata']['name']}[{key}] as a bounded-replay Job", _bounded_job(doc["data"])


def _bounded_job(data: dict[str, str]) -> dict[str, Any]:
    """The Job the Kubernetes runner builds from the view template for a bounded replay (its own code)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from kappa.control.runners.kubernetes import KubernetesRunner

    runner = KubernetesRunner.from_configmap(data)
    return runner.job_manifest(SAMPLE["__KAPPA_VIEW__"], int(SAMPLE["__KAPPA_VERSION__"]), SAMPLE["__KAPPA_STARTING__"])


# ------------------------------------------------------------------------------------------- CRDs
def strict_openapi(node: Any) -> Any:
    """openAPIV3Schema -> JSON schema with additionalProperties: false on closed objects."""
    if isinstance(node, list):
        return [strict_openapi(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_openapi(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def load_crds(crd_dir: Path) -> dict[tuple[str, str], dict[str, Any]]:
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(crd_dir.glob("monitoring.coreos.com_*.yaml")):
        if path.stem.split("_", 1)[1] not in CRD_KINDS:
            continue
        for crd in load_docs(path):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for ver in crd["spec"]["versions"]:
                schema = strict_openapi(ver["schema"]["openAPIV3Schema"])
                # metadata is validated by the API server's ObjectMeta rules, not the CRD schema
                schema.setdefault("properties", {})["metadata"] = {"type": "object"}
                schemas[(f"{group}/{ver['name']}", kind)] = schema
    return schemas


# ------------------------------------------------------------------------------------------- main
def validate(docs: list[tuple[str, dict[str, Any]]], versions: list[str], crds: dict | None, report: Report) -> None:
    import kubernetes_validate as kv

    for origin, doc in docs:
        report.objects += 1
        kind, api = doc.get("kind", "?"), doc.get("apiVersion", "?")
        ident = f"{kind}/{doc.get('metadata', {}).get('name', '?')} ({origin})"
        if api.startswith("monitoring.coreos.com/"):
            if crds is None:
                report.skipped.append(f"{ident}: no CRD schemas given (--crd-dir)")
                continue
            schema = crds.get((api, kind))
            if schema is None:
                report.skipped.append(f"{ident}: no CRD schema for {api} {kind}")
                continue
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
            if errors:
                e = errors[0]
                report.failed.append(f"{ident} [CRD]: {'/'.join(map(str, e.path))}: {e.message}")
            else:
                report.passed += 1
                report.crd_passed += 1
            continue
        for version in versions:
            try:
                kv.validate(copy.deepcopy(doc), version, strict=True)
            except kv.SchemaNotFoundError:
                report.skipped.append(f"{ident}: no schema in Kubernetes {version}")
            except kv.ValidationError as e:
                report.failed.append(f"{ident} [k8s {version}]: {'/'.join(map(str, e.path))}: {e.message}")
            else:
                report.passed += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k8s", required=True, help="comma-separated Kubernetes versions, e.g. 1.29.0,1.37.0")
    ap.add_argument("--crd-dir", type=Path, help="directory of CustomResourceDefinition YAML files")
    ap.add_argument("--extract", type=Path, help="write embedded manifests here (one file per source file)")
    ap.add_argument("--json", type=Path, help="write the report as JSON")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    versions = [v.strip() for v in args.k8s.split(",") if v.strip()]
    crds = load_crds(args.crd_dir) if args.crd_dir else None
    total = Report()
    for path in args.files:
        report = Report()
        docs = [(path.name, d) for d in load_docs(path)]
        inner = [(f"{path.name}:{o}", d) for _, doc in docs for o, d in embedded(doc)]
        if args.extract and inner:
            args.extract.mkdir(parents=True, exist_ok=True)
            out = args.extract / f"{path.stem}.embedded.yaml"
            out.write_text(yaml.safe_dump_all([d for _, d in inner], sort_keys=False), encoding="utf-8")
        validate(docs + inner, versions, crds, report)
        print(f"  {path.name}: {report.objects} objects ({len(inner)} embedded), {report.passed} schema validations "
              f"passed, {len(report.failed)} failed, {len(report.skipped)} skipped")
        for line in report.failed:
            print(f"    FAIL {line}")
        total.objects += report.objects
        total.passed += report.passed
        total.crd_passed += report.crd_passed
        total.failed += report.failed
        total.skipped += report.skipped
    for line in sorted(set(total.skipped)):
        print(f"    skipped: {line}")
    print(f"schemas: {total.objects} objects, {total.passed} validations passed ({total.crd_passed} against CRD "
          f"schemas), {len(total.failed)} failed, "
          f"{len(total.skipped)} skipped (Kubernetes {', '.join(versions)}; CRDs {'from ' + str(args.crd_dir) if crds else 'not available'})")
    if args.json:
        args.json.write_text(json.dumps({"objects": total.objects, "passed": total.passed,
                                         "crd_passed": total.crd_passed, "failed": total.failed,
                                         "skipped": total.skipped}, indent=2), encoding="utf-8")
    return 1 if total.failed else 0


if __name__ == "__main__":
    sys.exit(main())

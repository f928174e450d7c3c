#!/usr/bin/env python3
"""Generate helm/kappa/values.schema.json from helm/kappa/values.yaml.

The structure and defaults come from values.yaml, every description from its ``## @param <path> <text>``
comment (a key without one is an error), and the constraints below (enums, patterns, free-form Kubernetes
structures). Every object gets ``additionalProperties: false`` (maps of user-chosen keys constrain their
values instead), so Helm rejects unknown keys and wrong types at lint/template/install time.

Usage:
    python infra/deploy/gen_values_schema.py           # write the schema
    python infra/deploy/gen_values_schema.py --check   # exit 1 if the committed schema is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
VALUES = ROOT / "helm" / "kappa" / "values.yaml"
SCHEMA = ROOT / "helm" / "kappa" / "values.schema.json"

QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
DURATION = r"^([0-9]+(ms|s|m|h|d|w|y))+$"
STARTING = r"^(earliest|latest|ts:[0-9]+|\{.+\})$"

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SCALAR_MAP = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}
RESOURCE_LIST = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        k: {"type": ["string", "number"], "pattern": QUANTITY, "description": f"{k} quantity"}
        for k in ("cpu", "memory", "ephemeral-storage")
    },
}
RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "required": ["requests", "limits"],
    "properties": {
        "requests": {**RESOURCE_LIST, "required": ["cpu", "memory"], "description": "Resource requests"},
        "limits": {**RESOURCE_LIST, "required": ["cpu", "memory"], "description": "Resource limits"},
    },
}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/definitions/{name}"}


def strict(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = required
    return out


STRINGS = {"type": "array", "items": {"type": "string"}}
#: the Kubernetes types that values may carry, strict (additionalProperties: false) down to the leaves
DEFINITIONS: dict[str, Any] = {
    "labelSelectorRequirement": strict(
        {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]}, "values": STRINGS},
        ["key", "operator"],
    ),
    "labelSelector": strict({
        "matchLabels": STRING_MAP,
        "matchExpressions": {"type": "array", "items": ref("labelSelectorRequirement")},
    }),
    "nodeSelectorRequirement": strict(
        {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]}, "values": STRINGS},
        ["key", "operator"],
    ),
    "nodeSelectorTerm": strict({
        "matchExpressions": {"type": "array", "items": ref("nodeSelectorRequirement")},
        "matchFields": {"type": "array", "items": ref("nodeSelectorRequirement")},
    }),
    "podAffinityTerm": strict(
        {
            "labelSelector": ref("labelSelector"),
            "namespaceSelector": ref("labelSelector"),
            "namespaces": STRINGS,
            "topologyKey": {"type": "string"},
            "matchLabelKeys": STRINGS,
            "mismatchLabelKeys": STRINGS,
        },
        ["topologyKey"],
    ),
    "podAffinity": strict({
        "requiredDuringSchedulingIgnoredDuringExecution": {"type": "array", "items": ref("podAffinityTerm")},
        "preferredDuringSchedulingIgnoredDuringExecution": {
            "type": "array",
            "items": strict({"weight": {"type": "integer", "minimum": 1, "maximum": 100},
                             "podAffinityTerm": ref("podAffinityTerm")}, ["weight", "podAffinityTerm"]),
        },
    }),
    "affinity": strict({
        "nodeAffinity": strict({
            "requiredDuringSchedulingIgnoredDuringExecution": strict(
                {"nodeSelectorTerms": {"type": "array", "items": ref("nodeSelectorTerm")}}, ["nodeSelectorTerms"]),
            "preferredDuringSchedulingIgnoredDuringExecution": {
                "type": "array",
                "items": strict({"weight": {"type": "integer", "minimum": 1, "maximum": 100},
                                 "preference": ref("nodeSelectorTerm")}, ["weight", "preference"]),
            },
        }),
        "podAffinity": ref("podAffinity"),
        "podAntiAffinity": ref("podAffinity"),
    }),
    "toleration": strict({
        "key": {"type": "string"},
        "operator": {"enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": {"type": "integer"},
    }),
    "keySelector": strict({"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}}, ["key"]),
    "envVar": strict(
        {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "string"},
            "valueFrom": strict({
                "secretKeyRef": ref("keySelector"),
                "configMapKeyRef": ref("keySelector"),
                "fieldRef": strict({"fieldPath": {"type": "string"}, "apiVersion": {"type": "string"}}, ["fieldPath"]),
                "resourceFieldRef": strict({"resource": {"type": "string"}, "containerName": {"type": "string"},
                                            "divisor": {"type": ["string", "number"]}}, ["resource"]),
            }),
        },
        ["name"],
    ),
    "networkPolicyPeer": strict({
        "podSelector": ref("labelSelector"),
        "namespaceSelector": ref("labelSelector"),
        "ipBlock": strict({"cidr": {"type": "string"}, "except": STRINGS}, ["cidr"]),
    }),
}


def _describe(node: Any, owner: str) -> None:
    """Give every property of the Kubernetes definitions a description (the field path in the API type)."""
    if isinstance(node, dict):
        for key, child in node.get("properties", {}).items():
            if isinstance(child, dict):
                child.setdefault("description", f"Kubernetes {owner}.{key}")
                _describe(child, f"{owner}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                _describe(node[key], owner)


for _name, _definition in DEFINITIONS.items():
    _definition.setdefault("description", f"Kubernetes {_name}")
    _describe(_definition, _name)

AFFINITY = {"type": "object", **ref("affinity")}
LABEL_SELECTOR = {"type": "object", **ref("labelSelector")}
ENV_LIST = {"type": "array", "items": ref("envVar")}
TOLERATIONS = {"type": "array", "items": ref("toleration")}
PEERS = {"type": "array", "items": ref("networkPolicyPeer")}
IMAGE_DIGEST = r"^$|^sha256:[a-f0-9]{64}$"
PULL_POLICY = ["Always", "IfNotPresent", "Never"]

#: JSON-schema fragments by values path ("*" matches one path segment).
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "commonLabels": STRING_MAP,
    "imagePullSecrets": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "*.image.digest": {"pattern": IMAGE_DIGEST},
    "*.image.pullPolicy": {"enum": PULL_POLICY},
    "*.*.image.digest": {"pattern": IMAGE_DIGEST},
    "*.*.image.pullPolicy": {"enum": PULL_POLICY},
    "image.digest": {"pattern": IMAGE_DIGEST},
    "image.pullPolicy": {"enum": PULL_POLICY},
    "image.repository": {"minLength": 1},
    "kafka.external.securityProtocol": {"enum": ["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]},
    "kafka.external.sasl.mechanism": {"enum": ["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]},
    "kafka.replicas": {"enum": [1, 3]},
    "kafka.clusterId": {"pattern": r"^$|^[A-Za-z0-9_-]{22}$"},
    "kafka.config": SCALAR_MAP,
    "kafka.topics.replicationFactor": {"minimum": 0, "maximum": 3},
    "lake.type": {"enum": ["pvc", "s3"]},
    "lake.persistence.accessMode": {"enum": ["ReadWriteOnce", "ReadWriteMany"]},
    "lake.persistence.mountPath": {"pattern": r"^/[^\s]*$"},
    "lake.s3.uri": {"pattern": r"^$|^s3a://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"},
    "views": {
        "type": "object",
        "propertyNames": {"pattern": r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"},
        "additionalProperties": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "versions": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 1},
                    "uniqueItems": True,
                    "description": "Versions of this view to run (each must be declared in kappa/platform.yaml)",
                },
                "starting": {"type": "string", "pattern": STARTING, "description": "Start position of a fresh checkpoint"},
            },
        },
    },
    "viewJobs.grouping": {"enum": ["perView", "grouped"]},
    "viewJobs.groupedResources": RESOURCES,
    "viewJobs.groupedDriverMemory": {"pattern": r"^[0-9]+[kmgt]?$"},
    "viewJobs.starting": {"pattern": STARTING},
    "viewJobs.spark.mode": {"enum": ["local", "kubernetes"]},
    "viewJobs.spark.localMaster": {"pattern": r"^local(\[([0-9]+|\*)\])?$"},
    "viewJobs.spark.extraConf": SCALAR_MAP,
    "viewJobs.spark.executor.memory": {"pattern": r"^[0-9]+[kmgt]?$"},
    "viewJobs.spark.executor.memoryOverhead": {"pattern": r"^[0-9]+[kmgt]?$"},
    "viewJobs.spark.executor.requestCores": {"type": ["string", "number"], "pattern": QUANTITY},
    "viewJobs.spark.executor.limitCores": {"type": ["string", "number"], "pattern": QUANTITY},
    "airflow.apiServer.service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "airflow.auth.adminUsername": {"pattern": r"^[A-Za-z0-9_.-]+$"},
    "monitoring.prometheusOperator": {"enum": ["auto", "enabled", "disabled"]},
    "monitoring.podMonitor.interval": {"pattern": DURATION},
    "monitoring.podMonitor.scrapeTimeout": {"pattern": DURATION},
    "monitoring.prometheusRule.thresholds.lagFor": {"pattern": DURATION},
    "monitoring.prometheusRule.thresholds.replayStalledFor": {"pattern": DURATION},
    "monitoring.prometheusRule.thresholds.quarantineRatio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "monitoring.grafanaDashboard.labels": STRING_MAP,
    "monitoring.grafanaDashboard.annotations": STRING_MAP,
    "monitoring.podMonitor.labels": STRING_MAP,
    "monitoring.prometheusRule.labels": STRING_MAP,
    "networkPolicy.metrics.namespaceSelector": LABEL_SELECTOR,
    "networkPolicy.metrics.podSelector": LABEL_SELECTOR,
    "networkPolicy.kafka.extraFrom": PEERS,
    "networkPolicy.airflow.apiServerFrom": PEERS,
    "producer.rate": {"type": "number", "exclusiveMinimum": 0},
    "sql.driverMemory": {"pattern": r"^[0-9]+[kmgt]?$"},
    "sql.cores": {"minimum": 1},
    "sql.jdbcPort": {"minimum": 1024, "maximum": 65535},
    "sql.connectPort": {"minimum": 1024, "maximum": 65535},
    "sql.poll": {"type": "number", "minimum": 0.5},
    "sql.startupProbeFailureThreshold": {"minimum": 1},
    "sql.auth.secretKey": {"pattern": r"^[-._a-zA-Z0-9]+$"},
    "sql.service.type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
    "sql.networkPolicy.from": PEERS,
    "sql.networkPolicy.lakeTo": PEERS,
}
#: by last path segment
BY_KEY: dict[str, dict[str, Any]] = {
    "resources": RESOURCES,
    "initResources": RESOURCES,
    "affinity": AFFINITY,
    "nodeSelector": STRING_MAP,
    "tolerations": TOLERATIONS,
    "podAnnotations": STRING_MAP,
    "annotations": STRING_MAP,
    "extraEnv": ENV_LIST,
    "size": {"type": "string", "pattern": QUANTITY},
    "tmpSizeLimit": {"type": "string", "pattern": QUANTITY},
    "storageClass": {"type": "string"},
    "metricsPort": {"minimum": 1024, "maximum": 65535},
    "driverPort": {"minimum": 1024, "maximum": 65535},
    "blockManagerPort": {"minimum": 1024, "maximum": 65535},
    "port": {"minimum": 1, "maximum": 65535},
    "replicas": {"minimum": 1},
    "backoffLimit": {"minimum": 0},
    "activeDeadlineSeconds": {"minimum": 60},
}
#: descriptions of objects that have no @param of their own
OBJECT_DOCS = {
    "": "Values of the kappa chart",
    "image": "Project view-job image (view drivers, Spark executors, topics Job)",
    "kafka": "Kafka: bundled KRaft brokers or an external cluster",
    "kafka.external": "External Kafka cluster",
    "kafka.external.sasl": "SASL credentials of the external cluster (from an existing Secret)",
    "kafka.external.tls": "TLS trust of the external cluster",
    "kafka.image": "Kafka image",
    "kafka.persistence": "Broker log-dir volumes",
    "kafka.topics": "Topics of kappa/platform.yaml",
    "kafka.topics.job": "The topics hook Job (`kappa topics ensure`)",
    "lake": "Where Delta tables, checkpoints and the view registry live",
    "lake.persistence": "PersistentVolumeClaim of the lake (lake.type=pvc)",
    "lake.s3": "S3 location and credentials of the lake (lake.type=s3)",
    "lake.check": "The lake check hook Job before each install/upgrade (`kappa lake check`, lake.type=s3)",
    "viewJobs": "Settings shared by every view-version driver",
    "viewJobs.serviceAccount": "ServiceAccount of the drivers (and Spark executors)",
    "viewJobs.rbac": "RBAC of the drivers",
    "viewJobs.spark": "Spark settings of the drivers",
    "viewJobs.spark.executor": "Spark executors (kubernetes mode)",
    "producer": "Demo producer of synthetic ad events (`kappa produce --live`)",
    "airflow": "Airflow 3 (LocalExecutor) driving replays and rollbacks",
    "airflow.image": "Project Airflow image",
    "airflow.auth": "Airflow authentication",
    "airflow.secrets": "Airflow secrets (Fernet key, API/JWT secrets, admin password)",
    "airflow.apiServer": "Airflow API server",
    "airflow.apiServer.service": "Service of the API server",
    "airflow.scheduler": "Airflow scheduler",
    "airflow.dagProcessor": "Airflow DAG processor",
    "airflow.triggerer": "Airflow triggerer",
    "airflow.migrations": "The `airflow db migrate` Job",
    "airflow.serviceAccount": "ServiceAccount of the Airflow pods",
    "airflow.rbac": "RBAC of the Kubernetes runner",
    "airflow.externalDatabase": "External Airflow metadata database",
    "airflow.postgresql": "Bundled PostgreSQL metadata database",
    "airflow.postgresql.image": "PostgreSQL image",
    "airflow.postgresql.persistence": "PostgreSQL data volume",
    "monitoring": "Prometheus-operator objects, alerts and the Grafana dashboard",
    "monitoring.podMonitor": "PodMonitor of the view drivers",
    "monitoring.prometheusRule": "Alert rules",
    "monitoring.prometheusRule.thresholds": "Alert thresholds",
    "monitoring.grafanaDashboard": "Grafana dashboard ConfigMap",
    "sql": "The analysts' SQL service (`kappa sql serve`: JDBC and Spark Connect over the serving views, read-only)",
    "sql.auth": "The service's token (a Secret)",
    "sql.service": "Service `<fullname>-sql`",
    "sql.serviceAccount": "ServiceAccount `<fullname>-sql`",
    "sql.networkPolicy": "Who may reach the service, and where it may connect",
    "networkPolicy": "NetworkPolicies",
    "networkPolicy.metrics": "Who may scrape metrics",
    "networkPolicy.kafka": "Extra access to the bundled brokers",
    "networkPolicy.airflow": "Extra access to the Airflow API server",
}


def param_docs(text: str) -> dict[str, str]:
    docs: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*## @param (\S+) (.+)$", line)
        if m:
            docs[m.group(1)] = m.group(2).strip()
    return docs


def constraint(path: str) -> dict[str, Any] | None:
    if path in CONSTRAINTS:
        return CONSTRAINTS[path]
    parts = path.split(".")
    for pattern, frag in CONSTRAINTS.items():
        pp = pattern.split(".")
        if "*" in pp and len(pp) == len(parts) and all(a in ("*", b) for a, b in zip(pp, parts)):
            return frag
    return BY_KEY.get(parts[-1])


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def build(value: Any, path: str, docs: dict[str, str], used: set[str]) -> dict[str, Any]:
    frag = constraint(path)
    doc = docs.get(path)
    if doc:
        used.add(path)
    if frag is not None and (frag.get("type") in ("object", "array") or "additionalProperties" in frag or "$ref" in frag):
        node = json.loads(json.dumps(frag))  # free-form structure with its own shape
        node.setdefault("type", json_type(value))
    elif isinstance(value, dict):
        node = {
            "type": "object",
            "additionalProperties": False,
            "properties": {k: build(v, f"{path}.{k}" if path else k, docs, used) for k, v in value.items()},
        }
    else:
        node = {"type": json_type(value)}
        node.update(json.loads(json.dumps(frag or {})))
    description = doc or OBJECT_DOCS.get(path)
    if description is None:
        raise SystemExit(f"values.yaml: key {path!r} has no `## @param {path} <description>` comment")
    node["description"] = description
    if not isinstance(value, dict) or path == "" or frag is not None:
        node["default"] = value
    if path == "":
        node.pop("default", None)
    return node


def generate() -> str:
    text = VALUES.read_text(encoding="utf-8")
    values = yaml.safe_load(text)
    docs = param_docs(text)
    used: set[str] = set()
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "kappa chart values", **build(values, "", docs, used),
              "definitions": DEFINITIONS}
    unused = sorted(set(docs) - used)
    if unused:
        raise SystemExit(f"values.yaml: @param for keys that do not exist: {', '.join(unused)}")
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed schema differs")
    args = ap.parse_args()
    out = generate()
    if args.check:
        if not SCHEMA.exists() or SCHEMA.read_text(encoding="utf-8") != out:
            print(f"{SCHEMA.relative_to(ROOT)} is stale: run python infra/deploy/gen_values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(out, encoding="utf-8")
    print(f"wrote {SCHEMA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

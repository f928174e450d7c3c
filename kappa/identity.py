"""A view version's identity: its name, its number, how it is written (``view@vN``), where it lives in the lake
and the Delta appId of one of its runs - defined once, here, for the job, the registry, serving, replays and
runners.

Nothing here imports Spark, Kafka or Delta: the control plane and the DAG files use it freely.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RUN_ID_PROPERTY", "VIEW_NAME", "ViewPaths", "app_id", "check_version_key", "in_lake", "new_run_id",
           "view_ref"]

#: What a view name may look like (lower_snake_case): it is a folder, a Spark/DuckDB view name and a label value.
VIEW_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def view_ref(name: str, version: int) -> str:
    """``name@vN``: how a view version is named in logs, metrics, messages and Delta appIds."""
    return f"{name}@v{version}"


def app_id(name: str, version: int, run_id: str) -> str:
    """The Delta appId of one run of a view version (``kappa:<view>@v<N>:<run id>``): the key of its idempotent
    commits (``txnAppId`` / ``txnVersion`` = the micro-batch id) and of its lineage in the commit metadata."""
    return f"kappa:{view_ref(name, version)}:{run_id}"


#: Delta table property holding the id of the run that writes a view version's table (its appId's last part).
RUN_ID_PROPERTY = "kappa.runId"


def registry_table(lake_uri: str, name: str) -> str:
    """URI of one of the control plane's tables in the lake (``<lake>/_registry/<name>``: versions, aliases,
    leases...); the retention leases' table (``lease_holds``) is also read by an archive's job."""
    return f"{lake_uri.rstrip('/')}/_registry/{name}"


def new_run_id() -> str:
    """A fresh run id (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def check_version_key(name: object, version: object) -> str | None:
    """Why ``(name, version)`` cannot name a view version (one line), or None when it can."""
    if not isinstance(name, str) or not VIEW_NAME.match(name):
        return f"invalid view name {name!r} (lower_snake_case)"
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"invalid version {version!r} of {name} (integer >= 1)"
    return None


@dataclass(frozen=True)
class ViewPaths:
    """Where a view version keeps its table and checkpoint, under the lake root."""

    lake: str
    name: str
    version: int

    @property
    def root(self) -> str:
        return f"{self.lake.rstrip('/')}/views/{self.name}/v{self.version}"

    @property
    def table(self) -> str:
        return f"{self.root}/table"

    @property
    def checkpoint(self) -> str:
        return f"{self.root}/checkpoint"

    @property
    def staging(self) -> str:
        """The run's bulk catch-up table (:class:`kappa.runtime.sink.DeltaSink`)."""
        return f"{self.root}/staging"

    @property
    def quarantine(self) -> str:
        return f"{self.lake.rstrip('/')}/quarantine"

    @property
    def is_local(self) -> bool:
        return "://" not in self.lake or self.lake.startswith("file:")

    def local(self, sub: str) -> Path:
        """Local filesystem path of a checkpoint file (the driver lock)."""
        return Path(self.checkpoint.removeprefix("file:")) / sub


def in_lake(table_path: str, lake: str, name: str, version: int) -> str:
    """A version's table as recorded (registry, serving alias) -> the same table under ``lake``.

    A record holds the path its writer saw: ``/data/lake/views/<view>/v<N>/table`` in a pod, a folder on the node
    for an analyst there. Every reader of the same local (mounted) lake mounts it its own way, so a recorded local
    table in the platform's layout is read as that version's table under the reader's lake root. Any other path is
    kept as recorded: a table registered outside the layout, or on another store (an ``s3a://`` record in a local
    lake is not this lake's table).
    """
    def local(uri: str) -> bool:
        return "://" not in uri or uri.startswith("file:")

    if local(table_path) and local(lake) and table_path.rstrip("/").endswith(f"/views/{name}/v{version}/table"):
        return ViewPaths(lake, name, version).table
    return table_path

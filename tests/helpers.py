"""Test helpers that read results without going through the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["committed_batches", "delta_txns", "read_table"]


def read_table(spark: Any, path: str) -> list[Any]:
    """All rows of a Delta table (Spark's reader; the writer path is what is under test)."""
    return spark.read.format("delta").load(path).collect()


def delta_txns(table: str) -> dict[str, int]:
    """appId -> highest txnVersion recorded in the table's _delta_log JSON commits (plain file reading)."""
    out: dict[str, int] = {}
    for commit in sorted(Path(table, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                app, version = action["txn"]["appId"], int(action["txn"]["version"])
                out[app] = max(out.get(app, -1), version)
    return out


def committed_batches(checkpoint: str) -> list[int]:
    """Batch ids committed in a Spark checkpoint (its commits/ folder)."""
    folder = Path(checkpoint, "commits")
    return sorted(int(p.name) for p in folder.glob("[0-9]*")) if folder.exists() else []

"""Which slice of the log each Delta commit of a view holds.

Spark's checkpoint records every micro-batch's end offsets and the event-time watermark it ran with
(``<checkpoint>/offsets/<batch id>``), but it purges all but the last ``spark.sql.streaming.minBatchesToRetain``
(100) entries. A strict check of an event-time view needs *every* batch boundary since the version started
(late rows are dropped by the previous batch's watermark), so the job copies each batch's entry into the Delta
commit that applies it, as the commit's ``userMetadata``::

    {"kappa": {"app_id": "kappa:<view>@v<N>:<run>", "batch": 7, "topic": "ad-events",
               "end_offsets": {"0": 1200, "1": 1180}, "watermark_ms": 1700000123000,
               "lookups": {"campaigns": {"0": 1000}}}}

``lookups`` holds the end offsets each lookup topic had when the cached lookup the batch joined against was read
(:mod:`kappa.runtime.lookups`); absent for views without lookups.

The boundary and the data it describes land in one atomic commit, and they stay as long as the table's history
does (``delta.logRetentionDuration``, 30 days by default) - also the answer to "which offsets does Delta version
N contain" for anyone auditing a view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")

__all__ = ["BatchBoundary", "batch_metadata", "batches_from_history", "expectations_from_history", "parse_offset_log",
           "with_expectations"]


@dataclass(frozen=True)
class BatchBoundary:
    """One micro-batch of a streaming job, as its checkpoint recorded it.

    Attributes:
        batch_id: Micro-batch id.
        end_offsets: Partition -> first offset *not* in the batch (Spark's ``offsets/<batch>`` entry).
        watermark_ms: Event-time watermark the batch ran with (``batchWatermarkMs``).
        lookups: Lookup name -> end offsets of its topic when the lookup the batch joined was read (from the
            Delta commit's lineage; empty when not recorded, e.g. a boundary read from the checkpoint).
    """

    batch_id: int
    end_offsets: Mapping[int, int]
    watermark_ms: int = 0
    lookups: Mapping[str, Mapping[int, int]] = field(default_factory=dict, compare=False)



def parse_offset_log(text: str, topic: str) -> tuple[dict[int, int], int]:
    """Parse a Spark ``offsets/<batch>`` entry: (end offsets of ``topic``, ``batchWatermarkMs``)."""
    lines = text.splitlines()
    watermark = 0
    if len(lines) > 1:
        try:
            watermark = int(json.loads(lines[1]).get("batchWatermarkMs", 0) or 0)
        except (ValueError, AttributeError):
            watermark = 0
    for line in lines[2:]:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and topic in data:
            return {int(p): int(o) for p, o in data[topic].items()}, watermark
    return {}, watermark


def batch_metadata(*, app_id: str, batch_id: int, topic: str, end_offsets: Mapping[int, int],
                   watermark_ms: int, lookups: Mapping[str, Mapping[int, int]] | None = None) -> str:
    """The ``userMetadata`` of the Delta commit applying ``batch_id`` (compact JSON)."""
    meta: dict[str, Any] = {
        "app_id": app_id, "batch": int(batch_id), "topic": topic,
        "end_offsets": {str(p): int(o) for p, o in sorted(end_offsets.items())}, "watermark_ms": int(watermark_ms),
    }
    if lookups:
        meta["lookups"] = {name: {str(p): int(o) for p, o in sorted(offsets.items())}
                           for name, offsets in sorted(lookups.items())}
    return json.dumps({"kappa": meta}, separators=(",", ":"), sort_keys=True)


def with_expectations(user_metadata: str | None, rows: int, violations: Mapping[str, int]) -> str | None:
    """``user_metadata`` plus the batch's expectation counts (``"expectations": {"rows": n, "violations": {...}}``):
    they commit atomically with the batch, so a run's totals are exact across restarts and re-runs."""
    if user_metadata is None:
        return None
    data = json.loads(user_metadata)
    data["kappa"]["expectations"] = {"rows": int(rows), "violations": {k: int(v) for k, v in sorted(violations.items())}}
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def _run_batches(history: Iterable[Mapping[str, Any]], app_id: str, upto: int | None,
                 parse: Callable[[Mapping[str, Any]], T]) -> dict[int, T]:
    """``parse(meta)`` of each batch of ``app_id`` (id <= ``upto``) recorded in a commit history, by batch id.

    A batch Spark re-ran after a crash was skipped by Delta (same appId/txnVersion), so each id appears once;
    should it appear twice (the view's and the staging table's history), the entries are identical and one is
    kept. Commits without our metadata, or whose metadata ``parse`` cannot read, are skipped.
    """
    found: dict[int, T] = {}
    for commit in history:
        text = commit.get("userMetadata")
        if not text or '"kappa"' not in text:
            continue
        try:
            meta = json.loads(text)["kappa"]
            if meta.get("app_id") != app_id:
                continue
            batch = int(meta["batch"])
            if upto is None or batch <= upto:
                found[batch] = parse(meta)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return found


def expectations_from_history(history: Iterable[Mapping[str, Any]], app_id: str, *,
                              upto: int | None = None) -> tuple[int, dict[str, int]]:
    """(rows checked, violations per expectation) over the batches of ``app_id`` recorded in a Delta table's
    commit history (each batch once, like :func:`batches_from_history`)."""
    def parse(meta: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
        counts = meta["expectations"]
        return int(counts["rows"]), {str(k): int(v) for k, v in counts["violations"].items()}

    rows, violations = 0, {}
    for n, per in _run_batches(history, app_id, upto, parse).values():
        rows += n
        for name, v in per.items():
            violations[name] = violations.get(name, 0) + v
    return rows, violations


def batches_from_history(history: Iterable[Mapping[str, Any]], app_id: str, *,
                         upto: int | None = None) -> list[BatchBoundary]:
    """Batch boundaries of ``app_id`` recorded in a Delta table's commit history, oldest batch first.

    Args:
        history: Commit infos (``deltalake.DeltaTable.history()``), in any order.
        app_id: Only commits of this run.
        upto: Only batches with an id <= this.
    """
    def parse(meta: Mapping[str, Any]) -> BatchBoundary:
        return BatchBoundary(
            batch_id=int(meta["batch"]), end_offsets={int(p): int(o) for p, o in meta["end_offsets"].items()},
            watermark_ms=int(meta.get("watermark_ms") or 0),
            lookups={str(name): {int(p): int(o) for p, o in ends.items()}
                     for name, ends in (meta.get("lookups") or {}).items()})

    found = _run_batches(history, app_id, upto, parse)
    return [found[b] for b in sorted(found)]

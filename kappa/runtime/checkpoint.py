"""Reading a view version's checkpoint, wherever the lake is: what its run committed and how far it got.

A view version's checkpoint folder (``<lake>/views/<view>/v<N>/checkpoint``) holds Spark's query checkpoint
(``main/offsets/<batch>``, ``main/commits/<batch>``) and the run's ``run.json`` (run id, start offsets and the
target the run first had to reach, written by :mod:`kappa.runtime.job`). Files are read from a local path or any fsspec
URL (object stores), never through Spark, so the control plane (replay, ``make run``'s wait, ``kappa status``)
can ask without a JVM.

Progress of a run is defined once, here (:func:`run_progress`), and every place that shows it - the job's
``kappa_replay_progress_ratio``, the CLI's bar, the Airflow sensor's log, ``kappa status`` - uses it: the share
of the records between the run's start offsets and its *target* (the log end when the run started, or the
offsets at a bounded run's end timestamp) that the last committed micro-batch has passed. The target is fixed
per run, so the ratio only grows; what the live log added since is the lag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kappa.runtime.deltars import is_local_uri, local_path
from kappa.errors import KappaError, one_line
from kappa.runtime.lineage import parse_offset_log
from kappa.runtime.lineage import BatchBoundary

__all__ = ["CheckpointError", "RunProgress", "batch_ids", "checkpoint_batches", "last_commit", "list_names",
           "offsets_of", "pending_watermark", "read_text", "run_info", "run_progress"]


class CheckpointError(KappaError, ValueError):
    """A checkpoint file cannot be read (one line)."""


def _fsspec(uri: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with Airflow
        raise CheckpointError(f"reading {uri} needs fsspec and the filesystem's driver (e.g. s3fs)") from None
    try:
        fs, path = fsspec.core.url_to_fs(re.sub(r"^s3a://", "s3://", uri))
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"cannot read {uri}: {one_line(exc)}") from None
    return fs, path


def read_text(uri: str) -> str | None:
    """Text of a file in the lake (local path or any fsspec URL); None if it does not exist."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        return path.read_text() if path.is_file() else None
    fs, path = _fsspec(uri)
    return fs.cat_file(path).decode() if fs.exists(path) else None


def list_names(uri: str) -> list[str]:
    """Names in a lake directory (empty if it does not exist)."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    fs, path = _fsspec(uri)
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)) if fs.exists(path) else []


def batch_ids(folder: str) -> list[int]:
    """Micro-batch ids recorded in a checkpoint's ``offsets`` or ``commits`` folder, ascending."""
    return sorted(int(name) for name in list_names(folder) if name.isdigit())


def checkpoint_batches(checkpoint: str, topic: str, *, upto: int | None = None) -> list[BatchBoundary]:
    """Micro-batches recorded in a query checkpoint (``<checkpoint>/offsets``), oldest first.

    Args:
        checkpoint: The query's checkpoint folder (``<view checkpoint>/main``).
        topic: Source topic whose offsets are read.
        upto: Only batches with an id <= this.

    Returns:
        A :class:`kappa.verify.oracle.BatchBoundary` per batch (end offsets, watermark). Spark only keeps the last
        ``spark.sql.streaming.minBatchesToRetain`` (100) entries; callers needing all of them check ids.
    """
    out = []
    for batch in batch_ids(f"{checkpoint}/offsets"):
        if upto is not None and batch > upto:
            continue
        text = read_text(f"{checkpoint}/offsets/{batch}")
        if text is None:
            continue
        offsets, watermark = parse_offset_log(text, topic)
        out.append(BatchBoundary(batch_id=batch, end_offsets=offsets, watermark_ms=watermark))
    return out


def last_commit(checkpoint: str, topic: str) -> tuple[dict[int, int], int | None]:
    """End offsets of ``topic`` in the last *committed* micro-batch of a query checkpoint, and its id
    (``({}, None)`` before the first commit)."""
    committed = batch_ids(f"{checkpoint}/commits")
    if not committed:
        return {}, None
    batch = committed[-1]
    text = read_text(f"{checkpoint}/offsets/{batch}")
    return (parse_offset_log(text, topic)[0] if text else {}), batch


def pending_watermark(checkpoint: str) -> tuple[int, int] | None:
    """``(watermark the last committed batch ran with, watermark it set for the next one)`` when the next is
    later, else None (no commit yet, no watermark, or nothing pending).

    Spark records both in the checkpoint (``offsets/<N>``: ``batchWatermarkMs``; ``commits/<N>``:
    ``nextBatchWatermarkMs``). When the next is later, a stateful query still owes a batch - a no-data batch
    if no record arrives - that emits the windows the new watermark closes and evicts their state: until it
    ran, the table does not hold everything the records read so far make final.
    """
    committed = batch_ids(f"{checkpoint}/commits")
    if not committed:
        return None
    batch = committed[-1]
    commit, offsets = read_text(f"{checkpoint}/commits/{batch}"), read_text(f"{checkpoint}/offsets/{batch}")
    if not commit or not offsets:
        return None
    try:
        nxt = int(json.loads(commit.splitlines()[1]).get("nextBatchWatermarkMs", 0) or 0)
    except (IndexError, ValueError):
        return None
    current = parse_offset_log(offsets, "")[1]
    return (current, nxt) if nxt > current else None


def run_info(view_checkpoint: str) -> dict[str, Any]:
    """The run's ``run.json`` in a view version's checkpoint folder ({} if none or unreadable)."""
    text = read_text(f"{view_checkpoint}/run.json")
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def offsets_of(mapping: Mapping[str, Any] | None) -> dict[int, int]:
    """``{"0": 12}`` (JSON keys) as ``{0: 12}``."""
    return {int(p): int(o) for p, o in (mapping or {}).items()}


@dataclass(frozen=True, slots=True)
class RunProgress:
    """How far a run got toward its target (see the module docstring).

    Attributes:
        done: Records between the start offsets and the processed offsets, counted up to the target.
        total: Records between the start offsets and the target.
        ratio: ``done / total`` (1.0 when there is nothing to do); never goes down for one run.
    """

    done: int
    total: int
    ratio: float


def run_progress(start: Mapping[int, int], target: Mapping[int, int], processed: Mapping[int, int]) -> RunProgress:
    """Progress of a run from its start offsets, its fixed target and the offsets its last commit reached.

    A partition missing from ``start`` starts at 0; one missing from ``processed`` has processed nothing.

    Example:
        >>> run_progress({0: 0, 1: 10}, {0: 100, 1: 30}, {0: 50, 1: 40})
        RunProgress(done=70, total=120, ratio=0.5833333333333334)
    """
    done = total = 0
    for p, end in target.items():
        begin = start.get(p, 0)
        total += max(0, end - begin)
        done += max(0, min(processed.get(p, begin), end) - begin)
    return RunProgress(done=done, total=total, ratio=1.0 if total == 0 else done / total)

"""Reading a view version's checkpoint, wherever the lake is: what its run committed and how far it got.

A view version's checkpoint folder (``<lake>/views/<view>/v<N>/checkpoint``) holds Spark's query checkpoint
(``main/offsets/<batch>``, ``main/commits/<batch>``) and the run's ``run.json`` (run id, start offsets and the
target the run first had to reach). Files are read from a local path or an object store (obstore), never
through Spark, so the control plane (replay, ``make run``'s wait, ``kappa status``) can ask without a JVM.

**The run** of a view version is resolved here for everyone - the job that writes the table and the control plane
that registers it (:func:`open_run`, :func:`current_run_id`): the run id lives in ``run.json`` and, once the job
created the table, in the table's ``kappa.runId`` property (:data:`kappa.identity.RUN_ID_PROPERTY`); the two
must agree, and a table holding data of a run whose checkpoint is gone is never written again.

Progress of a run is defined once, here (:func:`run_progress`), and every place that shows it - the job's
``kappa_replay_progress_ratio``, the CLI's bar, the Airflow sensor's log, ``kappa status`` - uses it: the share
of the records between the run's start offsets and its *target* (the log end when the run started, or the
offsets at a bounded run's end timestamp) that the last committed micro-batch has passed. The target is fixed
per run, so the ratio only grows; what the live log added since is the lag.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kappa.errors import KappaError, one_line
from kappa.identity import RUN_ID_PROPERTY, ViewPaths, new_run_id, view_ref
from kappa.runtime.deltars import is_local_uri, local_path, rs_uri
from kappa.runtime.lineage import parse_offset_log
from kappa.runtime.lineage import BatchBoundary

__all__ = ["LAKE_FILES", "CheckpointError", "LakeError", "LakeFiles", "RunMismatch", "RunProgress", "batch_ids",
           "check_lake", "checkpoint_batches", "current_run_id", "delete_tree", "lake_endpoint", "last_commit",
           "last_progress", "list_names",
           "modified_at", "offsets_of", "open_run", "pending_watermark", "read_text", "run_info", "run_progress",
           "save_run_info", "table_run_id", "tree_exists", "write_text"]


class CheckpointError(KappaError, ValueError):
    """A checkpoint file cannot be read (one line)."""


class RunMismatch(KappaError, RuntimeError):
    """The Delta table was written by another run of this version than the checkpoint's."""


@functools.lru_cache(maxsize=32)
def _store(root: str) -> Any:
    from obstore.store import from_url  # the object_store crate delta-rs uses; reads the same AWS_* environment

    return from_url(root)


def _object(uri: str) -> tuple[Any, str]:
    """(store, key) of a lake URI on an object store (``s3a://bucket/key`` is ``s3://`` there)."""
    scheme, _, rest = re.sub(r"^s3a://", "s3://", uri).partition("://")
    bucket, _, key = rest.partition("/")
    try:
        return _store(f"{scheme}://{bucket}"), key.strip("/")
    except Exception as exc:  # noqa: BLE001 - obstore's configuration errors: an unknown scheme, a bad option
        raise CheckpointError(f"cannot open {uri}: {one_line(exc)}") from None


class LakeError(KappaError, RuntimeError):
    """The lake's object store cannot be used as configured: which setting is wrong, in one line."""


#: S3 error codes -> what they say about the configuration ({bucket}, {key}, {endpoint}).
_S3_CODES = {
    "NoSuchBucket": "bucket {bucket} does not exist at {endpoint} (KAPPA_LAKE_URI)",
    "InvalidAccessKeyId": "the object store at {endpoint} does not know the access key {key} (AWS_ACCESS_KEY_ID)",
    "SignatureDoesNotMatch": "the object store at {endpoint} refused the secret key given for {key} "
                             "(AWS_SECRET_ACCESS_KEY)",
    "AccessDenied": "the object store at {endpoint} denies {key} access to bucket {bucket} (its policy, or "
                    "the credential)",
    "InvalidBucketName": "{bucket} is not a valid bucket name (KAPPA_LAKE_URI)",
}


def lake_endpoint(env: Mapping[str, str] | None = None) -> str:
    """The object store the environment names (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``), or ``AWS S3``."""
    from kappa.config import aws_endpoint

    return aws_endpoint(env) or "AWS S3"


def check_lake(lake_uri: str) -> None:
    """Whether the lake's object store answers, with this bucket and the credential of the environment (the
    standard ``AWS_*`` variables): ONE listing of the lake's prefix (two retries), before anything is created. A
    local lake is not checked.

    Raises:
        LakeError: one line naming what is wrong - the endpoint (unreachable), the bucket, or the credential.
    """
    if is_local_uri(lake_uri):
        return
    import os
    from datetime import timedelta

    import obstore
    from obstore.store import from_url

    env = os.environ
    endpoint = lake_endpoint(env)
    scheme, _, rest = re.sub(r"^s3a://", "s3://", lake_uri).partition("://")
    bucket, _, key = rest.partition("/")
    access = env.get("AWS_ACCESS_KEY_ID") or "(from the AWS default chain)"
    try:
        store = from_url(f"{scheme}://{bucket}",
                         retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=10)})
        obstore.list_with_delimiter(store, f"{key.strip('/')}/" if key.strip("/") else None)
    except Exception as exc:  # noqa: BLE001 - obstore's errors carry the S3 error code in their text
        text = str(exc)
        code = re.search(r"<Code>(\w+)</Code>", text)
        if code and code.group(1) in _S3_CODES:
            raise LakeError(_S3_CODES[code.group(1)].format(bucket=bucket, key=access, endpoint=endpoint)) from None
        if "169.254.169.254" in text:  # no credential in the environment: the SDK chain fell through to the IMDS
            raise LakeError(f"no credential for the lake's object store at {endpoint}: set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (or a profile, or a role: IRSA, an instance role)") from None
        if "builder error" in text and endpoint.startswith("http://") and env.get("AWS_ALLOW_HTTP") != "true":
            raise LakeError(f"the lake's object store at {endpoint} is plain HTTP, which delta-rs and obstore "
                            "refuse unless AWS_ALLOW_HTTP=true") from None
        if "error sending request" in text or "Connection refused" in text or "dns error" in text:
            raise LakeError(f"the lake's object store at {endpoint} is not reachable (AWS_ENDPOINT_URL): no "
                            "answer to a listing") from None
        raise LakeError(f"the lake {lake_uri} cannot be listed at {endpoint}: "
                        f"{code.group(1) if code else one_line(exc)[:300]}") from None


def read_text(uri: str) -> str | None:
    """Text of a file in the lake (a local path or an object store URL); None if it does not exist."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        return path.read_text() if path.is_file() else None
    import obstore

    store, key = _object(uri)
    try:
        return bytes(obstore.get(store, key).bytes()).decode()
    except FileNotFoundError:
        return None


def write_text(uri: str, text: str) -> None:
    """Replace a file in the lake atomically (local: a temporary file renamed over it; object stores: one PUT)."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # own name: concurrent writers never clash
        tmp.write_text(text)
        tmp.replace(path)
        return
    import obstore

    store, key = _object(uri)
    obstore.put(store, key, text.encode())


def modified_at(uri: str) -> float | None:
    """Modification time (epoch seconds) of a file in the lake; None if it does not exist."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        return path.stat().st_mtime if path.exists() else None
    import obstore

    store, key = _object(uri)
    try:
        return float(obstore.head(store, key)["last_modified"].timestamp())
    except FileNotFoundError:
        return None


def last_progress(view_checkpoint: str) -> float | None:
    """When a view version's run last showed life (epoch seconds): its last committed micro-batch, else the
    creation of its ``run.json``; None before either."""
    committed = batch_ids(f"{view_checkpoint}/main/commits")
    if committed:
        return modified_at(f"{view_checkpoint}/main/commits/{committed[-1]}")
    return modified_at(f"{view_checkpoint}/run.json")


class LakeFiles:
    """Reading and writing small lake files: local paths directly, other URIs through obstore (the control
    plane's way; a view job on an object store uses its Spark session's instead,
    :class:`kappa.runtime.spark.HadoopFiles`)."""

    read = staticmethod(read_text)
    write = staticmethod(write_text)


#: The default :class:`LakeFiles`.
LAKE_FILES = LakeFiles()


def list_names(uri: str) -> list[str]:
    """Names in a lake directory (empty if it does not exist)."""
    if is_local_uri(uri):
        path = Path(local_path(uri))
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    import obstore

    store, key = _object(uri)
    listed = obstore.list_with_delimiter(store, f"{key}/" if key else None)
    paths = [*listed["common_prefixes"], *(o["path"] for o in listed["objects"])]
    return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in paths})


def tree_exists(uri: str) -> bool:
    """Whether a lake directory holds anything (a local directory, or any object under the prefix)."""
    if is_local_uri(uri):
        return Path(local_path(uri)).exists()
    import obstore

    store, key = _object(uri)
    for batch in obstore.list(store, f"{key}/", chunk_size=1):
        return bool(batch)
    return False


def delete_tree(uri: str) -> None:
    """Remove a lake directory and everything under it (object stores: every object under the prefix)."""
    if is_local_uri(uri):
        shutil.rmtree(local_path(uri), ignore_errors=True)
        return
    import obstore

    store, key = _object(uri)
    for batch in obstore.list(store, f"{key}/", chunk_size=500):
        obstore.delete(store, [o["path"] for o in batch])


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


def run_info(view_checkpoint: str, *, files: Any = LAKE_FILES) -> dict[str, Any]:
    """The run's ``run.json`` in a view version's checkpoint folder ({} if none or unreadable)."""
    text = files.read(f"{view_checkpoint}/run.json")
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def save_run_info(view_checkpoint: str, info: Mapping[str, Any], *, files: Any = LAKE_FILES) -> None:
    """Write the run's ``run.json`` in a view version's checkpoint folder (atomically, local or object store;
    ``files`` is a :class:`LakeFiles` - a view job passes :class:`kappa.runtime.spark.HadoopFiles`)."""
    files.write(f"{view_checkpoint}/run.json", json.dumps(dict(info), indent=2))


def table_run_id(table: str) -> str | None:
    """The run id stamped on a view version's Delta table (``kappa.runId``); None if there is no table yet."""
    from deltalake import DeltaTable

    uri = rs_uri(table)
    if not DeltaTable.is_deltatable(uri):
        return None
    return DeltaTable(uri).metadata().configuration.get(RUN_ID_PROPERTY) or None


def current_run_id(paths: ViewPaths) -> str | None:
    """The run id of a view version's current run: its table's, else its checkpoint's; None before any run."""
    return table_run_id(paths.table) or run_info(paths.checkpoint).get("run_id") or None


def open_run(paths: ViewPaths, *, run_id: str | None = None, files: Any = LAKE_FILES,
             **fields: Any) -> dict[str, Any]:
    """The run a view version's job writes with: its ``run.json``, created when there is none.

    An existing ``run.json`` is the run (its id must match the table's ``kappa.runId``). Without one, a new run
    is recorded: the table's run id when its table exists but holds no data yet, else ``run_id`` or a fresh id,
    with ``fields`` (e.g. ``starting``, ``created_by``). ``files`` reaches the checkpoint (:class:`LakeFiles`:
    local files or obstore by default).

    Raises:
        RunMismatch: The checkpoint's run is not the table's, or the table holds data of a run whose
            checkpoint is gone (writing into it again would duplicate rows).
    """
    from deltalake import DeltaTable

    ref = view_ref(paths.name, paths.version)
    info = run_info(paths.checkpoint, files=files)
    table_run = table_run_id(paths.table)
    if info:
        if table_run is not None and table_run != info.get("run_id"):
            raise RunMismatch(f"{ref}: checkpoint run {info.get('run_id')} does not match the table's run "
                              f"{table_run}; refusing to mix two runs in one table")
        return info
    if table_run is not None and DeltaTable(rs_uri(paths.table)).version() > 0:
        raise RunMismatch(f"{ref}: table {paths.table} already holds data of run {table_run} but its checkpoint "
                          "is gone; replaying into it would duplicate rows - start a new version instead")
    info = {"run_id": table_run or run_id or new_run_id(), "view": paths.name, "version": paths.version,
            "created": time.time(), **fields}
    save_run_info(paths.checkpoint, info, files=files)
    return info


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

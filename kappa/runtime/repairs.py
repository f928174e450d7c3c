"""A repair's swap: the one MERGE that replaces a range of windows in a serving table, and how it is committed by
exactly one Spark writer on an object-store lake.

``kappa repair`` (:mod:`kappa.control.replay.repair`) recomputes, stages and verifies a range; the swap itself is
:func:`swap`. Where it runs depends on the lake:

* **local disk**: the repair's own driver commits it, beside the live job. Delta's local log store makes the
  commit file appear atomically (rename), so two drivers never both write version N; a conflict with the live
  job's commit is retried (:func:`swap`).
* **object store**: delta-spark's S3 log store excludes concurrent commits only inside ONE driver JVM, so the
  repair's driver never commits to the serving table. It *hands the swap to the live job*: a request object
  ``<version>/repair-requests/<id>.json``; the serving version's driver (:class:`RepairInbox`, a thread of
  :class:`kappa.runtime.job.ViewJob`) applies it in its own JVM, between its own micro-batch commits (the batch
  handler's commit lock), writes ``<version>/repair-results/<id>.json`` and removes the request. With the job
  stopped the request waits for its next start. One Spark writer per serving table, by construction::

      kappa repair ─ stage <version>/repairs/<id> ─ verify ─ PUT repair-requests/<id>.json ─ wait for result
      live job ── batch commit ── [inbox: MERGE staged range, txn (kappa-repair-<id>, 0)] ── batch commit
                                   └─ PUT repair-results/<id>.json, DELETE the request

The MERGE is an idempotent Delta transaction (``txnAppId`` ``kappa-repair-<id>``, ``txnVersion`` 0): a driver
that dies between the commit and the result object applies the request again at its next start, and Delta skips
it; the result then names the commit that holds it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kappa.errors import KappaError, one_line

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

__all__ = ["RepairInbox", "SwapError", "SwapRequest", "WINDOW_START", "request_uri", "result_uri", "swap"]

log = logging.getLogger("kappa.runtime.repairs")

#: The key column a repairable view's windows start at.
WINDOW_START = "window_start"

REQUESTS = "repair-requests"
RESULTS = "repair-results"


class SwapError(KappaError, RuntimeError):
    """A swap could not be committed (one line)."""


@dataclass(frozen=True)
class SwapRequest:
    """What the serving version's driver needs to commit a repair's swap.

    Attributes:
        id: The repair's id (its staging table is ``<version>/repairs/<id>``).
        staging: The staged windows (a Delta table).
        keys: The view's key columns (the MERGE's join).
        start_ms, end_ms: The range: windows starting in ``[start_ms, end_ms)``.
        meta: The commit's ``userMetadata`` (``{"kappa": {"repair": ...}}``).
        by: Who asked.
        requested_at: Epoch seconds.
    """

    id: str
    staging: str
    keys: tuple[str, ...]
    start_ms: int
    end_ms: int
    meta: str
    by: str
    requested_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SwapRequest":
        raw = json.loads(text)
        return cls(**{**raw, "keys": tuple(raw["keys"])})


def request_uri(version_root: str, repair_id: str) -> str:
    return f"{version_root.rstrip('/')}/{REQUESTS}/{repair_id}.json"


def result_uri(version_root: str, repair_id: str) -> str:
    return f"{version_root.rstrip('/')}/{RESULTS}/{repair_id}.json"


def _txn_app(repair_id: str) -> str:
    return f"kappa-repair-{repair_id}"


def swap(spark: "SparkSession", table: str, request: SwapRequest, *, applied_by: str | None = None) -> int:
    """Commit the staged range into ``table`` in ONE idempotent MERGE: update the matched windows, insert the new,
    delete the range's windows the recompute no longer has. Returns the Delta version holding it (the earlier one
    when this repair was already committed). A concurrent commit that conflicts (a live job beside a local-disk
    repair) is retried.

    Raises:
        SwapError: the MERGE failed for another reason, or kept conflicting.
    """
    from delta.tables import DeltaTable

    from kappa.runtime.sink import _idempotent_dml

    meta = request.meta
    if applied_by:
        body = json.loads(meta)
        body["kappa"]["repair"]["applied_by"] = applied_by
        meta = json.dumps(body)
    session = spark.newSession()  # its own SQL conf: the txn settings never reach another query of this JVM
    staged = session.read.format("delta").load(request.staging)
    on = " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in request.keys)
    gone = (f"t.`{WINDOW_START}` >= timestamp_millis({int(request.start_ms)}) AND "
            f"t.`{WINDOW_START}` < timestamp_millis({int(request.end_ms)})")
    for attempt in range(5):
        try:
            with _idempotent_dml(session, _txn_app(request.id), 0, meta):
                (DeltaTable.forPath(session, table).alias("t").merge(staged.alias("s"), on)
                 .whenMatchedUpdateAll().whenNotMatchedInsertAll().whenNotMatchedBySourceDelete(condition=gone)
                 .execute())
            break
        except Exception as exc:  # noqa: BLE001 - only Delta's concurrent-commit conflicts are retried
            if "Concurrent" not in type(exc).__name__ + str(exc)[:300] or attempt == 4:
                raise SwapError(f"repair swap into {table} failed: {one_line(exc)}") from None
            time.sleep(1 + attempt)
    version = committed_version(session, table, request.id)
    if version is None:  # pragma: no cover - Delta either committed it or had it already
        raise SwapError(f"repair {request.id}: its commit is not in {table}'s history")
    return version


def committed_version(spark: "SparkSession", table: str, repair_id: str, *, depth: int = 200) -> int | None:
    """The Delta version of ``table`` whose commit holds repair ``repair_id`` (its ``userMetadata``), or None."""
    from delta.tables import DeltaTable

    for row in DeltaTable.forPath(spark, table).history(depth).select("version", "userMetadata").collect():
        try:
            repair = json.loads(row["userMetadata"] or "{}").get("kappa", {}).get("repair", {})
        except ValueError:
            continue
        if repair.get("id") == repair_id:
            return int(row["version"])
    return None


class RepairInbox:
    """The serving version's side of a handed-off repair: polls ``<version>/repair-requests/`` and commits each
    request's swap in this driver's JVM while holding ``commit_lock`` (the batch handler holds it around its own
    commits), then writes the result and removes the request.

    Args:
        spark: the job's session.
        root: the version's root in the lake.
        table: the version's table.
        files: the job's lake files (read, write, list, delete through the session's Hadoop file system).
        commit_lock: serializes the swap with the micro-batch commits.
        applied_by: the driver's identity, recorded in the commit (its Delta application id).
        ref: ``view@vN``, for the log.
    """

    def __init__(self, spark: "SparkSession", root: str, table: str, files: Any, commit_lock: threading.Lock, *,
                 applied_by: str, ref: str) -> None:
        self.spark, self.root, self.table, self.files = spark, root.rstrip("/"), table, files
        self.commit_lock, self.applied_by, self.ref = commit_lock, applied_by, ref

    def pending(self) -> list[str]:
        """Ids of the requests waiting, oldest id first (ids start with their UTC time)."""
        return sorted(name.removesuffix(".json") for name in self.files.list(f"{self.root}/{REQUESTS}")
                      if name.endswith(".json"))

    def apply_pending(self, stop: threading.Event | None = None) -> list[dict[str, Any]]:
        """Apply every waiting request; returns their results."""
        done = []
        for repair_id in self.pending():
            if stop is not None and stop.is_set():
                break
            result = self.apply(repair_id, stop)
            if result is not None:
                done.append(result)
        return done

    def apply(self, repair_id: str, stop: threading.Event | None = None) -> dict[str, Any] | None:
        """Commit one request's swap and answer it; None when it stays for the next start (the job is stopping
        and the swap was cut: Delta committed it or not, the idempotent transaction makes the retry exact)."""
        text = self.files.read(request_uri(self.root, repair_id))
        if text is None:  # already handled (another poll)
            return None
        started = time.time()
        try:
            request = SwapRequest.from_json(text)
            with self.commit_lock:
                version = swap(self.spark, self.table, request, applied_by=self.applied_by)
            result = {"id": repair_id, "delta_version": version, "applied_by": self.applied_by,
                      "applied_at": time.time(), "seconds": round(time.time() - started, 3)}
            log.info("%s: repair %s swapped in Delta version %s (handed over by %s)", self.ref, repair_id, version,
                     request.by)
        except Exception as exc:  # noqa: BLE001 - the requester is told why, in one line; the job goes on
            if stop is not None and stop.is_set():
                log.info("%s: repair %s cut by the stop; applied at the next start", self.ref, repair_id)
                return None
            result = {"id": repair_id, "error": one_line(exc), "applied_by": self.applied_by,
                      "applied_at": time.time()}
            log.error("%s: repair %s not applied: %s", self.ref, repair_id, result["error"])
        self.files.write(result_uri(self.root, repair_id), json.dumps(result))
        self.files.delete(request_uri(self.root, repair_id))
        return result

    def run(self, stop: threading.Event, poll_seconds: float) -> None:
        """Poll until ``stop`` is set (the job's thread); a failed poll (store unreachable) is retried."""
        while True:
            try:
                self.apply_pending(stop)
            except Exception as exc:  # noqa: BLE001 - the store may be briefly unreachable: say so, poll again
                log.warning("%s: repair requests not read: %s", self.ref, one_line(exc))
            if stop.wait(poll_seconds):
                return

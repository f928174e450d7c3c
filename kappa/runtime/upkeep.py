"""Every view table keeps itself: a thread of its live job compacts the small files its micro-batches write and
deletes the files no version within its history still references, between the job's own commits.

.. code-block:: text

    every KAPPA_UPKEEP_SECONDS (1 h; the first after one period and a per-view offset, so the views of one host
    do not all compact at once); under the job's commit lock - the job's micro-batch commits, a repair's swap
    applied by the job, and these are one writer's commits, one after the other, never in conflict:
      (an archive only) retention: whole prefixes of a partition older than its `retention` (kappa.runtime.archive)
      OPTIMIZE  files under COMPACT_BELOW_BYTES rewritten into few large ones, per partition (dataChange=false:
                the change feed, `watch` and streaming readers skip the commit; the rows are the same rows)
    then, beside the job's commits (it commits nothing and deletes only files older than the retention):
      VACUUM    (LITE: the files the log's commits since the last VACUUM removed - compaction's, each MERGE's;
                the first of a job and then once a day FULL: also files no commit added, as an empty write leaves)
                files no version within the table's history references leave (delta.deletedFileRetentionDuration)
                - time travel (`--as-of`) and the change feed (`table_changes`, `watch`) reach every version of it
      the log   commit files older than the history (delta.logRetentionDuration) and before the last checkpoint
                leave
      then the view's partition of the shared quarantine, through delta-rs (its one commit protocol): compacted,
                VACUUMed and its log cleaned the same way, beside the other drivers' appends (no lock: blind
                appends commute with a no-data-change commit)
    the history KAPPA_HISTORY_HOURS, unset an hour on a lake on a file system (a listing of a table's log reads
                every file in it, and every live commit lists it twice) and Delta's own on an object store (7 days
                of files, 30 of log: S3 lists a log from a version); the quarantine's at most a quarter of an hour
                (QUARANTINE_HISTORY_HOURS); an archive keeps Delta's own

Between two upkeeps, as writers go: every LOOK_SECONDS the keeper counts the files under LOOK_BELOW_BYTES (4 MiB:
the micro-batches' and earlier looks' small outputs, not the compacted file growing towards COMPACT_BELOW_BYTES,
which the hourly upkeep alone rewrites) the table's current version references, and the small files of the view's
partition of the quarantine; past KAPPA_COMPACT_FILES (100) it compacts those at once - the OPTIMIZE above, or the
quarantine's delta-rs compaction - without VACUUM, which stays hourly; with a history of its own
(KAPPA_HISTORY_HOURS) the look also removes both tables' expired log, so that the log holds about the history and
no more. While a publishing
version's publisher is behind its table, the table's VACUUM and log clean-up wait (the change data it has still to
read). A delta-rs commit materializes every file of the table's current version: an append of 400 rows to a table
of 1,500 small files took 95 ms on 2 cores, to one compacted into a single file after as many commits 30 ms (the
rest grows with the log: docs/performance.md), and the quarantine, which every view appends to, gathers the
files of all of them; compacted as writers go, no table a live job appends to holds more than about
KAPPA_COMPACT_FILES small files, whatever the upkeep's period.

A live micro-batch writes one file per table partition (a few KB); at the 2 s trigger a view table gains ~1,800
files an hour. After an upkeep each partition holds the files of earlier upkeeps (each at least
COMPACT_BELOW_BYTES, or the partition's whole size) and the micro-batches of the last period. A failed upkeep
(a concurrent writer from another process, a stopped store) changes nothing and is tried again a period later;
it never fails a micro-batch.
"""

from __future__ import annotations

import logging
import threading
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

__all__ = ["COMPACT_BELOW_BYTES", "FULL_VACUUM_SECONDS", "LOOK_BELOW_BYTES", "LOOK_SECONDS",
           "QUARANTINE_HISTORY_HOURS", "Compacted",
           "TableKeeper", "Upkept", "clean_log", "compact", "compact_between", "compact_quarantine",
           "history_properties", "keep_history", "keep_registry", "small_files", "vacuum"]

#: Files smaller than this are compacted (Delta's ``optimize.minFileSize``, 1 GB by default, would rewrite every
#: partition's whole data each period until it reached 1 GB); a compacted file at least this big is left alone,
#: so a row is rewritten two or three times at most.
COMPACT_BELOW_BYTES = 64 * 1024 * 1024

#: Between upkeeps a look compacts only files under this: the micro-batches' own (a few KB each) and the earlier
#: looks' outputs while they are small, not the compacted file that grows towards COMPACT_BELOW_BYTES - rewriting it
#: at every look wrote about five times a table's data within its history (events_raw: 1.1 GiB on disk after 4,500
#: commits of ``make bench-commits`` against 0.6 hourly). The hourly upkeep merges the looks' files.
LOOK_BELOW_BYTES = COMPACT_BELOW_BYTES // 16


#: How often an upkeep's VACUUM is a full one (the others are LITE: :func:`vacuum`).
FULL_VACUUM_SECONDS = 86_400

#: How often a keeper counts its table's small files between upkeeps (``KAPPA_COMPACT_FILES``).
LOOK_SECONDS = 30.0

#: The quarantine's history on a lake whose tables keep a short one (``KAPPA_HISTORY_HOURS``), at most: every view's
#: driver appends to it (six views at the 2 s trigger: 10,800 commits an hour), and no reader travels back in it -
#: its rows are what operators read.
QUARANTINE_HISTORY_HOURS = 0.25

_LOG_RETENTION = "delta.logRetentionDuration"
_FILE_RETENTION = "delta.deletedFileRetentionDuration"


def history_properties(hours: float | None, *, quarantine: bool = False) -> dict[str, str]:
    """The table properties that make a table's history reach ``hours`` back (its log and the files its commits
    replaced kept that long; the quarantine's at most :data:`QUARANTINE_HISTORY_HOURS`); none for None (Delta's
    own: 7 days of files, 30 of log)."""
    if hours is None:
        return {}
    minutes = max(1, round((min(hours, QUARANTINE_HISTORY_HOURS) if quarantine else hours) * 60))
    return {_LOG_RETENTION: f"interval {minutes} minutes", _FILE_RETENTION: f"interval {minutes} minutes"}


def keep_history(spark: "SparkSession | None", uri: str, properties: dict[str, str]) -> bool:
    """Set ``properties`` (:func:`history_properties`) on the existing table at ``uri`` where it has others - a
    table made before them, or under another ``KAPPA_HISTORY_HOURS``; True when it changed them. Through Spark
    (``spark`` given: a view table, before its job's query starts - nothing else writes it then) or delta-rs (the
    quarantine, which only delta-rs writes: the drivers' appends that meet the change retry once,
    :func:`kappa.runtime.deltars.append_once`)."""
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import CommitFailedError

    from kappa.runtime.deltars import rs_uri

    for attempt in range(3):
        table = RsTable(rs_uri(uri))
        have = table.metadata().configuration
        if not properties or all(have.get(k) == v for k, v in properties.items()):
            return False
        if spark is not None:
            break
        try:
            table.alter.set_table_properties(properties)
            return True
        except CommitFailedError:  # another driver changed them at the same moment: look again
            if attempt == 2:
                raise
    quoted = uri.replace("`", "``")
    values = ", ".join(f"'{k}' = '{v}'" for k, v in properties.items())
    spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ({values})")
    return True


@dataclass(frozen=True, slots=True)
class Compacted:
    """What one :func:`compact` did: small files rewritten (removed -> added) and whether VACUUM ran."""

    files_removed: int = 0
    files_added: int = 0
    vacuumed: bool = False

    def line(self) -> str:
        done = (f"compacted {self.files_removed:,} files into {self.files_added:,}" if self.files_removed
                else "nothing to compact")
        return done + ("; vacuumed" if self.vacuumed else "")


@dataclass(frozen=True, slots=True)
class Upkept:
    """One upkeep of a live job: its table's (:class:`Compacted`, or an archive's ``Kept``) and its view's
    partition of the quarantine."""

    table: Any
    quarantine: Compacted

    def line(self) -> str:
        return f"{self.table.line()}; quarantine: {self.quarantine.line()}"


def compact(spark: "SparkSession", table: str, *, lock: Any = None, full_vacuum: bool = False,
            keep: bool = True, hold: Callable[[], bool] | None = None, below: int = COMPACT_BELOW_BYTES) -> Compacted:
    """OPTIMIZE ``table``'s files under ``below`` bytes while holding ``lock`` (the job's commit lock: a MERGE of
    the same files in between would make one of the two fail), then VACUUM it without the lock - every upkeep, as a
    MERGE view's micro-batches, a repair's swap and an archive's retention replace files without any compaction:
    LITE, or FULL when ``full_vacuum`` (:func:`vacuum`) - and clean its log. ``keep=False``: the compaction alone
    (between upkeeps, as writers go). While ``hold()`` is true (a publisher behind the table) the table's history
    stays: no VACUUM, no clean-up of the log."""
    import contextlib

    from delta.tables import DeltaTable

    with lock if lock is not None else contextlib.nullcontext():
        spark.conf.set("spark.databricks.delta.optimize.minFileSize", str(below))
        metrics = DeltaTable.forPath(spark, table).optimize().executeCompaction().first()["metrics"]
    removed, added = int(metrics["numFilesRemoved"] or 0), int(metrics["numFilesAdded"] or 0)
    keep = keep and not (hold is not None and hold())
    if keep:
        vacuum(spark, table, full=full_vacuum)
        clean_log(table)
    return Compacted(removed, added, keep)


def small_files(table: Any, partition: tuple[str, str] | None = None, *, below: int = COMPACT_BELOW_BYTES) -> int:
    """How many files under ``below`` bytes the current version of ``table`` (a delta-rs
    ``DeltaTable``, brought up to date here) references - in ``partition`` (column, value) when given."""
    table.update_incremental()
    actions = table.get_add_actions(flatten=True)
    sizes = actions.column(actions.column_names.index("size_bytes")).to_pylist()
    if partition is not None:
        name = f"partition.{partition[0]}"
        if name not in actions.column_names:
            return 0
        values = actions.column(actions.column_names.index(name)).to_pylist()
        sizes = [size for size, value in zip(sizes, values) if value == partition[1]]
    return sum(1 for size in sizes if size < below)


def compact_between(spark: "SparkSession", table: str, quarantine: str, view: str, *, limit: int, lock: Any = None,
                    table_too: bool = True, handles: dict[str, Any] | None = None, clean: bool = False,
                    hold: Callable[[], bool] | None = None) -> Upkept | None:
    """A keeper's look between upkeeps: ``table`` (when ``table_too``) compacted under ``lock`` once its current
    version references more than ``limit`` files under :data:`LOOK_BELOW_BYTES` (those alone), and ``view``'s
    partition of the ``quarantine`` (a delta-rs URI) likewise - the compaction alone, no VACUUM; None when neither
    was due. ``handles`` keeps the delta-rs tables it counts with from one look to the next (brought up to date
    incrementally). ``clean``: the expired log of both is removed at every look too (a short history,
    ``KAPPA_HISTORY_HOURS``: the log stays about as long as the history), the table's not while ``hold()`` is true."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri

    opened = handles if handles is not None else {}

    def count(uri: str, partition: tuple[str, str] | None = None, below: int = COMPACT_BELOW_BYTES) -> int:
        if uri not in opened:
            opened[uri] = DeltaTable(uri)
        return small_files(opened[uri], partition, below=below)

    done = quarantined = None
    if table_too and count(rs_uri(table), below=LOOK_BELOW_BYTES) > limit:
        done = compact(spark, table, lock=lock, keep=False, below=LOOK_BELOW_BYTES)
    if count(quarantine, ("view", view)) > limit:
        quarantined = compact_quarantine(quarantine, view, keep=False)
    if clean:
        if table_too and not (hold is not None and hold()):
            opened[rs_uri(table)].cleanup_metadata()
        opened[quarantine].cleanup_metadata()
    if done is None and quarantined is None:
        return None
    return Upkept(done or Compacted(), quarantined or Compacted())


def clean_log(table: str) -> None:
    """Remove the commit files of ``table``'s log older than its history (``delta.logRetentionDuration``: an hour
    on a lake on a file system, 30 days on an object store) and before its last checkpoint, through delta-rs: most
    commits of a live table are delta-rs', which leave the log's clean-up to the keeper (:data:`LIVE_HOOKS
    <kappa.runtime.deltars.LIVE_HOOKS>`). It commits nothing."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri

    DeltaTable(rs_uri(table)).cleanup_metadata()


def vacuum(spark: "SparkSession", table: str, *, full: bool = False) -> None:
    """VACUUM ``table`` at its retention (7 days unless the table says otherwise). It commits nothing (VACUUM's
    own log entries are off) and deletes only files older than the retention that no version within it
    references, so it runs beside the job's commits: a micro-batch's files are seconds old, and Delta refuses a
    retention under 7 days unless told otherwise. LITE: the files the log's commits since the last VACUUM removed
    (compaction's, each MERGE's, their change-data files), not a listing of the whole table, which grows with
    every file replaced within the retention. FULL (``full``, and where the log no longer holds those commits:
    no VACUUM for longer than the log's 30 days) lists the table and also deletes files no commit ever added -
    an empty micro-batch's write through delta-spark leaves its empty file so."""
    spark.conf.set("spark.databricks.delta.vacuum.logging.enabled", "false")
    # the retention is the table's own (delta.deletedFileRetentionDuration: KAPPA_HISTORY_HOURS where it is short);
    # Delta's check refuses one under 7 days, a guard against a RETAIN typed by hand, which this never passes
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    # a full VACUUM lists the table in Spark's partition-discovery parallelism: 10,000 tasks by default, 40 s of
    # task overhead on 2 cores for a table of a dozen files (measured); the listing is I/O, a few tasks suffice
    spark.conf.set("spark.sql.sources.parallelPartitionDiscovery.parallelism",
                   str(max(2, spark.sparkContext.defaultParallelism)))
    quoted = table.replace("`", "``")
    if full:
        spark.sql(f"VACUUM delta.`{quoted}`")
        return
    try:
        spark.sql(f"VACUUM delta.`{quoted}` LITE")
    except Exception as exc:  # noqa: BLE001 - the refusals that a full VACUUM answers
        text = str(exc)
        # the log no longer holds the commits since the last VACUUM - or lost one while LITE read it, the log's
        # clean-up after a checkpoint running under it (a retention shorter than the time since that VACUUM)
        if "DELTA_CANNOT_VACUUM_LITE" not in text and not ("FILE_NOT_EXIST" in text and "/_delta_log/" in text):
            raise
        log.info("%s: a LITE VACUUM cannot see every removed file (%s): a full one", table, text[:200])
        spark.sql(f"VACUUM delta.`{quoted}`")


def compact_quarantine(uri: str, view: str, *, keep: bool = True) -> Compacted:
    """Compact ``view``'s partition of the shared quarantine through delta-rs, the table's one commit protocol,
    VACUUM it (every file no version within its history references: a full VACUUM) and clean its log. Every driver
    appends there at any time: delta-rs' compaction commits as no data change, so the blind appends beside it
    commit on the next log version, and two versions of one view compacting at once cost one of them a retry a
    period later. ``keep=False``: the compaction alone (between upkeeps, as writers go)."""
    return _keep_rs(uri, partition_filters=[("view", "=", view)], keep=keep)


def keep_registry(lake_uri: str) -> dict[str, Compacted]:
    """The control plane's tables (``<lake>/_registry/<name>``: versions, events, the serving alias, leases),
    through delta-rs, their one commit protocol: compacted, VACUUMed in full (files unreferenced for 7 days),
    checkpointed (a reader loads the last checkpoint and the commits after it, not every commit since the table
    began) and their log files past the log's retention (30 days) removed. Run hourly by the ``kappa_retire`` DAG.
    Their writers' compare-and-set commits retry on a conflict (:mod:`kappa.control.registry`), so a compaction that
    commits between a writer's read and its commit costs that writer one retry; appends commute with it."""
    from deltalake import DeltaTable

    from kappa.runtime.checkpoint import list_names
    from kappa.runtime.deltars import rs_uri

    root = f"{lake_uri.rstrip('/')}/_registry"
    out: dict[str, Compacted] = {}
    for name in list_names(root):
        uri = rs_uri(f"{root}/{name}")
        try:
            is_table = DeltaTable.is_deltatable(uri)
        except OSError:  # a file (catalog.sql): delta-rs cannot open it as a table's folder
            is_table = False
        if is_table:  # not catalog.sql, nor a table being created
            out[name] = _keep_rs(uri, checkpoint=True)
    return out


def _keep_rs(uri: str, *, partition_filters: list | None = None, checkpoint: bool = False,
             keep: bool = True) -> Compacted:
    """A delta-rs table's upkeep: compaction (of ``partition_filters``' partitions), a full VACUUM, a checkpoint when
    ``checkpoint``, the log's expired commits removed; the compaction alone when not ``keep``."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import after_commit

    table = DeltaTable(uri)
    metrics = table.optimize.compact(partition_filters=partition_filters, target_size=COMPACT_BELOW_BYTES)
    removed, added = int(metrics.get("numFilesRemoved") or 0), int(metrics.get("numFilesAdded") or 0)
    if not keep:
        if removed:  # it committed
            after_commit(table)
        return Compacted(removed, added, False)
    # a full VACUUM (a listing of the table): a short history's checkpoints and log clean-up forget a replaced
    # file's removal within minutes, and delta-rs' default (lite) VACUUM, which reads only the removals the log
    # still holds, left every such file on disk (the quarantine of make bench-commits: 20,756 of 20,948 files)
    table.vacuum(dry_run=False, full=True)
    if checkpoint:
        table.create_checkpoint()
    table.cleanup_metadata()
    after_commit(table)
    return Compacted(removed, added, True)


class TableKeeper:
    """A live job's thread that runs ``step`` (it takes the job's commit lock for what commits, and returns
    something with a ``line()``) every ``period`` seconds; :attr:`last` is what the last run did. The first run
    waits one period (a starting job catches up first) plus an offset of up to a quarter period derived from
    ``ref``. Between two runs, every ``look`` seconds, ``between`` (when given) compacts what has gathered too many
    small files and returns what it did, or None when nothing was due; :attr:`compactions` counts those that
    did something."""

    def __init__(self, ref: str, step: Callable[[], Any], *, what: str = "upkeep",
                 between: Callable[[], Any] | None = None) -> None:
        self.ref, self.step, self.what, self.between = ref, step, what, between
        self.last: Any = None
        self.failures = 0
        self.compactions = 0

    def run(self, stop: threading.Event, period: float, look: float = LOOK_SECONDS) -> None:
        import time

        from kappa.errors import one_line

        offset = period / 4 * (zlib.crc32(self.ref.encode()) % 1000) / 1000
        due = time.monotonic() + period + offset
        while True:
            left = due - time.monotonic()
            if stop.wait(max(0.0, min(left, look) if self.between is not None else left)):
                return
            full = time.monotonic() >= due
            what = self.what if full else "compaction"
            try:
                if full:
                    due = time.monotonic() + period
                    self.last = self.step()
                    log.info("%s: %s: %s", self.ref, self.what, self.last.line())
                elif (done := self.between()) is not None:  # type: ignore[misc]
                    self.compactions += 1
                    log.info("%s: %s: %s", self.ref, what, done.line())
            except Exception as exc:  # noqa: BLE001 - tried again later; a failed commit changed nothing
                self.failures += 1
                log.warning("%s: %s failed (tried again in %.0f s): %s", self.ref, what,
                            period if full else look, one_line(exc))

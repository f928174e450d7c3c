"""The lake's archive of a stream topic, and replays that start from it (Kappa+: the same streaming code over the
archived history, then the live log).

The archive of a topic is a view whose version keeps every record (``ViewDefinition.keep_invalid``): its
partition, offset, Kafka timestamp, raw key and value bytes - valid or not - beside the decoded columns and the
reason a record is invalid (``error``). Its job writes it exactly once like every view (checkpointed offsets,
idempotent Delta commits), partitioned by Kafka partition. ``platform.yaml`` names it (``archives: <topic>``).

A replay whose start is no longer in the log reads ``[start, handover)`` of each partition from the archive and
``[handover, ...)`` from the log, in one checkpoint:

.. code-block:: text

    batch 0  archive [start, handover) (Delta, decoded columns) ─┐
             log [handover, log end now) (Kafka, decoded)     ─┴─ union -> the view's plan -> one micro-batch
             (Trigger.AvailableNow: then the no-data batch that emits what its watermark closed), committed like
             any other: idempotent Delta commits, state and watermark in the checkpoint
    switch   the offset log keeps the log source's entries only, and the query's initial offsets become the
             replay's start (sources/0/0): batch 0 read [start, its end) of the log, as far as the checkpoint tells
    batch 1+ the view's own query (Kafka only) on the same checkpoint, state and watermark

The whole range the replay found is one micro-batch, as a replay from the log reads it: no watermark falls
between the archive part and the log part, so windows, sessions and dedupe give the table a replay of the same
range from the log gives. Everything after the switch sees a checkpoint of the log only.

Where the archive's records are read back (recompute, repair: :func:`kappa.runtime.rerun.read_range`), the part
below the log's start comes from the archive and the rest from the log.

The archive keeps itself (its job's :class:`kappa.runtime.upkeep.TableKeeper`, every ``KAPPA_UPKEEP_SECONDS``,
between the job's commits): records older than its ``retention`` (platform.yaml) leave it as whole prefixes of a
partition - never while a replay's lease holds the topic - and the small files of live micro-batches are compacted,
so a replay reads few large files.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from kappa.errors import KappaError

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

    from kappa.config import Settings
    from kappa.runtime.parsing import RecordFormat

log = logging.getLogger(__name__)

__all__ = ["ArchiveError", "Coverage", "Kept", "archive_query", "archive_rows", "archive_of",
           "archived_decoded", "coverage", "expired_prefixes", "keep", "switch_checkpoint", "phase_done",
           "plan_handover", "replay_leases"]

#: The archive's column for the reason a record is invalid (``_error`` of :func:`kappa.runtime.parsing.decode`).
ERROR = "error"


class ArchiveError(KappaError, RuntimeError):
    """The archive cannot serve a replay (a gap, a missing file, no archive)."""


def archive_rows(decoded: "DataFrame") -> "DataFrame":
    """Every record of :func:`kappa.runtime.parsing.decode` output as the archive keeps it: decoded columns,
    raw bytes, Kafka coordinates and ``error`` (NULL for a valid record)."""
    from kappa.runtime.parsing import BARRIER

    return decoded.drop(BARRIER).withColumnRenamed("_error", ERROR)


def archive_of(settings: "Settings", topic: str) -> tuple[str, str] | None:
    """(archive view name, its table) of a declared stream topic, or None when no view archives it. The
    table is the one of the archive view's default version."""
    from kappa.catalog import load_catalog
    from kappa.identity import ViewPaths

    for spec in load_catalog().views.values():
        if spec.archives == topic:
            return spec.name, ViewPaths(settings.lake_uri, spec.name, spec.default_version).table
    return None


def _ranges_filter(ranges: Mapping[int, tuple[int, int]]) -> Any:
    from pyspark.sql import functions as F

    cond = F.lit(False)
    for p, (lo, hi) in sorted(ranges.items()):
        if hi > lo:
            cond = cond | ((F.col("partition") == p) & (F.col("offset") >= lo) & (F.col("offset") < hi))
    return cond


def archived_decoded(spark: "SparkSession", table: str, fmt: "RecordFormat", ranges: Mapping[int, tuple[int, int]],
                     *, stream: bool = False) -> "DataFrame":
    """The archived records of ``[lo, hi)`` per partition, shaped like :func:`kappa.runtime.parsing.decode`
    output (same columns, same order). The archive's decoded columns are used when they are what decoding now
    gives (same names and types); otherwise the raw bytes are decoded again (the schema changed since).

    ``stream``: a streaming read (the replay's first phase); the ranges bound what it reads.
    """
    from pyspark.sql import functions as F

    from kappa.runtime.parsing import BARRIER, barrier, decode, decoded_schema

    reader = spark.readStream if stream else spark.read
    if stream:  # the whole range in one micro-batch, however many files hold it
        reader = reader.option("maxFilesPerTrigger", str(1 << 30))
    archived = reader.format("delta").load(table).where(_ranges_filter(ranges))
    archived = archived.withColumnRenamed(ERROR, "_error")
    have = {f.name: f.dataType for f in archived.schema.fields}
    wanted = [f for f in decoded_schema(spark, fmt).fields if f.name != BARRIER]
    if all(have.get(f.name) == f.dataType for f in wanted):
        return archived.select(*(f.name for f in wanted)).withColumn(BARRIER, barrier())
    log.info("archive %s: decoded columns differ from the schema now; decoding its raw bytes again", table)
    raw = archived.select(F.col("raw_key").alias("key"), F.col("raw_value").alias("value"), "topic", "partition",
                          "offset", F.col("kafka_timestamp").alias("timestamp"))
    return decode(raw, fmt)


# coverage -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Coverage:
    """What the archive holds of one partition: ``rows`` distinct offsets within ``[low, high)`` (``high`` = last
    offset + 1) in ``records`` records; contiguous when every offset is there once."""

    low: int
    high: int
    rows: int
    records: int

    @property
    def contiguous(self) -> bool:
        return self.rows == self.records == self.high - self.low


def archive_query(table: str, sql: str) -> list[dict[str, Any]]:
    """Rows of a SQL query over the Delta table ``t`` (delta-rs' DataFusion, no Spark)."""
    from deltalake import DeltaTable, QueryBuilder

    from kappa.runtime.deltars import rs_uri

    data = QueryBuilder().register("t", DeltaTable(rs_uri(table))).execute(sql).read_all()
    names = list(data.column_names)
    columns = [data.column(i).to_pylist() for i in range(len(names))]
    return [dict(zip(names, values)) for values in zip(*columns)]


def _where(ranges: Mapping[int, tuple[int, int]] | None) -> str:
    if ranges is None:
        return ""
    parts = [f'("partition" = {int(p)} AND "offset" >= {int(lo)} AND "offset" < {int(hi)})'
             for p, (lo, hi) in sorted(ranges.items())]
    return " WHERE " + (" OR ".join(parts) if parts else "false")


def coverage(table: str, ranges: Mapping[int, tuple[int, int]] | None = None) -> dict[int, Coverage]:
    """Per partition, what the archive table holds (within ``ranges`` when given), read with delta-rs: the offset
    column only, no Spark. An empty table (or none yet) covers nothing.

    Raises:
        ArchiveError: A data file the table lists cannot be read (deleted, corrupt) - named, in one line.
    """
    from deltalake.exceptions import TableNotFoundError

    try:
        rows = archive_query(table, 'SELECT "partition" AS p, min("offset") AS lo, max("offset") AS hi, '
                             'count(DISTINCT "offset") AS n, count(*) AS total '
                             f'FROM t{_where(ranges)} GROUP BY "partition"')
    except TableNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001 - delta-rs/DataFusion errors (a missing or corrupt file) in one line
        raise ArchiveError(f"archive {table}: cannot read its files ({' '.join(str(exc).split())[:300]})") from None
    return {int(r["p"]): Coverage(int(r["lo"]), int(r["hi"]) + 1, int(r["n"]), int(r["total"]))
            for r in rows if r["p"] is not None}


def plan_handover(table: str, start: Mapping[int, int], log_start: Mapping[int, int],
                  target: Mapping[int, int], *, prefer_archive: bool = False) -> dict[int, int]:
    """Per partition, the handover offset of a replay from ``start`` when the log begins at ``log_start``: the
    archive serves ``[start, handover)``, the log the rest. The archive is used as far as it reaches (its
    columnar files read faster than the log), never past ``target``; on a partition whose start the log still
    holds, only with ``prefer_archive`` (else the log serves it all).

    Raises:
        ArchiveError: The archive misses a record the replay needs (its start, a hole inside, or the gap
            between the archive's end and the log's start) or holds one twice, named partition by partition.
    """
    first = {p: int(start.get(p, log_start.get(p, 0))) for p in target}
    # one query: what the archive holds of [first, target) - how far it reaches, and whether exactly once
    held = coverage(table, {p: (lo, int(target[p])) for p, lo in first.items() if int(target[p]) > lo})
    handover: dict[int, int] = {}
    problems: list[str] = []
    holes: list[str] = []
    for p in sorted(target):
        lo = first[p]
        need_to = max(lo, int(log_start.get(p, 0)))  # below this the log holds nothing
        got = held.get(p)
        if need_to <= lo and not prefer_archive or int(target[p]) <= lo:
            handover[p] = lo  # the log still has the start (or there is nothing to read)
            continue
        if got is None or got.low > lo:
            have = f"it starts at {got.low}" if got else "it holds nothing of it"
            problems.append(f"partition {p}: the replay starts at {lo}, {have}")
            continue
        if got.high < need_to:
            problems.append(f"partition {p}: the archive ends at {got.high} and the log starts at {need_to} "
                            f"({need_to - got.high:,} records in neither)")
            continue
        handover[p] = got.high  # <= target: the query stopped there
        if got.rows != got.high - lo:
            holes.append(f"partition {p}: {got.high - lo - got.rows:,} of [{lo}, {got.high}) missing")
        elif got.records != got.rows:  # written twice: a replay would count those records twice
            holes.append(f"partition {p}: {got.records - got.rows:,} records of [{lo}, {got.high}) held twice")
    if problems:
        raise ArchiveError(f"archive {table} cannot serve the replay: " + "; ".join(problems))
    if holes:
        raise ArchiveError(f"archive {table} does not hold the replay's range exactly once: " + "; ".join(holes))
    return handover


# the checkpoint switch ------------------------------------------------------------------------------------
def _offsets_json(topic: str, offsets: Mapping[int, int]) -> str:
    return json.dumps({topic: {str(p): int(o) for p, o in sorted(offsets.items())}}, separators=(",", ":"))


def phase_done(files: Any, main: str) -> bool:
    """Whether the first micro-batch (archive + log) of the checkpoint ``main`` (``<checkpoint>/main``) committed."""
    return files.read(f"{main}/commits/0") is not None


def switch_checkpoint(files: Any, main: str, topic: str, start: Mapping[int, int]) -> bool:
    """After the first micro-batch (archive + log) committed: make the checkpoint the log's alone - the offset
    log's entries of the archive source go, the log source's stay, and the query's initial offsets become the
    replay's start (see the module doc). Idempotent; False when there was nothing to switch."""
    if files.read(f"{main}/commits/0") is None:
        raise ArchiveError(f"{main}: the first micro-batch has not committed; nothing to switch")
    from kappa.runtime.checkpoint import list_names

    names = files.list(f"{main}/offsets") if hasattr(files, "list") else list_names(f"{main}/offsets")
    switched = False
    _drop_checksum(f"{main}/sources/0/0")
    files.write(f"{main}/sources/0/0", "v1\n" + _offsets_json(topic, start))
    for batch in sorted(int(name) for name in names if name.isdigit()):
        lines = (files.read(f"{main}/offsets/{batch}") or "").splitlines()
        logged = [line for line in lines[2:] if line.strip() and topic in json.loads(line)]
        if len(logged) != len(lines) - 2:
            _drop_checksum(f"{main}/offsets/{batch}")
            files.write(f"{main}/offsets/{batch}", "\n".join([*lines[:2], *logged]))
            switched = True
    return switched


def _drop_checksum(uri: str) -> None:
    """A local checkpoint file has a Hadoop checksum beside it (``.<name>.crc``) that Spark verifies on read:
    the rewritten file must not keep the old one."""
    from pathlib import Path

    from kappa.runtime.deltars import is_local_uri, local_path

    if is_local_uri(uri):
        path = Path(local_path(uri))
        path.with_name(f".{path.name}.crc").unlink(missing_ok=True)


# the archive's own retention and file size -------------------------------------------------------------------
@dataclass(frozen=True)
class Kept:
    """What one :func:`keep` did: per partition the offsets ``[low, new low)`` retention removed, the small files
    compaction rewrote (removed -> added), and the leases that held retention back (nothing removed then)."""

    removed: dict[int, tuple[int, int]]
    files_removed: int = 0
    files_added: int = 0
    held_by: tuple[str, ...] = ()

    def line(self) -> str:
        parts = []
        if self.held_by:
            parts.append(f"retention held back by the replay lease(s) of {', '.join(self.held_by)}")
        elif self.removed:
            parts.append("retention removed " + ", ".join(f"partition {p} offsets {lo:,}-{hi - 1:,}"
                                                          for p, (lo, hi) in sorted(self.removed.items())))
        if self.files_removed:
            parts.append(f"compacted {self.files_removed} files into {self.files_added}")
        return "; ".join(parts) or "nothing to remove or compact"


def expired_prefixes(spark: "SparkSession", table: str, cutoff_ms: int) -> dict[int, tuple[int, int]]:
    """Per partition, the offsets ``[low, first)`` whose records are all older than ``cutoff_ms`` (Kafka
    timestamp, epoch ms): ``first`` is the lowest offset of a record at or after the cutoff, so what leaves is a
    prefix - the archive never gets a hole, and a record newer than the cutoff stays even where its neighbours'
    timestamps are older (as Kafka's retention keeps a segment while any of its records is young). Two queries
    whose filters Delta's file statistics answer mostly by skipping files (only files holding older records are
    read)."""
    from pyspark.sql import functions as F

    rows = spark.read.format("delta").load(table)
    cutoff = F.timestamp_millis(F.lit(cutoff_ms))
    old = rows.where(F.col("kafka_timestamp") < cutoff).groupBy("partition").agg(
        F.min("offset").alias("low"), F.max("offset").alias("last_old")).collect()
    if not old:
        return {}
    bound = F.lit(False)
    for row in old:
        bound = bound | ((F.col("partition") == row["partition"]) & (F.col("offset") <= row["last_old"]))
    young = {row["partition"]: row["first"] for row in rows.where(bound & (F.col("kafka_timestamp") >= cutoff))
             .groupBy("partition").agg(F.min("offset").alias("first")).collect()}
    out = {}
    for row in old:
        first = young.get(row["partition"], row["last_old"] + 1)
        if first > row["low"]:
            out[int(row["partition"])] = (int(row["low"]), int(first))
    return out


def keep(spark: "SparkSession", table: str, *, retention_ms: int | None, now_ms: int | None = None,
         holds: Any = tuple, lock: Any = None, full_vacuum: bool = False) -> Kept:
    """The archive's upkeep, run by its own job between its commits (``lock``: the job's commit lock; one writer
    per table also on an object store): records older than ``retention_ms`` leave (:func:`expired_prefixes`, one
    DELETE) unless a replay's lease holds the topic (``holds()``: the replays whose lease does - they may be reading
    them; asked again right before the DELETE, a replay may have taken its lease meanwhile); then the small
    files of live micro-batches are compacted and the files no version of the retention references leave
    (:func:`kappa.runtime.upkeep.compact`)."""
    import contextlib
    import time

    from delta.tables import DeltaTable

    from kappa.runtime.upkeep import compact

    guard = lock if lock is not None else contextlib.nullcontext()
    removed: dict[int, tuple[int, int]] = {}
    held_by = tuple(holds())
    if retention_ms is not None and not held_by:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        removed = expired_prefixes(spark, table, now_ms - retention_ms)
    with guard:
        if removed:
            held_by = tuple(holds())
            removed = {} if held_by else removed
        if removed:
            delta = DeltaTable.forPath(spark, table)
            if delta.detail().first()["properties"].get("delta.appendOnly") == "true":  # tables of older releases
                spark.sql(f"ALTER TABLE delta.`{table}` SET TBLPROPERTIES ('delta.appendOnly' = 'false')")
            delta.delete(_ranges_filter(removed))
    done = compact(spark, table, lock=lock, full_vacuum=full_vacuum)
    return Kept(removed, done.files_removed, done.files_added, held_by)


def replay_leases(settings: "Settings", topic: str) -> list[str]:
    """The replays whose retention lease holds ``topic`` now (``view@vN``), read from the leases' table
    (:mod:`kappa.control.leases`) with delta-rs: a lease holds until it is released or its run showed no life for
    ``KAPPA_LEASE_TTL_SECONDS``. (Ending an expired lease, and a version that left ``building``, is the control
    plane's part: until it does, retention here waits - the safe side.)"""
    import time

    from deltalake import DeltaTable

    from kappa.identity import ViewPaths, registry_table
    from kappa.runtime.checkpoint import last_progress
    from kappa.runtime.deltars import read_rows

    uri = registry_table(settings.lake_uri, "lease_holds")
    if not DeltaTable.is_deltatable(uri):
        return []
    holding = []
    for row in read_rows(DeltaTable(uri)):
        if row["topic"] != topic or row["released_at"] is not None:
            continue
        alive = last_progress(ViewPaths(settings.lake_uri, row["view"], int(row["version"])).checkpoint)
        renewed = (row["renewed_at"] or row["taken_at"]).timestamp()
        if time.time() - max(alive or 0.0, renewed) <= settings.lease_ttl_seconds:
            holding.append(f"{row['view']}@v{int(row['version'])}")
    return sorted(holding)

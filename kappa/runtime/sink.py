"""Idempotent Delta commits keyed by (app id, batch id).

* appends use the DataFrameWriter options ``txnAppId``/``txnVersion``; the quarantine's small appends use the same
  Delta application transaction through delta-rs (:class:`QuarantineSink`);
* MERGE (upserts, KTable deletes, window finality - stored windows the watermark passed are flagged final in the
  same commit: ``WHEN NOT MATCHED BY SOURCE`` through delta-spark, rows carried in the MERGE's source through
  delta-rs, see **Finality**) uses the documented SQL confs
  ``spark.databricks.delta.write.txnAppId``/``txnVersion`` (idempotent DML, Delta >= 2.3), set on the
  micro-batch's own session (one per streaming query, so concurrent queries never see each other's values).

Delta records ``(appId, txnVersion)`` in the commit itself; a batch that Spark re-runs after a crash between the
Delta commit and the checkpoint commit is skipped by Delta, so it is never applied twice. Each commit happens
in exactly one transaction: a batch either landed completely or not at all.

**Bulk catch-up** (MERGE-less catch-up of a run). Until a run has made its first commit to the view table, its
micro-batches that stopped at ``maxOffsetsPerTrigger`` while more of the log is waiting (a replay, a new view
reading its backlog) are not merged: each is *appended* to the run's staging table ``<version>/staging`` with
its batch id (same appId/txnVersion idempotency, same lineage as ``userMetadata``). The first batch that is not
such a catch-up batch (or the end of a bounded run, or a restart) *compacts*: the latest row per key across the
staged batches and itself (later batch wins, as consecutive MERGEs would), finality from the event-time maximum
of all of them but the last (see **Finality**), tombstones dropped, in ONE append commit to the view table keyed by
that batch id. From then on the run merges as usual. A bounded run of a stateful view (``availableNow``: a
replay) also stages a batch that wrote rows: the no-data batch Spark runs after it once the watermark moved
compacts it, so the rows and the finality that batch sets go into the table in one append instead of an append
and a MERGE (a run whose last batch was staged is compacted when its query ends). Nobody reads a run's table
before it caught up (a replay is promoted after verification; a new view has nothing to show yet), so only the
result has to equal what per-batch MERGEs would have written.

**Live batches through delta-rs.** A micro-batch that is not staged and whose output has at most
:data:`LIVE_ROWS` rows is collected to the driver (:func:`collect_rows`) and committed with delta-rs - the same
appends, MERGEs and deletes, the same ``txn(appId, batch id)`` and ``userMetadata``, the change data feed written
by delta-rs for its MERGEs - instead of delta-spark, which reconstructs the table's whole state with a Spark job
for every idempotent commit (Delta 4.4 answers ``txnVersion`` from ``Snapshot.computedState`` only, never from the
``.crc`` it writes): measured 0.14 against 1.58 CPU-s for a 50-row idempotent append and 0.23 against 3.2 CPU-s for
a 50-row MERGE (docs/performance.md). Larger batches (a restart's backlog, a bounded run) and bulk catch-up go
through delta-spark as before; both engines write the same table one commit after the other (one driver holds the
run's lock, the commit lock orders a repair's swap), and a table written through delta-rs is checkpointed every
:data:`kappa.runtime.deltars.CHECKPOINT_INTERVAL` commits. ``KAPPA_LIVE_COMMITS=spark`` turns the path off.

**Finality** (windowed views, :class:`kappa.runtime.view.Finality`). Spark drops a late row of micro-batch ``k``
with the watermark batch ``k - 1`` ran with, ``max(event time through batch k - 2) - delay``, and evicts state with
its own, one batch later. So the rows batch ``k + 1`` may still emit are the windows ending after ``max(event time
through batch k - 1) - delay``: after committing batch ``k`` a window is final - its row never changes again -
when it ends at or before the event-time maximum of the table *before* that commit, minus the delay. The flag
lags the watermark by one batch; the no-data batch Spark runs when its watermark moves closes the rest, so a
table at rest is final up to ``max(event time) - delay``. A batch's MERGE joins only stored rows whose window
ends at or after the batch's earliest window end (exact: a window's end is a function of its key), so a MERGE
reads the windows the batch touches, not the whole table. The table is partitioned by the flag
(:attr:`kappa.runtime.view.ViewDefinition.table_partitions`): a MERGE rewrites the files of the open windows it
updates or closes, and a window's row is written to the final partition once, when it closes - the bytes a batch
writes do not grow with the table (in one partition every MERGE rewrote every row the table held). A live batch
that closes windows reads their open rows from the open partition and carries them, flagged, in its source (delta-rs
reads and conflict-checks every file of the table for a ``WHEN NOT MATCHED BY SOURCE`` clause).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from kappa.runtime.deltars import SQL_TYPES
from kappa.runtime.spark import per_jvm
from kappa.runtime.view import Finality, ViewDefinition

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructField, StructType

    from kappa.runtime.deltars import Collected

__all__ = ["CHANGE_FEED", "LIVE_ROWS", "DeltaSink", "collect_rows", "collect_split", "QuarantineSink",
           "QUARANTINE_COLUMNS", "QUARANTINE_SCHEMA", "STAGED_BATCH", "SeedError", "enable_change_feed",
           "create_view_tables", "ensure_table", "final_flag", "seed_table", "table_columns", "txn_version"]

QUARANTINE_SCHEMA = (
    "view STRING, version INT, topic STRING, partition INT, offset BIGINT, kafka_timestamp TIMESTAMP, "
    "raw_key BINARY, raw_value BINARY, error STRING, batch_id BIGINT, quarantined_at TIMESTAMP"
)

#: The quarantine's columns as Arrow types (its appends go through delta-rs, see :class:`QuarantineSink`).
QUARANTINE_COLUMNS = tuple((name, SQL_TYPES[sql]) for name, sql in
                           (column.split() for column in QUARANTINE_SCHEMA.split(", ")))

#: Column of the staging table holding the micro-batch id a staged row came from.
STAGED_BATCH = "_kappa_batch"

#: A live micro-batch with at most this many output rows is committed through delta-rs (see the module doc).
LIVE_ROWS = 20_000

_TXN_APP = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


#: Table property of Delta Change Data Feed (on for every view table: ``kappa watch``, ``table_changes``).
CHANGE_FEED = "delta.enableChangeDataFeed"


def ensure_table(spark: "SparkSession", path: str, schema: "StructType | str", *,
                 partition_by: tuple[str, ...] = (), properties: dict[str, str] | None = None) -> None:
    """Create an empty Delta table at ``path`` if none exists (readers then see an empty view, not an error).

    Several drivers may create a shared table (the quarantine) at the same instant; the loser of that race sees
    the winner's first commit appear and simply uses the table.
    """
    import time

    from delta.tables import DeltaTable

    if isinstance(schema, str):
        from pyspark.sql.types import _parse_datatype_string

        schema = _parse_datatype_string(schema)
    for attempt in range(10):
        if DeltaTable.isDeltaTable(spark, path):
            return
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema)
        if partition_by:
            builder = builder.partitionedBy(*partition_by)
        for key, value in (properties or {}).items():
            builder = builder.property(key, value)
        try:
            builder.execute()
            return
        except Exception as exc:  # noqa: BLE001 - only the creation race is retried
            race = any(marker in str(exc) for marker in (
                "DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION", "FileAlreadyExists", "ConcurrentWrite",
                "ProtocolChanged", "MetadataChanged", "DELTA_CONCURRENT"))
            if not race or attempt == 9:
                raise
            time.sleep(0.5 * (attempt + 1))


def enable_change_feed(spark: "SparkSession", path: str) -> bool:
    """Turn Delta Change Data Feed on for an existing table that lacks it (tables created before the platform
    turned it on for every view); True when it was turned on now. The feed starts at that commit."""
    from kappa.runtime.deltars import rs_uri
    from deltalake import DeltaTable as RsTable

    if RsTable(rs_uri(path)).metadata().configuration.get(CHANGE_FEED) == "true":
        return False
    escaped = path.replace("`", "``")
    spark.sql(f"ALTER TABLE delta.`{escaped}` SET TBLPROPERTIES ('{CHANGE_FEED}' = 'true')")
    return True


def create_view_tables(spark: "SparkSession", view: ViewDefinition, output: "StructType", table: str,
                       quarantine: str, run_id: str, *, history_hours: float | None = None) -> bool:
    """A view version's table (the run's properties, change data feed on, partitioned by
    :attr:`ViewDefinition.table_partitions`) and the shared quarantine, each unless it exists, each keeping the
    history ``history_hours`` asks for (``Settings.table_history_hours``; an archive keeps Delta's own: a replay
    reads a version of it for longer than an hour) - set on an existing table too; True when the change data feed
    of an existing view table was turned on now (:func:`enable_change_feed`)."""
    from kappa.identity import RUN_ID_PROPERTY
    from kappa.runtime.deltars import create_table, rs_uri
    from kappa.runtime.upkeep import history_properties, keep_history

    history = {} if view.keep_invalid else history_properties(history_hours)
    ensure_table(spark, table, table_columns(view, output), partition_by=view.table_partitions,
                 properties={RUN_ID_PROPERTY: run_id, "kappa.view": view.name, "kappa.version": str(view.version),
                             CHANGE_FEED: "true", "delta.appendOnly":
                             # an archive's retention deletes its oldest records
                             "true" if view.write == "append" and not view.keep_invalid else "false", **history})
    turned_on = enable_change_feed(spark, table)
    keep_history(spark, table, history)
    # the quarantine is written by every driver through delta-rs only, so delta-rs creates it too: one commit
    # protocol per table (on an object store, delta-spark's log store would not exclude another process)
    held = history_properties(history_hours, quarantine=True)
    create_table(rs_uri(quarantine), QUARANTINE_COLUMNS, partition_by=("view",), properties=held)
    keep_history(None, quarantine, held)
    return turned_on


def txn_version(spark: "SparkSession", path: str, app_id: str) -> int | None:
    """Last ``txnVersion`` Delta recorded for ``app_id`` in the table (None if never)."""
    from kappa.runtime.spark import jvm_class

    jvm = spark.sparkContext._jvm  # the Delta Scala API has no Python wrapper for SetTransaction lookups
    log = jvm_class(jvm, "org.apache.spark.sql.delta.DeltaLog").forTable(spark._jsparkSession, path)
    none = jvm_class(jvm, "scala.Option").empty()
    opt = log.update(False, none, none).transactions().get(app_id)
    return None if opt.isEmpty() else int(opt.get())


class SeedError(RuntimeError):
    """The serving version's rows cannot seed the new version's table (a column changed its type)."""


def seed_table(spark: "SparkSession", path: str, seed: dict[str, Any], app_id: str) -> bool:
    """Seed a continued version's empty table with the serving version's rows (``upgrade=continue``,
    :mod:`kappa.control.replay.upgrade`): the rows of ``seed["table"]`` at Delta version ``seed["delta_version"]``,
    in the new table's columns (a column the serving version lacks is NULL in them; one the new version dropped
    is left out), in one append keyed ``<app_id>/seed`` - Delta skips it when a restarted driver writes it again.
    True when this call wrote it.

    Raises:
        SeedError: A column both tables have changed its type (the seeded rows would not mean the same thing).
    """
    import json

    from pyspark.sql import functions as F

    seed_app = f"{app_id}/seed"
    if txn_version(spark, path, seed_app) is not None:
        return False
    target = spark.read.format("delta").load(path).schema
    source = spark.read.format("delta").option("versionAsOf", int(seed["delta_version"])).load(seed["table"])
    have = {f.name: f.dataType for f in source.schema.fields}
    changed = [f"{f.name} {have[f.name].simpleString()} -> {f.dataType.simpleString()}" for f in target.fields
               if f.name in have and have[f.name] != f.dataType]
    if changed:
        raise SeedError(f"cannot continue from v{seed.get('from_version')}: column types changed "
                        f"({', '.join(changed)}); replay this version from the log instead")
    rows = source.select(*[F.col(f"`{f.name}`") if f.name in have else F.lit(None).cast(f.dataType).alias(f.name)
                           for f in target.fields])
    meta = json.dumps({"kappa": {"seed": {k: seed[k] for k in ("from_version", "table", "delta_version", "batch",
                                                                "end_offsets") if k in seed}}})
    (rows.write.format("delta").mode("append").option("txnAppId", seed_app).option("txnVersion", "0")
     .option("userMetadata", meta).save(path))
    return True


def table_columns(view: ViewDefinition, output: "StructType") -> "StructType":
    """Schema of the view's Delta table given the transform's output schema."""
    from pyspark.sql.types import BooleanType, StructField, StructType

    fields = [f for f in output.fields if not (view.write == "upsert_delete" and f.name == "is_tombstone")]
    if view.finality is not None and view.finality.flag_column not in output.fieldNames():
        fields.append(StructField(view.finality.flag_column, BooleanType(), False))
    return StructType(fields)


@per_jvm
def _driver_columns(fields: "tuple[StructField, ...]",
                    prefix: str = "") -> "tuple[tuple[tuple[str, str], ...], tuple[Column, ...]] | None":
    """(name, type) and the expression collecting each of ``fields`` as :class:`kappa.runtime.deltars.Collected`
    holds it (timestamps as epoch microseconds, dates as epoch days); None when one has a type delta-rs commits are
    not made for here (``SPARK_TYPES``). ``prefix`` reaches them inside a struct column (``"out."``)."""
    from pyspark.sql import functions as F

    from kappa.runtime.deltars import SPARK_TYPES

    columns, exprs = [], []
    for f in fields:
        kind = f.dataType.simpleString()
        if kind not in SPARK_TYPES:
            return None
        columns.append((f.name, kind))
        col = F.col(f"{prefix}`{f.name}`")
        exprs.append(F.unix_micros(col) if kind == "timestamp" else F.unix_date(col) if kind == "date" else col)
    return tuple(columns), tuple(exprs)


def collect_rows(frame: "DataFrame", limit: int = LIVE_ROWS) -> "Collected | None":
    """The rows of ``frame`` at the driver (:class:`kappa.runtime.deltars.Collected`), or None when it has more
    than ``limit`` or a column of a type delta-rs commits are not made for here (``SPARK_TYPES``)."""
    from kappa.runtime.deltars import Collected

    driver = _collect_selection(tuple(frame.schema.fields))
    if driver is None:
        return None
    columns, selection = driver
    rows = frame.select(*selection).limit(limit + 1).collect()
    if len(rows) > limit:
        return None
    return Collected(tuple(columns), [tuple(r) for r in rows])


@per_jvm
def _collect_selection(fields: "tuple[StructField, ...]",
                       ) -> "tuple[tuple[tuple[str, str], ...], tuple[Column, ...]] | None":
    """:func:`collect_rows`' columns for a frame of ``fields``: (name, type) and the expressions, named."""
    driver = _driver_columns(fields)
    if driver is None:
        return None
    columns, exprs = driver
    return columns, tuple(e.alias(name) for e, (name, _kind) in zip(exprs, columns))


@per_jvm
def _side_exprs(prefix: str = "") -> "tuple[Column, ...]":
    """The expressions collecting :data:`kappa.runtime.plan.SIDE_COLUMNS` as the quarantine's delta-rs appends take
    them (``kafka_timestamp`` as epoch microseconds); ``prefix`` reaches them inside a struct column."""
    from pyspark.sql import functions as F

    from kappa.runtime.plan import SIDE_COLUMNS

    return tuple(F.unix_micros(F.col(f"{prefix}{c}")) if c == "kafka_timestamp" else F.col(f"{prefix}{c}")
                 for c in SIDE_COLUMNS)


@per_jvm
def _split_selection(out_fields: "tuple[StructField, ...]",
                     ) -> "tuple[tuple[tuple[str, str], ...], tuple[Column, ...]] | None":
    """:func:`collect_split`'s columns for output columns ``out_fields``: (name, type) of each, and the tag, the
    output's expressions and the side row's, each named apart; None as :func:`_driver_columns`."""
    from pyspark.sql import functions as F

    from kappa.runtime.plan import KIND

    driver = _driver_columns(out_fields, "out.")
    if driver is None:
        return None
    columns, exprs = driver
    return columns, (F.col(KIND), *(e.alias(f"_{i}") for i, e in enumerate(exprs + _side_exprs("side."))))


def collect_split(batch: "DataFrame", output_columns: "Sequence[str]", limit: int = LIVE_ROWS, *,
                  out_fields: "Sequence[StructField] | None" = None,
                  ) -> "tuple[Collected, list[dict[str, Any]]] | None":
    """A stateful view's micro-batch (:func:`kappa.runtime.plan.stateful_plan`'s tagged rows) at the driver in one
    job: its output rows as :func:`collect_rows` gives them and its side rows as :meth:`QuarantineSink.collect`
    does. One pass computes the batch once - its state store written once, its metrics counted once - with nothing
    kept between two jobs. None, before any job, when an output column has a type :func:`collect_rows` refuses;
    after it, when there are more than ``limit`` output rows (the caller counts the log records first).
    ``out_fields``: the fields of the batch's ``out`` column when the caller knows them (else read from its
    schema, a call into the JVM)."""
    from kappa.runtime.deltars import Collected
    from kappa.runtime.plan import OUT, SIDE_COLUMNS

    if out_fields is None:
        out_fields = batch.schema["out"].dataType.fields
    fields = {f.name: f for f in out_fields}
    driver = _split_selection(tuple(fields[c] for c in output_columns))
    if driver is None:
        return None
    columns, selection = driver
    n = len(columns)
    out, bad = [], []
    for row in batch.select(*selection).collect():
        if row[0] == OUT:
            out.append(tuple(row[1:n + 1]))
        else:
            bad.append(dict(zip(SIDE_COLUMNS, row[n + 1:])))
    if len(out) > limit:
        return None
    return Collected(tuple(columns), out), bad


def _micros(value: Any) -> int:
    """Epoch microseconds of a timestamp as Spark's ``collect`` returns it (a naive datetime in this process' local
    time, or an aware one), or of epoch microseconds."""
    if isinstance(value, int):
        return value
    from pyspark.sql.types import TimestampType

    return int(TimestampType().toInternal(value))


def _timestamp(micros: int) -> Any:
    """The datetime Spark's ``collect`` returns for epoch microseconds (so both paths compare alike)."""
    from pyspark.sql.types import TimestampType

    return TimestampType().fromInternal(micros)


def _sql_ts(micros: int) -> str:
    """A UTC timestamp literal delta-rs' SQL (DataFusion) compares with a timestamp column."""
    from datetime import UTC, datetime, timedelta

    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)
    return f"'{moment.strftime('%Y-%m-%dT%H:%M:%S.%fZ')}'"


def _append_once(frame: "DataFrame", path: str, app_id: str, batch_id: int, user_metadata: str | None = None) -> None:
    """Append ``frame`` to the Delta table at ``path`` unless ``(app_id, batch_id)`` is already committed there."""
    writer = (frame.write.format("delta").mode("append").option("txnAppId", app_id)
              .option("txnVersion", batch_id))
    if user_metadata:
        writer = writer.option("userMetadata", user_metadata)
    writer.save(path)


@contextmanager
def _idempotent_dml(session: "SparkSession", app_id: str, batch_id: int, user_metadata: str | None) -> Iterator[None]:
    session.conf.set(_TXN_APP, app_id)
    session.conf.set(_TXN_VERSION, str(batch_id))
    if user_metadata:
        session.conf.set(_USER_METADATA, user_metadata)
    try:
        yield
    finally:
        session.conf.unset(_TXN_APP)
        session.conf.unset(_TXN_VERSION)
        session.conf.unset(_USER_METADATA)


def _passed(window_end: Any, event_max: Any, fin: Finality) -> bool:
    """Is a window ending at ``window_end`` final when the table's event-time maximum before the commit is
    ``event_max``?"""
    return event_max is not None and window_end.timestamp() <= event_max.timestamp() - fin.delay_seconds


def final_flag(fin: Finality, event_max: Any) -> "Column":
    """The finality flag of a row given the event-time maximum ``event_max`` of the batches before the commit."""
    from pyspark.sql import functions as F

    if event_max is None:
        return F.lit(False)
    return F.col(fin.window_end_column) <= F.lit(event_max) - F.expr(f"INTERVAL {fin.delay_seconds} SECONDS")


@dataclass
class DeltaSink:
    """Writes one view version's micro-batches into its Delta table, exactly once per batch id.

    Every batch id gets exactly one commit, also when it has nothing to write (an empty commit carries the
    batch's ``(appId, txnVersion)`` and lineage, so the table says which slice of the log it holds), and a batch
    that changes nothing rewrites nothing: an empty batch runs a MERGE only to close windows, a MERGE reads only
    the windows the batch touches, and it visits stored rows for finality only when they become final.
    """

    view: ViewDefinition
    path: str
    app_id: str
    #: staging table of bulk catch-up (None: every batch is written to the view table directly)
    staging: str | None = None
    #: the run's checkpoint has planned no micro-batch yet, so neither table can hold a commit of this run (the
    #: Delta snapshot that would say so is not read: a fresh replay starts sooner)
    fresh: bool = False
    #: a bounded run of a stateful view (``availableNow``): while it may stage, a batch that wrote rows is staged
    #: too, and compacted with the batch after it - the no-data batch Spark runs once the watermark moved, whose
    #: rows (or finality: the windows that batch closes) go into the same single append instead of a MERGE of its
    #: own. A run whose last batch was staged is compacted when its query ends (:meth:`ViewJob._settle`).
    stage_rows: bool = False
    _event_max: Any = field(default=None, init=False, repr=False)
    _event_max_known: bool = field(default=False, init=False, repr=False)
    _bulk: bool | None = field(default=None, init=False, repr=False)
    #: distinct window ends of the stored rows that are not final yet (None: not known, read from the table)
    _open_ends: set | None = field(default=None, init=False, repr=False)
    #: the last batch id the table holds a commit of (None: not known yet, read from the table once)
    _last_batch: int | None = field(default=None, init=False, repr=False)
    #: live batches of at most LIVE_ROWS rows are committed through delta-rs (``KAPPA_LIVE_COMMITS``)
    live_rs: bool = True
    _rs: Any = field(default=None, init=False, repr=False)

    def bulk(self, session: "SparkSession") -> bool:
        """True while this run may still stage batches: it has a staging table, its view is not append-only and
        the view table has no commit of this run yet (asked once, then tracked in memory)."""
        if self._bulk is None:
            self._bulk = (self.staging is not None and self.view.write != "append"
                          and (self.fresh or txn_version(session, self.path, self.app_id) is None))
        return self._bulk

    def pending(self, session: "SparkSession") -> int | None:
        """Batch id of the last staged batch not yet compacted into the view table (None: nothing pending)."""
        from delta.tables import DeltaTable

        if self.fresh or not self.bulk(session) or not DeltaTable.isDeltaTable(session, self.staging):
            return None
        return txn_version(session, self.staging, self.app_id)

    def live(self, session: "SparkSession") -> bool:
        """Are this run's batches committed through delta-rs when they are small (not staged, path on)?"""
        return self.live_rs and not self.bulk(session)

    def write(self, batch: "DataFrame", batch_id: int, *, user_metadata: str | None = None,
              rows: int | None = None, batch_event_max: Any = None, window_ends: frozenset | None = None,
              catching_up: bool = False, collected: "Collected | None" = None) -> str:
        """Apply ``batch`` (the transform's output for ``batch_id``) in a single idempotent commit.

        Args:
            batch: the output rows of the micro-batch (persisted by the caller).
            batch_id: the micro-batch id (the Delta txnVersion).
            user_metadata: the commit's ``userMetadata`` (the batch's log range, see :mod:`kappa.runtime.lineage`).
            rows: number of rows in ``batch`` when the caller counted them (``None``: not known).
            batch_event_max: max of the finality's event-time column over ``batch`` (windowed views).
            window_ends: the distinct window ends of ``batch`` (windowed views; ``None``: not known).

            catching_up: the batch stopped at the micro-batch bound with more of the log waiting; while the run
                has no commit in the view table yet, it is staged instead of merged (see the module doc).
            collected: ``batch``'s rows collected to the driver (:func:`collect_rows`): the commit goes through
                delta-rs (live batches; see the module doc).

        Returns what the commit did: ``append``, ``merge``, ``empty`` (a commit without data files), ``close``
        (an empty batch's MERGE that only flags stored windows final), ``skip`` (a merged batch Spark runs
        again: the table holds its commit already), ``stage``
        (appended to the staging table) or ``compact`` (the staged batches and this one, in one append).
        """
        if self.bulk(batch.sparkSession):
            if catching_up or (self.stage_rows and bool(rows)):
                self._stage(batch, batch_id, user_metadata)
                return "stage"
            self.compact(batch.sparkSession, batch_id, user_metadata, batch=batch)
            return "compact"
        if collected is not None and self.live_rs:
            try:
                done = self._write_rs(batch.sparkSession, collected, batch_id, user_metadata, batch_event_max,
                                      window_ends)
            except BaseException:
                # its commit may have landed before the error (delta-rs checks no txn itself): what this sink knew
                # of the table is read from it again at the batch's next attempt
                self._last_batch, self._event_max_known, self._open_ends = None, False, None
                raise
            if done is not None:
                return done
        if self.view.write == "append":
            self._append(batch, batch_id, user_metadata)
            return "append" if rows != 0 else "empty"
        if self.view.write == "merge":
            return self._merge(batch, batch_id, user_metadata, rows, batch_event_max, window_ends)
        if self.view.write == "upsert_delete":
            if rows == 0:
                self._append(batch, batch_id, user_metadata)
                return "empty"
            self._upsert_delete(batch, batch_id, user_metadata)
            return "merge"
        raise ValueError(f"unknown write mode {self.view.write!r}")  # pragma: no cover - Literal type

    def _stage(self, batch: "DataFrame", batch_id: int, user_metadata: str | None) -> None:
        from pyspark.sql import functions as F

        _append_once(batch.withColumn(STAGED_BATCH, F.lit(batch_id).cast("bigint")), self.staging, self.app_id,
                     batch_id, user_metadata)
        self.fresh = False  # the staging table holds a commit of this run now: pending() must look

    def compact(self, session: "SparkSession", batch_id: int, user_metadata: str | None, *,
                batch: "DataFrame | None" = None) -> None:
        """End bulk catch-up: write the latest row per key of the staged batches (and ``batch``) to the view table
        in one append commit keyed by ``batch_id``; later batches win, tombstones are dropped, finality follows
        the event-time maximum of everything staged. Called with the first batch that is not a catch-up batch,
        or without a batch (``batch_id`` = the last staged one) at the end of a bounded run and at a restart."""
        from delta.tables import DeltaTable
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        from kappa.runtime.spark import computed_once

        parts = []
        if DeltaTable.isDeltaTable(session, self.staging):
            parts.append(session.read.format("delta").load(self.staging))
        if batch is not None:
            parts.append(batch.withColumn(STAGED_BATCH, F.lit(batch_id).cast("bigint")))
        if not parts:
            raise ValueError(f"{self.view.ref}: nothing to compact")
        rows = parts[0]
        for part in parts[1:]:
            rows = rows.unionByName(part)
        order = [F.col(STAGED_BATCH).desc()]
        if self.view.write == "upsert_delete" and self.view.order_column:
            order.append(F.col(self.view.order_column).desc())
        by_key = Window.partitionBy(*self.view.keys)
        fin = self.view.finality
        if fin is not None:
            # the event-time maxima of each key's rows - of all its staged rows, and of those before the last batch
            # compacted - ride along the same window (no second pass over the staged rows); their maxima over the
            # latest rows are the maxima over every staged row
            rows = (rows.withColumn("_max", F.max(fin.event_max_column).over(by_key))
                    .withColumn("_before", F.max(F.when(F.col(STAGED_BATCH) < batch_id,
                                                         F.col(fin.event_max_column))).over(by_key)))
        latest = (rows.withColumn("_rn", F.row_number().over(by_key.orderBy(*order)))
                  .where("_rn = 1").drop("_rn", STAGED_BATCH))
        if self.view.write == "upsert_delete":
            latest = latest.where(~F.col("is_tombstone"))
        event_max, open_ends = None, None
        with computed_once(latest) if fin is not None else nullcontext(latest) as result:
            if fin is not None:
                # finality from the batches before the last one compacted, as a MERGE of it would have set it; when
                # nothing came before it (a replay's one batch), no row is final: the open windows are all the ends,
                # collected in the same pass (the next batch's close needs them; else it reads them from the table)
                before, event_max, ends = result.agg(
                    F.max("_before"), F.max("_max"),
                    F.collect_set(F.when(F.col("_before").isNull(), F.col(fin.window_end_column)))).collect()[0]
                open_ends = set(ends) if before is None else None
                result = result.drop("_before", "_max").withColumn(fin.flag_column, final_flag(fin, before))
            self._append(result, batch_id, user_metadata)
        self._event_max, self._event_max_known, self._bulk, self._open_ends = event_max, True, False, open_ends
        self._last_batch = batch_id

    def _append(self, batch: "DataFrame", batch_id: int, user_metadata: str | None) -> None:
        columns = table_columns(self.view, batch.schema).fieldNames()
        _append_once(batch.select(*columns), self.path, self.app_id, batch_id, user_metadata)

    def _table(self, session: "SparkSession"):
        from delta.tables import DeltaTable

        return DeltaTable.forPath(session, self.path)

    def _cond(self) -> str:
        return " AND ".join(f"t.`{k}` <=> s.`{k}`" for k in self.view.keys)

    def _merge(self, batch: "DataFrame", batch_id: int, user_metadata: str | None, rows: int | None,
               batch_event_max: Any, window_ends: frozenset | None = None) -> str:
        from pyspark.sql import functions as F

        session = batch.sparkSession
        fin = self.view.finality
        if self._committed(session, batch_id):
            # Spark runs a batch again after a crash or a failure between the Delta commit and its checkpoint
            # commit: Delta would skip the commit, and the state kept in memory must not move as if it happened
            return "skip"
        if fin is None:
            if rows == 0:
                self._append(batch, batch_id, user_metadata)
                return "empty"
            self._run_merge(batch, batch_id, user_metadata, F.expr(self._cond()))
            self._last_batch = batch_id
            return "merge"
        # the flag of this commit: windows ending at or before the maximum of the batches before it, minus the delay
        previous_max = self._known_event_max(session, fin)
        source = batch.withColumn(fin.flag_column, final_flag(fin, previous_max))
        closing = self._closing(session, fin, previous_max)
        if rows == 0 and closing is None:  # nothing to upsert and nothing becomes final: an empty commit
            self._append(source, batch_id, user_metadata)
            self._last_batch = batch_id
            return "empty"
        if rows is None or (rows and (batch_event_max is None or window_ends is None)):
            batch_event_max, low = source.agg(F.max(fin.event_max_column), F.min(fin.window_end_column)).collect()[0]
        else:
            low = min(window_ends) if window_ends else None
        cond = F.expr(self._cond())
        if low is not None:  # a target-only bound Delta skips files with: the stored rows this batch can match
            cond = cond & (F.col(f"t.`{fin.window_end_column}`") >= F.lit(low))
        else:  # an empty batch: it matches no stored row
            cond = cond & F.lit(False)
        self._run_merge(source, batch_id, user_metadata, cond, closing)
        self._merged(batch_id, fin, previous_max, batch_event_max, window_ends)
        return "close" if rows == 0 else "merge"

    def _merged(self, batch_id: int, fin: Finality, previous_max: Any, batch_event_max: Any,
                window_ends: frozenset | None) -> None:
        """What a windowed view's sink carries forward once a batch's MERGE went through (either engine): the
        table's event-time maximum and the ends of its windows still open."""
        self._last_batch = batch_id
        self._event_max = max((t for t in (previous_max, batch_event_max) if t is not None), default=None)
        if window_ends is None or self._open_ends is None:
            self._open_ends = None
        else:
            self._open_ends = {end for end in self._open_ends | window_ends if not _passed(end, previous_max, fin)}

    def _committed(self, session: "SparkSession", batch_id: int) -> bool:
        """Does the table already hold this run's commit of ``batch_id``? Asked of the table once per sink (a
        restarted driver runs its last batch again), then known from the commits this sink made."""
        if self._last_batch is None:
            if self.live_rs:  # the same txn action, read natively (no Spark job)
                table = self._rs_table()
                table.update_incremental()
                last = table.transaction_version(self.app_id)
            else:
                last = txn_version(session, self.path, self.app_id)
            self._last_batch = -1 if last is None else last
        return batch_id <= self._last_batch

    # ----------------------------------------------------------------------------------- live, through delta-rs
    def _rs_table(self) -> Any:
        if self._rs is None:
            from deltalake import DeltaTable as RsTable

            from kappa.runtime.deltars import rs_uri

            self._rs = RsTable(rs_uri(self.path))
        return self._rs

    def _rs_keys(self) -> str:
        return " AND ".join(f'(t."{k}" IS NOT DISTINCT FROM s."{k}")' for k in self.view.keys)

    def _rs_empty(self, table: Any, batch_id: int, user_metadata: str | None) -> None:
        """A commit without data files carrying the batch's txn and lineage."""
        import arro3.core as ac

        def empty(dtype: Any) -> Any:
            try:
                return ac.Array([], dtype)
            except NotImplementedError:  # timestamps, dates: arro3 builds them by casting integers
                return ac.Array([], ac.DataType.int64()).cast(dtype)

        schema = table.schema().to_arrow()
        self._rs_append(table, ac.Table.from_arrays([empty(f.type) for f in schema], schema=schema), batch_id,
                        user_metadata)

    def _rs_append(self, table: Any, data: Any, batch_id: int, user_metadata: str | None) -> None:
        """``append_once`` of ``batch_id``: the table is asked whether it holds it only while this sink does not
        know (its first commit, or after a write that raised: :meth:`write`)."""
        from kappa.runtime.deltars import append_once

        append_once(table, data, self.app_id, batch_id, user_metadata, last=self._last_batch)
        self._last_batch = max(batch_id, self._last_batch if self._last_batch is not None else -1)

    def _write_rs(self, session: "SparkSession", rows: "Collected", batch_id: int, user_metadata: str | None,
                  batch_event_max: Any, window_ends: frozenset | None) -> str | None:
        """:meth:`write` of a live batch through delta-rs; None when the table has a column the rows lack (the
        Spark path writes it then)."""
        from kappa.runtime.deltars import Collected

        table = self._rs_table()
        names = [f.name for f in table.schema().fields]
        fin = self.view.finality
        have = {name for name, _type in rows.columns} | ({fin.flag_column} if fin is not None else set())
        if not set(names) <= have:
            return None
        if self.view.write == "append":
            self._rs_append(table, rows.arrow(names=names), batch_id, user_metadata)
            return "append" if rows.rows else "empty"
        if self._committed(session, batch_id):
            return "skip"  # as in _merge: the state kept in memory must not move as if it happened twice
        # the table's log as it is now: a repair's swap (kappa.runtime.repairs) commits through delta-spark between
        # this driver's commits, and a MERGE planned on an older version fails delta-rs' conflict check
        table.update_incremental()
        if not rows.rows and (fin is None or self.view.write != "merge"):
            self._rs_empty(table, batch_id, user_metadata)
            return "empty"
        if self.view.write == "upsert_delete":
            self._rs_upsert_delete(table, rows, names, batch_id, user_metadata)
            self._last_batch = batch_id
            return "merge"
        if fin is None:
            self._rs_merge(table, rows.arrow(names=names), self._rs_keys(), batch_id, user_metadata)
            self._last_batch = batch_id
            return "merge"
        previous_max = self._known_event_max(session, fin)
        prev = None if previous_max is None else _micros(previous_max)
        bound = None if prev is None else prev - int(fin.delay_seconds * 1_000_000)
        end_at = rows.index(fin.window_end_column)
        flags = [bound is not None and row[end_at] is not None and row[end_at] <= bound for row in rows.rows]
        if fin.flag_column in dict(rows.columns):
            at = rows.index(fin.flag_column)
            source = Collected(rows.columns, [(*row[:at], f, *row[at + 1:]) for row, f in zip(rows.rows, flags)])
        else:
            source = Collected((*rows.columns, (fin.flag_column, "boolean")),
                               [(*row, f) for row, f in zip(rows.rows, flags)])
        passed = self._passed_ends(session, fin, previous_max)
        if not rows.rows and not passed:  # nothing to upsert and nothing becomes final: an empty commit
            self._rs_empty(table, batch_id, user_metadata)
            return "empty"
        if rows.rows and (batch_event_max is None or window_ends is None):
            emax = [v for v in rows.values(fin.event_max_column) if v is not None]
            batch_event_max = _timestamp(max(emax)) if emax else None
            window_ends = frozenset(_timestamp(v) for v in rows.values(fin.window_end_column) if v is not None)
        low = min(_micros(end) for end in window_ends) if rows.rows and window_ends else None
        if passed:
            first = min(_micros(e) for e in passed)
            source = self._rs_closing(table, source, fin, first, bound)
            low = first if low is None else min(low, first)
        if not source.rows:  # the windows it would close hold no stored row: nothing to write
            self._rs_empty(table, batch_id, user_metadata)
            self._merged(batch_id, fin, previous_max, batch_event_max, window_ends)
            return "empty"
        cond = self._rs_keys() + f' AND t."{fin.window_end_column}" >= {_sql_ts(low)}'
        self._rs_merge(table, source.arrow(names=names), cond, batch_id, user_metadata)
        self._merged(batch_id, fin, previous_max, batch_event_max, window_ends)
        return "close" if not rows.rows else "merge"

    def _rs_closing(self, table: Any, source: "Collected", fin: Finality, first: int, bound: int) -> "Collected":
        """``source`` and the stored rows this commit makes final that the batch does not carry, flagged final.

        They are read from the table's open windows (a windowed MERGE view's table is partitioned by the flag:
        :attr:`kappa.runtime.view.ViewDefinition.table_partitions`, so this reads the few files of the open
        partition) and travel in the MERGE's source: its matched update moves them to the final partition. A
        ``WHEN NOT MATCHED BY SOURCE`` clause would do the same in the MERGE itself, but delta-rs then reads and
        conflict-checks every file of the table at every commit.
        """
        from kappa.runtime.deltars import Collected, arrow_to_rows, collected_value

        end = f'"{fin.window_end_column}"'
        stored = arrow_to_rows(table.scan(predicate=f'NOT "{fin.flag_column}" AND {end} >= {_sql_ts(first)} '
                                                    f"AND {end} <= {_sql_ts(bound)}").read_all())
        keys = [source.index(k) for k in self.view.keys]
        carried = {tuple(row[i] for i in keys) for row in source.rows}
        closing = []
        for stored_row in stored:
            row = tuple(True if name == fin.flag_column else collected_value(stored_row.get(name), kind)
                        for name, kind in source.columns)
            if tuple(row[i] for i in keys) not in carried:
                closing.append(row)
        return Collected(source.columns, source.rows + closing) if closing else source

    def _rs_merge(self, table: Any, source: Any, cond: str, batch_id: int, user_metadata: str | None) -> None:
        from kappa.runtime.deltars import LIVE_HOOKS, after_commit, commit_properties

        (table.merge(source, predicate=cond, source_alias="s", target_alias="t", post_commithook_properties=LIVE_HOOKS,
                     commit_properties=commit_properties(self.app_id, batch_id, user_metadata))
         .when_matched_update_all().when_not_matched_insert_all().execute())
        after_commit(table)

    def _rs_upsert_delete(self, table: Any, rows: "Collected", names: list[str], batch_id: int,
                          user_metadata: str | None) -> None:
        """The latest row per key (by the order column), deleted when it is a tombstone, else upserted."""
        from kappa.runtime.deltars import LIVE_HOOKS, after_commit, commit_properties

        if not self.view.order_column:
            raise ValueError(f"{self.view.ref}: upsert_delete needs order_column")
        keys = [rows.index(k) for k in self.view.keys]
        order = rows.index(self.view.order_column)
        latest: dict[tuple, tuple] = {}
        for row in rows.rows:
            key = tuple(row[i] for i in keys)
            seen = latest.get(key)
            if seen is None or (row[order] is not None and (seen[order] is None or row[order] > seen[order])):
                latest[key] = row
        source = rows.arrow(list(latest.values()), names=[*names, "is_tombstone"])
        values = {c: f's."{c}"' for c in names}
        (table.merge(source, predicate=self._rs_keys(), source_alias="s", target_alias="t",
                     post_commithook_properties=LIVE_HOOKS,
                     commit_properties=commit_properties(self.app_id, batch_id, user_metadata))
         .when_matched_delete(predicate="s.is_tombstone")
         .when_matched_update(updates=values, predicate="NOT s.is_tombstone")
         .when_not_matched_insert(updates=values, predicate="NOT s.is_tombstone")
         .execute())
        after_commit(table)

    def _run_merge(self, source: "DataFrame", batch_id: int, user_metadata: str | None, cond: "Column",
                   closing: "Column | None" = None) -> None:
        from pyspark.sql import functions as F

        merge = (self._table(source.sparkSession).alias("t").merge(source.alias("s"), cond)
                 .whenMatchedUpdateAll().whenNotMatchedInsertAll())
        if closing is not None:
            merge = merge.whenNotMatchedBySourceUpdate(condition=closing,
                                                       set={self.view.finality.flag_column: F.lit(True)})
        with _idempotent_dml(source.sparkSession, self.app_id, batch_id, user_metadata):
            merge.execute()

    def _closing(self, session: "SparkSession", fin: Finality, previous_max: Any) -> "Column | None":
        """The condition of the stored rows this commit makes final, or None when it closes none.

        The ends of the open windows are read from the table once, then tracked in memory from each batch's
        window ends; a tumbling window view closes a window every window length, not every batch. The condition
        is bounded below by the earliest end it closes (a target-only predicate Delta skips files with).
        """
        from pyspark.sql import functions as F

        passed = self._passed_ends(session, fin, previous_max)
        if not passed:
            return None
        end = F.col(f"t.`{fin.window_end_column}`")
        return (~F.col(f"t.`{fin.flag_column}`") & (end >= F.lit(min(passed)))
                & (end <= F.lit(previous_max) - F.expr(f"INTERVAL {fin.delay_seconds} SECONDS")))

    def _passed_ends(self, session: "SparkSession", fin: Finality, previous_max: Any) -> list:
        """The ends of the open windows this commit makes final (read from the table once, then tracked)."""
        from pyspark.sql import functions as F

        if previous_max is None:
            return []
        if self._open_ends is None:
            stored = self._table(session).toDF().where(~F.col(fin.flag_column))
            self._open_ends = {r[0] for r in stored.select(fin.window_end_column).distinct().collect()}
        return [end for end in self._open_ends if _passed(end, previous_max, fin)]

    def _known_event_max(self, session: "SparkSession", fin: Finality) -> Any:
        """max(event_max_column) of the table: read once per driver, then carried forward in memory.

        Taken before a commit, it bounds that commit's finality: a window ending at or before it minus the delay
        is final (the watermark that filters the next batch's late rows; see **Finality** in the module doc).
        """
        from pyspark.sql import functions as F

        if not self._event_max_known:
            self._event_max = self._table(session).toDF().agg(F.max(fin.event_max_column)).collect()[0][0]
            self._event_max_known = True
        return self._event_max

    def _upsert_delete(self, batch: "DataFrame", batch_id: int, user_metadata: str | None) -> None:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        if not self.view.order_column:
            raise ValueError(f"{self.view.ref}: upsert_delete needs order_column")
        latest = (
            batch.withColumn("_rn", F.row_number().over(
                Window.partitionBy(*self.view.keys).orderBy(F.col(self.view.order_column).desc())))
            .where("_rn = 1").drop("_rn")
        )
        session = batch.sparkSession
        columns = {c: f"s.`{c}`" for c in table_columns(self.view, batch.schema).fieldNames()}
        with _idempotent_dml(session, self.app_id, batch_id, user_metadata):
            (self._table(session).alias("t").merge(latest.alias("s"), self._cond())
             .whenMatchedDelete(condition="s.is_tombstone")
             .whenMatchedUpdate(condition="NOT s.is_tombstone", set=columns)
             .whenNotMatchedInsert(condition="NOT s.is_tombstone", values=columns)
             .execute())


@dataclass
class QuarantineSink:
    """Appends a micro-batch's bad records to the shared quarantine table, exactly once per (view run, batch).

    ``rows`` are records with the columns of :data:`kappa.runtime.plan.SIDE_COLUMNS`; the commit's appId is the view
    run's appId plus ``/quarantine`` and its txnVersion the micro-batch id of the view's query.

    The rows are few next to the batch (bad and late records); they are collected to the driver and appended
    with delta-rs (:func:`kappa.runtime.deltars.append_once`): the same Delta application transaction as delta-spark's
    ``txnAppId``, without the Spark job delta-spark runs to reconstruct the table's state on every idempotent
    commit - on ``make run`` that job was as costly as the view's own commit (docs/performance.md).
    """

    view: ViewDefinition
    path: str
    app_id: str
    _table: Any = field(default=None, init=False, repr=False)
    #: the last batch this sink knows the table holds (asked once, then its own commits: ``append_once``'s ``last``)
    _last: int | None = field(default=None, init=False, repr=False)

    def write(self, rows: "DataFrame", batch_id: int) -> int:
        """Append ``rows`` for micro-batch ``batch_id`` unless that batch's commit is already in the table.

        Returns the number of records the batch quarantines (also when its commit was already there).
        """
        return self.append(self.collect(rows), batch_id)

    @staticmethod
    def collect(rows: "DataFrame") -> list[dict[str, Any]]:
        """The records of ``rows`` (the columns of :data:`kappa.runtime.plan.SIDE_COLUMNS`) at the driver."""
        from kappa.runtime.plan import SIDE_COLUMNS

        return [dict(zip(SIDE_COLUMNS, r)) for r in rows.select(*_side_exprs()).collect()]

    def append(self, collected: list[dict[str, Any]], batch_id: int) -> int:
        """:meth:`write` of records already collected (:meth:`collect`)."""
        from datetime import UTC, datetime

        from deltalake import DeltaTable

        from kappa.runtime.deltars import append_once, arrow_rows, rs_uri, to_micros

        now = to_micros(datetime.now(UTC))
        records = [{**r, "view": self.view.name, "version": self.view.version, "batch_id": batch_id,
                    "quarantined_at": now} for r in collected]
        if self._table is None:
            self._table = DeltaTable(rs_uri(self.path))
        try:
            append_once(self._table, arrow_rows(QUARANTINE_COLUMNS, records), self.app_id, batch_id, last=self._last)
        except BaseException:
            self._last = None  # the commit may have landed before the error: ask the table next time
            raise
        self._last = batch_id if self._last is None else max(self._last, batch_id)
        return len(records)

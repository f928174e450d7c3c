"""The lake through delta-rs (no JVM): Arrow rows in and out, local paths, idempotent appends.

Used by the control plane (registry, serving alias, queries) and by the one data-plane write that does not need
Spark: the quarantine append of a micro-batch (:class:`kappa.runtime.sink.QuarantineSink`). delta-rs loads a table's
snapshot natively in milliseconds, where delta-spark reconstructs it with a Spark job on every idempotent commit
(``txnVersion`` -> ``Snapshot.computedState``), measured at 0.98 CPU-s per append against 0.014 here
(docs/performance.md).

**Idempotent appends** (:func:`append_once`) follow the Delta protocol's application transactions, the same
mechanism delta-spark's ``txnAppId``/``txnVersion`` options use: the commit carries ``txn(appId, version)``, and a
version at or below the one recorded is skipped. Blind appends of different appIds commute, so concurrent writers
of one table (every view's quarantine) simply retry on the next log version (delta-rs' conflict checker). On S3,
delta-rs 1.x commits with conditional writes (``If-None-Match``), so several drivers may append to one table
there too; the tables it appends to are never committed to by delta-spark after their creation.

**Two writers on a local table.** Spark's Hadoop ``file:`` file system keeps a checksum sidecar
(``._last_checkpoint.crc``) beside each file it writes; delta-rs rewrites ``_last_checkpoint`` without it, and a
stale sidecar makes Spark's reader fail the checksum, sleep, retry and fall back to listing the log. After a
delta-rs commit on a local table the sidecar is removed (:func:`drop_stale_checksum`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Iterable

import arro3.core as ac
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction, write_deltalake

__all__ = ["BIN", "CHECKPOINT_INTERVAL", "Collected", "SPARK_TYPES", "I32", "I64", "LIVE_HOOKS", "SQL_TYPES", "STR",
           "TS", "after_commit", "append_once", "collected_value", "commit_properties", "committed", "arrow_rows",
           "arrow_schema", "arrow_to_rows", "create_table", "drop_stale_checksum", "is_local_uri", "local_path",
           "read_rows", "rs_uri", "start_from_checkpoint", "to_micros"]

log = logging.getLogger(__name__)

TS = ac.DataType.timestamp("us", tz="UTC")
STR = ac.DataType.string()
I64 = ac.DataType.int64()
I32 = ac.DataType.int32()
BIN = ac.DataType.binary()

#: Arrow type of each Spark SQL type name the platform's delta-rs tables use.
SQL_TYPES = {"STRING": STR, "INT": I32, "BIGINT": I64, "TIMESTAMP": TS, "BINARY": BIN}


def is_local_uri(uri: str) -> bool:
    """True for plain paths and ``file:`` URIs (False for ``s3a://``, ``abfss://``...)."""
    return "://" not in uri or uri.startswith("file:")


def local_path(uri: str) -> str:
    """Filesystem path of a local URI (``file:///x`` / ``file:/x`` -> ``/x``)."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if uri.startswith("file:"):
        return uri[len("file:"):]
    return uri


def rs_uri(uri: str) -> str:
    """The URI delta-rs opens for a lake URI Spark opens (a local path; ``s3a://`` is ``s3://`` there)."""
    if is_local_uri(uri):
        return local_path(uri)
    return "s3://" + uri[len("s3a://"):] if uri.startswith("s3a://") else uri


def to_micros(value: datetime | None) -> int | None:
    """Microseconds since the epoch of a timezone-aware datetime (``ValueError`` for a naive one)."""
    if value is None:
        return None
    if value.tzinfo is None:
        raise ValueError(f"timestamp {value.isoformat()} has no time zone (use UTC)")
    delta = value - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _array(values: list[Any], dtype: Any) -> Any:
    if dtype == TS:  # arro3 cannot build timestamps from datetimes: go through int64 microseconds
        return ac.Array([v if v is None or isinstance(v, int) else to_micros(v) for v in values], I64).cast(TS)
    return ac.Array(values, dtype)


def arrow_schema(columns: Iterable[tuple[str, Any]]) -> Any:
    return ac.Schema([ac.Field(name, dtype, True) for name, dtype in columns])


def arrow_rows(columns: tuple[tuple[str, Any], ...], rows: list[dict[str, Any]],
               extra: tuple[tuple[str, Any], ...] = ()) -> Any:
    """An Arrow table of ``rows`` (dicts) with the typed ``columns`` (+ ``extra``); timestamps may be given as
    timezone-aware datetimes or as epoch microseconds."""
    cols = columns + extra
    arrays = [_array([r.get(name) for r in rows], dtype) for name, dtype in cols]
    return ac.Table.from_arrays(arrays, schema=arrow_schema(cols))


#: Arrow type of each Spark type a view's rows may have, by Spark's type name (the rows of a micro-batch committed
#: through delta-rs: :class:`Collected`); timestamps and dates travel as epoch microseconds and days.
SPARK_TYPES = {"string": STR, "int": I32, "bigint": I64, "smallint": ac.DataType.int16(),
               "tinyint": ac.DataType.int8(), "boolean": ac.DataType.bool(), "double": ac.DataType.float64(),
               "float": ac.DataType.float32(), "binary": BIN, "timestamp": TS, "date": ac.DataType.date32()}


@dataclass(frozen=True)
class Collected:
    """A micro-batch's rows collected to the driver: ``columns`` (name, Spark type name) and the rows as tuples in
    that order, timestamps as epoch microseconds (UTC) and dates as epoch days."""

    columns: tuple[tuple[str, str], ...]
    rows: list[tuple]

    def index(self, name: str) -> int:
        return [c for c, _type in self.columns].index(name)

    def values(self, name: str) -> list[Any]:
        i = self.index(name)
        return [row[i] for row in self.rows]

    def arrow(self, rows: list[tuple] | None = None, *, names: list[str] | None = None) -> Any:
        """An Arrow table of ``rows`` (default: all) with the columns ``names`` (default: all), typed."""
        rows = self.rows if rows is None else rows
        names = names or [c for c, _type in self.columns]
        types = dict(self.columns)
        fields, arrays = [], []
        for name in names:
            i, dtype = self.index(name), SPARK_TYPES[types[name]]
            values = [row[i] for row in rows]
            if dtype == TS:
                array = ac.Array(values, I64).cast(TS)
            elif types[name] == "date":
                array = ac.Array(values, I32).cast(dtype)
            else:
                array = ac.Array(values, dtype)
            arrays.append(array)
            fields.append(ac.Field(name, dtype, True))
        return ac.Table.from_arrays(arrays, schema=ac.Schema(fields))


def collected_value(value: Any, kind: str) -> Any:
    """A value read from a table (:func:`arrow_to_rows`) as :class:`Collected` holds one of Spark type ``kind``."""
    if value is None:
        return None
    if kind == "timestamp":
        return to_micros(value)
    if kind == "date":
        return (value - date(1970, 1, 1)).days
    return value


def _utc(value: Any) -> Any:
    return value.astimezone(UTC) if isinstance(value, datetime) else value


def read_rows(table: DeltaTable) -> list[dict[str, Any]]:
    """Every row of a (small) Delta table as dicts, timestamps in UTC."""
    return arrow_to_rows(table.scan().read_all())


def arrow_to_rows(data: Any) -> list[dict[str, Any]]:
    """The rows of an Arrow table as dicts, timestamps in UTC."""
    names = list(data.column_names)
    columns = [[_utc(v) for v in data.column(i).to_pylist()] for i in range(len(names))]
    return [dict(zip(names, values)) for values in zip(*columns)]


def create_table(uri: str, columns: tuple[tuple[str, Any], ...], *, partition_by: tuple[str, ...] = (),
                 storage_options: dict[str, str] | None = None, properties: dict[str, str] | None = None) -> None:
    """Create an empty Delta table at ``uri`` (with the table ``properties``) unless one exists, with delta-rs (its
    first commit is a conditional put on object stores: of several processes creating it at once, one wins and the
    others use its table).

    The creation commit is never retried at a later log version: delta-rs would otherwise commit a losing creator's
    table as version 1 - a second ``CREATE TABLE`` replacing the winner's metadata (seen with 4 processes on an
    object store); the loser's commit fails instead and it uses the table that exists."""
    from deltalake.exceptions import CommitFailedError, DeltaError

    if DeltaTable.is_deltatable(uri, storage_options):
        return
    if is_local_uri(uri):
        Path(local_path(uri)).mkdir(parents=True, exist_ok=True)
    try:
        DeltaTable.create(uri, arrow_schema(columns), mode="ignore", partition_by=list(partition_by) or None,
                          storage_options=storage_options, configuration=properties or None,
                          commit_properties=CommitProperties(max_commit_retries=0))
    except (CommitFailedError, DeltaError):
        # a concurrent creator committed version 0 first: fine as long as the table now exists
        if not DeltaTable.is_deltatable(uri, storage_options):
            raise


def drop_stale_checksum(uri: str) -> None:
    """Remove the Hadoop checksum sidecar of ``_last_checkpoint`` that a delta-rs checkpoint left stale (local)."""
    if is_local_uri(uri):
        Path(local_path(uri), "_delta_log", "._last_checkpoint.crc").unlink(missing_ok=True)


#: A table written through delta-rs gets a checkpoint every this many commits (delta-spark's own interval; delta-rs
#: alone checkpoints every 100): readers - Spark's included - replay at most this many commit files.
CHECKPOINT_INTERVAL = 20


#: The post-commit hooks of the live commits (:func:`append_once`, a view's MERGEs): no checkpoint -
#: :func:`after_commit` writes one every :data:`CHECKPOINT_INTERVAL` commits - and no clean-up of the expired log,
#: which the table's upkeep does (:mod:`kappa.runtime.upkeep`). delta-rs' clean-up lists ``_delta_log`` and stats
#: every file in it after every commit: on a local disk 24 of a 40 ms append once the log held 3,300 files.
LIVE_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


def commit_properties(app_id: str, version: int, user_metadata: str | None = None) -> CommitProperties:
    """A commit carrying ``txn(app_id, version)`` and, as delta-spark writes it, ``commitInfo.userMetadata``."""
    return CommitProperties(app_transactions=[Transaction(app_id, version)],
                            custom_metadata={"userMetadata": user_metadata} if user_metadata else None)


def committed(table: DeltaTable, app_id: str, version: int) -> bool:
    """Has ``table`` (brought up to date incrementally) recorded ``version`` or a later one for ``app_id``?"""
    table.update_incremental()
    done = table.transaction_version(app_id)
    return done is not None and done >= version


def after_commit(table: DeltaTable, *, rebase: bool = True) -> None:
    """After a commit through ``table`` (which delta-rs left at that commit's version): a checkpoint when the version
    is a multiple of :data:`CHECKPOINT_INTERVAL` (whichever writer commits it writes it), the handle then started
    again from it (:func:`start_from_checkpoint`; ``rebase=False`` only to measure without); drop the stale
    checksum sidecar a checkpoint leaves. Between checkpoints it lists nothing: a listing of ``_delta_log`` reads
    every file name in it on a local disk (1 ms per 1,000 files)."""
    version = table.version()
    if version % CHECKPOINT_INTERVAL == 0:
        table.create_checkpoint()
        drop_stale_checksum(table.table_uri)
        if rebase and version > 0:
            start_from_checkpoint(table, version)


def start_from_checkpoint(table: DeltaTable, version: int) -> None:
    """Make ``table``, which has just written the checkpoint of ``version``, hold its state as that checkpoint.

    delta-rs keeps a handle's state as the checkpoint it was loaded from plus every commit since, and moves that
    base only when an update finds a checkpoint newer than the handle's version - never for the checkpoints the
    handle writes itself. A long-lived writer's every commit then grew with its age (one handle appending to a
    table: 10 ms a commit in its first 100, 60 ms after 600; brought up to date before each, as a MERGE is, 14 ->
    102 ms after 1,000), whichever writer of a shared table wrote the checkpoints paid so on every commit, and the
    others did not (``make bench-log``). Loaded at the version before and brought up to date, the handle finds the
    checkpoint ahead of it and starts from it. A load that fails (the log's clean-up under it) leaves the handle
    brought up to date as it was."""
    try:
        table.load_as_version(version - 1)
    except Exception as exc:  # noqa: BLE001 - the handle stays as it was: slower, not wrong
        log.debug("%s: not started again from checkpoint %d: %s", table.table_uri, version, exc)
    table.update_incremental()


def append_once(table: DeltaTable, data: Any, app_id: str, version: int, user_metadata: str | None = None, *,
                last: int | None = None) -> bool:
    """Append ``data`` (an Arrow table; no rows: a commit without data files) to ``table`` in one commit carrying
    ``txn(app_id, version)``, unless the table already recorded ``version`` or a later one for ``app_id``. Returns
    False when it was skipped.

    The caller must be the only writer of ``app_id`` (a view version's run holds its driver lock). ``last``: the
    latest version of ``app_id`` the caller knows the table holds (it asked once, then made every commit since);
    without it the table is brought up to date (incrementally) and asked. With it, nothing is listed before the
    write: on a version other writers moved on, delta-rs commits on the next free log version after its conflict
    check (a blind append commutes with appends and with compaction); when that check refuses it (a metadata
    change; a commit of another writer that delta-rs counts as a concurrent transaction, as a delta-spark append
    between two of the sink's), nothing landed, and the append is tried once more on the table brought up to date.
    """
    from deltalake.exceptions import CommitFailedError

    def write() -> None:
        write_deltalake(table, data, mode="append", post_commithook_properties=LIVE_HOOKS,
                        commit_properties=commit_properties(app_id, version, user_metadata))

    if last is None:
        if committed(table, app_id, version):
            return False
        write()
    elif version <= last:
        return False
    else:
        try:
            write()
        except CommitFailedError:
            # nothing landed: a commit since this handle's version conflicts with a blind append in delta-rs'
            # check (the table's metadata - an ALTER -, another writer's transaction); brought up to date, once more
            table.update_incremental()
            write()
    after_commit(table)
    return True

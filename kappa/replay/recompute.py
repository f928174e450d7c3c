"""Verification by recompute: a view version's own transform, re-run by Spark over exactly the slice of the log
its Delta table holds, compared with the table.

The plain-Python oracles (:mod:`kappa.oracle`) check a view's *business logic* against a second implementation,
so they exist only for the built-in views. This check needs no second implementation: it takes the version's own
transform and recomputes, in one clean run without checkpoints, restarts, Delta, MERGE or bulk catch-up, what
the table must hold if the streaming machinery lost, duplicated or corrupted nothing across crashes, restarts,
state and commits. It works for any view version.

What the stream was allowed to see is reproduced from the lineage every Delta commit carries
(:mod:`kappa.lineage`): each micro-batch's end offsets, watermark and the offsets of the lookups it joined.

.. code-block:: text

    Delta commits of the run: batch ids, end offsets, watermarks, lookup offsets (kappa.lineage)
      │
    Kafka [start, end) ─ decode ─> valid records, each tagged with the recorded micro-batch it belonged to
      │                           (the invalid ones are compared with the quarantine: none lost or doubled)
      ▼
    one parquet folder per recorded micro-batch (local scratch; one Kafka read, one Spark job, no Python UDF)
      │ Stateful views: handed one batch at a time to a fresh streaming query (file source -> the view's
      │ transform in the streaming plan), so Spark keeps state, evicts it and drops late rows exactly as it did -
      │ same cuts, same watermarks (also the no-data batches, by not handing the next batch over before the
      │ engine ran them). Stateless views: batch jobs, each batch joined with the lookups it joined - the batches
      │ that joined the same lookup contents in one job when the write is an append (cuts cannot matter there).
      ▼
    every batch's output, tagged with its batch -> the view's write semantics in one batch job
      (append: all rows; merge: the last batch's row per key; upsert_delete: latest per key, tombstones
       delete; finality flag from the event-time maximum)
      ▼
    compared with the table at the verified Delta version: same keys, same values, no duplicated key;
    a failure names the first differing key.

Why not one batch job over the whole range: a stateful view's result depends on where the micro-batches were
cut (late rows are dropped by the previous batch's watermark, session state is evicted and cannot merge with
later events), which a single batch job cannot express; replaying the recorded cuts through Spark's own
streaming engine reproduces it for any stateful operator without knowing which one the view uses.

What it cannot see: a mistake in the transform itself (it is the same code - the oracle or a reviewer of the
diff report catches that), a record that was never decoded the way the schema says (the oracle re-validates with
jsonschema), and anything outside the verified Delta version.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from kappa.errors import KappaError, one_line

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, Row, SparkSession

    from kappa.config import Settings
    from kappa.oracle import BatchBoundary
    from kappa.view import ViewDefinition

__all__ = ["BATCH", "Check", "RecomputeError", "Step", "apply_writes", "compare", "empty_parquet", "match_keys",
           "recompute", "rerun_stateful", "rerun_stateless", "spark_session", "stage_batches", "without_dropped"]

log = logging.getLogger("kappa.replay.recompute")

#: Column tagging a recomputed row with the recorded micro-batch (position) that produced it.
BATCH = "_kappa_batch"
#: ``_kappa_batch`` of the staged invalid records (compared with the quarantine, never re-run).
INVALID = -1
#: How long the re-run may stay idle where the original ran a no-data batch before that batch is skipped.
NO_DATA_WAIT_SECONDS = 5.0
_EXAMPLES = 5


class RecomputeError(KappaError, ValueError):
    """The recorded run cannot be recomputed exactly (the message says why, in one line)."""


@dataclass(frozen=True, kw_only=True)
class Check:
    """The outcome of one check of a view version's table (``recompute`` or ``oracle``).

    Attributes:
        name: ``recompute`` or ``oracle``.
        passed: The table equals the expected result.
        rows: Rows in the table.
        expected_rows: Rows the check computed.
        missing: Keys (rows, for a view without keys) expected and not in the table.
        extra: Keys in the table and not expected.
        different: Keys in both with different values.
        duplicates: Keys present more than once in the table.
        first_difference: The first differing key (in key order) and what differs, or None.
        examples: Up to 5 differences, one line each.
        details: What else the check measured (batches re-run, seconds, quarantine counts).
        message: One human line.
    """

    name: str
    passed: bool
    rows: int = 0
    expected_rows: int = 0
    missing: int = 0
    extra: int = 0
    different: int = 0
    duplicates: int = 0
    first_difference: str | None = None
    examples: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["examples"] = list(self.examples)
        return out


# ------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Step:
    """A recorded micro-batch: its position (= batch id), whether it read records, the lookups it joined."""

    pos: int
    data: bool
    lookups: Mapping[str, Mapping[int, int]]


def _plan(batches: Sequence["BatchBoundary"], start: Mapping[int, int]) -> tuple[list[Step], dict[int, list[int]]]:
    """The recorded batches as steps of the re-run, and per partition the end offset after each batch."""
    ids = [b.batch_id for b in batches]
    if ids != list(range(len(ids))):
        missing = sorted(set(range(max(ids, default=-1) + 1)) - set(ids))
        raise RecomputeError(f"the boundaries of batches {_ranges(missing)} are no longer recorded (Delta history "
                             "and checkpoint both purged them); a recompute needs every batch of the run")
    partitions = sorted({p for b in batches for p in b.end_offsets} | set(start))
    ends: dict[int, list[int]] = {p: [] for p in partitions}
    steps = []
    previous = {p: int(start.get(p, 0)) for p in partitions}
    for b in batches:
        current = {p: max(previous[p], int(b.end_offsets.get(p, previous[p]))) for p in partitions}
        steps.append(Step(pos=b.batch_id, data=any(current[p] > previous[p] for p in partitions) or b.batch_id == 0,
                            lookups=b.lookups))
        for p in partitions:
            ends[p].append(current[p])
        previous = current
    return steps, ends


def _ranges(ids: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    out: list[str] = []
    for i in ids:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out[:6]) + (" ..." if len(out) > 6 else "")


# ------------------------------------------------------------------------------------------------ feeding
class _Feeder:
    """Hands the recorded micro-batches to the re-run one at a time and collects each batch's output.

    The next batch's files are moved into the watched folder from within the current batch's ``foreachBatch``
    call, so the engine finds them when it plans its next batch: no no-data batch can slip in between, unless
    the original ran one there - then nothing is handed over and the engine runs its own no-data batch.
    """

    def __init__(self, *, view: "ViewDefinition", steps: list[Step], staged: Path, feed: Path, out: Path,
                 empty: Callable[[], Path], no_data_wait: float = NO_DATA_WAIT_SECONDS) -> None:
        self.view, self.steps, self.staged, self.feed, self.out, self.empty = view, steps, staged, feed, out, empty
        self.no_data_wait = no_data_wait
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.cursor = 0  # the next recorded batch to reproduce
        self.expect_data = False
        self.changed = time.monotonic()
        self.batches_run = 0
        self.skipped: list[int] = []  # recorded no-data batches the re-run did not need
        self.error: str | None = None

    def start(self) -> None:
        with self.lock:
            self._hand_over()

    def _hand_over(self) -> None:
        """Move on to ``cursor``: done, its files into the feed (a data batch), or wait for a no-data batch."""
        self.changed = time.monotonic()
        if self.cursor >= len(self.steps):
            self.done.set()
            return
        step = self.steps[self.cursor]
        if not step.data:
            self.expect_data = False
            return
        folder = self.staged / f"{BATCH}={step.pos}"
        files = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        if not files:  # a batch that read records none of which was valid: still a batch, with no rows
            shutil.copyfile(self.empty(), self.feed / f".{step.pos:09d}.tmp")
            os.replace(self.feed / f".{step.pos:09d}.tmp", self.feed / f"{step.pos:09d}-empty.parquet")
        for i, f in enumerate(files):
            os.replace(f, self.feed / f"{step.pos:09d}-{i}.parquet")
        self.expect_data = True

    def skip_no_data(self) -> bool:
        """Skip the recorded no-data batch at ``cursor`` when the re-run has been idle there for a while."""
        with self.lock:
            if (self.done.is_set() or self.expect_data or self.cursor >= len(self.steps)
                    or time.monotonic() - self.changed < self.no_data_wait):
                return False
            self.skipped.append(self.steps[self.cursor].pos)
            self.cursor += 1
            self._hand_over()
            return True

    def on_batch(self, frame: "DataFrame", batch_id: int) -> None:
        from pyspark.sql import functions as F

        try:
            with self.lock:
                if self.done.is_set():
                    return  # a trailing no-data batch after the last recorded one
                # the batch of the files handed over, or the no-data batch the original ran at this point
                pos = self.steps[self.cursor].pos
                without_dropped(self.view, frame).withColumn(BATCH, F.lit(pos)).write.mode("append").parquet(
                    str(self.out))
                self.batches_run += 1
                self.cursor += 1
                self._hand_over()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread; the query stops on it
            self.error = one_line(exc)
            self.done.set()
            raise


# ------------------------------------------------------------------------------------------------ recompute
def recompute(view: "ViewDefinition", settings: "Settings", *, table_path: str, delta_version: int,
              batches: Sequence["BatchBoundary"], start: Mapping[int, int], end_timestamp_ms: int | None = None,
              quarantine_path: str | None = None, spark: "SparkSession | None" = None,
              timeout: float = 1800.0) -> Check:
    """Recompute ``view`` over the micro-batches ``batches`` (every batch of the run, from its first) starting at
    ``start`` and compare the result with the table at ``delta_version``.

    Args:
        view: The version's definition (its own transform is what runs).
        settings: Kafka, lake, jars.
        table_path: The version's Delta table.
        delta_version: The table version checked (it holds exactly ``batches``).
        batches: Every recorded boundary of the run, oldest first, ids 0..N (:func:`kappa.lineage.batches_from_history`).
        start: The run's start offsets (records before them were never the run's).
        end_timestamp_ms: A bounded run only processed records with a Kafka timestamp before this.
        quarantine_path: Also check the run's quarantined (invalid) records: none lost, none doubled.
        spark: A session to use; by default the active one, else a local one built and stopped here.
        timeout: Give up after this many seconds.

    Returns:
        A :class:`Check` named ``recompute``; ``passed`` False (with the reason as message) also when the run
        cannot be recomputed exactly.
    """
    t0 = time.monotonic()
    try:
        steps, ends = _plan(batches, start)
    except RecomputeError as exc:
        return Check(name="recompute", passed=False, message=f"recompute impossible: {exc}")
    session, own = _session(settings, spark)
    scratch = Path(tempfile.mkdtemp(prefix=f"recompute-{view.name}-v{view.version}-",
                                    dir=_scratch_root(settings)))
    try:
        return _recompute(session, view, settings, table_path=table_path, delta_version=delta_version,
                          steps=steps, ends=ends, start=start, end_timestamp_ms=end_timestamp_ms,
                          quarantine_path=quarantine_path, scratch=scratch, timeout=timeout, t0=t0)
    except RecomputeError as exc:
        return Check(name="recompute", passed=False, message=f"recompute impossible: {exc}",
                     details={"seconds": round(time.monotonic() - t0, 1)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if own:
            session.stop()


def _scratch_root(settings: "Settings") -> str:
    root = Path(settings.home) / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


@contextmanager
def spark_session(settings: "Settings") -> Iterator["SparkSession"]:
    """The process's Spark session (the active one, else a local one built here and stopped afterwards)."""
    session, own = _session(settings, None)
    try:
        yield session
    finally:
        if own:
            session.stop()


def _session(settings: "Settings", spark: "SparkSession | None") -> tuple["SparkSession", bool]:
    if spark is not None:
        return spark, False
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession() or SparkSession._instantiatedSession  # noqa: SLF001 - any thread's
    if active is not None:
        return active, False
    from kappa.spark import build_spark

    return build_spark("kappa-verify", jars_dir=settings.jars_dir,
                       warehouse_dir=str(Path(settings.home) / "warehouse")), True


def _recompute(spark: "SparkSession", view: "ViewDefinition", settings: "Settings", *, table_path: str,
               delta_version: int, steps: list[Step], ends: dict[int, list[int]], start: Mapping[int, int],
               end_timestamp_ms: int | None, quarantine_path: str | None, scratch: Path, timeout: float,
               t0: float) -> Check:
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, StructField, StructType

    from kappa.parsing import valid_rows

    topic = settings.topic(view.stream_topic)
    end = {p: e[-1] for p, e in ends.items() if e}
    decoded = _read_range(spark, settings, view, topic, start, end)
    if end_timestamp_ms is not None:  # what a bounded run's job filters right after decoding
        decoded = decoded.where(F.col("kafka_timestamp") < F.timestamp_millis(F.lit(int(end_timestamp_ms))))

    phases: dict[str, float] = {}
    mark = time.monotonic()
    staged, feed, out = scratch / "batches", scratch / "feed", scratch / "out"
    feed.mkdir()
    schema = valid_rows(decoded).schema
    stage_batches(spark, decoded, steps, ends, start, staged)
    phases["read_and_stage"], mark = round(time.monotonic() - mark, 1), time.monotonic()

    lookups_for = _Lookups(spark, settings, view, steps)
    try:
        if view.stateful:
            out_schema, batches_run, skipped = rerun_stateful(
                spark, view, steps, staged=staged, feed=feed, out=out, schema=schema, lookups_for=lookups_for,
                empty=lambda: empty_parquet(spark, schema, scratch / "empty"), checkpoint=scratch / "checkpoint",
                timeout=timeout)
        else:
            out_schema, batches_run, skipped = rerun_stateless(spark, view, steps, staged=staged, out=out,
                                                               schema=schema, lookups_for=lookups_for)
    finally:
        lookups_for.close()

    phases["rerun"], mark = round(time.monotonic() - mark, 1), time.monotonic()
    outputs = spark.read.schema(StructType([*out_schema.fields, StructField(BATCH, IntegerType())])).parquet(str(out))
    expected = apply_writes(view, outputs)
    table = spark.read.format("delta").option("versionAsOf", delta_version).load(table_path)
    check = compare(expected, table, keys=view.keys, name="recompute")
    details: dict[str, Any] = {"batches": len(steps), "batches_run": batches_run,
                               "no_data_batches_skipped": skipped}
    quarantine = None
    if quarantine_path is not None:
        invalid = (spark.read.schema(StructType([*schema.fields, StructField(BATCH, IntegerType())]))
                   .parquet(str(staged)).where(F.col(BATCH) == INVALID))
        quarantine = _quarantine_check(spark, view, quarantine_path, invalid, last_batch=steps[-1].pos)
        details.update(quarantine)
    phases["compare"] = round(time.monotonic() - mark, 1)
    details["phases_seconds"] = phases
    details["seconds"] = round(time.monotonic() - t0, 1)
    log.info("recompute of %s: %s batches (%s re-run, %s recorded no-data batches skipped), phases %s", view.ref,
             len(steps), batches_run, len(skipped), phases)
    passed = check.passed and (quarantine is None or quarantine["quarantine_passed"])
    message = check.message
    if quarantine is not None and not quarantine["quarantine_passed"]:
        message = (f"{message}; quarantine: {quarantine['quarantine_missing']} invalid records missing, "
                   f"{quarantine['quarantine_extra']} extra or doubled (e.g. {quarantine['quarantine_example']})")
    return Check(name="recompute", passed=passed, rows=check.rows, expected_rows=check.expected_rows,
                 missing=check.missing, extra=check.extra, different=check.different, duplicates=check.duplicates,
                 first_difference=check.first_difference, examples=check.examples, details=details,
                 message=f"{message} ({len(steps)} micro-batches re-run in {details['seconds']:.0f} s)")


def rerun_stateful(spark: "SparkSession", view: "ViewDefinition", steps: list[Step], *, staged: Path, feed: Path,
                    out: Path, schema: Any, lookups_for: Any, empty: Callable[[], Path], checkpoint: Path,
                    timeout: float, no_data_wait: float = NO_DATA_WAIT_SECONDS) -> tuple[Any, int, list[int]]:
    """Re-run a stateful transform in a fresh streaming query fed one recorded batch at a time (:class:`_Feeder`).
    Returns the output schema, the batches run and the recorded no-data batches skipped."""
    feeder = _Feeder(view=view, steps=steps, staged=staged, feed=feed, out=out, empty=empty,
                     no_data_wait=no_data_wait)
    transformed = view.transform(spark.readStream.schema(schema).parquet(str(feed)), **lookups_for.single())
    feeder.start()
    query = (transformed.writeStream.outputMode(view.output_mode)
             .queryName(f"kappa-recompute-{view.name}-v{view.version}").foreachBatch(feeder.on_batch)
             .option("checkpointLocation", str(checkpoint)).trigger(processingTime="0 seconds").start())
    deadline = time.monotonic() + timeout
    try:
        while not feeder.done.wait(0.5):
            if query.exception() is not None or not query.isActive:
                break
            if time.monotonic() > deadline:
                raise RecomputeError(f"the re-run did not finish within {timeout:.0f} s "
                                     f"({feeder.batches_run} of {len(steps)} batches)")
            if not query.status.get("isTriggerActive"):
                feeder.skip_no_data()
    finally:
        query.stop()
    failure = feeder.error or (one_line(query.exception()) if query.exception() is not None else None)
    if failure:
        raise RecomputeError(f"the re-run of the transform failed: {failure}")
    if not feeder.done.is_set():
        raise RecomputeError(f"the re-run stopped after {feeder.batches_run} of {len(steps)} batches")
    return transformed.schema, feeder.batches_run, feeder.skipped


def rerun_stateless(spark: "SparkSession", view: "ViewDefinition", steps: list[Step], *, staged: Path,
                     out: Path, schema: Any, lookups_for: Any, per_batch: bool = False) -> tuple[Any, int, list[int]]:
    """Re-run a stateless transform with batch jobs: a row's output depends only on the row and the lookups its
    batch joined, so the recorded batches that joined the same lookup contents run as one job - unless the write
    semantics need each row's batch (merge / upsert_delete: the last batch wins) or ``per_batch``, then one job
    per batch."""
    from pyspark.sql import functions as F

    data = [s.pos for s in steps if s.data]
    groups: list[list[int]] = []
    together = view.write == "append" and not per_batch
    for pos in data:
        if groups and together and lookups_for.key(pos) == lookups_for.key(groups[-1][-1]):
            groups[-1].append(pos)
        else:
            groups.append([pos])
    out_schema = None
    for group in groups:
        folders = [str(staged / f"{BATCH}={p}") for p in group if (staged / f"{BATCH}={p}").is_dir()]
        rows = spark.read.schema(schema).parquet(*folders) if folders else spark.createDataFrame([], schema)
        output = without_dropped(view, view.transform(rows, **lookups_for(group[-1])))
        out_schema = output.schema
        output.withColumn(BATCH, F.lit(group[-1])).write.mode("append").parquet(str(out))
    if out_schema is None:
        raise RecomputeError("the run read no batch with records")
    return out_schema, len(data), []


def without_dropped(view: "ViewDefinition", output: "DataFrame") -> "DataFrame":
    """The output rows a ``drop`` expectation kept out of the table removed."""
    for rule in view.expectations:
        if rule.on_violation == "drop":
            output = output.where(~rule.violated())
    return output


def _read_range(spark: "SparkSession", settings: "Settings", view: "ViewDefinition", topic: str,
                start: Mapping[int, int], end: Mapping[int, int]) -> "DataFrame":
    """The decoded records of ``topic`` in ``[start, end)`` (a Spark batch read of exactly those offsets)."""
    import json

    from kappa.parsing import decode

    parts = sorted(p for p, e in end.items() if e > int(start.get(p, 0)))
    if not parts:
        raise RecomputeError("the run processed no record (its batches never moved past the start offsets)")
    raw = (spark.read.format("kafka").options(**settings.spark_kafka_options())
           .option("assign", json.dumps({topic: parts}))
           .option("startingOffsets", json.dumps({topic: {str(p): int(start.get(p, -2)) for p in parts}}))
           .option("endingOffsets", json.dumps({topic: {str(p): int(end[p]) for p in parts}}))
           .option("failOnDataLoss", "false" if view.stream_format.tombstones else "true").load())
    return decode(raw, view.stream_format)


def stage_batches(spark: "SparkSession", decoded: "DataFrame", steps: list[Step], ends: Mapping[int, list[int]],
                  start: Mapping[int, int], staged: Path) -> None:
    """Write every record of the range once, in one Spark job, as parquet under ``staged/_kappa_batch=<pos>``:
    the valid ones in the folder of the recorded micro-batch that read them, the invalid ones (kept for the
    quarantine check) under ``_kappa_batch=-1``. The batch is found by a broadcast join with the batches'
    offset ranges (JVM only, no Python worker)."""
    from pyspark.sql import functions as F

    from kappa.parsing import BARRIER, INTERNAL_COLUMNS

    ranges = []
    for partition, after in ends.items():
        low = int(start.get(partition, 0))
        for step, high in zip(steps, after):
            if high > low:
                ranges.append((int(partition), step.pos, low, high))
            low = max(low, high)
    spans = spark.createDataFrame(ranges, "r_partition INT, r_pos INT, r_low LONG, r_high LONG")
    tagged = decoded.join(F.broadcast(spans), (F.col("partition") == F.col("r_partition"))
                          & (F.col("offset") >= F.col("r_low")) & (F.col("offset") < F.col("r_high")), "left")
    # the barrier keeps from_json evaluated once per record (see kappa.parsing._split)
    valid = F.col("_error").isNull() & (F.col(BARRIER) >= F.lit(0.0))
    keep = [c for c in decoded.columns if c not in INTERNAL_COLUMNS]
    (tagged.select(*keep, F.when(valid, F.col("r_pos")).otherwise(F.lit(INVALID)).alias(BATCH))
     .write.partitionBy(BATCH).parquet(str(staged)))


def empty_parquet(spark: "SparkSession", schema: Any, folder: Path) -> Path:
    """A parquet file with ``schema`` and no row (handed over for a batch whose records were all invalid)."""
    if not folder.is_dir():
        spark.createDataFrame([], schema).coalesce(1).write.parquet(str(folder))
    return next(iter(sorted(folder.glob("*.parquet"))))


class _Lookups:
    """The lookups each recorded batch joined, read at the offsets its lineage names (cached per offsets)."""

    def __init__(self, spark: "SparkSession", settings: "Settings", view: "ViewDefinition",
                 steps: list[Step]) -> None:
        self.spark, self.settings, self.view, self.steps = spark, settings, view, steps
        self._frames: dict[tuple, "DataFrame"] = {}

    def _ends(self, name: str, pos: int) -> dict[int, int] | None:
        """Offsets of lookup ``name`` batch ``pos`` joined: its own record, else the nearest recorded one."""
        recorded = [(abs(s.pos - pos), s.lookups[name]) for s in self.steps if s.lookups.get(name)]
        return dict(min(recorded, key=lambda x: x[0])[1]) if recorded else None

    def frame(self, name: str, ends: Mapping[int, int] | None) -> "DataFrame":
        from pyspark.sql import functions as F

        from kappa.lookups import lookup_frame

        key = (name, tuple(sorted((ends or {}).items())))
        if key not in self._frames:
            frame = lookup_frame(self.spark, self.settings, self.view.lookups[name], ends).persist()
            frame.count()
            self._frames[key] = frame
        return F.broadcast(self._frames[key])

    def __call__(self, pos: int) -> dict[str, "DataFrame"]:
        return {name: self.frame(name, self._ends(name, pos)) for name in self.view.lookups}

    def key(self, pos: int) -> tuple:
        """What batch ``pos`` joined: the same key, the same lookup contents (the offsets each lookup was read at)."""
        return tuple((name, tuple(sorted((self._ends(name, pos) or {}).items()))) for name in sorted(self.view.lookups))

    def single(self) -> dict[str, "DataFrame"]:
        """One version per lookup for a stateful view (its join is part of the streaming plan)."""
        out = {}
        for name in self.view.lookups:
            versions: dict[tuple, list[int]] = {}
            for s in self.steps:
                if s.data and s.lookups.get(name):
                    versions.setdefault(tuple(sorted(s.lookups[name].items())), []).append(s.pos)
            if len(versions) > 1:
                contents = {k: sorted(map(tuple, self.frame(name, dict(k)).collect())) for k in versions}
                if len({tuple(c) for c in contents.values()}) > 1:
                    spans = "; ".join(f"batches {_ranges(b)} joined offsets {dict(k)}" for k, b in versions.items())
                    raise RecomputeError(
                        f"lookup {name!r} changed during the run ({spans}); a stateful view joins its lookups "
                        "inside the streaming plan, so the re-run can join one version only - compare with the "
                        "oracle, or replay a range over which the lookup did not change")
            last = max(versions.items(), key=lambda kv: max(kv[1]))[0] if versions else None
            out[name] = self.frame(name, dict(last) if last is not None else None)
        return out

    def close(self) -> None:
        for frame in self._frames.values():
            try:
                frame.unpersist()
            except Exception:  # noqa: BLE001 - the session may be gone
                pass
        self._frames.clear()


def apply_writes(view: "ViewDefinition", outputs: "DataFrame") -> "DataFrame":
    """What the view's write semantics leave in the table after every batch's output, in batch order."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = outputs
    if view.write in ("merge", "upsert_delete"):
        order = [F.col(BATCH).desc()]
        if view.write == "upsert_delete" and view.order_column:
            order.append(F.col(view.order_column).desc())
        rows = (rows.withColumn("_rn", F.row_number().over(Window.partitionBy(*view.keys).orderBy(*order)))
                .where("_rn = 1").drop("_rn"))
        if view.write == "upsert_delete":
            rows = rows.where(~F.col("is_tombstone")).drop("is_tombstone")
    fin = view.finality
    if fin is not None and fin.flag_column not in outputs.columns:
        event_max = outputs.agg(F.max(fin.event_max_column)).collect()[0][0]
        flag = F.lit(False) if event_max is None else (
            F.col(fin.window_end_column) <= F.lit(event_max) - F.expr(f"INTERVAL {fin.delay_seconds} SECONDS"))
        rows = rows.withColumn(fin.flag_column, flag)
    return rows.drop(BATCH)


def _quarantine_check(spark: "SparkSession", view: "ViewDefinition", path: str, invalid: "DataFrame", *,
                      last_batch: int) -> dict[str, Any]:
    """The run's invalid records against its quarantine rows (late records and rows dropped by expectations
    aside): none missing, none twice."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from kappa.late import LATE_REASON

    expected = invalid.select("partition", "offset")
    if DeltaTable.isDeltaTable(spark, path):
        actual = (spark.read.format("delta").load(path)
                  .where((F.col("view") == view.name) & (F.col("version") == view.version)
                         & (F.col("batch_id") <= last_batch) & ~F.col("error").startswith(LATE_REASON)
                         & ~F.col("error").startswith("expectation "))
                  .select("partition", "offset"))
    else:
        actual = expected.limit(0)
    # one job: how often each record is expected (once) and quarantined
    both = (expected.groupBy("partition", "offset").agg(F.count(F.lit(1)).alias("_e"))
            .join(actual.groupBy("partition", "offset").agg(F.count(F.lit(1)).alias("_a")),
                  ["partition", "offset"], "full_outer")
            .select("partition", "offset", F.coalesce("_e", F.lit(0)).alias("_e"),
                    F.coalesce("_a", F.lit(0)).alias("_a")))
    totals = both.agg(F.sum("_e").alias("expected"),
                      F.sum(F.greatest(F.col("_e") - F.col("_a"), F.lit(0))).alias("missing"),
                      F.sum(F.greatest(F.col("_a") - F.col("_e"), F.lit(0))).alias("extra")).collect()[0]
    n_expected, n_missing, n_extra = (int(totals[c] or 0) for c in ("expected", "missing", "extra"))
    example = None
    if n_missing or n_extra:
        r = both.where(F.col("_e") != F.col("_a")).orderBy("partition", "offset").first()
        example = (f"partition {r['partition']} offset {r['offset']} is not in the quarantine" if r["_e"] > r["_a"]
                   else f"partition {r['partition']} offset {r['offset']} is quarantined once too often")
    return {"quarantine_expected": n_expected, "quarantine_missing": n_missing, "quarantine_extra": n_extra,
            "quarantine_passed": not (n_missing or n_extra), "quarantine_example": example}


# ------------------------------------------------------------------------------------------------ compare
def _fmt(value: Any) -> str:
    return repr(value.isoformat(sep=" ") if hasattr(value, "isoformat") else value)


def _key_text(row: "Row", keys: Iterable[str]) -> str:
    return "(" + ", ".join(f"{k}={_fmt(row[k])}" for k in keys) + ")"


def compare(expected: "DataFrame", table: "DataFrame", *, keys: Sequence[str], name: str) -> Check:
    """Compare the expected rows with the table's over the table's columns.

    With ``keys``: rows are matched by key (null-safe); missing, extra, different and duplicated keys are counted
    (one Spark job when they are equal, a second one for the examples when not) and the first differing key in
    key order is named with the columns that differ. Without keys the two are compared as multisets of rows.
    """
    from pyspark.sql import functions as F

    columns = table.columns
    absent = [c for c in columns if c not in expected.columns]
    if absent:
        return Check(name=name, passed=False, rows=table.count(),
                     message=f"{name}: the transform's output has no column(s) {', '.join(absent)} the table has")
    expected = expected.select(*columns)
    if not keys:
        return _compare_rows(expected, table, columns, name)
    keys = list(keys)
    values = [c for c in columns if c not in keys]
    # the table once per key, with how many rows it holds for it
    per_key = table.groupBy(*keys).agg(F.count(F.lit(1)).alias("_n"), *[F.first(c).alias(c) for c in values])
    joined = match_keys(expected, per_key, keys=keys, values=values, carry=("_n",))
    duplicated = F.col("_n") > 1
    totals = joined.agg(
        F.coalesce(F.sum("_n"), F.lit(0)).alias("rows"), F.count("_in_e").alias("expected_rows"),
        *[F.count(F.when(F.col("_kind") == kind, True)).alias(kind) for kind in ("missing", "extra", "different")],
        F.count(F.when(duplicated, True)).alias("duplicates")).collect()[0]
    counts = {kind: int(totals[kind]) for kind in ("missing", "extra", "different") if totals[kind]}
    n_table, n_expected, n_dups = int(totals["rows"]), int(totals["expected_rows"]), int(totals["duplicates"])
    first = [] if not counts and not n_dups else (
        joined.where(F.col("_kind").isNotNull() | duplicated).orderBy(*keys).limit(_EXAMPLES).collect())
    examples = [f"{_key_text(r, keys)}: {r['_n']} rows in the table" if (r["_n"] or 0) > 1 and r["_kind"] is None
                else _describe(r, keys, values, name) + (f" ({r['_n']} rows in the table)" if (r["_n"] or 0) > 1
                                                         else "") for r in first]
    passed = not counts and not n_dups
    first_difference = examples[0] if examples else None
    if passed:
        message = f"{n_table:,} rows equal the {name}"
    else:
        message = (f"differs from the {name}: {counts.get('missing', 0)} missing, {counts.get('extra', 0)} extra, "
                   f"{counts.get('different', 0)} different, {n_dups} duplicated keys; first differing key "
                   f"{first_difference}")
    return Check(name=name, passed=passed, rows=n_table, expected_rows=n_expected,
                 missing=counts.get("missing", 0), extra=counts.get("extra", 0),
                 different=counts.get("different", 0), duplicates=n_dups, first_difference=first_difference,
                 examples=tuple(examples[:_EXAMPLES]), message=message)


def match_keys(left: "DataFrame", right: "DataFrame", *, keys: Sequence[str], values: Sequence[str],
            carry: Sequence[str] = ()) -> "DataFrame":
    """Every key of ``left`` and ``right`` (each unique per key), matched null-safe by a full outer join: the key
    columns, each value as ``e_<column>`` (left) and ``t_<column>`` (right), ``_in_e`` / ``_in_t`` (true where
    that side has the key), the ``carry`` columns of ``right`` unchanged, and ``_kind``: ``missing`` (only in
    ``left``), ``extra`` (only in ``right``), ``different`` (a value of ``values`` differs) or null (equal)."""
    from pyspark.sql import functions as F

    e = left.select(*keys, *[F.col(c).alias(f"e_{c}") for c in values], F.lit(True).alias("_in_e"))
    t = right.select(*keys, *[F.col(c).alias(f"t_{c}") for c in values], *carry, F.lit(True).alias("_in_t"))
    cond = None
    for k in keys:
        c = e[k].eqNullSafe(t[k])
        cond = c if cond is None else cond & c
    joined = e.join(t, cond, "full_outer").select(
        *[F.coalesce(e[k], t[k]).alias(k) for k in keys], "_in_e", "_in_t",
        *[f"e_{c}" for c in values], *[f"t_{c}" for c in values], *carry)
    same = F.lit(True)
    for c in values:
        same = same & F.col(f"e_{c}").eqNullSafe(F.col(f"t_{c}"))
    kind = (F.when(F.col("_in_t").isNull(), F.lit("missing")).when(F.col("_in_e").isNull(), F.lit("extra"))
            .when(~same, F.lit("different")))
    return joined.withColumn("_kind", kind)


def _sort_key(values: tuple) -> tuple:
    return tuple((v is not None, v) for v in values)


def _describe(row: "Row", keys: Sequence[str], values: Sequence[str], name: str) -> str:
    key = _key_text(row, keys)
    if row["_kind"] == "missing":
        return f"{key}: missing from the table ({name}: " + ", ".join(
            f"{c}={_fmt(row[f'e_{c}'])}" for c in values) + ")"
    if row["_kind"] == "extra":
        return f"{key}: in the table only (" + ", ".join(f"{c}={_fmt(row[f't_{c}'])}" for c in values) + ")"
    changed = [c for c in values if row[f"e_{c}"] != row[f"t_{c}"]]
    return f"{key}: " + ", ".join(f"{c} table={_fmt(row[f't_{c}'])} {name}={_fmt(row[f'e_{c}'])}" for c in changed)


def _compare_rows(expected: "DataFrame", table: "DataFrame", columns: list[str], name: str) -> Check:
    """Multiset comparison of whole rows (a view without keys): how often each distinct row occurs on each side
    (grouping matches nulls), in one Spark job when they are equal."""
    from pyspark.sql import functions as F

    side = F.col("_side")
    both = (expected.withColumn("_side", F.lit(1)).unionByName(table.withColumn("_side", F.lit(-1)))
            .groupBy(*columns).agg(F.count(F.when(side == 1, True)).alias("_e"),
                                   F.count(F.when(side == -1, True)).alias("_t")))
    totals = both.agg(F.coalesce(F.sum("_e"), F.lit(0)).alias("expected"),
                      F.coalesce(F.sum("_t"), F.lit(0)).alias("rows"),
                      F.coalesce(F.sum(F.greatest(F.col("_e") - F.col("_t"), F.lit(0))), F.lit(0)).alias("missing"),
                      F.coalesce(F.sum(F.greatest(F.col("_t") - F.col("_e"), F.lit(0))), F.lit(0)).alias("extra")
                      ).collect()[0]
    n_table, n_expected = int(totals["rows"]), int(totals["expected"])
    n_missing, n_extra = int(totals["missing"]), int(totals["extra"])
    examples: list[str] = []
    if n_missing or n_extra:
        for r in both.where(F.col("_e") != F.col("_t")).orderBy(*columns).limit(_EXAMPLES).collect():
            examples.append(f"row missing from the table: {_key_text(r, columns)}" if r["_e"] > r["_t"] else
                            f"row in the table only (or once too often): {_key_text(r, columns)}")
    passed = not (n_missing or n_extra)
    message = (f"{n_table:,} rows equal the {name}" if passed else
               f"differs from the {name}: {n_missing} rows missing, {n_extra} extra or doubled; e.g. {examples[0]}")
    return Check(name=name, passed=passed, rows=n_table, expected_rows=n_expected, missing=n_missing, extra=n_extra,
                 first_difference=examples[0] if examples else None, examples=tuple(examples), message=message)

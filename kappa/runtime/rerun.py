"""The re-run engine: a view version's own transform run again, by Spark, over recorded micro-batches.

Used by verification (:mod:`kappa.verify.recompute`: re-run a live version over exactly the batches its Delta
table holds and compare) and by the view authors' testing kit (:mod:`kappa.runtime.testing`: a transform on a
few hand-written records). Both hand it *steps* - the recorded micro-batches, each with the lookups it joined -
and staged input, parquet folders per step of the re-run (a recorded batch, or a coalesced run of them):

.. code-block:: text

    Kafka [start, end) ─ decode ─> records in a folder per step and kind (stage_batches: valid, dropped as late
      │                            by the original, invalid - for the quarantine check)
      ▼
    stateful views: one batch at a time into a fresh streaming query (rerun_stateful: same cuts, same
      │ watermarks, also the no-data batches) - or, for a windowed aggregation that declares its late bound,
      │ runs of recorded batches as one (coalesce_steps: the rows the original dropped as late left out when
      │ staging, the watermark of each run checked against the recorded one), so the re-run's cost follows
      │ the records, not the micro-batches; stateless views: batch jobs (rerun_stateless)
      ▼
    every batch's output tagged with its batch -> the view's write semantics (apply_writes)
"""


from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from kappa.errors import KappaError, one_line

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import Column, DataFrame, SparkSession

    from kappa.config import Settings
    from kappa.runtime.lineage import BatchBoundary
    from kappa.runtime.view import ViewDefinition

__all__ = ["BATCH", "COALESCE_RECORDS", "CutsMatter", "INVALID", "KIND", "LATE", "LookupSnapshots", "RecomputeError",
           "Step", "VALID", "apply_writes", "batch_ranges", "coalesce_steps", "coalescable", "empty_parquet",
           "plan_steps", "read_range", "rerun_stateful", "rerun_stateless", "scratch_dir", "session_for",
           "spark_session", "stage_batches", "staged_files", "step_records", "without_dropped"]

log = logging.getLogger("kappa.runtime.rerun")

#: Column tagging a recomputed row with the recorded micro-batch (position) that produced it.
BATCH = "_kappa_batch"
#: Second partition column of staged records: what a record is to the re-run (:func:`stage_batches`).
KIND = "_kappa_kind"
#: A valid record the original run processed.
VALID = "valid"
#: A valid record the original run dropped as late (the view's ``late_bound`` behind the watermark it ran with):
#: left out of a coalesced re-run, handed to a re-run of one recorded batch at a time (Spark drops it again).
LATE = "late"
#: An invalid record (compared with the quarantine, never re-run).
INVALID = "invalid"
#: How long the re-run may stay idle where the original ran a no-data batch before that batch is skipped.
NO_DATA_WAIT_SECONDS = 5.0

class RecomputeError(KappaError, ValueError):
    """The recorded run cannot be recomputed exactly (the message says why, in one line)."""

# ------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Step:
    """A recorded micro-batch: its position (= batch id), whether it read records, the lookups it joined, the
    event-time watermark it ran with (``batchWatermarkMs``; its late rows were dropped by the previous batch's)
    and, for a step of a coalesced re-run (:func:`coalesce_steps`), the recorded batches it stands for."""

    pos: int
    data: bool
    lookups: Mapping[str, Mapping[int, int]]
    watermark_ms: int = 0
    members: tuple[int, ...] = ()

    @property
    def covers(self) -> tuple[int, ...]:
        """The recorded batch ids this step re-runs."""
        return self.members or (self.pos,)


def plan_steps(batches: Sequence["BatchBoundary"], start: Mapping[int, int]) -> tuple[list[Step], dict[int, list[int]]]:
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
                          lookups=b.lookups, watermark_ms=int(b.watermark_ms or 0)))
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

#: A step of a coalesced re-run holds at most this many records (the re-run logs its progress per step).
COALESCE_RECORDS = 500_000
#: Logical plan nodes whose result depends on the micro-batch cuts beyond the rows the watermark drops.
_CUT_SENSITIVE = frozenset({
    "Deduplicate", "DeduplicateWithinWatermark", "FlatMapGroupsWithState", "FlatMapGroupsInPandasWithState",
    "TransformWithState", "TransformWithStateInPandas", "TransformWithStateInPySpark", "UpdateEventTimeWatermarkColumn",
})


class CutsMatter(RecomputeError):
    """A coalesced re-run did not run with the watermark the recorded batches ran with: the view's result depends
    on the cuts after all (the re-run is then done again one recorded batch at a time)."""


def coalescable(view: "ViewDefinition", transformed: "DataFrame") -> str | None:
    """None when the re-run of ``view`` may feed several recorded micro-batches as one, else why it may not.

    Several recorded batches fed as one give the same table when the cuts decide only which rows the watermark
    dropped: the one stateful operator is an aggregation (over tumbling or sliding event-time windows, or none),
    and the view declares the bound Spark drops a row by (``late_bound``). The re-run then leaves out the rows the
    original dropped - each by the watermark of the batch before its own, as Spark does (:func:`stage_batches`) -
    and a window the original had already closed gets no row later (such a row would have been late). The
    re-run's watermark at each coalesced batch is still the recorded one (it comes from the same rows), and
    the feeder checks it (:class:`CutsMatter`). Session windows (a row merges with a session only while it is
    open), deduplication, arbitrary state and stream-stream joins depend on the cuts in other ways: one
    recorded batch at a time for them.
    """
    if not view.stateful:
        return "a stateless view"
    if view.late_bound is None:
        return "the view declares no late_bound, so the rows its watermark dropped cannot be told"
    aggregates, stack = 0, [transformed._jdf.queryExecution().analyzed()]
    while stack:
        node = stack.pop()
        name = str(node.nodeName())
        if node.isStreaming():
            if name in _CUT_SENSITIVE:
                return f"its plan has a {name} operator"
            if name == "Join" and node.left().isStreaming() and node.right().isStreaming():
                return "its plan joins two streams"
            if name == "Aggregate":
                aggregates += 1
                grouping = node.groupingExpressions()
                for i in range(grouping.size()):
                    expr = grouping.apply(i)
                    try:
                        meta = str(expr.metadata().json())
                    except Exception:  # noqa: BLE001 - not a named expression: no window marker
                        meta = ""
                    if "spark.sessionWindow" in meta or "session_window" in str(expr.toString()):
                        return "it aggregates over session windows"
        children = node.children()
        stack.extend(children.apply(i) for i in range(children.size()))
    if aggregates != 1:
        return f"its plan has {aggregates} streaming aggregations (one is coalesced)"
    return None


def coalesce_steps(steps: Sequence[Step], ends: Mapping[int, Sequence[int]], start: Mapping[int, int], *,
                   max_records: int | None = None,
                   fixed: Sequence[Sequence[int]] = ()) -> tuple[list[Step], dict[int, list[int]]]:
    """The recorded steps as a coalesced re-run feeds them: every step before the last data batch in runs of about
    ``max_records`` records (default :data:`COALESCE_RECORDS`), each run one step standing for its members (the
    recorded no-data batches among them need no batch of their own: what they closed, the next batch closes), then
    the last data batch and what follows it as recorded (the table's last batch decides the finality flag).
    ``fixed``: the first steps, given (lists of consecutive recorded batch positions from the first - the steps an
    earlier re-run staged, :mod:`kappa.verify.stagecache`; a run of several only before the last data batch, a
    single batch as recorded); the rest are formed as above. Returns the steps and, per partition, the end offset after each."""
    max_records = COALESCE_RECORDS if max_records is None else max_records
    last_data = max((i for i, step in enumerate(steps) if step.data), default=-1)
    partitions = list(ends)
    merged: list[Step] = []
    merged_ends: dict[int, list[int]] = {p: [] for p in partitions}
    group: list[int] = []
    count = 0

    def close() -> None:
        first, last = steps[group[0]], steps[group[-1]]
        merged.append(Step(pos=last.pos, data=True, lookups=last.lookups, watermark_ms=first.watermark_ms,
                           members=tuple(steps[i].pos for i in group)))
        for p in partitions:
            merged_ends[p].append(ends[p][group[-1]])

    records = step_records(steps, ends, start)
    index = {step.pos: i for i, step in enumerate(steps)}
    done = 0
    for members in fixed:
        group = [index[pos] for pos in members]
        if group != list(range(done, done + len(group))) or len(group) > 1 and group[-1] >= max(0, last_data):
            raise ValueError(f"fixed runs must be consecutive recorded batches, several only before the last data "
                             f"batch: {list(members)}")
        if len(group) > 1:
            close()
        else:  # one recorded batch: as recorded
            merged.append(steps[group[0]])
            for p in partitions:
                merged_ends[p].append(ends[p][group[0]])
        done += len(group)
    group = []
    for i in range(done, max(0, last_data)):
        group.append(i)
        count += records[i]
        if count >= max_records:
            close()
            group, count = [], 0
    if group:
        close()
    for i in range(max(done, last_data, 0), len(steps)):
        merged.append(steps[i])
        for p in partitions:
            merged_ends[p].append(ends[p][i])
    return merged, merged_ends


def step_records(steps: Sequence[Step], ends: Mapping[int, Sequence[int]], start: Mapping[int, int]) -> list[int]:
    """Records each step read (from the end offsets after each)."""
    return [sum(ends[p][i] - (ends[p][i - 1] if i else int(start.get(p, 0))) for p in ends)
            for i in range(len(steps))]

# ------------------------------------------------------------------------------------------------ feeding
class _Feeder:
    """Hands the recorded micro-batches to the re-run one at a time and collects each batch's output.

    The next batch's files are linked into the watched folder from within the current batch's ``foreachBatch``
    call, so the engine finds them when it plans its next batch: no no-data batch can slip in between, unless
    the original ran one there - then nothing is handed over and the engine runs its own no-data batch. The
    staged files stay where they are (a verification may keep them for the next one).
    """

    def __init__(self, *, view: "ViewDefinition", steps: list[Step], staged: Path, feed: Path, out: Path,
                 empty: Callable[[], Path], no_data_wait: float = NO_DATA_WAIT_SECONDS,
                 checkpoint: Path | None = None, kinds: Sequence[str] = (VALID, LATE)) -> None:
        self.view, self.steps, self.staged, self.feed, self.out, self.empty = view, steps, staged, feed, out, empty
        self.kinds = tuple(kinds)
        self.no_data_wait = no_data_wait
        self.checkpoint = checkpoint  # the re-run's own: a coalesced step's watermark is read from its offset log
        self.cuts_matter: str | None = None
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
        files = staged_files(self.staged, [step.pos], self.kinds)  # a coalesced step's records: one folder
        if not files:  # a batch that read records none of which was valid: still a batch, with no rows
            files = [self.empty()]
        for i, f in enumerate(files):  # a link is atomic: the engine never lists a file half written
            target = self.feed / f"{step.pos:09d}-{i}.parquet"
            try:
                os.link(f, target)
            except OSError:  # another file system (or one without links): a copy, renamed into place
                shutil.copyfile(f, self.feed / f".{step.pos:09d}-{i}.tmp")
                os.replace(self.feed / f".{step.pos:09d}-{i}.tmp", target)
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
                step = self.steps[self.cursor]
                pos = step.pos
                if len(step.members) > 1 and self.checkpoint is not None:
                    self._same_watermark(step, batch_id)
                without_dropped(self.view, frame).withColumn(BATCH, F.lit(pos)).write.mode("append").parquet(
                    str(self.out))
                self.batches_run += 1
                self.cursor += 1
                self._hand_over()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread; the query stops on it
            self.error = one_line(exc)
            self.done.set()
            raise

    def _same_watermark(self, step: Step, batch_id: int) -> None:
        """A coalesced step must run with the watermark its first recorded batch ran with (:func:`coalescable`)."""
        from kappa.runtime.lineage import parse_offset_log

        entry = self.checkpoint / "offsets" / str(batch_id)
        watermark = parse_offset_log(entry.read_text(), "")[1] if entry.is_file() else None
        if watermark != step.watermark_ms:
            self.cuts_matter = (f"the re-run's batch {batch_id} (recorded batches {_ranges(step.members)}) ran with "
                                f"watermark {watermark}, the recorded batch {step.members[0]} with {step.watermark_ms}")
            raise CutsMatter(self.cuts_matter)

# ------------------------------------------------------------------------------------------------ re-run
def scratch_dir(settings: "Settings") -> str:
    root = Path(settings.home) / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    return str(root)


@contextmanager
def spark_session(settings: "Settings") -> Iterator["SparkSession"]:
    """The process's Spark session (the active one, else a local one built here and stopped afterwards)."""
    session, own = session_for(settings, None)
    try:
        yield session
    finally:
        if own:
            from kappa.runtime.spark import stop_spark

            stop_spark(session)


def session_for(settings: "Settings", spark: "SparkSession | None") -> tuple["SparkSession", bool]:
    if spark is not None:
        return spark, False
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession() or SparkSession._instantiatedSession  # noqa: SLF001 - any thread's
    if active is not None:
        return active, False
    from kappa.runtime.spark import build_spark

    return build_spark("kappa-verify", settings), True


#: How often a long re-run logs its progress (batches done of all, time left at its pace so far).
PROGRESS_EVERY_SECONDS = 15.0


def rerun_stateful(spark: "SparkSession", view: "ViewDefinition", steps: list[Step], *, staged: Path, feed: Path,
                    out: Path, schema: Any, lookups_for: Any, empty: Callable[[], Path], checkpoint: Path,
                    timeout: float, no_data_wait: float = NO_DATA_WAIT_SECONDS,
                    records: Sequence[int] | None = None, late_rows: bool = True) -> tuple[Any, int, list[int]]:
    """Re-run a stateful transform in a fresh streaming query fed one step at a time (:class:`_Feeder`): a
    recorded batch, or a run of them (:func:`coalesce_steps`). Returns the output schema, the micro-batches run and
    the recorded no-data batches skipped. ``records``: what each step reads, for the progress lines (by records,
    the time left at the pace so far). ``late_rows`` False: the staged records the original dropped as late
    (:data:`LATE`) are left out, as a coalesced re-run needs."""
    feeder = _Feeder(view=view, steps=steps, staged=staged, feed=feed, out=out, empty=empty,
                     no_data_wait=no_data_wait, checkpoint=checkpoint, kinds=(VALID, LATE) if late_rows else (VALID,))
    transformed = view.transform(spark.readStream.schema(schema).parquet(str(feed)), **lookups_for.single())
    recorded = sum(len(step.covers) for step in steps)
    weights = list(records) if records is not None and len(records) == len(steps) else [1] * len(steps)
    feeder.start()
    query = (transformed.writeStream.outputMode(view.output_mode)
             .queryName(f"kappa-recompute-{view.name}-v{view.version}").foreachBatch(feeder.on_batch)
             .option("checkpointLocation", str(checkpoint)).trigger(processingTime="0 seconds").start())
    began = time.monotonic()
    deadline, said = began + timeout, began
    try:
        while not feeder.done.wait(0.5):
            if query.exception() is not None or not query.isActive:
                break
            if time.monotonic() - said >= PROGRESS_EVERY_SECONDS and feeder.cursor:
                said = time.monotonic()  # how far the re-run is (recorded batches), the time left at its pace so far
                cursor = min(feeder.cursor, len(steps))
                done = sum(len(step.covers) for step in steps[:cursor])
                share = sum(weights[:cursor]) / sum(weights) if sum(weights) else 0.0
                share = share if share > 0 else cursor / len(steps)  # no records done yet: count the steps
                left = (said - began) / share * (1.0 - share)
                log.info("recompute of %s: re-run batch %d of %d (%.0f%%), about %.0f s left in the re-run at its "
                         "pace so far (the comparisons follow it)", view.ref, done, recorded, 100.0 * share, left)
            if time.monotonic() > deadline:
                raise RecomputeError(f"the re-run did not finish within {timeout:.0f} s "
                                     f"({feeder.batches_run} of {len(steps)} batches)")
            if not query.status.get("isTriggerActive"):
                feeder.skip_no_data()
    finally:
        from kappa.runtime.spark import stopping_queries

        with stopping_queries(spark):  # done or failed: a batch it cuts is not a failure to log
            query.stop()
    if feeder.cuts_matter:
        raise CutsMatter(feeder.cuts_matter)
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
        files = [str(f) for f in staged_files(staged, group, (VALID, LATE))]  # no watermark here: none is late
        rows = spark.read.schema(schema).parquet(*files) if files else spark.createDataFrame([], schema)
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


def read_range(spark: "SparkSession", settings: "Settings", view: "ViewDefinition", topic: str,
                start: Mapping[int, int], end: Mapping[int, int]) -> "DataFrame":
    """The decoded records of ``topic`` in ``[start, end)`` (a Spark batch read of exactly those offsets): from
    the log, and what the log no longer holds from the topic's archive (:mod:`kappa.runtime.archive`)."""
    import json

    from kappa.runtime.parsing import decode

    parts = sorted(p for p, e in end.items() if e > int(start.get(p, 0)))
    if not parts:
        raise RecomputeError("the run processed no record (its batches never moved past the start offsets)")
    from_log = {p: int(start.get(p, -2)) for p in parts}
    archived = None
    if not view.stream_format.tombstones and any(o >= 0 for o in from_log.values()):
        from kappa.log.topics import partition_offsets

        log_start = {p: low for p, (low, _high) in partition_offsets(settings, topic).items()}
        gone = {p: (o, min(int(end[p]), log_start.get(p, 0))) for p, o in from_log.items()
                if 0 <= o < log_start.get(p, 0)}
        if gone:
            archived = _archived(spark, settings, view, gone)
            from_log = {p: max(o, log_start.get(p, 0)) for p, o in from_log.items()}
    parts = [p for p in parts if from_log[p] < int(end[p])]
    if not parts:
        assert archived is not None
        return archived
    raw = (spark.read.format("kafka").options(**settings.spark_kafka_options())
           .option("assign", json.dumps({topic: parts}))
           .option("startingOffsets", json.dumps({topic: {str(p): from_log[p] for p in parts}}))
           .option("endingOffsets", json.dumps({topic: {str(p): int(end[p]) for p in parts}}))
           .option("failOnDataLoss", "false" if view.stream_format.tombstones else "true").load())
    logged = decode(raw, view.stream_format)
    return logged if archived is None else archived.unionByName(logged)


def _archived(spark: "SparkSession", settings: "Settings", view: "ViewDefinition",
              ranges: Mapping[int, tuple[int, int]]) -> "DataFrame":
    """Records the log no longer holds, from the topic's archive; refused when there is none or it has a hole."""
    from kappa.runtime.archive import archive_of, archived_decoded, coverage

    found = archive_of(settings, view.stream_topic)
    detail = ", ".join(f"partition {p} [{lo}, {hi})" for p, (lo, hi) in sorted(ranges.items()))
    if found is None:
        raise RecomputeError(f"the log no longer holds {detail} and no view archives {view.stream_topic}")
    held = coverage(found[1], ranges)
    missing = [p for p, (lo, hi) in ranges.items() if hi > lo and (p not in held or not held[p].contiguous
                                                                   or held[p].high - held[p].low != hi - lo)]
    if missing:
        raise RecomputeError(f"neither the log nor the archive {found[1]} holds all of {detail}")
    return archived_decoded(spark, found[1], view.stream_format, ranges)


def batch_ranges(steps: Sequence[Step], ends: Mapping[int, Sequence[int]],
                 start: Mapping[int, int]) -> list[tuple[int, dict[int, tuple[int, int]], int]]:
    """Per recorded batch: its position, the offsets it read per partition (``[low, high)``, non-empty ones) and
    the watermark its late rows were dropped by (the batch before its own ran with it; 0: none)."""
    out = []
    low = {p: int(start.get(p, 0)) for p in ends}
    for i, step in enumerate(steps):
        read = {}
        for p, after in ends.items():
            high = int(after[i])
            if high > low[p]:
                read[int(p)] = (low[p], high)
            low[p] = max(low[p], high)
        out.append((step.pos, read, int(steps[i - 1].watermark_ms) if i else 0))
    return out


def stage_batches(spark: "SparkSession", decoded: "DataFrame", steps: Sequence[Step],
                  ends: Mapping[int, Sequence[int]], start: Mapping[int, int], staged: Path, *, first: int = 0,
                  tags: Mapping[int, int] | None = None, late_bound: "Column | None" = None) -> None:
    """Write every record ``decoded`` holds of the recorded batches ``steps[first:]`` once, in one Spark job, as
    parquet under ``staged/_kappa_batch=<pos>/_kappa_kind=<kind>``: in the folder of the step that re-runs the
    recorded micro-batch that read it - the batch itself, or with ``tags`` (recorded batch -> step) the coalesced
    run it belongs to (:func:`coalesce_steps`; a few big folders, not one per batch) - of kind :data:`VALID`,
    :data:`LATE` (with the view's ``late_bound``: the valid records the original run dropped as late - those whose
    bound the watermark of the batch before their own had passed, Spark's rule, :mod:`kappa.runtime.late`; a
    coalesced re-run leaves them out, one of a batch at a time hands them over) or :data:`INVALID` (kept for the
    quarantine check). The batch is found by a broadcast join with the batches' offset ranges (JVM only, no
    Python worker). ``decoded`` holds the records from the end of ``steps[first - 1]`` on (all of them with
    ``first`` 0)."""
    from pyspark.sql import functions as F

    from kappa.runtime.parsing import BARRIER, INTERNAL_COLUMNS

    ranges = [(p, (tags or {}).get(pos, pos), low, high, late_after)
              for pos, read, late_after in batch_ranges(steps, ends, start)[first:]
              for p, (low, high) in read.items()]
    spans = spark.createDataFrame(ranges, "r_partition INT, r_pos INT, r_low LONG, r_high LONG, r_late LONG")
    tagged = decoded.join(F.broadcast(spans), (F.col("partition") == F.col("r_partition"))
                          & (F.col("offset") >= F.col("r_low")) & (F.col("offset") < F.col("r_high")), "left")
    # the barrier keeps from_json evaluated once per record (see kappa.runtime.parsing._split)
    valid = F.col("_error").isNull() & (F.col(BARRIER) >= F.lit(0.0))
    keep = [c for c in decoded.columns if c not in INTERNAL_COLUMNS]
    kind = F.when(~valid, F.lit(INVALID))
    if late_bound is not None:  # as kappa.runtime.late.late_records: a NULL bound is never late; watermark 0 = none
        dropped = (F.col("r_late") > 0) & F.coalesce(late_bound <= F.timestamp_millis(F.col("r_late")), F.lit(False))
        kind = kind.when(dropped, F.lit(LATE))
    (tagged.select(*keep, F.col("r_pos").alias(BATCH), kind.otherwise(F.lit(VALID)).alias(KIND))
     .write.partitionBy(BATCH, KIND).parquet(str(staged)))


def staged_files(staged: Path, positions: Sequence[int], kinds: Sequence[str]) -> list[Path]:
    """The parquet files :func:`stage_batches` wrote into the folders of the steps ``positions``, of ``kinds``."""
    return [f for pos in positions for kind in kinds
            for f in sorted((staged / f"{BATCH}={pos}" / f"{KIND}={kind}").glob("*.parquet"))]


def empty_parquet(spark: "SparkSession", schema: Any, folder: Path) -> Path:
    """A parquet file with ``schema`` and no row (handed over for a batch whose records were all invalid)."""
    if not folder.is_dir():
        spark.createDataFrame([], schema).coalesce(1).write.parquet(str(folder))
    return next(iter(sorted(folder.glob("*.parquet"))))


class LookupSnapshots:
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

        from kappa.runtime.lookups import lookup_frame

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


def apply_writes(view: "ViewDefinition", outputs: "DataFrame", last: int | None = None) -> "DataFrame":
    """What the view's write semantics leave in the table after every batch's output, in batch order.

    ``last``: the id of the last batch the table holds (also when it wrote no row). A windowed view's finality
    flag comes from the event-time maximum of the batches before it (:mod:`kappa.runtime.sink`); None: of every
    batch (one batch job over the whole range, as a repair's recompute).
    """
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
        from kappa.runtime.sink import final_flag

        before = outputs if last is None else outputs.where(F.col(BATCH) < last)
        event_max = before.agg(F.max(fin.event_max_column)).collect()[0][0]
        rows = rows.withColumn(fin.flag_column, final_flag(fin, event_max))
    return rows.drop(BATCH)

"""How far a running micro-batch has read its log range: in-batch progress from Spark's status tracker.

A replay reads its whole range in one micro-batch by default, so its checkpoint shows nothing until that batch
commits. While a batch runs, its tasks say more. The job's queries read the log with
``maxRecordsPerPartition`` = :data:`READ_SPLIT_RECORDS`, so a big batch's read stage has one task per
:data:`READ_SPLIT_RECORDS` records or less, of about equal size; live batches (smaller) keep one task per Kafka
partition. The read stage's finished tasks, times the batch's records over its tasks, estimate the records read.

.. code-block:: text

    every second (job thread)      the query's jobs (its job group is the query's runId) that are running now
          |                        nothing running: no batch in flight, nothing to report
          v
    a batch running >= 2 s         its log range, once, from the offset log (offsets/<id>, written before it runs);
          |                        only batches of more than READ_SPLIT_RECORDS records are followed
          |                        the read stage: the first stage of its jobs with at least one task per
          v                        partition it reads (the batch's first multi-task stage; later, kept by id)
    Reading(records, read, ...)    read = records x finished tasks / tasks; rate = read / seconds since the
                                   batch was first seen running

The estimate is coarse by design: a task counts when it finishes, and what follows the read (the shuffle, the
state store, the Delta commit) is not in it. The job exports it as ``kappa_batch_records_read`` and uses it for
``kappa_replay_progress_ratio`` and ``kappa_replay_eta_seconds`` while the batch runs; ``kappa replay``'s progress
bar and the DAG's samples read it from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["READ_SPLIT_RECORDS", "Reading", "ReadTracker"]

#: Most records one read task of a micro-batch reads (Spark's ``maxRecordsPerPartition``): a batch of N records
#: is read by about N / 50,000 tasks - every core busy, and progress inside the batch.
READ_SPLIT_RECORDS = 50_000
#: A batch is looked at once it has run this long (live batches finish before: they cost nothing here).
MIN_BATCH_SECONDS = 2.0


@dataclass(frozen=True)
class Reading:
    """A running micro-batch's read, as its finished read tasks tell it.

    Attributes:
        batch_id: The running micro-batch.
        start: Its start offsets per partition (the previous batch's end).
        records: Records in its log range.
        read: Estimated records read (``records`` x ``tasks_done`` / ``tasks``).
        tasks: Tasks of its read stage.
        tasks_done: Finished ones.
        seconds: Since the batch was first seen running (its read and what came before it: the rate is low
            rather than high).
    """

    batch_id: int
    start: Mapping[int, int]
    records: int
    read: int
    tasks: int
    tasks_done: int
    seconds: float

    @property
    def rate(self) -> float | None:
        """Records/s read so far (None before a task finished)."""
        return self.read / self.seconds if self.read and self.seconds > 0 else None

    @property
    def complete(self) -> bool:
        """Every read task finished: the batch goes on with what follows the read (state, the Delta commit),
        for a time this cannot tell."""
        return self.tasks_done >= self.tasks

    def summary(self) -> str:
        """One line for the job's log."""
        if self.complete:
            return (f"batch {self.batch_id}: all {self.records:,} records read ({self.tasks} read tasks) in "
                    f"{self.seconds:.0f} s; writing")
        left = f", ~{(self.records - self.read) / self.rate:.0f} s left to read" if self.rate else ""
        return (f"batch {self.batch_id}: ~{self.read:,} of {self.records:,} records read "
                f"({self.tasks_done} of {self.tasks} read tasks) in {self.seconds:.0f} s{left}")


class ReadTracker:
    """Samples the running micro-batch of one streaming query (see the module doc).

    Args:
        tracker: ``SparkContext.statusTracker()``.
        group: The query's job group: its ``runId``.
        batch_range: ``batch_id -> (start offsets, end offsets)`` of a batch, from the offset log.
        next_batch: The id of the batch that runs next (the last committed one + 1).
        clock: Monotonic seconds.
    """

    def __init__(self, tracker: Any, group: str, *, batch_range: Callable[[int], tuple[Mapping[int, int],
                                                                                       Mapping[int, int]]],
                 next_batch: Callable[[], int], clock: Callable[[], float] = time.monotonic) -> None:
        self.tracker, self.group, self.batch_range, self.next_batch, self.clock = (
            tracker, group, batch_range, next_batch, clock)
        self._batch: int | None = None
        self._seen_at = 0.0
        self._records: int | None = None
        self._start: Mapping[int, int] = {}
        self._partitions = 0
        self._stage: int | None = None
        self._last: Reading | None = None

    def sample(self) -> Reading | None:
        """The running batch's read so far; None when no batch runs, it is young, or its read is not found."""
        batch, now = self.next_batch(), self.clock()
        active = set(self.tracker.getActiveJobsIds())
        if active:
            active &= self._group_jobs()
        if not active:
            # between two jobs of the batch, or in its driver-side commit: the batch it follows has not
            # committed yet (the next batch id has not moved), so what it read stands
            return self._last if self._last is not None and self._last.batch_id == batch else None
        if batch != self._batch:
            self._batch, self._seen_at, self._records, self._stage = batch, now, None, None
        if now - self._seen_at < MIN_BATCH_SECONDS:
            return None
        if self._records is None:
            start, end = self.batch_range(batch)
            self._start = {p: start.get(p, o) for p, o in end.items()}
            sizes = [max(0, o - start.get(p, o)) for p, o in end.items()]
            self._records, self._partitions = sum(sizes), sum(1 for s in sizes if s)
        if (self._records or 0) <= READ_SPLIT_RECORDS:  # a small batch: read by one task per partition, soon done
            return None
        if self._stage is None:
            self._stage = self._read_stage(active)
            if self._stage is None:
                return None
        info = self.tracker.getStageInfo(self._stage)
        if info is None or not info.numTasks:
            return None
        done = min(info.numCompletedTasks, info.numTasks)
        if self._last is not None and self._last.batch_id == batch and self._last.complete:
            return self._last  # read: its read time stays what it was
        self._last = Reading(batch_id=batch, start=self._start, records=self._records,
                             read=self._records * done // info.numTasks, tasks=info.numTasks, tasks_done=done,
                             seconds=now - self._seen_at)
        return self._last

    def _group_jobs(self) -> set[int]:
        """The ids of the jobs Spark remembers for the query's group, in two calls into the JVM: PySpark's
        ``getJobIdsForGroup`` fetches its answer one element per call (35 ms for 300 jobs; up to
        ``spark.ui.retainedJobs`` of them), which every job of a view host paid every second."""
        jtracker = getattr(self.tracker, "_jtracker", None)
        if jtracker is None:
            return set(self.tracker.getJobIdsForGroup(self.group))
        from pyspark import SparkContext

        from kappa.runtime.spark import jvm_class

        arrays = jvm_class(SparkContext._jvm, "java.util.Arrays")
        text = arrays.toString(jtracker.getJobIdsForGroup(self.group))
        return {int(i) for i in text.strip("[]").split(",") if i.strip()}

    def _read_stage(self, jobs: set[int]) -> int | None:
        """The batch's read stage: the lowest stage id among its running jobs with a task per partition it reads
        (or more) - the smaller stages before it read lookups and the table's log."""
        least = max(2, self._partitions)
        found = []
        for job in jobs:
            info = self.tracker.getJobInfo(job)
            for stage in (info.stageIds if info is not None else []):
                s = self.tracker.getStageInfo(stage)
                if s is not None and s.numTasks >= least:
                    found.append(stage)
        return min(found) if found else None

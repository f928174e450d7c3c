"""What happens to one micro-batch of a view version, phase by phase (the body of ``foreachBatch``).

.. code-block:: text

    compute      read + decode + transform, each row computed once: a small live batch of a stateful view is
                 collected to the driver in one job, its output and bad records together
                 (:func:`kappa.runtime.sink.collect_split`); any other batch is kept for the jobs that read it
                 (:func:`kappa.runtime.spark.computed_once`) - a small live one's rows and bad records collected
                 (:func:`kappa.runtime.sink.collect_rows`), a larger one's statistics (rows, bad records,
                 event-time maximum, event times for the latency histogram) from one aggregation over it
    write        one idempotent Delta commit of the view (appId, txnVersion = batch id; lineage as userMetadata;
                 a small live batch's through delta-rs)
    quarantine   one idempotent append of the batch's bad records and, for views that keep them, the late records
                 the watermark dropped from it (only when there are any; :mod:`kappa.runtime.late`)
    bookkeeping  metrics, latency histogram, lookup refresh

Spark's own phases (offsets, planning, offset-log write, commit-log write) come from the query's progress
report; :class:`PhaseTimes` keeps the last batch's durations of both for the metrics and the benchmark.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from kappa.runtime.lineage import with_expectations
from kappa.runtime.metrics import LATENCY_BUCKETS
from kappa.runtime.plan import KIND, OUT, SIDE, SIDE_COLUMNS, split_batch
from kappa.runtime.sink import LIVE_ROWS, collect_rows, collect_split
from kappa.runtime.spark import computed_once
from kappa.errors import KappaError

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

    from kappa.runtime.deltars import Collected
    from kappa.runtime.lookups import LookupCache
    from kappa.runtime.metrics import ViewMetrics
    from kappa.runtime.sink import DeltaSink, QuarantineSink
    from kappa.runtime.view import ViewDefinition

__all__ = ["BatchHandler", "BatchStats", "ExpectationFailed", "PhaseTimes", "fault"]

log = logging.getLogger("kappa.runtime.batch")

#: Our phases of a micro-batch, in order.
PHASES = ("compute", "write", "quarantine", "bookkeeping")
#: A stateless view's micro-batch of at most this many records is read by one task (``coalesce(1)``): Spark plans
#: one task per Kafka partition, and each task of a live batch of a few hundred records costs more than its reading
#: (serialization, scheduling, a cached block); bigger batches (catch-up, replays) keep every core busy.
ONE_TASK_RECORDS = 5_000


def fault(spec: str | None, phase: str, batch_id: int) -> None:
    """Fault injection for the crash tests only: SIGKILL the whole driver (Python + JVM) at a named phase.

    ``spec`` is ``KAPPA_FAULT`` (``Settings.fault``): ``<phase>@<batch id>`` (phases: before_write,
    between_commits, after_commit; before_switch@0: a replay's archive part committed, its checkpoint not yet
    switched to the log, :mod:`kappa.runtime.archive`). A real crash cannot be timed to the instant between the Delta commit and the
    checkpoint commit; this can.
    """
    if spec and spec == f"{phase}@{batch_id}":
        log.warning("fault injection: killing driver at %s of batch %s", phase, batch_id)
        os.killpg(os.getpgrp(), signal.SIGKILL)


class ExpectationFailed(KappaError, RuntimeError):
    """A ``fail`` expectation of the view version broke: the micro-batch was not written, the job stops."""


@dataclass(frozen=True)
class Checked:
    """The outcome of a micro-batch's expectations: rows to write, rows dropped into the quarantine, counts."""

    output: "DataFrame"
    dropped: "DataFrame | None"
    rows: int
    dropped_rows: int
    violations: dict[str, int]


def check_expectations(view: "ViewDefinition", output: "DataFrame", batch_id: int, *, topic: str) -> Checked:
    """Count each expectation's violations over ``output`` (one aggregation), stop on a ``fail`` rule that broke
    (:class:`ExpectationFailed`, before anything of the batch is written) and split off the rows a ``drop`` rule
    keeps out of the table, shaped as quarantine rows (the row as JSON in ``raw_value``)."""
    from pyspark.sql import functions as F

    rules = view.expectations
    drops = [r for r in rules if r.on_violation == "drop"]
    dropped_flag = F.lit(False)
    for r in drops:
        dropped_flag = dropped_flag | r.violated()
    counts = output.agg(F.count(F.lit(1)).alias("_rows"), F.sum(F.when(dropped_flag, 1).otherwise(0)).alias("_drop"),
                        *[F.sum(F.when(r.violated(), 1).otherwise(0)).alias(f"_v{i}")
                          for i, r in enumerate(rules)]).collect()[0]
    rows, n_dropped = int(counts["_rows"]), int(counts["_drop"] or 0)
    violations = {r.name: int(counts[f"_v{i}"] or 0) for i, r in enumerate(rules)}
    for rule in rules:
        if rule.on_violation == "fail" and violations[rule.name]:
            example = output.where(rule.violated()).limit(1).collect()[0].asDict()
            raise ExpectationFailed(
                f"{view.ref}: expectation {rule.name} ({rule.condition}) failed on {violations[rule.name]} of "
                f"{rows} rows of micro-batch {batch_id}, e.g. {example}; nothing of this batch was written")
    if not n_dropped:
        return Checked(output=output, dropped=None, rows=rows, dropped_rows=0, violations=violations)
    reason = F.coalesce(*[F.when(r.violated(), F.lit(r.reason)) for r in drops])
    flagged = output.withColumn("_kappa_reason", reason)
    dropped = flagged.where(F.col("_kappa_reason").isNotNull()).select(
        F.lit(topic).alias("topic"), F.lit(None).cast("int").alias("partition"),
        F.lit(None).cast("bigint").alias("offset"), F.lit(None).cast("timestamp").alias("kafka_timestamp"),
        F.lit(None).cast("binary").alias("raw_key"), F.to_json(F.struct(*output.columns)).cast("binary").alias("raw_value"),
        F.col("_kappa_reason").alias("error"))
    kept = flagged.where(F.col("_kappa_reason").isNull()).drop("_kappa_reason")
    return Checked(output=kept, dropped=dropped, rows=rows, dropped_rows=n_dropped, violations=violations)


@dataclass
class PhaseTimes:
    """Durations (seconds) of the phases of the last micro-batch, and their totals since start."""

    last: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    batches: int = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.last[name] = seconds
        self.total[name] = self.total.get(name, 0.0) + seconds


@dataclass(frozen=True)
class BatchStats:
    """One aggregation over a micro-batch: what it holds, without a second pass.

    ``event_groups`` are (event-time bucket start in ms or -1, rows, sum of event times in ms): 100 ms buckets for
    events of the last two minutes, 1 s for the last hour, one group for older ones - enough for the latency
    histogram (its sum is exact) at a bounded number of groups.
    """

    rows: int
    bad: int
    event_max: Any
    event_groups: tuple[tuple[int, int, int], ...]
    #: distinct window ends of the output rows (windowed views; the sink tracks which windows are open)
    window_ends: frozenset = frozenset()


def batch_stats(out: "DataFrame", side: "DataFrame", *, latency_column: str | None,
                event_max_column: str | None, window_end_column: str | None = None) -> BatchStats:
    from pyspark.sql import functions as F

    now_ms = int(time.time() * 1000)
    ms = F.unix_millis(F.col(latency_column)) if latency_column else F.lit(None).cast("bigint")
    bucket = (F.when(ms >= F.lit(now_ms - 120_000), F.floor(ms / 100) * 100)
              .when(ms >= F.lit(now_ms - 3_600_000), F.floor(ms / 1000) * 1000).otherwise(F.lit(-1)))
    none_ts = F.lit(None).cast("timestamp")
    emax = F.col(event_max_column) if event_max_column else none_ts
    wend = F.col(window_end_column) if window_end_column else none_ts
    tagged = out.select(F.lit(OUT).alias(KIND), ms.alias("ms"), bucket.cast("bigint").alias("bucket"),
                        emax.alias("emax"), wend.alias("wend")).unionByName(
        side.select(F.lit(SIDE).alias(KIND), F.lit(None).cast("bigint").alias("ms"),
                    F.lit(None).cast("bigint").alias("bucket"), none_ts.alias("emax"), none_ts.alias("wend")))
    groups = tagged.groupBy(KIND, "bucket").agg(F.count(F.lit(1)).alias("n"), F.sum("ms").alias("s"),
                                                 F.max("emax").alias("emax"),
                                                 F.collect_set("wend").alias("wends")).collect()
    rows = sum(g["n"] for g in groups if g[KIND] == OUT)
    bad = sum(g["n"] for g in groups if g[KIND] == SIDE)
    maxima = [g["emax"] for g in groups if g["emax"] is not None]
    events = tuple((int(g["bucket"]), int(g["n"]), int(g["s"])) for g in groups
                   if g[KIND] == OUT and g["bucket"] is not None and g["s"] is not None)
    ends = frozenset(end for g in groups for end in (g["wends"] or ()))
    return BatchStats(rows=rows, bad=bad, event_max=max(maxima) if maxima else None, event_groups=events,
                      window_ends=ends)


def collected_stats(out: "Collected", bad: int, *, latency_column: str | None, event_max_column: str | None,
                    window_end_column: str | None = None) -> BatchStats:
    """:func:`batch_stats` of a micro-batch whose output rows were collected to the driver (no Spark job)."""
    from kappa.runtime.sink import _timestamp

    now_ms = int(time.time() * 1000)
    groups: dict[int, list[int]] = {}
    if latency_column:
        for micros in out.values(latency_column):
            if micros is None:
                continue
            ms = micros // 1000
            bucket = (ms // 100 * 100 if ms >= now_ms - 120_000 else ms // 1000 * 1000 if ms >= now_ms - 3_600_000
                      else -1)
            group = groups.setdefault(bucket, [0, 0])
            group[0] += 1
            group[1] += ms
    maxima = [v for v in out.values(event_max_column) if v is not None] if event_max_column else []
    ends = frozenset(_timestamp(v) for v in out.values(window_end_column) if v is not None) if window_end_column \
        else frozenset()
    return BatchStats(rows=len(out.rows), bad=bad, event_max=_timestamp(max(maxima)) if maxima else None,
                      event_groups=tuple((b, n, total) for b, (n, total) in groups.items()), window_ends=ends)


def latency_buckets(groups: tuple[tuple[int, int, int], ...], committed_at: float) -> tuple[list[tuple[int, int]], float]:
    """(bucket index, count) pairs of :data:`LATENCY_BUCKETS` and the exact latency sum, from event-time groups."""
    counts: dict[int, int] = {}
    total = 0.0
    for start_ms, n, sum_ms in groups:
        total += n * committed_at - sum_ms / 1000.0
        mean = committed_at - (sum_ms / n) / 1000.0 if start_ms < 0 else committed_at - start_ms / 1000.0
        index = sum(1 for b in LATENCY_BUCKETS if mean > b)
        counts[index] = counts.get(index, 0) + n
    return sorted(counts.items()), total


@dataclass
class BatchHandler:
    """The ``foreachBatch`` body of one view version's query.

    Args:
        view: the view version.
        sink: its Delta sink.
        quarantine: the quarantine sink.
        metrics: its Prometheus metrics.
        lookups: the lookup cache (refreshed after each batch).
        lineage: ``batch id -> userMetadata`` (the batch's offsets and watermark, see :mod:`kappa.runtime.lineage`).
        catching_up: ``(session, batch id) -> bool``: the batch stopped at the micro-batch bound with more of the
            log waiting (bulk catch-up, :class:`kappa.runtime.sink.DeltaSink`).
        late_rows: ``(session, batch id) -> records the watermark dropped from the batch, or None``
            (:mod:`kappa.runtime.late`; views that keep late rows).
        records: ``(session, batch id) -> records of the log the batch reads, or None`` when not known (from the
            offset log): a stateless view's small batch is read by one task (:data:`ONE_TASK_RECORDS`).
    """

    view: "ViewDefinition"
    sink: "DeltaSink"
    quarantine: "QuarantineSink"
    metrics: "ViewMetrics"
    lookups: "LookupCache"
    lineage: Callable[[Any, int], str | None]
    catching_up: Callable[[Any, int], bool] = lambda _session, _batch_id: False
    output_columns: list[str] = field(default_factory=list)
    times: PhaseTimes = field(default_factory=PhaseTimes)
    late_rows: Callable[[Any, int], "DataFrame | None"] = lambda _session, _batch_id: None
    records: Callable[[Any, int], int | None] = lambda _session, _batch_id: None
    #: physical topic of the view's stream (the quarantine rows of dropped output rows name it)
    topic: str = ""
    #: fault injection of the crash tests (``KAPPA_FAULT``, see :func:`fault`)
    fault: str | None = None
    #: held around the batch's view-table commit: a repair handed to this driver commits between two batches
    #: (:class:`kappa.runtime.repairs.RepairInbox`)
    commit_lock: threading.Lock = field(default_factory=threading.Lock)
    #: called under ``commit_lock`` right before the view-table commit; raises to fail the micro-batch instead (an
    #: object-store lake's driver lease lost: :meth:`kappa.runtime.lock.LakeLease.check`)
    guard: Callable[[], None] = lambda: None
    #: the fields of a stateful micro-batch's ``out`` column (:func:`kappa.runtime.plan.stateful_plan`), once known
    _out_fields: "tuple[Any, ...] | None" = field(default=None, init=False, repr=False)

    def __call__(self, batch: "DataFrame", batch_id: int) -> None:
        try:
            self._handle(batch, batch_id)
        except Exception:
            self.metrics.g(self.metrics.batches_failed).inc()
            raise

    def _count_expectations(self, checked: Checked) -> None:
        m = self.metrics
        m.g(m.expectation_rows).inc(checked.rows)
        for rule in self.view.expectations:
            if checked.violations.get(rule.name):
                m.g(m.expectation_violations, expectation=rule.name,
                    action=rule.on_violation).inc(checked.violations[rule.name])

    def _frames(self, batch: "DataFrame") -> "tuple[DataFrame, DataFrame]":
        """(output rows, bad records) of the micro-batch."""
        if self.view.stateful:
            return split_batch(batch, self.output_columns)
        from kappa.runtime.parsing import invalid_rows, valid_rows

        side = invalid_rows(batch).withColumnRenamed("_error", "error").select(*SIDE_COLUMNS)
        if self.view.keep_invalid:  # every record goes to the table (an archive): the quarantine gets none
            from kappa.runtime.archive import archive_rows

            return self.view.transform(archive_rows(batch), **self.lookups.frames(self.view.lookups)), side.limit(0)
        output = self.view.transform(valid_rows(batch), **self.lookups.frames(self.view.lookups))
        return output, side

    def _one_pass(self, batch: "DataFrame", records: int | None) -> "tuple[Collected, list[dict[str, Any]]] | None":
        """A stateful view's small live micro-batch collected in one job (:func:`kappa.runtime.sink.collect_split`),
        or None: the batch is then computed once and kept for the several jobs that read it."""
        view = self.view
        if (not view.stateful or view.expectations or records is None or records > LIVE_ROWS
                or not self.sink.live(batch.sparkSession)):
            return None
        if self._out_fields is None:  # the same in every micro-batch of the query: read from the JVM once
            self._out_fields = tuple(batch.schema["out"].dataType.fields)
        return collect_split(batch, self.output_columns, out_fields=self._out_fields)

    def _handle(self, batch: "DataFrame", batch_id: int) -> None:
        m, times, view = self.metrics, self.times, self.view
        session = batch.sparkSession
        records = self.records(session, batch_id)
        if not view.stateful and records is not None and records <= ONE_TASK_RECORDS:
            batch = batch.coalesce(1)  # a stateful view's batch comes out of its shuffle: its tasks are the state's
        with ExitStack() as held:
            with times.phase("compute"):
                one_pass = self._one_pass(batch, records)
                if one_pass is None:
                    batch = held.enter_context(computed_once(batch))
                output, side = self._frames(batch)
                checked = None
                if view.expectations:
                    checked = check_expectations(view, output, batch_id, topic=self.topic)
                    output = checked.output
                    self._count_expectations(checked)
                fin = view.finality
                # a small live batch: its rows and bad records collected, its statistics counted here and its
                # commits made through delta-rs (kappa.runtime.sink: no Spark job to write it)
                if one_pass is not None:
                    collected, side_rows = one_pass
                else:
                    collected = collect_rows(output) if self.sink.live(session) else None
                    side_rows = self.quarantine.collect(side) if collected is not None else None
                columns = dict(latency_column=view.latency_column,
                               event_max_column=fin.event_max_column if fin else None,
                               window_end_column=fin.window_end_column if fin else None)
                if collected is not None:
                    stats = collected_stats(collected, len(side_rows), **columns)
                else:
                    stats = batch_stats(output, side, **columns)
            with times.phase("write"):
                lineage = self.lineage(session, batch_id)
                if checked is not None:
                    lineage = with_expectations(lineage, checked.rows, checked.violations)
                behind = self.sink.bulk(session) and self.catching_up(session, batch_id)
                fault(self.fault, "before_write", batch_id)
                with self.commit_lock:
                    self.guard()
                    done = self.sink.write(output, batch_id, user_metadata=lineage, rows=stats.rows,
                                           batch_event_max=stats.event_max, window_ends=stats.window_ends,
                                           catching_up=behind, collected=collected)
                if done == "compact":
                    log.info("%s: caught up at batch %s; staged batches compacted into the view table", view.ref,
                             batch_id)
                fault(self.fault, "between_commits", batch_id)
            with times.phase("quarantine"):
                late = self.late_rows(session, batch_id)
                dropped = checked.dropped if checked is not None else None
                if stats.bad or late is not None or dropped is not None:
                    if side_rows is not None and dropped is None:
                        late_rows = self.quarantine.collect(late) if late is not None else []
                        written = self.quarantine.append(side_rows + late_rows, batch_id)
                    else:
                        kept = side
                        for more in (late, dropped):
                            kept = kept if more is None else kept.unionByName(more)
                        written = self.quarantine.write(kept, batch_id)
                    m.g(m.quarantined).inc(stats.bad)
                    m.g(m.late_kept).inc(written - stats.bad - (checked.dropped_rows if dropped is not None else 0))
                fault(self.fault, "after_commit", batch_id)
            committed_at = time.time()
            with times.phase("bookkeeping"):
                m.g(m.batches).inc()
                m.g(m.last_batch_id).set(batch_id)
                m.g(m.rows_written).inc(stats.rows)
                if view.latency_column and stats.event_groups:
                    m.latency.add(*latency_buckets(stats.event_groups, committed_at))
                refreshed = self.lookups.refresh(view.lookups.values()) if view.lookups else []
                if refreshed:
                    log.info("%s: lookups %s changed; the next batch joins the new values", view.ref, refreshed)
            times.batches += 1
            for phase in PHASES:
                m.g(m.phase_seconds, phase=phase).set(times.last.get(phase, 0.0))

"""Verification by recompute: a view version's own transform, re-run by Spark over exactly the slice of the log
its Delta table holds, compared with the table.

The plain-Python oracles (:mod:`kappa.verify.oracle`) check a view's *business logic* against a second implementation,
so they exist only for the built-in views. This check needs no second implementation: it takes the version's own
transform and recomputes, in one clean run without checkpoints, restarts, Delta, MERGE or bulk catch-up, what
the table must hold if the streaming machinery lost, duplicated or corrupted nothing across crashes, restarts,
state and commits. It works for any view version.

What the stream was allowed to see is reproduced from the lineage every Delta commit carries
(:mod:`kappa.runtime.lineage`): each micro-batch's end offsets, watermark and the offsets of the lookups it joined.

.. code-block:: text

    Delta commits of the run: batch ids, end offsets, watermarks, lookup offsets (kappa.runtime.lineage)
      │
    Kafka [start, end) ─ decode ─> valid records, each tagged with the recorded micro-batch it belonged to
      │                           (the invalid ones are compared with the quarantine: none lost or doubled)
      ▼
    one parquet folder per recorded micro-batch and kind (valid / dropped as late / invalid; one Kafka read, one
      │ Spark job, no Python UDF), kept under $KAPPA_HOME/verify-cache for the next check of the same run, which
      │ reads and stages only the batches recorded since (kappa.verify.stagecache)
      │ Stateful views: handed one batch at a time to a fresh streaming query (file source -> the view's
      │ transform in the streaming plan), so Spark keeps state, evicts it and drops late rows exactly as it did -
      │ same cuts, same watermarks (also the no-data batches, by not handing the next batch over before the
      │ engine ran them). A windowed aggregation that declares its late bound is coalesced instead: runs of
      │ recorded batches (up to ~500,000 records) are handed over as one, the rows the original dropped as late
      │ left out (staged apart, each by the watermark of the batch before its own), and each run's watermark is
      │ checked against the recorded one - the re-run then costs what its records cost, not ~0.35 s per
      │ recorded micro-batch (kappa.runtime.rerun.coalescable says why the rest may not; a watermark that
      │ differs falls back to one batch at a time). Stateless views: batch jobs, each batch joined with the
      │ lookups it joined - the batches that joined the same lookup contents in one job when the write is an
      │ append (cuts cannot matter there).
      ▼
    every batch's output, tagged with its batch -> the view's write semantics in one batch job
      (append: all rows; merge: the last batch's row per key; upsert_delete: latest per key, tombstones
       delete; finality flag from the event-time maximum before the last batch)
      ▼
    compared with the table at the verified Delta version: same keys, same values, no duplicated key;
    a failure names the first differing key.

Why not one batch job over the whole range: a stateful view's result depends on where the micro-batches were
cut (late rows are dropped by the previous batch's watermark, session state is evicted and cannot merge with
later events), which a single batch job cannot express; replaying the recorded cuts through Spark's own
streaming engine reproduces it for any stateful operator without knowing which one the view uses. Coalescing
gives up only the cuts a windowed aggregation does not depend on once its late rows are known.

What it cannot see: a mistake in the transform itself (it is the same code - the oracle or a reviewer of the
diff report catches that), a record that was never decoded the way the schema says (the oracle re-validates with
jsonschema), and anything outside the verified Delta version.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kappa.runtime.rerun import (BATCH, INVALID, KIND, CutsMatter, LookupSnapshots, RecomputeError, Step,
                                 apply_writes, batch_ranges, coalesce_steps, coalescable, empty_parquet, plan_steps,
                                 read_range, rerun_stateful, rerun_stateless, scratch_dir, session_for, stage_batches,
                                 step_records)
from kappa.verify.compare import Check, compare
from kappa.verify.stagecache import Staging, format_fingerprint, staging

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

    from kappa.config import Settings
    from kappa.runtime.lineage import BatchBoundary
    from kappa.runtime.view import ViewDefinition

__all__ = ["recompute"]

log = logging.getLogger("kappa.verify.recompute")


def recompute(view: "ViewDefinition", settings: "Settings", *, table_path: str, delta_version: int,
              batches: Sequence["BatchBoundary"], start: Mapping[int, int], end_timestamp_ms: int | None = None,
              quarantine_path: str | None = None, spark: "SparkSession | None" = None,
              timeout: float = 1800.0, base: tuple[str, int] | None = None, coalesce: bool = True,
              run: str | None = None) -> Check:
    """Recompute ``view`` over the micro-batches ``batches`` (every batch of the run, from its first) starting at
    ``start`` and compare the result with the table at ``delta_version``.

    Args:
        view: The version's definition (its own transform is what runs).
        settings: Kafka, lake, jars.
        table_path: The version's Delta table.
        delta_version: The table version checked (it holds exactly ``batches``).
        batches: Every recorded boundary of the run, oldest first, ids 0..N (:func:`kappa.runtime.lineage.batches_from_history`).
        start: The run's start offsets (records before them were never the run's).
        end_timestamp_ms: A bounded run only processed records with a Kafka timestamp before this.
        quarantine_path: Also check the run's quarantined (invalid) records: none lost, none doubled.
        spark: A session to use; by default the active one, else a local one built and stopped here.
        timeout: Give up after this many seconds.
        base: ``(table, Delta version)`` a continued version was seeded from (``upgrade=continue``): its rows
            come before the first batch, and the write semantics apply the batches on top of them.
        coalesce: Re-run runs of recorded batches as one micro-batch where the view allows it
            (:func:`kappa.runtime.rerun.coalescable`); False: one recorded batch at a time.
        run: What identifies the recorded run (e.g. its table's Delta id and its application id): the staged
            records are kept for the next recompute of the same run, which then reads and stages only the batches
            recorded since (:mod:`kappa.verify.stagecache`). None: staged in scratch, removed afterwards.

    Returns:
        A :class:`Check` named ``recompute``; ``passed`` False (with the reason as message) also when the run
        cannot be recomputed exactly.
    """
    t0 = time.monotonic()
    try:
        steps, ends = plan_steps(batches, start)
    except RecomputeError as exc:
        return Check(name="recompute", passed=False, message=f"recompute impossible: {exc}")
    session, own = session_for(settings, spark)
    late_bound = view.late_bound() if view.stateful and view.late_bound is not None else None
    key = None if run is None else {
        "run": run, "topic": settings.topic(view.stream_topic), "start": {str(p): int(o) for p, o in start.items()},
        "end_timestamp_ms": end_timestamp_ms, "format": format_fingerprint(view),
        "late_bound": None if late_bound is None else str(late_bound)}
    scratch = Path(tempfile.mkdtemp(prefix=f"recompute-{view.name}-v{view.version}-", dir=scratch_dir(settings)))
    args = dict(table_path=table_path, delta_version=delta_version, steps=steps, ends=ends, start=start,
                end_timestamp_ms=end_timestamp_ms, quarantine_path=quarantine_path, timeout=timeout, t0=t0, base=base,
                late_bound=late_bound)
    try:
        with staging(settings, view, key, str(scratch)) as staged:
            try:
                return _recompute(session, view, settings, staged=staged, scratch=scratch / "run", coalesce=coalesce,
                                  **args)
            except CutsMatter as exc:  # the view's result depends on the cuts after all: as recorded, one at a time
                log.warning("recompute of %s: the coalesced re-run does not reproduce the recorded cuts (%s); "
                            "re-running one recorded batch at a time", view.ref, exc)
                return _recompute(session, view, settings, staged=staged, scratch=scratch / "per-batch",
                                  coalesce=False, **args)
    except RecomputeError as exc:
        return Check(name="recompute", passed=False, message=f"recompute impossible: {exc}",
                     details={"seconds": round(time.monotonic() - t0, 1)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if own:
            from kappa.runtime.spark import stop_spark

            stop_spark(session)


def _recompute(spark: "SparkSession", view: "ViewDefinition", settings: "Settings", *, table_path: str,
               delta_version: int, steps: list[Step], ends: dict[int, list[int]], start: Mapping[int, int],
               end_timestamp_ms: int | None, quarantine_path: str | None, staged: Staging, scratch: Path,
               timeout: float, t0: float, base: tuple[str, int] | None = None, coalesce: bool = True,
               late_bound: Any = None) -> Check:
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    from kappa.runtime.parsing import INTERNAL_COLUMNS, decoded_schema

    phases: dict[str, float] = {}
    mark = time.monotonic()
    schema = StructType([f for f in decoded_schema(spark, view.stream_format).fields
                         if f.name not in INTERNAL_COLUMNS])
    entries = Staging.entries(batch_ranges(steps, ends, start))
    feed, out = scratch / "feed", scratch / "out"
    feed.mkdir(parents=True)
    lookups_for = LookupSnapshots(spark, settings, view, steps)
    per_batch = "coalescing off"
    try:
        if view.stateful and coalesce:
            per_batch = coalescable(view, view.transform(spark.readStream.schema(schema).parquet(str(feed)),
                                                         **lookups_for.single()))
        coalesced = per_batch is None
        # the leading units an earlier recompute of this run staged (a coalesced run's steps, else single batches)
        fixed = staged.reuse(entries, single=not coalesced)
        reused, first = staged.records(), sum(len(unit) for unit in fixed)
        run_steps, run_ends = steps, ends
        if coalesced:
            try:
                run_steps, run_ends = coalesce_steps(steps, ends, start, fixed=fixed)
            except ValueError as exc:  # staged runs this plan cannot re-run as they were: stage everything again
                log.warning("recompute of %s: not reusing what was staged (%s)", view.ref, exc)
                staged.reuse([])  # removes every staged unit
                reused, first = 0, 0
                run_steps, run_ends = coalesce_steps(steps, ends, start)
        new_units = [step for step in run_steps if step.covers[0] >= first]  # batch ids are 0..N (plan_steps)
        since = {p: int(e[first - 1]) if first else int(start.get(p, 0)) for p, e in ends.items()}
        end = {p: e[-1] for p, e in ends.items() if e}
        incoming = None
        if first == 0 or any(end[p] > since[p] for p in end):
            decoded = read_range(spark, settings, view, settings.topic(view.stream_topic),
                                 start if first == 0 else since, end)
            if end_timestamp_ms is not None:  # what a bounded run's job filters right after decoding
                decoded = decoded.where(F.col("kafka_timestamp") < F.timestamp_millis(F.lit(int(end_timestamp_ms))))
            incoming = staged.incoming()
            stage_batches(spark, decoded, steps, ends, start, incoming, first=first, late_bound=late_bound,
                          tags={pos: step.pos for step in new_units for pos in step.covers})
        by_pos = {entry["pos"]: entry for entry in entries}
        staged.adopt(incoming, [{"pos": step.pos, "batches": [by_pos[pos] for pos in step.covers]}
                                for step in new_units])
        if first:
            log.info("recompute of %s: %d of %d recorded batches (%s records) staged by an earlier recompute of the "
                     "run; read %s records", view.ref, first, len(steps), f"{reused:,}",
                     f"{staged.records() - reused:,}")
        phases["read_and_stage"], mark = round(time.monotonic() - mark, 1), time.monotonic()
        log.info("recompute of %s: re-running %d recorded micro-batches (%s records) %s", view.ref, len(steps),
                 f"{sum(step_records(steps, ends, start)):,}",
                 f"as {len(run_steps)} steps" if coalesced else f"one at a time ({per_batch})")
        if view.stateful:
            out_schema, batches_run, skipped = rerun_stateful(
                spark, view, run_steps, staged=staged.root, feed=feed, out=out, schema=schema, lookups_for=lookups_for,
                empty=lambda: empty_parquet(spark, schema, scratch / "empty"), checkpoint=scratch / "checkpoint",
                timeout=timeout, records=step_records(run_steps, run_ends, start), late_rows=not coalesced)
        else:
            out_schema, batches_run, skipped = rerun_stateless(spark, view, steps, staged=staged.root, out=out,
                                                               schema=schema, lookups_for=lookups_for)
    finally:
        lookups_for.close()

    phases["rerun"], mark = round(time.monotonic() - mark, 1), time.monotonic()
    log.info("recompute of %s: re-run done in %.0f s; comparing its result with the table at Delta version %s%s",
             view.ref, phases["rerun"], delta_version, " and the quarantine" if quarantine_path is not None else "")
    outputs = spark.read.schema(StructType([*out_schema.fields, StructField(BATCH, IntegerType())])).parquet(str(out))
    if base is not None:  # the seed is "batch -1": every batch of the run applies on top of it
        seeded = spark.read.format("delta").option("versionAsOf", base[1]).load(base[0])
        outputs = seeded.select(*[
            (F.col(f"`{f.name}`") if f.name in seeded.columns else F.lit(False) if f.name == "is_tombstone"
             else F.lit(None)).cast(f.dataType).alias(f.name) for f in out_schema.fields],
            F.lit(-1).cast("int").alias(BATCH)).unionByName(outputs)
    expected = apply_writes(view, outputs, last=steps[-1].pos if steps else None)
    table = spark.read.format("delta").option("versionAsOf", delta_version).load(table_path)
    check = compare(expected, table, keys=view.keys, name="recompute")
    details: dict[str, Any] = {"batches": len(steps), "batches_run": batches_run,
                               "no_data_batches_skipped": skipped, "staged_before": {"batches": first,
                                                                                       "records": reused}}
    if view.stateful:  # how the recorded batches were re-run: coalesced, or one at a time and why
        details["rerun"] = (f"coalesced: {len(steps)} recorded batches in {len(run_steps)} steps" if coalesced
                            else f"one recorded batch at a time: {per_batch}")
    quarantine = None
    if quarantine_path is not None:
        invalid = (spark.read.schema(StructType([*schema.fields, StructField(BATCH, IntegerType()),
                                                 StructField(KIND, StringType())]))
                   .parquet(str(staged.root)).where(F.col(KIND) == INVALID))
        quarantine = _quarantine_check(spark, view, quarantine_path, invalid, last_batch=steps[-1].pos)
        details.update(quarantine)
    phases["compare"] = round(time.monotonic() - mark, 1)
    details["phases_seconds"] = phases
    details["seconds"] = round(time.monotonic() - t0, 1)
    log.info("recompute of %s: %s batches (%s re-run micro-batches, %s recorded no-data batches skipped%s), "
             "phases %s", view.ref, len(steps), batches_run, len(skipped),
             f"; {details['rerun']}" if "rerun" in details else "", phases)
    passed = check.passed and (quarantine is None or quarantine["quarantine_passed"])
    message = check.message
    if quarantine is not None and not quarantine["quarantine_passed"]:
        message = (f"{message}; quarantine: {quarantine['quarantine_missing']} invalid records missing, "
                   f"{quarantine['quarantine_extra']} extra or doubled (e.g. {quarantine['quarantine_example']})")
    return Check(name="recompute", passed=passed, rows=check.rows, expected_rows=check.expected_rows,
                 missing=check.missing, extra=check.extra, different=check.different, duplicates=check.duplicates,
                 first_difference=check.first_difference, examples=check.examples, details=details,
                 message=f"{message} ({len(steps)} micro-batches re-run"
                 + (f" as {batches_run}" if batches_run < len(steps) and coalesced else "")
                 + f" in {details['seconds']:.0f} s)")


def _quarantine_check(spark: "SparkSession", view: "ViewDefinition", path: str, invalid: "DataFrame", *,
                      last_batch: int) -> dict[str, Any]:
    """The run's invalid records against its quarantine rows (late records and rows dropped by expectations
    aside): none missing, none twice."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from kappa.runtime.late import LATE_REASON

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

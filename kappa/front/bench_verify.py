"""``make bench-verify``: what a strict verification of a long-lived version costs.

Usage:
    python -m kappa.front.bench_verify [--rate 1000] [--minutes 60] [--again-minutes 10] [--per-batch]
                                       [--out reports]

A version of ``campaign_window_counts`` follows a live stream (``--rate`` events/s, 5 % late by up to 30 s, 1 %
malformed; a 1 s trigger) for ``--minutes``, as a serving version does, on a broker and a lake of its own. Then:

(a) its strict verification's recompute (:mod:`kappa.verify.recompute`) as verification runs it: coalesced where
    the view allows (:func:`kappa.runtime.rerun.coalescable`) - seconds, phases, recorded and re-run micro-batches;
(b) with ``--per-batch``, the same recompute one recorded batch at a time, side by side (minutes per hour of
    1 s batches: use it with a shorter ``--minutes``);
(c) it follows the stream for ``--again-minutes`` more and is verified again (what verifying a version again later
    costs): the records (a) staged are reused (:mod:`kappa.verify.stagecache`), only the batches recorded since are
    read and staged;
(d) the same verification with nothing staged before (every record read again), side by side with (c);
(e) one row of the table changed by hand (a wrong count), then verified again as (c): it must fail.

Every verification but (e) must pass, and (e) must fail: otherwise the bench exits non-zero. The version's job is stopped
while it is verified (verification runs in its own process in the platform; here the cost is measured alone).

Writes ``<out>/bench-verify.json`` and ``<out>/bench-verify.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["main", "run"]

#: The live job's processing-time trigger (as the views of ``make run``).
TRIGGER_SECONDS = 1.0


def _follow(spark: Any, settings: Any, view: Any, topic: str, universe: Any, *, rate: float, seconds: float,
            seed: int) -> Any:
    """Run the view's job live while ``rate * seconds`` events are produced at ``rate``; stop it once they are
    committed. Returns the (stopped) job."""
    from kappa.log import generator
    from kappa.runtime.job import ViewJob

    job = ViewJob(view, settings, spark=spark, starting="earliest", trigger_seconds=TRIGGER_SECONDS)
    job.start()
    try:
        events = generator.events(int(rate * seconds), seed=seed, universe=universe, live=True, late_fraction=0.05,
                                  max_lateness_ms=30_000, malformed_fraction=0.01)
        generator.produce(settings, topic, events, rate=rate)
        job.process_all_available()
    finally:
        job.stop()
    return job


def _verify(spark: Any, settings: Any, view: Any, job: Any, *, coalesce: bool, cached: bool) -> dict[str, Any]:
    """The recompute of the version's table as its strict verification runs it; seconds and what it did.
    ``cached``: with the run's staged records kept for the next one (as verification runs it), else in scratch."""
    from deltalake import DeltaTable

    from kappa.runtime.lineage import batches_from_history
    from kappa.verify.recompute import recompute

    table = DeltaTable(job.paths.table)
    last = table.transaction_version(job.app_id)
    batches = batches_from_history(table.history(), job.app_id, upto=last)
    start = dict(job.start_offsets or {p: 0 for p in batches[-1].end_offsets})
    records = sum(batches[-1].end_offsets[p] - start.get(p, 0) for p in batches[-1].end_offsets)
    t0 = time.monotonic()
    check = recompute(view, settings, table_path=job.paths.table, delta_version=table.version(), batches=batches,
                      start=start, quarantine_path=job.paths.quarantine, spark=spark, timeout=4 * 3600.0,
                      coalesce=coalesce, run=f"{table.metadata().id}:{job.app_id}" if cached else None)
    seconds = time.monotonic() - t0
    details = check.details or {}
    return {"coalesce": coalesce, "passed": check.passed, "message": check.message, "seconds": seconds,
            "records": records, "batches": len(batches), "batches_run": details.get("batches_run"),
            "rerun": details.get("rerun"), "phases_s": details.get("phases_seconds"), "rows": check.rows,
            "staged_before": (details.get("staged_before") or {}).get("records", 0), "expect_pass": True}


def _corrupt_one_row(spark: Any, table_path: str) -> None:
    """Add one to the count of one row of the table (a commit of its own, as a bug in a writer would make)."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    row = spark.read.format("delta").load(table_path).orderBy("window_start", "campaign_id").first()
    DeltaTable.forPath(spark, table_path).update(
        (F.col("window_start") == F.lit(row["window_start"])) & (F.col("campaign_id") == F.lit(row["campaign_id"])),
        {"view_count": F.col("view_count") + F.lit(1)})


def run(*, rate: float, minutes: float, again_minutes: float, per_batch: bool, out: Path,
        partitions: int = 4) -> dict[str, Any]:
    from kappa.front.bench import bench_settings
    from kappa.log import generator
    from kappa.log.topics import create_topic, declared_topics, ensure_topics
    from kappa.runtime.spark import build_spark, stop_spark
    from kappa.runtime.view import load_view

    settings, broker = bench_settings("bench-verify")
    topic = f"bench-verify-{uuid.uuid4().hex[:6]}"
    result: dict[str, Any] = {"rate": rate, "minutes": minutes, "again_minutes": again_minutes,
                              "trigger_s": TRIGGER_SECONDS, "partitions": partitions, "cores": os.cpu_count(),
                              "verifications": []}
    spark = None
    try:
        ensure_topics(settings, declared_topics(settings))  # campaigns: the view's lookup
        create_topic(settings, topic, partitions, {"retention.ms": "-1"})
        universe = generator.universe(seed=0)
        generator.publish_campaigns(settings, generator.campaign_records(universe))
        spark = build_spark("kappa-bench-verify", settings, driver_memory="2g")
        view = dataclasses.replace(load_view("jobs.campaign_window_counts.v1"), stream_topic=topic, version=98)

        t0 = time.monotonic()
        job = _follow(spark, settings, view, topic, universe, rate=rate, seconds=minutes * 60, seed=1)
        result["follow_s"] = time.monotonic() - t0
        print(f"followed {rate:,.0f} events/s for {result['follow_s'] / 60:.1f} min", flush=True)
        runs = [("(a) coalesced", True, True)] + ([("(b) one batch at a time", False, False)] if per_batch else [])

        def verify(label: str, coalesce: bool, cached: bool, expect_pass: bool = True) -> None:
            measured = {"label": label, **_verify(spark, settings, view, job, coalesce=coalesce, cached=cached),
                        "expect_pass": expect_pass}
            result["verifications"].append(measured)
            print(f"{label}: {measured['seconds']:.0f} s for {measured['batches']:,} recorded micro-batches, "
                  f"{measured['records']:,} records, {measured['staged_before']:,} staged before "
                  f"({measured['message']})", flush=True)

        for label, coalesce, cached in runs:
            verify(label, coalesce, cached)
        if again_minutes > 0:
            t0 = time.monotonic()
            job = _follow(spark, settings, view, topic, universe, rate=rate, seconds=again_minutes * 60, seed=2)
            result["follow_again_s"] = time.monotonic() - t0
            verify(f"(c) again, {again_minutes:g} min later", True, True)
            verify("(d) as (c), nothing staged before", True, False)
            _corrupt_one_row(spark, job.paths.table)
            verify("(e) as (c), one row changed by hand", True, True, expect_pass=False)
    finally:
        if spark is not None:
            stop_spark(spark)
        if broker is not None:
            broker.stop()
    _report(result, out)
    return result


def _report(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-verify.json").write_text(json.dumps(result, indent=2))
    runs = result["verifications"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottoms = [0.0] * len(runs)
    for phase, colour in (("read_and_stage", "#888"), ("rerun", "#2a7"), ("compare", "#37c")):
        values = [float((r.get("phases_s") or {}).get(phase, 0.0)) for r in runs]
        ax.bar([r["label"] for r in runs], values, bottom=bottoms, color=colour, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("seconds")
    ax.set_title(f"strict verification after {result['minutes']:g} min at {result['rate']:,.0f} events/s, "
                 f"{result['trigger_s']:g} s trigger")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench-verify.png", dpi=100)
    table = Table("verification", "seconds", "recorded batches", "re-run batches", "records", "staged before",
                  "passed")
    for r in runs:
        table.add_row(r["label"], f"{r['seconds']:.0f}", f"{r['batches']:,}", f"{r['batches_run'] or 0:,}",
                      f"{r['records']:,}", f"{r.get('staged_before', 0):,}", "yes" if r["passed"] else "no")
    Console().print(table)
    print(f"report: {out / 'bench-verify.json'}, {out / 'bench-verify.png'}")


def main() -> None:
    from kappa.front.bench import run_interruptible

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s of the live stream")
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes the version follows it before (a)")
    parser.add_argument("--again-minutes", type=float, default=10.0, help="minutes more before (c) (0: skip)")
    parser.add_argument("--per-batch", action="store_true", help="also (b): one recorded batch at a time")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    outcome: dict[str, Any] = {}

    def bench() -> None:
        outcome.update(run(rate=args.rate, minutes=args.minutes, again_minutes=args.again_minutes,
                           per_batch=args.per_batch, out=args.out))

    run_interruptible(bench, "the broker")
    failed = [r["label"] for r in outcome.get("verifications", []) if r["passed"] != r["expect_pass"]]
    if failed:
        print(f"error: verification did not give the expected outcome: {', '.join(failed)} (see the report)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

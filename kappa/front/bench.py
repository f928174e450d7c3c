"""``make bench``: how fast is replay compared with simply reading the log, and how fresh are live views?

Usage:
    python -m kappa.front.bench [--events 2000000] [--live-rate 10000] [--live-seconds 60] [--stack-minutes 5]
                          [--out reports]

Measures, in one run on one machine (numbers are only comparable side by side):

(a) the raw log-read ceiling: a plain confluent-kafka consumer reading the benchmark topic to nothing;
(a') Spark's own ceiling on this machine: a batch Kafka read of the topic, counted, and also decoded/validated;
(b) replay throughput of ``campaign_window_counts`` from earliest (events/s, no micro-batch bound, as ``kappa
    replay`` runs by default) and its ratio to (a); also at a quarter and half of the events (own topics), with
    the R^2 of the linear fit of replay time against events;
(c) live end-to-end latency p50/p99 (event time -> committed in Delta) at a steady produce rate, 1 s trigger;
(d) peak RSS of the broker and of the Spark driver JVM;
(e) the peer: the same windowed count with Quix Streams + delta-rs (:mod:`kappa.front.peer`), checked against the
    oracle, and our replay's throughput as a ratio to it;
(f) what keeping late records costs (:mod:`kappa.runtime.late`): a replay of a log with late events all through it,
    with and without the view's ``late_bound``; the live measurement (c) keeps them too (none arrive late there);
(i) replay from the archive (:mod:`kappa.runtime.archive`): a half, all and twice the events of (b) read from the
    topic's archive view (copied first, not timed; each replayed twice, the faster counts), then the largest from
    the log again beside it; events/s, the ratios to (a), to the live rate and to the log replay, the sizes' linear
    fit, its fixed cost phase by phase, and whether each table equals its log replay's; (i') the engine's floor
    under it: the view's transform over the same archived records in plain Structured Streaming, one Delta append
    per micro-batch (:func:`engine_floor_run`), at the same sizes - its fixed cost is what no job of ours can go under;
(h) replay per core: the replay of (b) in a Spark of 1 and of 2 cores (``local[1]``, ``local[2]``; shuffle
    partitions = cores; each after a warm-up replay in its own session), events/s per core and how much of the
    second core the replay uses; with (b)'s fixed cost and marginal rate, what a history of N events takes on C
    cores (docs/performance.md gives the formula);
(g) ``make run``'s steady state: the local stack (view host, producer at 200 events/s, Airflow) started in its
    own home on the bench's broker; after 5 minutes each view's lag and latency, its batches' mean duration and
    phases over the last minute, the RSS/PSS of everything it started and the cores each part used.

Writes ``<out>/bench.json`` and ``<out>/bench.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["bench_settings", "main", "run", "replay_run", "run_interruptible"]

#: Processing-time trigger of the live measurement (c).
LIVE_TRIGGER_SECONDS = 1.0
#: live latency is also reported for what committed after this much load (the first batches compile, JIT)
LIVE_WARMUP_SECONDS = 20.0
#: events of the late-record measurement (f)
LATE_EVENTS = 400_000


class _PeakRss:
    """Samples the resident memory of a process tree in the background and keeps the peak."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5) -> None:
        self.pids, self.interval = pids, interval
        self.peak: dict[str, int] = {name: 0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.interval):
            for name, pid in self.pids.items():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                self.peak[name] = max(self.peak[name], rss)

    def __enter__(self) -> "_PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _spark_jvm_pid(exclude: set[int]) -> int | None:
    """The Spark driver JVM this process launched (its only java child besides the broker)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if "java" in child.name() and child.pid not in exclude and "SparkSubmit" in " ".join(child.cmdline()):
            return child.pid
    return None


def raw_ceiling(settings: Any, topic: str, expected: int) -> dict[str, float]:
    """(a) Read every record of ``topic`` with a plain consumer, doing nothing with it."""
    from confluent_kafka import Consumer

    consumer = Consumer(settings.kafka_client_config({
        "group.id": f"bench-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "fetch.max.bytes": 52428800, "max.partition.fetch.bytes": 10485760}))
    consumer.subscribe([topic])
    n, started, first = 0, time.monotonic(), None
    try:
        while n < expected and time.monotonic() - started < 600:
            msgs = consumer.consume(num_messages=100_000, timeout=1.0)
            if msgs and first is None:
                first = time.monotonic()
            n += sum(1 for m in msgs if m.error() is None)
    finally:
        consumer.close()
    elapsed = time.monotonic() - (first or started)
    return {"records": n, "seconds": elapsed, "events_per_s": n / elapsed if elapsed else 0.0}


def spark_ceiling(spark: Any, settings: Any, topic: str, expected: int) -> dict[str, float]:
    """(a') What Spark itself reaches on this machine: a batch read of ``topic`` counted, then also decoded and
    validated exactly as the view jobs do (:func:`kappa.runtime.parsing.decode`) - the floor under any replay's cost."""
    from kappa.runtime.parsing import AD_EVENTS, decode, valid_rows

    def raw() -> Any:
        return (spark.read.format("kafka").options(**settings.spark_kafka_options()).option("subscribe", topic)
                .option("startingOffsets", "earliest").option("endingOffsets", "latest").load())

    out: dict[str, float] = {}
    for name, count in (("read", lambda: raw().count()), ("decode", lambda: valid_rows(decode(raw(), AD_EVENTS)).count())):
        started = time.monotonic()
        n = count()
        seconds = time.monotonic() - started
        out[f"{name}_seconds"], out[f"{name}_events_per_s"] = seconds, (n / seconds if seconds else 0.0)
        if n != expected:
            raise RuntimeError(f"Spark {name} saw {n} records, expected {expected}")
    return out


def _sizes(events: int) -> list[int]:
    """Replay sizes: a quarter, a half and all of ``events`` (the last is the headline number)."""
    return sorted({max(1000, events // 4), max(1000, events // 2), events})


def _r_squared(xs: list[float], ys: list[float]) -> float | None:
    """R^2 of the least-squares line through (xs, ys) (None with fewer than three points)."""
    if len(xs) < 3:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or ss_tot == 0:
        return None
    slope = sxy / sxx
    ss_res = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(xs, ys))
    return 1.0 - ss_res / ss_tot


def replay_run(spark: Any, settings: Any, view: Any, events: int, *,
               max_offsets_per_trigger: int | None = None) -> dict[str, Any]:
    """(b) Replay ``view`` from earliest to the end of its topic as ``kappa replay`` does by default
    (availableNow, no micro-batch bound: the backlog is one batch); events/s and our phase totals."""
    from kappa.runtime.job import ViewJob

    job = ViewJob(view, settings, spark=spark, starting="earliest", available_now=True,
                  max_offsets_per_trigger=max_offsets_per_trigger)
    t0 = time.monotonic()
    job.start()
    job.await_termination(3600)
    elapsed = time.monotonic() - t0
    failure = job.failure()
    job.stop()
    if failure:
        raise RuntimeError(f"replay failed: {failure}")
    registry, labels = job.metrics.registry, job.metrics.labels
    return {"events": events, "seconds": elapsed, "events_per_s": events / elapsed,
            "batches": job.handler.times.batches, "phases_s": dict(job.handler.times.total),
            "late_batches": len(job.late_batches),
            "late_kept": registry.get_sample_value("kappa_late_records_kept_total", labels) or 0}


class _Timeline:
    """The streaming queries' starts and micro-batches (Spark's own timestamps and phase durations), for the phases
    of a replay: :func:`archive_phases`."""

    def __init__(self, spark: Any) -> None:
        from pyspark.sql.streaming import StreamingQueryListener

        self.events: list[tuple[str, str, dict[str, Any]]] = []
        timeline = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                timeline.events.append(("started", event.name, {"timestamp": event.timestamp}))

            def onQueryProgress(self, event: Any) -> None:
                timeline.events.append(("progress", event.progress.name, json.loads(event.progress.json)))

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        self.spark, self.listener = spark, Listener()

    def __enter__(self) -> "_Timeline":
        self.spark.streams.addListener(self.listener)
        return self

    def __exit__(self, *exc: object) -> None:
        self.spark.streams.removeListener(self.listener)


def _epoch(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def archive_phases(events: list[tuple[str, str, dict[str, Any]]], started: float, ended: float,
                   archive_query: str) -> dict[str, float]:
    """Where the wall time of a replay that starts in the archive went (s, summing to ``ended - started``, epoch
    seconds): the job's start-up until its archive query started (run, tables, lookups, plans); that query's start
    until its first batch; batch 0 (the whole range) by Spark's phases - offsets (the Delta source's snapshot, the
    log's end), planning, the batch itself (read, decode, state, our sink), its offset and commit logs; the no-data
    batch after it (it emits what the watermark closed); the switch to the log until the job ended (a bounded run
    is complete then: the view's own query does not start)."""
    start = next(e[2]["timestamp"] for e in events if e[0] == "started" and e[1] == archive_query)
    batches = {e[2]["batchId"]: e[2] for e in events if e[0] == "progress" and e[1] == archive_query}
    first = batches[0]
    d0 = first["durationMs"]
    phases = {"start-up": _epoch(start) - started, "query start": _epoch(first["timestamp"]) - _epoch(start),
              "batch 0 offsets": d0.get("latestOffset", 0) / 1000, "batch 0 planning":
              (d0.get("getBatch", 0) + d0.get("queryPlanning", 0)) / 1000, "batch 0 run": d0.get("addBatch", 0) / 1000,
              "batch 0 logs": (d0.get("walCommit", 0) + d0.get("commitOffsets", 0)) / 1000}
    last = first
    if 1 in batches:
        last = batches[1]
        phases["no-data batch"] = (_epoch(last["timestamp"]) - _epoch(first["timestamp"])
                                   - d0["triggerExecution"] / 1000 + last["durationMs"]["triggerExecution"] / 1000)
    phases["switch, end"] = ended - _epoch(last["timestamp"]) - last["durationMs"]["triggerExecution"] / 1000
    return phases


def archive_replay_run(spark: Any, settings: Any, view: Any, topic: str, events: int, *, versions: tuple[int, ...],
                       archive_version: int) -> dict[str, Any]:
    """(i) The replay of (b) with its whole range read from the topic's archive (:mod:`kappa.runtime.archive`): the
    archive view copies ``topic`` first (not timed: in production it is written as the log is), then a version whose
    run starts in the archive, handover at the log end, replays it, once per version of ``versions``; the fastest
    run's events/s as (b) (``version``: its version; ``seconds_all``: every run's), where its time went
    (:func:`archive_phases`), and the archive table and ranges it read (``archive_table``, ``ranges``)."""
    from kappa.catalog import load_catalog
    from kappa.identity import ViewPaths
    from kappa.log.topics import partition_offsets
    from kappa.runtime.checkpoint import open_run
    from kappa.runtime.view import load_view

    spec = next(v for v in load_catalog().views.values() if v.archives == view.stream_topic)
    archiver = dataclasses.replace(load_view(spec.module()), stream_topic=topic, version=archive_version)
    t0 = time.monotonic()
    replay_run(spark, settings, archiver, events)
    copied = time.monotonic() - t0
    ends = {p: high for p, (_low, high) in partition_offsets(settings, topic).items()}
    runs = []
    for version in versions:
        replayed = dataclasses.replace(view, stream_topic=topic, version=version)
        open_run(ViewPaths(settings.lake_uri, replayed.name, version), created_by="kappa.front.bench", archive={
            "view": archiver.name, "table": ViewPaths(settings.lake_uri, archiver.name, archive_version).table,
            "start": {str(p): 0 for p in ends}, "handover": {str(p): o for p, o in ends.items()}})
        with _Timeline(spark) as timeline:
            started = time.time()
            run = replay_run(spark, settings, replayed, events)
        time.sleep(0.5)  # the listener's last events arrive asynchronously
        run["timeline_s"] = archive_phases(timeline.events, started, started + run["seconds"],
                                           f"{replayed.ref}:archive")
        run["version"] = version
        runs.append(run)
    best = dict(min(runs, key=lambda r: r["seconds"]))
    best["archive_copy_seconds"], best["seconds_all"] = copied, [r["seconds"] for r in runs]
    best["archive_table"] = ViewPaths(settings.lake_uri, archiver.name, archive_version).table
    best["ranges"] = {p: (0, end) for p, end in ends.items()}
    return best


def engine_floor_run(spark: Any, settings: Any, view: Any, table: str, ranges: dict[int, tuple[int, int]],
                     events: int, *, tries: int = 2) -> dict[str, Any]:
    """(i') The floor under a replay from the archive: the view's own transform over the same archived records in
    plain Structured Streaming - its output mode, availableNow, so the same two micro-batches (the range, then the
    no-data batch the watermark asks for) - each micro-batch counted and appended to a Delta table with
    txnAppId/txnVersion; nothing of the platform's job (run bookkeeping, staging and compaction, finality,
    quarantine, lineage, metrics). Timed like a replay, from reading the lookups to the query's end; the faster of
    ``tries`` runs."""
    import shutil
    import tempfile

    from kappa.runtime.archive import archived_decoded
    from kappa.runtime.lookups import LookupCache
    from kappa.runtime.parsing import valid_rows
    from kappa.runtime.spark import computed_once

    home = Path(tempfile.mkdtemp(prefix="floor-", dir=str(settings.home)))
    seconds = []
    try:
        for i in range(tries):
            out = str(home / f"table-{i}")

            def append(batch: Any, batch_id: int) -> None:
                with computed_once(batch) as kept:  # as a view's micro-batch is kept for its jobs
                    kept.count()
                    (kept.write.format("delta").mode("append").option("txnAppId", "floor")
                     .option("txnVersion", batch_id).save(out))

            t0 = time.monotonic()
            lookups = LookupCache(spark, settings)
            try:
                rows = valid_rows(archived_decoded(spark, table, view.stream_format, ranges, stream=True))
                query = (view.transform(rows, **lookups.frames(view.lookups)).writeStream
                         .outputMode(view.output_mode if view.stateful else "append")
                         .option("checkpointLocation", str(home / f"checkpoint-{i}"))
                         .trigger(availableNow=True).foreachBatch(append).start())
                query.awaitTermination()
                seconds.append(time.monotonic() - t0)
            finally:
                lookups.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return {"events": events, "seconds": min(seconds), "seconds_all": seconds, "events_per_s": events / min(seconds)}


def same_table(spark: Any, settings: Any, view: Any, version: int, other: int) -> bool:
    """Whether two versions' tables hold the same rows (an archive replay beside the log replay of its range)."""
    from kappa.identity import ViewPaths

    a, b = (spark.read.format("delta").load(ViewPaths(settings.lake_uri, view.name, v).table) for v in (version, other))
    return a.exceptAll(b).isEmpty() and b.exceptAll(a).isEmpty()


def _line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through (xs, ys); None with fewer than two distinct xs."""
    import numpy

    if len(set(xs)) < 2:
        return None
    slope, intercept = numpy.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def per_core(settings: Any, view: Any, topic: str, events: int, *, warm_topic: str, warm_events: int,
             cores: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """(h) The replay of (b) in a Spark session of each size in ``cores`` (``local[N]``, shuffle partitions N),
    after a warm-up replay of ``warm_topic`` in the same session: events/s, events/s per core, and the speed-up
    of the largest over one core (its share of linear: ``efficiency``)."""
    from kappa.runtime.spark import build_spark, stop_spark

    runs: dict[str, Any] = {}
    for i, n in enumerate(cores):
        spark = build_spark(f"kappa-bench-{n}-cores", settings, master=f"local[{n}]", driver_memory="2g")
        try:
            replay_run(spark, settings, dataclasses.replace(view, stream_topic=warm_topic, version=400 + 10 * i),
                       warm_events)
            run = replay_run(spark, settings, dataclasses.replace(view, stream_topic=topic, version=401 + 10 * i),
                             events)
        finally:
            stop_spark(spark)
        runs[str(n)] = {"cores": n, "seconds": run["seconds"], "events_per_s": run["events_per_s"],
                        "events_per_s_per_core": run["events_per_s"] / n}
        print(f"(h) replay on {n} core{'s' if n > 1 else ''}: {run['events_per_s']:,.0f} events/s "
              f"({run['events_per_s'] / n:,.0f} per core)")
    one, most = runs[str(cores[0])], runs[str(cores[-1])]
    speedup = most["events_per_s"] / one["events_per_s"]
    return {"events": events, "runs": runs, "speedup": speedup,
            "efficiency": speedup / (cores[-1] / cores[0])}


def late_cost(spark: Any, settings: Any, view: Any, topic: str, events: int) -> dict[str, Any]:
    """(f) What keeping late records costs a replay whose log has late events all through it: the same topic
    (5 % of events up to 90 s late) replayed in 50,000-record batches by ``view`` with its ``late_bound`` and
    without (drops only counted), alternately, twice each; the second of each is reported (warm JVM)."""
    bound = 50_000
    runs: dict[bool, dict[str, Any]] = {}
    for i, keep in enumerate((True, False, True, False)):
        variant = dataclasses.replace(view, stream_topic=topic, version=300 + i,
                                      late_bound=view.late_bound if keep else None)
        runs[keep] = replay_run(spark, settings, variant, events, max_offsets_per_trigger=bound)
    out = {"events": events, "batch_bound": bound, "keep": runs[True], "count_only": runs[False],
           "slowdown": runs[False]["events_per_s"] / runs[True]["events_per_s"]}
    print(f"(f) late records: replay keeping them {runs[True]['events_per_s']:,.0f} events/s "
          f"({runs[True]['late_kept']:.0f} kept, {runs[True]['late_batches']} of {runs[True]['batches']} batches "
          f"re-read), counting only {runs[False]['events_per_s']:,.0f} events/s")
    return out


def peer_run(settings: Any, topic: str, events: int, home: Path, replay_rate: float) -> dict[str, Any]:
    """(e) The same windowed count with the pip-installable alternative (Quix Streams + delta-rs, :mod:`kappa.front.peer`)
    over the same topic, checked against the plain-Python oracle; our replay's throughput as a ratio to it.

    The peer's window grace covers the whole replayed event-time span: Quix reads the partitions of a backlog
    unevenly and, with the view's 30 s grace, drops 15-22 % of the views as late, so its counts would be wrong.
    """
    from deltalake import DeltaTable

    from jobs.campaign_catalog.oracle import expected_campaign_catalog
    from jobs.campaign_window_counts.oracle import expected_window_counts
    from kappa.front.peer import run_peer
    from kappa.verify import oracle

    span_ms = int(events / 1000.0 * 1000) + 120_000  # kappa.log.generator.events: 1,000 events per synthetic second
    table = str(home / f"peer-{uuid.uuid4().hex[:6]}")
    out = run_peer(settings, topic, settings.topic("campaigns"), table, expected_events=events, timeout=3600,
                   grace_ms=span_ms)
    scanned = DeltaTable(table).scan().read_all()
    columns = {name: scanned.column(i).to_pylist() for i, name in enumerate(scanned.column_names)}
    data = list(zip(columns["campaign_id"], columns["window_start"], columns["view_count"]))
    actual = {(campaign, int(start.timestamp() * 1000)): count for campaign, start, count in data}
    validated = oracle.validate_records(oracle.read_log(settings, topic), "ad_event", key_field="user_id")
    mapping = expected_campaign_catalog(oracle.validate_records(
        oracle.read_log(settings, settings.topic("campaigns")), "campaign", key_field=None, tombstones=True))
    expected = {k: n for k, (n, _final) in expected_window_counts(validated, mapping).items()}
    wrong = sum(1 for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))
    out.update({"grace_ms": span_ms, "windows_expected": len(expected), "windows_wrong": wrong,
                "equals_oracle": wrong == 0 and len(data) == len(expected),
                "replay_ratio": replay_rate / out["events_per_s"] if out.get("events_per_s") else None})
    print(f"(e) peer {out['impl']}: {out['events_per_s']:,.0f} events/s, equals oracle: {out['equals_oracle']} "
          f"({wrong} windows differ); our replay = {out['replay_ratio']:.2f}x the peer")
    return out


def _buckets(job: Any) -> list[tuple[float, int]]:
    """(upper bound, cumulative count) of the job's end-to-end latency histogram."""
    samples = next(iter(job.metrics.latency.collect())).samples
    return [(float(s.labels["le"]), int(s.value)) for s in samples if s.name.endswith("_bucket")]


def _quantile(buckets: list[tuple[float, int]], q: float) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) buckets, like Prometheus."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 0.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def bench_settings(name: str) -> tuple[Any, Any]:
    """Settings for a bench under ``$KAPPA_HOME/<name>``: a lake of its own and, unless an external cluster is
    configured, a started broker of its own (returned, to be stopped; else None)."""
    from kappa.config import Settings
    from kappa.log.broker import LocalBroker, free_port

    base = Settings.from_env()
    home = Path(base.home) / name
    lake = str(home / f"lake-{int(time.time())}")
    if not base.local_broker:
        return base.replace(lake_uri=lake), None
    broker = LocalBroker(home / "broker", port=free_port(), controller_port=free_port())
    try:
        broker.start()
    except BaseException:  # interrupted or failed while starting: no broker left behind
        broker.stop()
        raise
    return base.replace(kafka_bootstrap=broker.bootstrap, local_broker=False, lake_uri=lake), broker


def run(*, events: int, live_rate: float, live_seconds: float, out: Path, partitions: int = 4,
        stack_minutes: float = 5.0) -> dict[str, Any]:
    from kappa.log import generator
    from kappa.runtime.job import ViewJob
    from kappa.runtime.spark import build_spark, stop_spark
    from kappa.log.topics import create_topic, delete_topics
    from kappa.runtime.view import load_view

    settings, broker = bench_settings("bench")
    home = Path(settings.home) / "bench"
    topic = f"bench-ad-events-{uuid.uuid4().hex[:6]}"
    live_topic = f"bench-live-{uuid.uuid4().hex[:6]}"
    extra_topics: list[str] = []
    result: dict[str, Any] = {"events": events, "partitions": partitions, "live_rate": live_rate,
                              "live_seconds": live_seconds, "cores": os.cpu_count()}
    try:
        from kappa.log.topics import declared_topics, ensure_topics

        ensure_topics(settings, declared_topics(settings))  # campaigns: the join's lookup
        create_topic(settings, topic, partitions, {"retention.ms": "-1"})
        create_topic(settings, live_topic, partitions, {"retention.ms": "-1"})
        u = generator.universe(seed=0)
        generator.publish_campaigns(settings, generator.campaign_records(u))
        t0 = time.monotonic()
        produced = generator.produce(settings, topic, generator.events(events, seed=0, universe=u))
        result["load"] = {"seconds": time.monotonic() - t0, "delivered": produced.delivered}
        print(f"loaded {produced.delivered} events in {result['load']['seconds']:.1f}s")

        result["raw_ceiling"] = raw_ceiling(settings, topic, events)
        print(f"(a) raw consumer: {result['raw_ceiling']['events_per_s']:,.0f} events/s")

        spark = build_spark("kappa-bench", settings, driver_memory="2g")
        result["spark_ceiling"] = spark_ceiling(spark, settings, topic, events)
        print(f"(a') Spark Kafka read: {result['spark_ceiling']['read_events_per_s']:,.0f} events/s, "
              f"read + decode/validate: {result['spark_ceiling']['decode_events_per_s']:,.0f} events/s")
        pids = {"spark_driver": _spark_jvm_pid({broker.pid} if broker is not None and broker.pid else set())
                or os.getpid()}
        if broker is not None and broker.pid:
            pids["broker"] = broker.pid
        view = load_view("jobs.campaign_window_counts.v1")
        with _PeakRss(pids) as rss:
            # smaller sizes first (each its own topic, loaded now), the full one last: replay time vs events
            runs = []
            for i, size in enumerate(_sizes(events)):
                size_topic = topic
                if size != events:
                    size_topic = f"{topic}-{size}"
                    create_topic(settings, size_topic, partitions, {"retention.ms": "-1"})
                    generator.produce(settings, size_topic, generator.events(size, seed=0, universe=u))
                    extra_topics.append(size_topic)
                if i == 0:  # the first replay in a JVM runs at half speed (JIT): warm up on the smallest topic
                    warmup = replay_run(spark, settings, dataclasses.replace(view, stream_topic=size_topic,
                                                                             version=199), size)
                runs.append(replay_run(spark, settings, dataclasses.replace(view, stream_topic=size_topic,
                                                                            version=200 + i), size))
            result["replay"] = dict(runs[-1])
            result["replay"]["warmup_seconds"] = warmup["seconds"]
            result["replay"]["sizes"] = [{k: r[k] for k in ("events", "seconds", "events_per_s", "batches")}
                                         for r in runs]
            result["replay"]["linear_r2"] = _r_squared([r["events"] for r in runs], [r["seconds"] for r in runs])
            fit = _line([r["events"] for r in runs], [r["seconds"] for r in runs])
            if fit is not None:  # replay time = fixed + events / marginal rate
                result["replay"]["fixed_s"], result["replay"]["marginal_events_per_s"] = fit[0], 1.0 / fit[1]
            result["replay"]["ratio_to_raw"] = result["replay"]["events_per_s"] / result["raw_ceiling"]["events_per_s"]
            result["replay"]["ratio_to_live_rate"] = result["replay"]["events_per_s"] / live_rate
            print(f"(b) replay: {result['replay']['events_per_s']:,.0f} events/s "
                  f"({result['replay']['ratio_to_raw']:.2f}x raw, {result['replay']['ratio_to_live_rate']:.1f}x live rate); "
                  "sizes " + ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in runs)
                  + f", linear fit R^2 {_fmt(result['replay']['linear_r2'])}")

            # (i) replays with their range read from the archive, up to twice (b)'s events (half and all of them
            # are (b)'s topics, twice is its own), then the log replay of the largest again: the two measured side
            # by side (the JVM is as warm for both)
            topics = dict(zip(_sizes(events), [*extra_topics, topic]))
            logged = {size: 200 + i for i, size in enumerate(_sizes(events))}
            for size in _sizes(2 * events):
                if size not in topics:
                    topics[size] = f"{topic}-{size}"
                    create_topic(settings, topics[size], partitions, {"retention.ms": "-1"})
                    generator.produce(settings, topics[size], generator.events(size, seed=0, universe=u))
                    extra_topics.append(topics[size])
            # each size replayed twice, the faster counts: the fixed cost is seconds, the noise of a shared machine
            # tenths of them
            archived = [archive_replay_run(spark, settings, view, topics[size], size, versions=(210 + i, 230 + i),
                                           archive_version=300 + i)
                        for i, size in enumerate(_sizes(2 * events))]
            floors = [engine_floor_run(spark, settings, view, r["archive_table"], r["ranges"], r["events"])
                      for r in archived]
            largest = archived[-1]["events"]
            again = replay_run(spark, settings, dataclasses.replace(view, stream_topic=topics[largest], version=220),
                               largest)
            logged[largest] = 220
            result["archive_replay"] = {
                "sizes": [{k: r[k] for k in ("events", "seconds", "seconds_all", "events_per_s", "batches",
                                             "archive_copy_seconds", "timeline_s")} for r in archived],
                "equals_log_replay": all(same_table(spark, settings, view, r["version"], logged[r["events"]])
                                         for r in archived if r["events"] in logged),
                "events_per_s": archived[-1]["events_per_s"], "phases_s": archived[-1]["phases_s"],
                "log_replay_beside_s": again["seconds"], "log_replay_beside_events_per_s": again["events_per_s"],
                "ratio_to_log_replay": archived[-1]["events_per_s"] / again["events_per_s"],
                "ratio_to_raw": archived[-1]["events_per_s"] / result["raw_ceiling"]["events_per_s"],
                "ratio_to_live_rate": archived[-1]["events_per_s"] / live_rate,
                "linear_r2": _r_squared([r["events"] for r in archived], [r["seconds"] for r in archived])}
            fit = _line([r["events"] for r in archived], [r["seconds"] for r in archived])
            if fit is not None:
                result["archive_replay"]["fixed_s"] = fit[0]
                result["archive_replay"]["marginal_events_per_s"] = 1.0 / fit[1]
                # the fixed cost phase by phase: each phase's time against events, its intercept
                by_phase = {}
                for phase in archived[-1]["timeline_s"]:
                    line = _line([r["events"] for r in archived], [r["timeline_s"].get(phase, 0.0) for r in archived])
                    by_phase[phase] = line[0] if line is not None else None
                result["archive_replay"]["fixed_by_phase_s"] = by_phase
            floor = {"sizes": floors, "linear_r2": _r_squared([r["events"] for r in floors],
                                                              [r["seconds"] for r in floors])}
            fit = _line([r["events"] for r in floors], [r["seconds"] for r in floors])
            if fit is not None:
                floor["fixed_s"], floor["marginal_events_per_s"] = fit[0], 1.0 / fit[1]
            result["archive_replay"]["engine_floor"] = floor
            a = result["archive_replay"]
            print(f"(i) replay from the archive: {a['events_per_s']:,.0f} events/s ({a['ratio_to_raw']:.2f}x raw, "
                  f"{a['ratio_to_live_rate']:.1f}x live rate, {a['ratio_to_log_replay']:.2f}x the log replay beside "
                  f"it at {a['log_replay_beside_events_per_s']:,.0f}); sizes "
                  + ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in archived)
                  + f", linear fit R^2 {_fmt(a['linear_r2'])}; tables equal to the log replays': {a['equals_log_replay']}")
            if "fixed_s" in floor:
                print("(i') the engine's floor (the view's transform in plain Structured Streaming, one Delta append "
                      "per micro-batch): sizes " + ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in floors)
                      + f"; fixed cost {floor['fixed_s']:.1f} s, marginal {floor['marginal_events_per_s']:,.0f} events/s")
            if "fixed_by_phase_s" in a:
                print(f"    fixed cost {a['fixed_s']:.1f} s, marginal {a['marginal_events_per_s']:,.0f} events/s; the fixed "
                      "cost by phase: " + ", ".join(f"{k} {_secs(v, 2)}" for k, v in a["fixed_by_phase_s"].items()))

            result["peer"] = peer_run(settings, topic, events, home, result["replay"]["events_per_s"])

            late_topic = f"{topic}-late"
            create_topic(settings, late_topic, partitions, {"retention.ms": "-1"})
            extra_topics.append(late_topic)
            late_events = min(events, LATE_EVENTS)
            generator.produce(settings, late_topic, generator.events(
                late_events, seed=3, universe=u, rate_per_s=1000, late_fraction=0.05, max_lateness_ms=90_000))
            result["late"] = late_cost(spark, settings, view, late_topic, late_events)

            live_view = dataclasses.replace(view, stream_topic=live_topic, version=99)
            job = ViewJob(live_view, settings, spark=spark, starting="latest", trigger_seconds=LIVE_TRIGGER_SECONDS)
            job.start()
            time.sleep(5)
            warm: dict[str, Any] = {}

            def snapshot() -> None:  # the latency histogram once the query had LIVE_WARMUP_SECONDS of load
                time.sleep(LIVE_WARMUP_SECONDS)
                warm["buckets"] = _buckets(job)
                warm["times"] = (job.handler.times.batches, dict(job.handler.times.total))

            watcher = threading.Thread(target=snapshot, daemon=True)
            t0 = time.monotonic()
            watcher.start()
            sent = generator.produce(settings, live_topic, generator.events(
                int(live_rate * live_seconds), seed=1, universe=u, live=True), rate=live_rate)
            achieved = sent.delivered / (time.monotonic() - t0)
            time.sleep(10)
            watcher.join()
            buckets = _buckets(job)
            live_times = job.handler.times
            job.stop()
            # steady state: what was committed after the warm-up (first batches compile code, JIT, backlog)
            warm_counts = dict(warm["buckets"])
            steady = [(le, n - warm_counts.get(le, 0)) for le, n in buckets]
            warm_batches, warm_total = warm["times"]
            steady_batches = max(1, live_times.batches - warm_batches)
            result["live"] = {"trigger_s": LIVE_TRIGGER_SECONDS, "target_rate": live_rate, "achieved_rate": achieved,
                              "p50_s": _quantile(buckets, 0.5), "p99_s": _quantile(buckets, 0.99),
                              "warmup_s": LIVE_WARMUP_SECONDS,
                              "steady_p50_s": _quantile(steady, 0.5), "steady_p99_s": _quantile(steady, 0.99),
                              "rows_observed": buckets[-1][1] if buckets else 0, "batches": live_times.batches,
                              "phases_mean_s": {k: v / max(1, live_times.batches) for k, v in live_times.total.items()},
                              "steady_phases_mean_s": {k: (v - warm_total.get(k, 0.0)) / steady_batches
                                                       for k, v in live_times.total.items()}}
            print(f"(c) live at {achieved:,.0f} events/s: p50 {_secs(result['live']['p50_s'])}, "
                  f"p99 {_secs(result['live']['p99_s'])}; after {LIVE_WARMUP_SECONDS:.0f} s: "
                  f"p50 {_secs(result['live']['steady_p50_s'])}, p99 {_secs(result['live']['steady_p99_s'])}")
        result["peak_rss_mb"] = {k: v / 2**20 for k, v in rss.peak.items()}
        stop_spark(spark)
        result["per_core"] = per_core(settings, view, topic, events, warm_topic=extra_topics[0] if extra_topics
                                      else topic, warm_events=_sizes(events)[0])
        if stack_minutes > 0:
            result["stack"] = stack_steady_state(settings, minutes=stack_minutes,
                                                 broker_pid=broker.pid if broker is not None else None)
    finally:
        try:
            delete_topics(settings, [topic, live_topic, *extra_topics])
        except Exception:  # noqa: BLE001 - cleanup only
            pass
        if broker is not None:
            broker.stop()
    _report(result, out)
    return result


def _tree(pid: int | None) -> list[Any]:
    """A process and all its descendants (psutil), [] if it is gone."""
    import psutil

    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_usage(pid: int | None) -> dict[str, float]:
    """RSS, PSS (MiB) and CPU seconds so far of a process tree."""
    import psutil

    rss = pss = cpu = 0.0
    for proc in _tree(pid):
        try:
            info = proc.memory_full_info()
            times = proc.cpu_times()
        except psutil.Error:
            continue
        rss += info.rss / 2**20
        pss += getattr(info, "pss", info.rss) / 2**20
        cpu += times.user + times.system
    return {"rss_mb": rss, "pss_mb": pss, "cpu_s": cpu}


def _view_sample(port: int) -> dict[str, Any] | None:
    """Lag (records, summed over partitions) and the latency histogram from a view's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    lag, buckets, rows, phases = 0.0, [], 0.0, {}
    batches = {"count": 0.0, "sum": 0.0, "last_id": None}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kappa_partition_lag_records":
                lag += sample.value
            elif sample.name == "kappa_end_to_end_latency_seconds_bucket":
                buckets.append((float(sample.labels["le"]), int(sample.value)))
            elif sample.name == "kappa_rows_written_total":
                rows += sample.value
            elif sample.name == "kappa_batch_phase_seconds":
                phases[sample.labels["phase"]] = sample.value
            elif sample.name in ("kappa_batch_duration_seconds_count", "kappa_batch_duration_seconds_sum"):
                batches[sample.name.rsplit("_", 1)[1]] += sample.value
            elif sample.name == "kappa_last_batch_id":
                batches["last_id"] = sample.value
    return {"lag": lag, "buckets": sorted(buckets), "rows_written": rows, "phases": phases, "batches": batches}


STACK_PORTS_HINT = "stop `make run` first (`make down`): the stack's metrics and Airflow ports are fixed"


def stack_steady_state(settings: Any, *, minutes: float, rate: float = 200.0,
                       broker_pid: int | None = None) -> dict[str, Any]:
    """(g) ``make run``'s stack in its own home and topics on the bench's broker: after ``minutes`` of its live
    producer, each view's lag (records; seconds = records / produce rate) and end-to-end latency over the last
    minute, the RSS/PSS of everything it started and the CPU each part used in that minute."""
    import socket

    from kappa.front import stack
    from kappa.process import Daemon
    from kappa.runtime.host import host_pid
    from kappa.control.runners.local import metrics_port

    ports = {view: metrics_port(view, version) for view, version in stack.stack_views(settings)}
    for port in [*ports.values(), settings.airflow_port]:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                print(f"(g) skipped: port {port} is in use; {STACK_PORTS_HINT}")
                return {"skipped": f"port {port} in use"}
    home = Path(settings.home) / "bench" / f"stack-{int(time.time())}"
    st = settings.replace(home=home, lake_uri=str(home / "lake"), topic_prefix=f"stack{int(time.time())}-")
    lines: list[str] = []
    t_up = time.monotonic()
    try:
        stack.up(st, rate=rate, echo=lines.append)
        stack.wait_ready(st)
        stack.start_airflow(st)
        up_seconds = time.monotonic() - t_up
        def parts() -> dict[str, int | None]:
            return {"broker": broker_pid, "view host": host_pid(st), "producer": Daemon("producer", st).pid(),
                    "airflow": Daemon("airflow", st).pid()}

        measure_from = max(0.0, minutes * 60 - 60)
        time.sleep(measure_from)
        before = {name: _tree_usage(pid) for name, pid in parts().items()}
        first = {view: _view_sample(port) for view, port in ports.items()}
        lags: dict[str, list[float]] = {view: [] for view in ports}
        # the phases of each batch seen (a sample shows the last batch's; a new batch id is a new batch)
        phases: dict[str, list[dict[str, float]]] = {view: [] for view in ports}
        t0 = time.monotonic()
        samples: dict[str, Any] = dict(first)
        while time.monotonic() - t0 < min(60.0, minutes * 60):
            time.sleep(5)
            for view, port in ports.items():
                sample = _view_sample(port)
                if sample is not None:
                    lags[view].append(sample["lag"])
                    if (samples.get(view) or {}).get("batches", {}).get("last_id") != sample["batches"]["last_id"]:
                        phases[view].append(sample["phases"])
                    samples[view] = sample
        window = time.monotonic() - t0
        after = {name: _tree_usage(pid) for name, pid in parts().items()}
        views = {}
        for view in ports:
            last, start = samples.get(view), first.get(view)
            if last is None:
                views[view] = {"reachable": False}
                continue
            start_counts = dict(start["buckets"]) if start else {}
            minute = [(le, n - start_counts.get(le, 0)) for le, n in last["buckets"]]
            series = lags[view] or [last["lag"]]
            views[view] = {"lag_records_mean": sum(series) / len(series), "lag_records_max": max(series),
                           "lag_seconds_max": max(series) / rate, "rows_written": last["rows_written"],
                           "latency_p50_s": _quantile(minute, 0.5), "latency_p99_s": _quantile(minute, 0.99)}
            ran = last["batches"]["count"] - (start["batches"]["count"] if start else 0.0)
            if ran > 0:
                views[view]["batches"] = ran
                views[view]["batch_mean_s"] = (last["batches"]["sum"] - (start["batches"]["sum"] if start else 0.0)) / ran
            if phases[view]:
                names = sorted({name for seen in phases[view] for name in seen})
                views[view]["phase_mean_s"] = {name: sum(seen.get(name, 0.0) for seen in phases[view])
                                               / len(phases[view]) for name in names}
        usage = {name: {"rss_mb": after[name]["rss_mb"], "pss_mb": after[name]["pss_mb"],
                        "cores": (after[name]["cpu_s"] - before[name]["cpu_s"]) / window}
                 for name in after}
        out = {"minutes": minutes, "rate": rate, "up_seconds": up_seconds, "views": views, "processes": usage,
               "rss_mb_total": sum(u["rss_mb"] for u in usage.values()),
               "pss_mb_total": sum(u["pss_mb"] for u in usage.values()), "load_avg": os.getloadavg()}
    finally:
        stack.down(st, echo=lines.append)
    for view, v in out["views"].items():
        if v.get("reachable") is False:
            print(f"(g) {view}: metrics unreachable")
            continue
        print(f"(g) {view}: lag {v['lag_records_mean']:,.0f} records mean, {v['lag_records_max']:,.0f} max "
              f"({v['lag_seconds_max']:.1f} s of produce), latency p50 {_secs(v['latency_p50_s'])} "
              f"p99 {_secs(v['latency_p99_s'])}")
        if "batch_mean_s" in v:
            print(f"    {v['batches']:.0f} batches in the minute, {v['batch_mean_s']:.2f} s each; phases (s): "
                  + ", ".join(f"{k} {x:.2f}" for k, x in (v.get("phase_mean_s") or {}).items()))
    print(f"(g) stack after {minutes:g} min: RSS {out['rss_mb_total']:,.0f} MiB (PSS {out['pss_mb_total']:,.0f}); "
          "cores " + ", ".join(f"{k} {u['cores']:.2f}" for k, u in usage.items()))
    return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _secs(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} s"


def _not_run(ax: Any, why: str) -> None:
    """A panel whose measurement did not run says so instead of drawing empty axes."""
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="#777")
    ax.set_xticks([])
    ax.set_yticks([])


def _figure(result: dict[str, Any]) -> Any:
    """The report's figure: one panel per measurement; a measurement that did not run says so in its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3, ax4, ax5) = plt.subplots(1, 5, figsize=(21, 4))
    names = ["raw consumer (a)", "Spark read (a')", "Spark decode (a')", "replay (b)", "archive replay (i)",
             "live rate"]
    ceiling = result.get("spark_ceiling") or {}
    values = [result["raw_ceiling"]["events_per_s"], ceiling.get("read_events_per_s", 0.0),
              ceiling.get("decode_events_per_s", 0.0), result["replay"]["events_per_s"],
              (result.get("archive_replay") or {}).get("events_per_s", 0.0), result["live"]["achieved_rate"]]
    ax1.bar(names, values, color=["#888", "#aaa", "#bbb", "#2a7", "#1a5", "#37c"])
    ax1.tick_params(axis="x", labelrotation=30)
    ax1.set_ylabel("events/s")
    ax1.set_title(f"throughput, {result['events']:,} events")
    live = result["live"]
    ax2.bar(["p50", "p99", "p50 steady", "p99 steady"],
            [live["p50_s"] or 0, live["p99_s"] or 0, live.get("steady_p50_s") or 0, live.get("steady_p99_s") or 0],
            color=["#c73", "#c73", "#e96", "#e96"])
    ax2.set_ylabel("seconds")
    ax2.set_title("live end-to-end latency (c)")
    ax3.bar(list(result["peak_rss_mb"]), list(result["peak_rss_mb"].values()), color="#76a")
    ax3.set_ylabel("MiB")
    ax3.set_title("peak RSS (d)")
    stack_views = {v: d for v, d in ((result.get("stack") or {}).get("views") or {}).items() if "lag_seconds_max" in d}
    ax4.bar(list(stack_views), [d["lag_seconds_max"] for d in stack_views.values()], color="#3a9")
    ax4.tick_params(axis="x", labelrotation=30)
    ax4.set_ylabel("seconds of produce behind (max, last minute)")
    ax4.set_title("make run steady state (g)")
    if not stack_views:
        _not_run(ax4, "not run (--stack-minutes 0)" if result.get("stack") is None else "no view measured")
    per_core_runs = (result.get("per_core") or {}).get("runs") or {}
    if not per_core_runs:
        _not_run(ax5, "not run")
    ax5.bar([f"{n} core(s)" for n in per_core_runs], [r["events_per_s"] for r in per_core_runs.values()],
            color="#2a7")
    ax5.bar([f"{n} core(s)" for n in per_core_runs], [r["events_per_s_per_core"] for r in per_core_runs.values()],
            color="#7c9", width=0.4, label="per core")
    ax5.set_ylabel("events/s")
    ax5.set_title("replay per core (h)")
    if per_core_runs:
        ax5.legend()
    fig.tight_layout()
    return fig


def _report(result: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2))
    fig = _figure(result)
    fig.savefig(out / "bench.png", dpi=100)
    table = Table("measure", "value")
    table.add_row("(a) raw log read", f"{result['raw_ceiling']['events_per_s']:,.0f} events/s")
    spark_ceiling = result.get("spark_ceiling") or {}
    if spark_ceiling:
        table.add_row("(a') Spark Kafka read (batch, count)", f"{spark_ceiling['read_events_per_s']:,.0f} events/s")
        table.add_row("     Spark read + decode/validate", f"{spark_ceiling['decode_events_per_s']:,.0f} events/s")
    table.add_row("(b) replay campaign_window_counts", f"{result['replay']['events_per_s']:,.0f} events/s")
    sizes = result["replay"].get("sizes") or []
    if sizes:
        table.add_row("    replay time by size", ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in sizes)
                      + f" (linear fit R^2 {_fmt(result['replay'].get('linear_r2'))})")
    table.add_row("    ratio to (a) (goal >= 0.5)", f"{result['replay']['ratio_to_raw']:.2f}")
    table.add_row("    ratio to live rate (goal >= 30)", f"{result['replay']['ratio_to_live_rate']:.1f}")
    peer = result.get("peer") or {}
    if peer:
        table.add_row(f"(e) peer: {peer['impl']}", f"{peer['events_per_s']:,.0f} events/s, equals oracle: "
                      f"{peer['equals_oracle']}")
        table.add_row("    our replay / peer (goal >= 2)", f"{peer['replay_ratio']:.2f}")
    table.add_row("(c) live trigger", f"{result['live'].get('trigger_s', 0.0):.1f} s")
    table.add_row("(c) live rate achieved", f"{result['live']['achieved_rate']:,.0f} events/s")
    table.add_row("    latency p50 / p99", f"{_secs(result['live']['p50_s'])} / {_secs(result['live']['p99_s'])}")
    if "steady_p99_s" in result["live"]:
        table.add_row(f"    after {result['live']['warmup_s']:.0f} s of load: p50 / p99 (goal p99 <= 5 s)",
                      f"{_secs(result['live']['steady_p50_s'])} / {_secs(result['live']['steady_p99_s'])}")
    if "fixed_s" in result["replay"]:
        table.add_row("    fixed cost / marginal rate (linear fit)",
                      f"{result['replay']['fixed_s']:.1f} s / {result['replay']['marginal_events_per_s']:,.0f} events/s")
    arch = result.get("archive_replay") or {}
    if arch:
        table.add_row("(i) replay from the archive", f"{arch['events_per_s']:,.0f} events/s: {arch['ratio_to_raw']:.2f}x "
                      f"(a) (goal >= 1.0), {arch['ratio_to_live_rate']:.1f}x live rate (goal >= 30), "
                      f"{arch['ratio_to_log_replay']:.2f}x the log replay beside it; tables equal to the log "
                      f"replays': {arch['equals_log_replay']}")
        table.add_row("    replay time by size", ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in arch["sizes"])
                      + f" (linear fit R^2 {_fmt(arch.get('linear_r2'))}; goal >= 0.98)")
        if "fixed_s" in arch:
            table.add_row("    fixed cost / marginal rate (goal fixed <= 2 s)",
                          f"{arch['fixed_s']:.1f} s / {arch['marginal_events_per_s']:,.0f} events/s")
        if "fixed_by_phase_s" in arch:
            table.add_row("    fixed cost by phase (intercepts)",
                          ", ".join(f"{k} {_secs(v, 2)}" for k, v in arch["fixed_by_phase_s"].items()))
        table.add_row("    total s per phase", ", ".join(f"{k} {v:.2f}" for k, v in arch["phases_s"].items()))
        floor = arch.get("engine_floor") or {}
        if "fixed_s" in floor:
            table.add_row("(i') the engine's floor: the view's transform in plain Structured Streaming",
                          ", ".join(f"{r['events']:,}: {r['seconds']:.1f} s" for r in floor["sizes"])
                          + f"; fixed cost {floor['fixed_s']:.1f} s, marginal {floor['marginal_events_per_s']:,.0f} "
                          "events/s")
    cores = result.get("per_core") or {}
    for n, r in (cores.get("runs") or {}).items():
        table.add_row(f"(h) replay on {n} core{'s' if r['cores'] > 1 else ''}",
                      f"{r['events_per_s']:,.0f} events/s, {r['events_per_s_per_core']:,.0f} per core")
    if cores:
        table.add_row("    speed-up over 1 core / efficiency", f"{cores['speedup']:.2f}x / {cores['efficiency']:.0%}")
    late = result.get("late") or {}
    if late:
        table.add_row(f"(f) replay of {late['events']:,} events, 5 % late", (
            f"keeping late records {late['keep']['events_per_s']:,.0f} events/s ({late['keep']['late_kept']:.0f} "
            f"kept), counting only {late['count_only']['events_per_s']:,.0f} events/s"))
    for label, phases in (("(b) replay, total s per phase", result["replay"].get("phases_s")),
                          ("(c) live, mean s per batch", result["live"].get("phases_mean_s")),
                          ("(c) live after warm-up, mean s per batch", result["live"].get("steady_phases_mean_s"))):
        if phases:
            table.add_row(label, ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    for name, mb in result["peak_rss_mb"].items():
        table.add_row(f"(d) peak RSS {name}", f"{mb:,.0f} MiB")
    stack_result = result.get("stack") or {}
    for view, v in (stack_result.get("views") or {}).items():
        if "lag_records_max" in v:
            table.add_row(f"(g) make run after {stack_result['minutes']:g} min: {view}",
                          f"lag {v['lag_records_mean']:,.0f} records mean / {v['lag_records_max']:,.0f} max "
                          f"({v['lag_seconds_max']:.1f} s; goal <= 10 s), latency p99 {_secs(v['latency_p99_s'])}"
                          + (f", batch {v['batch_mean_s']:.2f} s" if "batch_mean_s" in v else ""))
    if "rss_mb_total" in stack_result:
        table.add_row("(g) make run: RSS / PSS of all it started (goal <= 6 GiB)",
                      f"{stack_result['rss_mb_total']:,.0f} / {stack_result['pss_mb_total']:,.0f} MiB; cores "
                      + ", ".join(f"{k} {u['cores']:.2f}" for k, u in stack_result["processes"].items()))
    Console().print(table)
    print(f"report: {out / 'bench.json'}, {out / 'bench.png'}")


def main() -> None:
    from kappa.config import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=Settings.from_env().bench_events)
    parser.add_argument("--live-rate", type=float, default=10_000)
    parser.add_argument("--live-seconds", type=float, default=60)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--stack-minutes", type=float, default=5.0,
                        help="minutes of the local stack's producer before (g) measures it (0: skip)")
    args = parser.parse_args()
    run_interruptible(lambda: run(events=args.events, live_rate=args.live_rate, live_seconds=args.live_seconds,
                                  out=args.out, stack_minutes=args.stack_minutes), "the broker")


def run_interruptible(bench: Any, started: str) -> None:
    """Run ``bench()``; SIGTERM unwinds like Ctrl-C (its finally blocks stop what it started: ``started``), and an
    interrupted run exits 130 with one line instead of a traceback."""
    from kappa.process import interrupt_on_termination

    try:
        with interrupt_on_termination():
            bench()
    except KeyboardInterrupt as exc:
        print(f"bench interrupted ({exc.args[0] if exc.args else 'SIGINT'}): stopped {started} and every process "
              "it had started; no report written", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()

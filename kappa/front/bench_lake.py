"""``make bench-lake``: the lake on the object store beside the lake on a local disk, in one run, one JVM.

Usage:
    python -m kappa.front.bench_lake [--events 250000] [--live-rate 2000] [--live-seconds 40] [--commits 20]
                                     [--rounds 2] [--out reports]

Starts its own KRaft broker and its own object store (:class:`kappa.objectstore.LocalObjectStore`, SeaweedFS on
loopback) and measures, alternating disk and store so that both see the same machine load:

(a) replay of ``campaign_window_counts`` from earliest (``kappa replay``'s default: availableNow, one batch), events/s
    and the sink's phase times, ``--rounds`` times on each lake;
(b) live end-to-end latency p50/p99 (event time -> committed in Delta) at ``--live-rate`` with a 1 s trigger, on
    each lake, and the mean phase times of a micro-batch;
(c) one Delta commit's latency: ``--commits`` one-row appends to a table through delta-spark (a view's writer) and
    through delta-rs (the quarantine's, the registry's writer), median and p90 on each lake;
(d) memory: peak RSS of the Spark driver JVM, the broker and the store's processes;
(e) the S3 requests behind it: S3A's own request counters (the Spark side: Delta log, data files, checkpoint,
    RocksDB state) per replay and per live micro-batch, and what a real S3 would add per micro-batch at 10, 30 and
    50 ms per request - an upper bound that takes every request as sequential (S3A runs some in parallel).

Writes ``<out>/bench-lake.json`` and ``<out>/bench-lake.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from kappa.front.bench import (LIVE_TRIGGER_SECONDS, _buckets, _PeakRss, _quantile, _spark_jvm_pid, replay_run,
                               run_interruptible)

__all__ = ["main", "run", "s3a_requests"]

#: per-request latencies of a real S3 the projection (e) is computed for, in seconds
S3_LATENCIES = (0.010, 0.030, 0.050)
LAKES = ("disk", "store")


def s3a_requests(spark: Any, uri: str) -> dict[str, int]:
    """S3A's request counters of the file system instance that serves ``uri`` in this JVM (the one Delta, the
    checkpoint and the state store use: Hadoop caches one instance per bucket): the ``object_*`` requests (LIST,
    HEAD as ``object_metadata_request``, PUT, DELETE, COPY, multipart) and the GETs (``action_http_get_request``).
    ``action_http_head_request`` is left out: it counts the same HEADs as ``object_metadata_request``."""
    jvm = spark._jvm
    fs = jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI(uri), spark.sparkContext._jsc.hadoopConfiguration())
    counts, it = {}, fs.getStorageStatistics().getLongStatistics()
    while it.hasNext():
        stat = it.next()
        name = stat.getName()
        if (name.startswith("object_") and name.endswith(("_request", "_requests"))) or name == "action_http_get_request":
            counts[name] = int(stat.getValue())
    return counts


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def _commit_latency(spark: Any, base: str, commits: int) -> dict[str, Any]:
    """(c) ``commits`` one-row appends through delta-spark, then through delta-rs, each to a table of its own."""
    from deltalake import write_deltalake

    from kappa.runtime.deltars import I32, STR, arrow_rows, rs_uri

    out: dict[str, Any] = {}
    df = spark.createDataFrame([(1, "x")], "n INT, s STRING")
    df.write.format("delta").mode("append").save(f"{base}/commit-spark")  # creation is not measured
    times = []
    for _ in range(commits):
        t0 = time.perf_counter()
        df.write.format("delta").mode("append").save(f"{base}/commit-spark")
        times.append(time.perf_counter() - t0)
    out["delta_spark"] = times
    rows = arrow_rows((("n", I32), ("s", STR)), [{"n": 1, "s": "x"}])
    uri = rs_uri(f"{base}/commit-rs")
    write_deltalake(uri, rows, mode="append")
    times = []
    for _ in range(commits):
        t0 = time.perf_counter()
        write_deltalake(uri, rows, mode="append")
        times.append(time.perf_counter() - t0)
    out["delta_rs"] = times
    return {k: {"median_s": statistics.median(v), "p90_s": sorted(v)[int(0.9 * (len(v) - 1))], "n": len(v)}
            for k, v in out.items()}


def _live(spark: Any, settings: Any, view: Any, topic: str, rate: float, seconds: float, universe: Any,
          seed: int, s3_uri: str | None) -> dict[str, Any]:
    """(b) A live query from latest on ``topic`` while ``rate`` events/s arrive for ``seconds``."""
    from kappa.log import generator
    from kappa.runtime.job import ViewJob

    job = ViewJob(view, settings, spark=spark, starting="latest", trigger_seconds=LIVE_TRIGGER_SECONDS)
    job.start()
    time.sleep(5)
    before = s3a_requests(spark, s3_uri) if s3_uri else {}
    batches0, totals0 = job.handler.times.batches, dict(job.handler.times.total)
    t0 = time.monotonic()
    sent = generator.produce(settings, topic, generator.events(int(rate * seconds), seed=seed, universe=universe,
                                                               live=True), rate=rate)
    achieved = sent.delivered / (time.monotonic() - t0)
    time.sleep(10)
    buckets, times = _buckets(job), job.handler.times
    requests = _delta(s3a_requests(spark, s3_uri), before) if s3_uri else {}
    job.stop()
    batches = max(1, times.batches - batches0)
    return {"achieved_rate": achieved, "p50_s": _quantile(buckets, 0.5), "p99_s": _quantile(buckets, 0.99),
            "batches": batches,
            "phases_mean_s": {k: (v - totals0.get(k, 0.0)) / batches for k, v in times.total.items()},
            "s3a_requests": requests, "s3a_requests_per_batch": sum(requests.values()) / batches}


def run(*, events: int, live_rate: float, live_seconds: float, commits: int, rounds: int, out: Path) -> dict[str, Any]:
    from kappa.config import Settings
    from kappa.log import generator
    from kappa.log.broker import LocalBroker, free_port
    from kappa.log.topics import create_topic, declared_topics, ensure_topics
    from kappa.objectstore import LocalObjectStore, Ports, weed_binary
    from kappa.runtime.spark import build_spark, stop_spark
    from kappa.runtime.view import load_view

    base = Settings.from_env()
    home = Path(base.home) / "bench-lake"
    stamp = int(time.time())
    broker = LocalBroker(home / "broker", port=free_port(), controller_port=free_port())
    store = LocalObjectStore(home / "objectstore", ports=Ports.free(), weed=weed_binary(build=True))
    result: dict[str, Any] = {"events": events, "live_rate": live_rate, "live_seconds": live_seconds,
                              "rounds": rounds, "cores": os.cpu_count()}
    spark = None
    try:
        broker.start()
        store.start()
        store.ensure_bucket("kappa")
        os.environ.update(store.delta_rs_options())  # delta-rs here, and Spark's s3a endpoint (s3a_conf)
        lakes = {"disk": base.replace(kafka_bootstrap=broker.bootstrap, local_broker=False,
                                      lake_uri=str(home / f"lake-{stamp}")),
                 "store": base.replace(kafka_bootstrap=broker.bootstrap, local_broker=False,
                                       lake_uri=f"s3a://kappa/bench-{stamp}")}
        settings = lakes["disk"]
        ensure_topics(settings, declared_topics(settings))
        topic, live_topic = f"bench-lake-{uuid.uuid4().hex[:6]}", f"bench-lake-live-{uuid.uuid4().hex[:6]}"
        for t in (topic, live_topic):
            create_topic(settings, t, 4, {"retention.ms": "-1"})
        u = generator.universe(seed=0)
        generator.publish_campaigns(settings, generator.campaign_records(u))
        generator.produce(settings, topic, generator.events(events, seed=0, universe=u))
        print(f"loaded {events:,} events; store at {store.endpoint}")

        spark = build_spark("kappa-bench-lake", lakes["store"], driver_memory="2g")
        s3_uri = lakes["store"].lake_uri
        pids = {"spark_driver": _spark_jvm_pid({broker.pid} if broker.pid else set()) or os.getpid(),
                "broker": broker.pid, **{f"store_{role}": pid for role, pid in store.pids().items()}}
        view = load_view("jobs.campaign_window_counts.v1")
        version = iter(range(300, 400))
        replay_run(spark, lakes["disk"], dataclasses.replace(view, stream_topic=topic, version=next(version)), events)
        result["replay"] = {lake: [] for lake in LAKES}
        with _PeakRss({k: v for k, v in pids.items() if v}) as rss:
            for r in range(rounds):
                for lake in (LAKES if r % 2 == 0 else LAKES[::-1]):
                    before = s3a_requests(spark, s3_uri)
                    run_ = replay_run(spark, lakes[lake], dataclasses.replace(view, stream_topic=topic,
                                                                              version=next(version)), events)
                    run_["s3a_requests"] = _delta(s3a_requests(spark, s3_uri), before)
                    result["replay"][lake].append(run_)
                    print(f"(a) replay on the {lake}: {run_['events_per_s']:,.0f} events/s ({run_['seconds']:.1f} s, "
                          f"{sum(run_['s3a_requests'].values())} S3 requests)")
            result["live"] = {}
            for i, lake in enumerate(LAKES):
                result["live"][lake] = _live(spark, lakes[lake], dataclasses.replace(view, stream_topic=live_topic,
                                                                                     version=next(version)),
                                             live_topic, live_rate, live_seconds, u, seed=10 + i,
                                             s3_uri=s3_uri if lake == "store" else None)
                live = result["live"][lake]
                print(f"(b) live on the {lake} at {live['achieved_rate']:,.0f} events/s: p50 {live['p50_s']:.2f} s, "
                      f"p99 {live['p99_s']:.2f} s, {live['s3a_requests_per_batch']:.1f} S3 requests per micro-batch")
            result["commit"] = {}
            for lake in LAKES:
                result["commit"][lake] = _commit_latency(spark, f"{lakes[lake].lake_uri}/bench-commits", commits)
                c = result["commit"][lake]
                print(f"(c) one commit on the {lake}: delta-spark {c['delta_spark']['median_s'] * 1000:.0f} ms, "
                      f"delta-rs {c['delta_rs']['median_s'] * 1000:.0f} ms (medians of {commits})")
        result["peak_rss_mb"] = {k: v / 2**20 for k, v in rss.peak.items()}
        live = result["live"]["store"]
        result["real_s3_projection"] = {
            f"{int(lat * 1000)}ms": {"added_s_per_live_batch": live["s3a_requests_per_batch"] * lat,
                                     "added_s_per_replay": statistics.mean(sum(r["s3a_requests"].values())
                                                                           for r in result["replay"]["store"]) * lat}
            for lat in S3_LATENCIES}
    finally:
        if spark is not None:
            stop_spark(spark)
        store.stop()
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
    (out / "bench-lake.json").write_text(json.dumps(result, indent=2, default=str))
    rate = {lake: statistics.mean(r["events_per_s"] for r in result["replay"][lake]) for lake in LAKES}
    table = Table(title=f"the lake on a local disk and on the object store ({result['cores']} cores, one run)")
    table.add_column("measure")
    for lake in LAKES:
        table.add_column(lake, justify="right")
    table.add_column("store / disk", justify="right")

    def row(name: str, values: dict[str, float], fmt: str) -> None:
        table.add_row(name, *(fmt.format(values[lake]) for lake in LAKES),
                      f"{values['store'] / values['disk']:.2f}x" if values["disk"] else "-")

    row(f"replay events/s (mean of {result['rounds']})", rate, "{:,.0f}")
    for q in ("p50_s", "p99_s"):
        row(f"live {q[:3]} (s)", {lake: result["live"][lake][q] for lake in LAKES}, "{:.2f}")
    row("live write phase per batch (s)", {lake: result["live"][lake]["phases_mean_s"].get("write", 0.0)
                                           for lake in LAKES}, "{:.3f}")
    for engine in ("delta_spark", "delta_rs"):
        row(f"one commit, {engine.replace('_', '-')} (ms, median)",
            {lake: result["commit"][lake][engine]["median_s"] * 1000 for lake in LAKES}, "{:.0f}")
    Console().print(table)
    live = result["live"]["store"]
    print(f"S3 requests per live micro-batch: {live['s3a_requests_per_batch']:.1f} "
          + json.dumps({k: round(v / live["batches"], 1) for k, v in live["s3a_requests"].items()}))
    for lat, proj in result["real_s3_projection"].items():
        print(f"a real S3 at {lat} per request would add at most {proj['added_s_per_live_batch']:.2f} s per live "
              f"micro-batch and {proj['added_s_per_replay']:.1f} s per replay")
    print("peak RSS (MiB): " + ", ".join(f"{k} {v:,.0f}" for k, v in result["peak_rss_mb"].items()))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(LAKES, [rate[lake] for lake in LAKES], color=["#4c72b0", "#dd8452"])
    axes[0].set_title("replay (events/s)")
    for i, q in enumerate(("p50_s", "p99_s")):
        axes[1].bar([x + i * 0.35 for x in range(2)], [result["live"][lake][q] for lake in LAKES], 0.35, label=q[:3])
    axes[1].set_xticks([0.175, 1.175], LAKES)
    axes[1].set_title("live latency (s)")
    axes[1].legend()
    for i, engine in enumerate(("delta_spark", "delta_rs")):
        axes[2].bar([x + i * 0.35 for x in range(2)],
                    [result["commit"][lake][engine]["median_s"] * 1000 for lake in LAKES], 0.35,
                    label=engine.replace("_", "-"))
    axes[2].set_xticks([0.175, 1.175], LAKES)
    axes[2].set_title("one commit (ms, median)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out / "bench-lake.png", dpi=100)
    print(f"report: {out / 'bench-lake.json'}, {out / 'bench-lake.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=250_000)
    parser.add_argument("--live-rate", type=float, default=2_000)
    parser.add_argument("--live-seconds", type=float, default=40)
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    run_interruptible(lambda: run(events=args.events, live_rate=args.live_rate, live_seconds=args.live_seconds,
                                  commits=args.commits, rounds=args.rounds, out=args.out), "the broker, the store")


if __name__ == "__main__":
    main()

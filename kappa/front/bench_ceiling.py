"""The live ceiling: the highest event rate at which ``campaign_window_counts`` keeps its p99 end-to-end latency
within a bound for a sustained run, beside the peer at the same rates (the Yahoo Streaming Benchmark's method).

For each system - the platform's view (``campaign_window_counts`` v1 as a live :class:`kappa.runtime.job.ViewJob`,
the processing-time trigger of ``make bench`` (c), 1 s) and the peer (Quix Streams + delta-rs,
:func:`kappa.front.peer.start_peer_live`: the same count, its open windows' current values upserted into a Delta
table at each of its 1 s checkpoints) - and for each rate of a ladder, one *point*, alone on the machine:

.. code-block:: text

    a fresh topic (4 partitions); the system started at its end and ready (its first micro-batch ran / the peer's
    partitions are assigned); then a producer in a process of its own sends --seconds (300: the method's 5 minutes)
    of events at the rate, event time = wall clock; the system's end-to-end latency histogram (event time ->
    window row committed in Delta: each committed row's latest event) is read at --warm seconds and at the end,
    and its steady p99 is that of the rows committed in between and after; once the producer is done the run
    waits until the system has read the log's end (at most --drain seconds, 20: the peer runs that long after
    the load in any case), so a system that fell behind has its late rows counted instead of hidden
    passed     steady p99 <= --p99 (5 s) and the producer reached 95 % of the rate and the system read everything

Before the platform's first point its JVM runs ``--jvm-warmup`` seconds (150) at the lowest rate, not counted: a
JVM's first live micro-batches compile code and meet the JIT (the peer, an interpreter, has no such phase).
The ladder (``--rates``, ascending) stops for a system at its first failed rate; ``--refine`` points then halve the
interval between its highest passed rate and its lowest failed one. The *ceiling* is the highest passed rate. Also
per point: the records behind at worst (every second: the log's end against what the system committed), the cores
of the system (the Spark driver JVM and this process' own Python, which runs the view's ``foreachBatch``; the
peer's process) and of the producer - on 2 cores the producer's share is taken from what the system has, as it
would not be on YSB's separate producer machines.

After the view's points, the **engine's floor** at the same rates (``--no-floor`` skips it, :func:`floor_at`): the
view's query - its decoding, transform, lookup join, output mode and trigger - in plain Structured Streaming in the
same warm session, each micro-batch's rows collected instead of committed, so that what the platform adds to a
micro-batch (its Delta commit, statistics, finality, bad records) is the difference between the two.

``python -m kappa.front.bench_ceiling`` (``make bench-ceiling``) prints each point and both ceilings and writes
``reports/bench-ceiling.json`` and ``reports/bench-ceiling.png`` (p99 and cores against the rate).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = ["DEFAULT_RATES", "ceiling", "main", "passed", "sweep"]

#: The ladder of rates (events/s) tried in order.
DEFAULT_RATES = (2_000, 5_000, 10_000, 20_000)
#: The p99 bound (seconds) a rate must keep.
P99_BOUND = 5.0
#: How much of the rate the producer must reach for a point to count.
RATE_REACHED = 0.95
#: Refined rates are rounded to this step (events/s).
RATE_STEP = 500


# ------------------------------------------------------------------------------------------------ the search
def passed(point: dict[str, Any], bound: float) -> bool:
    """Whether a point kept the bound: its steady p99 within it, the producer at its rate, every record read."""
    p99 = point.get("steady_p99_s")
    return (p99 is not None and p99 <= bound and point.get("caught_up", False)
            and point.get("achieved_rate", 0.0) >= RATE_REACHED * point["rate"])


def ceiling(points: list[dict[str, Any]]) -> float | None:
    """The highest rate that passed below every rate that failed (None: none passed)."""
    failed = [p["rate"] for p in points if not p["passed"]]
    ok = [p["rate"] for p in points if p["passed"] and (not failed or p["rate"] < min(failed))]
    return max(ok) if ok else None


def sweep(measure: Callable[[float], dict[str, Any]], rates: list[float], *, refine: int,
          bound: float) -> list[dict[str, Any]]:
    """Measure ``rates`` in ascending order until one fails, then ``refine`` points between the highest passed
    rate and the lowest failed one (halving, rounded to :data:`RATE_STEP`). ``measure(rate)`` returns a point with
    at least ``rate``; each point gets ``passed``."""
    points: list[dict[str, Any]] = []

    def run(rate: float) -> bool:
        point = measure(rate)
        point["passed"] = passed(point, bound)
        points.append(point)
        return point["passed"]

    for rate in sorted(rates):
        if not run(rate):
            break
    for _ in range(refine):
        failed = [p["rate"] for p in points if not p["passed"]]
        if not failed:
            break
        low = max([p["rate"] for p in points if p["passed"] and p["rate"] < min(failed)], default=0.0)
        middle = round((low + min(failed)) / 2 / RATE_STEP) * RATE_STEP
        if middle <= low or middle >= min(failed):
            break
        run(middle)
    return sorted(points, key=lambda p: p["rate"])


# ------------------------------------------------------------------------------------------------ the producer
def _produce(settings: Any, topic: str, n: int, rate: float, seed: int, out: Any) -> None:
    """In a process of its own: ``n`` live events at ``rate``; puts (delivered, seconds, CPU seconds) on ``out``."""
    import resource

    from kappa.log import generator

    started = time.monotonic()
    sent = generator.produce(settings, topic, generator.events(n, seed=seed, universe=generator.universe(seed=0),
                                                               live=True), rate=rate)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((sent.delivered, time.monotonic() - started, usage.ru_utime + usage.ru_stime))


class Producer:
    """:func:`_produce` in a spawned process: its CPU and the GIL are not the measured system's."""

    def __init__(self, settings: Any, topic: str, rate: float, seconds: float, seed: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        self._out = context.Queue()
        self._process = context.Process(target=_produce, args=(settings, topic, int(rate * seconds), rate, seed,
                                                               self._out), daemon=True)
        self.rate, self.seconds = rate, seconds

    def start(self) -> "Producer":
        self._process.start()
        return self

    def wait(self) -> dict[str, float]:
        """Wait for the producer; its delivered records, achieved rate and cores."""
        delivered, seconds, cpu = self._out.get(timeout=self.seconds * 3 + 300)
        self._process.join(30)
        return {"delivered": delivered, "achieved_rate": delivered / seconds if seconds else 0.0,
                "producer_cores": cpu / seconds if seconds else 0.0}

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(10)


# ------------------------------------------------------------------------------------------------ one point
def _behind(settings: Any, topic: str, read: Callable[[], dict[int, int]]) -> int:
    """Records of ``topic`` beyond what ``read()`` says the system committed (the log's end asked through the
    process' one AdminClient: a new client per question would cost the measured process a connection a second)."""
    from kappa.log.topics import recent_partition_offsets

    ends = recent_partition_offsets(settings, topic, max_age=0)
    done = read()
    return sum(max(0, high - done.get(p, low)) for p, (low, high) in ends.items())


class _Watch:
    """Every second, the records the system is behind; the worst seen."""

    def __init__(self, settings: Any, topic: str, read: Callable[[], dict[int, int]]) -> None:
        self.settings, self.topic, self.read = settings, topic, read
        self.worst = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ceiling-watch")

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.worst = max(self.worst, _behind(self.settings, self.topic, self.read))
            except Exception:  # noqa: BLE001 - a missed sample is no measurement
                continue

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _cpu(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _fresh_topic(settings: Any, rate: float, who: str) -> str:
    from kappa.log.topics import create_topic

    topic = f"ceiling-{who}-{int(rate)}-{uuid.uuid4().hex[:6]}"
    create_topic(settings, topic, 4, {"retention.ms": str(3_600_000)})
    return topic


def ours_at(spark: Any, settings: Any, rate: float, *, seconds: float, warm: float, drain: float,
            version: int, jvm: int | None) -> dict[str, Any]:
    """One point of the platform's view: see the module docstring."""
    from kappa.front.bench import LIVE_TRIGGER_SECONDS, _buckets, _quantile
    from kappa.log.topics import delete_topics
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view

    topic = _fresh_topic(settings, rate, "view")
    view = dataclasses.replace(load_view("jobs.campaign_window_counts.v1"), stream_topic=topic, version=version)
    job = ViewJob(view, settings, spark=spark, starting="latest", trigger_seconds=LIVE_TRIGGER_SECONDS)
    producer = Producer(settings, topic, rate, seconds)
    pids = [os.getpid()] + ([jvm] if jvm else [])
    try:
        job.start()
        deadline = time.monotonic() + 120
        while not job.queries or job.queries[0].lastProgress is None:  # its first micro-batch: started at the end
            if time.monotonic() > deadline:
                raise RuntimeError(f"{view.ref} ran no micro-batch within 120 s")
            time.sleep(0.5)
        with _Watch(settings, topic, lambda: dict(job.processed_offsets)) as watch:
            producer.start()
            time.sleep(warm)
            warm_buckets, cpu0, t0 = _buckets(job), _cpu(pids), time.monotonic()
            produced = producer.wait()
            caught_up, waited = _wait_caught_up(settings, topic, lambda: dict(job.processed_offsets), drain)
            cpu, elapsed = _cpu(pids) - cpu0, time.monotonic() - t0
        buckets = _buckets(job)
        times = job.handler.times
        phases = {k: v / max(1, times.batches) for k, v in times.total.items()}
    finally:
        producer.kill()
        job.stop()
        delete_topics(settings, [topic])
    before = dict(warm_buckets)
    steady = [(le, n - before.get(le, 0)) for le, n in buckets]
    return {"rate": rate, **produced, "p50_s": _quantile(buckets, 0.5), "p99_s": _quantile(buckets, 0.99),
            "steady_p50_s": _quantile(steady, 0.5), "steady_p99_s": _quantile(steady, 0.99),
            "rows": buckets[-1][1] if buckets else 0, "worst_behind": watch.worst, "caught_up": caught_up,
            "caught_up_after_s": waited, "cores": cpu / elapsed if elapsed else None, "batches": times.batches,
            "phases_mean_s": phases}


def floor_at(spark: Any, settings: Any, rate: float, *, seconds: float, warm: float, drain: float,
             jvm: int | None) -> dict[str, Any]:
    """One point of the engine's floor: the view's query in plain Structured Streaming, nothing of the platform.

    The same topic shape, decoding (:func:`kappa.runtime.parsing.decode`, :func:`~kappa.runtime.parsing.valid_rows`),
    transform and lookup (the view's own, joined as it joins them), output mode and trigger as
    ``campaign_window_counts`` v1, in the same warm session; each micro-batch's rows collected to the driver - the
    least a committed batch does - where the view commits them to Delta with its statistics, finality and bad
    records. A row's latency is taken when its micro-batch's collect returns (now - its latest event), on the view's
    buckets; its cores are this process' and the JVM's, as the view's are."""
    import tempfile

    from kappa.front.bench import LIVE_TRIGGER_SECONDS, _quantile
    from kappa.front.bench_live import view_query
    from kappa.log.topics import delete_topics
    from kappa.runtime.lookups import LookupCache
    from kappa.runtime.metrics import LATENCY_BUCKETS
    from kappa.runtime.parsing import decode
    from kappa.runtime.view import load_view

    view = load_view("jobs.campaign_window_counts.v1")
    topic = _fresh_topic(settings, rate, "floor")
    counts = [0] * (len(LATENCY_BUCKETS) + 1)
    state = {"batches": 0}
    lock = threading.Lock()

    def collect(batch: Any, _batch_id: int) -> None:
        latest = [row[0] for row in batch.select(view.latency_column).collect()]
        now = time.time()
        with lock:
            for event in latest:
                late = now - event.timestamp()
                counts[sum(1 for b in LATENCY_BUCKETS if late > b)] += 1
            state["batches"] += 1

    def buckets() -> list[tuple[float, int]]:
        with lock:
            total, out = 0, []
            for bound, n in zip([*LATENCY_BUCKETS, float("inf")], counts):
                total += n
                out.append((bound, total))
            return out

    def processed() -> dict[int, int]:  # the offsets the query's last finished micro-batch read up to
        progress = query.lastProgress
        if not progress:
            return {}
        end = progress["sources"][0]["endOffset"]
        end = json.loads(end) if isinstance(end, str) else end
        return {int(p): int(o) for p, o in (end or {}).get(topic, {}).items()}

    cache = LookupCache(spark, settings)
    raw = (spark.readStream.format("kafka").options(**settings.spark_kafka_options())
           .option("subscribe", topic).option("startingOffsets", "latest").load())
    rows, mode, _ = view_query(decode(raw, view.stream_format), view.ref, cache)  # as make bench-live's floor runs it
    checkpoint = tempfile.mkdtemp(dir=settings.home, prefix="ceiling-floor-")
    query = (rows.writeStream.outputMode(mode).option("checkpointLocation", checkpoint)
             .trigger(processingTime=f"{LIVE_TRIGGER_SECONDS} seconds").foreachBatch(collect).start())
    producer = Producer(settings, topic, rate, seconds)
    pids = [os.getpid()] + ([jvm] if jvm else [])
    try:
        deadline = time.monotonic() + 120
        while query.lastProgress is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the floor's query ran no micro-batch within 120 s")
            time.sleep(0.5)
        with _Watch(settings, topic, processed) as watch:
            producer.start()
            time.sleep(warm)
            warm_buckets, cpu0, t0, batches0 = buckets(), _cpu(pids), time.monotonic(), state["batches"]
            produced = producer.wait()
            caught_up, waited = _wait_caught_up(settings, topic, processed, drain)
            cpu, elapsed = _cpu(pids) - cpu0, time.monotonic() - t0
        progress = [p for p in query.recentProgress if p.get("numInputRows")]
        phases: dict[str, float] = {}
        for p in progress:
            for key, ms in (p.get("durationMs") or {}).items():
                phases[key] = phases.get(key, 0.0) + ms / 1000 / len(progress)
    finally:
        producer.kill()
        query.stop()
        cache.close()
        delete_topics(settings, [topic])
    final = buckets()
    before = dict(warm_buckets)
    steady = [(le, n - before.get(le, 0)) for le, n in final]
    return {"rate": rate, **produced, "p50_s": _quantile(final, 0.5), "p99_s": _quantile(final, 0.99),
            "steady_p50_s": _quantile(steady, 0.5), "steady_p99_s": _quantile(steady, 0.99), "rows": final[-1][1],
            "worst_behind": watch.worst, "caught_up": caught_up, "caught_up_after_s": waited,
            "cores": cpu / elapsed if elapsed else None, "batches": state["batches"] - batches0,
            "phases_mean_s": phases}


def _wait_caught_up(settings: Any, topic: str, read: Callable[[], dict[int, int]],
                    limit: float) -> tuple[bool, float]:
    """Wait until the system has committed the log's end (at most ``limit`` s); whether it did and how long."""
    started = time.monotonic()
    while True:
        if _behind(settings, topic, read) == 0:
            return True, time.monotonic() - started
        if time.monotonic() - started > limit:
            return False, time.monotonic() - started
        time.sleep(0.5)


def peer_at(settings: Any, rate: float, *, seconds: float, warm: float, drain: float,
            home: Path) -> dict[str, Any]:
    """One point of the peer: see the module docstring."""
    from kappa.front.bench import _quantile
    from kappa.front.peer import start_peer_live
    from kappa.log.topics import delete_topics

    topic = _fresh_topic(settings, rate, "peer")
    table = str(home / f"peer-live-{uuid.uuid4().hex[:6]}")
    producer = Producer(settings, topic, rate, seconds)
    peer = start_peer_live(settings, topic, settings.topic("campaigns"), table, seconds=seconds, warmup=warm,
                           drain=drain)
    try:
        producer.start()
        produced = producer.wait()
        out = peer.wait()
    except BaseException:
        producer.kill()
        peer.kill()
        raise
    finally:
        delete_topics(settings, [topic])
    caught_up = out.get("events", 0) >= produced["delivered"]
    # its percentiles from its histogram on the view's buckets, interpolated as the view's are (its exact ones too)
    steady = [(float(le), int(n)) for le, n in out.get("steady_buckets") or []]
    return {"rate": rate, **produced, "p50_s": out.get("p50_s"), "p99_s": out.get("p99_s"),
            "steady_p50_s": _quantile(steady, 0.5), "steady_p99_s": _quantile(steady, 0.99),
            "steady_exact_p50_s": out.get("steady_p50_s"), "steady_exact_p99_s": out.get("steady_p99_s"),
            "rows": out.get("rows_committed"), "caught_up": caught_up, "events": out.get("events"),
            # its CPU over the time it consumed (first record to last: its idle drain after it costs next to nothing)
            "cores": out["cpu_seconds"] / out["consume_seconds"] if out.get("consume_seconds") else None,
            "impl": out.get("impl"), "delta_commits": out.get("delta_commits")}


# ------------------------------------------------------------------------------------------------ the run
def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _say(system: str, p: dict[str, Any]) -> None:
    print(f"  {system:6} {p['rate']:>8,.0f}/s  achieved {p['achieved_rate']:>8,.0f}/s  p99 {_fmt(p['steady_p99_s'])} s"
          f" (p50 {_fmt(p['steady_p50_s'])})  worst behind {p.get('worst_behind', '-')}  cores {_fmt(p['cores'], 2)}"
          f" (producer {_fmt(p['producer_cores'], 2)})  {'passed' if p['passed'] else 'FAILED'}", flush=True)
    phases = sorted((p.get("phases_mean_s") or {}).items(), key=lambda kv: -kv[1])
    if phases:
        print("         mean per micro-batch: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases[:6]), flush=True)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from kappa.front.bench import _spark_jvm_pid, bench_settings
    from kappa.log import generator
    from kappa.log.topics import declared_topics, ensure_topics
    from kappa.runtime.spark import build_spark, stop_spark

    settings, broker = bench_settings("bench-ceiling")
    home = Path(settings.home) / "bench-ceiling"
    rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    result: dict[str, Any] = {"rates": rates, "seconds": args.seconds, "warm": args.warm, "p99_bound": args.p99,
                              "cores": os.cpu_count(), "systems": {}}
    try:
        ensure_topics(settings, declared_topics(settings))  # campaigns: the join's lookup
        generator.publish_campaigns(settings, generator.campaign_records(generator.universe(seed=0)))
        spark = build_spark("kappa-bench-ceiling", settings, driver_memory="2g")
        jvm = _spark_jvm_pid({broker.pid} if broker is not None and broker.pid else set())
        versions = iter(range(700, 800))
        try:
            print(f"bench-ceiling: campaign_window_counts, {args.seconds:.0f} s per rate, p99 bound {args.p99} s")
            if args.jvm_warmup > 0:  # a JVM's first live batches compile code (JIT): one point not counted first
                warmup = ours_at(spark, settings, rates[0], seconds=args.jvm_warmup, warm=0, drain=args.drain,
                                 version=next(versions), jvm=jvm)
                result["view_jvm_warmup"] = warmup
                print(f"  (the JVM warmed up: {args.jvm_warmup:.0f} s at {rates[0]:,.0f}/s, p99 "
                      f"{_fmt(warmup['steady_p99_s'])} s, not counted)", flush=True)
            points = sweep(lambda rate: _said("view", ours_at(
                spark, settings, rate, seconds=args.seconds, warm=args.warm, drain=args.drain,
                version=next(versions), jvm=jvm), args.p99), rates, refine=args.refine, bound=args.p99)
            result["systems"]["view"] = {"points": points, "ceiling": ceiling(points)}
            if args.floor:  # the engine alone at the same rates, in the same warm session
                points = sweep(lambda rate: _said("floor", floor_at(
                    spark, settings, rate, seconds=args.seconds, warm=args.warm, drain=args.drain, jvm=jvm),
                    args.p99), rates, refine=args.refine, bound=args.p99)
                result["systems"]["floor"] = {"points": points, "ceiling": ceiling(points)}
        finally:
            stop_spark(spark)
        if args.peer:
            points = sweep(lambda rate: _said("peer", peer_at(
                settings, rate, seconds=args.seconds, warm=args.warm, drain=args.drain, home=home),
                args.p99), rates, refine=args.refine, bound=args.p99)
            result["systems"]["peer"] = {"points": points, "ceiling": ceiling(points)}
    finally:
        if broker is not None:
            broker.stop()
    for system, out in result["systems"].items():
        at = {p["rate"]: p for p in out["points"]}
        ten = at.get(10_000.0)
        print(f"{system}: ceiling {_fmt(out['ceiling'], 0)} events/s (p99 <= {args.p99} s for {args.seconds:.0f} s)"
              + (f"; at 10,000 events/s p99 {_fmt(ten['steady_p99_s'])} s" if ten else ""))
    _report(result, args.out)
    return result


def _said(system: str, point: dict[str, Any], bound: float) -> dict[str, Any]:
    _say(system, {**point, "passed": passed(point, bound)})
    return point


def _report(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-ceiling.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    fig, (lat, cores) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, data in result["systems"].items():
        points = data["points"]
        rates = [p["rate"] for p in points]
        lat.plot(rates, [p["steady_p99_s"] if p["steady_p99_s"] is not None else float("nan") for p in points],
                 marker="o", label=f"{system} (ceiling {_fmt(data['ceiling'], 0)}/s)")
        cores.plot(rates, [p["cores"] if p["cores"] is not None else float("nan") for p in points], marker="o",
                   label=system)
        cores.plot(rates, [p["producer_cores"] for p in points], linestyle=":", label=f"producer beside {system}")
    lat.axhline(result["p99_bound"], color="grey", linestyle="--", linewidth=1)
    lat.set(xlabel="events/s", ylabel="steady p99 end-to-end latency (s)", title="p99 against the rate")
    cores.set(xlabel="events/s", ylabel="cores", title="cores against the rate")
    for ax in (lat, cores):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "bench-ceiling.png", dpi=110)
    print(f"report: {out / 'bench-ceiling.json'}, {out / 'bench-ceiling.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default=",".join(str(r) for r in DEFAULT_RATES),
                        help="comma-separated events/s, tried in ascending order")
    parser.add_argument("--seconds", type=float, default=300.0, help="seconds of load per rate")
    parser.add_argument("--warm", type=float, default=20.0, help="seconds of load before the latency counts")
    parser.add_argument("--p99", type=float, default=P99_BOUND, help="the p99 bound a rate must keep (s)")
    parser.add_argument("--refine", type=int, default=1, help="points halving the passed..failed interval")
    parser.add_argument("--drain", type=float, default=20.0,
                        help="seconds a system may take to read the log's end after the producer stopped")
    parser.add_argument("--jvm-warmup", dest="jvm_warmup", type=float, default=150.0,
                        help="seconds of the lowest rate run first, not counted (the JVM's JIT)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="without the peer")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="without the engine's floor (the view's query in plain Structured Streaming)")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    from kappa.front.bench import run_interruptible

    run_interruptible(lambda: bench(args), "the broker")


if __name__ == "__main__":
    main()

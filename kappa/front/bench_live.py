"""What a live view costs: ``make run``'s view host, CPU per micro-batch, idle and at 200 events/s, beside a baseline.

For each code version - the baseline commit (``--baseline``, fc054fe by default: the commit the live path's
fixed cost was measured at) and the working tree - one *leg* runs ``make run``'s stack as ``bin/kappa up`` starts
it (every declared view in the view host, the live producer, the supervisor; Airflow and the analysts' SQL
service with ``--airflow``: the whole ``make run``) in a home and topics of
its own on the bench's broker, one leg after the other (never both at once: they would share the two cores):

.. code-block:: text

    up         stack.up + wait_ready: every view has read its topic and has rows
    load       the producer at --rate events/s; after --warm seconds, --load seconds measured: the CPU of the
               view host's process tree (Python + JVM) and of each part, the micro-batches each view committed
               and its lag - both read from its checkpoint (the last committed batch's offsets against the log
               end, every 2 s; seconds = records / rate), not from its metrics, which a slow listener delays -
               and from its metrics its batches' mean duration and end-to-end latency (p50/p99 of that window)
    idle       the producer stopped; once every view caught up, --idle seconds measured the same way

CPU-s per micro-batch = the view host's CPU seconds / the micro-batches all its views committed in the window
(and, idle, the view host's cores with nothing to read).

Between the two, the **engine's floor** (``floor``, skipped with ``--no-floor``): the same topics, triggers and rate
read by plain Structured Streaming in a session built like the view host's - per view one query that decodes and
validates its records in the stream and collects each micro-batch's valid records to the driver, nothing else of
the platform (no Delta commit, no quarantine, no metrics) - so what a micro-batch costs the engine alone is measured
in the same run as what it costs a view. With ``--shared-floor`` a second floor leg reads each topic once for
every view over it (one query per topic and trigger, each micro-batch decoded once and collected once per view):
what one read of a topic for every view would leave of the engine's cost. With ``--query-floor`` a floor leg runs
each view's own query instead (:func:`view_query`: its transform, lookups and output mode - a stateful view's
state kept by Spark - each micro-batch's rows collected): what the views' work costs the engine, where the plain
floor only reads and decodes. A leg runs the baseline's own code: its
tree is a git worktree (``.cache/bench-trees/<commit>``, sharing this checkout's ``.cache``) put first on
``PYTHONPATH``; this file is run as a script there and uses only what both versions have (``kappa.front.stack``,
the runner's ports).

**Many views** (``--views 6,12,20``): one leg of the working tree per count of view versions in the one view host -
the declared views, then their other declared versions, then copies of the views over ``ad-events``
(:func:`many_versions`), the extra ones started from the log's beginning beside the declared ones as a replay's
version runs beside the serving one and followed until each has read that backlog - and the engine's floor
with as many queries as the largest; the cores, CPU-s per micro-batch and the worst lag against the count.

**Heap ceilings** (``--host-memory 512m,768m``): each of the working tree's legs once per view-host heap ceiling
(``KAPPA_HOST_DRIVER_MEMORY``), one after the other, with the host JVM's time collecting beside its CPU and RSS.
**Plans** (``--batches-per-second 3,3.5``): the same, once per number of live micro-batches a second the host plans
its versions' triggers for (``KAPPA_HOST_BATCHES_PER_SECOND``); with ``--host-memory``, once per pair.

``python -m kappa.front.bench_live`` (``make bench-live``) prints both legs side by side and writes
``reports/bench-live.json`` and ``reports/bench-live.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: The commit the live path's cost was measured at before the work on it (docs/performance.md).
BASELINE = "fc054fe"


# ------------------------------------------------------------------------------------------------ one leg
def _tree_usage(pid: int | None) -> dict[str, float]:
    """RSS (MiB) and CPU seconds so far of a process and its descendants, and the RSS and CPU seconds of its JVMs
    (the view host's Spark driver) among them."""
    import psutil

    rss = cpu = jvm = jvm_rss = 0.0
    java: int | None = None
    if pid is None:
        return {"rss_mb": 0.0, "cpu_s": 0.0, "jvm_cpu_s": 0.0, "jvm_rss_mb": 0.0, "jvm_pid": None}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for proc in procs:
        try:
            resident = proc.memory_info().rss / 2**20
            times = proc.cpu_times()
            used = times.user + times.system + getattr(times, "children_user", 0) + getattr(times, "children_system", 0)
            rss, cpu = rss + resident, cpu + used
            if proc.name() == "java":
                jvm, jvm_rss, java = jvm + used, jvm_rss + resident, java or proc.pid
        except psutil.Error:
            continue
    return {"rss_mb": rss, "cpu_s": cpu, "jvm_cpu_s": jvm, "jvm_rss_mb": jvm_rss, "jvm_pid": java}


def _tree_pss(pid: int | None) -> float | None:
    """The proportional set size (MiB) of a process and its descendants: each page they share counted once in all,
    where summed RSS counts it in each (Airflow's forked processes share most of theirs). None: not readable."""
    import psutil

    if pid is None:
        return None
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        return sum(proc.memory_full_info().pss for proc in procs) / 2**20
    except (psutil.Error, AttributeError):  # gone meanwhile, or no PSS on this platform
        return None


def _listener(address: str) -> int | None:
    """The pid of the process listening on ``host:port`` (the bench's broker), None when none is found."""
    import psutil

    port = int(address.rpartition(":")[2])
    try:
        return next((c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid), None)
    except psutil.Error:
        return None


def _heap(java: int | None) -> dict[str, float] | None:
    """The collector of the JVM ``java`` so far (``jstat -gc``): its seconds collecting, and its heap committed and
    used now (MiB)."""
    if java is None:
        return None
    try:
        out = subprocess.run(["jstat", "-gc", str(java)], capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    half = len(out) // 2
    if half == 0 or len(out) != 2 * half:
        return None
    gc = dict(zip(out[:half], out[half:]))
    try:
        spaces = ("S0C", "S1C", "EC", "OC")
        return {"gc_s": float(gc["GCT"]), "young_gcs": int(gc["YGC"]), "full_gcs": int(gc["FGC"]),
                "full_gc_s": float(gc["FGCT"]),
                "heap_committed_mb": sum(float(gc[k]) for k in spaces) / 1024,
                "heap_used_mb": sum(float(gc[k]) for k in ("S0U", "S1U", "EU", "OU")) / 1024}
    except (KeyError, ValueError):
        return None


def _scrape(port: int) -> dict[str, Any] | None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, Any] = {"lag": 0.0, "batches": 0.0, "batch_seconds": 0.0, "buckets": []}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kappa_partition_lag_records":
                out["lag"] += s.value
            elif s.name == "kappa_batch_duration_seconds_count":
                out["batches"] += s.value
            elif s.name == "kappa_batch_duration_seconds_sum":
                out["batch_seconds"] += s.value
            elif s.name == "kappa_end_to_end_latency_seconds_bucket":
                out["buckets"].append((float(s.labels["le"]), int(s.value)))
    out["buckets"].sort()
    return out


def _quantile(buckets: list[tuple[float, int]], q: float) -> float | None:
    """Upper bound of the histogram bucket holding quantile ``q`` (cumulative Prometheus buckets)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    want = q * buckets[-1][1]
    for le, n in buckets:
        if n >= want:
            return le
    return None


def _committed(st: Any, view: str, version: int, topic: str) -> tuple[int, int]:
    """(last committed micro-batch id, records of ``topic`` not yet committed) from the view's checkpoint and the
    log end - not from the job's metrics, which a slow listener delays."""
    from kappa.control.replay.version import committed_offsets
    from kappa.log.topics import partition_offsets

    offsets, batch = committed_offsets(st, view, version, topic)
    ends = partition_offsets(st, topic)
    return (-1 if batch is None else batch), sum(max(0, high - offsets.get(p, low)) for p, (low, high) in ends.items())


def _window(st: Any, versions: dict[str, tuple[str, int]], ports: dict[str, int], parts: dict[str, int | None],
            seconds: float, rate: float) -> dict:
    """Measure ``seconds``: CPU and RSS of each part; per view version (``versions``: its label -> (view,
    version), ``ports``: label -> metrics port) the micro-batches committed and the lag (from its checkpoint, every
    2 s), its batches' mean duration and its end-to-end latency (from its metrics)."""
    from kappa.control.replay.version import stream_topic

    topics = {label: st.topic(stream_topic(view, version)) for label, (view, version) in versions.items()}
    before = {name: _tree_usage(pid) for name, pid in parts.items()}
    heap_before = _heap(before.get("view host", {}).get("jvm_pid"))
    first = {label: _scrape(port) for label, port in ports.items()}
    start = {label: _committed(st, *versions[label], topics[label]) for label in ports}
    lags: dict[str, list[float]] = {label: [start[label][1]] for label in ports}
    peak = {name: before[name]["rss_mb"] for name in parts}  # RSS sampled every 2 s: its maximum in the window
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(2)
        for label in ports:
            lags[label].append(_committed(st, *versions[label], topics[label])[1])
        for name, pid in parts.items():
            peak[name] = max(peak[name], _tree_usage(pid)["rss_mb"])
    elapsed = time.monotonic() - t0
    after = {name: _tree_usage(pid) for name, pid in parts.items()}
    heap_after = _heap(after.get("view host", {}).get("jvm_pid"))
    end = {label: _committed(st, *versions[label], topics[label]) for label in ports}
    last = {label: _scrape(port) for label, port in ports.items()}
    views: dict[str, Any] = {}
    for label in ports:
        a, b = first.get(label), last.get(label)
        series = lags[label]
        views[label] = {"topic": topics[label], "batches": end[label][0] - start[label][0],
                        "lag_records_mean": sum(series) / len(series), "lag_records_max": max(series),
                        # seconds of produce: for the views reading the producer's topic
                        "lag_seconds_max": (max(series) / rate if rate and topics[label] == st.topic("ad-events")
                                            else None)}
        if a is not None and b is not None:
            counts = dict(a["buckets"])
            window = [(le, n - counts.get(le, 0)) for le, n in b["buckets"]]
            timed = b["batches"] - a["batches"]  # batches that read records (the job's histogram)
            views[label].update({
                "batch_mean_s": (b["batch_seconds"] - a["batch_seconds"]) / timed if timed else None,
                "latency_p50_s": _quantile(window, 0.5), "latency_p99_s": _quantile(window, 0.99)})
    cpu = {name: after[name]["cpu_s"] - before[name]["cpu_s"] for name in parts}
    jvm = after.get("view host", {}).get("jvm_cpu_s", 0.0) - before.get("view host", {}).get("jvm_cpu_s", 0.0)
    batches = sum(v.get("batches") or 0.0 for v in views.values())
    return {"seconds": elapsed, "views": views, "batches": batches,
            "cores": {name: c / elapsed for name, c in cpu.items()},
            "cores_total": sum(cpu.values()) / elapsed,
            "rss_mb": {name: after[name]["rss_mb"] for name in parts},
            "rss_mb_total": sum(after[name]["rss_mb"] for name in parts),
            "rss_mb_peak": {name: max(peak[name], after[name]["rss_mb"]) for name in parts},
            # what the parts hold in all, each shared page once (the window's end)
            "pss_mb": {name: _tree_pss(pid) for name, pid in parts.items()},
            # the view host's JVM (its heap, the class-data archive, code, threads) apart from its Python process
            "host_jvm_rss_mb": after.get("view host", {}).get("jvm_rss_mb"),
            # its collector: the share of the window's wall time spent collecting, the heap at the window's end
            "host_gc_share": ((heap_after["gc_s"] - heap_before["gc_s"]) / elapsed
                              if heap_before and heap_after else None),
            "host_gcs": ({k: heap_after[k] - heap_before[k] for k in ("young_gcs", "full_gcs", "full_gc_s")}
                         if heap_before and heap_after else None),
            "host_heap_committed_mb": heap_after["heap_committed_mb"] if heap_after else None,
            "host_heap_used_mb": heap_after["heap_used_mb"] if heap_after else None,
            "host_cpu_s": cpu.get("view host", 0.0),
            "host_cpu_s_per_batch": cpu.get("view host", 0.0) / batches if batches else None,
            # the view host's CPU in its JVM (Spark) against its Python process (the jobs' batch code, metrics)
            "host_jvm_share": jvm / cpu["view host"] if cpu.get("view host") else None,
            "load_avg": os.getloadavg()}


def _extras(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The view versions a leg runs beside the declared ones (``--extra view@vN,...``, :func:`many_versions`)."""
    return [(ref.rpartition("@v")[0], int(ref.rpartition("@v")[2])) for ref in args.extra.split(",") if ref]


def leg(args: argparse.Namespace) -> None:
    """One code version's stack: up, the load window, the idle window, down; the result as JSON in ``args.out``.
    With ``--extra``, those view versions run in the view host beside the declared ones, started from the log's
    beginning right after ``up`` (as a replay's version runs beside the serving one)."""
    from kappa.config import Settings
    from kappa.control.replay.version import committed_offsets, module_of, stream_topic
    from kappa.control.runners.local import LocalRunner, metrics_port
    from kappa.front import stack
    from kappa.identity import view_ref
    from kappa.log.topics import partition_offsets
    from kappa.process import Daemon
    from kappa.runtime.driver import JobSpec
    from kappa.runtime.host import host_pid
    from kappa.runtime.view import load_view

    try:
        from kappa.runtime.job import live_trigger_seconds
    except ImportError:  # a tree before platform.yaml's triggers (726a51f; the default baseline): its module's or 2 s
        live_trigger_seconds = lambda view: view.trigger_seconds or 2.0  # noqa: E731
    try:
        from kappa.runtime.host import planned_trigger
    except ImportError:  # a tree before the host planned its versions' triggers in one function
        planned_trigger = None

    st = Settings.from_env()
    declared, extras = stack.stack_views(st), _extras(args)
    versions = {**{view: (view, version) for view, version in declared},
                **{view_ref(view, version): (view, version) for view, version in extras}}
    ports = {label: metrics_port(*ref) for label, ref in versions.items()}
    say = lambda line: print(f"  [{args.label}] {line}", flush=True)  # noqa: E731
    result: dict[str, Any] = {"label": args.label, "views": len(ports), "rate": args.rate}
    t0 = time.monotonic()
    try:
        stack.up(st, rate=args.rate, echo=say)
        runner = LocalRunner(st, mode="host")
        asked = {}  # each extra version: the log's end when it was asked for (its backlog)
        for view, version in extras:
            asked[(view, version)] = {p: high for p, (_low, high) in partition_offsets(
                st, st.topic(stream_topic(view, version))).items()}
            runner.start(JobSpec(view, version, starting="earliest"), wait=False)
        if extras:
            say(f"{len(extras)} more view versions asked of the view host: {', '.join(view_ref(*e) for e in extras)}")
        stack.wait_ready(st, timeout=900)

        def read_backlog(view: str, version: int) -> bool:  # a committed micro-batch covers its backlog
            offsets, batch = committed_offsets(st, view, version, st.topic(stream_topic(view, version)))
            return batch is not None and all(offsets.get(p, 0) >= end for p, end in asked[(view, version)].items())

        deadline, behind = time.monotonic() + 900, list(extras)
        while behind and time.monotonic() < deadline:
            behind = [ref for ref in behind if not read_backlog(*ref)]
            time.sleep(2)
        if behind:  # measured all the same: how far behind a host of that many falls is the figure
            result["backlog_unread"] = [view_ref(*ref) for ref in behind]
            say(f"still reading their backlog after 15 minutes: {', '.join(result['backlog_unread'])}")
        if args.airflow:  # the rest of make run: Airflow and the analysts' SQL service
            stack.start_airflow(st)
            stack.start_sql(st)
        result["up_seconds"] = time.monotonic() - t0
        say(f"ready after {result['up_seconds']:.0f} s; warming up {args.warm:g} s at {args.rate:g} events/s")

        def parts() -> dict[str, int | None]:
            out = {"view host": host_pid(st), "producer": Daemon("producer", st).pid(),
                   "supervisor": Daemon("supervisor", st).pid()}
            if args.airflow:  # the whole of make run: its broker too (the bench's, as make run starts its own)
                out["airflow"] = Daemon("airflow", st).pid()
                out["sql"] = Daemon("sql", st).pid()
                out["broker"] = _listener(st.kafka_bootstrap.split(",")[0])
            return out

        time.sleep(args.warm)
        say(f"measuring {args.load:g} s at {args.rate:g} events/s")
        result["load"] = _window(st, versions, ports, parts(), args.load, args.rate)
        stack.stop_producer(st)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # idle = every view read everything there is
            samples = [_scrape(port) for port in ports.values()]
            if all(s is not None and s["lag"] == 0 for s in samples):
                break
            time.sleep(2)
        time.sleep(10)
        say(f"measuring {args.idle:g} s idle")
        result["idle"] = _window(st, versions, ports, parts(), args.idle, 0.0)
        own_triggers = {label: live_trigger_seconds(load_view(module_of(*ref))) for label, ref in versions.items()}
        for label, own in own_triggers.items():  # how often each runs: a view read for history runs every 30 s
            result["load"]["views"][label]["trigger_s"] = own
            if planned_trigger is not None:  # and how often the host runs it: its plan for all of them
                result["load"]["views"][label]["planned_trigger_s"] = planned_trigger(
                    own, list(own_triggers.values()), st.host_batches_per_second)
    finally:
        stack.down(st, echo=say)
    Path(args.out).write_text(json.dumps(result, indent=2))


def floor_queries(refs: list[tuple[str, int]], *, shared: bool) -> list[tuple[tuple[str, str, float], list[str]]]:
    """The engine floor's queries: ((topic, format, trigger seconds), the view versions it reads for) - one per view
    version, or with ``shared`` one per topic, format and trigger for every view version that reads it so."""
    from kappa.control.replay.version import module_of
    from kappa.runtime.job import live_trigger_seconds
    from kappa.runtime.view import load_view

    groups: dict[tuple, list[str]] = {}
    for name, version in refs:
        view = load_view(module_of(name, version))
        key = (view.stream_topic, view.stream_format, live_trigger_seconds(view))
        groups.setdefault(key if shared else (*key, name, version), []).append(f"{name}@v{version}")
    return [(key[:3], names) for key, names in groups.items()]


def floor_leg(args: argparse.Namespace) -> None:
    """The engine's floor, measured like a leg: plain Structured Streaming and nothing of the platform - for each view
    of ``make run`` (and each ``--extra`` version) one query over the same topic with the same trigger, its records
    decoded and validated in the stream as the views do (:func:`kappa.runtime.parsing.decode`), each micro-batch's
    valid records collected to the driver (one Spark job: the least a live view's batch does) - at the same rate, in
    a session built like the view host's. CPU-s per micro-batch = this process tree's CPU / the micro-batches its
    queries ran for the views.

    ``--shared``: one query per topic (and format and trigger) for every view that reads it, each micro-batch read
    and decoded once, kept (:func:`kappa.runtime.spark.computed_once`) and collected once per view - the least a
    single read of a topic feeding every view over it would do; a micro-batch of that query counts once per view."""
    import tempfile
    import threading

    from kappa.config import Settings
    from kappa.control.leases import converge_topics
    from kappa.front import stack
    from kappa.log.topics import recent_partition_offsets
    from kappa.runtime.lookups import LookupCache
    from kappa.runtime.parsing import decode, valid_rows
    from kappa.runtime.spark import build_spark, computed_once

    st = Settings.from_env()
    say = lambda line: print(f"  [{args.label}] {line}", flush=True)  # noqa: E731
    result: dict[str, Any] = {"label": args.label, "rate": args.rate}
    t0 = time.monotonic()
    for change in converge_topics(st):
        say(f"topic      {change}")
    spark = build_spark("kappa-bench-floor", st, extra_conf={"spark.scheduler.mode": "FAIR"})
    counts: dict[str, int] = {}
    lock = threading.Lock()

    lookups = LookupCache(spark, st)

    def handler(names: list[str], own: Any = None) -> Any:
        def run(batch: Any, _batch_id: int) -> None:
            if own is not None:  # --queries: the view's own rows of the batch
                own(batch).collect()
            elif len(names) == 1:
                valid_rows(batch).collect()
            else:  # one read and decode, then one job per view over the rows kept (as a shared read would)
                with computed_once(valid_rows(batch)) as rows:
                    for _name in names:
                        rows.collect()
            with lock:
                for name in names:
                    counts[name] = counts.get(name, 0) + 1
        return run

    queries = []
    read: list[tuple[str, list[str]]] = []  # each query's topic and the views it reads for
    refs = [*stack.stack_views(st), *_extras(args)]

    def behind(query: Any, topic: str) -> int | None:
        """Records of ``topic`` past the offsets the query's last finished micro-batch read up to."""
        progress = query.lastProgress
        if not progress:
            return None
        end = progress["sources"][0]["endOffset"]
        done = json.loads(end) if isinstance(end, str) else end
        done = {int(p): int(o) for p, o in (done or {}).get(st.topic(topic), {}).items()}
        ends = recent_partition_offsets(st, st.topic(topic), max_age=0)  # one AdminClient for the process
        return sum(max(0, high - done.get(p, low)) for p, (low, high) in ends.items())

    try:
        for (topic, fmt, trigger), names in floor_queries(refs, shared=args.shared):
            read.append((topic, names))
            raw = (spark.readStream.format("kafka").options(**st.spark_kafka_options())
                   .option("subscribe", st.topic(topic)).option("startingOffsets", "latest").load())
            stream, mode, own = decode(raw, fmt), "append", None
            if args.queries:
                stream, mode, own = view_query(stream, names[0], lookups)
            queries.append(stream.writeStream.outputMode(mode)
                           .option("checkpointLocation", tempfile.mkdtemp(dir=st.home, prefix=f"floor-{topic}-"))
                           .trigger(processingTime=f"{trigger} seconds")
                           .foreachBatch(handler(names, own)).start())
        producer = stack.start_producer(st, rate=args.rate)  # a child of this process: not counted below
        result["up_seconds"] = time.monotonic() - t0
        say(f"{len(queries)} queries for {len(refs)} views at {args.rate:g} events/s; warming up {args.warm:g} s")
        time.sleep(args.warm)
        say(f"measuring {args.load:g} s")
        pid = os.getpid()

        def usage() -> dict[str, float]:
            mine, theirs = _tree_usage(pid), _tree_usage(producer.pid())
            return {key: mine[key] - theirs[key] for key in mine if key != "jvm_pid"}  # the producer has no JVM

        before, first, started = usage(), dict(counts), time.monotonic()
        lags: dict[str, list[int]] = {}
        while time.monotonic() - started < args.load:  # the lag, as the legs read it: every 2 s
            time.sleep(2)
            for query, (topic, names) in zip(queries, read):
                late = behind(query, topic)
                for name in names if late is not None else ():
                    lags.setdefault(name, []).append(late)
        after, last, elapsed = usage(), dict(counts), time.monotonic() - started
        batches = sum(last.values()) - sum(first.values())
        cpu = after["cpu_s"] - before["cpu_s"]
        topic_of = {name: topic for topic, names in read for name in names}
        declared = set(stack.stack_views(st))
        result["queries"] = len(queries)
        result["load"] = {"seconds": elapsed, "batches": batches, "cores": {"view host": cpu / elapsed},
                          "cores_total": cpu / elapsed, "rss_mb_total": after["rss_mb"],
                          "host_cpu_s_per_batch": cpu / batches if batches else None,
                          # labelled as the legs label them: a declared view by its name
                          "views": {(name if (name, version) in declared else ref): {
                              "batches": last.get(ref, 0) - first.get(ref, 0),
                              "lag_records_max": max(lags.get(ref) or [0]),
                              "lag_seconds_max": (max(lags.get(ref) or [0]) / args.rate
                                                  if topic_of.get(ref) == "ad-events" else None)}
                              for name, version, ref in ((n, v, f"{n}@v{v}") for n, v in refs)},
                          "load_avg": os.getloadavg()}
    finally:
        stack.stop_producer(st)
        for query in queries:
            query.stop()
        lookups.close()
    Path(args.out).write_text(json.dumps(result, indent=2))


def view_query(decoded: Any, ref: str, lookups: Any) -> tuple[Any, str, Any]:
    """A view version's own query over its decoded stream, in plain Structured Streaming (the ``--queries`` floor):
    (the streaming DataFrame, its output mode, what a micro-batch collects of it). A stateful view's transform runs
    in the stream (its state kept by Spark, as the view's is) and each micro-batch's rows are collected; a stateless
    one's runs on each micro-batch's valid records (every record for an archive), as the view's does."""
    from kappa.control.replay.version import module_of
    from kappa.runtime.archive import archive_rows
    from kappa.runtime.parsing import valid_rows
    from kappa.runtime.view import load_view

    name, _, version = ref.rpartition("@v")
    view = load_view(module_of(name, int(version)))
    frames = lookups.frames(view.lookups)
    if view.stateful:
        return view.transform(valid_rows(decoded), **frames), view.output_mode, lambda batch: batch
    pick = archive_rows if view.keep_invalid else valid_rows
    return decoded, "append", lambda batch: view.transform(pick(batch), **frames)


# ------------------------------------------------------------------------------------------------ the bench
def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def code_tree(root: Path, ref: str) -> tuple[Path, str]:
    """(tree, commit) of ``ref``: this checkout for ``HEAD`` with its changes, else a cached git worktree of the
    commit sharing this checkout's ``.cache`` (venv, jars)."""
    commit = _git("rev-parse", "--short", f"{ref}^{{commit}}", cwd=root)
    if ref == "HEAD":
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=root))
        return root, commit + ("+changes" if dirty else "")
    tree = root / ".cache" / "bench-trees" / commit
    if not (tree / "kappa").is_dir():
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(tree), commit], cwd=root, check=True,
                       capture_output=True)
    cache = tree / ".cache"
    if not cache.exists():
        cache.symlink_to(root / ".cache")
    return tree, commit


#: Version numbers of the copies ``--views`` adds: far above any declared one.
COPY_VERSION_BASE = 11


def many_versions(count: int, home: Path) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """The view versions beyond the declared defaults that make ``count`` in all, and the environment that declares
    them: the declared views' other versions first (as replays run them beside the serving ones), then copies of
    the default versions of the views over ``ad-events`` (the archive aside: one per topic), numbered from
    :data:`COPY_VERSION_BASE` - the same logic as a version of its own, with its own table and checkpoint, publishing
    nothing (a copy's windows would be published twice). The copies' modules and a ``platform.yaml`` declaring them
    are written under ``home``; the environment points ``KAPPA_PLATFORM`` and ``PYTHONPATH`` at them."""
    import yaml

    from kappa.catalog import load_catalog, platform_file

    catalog = load_catalog()
    declared = [(name, spec.default_version) for name, spec in catalog.views.items()]
    if count <= len(declared):
        return [], {}
    extras = [(name, version) for name, spec in catalog.views.items() for version in sorted(spec.versions)
              if version != spec.default_version][: count - len(declared)]
    sources = [(name, spec.default_version) for name, spec in catalog.views.items()
               if "ad-events" in spec.topics and not spec.archives]
    package = home / "copies" / "kappa_bench_copies"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"""Copies of declared view versions (kappa.front.bench_live --views)."""\n')
    data = yaml.safe_load(platform_file().read_text(encoding="utf-8"))
    next_version = {name: COPY_VERSION_BASE for name, _ in sources}
    for i in range(count - len(declared) - len(extras)):
        name, source = sources[i % len(sources)]
        version = next_version[name]
        next_version[name] += 1
        module = f"{name}_v{version}"
        (package / f"{module}.py").write_text(
            f'"""{name} v{source} as version {version}: its own table and checkpoint, publishing nothing."""\n'
            "from dataclasses import replace\n\n"
            f"from {catalog.module_of(name, source)} import VIEW as _SOURCE\n\n"
            f"VIEW = replace(_SOURCE, version={version}, publish=None)\n")
        data["views"][name]["versions"][version] = {"module": f"kappa_bench_copies.{module}"}
        extras.append((name, version))
    platform = home / "platform.yaml"
    platform.write_text(yaml.safe_dump(data, sort_keys=False))
    return extras, {"KAPPA_PLATFORM": str(platform), "PYTHONPATH": str(package.parent)}


def _print(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="live cost: make run's view host (CPU-s per micro-batch = host CPU / batches committed)")
    table.add_column("")
    for r in results:
        table.add_column(f"{r['label']} ({r['commit']})", justify="right")

    def row(name: str, get: Any, fmt: str = "{:.3f}") -> None:
        cells = []
        for r in results:
            try:
                value = get(r)
            except (KeyError, TypeError):
                value = None
            cells.append("-" if value is None else fmt.format(value))
        table.add_row(name, *cells)

    row("ready after (s)", lambda r: r["up_seconds"], "{:.0f}")
    row("load: CPU-s per micro-batch (checkpoint commits)", lambda r: r["load"]["host_cpu_s_per_batch"])
    row("load: micro-batches / s (all views)", lambda r: r["load"]["batches"] / r["load"]["seconds"], "{:.2f}")
    row("load: view host cores", lambda r: r["load"]["cores"]["view host"], "{:.2f}")
    row("load: share of it in the JVM", lambda r: r["load"].get("host_jvm_share"), "{:.0%}")
    row("load: cores of all it started", lambda r: r["load"]["cores_total"], "{:.2f}")
    row("load: RSS of all it started (MiB)", lambda r: r["load"]["rss_mb_total"], "{:,.0f}")
    row("load: PSS of all it started (MiB, shared pages once)",
        lambda r: sum(r["load"]["pss_mb"].values()), "{:,.0f}")
    for part in [p for p in ("broker", "airflow", "sql") if p in results[-1]["load"]["cores"]]:
        row(f"load: {part} cores", lambda r, p=part: r["load"]["cores"][p], "{:.3f}")
        row(f"load: {part} RSS / PSS (MiB)",
            lambda r, p=part: f"{r['load']['rss_mb'][p]:,.0f} / {r['load']['pss_mb'][p]:,.0f}", "{}")
    row("load: view host RSS, peak (MiB)", lambda r: r["load"]["rss_mb_peak"]["view host"], "{:,.0f}")
    row("load: view host JVM RSS at the end (MiB)", lambda r: r["load"]["host_jvm_rss_mb"], "{:,.0f}")
    row("load: its heap committed at the end (MiB)", lambda r: r["load"]["host_heap_committed_mb"], "{:,.0f}")
    row("load: its time collecting (share of wall time)", lambda r: r["load"]["host_gc_share"], "{:.1%}")
    for view in results[-1]["load"]["views"]:
        row(f"load: {view} lag max (records)", lambda r, v=view: r["load"]["views"][v]["lag_records_max"], "{:,.0f}")
        row(f"load: {view} lag max (s)", lambda r, v=view: r["load"]["views"][v]["lag_seconds_max"], "{:.1f}")
        row(f"load: {view} micro-batches", lambda r, v=view: r["load"]["views"][v]["batches"], "{:.0f}")
        row(f"load: {view} batch mean (s)", lambda r, v=view: r["load"]["views"][v]["batch_mean_s"], "{:.2f}")
        row(f"load: {view} latency p99 (s)", lambda r, v=view: r["load"]["views"][v]["latency_p99_s"], "{:.1f}")
    row("idle: view host cores", lambda r: r["idle"]["cores"]["view host"], "{:.3f}")
    row("idle: micro-batches in the window", lambda r: r["idle"]["batches"], "{:.0f}")
    row("idle: CPU-s per micro-batch", lambda r: r["idle"]["host_cpu_s_per_batch"])
    row("idle: view host JVM RSS at the end (MiB)", lambda r: r["idle"]["host_jvm_rss_mb"], "{:,.0f}")
    row("idle: its heap committed at the end (MiB)", lambda r: r["idle"]["host_heap_committed_mb"], "{:,.0f}")
    Console().print(table)


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['label']}\n{r['commit']}" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(labels, [r["load"]["host_cpu_s_per_batch"] or 0 for r in results], color="#c73")
    axes[0].set_title("CPU-s per micro-batch at load")
    axes[1].bar(labels, [r["load"]["cores_total"] for r in results], color="#37c", label="at load")
    axes[1].bar(labels, [r["idle"]["cores"]["view host"] if "idle" in r else 0 for r in results], color="#9bd",
                label="view host idle")
    axes[1].set_title("cores")
    axes[1].legend()
    views = list(results[-1]["load"]["views"])
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        axes[2].bar([x + i * width for x in range(len(views))],
                    [r["load"]["views"].get(v, {}).get("lag_seconds_max") or 0 for v in views], width, label=labels[i])
    axes[2].set_xticks([x + width / 2 for x in range(len(views))], views, rotation=30, ha="right")
    axes[2].set_title("lag max (s of produce) at load")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path)


#: A view version whose micro-batches run less often than this is read for history, not freshness (the archive's
#: 30 s): the freshness figures (worst lag, worst p99) leave it out.
FRESH_TRIGGER_SECONDS = 10.0


def _worst(r: dict[str, Any], key: str) -> tuple[float | None, str]:
    """The largest ``key`` over a leg's view versions kept fresh (:data:`FRESH_TRIGGER_SECONDS`) at load, and
    whose it is."""
    values = [(v.get(key), label) for label, v in r["load"]["views"].items()
              if v.get(key) is not None and (v.get("trigger_s") or 0) <= FRESH_TRIGGER_SECONDS]
    return max(values) if values else (None, "")


def _print_views(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="many views: view versions in one host at load (lag from checkpoints, seconds of produce; "
                        f"worst of those triggered every {FRESH_TRIGGER_SECONDS:g} s or more often)")
    for name in ("", "view versions", "host cores", "cores of all", "CPU-s / micro-batch", "micro-batches / s",
                 "RSS MiB", "host collecting", "worst lag (s)", "worst p99 (s)", "idle cores"):
        table.add_column(name, justify="left" if not name else "right")
    for r in results:
        load, floor = r["load"], r["commit"] == "Spark alone"
        lag, lag_of = _worst(r, "lag_seconds_max")
        p99, p99_of = _worst(r, "latency_p99_s")
        table.add_row(r["label"], str(r["view_versions"]), f"{load['cores']['view host']:.2f}",
                      f"{load['cores_total']:.2f}",
                      "-" if load["host_cpu_s_per_batch"] is None else f"{load['host_cpu_s_per_batch']:.3f}",
                      f"{load['batches'] / load['seconds']:.2f}", f"{load['rss_mb_total']:,.0f}",
                      "-" if load.get("host_gc_share") is None else f"{load['host_gc_share']:.1%}",
                      "-" if floor or lag is None else f"{lag:.1f} {lag_of}",
                      "-" if floor or p99 is None else f"{p99:.0f} {p99_of}",
                      "-" if "idle" not in r else f"{r['idle']['cores']['view host']:.3f}")
    console = Console(width=max(Console().width, 170))
    console.print(table)
    hosts = [r for r in results if r["commit"] != "Spark alone"]
    for last in [r for r in hosts if r["view_versions"] == hosts[-1]["view_versions"]]:  # each leg of the most
        detail = Table(title=f"{last['label']}: each view version at load")
        for name in ("", "trigger (s)", "planned (s)", "micro-batches", "batch mean (s)", "lag max (records)",
                     "lag max (s)", "p99 (s)"):
            detail.add_column(name, justify="left" if not name else "right")
        for label, v in last["load"]["views"].items():
            detail.add_row(label, *("-" if v.get(k) is None else f.format(v[k]) for k, f in (
                ("trigger_s", "{:g}"), ("planned_trigger_s", "{:.3g}"), ("batches", "{:.0f}"),
                ("batch_mean_s", "{:.2f}"),
                ("lag_records_max", "{:,.0f}"), ("lag_seconds_max", "{:.1f}"), ("latency_p99_s", "{:.0f}"))))
        console.print(detail)


def _plot_views(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legs = [r for r in results if r["commit"] != "Spark alone"]
    floors = [r for r in results if r["commit"] == "Spark alone"]
    n = [r["view_versions"] for r in legs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(n, [r["load"]["cores"]["view host"] for r in legs], "o-", color="#37c", label="view host")
    axes[0].plot(n, [r["idle"]["cores"]["view host"] for r in legs], "o--", color="#9bd", label="view host idle")
    for r in floors:
        shared = "one read" in r["label"]
        axes[0].plot([r["view_versions"]], [r["load"]["cores"]["view host"]], "D" if shared else "s",
                     color="#3a3" if shared else "#c73",
                     label=f"engine floor (Spark alone{', one read per topic' if shared else ''})")
    axes[0].axhline(2, color="#999", lw=0.8)
    axes[0].set_title("cores at 200 events/s")
    axes[0].set_xlabel("view versions in one host")
    axes[0].legend()
    axes[1].plot(n, [r["load"]["host_cpu_s_per_batch"] or 0 for r in legs], "o-", color="#c73")
    axes[1].set_title("CPU-s per micro-batch")
    axes[1].set_xlabel("view versions in one host")
    axes[2].plot(n, [_worst(r, "lag_seconds_max")[0] or 0 for r in legs], "o-", color="#3a3", label="worst lag")
    axes[2].axhline(10, color="#999", lw=0.8, label="target 10 s")
    axes[2].set_title("worst lag of a view version (s of produce)")
    axes[2].set_xlabel("view versions in one host")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="commit to measure beside the working tree ('' = none)")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--warm", type=float, default=120.0, help="seconds at load before measuring")
    parser.add_argument("--load", type=float, default=120.0, help="seconds measured at load")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds measured idle")
    parser.add_argument("--airflow", action="store_true",
                        help="start Airflow and the analysts' SQL service too (the whole make run)")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the engine's floor (plain Structured Streaming over the same topics)")
    parser.add_argument("--busy", type=int, default=0,
                        help="unrelated processes kept busy (one core each) through every leg: a shared machine")
    parser.add_argument("--views", default="",
                        help="many views: comma-separated counts of view versions in one host (e.g. 6,12,20), "
                             "one leg of this tree each (no baseline); the engine's floor at the largest")
    parser.add_argument("--host-memory", dest="host_memory", default="",
                        help="comma-separated heap ceilings of the view host (KAPPA_HOST_DRIVER_MEMORY, e.g. "
                             "768m,1g): the working tree's legs once with each, side by side")
    parser.add_argument("--batches-per-second", dest="budgets", default="",
                        help="comma-separated micro-batches per second the view host plans for "
                             "(KAPPA_HOST_BATCHES_PER_SECOND, e.g. 3,3.5): the working tree's legs once with each")
    parser.add_argument("--shared-floor", dest="shared_floor", action="store_true",
                        help="also the engine's floor with one query per topic for every view over it")
    parser.add_argument("command", nargs="?", default="bench", choices=("bench", "leg", "floor"))
    parser.add_argument("--query-floor", dest="query_floor", action="store_true",
                        help="also the engine's floor with each view's own query (its transform, lookups, output "
                             "mode) in plain Structured Streaming")
    parser.add_argument("--shared", action="store_true", help=argparse.SUPPRESS)  # the floor leg: one read per topic
    parser.add_argument("--queries", action="store_true", help=argparse.SUPPRESS)  # the floor leg: views' queries
    parser.add_argument("--extra", default="", help=argparse.SUPPRESS)  # a leg's versions beside the declared
    parser.add_argument("--label", default="")
    parser.add_argument("--leg-out", dest="leg_out", default="")
    args = parser.parse_args()
    if args.command in ("leg", "floor"):
        args.out = args.leg_out
        (leg if args.command == "leg" else floor_leg)(args)
        return
    from kappa.front.bench import bench_settings, run_interruptible

    run_interruptible(lambda: bench(args, bench_settings), "the broker")


def bench(args: argparse.Namespace, bench_settings: Any) -> None:
    import socket

    from kappa.config import jvm_size_bytes
    from kappa.control.runners.local import metrics_port
    from kappa.front import stack

    root = Path(__file__).resolve().parents[2]
    settings, broker = bench_settings("bench-live")
    busy: list[subprocess.Popen] = []
    try:
        for port in [metrics_port(v, n) for v, n in stack.stack_views(settings)] + [
                settings.airflow_port, settings.sql_jdbc_port, settings.sql_connect_port]:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    raise SystemExit(f"bench-live: port {port} is in use; stop `make run` first (`make down`)")
        for _ in range(args.busy):  # a spinning interpreter: the CPU the views share the machine with
            busy.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        if busy:
            print(f"bench-live: {len(busy)} unrelated busy process(es) beside every leg", flush=True)
        counts = sorted({int(n) for n in args.views.split(",") if n.strip()})
        heaps = [h.strip() for h in args.host_memory.split(",") if h.strip()] or [""]
        for heap in filter(None, heaps):  # a wrong size stops the bench before its first leg
            try:
                jvm_size_bytes(heap)
            except ValueError as e:
                raise SystemExit(f"bench-live: --host-memory: {e}") from None
        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()] or [""]
        for budget in filter(None, budgets):
            try:
                if not 0 < float(budget) < 1e6:
                    raise ValueError
            except ValueError:
                raise SystemExit(f"bench-live: --batches-per-second: {budget!r} is not a positive number") from None
        if counts:  # many views: this tree with more and more view versions in its host, the floor at the most
            legs = [(f"host of {n}", "HEAD", "leg", n) for n in counts]
            legs += [(f"engine floor, {counts[-1]} queries", "HEAD", "floor", counts[-1])] if args.floor else []
            legs += ([(f"engine floor, {counts[-1]} views, one read per topic", "HEAD", "shared", counts[-1])]
                     if args.shared_floor else [])
            legs += ([(f"engine floor, {counts[-1]} views' queries", "HEAD", "queries", counts[-1])]
                     if args.query_floor else [])
        else:
            legs = ([("baseline", args.baseline, "leg", 0)] if args.baseline else [])
            legs += ([("engine floor", "HEAD", "floor", 0)] if args.floor else [])
            legs += ([("engine floor, one read per topic", "HEAD", "shared", 0)] if args.shared_floor else [])
            legs += ([("engine floor, the views' queries", "HEAD", "queries", 0)] if args.query_floor else [])
            legs += [("this tree", "HEAD", "leg", 0)]
        # each of the working tree's legs once per heap ceiling and plan asked for (the baseline's with its defaults)
        legs = [(label + (f", heap {heap}" if heap else "") + (f", {budget} batches/s" if budget else ""),
                 ref, kind, count, heap, budget)
                for label, ref, kind, count in legs
                for heap in (heaps if kind == "leg" and ref == "HEAD" else [""])
                for budget in (budgets if kind == "leg" and ref == "HEAD" else [""])]
        results = []
        for label, ref, kind, count, heap, budget in legs:
            tree, commit = code_tree(root, ref)
            stamp = int(time.time())
            home = Path(settings.home) / "bench-live" / f"{commit}-{stamp}"
            out = home / "leg.json"
            home.mkdir(parents=True, exist_ok=True)
            extras, declare = many_versions(count, home)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), declare.get("PYTHONPATH")])),
                   "KAPPA_REPO_ROOT": str(tree), "KAPPA_HOME": str(home),
                   "KAPPA_LAKE_URI": str(home / "lake"), "KAPPA_TOPIC_PREFIX": f"live{stamp}-",
                   "KAPPA_KAFKA_BOOTSTRAP": settings.kafka_bootstrap}
            if "KAPPA_PLATFORM" in declare:
                env["KAPPA_PLATFORM"] = declare["KAPPA_PLATFORM"]
            if heap:
                env["KAPPA_HOST_DRIVER_MEMORY"] = heap
            if budget:
                env["KAPPA_HOST_BATCHES_PER_SECOND"] = budget
            print(f"bench-live: {label} = {commit} ({tree})", flush=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "floor" if kind in ("shared", "queries") else kind,
                   "--label", label, "--leg-out", str(out),
                   "--rate", str(args.rate), "--warm", str(args.warm), "--load", str(args.load),
                   "--idle", str(args.idle), "--extra", ",".join(f"{v}@v{n}" for v, n in extras)]
            cmd += ["--airflow"] if args.airflow else []
            cmd += ["--shared"] if kind == "shared" else []
            cmd += ["--queries"] if kind == "queries" else []
            subprocess.run(cmd, env=env, cwd=tree, check=True)
            results.append({**json.loads(out.read_text()),
                            "commit": "Spark alone" if kind in ("floor", "shared", "queries") else commit,
                            "busy_processes": len(busy),
                            "view_versions": len(stack.stack_views(settings)) + len(extras),
                            # None: the leg's own default
                            "host_memory": heap or None, "host_batches_per_second": float(budget) if budget else None})
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-live.json").write_text(json.dumps(results, indent=2))
        (_plot_views if counts else _plot)(results, args.out / "bench-live.png")
        (_print_views if counts else _print)(results)
        print(f"bench-live: {args.out / 'bench-live.json'}, {args.out / 'bench-live.png'}")
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    # a leg runs this file as a script with another tree's kappa first on PYTHONPATH: its own folder must not
    # shadow anything (kappa.front's modules as top-level names)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()

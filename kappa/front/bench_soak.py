"""Day two, compressed: what a running stack's tables, logs and processes grow to, with and without its upkeep.

Two legs of ``make run``'s stack (every declared view in the view host, the live producer at ``--rate``), one after
the other on the bench's broker, each in a home and topics of its own (never both at once: they would share the two
cores):

.. code-block:: text

    upkeep       KAPPA_UPKEEP_SECONDS = --upkeep-seconds (300 s: an hour's upkeep compressed twelve-fold): every
                 live job compacts its table and VACUUMs it between its micro-batches (kappa.runtime.upkeep)
    no upkeep    KAPPA_UPKEEP_SECONDS = ten times the leg's length: no upkeep runs in the leg

Every ``--sample-seconds`` for ``--minutes`` per leg, for each view's serving table and the quarantine: its Delta
version (the commits so far), the data files its current version references (what a reader lists: compaction
bounds it) and its files on disk - data, change feed, ``_delta_log`` commits and checkpoints - and bytes (what the
disk holds: VACUUM removes a replaced file only once 7 days old, so this count flattens after a week, not within a
compressed run); the view's Spark checkpoint and state store on disk; the RSS of every process the stack started,
and of the view host's JVM its anonymous and file-backed parts and, with ``--nmt``, what its native memory
tracking says each part of the JVM holds; the seconds of ``bin/kappa query``'s engine
(:func:`kappa.front.query.run_query`) for ``SELECT count(*)`` over each serving view, and for the change feed of the
last ``--changes-minutes`` (``table_changes`` from the version the leg sampled that long ago).

Printed per leg and table, over two windows of two upkeep periods each - the first starting one window in, and
the last of the leg (the same windows in both legs): the most data files a reader listed in each (with upkeep the
count rises between compactions and drops at each: the peaks are what a reader meets at worst) and the median
query seconds in each (their ratios: the target is at most 1.25), the RSS slope after the first quarter of the
leg (MiB/hour; target under 10) and the JVM's parts' slopes, and the files projected to 30 days at the rate the
peaks grew.
``python -m kappa.front.bench_soak`` (``make bench-soak``) writes ``reports/bench-soak.json`` (every sample) and
``reports/bench-soak.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

#: What the no-upkeep leg's period is, in leg lengths: its first upkeep would come after the leg ends.
NO_UPKEEP_FACTOR = 10

#: One category of ``jcmd <pid> VM.native_memory summary scale=MB`` (JDK 17): ``-  Java Heap (reserved=..MB, ...``
_NMT_LINE = re.compile(r"^-\s+(?P<name>.+?) \(reserved=\d+MB, committed=(?P<committed>\d+)MB\)", re.MULTILINE)
_NMT_TOTAL = re.compile(r"^Total: reserved=\d+MB, committed=(?P<committed>\d+)MB", re.MULTILINE)


def native_memory(java: int | None) -> dict[str, Any] | None:
    """What the JVM ``java`` holds, read while it runs: its resident memory split as the kernel sees it
    (``/proc/<pid>/smaps_rollup``: anonymous, file-backed; MiB) and, when it was started with native memory
    tracking (``--nmt``), the MiB each of its categories has committed (``Java Heap``, ``Class``, ``Thread``,
    ``Code``, ...) and their total. None when there is no such process."""
    if java is None:
        return None
    out: dict[str, Any] = {}
    try:
        if Path(f"/proc/{java}/comm").read_text().strip() != "java":  # jcmd signals its target: a JVM's, only
            return None
        rollup = Path(f"/proc/{java}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+) kB", rollup, re.MULTILINE)}
    out["rss_mb"] = round(fields.get("Rss", 0) / 1024, 1)
    out["anon_mb"] = round(fields.get("Anonymous", 0) / 1024, 1)
    out["file_mb"] = round((fields.get("Rss", 0) - fields.get("Anonymous", 0)) / 1024, 1)
    try:
        text = subprocess.run(["jcmd", str(java), "VM.native_memory", "summary", "scale=MB"], capture_output=True,
                              text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    total = _NMT_TOTAL.search(text)
    if total:  # "Native memory tracking is not enabled" otherwise
        out["nmt_committed_mb"] = int(total["committed"])
        out["nmt_mb"] = {m["name"]: int(m["committed"]) for m in _NMT_LINE.finditer(text)}
    return out


def table_stats(path: Path) -> dict[str, int]:
    """Files and bytes of one Delta table on disk: ``data`` (Parquet outside the log and the change feed),
    ``cdc`` (``_change_data``), ``commits`` (the log's JSON files), ``checkpoints`` (the log's Parquet files),
    ``bytes`` (all of them), ``version`` (the highest commit in the log; -1 without one) and ``active`` (the data
    files its current version references: :func:`active_files`)."""
    out = {"data": 0, "cdc": 0, "commits": 0, "checkpoints": 0, "bytes": 0, "version": -1, "active": 0}
    if not path.is_dir():
        return out
    out["active"] = active_files(path)
    for root, _dirs, files in os.walk(path):
        rel = Path(root).relative_to(path).parts
        for name in files:
            try:
                out["bytes"] += (Path(root) / name).stat().st_size
            except OSError:  # removed by a VACUUM meanwhile
                continue
            if rel[:1] == ("_delta_log",):
                if name.endswith(".json") and name[:20].isdigit():
                    out["commits"] += 1
                    out["version"] = max(out["version"], int(name[:20]))
                elif ".checkpoint" in name and name.endswith(".parquet"):
                    out["checkpoints"] += 1
            elif rel[:1] == ("_change_data",):
                out["cdc"] += name.endswith(".parquet")
            elif name.endswith(".parquet"):
                out["data"] += 1
    return out


def disk_files(stats: dict[str, int]) -> int:
    """The files of :func:`table_stats` on disk: data, change feed, commits and checkpoints."""
    return sum(stats.get(k, 0) for k in ("data", "cdc", "commits", "checkpoints"))


def active_files(path: Path) -> int:
    """Data files the table's current version references (what a reader lists); 0 without a table."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        return len(DeltaTable(str(path)).file_uris())
    except TableNotFoundError:
        return 0


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour; None for fewer than two distinct times."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600


def summarize(samples: list[dict[str, Any]], window_seconds: float) -> dict[str, Any]:
    """Per table, over two windows of ``window_seconds`` (two upkeep periods: with upkeep the files a reader
    lists rise between compactions and drop at each, so a single sample says little) - the first one starting
    one window in (``from``) and the last one of the leg (``to``): the most data files a reader listed in each
    (the sawtooth's peaks), the median seconds of the timed query in each, their ratios, the commits at each
    window's start, and the files projected to 30 days at the rate the peaks grew between the two windows; the
    stack's RSS slope after the first quarter (MiB/hour). Both legs are summarized with the same windows."""
    if not samples:
        return {}
    last_t = samples[-1]["t"]
    first = [s for s in samples if window_seconds <= s["t"] < 2 * window_seconds] or samples[-1:]
    final = [s for s in samples if s["t"] > last_t - window_seconds and s["t"] >= first[0]["t"]] or samples[-1:]
    span = max((final[0]["t"] + final[-1]["t"]) / 2 - (first[0]["t"] + first[-1]["t"]) / 2, 1.0)
    tables: dict[str, Any] = {}
    for name, stats in samples[-1]["tables"].items():
        def peak(window: list[dict[str, Any]]) -> int:  # what a reader lists: the current version's data files
            return max((s["tables"].get(name) or {}).get("active", 0) for s in window)

        def median_query(window: list[dict[str, Any]]) -> float | None:
            values = sorted(s["query_s"][name] for s in window if s["query_s"].get(name) is not None)
            return values[len(values) // 2] if values else None

        f0, f1 = peak(first), peak(final)
        q0, q1 = median_query(first), median_query(final)
        grow = (f1 - f0) / span  # files per second between the two windows' peaks
        tables[name] = {"commits_from": (first[0]["tables"].get(name) or {}).get("version"),
                        "commits_to": stats["version"], "files_from": f0, "files_to": f1,
                        "files_ratio": f1 / f0 if f0 else None,
                        "files_30_days": round(f1 + max(grow, 0.0) * (30 * 86_400 - last_t)),
                        "query_s_from": q0, "query_s_to": q1,
                        "query_ratio": q1 / q0 if q0 and q1 is not None else None,
                        "disk_files_from": disk_files(first[0]["tables"].get(name) or {}),
                        "disk_files_to": disk_files(stats), "bytes_to": stats["bytes"]}
    quarter = last_t / 4
    rss = [(s["t"], s["rss_mb_total"]) for s in samples if s["t"] >= quarter]
    return {"from_t": first[0]["t"], "to_t": last_t, "window_s": window_seconds, "tables": tables,
            "rss_mb_per_hour": slope_per_hour(rss), "rss_mb_to": samples[-1]["rss_mb_total"],
            "host_jvm_per_hour": jvm_slopes([s for s in samples if s["t"] >= quarter])}


def jvm_slopes(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The view host JVM's growth (MiB/hour, least squares over ``samples``): resident, anonymous, file-backed,
    the native memory tracking's total and each of its categories - where a growing RSS grows."""
    series: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        jvm = s.get("host_jvm") or {}
        parts = {k: jvm[k] for k in ("rss_mb", "anon_mb", "file_mb", "nmt_committed_mb") if k in jvm}
        parts.update({f"nmt {name}": mb for name, mb in (jvm.get("nmt_mb") or {}).items()})
        for key, mb in parts.items():
            series.setdefault(key, []).append((s["t"], mb))
    slopes = {key: slope_per_hour(points) for key, points in series.items()}
    return {key: round(v, 1) for key, v in slopes.items() if v is not None}


# ------------------------------------------------------------------------------------------------ one leg
def _sample(st: Any, t: float, history: list[dict[str, Any]], changes_seconds: float) -> dict[str, Any]:
    from kappa.control.serving import ServingAlias
    from kappa.front.query import QueryError, run_query
    from kappa.front.stack import stack_views
    from kappa.identity import ViewPaths
    from kappa.process import Daemon
    from kappa.runtime.deltars import local_path
    from kappa.runtime.host import host_pid
    from kappa.front.bench_live import _tree_usage
    from kappa.verify.stagecache import folder_bytes

    sample: dict[str, Any] = {"t": round(t, 1), "tables": {}, "checkpoint_bytes": {}, "state_bytes": {},
                              "query_s": {}, "changes_s": {}, "rss_mb": {}}
    views = [view for view, _version in stack_views(st)]
    for view, target in ServingAlias(st.lake_uri).targets(views).items():
        table = Path(local_path(target.table_path))
        sample["tables"][view] = table_stats(table)
        checkpoint = Path(local_path(ViewPaths(st.lake_uri, view, target.version).checkpoint))
        sample["checkpoint_bytes"][view] = folder_bytes(checkpoint)
        # each query of the view keeps its own checkpoint under it (``main``, ...), its state store in ``state``
        own = [q for q in checkpoint.iterdir() if q.is_dir()] if checkpoint.is_dir() else []
        sample["state_bytes"][view] = sum(folder_bytes(q / "state") for q in own)
        # the change feed from the version sampled --changes-minutes ago (or at the first sample)
        then = [h for h in history if h["t"] <= t - changes_seconds] or history[:1]
        start = (then[-1]["tables"].get(view) or {}).get("version", -1) if then else -1
        queries = {"query_s": f"SELECT count(*) FROM {view}"}
        if start >= 0:
            queries["changes_s"] = f"SELECT count(*) FROM table_changes('{view}', {start})"
        for key, sql in queries.items():
            began = time.monotonic()
            try:
                run_query(sql, settings=st)
            except QueryError:  # a view with no table yet, or a feed not kept: no figure
                continue
            sample[key][view] = round(time.monotonic() - began, 3)
    sample["tables"]["quarantine"] = table_stats(Path(local_path(st.lake_uri)) / "quarantine")
    for part, pid in (("view host", host_pid(st)), ("producer", Daemon("producer", st).pid()),
                      ("supervisor", Daemon("supervisor", st).pid())):
        usage = _tree_usage(pid)
        sample["rss_mb"][part] = round(usage["rss_mb"], 1)
        if part == "view host":  # its JVM apart from its Python, and what the JVM holds beside its heap
            sample["host_jvm"] = native_memory(usage["jvm_pid"])
    sample["rss_mb_total"] = round(sum(sample["rss_mb"].values()), 1)
    sample["home_bytes"] = folder_bytes(Path(st.home))
    return sample


def leg(label: str, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    from kappa.config import Settings
    from kappa.front import stack

    os.environ.update(env)  # the processes the stack starts inherit it (KAPPA_UPKEEP_SECONDS among it)
    st = Settings.from_env()
    say = lambda line: print(f"  [{label}] {line}", flush=True)  # noqa: E731
    samples: list[dict[str, Any]] = []
    try:
        stack.up(st, rate=args.rate, echo=say)
        stack.wait_ready(st, timeout=900)
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < args.minutes * 60:
            samples.append(_sample(st, t, samples, args.changes_minutes * 60))
            s = samples[-1]
            files = {v: f"{x['active']}/{disk_files(x)}" for v, x in s["tables"].items()}
            say(f"{t / 60:5.1f} min: files read/on disk {files}; RSS {s['rss_mb_total']:,.0f} MiB")
            time.sleep(max(0.0, args.sample_seconds - (time.monotonic() - t0 - t)))
    finally:
        stack.down(st, echo=say)
    return {"label": label, "upkeep_seconds": float(env["KAPPA_UPKEEP_SECONDS"]), "samples": samples,
            "summary": summarize(samples, 2 * args.upkeep_seconds)}  # the same windows in both legs


# ------------------------------------------------------------------------------------------------ report
def _print(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    for r in results:
        s = r["summary"]
        table = Table(title=f"{r['label']}: peaks of the {s.get('window_s', 0) / 60:g} min from "
                            f"{s.get('from_t', 0) / 60:.0f} min -> the last {s.get('window_s', 0) / 60:g} min to "
                            f"{s.get('to_t', 0) / 60:.0f} min "
                            f"(upkeep every {r['upkeep_seconds']:g} s); RSS {s.get('rss_mb_to', 0):,.0f} MiB, "
                            f"slope {s.get('rss_mb_per_hour') or 0:+.0f} MiB/h after the first quarter")
        for col in ("table", "commits", "files read", "files ratio", "files in 30 days", "files on disk", "query s",
                    "query ratio", "MiB"):
            table.add_column(col, justify="left" if col == "table" else "right")
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        for name, t in s.get("tables", {}).items():
            table.add_row(name, f"{fmt(t['commits_from'], '{:,}')} -> {fmt(t['commits_to'], '{:,}')}",
                          f"{t['files_from']:,} -> {t['files_to']:,}", fmt(t["files_ratio"], "{:.2f}"),
                          f"{t['files_30_days']:,}", f"{t['disk_files_from']:,} -> {t['disk_files_to']:,}",
                          f"{fmt(t['query_s_from'], '{:.2f}')} -> {fmt(t['query_s_to'], '{:.2f}')}",
                          fmt(t["query_ratio"], "{:.2f}"), f"{t['bytes_to'] / 2**20:,.1f}")
        Console(width=160).print(table)
        slopes = s.get("host_jvm_per_hour") or {}
        if slopes:  # where the view host's JVM grows, largest first
            grow = ", ".join(f"{k} {v:+.0f}" for k, v in sorted(slopes.items(), key=lambda kv: -abs(kv[1])))
            print(f"{r['label']}: the view host's JVM after the first quarter, MiB/hour: {grow}")


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    for r, style in zip(results, ("-", "--")):
        samples = r["samples"]
        minutes = [s["t"] / 60 for s in samples]
        for name in (samples[-1]["tables"] if samples else {}):
            files = [(s["tables"].get(name) or {}).get("active", 0) for s in samples]
            axes[0].plot(minutes, files, style, label=f"{name} ({r['label']})")
            axes[3].plot(minutes, [(s["tables"].get(name) or {}).get("bytes", 0) / 2**20 for s in samples], style,
                         label=f"{name} ({r['label']})")
        axes[1].plot(minutes, [max(s["query_s"].values(), default=0) for s in samples], style, label=r["label"])
        axes[2].plot(minutes, [s["rss_mb_total"] for s in samples], style, label=r["label"])
    for ax, title in zip(axes, ("data files a reader lists, per table", "slowest count(*) over a view (s)",
                                "RSS of the stack (MiB)", "MiB on disk per table (replaced files stay 7 days)")):
        ax.set_title(title)
        ax.set_xlabel("minutes")
    axes[0].legend(fontsize=6)
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes per leg")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--upkeep-seconds", dest="upkeep_seconds", type=float, default=300.0)
    parser.add_argument("--sample-seconds", dest="sample_seconds", type=float, default=60.0)
    parser.add_argument("--changes-minutes", dest="changes_minutes", type=float, default=60.0)
    parser.add_argument("--no-control", dest="control", action="store_false", help="skip the leg without upkeep")
    parser.add_argument("--nmt", action="store_true",
                        help="start the view host's JVM with native memory tracking and sample its categories")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    from kappa.front.bench import bench_settings, run_interruptible

    run_interruptible(lambda: bench(args, bench_settings), "the broker")


def bench(args: argparse.Namespace, bench_settings: Any) -> None:
    settings, broker = bench_settings("bench-soak")
    try:
        legs = [("upkeep", args.upkeep_seconds)]
        legs += [("no upkeep", NO_UPKEEP_FACTOR * args.minutes * 60)] if args.control else []
        results = []
        for label, period in legs:
            stamp = int(time.time())
            home = Path(settings.home) / "bench-soak" / f"{stamp}"
            print(f"bench-soak: {label}: {args.minutes:g} min at {args.rate:g} events/s, upkeep every {period:g} s",
                  flush=True)
            env = {"KAPPA_HOME": str(home), "KAPPA_LAKE_URI": str(home / "lake"),
                   "KAPPA_TOPIC_PREFIX": f"soak{stamp}-", "KAPPA_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
                   "KAPPA_UPKEEP_SECONDS": f"{period:g}"}
            if args.nmt:  # every JVM the leg starts (the view host's); the broker runs already
                env["JAVA_TOOL_OPTIONS"] = " ".join(filter(None, (os.environ.get("JAVA_TOOL_OPTIONS"),
                                                                  "-XX:NativeMemoryTracking=summary")))
            results.append(leg(label, env, args))
            args.out.mkdir(parents=True, exist_ok=True)  # every leg's samples kept as soon as it ends
            (args.out / "bench-soak.json").write_text(json.dumps(results, indent=2))
        _plot(results, args.out / "bench-soak.png")
        _print(results)
        print(f"bench-soak: {args.out / 'bench-soak.json'}, {args.out / 'bench-soak.png'}")
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

"""Day two at 20,000 commits: the views' live commit path alone, with and without its upkeep.

A month of ``make run`` is 1.3 million micro-batches per view (one every 2 s); a real stack reaches 20,000 commits
per table after 11 hours. This bench reaches them in about an hour for two views by running only what a live
micro-batch does to the lake - the rows a micro-batch's transform produced, committed by the view's own sink
(:class:`kappa.runtime.sink.DeltaSink`, through delta-rs as every live batch of ``make run``), its bad records
appended to the shared quarantine (:class:`kappa.runtime.sink.QuarantineSink`) - and its upkeep
(:mod:`kappa.runtime.upkeep`: compaction under the commit lock, VACUUM, the log's clean-up; the quarantine's
partition), without the Kafka read and the Spark micro-batch around them:

.. code-block:: text

    template    each view's real transform over --template-batches micro-batches of make run's producer
                (200 events/s, 5 % late, 1 % malformed; 2 s of events each) in the testing kit's streaming run
                (kappa.runtime.testing.run_view): each batch's own output rows and bad records
    commit i    batch i mod K of the template, its timestamps moved on by (i div K) x K x 2 s (a whole number
                of windows), committed as batch id i by the view's DeltaSink; its bad records appended to the
                quarantine as the job's QuarantineSink does
    legs        each in a process (its own Spark driver, one core) and a lake of its own, at the same time (the
                same machine at the same moments); the others stop when the first ends (--grace-minutes):
      upkeep      the live job's keeper: every --upkeep-every commits its hourly step (kappa.runtime.upkeep.compact
                  of the table, a full VACUUM the first time, then compact_quarantine of the view's partition), and
                  every 15 commits (its 30 s look) compaction as writers go (compact_between, --compact-files)
                  and the removal of the log older than the tables' history
      hourly      the hourly step alone (KAPPA_COMPACT_FILES=0: no look)
      no-upkeep   neither
    history     a local lake's tables keep an hour of history (KAPPA_HISTORY_HOURS): the legs with upkeep keep
                --history-commits commits' worth (1,800: an hour at the 2 s trigger), its length in time set from
                the leg's pace at every sample (the quarantine a quarter of it, as live); 0: Delta's own

Every --sample-every commits, per table: its Delta version, the data files its current version references (what
a reader lists), its files and bytes on disk (``bench_soak.table_stats``), the commits' median and 95th
percentile seconds since the last sample, and the seconds of ``bin/kappa query``'s engine
(:func:`kappa.front.query.run_query`) for ``SELECT count(*)`` over the view and for its change feed over the last
--changes-commits commits (``table_changes``). VACUUM deletes a replaced file once the table's history no longer
reaches it (the history, like the log's, set in compressed time for the legs with upkeep; Delta's 7 days for the
other): the figures to read are what a reader lists and the commit's and readers' seconds.

``python -m kappa.front.bench_commits`` (``make bench-commits``) prints the first and last windows of two upkeep
periods (from commit 2,000 and the last; their ratios; the target is at most 1.25) and writes
``reports/bench-commits.json`` (every sample) and ``reports/bench-commits.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kappa.runtime.upkeep import LOOK_SECONDS

#: The live views whose commit shapes the bench drives by default: an append (events_raw) and a windowed MERGE with
#: finality (campaign_window_counts). user_sessions' micro-batches at make run's rate commit nothing but their txn
#: (1,000 users each send an event every 5 s: a session with a 30 s gap never closes); --views adds it.
DEFAULT_VIEWS = ("events_raw", "campaign_window_counts")

#: Seconds of events per micro-batch (the live trigger, kappa.runtime.job.DEFAULT_TRIGGER_SECONDS).
BATCH_SECONDS = 2.0


@dataclass
class Template:
    """One view's real micro-batches: the transform's output rows and the bad records of each."""

    view: Any
    schema: Any
    columns: tuple[tuple[str, str], ...]
    batches: list[list[dict[str, Any]]]
    bad: list[list[dict[str, Any]]]

    def rows(self, i: int) -> tuple[list[tuple], list[dict[str, Any]]]:
        """Batch ``i``: the template's batch ``i mod K`` with every timestamp ``(i div K) * K * BATCH_SECONDS``
        later (the output rows as :class:`kappa.runtime.deltars.Collected` holds them; the bad records as
        :meth:`kappa.runtime.sink.QuarantineSink.append` takes them)."""
        from kappa.runtime.deltars import to_micros

        k = len(self.batches)
        shift = int((i // k) * k * BATCH_SECONDS * 1_000_000)

        def value(v: Any, kind: str) -> Any:
            if v is None:
                return None
            if kind == "timestamp":
                return to_micros(v.replace(tzinfo=UTC) if v.tzinfo is None else v) + shift
            return v

        out = [tuple(value(r.get(name), kind) for name, kind in self.columns) for r in self.batches[i % k]]
        bad = [{**b, "offset": b["offset"] + (i // k) * 1_000_000,
                "kafka_timestamp": b["kafka_timestamp"] + shift} for b in self.bad[i % k]]
        return out, bad


def templates(spark: Any, views: list[str], batches: int, rate: float, seed: int,
              say: Any = print) -> dict[str, Template]:
    """Each view's real transform over ``batches`` micro-batches of make run's producer (the testing kit)."""
    from kappa.catalog import load_catalog
    from kappa.log import generator
    from kappa.runtime.deltars import to_micros
    from kappa.runtime.testing import run_view
    from kappa.runtime.view import load_view

    catalog = load_catalog()
    u = generator.universe(seed=seed)
    per_batch = int(rate * BATCH_SECONDS)
    start = 1_800_000_000_000
    records = [(key, value) for key, value, _meta in generator.events(
        per_batch * batches, seed=seed, universe=u, start_ms=start, rate_per_s=rate, late_fraction=0.05,
        malformed_fraction=0.01)]
    chunks = [records[j * per_batch:(j + 1) * per_batch] for j in range(batches)]
    campaigns = [{"ad_id": ad, "campaign_id": c} for ad, c in generator.campaign_records(u).items()]
    out = {}
    for name in views:
        view = load_view(catalog.views[name].module())
        began = time.monotonic()
        run = run_view(view, chunks, lookups={"campaigns": campaigns} if "campaigns" in view.lookups else None,
                       spark=spark, timeout=1800)
        columns = tuple((f.name, f.dataType.simpleString()) for f in run.schema.fields)
        bad: list[list[dict[str, Any]]] = [[] for _ in chunks]
        for q in run.quarantined:  # as the job's side rows carry them (kappa.runtime.plan.SIDE_COLUMNS)
            bad[q.batch].append({"topic": "ad-events", "partition": 0, "offset": q.offset,
                                 "kafka_timestamp": to_micros(datetime.fromtimestamp(start / 1000, UTC)),
                                 "raw_key": b"k", "raw_value": q.raw_value, "error": q.reason})
        out[name] = Template(view, run.schema, columns, run.batches[:batches], bad)
        rows = sum(len(b) for b in out[name].batches)
        say(f"template {view.ref}: {batches} batches, {rows:,} output rows, {sum(len(b) for b in bad)} bad records "
            f"({time.monotonic() - began:.0f} s)")
    return out


class _Batch:
    """What :meth:`DeltaSink.write` reads of the micro-batch's DataFrame when its rows come collected (the live
    path): its session. The rows themselves are the collected ones."""

    def __init__(self, spark: Any) -> None:
        self.sparkSession = spark


@dataclass
class Leg:
    """One lake: a table per view (its sink, its quarantine writer), the registry serving them."""

    label: str
    upkeep: bool  # the hourly upkeep
    between: bool  # compaction as writers go between upkeeps (KAPPA_COMPACT_FILES)
    settings: Any
    sinks: dict[str, Any] = field(default_factory=dict)
    quarantines: dict[str, Any] = field(default_factory=dict)
    #: per view, each commit's seconds in its table's write and in its quarantine append (0 without bad records)
    seconds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    upkeeps: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # commit -> table version


def open_leg(spark: Any, settings: Any, label: str, tmpl: dict[str, Template]) -> Leg:
    """The leg in the lake of ``settings``: each view's table created as its job creates it, registered and
    served."""
    from kappa.control.registry import Registry
    from kappa.control.serving import ServingAlias
    from kappa.identity import ViewPaths, app_id
    from kappa.runtime.sink import DeltaSink, QuarantineSink, create_view_tables

    leg = Leg(label, *LEGS[label], settings)
    reg, alias = Registry(settings.lake_uri), ServingAlias(settings.lake_uri)
    for name, t in tmpl.items():
        view = t.view
        paths = ViewPaths(settings.lake_uri, name, view.version)
        run_app = app_id(name, view.version, "bench")
        create_view_tables(spark, view, t.schema, paths.table, paths.quarantine, "bench")
        leg.sinks[name] = DeltaSink(view, paths.table, run_app)
        leg.quarantines[name] = QuarantineSink(view, paths.quarantine, f"{run_app}/quarantine")
        leg.seconds[name] = []
        reg.register(name, view.version, code_module=f"jobs.{name}.v{view.version}", table_path=paths.table,
                     app_id=run_app, starting="earliest", triggered_by="bench-commits")
        for state in ("caught_up", "verified"):
            reg.set_state(name, view.version, state, by="bench-commits")
        alias.promote(name, view.version, by="bench-commits")
    return leg


def commit(spark: Any, leg: Leg, tmpl: dict[str, Template], i: int) -> None:
    """Batch ``i`` of every view into the leg's tables, as a live job commits it."""
    from kappa.runtime.deltars import Collected
    from kappa.runtime.lineage import batch_metadata

    for name, t in tmpl.items():
        rows, bad = t.rows(i)
        sink = leg.sinks[name]
        meta = batch_metadata(app_id=sink.app_id, batch_id=i, topic="ad-events",
                              end_offsets={p: 100 * (i + 1) for p in range(4)}, watermark_ms=i * 2000)
        began = time.perf_counter()
        sink.write(_Batch(spark), i, user_metadata=meta, rows=len(rows), collected=Collected(t.columns, rows))
        wrote = time.perf_counter()
        if bad:
            leg.quarantines[name].append(bad, i)
        leg.seconds[name].append((wrote - began, time.perf_counter() - wrote))


def upkeep(spark: Any, leg: Leg, first: bool) -> None:
    """The live job's hourly keeper step for every view of the leg (kappa.runtime.job.ViewJob._start_keeper): the
    table compacted (a full VACUUM the first time), then the view's partition of the quarantine."""
    from kappa.runtime.deltars import rs_uri
    from kappa.runtime.upkeep import Upkept, compact, compact_quarantine

    for name, sink in leg.sinks.items():
        began = time.monotonic()
        done = Upkept(compact(spark, sink.path, full_vacuum=first),
                      compact_quarantine(rs_uri(leg.quarantines[name].path), name))
        leg.upkeeps.append({"view": name, "kind": "upkeep", "seconds": round(time.monotonic() - began, 2),
                            "line": done.line()})


def look(spark: Any, leg: Leg, limit: int, handles: dict[str, Any], *, clean: bool = False) -> None:
    """The keeper's look between upkeeps for every view of the leg (kappa.runtime.upkeep.compact_between; ``clean``:
    with a history of its own, the expired log removed too)."""
    from kappa.runtime.deltars import rs_uri
    from kappa.runtime.upkeep import compact_between

    for name, sink in leg.sinks.items():
        began = time.monotonic()
        done = compact_between(spark, sink.path, rs_uri(leg.quarantines[name].path), name, limit=limit,
                               handles=handles, clean=clean)
        if done is not None:
            leg.upkeeps.append({"view": name, "kind": "compaction", "seconds": round(time.monotonic() - began, 2),
                                "line": done.line()})


def keep_history_of(spark: Any, leg: Leg, commits: int, per_minute: float) -> float:
    """Set the leg's tables' history to what holds ``commits`` commits at its pace (``per_minute``): the live job's
    history in time compressed as the bench compresses time - an hour at the 2 s trigger is 1,800 commits; the
    quarantine's, a quarter of it, as live (kappa.runtime.upkeep.QUARANTINE_HISTORY_HOURS). Returns the hours."""
    from kappa.config import LOCAL_HISTORY_HOURS
    from kappa.runtime.upkeep import QUARANTINE_HISTORY_HOURS, history_properties, keep_history

    hours = commits / per_minute / 60
    share = QUARANTINE_HISTORY_HOURS / LOCAL_HISTORY_HOURS
    for name, sink in leg.sinks.items():
        keep_history(spark, sink.path, history_properties(hours))
        keep_history(None, leg.quarantines[name].path, history_properties(hours * share))
    return hours


def sample(leg: Leg, i: int, changes_commits: int) -> dict[str, Any]:
    """The leg's tables after ``i`` commits each: what :mod:`kappa.front.bench_soak` samples, by commit."""
    import psutil

    from kappa.front.bench_soak import table_stats
    from kappa.front.query import QueryError, run_query
    from kappa.runtime.deltars import local_path

    out: dict[str, Any] = {"commit": i, "tables": {}, "commit_s": {}, "query_s": {}, "changes_s": {}}
    for name, sink in leg.sinks.items():
        stats = table_stats(Path(local_path(sink.path)))
        out["tables"][name] = stats
        leg.versions.setdefault(name, []).append((i, stats["version"]))
        parts, leg.seconds[name] = leg.seconds[name], []
        recent = sorted(t + q for t, q in parts)
        if recent:  # the median and 95th percentile of a whole commit; the mean of it and of its two parts
            out["commit_s"][name] = {"median": round(statistics.median(recent), 4),
                                     "p95": round(recent[int(0.95 * (len(recent) - 1))], 4),
                                     "mean": round(statistics.fmean(recent), 4),
                                     "table_mean": round(statistics.fmean(t for t, _q in parts), 4),
                                     "quarantine_mean": round(statistics.fmean(q for _t, q in parts), 4)}
        then = [v for c, v in leg.versions[name] if c <= i - changes_commits] or [0]
        for key, sql in (("query_s", f"SELECT count(*) FROM {name}"),
                         ("changes_s", f"SELECT count(*) FROM table_changes('{name}', {then[-1]})")):
            began = time.monotonic()
            try:
                run_query(sql, settings=leg.settings)
            except QueryError as exc:
                out.setdefault("errors", []).append(f"{name}: {exc}")
                continue
            out[key][name] = round(time.monotonic() - began, 3)
    out["tables"]["quarantine"] = table_stats(Path(local_path(leg.settings.lake_uri)) / "quarantine")
    out["rss_mb"] = round(sum(p.memory_info().rss for p in [psutil.Process(), *psutil.Process().children(True)])
                          / 2**20, 1)
    return out


def summarize(samples: list[dict[str, Any]], start: int, window: int) -> dict[str, Any]:
    """Per table, the window of ``window`` commits from commit ``start`` beside the last ``window`` commits: the
    most data files a reader listed (with upkeep the count rises between compactions and drops at each), the
    median seconds of the count, of the change feed and of a commit, their ratios, and the files a reader would
    list after 30 days of 2 s micro-batches at the rate the peaks grew between the windows."""
    if not samples:
        return {}
    last = samples[-1]["commit"]
    first = [s for s in samples if start <= s["commit"] < start + window] or samples[:1]
    final = [s for s in samples if s["commit"] > last - window and s["commit"] >= first[0]["commit"]] or samples[-1:]
    span = max((final[0]["commit"] + final[-1]["commit"]) / 2 - (first[0]["commit"] + first[-1]["commit"]) / 2, 1)
    month = int(30 * 86_400 / BATCH_SECONDS)

    def median(window_samples: list[dict[str, Any]], key: str, name: str, part: str | None = None) -> float | None:
        values = [s[key][name] if part is None else s[key][name][part]
                  for s in window_samples if s[key].get(name) is not None]
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(b / a, 2) if a and b is not None else None

    tables = {}
    for name, stats in samples[-1]["tables"].items():
        f0 = max((s["tables"].get(name) or {}).get("active", 0) for s in first)
        f1 = max((s["tables"].get(name) or {}).get("active", 0) for s in final)
        row = {"commits_from": first[0]["commit"], "commits_to": last, "version_to": stats["version"],
               "files_from": f0, "files_to": f1, "files_ratio": ratio(f0, f1),
               "files_30_days": round(f1 + max((f1 - f0) / span, 0.0) * (month - last)),
               "log_files_to": stats["commits"] + stats["checkpoints"], "bytes_to": stats["bytes"]}
        for key, label in (("query_s", "query"), ("changes_s", "changes")):
            a, b = median(first, key, name), median(final, key, name)
            row.update({f"{label}_s_from": a, f"{label}_s_to": b, f"{label}_ratio": ratio(a, b)})
        a, b = median(first, "commit_s", name, "median"), median(final, "commit_s", name, "median")
        row.update({"commit_s_from": a, "commit_s_to": b, "commit_ratio": ratio(a, b)})
        for part in ("mean", "table_mean", "quarantine_mean"):  # samples before these were kept have none
            a, b = (median([s for s in w if part in (s["commit_s"].get(name) or {})], "commit_s", name, part)
                    for w in (first, final))
            row.update({f"commit_{part}_s_from": a, f"commit_{part}_s_to": b})
        tables[name] = row
    rss = [s["rss_mb"] for s in samples]
    return {"window": window, "tables": tables, "rss_mb_from": rss[0], "rss_mb_to": rss[-1]}


# ------------------------------------------------------------------------------------------------ report
def _print(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    for r in results:
        s = r["summary"]
        stopped = f"; stopped {r['stopped']}" if r.get("stopped") else ""
        table = Table(title=f"{r['label']}: the {s.get('window', 0):,} commits from commit "
                            f"{r['from_commit']:,} -> the last {s.get('window', 0):,} "
                            f"({r['minutes']:.0f} min for {r['commits']:,} commits of every table{stopped})")
        for col in ("table", "commits", "files read", "ratio", "in 30 days", "log files", "count(*) s", "ratio",
                    "changes s", "ratio", "commit s", "ratio", "MiB"):
            table.add_column(col, justify="left" if col == "table" else "right")
        for name, t in s.get("tables", {}).items():
            table.add_row(name, f"{t['commits_from']:,} -> {t['commits_to']:,}",
                          f"{t['files_from']:,} -> {t['files_to']:,}", fmt(t["files_ratio"], "{:.2f}"),
                          f"{t['files_30_days']:,}", f"{t['log_files_to']:,}",
                          f"{fmt(t['query_s_from'], '{:.2f}')} -> {fmt(t['query_s_to'], '{:.2f}')}",
                          fmt(t["query_ratio"], "{:.2f}"),
                          f"{fmt(t['changes_s_from'], '{:.2f}')} -> {fmt(t['changes_s_to'], '{:.2f}')}",
                          fmt(t["changes_ratio"], "{:.2f}"),
                          f"{fmt(t['commit_s_from'], '{:.3f}')} -> {fmt(t['commit_s_to'], '{:.3f}')}",
                          fmt(t["commit_ratio"], "{:.2f}"), f"{t['bytes_to'] / 2**20:,.1f}")
        Console(width=180).print(table)
        for name, t in s.get("tables", {}).items():
            if t.get("commit_mean_s_to") is not None:
                print(f"bench-commits: {r['label']}: {name}: a commit's mean {fmt(t['commit_mean_s_from'], '{:.3f}')}"
                      f" -> {fmt(t['commit_mean_s_to'], '{:.3f}')} s: the table's write "
                      f"{fmt(t['commit_table_mean_s_from'], '{:.3f}')} -> {fmt(t['commit_table_mean_s_to'], '{:.3f}')}"
                      f", the quarantine's append {fmt(t['commit_quarantine_mean_s_from'], '{:.3f}')} -> "
                      f"{fmt(t['commit_quarantine_mean_s_to'], '{:.3f}')}")


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    colors: dict[str, str] = {}  # a table keeps its color in every panel and leg; a leg its line style
    for r, style in zip(results, ("-", "--", ":")):
        samples = r["samples"]
        commits = [s["commit"] for s in samples]
        for name in (samples[-1]["tables"] if samples else {}):
            line = {"label": f"{name} ({r['label']})", "linestyle": style,
                    "color": colors.setdefault(name, f"C{len(colors)}")}
            axes[0].plot(commits, [(s["tables"].get(name) or {}).get("active", 0) for s in samples], **line)
            if name in samples[-1]["query_s"]:
                axes[1].plot(commits, [s["query_s"].get(name) for s in samples], **line)
                axes[2].plot(commits, [(s["commit_s"].get(name) or {}).get("median") for s in samples], **line)
            axes[3].plot(commits, [(s["tables"].get(name) or {}).get("commits", 0)
                                   + (s["tables"].get(name) or {}).get("checkpoints", 0) for s in samples], **line)
    for ax, title in zip(axes, ("data files a reader lists", "SELECT count(*) through the query engine (s)",
                                "median commit of a micro-batch (s)", "files in _delta_log")):
        ax.set_title(title)
        ax.set_xlabel("commits per table")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=20_000, help="commits per table and leg")
    parser.add_argument("--views", default=",".join(DEFAULT_VIEWS))
    parser.add_argument("--upkeep-every", dest="upkeep_every", type=int, default=1800,
                        help="commits between upkeeps (1,800: the default hourly upkeep at the 2 s trigger)")
    parser.add_argument("--sample-every", dest="sample_every", type=int, default=500)
    parser.add_argument("--changes-commits", dest="changes_commits", type=int, default=1500,
                        help="the change feed read at each sample: the last N commits (1,500: 50 minutes at the 2 s "
                             "trigger, within the history's hour whatever the pace's jitter)")
    parser.add_argument("--from-commit", dest="from_commit", type=int, default=2000,
                        help="the first window of the summary starts here")
    parser.add_argument("--window", type=int, default=0,
                        help="commits per summary window (0: two upkeep periods)")
    parser.add_argument("--template-batches", dest="template_batches", type=int, default=30)
    parser.add_argument("--rate", type=float, default=200.0, help="events/s of the template's producer")
    parser.add_argument("--max-minutes", dest="max_minutes", type=float, default=0.0,
                        help="a leg stops at its first sample after this many minutes of commits (0: none)")
    parser.add_argument("--legs", default="upkeep,hourly",
                        help="the legs, each a process: upkeep (the keeper: hourly, and compaction as writers go), "
                             "hourly (the keeper without compaction as writers go), no-upkeep; the others stop "
                             "when the first one ends")
    parser.add_argument("--grace-minutes", dest="grace_minutes", type=float, default=0.0,
                        help="how long the other legs may go on once the first one ended")
    parser.add_argument("--history-commits", dest="history_commits", type=int, default=1800,
                        help="the legs with upkeep keep the history of this many commits (the live default, an "
                             "hour, at the 2 s trigger), set from their pace at every sample; 0: Delta's own")
    parser.add_argument("--compact-files", dest="compact_files", type=int, default=100,
                        help="the upkeep leg's KAPPA_COMPACT_FILES")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--report", action="store_true",
                        help="no run: the report of the legs' samples saved in --out (a run stopped early)")
    parser.add_argument("--leg", choices=sorted(LEGS), help=argparse.SUPPRESS)  # one leg (a child of the bench)
    parser.add_argument("--stamp", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.commits < 1 or args.upkeep_every < 1 or args.sample_every < 1:
        parser.error("--commits, --upkeep-every and --sample-every must be at least 1")
    from kappa.front.bench import run_interruptible

    if args.report:
        legs = [leg for leg in args.legs.split(",") if leg]
        report(args, legs, [0 if (args.out / f"bench-commits-{leg}.json").is_file() else 1 for leg in legs])
    elif args.leg:
        run_leg(args)
    else:
        run_interruptible(lambda: bench(args), "both legs")


#: leg -> (the hourly upkeep, compaction as writers go between upkeeps): the platform's keeper, the keeper before
#: compaction as writers go (KAPPA_COMPACT_FILES=0), no upkeep.
LEGS = {"upkeep": (True, True), "hourly": (True, False), "no-upkeep": (False, False)}


def bench(args: argparse.Namespace) -> None:
    """Both legs at once, each in a process of its own (its own Spark driver: one core each), then the report."""
    import subprocess
    import sys

    legs = [leg for leg in args.legs.split(",") if leg]
    unknown = set(legs) - set(LEGS)
    if unknown or not legs:
        raise SystemExit(f"bench-commits: --legs {args.legs!r}: name some of {', '.join(LEGS)}")
    stamp = str(int(time.time()))
    for leg in LEGS:  # an earlier run's legs are not this one's
        (args.out / f"bench-commits-{leg}.json").unlink(missing_ok=True)
    children = [subprocess.Popen([sys.executable, "-m", "kappa.front.bench_commits", *sys.argv[1:], "--leg", leg,
                                  "--stamp", stamp]) for leg in legs]
    try:
        first = children[0].wait()  # the others stop with it: without compaction a commit costs more and more
        for c in children[1:]:
            try:
                c.wait(args.grace_minutes * 60)
            except subprocess.TimeoutExpired:
                c.terminate()
        codes = [first] + [c.wait() for c in children[1:]]
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
                c.wait(60)
    report(args, legs, codes)


def report(args: argparse.Namespace, legs: list[str], codes: list[int]) -> None:
    """The report of the legs' saved samples (each leg saves them at every sample): a leg that exited or was
    stopped early is reported to its last sample and marked so."""
    saved = {leg: args.out / f"bench-commits-{leg}.json" for leg in legs}
    for leg, code in zip(legs, codes):
        if code == -signal.SIGTERM and leg != legs[0] and saved[leg].is_file():  # stopped by bench()
            stopped = json.loads(saved[leg].read_text())
            stopped["stopped"] = f"when the {legs[0]} leg ended"
            saved[leg].write_text(json.dumps(stopped, indent=2))
        elif code:
            print(f"bench-commits: the {leg} leg exited {code}: "
                  + (f"its samples to commit {json.loads(saved[leg].read_text())['commits']:,} are reported"
                     if saved[leg].is_file() else "it measured nothing"), flush=True)
    results = [json.loads(path.read_text()) for leg, path in saved.items() if path.is_file()]
    if not results:
        raise SystemExit(f"bench-commits: no leg measured anything (exit codes {codes}); no report written")
    for r in results:
        if not r.get("stopped") and r["commits"] < r.get("asked", r["commits"]):
            r["stopped"] = f"at commit {r['commits']:,} of {r['asked']:,}"
        r["from_commit"] = args.from_commit
        r["summary"] = summarize(r["samples"], args.from_commit, args.window or 2 * args.upkeep_every)
    (args.out / "bench-commits.json").write_text(json.dumps(results, indent=2, default=str))
    _plot(results, args.out / "bench-commits.png")
    _print(results)
    for r in results:
        for kind in ("upkeep", "compaction"):
            runs = [u["seconds"] for u in r["upkeeps"] if u["kind"] == kind]
            if runs:
                print(f"bench-commits: {r['label']}: {len(runs)} {kind}s of a view's table and quarantine partition, "
                      f"{statistics.median(runs):.1f} s median, {max(runs):.1f} s at most")
    print(f"bench-commits: {args.out / 'bench-commits.json'}, {args.out / 'bench-commits.png'}")


def run_leg(args: argparse.Namespace) -> None:
    """One leg in this process: its templates, its lake, its commits and samples (``bench-commits-<leg>.json``)."""
    from kappa.config import Settings
    from kappa.runtime.spark import build_spark, stop_spark

    base = Settings.from_env()
    home = Path(base.home) / "bench-commits" / f"{args.stamp}-{args.leg}"
    settings = base.replace(home=home, lake_uri=str(home / "lake"))
    os.environ.update({"KAPPA_HOME": str(home), "KAPPA_LAKE_URI": settings.lake_uri})
    views = [v for v in args.views.split(",") if v]
    spark = build_spark(f"kappa-bench-commits-{args.leg}", settings, master="local[1]", driver_memory="1g")
    say = lambda line: print(f"  [{args.leg}] {line}", flush=True)  # noqa: E731
    try:
        tmpl = templates(spark, views, args.template_batches, args.rate, seed=49, say=say)
        leg = open_leg(spark, settings, args.leg, tmpl)
        handles: dict[str, Any] = {}
        every = max(1, round(LOOK_SECONDS / BATCH_SECONDS))  # the keeper's look, in micro-batches
        t0 = time.monotonic()
        args.out.mkdir(parents=True, exist_ok=True)

        def save(done: int, stopped: str = "") -> None:  # after every sample: a stopped leg keeps what it measured
            (args.out / f"bench-commits-{args.leg}.json").write_text(json.dumps(
                {"label": args.leg.replace("-", " "), "commits": done, "asked": args.commits, "stopped": stopped,
                 "minutes": round((time.monotonic() - t0) / 60, 1), "from_commit": args.from_commit,
                 "upkeep_every": args.upkeep_every if leg.upkeep else None,
                 "compact_files": args.compact_files if leg.between else None,
                 "history_commits": args.history_commits if leg.upkeep else None, "samples": leg.samples,
                 "upkeeps": leg.upkeeps}, indent=2, default=str))

        for i in range(args.commits):
            commit(spark, leg, tmpl, i)
            if leg.upkeep and (i + 1) % args.upkeep_every == 0:
                upkeep(spark, leg, first=not any(u["kind"] == "upkeep" for u in leg.upkeeps))
            elif leg.between and (i + 1) % every == 0:
                look(spark, leg, args.compact_files, handles, clean=bool(args.history_commits))
            if (i + 1) % args.sample_every == 0 or i + 1 == args.commits:
                leg.samples.append({**sample(leg, i + 1, args.changes_commits), "t": round(time.monotonic() - t0, 1)})
                if leg.upkeep and args.history_commits:  # the pace so far sets the history's length in time
                    leg.samples[-1]["history_minutes"] = round(60 * keep_history_of(
                        spark, leg, args.history_commits, (i + 1) / ((time.monotonic() - t0) / 60)), 1)
                files = {n: x["active"] for n, x in leg.samples[-1]["tables"].items()}
                say(f"{i + 1:,} commits ({(time.monotonic() - t0) / 60:.1f} min); files a reader lists {files}")
                over = args.max_minutes and time.monotonic() - t0 > args.max_minutes * 60
                save(i + 1, f"after {args.max_minutes:g} min (--max-minutes)" if over and i + 1 < args.commits else "")
                if over:
                    break
    finally:
        stop_spark(spark)


if __name__ == "__main__":
    main()

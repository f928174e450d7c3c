"""What a live commit costs as a table's ``_delta_log`` grows, on a local disk and on the object store.

A view table committed every 2 s gains ~1.1 log files per micro-batch (a JSON per commit, a checkpoint every
:data:`kappa.runtime.deltars.CHECKPOINT_INTERVAL`): 43,200 a day, and Delta keeps them 30 days
(``delta.logRetentionDuration``). This bench builds tables whose log already holds N commits - the commits are
``commitInfo``-only JSON files (valid Delta commits that add nothing) and copies of a checkpoint every 20, the last
one a real checkpoint, so each table is read as a long-lived one is: its last checkpoint, then the commits after
it - and times, on each:

.. code-block:: text

    write        delta-rs' append of 100 rows with its default post-commit hooks (a checkpoint at its own
                 interval and the clean-up of the expired log, which lists the whole log after every commit)
    live write   the same append with the live commits' hooks (kappa.runtime.deltars.LIVE_HOOKS: neither)
    append_once  the live sink's idempotent append as a view's driver makes it: it knows its last batch, lists
                 nothing before the write (kappa.runtime.deltars.append_once with ``last``)
    update       bringing an open table up to date when nothing changed (one listing of the log from its version)
    open         opening the table (``DeltaTable(uri)``: its last checkpoint and the commits after it)

A handle's age: two long-lived handles of a fresh table append in turn --age-commits times each (as two views'
writers of the shared quarantine do; the live append: LIVE_HOOKS, the writer's txn, then
:func:`kappa.runtime.deltars.after_commit`, whose checkpoint falls on one of them) - once with the writer of a
checkpoint started again from it (:func:`kappa.runtime.deltars.start_from_checkpoint`, the live path) and once
without; the medians of each writer's first and last 100 appends.

``python -m kappa.front.bench_log [--lengths 50,2000,20000] [--stores local,s3] [--age-commits 600]`` (``make
bench-log``): ``s3`` is the platform's object store (:mod:`kappa.objectstore`, started when it is not running);
prints the medians in ms and writes ``reports/bench-log.json`` and ``reports/bench-log.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Callable

#: What is timed on each table, in the order printed.
MEASURES = ("write", "live_write", "append_once", "update", "open")


def _ms(action: Callable[[], Any], repeat: int) -> float:
    took = []
    for _ in range(repeat):
        began = time.perf_counter()
        action()
        took.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(took), 2)


def build(uri: str, commits: int, put: Callable[[str, bytes], None], get: Callable[[str], bytes]) -> Any:
    """A table at ``uri`` whose log holds ``commits`` commits (see the module doc); returns it opened."""
    from deltalake import DeltaTable, write_deltalake

    from kappa.runtime.deltars import CHECKPOINT_INTERVAL, create_table

    create_table(uri, _columns())
    table = DeltaTable(uri)
    write_deltalake(table, _rows(), mode="append")
    table.create_checkpoint()
    checkpoint = get(f"_delta_log/{1:020}.checkpoint.parquet")
    body = (json.dumps({"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "WRITE"}}) + "\n").encode()
    for version in range(2, commits + 1):
        put(f"_delta_log/{version:020}.json", body)
        if version % CHECKPOINT_INTERVAL == 0 and version != commits:  # the last one is a real checkpoint
            put(f"_delta_log/{version:020}.checkpoint.parquet", checkpoint)
    table = DeltaTable(uri)
    table.create_checkpoint()
    return table


def measure(uri: str, table: Any, repeat: int) -> dict[str, float]:
    """The medians (ms) of :data:`MEASURES` on ``table`` (at ``uri``)."""
    from deltalake import DeltaTable, write_deltalake

    from kappa.runtime.deltars import LIVE_HOOKS, append_once

    batch = iter(range(1, 10**9))
    rows = _rows()
    return {
        "write": _ms(lambda: write_deltalake(table, rows, mode="append"), max(3, repeat // 3)),
        "live_write": _ms(lambda: write_deltalake(table, rows, mode="append", post_commithook_properties=LIVE_HOOKS),
                          repeat),
        "append_once": _ms(lambda: append_once(table, rows, "bench", (b := next(batch)), last=b - 1), repeat),
        "update": _ms(table.update_incremental, repeat),
        "open": _ms(lambda: DeltaTable(uri), max(3, repeat // 3)),
    }


def age(uri: str, commits: int, rebase: bool) -> dict[str, list[float]]:
    """Two handles of a fresh table at ``uri`` append ``commits`` times each, in turn; each append's ms per
    writer. ``rebase``: the writer of a checkpoint starts again from it (the live path)."""
    from deltalake import DeltaTable, write_deltalake

    from kappa.runtime.deltars import LIVE_HOOKS, after_commit, commit_properties, create_table

    create_table(uri, _columns())
    writers = {"a": DeltaTable(uri), "b": DeltaTable(uri)}
    took: dict[str, list[float]] = {name: [] for name in writers}
    rows = _rows()
    for batch in range(commits):
        for name, table in writers.items():
            began = time.perf_counter()
            write_deltalake(table, rows, mode="append", post_commithook_properties=LIVE_HOOKS,
                            commit_properties=commit_properties(name, batch))
            after_commit(table, rebase=rebase)
            took[name].append(round((time.perf_counter() - began) * 1000, 2))
    return took


def _rows() -> Any:
    from kappa.runtime.deltars import arrow_rows

    return arrow_rows(_columns(), [{"id": i, "s": "x" * 20} for i in range(100)])


def _columns() -> tuple:
    from kappa.runtime.deltars import I64, STR

    return (("id", I64), ("s", STR))



def _local(root: Path, commits: int) -> tuple[str, Callable, Callable]:
    path = root / f"log-{commits}"
    shutil.rmtree(path, ignore_errors=True)

    def put(key: str, data: bytes) -> None:
        (path / key).write_bytes(data)

    return str(path), put, lambda key: (path / key).read_bytes()


def _s3(prefix: str, commits: int) -> tuple[str, Callable, Callable]:
    import os

    import obstore
    from obstore.store import from_url

    from kappa.config import Settings
    from kappa.objectstore import LocalObjectStore

    store = LocalObjectStore.from_settings(Settings.from_env())
    if not store.is_running():
        store.start()
    store.ensure_bucket("kappa")
    options = store.delta_rs_options()
    os.environ.update(options)  # delta-rs and obstore read the store's endpoint and credential from there
    s3 = from_url("s3://kappa")
    key = f"{prefix}/log-{commits}"
    for listed in obstore.list(s3, prefix=key + "/"):
        obstore.delete(s3, [o["path"] for o in listed])
    return (f"s3://kappa/{key}", lambda k, data: obstore.put(s3, f"{key}/{k}", data),
            lambda k: bytes(obstore.get(s3, f"{key}/{k}").bytes()))


def run_age(commits: int, stores: list[str], root: Path) -> list[dict[str, Any]]:
    """:func:`age` on each store, without and with the start from the checkpoint."""
    results = []
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    window = min(100, commits)
    for store in stores:
        for rebase in (False, True):
            label = f"age-{'rebase' if rebase else 'as-is'}"
            uri, _put, _get = _local(root, commits) if store == "local" else _s3(f"bench-log/{stamp}/{label}", commits)
            took = age(uri, commits, rebase)
            row = {"store": store, "rebase": rebase, "commits": commits, "ms": took,
                   **{f"{name}_first_ms": round(statistics.median(v[:window]), 2) for name, v in took.items()},
                   **{f"{name}_last_ms": round(statistics.median(v[-window:]), 2) for name, v in took.items()}}
            print(f"age {store:<6} {'started again from its checkpoints' if rebase else 'as delta-rs keeps it':<35} "
                  + "  ".join(f"writer {name}: {row[f'{name}_first_ms']:.1f} -> {row[f'{name}_last_ms']:.1f} ms"
                              for name in took), flush=True)
            results.append(row)
            if store == "local":
                shutil.rmtree(uri, ignore_errors=True)
    return results


def run(lengths: list[int], stores: list[str], repeat: int, root: Path) -> list[dict[str, Any]]:
    results = []
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    for store in stores:
        for commits in lengths:
            uri, put, get = _local(root, commits) if store == "local" else _s3(f"bench-log/{stamp}", commits)
            began = time.monotonic()
            table = build(uri, commits, put, get)
            row = {"store": store, "commits": commits, "built_s": round(time.monotonic() - began, 1),
                   **measure(uri, table, repeat)}
            print(f"{store:<6} {commits:>7,} " + " ".join(f"{row[m]:>11.1f}" for m in MEASURES), flush=True)
            results.append(row)
            if store == "local":
                shutil.rmtree(uri, ignore_errors=True)
    return results


def _plot(results: list[dict[str, Any]], ages: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stores = sorted({r["store"] for r in results})
    rows = 2 if ages else 1
    fig, axes = plt.subplots(rows, len(stores), figsize=(6 * len(stores), 4 * rows), squeeze=False)
    for ax, store in zip(axes[1] if ages else [], stores):
        for r in (a for a in ages if a["store"] == store):
            for name, took in r["ms"].items():
                smooth = [statistics.median(took[max(0, i - 24):i + 1]) for i in range(len(took))]
                ax.plot(range(1, len(took) + 1), smooth,
                        label=f"writer {name}, {'started again from its checkpoints' if r['rebase'] else 'as is'}")
        ax.set(title=f"One handle's appends as it ages, lake: {store}", xlabel="appends through the handle",
               ylabel="ms (median of the last 25)")
        ax.legend(fontsize=7)
    for ax, store in zip(axes[0], stores):
        rows = [r for r in results if r["store"] == store]
        for name in MEASURES:
            ax.plot([r["commits"] for r in rows], [r[name] for r in rows], marker="o", label=name)
        ax.set(title=f"A commit against the log's length, lake: {store}", xlabel="commits in _delta_log",
               ylabel="ms (median)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="50,2000,20000", help="commits in each table's log")
    parser.add_argument("--stores", default="local,s3", help="local, s3 (the platform's object store), or both")
    parser.add_argument("--repeat", type=int, default=15, help="timings per measure (the median is reported)")
    parser.add_argument("--age-commits", dest="age_commits", type=int, default=600,
                        help="appends of each of two long-lived handles, with and without the start from a "
                             "checkpoint (0: not measured)")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not stores or set(stores) - {"local", "s3"}:
        parser.error(f"--stores takes local and/or s3, not {args.stores!r}")
    try:
        lengths = sorted(int(n) for n in args.lengths.split(","))
    except ValueError:
        parser.error(f"--lengths takes whole numbers separated by commas, not {args.lengths!r}")
    if lengths[0] < 2:
        parser.error("--lengths: a log of at least 2 commits")
    if args.age_commits < 0:
        parser.error(f"--age-commits takes 0 or more appends, not {args.age_commits}")
    print(f"{'store':<6} {'commits':>7} " + " ".join(f"{m:>11}" for m in MEASURES) + "   (ms, median)")
    with tempfile.TemporaryDirectory(prefix="bench-log-") as root:
        results = run(lengths, stores, args.repeat, Path(root))
        ages = run_age(args.age_commits, stores, Path(root)) if args.age_commits else []
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-log.json").write_text(json.dumps({"results": results, "repeat": args.repeat, "age": ages},
                                                        indent=2))
    _plot(results, ages, args.out / "bench-log.png")
    print(f"report: {args.out / 'bench-log.json'}, {args.out / 'bench-log.png'}")


if __name__ == "__main__":
    main()

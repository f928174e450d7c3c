"""What analysts' SQL answers and what it costs the views: the SQL service beside ``make run``'s stack.

One *leg*, in a home, lake and topics of its own on the bench's broker: the stack as ``bin/kappa up`` starts it
(every declared view in the view host, the live producer at ``--rate``), then the SQL service (``kappa sql
serve``, as ``make run`` starts it once the views have rows). After ``--warm`` seconds:

.. code-block:: text

    alone      --window s with no analyst: the views' lag, the cores and RSS of the view host and the service (the
               worst lag printed is the live views', those with a trigger of 10 s or less: ad_events_archive's
               30 s trigger is its lag by design)
    connect    JDBC (PyHive) and Spark Connect (pyspark-client), each: a first session (cold: the service's
               first of that kind) and a second one (warm) - seconds to connected and to the first answer of a
               point query (one row of the largest view by its key, partition and offset), then --points
               more point queries (p50 / p99)
    1 analyst  one analyst scanning the largest view in full (every column of every row) again and again for
               --window s, while the views' lag, cores and RSS are measured as above
    8 analysts the same with eight analysts at once (four JDBC, four Spark Connect)

The clients run in the analysts' venv (``.cache/analyst-venv``, ``infra/local/requirements-analyst.lock``: what a
laptop installs), each its own process (:mod:`kappa.front.sql.loadgen`). The views' lag is read from their
checkpoints against the log's end every 2 s, as ``make bench-live`` reads it (:func:`kappa.front.bench_live._window`).

``python -m kappa.front.bench_sql`` (``make bench-sql``) prints the figures and writes ``reports/bench-sql.json``
and ``reports/bench-sql.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOADGEN = Path(__file__).resolve().parent / "sql" / "loadgen.py"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(latencies: list[float]) -> dict[str, Any]:
    return {"n": len(latencies), "p50_s": _pct(latencies, 0.5), "p99_s": _pct(latencies, 0.99),
            "max_s": max(latencies) if latencies else None}


def _largest(settings: Any) -> tuple[str, int]:
    """(the serving view over the most bytes among those keyed by partition and offset, a mid offset of
    partition 0)."""
    from kappa.control.registry import open_delta
    from kappa.control.serving import ServingAlias

    serving = ServingAlias.from_settings(settings)
    best: tuple[int, str, Any] | None = None
    for view in ("events_raw", "ad_events_archive"):
        table = open_delta(serving.target(view).table_path)
        size = sum(table.get_add_actions(flatten=True).column("size_bytes").to_pylist())
        if best is None or size > best[0]:
            best = (size, view, table)
    _size, view, table = best
    actions = table.get_add_actions(flatten=True)
    highs = [v for p, v in zip(actions.column("partition.partition").to_pylist()
                               if "partition.partition" in actions.column_names else [0] * actions.num_rows,
                               actions.column("max.offset").to_pylist()) if p == 0 and v is not None]
    return view, (max(highs) // 2 if highs else 0)


def leg(args: argparse.Namespace) -> None:
    """The stack, the service, the windows; the result as JSON in ``args.leg_out``."""
    from kappa.config import Settings
    from kappa.control.replay.version import module_of
    from kappa.control.runners.local import metrics_port
    from kappa.front import stack
    from kappa.front.bench_live import _tree_usage, _window
    from kappa.front.sql.server import ensure_token
    from kappa.front.venvs import ensure_venv
    from kappa.process import Daemon
    from kappa.runtime.host import host_pid
    from kappa.runtime.job import live_trigger_seconds
    from kappa.runtime.view import load_view

    st = Settings.from_env()
    versions = {view: (view, version) for view, version in stack.stack_views(st)}
    ports = {label: metrics_port(*ref) for label, ref in versions.items()}
    say = lambda line: print(f"  [bench-sql] {line}", flush=True)  # noqa: E731
    python = ensure_venv(ROOT, "analyst-venv", "infra/local/requirements-analyst.lock")
    result: dict[str, Any] = {"rate": args.rate, "window_s": args.window}
    try:
        stack.up(st, rate=args.rate, echo=say)
        stack.wait_ready(st, timeout=900)
        t0 = time.monotonic()
        sql = stack.start_sql(st)
        while not stack.sql_ready_file(st).exists():
            if sql.pid() is None:
                raise SystemExit(f"bench-sql: the SQL service stopped; see {sql.log_file}")
            time.sleep(1)
        result["sql_start_s"] = time.monotonic() - t0
        token = ensure_token(st)
        say(f"SQL service listening after {result['sql_start_s']:.0f} s; warming up {args.warm:g} s")
        time.sleep(args.warm)
        view, offset = _largest(st)
        point = f"SELECT * FROM analytics.{view} WHERE partition = 0 AND offset = {offset}"
        scan = f"SELECT count(*), sum(length(to_json(struct(*)))) FROM analytics.{view}"
        result.update({"largest_view": view, "point_sql": point, "scan_sql": scan})

        def parts() -> dict[str, int | None]:
            return {"view host": host_pid(st), "producer": Daemon("producer", st).pid(), "sql": sql.pid()}

        def client(kind: str, query: str, **how: Any) -> subprocess.Popen:
            host, port = ("localhost", st.sql_connect_port) if kind == "connect" else ("127.0.0.1", st.sql_jdbc_port)
            extra = [f"--{k}={v}" for k, v in how.items()]
            return subprocess.Popen([str(python), str(LOADGEN), kind, host, str(port), token, query, *extra],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def answer(proc: subprocess.Popen) -> dict[str, Any]:
            out, errs = proc.communicate(timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(f"bench-sql: a client failed: {errs.strip().splitlines()[-1:]}")
            return json.loads(out.strip().splitlines()[-1])

        say(f"measuring {args.window:g} s with no analyst")
        result["alone"] = _window(st, versions, ports, parts(), args.window, args.rate)
        result["connect"] = {}
        for kind in ("jdbc", "connect"):
            for when in ("cold", "warm"):
                got = answer(client(kind, point, repeat=args.points if when == "warm" else 0))
                result["connect"][f"{kind} {when}"] = {"connect_s": got["connect_s"], "first_s": got["first_s"],
                                                       "rows": got["rows"], "point": _summary(got["latencies_s"])}
                say(f"{kind} {when}: connected in {got['connect_s']:.2f} s, first answer {got['first_s']:.2f} s")
        for n in (1, 8):
            say(f"measuring {args.window:g} s with {_analysts(n)} scanning {view} in full")
            until = time.time() + args.window
            clients = [client("jdbc" if i % 2 == 0 else "connect", scan, until=until) for i in range(n)]
            window = _window(st, versions, ports, parts(), args.window, args.rate)
            answers = [answer(c) for c in clients]
            latencies = [x for a in answers for x in a["latencies_s"]] + [a["first_s"] - a["connect_s"] for a in answers]
            window["scans"] = _summary(latencies)
            window["sql_rss_peak_mb"] = _tree_usage(sql.pid())["rss_mb"]
            result[_analysts(n)] = window
        for label, ref in versions.items():  # a view read for history (a 30 s trigger) is not a live one
            trigger = live_trigger_seconds(load_view(module_of(*ref)))
            for name in ("alone", _analysts(1), _analysts(8)):
                result[name]["views"][label]["trigger_s"] = trigger
    finally:
        stack.down(st, echo=say)
    Path(args.leg_out).write_text(json.dumps(result, indent=2))


def _analysts(n: int) -> str:
    return f"{n} analyst" + ("s" if n > 1 else "")


#: Views whose trigger is longer are read for history, not freshness (``ad_events_archive``: 30 s); their lag is
#: their trigger by design and is left out of the worst live lag.
LIVE_TRIGGER_S = 10.0


def _worst_lag(window: dict[str, Any]) -> float | None:
    """The worst lag (seconds of produce) of the live views over the window."""
    lags = [v["lag_seconds_max"] for v in window["views"].values()
            if v.get("lag_seconds_max") is not None and (v.get("trigger_s") or 0) <= LIVE_TRIGGER_S]
    return max(lags) if lags else None


def _print(r: dict[str, Any]) -> None:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    print(f"\nbench-sql: the largest view {r['largest_view']}; service listening {r['sql_start_s']:.0f} s after start")
    print(f"{'session':<14}{'connect s':>11}{'first answer s':>16}{'point p50 s':>13}{'point p99 s':>13}")
    for name, c in r["connect"].items():
        print(f"{name:<14}{s(c['connect_s']):>11}{s(c['first_s']):>16}{s(c['point']['p50_s']):>13}"
              f"{s(c['point']['p99_s']):>13}")
    print(f"\n{'analysts':<12}{'scans':>7}{'scan p50 s':>12}{'scan p99 s':>12}{'worst live lag s':>18}"
          f"{'view host cores':>17}{'sql cores':>11}{'sql RSS MiB':>13}")
    for name in ("alone", _analysts(1), _analysts(8)):
        w = r[name]
        scans = w.get("scans") or {"n": 0, "p50_s": None, "p99_s": None}
        print(f"{name:<12}{scans['n']:>7}{s(scans['p50_s']):>12}{s(scans['p99_s']):>12}{s(_worst_lag(w)):>18}"
              f"{w['cores'].get('view host', 0):>17.2f}{w['cores'].get('sql', 0):>11.2f}{w['rss_mb'].get('sql', 0):>13.0f}")


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 5))
    names = list(r["connect"])
    a.bar([f"{n}\nconnect" for n in names], [r["connect"][n]["first_s"] for n in names], color="#4c72b0")
    a.set_ylabel("seconds to the first answer")
    a.set_title("a session's first answer (point query)")
    windows = ["alone", _analysts(1), _analysts(8)]
    b.bar(windows, [_worst_lag(r[w]) or 0 for w in windows], color="#dd8452")
    b.set_ylabel(f"worst lag of the live views (trigger <= {LIVE_TRIGGER_S:g} s), s of produce")
    b.set_title(f"the views at {r['rate']:g} events/s while analysts scan")
    p50 = [(r[w].get("scans") or {}).get("p50_s") or 0 for w in windows[1:]]
    p99 = [(r[w].get("scans") or {}).get("p99_s") or 0 for w in windows[1:]]
    xs = range(len(p50))
    c.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    c.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    c.set_xticks(list(xs), windows[1:])
    c.set_ylabel("seconds per full scan")
    c.set_title(f"full scans of {r['largest_view']}")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="the live producer's events/s")
    parser.add_argument("--warm", type=float, default=60.0, help="seconds after the service listens, before measuring")
    parser.add_argument("--window", type=float, default=120.0, help="seconds of each measured window")
    parser.add_argument("--points", type=int, default=20, help="point queries of each warm session")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("command", nargs="?", default="bench", choices=("bench", "leg"))
    parser.add_argument("--leg-out", dest="leg_out", default="")
    args = parser.parse_args()
    if args.command == "leg":
        leg(args)
        return
    from kappa.front.bench import bench_settings, run_interruptible

    run_interruptible(lambda: bench(args, bench_settings), "the broker")


def bench(args: argparse.Namespace, bench_settings: Any) -> None:
    from kappa.config import Settings

    base = Settings.from_env()
    for port in (base.sql_jdbc_port, base.sql_connect_port, base.airflow_port):
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"bench-sql: port {port} is in use; stop `make run` first (`make down`)")
    settings, broker = bench_settings("bench-sql")
    try:
        stamp = int(time.time())
        home = Path(settings.home) / "bench-sql" / str(stamp)
        home.mkdir(parents=True, exist_ok=True)
        out = home / "leg.json"
        env = {**os.environ, "KAPPA_HOME": str(home), "KAPPA_LAKE_URI": str(home / "lake"),
               "KAPPA_TOPIC_PREFIX": f"sql{stamp}-", "KAPPA_KAFKA_BOOTSTRAP": settings.kafka_bootstrap}
        subprocess.run([sys.executable, "-m", "kappa.front.bench_sql", "leg", "--leg-out", str(out),
                        "--rate", str(args.rate), "--warm", str(args.warm), "--window", str(args.window),
                        "--points", str(args.points)], env=env, cwd=ROOT, check=True)
        result = json.loads(out.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-sql.json").write_text(json.dumps(result, indent=2))
        _plot(result, args.out / "bench-sql.png")
        _print(result)
        print(f"bench-sql: {args.out / 'bench-sql.json'}, {args.out / 'bench-sql.png'}")
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()

"""An analyst's load on the SQL service, run as a script by the analysts' venv (``.cache/analyst-venv``: pyspark-client
and PyHive, nothing of the platform): ``python loadgen.py jdbc|connect HOST PORT TOKEN SQL [--repeat N]
[--until EPOCH]`` opens one session, times the connection and the first answer, then runs ``SQL`` again ``--repeat``
times (or until ``--until``) and prints one JSON object: ``connect_s``, ``first_s``, ``latencies_s``, ``rows``.

Used by :mod:`kappa.front.bench_sql`.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("jdbc", "connect"))
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("token")
    parser.add_argument("sql")
    parser.add_argument("--repeat", type=int, default=0)
    parser.add_argument("--until", type=float, default=0.0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.kind == "jdbc":
        from pyhive import hive

        cursor = hive.connect(host=args.host, port=args.port, username="loadgen", password=args.token,
                              auth="CUSTOM").cursor()

        def run() -> list:
            cursor.execute(args.sql)
            return cursor.fetchall()
    else:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.remote(f"sc://{args.host}:{args.port}/;token={args.token}").create()

        def run() -> list:
            return spark.sql(args.sql).collect()
    connected = time.perf_counter()
    rows = run()
    first = time.perf_counter()
    latencies = []
    while len(latencies) < args.repeat or (args.until and time.time() < args.until):
        began = time.perf_counter()
        rows = run()
        latencies.append(time.perf_counter() - began)
    print(json.dumps({"connect_s": connected - t0, "first_s": first - t0, "latencies_s": latencies,
                      "rows": len(rows)}))


if __name__ == "__main__":
    main()

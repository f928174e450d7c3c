"""An analyst's client of the SQL service, run by ``.cache/analyst-venv``'s Python (pyspark-client and PyHive from
``infra/local/requirements-analyst.lock``; nothing of the platform is importable there).

``python sql_client.py jdbc|connect HOST PORT TOKEN`` opens ONE session, prints ``{"ready": true}`` (or
``{"error": ...}`` and exits when the service refuses it), then answers each stdin line - ``{"sql": "..."}`` or
``{"op": "<name>", ...}`` - with one JSON line: ``{"rows": [...]}`` or ``{"error": "..."}``. :class:`Client` is the
tests' side of it (the platform's venv).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _connect(host: str, port: int, token: str):
    from pyspark.sql import SparkSession
    from pyspark.sql.functions import udf

    spark = SparkSession.builder.remote(f"sc://{host}:{port}/;token={token}").create()
    spark.sql("SELECT 1").collect()  # the session really opens (a wrong token fails here)

    def add_artifact(_req):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
            fh.write("X = 1\n")
        spark.addArtifacts(fh.name, pyfile=True)
        return []

    ops = {
        "write": lambda req: spark.range(3).write.format("delta").mode("append").save(req["path"]) or [],
        "read_file": lambda req: [list(r) for r in spark.read.text(req["path"]).collect()],
        "python_udf": lambda req: [list(r) for r in
                                   spark.range(3).select(udf(lambda x: x + 1, "long")("id")).collect()],
        "token_conf": lambda req: [[spark.conf.get("spark.connect.authenticate.token", None)]],
        "add_artifact": add_artifact,
    }
    return (lambda sql: [list(r) for r in spark.sql(sql).collect()]), ops


def _jdbc(host: str, port: int, token: str):
    from pyhive import hive

    cursor = hive.connect(host=host, port=port, username="analyst", password=token, auth="CUSTOM").cursor()

    def run(sql: str) -> list[list]:
        cursor.execute(sql)
        return [list(r) for r in cursor.fetchall()] if cursor.description else []

    return run, {}


class Client:
    """One open session of ``tests/sql_client.py`` in the analyst venv."""

    def __init__(self, python: Path, kind: str, port: int, token: str) -> None:
        host = "localhost" if kind == "connect" else "127.0.0.1"  # Connect sends a token in clear only to localhost
        self.proc = subprocess.Popen([str(python), str(HERE), kind, host, str(port),
                                      token], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self.opened = json.loads(self.proc.stdout.readline() or '{"error": "the client exited"}')

    def ask(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def rows(self, sql: str) -> list[list[Any]]:
        answer = self.ask(sql=sql)
        assert "rows" in answer, f"{sql}: {answer}"
        return answer["rows"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def main() -> None:
    kind, host, port, token = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    try:
        run, ops = (_jdbc if kind == "jdbc" else _connect)(host, port, token)
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:3000]}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = {"rows": run(req["sql"]) if "sql" in req else ops[req["op"]](req)}
        except Exception as exc:  # noqa: BLE001 - each statement's error is its answer
            out = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
        print(json.dumps(out, default=str), flush=True)


if __name__ == "__main__":
    main()

"""A local driver's Hadoop starts no process per file (``kappa.runtime.spark.forkless_fs``, kappa/runtime/java).

Without Hadoop's native library its local file system runs ``chmod`` for each file it creates and ``readlink``
for each link check: 20 processes for each micro-batch of a query that does nothing. The sessions the platform builds use the classes of
``make setup``'s ``kappa-hadoop.jar`` instead. The test runs a stateful streaming query (RocksDB state store,
checkpoint logs) writing a Delta table through delta-spark in a session of its own, with ``chmod`` and
``readlink`` on the JVM's ``PATH`` replaced by scripts that note each call and run the real command (a spy: the
real command still does the work), once as the platform builds sessions and once with ``KAPPA_SPARK_FORKLESS_FS``
off - Hadoop's own, which must be seen spawning them (else the spy proves nothing). What the session's start runs
(Spark makes each jar it adds executable with ``chmod a+x``, once per JVM) is not counted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kappa.config import Settings
from kappa.runtime.spark import forkless_fs

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

_WORKLOAD = """
import json, sys
from pathlib import Path
from pyspark.sql import functions as F
from kappa.config import Settings
from kappa.runtime.spark import build_spark

work = Path(sys.argv[1])
spark = build_spark("forkless-test", Settings.from_env())
spark.range(1).count()
(work / "spawned.log").unlink(missing_ok=True)  # the session's start (Spark's chmod a+x of each added jar) is not counted
conf = spark.sparkContext._jsc.hadoopConfiguration()
uri = spark.sparkContext._jvm.java.net.URI("file:///")
fs = spark.sparkContext._jvm.org.apache.hadoop.fs.FileSystem.get(uri, conf)
fc = spark.sparkContext._jvm.org.apache.hadoop.fs.FileContext.getFileContext(uri, conf)
inbox = work / "inbox"
inbox.mkdir()
schema = "user STRING, ts TIMESTAMP"
counts = (spark.readStream.schema(schema).json(str(inbox)).withWatermark("ts", "10 seconds")
          .groupBy("user", F.window("ts", "5 seconds")).count())

def write(batch, batch_id):
    batch.select("user", F.col("window.start").alias("start"), "count").write.format("delta") \\
        .mode("append").option("txnAppId", "forkless-test").option("txnVersion", batch_id).save(str(work / "table"))

for n in range(3):  # three micro-batches, each its offset and commit log files, state store files and a Delta commit
    (inbox / f"{n}.json").write_text("\\n".join(json.dumps({"user": f"u{i % 3}", "ts": f"2026-01-01T00:00:{n * 5 + i:02d}"})
                                               for i in range(5)))
    query = (counts.writeStream.outputMode("update").foreachBatch(write).trigger(availableNow=True)
             .option("checkpointLocation", str(work / "checkpoint")).start())
    query.awaitTermination(120)
rows = spark.read.format("delta").load(str(work / "table")).agg(F.sum("count")).collect()[0][0]
print(json.dumps({"fs": fs.getClass().getName(), "fc": fc.getDefaultFileSystem().getClass().getName(),
                  "rows": rows}))
"""


def _spy(folder: Path, log: Path) -> Path:
    """``chmod`` and ``readlink`` that note their arguments in ``log`` and then run the real command."""
    folder.mkdir()
    for name in ("chmod", "readlink"):
        real = shutil.which(name)
        assert real, f"no {name} on PATH"
        script = folder / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        script.chmod(0o755)
    return folder


def _run(tmp_path: Path, name: str, forkless: bool) -> tuple[dict, list[str], Path]:
    work = tmp_path / name
    work.mkdir()
    log = work / "spawned.log"
    spy = _spy(work / "bin", log)
    env = {**os.environ, "KAPPA_HOME": str(work / "home"), "KAPPA_SPARK_FORKLESS_FS": str(forkless).lower(),
           "KAPPA_SPARK_LOG_FILE": str(work / "spark.log"), "PATH": f"{spy}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-c", _WORKLOAD, str(work)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    spawned = log.read_text().splitlines() if log.exists() else []
    return result, spawned, work


@pytest.mark.timeout(600)
def test_micro_batches_of_a_platform_session_start_no_chmod_or_readlink(tmp_path):
    ours, spawned, work = _run(tmp_path, "forkless", forkless=True)
    hadoops, hadoop_spawned, hadoop_work = _run(tmp_path, "hadoop", forkless=False)

    assert ours["fs"] == "kappa.hadoop.ForklessLocalFileSystem", ours
    assert ours["fc"] == "kappa.hadoop.ForklessLocalFs", ours
    # off: whatever the jars register for file:// (Hive's ProxyLocalFileSystem over Hadoop's, from pyspark's jars)
    assert not hadoops["fs"].startswith("kappa.") and hadoops["fc"] == "org.apache.hadoop.fs.local.LocalFs", hadoops
    # the same answer both ways: 15 records counted once each
    assert ours["rows"] == hadoops["rows"] == 15, (ours, hadoops)
    # Hadoop's own file system ran both commands for these files (the spy sees them), the platform's none
    assert any(line.startswith("chmod ") for line in hadoop_spawned), hadoop_spawned[:5]
    assert any(line.startswith("readlink ") for line in hadoop_spawned), hadoop_spawned[:5]
    assert spawned == [], spawned[:10]
    # the permissions Hadoop asks for are the files' all the same (its umask 022: 0644 files, 0755 folders)
    for folder in (work, hadoop_work):
        offsets = sorted((folder / "checkpoint" / "offsets").glob("[0-9]*"))
        assert offsets, list((folder / "checkpoint").iterdir())
        assert {stat.S_IMODE(p.stat().st_mode) for p in offsets} == {0o644}, folder
        assert stat.S_IMODE((folder / "checkpoint" / "offsets").stat().st_mode) == 0o755


def test_only_a_local_driver_with_the_jar_gets_it(tmp_path):
    settings = Settings.from_env()
    conf = forkless_fs(settings, "local[2]")
    jar = Path(conf["spark.driver.extraClassPath"])
    assert jar.is_file() and jar.parent.name == "hadoop", conf
    assert conf["spark.hadoop.fs.file.impl"] == "kappa.hadoop.ForklessLocalFileSystem"
    # executors in other JVMs would not have the classes; off when asked; nothing before make setup built the jar
    assert forkless_fs(settings, "k8s://https://kubernetes.default.svc") == {}
    assert forkless_fs(Settings.from_env({"KAPPA_SPARK_FORKLESS_FS": "false"}), "local[2]") == {}
    assert forkless_fs(Settings.from_env({"KAPPA_REPO_ROOT": str(tmp_path)}), "local[2]") == {}

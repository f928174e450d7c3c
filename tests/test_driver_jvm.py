"""The options a driver JVM of the platform runs with (``kappa.runtime.spark.build_spark``), read back from the
running JVM itself (``HotSpotDiagnosticMXBean``), not from the configuration that asked for them.

What the heap's footprint settings and the native heap's trim are worth is measured by ``make bench-live``
(docs/performance.md); here: every session the platform builds runs with them, and ``KAPPA_SPARK_HEAP_FOOTPRINT=false``
and ``KAPPA_SPARK_TRIM_SECONDS=0`` leave the JVM's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kappa.runtime.spark import PARALLEL_GC_FOOTPRINT

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

FLAGS = ("UseParallelGC", "GCTimeRatio", "MinHeapFreeRatio", "MaxHeapFreeRatio", "AdaptiveSizePolicyWeight",
         "ThreadStackSize", "MaxHeapSize", "TrimNativeHeapInterval")

_READ = """
import json
from kappa.config import Settings
from kappa.runtime.spark import build_spark
spark = build_spark("jvm-options-test", Settings.from_env())
print(json.dumps(__import__("tests.test_driver_jvm", fromlist=["vm_flags"]).vm_flags(spark)))
"""


def vm_flags(spark) -> dict[str, str]:
    """The running driver JVM's value of each of :data:`FLAGS`."""
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    return {name: str(bean.getVMOption(name).getValue()) for name in FLAGS}


def _expected(options) -> dict[str, str]:
    return dict(option.removeprefix("-XX:").split("=") for option in options)


def test_a_platform_driver_keeps_its_heap_near_what_it_holds(spark):
    flags = vm_flags(spark)
    assert flags["UseParallelGC"] == "true", flags
    assert {k: flags[k] for k in _expected(PARALLEL_GC_FOOTPRINT)} == _expected(PARALLEL_GC_FOOTPRINT), flags
    assert flags["ThreadStackSize"] == "8192", flags  # -Xss8m (a failed foreachBatch's traceback, see build_spark)
    assert int(flags["MaxHeapSize"]) == 2**30, flags  # the heap's maximum is still the session's driver memory
    assert flags["TrimNativeHeapInterval"] == "10000", flags  # KAPPA_SPARK_TRIM_SECONDS' default, in milliseconds


@pytest.mark.timeout(300)
def test_the_footprint_settings_can_be_turned_off(tmp_path):
    env = {**os.environ, "KAPPA_SPARK_HEAP_FOOTPRINT": "false", "KAPPA_SPARK_TRIM_SECONDS": "0",
           "KAPPA_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-c", _READ], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flags = json.loads(proc.stdout.strip().splitlines()[-1])
    # the parallel collector's own defaults: 1 % of the time collecting, free ratios 0-100 (no bound)
    assert (flags["UseParallelGC"], flags["GCTimeRatio"]) == ("true", "99"), flags
    assert flags["MaxHeapFreeRatio"] == "100", flags
    assert flags["TrimNativeHeapInterval"] == "0", flags  # the JVM's default: its C heap never trimmed


def _count_by_key(spark, source: Path, checkpoint: Path) -> list[list[tuple[int, int]]]:
    """Run a stateful query (``count(*)`` by ``k`` over the parquet files in ``source``) to the end of its input
    from ``checkpoint``: the rows of each of its micro-batches."""
    batches: list[list[tuple[int, int]]] = []
    counts = spark.readStream.schema("id long, k long").parquet(str(source)).groupBy("k").count()
    query = (counts.writeStream.outputMode("update").option("checkpointLocation", str(checkpoint))
             .foreachBatch(lambda frame, _: batches.append(sorted(tuple(r) for r in frame.collect())))
             .trigger(availableNow=True).start())
    query.awaitTermination(240)
    return batches


def _rocksdb_instances(spark, bounded: bool) -> int:
    """State stores of this JVM registered with RocksDB's memory manager under the shared bound (or not)."""
    package = spark.sparkContext._jvm.org.apache.spark.sql.execution.streaming.state
    manager = getattr(getattr(package, "RocksDBMemoryManager$"), "MODULE$")
    return int(manager.getNumRocksDBInstances(bounded))


@pytest.mark.timeout(300)
def test_state_stores_share_one_memory_budget_and_write_zstd_changelogs(spark, tmp_path):
    """A stateful query of a platform session opens its RocksDB stores under the one bound of
    ``KAPPA_STATE_MEMORY_MB`` (a store outside it has memtables of its own: 64 MiB each, see build_spark), and
    writes its changelogs in zstd."""
    from pyspark.sql import functions as F

    assert spark.conf.get("spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB") == "128"
    source = tmp_path / "in"
    spark.range(200).withColumn("k", F.col("id") % 7).write.parquet(str(source))
    seen = [len(rows) for rows in _count_by_key(spark, source, tmp_path / "cp")]
    assert seen == [7], seen  # the query ran its one batch through the store
    assert _rocksdb_instances(spark, True) >= 1
    assert _rocksdb_instances(spark, False) == 0
    # its changelog is zstd (frame magic 28 b5 2f fd), not lz4-java's blocks ("LZ4Block")
    changelogs = sorted((tmp_path / "cp" / "state").rglob("*.changelog"))
    assert changelogs, sorted((tmp_path / "cp").rglob("*"))
    assert {path.read_bytes()[:4] for path in changelogs} == {bytes.fromhex("28b52ffd")}


@pytest.mark.timeout(300)
def test_a_checkpoint_started_in_lz4_keeps_its_codec(spark, tmp_path):
    """A stateful view's checkpoint written before the platform turned to zstd (Spark's default codec, lz4) goes on
    after the upgrade: its state is read back (the counts carry on) and its new changelogs stay lz4, the codec its
    offsets recorded."""
    from pyspark.sql import functions as F

    key = "spark.sql.streaming.stateStore.compression.codec"
    source, checkpoint = tmp_path / "in", tmp_path / "cp"

    def run() -> list[tuple[int, int]]:
        return sorted(row for rows in _count_by_key(spark, source, checkpoint) for row in rows)

    assert spark.conf.get(key) == "zstd"
    spark.range(30).withColumn("k", F.col("id") % 3).write.parquet(str(source))
    spark.conf.set(key, "lz4")
    try:
        assert run() == [(0, 10), (1, 10), (2, 10)]
    finally:
        spark.conf.set(key, "zstd")
    spark.range(30, 36).withColumn("k", F.col("id") % 3).write.mode("append").parquet(str(source))
    assert run() == [(0, 12), (1, 12), (2, 12)]  # the state written in lz4, read back and carried on
    assert {p.read_bytes()[:8] for p in (checkpoint / "state").rglob("*.changelog")} == {b"LZ4Block"}

"""A class-data sharing (AppCDS) archive for Spark driver JVMs: faster starts of every view job.

A driver JVM spends most of its start loading and verifying ~20,000 classes (Spark, Scala, Delta, the Kafka
connector). A dynamic CDS archive (JDK 13+) holds them pre-parsed and pre-verified; a JVM started with
``-XX:SharedArchiveFile`` maps it instead. Measured on two cores: a SparkSession up in 2.7 s instead of 4.3 s and
a session plus its first Delta write and read in 8 s instead of 11.5 s; a view driver catching up 2,000 events
(start to exit) in 24 s instead of 29 s - paid at every start of a view job, a replay, a verification, and at every
restart after a crash.

``make setup`` builds the archive once (``python -m kappa.runtime.cds``: a driver runs a small workload touching
the classes a view job uses - Delta writes, MERGE, the change feed, a stateful stream on RocksDB, the Kafka
source - and dumps what it loaded at exit). :func:`java_options` adds it to a driver's options when it exists.
A JVM whose build or class path does not match the archive ignores it (``-Xshare:auto``) and starts as before;
``KAPPA_SPARK_CDS=false`` turns it off. A *truncated* archive is not detected that way (the JVM dies mapping it),
so the archive is written beside its destination and renamed into place only once complete.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from kappa.config import Settings

__all__ = ["archive_path", "build_archive", "java_options"]

#: quiet: a JVM mapping (or dumping) the archive reports each class it skips on stdout otherwise
_QUIET = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")


def archive_path(jars_dir: Path) -> Path:
    """Where ``make setup`` puts the archive: ``<jars>/cds/spark-driver.jsa``."""
    return Path(jars_dir) / "cds" / "spark-driver.jsa"


def java_options(settings: Settings) -> list[str]:
    """JVM options that map the archive, or none if it was not built or ``KAPPA_SPARK_CDS`` is off."""
    archive = archive_path(settings.jars_dir)
    if not settings.spark_cds or not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}", "-Xshare:auto", *_QUIET]


def _workload(spark, work: Path) -> None:
    """Touch what a view job's driver loads: Delta (CDF on) write, MERGE, history, the change feed, a stateful
    streaming query with a RocksDB state store writing Delta in foreachBatch, the Kafka source's planning."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    table = str(work / "t")
    (spark.range(200).withColumn("k", F.col("id") % 7)
     .write.format("delta").option("delta.enableChangeDataFeed", "true").save(table))
    target = DeltaTable.forPath(spark, table)
    updates = spark.range(100, 300).withColumn("k", F.col("id") % 5)
    (target.alias("t").merge(updates.alias("s"), "t.id = s.id")
     .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())
    target.history().collect()
    spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 0).load(table).count()
    spark.read.format("delta").load(table).groupBy("k").agg(F.count("*"), F.max("id")).collect()

    sink = str(work / "windows")
    spark.createDataFrame([], "window_start timestamp, k long, n long").write.format("delta").save(sink)

    def merge(batch, batch_id: int) -> None:
        (DeltaTable.forPath(spark, sink).alias("t")
         .merge(batch.alias("s"), "t.window_start = s.window_start AND t.k = s.k")
         .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())

    source = str(work / "source")
    for part in range(3):  # three files, one micro-batch each
        (spark.range(part * 100, part * 100 + 100).selectExpr("id", "timestamp_millis(id * 100) AS ts")
         .write.mode("append").parquet(source))
    stream = (spark.readStream.schema("id long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(source)
              .withWatermark("ts", "1 second")
              .groupBy(F.window("ts", "1 second").start.alias("window_start"), (F.col("id") % 3).alias("k"))
              .agg(F.count("*").alias("n")))
    (stream.writeStream.foreachBatch(merge).outputMode("update").option("checkpointLocation", str(work / "ckpt"))
     .trigger(availableNow=True).start().awaitTermination())
    (spark.readStream.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9")
     .option("subscribe", "none").load().selectExpr("CAST(value AS STRING)").schema)


def build_archive(destination: Path) -> Path:
    """Run the workload in a driver JVM that dumps its loaded classes at exit; the archive lands atomically."""
    from kappa.runtime.spark import build_spark

    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kappa-cds-"))
    try:
        settings = Settings.from_env().replace(home=work)
        spark = build_spark("kappa-cds", settings, cds_options=[f"-XX:ArchiveClassesAtExit={partial}", *_QUIET])
        _workload(spark, work)
        gateway = spark.sparkContext._gateway
        spark.stop()
        proc = getattr(gateway, "proc", None)
        gateway.shutdown()
        if proc is not None:  # the JVM exits when its stdin closes and writes the archive on the way out
            proc.stdin.close()
            proc.wait(timeout=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not partial.is_file():
        raise RuntimeError(f"the driver JVM wrote no archive to {partial}")
    partial.replace(destination)
    return destination


if __name__ == "__main__":  # python -m kappa.runtime.cds [DESTINATION]
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else archive_path(Settings.from_env().jars_dir)
    built = build_archive(target)
    print(f"cds: {built} ({built.stat().st_size // (1 << 20)} MiB)")

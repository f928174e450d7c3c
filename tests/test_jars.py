"""The JVM jars make setup fetched: broker main classes present, Spark connector jars consistent with pyspark."""

from __future__ import annotations

import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from kappa.config import Settings
from kappa.versions import read_versions

JARS = Settings.from_env().jars_dir


def _pyspark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "jars"


def _artifact(jar: str) -> str:
    return re.split(r"-\d", jar, maxsplit=1)[0]


def test_broker_jars() -> None:
    v = read_versions()
    broker = JARS / "broker"
    assert broker.is_dir(), "run `make setup`"
    kafka_jar = broker / f"kafka_{v['SCALA_BINARY']}-{v['KAFKA_VERSION']}.jar"
    with zipfile.ZipFile(kafka_jar) as z:
        names = set(z.namelist())
    assert {"kafka/Kafka.class", "kafka/tools/StorageTool.class"} <= names
    jars = {p.name for p in broker.glob("*.jar")}
    assert any(j.startswith("log4j-slf4j-impl-") for j in jars) and any(j.startswith("log4j-core-") for j in jars)


def test_spark_jars_complement_pyspark() -> None:
    v = read_versions()
    spark = {p.name for p in (JARS / "spark").glob("*.jar")}
    for want in (f"spark-sql-kafka-0-10_{v['SCALA_BINARY']}-{v['SPARK_VERSION']}.jar",
                 f"{v['DELTA_SPARK_ARTIFACT']}-{v['DELTA_VERSION']}.jar", f"delta-storage-{v['DELTA_VERSION']}.jar"):
        assert want in spark
    assert any(j.startswith("kafka-clients-") for j in spark) and any(j.startswith("commons-pool2-") for j in spark)
    shipped = {_artifact(p.name) for p in _pyspark_jars().glob("*.jar")}
    dupes = sorted(j for j in spark if _artifact(j) in shipped)
    assert not dupes, f"already in pyspark/jars: {dupes}"


@pytest.mark.skipif(shutil.which("javap") is None, reason="javap (JDK) not on PATH")
def test_token_provider_has_what_spark_sql_kafka_calls(tmp_path: Path) -> None:
    """spark-token-provider-kafka is pinned on its own (see infra/versions.env; an older release stood in while
    Central lacked the matching one): every member of org.apache.spark.kafka010 that spark-sql-kafka references
    must exist there with the same descriptor."""
    v = read_versions()
    spark = JARS / "spark"
    sqlk = spark / f"spark-sql-kafka-0-10_{v['SCALA_BINARY']}-{v['SPARK_VERSION']}.jar"
    token = next(spark.glob("spark-token-provider-kafka-0-10_*.jar"))
    with zipfile.ZipFile(sqlk) as z:  # only classes whose constant pool mentions the package
        classes = [n[:-6].replace("/", ".") for n in z.namelist()
                   if n.endswith(".class") and b"org/apache/spark/kafka010/" in z.read(n)]
    out = subprocess.run(["javap", "-v", "-cp", str(sqlk), *classes], capture_output=True, text=True, check=True).stdout
    refs = set(re.findall(r"// (?:Method|Field|InterfaceMethod) (org/apache/spark/kafka010/\S+)", out))
    assert refs, "expected references into org.apache.spark.kafka010"
    by_class: dict[str, set[tuple[str, str]]] = {}
    for ref in refs:
        cls, member = ref.split(".", 1)
        name, desc = (member[1:].split('":', 1) if member.startswith('"') else member.split(":", 1))
        by_class.setdefault(cls.replace("/", "."), set()).add((name, desc))
    missing = []
    for cls, members in by_class.items():
        listing = subprocess.run(["javap", "-s", "-p", "-cp", str(token), cls], capture_output=True, text=True)
        assert listing.returncode == 0, f"{cls} missing from {token.name}"
        lines = listing.stdout.splitlines()
        have = set()
        for i, line in enumerate(lines):
            if line.strip().startswith("descriptor:") and i > 0:
                decl = lines[i - 1]
                m = re.search(r"([\w$]+)\(", decl)
                name = m.group(1) if m else decl.strip().rstrip(";").split()[-1]
                if name == cls.rsplit(".", 1)[-1]:  # constructor
                    name = "<init>"
                have.add((name, line.split(":", 1)[1].strip()))
        missing += [f"{cls}.{n}{d}" for n, d in members if (n, d) not in have]
    assert not missing, f"{token.name} lacks: {missing}"


def test_driver_jvms_map_the_class_data_archive(spark, tmp_path: Path) -> None:
    """make setup built the drivers' class-data archive; the platform's sessions map it, and a JVM that must map
    it (-Xshare:on: no archive, no JVM) starts and runs a job with it."""
    import sys

    from kappa.runtime.cds import archive_path

    archive = archive_path(JARS)
    assert archive.is_file(), "run `make setup`"
    jvm = spark.sparkContext._jvm
    hotspot = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    assert hotspot.getVMOption("SharedArchiveFile").getValue() == str(archive)
    script = ("import sys\nfrom kappa.config import Settings\nfrom kappa.runtime.spark import build_spark\n"
              "s = build_spark('cds', Settings.from_env().replace(home=sys.argv[2]),"
              " cds_options=['-XX:SharedArchiveFile=' + sys.argv[1], '-Xshare:on'])\n"
              "print('rows', s.range(7).count())\n")
    run = subprocess.run([sys.executable, "-c", script, str(archive), str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "rows 7" in run.stdout, run.stderr[-2000:]


def test_a_killed_driver_s_scratch_files_are_removed_by_the_next_one(spark, tmp_path: Path) -> None:
    """A SIGKILLed driver JVM never runs Spark's shutdown hook, which removes its temporary folders (the jars its
    tasks use, block manager files): the platform's drivers keep them in a folder of their own process, and the next
    driver removes the folders of processes that are gone."""
    import os
    import signal
    import sys
    import time

    from kappa.runtime.spark import scratch_dir

    jvm = spark.sparkContext._jvm
    assert jvm.java.lang.System.getProperty("java.io.tmpdir") == spark.conf.get("spark.local.dir") == scratch_dir()
    script = ("import os, signal, sys\nfrom kappa.config import Settings\nfrom kappa.runtime.spark import build_spark\n"
              "s = build_spark('killed', Settings.from_env().replace(home=sys.argv[1]))\n"
              "print(s.conf.get('spark.local.dir'), s.range(7).count(), flush=True)\n"
              "os.killpg(0, signal.SIGKILL)\n")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    left, rows = run.stdout.split()
    assert rows == "7" and Path(left).name != str(os.getpid())
    assert any(Path(left).rglob("*.jar")), "the killed driver left its task jars behind"
    old = time.time() - 120
    os.utime(left, (old, old))
    scratch_dir()  # what the next driver of this machine does first
    assert not Path(left).exists()
    assert Path(scratch_dir()).is_dir()  # this process' own stays

"""SparkSession factory for view jobs, verification and tests.

Every JVM artifact comes from ``.cache/jars/spark`` (fetched by ``make setup`` with Maven); Spark is never
asked to resolve packages from a repository at run time (no ``spark.jars.packages``).

A lake on an S3-API object store (``KAPPA_LAKE_URI=s3a://<bucket>/<prefix>``) adds ``.cache/jars/s3a`` (hadoop-aws
and the AWS SDK modules it uses) and takes the store from the standard AWS environment every other reader of the
lake uses too (delta-rs, DuckDB's reads through it, pyarrow): ``AWS_ENDPOINT_URL`` (a store other than AWS:
path-style requests, TLS as its scheme says), ``AWS_REGION``; the credentials stay in the environment, where
S3A's default provider chain reads them (they never enter the Spark conf, which the UI and logs show).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeVar

from kappa.errors import KappaError
from kappa.runtime import cds

if TYPE_CHECKING:  # pragma: no cover - typing only
    from pyspark.sql import DataFrame, SparkSession

    from kappa.config import Settings

__all__ = ["HadoopFiles", "MissingJarsError", "build_spark", "computed_once", "end_jvm", "forkless_fs", "forkless_jar",
           "jvm_class", "jvm_output_to_logging", "per_jvm", "s3a_conf", "spark_jars", "view_shuffle_partitions"]

T = TypeVar("T")


class MissingJarsError(KappaError, RuntimeError):
    """The Spark connector/Delta jars have not been fetched (run ``make setup``)."""


_REQUIRED = ("spark-sql-kafka-0-10", "delta-spark", "delta-storage", "kafka-clients")


def spark_jars(jars_dir: Path, *, s3a: bool = False) -> list[str]:
    """Return the local jar files Spark needs and the S3A filesystem's when fetched (loaded only when an ``s3a://``
    path is opened), failing with a one-line hint if any is missing (the S3A ones only with ``s3a``)."""
    spark_dir = Path(jars_dir) / "spark"
    jars = sorted(str(p) for p in spark_dir.glob("*.jar"))
    missing = [name for name in _REQUIRED if not any(Path(j).name.startswith(name) for j in jars)]
    if missing:
        raise MissingJarsError(f"missing Spark jars {missing} in {spark_dir}: run `make setup` first")
    jars += sorted(str(p) for p in (Path(jars_dir) / "s3a").glob("*.jar"))
    if s3a and not any(Path(j).name.startswith("hadoop-aws-") for j in jars):
        raise MissingJarsError(f"an s3a:// lake needs hadoop-aws, not in {Path(jars_dir) / 's3a'}: run `make setup` "
                               "first")
    return jars


def forkless_jar(settings: "Settings") -> Path:
    """Where ``make setup`` (and the view-job image) puts Hadoop's local file system without a process per file
    operation and the plan-metrics helper of :mod:`kappa.runtime.late` (kappa/runtime/java):
    ``<jars>/hadoop/kappa-hadoop.jar``."""
    return Path(settings.jars_dir) / "hadoop" / "kappa-hadoop.jar"


def forkless_fs(settings: "Settings", master: str) -> dict[str, str]:
    """Spark settings that give a local driver's Hadoop a local file system that starts no process per file.

    Without Hadoop's native library (pyspark ships none) its local file system runs ``chmod`` for the permission of
    every file it creates and ``readlink`` to learn whether a path is a link, several times for each checkpoint,
    state-store and Delta log file: 20 processes for each micro-batch of a query that does nothing (16 ``readlink``,
    4 ``chmod``; more with state and Delta commits), each one started by the driver JVM.
    ``kappa.hadoop.ForklessLocalFileSystem`` and ``ForklessLocalFs`` make both a ``java.nio`` call
    (docs/performance.md). Empty - Hadoop's own - when ``KAPPA_SPARK_FORKLESS_FS`` is off, for a
    master that is not local (executors elsewhere would lack the classes) or before ``make setup`` built the jar.
    The jar goes on the JVM's own class path: Hadoop loads ``fs.file.impl`` before ``spark.jars`` are there.
    """
    jar = forkless_jar(settings)
    if not settings.spark_forkless_fs or not master.startswith("local") or not jar.is_file():
        return {}
    return {"spark.driver.extraClassPath": str(jar),
            "spark.hadoop.fs.file.impl": "kappa.hadoop.ForklessLocalFileSystem",
            "spark.hadoop.fs.AbstractFileSystem.file.impl": "kappa.hadoop.ForklessLocalFs"}


def s3a_conf(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Spark settings of the S3A filesystem from the standard AWS environment (``AWS_ENDPOINT_URL[_S3]``,
    ``AWS_REGION``/``AWS_DEFAULT_REGION``); empty for AWS itself with no region set (S3A's defaults apply).

    >>> conf = s3a_conf({"AWS_ENDPOINT_URL": "http://127.0.0.1:8333", "AWS_REGION": "us-east-1"})
    >>> conf["spark.hadoop.fs.s3a.connection.ssl.enabled"], conf["spark.hadoop.fs.s3a.endpoint.region"]
    ('false', 'us-east-1')
    """
    from kappa.config import aws_endpoint

    env = os.environ if env is None else env
    conf: dict[str, str] = {}
    endpoint = aws_endpoint(env)
    if endpoint:
        conf["spark.hadoop.fs.s3a.endpoint"] = endpoint
        conf["spark.hadoop.fs.s3a.path.style.access"] = "true"
        conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(endpoint.startswith("https:")).lower()
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = region
    return conf


def view_shuffle_partitions(settings: "Settings") -> int | None:
    """Shuffle partitions of a session that runs views' streaming queries (the view host, a view's driver):
    ``$KAPPA_SHUFFLE_PARTITIONS`` when set, else one on a ``local[N]`` master, else None (:func:`build_spark`'s
    default).

    A stateful query keeps the count of its first micro-batch for good: it is the number of its state stores, and
    every stage after a shuffle runs one task per partition in every micro-batch. A live micro-batch of a few
    hundred records gains nothing from a second task on a machine of a few cores and pays its fixed cost (task
    serialization, a state store commit, generated code per task): one partition cut ``campaign_window_counts``'
    CPU per live micro-batch by about a quarter at 200 events/s, and replays of 300,000 events ran as fast with
    one as with two (docs/performance.md). The read of the log stays parallel (one task per Kafka partition, more
    for big batches: ``maxRecordsPerPartition``). A cluster master keeps the default: executors on several nodes
    share the state stores only when there are several."""
    if settings.shuffle_partitions:
        return settings.shuffle_partitions
    return 1 if _local_cores(settings.spark_master) is not None else None


def _local_cores(master: str) -> int | None:
    """Task slots of a ``local``/``local[N]``/``local[*]`` master (None for a cluster master)."""
    if master == "local":
        return 1
    if master.startswith("local[") and master.endswith("]"):
        spec = master[len("local["):-1].split(",")[0]
        return (os.cpu_count() or 1) if spec == "*" else int(spec)
    return None


#: A Spark log line as log4j's console layout writes it (``yy/MM/dd HH:mm:ss LEVEL Logger: message``).
_SPARK_LINE = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (TRACE|DEBUG|INFO|WARN|ERROR|FATAL) (.*)$")
_SPARK_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
                 "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
#: A line that continues the one before it: a stack frame, a cause, an exception's class line.
_CONTINUED = re.compile(r"^(\s|Caused by:|Suppressed:|[\w.$]+(Exception|Error|Throwable)(:|$))")
#: Whether the JVMs this process starts print into Python logging (:func:`jvm_output_to_logging`).
_TO_LOGGING = threading.Event()


def jvm_output_to_logging() -> None:
    """From now on, a Spark JVM this process starts prints into Python logging - the logger ``spark``, each line at
    the level it names (a stack trace's lines at the level of the line they follow; what the JVM prints itself,
    such as ``WARNING: Using incubator modules``, at INFO) - instead of onto this process' stdout and stderr.

    For Airflow tasks: the task runner logs whatever a task writes to stderr at level *error*, so Spark's warnings
    and notices would read as errors in a task that succeeded. A log file (``KAPPA_SPARK_LOG_FILE``) still wins;
    a JVM already running keeps its output where it is."""
    _TO_LOGGING.set()


def _pump(fd: int) -> None:
    """Log each line read from ``fd`` (the JVM's stdout and stderr) until the JVM closes it."""
    out = logging.getLogger("spark")
    level = logging.INFO
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as lines:
        for raw in lines:
            line = raw.rstrip("\n")
            if not line.strip():
                continue
            found = _SPARK_LINE.match(line)
            if found:
                level, line = _SPARK_LEVELS[found.group(1)], found.group(2)
            elif not _CONTINUED.match(line):
                level = logging.INFO
            out.log(level, "%s", line)


def _launch_into_logging(builder: Any) -> None:
    """Launch the JVM of ``builder``'s session with its stdout and stderr on a pipe whose lines go to Python logging
    (:func:`_pump`), through pyspark's own ``launch_gateway`` (its ``popen_kwargs`` exist for capturing them); the
    session then uses that JVM. Python's own stdout and stderr are untouched (what logging prints there would
    otherwise feed the pipe again)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        conf = SparkConf(loadDefaults=False)
        for key, value in builder._options.items():  # what getOrCreate would pass to spark-submit
            conf.set(key, value)
        reader, writer = os.pipe()
        try:
            gateway = launch_gateway(conf, popen_kwargs={"stdout": writer, "stderr": writer})
        except BaseException:
            os.close(reader)
            raise
        finally:
            os.close(writer)  # the JVM holds its own copy: the reader ends when the JVM does
        threading.Thread(target=_pump, args=(reader,), name="spark-output", daemon=True).start()
        SparkContext._gateway, SparkContext._jvm = gateway, gateway.jvm


@contextlib.contextmanager
def _jvm_output_to(log_file: str | None) -> Iterator[None]:
    """While pyspark starts the JVM, point this process's stdout/stderr at ``log_file`` (the JVM inherits them):
    what the JVM prints itself, before or beside log4j (``WARNING: Using incubator modules``, a crash report),
    goes to the file too. Nothing changes without a log file or when a JVM is already running."""
    from pyspark import SparkContext

    if not log_file or SparkContext._active_spark_context is not None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    target = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = (os.dup(1), os.dup(2))
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def scratch_dir() -> str:
    """This process' folder for its Spark JVM's scratch files (``spark.local.dir``, ``java.io.tmpdir``):
    ``<tmp>/kappa-spark-<uid>/<pid>``; the folders of processes that are gone are removed first.

    Spark removes its temporary folders (the jars it copies for its tasks, ~44 MB, block manager and shuffle
    files) in a shutdown hook, which a SIGKILLed JVM never runs: every driver killed that way (a crash test, the
    OOM killer, a supervisor's restart after one) left them in /tmp for good - 228 of them, 5 GB, on a machine that
    ran the tests for a few days. One folder per driver process makes what a dead one left identifiable."""
    import shutil
    import tempfile
    import time

    from kappa.process import pid_alive

    root = Path(tempfile.gettempdir()) / f"kappa-spark-{os.getuid()}"
    root.mkdir(exist_ok=True)
    for folder in root.iterdir():
        try:
            pid = int(folder.name)
            stale = pid != os.getpid() and not pid_alive(pid) and time.time() - folder.stat().st_mtime > 60
        except (ValueError, OSError):
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
    mine = root / str(os.getpid())
    mine.mkdir(exist_ok=True)
    return str(mine)


#: The parallel collector's heap sized to what it holds (see build_spark); ``KAPPA_SPARK_HEAP_FOOTPRINT=false``
#: leaves it to grow to its maximum.
PARALLEL_GC_FOOTPRINT = ("-XX:MinHeapFreeRatio=20", "-XX:MaxHeapFreeRatio=50", "-XX:GCTimeRatio=19",
                         "-XX:AdaptiveSizePolicyWeight=90")


@functools.lru_cache(maxsize=None)
def _jvm_trims(java: str) -> bool:
    """Whether the JVM ``java`` knows ``-XX:TrimNativeHeapInterval`` (JDK 17.0.9 and later, 21.0.1 and later): an
    older one refuses to start with it."""
    try:
        done = subprocess.run([java, "-XX:TrimNativeHeapInterval=0", "-version"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def trim_options(settings: "Settings") -> list[str]:
    """The JVM option that hands what the C heap holds free back to the system every ``KAPPA_SPARK_TRIM_SECONDS``.

    glibc keeps memory that was freed in its arenas for the next allocation, and it gives back only what lies at an
    arena's top; a driver's native allocations (RocksDB's blocks and iterators, zstd and lz4 buffers, Netty, the
    JVM's own) come and go every micro-batch, so freed memory scattered through the arenas stays resident: ``make
    run``'s view host gave back 185 MiB at one ``jcmd <pid> System.trim_native_heap`` after 27 minutes, and had
    grown 70 MiB again four minutes later. The JVM's periodic trim (``malloc_trim``) is the same call. None when
    it is off or the JVM does not know the option."""
    if settings.spark_trim_seconds <= 0:
        return []
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else (shutil.which("java") or "java")
    if not _jvm_trims(java):
        return []
    return [f"-XX:TrimNativeHeapInterval={int(settings.spark_trim_seconds * 1000)}"]


def build_spark(
    app_name: str,
    settings: "Settings",
    *,
    master: str | None = None,
    shuffle_partitions: int | None = None,
    driver_memory: str = "1g",
    warehouse_dir: str | None = None,
    extra_conf: Mapping[str, str] | None = None,
    cds_options: Sequence[str] | None = None,
    call_sites: bool = False,
) -> "SparkSession":
    """Build (or return the active) SparkSession with Delta and the Kafka connector on the classpath.

    Args:
        app_name: Spark application name (shows in logs and the UI).
        settings: the jars (``.cache/jars``, filled by ``make setup``), the master, the shuffle partitions, the UI and
            the log level (``KAPPA_SPARK_*``, :class:`kappa.config.Settings`).
        master: Spark master; defaults to ``settings.spark_master``.
        shuffle_partitions: shuffle partitions, fixed in a streaming checkpoint at its first batch; default
            ``settings.shuffle_partitions``, else the cores of a ``local[N]`` master (one task per core and stage:
            every extra task of a micro-batch is fixed cost), else 4.
        driver_memory: heap of the local driver JVM.
        warehouse_dir: Spark SQL warehouse (catalog views for analysts live there); default ``<home>/warehouse``.
        extra_conf: additional Spark settings, applied last.
        cds_options: the driver JVM's class-data sharing options; default: map the archive ``make setup`` built
            (:func:`kappa.runtime.cds.java_options`).
        call_sites: PySpark records the Python line of every DataFrame and Column call for its error messages
            (``spark.python.sql.dataFrameDebugging.enabled``): four calls into the JVM and a walk of the Python stack
            for each ``F.col``, ``select`` or ``where``, and a micro-batch makes hundreds - about 3 times the Python
            CPU of building a DataFrame. Off for the platform's drivers; on for a session someone writes code in.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    master = master or settings.spark_master
    if shuffle_partitions is None:
        shuffle_partitions = settings.shuffle_partitions or _local_cores(master) or 4
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # a local driver stays on loopback
    from pyspark.sql import SparkSession

    on_s3a = settings.lake_uri.startswith("s3a://")
    builder = (
        SparkSession.builder.appName(app_name)
        .master(master)
        .config("spark.jars", ",".join(spark_jars(settings.jars_dir, s3a=on_s3a)))
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.default.parallelism", str(shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", str(settings.spark_ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.databricks.delta.snapshotPartitions", "2")
        .config("spark.databricks.delta.properties.defaults.checkpointInterval", "20")
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.sql.adaptive.enabled", "false")
        # RocksDB commits upload the batch's changes, not a snapshot (snapshots in the background); it can be
        # turned on for existing checkpoints
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        # a changelog (every changed key's whole value, each micro-batch) in zstd, whose window spans the blocks
        # that lz4 compresses one by one: user_sessions' sessions (their sets of ad ids) 3.5 MB a batch -> 2.4 MB in
        # lz4, 0.27 MB in zstd. A checkpoint keeps the codec it started with (Spark records it in its offsets)
        .config("spark.sql.streaming.stateStore.compression.codec", "zstd")
        # a micro-batch (stateful plan, stats, Delta MERGE) compiles ~100 generated classes; Spark's cache of
        # them holds 100 by default, so every batch evicted and recompiled them all (~1 s of each batch)
        .config("spark.sql.codegen.cache.maxEntries", "2000")
        .config("spark.python.sql.dataFrameDebugging.enabled", str(call_sites).lower())
    )
    if settings.state_memory_mb > 0:
        # every RocksDB state store of the JVM (one per stateful operator and partition, and per version while a
        # replay runs beside it) in one budget: a shared block cache whose memtables are charged to it, instead of
        # RocksDB's 64 MiB memtables and 8 MiB cache per store; a soft bound (Spark's LRU cache has no strict limit:
        # a store never fails on it). A bound for a JVM of many stores: make run's six views' stores hold little, and
        # it did not lower their host's RSS (docs/performance.md)
        builder = (builder.config("spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage", "true")
                   .config("spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB", str(settings.state_memory_mb)))
    if not settings.spark_ui:
        # Spark's status store keeps the last 1,000 jobs, stages and SQL executions (with their plans' graphs) for
        # the UI and the status tracker; a view host runs several per micro-batch of each view. Without the UI only
        # the jobs in flight are read (kappa.runtime.inflight): keep a few hundred
        for key, value in (("spark.ui.retainedJobs", "200"), ("spark.ui.retainedStages", "200"),
                           ("spark.ui.retainedTasks", "20000"), ("spark.sql.ui.retainedExecutions", "100")):
            builder = builder.config(key, value)
    if master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    # -Xss8m: Spark matches a failed foreachBatch's Python traceback with a recursive regex when a query stops; a
    # long traceback overflows the default 1 MiB thread stack (StackOverflowError in the stream thread).
    # The parallel collector: a driver's garbage is young (each micro-batch's plans, rows and tasks) and nothing reads
    # its pauses but the batch they fall in; G1's concurrent work and write barriers cost more on 2 cores. Two malloc
    # arenas instead of 8 per core for the JVM's native memory (RocksDB, Netty, the compilers' threads). Measured
    # together on make run's view host, side by side: 1.246 -> 1.147 and 1.923 -> 1.693 CPU-s per micro-batch, RSS
    # -214 and -227 MiB (docs/performance.md, "What the jobs' pollers cost"). Micro-batches are not cached (see
    # computed_once): a collector's timing made SPARK-59451's race with cached relations show.
    # Sized to what it holds, not to its maximum: the parallel collector's default goal (1 % of the time collecting,
    # GCTimeRatio 99) grows the heap to -Xmx whatever is live (a view host's ~300-500 MiB in a 1 GiB heap). A looser
    # time goal (5 %) lets the free-ratio bounds keep the heap 20-50 % above what is live; -Xmx stays the ceiling.
    # make run's view host side by side: RSS -210 MiB (heap 812 of 1,024 MiB committed), CPU per micro-batch within
    # noise (collecting 3.1 % of the time against 2.5 %); the tighter recipe (20 % time goal, 40 % free at most)
    # saved 557 MiB for 10 % of the time collecting and 16 % more CPU (docs/performance.md)
    java_options = ["-Xss8m", "-XX:+UseParallelGC", *(PARALLEL_GC_FOOTPRINT if settings.spark_heap_footprint else ()),
                    *trim_options(settings), *(cds.java_options(settings) if cds_options is None else cds_options)]
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # read by the JVM's glibc when it starts (a child of this process)
    if master.startswith("local"):  # a driver and its executors in one JVM: its scratch files in one folder
        scratch = scratch_dir()
        builder = builder.config("spark.local.dir", scratch)
        java_options.append(f"-Djava.io.tmpdir={scratch}")
    warehouse_dir = warehouse_dir or str(Path(settings.home) / "warehouse")
    if warehouse_dir:
        builder = builder.config("spark.sql.warehouse.dir", warehouse_dir)
        java_options.append(f"-Dderby.system.home={warehouse_dir}")
    if settings.spark_log_file:  # the JVM's log into a file (a command's own session), not the terminal
        Path(settings.spark_log_file).parent.mkdir(parents=True, exist_ok=True)
        java_options += [f"-Dlog4j2.configurationFile={Path(__file__).with_name('log4j2-file.properties')}",
                         f"-Dkappa.spark.log={settings.spark_log_file}"]
    builder = builder.config("spark.driver.extraJavaOptions", " ".join(java_options))
    conf = {**(s3a_conf() if on_s3a else {}), **forkless_fs(settings, master)}
    for key, value in (extra_conf or {}).items():
        if key == "spark.driver.extraClassPath" and conf.get(key):  # both on the class path
            value = os.pathsep.join(part for part in (value, conf[key]) if part)
        conf[key] = value
    for key, value in conf.items():
        builder = builder.config(key, value)
    if _TO_LOGGING.is_set() and not settings.spark_log_file:
        _launch_into_logging(builder)
    with _jvm_output_to(settings.spark_log_file):
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(settings.spark_log_level)
    # Delta's MERGE checkpoints its source locally and Spark warns at each unpersist that the lineage is gone:
    # one line per live micro-batch, nothing to act on
    jvm = spark.sparkContext._jvm
    configurator = jvm_class(jvm, "org.apache.logging.log4j.core.config.Configurator")
    error = jvm_class(jvm, "org.apache.logging.log4j.Level").ERROR
    configurator.setLevel("org.apache.spark.rdd.MapPartitionsRDD", error)
    # "Current batch is falling behind" at every slow micro-batch: the job says it once when it starts and once
    # when it ends, with the gauge kappa_falling_behind (kappa.runtime.job._Pace)
    configurator.setLevel("org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor", error)
    # at the JVM's exit Spark removes its scratch folders with `rm -rf`, and a stop that signals the process group
    # can end that `rm` first: a WARN with a stack trace, then the same folders removed through Java (a failure of
    # that is still logged, at ERROR, by the caller)
    configurator.setLevel("org.apache.spark.network.util.JavaUtils", error)
    # py4j logs each gateway connection it closes at INFO, also while the interpreter shuts down (when a
    # configured handler's stream may be closed already): keep it to warnings
    logging.getLogger("py4j").setLevel(logging.WARNING)
    return spark


class _InterruptedByStop(logging.Filter):
    """Drops py4j's ERROR + traceback of a foreachBatch cut by ``java.lang.InterruptedException`` while a stop is
    under way (:func:`stopping_queries`), and says it once at INFO instead."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.stops = 0  # stops under way in this process
        self.told = False
        self.quiet: dict[str, object] = {}  # Spark loggers turned off during stops -> their levels before
        self.timer: threading.Timer | None = None  # the pending restore of their levels

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not self.stops or exc is None:
            return True
        try:
            interrupted = "java.lang.InterruptedException" in str(exc)  # a Java exception's text comes from the JVM
        except Exception:  # noqa: BLE001 - unreadable: let the record through
            return True
        if interrupted:
            if not self.told:
                self.told = True
                logging.getLogger("kappa.runtime.job").info(
                    "a micro-batch in flight was cut by the stop; it runs again from the checkpoint at the next start")
            return False
        return True


_BY_STOP = _InterruptedByStop()
logging.getLogger("py4j.clientserver").addFilter(_BY_STOP)

#: Spark loggers that report, at ERROR, the cancellation a stop sends to a micro-batch in flight: its block fetches
#: and broadcasts fail as the cancelled job's blocks go away (seen in view-host.log at every stop that cut a batch).
_STOP_NOISE = ("org.apache.spark.network.shuffle.RetryingBlockTransferor",
               "org.apache.spark.network.shuffle.OneForOneBlockFetcher",
               "org.apache.spark.network.server.TransportRequestHandler",
               "org.apache.spark.broadcast.TorrentBroadcast",
               # the cut batch's file writes: "Aborting job ... InterruptedException" (Delta's and Spark's writer)
               # and the interrupted `chmod` of a checkpoint file it was writing (a WARN with its stack)
               "org.apache.spark.sql.delta.files.DeltaFileFormatWriter",
               "org.apache.spark.sql.execution.datasources.FileFormatWriter",
               "org.apache.hadoop.util.Shell")
#: Seconds those loggers stay quiet after the stop returned (the cancelled tasks' threads finish after it).
_STOP_NOISE_TAIL = 10.0


@contextlib.contextmanager
def stopping_queries(spark: "SparkSession | None") -> Iterator[None]:
    """Around stopping streaming queries on purpose (a stop, a promote, a rollback, a host shutdown): the interrupt
    that cuts a micro-batch in flight is the stop itself, not a failure - py4j's traceback of the interrupted batch
    and Spark's ERROR lines about its cancelled block fetches and broadcasts are left out (one INFO line says a
    batch was cut). py4j's come back after the block, Spark's loggers :data:`_STOP_NOISE_TAIL` s later (the cancelled
    tasks end after the stop returned). The checkpoint and the idempotent commit make the cut batch's re-run exact."""
    with _BY_STOP.lock:
        _BY_STOP.stops += 1
        _BY_STOP.told = False
        first = _BY_STOP.stops == 1 and not _BY_STOP.quiet
    jvm = None
    try:
        jvm = spark.sparkContext._jvm if spark is not None else None
        if jvm is not None and first:
            config = jvm_class(jvm, "org.apache.logging.log4j.core.config.Configurator")
            managers = jvm_class(jvm, "org.apache.logging.log4j.LogManager")
            off = jvm_class(jvm, "org.apache.logging.log4j.Level").OFF
            for name in _STOP_NOISE:
                _BY_STOP.quiet[name] = managers.getLogger(name).getLevel()
                config.setLevel(name, off)
    except Exception:  # noqa: BLE001 - the JVM is gone already: nothing to quiet
        jvm = None
    try:
        yield
    finally:
        with _BY_STOP.lock:
            _BY_STOP.stops -= 1
        if jvm is not None:
            timer = threading.Timer(_STOP_NOISE_TAIL, _restore_levels, args=(jvm,))
            timer.daemon = True
            with _BY_STOP.lock:
                if _BY_STOP.timer is not None:
                    _BY_STOP.timer.cancel()  # the latest stop's restore does it for both
                _BY_STOP.timer = timer
            timer.start()


def _restore_levels(jvm: object) -> None:
    """The loggers :func:`stopping_queries` quieted get their levels back once no stop is under way."""
    with _BY_STOP.lock:
        if _BY_STOP.stops or not _BY_STOP.quiet:
            return
        levels, _BY_STOP.quiet = dict(_BY_STOP.quiet), {}
    try:
        for name, level in levels.items():
            jvm_class(jvm, "org.apache.logging.log4j.core.config.Configurator").setLevel(name, level)
    except Exception:  # noqa: BLE001 - the JVM ended with the stop
        pass


@contextlib.contextmanager
def computed_once(frame: "DataFrame") -> Iterator["DataFrame"]:
    """``frame`` for several actions, computed by the first and kept for the others until the block ends.

    A lazy local checkpoint - the rows as blocks of one RDD, freed at the end - not Spark's cache (``persist``): a
    cached relation's tasks carry an accumulator that Spark 4.2's executor heartbeat can read while a task is still
    deserializing it (SPARK-59451: a ``NullPointerException`` in ``PartitionKeyedAccumulator.isZero`` that ends
    the executor's heartbeats), and building its column batches and statistics costs more than a micro-batch's rows
    are worth. The checkpointed rows replace ``frame``'s plan, so each row is computed exactly once, whatever the
    actions that follow (a stateful micro-batch's state store is written once, its metrics counted once).
    """
    kept = frame.localCheckpoint(eager=False)
    try:
        yield kept
    finally:
        try:
            kept._jdf.logicalPlan().rdd().unpersist(False)  # else its blocks wait for the JVM's garbage collector
        except Exception as exc:  # noqa: BLE001 - Spark's context cleaner frees them once the RDD is unreferenced
            logging.getLogger("kappa.runtime.spark").debug(
                "a local checkpoint's blocks are left to Spark's cleaner: %s", exc)


def stop_spark(spark: "SparkSession") -> None:
    """Stop a session the platform built: the state stores first (their maintenance thread, else it may run once
    more after SparkEnv is gone and log a stack trace at ERROR - "Error running maintenance thread ... SparkEnv not
    active" - at the end of a run that succeeded), then Spark."""
    try:
        store = jvm_class(spark.sparkContext._jvm, "org.apache.spark.sql.execution.streaming.state.StateStore$")
        getattr(store, "MODULE$").stop()
    except Exception:  # noqa: BLE001 - no state store was loaded, or the JVM is already gone
        pass
    with _BY_STOP.lock:  # the loggers a stop quieted get their levels back now, not from a timer once the JVM ended
        timer, _BY_STOP.timer = _BY_STOP.timer, None
    if timer is not None:
        timer.cancel()
        _restore_levels(spark.sparkContext._jvm)
    spark.stop()


def end_jvm(timeout: float = 30.0) -> None:
    """End the Spark JVM this process started and wait for it, at the end of a process that ran Spark (the view
    host, a view's driver). The JVM exits when its stdin closes, running its shutdown hooks (Spark removes its
    temporary folders); a process that just exits leaves them running while whoever stopped it signals the
    process group - and a hook cut by that signal logs a stack trace at a stop that went well."""
    try:
        from pyspark import SparkContext
    except ImportError:  # pragma: no cover - no pyspark, no JVM
        return
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return
    client = getattr(gateway, "_gateway_client", None)
    if client is not None:  # no call into the JVM from here on (py4j's finalizers check it: none logs a traceback)
        client.is_connected = False
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout)
    except Exception:  # noqa: BLE001 - it did not end in time: the caller's exit and its group's signal end it
        pass


def per_jvm(build: "Callable[..., T]") -> "Callable[..., T]":
    """``build`` memoized for the JVM this process talks to: the Columns it returns are that JVM's objects, each made
    by calls into it, and a view's micro-batches select the same ones every time (six views at a 2 s trigger built
    the same few dozen, hundreds of calls a second). Its arguments must be hashable. Keyed by the Py4J gateway too,
    so a process that starts another JVM builds them again."""

    @functools.lru_cache(maxsize=256)
    def cached(_gateway: Any, *args: Any) -> Any:
        return build(*args)

    @functools.wraps(build)
    def wrapper(*args: Any) -> Any:
        from pyspark import SparkContext

        return cached(SparkContext._gateway, *args)

    return wrapper


def jvm_class(jvm: Any, fqn: str) -> Any:
    """The JVM class ``fqn`` (a fully qualified name, ``Outer$`` for a Scala object) in one Py4J lookup.

    ``jvm.org.apache.hadoop.fs.Path`` resolves every dot apart, and the JVM answers each prefix that is no class
    (``org``, ``org.apache``, ...) with a ``Class.forName`` that fails only after searching every jar of the
    classpath (278 on a view host), a bare name once more under each of PySpark's star imports: 9.8 ms for that
    path against 0.2 ms for ``getattr(jvm, "org.apache.hadoop.fs.Path")``, most of it the driver's CPU - paid by
    every checkpoint file a micro-batch reads and every second by each job's reading poller (docs/performance.md)."""
    return getattr(jvm, fqn)


class HadoopFiles:
    """Small lake files (a checkpoint's ``run.json``, offset log entries) through the Spark session's Hadoop file
    system: any store the session can write to (``s3a://``, ``abfss://``...), with its credentials and settings -
    what a view job uses."""

    def __init__(self, spark: "SparkSession") -> None:
        self._jvm = spark.sparkContext._jvm
        self._conf = spark.sparkContext._jsc.hadoopConfiguration()

    def _fs(self, uri: str) -> tuple[object, object]:
        path = jvm_class(self._jvm, "org.apache.hadoop.fs.Path")(uri)
        return path.getFileSystem(self._conf), path

    def read(self, uri: str) -> str | None:
        """The file's text; None if it does not exist."""
        fs, path = self._fs(uri)
        if not fs.exists(path):
            return None
        stream = fs.open(path)
        try:
            return str(jvm_class(self._jvm, "org.apache.commons.io.IOUtils").toString(stream, "UTF-8"))
        finally:
            stream.close()

    def write(self, uri: str, text: str) -> None:
        """Replace the file (one PUT on object stores; the ``file:`` store writes a temporary file first)."""
        fs, path = self._fs(uri)
        stream = fs.create(path, True)
        try:
            stream.write(bytearray(text.encode()))
        finally:
            stream.close()

    def list(self, uri: str) -> list[str]:
        """Names in a directory (empty if it does not exist)."""
        fs, path = self._fs(uri)
        try:
            return sorted(str(status.getPath().getName()) for status in fs.listStatus(path))
        except Exception as exc:  # noqa: BLE001 - py4j wraps Java's FileNotFoundException
            if "FileNotFoundException" in str(exc):
                return []
            raise

    def delete(self, uri: str) -> None:
        """Remove one file (nothing if it does not exist)."""
        fs, path = self._fs(uri)
        fs.delete(path, False)

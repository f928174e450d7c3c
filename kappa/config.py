"""Runtime settings of the platform, read from the environment.

Every component (CLI, jobs, DAGs, tests) builds one :class:`Settings` with :meth:`Settings.from_env` and
derives its client configuration from it, so pointing the whole platform somewhere else is a matter of
environment variables (empty = unset):

- ``KAPPA_HOME`` -- runtime state (broker data, lake, logs). Default ``<repo>/.kappa``.
- ``KAPPA_KAFKA_BOOTSTRAP`` -- Kafka bootstrap servers. Default ``127.0.0.1:9092``. Setting it means an
  *external* cluster: the platform then never starts a local broker (``Settings.local_broker`` is False).
- ``KAPPA_KAFKA_SECURITY_PROTOCOL`` -- ``PLAINTEXT`` (default), ``SSL``, ``SASL_PLAINTEXT``, ``SASL_SSL``.
- ``KAPPA_KAFKA_SASL_MECHANISM`` -- ``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` (with SASL_*).
- ``KAPPA_KAFKA_SASL_USERNAME`` / ``KAPPA_KAFKA_SASL_PASSWORD`` -- SASL credentials (password never in ``repr``).
- ``KAPPA_KAFKA_SSL_CA_LOCATION`` -- PEM file of the CA that signed the brokers' certificates (with SSL/SASL_SSL).
- ``KAPPA_LAKE_URI`` -- root of Delta tables, checkpoints and the view registry. Default ``<home>/lake``.
- ``KAPPA_TOPIC_PREFIX`` -- prefix of every physical topic name (several environments or test runs on one
  cluster). Default none.
- ``KAPPA_REPO_ROOT`` -- repository root (jars, schemas, platform.yaml). Default: parent of the package.
- ``KAPPA_METRICS_ADDR`` -- address the drivers' ``/metrics`` servers bind. Default ``127.0.0.1`` (loopback);
  the Helm chart sets ``0.0.0.0`` so Prometheus can scrape the pods.
- ``KAPPA_CLI`` -- how messages spell the command line (``bin/kappa`` from a checkout, ``kappa`` in images).
- ``KAPPA_PLATFORM`` -- the platform declaration (views, topics). Default ``kappa/platform.yaml``.

Running view versions:

- ``KAPPA_RUNNER`` -- who runs view drivers: ``local`` (default; processes or the view host on this machine) or
  ``kubernetes`` (a Deployment each, from the chart's view template).
- ``KAPPA_LOCAL_DRIVER`` -- the local runner's choice: ``auto`` (default: join the view host when it runs, else
  a driver process of its own), ``host`` or ``own``.
- ``KAPPA_K8S_NAMESPACE`` / ``KAPPA_VIEW_TEMPLATE_DIR`` -- the Kubernetes runner's namespace (default: the
  template's, else the pod's) and the mounted view-template ConfigMap (default ``/etc/kappa/view-template``).
- ``KAPPA_METRICS_PORT`` -- a driver's ``/metrics`` port when its runner names none (default 9400; 0: any).
- ``KAPPA_EXIT_FILE`` -- a driver writes its exit code to this file (set by the local runner).
- ``KAPPA_STOP_DRAIN_SECONDS`` -- how long a stopping driver waits for the running micro-batch (default 45).
- ``KAPPA_HOST_POLL_SECONDS`` / ``KAPPA_HOST_RESTART_BACKOFF_SECONDS`` / ``KAPPA_HOST_MAX_RESTARTS`` -- the view
  host's reconcile interval (1 s), first restart backoff of a failed query (5 s, doubling) and the consecutive
  failures after which a query stays ``failed`` (5).
- ``KAPPA_HOST_BATCHES_PER_SECOND`` -- the live micro-batches per second a view host plans for (3.5; about one core
  at the measured cost of a micro-batch): when its live versions' triggers ask for more, each version the host
  starts runs no more often than the shortest common trigger that fits, at most 5 times its declared one
  (:mod:`kappa.runtime.host`; 0: never).
- ``KAPPA_SPARK_MASTER`` (``local[2]``), ``KAPPA_SHUFFLE_PARTITIONS`` (default: 1 for views' sessions on a local
  master, the local cores for other sessions, else 4), ``KAPPA_SPARK_UI`` (``false``), ``KAPPA_SPARK_LOG_LEVEL``
  (``WARN``), ``KAPPA_SPARK_CDS`` (``true``: driver JVMs map the class-data archive ``make setup`` built,
  :mod:`kappa.runtime.cds`), ``KAPPA_SPARK_FORKLESS_FS`` (``true``: a local driver's Hadoop sets permissions and
  reads links through ``java.nio`` instead of starting ``chmod`` and ``readlink`` for every file it writes,
  :func:`kappa.runtime.spark.forkless_fs`), ``KAPPA_SPARK_HEAP_FOOTPRINT`` (``true``: a driver's heap is kept 20-50 %
  above what it holds instead of growing to its maximum, :data:`kappa.runtime.spark.PARALLEL_GC_FOOTPRINT`),
  ``KAPPA_STATE_MEMORY_MB`` (``128``: the native memory all of a JVM's RocksDB state stores share - block cache and
  memtables, a soft bound; ``0``: RocksDB's defaults, 64 MiB memtables per store), ``KAPPA_SPARK_TRIM_SECONDS``
  (``10``: how often a driver JVM hands the native memory its C heap holds free back to the system,
  :func:`kappa.runtime.spark.trim_options`; ``0``: never) -- the Spark sessions the platform builds.
- ``KAPPA_HOST_DRIVER_MEMORY`` -- the heap ceiling of the local view host's driver JVM (``768m``; a JVM size:
  ``1536m``, ``2g``). Its live set is a few hundred MiB for the six declared views (about 250 MiB after a full
  collection), and a steady stream of micro-batches fills the heap to its ceiling; a host running many more versions
  wants more (20: 15 % of its time collecting at 768m, 10 % at 1g). ``kappa host run --driver-memory`` overrides
  it (the chart's grouped driver, which runs no replay: ``viewJobs.groupedDriverMemory``, 512m).
- ``KAPPA_SPARK_LOG_FILE`` -- where the JVM's log of a session goes instead of stderr (unset: stderr, as drivers
  log; the CLI's replay, verify and repair put their own session's in ``<home>/logs/spark-cli.log``).

Operating it:

- ``KAPPA_AIRFLOW_PORT`` -- the local Airflow's port (default 8080).
- ``KAPPA_SQL_JDBC_PORT`` / ``KAPPA_SQL_CONNECT_PORT`` -- the analysts' SQL service's JDBC (HiveServer2) and Spark
  Connect ports (default 10000 and 15002).
- ``KAPPA_SQL_TOKEN`` -- the SQL service's credential (the chart's Secret); unset, the local stack's is
  ``$KAPPA_HOME/sql/token``, made once.
- ``KAPPA_AIRFLOW_PASSWORD`` -- the password ``kappa airflow trigger --url`` logs in with at another Airflow (the
  local stack's own is read from its home); never taken from the command line.
- ``KAPPA_REPLAY_POKE_SECONDS`` / ``KAPPA_REPLAY_TIMEOUT_SECONDS`` -- how often ``kappa_replay`` checks a
  running replay (default 60 s; the local stack sets 10) and when it gives up (default 24 h).
- ``KAPPA_WATCH_POLL_SECONDS`` -- how often the watch after a switch reads the new version's metrics (15 s).
- ``KAPPA_KAFKA_OUTAGE_SECONDS`` -- how long a view job waits for an unreachable broker (its micro-batch retries
  reading the log's offsets) before its query fails (1800 s; restarts from the checkpoint follow as usual).
- ``KAPPA_UPKEEP_SECONDS`` -- how often a live job keeps its table: compacts the small files of its micro-batches,
  VACUUMs, and in an archive's job applies the archive's retention first (3600 s; :mod:`kappa.runtime.upkeep`).
- ``KAPPA_COMPACT_FILES`` -- between two upkeeps, a live job compacts its table, or its view's partition of the
  quarantine, once its current version references more small files than this (100; 0: only at the upkeeps): a
  delta-rs commit costs more the more files the table has (:mod:`kappa.runtime.upkeep`).
- ``KAPPA_HISTORY_HOURS`` -- how far back a live view table's history reaches - time travel, its change feed, its
  commit history: its log and the files its commits replaced are kept this long, then removed by its keeper
  (``delta.logRetentionDuration`` and ``delta.deletedFileRetentionDuration``). Unset: 1 hour on a lake on a file
  system, whose listing of a table's log reads every file in it at every commit; Delta's own (7 days of files, 30
  of log) on an object store, which lists a log from a version (:mod:`kappa.runtime.upkeep`, docs/lake.md).
- ``KAPPA_SUPERVISE_POLL_SECONDS`` / ``KAPPA_SUPERVISE_BACKOFF_SECONDS`` -- how often the local stack's supervisor
  looks at what ``kappa up`` started (5 s) and its first wait before restarting one that died (5 s, doubling with
  each failure in a row; :mod:`kappa.front.supervisor`).
- ``KAPPA_LOG_MAX_MB`` -- the size past which the supervisor moves a process log under ``$KAPPA_HOME`` aside (64 MB;
  one previous file kept).
- ``KAPPA_AIRFLOW_DB_CONN`` -- Airflow's metadata database URL for ``kappa_retire``'s ``airflow db clean`` where
  Airflow's own setting comes from the environment only (the chart sets it; Airflow 3 hides its
  ``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` from tasks). Unset locally: ``airflow.cfg`` has it.
- ``KAPPA_VERIFY_CACHE_MB`` -- how much disk the records staged by strict verifications may keep under
  ``$KAPPA_HOME/verify-cache`` for the next verification of the same version (4096 MB; the least recently used go
  first; 0: keep nothing, every verification reads its whole range again; :mod:`kappa.verify.stagecache`).
- ``KAPPA_LEASE_TTL_SECONDS`` -- a replay's retention lease expires when its job committed nothing for this long
  (900 s: a crashed driver's lease does not hold the topic's retention forever).
- ``KAPPA_DRIVER_LEASE_SECONDS`` -- on an object-store lake, how long a view version's driver lease outlives its
  last renewal (120 s; renewed every quarter of it): a driver on another machine takes over a crashed one's after
  this long, and a driver that cannot renew it when a commit comes due five sixths of it after the last renewal
  fails that micro-batch (kappa.runtime.lock.LakeLease).
- ``KAPPA_LIVE_COMMITS`` -- how a view commits its small live micro-batches: ``delta-rs`` (default; no Spark job
  per commit) or ``spark`` (delta-spark, as every larger batch; :mod:`kappa.runtime.sink`).
- ``KAPPA_BENCH_EVENTS`` -- the largest replay of ``make bench`` (2,000,000 events).
- ``KAPPA_FAULT`` -- fault injection for the crash tests (``<phase>:<batch>``; never set in production).

Example:
    >>> from kappa.config import Settings
    >>> s = Settings.from_env({"KAPPA_HOME": "/tmp/k"})
    >>> s.kafka_bootstrap, s.local_broker, s.lake_uri
    ('127.0.0.1:9092', True, '/tmp/k/lake')
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kappa.errors import KappaError

__all__ = [
    "DEFAULT_BOOTSTRAP",
    "SASL_MECHANISMS",
    "SECURITY_PROTOCOLS",
    "DEFAULT_KEEP_HOURS",
    "LOCAL_DRIVER_MODES",
    "LOCAL_HISTORY_HOURS",
    "PLATFORM_FILE",
    "RUNNERS",
    "ConfigError",
    "Settings",
    "aws_endpoint",
    "default_repo_root",
]

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
#: The shipped platform declaration (views, topics), next to this module.
PLATFORM_FILE: Path = Path(__file__).resolve().parent / "platform.yaml"
#: The runners ``KAPPA_RUNNER`` can name (kappa.control.runners.RUNNERS maps them to their classes).
RUNNERS = ("local", "kubernetes")
LOCAL_DRIVER_MODES = ("auto", "host", "own")
#: How long a replaced view version's table is kept for rollback before retirement deletes it (7 days). The one
#: default of the alias (kappa.control.serving), the replay request, the CLI and the DAGs' Params.
DEFAULT_KEEP_HOURS = 168.0
#: How far back a live view table's history reaches on a lake on a file system (``KAPPA_HISTORY_HOURS`` unset): a
#: listing of its log reads every file in it, ~1 us each, twice for every live commit; an hour of 2 s micro-batches
#: is ~1,900 log files (docs/performance.md "The log every commit listed").
LOCAL_HISTORY_HOURS = 1.0
SECURITY_PROTOCOLS = frozenset({"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"})
SASL_MECHANISMS = frozenset({"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"})

_JAAS_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


class ConfigError(KappaError, ValueError):
    """Inconsistent or invalid settings (message names the environment variable)."""


def aws_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The S3 endpoint the environment names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, the AWS SDKs'
    order); None for AWS S3 itself. The one lookup of the lake's readers and writers (Spark's S3A, delta-rs, obstore,
    the lake check)."""
    env = os.environ if env is None else env
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def default_repo_root() -> Path:
    """The repository root: the directory above the ``kappa`` package (editable install)."""
    return Path(__file__).resolve().parents[1]


def _jaas_quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def jvm_size_bytes(size: str) -> int:
    """Bytes of a JVM memory size as ``-Xmx`` takes it (``768m``, ``1g``, ``1536m``, a count of bytes).

    Raises:
        ValueError: If ``size`` is not one.
    """
    m = re.fullmatch(r"([1-9][0-9]*)([kKmMgG]?)", size.strip())
    if m is None:
        raise ValueError(f"a JVM memory size looks like '768m' or '1g', got {size!r}")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Immutable platform settings; build with :meth:`from_env`, derive variants with :meth:`replace`.

    Attributes:
        repo_root: Repository root (``infra/``, ``schemas/``, ``.cache/``).
        home: Runtime state directory (``KAPPA_HOME``).
        kafka_bootstrap: Bootstrap servers, ``host:port[,host:port...]``.
        local_broker: True when the platform manages a local broker (``KAPPA_KAFKA_BOOTSTRAP`` unset).
        security_protocol: Kafka security protocol, or None for PLAINTEXT.
        sasl_mechanism: SASL mechanism when the protocol is SASL_*.
        sasl_username: SASL user name.
        sasl_password: SASL password (excluded from ``repr``).
        ssl_ca_location: PEM CA bundle for SSL / SASL_SSL.
        lake_uri: Root URI/path of Delta tables, checkpoints and the view registry.
        topic_prefix: Prefix of every physical topic name (``KAPPA_TOPIC_PREFIX``).
        metrics_addr: Bind address of the Prometheus ``/metrics`` servers.
        cli: The command line as users invoke it, for the commands that messages suggest.
        platform: The platform declaration file (``KAPPA_PLATFORM``).
        runner, local_driver, k8s_namespace, view_template_dir, metrics_port, exit_file, stop_drain_seconds, live_commits,
        host_poll_seconds, host_restart_backoff_seconds, host_max_restarts, host_batches_per_second,
        host_driver_memory, spark_master,
        shuffle_partitions, spark_ui, spark_log_level, spark_log_file, spark_cds, spark_forkless_fs, spark_heap_footprint,
        state_memory_mb, spark_trim_seconds, airflow_port, airflow_password, sql_jdbc_port, sql_connect_port,
        sql_token, replay_poke_seconds, replay_timeout_seconds, watch_poll_seconds, lease_ttl_seconds,
        driver_lease_seconds, kafka_outage_seconds, upkeep_seconds, compact_files, history_hours,
        supervise_poll_seconds,
        supervise_backoff_seconds,
        log_max_mb, airflow_db_conn, verify_cache_mb, bench_events, fault: the ``KAPPA_*`` variable of the same name
        (upper case), see the module docs.
    """

    repo_root: Path
    home: Path
    kafka_bootstrap: str = DEFAULT_BOOTSTRAP
    local_broker: bool = True
    security_protocol: str | None = None
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_ca_location: str | None = None
    lake_uri: str = ""
    topic_prefix: str = ""
    metrics_addr: str = "127.0.0.1"
    cli: str = "kappa"
    platform: Path = PLATFORM_FILE
    runner: str = "local"
    local_driver: str = "auto"
    k8s_namespace: str | None = None
    view_template_dir: str | None = None
    metrics_port: int = 9400
    exit_file: str | None = None
    stop_drain_seconds: float = 45.0
    live_commits: str = "delta-rs"
    host_poll_seconds: float = 1.0
    host_restart_backoff_seconds: float = 5.0
    host_max_restarts: int = 5
    host_batches_per_second: float = 3.5
    #: 768m: six views' live set is ~250-300 MiB after a full collection; a steady stream of micro-batches fills the
    #: heap to its maximum, so the maximum is what the process holds - 2g made the JVM 1.85 GiB resident, 1g 400-570
    #: MiB less at the same CPU per micro-batch, 768m 236 MiB less than 1g at the same CPU and time collecting
    #: (docs/performance.md, "a view host's memory is its heap's maximum", "the C heap trimmed")
    host_driver_memory: str = "768m"
    spark_master: str = "local[2]"
    shuffle_partitions: int | None = None
    spark_ui: bool = False
    spark_log_level: str = "WARN"
    spark_log_file: str | None = None
    spark_cds: bool = True
    spark_forkless_fs: bool = True
    spark_heap_footprint: bool = True
    state_memory_mb: int = 128
    spark_trim_seconds: float = 10.0
    airflow_port: int = 8080
    airflow_password: str | None = field(default=None, repr=False)
    sql_jdbc_port: int = 10000
    sql_connect_port: int = 15002
    sql_token: str | None = field(default=None, repr=False)
    replay_poke_seconds: float | None = None
    replay_timeout_seconds: float = 24 * 3600.0
    watch_poll_seconds: float = 15.0
    lease_ttl_seconds: float = 900.0
    driver_lease_seconds: float = 120.0
    kafka_outage_seconds: float = 1800.0
    upkeep_seconds: float = 3600.0
    compact_files: int = 100
    history_hours: float | None = None
    supervise_poll_seconds: float = 5.0
    supervise_backoff_seconds: float = 5.0
    log_max_mb: float = 64.0
    airflow_db_conn: str | None = field(default=None, repr=False)
    verify_cache_mb: int = 4096
    bench_events: int = 2_000_000
    fault: str | None = None

    def __post_init__(self) -> None:
        if not self.lake_uri:
            object.__setattr__(self, "lake_uri", str(self.home / "lake"))
        self._validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from ``os.environ`` (or the given mapping).

        Args:
            env: Environment to read; defaults to ``os.environ``. Empty values count as unset.

        Raises:
            ConfigError: If the security settings are inconsistent.
        """
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def number(name: str, kind: type, default: Any) -> Any:
            value = get(name)
            if value is None:
                return default
            try:
                return kind(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: not a{'n integer' if kind is int else ' number'}") from None

        def flag(name: str, default: bool) -> bool:
            value = get(name)
            if value is None:
                return default
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}={value!r}: not a yes/no setting (1/true/yes/on or 0/false/no/off)")

        repo_root = Path(get("KAPPA_REPO_ROOT") or default_repo_root()).resolve()
        home = Path(get("KAPPA_HOME") or repo_root / ".kappa").expanduser().resolve()
        bootstrap = get("KAPPA_KAFKA_BOOTSTRAP")
        protocol = get("KAPPA_KAFKA_SECURITY_PROTOCOL")
        mechanism = get("KAPPA_KAFKA_SASL_MECHANISM")
        return cls(
            repo_root=repo_root,
            home=home,
            kafka_bootstrap=bootstrap or DEFAULT_BOOTSTRAP,
            local_broker=bootstrap is None,
            security_protocol=protocol.upper() if protocol else None,
            sasl_mechanism=mechanism.upper() if mechanism else None,
            sasl_username=get("KAPPA_KAFKA_SASL_USERNAME"),
            sasl_password=get("KAPPA_KAFKA_SASL_PASSWORD"),
            ssl_ca_location=get("KAPPA_KAFKA_SSL_CA_LOCATION"),
            lake_uri=get("KAPPA_LAKE_URI") or "",
            topic_prefix=get("KAPPA_TOPIC_PREFIX") or "",
            metrics_addr=get("KAPPA_METRICS_ADDR") or "127.0.0.1",
            cli=get("KAPPA_CLI") or "kappa",
            platform=Path(get("KAPPA_PLATFORM") or PLATFORM_FILE),
            runner=(get("KAPPA_RUNNER") or "local").lower(),
            local_driver=get("KAPPA_LOCAL_DRIVER") or "auto",
            k8s_namespace=get("KAPPA_K8S_NAMESPACE"),
            view_template_dir=get("KAPPA_VIEW_TEMPLATE_DIR"),
            metrics_port=number("KAPPA_METRICS_PORT", int, 9400),
            exit_file=get("KAPPA_EXIT_FILE"),
            stop_drain_seconds=number("KAPPA_STOP_DRAIN_SECONDS", float, 45.0),
            live_commits=(get("KAPPA_LIVE_COMMITS") or "delta-rs").lower(),
            host_poll_seconds=number("KAPPA_HOST_POLL_SECONDS", float, 1.0),
            host_restart_backoff_seconds=number("KAPPA_HOST_RESTART_BACKOFF_SECONDS", float, 5.0),
            host_max_restarts=number("KAPPA_HOST_MAX_RESTARTS", int, 5),
            host_batches_per_second=number("KAPPA_HOST_BATCHES_PER_SECOND", float, 3.5),
            host_driver_memory=get("KAPPA_HOST_DRIVER_MEMORY") or "768m",
            spark_master=get("KAPPA_SPARK_MASTER") or "local[2]",
            shuffle_partitions=number("KAPPA_SHUFFLE_PARTITIONS", int, None),
            spark_ui=flag("KAPPA_SPARK_UI", False),
            spark_log_level=get("KAPPA_SPARK_LOG_LEVEL") or "WARN",
            spark_log_file=get("KAPPA_SPARK_LOG_FILE"),
            spark_cds=flag("KAPPA_SPARK_CDS", True),
            spark_forkless_fs=flag("KAPPA_SPARK_FORKLESS_FS", True),
            spark_heap_footprint=flag("KAPPA_SPARK_HEAP_FOOTPRINT", True),
            state_memory_mb=number("KAPPA_STATE_MEMORY_MB", int, 128),
            spark_trim_seconds=number("KAPPA_SPARK_TRIM_SECONDS", float, 10.0),
            airflow_port=number("KAPPA_AIRFLOW_PORT", int, 8080),
            airflow_password=get("KAPPA_AIRFLOW_PASSWORD"),
            sql_jdbc_port=number("KAPPA_SQL_JDBC_PORT", int, 10000),
            sql_connect_port=number("KAPPA_SQL_CONNECT_PORT", int, 15002),
            sql_token=get("KAPPA_SQL_TOKEN"),
            replay_poke_seconds=number("KAPPA_REPLAY_POKE_SECONDS", float, None),
            replay_timeout_seconds=number("KAPPA_REPLAY_TIMEOUT_SECONDS", float, 24 * 3600.0),
            watch_poll_seconds=number("KAPPA_WATCH_POLL_SECONDS", float, 15.0),
            lease_ttl_seconds=number("KAPPA_LEASE_TTL_SECONDS", float, 900.0),
            driver_lease_seconds=number("KAPPA_DRIVER_LEASE_SECONDS", float, 120.0),
            kafka_outage_seconds=number("KAPPA_KAFKA_OUTAGE_SECONDS", float, 1800.0),
            upkeep_seconds=number("KAPPA_UPKEEP_SECONDS", float, 3600.0),
            compact_files=number("KAPPA_COMPACT_FILES", int, 100),
            history_hours=number("KAPPA_HISTORY_HOURS", float, None),
            supervise_poll_seconds=number("KAPPA_SUPERVISE_POLL_SECONDS", float, 5.0),
            supervise_backoff_seconds=number("KAPPA_SUPERVISE_BACKOFF_SECONDS", float, 5.0),
            log_max_mb=number("KAPPA_LOG_MAX_MB", float, 64.0),
            airflow_db_conn=get("KAPPA_AIRFLOW_DB_CONN"),
            verify_cache_mb=number("KAPPA_VERIFY_CACHE_MB", int, 4096),
            bench_events=number("KAPPA_BENCH_EVENTS", int, 2_000_000),
            fault=get("KAPPA_FAULT"),
        )

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with some fields changed (validated again).

        Changing ``home`` without ``lake_uri`` keeps a lake under the *old* home; pass ``lake_uri=""`` to
        re-derive it from the new home.
        """
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived paths
    @property
    def table_history_hours(self) -> float | None:
        """How far back a live view table's history reaches (``KAPPA_HISTORY_HOURS``): unset, 1 hour on a lake on a
        file system (:data:`LOCAL_HISTORY_HOURS`), None - Delta's own retentions - on an object store."""
        if self.history_hours is not None:
            return self.history_hours
        local = "://" not in self.lake_uri or self.lake_uri.startswith("file:")
        return LOCAL_HISTORY_HOURS if local else None

    def topic(self, name: str) -> str:
        """Physical Kafka topic of a declared topic (``KAPPA_TOPIC_PREFIX`` + name).

        A prefix lets several environments (or test runs) share one cluster without sharing data.
        """
        return f"{self.topic_prefix}{name}"

    @property
    def jars_dir(self) -> Path:
        """``<repo>/.cache/jars`` (``broker/`` and ``spark/`` sub-folders, filled by ``make setup``)."""
        return self.repo_root / ".cache" / "jars"

    @property
    def broker_home(self) -> Path:
        """Home of the local broker: ``<home>/broker`` (config, data, logs, pid file)."""
        return self.home / "broker"

    @property
    def schemas_dir(self) -> Path:
        """Versioned JSON Schemas, ``<repo>/schemas``."""
        return self.repo_root / "schemas"

    # ------------------------------------------------------------------ client configs
    def kafka_client_config(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """librdkafka configuration for confluent-kafka clients (Producer/Consumer/AdminClient).

        Args:
            overrides: Extra librdkafka properties merged last (e.g. ``{"client.id": "x"}``).

        Returns:
            A new dict with ``bootstrap.servers`` and the security settings.
        """
        conf: dict[str, Any] = {"bootstrap.servers": self.kafka_bootstrap}
        if self.security_protocol:
            conf["security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            conf["sasl.username"] = self.sasl_username
        if self.sasl_password is not None:
            conf["sasl.password"] = self.sasl_password
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        if overrides:
            conf.update(overrides)
        return conf

    def spark_kafka_options(self) -> dict[str, str]:
        """Options for Spark's Kafka source/sink (``spark.readStream.format("kafka").options(**...)``).

        All keys carry the ``kafka.`` prefix Spark forwards to the Java client. SASL credentials become a
        ``kafka.sasl.jaas.config``; an SSL CA file is passed as a PEM trust store (KIP-651).
        """
        opts: dict[str, str] = {"kafka.bootstrap.servers": self.kafka_bootstrap}
        if self.security_protocol:
            opts["kafka.security.protocol"] = self.security_protocol
        if self.sasl_mechanism:
            opts["kafka.sasl.mechanism"] = self.sasl_mechanism
            if self.sasl_username is not None:
                module = _JAAS_MODULES[self.sasl_mechanism]
                opts["kafka.sasl.jaas.config"] = (
                    f'{module} required username="{_jaas_quote(self.sasl_username)}" '
                    f'password="{_jaas_quote(self.sasl_password or "")}";'
                )
        if self.ssl_ca_location:
            opts["kafka.ssl.truststore.type"] = "PEM"
            opts["kafka.ssl.truststore.location"] = self.ssl_ca_location
        return opts

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        if self.live_commits not in ("delta-rs", "spark"):
            raise ConfigError(f"KAPPA_LIVE_COMMITS={self.live_commits!r}: use delta-rs or spark")
        if self.history_hours is not None and not 0 < self.history_hours < 100_000:
            raise ConfigError(f"KAPPA_HISTORY_HOURS={self.history_hours:g}: a number of hours above 0")
        if self.runner not in RUNNERS:
            raise ConfigError(f"KAPPA_RUNNER={self.runner!r}: use one of {', '.join(RUNNERS)}")
        if self.local_driver not in LOCAL_DRIVER_MODES:
            raise ConfigError(f"KAPPA_LOCAL_DRIVER={self.local_driver!r}: use one of {', '.join(LOCAL_DRIVER_MODES)}")
        if not self.kafka_bootstrap or any(not part.strip() for part in self.kafka_bootstrap.split(",")):
            raise ConfigError(f"KAPPA_KAFKA_BOOTSTRAP: invalid bootstrap servers {self.kafka_bootstrap!r}")
        proto = self.security_protocol
        if proto is not None and proto not in SECURITY_PROTOCOLS:
            raise ConfigError(
                f"KAPPA_KAFKA_SECURITY_PROTOCOL: {proto!r} is not one of {', '.join(sorted(SECURITY_PROTOCOLS))}"
            )
        sasl = proto is not None and proto.startswith("SASL_")
        if sasl:
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ConfigError(
                    f"KAPPA_KAFKA_SASL_MECHANISM: {proto} needs one of {', '.join(sorted(SASL_MECHANISMS))}, "
                    f"got {self.sasl_mechanism!r}"
                )
            if not self.sasl_username or self.sasl_password is None:
                raise ConfigError(
                    f"KAPPA_KAFKA_SASL_USERNAME/KAPPA_KAFKA_SASL_PASSWORD: required with {proto}/{self.sasl_mechanism}"
                )
        elif self.sasl_mechanism or self.sasl_username:
            raise ConfigError(
                "KAPPA_KAFKA_SASL_*: SASL settings given but KAPPA_KAFKA_SECURITY_PROTOCOL is "
                f"{proto or 'unset'} (use SASL_PLAINTEXT or SASL_SSL)"
            )
        if not self.driver_lease_seconds >= 3:
            raise ConfigError(f"KAPPA_DRIVER_LEASE_SECONDS={self.driver_lease_seconds:g}: at least 3 (it is renewed "
                              "every quarter of it)")
        try:
            jvm_size_bytes(self.host_driver_memory)
        except ValueError:
            raise ConfigError(f"KAPPA_HOST_DRIVER_MEMORY={self.host_driver_memory!r}: a JVM heap size such as 1536m "
                              "or 2g") from None
        if self.verify_cache_mb < 0:
            raise ConfigError(f"KAPPA_VERIFY_CACHE_MB={self.verify_cache_mb}: 0 (keep nothing) or more")
        if self.spark_trim_seconds < 0:
            raise ConfigError(f"KAPPA_SPARK_TRIM_SECONDS={self.spark_trim_seconds:g}: 0 (never) or more seconds")
        if self.ssl_ca_location and proto not in {"SSL", "SASL_SSL"}:
            raise ConfigError(
                f"KAPPA_KAFKA_SSL_CA_LOCATION: set but KAPPA_KAFKA_SECURITY_PROTOCOL is {proto or 'unset'} "
                "(use SSL or SASL_SSL)"
            )

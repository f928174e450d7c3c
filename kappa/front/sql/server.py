"""``kappa sql serve``: one Spark application that answers analysts' SQL over the serving views.

Two endpoints share one Spark session catalog:

* **JDBC / ODBC** - Spark's Thrift server (the HiveServer2 protocol: beeline, DBeaver, Superset, PyHive), user
  any name, password the service's token (:class:`kappa.sql.TokenAuth`, Java);
* **Spark Connect** - ``sc://host:port/;token=<token>`` (``SparkSession.builder.remote``, notebooks), the token
  checked by Spark's own pre-shared-key interceptor, read from the environment (never from the Spark conf: on
  Spark 4.2.0 the Config RPC returns ``spark.connect.authenticate.token`` to any client, SPARK-58658).

What they serve, kept current by :class:`Catalog` (a poll of the registry every ``poll`` seconds, in this process):

* ``analytics.<view>``: an external Delta table over the version that serves the view; a promotion or a rollback
  re-points it (``ALTER TABLE ... SET LOCATION``, one catalog change), so the next query of an open session reads
  the new version. Time travel (``VERSION AS OF`` / ``TIMESTAMP AS OF``) and ``table_changes('analytics.<view>',
  from)`` work on it;
* ``kappa.freshness``: one row per view - serving version, table, its last Delta version and commit time, and for
  windowed views the watermark (from the table's file statistics);
* ``kappa.quarantine``, ``kappa.registry``, ``kappa.registry_events``: the quarantine and the registry tables.

Read-only: every client plan is checked before it runs (:class:`kappa.sql.ReadOnly`: queries, SHOW, DESCRIBE,
EXPLAIN, SET, USE, temporary views; only the lake's tables as sources; no user code) and Spark Connect's commands
other than SQL and temporary views are refused at the RPC (:class:`kappa.sql.ConnectGuard`). The catalog's own
session is the only one trusted. Analysts' queries run in this process, apart from the views: at most ``cores``
tasks at once, in a heap of ``memory``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from kappa.config import Settings
from kappa.errors import KappaError, one_line

__all__ = ["Catalog", "SqlServiceError", "ensure_token", "jar_path", "serve", "token_path"]

log = logging.getLogger(__name__)

#: The database of the serving views and the one of the platform's own tables.
VIEWS_DB = "analytics"
META_DB = "kappa"


class SqlServiceError(KappaError, RuntimeError):
    """The SQL service cannot start (one line: what and why)."""


def jar_path(settings: Settings) -> Path:
    """The guards' jar ``make setup`` builds (``infra/local/bootstrap.sh``: ``sql`` step)."""
    return Path(settings.jars_dir) / "sql" / "kappa-sql.jar"


def token_path(settings: Settings) -> Path:
    """Where the local stack keeps the service's token (mode 0600; the cluster's is a Secret)."""
    return Path(settings.home) / "sql" / "token"


def ensure_token(settings: Settings) -> str:
    """The local service's token: read, or made once (32 random bytes, URL-safe) and kept 0600."""
    path = token_path(settings)
    try:
        token = path.read_text().strip()
        if token:
            return token
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def _quote(path: str) -> str:
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True, slots=True)
class FreshnessRow:
    view: str
    serving_version: int
    table_path: str
    delta_version: int
    last_commit: datetime | None
    watermark: datetime | None


class Catalog:
    """Keeps ``analytics.<view>`` on the serving versions and ``kappa.*`` current, through one trusted session."""

    def __init__(self, spark: Any, settings: Settings) -> None:
        from kappa.catalog import load_catalog
        from kappa.control.serving import ServingAlias

        self.spark = spark
        self.settings = settings
        self.catalog = load_catalog()
        self.lake = settings.lake_uri.rstrip("/")
        self.serving = ServingAlias(self.lake, catalog=self.catalog)
        self.locations: dict[str, str] = {}
        self.meta: set[str] = set()
        self.freshness: tuple[FreshnessRow, ...] | None = None
        for database in (VIEWS_DB, META_DB):
            spark.sql(f"CREATE DATABASE IF NOT EXISTS {database}")

    def sync(self) -> list[str]:
        """One pass: create or re-point what changed; returns what it did (one line each)."""
        from kappa.control.registry import open_delta

        done: list[str] = []
        rows: list[FreshnessRow] = []
        before = {row.view: row for row in self.freshness or ()}
        for view, target in self.serving.targets().items():
            path = target.table_path
            try:
                table = open_delta(path)
            except KappaError:
                continue  # no table yet: the view's first micro-batch creates it
            rows.append(self._freshness(view, target.version, path, table, before.get(view)))
            current = self.locations.get(view)
            if current == path:
                continue
            if current is None:
                self.spark.sql(f"DROP TABLE IF EXISTS {VIEWS_DB}.{view}")
                self.spark.sql(f"CREATE TABLE {VIEWS_DB}.{view} USING delta LOCATION {_quote(path)}")
                done.append(f"{VIEWS_DB}.{view} -> v{target.version} ({path})")
            else:
                self.spark.sql(f"ALTER TABLE {VIEWS_DB}.{view} SET LOCATION {_quote(path)}")
                done.append(f"{VIEWS_DB}.{view} re-pointed -> v{target.version} ({path})")
            self.locations[view] = path
        for name, path in (("quarantine", f"{self.lake}/quarantine"),
                           ("registry", self.serving.registry.versions_uri),
                           ("registry_events", self.serving.registry.events_uri)):
            if name in self.meta:
                continue
            try:
                open_delta(path)
            except KappaError:
                continue
            self.spark.sql(f"CREATE TABLE IF NOT EXISTS {META_DB}.{name} USING delta LOCATION {_quote(path)}")
            self.meta.add(name)
            done.append(f"{META_DB}.{name} ({path})")
        if tuple(rows) != self.freshness:
            self._write_freshness(rows)
            self.freshness = tuple(rows)
        return done

    def _freshness(self, view: str, version: int, path: str, table: Any,
                   before: FreshnessRow | None) -> FreshnessRow:
        """The view's row of kappa.freshness; ``before`` (the last pass's row) again while its table has no new
        commit (the watermark lists every file's statistics)."""
        from kappa.control.registry import commit_time
        from kappa.runtime.view import load_view

        delta_version = table.version()
        if before is not None and (before.serving_version, before.table_path, before.delta_version) == (
                version, path, delta_version):
            return before
        watermark = None
        try:
            spec = load_view(self.catalog.module_of(view, version)).watermark
        except KappaError:
            spec = None
        if spec is not None:
            column, delay = spec
            try:
                actions = table.get_add_actions(flatten=True)
                name = f"max.{column}"
                if name in actions.column_names:
                    highs = [v for v in actions.column(name).to_pylist() if v is not None]
                    if highs:
                        high = max(highs)
                        if high.tzinfo is None:
                            high = high.replace(tzinfo=timezone.utc)
                        watermark = high - timedelta(seconds=delay)
            except Exception as exc:  # noqa: BLE001 - freshness is best effort; the row says no watermark
                log.debug("freshness of %s: %s", view, one_line(exc))
        return FreshnessRow(view, version, path, delta_version, commit_time(path, delta_version), watermark)

    def _write_freshness(self, rows: list[FreshnessRow]) -> None:
        def ts(value: datetime | None) -> str:
            return "CAST(NULL AS TIMESTAMP)" if value is None else f"TIMESTAMP '{value.isoformat()}'"

        # the first SELECT names and types the columns (and is the answer while no view has a table)
        selects = ["SELECT CAST(NULL AS STRING) AS view, CAST(NULL AS INT) AS serving_version, "
                   "CAST(NULL AS STRING) AS table_path, CAST(NULL AS BIGINT) AS delta_version, "
                   "CAST(NULL AS TIMESTAMP) AS last_commit, CAST(NULL AS TIMESTAMP) AS watermark WHERE false"]
        selects += [f"SELECT '{r.view}', {r.serving_version}, {_quote(r.table_path)}, {r.delta_version}, "
                    f"{ts(r.last_commit)}, {ts(r.watermark)}" for r in rows]
        self.spark.sql(f"CREATE OR REPLACE VIEW {META_DB}.freshness AS {' UNION ALL '.join(selects)}")


#: how old a table's snapshot a query may answer from while the newer one loads (Delta's stalenessLimit)
SNAPSHOT_STALENESS = "5s"


def _spark(settings: Settings, *, host: str, connect_port: int, cores: int, memory: str) -> Any:
    from kappa.runtime.spark import build_spark, spark_jars

    jar = jar_path(settings)
    if not jar.is_file():
        raise SqlServiceError(f"{jar} is missing: run `make setup` (it builds the SQL service's guards)")
    return build_spark(
        "kappa-sql", settings, master=f"local[{cores}]", driver_memory=memory,
        extra_conf={
            # every jar on the JVM's own class path rather than spark.jars' loader: a Spark Connect session's
            # class loader does not see the latter's resources, and Delta's snapshot cache cleans closures by
            # reading their class files (a NullPointerException in ClosureCleaner otherwise)
            "spark.jars": "",
            "spark.driver.extraClassPath": os.pathsep.join(
                [*spark_jars(settings.jars_dir, s3a=settings.lake_uri.startswith("s3a://")), str(jar)]),
            "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension,kappa.sql.ReadOnly",
            "spark.connect.grpc.binding.address": host,
            "spark.connect.grpc.binding.port": str(connect_port),
            "spark.connect.grpc.interceptor.classes": "kappa.sql.ConnectGuard",
            # an ALTER TABLE ... SET LOCATION to a version whose schema differs (a replay that added a column)
            "spark.databricks.delta.alterLocation.bypassSchemaCheck": "true",
            "spark.sql.thriftServer.incrementalCollect": "true",
            # a query answers from the table's snapshot it already has when that is under 5 s old, and loads the
            # newer one in the background: the live views commit every few seconds, and without it each query
            # lists the log and rebuilds the snapshot's state first. A session that wants the last commit at once:
            # SET spark.databricks.delta.stalenessLimit = 0
            "spark.databricks.delta.stalenessLimit": SNAPSHOT_STALENESS,
        })


def serve(settings: Settings, *, host: str = "127.0.0.1", jdbc_port: int | None = None,
          connect_port: int | None = None, poll: float = 5.0, cores: int = 1, memory: str = "1g", ready_file: Path | None = None,
          stop: threading.Event | None = None) -> None:
    """Run the service until ``stop`` is set (or the process is stopped).

    The ports are the settings' (``KAPPA_SQL_JDBC_PORT``, ``KAPPA_SQL_CONNECT_PORT``) unless given. The token is
    ``KAPPA_SQL_TOKEN`` (the chart's Secret), else the local stack's file (:func:`ensure_token`); it is handed to Spark Connect through ``SPARK_CONNECT_AUTHENTICATE_TOKEN`` in this
    process' environment, which the JVM inherits.
    """
    jdbc_port = jdbc_port or settings.sql_jdbc_port
    connect_port = connect_port or settings.sql_connect_port
    token = settings.sql_token or ensure_token(settings)
    # read by the JVM this process starts: the JDBC check (kappa.sql.TokenAuth) and Spark Connect's own
    os.environ.update({"KAPPA_SQL_TOKEN": token, "SPARK_CONNECT_AUTHENTICATE_TOKEN": token})
    spark = _spark(settings, host=host, connect_port=connect_port, cores=cores, memory=memory)
    jvm = spark.sparkContext._jvm
    jvm.kappa.sql.ReadOnly.trust(spark._jsparkSession)
    system = jvm.java.lang.System
    system.setProperty("kappa.sql.lake", settings.lake_uri)
    for key, value in (("hive.server2.thrift.bind.host", host), ("hive.server2.thrift.port", str(jdbc_port)),
                       ("hive.server2.transport.mode", "binary"), ("hive.server2.authentication", "CUSTOM"),
                       ("hive.server2.custom.authentication.class", "kappa.sql.TokenAuth"),
                       ("hive.server2.enable.doAs", "false")):
        system.setProperty(key, value)
    # a JDBC session's close asks Hive for a metastore client (to uncache DataNucleus' class loaders) though the
    # service's catalog is Spark's in-memory one; creating that client's Derby database fails and is retried, each
    # time with a stack trace at ERROR: nothing a reader of the log can act on (the session is closed either way)
    from kappa.runtime.spark import jvm_class

    configurator = jvm_class(jvm, "org.apache.logging.log4j.core.config.Configurator")
    off = jvm_class(jvm, "org.apache.logging.log4j.Level").OFF
    for logger in ("DataNucleus", "org.apache.hadoop.hive.metastore"):
        configurator.setLevel(logger, off)
    jvm.java.lang.System.setProperty("derby.stream.error.file", os.devnull)  # Derby's own log of the same failure
    catalog = Catalog(spark, settings)
    for line in catalog.sync():
        log.info("catalog: %s", line)
    sc = spark.sparkContext
    jvm.org.apache.spark.sql.hive.thriftserver.HiveThriftServer2.startWithContext(spark._jsparkSession.sqlContext())
    jvm.org.apache.spark.sql.connect.service.SparkConnectService.start(sc._jsc.sc())
    log.info("serving: jdbc:hive2://%s:%d/ and sc://%s:%d/", host, jdbc_port, host, connect_port)
    ready_file = ready_file or Path(settings.home) / "sql" / "ready"
    if ready_file:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        ready_file.write_text(f"jdbc {host}:{jdbc_port}\nconnect {host}:{connect_port}\n")
    stop = stop or threading.Event()
    while not stop.wait(poll):
        try:
            for line in catalog.sync():
                log.info("catalog: %s", line)
        except Exception as exc:  # noqa: BLE001 - the next poll tries again; the endpoints keep serving
            log.warning("catalog: %s", one_line(exc))

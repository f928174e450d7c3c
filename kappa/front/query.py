"""SQL over the serving views without Spark: delta-rs reads the tables, DuckDB runs the query in memory.

Every view declared in ``kappa/platform.yaml`` is queryable under its own name and reads the table its serving
alias points to (:mod:`kappa.control.serving`); so are ``quarantine`` (``<lake>/quarantine``), ``registry``
(``<lake>/_registry/versions``) and ``registry_events`` (``<lake>/_registry/events``). Only the tables whose
name appears in the SQL are loaded.

``table_changes('<view>', <from>[, <to>])`` reads the serving table's change data feed between two of its Delta
versions (inclusive; default to the latest), as Spark SQL's function of that name does: the view's columns plus
``_change_type`` (insert / update_preimage / update_postimage / delete), ``_commit_version`` and
``_commit_timestamp`` (:mod:`kappa.control.changefeed`).

``as_of`` time-travels: an integer is a Delta version of the (single) table the query reads; an ISO timestamp
applies to every table *and* to the alias itself, so the answer is what readers saw at that moment.

Each loaded table's freshness is reported: Delta version, commit time, and for windowed views the
watermark.

Example:
    >>> from kappa.front.query import run_query  # doctest: +SKIP
    >>> res = run_query("SELECT campaign_id, sum(view_count) FROM campaign_window_counts GROUP BY 1")  # doctest: +SKIP
    >>> res.columns, res.freshness["campaign_window_counts"].watermark  # doctest: +SKIP
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import duckdb

from kappa.runtime.deltars import arrow_rows
from kappa.control.registry import (
    _EVENT_COLUMNS,
    _VERSION_COLUMNS,
    AsOfError,
    TableMissing,
    commit_time,
    open_delta,
)
from kappa.errors import KappaError, one_line

__all__ = ["Freshness", "QueryError", "QueryResult", "analyst_spark", "parse_as_of", "run_query"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MISSING_TABLE = re.compile(r"Table with name (\S+) does not exist", re.IGNORECASE)
#: ``table_changes('<view>', <from>[, <to>])``: the serving table's change feed between two Delta versions.
_TABLE_CHANGES = re.compile(r"table_changes\s*\(\s*'([^']*)'\s*,\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)", re.IGNORECASE)


class QueryError(KappaError, ValueError):
    """The query cannot be answered; the message is one line for the CLI."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Freshness:
    """How current one queried table is.

    Attributes:
        table: Name used in the SQL.
        path: Delta table read.
        serving_version: View version served (None for quarantine / registry tables).
        delta_version: Delta version read.
        last_commit: Commit time of that Delta version (UTC), if still in the log.
        watermark: For windowed views, ``max(event column) - delay`` over the rows read.
    """

    table: str
    path: str
    serving_version: int | None
    delta_version: int
    last_commit: datetime | None
    watermark: datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class QueryResult:
    """Answer of :func:`run_query`.

    Attributes:
        columns: Column names, in order.
        types: DuckDB type names of the columns.
        rows: Result rows (timestamps are timezone-aware UTC datetimes).
        freshness: Table name -> freshness, for every table the query loaded.
        as_of: The ``as_of`` argument, if any.
    """

    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]
    freshness: dict[str, Freshness]
    as_of: str | None = None


def parse_as_of(as_of: str | None) -> int | datetime | None:
    """``"12"`` -> Delta version 12; an ISO timestamp -> aware datetime (naive means UTC).

    Raises:
        QueryError: Neither a version number nor an ISO timestamp.
    """
    if as_of is None:
        return None
    text = str(as_of).strip()
    if text.isdigit():
        return int(text)
    try:
        ts = datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(f"--as-of {as_of!r}: expected a Delta version number or an ISO timestamp "
                         "(e.g. 2024-05-01T12:00:00Z)") from None
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=timezone.utc)


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    path: str
    serving_version: int | None
    missing_message: str
    empty_columns: tuple[tuple[str, Any], ...] | None = None  # registry tables: empty when missing


def run_query(sql: str, *, as_of: str | None = None, settings: Any = None, catalog: Any = None) -> QueryResult:
    """Run ``sql`` over the serving views (plus ``quarantine``, ``registry``, ``registry_events``).

    Args:
        sql: DuckDB SQL. External file access is disabled: only the registered tables can be read.
        as_of: Delta version number (for a query over a single table) or ISO timestamp (every table and the
            serving alias, as of that time).
        settings: Platform settings (default: ``Settings.from_env()``).
        catalog: View declarations (default: :func:`kappa.catalog.load_catalog`).

    Returns:
        Columns, rows and per-table freshness.

    Raises:
        QueryError: Bad SQL (DuckDB's message), a view without data, or an impossible ``as_of``.
    """
    if not sql or not sql.strip():
        raise QueryError("empty query")
    if settings is None:
        from kappa.config import Settings

        settings = Settings.from_env()
    if catalog is None:
        from kappa.catalog import load_catalog

        catalog = load_catalog()
    from kappa.control.serving import ServingAlias

    when = parse_as_of(as_of)
    ts = when if isinstance(when, datetime) else None
    lake = settings.lake_uri.rstrip("/")
    serving = ServingAlias(lake, catalog=catalog)
    sql, changes = _table_changes(sql, catalog, serving, ts)
    mentioned = {m.group(0).lower() for m in _IDENT.finditer(sql)}

    sources: list[_Source] = []
    for view, target in serving.targets([v for v in catalog.views if v in mentioned], as_of=ts).items():
        sources.append(_Source(view, target.table_path, target.version,
                               f"view {view} has no data yet: is its job running? (`make run`)"))
    if "quarantine" in mentioned and "quarantine" not in catalog.views:
        sources.append(_Source("quarantine", f"{lake}/quarantine", None,
                               "quarantine has no data yet: is a view job running? (`make run`)"))
    for name, path, columns in (("registry", serving.registry.versions_uri, _VERSION_COLUMNS),
                                ("registry_events", serving.registry.events_uri, _EVENT_COLUMNS)):
        if name in mentioned and name not in catalog.views:
            sources.append(_Source(name, path, None, f"{name} is empty", columns))

    con = duckdb.connect(config={"enable_external_access": False})
    try:
        con.execute("SET TimeZone = 'UTC'")
        freshness: dict[str, Freshness] = {}
        missing: dict[str, str] = {}
        tables: dict[str, Any] = {}
        for name, (data, fresh) in changes.items():
            con.register(name, data)
            freshness[fresh.table] = fresh
        for src in sources:
            try:
                table = open_delta(src.path)
            except TableMissing:
                if src.empty_columns is not None:
                    con.register(src.name, arrow_rows(src.empty_columns, []))
                else:
                    missing[src.name] = src.missing_message  # only an error if DuckDB needs it
                continue
            tables[src.name] = (src, table)
        if isinstance(when, int) and len(tables) > 1:
            raise QueryError(f"--as-of {when} is a Delta version, which is per table; the query reads "
                             f"{', '.join(sorted(tables))}: use an ISO timestamp instead")
        for name, (src, latest) in tables.items():
            try:
                table = latest if when is None else open_delta(src.path, as_of=when)
            except AsOfError as exc:
                raise QueryError(f"{name} {exc}") from None
            data = table.scan().read_all()
            con.register(name, data)
            version = table.version()
            freshness[name] = Freshness(
                table=name, path=src.path, serving_version=src.serving_version, delta_version=version,
                last_commit=commit_time(src.path, version),
                watermark=(_watermark(con, name, data, catalog, src.serving_version)
                           if src.serving_version is not None else None),
            )
        return _execute(con, sql, freshness, missing, names=_queryable(catalog), as_of=as_of)
    finally:
        con.close()


def _table_changes(sql: str, catalog: Any, serving: Any, ts: datetime | None) -> tuple[str, dict[str, Any]]:
    """Replace each ``table_changes('<view>', a[, b])`` by a registered name; returns the SQL and
    ``{name: (Arrow change rows, Freshness)}``."""
    from kappa.control.changefeed import ChangeFeedError, read_changes

    found: dict[str, Any] = {}

    def load(match: re.Match[str]) -> str:
        view, start, end = match.group(1), int(match.group(2)), match.group(3)
        if view not in catalog.views:
            raise QueryError(f"table_changes: {view!r} is not a declared view ({', '.join(catalog.views)})")
        target = serving.target(view, as_of=ts)
        try:
            data = read_changes(target.table_path, start, None if end is None else int(end))
        except ChangeFeedError as exc:
            raise QueryError(f"table_changes('{view}', ...): {exc}") from None
        name = f"__kappa_changes_{len(found)}"
        last = int(end) if end is not None else open_delta(target.table_path).version()
        found[name] = (data, Freshness(table=f"table_changes('{view}', {start}, {last})", path=target.table_path,
                                       serving_version=target.version, delta_version=last,
                                       last_commit=commit_time(target.table_path, last), watermark=None))
        return name

    return _TABLE_CHANGES.sub(load, sql), found


def _queryable(catalog: Any) -> list[str]:
    return [*catalog.views, "quarantine", "registry", "registry_events"]


def _watermark(con: duckdb.DuckDBPyConnection, name: str, data: Any, catalog: Any, version: int) -> datetime | None:
    """The serving version's own watermark rule (:attr:`kappa.runtime.view.ViewDefinition.watermark`) over the
    rows read; None for a version the declarations no longer name."""
    from kappa.runtime.view import load_view

    try:
        spec = load_view(catalog.module_of(name, version)).watermark
    except KappaError:
        return None
    if spec is None or spec[0] not in data.column_names:
        return None
    column, delay = spec[0], timedelta(seconds=spec[1])
    ((micros,),) = con.sql(f'SELECT epoch_us(max("{column}")) FROM "{name}"').fetchall()
    if micros is None:
        return None
    return datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=micros) - delay


def _execute(con: duckdb.DuckDBPyConnection, sql: str, freshness: dict[str, Freshness], missing: dict[str, str],
             *, names: list[str], as_of: str | None) -> QueryResult:
    try:
        rel = con.sql(sql)
        if rel is None:  # a statement without a result (SET, CREATE TEMP TABLE...)
            return QueryResult(columns=[], types=[], rows=[], freshness=freshness, as_of=as_of)
        columns = list(rel.columns)
        types = [str(t) for t in rel.types]
        # DuckDB needs pytz to return TIMESTAMPTZ values; convert to naive UTC in SQL and re-attach UTC here
        exprs, aware = [], []
        for i, typ in enumerate(types, start=1):
            if typ == "TIMESTAMP WITH TIME ZONE":
                exprs.append(f"timezone('UTC', #{i})")
                aware.append(i - 1)
            elif "WITH TIME ZONE" in typ:
                exprs.append(f"CAST(#{i} AS VARCHAR)")
            else:
                exprs.append(f"#{i}")
        raw = rel.project(", ".join(exprs)).fetchall() if exprs else rel.fetchall()
    except duckdb.Error as exc:
        first = one_line(exc)
        hit = _MISSING_TABLE.search(first)
        if hit:
            table = hit.group(1).strip('"').lower()
            if table in missing:
                raise QueryError(missing[table]) from None
            first = f"{first.rstrip('!')}: queryable tables are {', '.join(names)}"
        raise QueryError(first) from None
    rows = raw
    if aware:
        rows = []
        for row in raw:
            values = list(row)
            for i in aware:
                if values[i] is not None:
                    values[i] = values[i].replace(tzinfo=timezone.utc)
            rows.append(tuple(values))
    return QueryResult(columns=columns, types=types, rows=rows, freshness=freshness, as_of=as_of)


def analyst_spark(settings: Any = None, *, database: str = "analytics") -> Any:
    """A SparkSession for analysts: Delta and the Kafka connector on the classpath, its SQL warehouse under
    ``$KAPPA_HOME/warehouse``, and ``<database>.<view>`` defined for every view over the version that serves it
    (:func:`kappa.control.replay.spark_catalog`) - so ``SELECT * FROM analytics.campaign_window_counts`` follows
    promotions and needs no path.

    Example:
        >>> spark = analyst_spark()  # doctest: +SKIP
        >>> spark.sql("SELECT count(*) FROM analytics.events_raw").show()  # doctest: +SKIP
    """
    from kappa.config import Settings
    from kappa.control.replay import spark_catalog
    from kappa.runtime.spark import build_spark

    settings = settings or Settings.from_env()
    spark = build_spark("kappa-analyst", settings, call_sites=True)  # an analyst's errors name their line
    spark_catalog(spark, settings, database=database)
    return spark

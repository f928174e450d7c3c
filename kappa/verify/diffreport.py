"""The diff report before a promotion: how a verified view version's table differs from the serving one's.

Verification proves the new table is what its transform computes from the log; whether that is the *intended*
logic change is a human judgement. The report gives the operator what to judge by, per key:

* ``added`` (keys only in the new table), ``removed`` (only in the serving one), ``changed`` (in both, a value
  differs in a column both tables have), ``unchanged``;
* the same counts per bucket of the first time key (``window_start``, ``session_start``: truncated to the
  minute, hour or day so that at most ~48 buckets remain), else per value (or first character) of the first key;
* up to 5 examples per kind with the old and new values;
* a PNG (stacked bars of added / removed / changed per bucket).

Written as ``diff-v<new>-vs-v<serving>.json`` and ``.png`` under the version's folder (``views/<view>/v<N>/
reports/`` on a local lake, else ``$KAPPA_HOME/reports/<view>/v<N>/``); the CLI prints the paths, the Airflow
``verify`` task logs the summary per bucket and returns the report in its XCom.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

__all__ = ["DiffReport", "diff_report"]

log = logging.getLogger("kappa.verify.diffreport")

#: At most about this many buckets in the breakdown.
MAX_BUCKETS = 48
_UNITS = (("second", 1), ("minute", 60), ("hour", 3600), ("day", 86400), ("week", 7 * 86400), ("month", 31 * 86400),
          ("year", 366 * 86400))
_KINDS = {"missing": "added", "extra": "removed", "different": "changed"}


@dataclass(frozen=True, kw_only=True)
class DiffReport:
    """What changes for readers if ``version`` replaces ``serving_version`` (see the module doc)."""

    view: str
    version: int
    serving_version: int
    delta_version: int
    serving_delta_version: int
    keys: list[str]
    compared: list[str]
    only_new_columns: list[str]
    only_old_columns: list[str]
    rows_new: int
    rows_old: int
    added: int
    removed: int
    changed: int
    unchanged: int
    bucket_by: str | None
    buckets: list[dict[str, Any]] = field(default_factory=list)
    examples: dict[str, list[str]] = field(default_factory=dict)
    json_path: str = ""
    png_path: str | None = None

    def summary(self) -> str:
        """One line: the counts and where the report is."""
        return (f"diff v{self.version} vs serving v{self.serving_version}: {self.added:,} keys added, "
                f"{self.removed:,} removed, {self.changed:,} changed, {self.unchanged:,} unchanged "
                f"(report {self.json_path}" + (f", plot {self.png_path}" if self.png_path else "") + ")")

    def lines(self) -> list[str]:
        """The breakdown and the examples, for a task log or a terminal."""
        out = [f"{'bucket (' + (self.bucket_by or '-') + ')':<40} {'added':>9} {'removed':>9} {'changed':>9}"]
        out += [f"{b['bucket']:<40} {b['added']:>9,} {b['removed']:>9,} {b['changed']:>9,}" for b in self.buckets]
        for kind, examples in self.examples.items():
            out += [f"{kind}: {e}" for e in examples]
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def diff_report(spark: "SparkSession", *, view: str, version: int, table: str, delta_version: int,
                serving_version: int, serving_table: str, keys: Sequence[str], out_dir: Path) -> DiffReport:
    """Compare ``table`` at ``delta_version`` with the serving version's table (latest) and write the report."""
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from kappa.verify.compare import match_keys

    # pinned: the serving job may commit while the report is computed
    serving_delta = int(DeltaTable.forPath(spark, serving_table).history(1).collect()[0]["version"])
    new = spark.read.format("delta").option("versionAsOf", delta_version).load(table)
    old = spark.read.format("delta").option("versionAsOf", serving_delta).load(serving_table)
    shared_keys = [k for k in keys if k in old.columns]
    compared = [c for c in new.columns if c in old.columns and c not in keys]
    common: dict[str, Any] = dict(view=view, version=version, serving_version=serving_version,
                                  delta_version=delta_version, serving_delta_version=serving_delta, keys=list(keys),
                                  compared=compared, only_new_columns=[c for c in new.columns if c not in old.columns],
                                  only_old_columns=[c for c in old.columns if c not in new.columns])
    stem = out_dir / f"diff-v{version}-vs-v{serving_version}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not keys or len(shared_keys) != len(keys):
        rows_new, rows_old = new.count(), old.count()
        report = DiffReport(**common, rows_new=rows_new, rows_old=rows_old, added=rows_new, removed=rows_old,
                            changed=0, unchanged=0, bucket_by=None,
                            examples={"note": ["the tables share no key: every row counts as added or removed"]},
                            json_path=f"{stem}.json")
        Path(report.json_path).write_text(json.dumps(report.to_dict(), indent=2, default=str))
        return report
    by = next((k for k in keys if _is_time(new.schema[k].dataType)), keys[0])
    time_key = _is_time(new.schema[by].dataType)
    joined = match_keys(new.dropDuplicates(list(keys)), old.dropDuplicates(list(keys)), keys=list(keys),
                     values=compared).persist()
    try:
        differs = F.col("_kind").isNotNull()
        # one job: the row counts, the differences per kind, and the span (or spread) of the bucket key
        spread = ([F.min(F.when(differs, F.col(by))).alias("low"), F.max(F.when(differs, F.col(by))).alias("high")]
                  if time_key else [F.approx_count_distinct(F.when(differs, F.col(by))).alias("distinct")])
        totals = joined.agg(F.count("_in_e").alias("rows_new"), F.count("_in_t").alias("rows_old"),
                            *[F.count(F.when(F.col("_kind") == kind, True)).alias(label)
                              for kind, label in _KINDS.items()], *spread).collect()[0]
        counts = {label: int(totals[label]) for label in _KINDS.values()}
        bucket_col, bucket = _bucket(by, time_key, totals)
        buckets: dict[str, dict[str, Any]] = {}
        examples: dict[str, list[str]] = {}
        if any(counts.values()):
            diffs = joined.where(differs)
            for r in (diffs.withColumn("_bucket", bucket).groupBy("_bucket", "_kind").count()
                      .orderBy("_bucket").collect()):
                name = _text(r["_bucket"])
                slot = buckets.setdefault(name, {"bucket": name, "added": 0, "removed": 0, "changed": 0})
                slot[_KINDS[r["_kind"]]] += r["count"]
            first = (diffs.withColumn("_rn", F.row_number().over(Window.partitionBy("_kind").orderBy(*keys)))
                     .where(F.col("_rn") <= 5).orderBy(*keys).collect())
            for kind, label in _KINDS.items():
                found = [_example(r, keys, compared, kind) for r in first if r["_kind"] == kind]
                if found:
                    examples[label] = found
    finally:
        joined.unpersist()
    rows_new, rows_old = int(totals["rows_new"]), int(totals["rows_old"])
    unchanged = rows_new - counts["added"] - counts["changed"]
    report = DiffReport(**common, rows_new=rows_new, rows_old=rows_old, added=counts["added"],
                        removed=counts["removed"], changed=counts["changed"], unchanged=max(0, unchanged),
                        bucket_by=bucket_col, buckets=list(buckets.values()), examples=examples,
                        json_path=f"{stem}.json",
                        png_path=_plot(list(buckets.values()), f"{stem}.png", view, version, serving_version,
                                       bucket_col))
    Path(report.json_path).write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return report


def _is_time(dtype: Any) -> bool:
    from pyspark.sql.types import DateType, TimestampNTZType, TimestampType

    return isinstance(dtype, (TimestampType, TimestampNTZType, DateType))


def _bucket(column: str, time_key: bool, totals: Any) -> tuple[str, Any]:
    """(description, Column) of the breakdown: a time key truncated to a unit giving <= ~48 buckets over the span
    of the differences, else the key's value (few distinct) or its first character."""
    from pyspark.sql import functions as F

    if time_key:
        low, high = totals["low"], totals["high"]
        span = (high - low).total_seconds() if low is not None and high is not None else 0
        unit = next((u for u, seconds in _UNITS if span / seconds <= MAX_BUCKETS), "year")
        return f"{column} per {unit}", F.date_trunc(unit, F.col(column)).cast("string")
    if totals["distinct"] <= MAX_BUCKETS:
        return column, F.col(column).cast("string")
    return f"{column} by first character", F.substring(F.col(column).cast("string"), 1, 1)


def _text(value: Any) -> str:
    return "(null)" if value is None else str(value)


def _example(row: Any, keys: Sequence[str], compared: Sequence[str], kind: str) -> str:
    key = ", ".join(f"{k}={_text(row[k])}" for k in keys)
    if kind == "missing":
        return f"({key}) new: " + ", ".join(f"{c}={_text(row[f'e_{c}'])}" for c in compared)
    if kind == "extra":
        return f"({key}) old: " + ", ".join(f"{c}={_text(row[f't_{c}'])}" for c in compared)
    changed = [c for c in compared if row[f"e_{c}"] != row[f"t_{c}"]]
    return f"({key}) " + ", ".join(f"{c}: {_text(row[f't_{c}'])} -> {_text(row[f'e_{c}'])}" for c in changed)


def _plot(buckets: list[dict[str, Any]], path: str, view: str, version: int, serving: int,
          bucket_by: str) -> str | None:
    """Stacked bars of added / removed / changed keys per bucket."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency; the JSON report stands alone
        return None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [b["bucket"] for b in buckets] or ["(no difference)"]
    bottom = [0] * len(names)
    for kind, color in (("added", "#2e7d32"), ("removed", "#c62828"), ("changed", "#f9a825")):
        heights = [b[kind] for b in buckets] or [0]
        ax.bar(range(len(names)), heights, bottom=bottom, color=color, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("keys")
    ax.set_xlabel(bucket_by)
    ax.set_title(f"{view}: v{version} vs serving v{serving}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

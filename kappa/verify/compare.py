"""Comparing a view version's table with what it should hold: by key (missing, extra, different, duplicated
keys, the first difference named), or as a multiset of rows for a view without keys. Shared by the recompute
(:mod:`kappa.verify.recompute`), the oracle check and the diff report (:mod:`kappa.verify.diffreport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, Row

__all__ = ["Check", "compare", "match_keys"]

_EXAMPLES = 5


@dataclass(frozen=True, kw_only=True)
class Check:
    """The outcome of one check of a view version's table (``recompute`` or ``oracle``).

    Attributes:
        name: ``recompute`` or ``oracle``.
        passed: The table equals the expected result.
        rows: Rows in the table.
        expected_rows: Rows the check computed.
        missing: Keys (rows, for a view without keys) expected and not in the table.
        extra: Keys in the table and not expected.
        different: Keys in both with different values.
        duplicates: Keys present more than once in the table.
        first_difference: The first differing key (in key order) and what differs, or None.
        examples: Up to 5 differences, one line each.
        details: What else the check measured (batches re-run, seconds, quarantine counts).
        message: One human line.
    """

    name: str
    passed: bool
    rows: int = 0
    expected_rows: int = 0
    missing: int = 0
    extra: int = 0
    different: int = 0
    duplicates: int = 0
    first_difference: str | None = None
    examples: tuple[str, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["examples"] = list(self.examples)
        return out


def _fmt(value: Any) -> str:
    return repr(value.isoformat(sep=" ") if hasattr(value, "isoformat") else value)


def _key_text(row: "Row", keys: Iterable[str]) -> str:
    return "(" + ", ".join(f"{k}={_fmt(row[k])}" for k in keys) + ")"


def compare(expected: "DataFrame", table: "DataFrame", *, keys: Sequence[str], name: str) -> Check:
    """Compare the expected rows with the table's over the table's columns.

    With ``keys``: rows are matched by key (null-safe); missing, extra, different and duplicated keys are counted
    (one Spark job when they are equal, a second one for the examples when not) and the first differing key in
    key order is named with the columns that differ. Without keys the two are compared as multisets of rows.
    """
    from pyspark.sql import functions as F

    columns = table.columns
    absent = [c for c in columns if c not in expected.columns]
    if absent:
        return Check(name=name, passed=False, rows=table.count(),
                     message=f"{name}: the transform's output has no column(s) {', '.join(absent)} the table has")
    expected = expected.select(*columns)
    if not keys:
        return _compare_rows(expected, table, columns, name)
    keys = list(keys)
    values = [c for c in columns if c not in keys]
    # the table once per key, with how many rows it holds for it
    per_key = table.groupBy(*keys).agg(F.count(F.lit(1)).alias("_n"), *[F.first(c).alias(c) for c in values])
    joined = match_keys(expected, per_key, keys=keys, values=values, carry=("_n",))
    duplicated = F.col("_n") > 1
    totals = joined.agg(
        F.coalesce(F.sum("_n"), F.lit(0)).alias("rows"), F.count("_in_e").alias("expected_rows"),
        *[F.count(F.when(F.col("_kind") == kind, True)).alias(kind) for kind in ("missing", "extra", "different")],
        F.count(F.when(duplicated, True)).alias("duplicates")).collect()[0]
    counts = {kind: int(totals[kind]) for kind in ("missing", "extra", "different") if totals[kind]}
    n_table, n_expected, n_dups = int(totals["rows"]), int(totals["expected_rows"]), int(totals["duplicates"])
    first = [] if not counts and not n_dups else (
        joined.where(F.col("_kind").isNotNull() | duplicated).orderBy(*keys).limit(_EXAMPLES).collect())
    examples = [f"{_key_text(r, keys)}: {r['_n']} rows in the table" if (r["_n"] or 0) > 1 and r["_kind"] is None
                else _describe(r, keys, values, name) + (f" ({r['_n']} rows in the table)" if (r["_n"] or 0) > 1
                                                         else "") for r in first]
    passed = not counts and not n_dups
    first_difference = examples[0] if examples else None
    if passed:
        message = f"{n_table:,} rows equal the {name}"
    else:
        message = (f"differs from the {name}: {counts.get('missing', 0)} missing, {counts.get('extra', 0)} extra, "
                   f"{counts.get('different', 0)} different, {n_dups} duplicated keys; first differing key "
                   f"{first_difference}")
    return Check(name=name, passed=passed, rows=n_table, expected_rows=n_expected,
                 missing=counts.get("missing", 0), extra=counts.get("extra", 0),
                 different=counts.get("different", 0), duplicates=n_dups, first_difference=first_difference,
                 examples=tuple(examples[:_EXAMPLES]), message=message)


def match_keys(left: "DataFrame", right: "DataFrame", *, keys: Sequence[str], values: Sequence[str],
            carry: Sequence[str] = ()) -> "DataFrame":
    """Every key of ``left`` and ``right`` (each unique per key), matched null-safe by a full outer join: the key
    columns, each value as ``e_<column>`` (left) and ``t_<column>`` (right), ``_in_e`` / ``_in_t`` (true where
    that side has the key), the ``carry`` columns of ``right`` unchanged, and ``_kind``: ``missing`` (only in
    ``left``), ``extra`` (only in ``right``), ``different`` (a value of ``values`` differs) or null (equal)."""
    from pyspark.sql import functions as F

    e = left.select(*keys, *[F.col(c).alias(f"e_{c}") for c in values], F.lit(True).alias("_in_e"))
    t = right.select(*keys, *[F.col(c).alias(f"t_{c}") for c in values], *carry, F.lit(True).alias("_in_t"))
    cond = None
    for k in keys:
        c = e[k].eqNullSafe(t[k])
        cond = c if cond is None else cond & c
    joined = e.join(t, cond, "full_outer").select(
        *[F.coalesce(e[k], t[k]).alias(k) for k in keys], "_in_e", "_in_t",
        *[f"e_{c}" for c in values], *[f"t_{c}" for c in values], *carry)
    same = F.lit(True)
    for c in values:
        same = same & F.col(f"e_{c}").eqNullSafe(F.col(f"t_{c}"))
    kind = (F.when(F.col("_in_t").isNull(), F.lit("missing")).when(F.col("_in_e").isNull(), F.lit("extra"))
            .when(~same, F.lit("different")))
    return joined.withColumn("_kind", kind)


def _sort_key(values: tuple) -> tuple:
    return tuple((v is not None, v) for v in values)


def _describe(row: "Row", keys: Sequence[str], values: Sequence[str], name: str) -> str:
    key = _key_text(row, keys)
    if row["_kind"] == "missing":
        return f"{key}: missing from the table ({name}: " + ", ".join(
            f"{c}={_fmt(row[f'e_{c}'])}" for c in values) + ")"
    if row["_kind"] == "extra":
        return f"{key}: in the table only (" + ", ".join(f"{c}={_fmt(row[f't_{c}'])}" for c in values) + ")"
    changed = [c for c in values if row[f"e_{c}"] != row[f"t_{c}"]]
    return f"{key}: " + ", ".join(f"{c} table={_fmt(row[f't_{c}'])} {name}={_fmt(row[f'e_{c}'])}" for c in changed)


def _compare_rows(expected: "DataFrame", table: "DataFrame", columns: list[str], name: str) -> Check:
    """Multiset comparison of whole rows (a view without keys): how often each distinct row occurs on each side
    (grouping matches nulls), in one Spark job when they are equal."""
    from pyspark.sql import functions as F

    side = F.col("_side")
    both = (expected.withColumn("_side", F.lit(1)).unionByName(table.withColumn("_side", F.lit(-1)))
            .groupBy(*columns).agg(F.count(F.when(side == 1, True)).alias("_e"),
                                   F.count(F.when(side == -1, True)).alias("_t")))
    totals = both.agg(F.coalesce(F.sum("_e"), F.lit(0)).alias("expected"),
                      F.coalesce(F.sum("_t"), F.lit(0)).alias("rows"),
                      F.coalesce(F.sum(F.greatest(F.col("_e") - F.col("_t"), F.lit(0))), F.lit(0)).alias("missing"),
                      F.coalesce(F.sum(F.greatest(F.col("_t") - F.col("_e"), F.lit(0))), F.lit(0)).alias("extra")
                      ).collect()[0]
    n_table, n_expected = int(totals["rows"]), int(totals["expected"])
    n_missing, n_extra = int(totals["missing"]), int(totals["extra"])
    examples: list[str] = []
    if n_missing or n_extra:
        for r in both.where(F.col("_e") != F.col("_t")).orderBy(*columns).limit(_EXAMPLES).collect():
            examples.append(f"row missing from the table: {_key_text(r, columns)}" if r["_e"] > r["_t"] else
                            f"row in the table only (or once too often): {_key_text(r, columns)}")
    passed = not (n_missing or n_extra)
    message = (f"{n_table:,} rows equal the {name}" if passed else
               f"differs from the {name}: {n_missing} rows missing, {n_extra} extra or doubled; e.g. {examples[0]}")
    return Check(name=name, passed=passed, rows=n_table, expected_rows=n_expected, missing=n_missing, extra=n_extra,
                 first_difference=examples[0] if examples else None, examples=tuple(examples), message=message)

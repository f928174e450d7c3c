"""kappa.verify.compare.compare: the table against an expected result, by key or as a multiset of rows.

Real Spark DataFrames with hand-written rows, so each kind of difference is known in advance: a key missing from
the table, one only in the table, a value that differs, a key the table holds twice, and null keys and values
(matched null-safe: a null equals a null, never a value).
"""

from __future__ import annotations

import pytest

from kappa.verify.compare import compare

pytestmark = pytest.mark.integration

SCHEMA = "k1 STRING, k2 INT, n BIGINT, label STRING"
EXPECTED = [("a", 1, 10, "x"), ("a", 2, 20, None), ("b", 1, 30, "y"), (None, 1, 40, "z"), ("c", None, 50, "w")]


def _check(spark, table_rows, *, keys=("k1", "k2"), expected=EXPECTED):
    return compare(spark.createDataFrame(expected, SCHEMA), spark.createDataFrame(table_rows, SCHEMA),
                   keys=list(keys), name="recompute")


def test_an_equal_table_passes_with_nulls_in_keys_and_values(spark) -> None:
    check = _check(spark, list(reversed(EXPECTED)))
    assert check.passed and check.message == "5 rows equal the recompute", check
    assert (check.rows, check.expected_rows, check.first_difference) == (5, 5, None)


def test_each_kind_of_difference_is_counted_and_the_first_key_in_order_is_named(spark) -> None:
    table = [("a", 1, 10, "x"),          # equal
             ("a", 2, 20, "not null"),   # different: a null became a value
             ("b", 1, 30, "y"), ("b", 1, 30, "y"),  # the same key twice
             ("c", None, 51, "w"),       # different under a null key part
             ("d", 9, 1, "only here")]   # extra; (None, 1) is missing
    check = _check(spark, table)
    assert not check.passed
    assert (check.missing, check.extra, check.different, check.duplicates) == (1, 1, 2, 1), check
    assert (check.rows, check.expected_rows) == (6, 5)
    # key order puts nulls first: the missing (None, 1) row is the first difference
    assert check.first_difference == "(k1=None, k2=1): missing from the table (recompute: n=40, label='z')", check
    assert "(k1='a', k2=2): label table='not null' recompute=None" in check.examples, check.examples
    assert "(k1='b', k2=1): 2 rows in the table" in check.examples, check.examples
    assert "(k1='c', k2=None): n table=51 recompute=50" in check.examples, check.examples
    assert "(k1='d', k2=9): in the table only (n=1, label='only here')" in check.examples, check.examples
    assert check.message.startswith("differs from the recompute: 1 missing, 1 extra, 2 different, 1 duplicated keys")


def test_a_column_the_transform_does_not_produce_fails_with_its_name(spark) -> None:
    expected = spark.createDataFrame([("a", 1)], "k1 STRING, k2 INT")
    check = compare(expected, spark.createDataFrame([("a", 1, 10, "x")], SCHEMA), keys=["k1", "k2"], name="oracle")
    assert not check.passed and check.message == "oracle: the transform's output has no column(s) n, label the table has"


def test_without_keys_rows_are_compared_as_a_multiset(spark) -> None:
    same = _check(spark, [EXPECTED[2], *EXPECTED[:2], *EXPECTED[3:]], keys=())
    assert same.passed and same.rows == 5, same
    doubled = _check(spark, [*EXPECTED, EXPECTED[3]], keys=())  # a row with a null applied twice
    assert (doubled.passed, doubled.missing, doubled.extra, doubled.rows) == (False, 0, 1, 6), doubled
    assert doubled.first_difference == "row in the table only (or once too often): (k1=None, k2=1, n=40, label='z')"
    lost = _check(spark, EXPECTED[1:], keys=())
    assert (lost.missing, lost.extra) == (1, 0) and "row missing from the table: (k1='a', k2=1" in lost.message

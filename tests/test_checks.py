"""The pure parts of verification, expectations and the watch (no broker, no Spark)."""

from __future__ import annotations

import json

import pytest

from kappa.runtime.lineage import batch_metadata, batches_from_history, expectations_from_history, with_expectations
from kappa.runtime.lineage import BatchBoundary
from kappa.runtime.rerun import RecomputeError, plan_steps
from kappa.runtime.view import Expectation
from kappa.control.replay.watch import WatchPolicy, _judge

APP = "kappa:v@v1:run"


def _commit(batch: int, ends: dict[int, int], *, rows: int | None = None, violations: dict | None = None,
            app: str = APP, lookups: dict | None = None) -> dict:
    meta = batch_metadata(app_id=app, batch_id=batch, topic="t", end_offsets=ends, watermark_ms=batch * 10,
                          lookups=lookups)
    if rows is not None:
        meta = with_expectations(meta, rows, violations or {})
    return {"userMetadata": meta}


def test_plan_marks_data_and_no_data_batches_and_refuses_gaps():
    batches = [BatchBoundary(0, {0: 5, 1: 3}), BatchBoundary(1, {0: 5, 1: 3}, 100), BatchBoundary(2, {0: 9, 1: 3})]
    steps, ends = plan_steps(batches, {0: 0, 1: 0})
    assert [s.data for s in steps] == [True, False, True], "batch 1 read nothing: a no-data batch"
    assert ends == {0: [5, 5, 9], 1: [3, 3, 3]}
    with pytest.raises(RecomputeError, match=r"batches 1-2, 4 are no longer recorded"):
        plan_steps([BatchBoundary(0, {0: 1}), BatchBoundary(3, {0: 2}), BatchBoundary(5, {0: 3})], {})
    with pytest.raises(RecomputeError, match=r"batches 1-3, 7, 9-10 are"):
        plan_steps([BatchBoundary(i, {0: i}) for i in (0, 4, 5, 6, 8, 11)], {})


def test_lineage_carries_lookups_and_expectation_counts_once_per_batch():
    history = [_commit(0, {0: 5}, rows=10, violations={"a": 2}, lookups={"campaigns": {0: 7}}),
               _commit(1, {0: 8}, rows=4, violations={"a": 1, "b": 3}),
               _commit(1, {0: 8}, rows=4, violations={"a": 1, "b": 3}),  # the same batch seen twice (staging)
               _commit(0, {0: 5}, rows=99, violations={"a": 99}, app="kappa:v@v1:other")]
    assert batches_from_history(history, APP)[0].lookups == {"campaigns": {0: 7}}
    assert expectations_from_history(history, APP) == (14, {"a": 3, "b": 3})
    assert expectations_from_history(history, APP, upto=0) == (10, {"a": 2})
    assert json.loads(history[1]["userMetadata"])["kappa"]["expectations"] == {"rows": 4,
                                                                             "violations": {"a": 1, "b": 3}}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "Bad-Name", "condition": "x > 0"}, "lower_snake_case"),
    ({"name": "ok", "condition": "x > 0", "on_violation": "explode"}, "use warn, drop or fail"),
    ({"name": "ok", "condition": "  "}, "empty condition"),
    ({"name": "ok", "condition": "x > 0", "max_violation_rate": 1.5}, r"within \[0, 1\]"),
])
def test_expectations_are_validated_when_declared(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Expectation(**kwargs)
    assert Expectation("ok", "x > 0", "drop").reason == "expectation ok: x > 0"


def test_watch_judges_the_window_since_the_switch_not_the_run():
    policy = WatchPolicy(minutes=1, poll_seconds=1, max_quarantine_rate=0.1, min_records=100)
    base = {"kappa_input_rows_total": 10_000.0, "kappa_quarantined_records_total": 5_000.0}
    # half of the run before the switch was quarantined; since the switch 5 of 200: healthy
    calm = {"kappa_input_rows_total": 10_200.0, "kappa_quarantined_records_total": 5_005.0}
    assert not _judge(calm, base, policy, {}).startswith("!")
    # too few records since the switch to judge a rate
    assert not _judge({"kappa_input_rows_total": 10_050.0, "kappa_quarantined_records_total": 5_050.0}, base,
                      policy, {}).startswith("!")
    bad = {"kappa_input_rows_total": 10_200.0, "kappa_quarantined_records_total": 5_100.0}
    assert _judge(bad, base, policy, {}) == "!100 of the 200 records read since the switch went to the quarantine " \
                                            "(50.0% > 10.0%)"
    rules = {"kappa_expectation_rows_checked_total": 300.0, "kappa_expectation_violations_total:pos": 90.0,
             **calm}
    assert _judge(rules, {**base, "kappa_expectation_rows_checked_total": 0.0}, policy, {"pos": 0.2}) == \
        "!expectation pos broke on 90 of 300 rows since the switch (30.0% > 20.0%)"
    with pytest.raises(ValueError):
        WatchPolicy(minutes=-1)


def test_a_query_failure_is_told_by_the_python_error_inside_it():
    from kappa.runtime.job import failure_line

    text = ("An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):\n"
            '  File "batch.py", line 9, in check\n    raise ExpectationFailed(...)\n'
            "kappa.runtime.batch.ExpectationFailed: v@v3: expectation e (x > 0) failed on 2 of 5 rows\n"
            "\tat org.apache.spark.Foo(Foo.java:1)\norg.apache.spark.SparkException: wrapped\n")
    assert failure_line(text) == "ExpectationFailed: v@v3: expectation e (x > 0) failed on 2 of 5 rows"
    assert failure_line("[STREAM_FAILED] Query x terminated\nmore") == "[STREAM_FAILED] Query x terminated"

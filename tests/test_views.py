"""The four views, run by the real plumbing on the real broker, equal an independent recomputation.

Includes the bad-input flood: 30 % malformed records (invalid JSON, wrong types, missing fields, oversized
values, null keys, unknown enum values) never stop a job and land exactly once in quarantine.
"""

from __future__ import annotations

import pytest

from kappa import generator
from kappa.job import ViewJob, ViewPaths
from kappa.view import load_view
from tests.views_oracle import assert_views_match

pytestmark = pytest.mark.integration

VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")


def _run_all(spark, settings, **options) -> None:
    for name in VIEWS:
        job = ViewJob(load_view(f"jobs.{name}.v1"), settings, spark=spark, starting="earliest",
                      available_now=True, **options)
        job.start()
        try:
            assert job.await_termination(600), f"{name} did not finish"
            assert job.failure() is None, job.failure()
        finally:
            job.stop()


def test_views_match_oracle_with_30_percent_bad_records(spark, kafka, declared_topics, lake):
    u = generator.universe(seed=11, campaigns=20, users=400)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    # KTable semantics: a remap and a tombstone after the first value; plus bad mapping records
    ads = list(mapping)
    generator.publish_campaigns(lake, {ads[0]: u.campaigns[-1], ads[1]: None}, topic=lake.topic("campaigns"))
    generator.produce(lake, lake.topic("campaigns"), [(None, b'{"campaign_id": "x"}'), (ads[2].encode(), b"{nope")])
    stream = generator.events(6000, seed=11, universe=u, start_ms=1_700_000_000_000, rate_per_s=25,
                              late_fraction=0.1, max_lateness_ms=5000, malformed_fraction=0.3)
    result = generator.produce(lake, lake.topic("ad-events"), stream)
    assert result.delivered == 6000

    _run_all(spark, lake)
    stats = assert_views_match(spark, lake)
    # the flood really was a flood, and nothing was lost: valid + quarantined == consumed
    assert stats["valid"] + stats["quarantined"] == stats["consumed"]
    assert stats["quarantined"] >= 0.25 * stats["consumed"]
    assert stats["final_windows"] > 0 and stats["sessions"] > 0
    reasons = {r.error for r in spark.read.format("delta").load(ViewPaths(lake.lake_uri, "events_raw", 1).quarantine)
               .where("view = 'events_raw'").select("error").distinct().collect()}
    assert {"null key", "malformed JSON"} <= reasons or len(reasons) >= 4, reasons

    # running again over the same log is a no-op: the checkpoint is complete, nothing is duplicated
    _run_all(spark, lake)
    assert assert_views_match(spark, lake) == stats


def test_second_driver_for_same_version_is_refused(spark, kafka, declared_topics, lake):
    from kappa.lock import DriverAlreadyRunning

    view = load_view("jobs.events_raw.v1")
    first = ViewJob(view, lake, spark=spark, starting="latest")
    first.start()
    try:
        with pytest.raises(DriverAlreadyRunning, match="already running"):
            ViewJob(view, lake, spark=spark, starting="latest").start()
    finally:
        first.stop()
    # once the first one stopped, a new driver may take over the same checkpoint
    again = ViewJob(view, lake, spark=spark, starting="latest")
    again.start()
    again.stop()

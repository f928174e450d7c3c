"""The four views, run by the real plumbing on the real broker, equal an independent recomputation.

Includes the bad-input flood: 30 % malformed records (invalid JSON, wrong types, missing fields, oversized
values, null keys, unknown enum values) never stop a job and land exactly once in quarantine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kappa import generator
from kappa.job import ViewJob, ViewPaths
from kappa.view import load_view
from tests.helpers import committed_batches, delta_txns
from tests.views_oracle import assert_views_match

pytestmark = pytest.mark.integration

VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")


def _run_all(spark, settings, bounds: dict[str, int] | None = None) -> None:
    for name in VIEWS:
        job = ViewJob(load_view(f"jobs.{name}.v1"), settings, spark=spark, starting="earliest",
                      available_now=True, max_offsets_per_trigger=(bounds or {}).get(name))
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


def _operations(table: str) -> list[str]:
    """Operations of a Delta table's commits, oldest first (plain reading of _delta_log)."""
    ops = []
    for commit in sorted(Path(table, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "commitInfo" in action:
                ops.append(action["commitInfo"]["operation"])
    return ops


def test_bounded_catch_up_stages_batches_and_writes_the_table_once(spark, kafka, declared_topics, lake):
    """A run catching up in bounded micro-batches appends them to its staging table and writes its view table
    once, without MERGE; the result equals the oracle; after catching up the run merges as usual."""
    u = generator.universe(seed=12, campaigns=8, users=120)
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(lake, mapping, topic=lake.topic("campaigns"))
    ads = list(mapping)
    generator.publish_campaigns(lake, {ads[0]: u.campaigns[-1], ads[1]: None}, topic=lake.topic("campaigns"))
    stream = generator.events(3000, seed=12, universe=u, start_ms=1_700_000_000_000, rate_per_s=25,
                              late_fraction=0.1, max_lateness_ms=5000, malformed_fraction=0.05)
    generator.produce(lake, lake.topic("ad-events"), stream)

    _run_all(spark, lake, bounds={"events_raw": 500, "campaign_catalog": 6, "campaign_window_counts": 400,
                                  "user_sessions": 500})
    stats = assert_views_match(spark, lake)
    for name in ("campaign_window_counts", "campaign_catalog"):
        paths = ViewPaths(lake.lake_uri, name, 1)
        staged = {r[0] for r in spark.read.format("delta").load(paths.staging).select("_kappa_batch").collect()}
        batches = committed_batches(f"{paths.checkpoint}/main")
        assert len(staged) >= 3, f"{name}: only batches {sorted(staged)} were staged"
        assert max(staged) < batches[-1], f"{name}: the last batch must not be staged"
        ops = _operations(paths.table)
        assert "MERGE" not in ops, f"{name} merged while catching up: {ops}"
        app = next(a for a in delta_txns(paths.table) if a.startswith(f"kappa:{name}@v1:") and "/" not in a)
        assert delta_txns(paths.table)[app] == batches[-1]
        assert not (set(_operations(paths.staging)) - {"WRITE", "CREATE TABLE"})

    # the run caught up: new records are merged into the table (updates, finality), still equal to the oracle
    generator.produce(lake, lake.topic("ad-events"), generator.events(
        600, seed=13, universe=u, start_ms=1_700_000_000_000 + 3000 * 40, rate_per_s=25))
    # a catalog change no event refers to (a remap of a used ad would change old windows in the oracle only)
    generator.publish_campaigns(lake, {"00000000-0000-4000-8000-000000000001": u.campaigns[0]},
                                topic=lake.topic("campaigns"))
    _run_all(spark, lake)
    after = assert_views_match(spark, lake)
    assert after["valid"] > stats["valid"]
    for name in ("campaign_window_counts", "campaign_catalog"):
        assert "MERGE" in _operations(ViewPaths(lake.lake_uri, name, 1).table), name


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

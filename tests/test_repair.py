"""Partial-range replay: one range of windows of the serving version rebuilt from the log, verified, and swapped
into the serving table in one Delta commit (kappa.control.replay.repair), with a reader watching throughout."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from pathlib import Path

import pytest

from kappa.control.replay import ReplayError
from kappa.control.replay.repair import repair_range
from kappa.identity import ViewPaths
from kappa.log import generator
from kappa.runtime.job import ViewJob
from kappa.runtime.view import load_view
from kappa.verify import oracle
from tests.conftest import subprocess_env

pytestmark = pytest.mark.integration

VIEW = "campaign_window_counts"
T0 = 1_700_200_000_000  # a whole 10 s


def _run(spark, settings) -> None:
    job = ViewJob(load_view(f"jobs.{VIEW}.v1"), settings, spark=spark, starting="earliest", available_now=True)
    job.start()
    try:
        assert job.await_termination(300) and job.failure() is None, job.failure()
    finally:
        job.stop()


def _windows(table: str, version: int | None = None) -> dict[tuple, tuple]:
    from deltalake import DeltaTable

    from kappa.control.replay import table_rows

    rows = table_rows(DeltaTable(table, version=version))[1]
    return {(r["campaign_id"], oracle.epoch_ms(r["window_start"])): (r["view_count"], r["is_final"]) for r in rows}


@pytest.mark.timeout(1200)  # four recomputes of the log; 815 s on 2 shared, loaded cores with five
def test_a_repaired_range_is_swapped_in_one_commit_and_nothing_else_changes(spark, kafka, declared_topics, lake,
                                                                            monkeypatch, capsys):
    from deltalake import DeltaTable

    u = generator.universe(seed=51, campaigns=4, users=60)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    topic = lake.topic("ad-events")
    generator.produce(lake, topic, generator.events(1500, seed=51, universe=u, start_ms=T0, rate_per_s=10))
    _run(spark, lake)
    # the fix for [30 s, 60 s): corrected records re-produced long after the watermark passed them, then more
    # on-time traffic - the live job drops the fix as late
    start, end = T0 + 30_000, T0 + 60_000
    fix = list(generator.events(120, seed=52, universe=u, start_ms=start, rate_per_s=4))
    generator.produce(lake, topic, fix)
    generator.produce(lake, topic, generator.events(300, seed=53, universe=u, start_ms=T0 + 150_000, rate_per_s=10))
    _run(spark, lake)

    table = ViewPaths(lake.lake_uri, VIEW, 1).table
    before_version = DeltaTable(table).version()
    before = _windows(table)
    with pytest.raises(ReplayError, match="is not final yet") as refused:  # the live job may still change these
        repair_range(VIEW, lake, start_ms=T0 + 170_000, end_ms=T0 + 190_000, by="test", spark=spark)
    assert "\n" not in str(refused.value)
    with pytest.raises(ReplayError, match="has no event-time windows"):
        repair_range("events_raw", lake, start_ms=start, end_ms=end, by="test", spark=spark)
    from kappa.front import cli  # the command docs/replay.md shows, on this test's platform

    for key, value in subprocess_env(lake).items():
        if key.startswith("KAPPA_"):
            monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        cli.main(["repair", VIEW, "--from", "yesterday", "--to", str(end)])
    assert exited.value.code != 0 and "--from 'yesterday': expected epoch milliseconds" in capsys.readouterr().err
    # a range without data (an hour before the first event: no record, no window) is refused in one line and
    # commits nothing (the command docs/replay.md shows; its ReplayError is repair_range's)
    with pytest.raises(SystemExit) as exited:
        cli.main(["repair", VIEW, "--from", str(T0 - 3_600_000), "--to", str(T0)])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(rf"error: {VIEW}@v1: nothing to repair in \S+ \S+\.\.\S+ \S+ UTC - the log has no record of "
                        r"a window starting there and the table no window there \(its windows start between .+ UTC\); "
                        r"nothing was written", err.strip()), err
    assert DeltaTable(table).version() == before_version  # no commit
    assert not Path(ViewPaths(lake.lake_uri, VIEW, 1).root, "repairs").exists()  # and nothing staged either
    with pytest.raises(SystemExit) as exited:
        cli.main(["repair", VIEW, "--from", str(start), "--to", str(end), "--dry-run"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "dry run: not swapped" in out, out
    assert DeltaTable(table).version() == before_version

    def in_range(key: tuple) -> bool:
        return start <= key[1] < end

    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:  # what an analyst polling the table sees, snapshot by snapshot
        while not stop.is_set():
            seen.add(sum(n for k, (n, _final) in _windows(table).items() if in_range(k)))

    watcher = threading.Thread(target=reader, daemon=True)
    watcher.start()
    try:
        result = repair_range(VIEW, lake, start_ms=start, end_ms=end, by="test", spark=spark)
    finally:
        stop.set()
        watcher.join(60)
    assert result.swapped and result.verified, result.message
    assert result.delta_version == before_version + 1 == DeltaTable(table).version(), "one commit"
    after = _windows(table)
    assert {k: v for k, v in after.items() if not in_range(k)} == {k: v for k, v in before.items() if not in_range(k)}

    # inside the range: every valid view event of a mapped ad counted once, the fix included (counted here
    # from the raw log, in plain Python)
    mapping = dict(generator.campaign_records(u))
    counts: Counter = Counter()
    for rec in oracle.read_log(lake, topic):
        event = json.loads(rec.value)
        if event["event_type"] == "view" and start <= event["event_time"] - event["event_time"] % 10_000 < end:
            counts[(mapping[event["ad_id"]], event["event_time"] - event["event_time"] % 10_000)] += 1
    assert {k: n for k, (n, _final) in after.items() if in_range(k)} == dict(counts)
    assert all(final for k, (_n, final) in after.items() if in_range(k))
    fixed_views = sum(1 for e in fix if json.loads(e.value)["event_type"] == "view")
    old_sum = sum(n for k, (n, _f) in before.items() if in_range(k))
    new_sum = sum(counts.values())
    assert new_sum == old_sum + fixed_views > old_sum
    assert result.changed + result.added > 0 and result.removed == 0
    # readers saw the old range or the new one, never a mix
    assert seen <= {old_sum, new_sum} and old_sum in seen, seen
    commit = DeltaTable(table).history(1)[0]
    assert commit["operation"] == "MERGE" and json.loads(commit["userMetadata"])["kappa"]["repair"]["by"] == "test"

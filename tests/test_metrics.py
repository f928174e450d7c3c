"""A real view driver serves Prometheus metrics, and the values move while data flows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kappa.log import generator
from kappa.log.broker import free_port
from tests.conftest import subprocess_env

pytestmark = pytest.mark.integration


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    matches = [v for (n, lbl), v in samples.items() if n == name and all((k, v2) in lbl for k, v2 in labels.items())]
    return sum(matches) if matches else float("nan")


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except OSError:  # endpoint not up yet
            pass
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


def test_running_job_metrics_move(kafka, declared_topics, lake, tmp_path):
    u = generator.universe(seed=5, campaigns=5)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    port = free_port()
    log = open(tmp_path / "job.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kappa.runtime.driver", "view", "events_raw", "--starting", "earliest",
         "--metrics-port", str(port), "--trigger-seconds", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(lake), start_new_session=True)
    try:
        _wait_for(lambda: scrape(port), 240, "the metrics endpoint")

        def produce(seed: int) -> None:
            generator.produce(lake, lake.topic("ad-events"), generator.events(
                400, seed=seed, universe=u, live=True, malformed_fraction=0.1))

        produce(1)
        first = _wait_for(lambda: (s := scrape(port)) and value(s, "kappa_batches_total") >= 1 and
                          value(s, "kappa_input_rows_total") > 0 and s, 240, "a first committed batch")
        produce(2)
        second = _wait_for(lambda: (s := scrape(port)) and value(s, "kappa_input_rows_total") >
                           value(first, "kappa_input_rows_total") and value(s, "kappa_partition_lag_records") == 0
                           and s, 240, "the second load to be processed")

        labels = {"view": "events_raw", "version": "1"}
        assert value(second, "kappa_input_rows_total", **labels) >= 800
        assert value(second, "kappa_last_delta_version", **labels) > value(first, "kappa_last_delta_version", **labels)
        assert value(second, "kappa_quarantined_records_total", **labels) > value(
            first, "kappa_quarantined_records_total", **labels) > 0
        assert value(second, "kappa_rows_written_total", **labels) > value(first, "kappa_rows_written_total", **labels)
        # end-to-end latency histogram: every written row observed, with a plausible (live) latency
        count = value(second, "kappa_end_to_end_latency_seconds_count", **labels)
        assert count == value(second, "kappa_rows_written_total", **labels)
        assert 0 < value(second, "kappa_end_to_end_latency_seconds_sum", **labels) / count < 300
        assert value(second, "kappa_batch_duration_seconds_count", **labels) >= 2
        # lag per partition of the 4-partition topic, all caught up, and the log end offset known
        lags = [v for (n, lbl), v in second.items() if n == "kappa_partition_lag_records"]
        assert len(lags) == declared_topics["ad-events"] and all(v == 0 for v in lags)
        assert value(second, "kappa_partition_log_end_offset") > value(first, "kappa_partition_log_end_offset")
        # the last micro-batch was the second load's (a stateless view runs no empty batches): its rate was set
        rate = value(second, "kappa_processed_rows_per_second", **labels)
        assert 0 < rate < float("inf"), rate
        assert value(second, "kappa_falling_behind", **labels) in (0, 1)
        # the run reached its target and lags nothing: no wait is left
        assert value(second, "kappa_replay_progress_ratio", **labels) == 1.0
        assert value(second, "kappa_replay_eta_seconds", **labels) == 0
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # like Kubernetes: the driver process gets SIGTERM
        try:
            proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    text = (tmp_path / "job.log").read_text()
    assert proc.returncode == 0, text[-2000:]
    # Spark's per-batch warning is the job's one line at the start and end of a slow stretch (_Pace)
    assert "Current batch is falling behind" not in text


def test_falling_behind_is_said_once_when_it_starts_and_once_when_it_ends():
    from kappa.runtime.job import _Pace

    pace, trigger = _Pace(), 2.0
    said = [pace.batch(s, trigger) for s in (1.0, 3.0, 1.0, 3.0, 3.0, 1.0)]  # odd slow batches: nothing
    assert said == [None] * 6 and not pace.behind
    said = [pace.batch(s, trigger) for s in (3.5, 4.0, 5.0, 6.0)]  # the third slow one in a row
    assert said[:2] == [None, None] and said[3] is None and pace.behind
    assert said[2].startswith("falling behind: 3 micro-batches in a row took longer than the 2 s trigger (last 5.0 s)")
    said = [pace.batch(s, trigger) for s in (1.0, 1.0, 7.0, 1.0, 1.0, 1.0)]  # a slow one resets the streak
    assert said[:5] == [None] * 5
    assert said[5].startswith("keeping up again: micro-batches fit the 2 s trigger after 7 batches") and \
        "(longest 7.0 s)" in said[5]
    assert not pace.behind


def test_a_replay_read_in_one_micro_batch_shows_progress_and_an_eta_before_it_commits(spark, kafka, lake):
    """The default replay reads its whole range in one micro-batch: the checkpoint shows nothing until it commits,
    so the job reports what the batch's read tasks got through (kappa.runtime.inflight) - on its /metrics, and
    through ``with_reading`` in what ``kappa replay`` and the DAG show."""
    from datetime import UTC, datetime

    from kappa.control.replay import Progress, with_reading
    from kappa.log.topics import partition_offsets
    from kappa.runtime.inflight import READ_SPLIT_RECORDS
    from kappa.runtime.job import ViewJob
    from kappa.runtime.view import load_view

    events = 600_000
    u = generator.universe(seed=7, campaigns=5)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    topic = lake.topic("ad-events")
    assert generator.produce(lake, topic, generator.events(events, seed=7, universe=u)).delivered == events
    end = {p: hi for p, (_lo, hi) in partition_offsets(lake, topic).items()}
    job = ViewJob(load_view("jobs.campaign_window_counts.v1"), lake, spark=spark, starting="earliest",
                  metrics_port=free_port(), lag_poll_seconds=0.5)
    url = f"http://127.0.0.1:{job.metrics_port}/metrics"
    hand = Progress(view="campaign_window_counts", version=1, topic=topic, start_offsets={p: 0 for p in end},
                    processed_offsets={p: 0 for p in end}, target_offsets=end, batch_id=None, done=0, total=events,
                    ratio=0.0, lag=events, rate=None, eta_seconds=None, sampled_at=datetime.now(UTC))
    seen: list[tuple[float, float, float, int, float | None]] = []
    job.start()
    try:
        while not job.processed_offsets:  # until the one micro-batch commits
            samples = scrape(job.bound_port)
            shown = with_reading(hand, url)
            seen.append((value(samples, "kappa_batch_records_read"), value(samples, "kappa_replay_progress_ratio"),
                         value(samples, "kappa_replay_eta_seconds"), shown.reading, shown.eta_seconds))
            assert job.failure() is None, job.failure()
            time.sleep(0.25)
        job.process_all_available()
        # committed: the in-batch figures give way to the checkpoint's (the job polls every second)
        after = _wait_for(lambda: (lambda m: m if value(m, "kappa_batch_records_read") == 0 and value(
            m, "kappa_replay_progress_ratio") == 1.0 else None)(scrape(job.bound_port)), 30, "the commit's figures")
    finally:
        job.stop()
    assert job.handler.times.batches >= 1 and sum(job.processed_offsets.values()) == events
    # the run recorded when it reached its target: later replays' ETA counts to it (planning.measured_throughput)
    from kappa.runtime.checkpoint import run_info

    assert datetime.fromisoformat(run_info(job.paths.checkpoint)["target_reached_at"]) <= datetime.now(UTC)
    inside = [s for s in seen if 0 < s[0] < events]
    assert inside, f"no sample showed a part of the batch read before it committed: {seen}"
    # one task's share or more at a time (the read is split into tasks of at most READ_SPLIT_RECORDS records)
    assert len({s[0] for s in inside}) >= 2 or events / READ_SPLIT_RECORDS < 4, seen
    # the progress gauge counts the read but stays short of 1.0 until the commit (NaN: before the lag poll ran)
    assert all(r != r or 0 <= r < 1 for _, r, *_ in inside) and any(0 < r < 1 for _, r, *_ in inside), seen
    assert any(0 < e < float("inf") for *_, e, _, _ in inside), f"no finite in-batch ETA: {seen}"
    assert any(0 < r < events and e is not None and 0 < e < float("inf") for *_, r, e in inside), \
        f"with_reading never carried the job's read and ETA: {seen}"
    assert value(after, "kappa_batch_records_read") == 0 and value(after, "kappa_replay_progress_ratio") == 1.0


def _distinct_offsets(lake) -> tuple[int, int]:
    """(rows, distinct (partition, offset)) of events_raw v1, read with delta-rs and DuckDB (not the driver's Spark)."""
    import duckdb
    from deltalake import DeltaTable

    from kappa.identity import ViewPaths

    con = duckdb.connect()
    table = DeltaTable(ViewPaths(lake.lake_uri, "events_raw", 1).table.removeprefix("file:"))
    con.register("t", table.scan().read_all())
    return con.sql('SELECT count(*), count(DISTINCT ("partition", "offset")) FROM t').fetchall()[0]


def test_a_failing_driver_restarts_its_query_counts_each_failure_then_exits(kafka, declared_topics, lake, tmp_path):
    """A view's own driver whose commits fail (a real storage fault: the table's Delta log replaced by a file - the
    one fake here, nothing else makes a commit fail on demand) restarts its query from its checkpoint in the same
    process after a doubling backoff, its metrics endpoint up all along, so ``kappa_batches_failed_total`` climbs
    where Prometheus scrapes it; after ``KAPPA_HOST_MAX_RESTARTS`` restarts the next failure ends the driver with
    exit code 1 (its pod restarts). Started again once the log is back, it catches up exactly once."""
    import shutil

    from kappa.identity import ViewPaths

    u = generator.universe(seed=11, campaigns=5)
    generator.publish_campaigns(lake, generator.campaign_records(u), topic=lake.topic("campaigns"))
    log_dir = ViewPaths(lake.lake_uri, "events_raw", 1).table.removeprefix("file:") + "/_delta_log"
    env = subprocess_env(lake, KAPPA_HOST_RESTART_BACKOFF_SECONDS="2", KAPPA_HOST_MAX_RESTARTS="3")
    port = free_port()

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "kappa.runtime.driver", "view", "events_raw", "--starting", "earliest",
             "--metrics-port", str(port), "--trigger-seconds", "1"],
            stdout=open(tmp_path / name, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

    produced = generator.produce(lake, lake.topic("ad-events"), generator.events(300, seed=1, universe=u, live=True))
    proc = start("first.log")
    try:
        first = _wait_for(lambda: (s := scrape(port)) and value(s, "kappa_batches_total") >= 1 and s, 240,
                          "a first batch")
        assert value(first, "kappa_batches_failed_total") == 0, "exported at 0 before any failure"
        shutil.move(log_dir, log_dir + ".away")
        with open(log_dir, "w") as fh:
            fh.write("not a directory")
        more = generator.produce(lake, lake.topic("ad-events"), generator.events(200, seed=2, universe=u, live=True))
        seen: list[float] = []  # kappa_batches_failed_total, scraped while the same process runs
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                seen.append(value(scrape(port), "kappa_batches_failed_total"))
            except OSError:
                pass
            time.sleep(0.5)
        assert proc.poll() == 1, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if os.path.isfile(log_dir):
            os.remove(log_dir)
            shutil.move(log_dir + ".away", log_dir)
    text = (tmp_path / "first.log").read_text()
    for n in (1, 2, 3):
        assert f"events_raw@v1 failed ({n} of 3)" in text and "restarting it from its checkpoint" in text, text[-3000:]
    counted = sorted({v for v in seen if v == v})
    assert counted and counted[-1] >= 3 and counted == sorted(counted), \
        f"failed batches counted in one process, scraped: {counted}"
    # back: a new driver resumes from the checkpoint and every record is in the table once
    proc = start("second.log")
    try:
        expected = produced.kinds["valid"] + more.kinds["valid"]
        _wait_for(lambda: _distinct_offsets(lake)[1] >= expected, 300, f"{expected} rows in events_raw")
        assert _distinct_offsets(lake) == (expected, expected)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)

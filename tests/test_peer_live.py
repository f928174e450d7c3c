"""The benchmark peer's live mode (:func:`kappa.front.peer.start_peer_live`) measures latency and counts exactly.

Real broker, real Quix Streams worker in its own venv, real Delta table read back with delta-rs. The worker starts
on an empty 4-partition topic and reports ready; only then are ~20 s of events produced at 1,000/s, stamped with the
wall clock (``generator.events(..., live=True)``, with late and malformed records). The result must account for
every record produced (nothing produced after ready may be missed: the ready line is the guarantee the latency
benchmark relies on) and carry sound latency figures, and the table's windows must equal the independent
plain-Python oracle over the raw records read back from Kafka (``kappa.verify.oracle.read_log`` +
``validate_records`` + ``expected_window_counts``): every (campaign_id, window_start) with its count, and its
``last_event_time`` equal to the max event time of the window's views.

Why exact equality holds: the live peer upserts each window's current value at every checkpoint and its final
checkpoint flushes the last ones, so the table holds every window's full count as long as no view is dropped as
late. Event times are the wall clock minus at most 5 s of lateness, well inside the 30 s grace.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone

from deltalake import DeltaTable

from jobs.campaign_catalog.oracle import expected_campaign_catalog
from jobs.campaign_window_counts.oracle import expected_window_counts
from kappa.front.peer import PEER_IMPL, start_peer_live
from kappa.log import generator
from kappa.runtime.metrics import LATENCY_BUCKETS
from kappa.verify.oracle import read_log, validate_records

WINDOW_MS = 10_000
RATE = 1_000
PRODUCE_S = 20


def _ms(value: datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(round(value.timestamp() * 1000))


def _table_windows(path: str) -> dict[tuple[str, int], tuple[int, int]]:
    """(campaign_id, window_start ms) -> (view_count, last_event_time ms) of the peer's Delta table."""
    data = DeltaTable(path).scan().read_all()
    names = list(data.column_names)
    assert names == ["campaign_id", "window_start", "window_end", "view_count", "last_event_time"], names
    windows: dict[tuple[str, int], tuple[int, int]] = {}
    for campaign, start, end, count, last in zip(*(data.column(i).to_pylist() for i in range(len(names)))):
        assert _ms(end) - _ms(start) == WINDOW_MS and _ms(start) % WINDOW_MS == 0
        assert _ms(start) <= _ms(last) < _ms(end)
        key = (campaign, _ms(start))
        assert key not in windows, f"window {key} written twice"
        windows[key] = (count, _ms(last))
    return windows


def _check_buckets(buckets: list[list], total: int) -> None:
    """Cumulative ``[upper bound, count]`` pairs on the platform's bounds, ending with ``["+Inf", total]``."""
    assert [b for b, _ in buckets] == [*LATENCY_BUCKETS, "+Inf"]
    counts = [c for _, c in buckets]
    assert counts == sorted(counts) and counts[-1] == total


def test_peer_live_counts_exactly_and_reports_latency(kafka_settings, topic_factory, tmp_path):
    settings = kafka_settings
    campaigns_topic = topic_factory(1, {"cleanup.policy": "compact"})
    topic = topic_factory(4)
    u = generator.universe(seed=31, campaigns=20, users=400)
    assert generator.publish_campaigns(settings, generator.campaign_records(u), topic=campaigns_topic).delivered

    table = str(tmp_path / "peer-live-window-counts")
    peer = start_peer_live(settings, topic, campaigns_topic, table, seconds=PRODUCE_S + 5, warmup=5.0, drain=10.0)
    try:
        n = RATE * PRODUCE_S
        started = time.monotonic()
        produced = generator.produce(settings, topic, generator.events(
            n, seed=31, universe=u, live=True, late_fraction=0.05, max_lateness_ms=5_000,
            malformed_fraction=0.02), rate=RATE)
        produce_s = time.monotonic() - started
        result = peer.wait()
    finally:
        peer.kill()
    assert produced.delivered == n and produce_s < PRODUCE_S + 5, (produced.as_dict(), produce_s)
    assert produced.late > 0 and sum(c for k, c in produced.kinds.items() if k != "valid") > 0

    # the oracle, over the raw log
    records = read_log(settings, topic)
    validated = validate_records(records, "ad_event", key_field="user_id")
    mapping = expected_campaign_catalog(
        validate_records(read_log(settings, campaigns_topic), "campaign", key_field=None, tombstones=True))
    assert mapping == u.ad_to_campaign
    expected = {k: count for k, (count, _final) in expected_window_counts(validated, mapping).items()}
    last_event: dict[tuple[str, int], int] = {}
    for v in validated:
        if v.error is None and v.value["event_type"] == "view" and v.value["ad_id"] in mapping:
            t = v.value["event_time"]
            key = (mapping[v.value["ad_id"]], t - t % WINDOW_MS)
            last_event[key] = max(last_event.get(key, t), t)

    # every record produced after ready was consumed, none dropped as late, the invalid ones skipped
    assert len(records) == n
    assert result["mode"] == "live" and result["impl"] == PEER_IMPL
    assert result["events"] == n
    assert result["late_dropped"] == 0
    assert result["invalid"] + result["invalid_key"] == sum(v.error is not None for v in validated)
    assert result["views_counted"] == sum(expected.values())

    # the table: every window with its full count and max event time, once
    actual = _table_windows(table)
    missing = expected.keys() - actual.keys()
    extra = actual.keys() - expected.keys()
    wrong = {k: (actual[k], (expected[k], last_event[k])) for k in expected.keys() & actual.keys()
             if actual[k] != (expected[k], last_event[k])}
    assert not missing and not extra and not wrong, (
        f"{len(missing)} missing, {len(extra)} extra, {len(wrong)} wrong windows; e.g. "
        f"{sorted(missing)[:3]} {sorted(extra)[:3]} {list(wrong.items())[:3]}")

    # latency: one observation per upserted row (a window is upserted again at each checkpoint that changed it)
    assert result["delta_commits"] > 0
    assert result["rows_committed"] >= len(actual) > 0
    _check_buckets(result["buckets"], result["rows_committed"])
    _check_buckets(result["steady_buckets"], result["steady_rows"])
    assert 0 < result["steady_rows"] < result["rows_committed"]
    for name in ("p50_s", "p99_s", "steady_p50_s", "steady_p99_s", "steady_max_s"):
        assert isinstance(result[name], float) and math.isfinite(result[name]) and result[name] > 0, (name, result)
    assert result["steady_p50_s"] <= result["steady_p99_s"] <= result["steady_max_s"]
    assert result["seconds"] > 0 and result["events_per_s"] > 0
    assert result["cpu_seconds"] > 0 and result["max_rss_mb"] > 0

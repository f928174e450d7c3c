"""Compare the Delta tables of the four views with the plain-Python oracle (kappa.oracle)."""

from __future__ import annotations

from typing import Any

from kappa import lineage, oracle, replay
from kappa.config import Settings
from kappa.job import ViewPaths
from kappa.oracle import OracleInput
from tests.helpers import read_table


def _ms(ts: Any) -> int:
    return int(round(ts.timestamp() * 1000))


def expected(settings: Settings) -> dict[str, Any]:
    events = oracle.validate_records(oracle.read_log(settings, settings.topic("ad-events")), "ad_event", key_field="user_id")
    campaigns = oracle.validate_records(oracle.read_log(settings, settings.topic("campaigns")), "campaign", key_field=None,
                                        tombstones=True)
    mapping = oracle.expected_campaign_catalog(campaigns)
    return {
        "events": events,
        "campaign_records": campaigns,
        "events_raw": oracle.expected_events_raw(events),
        "campaign_catalog": mapping,
        "campaign_window_counts": oracle.expected_window_counts(events, mapping),
        "user_sessions": _sessions(settings, events),
        "bad_events": {(v.record.partition, v.record.offset) for v in events if v.error},
        "bad_campaigns": {(v.record.partition, v.record.offset) for v in campaigns if v.error},
    }


def _sessions(settings: Settings, events: list[Any]) -> dict[tuple, tuple]:
    """user_sessions under Spark's micro-batch semantics, from the batch boundaries and watermarks the job recorded
    in its Delta commits (kappa.lineage). Which sessions are emitted depends on them: a driver restarted after
    its last data batch loses the watermark that batch advanced to (Spark keeps it in memory until the next
    batch is planned), so a bounded run may end with sessions still open - they are not in the table yet."""
    from deltalake import DeltaTable

    app_id = replay.run_app_id(settings, "user_sessions", 1)
    assert app_id, "user_sessions has no run"
    history = DeltaTable(ViewPaths(settings.lake_uri, "user_sessions", 1).table).history()
    batches = lineage.batches_from_history(history, app_id)
    assert [b.batch_id for b in batches] == list(range(len(batches))), "a user_sessions commit lacks its lineage"
    assert batches, "user_sessions committed no batch"
    ends: dict[int, int] = {}
    for v in events:
        ends[v.record.partition] = max(ends.get(v.record.partition, 0), v.record.offset + 1)
    assert batches[-1].end_offsets == ends, "user_sessions did not process the whole log"
    return {k: v[:3] for k, v in oracle.expected_sessions_batched(OracleInput(events, {}, batches)).items()}


def actual(spark: Any, settings: Settings) -> dict[str, Any]:
    def table(view: str) -> list[Any]:
        return read_table(spark, ViewPaths(settings.lake_uri, view, 1).table)

    raw = table("events_raw")
    quarantine = read_table(spark, ViewPaths(settings.lake_uri, "events_raw", 1).quarantine)
    out = {
        "events_raw_rows": len(raw),
        "events_raw": {(r.partition, r.offset): r.asDict() for r in raw},
        "campaign_catalog_rows": None,
        "campaign_window_counts": {},
        "user_sessions": {},
        "quarantine": {},
    }
    catalog = table("campaign_catalog")
    out["campaign_catalog_rows"] = len(catalog)
    out["campaign_catalog"] = {r.ad_id: r.campaign_id for r in catalog}
    windows = table("campaign_window_counts")
    out["campaign_window_counts_rows"] = len(windows)
    out["campaign_window_counts"] = {(r.campaign_id, _ms(r.window_start)): (r.view_count, r.is_final)
                                     for r in windows}
    sessions = table("user_sessions")
    out["user_sessions_rows"] = len(sessions)
    out["user_sessions"] = {(r.user_id, _ms(r.session_start)): (_ms(r.session_end), r.event_count, r.distinct_ads)
                            for r in sessions}
    for r in quarantine:
        out["quarantine"].setdefault(r.view, []).append((r.partition, r.offset))
    return out


def diff(a: dict, b: dict, limit: int = 5) -> list:
    keys = set(a) | set(b)
    return [(k, a.get(k), b.get(k)) for k in sorted(keys, key=str) if a.get(k) != b.get(k)][:limit]


def assert_views_match(spark: Any, settings: Settings) -> dict[str, int]:
    """Every view equals the oracle: no missing rows, no duplicated rows, bad records quarantined once."""
    exp, got = expected(settings), actual(spark, settings)
    # events_raw: exactly the valid records, each once (row count == distinct keys == oracle)
    assert got["events_raw_rows"] == len(got["events_raw"]), "duplicated rows in events_raw"
    assert set(got["events_raw"]) == set(exp["events_raw"]), diff(
        {k: 1 for k in got["events_raw"]}, {k: 1 for k in exp["events_raw"]})
    sample = next(iter(exp["events_raw"].items()), None)
    if sample:
        (key, fields) = sample
        row = got["events_raw"][key]
        assert all(row[f] == fields[f] for f in ("user_id", "ad_id", "event_type", "event_time", "ip"))
    assert got["campaign_catalog_rows"] == len(got["campaign_catalog"])
    assert got["campaign_catalog"] == exp["campaign_catalog"], diff(got["campaign_catalog"], exp["campaign_catalog"])
    assert got["campaign_window_counts_rows"] == len(got["campaign_window_counts"])
    assert got["campaign_window_counts"] == exp["campaign_window_counts"], diff(
        got["campaign_window_counts"], exp["campaign_window_counts"])
    assert got["user_sessions_rows"] == len(got["user_sessions"]), "duplicated sessions"
    assert got["user_sessions"] == exp["user_sessions"], diff(got["user_sessions"], exp["user_sessions"])
    for view in ("events_raw", "campaign_window_counts", "user_sessions"):
        q = got["quarantine"].get(view, [])
        assert len(q) == len(set(q)), f"{view}: a bad record was quarantined twice"
        assert set(q) == exp["bad_events"], f"{view}: quarantine differs from the oracle's bad records"
    q = got["quarantine"].get("campaign_catalog", [])
    assert len(q) == len(set(q)) and set(q) == exp["bad_campaigns"]
    return {
        "consumed": len(exp["events"]),
        "valid": len(exp["events_raw"]),
        "quarantined": len(exp["bad_events"]),
        "windows": len(exp["campaign_window_counts"]),
        "final_windows": sum(1 for _n, final in exp["campaign_window_counts"].values() if final),
        "sessions": len(exp["user_sessions"]),
        "catalog": len(exp["campaign_catalog"]),
    }

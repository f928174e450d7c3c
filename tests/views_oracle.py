"""Compare the Delta tables of the four views with the plain-Python oracle (kappa.verify.oracle)."""

from __future__ import annotations

from typing import Any

from kappa.runtime import lineage, oracle, replay
from kappa.config import Settings
from kappa.identity import ViewPaths
from kappa.verify.oracle import OracleInput
from tests.helpers import read_table


def _ms(ts: Any) -> int:
    return int(round(ts.timestamp() * 1000))


def expected(settings: Settings) -> dict[str, Any]:
    events = oracle.validate_records(oracle.read_log(settings, settings.topic("ad-events")), "ad_event", key_field="user_id")
    campaigns = oracle.validate_records(oracle.read_log(settings, settings.topic("campaigns")), "campaign", key_field=None,
                                        tombstones=True)
    window_input = OracleInput(events, {"campaigns": campaigns}, _batches(settings, "campaign_window_counts", events))
    session_input = OracleInput(events, {}, _batches(settings, "user_sessions", events))
    return {
        "events": events,
        "campaign_records": campaigns,
        "events_raw": oracle.expected_events_raw(events),
        "campaign_catalog": oracle.expected_campaign_catalog(campaigns),
        "campaign_window_counts": {k: (v[0], v[2]) for k, v in
                                   oracle.ORACLES[("campaign_window_counts", 1)].compute(window_input).items()},
        "late_windows": oracle.late_window_records(window_input, counted=("view",), window_ms=10_000),
        "user_sessions": {k: v[:3] for k, v in oracle.expected_sessions_batched(session_input).items()},
        "late_sessions": oracle.late_session_records(session_input),
        "bad_events": {(v.record.partition, v.record.offset) for v in events if v.error},
        "bad_campaigns": {(v.record.partition, v.record.offset) for v in campaigns if v.error},
    }


def _batches(settings: Settings, view: str, events: list[Any]) -> "list[oracle.BatchBoundary]":
    """The micro-batch boundaries and watermarks ``view`` recorded in its Delta commits (kappa.runtime.lineage): what a
    watermarked view emits, drops as late and marks final depends on them. A driver restarted after its last
    data batch loses the watermark that batch advanced to (Spark keeps it in memory until the next batch is
    planned), so a bounded run may end with sessions or windows still open."""
    from deltalake import DeltaTable

    app_id = replay.run_app_id(settings, view, 1)
    assert app_id, f"{view} has no run"
    paths = ViewPaths(settings.lake_uri, view, 1)
    history = DeltaTable(paths.table).history()
    if DeltaTable.is_deltatable(paths.staging):  # batches of a bulk catch-up are commits of the staging table
        history += DeltaTable(paths.staging).history()
    batches = lineage.batches_from_history(history, app_id)
    assert [b.batch_id for b in batches] == list(range(len(batches))), f"a {view} commit lacks its lineage"
    assert batches, f"{view} committed no batch"
    ends: dict[int, int] = {}
    for v in events:
        ends[v.record.partition] = max(ends.get(v.record.partition, 0), v.record.offset + 1)
    assert batches[-1].end_offsets == ends, f"{view} did not process the whole log"
    return batches


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
        assert len(q) == len(set(q)), f"{view}: a record was quarantined twice"
        # the window and session views also keep the records their watermark dropped (kappa.runtime.late)
        late = {"campaign_window_counts": exp["late_windows"], "user_sessions": exp["late_sessions"]}
        want = exp["bad_events"] | late.get(view, set())
        assert set(q) == want, (f"{view}: quarantine differs from the oracle's bad and late records: "
                                f"{sorted(set(q) ^ want)[:5]}")
    q = got["quarantine"].get("campaign_catalog", [])
    assert len(q) == len(set(q)) and set(q) == exp["bad_campaigns"]
    return {
        "consumed": len(exp["events"]),
        "valid": len(exp["events_raw"]),
        "quarantined": len(exp["bad_events"]),
        "late_kept": len(exp["late_windows"]),
        "late_sessions_kept": len(exp["late_sessions"]),
        "windows": len(exp["campaign_window_counts"]),
        "final_windows": sum(1 for _n, final in exp["campaign_window_counts"].values() if final),
        "sessions": len(exp["user_sessions"]),
        "catalog": len(exp["campaign_catalog"]),
    }

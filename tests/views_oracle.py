"""Compare the Delta tables of the four views, every column, with their plain-Python oracles (jobs/<view>/oracle.py)."""

from __future__ import annotations

from typing import Any

from kappa.control import replay
from kappa.runtime import lineage
from kappa.verify import oracle
from kappa.config import Settings
from kappa.identity import ViewPaths
from jobs.campaign_window_counts.oracle import late_window_records
from jobs.user_sessions.oracle import late_session_records
from kappa.verify.oracle import OracleInput
from tests.helpers import read_table


def _ms(ts: Any) -> int:
    return int(round(ts.timestamp() * 1000))


#: the views `make run` starts, each with the lookups its oracle reads
VIEWS = ("events_raw", "campaign_catalog", "campaign_window_counts", "user_sessions")


def expected(settings: Settings) -> dict[str, Any]:
    events = oracle.validate_records(oracle.read_log(settings, settings.topic("ad-events")), "ad_event", key_field="user_id")
    campaigns = oracle.validate_records(oracle.read_log(settings, settings.topic("campaigns")), "campaign", key_field=None,
                                        tombstones=True)
    inputs = {
        "events_raw": OracleInput(events),
        "campaign_catalog": OracleInput(campaigns),
        "campaign_window_counts": OracleInput(events, {"campaigns": campaigns},
                                              _batches(settings, "campaign_window_counts", events)),
        "user_sessions": OracleInput(events, {}, _batches(settings, "user_sessions", events)),
    }
    out: dict[str, Any] = {view: oracle.oracle_for(view, 1).compute(inputs[view]) for view in VIEWS}
    out.update({
        "events": events,
        "late_windows": late_window_records(inputs["campaign_window_counts"], counted=("view",), window_ms=10_000),
        "late_sessions": late_session_records(inputs["user_sessions"]),
        "bad_events": {(v.record.partition, v.record.offset) for v in events if v.error},
        "bad_campaigns": {(v.record.partition, v.record.offset) for v in campaigns if v.error},
    })
    return out


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
    """Each view's table in the oracle's (key, values) form - every column - with its row count, and the
    quarantine's (partition, offset) per view."""
    out: dict[str, Any] = {"quarantine": {}}
    for view in VIEWS:
        spec = oracle.oracle_for(view, 1)
        rows = read_table(spark, ViewPaths(settings.lake_uri, view, 1).table)
        columns = set(rows[0].asDict()) if rows else set(spec.keys) | set(spec.values)
        assert columns == set(spec.keys) | set(spec.values), (
            f"{view}: the oracle compares {sorted(set(spec.keys) | set(spec.values))}, the table has {sorted(columns)}")
        out[view] = dict(spec.adapt(r.asDict()) for r in rows)
        out[f"{view}_rows"] = len(rows)
    for r in read_table(spark, ViewPaths(settings.lake_uri, "events_raw", 1).quarantine):
        out["quarantine"].setdefault(r.view, []).append((r.partition, r.offset))
    return out


def diff(a: dict, b: dict, limit: int = 5) -> list:
    keys = set(a) | set(b)
    return [(k, a.get(k), b.get(k)) for k in sorted(keys, key=str) if a.get(k) != b.get(k)][:limit]


def assert_views_match(spark: Any, settings: Settings) -> dict[str, int]:
    """Every view equals the oracle: no missing rows, no duplicated rows, bad records quarantined once."""
    exp, got = expected(settings), actual(spark, settings)
    for view in VIEWS:  # every column of every row, each key once
        assert got[f"{view}_rows"] == len(got[view]), f"duplicated keys in {view}"
        assert got[view] == exp[view], (view, diff(got[view], exp[view]))
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
        "final_windows": sum(1 for *_values, final in exp["campaign_window_counts"].values() if final),
        "sessions": len(exp["user_sessions"]),
        "catalog": len(exp["campaign_catalog"]),
    }

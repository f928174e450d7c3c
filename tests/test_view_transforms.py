"""Every shipped view's transform on a few hand-written records, with the testing kit (``kappa.runtime.testing``).

No broker, no Delta: each test states the micro-batches a view reads and what its table must then hold, worked
out by hand from the view's definition (windows, watermark, joins, sessions, upserts) - the kind of unit test a
view author writes next to a new version before replaying it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kappa.runtime.testing import run_view

pytestmark = pytest.mark.integration

T0 = 1_699_999_980_000  # a whole minute: 10 s and 60 s windows start here
USER = "00000000-0000-4000-8000-0000000000{:02d}"
AD = "00000000-0000-4000-8000-00000000a0{:02d}"
CAMPAIGN = "00000000-0000-4000-8000-00000000c0{:02d}"
PAGE = "00000000-0000-4000-8000-00000000f000"


def event(user: int, ad: int, at_s: float, kind: str = "view") -> dict:
    return {"user_id": USER.format(user), "page_id": PAGE, "ad_id": AD.format(ad), "ad_type": "banner",
            "event_type": kind, "event_time": T0 + int(at_s * 1000), "ip": "10.0.0.1"}


def ts(at_s: float) -> datetime:
    return datetime.fromtimestamp((T0 + int(at_s * 1000)) / 1000, UTC).replace(tzinfo=None)


CAMPAIGNS = [{"ad_id": AD.format(1), "campaign_id": CAMPAIGN.format(1)},
             {"ad_id": AD.format(2), "campaign_id": CAMPAIGN.format(2)}]


def test_campaign_window_counts_v1_counts_views_per_10s_window_and_finalises_behind_the_watermark(spark):
    from jobs.campaign_window_counts.v1 import VIEW

    run = run_view(VIEW, [
        [event(1, 1, 1), event(2, 1, 2), event(3, 1, 3, "click"), event(4, 2, 12), event(5, 3, 4)],  # ad 3: no campaign
        [event(1, 1, 45)],  # the next batch runs with watermark 45 - 30 = 15 s
        [event(2, 1, 50)],  # ... this one: the state of windows ending by 15 s is evicted after it
        [event(2, 1, 5)],   # late: a row is judged by the previous batch's watermark (15 s): dropped
    ], lookups={"campaigns": CAMPAIGNS}, spark=spark)
    got = {(r["campaign_id"], r["window_start"]): (r["view_count"], r["last_event_time"], r["is_final"])
           for r in run.rows}
    assert got == {
        (CAMPAIGN.format(1), ts(0)): (2, ts(2), True),     # ends at 10 s <= 50 s - 30 s
        (CAMPAIGN.format(2), ts(10)): (1, ts(12), True),   # ends at 20 s <= 20 s
        (CAMPAIGN.format(1), ts(40)): (1, ts(45), False),
        (CAMPAIGN.format(1), ts(50)): (1, ts(50), False),
    }
    assert [len(b) for b in run.batches[:4]] == [2, 1, 1, 0], run.batches  # update mode: changed windows only
    assert all(r["window_end"] - r["window_start"] == timedelta(seconds=10) for r in run.rows)


def test_campaign_window_counts_v2_counts_views_and_clicks_per_minute(spark):
    from jobs.campaign_window_counts.v2 import VIEW

    run = run_view(VIEW, [
        [event(1, 1, 1), event(2, 1, 2, "click"), event(3, 1, 3, "purchase"), event(4, 2, 59, "click")],
        [event(1, 1, 61), event(5, 1, 30, "click")],  # watermark still 59 - 30 = 29 s: 30 s counts
    ], lookups={"campaigns": CAMPAIGNS}, spark=spark)
    got = {(r["campaign_id"], r["window_start"]): (r["view_count"], r["click_count"], r["is_final"])
           for r in run.rows}
    assert got == {(CAMPAIGN.format(1), ts(0)): (1, 2, False), (CAMPAIGN.format(2), ts(0)): (0, 1, False),
                   (CAMPAIGN.format(1), ts(60)): (1, 0, False)}


def test_campaign_window_counts_v3_counts_each_event_once_in_six_hopping_windows(spark):
    """60 s windows every 10 s; a retried event (same event_id) counts once whether the copy comes in the same
    batch or a later one; records without an event_id are never merged; a copy behind the watermark is late."""
    from jobs.campaign_window_counts.v3 import VIEW

    def once(user: int, ad: int, at_s: float, kind: str = "view", *, id_: int | None = None) -> dict:
        e = event(user, ad, at_s, kind)
        return e if id_ is None else {**e, "event_id": f"00000000-0000-4000-8000-0000000e00{id_:02d}"}

    a, b, c, d = once(1, 1, 5, id_=1), once(2, 1, 12, "click", id_=2), once(4, 2, 40, id_=3), once(5, 1, 75, id_=4)
    run = run_view(VIEW, [
        [a, a, b, once(3, 1, 14), once(3, 1, 14)],  # a twice in one batch; the two without id both count
        [b, c],                                      # b again, one batch later: remembered, dropped
        [d],                                         # the next batch drops what 40 - 30 = 10 s reached
        [a, d, once(6, 1, 9, id_=5)],                # a's copy and 9 s are late, d's copy is remembered
    ], lookups={"campaigns": CAMPAIGNS}, spark=spark)
    got = {(r["campaign_id"], int((r["window_start"] - ts(0)).total_seconds())):
           (r["view_count"], r["click_count"], r["last_event_time"], r["is_final"]) for r in run.rows}
    c1, c2 = CAMPAIGN.format(1), CAMPAIGN.format(2)
    expected = {(c1, -50): (1, 0, ts(5), True)}                                      # a
    expected |= {(c1, s): (3, 1, ts(14), s + 60 <= 45) for s in (-40, -30, -20, -10, 0)}  # a, b, both 14 s views
    expected |= {(c1, 10): (2, 1, ts(14), False)}                                    # b, both 14 s views
    expected |= {(c1, s): (1, 0, ts(75), False) for s in (20, 30, 40, 50, 60, 70)}  # d
    expected |= {(c2, s): (1, 0, ts(40), False) for s in (-10, 0, 10, 20, 30, 40)}   # c
    assert got == expected
    assert all(r["window_end"] - r["window_start"] == timedelta(seconds=60) for r in run.rows)


def test_user_sessions_closes_a_session_30s_after_its_last_event(spark):
    from jobs.user_sessions.v1 import VIEW

    run = run_view(VIEW, [
        [event(1, 1, 0), event(1, 2, 10), event(1, 1, 20), event(2, 1, 5)],
        [event(1, 1, 100)],  # watermark 100 - 30 = 70 s: user 1's [0, 50) and user 2's [5, 35) are closed
    ], spark=spark)
    got = {(r["user_id"], r["session_start"]): (r["session_end"], r["event_count"], r["distinct_ads"])
           for r in run.rows}
    assert got == {(USER.format(1), ts(0)): (ts(50), 3, 2), (USER.format(2), ts(5)): (ts(35), 1, 1)}
    # written once, by the no-data batch the engine ran after the watermark moved; the open session is not
    assert [len(b) for b in run.batches] == [0, 0, 2], run.batches


def test_campaign_catalog_keeps_the_latest_mapping_and_tombstones_delete(spark):
    from jobs.campaign_catalog.v1 import VIEW

    run = run_view(VIEW, [
        [{"ad_id": AD.format(1), "campaign_id": CAMPAIGN.format(1)},
         {"ad_id": AD.format(2), "campaign_id": CAMPAIGN.format(2)},
         {"ad_id": AD.format(1), "campaign_id": CAMPAIGN.format(3)}],  # the later record of ad 1 wins
        [(AD.format(2), None), {"ad_id": AD.format(4), "campaign_id": "not-a-uuid"}],  # delete ad 2; invalid
    ], spark=spark)
    assert [(r["ad_id"], r["campaign_id"], r["source_offset"]) for r in run.rows] == [
        (AD.format(1), CAMPAIGN.format(3), 2)]
    (bad,) = run.quarantined
    assert (bad.batch, bad.offset) == (1, 4) and "campaign_id" in bad.reason, bad


def test_events_raw_archives_every_valid_event_with_its_coordinates_and_quarantines_the_rest(spark):
    from jobs.events_raw.v1 import VIEW

    good = [event(1, 1, 0), event(2, 2, 1, "click")]
    run = run_view(VIEW, [[good[0], b"{not json"], [good[1], {**event(3, 1, 2), "ad_type": "billboard"}]],
                   spark=spark)
    assert [(r["offset"], r["user_id"], r["event_type"], r["event_ts"]) for r in run.rows] == [
        (0, USER.format(1), "view", ts(0)), (2, USER.format(2), "click", ts(1))]
    assert [(q.batch, q.offset) for q in run.quarantined] == [(0, 1), (1, 3)]
    assert run.quarantined[0].reason.startswith("malformed JSON") and run.quarantined[0].raw_value == b"{not json"
    assert "ad_type" in run.quarantined[1].reason, run.quarantined[1]


def test_a_lookup_the_view_does_not_declare_is_refused(spark):
    from jobs.events_raw.v1 import VIEW

    with pytest.raises(ValueError, match="declares no lookup campaigns"):
        run_view(VIEW, [[event(1, 1, 0)]], lookups={"campaigns": CAMPAIGNS}, spark=spark)

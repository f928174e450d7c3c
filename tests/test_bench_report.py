"""``make bench``'s figure: a measurement that did not run says so in its panel (``--stack-minutes 0`` skips the
``make run`` steady state (g)); one that ran draws its bars."""

from __future__ import annotations

from kappa.front.bench import _figure


def _result(**more):
    return {"events": 1000, "raw_ceiling": {"events_per_s": 50_000.0}, "replay": {"events_per_s": 20_000.0},
            "live": {"achieved_rate": 200.0, "p50_s": 3.0, "p99_s": 7.0}, "peak_rss_mb": {"view host": 2800.0},
            **more}


def _panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_a_panel_whose_measurement_did_not_run_says_so():
    fig = _figure(_result(stack=None))
    g = _panel(fig, "make run steady state (g)")
    assert [t.get_text() for t in g.texts] == ["not run (--stack-minutes 0)"]
    assert not g.patches  # no bars, no ticks: nothing that reads as a measurement of zero
    assert [t.get_text() for t in _panel(fig, "replay per core (h)").texts] == ["not run"]


def test_a_panel_whose_measurement_ran_draws_it():
    fig = _figure(_result(stack={"views": {"events_raw@v1": {"lag_seconds_max": 4.0},
                                           "user_sessions@v1": {"lag_seconds_max": 6.2}}},
                          per_core={"runs": {"1": {"events_per_s": 9000.0, "events_per_s_per_core": 9000.0}}}))
    g = _panel(fig, "make run steady state (g)")
    assert not g.texts and [round(p.get_height(), 1) for p in g.patches] == [4.0, 6.2]
    assert not _panel(fig, "replay per core (h)").texts

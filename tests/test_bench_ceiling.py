"""``make bench-ceiling``'s search: which rates it measures, what counts as kept, and the ceiling it reports.

The measurements themselves run the real view and the real peer (``python -m kappa.front.bench_ceiling``); here a
point is a dict a system at a known capacity would produce, to check the ladder's logic on its own.
"""

from __future__ import annotations

from kappa.front.bench_ceiling import RATE_STEP, ceiling, passed, sweep


def _system(capacity: float):
    """A system whose p99 stays at 2 s up to ``capacity`` events/s and grows past it; the rates it was asked for."""
    asked: list[float] = []

    def measure(rate: float) -> dict:
        asked.append(rate)
        return {"rate": rate, "achieved_rate": rate, "caught_up": rate <= 1.5 * capacity,
                "steady_p99_s": 2.0 if rate <= capacity else 2.0 * rate / capacity + 5}
    return measure, asked


def test_the_ladder_stops_at_the_first_failed_rate_and_refines_between():
    measure, asked = _system(capacity=12_000)
    points = sweep(measure, [2_000, 5_000, 10_000, 20_000, 40_000], refine=2, bound=5.0)
    # 40,000 is never asked for: 20,000 failed; then 15,000 (between 10,000 and 20,000) and 12,500
    assert asked == [2_000, 5_000, 10_000, 20_000, 15_000, 12_500]
    assert [p["passed"] for p in points] == [True, True, True, False, False, False]
    assert [p["rate"] for p in points] == sorted(asked)
    assert ceiling(points) == 10_000


def test_refining_finds_a_rate_between_passed_and_failed():
    measure, asked = _system(capacity=16_000)
    points = sweep(measure, [5_000, 10_000, 20_000], refine=1, bound=5.0)
    assert asked == [5_000, 10_000, 20_000, 15_000] and ceiling(points) == 15_000


def test_refining_stops_when_the_interval_is_one_step():
    measure, asked = _system(capacity=2_200)
    points = sweep(measure, [2_000, 2_000 + RATE_STEP], refine=3, bound=5.0)
    assert asked == [2_000, 2_000 + RATE_STEP] and ceiling(points) == 2_000


def test_a_system_that_passes_every_rate_has_the_highest_as_its_ceiling_and_one_below_every_rate_none():
    measure, _ = _system(capacity=1e9)
    assert ceiling(sweep(measure, [1_000, 3_000], refine=2, bound=5.0)) == 3_000
    measure, asked = _system(capacity=100)
    # below the lowest rate the refinement halves towards zero, down to one step
    assert ceiling(sweep(measure, [1_000, 3_000], refine=2, bound=5.0)) is None and asked == [1_000, 500]


def test_a_point_counts_only_with_its_rate_reached_and_everything_read():
    point = {"rate": 10_000, "achieved_rate": 10_000, "caught_up": True, "steady_p99_s": 4.9}
    assert passed(point, 5.0)
    assert not passed({**point, "steady_p99_s": 5.1}, 5.0)
    assert not passed({**point, "steady_p99_s": None}, 5.0)  # no row committed after the warm-up
    assert not passed({**point, "achieved_rate": 9_000}, 5.0)  # the producer could not keep the rate
    assert not passed({**point, "caught_up": False}, 5.0)  # rows never committed would hide their latency

"""The oracle of campaign_hourly_totals, in plain Python over the raw records of the topic it reads.

Per micro-batch ``k`` in order (the windows' watermark semantics of v3 of campaign_window_counts, with the
window as the event): a record whose ``window_start`` the watermark of batch ``k - 1`` reached is late
(dropped); a window already remembered is a copy (dropped); any other is remembered until a batch's watermark
passes ``window_start + delay`` and summed into its campaign's hour. An hour is final once it ends at or before
``max(window_start counted before the last batch) - delay``.
"""

from __future__ import annotations

from collections import defaultdict

from kappa.verify.oracle import (OracleInput, OracleSpec, Validated, counts_for_finality, epoch_ms,
                                 late_watermarks)

__all__ = ["ORACLES", "expected_hourly_totals", "hourly_totals_of_windows"]

HOUR_MS = 3_600_000


def expected_hourly_totals(inp: OracleInput, *, watermark_ms: int = 60_000) -> dict[tuple, tuple]:
    """(campaign_id, hour_start ms) -> (hour_end ms, views, windows, last window start ms, is_final)."""
    positions, late_wm = late_watermarks(inp)
    by_batch: dict[int, list[Validated]] = defaultdict(list)
    for v, pos in zip(inp.events, positions):
        if pos is not None and v.error is None:
            by_batch[pos].append(v)
    remembered: dict[tuple[str, int], int] = {}  # window key -> forgotten once the watermark passes this
    sums: dict[tuple[str, int], list[int]] = {}
    max_start: int | None = None
    for pos in sorted(by_batch):
        remembered = {k: expires for k, expires in remembered.items() if expires > late_wm[pos]}
        for v in by_batch[pos]:
            start = v.value["window_start"]
            if start <= late_wm[pos]:
                continue  # behind the watermark: dropped
            key = (v.value["campaign_id"], start)
            if key in remembered:
                continue  # a copy of a window already summed
            remembered[key] = start + watermark_ms
            hour = (v.value["campaign_id"], start - start % HOUR_MS)
            slot = sums.setdefault(hour, [0, 0, start])
            slot[0] += v.value["view_count"]
            slot[1] += 1
            slot[2] = max(slot[2], start)
            if counts_for_finality(inp, pos):
                max_start = start if max_start is None else max(max_start, start)
    return {k: (k[1] + HOUR_MS, views, n, last, max_start is not None and k[1] + HOUR_MS <= max_start - watermark_ms)
            for k, (views, n, last) in sums.items()}


def hourly_totals_of_windows(windows: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """(campaign_id, hour_start ms) -> views, from final windows (campaign_id, window_start ms) -> views: the
    end-to-end expectation of the two stages once every window is final."""
    out: dict[tuple[str, int], int] = defaultdict(int)
    for (campaign, start), views in windows.items():
        out[(campaign, start - start % HOUR_MS)] += views
    return dict(out)


def _row(row) -> tuple[tuple, tuple]:
    return ((row["campaign_id"], epoch_ms(row["hour_start"])),
            (epoch_ms(row["hour_end"]), row["view_count"], row["windows"], epoch_ms(row["last_window_start"]),
             row["is_final"]))


_SPEC = OracleSpec(compute=expected_hourly_totals, keys=("campaign_id", "hour_start"),
                   values=("hour_end", "view_count", "windows", "last_window_start", "is_final"), adapt=_row,
                   uses_batches=True)

#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for): one logic over each upstream
ORACLES = {1: _SPEC, 2: _SPEC}

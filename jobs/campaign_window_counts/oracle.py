"""The oracle of campaign_window_counts (v1: YSB view counts per 10 s window; v2: views and clicks per 60 s;
v3: distinct views and clicks per 60 s window sliding every 10 s), with the late records the recorded
micro-batches' watermarks dropped, in plain Python."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

from jobs.campaign_catalog.oracle import expected_campaign_catalog
from kappa.verify.oracle import (OracleInput, OracleSpec, Validated, counts_for_finality, epoch_ms,
                                 late_watermarks)

__all__ = ["ORACLES", "expected_window_counts", "expected_window_counts_v2", "expected_window_counts_v3",
           "late_event_records", "late_window_records"]


def _ms_to_window(ms: int, size_ms: int) -> int:
    return ms - (ms % size_ms)


def expected_window_counts(events: Iterable[Validated], mapping: Mapping[str, str], *, window_ms: int = 10_000,
                           watermark_ms: int = 30_000) -> dict[tuple[str, int], tuple[int, bool]]:
    """(campaign_id, window_start_ms) -> (view count, is_final) for the YSB query."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    max_time = None
    for v in events:
        if v.error is not None or v.value["event_type"] != "view":
            continue
        campaign = mapping.get(v.value["ad_id"])
        if campaign is None:
            continue
        t = v.value["event_time"]
        counts[(campaign, _ms_to_window(t, window_ms))] += 1
        max_time = t if max_time is None else max(max_time, t)
    if max_time is None:
        return {}
    watermark = max_time - watermark_ms
    return {k: (n, k[1] + window_ms <= watermark) for k, n in counts.items()}


def late_window_records(inp: OracleInput, *, counted: tuple[str, ...], window_ms: int) -> set[tuple[int, int]]:
    """(partition, offset) of the valid records of a counted type whose tumbling window had ended at or before
    the watermark of the previous micro-batch when they arrived: Spark drops them; a view declaring
    ``late_bound`` keeps them in the quarantine with reason ``late``."""
    positions, late_wm = late_watermarks(inp)
    return {(v.record.partition, v.record.offset) for v, pos in zip(inp.events, positions)
            if pos is not None and v.error is None and v.value["event_type"] in counted
            and _ms_to_window(v.value["event_time"], window_ms) + window_ms <= late_wm[pos]}


def _windows(inp: OracleInput, *, counted: tuple[str, ...], window_ms: int,
             watermark_ms: int) -> dict[tuple, tuple]:
    """Tumbling event-time windows per campaign with Spark's update-mode watermark semantics.

    Per micro-batch ``k`` (in order): valid events of a counted type whose ad has a campaign are dropped as late
    when their window ends at or before the watermark of batch ``k - 1`` (Spark filters late rows with the
    previous batch's watermark and evicts state with the current one); the others are counted. A window is
    final once it ends at or before ``max(event time of counted rows before the last batch) - watermark`` (the
    rows the next batch could still change are open). Value tuple: one count per type in ``counted``, the
    window's max event time (ms), ``is_final``.
    """
    mapping = expected_campaign_catalog(inp.lookups.get("campaigns", ()))
    positions, late_wm = late_watermarks(inp)
    counts: dict[tuple[str, int], list[int]] = {}
    last: dict[tuple[str, int], int] = {}
    max_time: int | None = None
    for v, pos in zip(inp.events, positions):
        if pos is None or v.error is not None or v.value["event_type"] not in counted:
            continue
        campaign = mapping.get(v.value["ad_id"])
        if campaign is None:
            continue
        t = v.value["event_time"]
        start = _ms_to_window(t, window_ms)
        if start + window_ms <= late_wm[pos]:
            continue  # arrived after the watermark passed its window: Spark drops it
        key = (campaign, start)
        slot = counts.setdefault(key, [0] * len(counted))
        slot[counted.index(v.value["event_type"])] += 1
        last[key] = max(last.get(key, t), t)
        if counts_for_finality(inp, pos):
            max_time = t if max_time is None else max(max_time, t)
    return {k: (*n, last[k], max_time is not None and k[1] + window_ms <= max_time - watermark_ms)
            for k, n in counts.items()}


def expected_window_counts_v2(inp: OracleInput, *, window_ms: int = 60_000,
                              watermark_ms: int = 30_000) -> dict[tuple[str, int], tuple[int, int, int, bool]]:
    """campaign_window_counts v2: (campaign_id, window_start_ms) -> (views, clicks, last event ms, is_final).

    60 s tumbling windows counting ``view`` and ``click`` events separately (see :func:`_windows` for the
    watermark semantics).
    """
    return _windows(inp, counted=("view", "click"), window_ms=window_ms, watermark_ms=watermark_ms)


def late_event_records(inp: OracleInput, *, counted: tuple[str, ...]) -> set[tuple[int, int]]:
    """(partition, offset) of the valid records of a counted type whose event time the watermark of the previous
    micro-batch had reached when they arrived (``event_time <= watermark``): the deduplication of v3 drops them;
    the view keeps them in the quarantine with reason ``late``."""
    positions, late_wm = late_watermarks(inp)
    return {(v.record.partition, v.record.offset) for v, pos in zip(inp.events, positions)
            if pos is not None and v.error is None and v.value["event_type"] in counted
            and v.value["event_time"] <= late_wm[pos]}


def expected_window_counts_v3(inp: OracleInput, *, window_ms: int = 60_000, slide_ms: int = 10_000,
                              watermark_ms: int = 30_000) -> dict[tuple[str, int], tuple[int, int, int, bool]]:
    """campaign_window_counts v3: (campaign_id, window_start_ms) -> (views, clicks, last event ms, is_final).

    Per micro-batch ``k`` in order, over the valid ``view``/``click`` records whose ad has a campaign, in log
    order: a record whose event time is at or before the watermark of batch ``k - 1`` is late (dropped); a record
    whose id (``event_id``, else its own partition/offset) is remembered is a duplicate (dropped); any other is
    remembered until the batch that ends with a watermark at or after ``event time + watermark delay`` (then
    forgotten) and counted in each ``window_ms`` window, starting on a multiple of ``slide_ms``, that holds
    its event time. A window is final once it ends at or before ``max(event time of counted records before the
    last batch) - delay``.
    """
    mapping = expected_campaign_catalog(inp.lookups.get("campaigns", ()))
    positions, late_wm = late_watermarks(inp)
    by_batch: dict[int, list[Validated]] = defaultdict(list)
    for v, pos in zip(inp.events, positions):
        if pos is not None and v.error is None and v.value["event_type"] in ("view", "click"):
            by_batch[pos].append(v)
    remembered: dict[Any, int] = {}  # dedupe key -> expires at (event time + delay)
    counts: dict[tuple[str, int], list[int]] = {}
    last: dict[tuple[str, int], int] = {}
    max_time: int | None = None
    for pos in sorted(by_batch):
        # the state batch pos - 1 evicted at its end, with the watermark that is pos's late bound
        remembered = {k: expires for k, expires in remembered.items() if expires > late_wm[pos]}
        for v in by_batch[pos]:
            campaign = mapping.get(v.value["ad_id"])
            if campaign is None:
                continue
            t = v.value["event_time"]
            if t <= late_wm[pos]:
                continue  # behind the watermark: dropped
            key = v.value.get("event_id") or (v.record.partition, v.record.offset)
            if key in remembered:
                continue  # a copy of a counted record
            remembered[key] = t + watermark_ms
            newest = t - t % slide_ms
            for start in range(newest, t - window_ms, -slide_ms):
                slot = counts.setdefault((campaign, start), [0, 0])
                slot[0 if v.value["event_type"] == "view" else 1] += 1
                last[(campaign, start)] = max(last.get((campaign, start), t), t)
            if counts_for_finality(inp, pos):
                max_time = t if max_time is None else max(max_time, t)
    return {k: (*n, last[k], max_time is not None and k[1] + window_ms <= max_time - watermark_ms)
            for k, n in counts.items()}


def _window_counts_v1(inp: OracleInput) -> dict[tuple, tuple]:
    """campaign_window_counts v1 with micro-batch semantics: -> (window end ms, views, last event ms, is_final)."""
    return {k: (k[1] + 10_000, *v) for k, v in _windows(inp, counted=("view",), window_ms=10_000,
                                                          watermark_ms=30_000).items()}


def _window_counts_v2(inp: OracleInput) -> dict[tuple, tuple]:
    """campaign_window_counts v2: -> (window end ms, views, clicks, last event ms, is_final)."""
    return {k: (k[1] + 60_000, *v) for k, v in expected_window_counts_v2(inp).items()}


def _window_counts_v3(inp: OracleInput) -> dict[tuple, tuple]:
    """campaign_window_counts v3: -> (window end ms, views, clicks, last event ms, is_final)."""
    return {k: (k[1] + 60_000, *v) for k, v in expected_window_counts_v3(inp).items()}


def _window_row_v1(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["campaign_id"], epoch_ms(row["window_start"])),
            (epoch_ms(row["window_end"]), row["view_count"], epoch_ms(row["last_event_time"]), row["is_final"]))


def _window_row_v2(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["campaign_id"], epoch_ms(row["window_start"])),
            (epoch_ms(row["window_end"]), row["view_count"], row["click_count"], epoch_ms(row["last_event_time"]),
             row["is_final"]))


#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for)
ORACLES = {
    1: OracleSpec(
        compute=_window_counts_v1, keys=("campaign_id", "window_start"),
        values=("window_end", "view_count", "last_event_time", "is_final"), adapt=_window_row_v1,
        uses_batches=True),
    2: OracleSpec(
        compute=_window_counts_v2, keys=("campaign_id", "window_start"),
        values=("window_end", "view_count", "click_count", "last_event_time", "is_final"), adapt=_window_row_v2,
        uses_batches=True),
    3: OracleSpec(
        compute=_window_counts_v3, keys=("campaign_id", "window_start"),
        values=("window_end", "view_count", "click_count", "last_event_time", "is_final"), adapt=_window_row_v2,
        uses_batches=True),
}

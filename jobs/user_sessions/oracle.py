"""The oracle of user_sessions: per-user sessions (30 s gap) closed by the recorded micro-batches' watermarks, in
plain Python."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

from kappa.verify.oracle import OracleInput, OracleSpec, Validated, epoch_ms, late_watermarks

__all__ = ["ORACLES", "SESSION_GAP_MS", "expected_sessions", "expected_sessions_batched", "late_session_records"]


#: user_sessions v1: a session closes this long after its last event (the view's gap and watermark delay).
SESSION_GAP_MS = 30_000


def expected_sessions(events: Iterable[Validated], *, gap_ms: int = SESSION_GAP_MS, watermark_ms: int = SESSION_GAP_MS,
                      closed_only: bool = True) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(user_id, session_start_ms) -> (session_end_ms, event_count, distinct_ads).

    A session is the maximal run of a user's events where each event comes at most ``gap_ms`` after the previous
    one (an event exactly ``gap_ms`` later still belongs to it: the windows ``[t, t+gap)`` touch, and touching
    session windows merge); it ends ``gap_ms`` after its last event. With ``closed_only`` only sessions whose end is at or
    before the final watermark (max event time - ``watermark_ms``) are returned.
    """
    by_user: dict[str, list[tuple[int, str]]] = defaultdict(list)
    max_time = None
    for v in events:
        if v.error is not None:
            continue
        t = v.value["event_time"]
        by_user[v.value["user_id"]].append((t, v.value["ad_id"]))
        max_time = t if max_time is None else max(max_time, t)
    if max_time is None:
        return {}
    watermark = max_time - watermark_ms
    sessions = {}
    for user, items in by_user.items():
        items.sort()
        start, end, count, ads = None, None, 0, set()
        for t, ad in items:
            if start is not None and t <= end:  # an event exactly `gap` after the last one continues it
                end = max(end, t + gap_ms)
                count += 1
                ads.add(ad)
                continue
            if start is not None:
                sessions[(user, start)] = (end, count, len(ads))
            start, end, count, ads = t, t + gap_ms, 1, {ad}
        if start is not None:
            sessions[(user, start)] = (end, count, len(ads))
    if closed_only:
        sessions = {k: v for k, v in sessions.items() if v[0] <= watermark}
    return sessions


def expected_sessions_batched(inp: OracleInput, *, gap_ms: int = SESSION_GAP_MS) -> dict[tuple, tuple]:
    """user_sessions v1 with Spark's micro-batch semantics (append mode, session windows, 30 s watermark).

    (user_id, session_start_ms) -> (session_end_ms, event_count, distinct_ads, last_event_ms). Per micro-batch
    ``k`` in order: a valid event whose own session window ``[t, t + gap)`` ends at or before the previous batch's
    watermark is dropped as late - Spark filters late input row by row, before any merging (with
    ``spark.sql.streaming.sessionWindow.merge.sessions.in.local.partition`` at its default, false), so a late
    event is dropped even when a later event of the same batch, or an open session, would have covered it; the
    user's other events of the batch merge among themselves into sessions (an event at most ``gap_ms`` after the
    previous one continues a session) and then with the user's open sessions; open sessions ending at or before
    batch ``k``'s watermark are emitted (written once) and forgotten. Events after the last recorded batch are
    not processed yet; sessions still open are not in the table.
    """
    batches = inp.batches or []
    positions, late_wm = late_watermarks(inp)
    per_batch: list[dict[str, list[tuple[int, str]]]] = [defaultdict(list) for _ in batches]
    for v, pos in zip(inp.events, positions):
        if pos is None or v.error is not None:
            continue
        t = v.value["event_time"]
        if t + gap_ms <= late_wm[pos]:
            continue  # dropped as late by Spark (late_session_records)
        per_batch[pos][v.value["user_id"]].append((t, v.value["ad_id"]))

    def merge(items: list[tuple[int, int, int, set[str], int]]) -> list[tuple[int, int, int, set[str], int]]:
        """Merge (start, end, count, ads, last) sessions that overlap or touch."""
        out: list[tuple[int, int, int, set[str], int]] = []
        for start, end, count, ads, last in sorted(items, key=lambda x: (x[0], x[1])):
            if out and start <= out[-1][1]:
                s0, e0, c0, a0, l0 = out[-1]
                out[-1] = (s0, max(e0, end), c0 + count, a0 | ads, max(l0, last))
            else:
                out.append((start, end, count, set(ads), last))
        return out

    open_sessions: dict[str, list[tuple[int, int, int, set[str], int]]] = defaultdict(list)
    emitted: dict[tuple, tuple] = {}
    for batch, rows in zip(batches, per_batch):
        for user, items in rows.items():
            open_sessions[user] = merge(open_sessions[user] + [(t, t + gap_ms, 1, {ad}, t) for t, ad in items])
        for user in list(open_sessions):
            keep = []
            for start, end, count, ads, last in open_sessions[user]:
                if end <= batch.watermark_ms:
                    emitted[(user, start)] = (end, count, len(ads), last)
                else:
                    keep.append((start, end, count, ads, last))
            open_sessions[user] = keep
    return emitted


def late_session_records(inp: OracleInput, *, gap_ms: int = SESSION_GAP_MS) -> set[tuple[int, int]]:
    """(partition, offset) of the valid events that user_sessions drops as late: the event's own session window
    ``[t, t + gap)`` had ended at or before the previous micro-batch's watermark when it arrived (see
    :func:`expected_sessions_batched`); the view keeps them in the quarantine with reason ``late``."""
    positions, late_wm = late_watermarks(inp)
    return {(v.record.partition, v.record.offset) for v, pos in zip(inp.events, positions)
            if pos is not None and v.error is None and v.value["event_time"] + gap_ms <= late_wm[pos]}


def _session_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["user_id"], epoch_ms(row["session_start"])),
            (epoch_ms(row["session_end"]), row["event_count"], row["distinct_ads"], epoch_ms(row["last_event_time"])))


#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for)
ORACLES = {
    1: OracleSpec(
        compute=expected_sessions_batched, keys=("user_id", "session_start"),
        values=("session_end", "event_count", "distinct_ads", "last_event_time"), adapt=_session_row,
        uses_batches=True),
}

"""Independent recomputation of the views from the raw log, in plain Python.

This module shares no code with the Spark path (no ``kappa.runtime.parsing``, no ``jobs``): records are read with a
plain confluent-kafka consumer, validated with ``jsonschema`` against ``schemas/``, and every view is
recomputed with dictionaries and sorting. Tests and the replay verification compare the Delta tables with it.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from kappa.runtime.lineage import BatchBoundary

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = [
    "LogRecord",
    "read_log",
    "Validated",
    "validate_records",
    "expected_events_raw",
    "expected_campaign_catalog",
    "expected_window_counts",
    "expected_window_counts_v2",
    "expected_sessions",
    "MAX_VALUE_BYTES",
    "OracleInput",
    "OracleSpec",
    "ORACLES",
    "late_window_records",
    "late_session_records",
    "expected_sessions_batched",
    "SESSION_GAP_MS",
]

#: Size limits of the platform's record contract (schemas/README.md).
MAX_VALUE_BYTES = {"ad_event": 16 * 1024, "campaign": 4 * 1024}
#: user_sessions v1: a session closes this long after its last event (the view's gap and watermark delay).
SESSION_GAP_MS = 30_000


@dataclass(frozen=True)
class LogRecord:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None


def read_log(settings: "Settings", topic: str, *, start: Mapping[int, int] | None = None,
             end: Mapping[int, int] | None = None, timeout: float = 60.0) -> list[LogRecord]:
    """Every record of ``topic`` in ``[start, end)`` per partition (default: whole retained log up to now)."""
    from confluent_kafka import Consumer, TopicPartition

    conf = {**settings.kafka_client_config(), "group.id": "kappa-oracle", "enable.auto.commit": False,
            "enable.partition.eof": True, "auto.offset.reset": "earliest"}
    consumer = Consumer(conf)
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        partitions = sorted(meta.partitions)
        bounds: dict[int, tuple[int, int]] = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            lo = max(low, (start or {}).get(p, low))
            hi = min(high, (end or {}).get(p, high))
            if hi > lo:
                bounds[p] = (lo, hi)
        if not bounds:
            return []
        consumer.assign([TopicPartition(topic, p, lo) for p, (lo, _hi) in bounds.items()])
        records: list[LogRecord] = []
        pending = set(bounds)
        import time

        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(pending)} did not reach their end")
            for msg in consumer.consume(num_messages=10000, timeout=1.0):
                p = msg.partition()
                if msg.error() is not None:
                    if msg.error().code() == msg.error()._PARTITION_EOF:
                        continue
                    raise RuntimeError(str(msg.error()))
                if p not in pending:
                    continue
                if msg.offset() >= bounds[p][1]:
                    pending.discard(p)
                    continue
                records.append(LogRecord(topic, p, msg.offset(), msg.timestamp()[1], msg.key(), msg.value()))
                if msg.offset() == bounds[p][1] - 1:
                    pending.discard(p)
        return records
    finally:
        consumer.close()


@dataclass(frozen=True)
class Validated:
    record: LogRecord
    value: dict | None  # parsed JSON (None for a tombstone)
    error: str | None


def validate_records(records: Iterable[LogRecord], subject: str, *, key_field: str | None,
                     tombstones: bool = False) -> list[Validated]:
    """Validate each record with ``jsonschema`` (independent of the Spark validator)."""
    import jsonschema

    from kappa.log.schemas import load as load_schema

    validator = jsonschema.Draft202012Validator(load_schema(subject))
    limit = MAX_VALUE_BYTES[subject]
    out = []
    for rec in records:
        error = None
        value = None
        if rec.key is None:
            error = "null key"
        elif rec.value is None:
            error = None if tombstones else "null value"
        elif len(rec.value) > limit:
            error = "oversized"
        else:
            try:
                value = json.loads(rec.value)
            except ValueError:
                error = "malformed JSON"
            else:
                if not isinstance(value, dict):
                    error = "not an object"
                else:
                    errs = list(validator.iter_errors(value))
                    if errs:
                        error = errs[0].message
                    elif any(type(value.get(name)) is float
                             for name, prop in validator.schema["properties"].items()
                             if prop.get("type") == "integer"):
                        error = "integer field written as a float"
                    elif key_field and value.get(key_field) != rec.key.decode("utf-8", "replace"):
                        error = "key mismatch"
        out.append(Validated(rec, value if error is None else None, error))
    return out


def _ms_to_window(ms: int, size_ms: int) -> int:
    return ms - (ms % size_ms)


def expected_events_raw(validated: Iterable[Validated]) -> dict[tuple[int, int], dict]:
    """(partition, offset) -> event fields, for every valid ad event."""
    return {(v.record.partition, v.record.offset): v.value for v in validated if v.error is None}


def expected_campaign_catalog(validated: Iterable[Validated]) -> dict[str, str]:
    """ad_id -> campaign_id after applying every valid record in log order (tombstones delete)."""
    table: dict[str, str] = {}
    for v in sorted((v for v in validated if v.error is None),
                    key=lambda v: (v.record.partition, v.record.offset)):
        key = v.record.key.decode()
        if v.record.value is None:
            table.pop(key, None)
        else:
            table[key] = v.value["campaign_id"]
    return table


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


# ===================================================================================================== replays
# What verification of a replayed view version needs: which oracle recomputes (view, version) and how a row of the
# Delta table maps onto the oracle's (key, value) form. Topics, record formats and lookups are the view's own
# declaration (kappa.runtime.view.ViewDefinition).


@dataclass(frozen=True)
class OracleInput:
    """Everything an oracle recomputes a view from.

    Attributes:
        events: Validated records of the view's stream topic in the verified offset range, in log order.
        lookups: Lookup name -> validated records of its (compacted) topic, whole retained log.
        batches: Micro-batch boundaries recorded by the job, oldest first; ``None`` = one single batch. Only
            event-time views use them: which records arrived after the watermark passed their window depends
            on where the batches were cut, not on the business logic.
    """

    events: Sequence[Validated]
    lookups: Mapping[str, Sequence[Validated]] = field(default_factory=dict)
    batches: Sequence[BatchBoundary] | None = None


@dataclass(frozen=True)
class OracleSpec:
    """How to verify one view version.

    Attributes:
        compute: ``OracleInput -> {key tuple: value tuple}``.
        keys: Key columns of the table (unique per row).
        values: Value columns compared (in the order of the value tuples).
        adapt: Table row (column -> Python value) -> ``(key tuple, value tuple)`` in the oracle's form.
        uses_batches: The result depends on micro-batch boundaries (event-time watermark).
    """

    compute: Callable[[OracleInput], dict[tuple, tuple]]
    keys: tuple[str, ...]
    values: tuple[str, ...]
    adapt: Callable[[Mapping[str, Any]], tuple[tuple, tuple]]
    uses_batches: bool = False


def _epoch_ms(value: Any) -> int | None:
    """Delta timestamp (datetime, naive = UTC) -> epoch millis."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(round(value.timestamp() * 1000))
    return int(value)


def _batch_index(records: Sequence[Validated], batches: Sequence[BatchBoundary] | None) -> list[int | None]:
    """Position in ``batches`` of each record (None: after the last recorded batch, not processed yet)."""
    if batches is None:
        return [0] * len(records)
    parts = {p for b in batches for p in b.end_offsets}
    ends: dict[int, list[int]] = {p: [] for p in parts}
    for b in batches:
        for p in parts:
            prev = ends[p][-1] if ends[p] else 0
            ends[p].append(max(prev, b.end_offsets.get(p, prev)))
    out: list[int | None] = []
    for v in records:
        per = ends.get(v.record.partition)
        i = bisect.bisect_right(per, v.record.offset) if per else len(batches)
        out.append(i if i < len(batches) else None)
    return out


def _late_watermarks(inp: OracleInput) -> tuple[list[int | None], list[int]]:
    """Each event's micro-batch position, and per position the watermark its late rows are dropped by (the one
    the previous batch ran with; 0 for the first)."""
    batches = inp.batches
    late_wm: list[int] = [0]
    if batches:
        late_wm = [0] + [b.watermark_ms for b in batches[:-1]]
    return _batch_index(inp.events, batches), late_wm


def late_window_records(inp: OracleInput, *, counted: tuple[str, ...], window_ms: int) -> set[tuple[int, int]]:
    """(partition, offset) of the valid records of a counted type whose tumbling window had ended at or before
    the watermark of the previous micro-batch when they arrived: Spark drops them; a view declaring
    ``late_bound`` keeps them in the quarantine with reason ``late``."""
    positions, late_wm = _late_watermarks(inp)
    return {(v.record.partition, v.record.offset) for v, pos in zip(inp.events, positions)
            if pos is not None and v.error is None and v.value["event_type"] in counted
            and _ms_to_window(v.value["event_time"], window_ms) + window_ms <= late_wm[pos]}


def _windows(inp: OracleInput, *, counted: tuple[str, ...], window_ms: int,
             watermark_ms: int) -> dict[tuple, tuple]:
    """Tumbling event-time windows per campaign with Spark's update-mode watermark semantics.

    Per micro-batch ``k`` (in order): valid events of a counted type whose ad has a campaign are dropped as late
    when their window ends at or before the watermark of batch ``k - 1`` (Spark filters late rows with the
    previous batch's watermark and evicts state with the current one); the others are counted. A window is
    final once it ends at or before ``max(event time of counted rows) - watermark``. Value tuple: one count per
    type in ``counted``, the window's max event time (ms), ``is_final``.
    """
    mapping = expected_campaign_catalog(inp.lookups.get("campaigns", ()))
    positions, late_wm = _late_watermarks(inp)
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
        max_time = t if max_time is None else max(max_time, t)
    if max_time is None:
        return {}
    final_before = max_time - watermark_ms
    return {k: (*n, last[k], k[1] + window_ms <= final_before) for k, n in counts.items()}


def expected_window_counts_v2(inp: OracleInput, *, window_ms: int = 60_000,
                              watermark_ms: int = 30_000) -> dict[tuple[str, int], tuple[int, int, int, bool]]:
    """campaign_window_counts v2: (campaign_id, window_start_ms) -> (views, clicks, last event ms, is_final).

    60 s tumbling windows counting ``view`` and ``click`` events separately (see :func:`_windows` for the
    watermark semantics).
    """
    return _windows(inp, counted=("view", "click"), window_ms=window_ms, watermark_ms=watermark_ms)


def _window_counts_v1(inp: OracleInput) -> dict[tuple, tuple]:
    """campaign_window_counts v1 with micro-batch semantics: -> (views, last event ms, is_final)."""
    return _windows(inp, counted=("view",), window_ms=10_000, watermark_ms=30_000)


def _window_row_v1(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["campaign_id"], _epoch_ms(row["window_start"])),
            (row["view_count"], _epoch_ms(row["last_event_time"]), row["is_final"]))


def _window_row_v2(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["campaign_id"], _epoch_ms(row["window_start"])),
            (row["view_count"], row["click_count"], _epoch_ms(row["last_event_time"]), row["is_final"]))


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
    positions, late_wm = _late_watermarks(inp)
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
    positions, late_wm = _late_watermarks(inp)
    return {(v.record.partition, v.record.offset) for v, pos in zip(inp.events, positions)
            if pos is not None and v.error is None and v.value["event_time"] + gap_ms <= late_wm[pos]}


def _session_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return ((row["user_id"], _epoch_ms(row["session_start"])),
            (_epoch_ms(row["session_end"]), row["event_count"], row["distinct_ads"], _epoch_ms(row["last_event_time"])))


_RAW_FIELDS = ("user_id", "page_id", "ad_id", "ad_type", "event_type", "event_time", "ip")


def _events_raw(inp: OracleInput) -> dict[tuple, tuple]:
    return {k: tuple(v[f] for f in _RAW_FIELDS) for k, v in expected_events_raw(inp.events).items()}


def _events_raw_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return (row["partition"], row["offset"]), tuple(row[f] for f in _RAW_FIELDS)


def _campaign_catalog(inp: OracleInput) -> dict[tuple, tuple]:
    return {(ad,): (campaign,) for ad, campaign in expected_campaign_catalog(inp.events).items()}


def _campaign_catalog_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return (row["ad_id"],), (row["campaign_id"],)


#: (view, version) -> how verification recomputes it. Views without an entry can only be replayed with
#: ``verify="none"``.
ORACLES: dict[tuple[str, int], OracleSpec] = {
    ("campaign_window_counts", 1): OracleSpec(
        compute=_window_counts_v1, keys=("campaign_id", "window_start"),
        values=("view_count", "last_event_time", "is_final"), adapt=_window_row_v1,
        uses_batches=True),
    ("campaign_window_counts", 2): OracleSpec(
        compute=expected_window_counts_v2, keys=("campaign_id", "window_start"),
        values=("view_count", "click_count", "last_event_time", "is_final"), adapt=_window_row_v2,
        uses_batches=True),
    ("user_sessions", 1): OracleSpec(
        compute=expected_sessions_batched, keys=("user_id", "session_start"),
        values=("session_end", "event_count", "distinct_ads", "last_event_time"), adapt=_session_row,
        uses_batches=True),
    ("events_raw", 1): OracleSpec(
        compute=_events_raw, keys=("partition", "offset"), values=_RAW_FIELDS,
        adapt=_events_raw_row),
    ("campaign_catalog", 1): OracleSpec(
        compute=_campaign_catalog, keys=("ad_id",), values=("campaign_id",),
        adapt=_campaign_catalog_row),
}

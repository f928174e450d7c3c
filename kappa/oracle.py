"""Independent recomputation of the views from the raw log, in plain Python.

This module shares no code with the Spark path (no ``kappa.parsing``, no ``jobs``): records are read with a
plain confluent-kafka consumer, validated with ``jsonschema`` against ``schemas/``, and every view is
recomputed with dictionaries and sorting. Tests and the replay verification compare the Delta tables with it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

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
    "expected_sessions",
    "MAX_VALUE_BYTES",
]

#: Size limits of the platform's record contract (schemas/README.md).
MAX_VALUE_BYTES = {"ad_event": 16 * 1024, "campaign": 4 * 1024}


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

    from kappa.schemas import load as load_schema

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


def expected_sessions(events: Iterable[Validated], *, gap_ms: int = 30_000, watermark_ms: int = 30_000,
                      closed_only: bool = True) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(user_id, session_start_ms) -> (session_end_ms, event_count, distinct_ads).

    A session is the maximal run of a user's events where each event starts within ``gap_ms`` of the previous
    one's time; it ends ``gap_ms`` after its last event. With ``closed_only`` only sessions whose end is at or
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
            if start is not None and t < end:
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

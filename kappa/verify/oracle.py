"""Independent recomputation of the views from the raw log, in plain Python.

This module shares no code with the Spark path (no ``kappa.runtime.parsing``): records are read with a plain
confluent-kafka consumer and validated with ``jsonschema`` against ``schemas/``. What a view's table must hold is
computed, with dictionaries and sorting, by the view's own oracle next to it: ``jobs/<view>/oracle.py`` declares
``ORACLES = {version: OracleSpec(...)}`` (:func:`oracle_for` finds it). Tests and the replay verification compare
the Delta tables with it; a view without one is verified by the recompute alone.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from kappa.runtime.lineage import BatchBoundary

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["MAX_VALUE_BYTES", "LogRecord", "OracleInput", "OracleSpec", "Validated", "batch_index", "epoch_ms",
           "counts_for_finality", "late_watermarks", "oracle_for", "read_log", "validate_records"]

#: Size limits of the platform's record contract (schemas/README.md).
MAX_VALUE_BYTES = {"ad_event": 16 * 1024, "campaign": 4 * 1024, "campaign_window": 4 * 1024}


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
    """Every record of ``topic`` in ``[start, end)`` per partition (default: whole retained log up to now). What
    the log no longer holds of an explicit start comes from the topic's archive (:func:`archived_records`)."""
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
        gone = {p: (o, min(low, (end or {}).get(p, low))) for p, o in (start or {}).items()
                for low, _high in [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)]
                if 0 <= o < low}
        archived = archived_records(settings, topic, gone) if gone else []
        if not bounds:
            return archived
        consumer.assign([TopicPartition(topic, p, lo) for p, (lo, _hi) in bounds.items()])
        records: list[LogRecord] = []
        pending = set(bounds)
        import time

        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(pending)} did not reach their end")
            # a batch returns when full or after the timeout: a short one, or every read ends with a full wait
            for msg in consumer.consume(num_messages=10000, timeout=0.1):
                p = msg.partition()
                if msg.error() is not None:
                    if msg.error().code() == msg.error()._PARTITION_EOF:
                        # at the log end, which is at or past the bound (a control record or a compacted
                        # offset can be the last one below it)
                        pending.discard(p)
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
        return archived + records
    finally:
        consumer.close()


def archived_records(settings: "Settings", topic: str, ranges: Mapping[int, tuple[int, int]]) -> list[LogRecord]:
    """The records ``[lo, hi)`` per partition of ``topic`` from its archive (:mod:`kappa.runtime.archive`), read with
    delta-rs, not Spark, in offset order.

    Raises:
        RuntimeError: No view archives the topic, or the archive does not hold every record of the ranges.
    """
    from kappa.runtime.archive import archive_of, archive_query

    declared = topic[len(settings.topic_prefix):] if topic.startswith(settings.topic_prefix) else topic
    found = archive_of(settings, declared)
    if found is None:
        raise RuntimeError(f"{topic}: the log no longer holds {dict(ranges)} and no view archives {declared}")
    out: list[LogRecord] = []
    for p, (lo, hi) in sorted(ranges.items()):
        if hi <= lo:
            continue
        rows = archive_query(found[1], 'SELECT "offset", kafka_timestamp, raw_key, raw_value FROM t WHERE '
                                       f'"partition" = {int(p)} AND "offset" >= {int(lo)} AND "offset" < {int(hi)} '
                                       'ORDER BY "offset"')
        if [r["offset"] for r in rows] != list(range(lo, hi)):
            raise RuntimeError(f"archive {found[1]}: partition {p} does not hold every record of [{lo}, {hi})")
        out += [LogRecord(topic, p, r["offset"], epoch_ms(r["kafka_timestamp"]) or 0, r["raw_key"], r["raw_value"])
                for r in rows]
    return out


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
        values: Value columns compared (in the order of the value tuples): every other column of the table.
        adapt: Table row (column -> Python value) -> ``(key tuple, value tuple)`` in the oracle's form.
        uses_batches: The result depends on micro-batch boundaries (event-time watermark).
    """

    compute: Callable[[OracleInput], dict[tuple, tuple]]
    keys: tuple[str, ...]
    values: tuple[str, ...]
    adapt: Callable[[Mapping[str, Any]], tuple[tuple, tuple]]
    uses_batches: bool = False


def epoch_ms(value: Any) -> int | None:
    """Delta timestamp (datetime, naive = UTC) -> epoch millis."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(round(value.timestamp() * 1000))
    return int(value)


def batch_index(records: Sequence[Validated], batches: Sequence[BatchBoundary] | None) -> list[int | None]:
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


def late_watermarks(inp: OracleInput) -> tuple[list[int | None], list[int]]:
    """Each event's micro-batch position, and per position the watermark its late rows are dropped by (the one
    the previous batch ran with; 0 for the first)."""
    batches = inp.batches
    late_wm: list[int] = [0]
    if batches:
        late_wm = [0] + [b.watermark_ms for b in batches[:-1]]
    return batch_index(inp.events, batches), late_wm


def counts_for_finality(inp: OracleInput, pos: int | None) -> bool:
    """Does an event of batch position ``pos`` move a windowed table's finality yet? After committing batch ``k``
    a window is final when it ends at or before ``max(event time through batch k - 1) - delay``
    (:mod:`kappa.runtime.sink`): the events of the last recorded batch do not count yet. Without recorded
    batches (one batch job over the range) every event counts."""
    return pos is not None and (not inp.batches or pos < len(inp.batches) - 1)


def oracle_for(view: str, version: int) -> OracleSpec | None:
    """The oracle of a declared view version: ``ORACLES[version]`` of the ``oracle`` module in the package of the
    version's module (``jobs.user_sessions.v1`` -> ``jobs.user_sessions.oracle``); None when it has none."""
    from kappa.catalog import load_catalog

    package = load_catalog().module_of(view, version).rpartition(".")[0]
    if not package:
        return None
    name = f"{package}.oracle"
    try:
        module = import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None
    return getattr(module, "ORACLES", {}).get(version)

"""A testing kit for view authors: run a view version's transform on a few hand-written records, without Kafka.

A unit test of a view gives the records each micro-batch reads (dicts, as the producer would send them, or raw
bytes for a malformed one) and, for a view with lookups, the records of each lookup topic. :func:`run_view`
decodes and validates them with the platform's own decoder (:mod:`kappa.runtime.parsing`), runs the transform the way
the job does - a stateful view in a streaming query fed one batch at a time, so watermarks, late rows, state
eviction and no-data batches behave as in production; a stateless one per batch - and applies the view's write
semantics (append, merge: the last batch wins, upsert/delete with tombstones, the finality flag). What comes back
is what the view's table would hold, plus what went to the quarantine and each batch's own output::

    from kappa.runtime.testing import run_view
    from jobs.campaign_window_counts.v1 import VIEW

    run = run_view(VIEW, batches=[[view_event("u1", "a1", 1_000)], [view_event("u2", "a1", 45_000)]],
                   lookups={"campaigns": [{"ad_id": "a1", "campaign_id": "c1"}]})
    assert run.rows == [{"campaign_id": "c1", "window_start": ..., "view_count": 1, ...}, ...]

It needs a local Spark (pyspark), nothing else: no broker, no Delta, no jars. The same machinery re-runs a
replayed version for its verification (:mod:`kappa.runtime.rerun`), so a view tested here is tested the way
it is verified.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

    from kappa.runtime.parsing import RecordFormat
    from kappa.runtime.view import ViewDefinition

__all__ = ["Quarantined", "ViewRun", "local_spark", "run_view"]

#: Kafka timestamp of a record without an event-time field (2023-11-14 22:13:20 UTC).
BASE_TIMESTAMP_MS = 1_700_000_000_000
#: How long a run waits for the no-data batch the engine may run after the last batch.
NO_DATA_WAIT_SECONDS = 2.0
_KAFKA_SCHEMA = ("key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
                 "timestampType INT")


@dataclass(frozen=True)
class Quarantined:
    """A record the decoder refused: where it was in the batches and why."""

    batch: int
    offset: int
    reason: str
    raw_value: bytes | None


@dataclass(frozen=True)
class ViewRun:
    """What one run of a view over the given batches produced.

    Attributes:
        rows: The table's rows after every batch, in key order (dicts; timestamps are naive UTC datetimes).
        batches: Each micro-batch's own output rows (before the write semantics), in order; for a stateful view
            one more at the end: the no-data batch the engine ran after the last one (empty if it ran none).
        quarantined: The invalid records (reason as the quarantine table would hold it).
        schema: The Spark schema of the transform's output (``StructType``; what the job's table is made from).
    """

    rows: list[dict[str, Any]]
    batches: list[list[dict[str, Any]]] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    schema: Any = None


def local_spark() -> "SparkSession":
    """The active Spark session, else a small local one (1 core, 1 shuffle partition, UTC, no UI)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession() or SparkSession._instantiatedSession  # noqa: SLF001 - any thread's
    if active is not None:
        return active
    return (SparkSession.builder.master("local[1]").appName("kappa-testing")
            .config("spark.sql.shuffle.partitions", "1").config("spark.default.parallelism", "1")
            .config("spark.sql.session.timeZone", "UTC").config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false").getOrCreate())


def run_view(view: "ViewDefinition", batches: Sequence[Sequence[Any]], *,
             lookups: Mapping[str, Sequence[Any]] | None = None,
             spark: "SparkSession | None" = None, timeout: float = 300.0) -> ViewRun:
    """Run ``view`` over ``batches`` of records, one micro-batch each, and return what its table would hold.

    Args:
        view: The view version (``VIEW`` of its module).
        batches: The records of each micro-batch of the view's stream topic, in log order: a dict is sent as
            JSON keyed by the format's key field (else its key column: ``ad_id`` of a campaign); ``(key, value)``
            sets the key (``value`` None: a tombstone); bare ``bytes`` are sent as they are, keyed ``"k"`` (a
            malformed record). An empty batch is a micro-batch without records.
        lookups: For each lookup the view declares, its topic's records in log order, in the same forms; a
            declared lookup not given is empty.
        spark: The session to use (default: :func:`local_spark`).
        timeout: Give up after this many seconds.
    """
    from pyspark.sql.types import IntegerType, StructField, StructType

    from kappa.runtime.lookups import latest_values
    from kappa.runtime.parsing import decode, invalid_rows, valid_rows
    from kappa.runtime.rerun import (BATCH, Step, apply_writes, empty_parquet, rerun_stateful, rerun_stateless,
                                        stage_batches)

    spark = spark or local_spark()
    given = dict(lookups or {})
    unknown = set(given) - set(view.lookups)
    if unknown:
        raise ValueError(f"{view.ref} declares no lookup {', '.join(sorted(unknown))} "
                         f"(declared: {', '.join(sorted(view.lookups)) or 'none'})")
    frames = {name: latest_values(_raw(spark, lookup.topic, lookup.format, [given.get(name, [])]), lookup).persist()
              for name, lookup in view.lookups.items()}
    steps = [Step(pos=i, data=True, lookups={}) for i in range(len(batches))]
    if view.stateful:  # as in production, the engine may run a no-data batch after the last one (watermark moved)
        steps.append(Step(pos=len(batches), data=False, lookups={}))
    ends, total = [], 0
    for batch in batches:
        total += len(batch)
        ends.append(total)
    raw = _raw(spark, view.stream_topic, view.stream_format, batches)
    decoded = decode(raw, view.stream_format)
    scratch = Path(tempfile.mkdtemp(prefix=f"kappa-testing-{view.name}-"))
    try:
        staged, feed, out = scratch / "batches", scratch / "feed", scratch / "out"
        feed.mkdir()
        schema = valid_rows(decoded).schema
        stage_batches(spark, decoded, steps[:len(batches)], {0: ends}, {0: 0}, staged)
        lookups_for = _Fixed(frames)
        if view.stateful:
            out_schema, _run, _skipped = rerun_stateful(
                spark, view, steps, staged=staged, feed=feed, out=out, schema=schema, lookups_for=lookups_for,
                empty=lambda: empty_parquet(spark, schema, scratch / "empty"), checkpoint=scratch / "checkpoint",
                timeout=timeout, no_data_wait=NO_DATA_WAIT_SECONDS)
        else:
            out_schema, _run, _skipped = rerun_stateless(spark, view, steps, staged=staged, out=out, schema=schema,
                                                         lookups_for=lookups_for, per_batch=True)
        outputs = spark.read.schema(StructType([*out_schema.fields, StructField(BATCH, IntegerType())])).parquet(
            str(out))
        table = apply_writes(view, outputs, last=steps[-1].pos)
        order = list(view.keys) or table.columns
        rows = [r.asDict(recursive=True) for r in table.orderBy(*order).collect()]
        per_batch: list[list[dict[str, Any]]] = [[] for _ in steps]
        for r in outputs.orderBy(BATCH, *order).collect():
            d = r.asDict(recursive=True)
            per_batch[d.pop(BATCH)].append(d)
        bounds = [0, *ends]
        quarantined = [
            Quarantined(batch=next(i for i in range(len(batches)) if bounds[i] <= r["offset"] < bounds[i + 1]),
                        offset=r["offset"], reason=r["_error"],
                        raw_value=bytes(r["raw_value"]) if r["raw_value"] is not None else None)
            for r in invalid_rows(decoded).select("offset", "_error", "raw_value").orderBy("offset").collect()]
        return ViewRun(rows=rows, batches=per_batch, quarantined=quarantined, schema=out_schema)
    finally:
        for frame in frames.values():
            frame.unpersist()
        shutil.rmtree(scratch, ignore_errors=True)


class _Fixed:
    """The lookups of a test run: the same contents for every batch."""

    def __init__(self, frames: Mapping[str, "DataFrame"]) -> None:
        self.frames = dict(frames)

    def __call__(self, pos: int) -> dict[str, "DataFrame"]:
        return dict(self.frames)

    def single(self) -> dict[str, "DataFrame"]:
        return dict(self.frames)

    def key(self, pos: int) -> tuple:
        return ()


def _raw(spark: "SparkSession", topic: str, fmt: "RecordFormat", batches: Sequence[Sequence[Any]]) -> "DataFrame":
    """Kafka source rows of ``topic`` (partition 0, consecutive offsets) for the records of ``batches``.

    A dict is the JSON value, keyed by its ``fmt.key_field`` (else ``fmt.key_column``) field; ``(key, value)``
    gives both (``value`` None: a tombstone; a dict: JSON; bytes: as they are); bare bytes are a value keyed
    ``"k"``. The Kafka timestamp is the record's event time when it has one.
    """
    key_field = fmt.key_field or fmt.key_column
    rows, offset = [], 0
    for batch in batches:
        for record in batch:
            if isinstance(record, tuple):
                key, value = record
            elif isinstance(record, Mapping):
                key, value = record.get(key_field), record
            else:
                key, value = "k", record
            millis = BASE_TIMESTAMP_MS + offset
            if isinstance(value, Mapping):
                event_ms = value.get(fmt.event_time_field) if fmt.event_time_field else None
                millis = event_ms if isinstance(event_ms, int) else millis
                value = json.dumps(value).encode()
            raw_key = key if key is None or isinstance(key, bytes) else str(key).encode()
            rows.append((raw_key, value, topic, 0, offset,
                         datetime.fromtimestamp(millis / 1000, UTC), 0))
            offset += 1
    return spark.createDataFrame(rows, _KAFKA_SCHEMA)

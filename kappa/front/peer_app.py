"""The benchmark peer's worker: the YSB windowed count as a Quix Streams application writing a Delta table.

Runs **only** in the peer's own interpreter (``.cache/peer-venv``, see :mod:`kappa.front.peer`): Quix Streams 3.28.1
needs ``confluent-kafka<2.13`` while the platform pins 2.16.1, so the two cannot share a venv. It imports nothing from
the platform (no Spark, no ``kappa.runtime.parsing``); :func:`kappa.front.peer.run_peer` starts it as
``python -m kappa.front.peer_app`` with a JSON job description on stdin and reads one ``PEER_RESULT {...}`` line from
its stdout (logs go to stderr).

The pipeline is what a Quix user writes for ``jobs/campaign_window_counts/v1.py``:

1. **Lookup** -- before the application starts, the compacted ``campaigns`` topic is read to its end with a plain
   consumer into a dict ``ad_id -> campaign_id`` (log order, tombstones delete, invalid records ignored): the peer's
   equivalent of Spark's stream-static join with the latest mapping.
2. **Validation** -- the topic's value deserializer is Quix's ``JSONDeserializer`` (orjson) with a validator for
   ``schemas/ad_event``, subclassed to also enforce the record contract's size limit (16 KiB) and to reject integer
   fields written as floats (``1.0`` passes JSON Schema's ``integer``). The validator is :class:`CompiledValidator`
   (the schema's rules precompiled; same verdicts as jsonschema, ~2.5x faster end to end) or, with
   ``"validator": "jsonschema"``, ``jsonschema.Draft202012Validator`` as ``JSONDeserializer(schema=...)`` builds it.
   A record that fails raises ``SerializationError``; ``on_consumer_error`` counts it and skips it. Null or
   mismatching keys (key != ``user_id``) are dropped by the first ``filter``. These are the rules of
   ``kappa.verify.oracle.validate_records``.
3. **Query** -- keep ``event_type == 'view'`` whose ad has a campaign, re-key by campaign (``group_by``: an internal
   repartition topic when the input has > 1 partition).
4. **Event time + window** -- ``set_timestamp`` takes the record's ``event_time`` (epoch ms) right after the
   re-keying (not a ``timestamp_extractor`` on the input: see the comment in :func:`run`), then
   ``tumbling_window(10 s, grace 30 s).count().final()``. Windows close per key (Quix's default closing strategy):
   a campaign's window is emitted once that campaign has seen an event 30 s past the window end; events for an
   already closed window are dropped (counted as ``late_dropped``). Quix processes records in arrival order and
   cannot align the partitions of one topic on event time, so replaying a multi-partition backlog drops views whose
   partition was read behind the others by more than the grace.
5. **Sink** -- a ``BatchingSink`` that appends the windows closed since the last checkpoint to the Delta table with
   delta-rs (one ``write_deltalake(mode="append")`` per checkpoint, i.e. every ``commit_interval`` = 5 s, Quix's
   default), so every window is written once, when final -- no merges.
6. **Tail** -- the input is finite: once every record was consumed (and every re-keyed record processed), the
   application is stopped (its final checkpoint flushes the sink), and the windows that never closed are read from
   the application's own final window state (Quix's RocksDB window store) and appended in one last commit. The
   table then holds every window with its count, like ``jobs.campaign_window_counts.oracle.expected_window_counts``.

Wall time is measured from the first record consumed to the commit of the last window.

**Live mode** (``"mode": "live"``, :func:`run_live`, started by :func:`kappa.front.peer.start_peer_live`) measures
end-to-end latency the way the platform's view does in Spark ``update`` mode: the consumer starts at the end of the
topic and prints ``PEER_READY`` once positioned, the window emits its *current* count and max event time on every
view, and each checkpoint (every second by default) MERGEs the windows changed since the previous one into the
table, recording ``commit wall time - last_event_time`` per row in histograms with the platform's
``LATENCY_BUCKETS``. It runs for a fixed time, then stops and prints latency percentiles in its ``PEER_RESULT``.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import json
import logging
import math
import shutil
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

RESULT_PREFIX = "PEER_RESULT "
#: Printed (alone on its line) by the live mode once it consumes every record produced from then on.
READY_LINE = "PEER_READY"
WINDOW_MS = 10_000
GRACE_MS = 30_000
STORE_NAME = "campaign_window_counts"
#: Record-contract size limits (schemas/README.md; the same numbers as kappa.verify.oracle.MAX_VALUE_BYTES).
MAX_VALUE_BYTES = {"ad_event": 16 * 1024, "campaign": 4 * 1024}
#: End-to-end latency buckets (seconds), event time -> row committed in Delta: a copy of
#: kappa/runtime/metrics.py LATENCY_BUCKETS (this module imports nothing from the platform).
LATENCY_BUCKETS: tuple[float, ...] = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 300, 600, 1800)
#: Live mode: longest idle consumer poll, so a checkpoint is never held back long after it is due.
LIVE_POLL_TIMEOUT = 0.1

log = logging.getLogger("kappa.front.peer_app")


def impl() -> str:
    """``quixstreams <version> + deltalake <version>``."""
    from importlib.metadata import version

    return f"quixstreams {version('quixstreams')} + deltalake {version('deltalake')}"


def load_schema(schemas_dir: Path, subject: str) -> dict[str, Any]:
    """Latest ``schemas/<subject>/v<N>.json`` (what ``kappa.log.schemas.load`` returns)."""
    files = sorted(Path(schemas_dir, subject).glob("v*.json"), key=lambda p: int(p.stem[1:]))
    if not files:
        raise FileNotFoundError(f"no schema for {subject!r} under {schemas_dir}")
    return json.loads(files[-1].read_text())


def _integer_fields(schema: dict[str, Any]) -> tuple[str, ...]:
    return tuple(name for name, prop in schema.get("properties", {}).items() if prop.get("type") == "integer")


# ------------------------------------------------------------------------------------------ validation
#: Keywords that never change which instances are valid (``format`` is an annotation in Draft 2020-12 unless a
#: format checker is configured -- jsonschema, and so the oracle, does not assert it).
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "examples", "default", "deprecated",
                          "readOnly", "writeOnly", "format"})
_OBJECT_KEYWORDS = frozenset({"type", "required", "properties", "additionalProperties"}) | _ANNOTATIONS
_PROPERTY_KEYWORDS = (frozenset({"type", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum"})
                      | _ANNOTATIONS)


def _is_type(value: Any, name: str) -> bool:
    """JSON Schema type test with jsonschema's semantics (bools are not numbers, 1.0 is an integer)."""
    if name == "string":
        return isinstance(value, str)
    if name == "integer":
        return (type(value) is int) or (type(value) is float and value.is_integer())
    if name == "number":
        return type(value) in (int, float)
    if name == "boolean":
        return type(value) is bool
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "null":
        return value is None
    raise NotImplementedError(f"type {name!r}")


class CompiledValidator:
    """A jsonschema-compatible validator for the flat-object subset of JSON Schema the platform's schemas use.

    ``jsonschema.Draft202012Validator`` costs ~0.3 ms per ad event in pure Python (it walks the schema with a
    fresh sub-validator per keyword), several times the rest of the per-record work. This one precompiles the same
    rules into one function per property -- the way ``kappa.runtime.parsing`` derives its Spark checks from the
    schema --
    and accepts exactly the same instances (``tests/test_peer.py`` checks it against jsonschema). It fails closed:
    a schema using any other keyword raises ``NotImplementedError`` at construction, and the caller falls back to
    jsonschema. Quix's ``JSONDeserializer(validator=...)`` takes it like a jsonschema validator.
    """

    def __init__(self, schema: dict[str, Any]) -> None:
        import re

        unknown = set(schema) - _OBJECT_KEYWORDS
        if unknown or schema.get("type") != "object" or schema.get("additionalProperties", True) is not True:
            raise NotImplementedError(f"unsupported top-level keywords {sorted(unknown)}")
        self.schema = schema
        self._required = tuple(schema.get("required", ()))
        self._checks: list[tuple[str, Any]] = []
        for name, prop in schema.get("properties", {}).items():
            unknown = set(prop) - _PROPERTY_KEYWORDS
            if unknown:
                raise NotImplementedError(f"unsupported keywords {sorted(unknown)} of {name!r}")
            tests: list[tuple[Any, str]] = []
            if "type" in prop:
                t = prop["type"]
                _is_type(None, t)  # NotImplementedError for an unknown type
                tests.append((lambda v, t=t: _is_type(v, t), f"is not of type {t!r}"))
            if "enum" in prop:
                allowed = tuple(prop["enum"])
                tests.append((lambda v, a=allowed: any(type(v) is type(x) and v == x for x in a),
                              f"is not one of {list(allowed)}"))
            if "pattern" in prop:
                rx = re.compile(prop["pattern"])
                tests.append((lambda v, rx=rx: not isinstance(v, str) or rx.search(v) is not None,
                              f"does not match {prop['pattern']!r}"))
            if "minLength" in prop:
                n = prop["minLength"]
                tests.append((lambda v, n=n: not isinstance(v, str) or len(v) >= n, f"is shorter than {n}"))
            if "maxLength" in prop:
                n = prop["maxLength"]
                tests.append((lambda v, n=n: not isinstance(v, str) or len(v) <= n, f"is longer than {n}"))
            if "minimum" in prop:
                m = prop["minimum"]
                tests.append((lambda v, m=m: type(v) not in (int, float) or v >= m, f"is less than {m}"))
            if "maximum" in prop:
                m = prop["maximum"]
                tests.append((lambda v, m=m: type(v) not in (int, float) or v <= m, f"is greater than {m}"))
            self._checks.append((name, tests))

    def check_schema(self, schema: dict[str, Any]) -> None:
        import jsonschema

        jsonschema.Draft202012Validator.check_schema(schema)

    def error(self, instance: Any) -> str | None:
        """The first violation, or None when ``instance`` is valid."""
        if not isinstance(instance, dict):
            return f"{instance!r} is not of type 'object'"
        for name in self._required:
            if name not in instance:
                return f"{name!r} is a required property"
        for name, tests in self._checks:
            if name in instance:
                value = instance[name]
                for test, why in tests:
                    if not test(value):
                        return f"{name!r}: {value!r} {why}"[:500]
        return None

    def is_valid(self, instance: Any) -> bool:
        return self.error(instance) is None

    def validate(self, instance: Any) -> None:
        import jsonschema

        why = self.error(instance)
        if why is not None:
            raise jsonschema.ValidationError(why)


def record_validator(schema: dict[str, Any], kind: str = "compiled") -> Any:
    """``compiled`` (:class:`CompiledValidator`, jsonschema if the schema needs more) or ``jsonschema``."""
    import jsonschema

    if kind == "compiled":
        try:
            return CompiledValidator(schema)
        except NotImplementedError as exc:
            log.warning("schema needs full JSON Schema (%s): validating with jsonschema", exc)
    elif kind != "jsonschema":
        raise ValueError(f"unknown validator {kind!r}")
    return jsonschema.Draft202012Validator(schema)


# ---------------------------------------------------------------------------------------------- lookup
def load_campaigns(client_config: dict[str, Any], topic: str, schema: dict[str, Any],
                   timeout: float = 60.0) -> tuple[dict[str, str], int]:
    """The latest ad -> campaign mapping of the compacted ``topic`` (whole retained log, log order).

    Valid records set the mapping, tombstones (null value, non-null key) delete it, invalid records (null key,
    oversized, malformed JSON, schema violation) are ignored. Returns (mapping, records read).
    """
    from confluent_kafka import Consumer, TopicPartition

    validator = record_validator(schema)
    ints = _integer_fields(schema)
    consumer = Consumer({**client_config, "group.id": f"kappa-peer-lookup-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics[topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {topic}: {meta.error}")
        ends: dict[int, int] = {}
        for p in sorted(meta.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            if high > low:
                ends[p] = high
        mapping: dict[str, str] = {}
        if not ends:
            return mapping, 0
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])  # offset 0: from the earliest retained
        pending, n = set(ends), 0
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: partitions {sorted(pending)} did not reach their end")
            for msg in consumer.consume(num_messages=10_000, timeout=0.5):
                if msg.error() is not None:
                    raise RuntimeError(str(msg.error()))
                p = msg.partition()
                if p not in pending or msg.offset() >= ends[p]:
                    continue
                n += 1
                if msg.offset() >= ends[p] - 1:
                    pending.discard(p)
                key, value = msg.key(), msg.value()
                if key is None:
                    continue
                if value is None:
                    mapping.pop(key.decode("utf-8", "replace"), None)
                    continue
                if len(value) > MAX_VALUE_BYTES["campaign"]:
                    continue
                try:
                    obj = json.loads(value)
                except ValueError:
                    continue
                if (not isinstance(obj, dict) or not validator.is_valid(obj)
                        or any(type(obj.get(name)) is float for name in ints)):
                    continue
                mapping[key.decode("utf-8", "replace")] = obj["campaign_id"]
        return mapping, n
    finally:
        consumer.close()


def delete_internal_topics(client_config: dict[str, Any], group: str, timeout: float = 30.0) -> list[str]:
    """Delete the repartition and changelog topics Quix created for consumer group ``group`` (one run's)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(dict(client_config))
    names = [t for t in admin.list_topics(timeout=timeout).topics
             if t.startswith((f"changelog__{group}--", f"repartition__{group}--"))]
    if names:
        for future in admin.delete_topics(names, operation_timeout=timeout).values():
            try:
                future.result(timeout)
            except Exception as exc:  # noqa: BLE001 - cleanup only
                log.warning("could not delete an internal topic: %s", exc)
    return names


# ---------------------------------------------------------------------------------------------- the query
def ad_event_deserializer(schema: dict[str, Any], validator: Any) -> Any:
    """Quix's ``JSONDeserializer`` for ``schemas/ad_event`` plus the record contract's extra rules (step 2).

    Raises ``SerializationError`` for an oversized record (> 16 KiB), malformed JSON, a schema violation, a value
    that is not an object or an integer field written as a float.
    """
    from quixstreams.models.serializers.exceptions import SerializationError
    from quixstreams.models.serializers.json import JSONDeserializer

    int_fields = _integer_fields(schema)
    limit = MAX_VALUE_BYTES["ad_event"]

    class AdEventDeserializer(JSONDeserializer):
        def __call__(self, value: bytes, ctx: Any) -> Any:
            if len(value) > limit:
                raise SerializationError(f"oversized record ({len(value)} > {limit} bytes)")
            data = super().__call__(value, ctx)  # JSON + schema validator, raises SerializationError
            if not isinstance(data, dict):
                raise SerializationError("not an object")
            for name in int_fields:
                if type(data.get(name)) is float:
                    raise SerializationError(f"integer field {name!r} written as a float")
            return data

    return AdEventDeserializer(schema=schema, validator=validator)


def _views_by_campaign(app: Any, topic_name: str, ad_schema: dict[str, Any], validator_kind: str,
                       ad_to_campaign: dict[str, str], counters: dict[str, int]) -> tuple[Any, Any]:
    """Steps 2-4 up to the window: the valid views of mapped ads as ``{campaign_id, event_time}``, keyed by
    campaign, stamped with their event time. Counts ``invalid_key``, ``routed`` (views sent to the re-keying) and
    ``arrived`` (views read back from it) in ``counters``. Returns (the StreamingDataFrame, the validator)."""

    # Event time is set *after* the re-keying: group_by produces to the repartition topic with the record's
    # current timestamp, and that topic inherits the input's retention (7 days by default). A timestamp extractor
    # on the input would stamp the repartition records with their (historical) event time, and the broker's
    # retention would delete them before they are read back -- silently losing views on any replay of data
    # older than the retention.
    def event_time(value: Any, key: Any, timestamp: int, headers: Any) -> int:
        return value["event_time"]

    validator = record_validator(ad_schema, validator_kind)
    topic = app.topic(topic_name, key_deserializer="str",
                      value_deserializer=ad_event_deserializer(ad_schema, validator))

    def valid_key(value: Any, key: Any, timestamp: int, headers: Any) -> bool:
        # null key / null value / key that is not the value's user_id: invalid under the record contract
        if key is not None and value is not None and value["user_id"] == key:
            return True
        counters["invalid_key"] += 1
        return False

    def routed(value: dict[str, Any]) -> None:
        counters["routed"] += 1

    def arrived(value: dict[str, Any]) -> None:
        counters["arrived"] += 1

    sdf = app.dataframe(topic)
    sdf = sdf.filter(valid_key, metadata=True)
    sdf = sdf.filter(lambda v: v["event_type"] == "view" and v["ad_id"] in ad_to_campaign)
    sdf = sdf.apply(lambda v: {"campaign_id": ad_to_campaign[v["ad_id"]], "event_time": v["event_time"]})  # join
    sdf = sdf.update(routed)
    sdf = sdf.group_by("campaign_id")
    sdf = sdf.update(arrived)
    sdf = sdf.set_timestamp(event_time)
    return sdf, validator


# ---------------------------------------------------------------------------------------------- the app
def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the peer once over the whole topic; see the module docstring. ``spec`` keys: ``client_config``,
    ``topic``, ``campaigns_topic``, ``table_path``, ``expected_events``, ``timeout``, ``schemas_dir``, optional
    ``commit_interval``, ``validator``, ``consumer_config``, ``grace_ms``, ``loglevel``; for debugging
    ``state_dir`` and ``keep_state`` (keep the window state and Quix's internal topics)."""
    import deltalake
    from arro3.core import Array, DataType, Field, Schema, Table
    from quixstreams import Application
    from quixstreams.kafka.configuration import ConnectionConfig
    from quixstreams.models.serializers.exceptions import SerializationError
    from quixstreams.sinks import BatchingSink
    from quixstreams.state.rocksdb.windowed.partition import WindowedRocksDBStorePartition

    client_config: dict[str, Any] = spec["client_config"]
    topic_name: str = spec["topic"]
    table_path: str = spec["table_path"]
    expected: int = int(spec["expected_events"])
    timeout: float = float(spec.get("timeout", 900))
    schemas_dir = Path(spec["schemas_dir"])
    ad_schema = load_schema(schemas_dir, "ad_event")

    # ---- 1. lookup: the latest mapping of the compacted campaigns topic, before the stream starts
    t_lookup = time.monotonic()
    ad_to_campaign, campaign_records = load_campaigns(
        client_config, spec["campaigns_topic"], load_schema(schemas_dir, "campaign"))
    lookup_seconds = time.monotonic() - t_lookup

    # ---- the Delta table (created empty up front, so it exists even when no window is produced)
    ts_type = DataType.timestamp("us", tz="UTC")
    schema = Schema([Field("campaign_id", DataType.string(), nullable=False),
                     Field("window_start", ts_type, nullable=False),
                     Field("window_end", ts_type, nullable=False),
                     Field("view_count", DataType.int64(), nullable=False)])
    if deltalake.DeltaTable.is_deltatable(table_path):
        raise FileExistsError(f"{table_path} already holds a Delta table: the peer writes a new one")
    deltalake.DeltaTable.create(table_path, schema=schema, name="campaign_window_counts_peer")

    stats = {"windows": 0, "commits": 0}
    # window timing: first record consumed -> last window committed
    clock: dict[str, float] = {}

    def append(rows: list[tuple[str, int, int, int]]) -> None:
        if not rows:
            return
        cols = list(zip(*rows))
        table = Table.from_arrays([
            Array(list(cols[0]), DataType.string()),
            Array([s * 1000 for s in cols[1]], DataType.int64()).cast(ts_type),
            Array([e * 1000 for e in cols[2]], DataType.int64()).cast(ts_type),
            Array(list(cols[3]), DataType.int64()),
        ], schema=schema)
        deltalake.write_deltalake(table_path, table, mode="append")
        stats["windows"] += len(rows)
        stats["commits"] += 1

    class DeltaWindowSink(BatchingSink):
        """Appends the windows closed since the last checkpoint, all partitions in one Delta commit."""

        def write(self, batch: Any) -> None:  # pragma: no cover - flush() below writes every batch at once
            append([(item.key, item.value["start"], item.value["end"], item.value["value"]) for item in batch])

        def flush(self) -> None:
            try:
                append([(item.key, item.value["start"], item.value["end"], item.value["value"])
                        for batch in self._batches.values() for item in batch])
            finally:
                self._batches.clear()

    counters = {"processed": 0, "invalid": 0, "invalid_key": 0, "routed": 0, "arrived": 0, "late": 0}
    done = threading.Event()
    timed_out = threading.Event()
    app_ref: dict[str, Any] = {}

    def finished() -> bool:
        return (counters["processed"] + counters["invalid"] >= expected
                and counters["arrived"] == counters["routed"])

    def check_done() -> None:
        if not done.is_set() and finished():
            clock["consumed"] = time.monotonic()
            done.set()
            app_ref["app"].stop()

    def first_record() -> None:
        if "first" not in clock:
            clock["first"] = time.monotonic()

    def on_consumer_error(exc: Exception, message: Any, logger: logging.Logger) -> bool:
        if isinstance(exc, SerializationError) and message is not None and message.topic() == topic_name:
            first_record()
            counters["invalid"] += 1
            check_done()
            return True  # skip the record
        return False  # anything else (broker errors, ...) fails the run

    def on_message_processed(topic: str, partition: int, offset: int) -> None:
        first_record()
        if topic == topic_name:
            counters["processed"] += 1
        check_done()

    def on_late(value: Any, key: Any, timestamp_ms: int, late_by_ms: int, start: int, end: int, *_: Any) -> bool:
        counters["late"] += 1
        return False  # counted, not logged per record

    state_dir = Path(spec.get("state_dir") or tempfile.mkdtemp(prefix="kappa-peer-state-"))
    group = f"kappa-peer-{uuid.uuid4().hex[:12]}"
    app = Application(
        broker_address=ConnectionConfig.from_librdkafka_dict(client_config, ignore_extras=True),
        consumer_group=group,
        auto_offset_reset="earliest",
        commit_interval=float(spec.get("commit_interval", 5.0)),
        state_dir=state_dir,
        on_consumer_error=on_consumer_error,
        on_message_processed=on_message_processed,
        loglevel=spec.get("loglevel", "WARNING"),
        consumer_extra_config=spec.get("consumer_config") or None,
    )
    app_ref["app"] = app

    # ---- 2.-4. validation, query, re-keying and event time (shared with the live mode)
    sdf, validator = _views_by_campaign(app, topic_name, ad_schema, spec.get("validator", "compiled"),
                                        ad_to_campaign, counters)
    grace_ms = int(spec.get("grace_ms", GRACE_MS))
    sdf = (sdf.tumbling_window(timedelta(milliseconds=WINDOW_MS), grace_ms=timedelta(milliseconds=grace_ms),
                               name=STORE_NAME, on_late=on_late)
           .count().final())
    sdf.sink(DeltaWindowSink())

    def watchdog() -> None:
        if not done.wait(timeout):
            timed_out.set()
            app.stop()

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        app.run()
        if timed_out.is_set():
            raise TimeoutError(
                f"peer did not consume {expected} records of {topic_name} within {timeout:.0f}s "
                f"(processed {counters['processed']}, invalid {counters['invalid']}, "
                f"routed {counters['routed']}, arrived {counters['arrived']})")
        if not done.is_set():
            raise RuntimeError("the Quix application stopped before consuming every record")

        # ---- 6. tail: windows that never closed, from the application's final window state
        tail: list[tuple[str, int, int, int]] = []
        # <state_dir>/<consumer group>/<store>/<stream id>/<partition>; the store is the window's name + suffix
        paths = sorted(glob.glob(str(state_dir / group / f"{STORE_NAME}_*" / "*" / "*")))
        if not paths:
            raise RuntimeError(f"no window state under {state_dir / group}")
        for path in paths:
            part = WindowedRocksDBStorePartition(path=path)
            try:
                tx = part.begin()
                for prefix in tx.iter_prefixes():
                    campaign = json.loads(prefix)
                    for (start, end), count, _ in tx.iter_windows(prefix):
                        tail.append((campaign, start, end, count))
            finally:
                part.close()
        closed_windows = stats["windows"]
        append(sorted(tail))
        clock["last_window"] = time.monotonic()
    finally:
        if not spec.get("keep_state"):
            shutil.rmtree(state_dir, ignore_errors=True)
            delete_internal_topics(client_config, group)

    seconds = clock["last_window"] - clock["first"]
    n = counters["processed"] + counters["invalid"]
    return {
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds if seconds > 0 else 0.0,
        "impl": impl(),
        "windows": stats["windows"],
        "windows_closed_in_stream": closed_windows,
        "windows_from_final_state": len(tail),
        "delta_commits": stats["commits"],
        "invalid": counters["invalid"],
        "invalid_key": counters["invalid_key"],
        "views_counted": counters["arrived"] - counters["late"],
        "late_dropped": counters["late"],
        "consume_seconds": clock["consumed"] - clock["first"],
        "lookup_seconds": lookup_seconds,
        "campaign_records": campaign_records,
        "mapped_ads": len(ad_to_campaign),
        "consumer_group": group,
        "grace_ms": grace_ms,
        "validator": type(validator).__name__,
    }


# ------------------------------------------------------------------------------------------ live mode
class LatencyHistogram:
    """End-to-end latencies bucketed on :data:`LATENCY_BUCKETS` (Prometheus ``le`` semantics: a latency equal to
    a bound counts in that bound's bucket), like the platform's ``kappa_end_to_end_latency_seconds``."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``[(upper bound, cumulative count), ...]`` ending with ``(inf, total)``."""
        return list(zip((*LATENCY_BUCKETS, math.inf), itertools.accumulate(self.counts)))

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile(q)`` (linear interpolation inside the bucket; the lower bound of +Inf)."""
        return _quantile(self.cumulative(), q)

    def as_json(self) -> list[list[Any]]:
        return [["+Inf" if bound == math.inf else bound, count] for bound, count in self.cumulative()]


def _quantile(buckets: list[tuple[float, int]], q: float) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) buckets, like Prometheus (a copy of
    ``kappa.front.bench._quantile``)."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0
    for bound, count in buckets:
        if count >= rank:
            if bound == math.inf:
                return prev_bound
            span = count - prev_count
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / span if span else 0.0)
        prev_bound, prev_count = bound, count
    return prev_bound


def _exact_quantile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank quantile of sorted values (the smallest value with at least ``q`` of them at or below it)."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _partition_count(client_config: dict[str, Any], topic: str, timeout: float = 30.0) -> int:
    from confluent_kafka.admin import AdminClient

    meta = AdminClient(dict(client_config)).list_topics(topic, timeout=timeout).topics[topic]
    if meta.error is not None:
        raise RuntimeError(f"topic {topic}: {meta.error}")
    return len(meta.partitions)


def run_live(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the peer live from the end of the topic for a fixed time, measuring end-to-end latency.

    The same query as :func:`run` (steps 1-4), with what the platform's ``update``-mode view does at each
    micro-batch: every checkpoint upserts the windows changed since the previous one, open ones included, with
    their count and ``last_event_time`` (max event time of the window's views so far), in one delta-rs MERGE, and
    each row written then has the latency ``commit wall time - last_event_time``.

    1. **Start** -- a fresh consumer group positioned at the end of the topic (see ``LiveApplication``); once every
       partition is assigned and positioned the worker prints :data:`READY_LINE` to stdout, and the driver starts
       producing.
    2. **Window** -- ``tumbling_window(10 s, grace).agg(view_count=Count(), last_event_time=Max("event_time"))
       .current()``: every view emits its window's current count and max event time.
    3. **Sink** -- keeps the latest value per (campaign_id, window_start) since the last checkpoint; the checkpoint
       (every ``commit_interval`` s) MERGEs them into the table (columns of :func:`run` plus ``last_event_time``)
       and feeds the latency histograms: all rows, and ``steady`` = rows committed ``warmup`` s or more after the
       first record (with their exact values as well).
    4. **Stop** -- ``seconds`` after ready plus ``drain`` s for the last records, ``app.stop()`` from a timer; the
       final checkpoint flushes the sink.

    ``spec`` keys: ``client_config``, ``topic``, ``campaigns_topic``, ``table_path``, ``schemas_dir``, ``seconds``,
    optional ``warmup`` (20), ``commit_interval`` (1.0), ``drain`` (10), ``ready_timeout`` (120), ``validator``,
    ``consumer_config``, ``grace_ms``, ``loglevel``; for debugging ``state_dir`` and ``keep_state``.
    """
    import resource

    import deltalake
    from arro3.core import Array, DataType, Field, Schema, Table
    from confluent_kafka import TopicPartition
    from quixstreams import Application
    from quixstreams.dataframe.windows.aggregations import Count, Max
    from quixstreams.kafka.configuration import ConnectionConfig
    from quixstreams.models.serializers.exceptions import SerializationError
    from quixstreams.sinks import BaseSink

    started = time.monotonic()
    client_config: dict[str, Any] = spec["client_config"]
    topic_name: str = spec["topic"]
    table_path: str = spec["table_path"]
    seconds = float(spec["seconds"])
    warmup = float(spec.get("warmup", 20.0))
    drain = float(spec.get("drain", 10.0))
    ready_timeout = float(spec.get("ready_timeout", 120.0))
    schemas_dir = Path(spec["schemas_dir"])
    ad_schema = load_schema(schemas_dir, "ad_event")

    # ---- lookup, as in run()
    t_lookup = time.monotonic()
    ad_to_campaign, campaign_records = load_campaigns(
        client_config, spec["campaigns_topic"], load_schema(schemas_dir, "campaign"))
    lookup_seconds = time.monotonic() - t_lookup
    partitions = _partition_count(client_config, topic_name)

    # ---- the Delta table: run()'s columns plus the window's max event time (the view's latency column)
    ts_type = DataType.timestamp("us", tz="UTC")
    schema = Schema([Field("campaign_id", DataType.string(), nullable=False),
                     Field("window_start", ts_type, nullable=False),
                     Field("window_end", ts_type, nullable=False),
                     Field("view_count", DataType.int64(), nullable=False),
                     Field("last_event_time", ts_type, nullable=False)])
    if deltalake.DeltaTable.is_deltatable(table_path):
        raise FileExistsError(f"{table_path} already holds a Delta table: the peer writes a new one")
    deltalake.DeltaTable.create(table_path, schema=schema, name="campaign_window_counts_peer")
    table = deltalake.DeltaTable(table_path)  # the only writer: MERGE moves this handle to each new version

    stats = {"rows": 0, "commits": 0}
    clock: dict[str, float] = {}
    all_rows, steady_rows = LatencyHistogram(), LatencyHistogram()
    steady_raw: list[float] = []

    def upsert(latest: dict[tuple[str, int], tuple[int, int, int]]) -> None:
        """One MERGE of ``(campaign_id, window_start ms) -> (window_end ms, count, last event time ms)``."""
        if not latest:
            return
        keys = list(latest)
        values = [latest[k] for k in keys]
        source = Table.from_arrays([
            Array([k[0] for k in keys], DataType.string()),
            Array([k[1] * 1000 for k in keys], DataType.int64()).cast(ts_type),
            Array([v[0] * 1000 for v in values], DataType.int64()).cast(ts_type),
            Array([v[1] for v in values], DataType.int64()),
            Array([v[2] * 1000 for v in values], DataType.int64()).cast(ts_type),
        ], schema=schema)
        # streamed_exec=False: delta-rs then derives a file-skipping filter from the (small) source, so a MERGE
        # reads the files of the recent windows only instead of the whole, growing table
        (table.merge(source, "t.campaign_id = s.campaign_id AND t.window_start = s.window_start",
                     source_alias="s", target_alias="t", streamed_exec=False)
         .when_matched_update_all().when_not_matched_insert_all().execute())
        committed_at = time.time()
        stats["rows"] += len(values)
        stats["commits"] += 1
        steady = "first_wall" in clock and committed_at >= clock["first_wall"] + warmup
        for _end, _count, last_ms in values:
            latency = committed_at - last_ms / 1000.0
            all_rows.observe(latency)
            if steady:
                steady_rows.observe(latency)
                steady_raw.append(latency)

    class DeltaUpsertSink(BaseSink):
        """Keeps the latest current value of each window since the last checkpoint; the checkpoint MERGEs them."""

        def __init__(self) -> None:
            super().__init__()
            self._latest: dict[tuple[str, int], tuple[int, int, int]] = {}

        def add(self, value: Any, key: Any, timestamp: int, headers: Any, topic: str, partition: int,
                offset: int) -> None:
            # a campaign's windows are all in one partition of the re-keyed stream, processed in order: the last
            # value added is the window's latest
            self._latest[(key, value["start"])] = (value["end"], value["view_count"], value["last_event_time"])

        def flush(self) -> None:
            try:
                upsert(self._latest)
            finally:
                self._latest = {}

        def on_paused(self) -> None:
            self._latest = {}

    counters = {"processed": 0, "invalid": 0, "invalid_key": 0, "routed": 0, "arrived": 0, "late": 0}
    ready = threading.Event()
    not_ready = threading.Event()
    app_ref: dict[str, Any] = {}

    def first_record() -> None:
        if "first" not in clock:
            clock["first"] = time.monotonic()
            clock["first_wall"] = time.time()
        clock["last"] = time.monotonic()

    def on_consumer_error(exc: Exception, message: Any, logger: logging.Logger) -> bool:
        if isinstance(exc, SerializationError) and message is not None and message.topic() == topic_name:
            first_record()
            counters["invalid"] += 1
            return True  # skip the record
        return False  # anything else (broker errors, ...) fails the run

    def on_message_processed(topic: str, partition: int, offset: int) -> None:
        if topic == topic_name:
            first_record()
            counters["processed"] += 1

    def on_late(value: Any, key: Any, timestamp_ms: int, late_by_ms: int, start: int, end: int, *_: Any) -> bool:
        counters["late"] += 1
        return False  # counted, not logged per record

    def declare_ready() -> None:
        clock["ready"] = time.monotonic()
        sys.stdout.write(READY_LINE + "\n")
        sys.stdout.flush()
        stopper = threading.Timer(seconds + drain, app_ref["app"].stop)
        stopper.daemon = True
        stopper.start()
        ready.set()

    pinned: set[tuple[str, int]] = set()

    # When is the consumer ready? Quix 3.28.1 has no public assignment hook: the Application callbacks
    # (on_consumer_error, on_processing_error, on_producer_error, on_message_processed) never fire on a rebalance,
    # and sources are started at the *beginning* of the assignment, before the consumer is assigned. Its rebalance
    # callback is Application._on_assign (passed to subscribe() as the bound method), so a subclass overriding it
    # sees every assignment. Being assigned is not enough, though: with no committed offset, librdkafka resolves
    # auto.offset.reset=latest lazily, with an asynchronous ListOffsets after the assignment, and a record produced
    # before that answer would be skipped. So the override positions each input and repartition partition it sees
    # for the first time at the high watermark read synchronously from the broker, and the assignment starts from
    # these explicit offsets (auto_offset_reset="latest" still covers anything else). Changelog partitions are left
    # to Quix. Once every input partition is positioned, every record produced from then on is consumed: READY.
    # A partition assigned again later (only after a rebalance) resumes from its committed offset, as usual.
    class LiveApplication(Application):
        def _on_assign(self, consumer: Any, topic_partitions: list[Any]) -> None:
            data_topics = self._topic_manager.non_changelog_topics
            positioned = []
            for tp in topic_partitions:
                if tp.topic in data_topics and (tp.topic, tp.partition) not in pinned:
                    _low, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=30)
                    tp = TopicPartition(tp.topic, tp.partition, high)
                    pinned.add((tp.topic, tp.partition))
                positioned.append(tp)
            super()._on_assign(consumer, positioned)
            if not ready.is_set() and all((topic_name, p) in pinned for p in range(partitions)):
                declare_ready()

    state_dir = Path(spec.get("state_dir") or tempfile.mkdtemp(prefix="kappa-peer-state-"))
    group = f"kappa-peer-{uuid.uuid4().hex[:12]}"
    commit_interval = float(spec.get("commit_interval", 1.0))
    app = LiveApplication(
        broker_address=ConnectionConfig.from_librdkafka_dict(client_config, ignore_extras=True),
        consumer_group=group,
        auto_offset_reset="latest",
        commit_interval=commit_interval,
        # the checkpoint is checked between polls: an idle poll must not hold it back for Quix's default 1 s
        consumer_poll_timeout=min(LIVE_POLL_TIMEOUT, commit_interval),
        state_dir=state_dir,
        on_consumer_error=on_consumer_error,
        on_message_processed=on_message_processed,
        loglevel=spec.get("loglevel", "WARNING"),
        consumer_extra_config=spec.get("consumer_config") or None,
    )
    app_ref["app"] = app

    sdf, validator = _views_by_campaign(app, topic_name, ad_schema, spec.get("validator", "compiled"),
                                        ad_to_campaign, counters)
    grace_ms = int(spec.get("grace_ms", GRACE_MS))
    sdf = (sdf.tumbling_window(timedelta(milliseconds=WINDOW_MS), grace_ms=timedelta(milliseconds=grace_ms),
                               name=STORE_NAME, on_late=on_late)
           .agg(view_count=Count(), last_event_time=Max("event_time")).current())
    sdf.sink(DeltaUpsertSink())

    def ready_watchdog() -> None:
        if not ready.wait(ready_timeout):
            not_ready.set()
            app.stop()

    threading.Thread(target=ready_watchdog, daemon=True).start()
    try:
        app.run()
        stopped = time.monotonic()
        if not_ready.is_set() or not ready.is_set():
            raise TimeoutError(f"the peer's partitions of {topic_name} were not assigned within {ready_timeout:.0f}s")
    finally:
        if not spec.get("keep_state"):
            shutil.rmtree(state_dir, ignore_errors=True)
            delete_internal_topics(client_config, group)

    usage = resource.getrusage(resource.RUSAGE_SELF)
    n = counters["processed"] + counters["invalid"]
    elapsed = stopped - clock["first"] if "first" in clock else 0.0
    steady_raw.sort()
    return {
        "impl": impl(),
        "mode": "live",
        "events": n,
        "seconds": elapsed,
        "events_per_s": n / elapsed if elapsed > 0 else 0.0,
        "rows_committed": stats["rows"],
        "delta_commits": stats["commits"],
        "p50_s": all_rows.quantile(0.5),
        "p99_s": all_rows.quantile(0.99),
        "steady_p50_s": _exact_quantile(steady_raw, 0.5),
        "steady_p99_s": _exact_quantile(steady_raw, 0.99),
        "steady_max_s": steady_raw[-1] if steady_raw else None,
        "steady_rows": len(steady_raw),
        "buckets": all_rows.as_json(),
        "steady_buckets": steady_rows.as_json(),
        "late_dropped": counters["late"],
        "invalid": counters["invalid"],
        "invalid_key": counters["invalid_key"],
        "views_counted": counters["arrived"] - counters["late"],
        "consume_seconds": clock["last"] - clock["first"] if "first" in clock else 0.0,
        "ready_seconds": clock["ready"] - started,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "max_rss_mb": usage.ru_maxrss / 1024.0,  # KiB on Linux
        "lookup_seconds": lookup_seconds,
        "campaign_records": campaign_records,
        "mapped_ads": len(ad_to_campaign),
        "consumer_group": group,
        "commit_interval": commit_interval,
        "warmup": warmup,
        "grace_ms": grace_ms,
        "validator": type(validator).__name__,
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.loads(sys.stdin.read())
    mode = spec.get("mode", "replay")
    if mode not in ("replay", "live"):
        raise ValueError(f"unknown mode {mode!r}")
    result = run_live(spec) if mode == "live" else run(spec)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

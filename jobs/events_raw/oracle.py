"""The oracle of events_raw: every valid event of the log, keyed by (partition, offset), in plain Python (v2: with
its event_id)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kappa.verify.oracle import OracleInput, OracleSpec, Validated, epoch_ms

__all__ = ["ORACLES", "RAW_FIELDS", "VALUES", "expected_events_raw"]


def expected_events_raw(validated: Iterable[Validated]) -> dict[tuple[int, int], dict]:
    """(partition, offset) -> event fields, for every valid ad event."""
    return {(v.record.partition, v.record.offset): v.value for v in validated if v.error is None}


RAW_FIELDS = ("user_id", "page_id", "ad_id", "ad_type", "event_type", "event_time", "ip")


#: every column of the table but the key (partition, offset): the event's fields, its event time as a timestamp,
#: and where Kafka kept it
VALUES = (*RAW_FIELDS, "event_ts", "topic", "kafka_timestamp")


def _events_raw(inp: OracleInput) -> dict[tuple, tuple]:
    return {(v.record.partition, v.record.offset): (*(v.value[f] for f in RAW_FIELDS), v.value["event_time"],
                                                    v.record.topic, v.record.timestamp_ms)
            for v in inp.events if v.error is None}


def _events_raw_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return (row["partition"], row["offset"]), (*(row[f] for f in RAW_FIELDS), epoch_ms(row["event_ts"]),
                                               row["topic"], epoch_ms(row["kafka_timestamp"]))


def _events_raw_v2(inp: OracleInput) -> dict[tuple, tuple]:
    """v2: v1's values and the record's ``event_id`` (None when it has none)."""
    return {(v.record.partition, v.record.offset): (*(v.value[f] for f in RAW_FIELDS), v.value["event_time"],
                                                    v.record.topic, v.record.timestamp_ms, v.value.get("event_id"))
            for v in inp.events if v.error is None}


def _events_raw_row_v2(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    key, values = _events_raw_row(row)
    return key, (*values, row["event_id"])


#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for)
ORACLES = {
    1: OracleSpec(
        compute=_events_raw, keys=("partition", "offset"), values=VALUES,
        adapt=_events_raw_row),
    2: OracleSpec(
        compute=_events_raw_v2, keys=("partition", "offset"), values=(*VALUES, "event_id"),
        adapt=_events_raw_row_v2),
}

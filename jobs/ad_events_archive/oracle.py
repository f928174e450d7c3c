"""The oracle of ad_events_archive: every record of the log, keyed by (partition, offset), in plain Python -
its exact key and value bytes, its Kafka timestamp and whether it is valid (``jsonschema``, independent of the
Spark validator; the reasons' wording differs, their presence must not)."""

from __future__ import annotations

from typing import Any, Mapping

from kappa.verify.oracle import OracleInput, OracleSpec, epoch_ms

__all__ = ["ORACLES"]

VALUES = ("raw_key", "raw_value", "kafka_timestamp", "error")


def _archive(inp: OracleInput) -> dict[tuple, tuple]:
    return {(v.record.partition, v.record.offset): (v.record.key, v.record.value, v.record.timestamp_ms,
                                                    v.error is not None)
            for v in inp.events}


def _archive_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    def raw(value: Any) -> bytes | None:
        return None if value is None else bytes(value)

    return (row["partition"], row["offset"]), (raw(row["raw_key"]), raw(row["raw_value"]),
                                               epoch_ms(row["kafka_timestamp"]), row["error"] is not None)


#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for)
ORACLES = {1: OracleSpec(compute=_archive, keys=("partition", "offset"), values=VALUES, adapt=_archive_row)}

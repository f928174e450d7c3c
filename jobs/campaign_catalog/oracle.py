"""The oracle of campaign_catalog: the latest ad -> campaign mapping of the compacted log (tombstones delete)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from kappa.verify.oracle import OracleInput, OracleSpec, Validated, epoch_ms

__all__ = ["ORACLES", "expected_campaign_catalog"]


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


def _campaign_catalog(inp: OracleInput) -> dict[tuple, tuple]:
    """ad_id -> (campaign_id, partition, offset and Kafka timestamp of the record that set it)."""
    table: dict[tuple, tuple] = {}
    for v in sorted((v for v in inp.events if v.error is None), key=lambda v: (v.record.partition, v.record.offset)):
        key = (v.record.key.decode(),)
        if v.record.value is None:
            table.pop(key, None)
        else:
            table[key] = (v.value["campaign_id"], v.record.partition, v.record.offset, v.record.timestamp_ms)
    return table


def _campaign_catalog_row(row: Mapping[str, Any]) -> tuple[tuple, tuple]:
    return (row["ad_id"],), (row["campaign_id"], row["source_partition"], row["source_offset"],
                             epoch_ms(row["updated_at"]))


#: version -> how verification recomputes it (kappa.verify.oracle.oracle_for)
ORACLES = {
    1: OracleSpec(
        compute=_campaign_catalog, keys=("ad_id",), values=("campaign_id", "source_partition", "source_offset", "updated_at"),
        adapt=_campaign_catalog_row),
}

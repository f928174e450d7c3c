"""The benchmark peer (Quix Streams + delta-rs, :mod:`kappa.front.peer`) computes the YSB windowed count exactly.

Real broker, real Quix Streams application in its own venv, real Delta table read back with delta-rs; the expected
counts come from the independent plain-Python oracle over the raw records read back from Kafka
(``kappa.verify.oracle.read_log`` + ``validate_records`` + ``expected_window_counts``). The comparison is exact: every
(campaign_id, window_start) with its count, no missing, extra or duplicated row.

Why exact equality holds: the oracle counts every valid view, the peer drops views whose window its per-campaign
event-time clock already closed (grace 30 s). The data is built so that nothing is ever that late:

* ``test_peer_single_partition_matches_oracle``: one partition, so the peer sees events in log order. A record's
  ``event_time`` is its synthetic clock minus at most ``max_lateness_ms`` = 5 s, and every earlier record's time is
  at most that clock, so a late record's window ends at most 5 s before anything the peer has seen -- well inside
  the 30 s grace. 800 s of event time: most windows close in the stream, the last ones come from the final state.
* ``test_peer_four_partitions_matches_oracle``: four partitions (so ``group_by`` goes through Quix's repartition
  topic, and the order in which partitions are consumed is not deterministic). The whole stream spans 20 s of event
  time plus 5 s lateness, < 30 s grace: no window can close nor any record be late whatever the interleaving, and
  every window comes from the final-state flush.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from deltalake import DeltaTable

from kappa.log import generator, schemas
from jobs.campaign_catalog.oracle import expected_campaign_catalog
from jobs.campaign_window_counts.oracle import expected_window_counts
from kappa.verify.oracle import read_log, validate_records
from kappa.front.peer import PEER_IMPL, run_peer
from kappa.front.peer_app import CompiledValidator

WINDOW_MS = 10_000


def _ms(value: datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(round(value.timestamp() * 1000))


def _table_counts(path: str) -> tuple[dict[tuple[str, int], int], int]:
    """(campaign_id, window_start ms) -> view_count of the peer's Delta table, and its row count."""
    data = DeltaTable(path).scan().read_all()
    names = list(data.column_names)
    assert names == ["campaign_id", "window_start", "window_end", "view_count"], names
    rows = list(zip(*(data.column(i).to_pylist() for i in range(len(names)))))
    counts: dict[tuple[str, int], int] = {}
    for campaign, start, end, count in rows:
        assert _ms(end) - _ms(start) == WINDOW_MS
        assert _ms(start) % WINDOW_MS == 0
        key = (campaign, _ms(start))
        assert key not in counts, f"window {key} written twice"
        counts[key] = count
    return counts, len(rows)


def _publish_campaigns(settings, topic: str, u: generator.Universe) -> None:
    """The mapping, then KTable updates (a remap, a tombstone) and invalid mapping records the lookup must skip."""
    mapping = generator.campaign_records(u)
    generator.publish_campaigns(settings, mapping, topic=topic)
    ads = list(mapping)
    generator.publish_campaigns(settings, {ads[0]: u.campaigns[-1], ads[1]: None}, topic=topic)
    # (a null-key record cannot be written at all: compacted topics reject it)
    bad = generator.produce(settings, topic, [(ads[2].encode(), b"{nope"),
                                              (ads[3].encode(), b'{"campaign_id": "not-a-uuid"}'),
                                              (ads[4].encode(), b'{"campaign": "' + u.campaigns[0].encode() + b'"}')])
    assert bad.delivered == 3


def _oracle(settings, topic: str, campaigns_topic: str) -> tuple[dict[tuple[str, int], int], int, int]:
    """Expected counts from the raw log, plus (records, invalid records)."""
    records = read_log(settings, topic)
    validated = validate_records(records, "ad_event", key_field="user_id")
    mapping = expected_campaign_catalog(
        validate_records(read_log(settings, campaigns_topic), "campaign", key_field=None, tombstones=True))
    expected = {k: n for k, (n, _final) in expected_window_counts(validated, mapping).items()}
    return expected, len(records), sum(v.error is not None for v in validated)


def _run_and_compare(settings, topic_factory, tmp_path, *, partitions: int, n: int, seed: int, rate_per_s: float):
    campaigns_topic = topic_factory(1, {"cleanup.policy": "compact"})
    topic = topic_factory(partitions)
    u = generator.universe(seed=seed, campaigns=20, users=400)
    _publish_campaigns(settings, campaigns_topic, u)
    produced = generator.produce(settings, topic, generator.events(
        n, seed=seed, universe=u, rate_per_s=rate_per_s, late_fraction=0.05, max_lateness_ms=5_000,
        malformed_fraction=0.02))
    assert produced.delivered == n
    assert produced.late > 0 and sum(c for k, c in produced.kinds.items() if k != "valid") > 0.01 * n

    table = str(tmp_path / "peer-window-counts")
    result = run_peer(settings, topic, campaigns_topic, table, expected_events=n, timeout=120)

    expected, records, invalid = _oracle(settings, topic, campaigns_topic)
    actual, rows = _table_counts(table)
    assert records == n
    missing = expected.keys() - actual.keys()
    extra = actual.keys() - expected.keys()
    wrong = {k: (actual[k], expected[k]) for k in expected.keys() & actual.keys() if actual[k] != expected[k]}
    assert not missing and not extra and not wrong, (
        f"{len(missing)} missing, {len(extra)} extra, {len(wrong)} wrong windows; e.g. "
        f"{sorted(missing)[:3]} {sorted(extra)[:3]} {list(wrong.items())[:3]}")
    assert actual == expected

    # the peer skipped exactly the records the oracle rejects, dropped nothing as late, wrote each window once
    assert result["events"] == n
    assert result["invalid"] + result["invalid_key"] == invalid
    assert result["late_dropped"] == 0
    assert result["views_counted"] == sum(expected.values())
    assert result["windows"] == rows == len(expected)
    assert result["impl"] == PEER_IMPL
    assert result["seconds"] > 0 and result["events_per_s"] > 0
    return result


def test_peer_single_partition_matches_oracle(kafka_settings, topic_factory, tmp_path):
    # 20,000 events at 25/s = 800 s of event time: ~80 windows x 20 campaigns, most closed in the stream
    result = _run_and_compare(kafka_settings, topic_factory, tmp_path, partitions=1, n=20_000, seed=21,
                              rate_per_s=25)
    assert result["windows_closed_in_stream"] > 10 * result["windows_from_final_state"] > 0


_GOOD = {"user_id": "0d9c4e7a-1a2b-4c3d-8e9f-0a1b2c3d4e5f", "page_id": "1d9c4e7a-1a2b-4c3d-8e9f-0a1b2c3d4e5f",
         "ad_id": "2d9c4e7a-1a2b-4c3d-8e9f-0a1b2c3d4e5f", "ad_type": "banner", "event_type": "view",
         "event_time": 1_700_000_000_000, "ip": "10.0.0.1"}


@pytest.mark.parametrize("instance", [
    _GOOD, {**_GOOD, "extra": [1, {"x": None}]}, {**_GOOD, "schema_version": 2}, {**_GOOD, "event_time": 0},
    {**_GOOD, "event_time": 1.0}, {**_GOOD, "event_time": 1.5}, {**_GOOD, "event_time": True},
    {**_GOOD, "event_time": -1}, {**_GOOD, "event_time": "1700000000000"}, {**_GOOD, "event_time": None},
    {**_GOOD, "schema_version": 0}, {**_GOOD, "schema_version": False}, {**_GOOD, "event_type": "VIEW"},
    {**_GOOD, "event_id": _GOOD["page_id"]}, {**_GOOD, "event_id": "x"}, {**_GOOD, "event_id": 7},
    {**_GOOD, "event_id": None},
    {**_GOOD, "event_type": ""}, {**_GOOD, "ad_type": 1}, {**_GOOD, "ad_id": 12345}, {**_GOOD, "ad_id": "x"},
    {**_GOOD, "user_id": _GOOD["user_id"].upper()}, {**_GOOD, "user_id": _GOOD["user_id"] + "0"},
    {**_GOOD, "ip": "1.2.3"}, {**_GOOD, "ip": "999.999.999.999"}, {**_GOOD, "page_id": "x" * 70_000},
    {k: v for k, v in _GOOD.items() if k != "ip"}, {}, [], "view", 3, None,
    {"campaign_id": _GOOD["ad_id"]}, {"campaign_id": _GOOD["ad_id"], "name": "x"}, {"campaign_id": 7},
    {"campaign_id": "not-a-uuid"}, {"campaign": _GOOD["ad_id"]},
])
def test_compiled_validator_agrees_with_jsonschema(instance):
    """The peer's precompiled validator accepts exactly what jsonschema (the oracle's validator) accepts."""
    import jsonschema

    for subject in ("ad_event", "campaign"):
        schema = schemas.load(subject)
        reference = jsonschema.Draft202012Validator(schema)
        assert CompiledValidator(schema).is_valid(instance) == reference.is_valid(instance), (subject, instance)


def test_compiled_validator_fails_closed_on_unsupported_keywords():
    with pytest.raises(NotImplementedError):
        CompiledValidator({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}}})
    with pytest.raises(NotImplementedError):
        CompiledValidator({"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]})


def test_peer_four_partitions_matches_oracle(kafka_settings, topic_factory, tmp_path):
    # 10,000 events at 500/s = 20 s of event time (+ 5 s lateness) < 30 s grace: exact under any interleaving
    result = _run_and_compare(kafka_settings, topic_factory, tmp_path, partitions=4, n=10_000, seed=22,
                              rate_per_s=500)
    assert result["windows_closed_in_stream"] == 0
    assert result["windows_from_final_state"] == result["windows"] > 0
    # the run's repartition and changelog topics are gone
    from confluent_kafka.admin import AdminClient

    left = [t for t in AdminClient(kafka_settings.kafka_client_config()).list_topics(timeout=10).topics
            if result["consumer_group"] in t]
    assert not left, left

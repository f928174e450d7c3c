"""Generator: determinism, late/malformed fractions, produce -> consume with the idempotent producer."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from kappa.config import Settings
from kappa.log.generator import MALFORMED_KINDS, events, produce, produce_cmd, publish_campaigns, universe
from kappa.log.topics import partition_offsets

TopicFactory = Callable[..., str]
ConsumeAll = Callable[..., list[Any]]


def test_same_seed_same_bytes() -> None:
    a = [(e.key, e.value) for e in events(2000, seed=42, late_fraction=0.1, malformed_fraction=0.1)]
    b = [(e.key, e.value) for e in events(2000, seed=42, late_fraction=0.1, malformed_fraction=0.1)]
    c = [(e.key, e.value) for e in events(2000, seed=43, late_fraction=0.1, malformed_fraction=0.1)]
    assert a == b
    assert a != c
    assert universe(seed=5) == universe(seed=5) and universe(seed=5).ads != universe(seed=6).ads


def test_universe_shape() -> None:
    u = universe(seed=1, campaigns=100)
    assert len(u.campaigns) == 100 and len(u.ads) == 1000 and len(set(u.ads)) == 1000
    assert Counter(u.ad_to_campaign.values()) == {c: 10 for c in u.campaigns}


def test_synthetic_clock_and_fractions() -> None:
    n, late_f, bad_f, max_late = 20_000, 0.1, 0.06, 3_000
    evs = list(events(n, seed=7, start_ms=1_000_000, rate_per_s=500, late_fraction=late_f,
                      max_lateness_ms=max_late, malformed_fraction=bad_f))
    metas = [e.meta for e in evs]
    late = sum(m.late for m in metas)
    bad = Counter(m.kind for m in metas if not m.valid)
    # binomial: 4 sigma bounds
    assert abs(late - n * late_f) < 4 * (n * late_f * (1 - late_f)) ** 0.5
    assert abs(sum(bad.values()) - n * bad_f) < 4 * (n * bad_f * (1 - bad_f)) ** 0.5
    assert set(bad) == set(MALFORMED_KINDS)
    assert min(bad.values()) > n * bad_f / len(MALFORMED_KINDS) * 0.6
    for m in metas:
        base = 1_000_000 + int(m.index * 1000 / 500)  # synthetic clock, not wall clock
        assert m.event_time == base - m.lateness_ms
        assert (0 < m.lateness_ms <= max_late) if m.late else m.lateness_ms == 0
    for e in evs:
        if e.meta.valid:
            obj = json.loads(e.value)
            assert e.key == obj["user_id"].encode() and obj["event_time"] == e.meta.event_time
        if e.meta.kind == "null_key":
            assert e.key is None
        if e.meta.kind == "oversized":
            assert len(e.value) > 64 * 1024


def test_duplicates_are_byte_identical_retries_a_few_records_later() -> None:
    plain = list(events(2000, seed=5, malformed_fraction=0.1))
    retried = list(events(2000, seed=5, malformed_fraction=0.1, duplicate_fraction=0.25, max_duplicate_distance=30))
    originals = [e for e in retried if not e.meta.duplicate]
    copies = [(i, e) for i, e in enumerate(retried) if e.meta.duplicate]
    assert originals == plain, "duplicates come on top of the same stream"
    assert 0.2 * 1800 < len(copies) < 0.3 * 1800  # of the ~1,800 valid records
    ids = [json.loads(e.value)["event_id"] for e in plain if e.meta.valid]
    assert len(set(ids)) == len(ids), "every event has an id of its own"
    position = {e.value: i for i, e in enumerate(retried) if not e.meta.duplicate}
    for i, copy in copies:
        assert copy.meta.valid and copy.key == retried[position[copy.value]].key
        assert 1 <= i - position[copy.value] <= 30 + len(copies), "sent again a few records later"
    with pytest.raises(ValueError, match="duplicate_fraction"):
        list(events(1, duplicate_fraction=1.5))


def test_live_mode_uses_clock() -> None:
    ev = next(events(1, seed=1, live=True, clock_ms=lambda: 123_456))
    assert ev.meta.event_time == 123_456


@pytest.mark.integration
def test_produce_then_consume_exactly_once(
    kafka_settings: Settings, topic_factory: TopicFactory, consume_all: ConsumeAll
) -> None:
    name = topic_factory(4)
    stream = list(events(5_000, seed=9, late_fraction=0.1, malformed_fraction=0.05))
    result = produce(kafka_settings, name, stream)
    assert result.sent == result.delivered == 5_000 and result.failed == 0
    assert result.kinds == Counter(e.meta.kind for e in stream)
    assert result.late == sum(e.meta.late for e in stream)

    offsets = partition_offsets(kafka_settings, name)
    assert sum(hi - lo for lo, hi in offsets.values()) == 5_000
    got = consume_all(name, 5_000)
    assert len(got) == 5_000  # no duplicates, nothing lost
    assert Counter((m.key(), m.value()) for m in got) == Counter((e.key, e.value) for e in stream)
    # keyed records of one user land in one partition
    parts_by_user: dict[bytes, set[int]] = {}
    for m in got:
        if m.key() is not None:
            parts_by_user.setdefault(m.key(), set()).add(m.partition())
    assert all(len(p) == 1 for p in parts_by_user.values())


@pytest.mark.integration
def test_campaigns_and_tombstones(
    kafka_settings: Settings, topic_factory: TopicFactory, consume_all: ConsumeAll
) -> None:
    name = topic_factory(1, {"cleanup.policy": "compact"})
    u = universe(seed=2, campaigns=3)
    r = publish_campaigns(kafka_settings, u.ad_to_campaign, topic=name)
    assert r.delivered == 30 and r.kinds == {"campaign": 30}
    r = publish_campaigns(kafka_settings, {u.ads[0]: None}, topic=name)
    assert r.kinds == {"tombstone": 1}
    msgs = consume_all(name, 31)
    assert msgs[-1].key() == u.ads[0].encode() and msgs[-1].value() is None
    assert json.loads(msgs[0].value()) == {"campaign_id": u.ad_to_campaign[u.ads[0]]}


@pytest.mark.integration
def test_produce_cmd(kafka_settings: Settings, topic_factory: TopicFactory) -> None:
    events_topic, camp_topic = topic_factory(2), topic_factory(1)
    out = produce_cmd(n=300, topic=events_topic, campaigns_topic=camp_topic, campaigns=2,
                      malformed_fraction=0.1, settings=kafka_settings)
    assert out["campaigns"]["delivered"] == 20 and out["events"]["delivered"] == 300

"""Topic management against the real broker: ensure_topics idempotency, declared configs, offsets."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer

from kappa.catalog import TopicSpec, load_catalog
from kappa.config import Settings
from kappa.log.topics import (
    TopicError,
    admin_client,
    delete_topics,
    describe,
    ensure_topics,
    offsets_for_timestamp,
    partition_offsets,
    recent_partition_offsets,
)

TopicFactory = Callable[..., str]
ConsumeAll = Callable[..., list[Any]]

pytestmark = pytest.mark.integration


def _platform_specs(suffix: str) -> list[TopicSpec]:
    """The topics of platform.yaml under unique names (the session broker is shared)."""
    return [dataclasses.replace(s, name=f"{s.name}-{suffix}") for s in load_catalog().topics.values()]


def test_ensure_topics_is_idempotent_and_applies_platform_configs(kafka_settings: Settings) -> None:
    specs = _platform_specs(uuid.uuid4().hex[:6])
    try:
        first = ensure_topics(kafka_settings, specs)
        assert sorted((c.topic, c.action) for c in first) == sorted((s.name, "created") for s in specs)
        assert ensure_topics(kafka_settings, specs) == []  # second call: nothing to do

        for spec in specs:
            info = describe(kafka_settings, spec.name)
            assert info.partitions == spec.partitions
            assert info.replication_factor == spec.replication_factor
            for key, value in spec.config.items():
                assert info.config[key] == value, f"{spec.name}: {key}"
                assert info.overrides[key] == value
        by_base = {s.name.rsplit("-", 1)[0]: s.name for s in specs}
        assert describe(kafka_settings, by_base["campaigns"]).config["cleanup.policy"] == "compact"
        assert describe(kafka_settings, by_base["ad-events"]).config["retention.ms"] == "-1"
    finally:
        delete_topics(kafka_settings, [s.name for s in specs])


def test_ensure_topics_converges_drift(kafka_settings: Settings, topic_factory: TopicFactory) -> None:
    name = topic_factory(2, {"retention.ms": "1000", "cleanup.policy": "delete"})
    declared = TopicSpec(name=name, partitions=4, replication_factor=1,
                         config={"retention.ms": "-1", "cleanup.policy": "delete", "segment.ms": "3600000"})
    changes = ensure_topics(kafka_settings, [declared])
    actions = {c.action: c for c in changes}
    assert set(actions) == {"config_altered", "partitions_added"}
    assert actions["config_altered"].configs == {
        "retention.ms": ("1000", "-1"),
        "segment.ms": ("604800000", "3600000"),
    }
    assert actions["partitions_added"].detail == "2 -> 4 partitions"
    info = describe(kafka_settings, name)
    assert info.partitions == 4 and info.config["retention.ms"] == "-1"
    assert ensure_topics(kafka_settings, [declared]) == []

    # never decrease partitions: declaring fewer is a warning, not a change
    fewer = dataclasses.replace(declared, partitions=1)
    assert ensure_topics(kafka_settings, [fewer]) == []
    assert describe(kafka_settings, name).partitions == 4


def test_invalid_replication_factor_is_a_clear_error(kafka_settings: Settings) -> None:
    spec = TopicSpec(name=f"rf3-{uuid.uuid4().hex[:6]}", partitions=1, replication_factor=3)
    with pytest.raises(TopicError, match=r"rf3-.*REPLICATION_FACTOR"):
        ensure_topics(kafka_settings, [spec], timeout=10)


def test_short_retention_topic(kafka_settings: Settings, topic_factory: TopicFactory) -> None:
    name = topic_factory(1, {"retention.ms": "1000", "segment.ms": "1000"})
    assert describe(kafka_settings, name).overrides["retention.ms"] == "1000"


def test_offsets(kafka_settings: Settings, topic_factory: TopicFactory) -> None:
    # records stamped in 2023: the broker's default time retention (7 days) would delete them at its next check
    name = topic_factory(2, {"retention.ms": "-1"})
    assert partition_offsets(kafka_settings, name) == {0: (0, 0), 1: (0, 0)}
    p = Producer(kafka_settings.kafka_client_config({"enable.idempotence": True}))
    t0 = 1_700_000_000_000
    for i in range(10):  # partition 0 gets timestamps t0..t0+9s, partition 1 the same
        for part in (0, 1):
            p.produce(name, value=b"x", partition=part, timestamp=t0 + i * 1000)
    assert p.flush(30) == 0
    assert partition_offsets(kafka_settings, name) == {0: (0, 10), 1: (0, 10)}
    assert offsets_for_timestamp(kafka_settings, name, t0) == {0: 0, 1: 0}
    assert offsets_for_timestamp(kafka_settings, name, t0 + 4500) == {0: 5, 1: 5}
    # later than every record: the end offset (a valid "start from here" position)
    assert offsets_for_timestamp(kafka_settings, name, int(time.time() * 1000) + 10**7) == {0: 10, 1: 10}


def test_recent_offsets_share_one_answer_per_period_between_callers(kafka_settings: Settings,
                                                                    topic_factory: TopicFactory) -> None:
    """The view jobs' lag pollers: callers within ``max_age`` get the last answer, later ones a new one."""
    import threading

    name = topic_factory(2, {"retention.ms": "-1"})
    first = recent_partition_offsets(kafka_settings, name, max_age=600)
    assert first == {0: (0, 0), 1: (0, 0)}
    p = Producer(kafka_settings.kafka_client_config({"enable.idempotence": True}))
    for part in (0, 1):
        p.produce(name, value=b"x", partition=part)
    assert p.flush(30) == 0
    answers: list[dict] = []
    callers = [threading.Thread(target=lambda: answers.append(recent_partition_offsets(kafka_settings, name,
                                                                                       max_age=600)))
               for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert answers == [first] * 4  # within the period: the answer from before the records, not four requests
    assert recent_partition_offsets(kafka_settings, name, max_age=0) == {0: (0, 1), 1: (0, 1)}  # older: asked
    assert recent_partition_offsets(kafka_settings, name, max_age=600) == {0: (0, 1), 1: (0, 1)}
    assert partition_offsets(kafka_settings, name) == {0: (0, 1), 1: (0, 1)}  # as the uncached answer
    with pytest.raises(TopicError, match="does not exist"):
        recent_partition_offsets(kafka_settings, f"nope-{uuid.uuid4().hex[:6]}", max_age=600, timeout=5)


def test_unknown_topic(kafka_settings: Settings) -> None:
    with pytest.raises(TopicError, match="does not exist"):
        partition_offsets(kafka_settings, f"nope-{uuid.uuid4().hex[:6]}", timeout=5)
    with pytest.raises(TopicError, match="does not exist"):
        describe(kafka_settings, f"nope-{uuid.uuid4().hex[:6]}", timeout=5)


def test_admin_client_uses_settings(kafka_settings: Settings) -> None:
    md = admin_client(kafka_settings).list_topics(timeout=10)
    assert md.brokers


def test_cli_honours_the_topic_prefix(kafka_settings: Settings) -> None:
    """`kappa topics ensure` and `kappa produce` (what `make run` runs) create and write the prefixed topics
    the views read, not the bare declared names."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    settings = kafka_settings.replace(topic_prefix=f"cli-{uuid.uuid4().hex[:6]}.")
    env = subprocess_env(settings)
    for args in (["topics", "ensure"], ["produce", "--count", "50", "--seed", "3"]):
        proc = subprocess.run([sys.executable, "-m", "kappa.front.cli", *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    events = partition_offsets(settings, settings.topic("ad-events"))
    assert sum(high for _low, high in events.values()) == 50
    assert len(events) == load_catalog().topics["ad-events"].partitions
    assert sum(high for _low, high in partition_offsets(settings, settings.topic("campaigns")).values()) > 0

"""LocalBroker: KRaft single node, idempotent start, clean stop, data survives a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kappa.log.broker import BrokerError, LocalBroker, free_port
from kappa.config import Settings
from kappa.log.generator import events, produce
from kappa.log.topics import create_topic, partition_offsets

if TYPE_CHECKING:
    from conftest import KafkaCluster

pytestmark = pytest.mark.integration


def test_heap_limit_and_ports_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1 GiB"):
        LocalBroker(tmp_path, heap="2g")
    with pytest.raises(ValueError, match="differ"):
        LocalBroker(tmp_path, port=9999, controller_port=9999)


def test_missing_jars_fail_loudly(tmp_path: Path) -> None:
    broker = LocalBroker(tmp_path / "b", port=free_port(), controller_port=free_port(), jars_dir=tmp_path / "none")
    with pytest.raises(BrokerError, match="make setup"):
        broker.start()


def test_restart_keeps_data(tmp_path: Path) -> None:
    """Own broker (not the session one): format once, produce, stop, start again, consume everything."""
    broker = LocalBroker(tmp_path / "broker", port=free_port(), controller_port=free_port(), heap="512m")
    try:
        t0 = time.monotonic()
        broker.start()
        first_start = time.monotonic() - t0
        pid = broker.pid
        assert broker.is_running() and pid is not None
        props = broker.config_file.read_text()
        assert "process.roles=broker,controller" in props and "auto.create.topics.enable=false" in props
        assert f"listeners=PLAINTEXT://127.0.0.1:{broker.port}" in props
        assert (broker.data_dir / "meta.properties").exists()
        cluster_id = (broker.home / "cluster.id").read_text().strip()

        broker.start()  # second start while running: no-op (the same process, no second server start logged)
        assert broker.pid == pid and broker.is_running()
        assert broker.log_file.read_text().count("Kafka Server started") == 1, broker.log_tail()

        rss = broker.rss_bytes()
        assert rss is not None and rss < 1 << 30, f"broker RSS {rss} >= 1 GiB"

        settings = Settings.from_env().replace(kafka_bootstrap=broker.bootstrap, local_broker=False)
        create_topic(settings, "persist", 2)
        result = produce(settings, "persist", events(500, seed=3))
        assert result.delivered == 500 and result.failed == 0

        assert broker.stop() is True
        assert not broker.is_running() and not broker.pid_file.exists()
        assert broker.stop() is False  # stopping a stopped broker is fine

        t0 = time.monotonic()
        broker.start()
        restart = time.monotonic() - t0
        assert (broker.home / "cluster.id").read_text().strip() == cluster_id  # not re-formatted
        offsets = partition_offsets(settings, "persist")
        assert sum(hi - lo for lo, hi in offsets.values()) == 500

        # read back through a consumer bound to this broker (consume_all is bound to the session cluster)
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        c = Consumer(settings.kafka_client_config({"group.id": "restart-check", "enable.auto.commit": False}))
        c.assign([TopicPartition("persist", p, OFFSET_BEGINNING) for p in offsets])
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 500 and time.monotonic() < deadline:
            got += [m.value() for m in c.consume(1000, timeout=0.5) if m.error() is None]
        c.close()
        expected = sorted(e.value for e in events(500, seed=3))
        assert sorted(got) == expected
        print(f"\nbroker first start {first_start:.1f}s, restart {restart:.1f}s, RSS {rss / 2**20:.0f} MiB")
    finally:
        broker.stop()
    assert not broker.is_running()


def test_port_in_use_is_reported(kafka: KafkaCluster, tmp_path: Path) -> None:
    if kafka.broker is None:
        pytest.skip("external cluster: no local port to collide with")
    other = LocalBroker(tmp_path / "other", port=kafka.broker.port, controller_port=free_port())
    with pytest.raises(BrokerError, match="already in use"):
        other.start()

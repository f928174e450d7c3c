"""Shared pytest fixtures.

The file is split in sections owned by different people; keep them separate.

Section 1 -- Kafka (platform engineer)
    ``kafka``          session: a real single-node KRaft broker (``kappa.log.broker.LocalBroker``) on free
                       ports under a temporary home, stopped at the end of the session; or, when
                       ``KAPPA_KAFKA_BOOTSTRAP`` is set, that external cluster (nothing started).
                       Yields a :class:`KafkaCluster` (``.settings``, ``.bootstrap``, ``.broker``, ``.env``).
    ``kafka_settings`` session: shortcut for ``kafka.settings``.
    ``topic_factory``  function: ``topic_factory(partitions=1, config=None) -> name`` creates uniquely
                       named topics on ``kafka`` and deletes them after the test.
    ``consume_all``    function: ``consume_all(topic, expected, timeout=30) -> list[Message]`` reads a
                       topic from the beginning until ``expected`` records arrived.

    No mocks: if the broker cannot start (e.g. jars missing -> run ``make setup``) the tests error
    out with the broker's log tail, they are never skipped silently.

Section 2 -- Spark (lead): add the session SparkSession fixtures below the marker.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kappa.log.broker import LocalBroker, free_port
from kappa.config import Settings
from kappa.log.topics import create_topic, delete_topics

# =====================================================================================================
# Section 1 -- Kafka fixtures (platform engineer)
# =====================================================================================================


@dataclass(frozen=True)
class KafkaCluster:
    """The cluster tests run against.

    Attributes:
        settings: Settings pointing at the cluster (home and lake under the session's tmp dir).
        broker: The local broker the fixture started, or None for an external cluster.
        env: Environment variables for subprocesses (``KAPPA_HOME``, ``KAPPA_KAFKA_BOOTSTRAP``,
            ``KAPPA_LAKE_URI`` and the security settings), so a ``kappa`` CLI run sees the same cluster.
    """

    settings: Settings
    broker: LocalBroker | None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        """Bootstrap servers."""
        return self.settings.kafka_bootstrap


def _subprocess_env(settings: Settings) -> dict[str, str]:
    env = {
        "KAPPA_HOME": str(settings.home),
        "KAPPA_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "KAPPA_LAKE_URI": settings.lake_uri,
        "KAPPA_TOPIC_PREFIX": settings.topic_prefix,
    }
    for var, value in (
        ("KAPPA_KAFKA_SECURITY_PROTOCOL", settings.security_protocol),
        ("KAPPA_KAFKA_SASL_MECHANISM", settings.sasl_mechanism),
        ("KAPPA_KAFKA_SASL_USERNAME", settings.sasl_username),
        ("KAPPA_KAFKA_SASL_PASSWORD", settings.sasl_password),
        ("KAPPA_KAFKA_SSL_CA_LOCATION", settings.ssl_ca_location),
    ):
        if value:
            env[var] = value
    return env


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """A real Kafka cluster for the whole session (local KRaft broker unless KAPPA_KAFKA_BOOTSTRAP)."""
    home = tmp_path_factory.mktemp("kappa-home")
    base = Settings.from_env()
    if not base.local_broker:  # external cluster: use it, start nothing
        settings = base.replace(home=home, lake_uri=os.environ.get("KAPPA_LAKE_URI", "") or "")
        yield KafkaCluster(settings=settings, broker=None, env=_subprocess_env(settings))
        return
    broker = LocalBroker(home / "broker", port=free_port(), controller_port=free_port(), heap="768m")
    broker.start()  # raises BrokerError with the log tail if it cannot start
    settings = base.replace(home=home, lake_uri="", kafka_bootstrap=broker.bootstrap, local_broker=False)
    try:
        yield KafkaCluster(settings=settings, broker=broker, env=_subprocess_env(settings))
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_settings(kafka: KafkaCluster) -> Settings:
    """Settings of the session's Kafka cluster."""
    return kafka.settings


@pytest.fixture
def topic_factory(kafka: KafkaCluster, request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """Create uniquely named topics (``t-<test>-<random>``); they are deleted after the test."""
    created: list[str] = []
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:60]

    def make(partitions: int = 1, config: dict[str, str] | None = None, *, prefix: str = "t") -> str:
        name = f"{prefix}-{slug}-{uuid.uuid4().hex[:8]}"
        create_topic(kafka.settings, name, partitions, config)
        created.append(name)
        return name

    yield make
    if created:
        delete_topics(kafka.settings, created)


@pytest.fixture
def consume_all(kafka: KafkaCluster) -> Callable[..., list[Any]]:
    """Read a topic from the beginning until ``expected`` records (or fail after ``timeout`` s)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    def read(topic: str, expected: int, *, timeout: float = 30.0) -> list[Any]:
        consumer = Consumer(
            kafka.settings.kafka_client_config(
                {"group.id": f"test-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                 "auto.offset.reset": "earliest", "enable.partition.eof": False}
            )
        )
        try:
            md = consumer.list_topics(topic, timeout=10)
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.topics[topic].partitions])
            out: list[Any] = []
            deadline = time.monotonic() + timeout
            while len(out) < expected and time.monotonic() < deadline:
                for msg in consumer.consume(num_messages=10_000, timeout=0.5):
                    if msg.error() is None:
                        out.append(msg)
            if len(out) < expected:
                raise AssertionError(f"read {len(out)} of {expected} records from {topic} in {timeout}s")
            # drain briefly to detect *extra* records (duplicates)
            out.extend(m for m in consumer.consume(num_messages=10_000, timeout=0.5) if m.error() is None)
            return out
        finally:
            consumer.close()

    return read


# =====================================================================================================
# Section 2 -- Spark fixtures (lead)
# =====================================================================================================


@pytest.fixture(scope="session")
def spark(kafka: KafkaCluster):
    """One SparkSession (local[2], Delta + Kafka connector from .cache/jars) for every in-process test."""
    from kappa.runtime.spark import build_spark, stop_spark

    session = build_spark("kappa-tests", kafka.settings)
    yield session
    stop_spark(session)  # the state stores first, as the platform stops its own sessions (no ERROR at exit)


@pytest.fixture(scope="session")
def declared_topics(kafka: KafkaCluster) -> dict[str, int]:
    """The topics of kappa/platform.yaml, created on the session cluster (name -> partitions)."""
    from kappa.catalog import load_catalog
    from kappa.log.topics import ensure_topics

    topics = load_catalog().topics
    ensure_topics(kafka.settings, list(topics.values()))
    return {name: spec.partitions for name, spec in topics.items()}


@pytest.fixture
def lake(kafka: KafkaCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Settings:
    """Settings with a fresh lake (tables, checkpoints, quarantine) and this test's own declared topics.

    The topics of kappa/platform.yaml are created under a per-test prefix (``KAPPA_TOPIC_PREFIX``), so every
    test reads a log holding only its own records, while using the real declarations (partitions, configs).
    """
    from kappa.log.topics import declared_topics, ensure_topics

    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:40]
    settings = kafka.settings.replace(lake_uri=str(tmp_path / "lake"), topic_prefix=f"{slug}-{uuid.uuid4().hex[:6]}.")
    ensure_topics(settings, declared_topics(settings))
    return settings


def subprocess_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for a ``kappa`` subprocess that talks to the same cluster and lake."""
    env = {**os.environ, **_subprocess_env(settings), "PYTHONUNBUFFERED": "1"}
    env.pop("KAPPA_FAULT", None)
    env.update(extra)
    return env


# =====================================================================================================
# Section 3 -- Airflow fixtures (replay engineer)
# =====================================================================================================

#: Sensor poke interval of the replay DAG during tests (read by dags/kappa_replay.py when it is parsed).
AIRFLOW_TEST_POKE_SECONDS = "2"


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A throw-away Airflow (sqlite metadata DB, this repo's ``dags/``) ready for ``DagBag`` and ``dag.test()``.

    Airflow reads its configuration on first import, so the environment is set here before anything imports
    ``airflow``; the database is created from the ORM (``airflow.utils.db.initdb``, the fast path for a new DB).
    """
    import sys

    home = tmp_path_factory.mktemp("airflow-home")
    dags = Path(__file__).resolve().parents[1] / "dags"
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "KAPPA_REPLAY_POKE_SECONDS": AIRFLOW_TEST_POKE_SECONDS,
        "KAPPA_WATCH_POLL_SECONDS": AIRFLOW_TEST_POKE_SECONDS,
    }
    if "airflow.configuration" in sys.modules:  # imported earlier with another home: fail loudly, not oddly
        from airflow.configuration import conf

        if conf.get("core", "dags_folder") != str(dags):
            pytest.fail("airflow was imported before the airflow_home fixture; request it first")
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    try:
        from airflow.utils.db import initdb

        initdb()
        yield home
    finally:
        patch.undo()


# =====================================================================================================
# Section 4 -- Object store fixtures
# =====================================================================================================


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3-API object store for the session (``kappa.objectstore.LocalObjectStore``: SeaweedFS on free loopback
    ports under a temporary home, a credential of its own) with the bucket ``kappa``; stopped at the end.

    The pinned ``weed`` binary is built into the tools cache when missing (minutes, once per machine). No mocks: if it
    cannot be built or started, the tests error out with the reason.
    """
    from kappa.objectstore import LocalObjectStore, Ports, weed_binary

    store = LocalObjectStore(tmp_path_factory.mktemp("objectstore"), ports=Ports.free(), weed=weed_binary(build=True))
    try:
        store.start()
        store.ensure_bucket("kappa")
        yield store
    finally:
        store.stop()

"""Kafka topic management with confluent-kafka's AdminClient: declare, inspect, locate offsets.

The topics of ``kappa/platform.yaml`` are *declared*: :func:`ensure_topics` converges the cluster to the
declaration (create missing topics, set differing configs, add partitions) and reports what it changed.
It never deletes data: it does not decrease partitions, drop topics or reset undeclared configs.

Transient errors (broker starting, controller moving, timeouts) are retried with tenacity until the
operation's ``timeout``.

Example:
    >>> from kappa.config import Settings
    >>> from kappa.catalog import load_catalog
    >>> from kappa.log.topics import ensure_topics, partition_offsets
    >>> s = Settings.from_env()
    >>> ensure_topics(s, load_catalog().topics.values())  # doctest: +SKIP
    [TopicChange(topic='ad-events', action='created', detail='4 partitions, RF 1, 5 configs')]
    >>> partition_offsets(s, "ad-events")  # doctest: +SKIP
    {0: (0, 0), 1: (0, 0), 2: (0, 0), 3: (0, 0)}
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # names not re-exported in its stubs
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
    ResourceType,
)
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from kappa.catalog import TopicSpec, load_catalog
from kappa.config import Settings
from kappa.errors import KappaError

__all__ = [
    "wait_for_topics",
    "TopicChange",
    "TopicError",
    "TopicInfo",
    "admin_client",
    "create_topic",
    "declared_topics",
    "delete_topics",
    "describe",
    "ensure_topics",
    "list_topics",
    "offsets_for_timestamp",
    "recent_partition_offsets",
    "partition_offsets",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

ChangeAction = Literal["created", "config_altered", "partitions_added"]

_TRANSIENT_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_CONTROLLER,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,  # right after creation, metadata may lag
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


class TopicError(KappaError, RuntimeError):
    """A topic operation failed for a non-transient reason (message names topic and Kafka error)."""


@dataclass(frozen=True, slots=True)
class TopicChange:
    """One change :func:`ensure_topics` made.

    Attributes:
        topic: Topic name.
        action: ``created``, ``config_altered`` or ``partitions_added``.
        detail: Human summary (``"retention.ms: 604800000 -> -1"``, ``"2 -> 4 partitions"``).
        configs: For ``config_altered``: key -> (old value, new value).
    """

    topic: str
    action: ChangeAction
    detail: str
    configs: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.topic}: {self.action.replace('_', ' ')} ({self.detail})"


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """What the cluster says about a topic.

    Attributes:
        name: Topic name.
        partitions: Number of partitions.
        replication_factor: Replicas of partition 0.
        config: Every config value (defaults included), sensitive ones omitted.
        overrides: Only the topic-level overrides (source ``DYNAMIC_TOPIC_CONFIG``).
    """

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    overrides: dict[str, str]


# ------------------------------------------------------------------------------------ plumbing
def admin_client(settings: Settings) -> AdminClient:
    """An AdminClient for ``settings`` (security options included); librdkafka logs go to ``logging``."""
    return AdminClient(settings.kafka_client_config({"client.id": "kappa-admin", "logger": log}))


def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def _is_transient(exc: BaseException) -> bool:
    err = _kafka_error(exc)
    if err is None:
        return False
    return err.code() in _TRANSIENT_CODES or bool(err.retriable())


def _retry(fn: Callable[[], T], *, timeout: float, what: str) -> T:
    """Run ``fn`` until it succeeds, retrying transient Kafka errors until ``timeout`` seconds."""
    retrying = Retrying(
        retry=retry_if_exception(_is_transient),
        stop=stop_after_delay(timeout),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
        before_sleep=lambda rs: log.debug("retrying %s after %s", what, rs.outcome.exception() if rs.outcome else None),
    )
    return retrying(fn)


def _wait(future: Any, *, timeout: float, what: str) -> Any:
    try:
        return future.result(timeout=timeout)
    except KafkaException:
        raise
    except TimeoutError as exc:  # concurrent.futures.TimeoutError is TimeoutError on 3.11
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"{what}: no answer in {timeout:.0f}s")) from exc


def _fail(topic: str, what: str, exc: BaseException) -> TopicError:
    err = _kafka_error(exc)
    reason = f"{err.name()}: {err.str()}" if err is not None else str(exc)
    return TopicError(f"{what} topic {topic!r} failed ({reason})")


# ------------------------------------------------------------------------------------ inspect
def list_topics(settings: Settings, *, timeout: float = 30.0, internal: bool = False) -> dict[str, int]:
    """Topic name -> partition count (internal ``__*`` topics only with ``internal=True``)."""
    admin = admin_client(settings)
    md = _retry(lambda: admin.list_topics(timeout=min(timeout, 10.0)), timeout=timeout, what="list_topics")
    return {
        name: len(t.partitions)
        for name, t in md.topics.items()
        if t.error is None and (internal or not name.startswith("__"))
    }


def wait_for_topics(settings: Settings, names: Iterable[str], *, say: Callable[[str], None],
                    alive: Callable[[], None] | None = None, stop: Callable[[], bool] | None = None,
                    poll: float = 2.0) -> bool:
    """Wait until every topic of ``names`` exists (auto-creation is off: the chart's topics Job, a post-install
    hook, creates them once the release's pods are up; ``kappa topics ensure`` does locally). ``say`` gets one line
    per change of what is missing, ``alive`` is called at each poll (a heartbeat), ``stop`` ends the wait early.
    Returns False when stopped, True once every topic exists; brokers still starting count as missing topics."""
    wanted, said = sorted(set(names)), ""
    while True:
        try:
            missing, why = sorted(set(wanted) - set(list_topics(settings, timeout=10.0))), ""
        except (KappaError, KafkaException) as exc:
            missing, why = wanted, f": {exc}".splitlines()[0]
        if not missing:
            return True
        line = f"waiting for topic(s) {', '.join(missing)} (created by `{settings.cli} topics ensure`){why}"
        if line != said:
            say(line)
            said = line
        if alive is not None:
            alive()
        if stop is not None and stop():
            return False
        time.sleep(poll)


def _describe_configs(admin: AdminClient, name: str, *, timeout: float) -> dict[str, ConfigEntry]:
    def call() -> dict[str, ConfigEntry]:
        res = ConfigResource(ResourceType.TOPIC, name)
        futures = admin.describe_configs([res], request_timeout=min(timeout, 10.0))
        return dict(_wait(futures[res], timeout=timeout, what=f"describe_configs {name}"))

    return _retry(call, timeout=timeout, what=f"describe_configs {name}")


def _source(entry: ConfigEntry) -> int:
    # confluent-kafka returns the raw int at run time although its type hints say ConfigSource
    src: Any = entry.source
    return int(getattr(src, "value", src))


def describe(settings: Settings, name: str, *, timeout: float = 30.0) -> TopicInfo:
    """Partitions, replication factor and configs of an existing topic.

    Raises:
        TopicError: If the topic does not exist.
    """
    admin = admin_client(settings)
    md = _retry(lambda: admin.list_topics(topic=name, timeout=min(timeout, 10.0)), timeout=timeout, what="metadata")
    t = md.topics.get(name)
    if t is None or t.error is not None:
        reason = t.error.str() if t is not None and t.error is not None else "not found"
        raise TopicError(f"topic {name!r} does not exist ({reason})")
    entries = _describe_configs(admin, name, timeout=timeout)
    config = {k: e.value for k, e in entries.items() if e.value is not None and not e.is_sensitive}
    overrides = {
        k: e.value
        for k, e in entries.items()
        if e.value is not None and _source(e) == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    }
    rf = len(t.partitions[0].replicas) if 0 in t.partitions else 0
    return TopicInfo(name=name, partitions=len(t.partitions), replication_factor=rf, config=config, overrides=overrides)


# ------------------------------------------------------------------------------------ declare
def declared_topics(settings: Settings) -> list[TopicSpec]:
    """The topics of kappa/platform.yaml under their physical names (``KAPPA_TOPIC_PREFIX`` + name)."""
    return [dataclasses.replace(spec, name=settings.topic(spec.name)) for spec in load_catalog().topics.values()]


def ensure_topics(
    settings: Settings, specs: Iterable[TopicSpec], *, held: Mapping[str, Mapping[str, str]] | None = None,
    timeout: float = 30.0,
) -> list[TopicChange]:
    """Converge the cluster to the declared topics; idempotent.

    * missing topic -> created with its partitions, replication factor and configs;
    * existing topic -> every declared config whose value differs is set (``incremental_alter_configs``,
      SET only -- undeclared overrides are left alone); fewer partitions than declared -> partitions
      added. More partitions than declared or a different replication factor are logged as warnings and
      left unchanged (Kafka cannot remove partitions; changing RF needs a reassignment).

    Args:
        settings: Cluster to talk to.
        specs: Declarations, e.g. ``load_catalog().topics.values()``.
        held: Topic -> configs that hold on top of the declared ones (the retention leases of replays in flight,
            :mod:`kappa.control.leases`): convergence sets those instead of the declared values; a None value
            removes the topic's own override of that key (back to the broker default) - for a lease's key the
            topic does not declare, once the lease ended.
        timeout: Seconds for the whole operation, transient-error retries included.

    Returns:
        The changes made (empty when the cluster already matched).

    Raises:
        TopicError: On a non-transient failure (e.g. replication factor larger than the cluster).
    """
    specs = [dataclasses.replace(s, config={**s.config, **held[s.name]}) if held and s.name in held else s
             for s in specs]
    deadline = time.monotonic() + timeout
    admin = admin_client(settings)

    def remaining() -> float:
        return max(1.0, deadline - time.monotonic())

    existing = list_topics(settings, timeout=remaining())
    changes: list[TopicChange] = []

    to_create = [s for s in specs if s.name not in existing]
    created = _create(admin, to_create, timeout=remaining())
    changes.extend(
        TopicChange(s.name, "created", f"{s.partitions} partitions, RF {s.replication_factor}, {len(s.config)} configs")
        for s in to_create
        if s.name in created
    )
    if to_create:
        _wait_for_metadata(admin, {s.name: s.partitions for s in to_create}, timeout=remaining())
        existing = list_topics(settings, timeout=remaining())

    for spec in specs:
        if spec.name in created:
            continue
        changes.extend(_converge_existing(admin, spec, existing.get(spec.name, 0), timeout=remaining()))
    for c in changes:
        log.info("topic %s: %s (%s)", c.topic, c.action, c.detail)
    return changes


def _create(admin: AdminClient, specs: list[TopicSpec], *, timeout: float) -> set[str]:
    """Create topics; returns the names this call created (already-existing ones are skipped)."""
    created: set[str] = set()
    pending = list(specs)
    for spec in specs:
        if spec.partitions < 1 or spec.replication_factor < 1:
            raise TopicError(f"topic {spec.name!r}: partitions and replication_factor must be >= 1")

    def call() -> None:
        nonlocal pending
        if not pending:
            return
        new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                        config={k: v for k, v in s.config.items() if v is not None}) for s in pending]
        futures = admin.create_topics(new, request_timeout=min(timeout, 15.0), operation_timeout=min(timeout, 15.0))
        still: list[TopicSpec] = []
        first_transient: KafkaException | None = None
        for s in pending:
            try:
                _wait(futures[s.name], timeout=timeout, what=f"create {s.name}")
                created.add(s.name)
            except KafkaException as exc:
                err = _kafka_error(exc)
                if err is not None and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # a concurrent creator won: converge it as an existing topic
                if _is_transient(exc):
                    still.append(s)
                    first_transient = first_transient or exc
                    continue
                raise _fail(s.name, "creating", exc) from exc
        pending = still
        if first_transient is not None:
            raise first_transient

    _retry(call, timeout=timeout, what="create_topics")
    return created


def _wait_for_metadata(admin: AdminClient, expected: Mapping[str, int], *, timeout: float) -> None:
    """Wait until every topic shows all its partitions with a leader (producers can use it at once)."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
        ready = all(
            (t := md.topics.get(name)) is not None
            and t.error is None
            and len(t.partitions) >= n
            and all(p.leader >= 0 for p in t.partitions.values())
            for name, n in expected.items()
        )
        if ready:
            return
        if time.monotonic() >= deadline:
            raise TopicError(f"topics {sorted(expected)} created but not ready (no leader) after {timeout:.0f}s")
        time.sleep(0.1)


def _converge_existing(
    admin: AdminClient, spec: TopicSpec, partitions: int, *, timeout: float
) -> list[TopicChange]:
    changes: list[TopicChange] = []
    entries = _describe_configs(admin, spec.name, timeout=timeout)
    diff: dict[str, tuple[str | None, str | None]] = {}
    for key, want in spec.config.items():
        entry = entries.get(key)
        have = entry.value if entry is not None else None
        if want is None:  # remove the topic's own override, if it has one
            if entry is not None and _source(entry) == ConfigSource.DYNAMIC_TOPIC_CONFIG.value:
                diff[key] = (have, None)
        elif have != want:
            diff[key] = (have, want)
    if diff:
        def alter() -> None:
            res = ConfigResource(
                ResourceType.TOPIC,
                spec.name,
                incremental_configs=[
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) if v is not None else
                    ConfigEntry(k, "", incremental_operation=AlterConfigOpType.DELETE) for k, (_, v) in diff.items()
                ],
            )
            futures = admin.incremental_alter_configs([res], request_timeout=min(timeout, 15.0))
            try:
                _wait(futures[res], timeout=timeout, what=f"alter configs {spec.name}")
            except KafkaException as exc:
                if _is_transient(exc):
                    raise
                raise _fail(spec.name, "altering configs of", exc) from exc

        _retry(alter, timeout=timeout, what=f"alter configs {spec.name}")
        detail = ", ".join(f"{k}: {old} -> {'(broker default)' if new is None else new}" for k, (old, new) in diff.items())
        changes.append(TopicChange(spec.name, "config_altered", detail, configs=diff))

    if partitions < spec.partitions:
        def grow() -> None:
            futures = admin.create_partitions(
                [NewPartitions(spec.name, spec.partitions)], request_timeout=min(timeout, 15.0)
            )
            try:
                _wait(futures[spec.name], timeout=timeout, what=f"create_partitions {spec.name}")
            except KafkaException as exc:
                err = _kafka_error(exc)
                if err is not None and err.code() == KafkaError.INVALID_PARTITIONS:
                    # already grown by a previous (timed-out) attempt? re-check instead of failing
                    md = admin.list_topics(topic=spec.name, timeout=5)
                    if len(md.topics[spec.name].partitions) >= spec.partitions:
                        return
                if _is_transient(exc):
                    raise
                raise _fail(spec.name, "adding partitions to", exc) from exc

        _retry(grow, timeout=timeout, what=f"create_partitions {spec.name}")
        _wait_for_metadata(admin, {spec.name: spec.partitions}, timeout=timeout)
        changes.append(TopicChange(spec.name, "partitions_added", f"{partitions} -> {spec.partitions} partitions"))
    elif partitions > spec.partitions:
        log.warning(
            "topic %s has %d partitions, declared %d: partitions are never removed (left as is)",
            spec.name, partitions, spec.partitions,
        )
    return changes


def create_topic(
    settings: Settings,
    name: str,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    *,
    replication_factor: int = 1,
    timeout: float = 30.0,
) -> TopicSpec:
    """Create one topic (for tests and ad-hoc use, e.g. a short-retention topic) and wait until usable.

    Raises:
        TopicError: If it already exists or creation fails.
    """
    spec = TopicSpec(name=name, partitions=partitions, replication_factor=replication_factor,
                     config={k: str(v) for k, v in (config or {}).items()})
    admin = admin_client(settings)
    if not _create(admin, [spec], timeout=timeout):
        raise TopicError(f"topic {name!r} already exists")
    _wait_for_metadata(admin, {name: partitions}, timeout=timeout)
    return spec


def delete_topics(settings: Settings, names: Iterable[str], *, timeout: float = 30.0) -> None:
    """Delete topics (missing ones are ignored). Used by tests to clean up."""
    names = list(names)
    if not names:
        return
    admin = admin_client(settings)
    futures = admin.delete_topics(names, operation_timeout=min(timeout, 15.0), request_timeout=min(timeout, 15.0))
    for name, fut in futures.items():
        try:
            _wait(fut, timeout=timeout, what=f"delete {name}")
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is None or err.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise _fail(name, "deleting", exc) from exc


# ------------------------------------------------------------------------------------ offsets
def _partitions(admin: AdminClient, topic: str, *, timeout: float) -> list[int]:
    md = _retry(lambda: admin.list_topics(topic=topic, timeout=min(timeout, 10.0)), timeout=timeout, what="metadata")
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        raise TopicError(f"topic {topic!r} does not exist")
    return sorted(t.partitions)


def _list_offsets(
    admin: AdminClient, topic: str, parts: list[int], spec: OffsetSpec, *, timeout: float
) -> dict[int, int]:
    def call() -> dict[int, int]:
        req = {TopicPartition(topic, p): spec for p in parts}
        futures = admin.list_offsets(req, request_timeout=min(timeout, 10.0))
        return {tp.partition: _wait(f, timeout=timeout, what="list_offsets").offset for tp, f in futures.items()}

    return _retry(call, timeout=timeout, what=f"list_offsets {topic}")


def partition_offsets(settings: Settings, topic: str, *, timeout: float = 30.0) -> dict[int, tuple[int, int]]:
    """Low and high watermark of every partition: ``{partition: (earliest, latest)}``.

    ``latest`` is the offset the next record will get, so ``latest - earliest`` is the number of
    retained offsets (records, for a non-compacted topic without transactions).
    """
    return _ends(admin_client(settings), topic, timeout=timeout)


def _ends(admin: AdminClient, topic: str, *, timeout: float) -> dict[int, tuple[int, int]]:
    parts = _partitions(admin, topic, timeout=timeout)
    low = _list_offsets(admin, topic, parts, OffsetSpec.earliest(), timeout=timeout)
    high = _list_offsets(admin, topic, parts, OffsetSpec.latest(), timeout=timeout)
    return {p: (low[p], high[p]) for p in parts}


#: :func:`recent_partition_offsets`: one AdminClient per client configuration, and per (configuration, topic) the
#: last answer with its time and a lock, so callers asking at once wait for one request instead of each making one
_SHARED_LOCK = threading.Lock()
_SHARED_ADMINS: dict[tuple, AdminClient] = {}
_RECENT_ENDS: dict[tuple, list] = {}  # key -> [lock, monotonic time of the answer, answer]


def _shared_admin(settings: Settings) -> tuple[tuple, AdminClient]:
    conf = settings.kafka_client_config({"client.id": "kappa-admin", "logger": log})
    key = tuple(sorted((k, str(v)) for k, v in conf.items() if k != "logger"))
    with _SHARED_LOCK:
        admin = _SHARED_ADMINS.get(key)
        if admin is None:
            admin = _SHARED_ADMINS[key] = AdminClient(conf)
    return key, admin


def recent_partition_offsets(settings: Settings, topic: str, *, max_age: float,
                             timeout: float = 30.0) -> dict[int, tuple[int, int]]:
    """:func:`partition_offsets`, answered from the last request for ``topic`` made in this process less than
    ``max_age`` seconds ago, through one AdminClient kept for the process.

    For pollers (the view jobs' lag gauges): the view host runs several jobs reading one topic, each asking every
    few seconds; a new client per question (threads, a connection, a metadata request) and one question per job
    cost the host more than its idle micro-batches."""
    key, admin = _shared_admin(settings)
    with _SHARED_LOCK:
        entry = _RECENT_ENDS.setdefault((key, topic), [threading.Lock(), float("-inf"), None])
    with entry[0]:
        if entry[2] is not None and time.monotonic() - entry[1] < max_age:
            return dict(entry[2])
        entry[1:] = [time.monotonic(), _ends(admin, topic, timeout=timeout)]
        return dict(entry[2])


def offsets_for_timestamp(settings: Settings, topic: str, ts_ms: int, *, timeout: float = 30.0) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is >= ``ts_ms``.

    Where no record is that recent the partition's end offset (high watermark) is returned, so the
    result is always a valid start position ("read everything from ``ts_ms`` on") -- e.g. for a replay's
    ``startingOffsets`` JSON.
    """
    admin = admin_client(settings)
    parts = _partitions(admin, topic, timeout=timeout)
    found = _list_offsets(admin, topic, parts, OffsetSpec.for_timestamp(int(ts_ms)), timeout=timeout)
    missing = [p for p, off in found.items() if off < 0]
    if missing:
        ends = _list_offsets(admin, topic, missing, OffsetSpec.latest(), timeout=timeout)
        found.update(ends)
    return dict(sorted(found.items()))

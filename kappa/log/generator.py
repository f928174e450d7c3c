"""Deterministic Yahoo Streaming Benchmark (YSB) event generator and Kafka producer helpers.

Everything is derived from a seed with :class:`random.Random`, and event times come from a *synthetic*
clock (``start_ms + i * 1000 / rate_per_s``), so two runs with the same arguments produce the same bytes
-- which is what makes replays and verification of the views reproducible. Only live demos
(``live=True``) use the wall clock.

Each generated record is an :class:`Event` ``(key, value, meta)``; ``meta`` labels it (valid or which
malformed kind, late or not) so tests can count what the jobs should have accepted or rejected.

Malformed kinds (:data:`MALFORMED_KINDS`):

``invalid_json``        value is not JSON (truncated document)
``wrong_type``          a field has the wrong JSON type (``event_time`` as string, ``ad_id`` as number)
``missing_field``       a required field is absent
``oversized``           ``page_id`` is a > 64 KiB string (the record stays below ``max.message.bytes``)
``null_key``            valid value but no key (ad-events are keyed by ``user_id``)
``unknown_event_type``  ``event_type`` outside ``view|click|purchase``

Every record carries an ``event_id`` (schema ``ad_event`` v2; derived from the seed, random in live mode).
``duplicate_fraction`` re-sends a share of the valid records unchanged a few records later, as a producer that
retries without idempotence does (the copy's meta has ``duplicate=True``).

Example:
    >>> from kappa.log.generator import events, universe
    >>> u = universe(seed=7, campaigns=2)
    >>> len(u.ads), len(u.ad_to_campaign)
    (20, 20)
    >>> first = next(events(1, seed=7, universe=u, start_ms=0))
    >>> first.meta.kind, first.meta.event_time
    ('valid', 0)
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kappa.config import Settings

__all__ = [
    "AD_TYPES",
    "EVENT_TYPES",
    "MALFORMED_KINDS",
    "Event",
    "EventMeta",
    "ProduceResult",
    "Universe",
    "campaign_records",
    "delete_campaigns",
    "events",
    "produce",
    "produce_cmd",
    "publish_campaigns",
    "universe",
]

log = logging.getLogger(__name__)

AD_TYPES: tuple[str, ...] = ("banner", "modal", "sponsored-search", "mail", "mobile")
EVENT_TYPES: tuple[str, ...] = ("view", "click", "purchase")
MalformedKind = Literal["invalid_json", "wrong_type", "missing_field", "oversized", "null_key", "unknown_event_type"]
MALFORMED_KINDS: tuple[MalformedKind, ...] = (
    "invalid_json", "wrong_type", "missing_field", "oversized", "null_key", "unknown_event_type",
)
_REQUIRED = ("user_id", "page_id", "ad_id", "ad_type", "event_type", "event_time", "ip")
_OVERSIZED_BYTES = 64 * 1024 + 1024  # > 64 KiB


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# ----------------------------------------------------------------------------------- universe
@dataclass(frozen=True, slots=True)
class Universe:
    """The fixed entities events refer to: campaigns, their ads, users and pages (all UUID strings).

    Attributes:
        campaigns: Campaign ids.
        ads: Ad ids (``ads_per_campaign`` per campaign, in campaign order).
        ad_to_campaign: Ad id -> campaign id (the content of topic ``campaigns``).
        users: User ids.
        pages: Page ids.
    """

    campaigns: tuple[str, ...]
    ads: tuple[str, ...]
    ad_to_campaign: dict[str, str]
    users: tuple[str, ...]
    pages: tuple[str, ...]


def universe(
    *, seed: int = 0, campaigns: int = 100, ads_per_campaign: int = 10, users: int = 1000, pages: int = 100
) -> Universe:
    """Deterministic entities for ``seed`` (YSB: 100 campaigns x 10 ads by default).

    The ids depend only on ``seed`` and the counts, so the campaign mapping published once and the
    events generated later agree.
    """
    if min(campaigns, ads_per_campaign, users, pages) < 1:
        raise ValueError("campaigns, ads_per_campaign, users and pages must be >= 1")
    rng = random.Random(f"kappa-universe-{seed}")
    camp = tuple(_uuid(rng) for _ in range(campaigns))
    mapping: dict[str, str] = {}
    for c in camp:
        for _ in range(ads_per_campaign):
            mapping[_uuid(rng)] = c
    return Universe(
        campaigns=camp,
        ads=tuple(mapping),
        ad_to_campaign=mapping,
        users=tuple(_uuid(rng) for _ in range(users)),
        pages=tuple(_uuid(rng) for _ in range(pages)),
    )


# ------------------------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class EventMeta:
    """What a generated record is, for tests and reports.

    Attributes:
        index: Position in the stream (0-based).
        kind: ``"valid"`` or one of :data:`MALFORMED_KINDS`.
        late: True if ``event_time`` was shifted back (out of order).
        lateness_ms: How far back (0 if not late).
        event_time: The event time written (synthetic clock minus lateness), epoch millis.
        event_type: ``view``/``click``/``purchase`` (or the bad value for ``unknown_event_type``).
        ad_id: Ad id used.
        campaign_id: Campaign of ``ad_id``.
        user_id: User id used.
        event_id: The record's ``event_id`` (None for records that do not carry one).
        duplicate: True for a re-sent copy of an earlier record (``duplicate_fraction``).
    """

    index: int
    kind: str
    late: bool
    lateness_ms: int
    event_time: int
    event_type: str
    ad_id: str
    campaign_id: str
    user_id: str
    event_id: str | None = None
    duplicate: bool = False

    @property
    def valid(self) -> bool:
        """True for records a job must accept."""
        return self.kind == "valid"


class Event(NamedTuple):
    """A record to produce: ``key`` (None for ``null_key``), ``value`` bytes and its :class:`EventMeta`."""

    key: bytes | None
    value: bytes
    meta: EventMeta


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def events(
    n: int,
    *,
    seed: int = 0,
    start_ms: int = 1_700_000_000_000,
    rate_per_s: float = 1000.0,
    late_fraction: float = 0.0,
    max_lateness_ms: int = 5_000,
    malformed_fraction: float = 0.0,
    duplicate_fraction: float = 0.0,
    max_duplicate_distance: int = 50,
    universe: Universe | None = None,
    live: bool = False,
    clock_ms: Callable[[], int] | None = None,
) -> Iterator[Event]:
    """Yield ``n`` YSB ad events (lazily).

    Args:
        n: Number of records.
        seed: Seed of the event stream (entities come from ``universe``, default ``universe(seed=seed)``).
        start_ms: Synthetic clock start (epoch millis).
        rate_per_s: Synthetic clock rate: record ``i`` has time ``start_ms + i * 1000 / rate_per_s``.
        late_fraction: Probability that a record's ``event_time`` is shifted back by 1..``max_lateness_ms``.
        max_lateness_ms: Maximum shift of late records.
        malformed_fraction: Probability that a record is malformed (kind chosen uniformly).
        duplicate_fraction: Probability that a valid record is sent a second time, byte for byte, after
            1..``max_duplicate_distance`` further records (a producer retry without idempotence). The copies come
            on top of the ``n`` records.
        max_duplicate_distance: How many records later a copy is sent at most.
        universe: Entities to draw from.
        live: Use the wall clock (at generation time) instead of the synthetic clock -- for demos with
            :func:`produce` ``rate=...``; not reproducible.
        clock_ms: Custom clock for ``live`` (default: ``time.time() * 1000``).

    Yields:
        :class:`Event` tuples ``(key, value, meta)``.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    for name, frac in (("late_fraction", late_fraction), ("malformed_fraction", malformed_fraction),
                       ("duplicate_fraction", duplicate_fraction)):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"{name} must be within [0, 1], got {frac}")
    if late_fraction > 0 and max_lateness_ms < 1:
        raise ValueError("max_lateness_ms must be >= 1 when late_fraction > 0")
    if duplicate_fraction > 0 and max_duplicate_distance < 1:
        raise ValueError("max_duplicate_distance must be >= 1 when duplicate_fraction > 0")
    u = universe if universe is not None else _default_universe(seed)
    rng = random.Random(f"kappa-events-{seed}")
    now = clock_ms or (lambda: int(time.time() * 1000))
    step = 1000.0 / rate_per_s
    # ids and duplicates have their own generators: the rest of the stream does not depend on them
    ids = random.Random(f"kappa-event-ids-{seed}")
    dups = random.Random(f"kappa-duplicates-{seed}")
    resend: list[tuple[int, int, Event]] = []  # heap of (send after record i, tie-break, copy)

    for i in range(n):
        # draw everything in a fixed order so the stream only depends on (seed, arguments)
        user = rng.choice(u.users)
        page = rng.choice(u.pages)
        ad = rng.choice(u.ads)
        ad_type = rng.choice(AD_TYPES)
        event_type = rng.choice(EVENT_TYPES)
        ip = f"{rng.randint(1, 223)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        late = rng.random() < late_fraction
        lateness = rng.randint(1, max_lateness_ms) if late else 0
        malformed = rng.random() < malformed_fraction
        kind: str = rng.choice(MALFORMED_KINDS) if malformed else "valid"

        base = now() if live else start_ms + int(i * step)
        event_time = base - lateness
        record: dict[str, Any] = {
            "user_id": user,
            "page_id": page,
            "ad_id": ad,
            "ad_type": ad_type,
            "event_type": event_type,
            "event_time": event_time,
            "ip": ip,
            "event_id": str(uuid.uuid4()) if live else _uuid(ids),
        }
        key: bytes | None = user.encode()
        value: bytes
        if kind == "valid":
            value = _dumps(record)
        elif kind == "invalid_json":
            text = _dumps(record)
            value = text[: rng.randint(1, len(text) - 2)]  # truncated document: never valid JSON
        elif kind == "wrong_type":
            if rng.random() < 0.5:
                record["event_time"] = str(event_time)
            else:
                record["ad_id"] = rng.getrandbits(63)
            value = _dumps(record)
        elif kind == "missing_field":
            del record[rng.choice(_REQUIRED)]
            value = _dumps(record)
        elif kind == "oversized":
            record["page_id"] = "x" * _OVERSIZED_BYTES
            value = _dumps(record)
        elif kind == "null_key":
            key = None
            value = _dumps(record)
        else:  # unknown_event_type
            record["event_type"] = event_type = rng.choice(("hover", "share", "VIEW", ""))
            value = _dumps(record)

        event = Event(
            key,
            value,
            EventMeta(
                index=i, kind=kind, late=late, lateness_ms=lateness, event_time=event_time,
                event_type=event_type, ad_id=ad, campaign_id=u.ad_to_campaign[ad], user_id=user,
                event_id=record.get("event_id"),
            ),
        )
        yield event
        if kind == "valid" and duplicate_fraction > 0 and dups.random() < duplicate_fraction:
            copy = event._replace(meta=dataclasses.replace(event.meta, duplicate=True))
            heapq.heappush(resend, (i + dups.randint(1, max_duplicate_distance), i, copy))
        while resend and (resend[0][0] <= i or i == n - 1):
            yield heapq.heappop(resend)[2]


def _default_universe(seed: int) -> Universe:
    return universe(seed=seed)


def campaign_records(u: Universe) -> dict[str, str]:
    """The ``campaigns`` topic content for a universe: ad id -> campaign id."""
    return dict(u.ad_to_campaign)


# ------------------------------------------------------------------------------------ produce
@dataclass(slots=True)
class ProduceResult:
    """Outcome of :func:`produce`.

    Attributes:
        sent: Records handed to the producer.
        delivered: Records acknowledged by the broker (acks=all).
        failed: Records that failed permanently.
        errors: Kafka error name -> count.
        kinds: ``EventMeta.kind`` -> count of *delivered* records (``"campaign"``/``"tombstone"`` for
            campaign records, ``"raw"`` for plain tuples).
        late: Delivered records flagged late.
        elapsed_s: Wall time from first send to the end of flush.
    """

    sent: int = 0
    delivered: int = 0
    failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    late: int = 0
    elapsed_s: float = 0.0

    @property
    def rate_per_s(self) -> float:
        """Delivered records per second."""
        return self.delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {
            "sent": self.sent, "delivered": self.delivered, "failed": self.failed,
            "errors": dict(self.errors), "kinds": dict(self.kinds), "late": self.late,
            "elapsed_s": round(self.elapsed_s, 3), "rate_per_s": round(self.rate_per_s, 1),
        }


#: Producer defaults: idempotent, acks=all, batched; override with ``producer_config``.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 20,
    "batch.size": 1_000_000,
    "batch.num.messages": 10_000,
    "compression.type": "lz4",
    "queue.buffering.max.messages": 200_000,
    "queue.buffering.max.kbytes": 262_144,
    "message.max.bytes": 1_000_000,
    "delivery.timeout.ms": 120_000,
    "client.id": "kappa-generator",
}


def make_producer(settings: Settings, producer_config: Mapping[str, Any] | None = None) -> Any:
    """An idempotent, acks=all confluent-kafka producer for ``settings``' cluster (:data:`PRODUCER_DEFAULTS`, then
    ``producer_config``); librdkafka's log lines go to the logging module."""
    from confluent_kafka import Producer  # local import: keep module import light

    return Producer(settings.kafka_client_config({**PRODUCER_DEFAULTS, "logger": log, **(producer_config or {})}))


def produce(
    settings: Settings,
    topic: str,
    records: Iterable[Event | tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, Any]],
    *,
    rate: float | None = None,
    producer_config: Mapping[str, Any] | None = None,
    flush_timeout: float = 120.0,
    producer: Any = None,
) -> ProduceResult:
    """Produce records to ``topic`` with an idempotent, acks=all producer and wait for every ack.

    Args:
        settings: Cluster (security settings included).
        topic: Target topic (must exist: auto-creation is off).
        records: :class:`Event` tuples from :func:`events`, or ``(key, value[, meta])`` tuples.
        rate: Max records per second (smooth pacing), None = as fast as possible.
        producer_config: librdkafka overrides on top of :data:`PRODUCER_DEFAULTS`.
        flush_timeout: Seconds to wait for outstanding acks at the end.
        producer: A producer of :func:`make_producer` to use (a long-lived one: no connection per call); by default
            one is made for this call (``producer_config`` applies to it only).

    Returns:
        Counts of sent/delivered/failed records, per kind.

    Raises:
        RuntimeError: If records are still undelivered after ``flush_timeout``.
    """
    from confluent_kafka import KafkaError  # local import: keep module import light

    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    # librdkafka's own log lines (e.g. "Coordinator load in progress: retrying" right after a broker
    # start) go to the logging module instead of stderr
    producer = producer if producer is not None else make_producer(settings, producer_config)
    result = ProduceResult()

    def on_delivery(kind: str, late: bool) -> Callable[[KafkaError | None, Any], None]:
        def callback(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                result.delivered += 1
                result.kinds[kind] += 1
                result.late += late
            else:
                result.failed += 1
                result.errors[err.name()] += 1

        return callback

    started = time.monotonic()
    for rec in records:
        key, value = rec[0], rec[1]
        meta = rec[2] if len(rec) > 2 else None
        kind = getattr(meta, "kind", None) or (meta if isinstance(meta, str) else "raw")
        late = bool(getattr(meta, "late", False))
        if rate is not None:
            due = started + result.sent / rate
            delay = due - time.monotonic()
            if delay > 0:
                producer.poll(0)
                time.sleep(delay)
        while True:
            try:
                producer.produce(topic, value=value, key=key, on_delivery=on_delivery(kind, late))
                break
            except BufferError:  # local queue full: serve callbacks and retry
                producer.poll(0.05)
        result.sent += 1
        if result.sent % 1000 == 0:
            producer.poll(0)
    remaining = producer.flush(flush_timeout)
    result.elapsed_s = time.monotonic() - started
    if remaining:
        raise RuntimeError(f"{remaining} record(s) to {topic!r} not acknowledged after {flush_timeout:.0f}s")
    if result.failed:
        log.warning("produce to %s: %d record(s) failed: %s", topic, result.failed, dict(result.errors))
    return result


def publish_campaigns(
    settings: Settings, mapping: Mapping[str, str | None], *, topic: str = "campaigns"
) -> ProduceResult:
    """Publish ad -> campaign mappings to the compacted ``campaigns`` topic.

    Args:
        settings: Cluster.
        mapping: Ad id -> campaign id; a None campaign publishes a tombstone (deletes the ad's mapping).
        topic: Target topic.
    """
    recs = [
        (ad.encode(), None if c is None else _dumps({"campaign_id": c}), "tombstone" if c is None else "campaign")
        for ad, c in mapping.items()
    ]
    return produce(settings, topic, recs)


def delete_campaigns(settings: Settings, ad_ids: Iterable[str], *, topic: str = "campaigns") -> ProduceResult:
    """Publish tombstones (null values) for ``ad_ids`` on the ``campaigns`` topic."""
    return publish_campaigns(settings, {ad: None for ad in ad_ids}, topic=topic)


def produce_cmd(
    *,
    n: int = 100_000,
    topic: str = "ad-events",
    campaigns_topic: str = "campaigns",
    seed: int = 0,
    campaigns: int = 100,
    rate: float | None = None,
    rate_per_s: float = 1000.0,
    start_ms: int = 1_700_000_000_000,
    late_fraction: float = 0.0,
    max_lateness_ms: int = 5_000,
    malformed_fraction: float = 0.0,
    duplicate_fraction: float = 0.0,
    publish_mapping: bool = True,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Everything ``kappa produce`` does: publish the campaign mapping, then ``n`` events.

    With ``rate`` the events are paced to ``rate``/s and stamped with the wall clock (live demo);
    without it they use the synthetic clock (``start_ms``, ``rate_per_s``) and are reproducible.

    Returns:
        ``{"campaigns": {...}, "events": {...}}`` summaries (see :meth:`ProduceResult.as_dict`).
    """
    s = settings or Settings.from_env()
    u = universe(seed=seed, campaigns=campaigns)
    out: dict[str, Any] = {}
    if publish_mapping:
        out["campaigns"] = publish_campaigns(s, campaign_records(u), topic=campaigns_topic).as_dict()
    stream = events(
        n, seed=seed, start_ms=start_ms, rate_per_s=rate or rate_per_s, late_fraction=late_fraction,
        max_lateness_ms=max_lateness_ms, malformed_fraction=malformed_fraction, duplicate_fraction=duplicate_fraction,
        universe=u, live=rate is not None,
    )
    out["events"] = produce(s, topic, stream, rate=rate).as_dict()
    return out

"""Retention leases: while a replay reads a topic, the topic's retention does not delete what it has not read yet.

A replay's preflight refuses a start that retention no longer covers; the lease covers the time after it. When a
replay launches, it takes a lease on the topic it reads (:func:`take`): a row in the registry's lease log
(``<lake>/_registry/leases``, an append-only Delta table) and, on the topic, the lease's configs
(:data:`LEASE_CONFIGS`: ``retention.ms`` and ``retention.bytes`` unlimited), so Kafka deletes nothing of it
while the lease holds. Topic convergence honours every active lease: :func:`converge_topics` - what ``make run``,
``kappa topics ensure``, a replay's launch and the scheduled ``kappa_retire`` DAG call - applies the declared
configs with the leases' on top, so it never shortens retention under an active lease, and puts the declared
values back once no lease holds the topic.

A lease ends

- when its replay caught up (:func:`release`, called by the step that records ``caught_up``), or its version
  left ``building`` any other way (failed, retired...), or its job was stopped by hand (``view stop``);
- when it **expires**: its run showed no life for ``KAPPA_LEASE_TTL_SECONDS`` (no micro-batch committed, and no
  ``run.json`` written, for that long - the replay's driver crashed or was stopped and nothing restarted it).

Either way the next convergence restores the declared retention. A lease is for the stream topic the version
reads; its lookup topics are compacted (their latest value per key stays).

Why unlimited rather than "long enough": the time a replay needs is not known when it starts (it may be slowed,
paused, restarted), and a retention computed from it would have to be renewed by someone while the replay runs;
unlimited holds until the lease ends, whoever is (or is not) watching. The cost is disk: the topic keeps what it
received during the replay, deleted by the restored retention afterwards.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kappa.control.registry import Registry, _ensure_table, _retrying, utcnow
from kappa.runtime.deltars import I64, STR, TS, arrow_rows, read_rows

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.log.topics import TopicChange

__all__ = ["LEASE_CONFIGS", "Lease", "active_leases", "converge_topics", "leases", "release", "take"]

log = logging.getLogger("kappa.control.leases")

#: Topic configs a lease sets for its duration.
LEASE_CONFIGS = {"retention.ms": "-1", "retention.bytes": "-1"}

_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("topic", STR), ("view", STR), ("version", I64), ("event", STR), ("at", TS), ("by", STR), ("note", STR),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """A lease as its log says (the latest event of its view version on its topic).

    Attributes:
        topic: Physical topic it holds.
        view: View name.
        version: View version whose replay holds it.
        taken_at: When it was taken.
        by: Who took it.
        released_at: When it ended (None while it holds).
        note: Why it ended.
    """

    topic: str
    view: str
    version: int
    taken_at: datetime
    by: str
    released_at: datetime | None = None
    note: str | None = None

    @property
    def ref(self) -> str:
        return f"{self.view}@v{self.version} on {self.topic}"


def _uri(settings: Settings) -> str:
    return f"{settings.lake_uri.rstrip('/')}/_registry/leases"


def _append(settings: Settings, rows: list[dict[str, Any]]) -> None:
    from deltalake import write_deltalake

    uri = _uri(settings)
    _ensure_table(uri, _COLUMNS, None)
    data = arrow_rows(_COLUMNS, rows)
    _retrying(lambda: write_deltalake(uri, data, mode="append"), f"lease log {uri}")


def leases(settings: Settings) -> list[Lease]:
    """Every lease ever taken (its latest state), oldest first."""
    from deltalake import DeltaTable

    uri = _uri(settings)
    if not DeltaTable.is_deltatable(uri):
        return []
    out: dict[tuple[str, str, int], Lease] = {}
    for row in sorted(read_rows(DeltaTable(uri)), key=lambda r: r["at"]):
        key = (row["topic"], row["view"], int(row["version"]))
        if row["event"] == "taken":
            out[key] = Lease(topic=key[0], view=key[1], version=key[2], taken_at=row["at"], by=row["by"])
        elif key in out and out[key].released_at is None:
            held = out[key]
            out[key] = Lease(topic=held.topic, view=held.view, version=held.version, taken_at=held.taken_at,
                             by=held.by, released_at=row["at"], note=row["note"])
    return sorted(out.values(), key=lambda lease: lease.taken_at)


def take(settings: Settings, topic: str, view: str, version: int, *, by: str) -> Lease:
    """Take (or keep) the lease of a view version's replay on ``topic`` and apply it to the topic at once."""
    held = next((lease for lease in leases(settings) if (lease.topic, lease.view, lease.version) == (
        topic, view, version) and lease.released_at is None), None)
    if held is None:
        _append(settings, [{"topic": topic, "view": view, "version": version, "event": "taken", "at": utcnow(),
                            "by": by, "note": None}])
        log.info("%s@v%s: retention lease taken on %s", view, version, topic)
    converge_topics(settings)
    return next(lease for lease in leases(settings) if (lease.topic, lease.view, lease.version) == (
        topic, view, version) and lease.released_at is None)


def release(settings: Settings, view: str, version: int, *, by: str, note: str, converge: bool = True) -> list[Lease]:
    """End the view version's active leases (idempotent) and restore the topics' retention where no other lease
    holds them. Returns the leases it ended."""
    ended = [lease for lease in leases(settings)
             if (lease.view, lease.version) == (view, version) and lease.released_at is None]
    if ended:
        now = utcnow()
        _append(settings, [{"topic": lease.topic, "view": view, "version": version, "event": "released", "at": now,
                            "by": by, "note": note} for lease in ended])
        for lease in ended:
            log.info("%s: retention lease released (%s)", lease.ref, note)
    if ended and converge:
        converge_topics(settings)
    return ended


def _expiry(settings: Settings, lease: Lease, registry: Registry) -> str | None:
    """Why an unreleased lease no longer holds (None while it does)."""
    from kappa.identity import ViewPaths
    from kappa.runtime.checkpoint import last_progress

    rec = registry.get(lease.view, lease.version)
    if rec is not None and rec.state != "building":
        return f"its version is {rec.state}"
    alive = last_progress(ViewPaths(settings.lake_uri, lease.view, lease.version).checkpoint)
    last = max(alive or 0.0, lease.taken_at.timestamp())
    idle = time.time() - last
    if idle > settings.lease_ttl_seconds:
        return (f"expired: its run committed nothing for {idle:.0f} s (KAPPA_LEASE_TTL_SECONDS "
                f"{settings.lease_ttl_seconds:.0f})")
    return None


def active_leases(settings: Settings, *, end_expired: bool = True) -> list[Lease]:
    """The leases that hold now; the ones that ended by themselves (expired, version no longer building) are
    released on the way (``end_expired``)."""
    registry = Registry(settings.lake_uri)
    holding = []
    for lease in leases(settings):
        if lease.released_at is not None:
            continue
        why = _expiry(settings, lease, registry)
        if why is None:
            holding.append(lease)
        elif end_expired:
            release(settings, lease.view, lease.version, by="kappa.control.leases", note=why, converge=False)
    return holding


def converge_topics(settings: Settings) -> list[TopicChange]:
    """Converge the declared topics (:func:`kappa.log.topics.ensure_topics`) with every active lease's configs on
    top of the declared ones: never shortens retention under a lease, restores it once none holds."""
    from kappa.log.topics import declared_topics, ensure_topics

    specs = declared_topics(settings)
    declared = {spec.name: spec.config for spec in specs}
    active = {lease.topic for lease in active_leases(settings)}
    held: dict[str, dict[str, str | None]] = {}
    for topic in {lease.topic for lease in leases(settings)}:
        if topic in active:
            held[topic] = dict(LEASE_CONFIGS)
        elif topic in declared:  # ended: the declared values come back; an undeclared lease key is removed
            held[topic] = {k: None for k in LEASE_CONFIGS if k not in declared[topic]}
    return ensure_topics(settings, specs, held=held)

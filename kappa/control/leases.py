"""Retention leases: while a replay reads a topic, the topic's retention does not delete what it has not read yet.

A replay's preflight refuses a start that retention no longer covers; the lease covers the time after it. When a
replay launches, it takes a lease on the topic it reads (:func:`take`): a row in the registry's lease table
(``<lake>/_registry/lease_holds``, one row per view version and topic) and, on the topic, the lease's configs
(:data:`LEASE_CONFIGS`: ``retention.ms`` and ``retention.bytes`` unlimited), so Kafka deletes nothing of it
while the lease holds. Topic convergence honours every active lease: :func:`converge_topics` - what ``make run``,
``kappa topics ensure``, a replay's launch and the scheduled ``kappa_retire`` DAG call - applies the declared
configs with the leases' on top, so it never shortens retention under an active lease, and puts the declared
values back once no lease holds the topic.

A lease ends

- when its replay caught up (:func:`release`, called by the step that records ``caught_up``), or its version
  left ``building`` any other way (failed, retired...), or its job was stopped by hand (``view stop``);
- when it **expires**: its run showed no life for ``KAPPA_LEASE_TTL_SECONDS`` (no micro-batch committed, no
  ``run.json`` written and no take renewed it, for that long - the replay's driver crashed or was stopped and
  nothing restarted it).

Either way the next convergence restores the declared retention. A lease is for the stream topic the version
reads; its lookup topics are compacted (their latest value per key stays).

**Concurrency.** Every change of a lease is a compare-and-set on its row (the registry's own
:func:`kappa.control.registry.commit_row`: a delta-rs ``MERGE`` that only fires while the row's ``revision`` is the
one read), so a decision is never applied to a state that changed under it. A take of a lease that holds renews it
(``renewed_at``, revision + 1): a relaunch racing the ``kappa_retire`` DAG that ends the same lease as expired
either renews it first - the expiry then re-reads, sees a fresh lease and ends nothing - or finds it ended and
takes it again. A convergence that read the leases before a concurrent take applies them, then reads them again
and converges once more if they changed meanwhile. Every take and end is also appended to the lease history
(``<lake>/_registry/leases``, append-only); a lake whose leases were only written there by an earlier release is
read from it once, when the lease table is created.

Why unlimited rather than "long enough": the time a replay needs is not known when it starts (it may be slowed,
paused, restarted), and a retention computed from it would have to be renewed by someone while the replay runs;
unlimited holds until the lease ends, whoever is (or is not) watching. The cost is disk: the topic keeps what it
received during the replay, deleted by the restored retention afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kappa.control.registry import Registry, _ensure_table, _retrying, commit_row, utcnow
from kappa.identity import registry_table
from kappa.runtime.deltars import I64, STR, TS, arrow_rows, read_rows

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.log.topics import TopicChange

__all__ = ["LEASE_CONFIGS", "Lease", "active_leases", "converge_topics", "leases", "release", "take"]

log = logging.getLogger("kappa.control.leases")

#: Topic configs a lease sets for its duration.
LEASE_CONFIGS = {"retention.ms": "-1", "retention.bytes": "-1"}

#: The lease history (append-only): one row per take and end.
_HISTORY: tuple[tuple[str, Any], ...] = (
    ("topic", STR), ("view", STR), ("version", I64), ("event", STR), ("at", TS), ("by", STR), ("note", STR),
)
#: The leases (one row per view version and topic), changed by compare-and-set on ``revision``.
_HOLDS: tuple[tuple[str, Any], ...] = (
    ("topic", STR), ("view", STR), ("version", I64), ("taken_at", TS), ("renewed_at", TS), ("by", STR),
    ("released_at", TS), ("note", STR), ("revision", I64),
)
_KEY_MATCH = 't."topic" = s."topic" AND t."view" = s."view" AND t."version" = s."version"'


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """A lease as its row says.

    Attributes:
        topic: Physical topic it holds.
        view: View name.
        version: View version whose replay holds it.
        taken_at: When it was taken (last taken again after it ended).
        by: Who took it.
        released_at: When it ended (None while it holds).
        note: Why it ended.
        renewed_at: When a take last confirmed it (its run's life counts from here at the latest).
        revision: The row's revision (compare-and-set).
    """

    topic: str
    view: str
    version: int
    taken_at: datetime
    by: str
    released_at: datetime | None = None
    note: str | None = None
    renewed_at: datetime | None = None
    revision: int = 0

    @property
    def ref(self) -> str:
        return f"{self.view}@v{self.version} on {self.topic}"

    @property
    def key(self) -> tuple[str, str, int]:
        return self.topic, self.view, self.version


def _uri(settings: Settings, table: str) -> str:
    return registry_table(settings.lake_uri, table)


def _history(settings: Settings, lease: Lease, event: str, at: datetime, by: str, note: str | None) -> None:
    from deltalake import write_deltalake

    uri = _uri(settings, "leases")
    _ensure_table(uri, _HISTORY, None)
    data = arrow_rows(_HISTORY, [{"topic": lease.topic, "view": lease.view, "version": lease.version,
                                  "event": event, "at": at, "by": by, "note": note}])
    _retrying(lambda: write_deltalake(uri, data, mode="append"), f"lease history {uri}")


def _from_history(settings: Settings) -> list[dict[str, Any]]:
    """The leases of a lake an earlier release wrote only to the history (its latest event per lease)."""
    from deltalake import DeltaTable

    uri = _uri(settings, "leases")
    if not DeltaTable.is_deltatable(uri):
        return []
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in sorted(read_rows(DeltaTable(uri)), key=lambda r: r["at"]):
        key = (row["topic"], row["view"], int(row["version"]))
        if row["event"] == "taken":
            out[key] = {"topic": key[0], "view": key[1], "version": key[2], "taken_at": row["at"],
                        "renewed_at": row["at"], "by": row["by"], "released_at": None, "note": None, "revision": 1}
        elif key in out and out[key]["released_at"] is None:
            out[key].update(released_at=row["at"], note=row["note"])
    return list(out.values())


def _holds_table(settings: Settings) -> str:
    """The lease table's URI, created (from the history of an earlier release, if any) when missing."""
    from deltalake import DeltaTable, write_deltalake
    from deltalake.exceptions import CommitFailedError, DeltaError

    uri = _uri(settings, "lease_holds")
    if DeltaTable.is_deltatable(uri):
        return uri
    seed = _from_history(settings)
    if not seed:
        _ensure_table(uri, _HOLDS, None)
        return uri
    try:  # one commit, no retry at a later version: of concurrent creators one wins, the others use its table
        write_deltalake(uri, arrow_rows(_HOLDS, seed), mode="error")
    except (CommitFailedError, DeltaError):
        if not DeltaTable.is_deltatable(uri):
            raise
    return uri


def leases(settings: Settings) -> list[Lease]:
    """Every lease ever taken (its latest state), oldest first."""
    from deltalake import DeltaTable

    uri = _uri(settings, "lease_holds")
    if not DeltaTable.is_deltatable(uri):
        if not DeltaTable.is_deltatable(_uri(settings, "leases")):
            return []
        uri = _holds_table(settings)
    rows = [Lease(**{**row, "version": int(row["version"])}) for row in read_rows(DeltaTable(uri))]
    return sorted(rows, key=lambda lease: (lease.taken_at, lease.key))


def _lease(settings: Settings, key: tuple[str, str, int]) -> Lease | None:
    return next((lease for lease in leases(settings) if lease.key == key), None)


def _commit(settings: Settings, new: Lease, expected_revision: int | None) -> None:
    row = {field.name: getattr(new, field.name) for field in dataclasses.fields(Lease)}
    commit_row(_holds_table(settings), _HOLDS, row, key_match=_KEY_MATCH, expected_revision=expected_revision)


def take(settings: Settings, topic: str, view: str, version: int, *, by: str) -> Lease:
    """Take the lease of a view version's replay on ``topic`` (or renew it, if it holds) and apply it to the topic
    at once. Returns the lease as committed: it holds."""
    key = (topic, view, version)

    def attempt() -> tuple[Lease, bool]:
        current = _lease(settings, key)
        now = utcnow()
        if current is not None and current.released_at is None:  # holds: renew, so that no expiry ends it now
            renewed = dataclasses.replace(current, renewed_at=now, revision=current.revision + 1)
            _commit(settings, renewed, current.revision)
            return renewed, False
        new = Lease(topic=topic, view=view, version=version, taken_at=now, renewed_at=now, by=by,
                    revision=1 if current is None else current.revision + 1)
        _commit(settings, new, None if current is None else current.revision)
        return new, True

    lease, taken = _retrying(attempt, f"take the retention lease of {view}@v{version} on {topic}")
    if taken:
        _history(settings, lease, "taken", lease.taken_at, by, None)
        log.info("%s: retention lease taken", lease.ref)
    converge_topics(settings)
    return lease


def _end(settings: Settings, lease: Lease, *, by: str, why: Callable[[Lease], str | None]) -> Lease | None:
    """End ``lease`` if it still holds and ``why`` (asked again on every fresh read) gives a reason; the ended
    lease, or None when it had ended already or ``why`` no longer gives one."""

    def attempt() -> Lease | None:
        current = _lease(settings, lease.key)
        if current is None or current.released_at is not None:
            return None
        note = why(current)
        if note is None:
            return None
        ended = dataclasses.replace(current, released_at=utcnow(), note=note, revision=current.revision + 1)
        _commit(settings, ended, current.revision)
        return ended

    ended = _retrying(attempt, f"end the retention lease of {lease.ref}")
    if ended is not None:
        _history(settings, ended, "released", ended.released_at, by, ended.note)
        log.info("%s: retention lease released (%s)", ended.ref, ended.note)
    return ended


def release(settings: Settings, view: str, version: int, *, by: str, note: str, converge: bool = True) -> list[Lease]:
    """End the view version's active leases (idempotent) and restore the topics' retention where no other lease
    holds them. Returns the leases it ended."""
    held = [lease for lease in leases(settings)
            if (lease.view, lease.version) == (view, version) and lease.released_at is None]
    ended = [e for e in (_end(settings, lease, by=by, why=lambda _current: note) for lease in held) if e is not None]
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
    last = max(alive or 0.0, (lease.renewed_at or lease.taken_at).timestamp())
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
        if _expiry(settings, lease, registry) is None:
            holding.append(lease)
        elif end_expired and _end(settings, lease, by="kappa.control.leases",
                                  why=lambda current: _expiry(settings, current, registry)) is None:
            # decided again on the row it would end: a take renewed it meanwhile (it holds) or it ended already
            current = _lease(settings, lease.key)
            if current is not None and current.released_at is None:
                holding.append(current)
    return holding


def converge_topics(settings: Settings) -> list[TopicChange]:
    """Converge the declared topics (:func:`kappa.log.topics.ensure_topics`) with every active lease's configs on
    top of the declared ones: never shortens retention under a lease, restores it once none holds."""
    from kappa.log.topics import declared_topics, ensure_topics

    specs = declared_topics(settings)
    declared = {spec.name: spec.config for spec in specs}
    changes: list[TopicChange] = []
    active = {lease.topic for lease in active_leases(settings)}
    for _ in range(5):
        held: dict[str, dict[str, str | None]] = {}
        for topic in {lease.topic for lease in leases(settings)}:
            if topic in active:
                held[topic] = dict(LEASE_CONFIGS)
            elif topic in declared:  # ended: the declared values come back; an undeclared lease key is removed
                held[topic] = {k: None for k in LEASE_CONFIGS if k not in declared[topic]}
        changes.extend(ensure_topics(settings, specs, held=held))
        # a lease taken (or ended) while this ran: its own convergence may have come first - apply it again
        now = {lease.topic for lease in active_leases(settings)}
        if now == active:
            break
        active = now
    return changes

"""The serving alias: per view, a pointer to exactly one version's table, switched atomically.

The pointer is a Delta table ``<lake>/_registry/serving`` with one row per view
(``view, version, table_path, switched_at, switched_by, previous_version``). A switch is **one** delta-rs
``MERGE`` commit on that row, so every reader (``kappa query``, the Spark view created from
:func:`spark_view_sql`, dashboards) sees either the old pointer or the new one, never something in between.
The table a pointer names is complete on its own (a Delta snapshot), and the previous version's table is kept
until its ``delete_after`` passes, so a reader that resolved the old pointer an instant before the switch can
still finish reading it.

``promote`` writes in this order, so re-running it repairs any crash in the middle:

1. switch the alias (the only step readers see);
2. mark the new version ``serving`` in the registry (clearing ``delete_after``);
3. mark every other ``serving`` version of the view ``retired`` with ``delete_after = now + keep``.

A retired version's table is kept :data:`kappa.config.DEFAULT_KEEP_HOURS` unless the promote says otherwise; ``delete_expired``
(run by the scheduled ``kappa_retire`` DAG and ``kappa retire``) removes it afterwards.

Example:
    >>> alias = ServingAlias(settings.lake_uri)  # doctest: +SKIP
    >>> alias.promote("user_sessions", 2, by="cli:alice")  # doctest: +SKIP
    SwitchResult(view='user_sessions', version=2, previous_version=1, changed=True, ...)
    >>> alias.resolve("user_sessions")  # doctest: +SKIP
    '/.../lake/views/user_sessions/v2/table'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from kappa.config import DEFAULT_KEEP_HOURS
from kappa.runtime.checkpoint import delete_tree, tree_exists
from kappa.runtime.deltars import I64, STR, TS, arrow_rows, is_local_uri, local_path, read_rows
from kappa.identity import ViewPaths, in_lake, view_ref
from kappa.control.registry import (
    AsOfError,
    Registry,
    RegistryError,
    StateConflict,
    TableMissing,
    VersionRecord,
    _ensure_table,
    _Lost,
    _q,
    _retrying,
    open_delta,
    utcnow,
)

__all__ = ["AliasRow", "DeletionResult", "ServingAlias", "ServingError", "SwitchResult", "Target"]

_ALIAS_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("view", STR), ("version", I64), ("table_path", STR), ("switched_at", TS), ("switched_by", STR),
    ("previous_version", I64),
)


class ServingError(RegistryError):
    """A promote / rollback / resolve request was refused (one-line message)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AliasRow:
    """One row of ``<lake>/_registry/serving``.

    Attributes:
        view: View name.
        version: Version the alias points to.
        table_path: Delta table of that version.
        switched_at: Time of the switch (UTC).
        switched_by: Who switched.
        previous_version: Version served before the switch (None for the first switch).
    """

    view: str
    version: int
    table_path: str
    switched_at: datetime
    switched_by: str
    previous_version: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What a view name resolves to.

    Attributes:
        view: View name.
        version: Version served.
        table_path: Its Delta table.
        via: ``"alias"`` (the serving table has a row) or ``"default"`` (catalog ``default_version``).
    """

    view: str
    version: int
    table_path: str
    via: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SwitchResult:
    """Outcome of :meth:`ServingAlias.promote` / :meth:`ServingAlias.rollback`.

    Attributes:
        view: View name.
        version: Version now serving.
        previous_version: Version that served before (None if none).
        table_path: Table the alias points to.
        changed: False when the alias already pointed to ``version`` (no-op or registry repair only).
        message: One human line describing what happened.
    """

    view: str
    version: int
    previous_version: int | None
    table_path: str
    changed: bool
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DeletionResult:
    """Outcome of deleting one expired version table.

    Attributes:
        view: View name.
        version: Version.
        table_path: Its table.
        deleted: True if the directory was removed (and the registry marked ``deleted_at``).
        message: One human line.
    """

    view: str
    version: int
    table_path: str
    deleted: bool
    message: str


class ServingAlias:
    """Serving pointers of all views, stored next to the registry.

    Args:
        lake_uri: Lake root (``Settings.lake_uri``).
        registry: Registry to keep in step (default: the one of ``lake_uri``).
        catalog: View declarations (default: :func:`kappa.catalog.load_catalog`), for default versions.
        storage_options: delta-rs object-store options for non-local lakes.
        keep: Default retention of a replaced version's table.
    """

    def __init__(self, lake_uri: str, *, registry: Registry | None = None, catalog: Any = None,
                 storage_options: dict[str, str] | None = None,
                 keep: timedelta = timedelta(hours=DEFAULT_KEEP_HOURS)) -> None:
        self.registry = registry or Registry(lake_uri, storage_options=storage_options)
        self.lake_uri = self.registry.lake_uri
        self.storage_options = storage_options
        self.keep = keep
        self._catalog = catalog

    @classmethod
    def from_settings(cls, settings: Any = None) -> ServingAlias:
        """Alias store of ``settings.lake_uri`` (default: ``Settings.from_env()``)."""
        if settings is None:
            from kappa.config import Settings

            settings = Settings.from_env()
        return cls(settings.lake_uri)

    @property
    def uri(self) -> str:
        """``<lake>/_registry/serving``."""
        return f"{self.lake_uri}/_registry/serving"

    @property
    def catalog(self) -> Any:
        """The view declarations (loaded on first use)."""
        if self._catalog is None:
            from kappa.catalog import load_catalog

            self._catalog = load_catalog()
        return self._catalog

    # ---------------------------------------------------------------------------------- reads
    def aliases(self, *, as_of: datetime | None = None) -> dict[str, AliasRow]:
        """All alias rows (view -> row), optionally as they were at ``as_of``."""
        try:
            table = open_delta(self.uri, as_of=as_of, storage_options=self.storage_options)
        except (TableMissing, AsOfError):
            return {}  # no switch had happened (yet / at that time): every view uses its default version
        return {row["view"]: AliasRow(**{**row, "table_path": in_lake(row["table_path"], self.lake_uri, row["view"],
                                                                      row["version"])})
                for row in read_rows(table)}

    def alias(self, view: str, *, as_of: datetime | None = None) -> AliasRow | None:
        """The alias row of one view (None if it was never switched)."""
        return self.aliases(as_of=as_of).get(view)

    def target(self, view: str, *, as_of: datetime | None = None) -> Target:
        """Version and table a view name resolves to (alias row, else the catalog's default version).

        Raises:
            ServingError: If the view is not declared in ``platform.yaml``.
        """
        return self.targets([view], as_of=as_of)[view]

    def targets(self, views: Iterable[str] | None = None, *, as_of: datetime | None = None) -> dict[str, Target]:
        """:meth:`target` of each of ``views`` (default: every declared view) from one read of the alias table.

        Raises:
            ServingError: If a view is not declared in ``platform.yaml``.
        """
        from kappa.catalog import UnknownView

        names = list(self.catalog.views if views is None else views)
        specs = {}
        for view in names:
            try:
                specs[view] = self.catalog.view(view)
            except UnknownView as exc:
                raise ServingError(str(exc)) from None
        rows = self.aliases(as_of=as_of)
        found: dict[str, Target] = {}
        for view, spec in specs.items():
            row = rows.get(view)
            if row is not None:
                found[view] = Target(view=view, version=row.version, table_path=row.table_path, via="alias")
            else:
                default = spec.default_version
                found[view] = Target(view=view, version=default,
                                     table_path=ViewPaths(self.lake_uri, view, default).table, via="default")
        return found

    def resolve(self, view: str, *, as_of: datetime | None = None) -> str:
        """Table path the view's alias points to (falls back to the default version's table)."""
        return self.target(view, as_of=as_of).table_path

    def spark_view_sql(self, view: str, *, database: str = "analytics") -> str:
        """``CREATE OR REPLACE VIEW <database>.<view>`` over the table the alias points to (run it with Spark)."""
        path = self.resolve(view).replace("`", "``")
        return f"CREATE OR REPLACE VIEW {database}.{view} AS SELECT * FROM delta.`{path}`"

    # ---------------------------------------------------------------------------------- switches
    def promote(self, view: str, version: int, *, by: str, keep: timedelta | None = None) -> SwitchResult:
        """Point the view's alias at ``version`` (idempotent; re-running repairs an interrupted promote).

        Args:
            view: View name.
            version: A ``verified`` version (or a ``retired`` one whose table is kept: a rollback).
            by: Who switches (``cli:<user>``, ``airflow:<dag_run_id>``).
            keep: Retention of the replaced version's table (default: the alias's ``keep``).

        Raises:
            ServingError: Unknown view/version, version not verified, or its table is missing.
        """
        return self.promote_chain([(view, version)], by=by, keep=keep)[0]

    def promote_chain(self, versions: list[tuple[str, int]], *, by: str,
                      keep: timedelta | None = None) -> list[SwitchResult]:
        """Point several views' aliases at once - a view and the views over it (a cascading replay): the alias
        rows of all of them change in **one** Delta commit, so a reader resolving the aliases from one snapshot
        (``kappa query`` joining two views) sees the old chain or the new one, never a mix (:meth:`_switch`). Idempotent like
        :meth:`promote` (which is this with one view); the registry follows per view.

        Raises:
            ServingError: As :meth:`promote`, for any of them (nothing is switched then), or a view given twice.
        """
        if not by:
            raise ServingError("by is required (e.g. cli:<user> or airflow:<dag_run_id>)")
        views = [view for view, _version in versions]
        if not versions or len(set(views)) != len(views):
            raise ServingError(f"one version per view, at least one view: {versions}")
        keep = self.keep if keep is None else keep
        checked = [self._promotable(view, version) for view, version in versions]
        if all(done for _rec, _others, done in checked):
            return [SwitchResult(view=rec.view, version=rec.version,
                                 previous_version=self.alias(rec.view).previous_version,
                                 table_path=rec.table_path, changed=False,
                                 message=f"{view_ref(rec.view, rec.version)} already serves; nothing to do")
                    for rec, _others, _done in checked]
        # 1. the aliases: one MERGE commit, the only step readers see
        switched = self._switch([(rec, others) for rec, others, _done in checked], by=by)
        return [self._follow_switch(rec, *switched[rec.view], by=by, keep=keep) for rec, _others, _done in checked]

    def _promotable(self, view: str, version: int) -> tuple[VersionRecord, list[VersionRecord], bool]:
        """(registry row, the view's other serving versions, already served and consistent) - or a refusal."""
        self.target(view)  # validates the view name against the catalog
        rec = self.registry.get(view, version)
        if rec is None:
            raise ServingError(f"{view_ref(view, version)} is not registered")
        alias = self.alias(view)
        others = [r for r in self.registry.list(view) if r.state == "serving" and r.version != version]
        if alias is not None and alias.version == version and rec.state == "serving" and not others:
            return rec, others, True
        if rec.state not in {"verified", "serving", "retired"}:
            raise ServingError(f"{view_ref(view, version)} is {rec.state}; only a verified version can be promoted")
        if rec.deleted_at is not None:
            raise ServingError(f"{view_ref(view, version)}: its table was deleted at {rec.deleted_at.isoformat()}")
        if not DeltaTable.is_deltatable(rec.table_path, self.storage_options):
            raise ServingError(f"{view_ref(view, version)}: no Delta table at {rec.table_path}")
        return rec, others, False

    def _follow_switch(self, rec: VersionRecord, changed: bool, previous: int | None, *, by: str,
                       keep: timedelta) -> SwitchResult:
        """Steps 2-4 of a promote, after the alias switched to ``rec``: the registry follows it."""
        view, version = rec.view, rec.version
        # 2. the new version serves (a rollback target loses its delete_after)
        try:
            self.registry.set_state(view, version, "serving", by=by, expected={"verified", "retired"},
                                    delete_after=None, note=f"alias switched from v{previous}" if previous else None)
        except StateConflict:
            pass  # a concurrent promote's reconciliation already made it serve (or retired it: step 4 decides)
        # 3. every other serving version is retired, its table kept for `keep`
        delete_after = utcnow() + keep
        retired = []
        for other in self.registry.list(view):
            if other.state == "serving" and other.version != version:
                try:
                    self.registry.set_state(view, other.version, "retired", by=by, expected={"serving"},
                                            delete_after=delete_after, note=f"replaced by v{version}")
                    retired.append(other.version)
                except StateConflict:
                    pass  # a concurrent promote already retired it
        # 4. a concurrent promote of the same view may have switched the alias after us, and its steps 2-3 may
        # interleave with ours: the registry is made to follow the alias (the only thing readers see)
        current = self._reconcile(view, by=by, delete_after=delete_after)
        if current != version:
            raise ServingError(f"concurrent switch of {view}: the alias now points to v{current}, not v{version}")

        if changed:
            message = f"{view} now serves v{version}" + (f" (was v{previous})" if previous else "")
        else:
            message = f"{view_ref(view, version)} already served by the alias; registry repaired"
        if retired:
            message += f"; retired v{', v'.join(map(str, retired))} until {delete_after:%Y-%m-%d %H:%M} UTC"
        return SwitchResult(view=view, version=version, previous_version=previous, table_path=rec.table_path,
                            changed=changed, message=message)

    def _reconcile(self, view: str, *, by: str, delete_after: datetime, attempts: int = 20) -> int | None:
        """Make the registry follow the alias: the version it points to ``serving``, every other ``retired``.

        Concurrent promotes each write the registry after their own switch, so a slower one may retire the
        version the alias ended on. Every promote ends here, and a round only ends once a re-read shows the
        alias unchanged and exactly its version serving - the last writer always leaves them consistent.
        Returns the alias's version (None: no alias)."""
        target = None
        for _ in range(attempts):
            alias = self.alias(view)
            if alias is None:
                return None
            target = alias.version
            for row in self.registry.list(view):
                try:
                    if row.version == target and row.state != "serving":
                        self.registry.set_state(view, target, "serving", by=by, expected={"verified", "retired"},
                                                delete_after=None, note="the alias points to it (after a "
                                                "concurrent promote)")
                    elif row.version != target and row.state == "serving":
                        self.registry.set_state(view, row.version, "retired", by=by, expected={"serving"},
                                                delete_after=delete_after, note=f"replaced by v{target}")
                except StateConflict:
                    pass  # someone else moved it meanwhile: the re-read below decides
            again = self.alias(view)
            serving = [r.version for r in self.registry.list(view) if r.state == "serving"]
            if again is not None and again.version == target and serving == [target]:
                return target
        return target

    def rollback(self, view: str, to_version: int | None = None, *, by: str,
                 keep: timedelta | None = None) -> SwitchResult:
        """Point the alias back to a kept earlier version (undo the last switch by default).

        Args:
            view: View name.
            to_version: Version to serve again; default: the alias's ``previous_version``. Automation that
                may retry should pass it (a bare rollback is relative to the current alias, so repeating it
                undoes the rollback).
            by: Who switches.
            keep: Retention of the replaced version's table.

        Raises:
            ServingError: Nothing serves, or the target is not a retired version whose table still exists.
        """
        return self.promote(view, self.rollback_target(view, to_version), by=by, keep=keep)

    def rollback_target(self, view: str, to_version: int | None = None) -> int:
        """The version a rollback of ``view`` serves again (see :meth:`rollback`), checked.

        Raises:
            ServingError: Nothing serves, or the target is not a retired version whose table still exists.
        """
        alias = self.alias(view)
        serving = self.registry.serving(view)
        current = alias.version if alias else (serving.version if serving else None)
        if current is None:
            raise ServingError(f"{view} has no serving version to roll back from")
        if to_version == current:
            return to_version  # already there: the promote is a no-op / repair
        kept = {r.version: r for r in self.registry.list(view) if self._kept(r) and r.version != current}
        if to_version is None:
            previous = alias.previous_version if alias else None
            if previous is None or previous not in kept:
                hint = f"; pass to_version (kept: v{', v'.join(map(str, sorted(kept)))})" if kept else ""
                why = "no previous version" if previous is None else f"previous version v{previous} is not kept"
                raise ServingError(f"cannot roll back {view} from v{current}: {why}{hint}")
            return previous
        if to_version not in kept:
            rec = self.registry.get(view, to_version)
            why = ("is not registered" if rec is None else
                   f"is {rec.state}" if rec.state != "retired" else "has no table any more")
            raise ServingError(f"cannot roll back {view} to v{to_version}: it {why}")
        return to_version

    # ---------------------------------------------------------------------------------- retention
    def expired(self, now: datetime | None = None) -> list[VersionRecord]:
        """Retired versions whose ``delete_after`` has passed and whose table was not deleted yet."""
        now = now or utcnow()
        aliased = {(v, a.version) for v, a in self.aliases().items()}
        return [r for r in self.registry.list()
                if r.state == "retired" and r.deleted_at is None and r.delete_after is not None
                and r.delete_after <= now and (r.view, r.version) not in aliased]

    def delete_expired(self, now: datetime | None = None, *, by: str) -> list[DeletionResult]:
        """Delete the tables of :meth:`expired` versions (a local lake or an object store).

        Each version is first marked ``deleted_at`` in the registry (compare-and-set on state ``retired``,
        after which it can no longer be promoted), then its directory is removed: the whole
        ``views/<view>/v<N>`` folder (table and checkpoint) when the table has the standard layout, otherwise
        the table directory. Only paths inside the lake are ever removed. Versions marked but whose directory
        still exists (a crash after marking) are deleted again.
        """
        if not by:
            raise ServingError("by is required (e.g. cli:<user> or airflow:<dag_run_id>)")
        now = now or utcnow()
        todo = self.expired(now) + [r for r in self.registry.list()
                                    if r.state == "retired" and r.deleted_at is not None
                                    and tree_exists(_victim(r))]
        results: list[DeletionResult] = []
        for rec in todo:
            results.append(self._delete(rec, now, by=by))
        return results

    # ---------------------------------------------------------------------------------- internals
    def _kept(self, rec: VersionRecord) -> bool:
        return (rec.state == "retired" and rec.deleted_at is None
                and DeltaTable.is_deltatable(rec.table_path, self.storage_options))

    def _switch(self, targets: list[tuple[VersionRecord, list[VersionRecord]]], *,
                by: str) -> dict[str, tuple[bool, int | None]]:
        """Compare-and-set the alias rows of ``targets`` (registry row, the view's other serving versions) in one
        MERGE commit; returns view -> (changed, previous version).

        The rows are read and merged at one snapshot of the alias table: a concurrent switch committed since then
        rewrote the same file, so delta-rs refuses the commit (all rows or none) and the switch is retried from a
        fresh read. Each source row also carries the version it expects the alias to hold; a count short of the
        rows means an expectation failed, and the switch is retried the same way."""
        _ensure_table(self.uri, _ALIAS_COLUMNS, self.storage_options)
        result: dict[str, tuple[bool, int | None]] = {}

        def attempt() -> dict[str, tuple[bool, int | None]]:
            table = DeltaTable(self.uri, storage_options=self.storage_options)
            aliases = {row["view"]: AliasRow(**row) for row in read_rows(table)}
            rows = []
            for rec, others in targets:
                alias = aliases.get(rec.view)
                if alias is not None and alias.version == rec.version:
                    result.setdefault(rec.view, (False, alias.previous_version))  # already switched
                    continue
                if alias is not None:
                    previous: int | None = alias.version
                else:
                    previous = max(others, key=lambda r: r.updated_at).version if others else None
                result[rec.view] = (True, previous)
                rows.append({"view": rec.view, "version": rec.version, "table_path": rec.table_path,
                             "switched_at": utcnow(), "switched_by": by, "previous_version": previous,
                             "expected_version": alias.version if alias else None})
            if not rows:
                return result
            source = arrow_rows(_ALIAS_COLUMNS, rows, extra=(("expected_version", I64),))
            cols = {_q(c): f"s.{_q(c)}" for c, _ in _ALIAS_COLUMNS}
            metrics = (
                table.merge(source, predicate='t."view" = s."view"', source_alias="s", target_alias="t")
                .when_matched_update(cols, predicate='t."version" = s."expected_version"')
                .when_not_matched_insert(cols)
                .execute()
            )
            if metrics.get("num_target_rows_updated", 0) + metrics.get("num_target_rows_inserted", 0) != len(rows):
                raise _Lost()
            return result

        views = ", ".join(rec.view for rec, _others in targets)
        return _retrying(attempt, f"switch the alias of {views}")

    def _delete(self, rec: VersionRecord, now: datetime, *, by: str) -> DeletionResult:
        def result(deleted: bool, message: str) -> DeletionResult:
            return DeletionResult(view=rec.view, version=rec.version, table_path=rec.table_path, deleted=deleted,
                                  message=message)

        victim = _victim(rec)
        lake = _dir_uri(self.lake_uri)
        if not victim.startswith(lake + "/"):
            return result(False, f"{rec.ref}: {victim} is outside the lake {lake}; not deleting it")
        if rec.deleted_at is None:
            try:  # mark first: from now on the version can no longer be promoted
                self.registry.set_state(rec.view, rec.version, "retired", by=by, expected={"retired"},
                                        deleted_at=now, note=f"table deleted ({victim})")
            except StateConflict as exc:
                return result(False, f"{rec.ref}: not deleted, {exc}")
        aliased = self.alias(rec.view)
        if aliased is not None and aliased.version == rec.version:
            return result(False, f"{rec.ref}: the alias points to it again; not deleting it")
        delete_tree(victim)
        if tree_exists(victim):
            return result(False, f"{rec.ref}: could not remove {victim}")
        return result(True, f"{rec.ref}: deleted {victim}")


def _dir_uri(uri: str) -> str:
    """A lake directory as a comparable string: a resolved local path, or the URI without a trailing slash."""
    return str(Path(local_path(uri)).resolve()) if is_local_uri(uri) else uri.rstrip("/")


def _victim(rec: VersionRecord) -> str:
    """Directory to remove for a version: ``views/<view>/v<N>`` (table + checkpoint) or the table dir."""
    table_dir = _dir_uri(rec.table_path)
    root, _, leaf = table_dir.rpartition("/")
    parts = root.split("/")
    standard = leaf == "table" and parts[-3:] == ["views", rec.view, f"v{rec.version}"]
    return root if standard else table_dir

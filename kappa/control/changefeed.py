"""What changed in a view, as it commits: Delta Change Data Feed of the serving version, following its alias.

Every view table is written with ``delta.enableChangeDataFeed`` on (:mod:`kappa.runtime.job`), so each Delta
commit of a view version records its inserted, updated (before and after image) and deleted rows. This module
reads them without Spark (delta-rs) for two front ends:

- ``kappa query "SELECT ... FROM table_changes('<view>', <from>, <to>)"``: the raw feed of the serving table
  between two of its Delta versions (:func:`read_changes`; columns of the view plus ``_change_type``,
  ``_commit_version``, ``_commit_timestamp``, as Spark SQL's ``table_changes`` returns them).
- ``kappa watch <view> [--where SQL]``: notifications of the serving version as it commits
  (:func:`follow_changes`), in the terms of a subscriber to a query result:

  ====== ==================================================================================================
  add    a row enters the result: inserted and matching ``where``, or updated into matching it
  change a matching row's values changed (its ``before`` image is given too); no-op updates are not reported
  remove a row leaves the result: deleted while matching, or updated out of matching ``where``
  switch the alias moved to another version (promotion or rollback): from here on, changes of that version
  ====== ==================================================================================================

Following the alias: the subscriber sees what readers see. When the alias switches, the old version's changes
are read up to the switch (commits of the old table at or before ``switched_at``), a ``switch`` notification is
given, and the new version's changes follow from its snapshot at the switch (the one readers saw first). Rows that
differ between the two versions at the switch are not listed: ``kappa query`` (or a diff report) shows them.

An update is paired with its before image by the version's keys (``ViewDefinition.keys``); ``where`` is DuckDB
SQL over the view's columns, evaluated for the before and the after image.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from kappa.errors import KappaError, one_line

__all__ = ["CHANGE_COLUMNS", "Change", "ChangeFeedError", "follow_changes", "read_changes"]

#: Columns Delta's change feed adds to a view's columns.
CHANGE_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


class ChangeFeedError(KappaError, ValueError):
    """The change feed cannot be read as asked (one line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One notification of :func:`follow_changes`.

    Attributes:
        kind: ``add`` | ``change`` | ``remove`` | ``switch`` (see the module docstring).
        view: View name.
        version: View version whose table committed it (for ``switch``: the version now serving).
        commit: Delta version of that table (for ``switch``: the snapshot readers saw first).
        committed_at: Commit time (UTC; for ``switch``: the time of the switch).
        row: The row (``change``: after the update; ``remove``: as it was); empty for ``switch``.
        before: ``change`` only: the row before the update.
        previous_version: ``switch`` only: the version that served before.
    """

    kind: str
    view: str
    version: int
    commit: int
    committed_at: datetime | None
    row: dict[str, Any] = field(default_factory=dict)
    before: dict[str, Any] | None = None
    previous_version: int | None = None

    def to_json(self) -> str:
        """One JSON line (timestamps in ISO 8601, UTC)."""
        body: dict[str, Any] = {"kind": self.kind, "view": self.view, "version": self.version,
                                "commit": self.commit, "committed_at": self.committed_at}
        if self.kind == "switch":
            body["previous_version"] = self.previous_version
        else:
            body["row"] = self.row
        if self.before is not None:
            body["before"] = self.before
        return json.dumps(body, default=_json_default, sort_keys=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _open(path: str) -> Any:
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri

    uri = rs_uri(path)
    if not DeltaTable.is_deltatable(uri):
        return None
    return DeltaTable(uri)


def read_changes(path: str, start: int, end: int | None = None) -> Any:
    """The change feed of the Delta table at ``path`` from Delta version ``start`` to ``end`` (inclusive; None:
    the latest) as an Arrow table: the table's columns plus :data:`CHANGE_COLUMNS`.

    Raises:
        ChangeFeedError: No table, a version outside its history, or a range the feed was off for.
    """
    import arro3.core as ac

    table = _open(path)
    if table is None:
        raise ChangeFeedError(f"no Delta table at {path} (has the view's job committed yet?)")
    latest = table.version()
    if start < 0 or start > latest or (end is not None and not start <= end <= latest):
        raise ChangeFeedError(f"versions {start}..{latest if end is None else end} are outside {path}'s history "
                              f"(0..{latest})")
    from deltalake.exceptions import DeltaError

    try:
        feed_on = _feed_on(path, start)
    except DeltaError as exc:  # its commit left the log with the table's history
        raise ChangeFeedError(f"version {start} of {path} is no longer readable - older than the table's history "
                              f"(KAPPA_HISTORY_HOURS; docs/lake.md): {one_line(exc)}") from None
    if not feed_on:  # the platform never turns the feed off: on at start = on for the range
        first = _feed_start(path, latest)
        raise ChangeFeedError(f"the change feed of {path} " + (f"starts at version {first}" if first is not None else
                              "is off") + f", not {start} (on from the commit its job turned it on)")
    try:
        reader = table.load_cdf(starting_version=start, ending_version=end if end is not None else latest)
        return ac.Table.from_arrow(reader)
    except Exception as exc:  # noqa: BLE001 - delta-rs raises several types for a feed that was off
        raise ChangeFeedError(f"cannot read the change feed of {path} from version {start}: {one_line(exc)}") from None


def _feed_on(path: str, version: int) -> bool:
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri
    from kappa.runtime.sink import CHANGE_FEED

    return DeltaTable(rs_uri(path), version=version).metadata().configuration.get(CHANGE_FEED) == "true"


def _feed_start(path: str, latest: int) -> int | None:
    """First version of the table with the change feed on (None if off at ``latest``); the platform never turns
    it off, so the versions with it on are a suffix of the history (binary search over snapshots)."""
    def on(version: int) -> bool:
        return _feed_on(path, version)

    if not on(latest):
        return None
    low, high = 0, latest
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if on(mid) else (mid + 1, high)
    return low


def _version_at(path: str, when: datetime) -> int:
    """The table's version readers saw at ``when`` (-1 when the table had no commit yet)."""
    from deltalake.exceptions import DeltaError

    table = _open(path)
    if table is None:
        return -1
    latest = table.version()
    for entry in table.history():
        stamp = entry.get("timestamp")
        if stamp is not None and datetime.fromtimestamp(stamp / 1000, tz=UTC) <= when:
            return min(int(entry["version"]), latest)
    try:  # history without timestamps (should not happen): the version as of that time
        table.load_as_version(when)
        return table.version()
    except DeltaError:
        return -1


class _Matcher:
    """Evaluates ``where`` (DuckDB SQL over the view's columns) on change rows, in their order."""

    def __init__(self, where: str | None) -> None:
        self.where = where.strip() if where and where.strip() else None

    def __call__(self, data: Any) -> list[bool]:
        if self.where is None:
            return [True] * data.num_rows
        import duckdb

        con = duckdb.connect(config={"enable_external_access": False, "preserve_insertion_order": True})
        try:
            con.execute("SET TimeZone = 'UTC'")
            con.register("changes", data)
            return [bool(v) for (v,) in con.sql(f"SELECT coalesce(({self.where}), false) FROM changes").fetchall()]
        except duckdb.Error as exc:
            raise ChangeFeedError(f"--where {self.where!r}: {one_line(exc)}") from None
        finally:
            con.close()

    def check(self, table: Any) -> None:
        """Fail early (one line) when ``where`` does not compile against the table's columns."""
        import arro3.core as ac

        self(ac.Table.from_batches([], schema=ac.Schema.from_arrow(table.schema().to_arrow())))


def notifications(view: str, version: int, data: Any, *, keys: tuple[str, ...] = (),
                  where: str | _Matcher | None = None) -> list[Change]:
    """The ``add`` / ``change`` / ``remove`` notifications of a slice of a table's change feed, in commit order."""
    matcher = where if isinstance(where, _Matcher) else _Matcher(where)
    matches = matcher(data)
    from kappa.runtime.deltars import arrow_to_rows

    rows = arrow_to_rows(data)
    by_commit: dict[int, list[tuple[dict[str, Any], bool]]] = {}
    for row, matched in zip(rows, matches):
        by_commit.setdefault(int(row["_commit_version"]), []).append((row, matched))
    out: list[Change] = []
    for commit in sorted(by_commit):
        entries = by_commit[commit]
        committed_at = entries[0][0]["_commit_timestamp"]
        pre: dict[Any, list[tuple[dict[str, Any], bool]]] = {}
        for row, matched in entries:
            if row["_change_type"] == "update_preimage":
                pre.setdefault(_key(row, keys), []).append((row, matched))

        def note(kind: str, row: dict[str, Any], before: dict[str, Any] | None = None) -> None:
            out.append(Change(kind=kind, view=view, version=version, commit=commit, committed_at=committed_at,
                              row=_clean(row), before=_clean(before) if before is not None else None))

        for row, matched in entries:
            change = row["_change_type"]
            if change == "insert" and matched:
                note("add", row)
            elif change == "delete" and matched:
                note("remove", row)
            elif change == "update_postimage":
                queue = pre.get(_key(row, keys))
                before, was = queue.pop(0) if queue else (None, False)
                if was and matched:
                    if before is None or _clean(before) != _clean(row):
                        note("change", row, before)
                elif matched:
                    note("add", row)
                elif was and before is not None:
                    note("remove", before)
    return out


def _key(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return tuple(row.get(k) for k in keys) if keys else None


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in CHANGE_COLUMNS}


def follow_changes(settings: Any, view: str, *, where: str | None = None, start: int | None = None,
                   poll: float = 1.0, until: Callable[[], bool] = lambda: False,
                   catalog: Any = None) -> Iterator[Change]:
    """Notifications of the view's serving version as it commits, following its alias (module docstring).

    Args:
        settings: Platform settings (its lake).
        view: A declared view.
        where: DuckDB SQL condition over the view's columns (None: every row).
        start: First Delta version of the serving table to report (None: only what commits from now on).
        poll: Seconds between looks at the table and the alias.
        until: Called after each look; the generator ends when it returns True.
        catalog: View declarations (default: :func:`kappa.catalog.load_catalog`).

    Raises:
        ChangeFeedError: A ``where`` that does not compile, or a feed that cannot be read.
        kappa.control.serving.ServingError: The view is not declared.
    """
    from kappa.control.serving import ServingAlias
    from kappa.runtime.view import load_view

    alias = ServingAlias(settings.lake_uri, catalog=catalog)
    matcher = _Matcher(where)
    checked = False

    def keys_of(version: int) -> tuple[str, ...]:
        return tuple(load_view(alias.catalog.module_of(view, version)).keys)

    target = alias.target(view)
    keys = keys_of(target.version)
    table = _open(target.table_path)
    cursor = start if start is not None else (table.version() + 1 if table is not None else 0)
    while True:
        table = _open(target.table_path)
        end = table.version() if table is not None else -1  # read before the alias: these commits precede any
        now = alias.target(view)                             # switch the alias does not show yet
        if now.version != target.version:
            row = alias.alias(view)
            switched_at = row.switched_at if row is not None else datetime.now(UTC)
            yield from _drain(target, cursor, _version_at(target.table_path, switched_at), keys, matcher)
            at = _version_at(now.table_path, switched_at)
            yield Change(kind="switch", view=view, version=now.version, commit=at, committed_at=switched_at,
                         previous_version=target.version)
            target, keys, cursor, checked = now, keys_of(now.version), at + 1, False
            table = _open(target.table_path)
            end = table.version() if table is not None else -1
        if table is not None:
            if not checked:
                matcher.check(table)
                checked = True
            yield from _drain(target, cursor, end, keys, matcher)
            cursor = max(cursor, end + 1)
        if until():
            return
        time.sleep(poll)


def _drain(target: Any, start: int, end: int, keys: tuple[str, ...], matcher: _Matcher) -> Iterator[Change]:
    if end < start:
        return
    yield from notifications(target.view, target.version, read_changes(target.table_path, start, end),
                             keys=keys, where=matcher)

"""The registry of view versions: one row per (view, version) in a Delta table, plus an audit log.

Tables (written with delta-rs, no Spark needed):

* ``<lake>/_registry/versions`` -- one row per view version: code identity (module + sha256 of its source),
  table path, Delta appId, starting position, offsets, lifecycle ``state`` and who changed it last.
* ``<lake>/_registry/events`` -- append-only audit log, one row per committed change
  (``view, version, from_state, to_state, by, at, note``).

Lifecycle (``set_state`` refuses anything else)::

    building -> caught_up | failed          caught_up -> verified | failed | building
    verified -> serving | failed            serving   -> retired
    retired  -> serving   (rollback)        failed    -> building  (re-run)

Setting the state a row already has is a no-op (idempotent retries); extra fields given with it are still
applied (e.g. progress updates of ``end_offsets`` while ``building``).

Concurrency: every change is a compare-and-set. The writer reads the row, checks the transition, and commits
one delta-rs ``MERGE`` on ``(view, version)`` whose update clause only fires when the row's ``revision`` is still
the one it read; the new row carries ``revision + 1``. A concurrent writer either makes delta-rs reject the
commit (``CommitFailedError``: serializable conflict check) or makes the MERGE update zero rows; both cases
re-read and re-decide (with ``tenacity``), so no update is ever lost or applied on a stale state.

Example:
    >>> reg = Registry("/tmp/lake")  # doctest: +SKIP
    >>> reg.register("user_sessions", 2, code_module="jobs.user_sessions.v2",
    ...              table_path="/tmp/lake/views/user_sessions/v2/table",
    ...              app_id="kappa:user_sessions@v2:abc", starting="earliest",
    ...              triggered_by="cli:alice")  # doctest: +SKIP
    >>> reg.set_state("user_sessions", 2, "caught_up", by="cli:alice", expected={"building"})  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_random_exponential

from kappa.runtime.deltars import I64, STR, TS, arrow_rows, create_table, read_rows
from kappa.errors import KappaError, one_line
from kappa.identity import check_version_key, in_lake, view_ref

__all__ = [
    "STATES",
    "TRANSITIONS",
    "AsOfError",
    "Event",
    "IllegalTransition",
    "Registry",
    "RegistryError",
    "StateConflict",
    "TableMissing",
    "VersionRecord",
    "code_hash",
    "commit_time",
    "open_delta",
    "utcnow",
]

#: Lifecycle states of a view version.
STATES: tuple[str, ...] = ("building", "caught_up", "verified", "serving", "retired", "failed")

#: Allowed state changes (``from -> {to, ...}``); re-setting the current state is always allowed (no-op).
TRANSITIONS: Mapping[str, frozenset[str]] = {
    "building": frozenset({"caught_up", "failed"}),
    "caught_up": frozenset({"verified", "failed", "building"}),
    "verified": frozenset({"serving", "failed"}),
    "serving": frozenset({"retired"}),
    "retired": frozenset({"serving"}),
    "failed": frozenset({"building"}),
}

#: Fields ``set_state`` may change besides ``state``/``note`` (offsets may be given as dicts).
_UPDATABLE = frozenset({"start_offsets", "end_offsets", "delete_after", "deleted_at", "app_id", "starting",
                        "table_path"})

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ errors
class RegistryError(KappaError, ValueError):
    """A registry or serving-alias operation was refused; the message is one line for the CLI."""


class StateConflict(RegistryError):
    """The row is not in the state the caller expected (someone else changed it first)."""


class IllegalTransition(RegistryError):
    """The requested state change is not allowed by the lifecycle."""


class TableMissing(RegistryError):
    """No Delta table exists at a path."""


class AsOfError(RegistryError):
    """A Delta table has no snapshot for the requested version / timestamp."""


class _Lost(Exception):
    """Internal: a compare-and-set MERGE matched no row (a concurrent writer won); re-read and retry."""


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True, slots=True, kw_only=True)
class VersionRecord:
    """One row of ``<lake>/_registry/versions``.

    Attributes:
        view: View name.
        version: Version number.
        code_module: Module implementing the version (``jobs.<view>.v<N>``).
        code_hash: sha256 (hex) of the module's source file at registration.
        table_path: Delta table of this version.
        app_id: Delta appId the job writes with (``kappa:<view>@v<N>:<run id>``).
        starting: Starting position given to the job (``earliest``, ``ts:<ms>``, JSON offsets...).
        start_offsets: JSON of the Kafka offsets the version started from, if known.
        end_offsets: JSON of the offsets processed so far (or at verification).
        state: One of :data:`STATES`.
        created_at: Registration time (UTC).
        updated_at: Time of the last committed change (UTC).
        state_changed_by: Who made the last change (``cli:<user>``, ``airflow:<dag_run_id>``...).
        note: Free text about the last change (e.g. a failure reason).
        delete_after: When a retired version's table may be deleted (None: keep).
        deleted_at: When the retired table was deleted (None: still exists).
        revision: Compare-and-set counter, +1 on every committed change.
    """

    view: str
    version: int
    code_module: str
    code_hash: str
    table_path: str
    app_id: str
    starting: str
    start_offsets: str | None
    end_offsets: str | None
    state: str
    created_at: datetime
    updated_at: datetime
    state_changed_by: str
    note: str | None
    delete_after: datetime | None
    deleted_at: datetime | None
    revision: int

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return view_ref(self.view, self.version)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (timestamps as ISO strings)."""
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One row of the audit log ``<lake>/_registry/events``.

    Attributes:
        view: View name.
        version: Version number.
        from_state: State before the change (None at registration).
        to_state: State after the change (equal to ``from_state`` for field-only updates).
        by: Who made the change.
        at: When (UTC).
        note: Free text.
    """

    view: str
    version: int
    from_state: str | None
    to_state: str
    by: str
    at: datetime
    note: str | None


# Column layout of the tables: (name, arrow type). Timestamps are UTC microseconds (Delta ``timestamp``).
_VERSION_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("view", STR), ("version", I64), ("code_module", STR), ("code_hash", STR), ("table_path", STR),
    ("app_id", STR), ("starting", STR), ("start_offsets", STR), ("end_offsets", STR), ("state", STR),
    ("created_at", TS), ("updated_at", TS), ("state_changed_by", STR), ("note", STR),
    ("delete_after", TS), ("deleted_at", TS), ("revision", I64),
)
_EVENT_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("view", STR), ("version", I64), ("from_state", STR), ("to_state", STR), ("by", STR), ("at", TS),
    ("note", STR),
)


# ------------------------------------------------------------------------------------------------ helpers
def utcnow() -> datetime:
    """Current time, timezone-aware UTC, microsecond precision (what Delta stores)."""
    return datetime.now(UTC)


def code_hash(module: str) -> str:
    """sha256 (hex) of a module's source file, located without importing the module itself.

    Only the parent packages are imported (``jobs``, ``jobs.<view>``), never the version module, so no
    pyspark import happens.

    Args:
        module: Dotted module path, e.g. ``jobs.user_sessions.v1``.

    Raises:
        RegistryError: If the module cannot be found or has no source file.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise RegistryError(f"module {module!r} not found: {exc}") from None
    if spec is None:
        raise RegistryError(f"module {module!r} not found")
    origin = spec.origin
    if not origin or origin in {"built-in", "frozen"} or not origin.endswith(".py"):
        raise RegistryError(f"module {module!r} has no Python source file (origin {origin!r})")
    with open(origin, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _q(name: str) -> str:
    return f'"{name}"'


def commit_time(uri: str, version: int, *, storage_options: dict[str, str] | None = None) -> datetime | None:
    """Commit timestamp of one Delta version (None if its commit info is no longer in the log).

    Reads the history of the *latest* snapshot (delta-rs mislabels the history of a time-travelled table).
    """
    latest = DeltaTable(uri, storage_options=storage_options)
    limit = max(latest.version() - version + 1, 1)
    for entry in latest.history(limit):
        if entry.get("version") == version and entry.get("timestamp") is not None:
            return datetime.fromtimestamp(entry["timestamp"] / 1000, tz=UTC)
    return None


def open_delta(uri: str, *, as_of: int | datetime | None = None,
               storage_options: dict[str, str] | None = None) -> DeltaTable:
    """Open a Delta table, optionally time-travelled to a version number or a point in time.

    Args:
        uri: Table path / URI.
        as_of: Delta version (int) or timestamp (timezone-aware datetime); None for the latest snapshot.
        storage_options: delta-rs object-store options.

    Raises:
        TableMissing: No Delta table at ``uri``.
        AsOfError: The version does not exist, or the table did not exist yet at ``as_of``.
    """
    if not DeltaTable.is_deltatable(uri, storage_options):
        raise TableMissing(f"no Delta table at {uri}")
    try:
        table = DeltaTable(uri, storage_options=storage_options)
    except TableNotFoundError:
        raise TableMissing(f"no Delta table at {uri}") from None
    if as_of is None:
        return table
    latest = table.version()
    if isinstance(as_of, int) and not isinstance(as_of, bool):
        if as_of < 0 or as_of > latest:
            raise AsOfError(f"has no Delta version {as_of} (latest is {latest})")
        try:
            return DeltaTable(uri, version=as_of, storage_options=storage_options)
        except DeltaError as exc:
            raise AsOfError(f"Delta version {as_of} is no longer readable - older than the table's history "
                            f"(KAPPA_HISTORY_HOURS; docs/lake.md): {one_line(exc)}") from None
    if not isinstance(as_of, datetime) or as_of.tzinfo is None:
        raise AsOfError(f"as-of {as_of!r} must be a version number or a timezone-aware datetime")
    try:
        table.load_as_version(as_of)
    except DeltaError as exc:
        raise AsOfError(f"has no snapshot as of {as_of.isoformat()}: {one_line(exc)}") from None
    # delta-rs silently returns the first version for a time before the table existed: refuse that
    committed = commit_time(uri, table.version(), storage_options=storage_options)
    if committed is not None and committed > as_of:
        raise AsOfError(f"did not exist yet at {as_of.isoformat()} (first commit {committed.isoformat()})")
    return table


def _json_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise RegistryError(f"{name} is not valid JSON: {value[:80]!r}") from None
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise RegistryError(f"{name} cannot be stored as JSON: {exc}") from None


def _retrying(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` again while it loses a compare-and-set or a Delta commit conflict."""
    try:
        for attempt in Retrying(
            retry=retry_if_exception_type((_Lost, CommitFailedError)),
            wait=wait_random_exponential(multiplier=0.01, max=0.5),
            stop=stop_after_attempt(60) | stop_after_delay(60),
            reraise=True,
        ):
            with attempt:
                return fn()
    except (_Lost, CommitFailedError) as exc:
        raise RegistryError(f"{what}: gave up after repeated concurrent-write conflicts ({one_line(exc)})") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _ensure_table(uri: str, columns: tuple[tuple[str, Any], ...], storage_options: dict[str, str] | None) -> None:
    create_table(uri, columns, storage_options=storage_options)


def commit_row(uri: str, columns: tuple[tuple[str, Any], ...], row: Mapping[str, Any], *, key_match: str,
               expected_revision: int | None, storage_options: dict[str, str] | None = None) -> None:
    """Commit one row of a table keyed by ``key_match`` (a MERGE predicate over ``t``/``s``) as a compare-and-set:
    inserted only while no row has its key (``expected_revision`` None), or updated only while the row's
    ``revision`` is still ``expected_revision``. When another writer got there first, the MERGE changes nothing
    (``_Lost``) or delta-rs refuses its commit (``CommitFailedError``); :func:`_retrying` re-reads and re-decides."""
    source = arrow_rows(columns, [{**row, "expected_revision": expected_revision}],
                        extra=(("expected_revision", I64),))
    merger = DeltaTable(uri, storage_options=storage_options).merge(
        source, predicate=key_match, source_alias="s", target_alias="t")
    setters = {_q(c): f"s.{_q(c)}" for c, _ in columns}
    if expected_revision is None:
        metrics, counted = merger.when_not_matched_insert(setters).execute(), "num_target_rows_inserted"
    else:
        metrics, counted = (merger.when_matched_update(setters, predicate='t."revision" = s."expected_revision"')
                            .execute(), "num_target_rows_updated")
    if metrics.get(counted) != 1:
        raise _Lost()


# ------------------------------------------------------------------------------------------------ registry
class Registry:
    """Registry of view versions (Delta tables under ``<lake>/_registry``).

    Args:
        lake_uri: Lake root (``Settings.lake_uri``).
        storage_options: delta-rs object-store options for non-local lakes.
    """

    def __init__(self, lake_uri: str, *, storage_options: dict[str, str] | None = None) -> None:
        if not lake_uri:
            raise RegistryError("lake URI is empty (set KAPPA_LAKE_URI or KAPPA_HOME)")
        self.lake_uri = lake_uri.rstrip("/")
        self.storage_options = storage_options

    @classmethod
    def from_settings(cls, settings: Any = None) -> Registry:
        """Registry of ``settings.lake_uri`` (default: ``Settings.from_env()``)."""
        if settings is None:
            from kappa.config import Settings

            settings = Settings.from_env()
        return cls(settings.lake_uri)

    # -------------------------------------------------------------------------------- locations
    @property
    def versions_uri(self) -> str:
        """``<lake>/_registry/versions``."""
        return f"{self.lake_uri}/_registry/versions"

    @property
    def events_uri(self) -> str:
        """``<lake>/_registry/events``."""
        return f"{self.lake_uri}/_registry/events"

    def ensure(self) -> None:
        """Create the (empty) registry tables if they do not exist yet."""
        _ensure_table(self.versions_uri, _VERSION_COLUMNS, self.storage_options)
        _ensure_table(self.events_uri, _EVENT_COLUMNS, self.storage_options)

    # -------------------------------------------------------------------------------- reads
    def _records(self) -> list[VersionRecord]:
        if not DeltaTable.is_deltatable(self.versions_uri, self.storage_options):
            return []
        rows = read_rows(DeltaTable(self.versions_uri, storage_options=self.storage_options))
        return [VersionRecord(**{**row, "table_path": in_lake(row["table_path"], self.lake_uri, row["view"],
                                                              row["version"])}) for row in rows]

    def get(self, view: str, version: int) -> VersionRecord | None:
        """The row of one view version, or None if it was never registered."""
        for rec in self._records():
            if rec.view == view and rec.version == version:
                return rec
        return None

    def list(self, view: str | None = None) -> list[VersionRecord]:
        """All rows (of one view), ordered by view then version."""
        recs = [r for r in self._records() if view is None or r.view == view]
        return sorted(recs, key=lambda r: (r.view, r.version))

    def serving(self, view: str) -> VersionRecord | None:
        """The version the registry marks ``serving`` (the most recently changed one if several).

        The serving alias (:mod:`kappa.control.serving`) is what readers follow; the registry state catches up in
        the same ``promote`` call (re-running ``promote`` repairs an interrupted one).
        """
        recs = [r for r in self.list(view) if r.state == "serving"]
        return max(recs, key=lambda r: r.updated_at) if recs else None

    def events(self, view: str | None = None, version: int | None = None) -> list[Event]:
        """Audit log entries (of one view / version), oldest first."""
        if not DeltaTable.is_deltatable(self.events_uri, self.storage_options):
            return []
        rows = read_rows(DeltaTable(self.events_uri, storage_options=self.storage_options))
        events = [Event(**row) for row in rows]
        events = [e for e in events
                  if (view is None or e.view == view) and (version is None or e.version == version)]
        return sorted(events, key=lambda e: e.at)

    # -------------------------------------------------------------------------------- writes
    def register(self, view: str, version: int, *, code_module: str, table_path: str, app_id: str,
                 starting: str, triggered_by: str, start_offsets: Any = None) -> VersionRecord:
        """Register a view version in state ``building`` (idempotent).

        Args:
            view: View name (lower_snake_case).
            version: Version number (>= 1).
            code_module: Module implementing the version; its source file is hashed (:func:`code_hash`).
            table_path: Delta table the version writes.
            app_id: Delta appId of the run.
            starting: Starting position (``earliest``, ``latest``, ``ts:<ms>``, JSON offsets).
            triggered_by: Who registers (``cli:<user>``, ``airflow:<dag_run_id>``).
            start_offsets: Resolved starting offsets (dict or JSON string), if known.

        Returns:
            The new row, or the existing one if the same code was already registered as this version.

        Raises:
            RegistryError: If the version exists with another code hash, or an argument is invalid.
        """
        _check_key(view, version)
        if not triggered_by:
            raise RegistryError("triggered_by is required (e.g. cli:<user> or airflow:<dag_run_id>)")
        digest = code_hash(code_module)
        start_json = _json_text("start_offsets", start_offsets)
        self.ensure()

        def attempt() -> tuple[VersionRecord, bool]:
            current = self.get(view, version)
            if current is not None:
                if current.code_hash != digest:
                    raise RegistryError(
                        f"version {version} of {view} already exists with other code; a version's table belongs "
                        "to its code: declare a new version of it (a number not declared yet)"
                    )
                return current, False
            now = utcnow()
            rec = VersionRecord(
                view=view, version=version, code_module=code_module, code_hash=digest, table_path=table_path,
                app_id=app_id, starting=starting, start_offsets=start_json, end_offsets=None, state="building",
                created_at=now, updated_at=now, state_changed_by=triggered_by, note=None, delete_after=None,
                deleted_at=None, revision=1,
            )
            commit_row(self.versions_uri, _VERSION_COLUMNS, dataclasses.asdict(rec), key_match=_KEY_MATCH,
                       expected_revision=None, storage_options=self.storage_options)
            return rec, True

        rec, created = _retrying(attempt, f"register {view_ref(view, version)}")
        if created:
            self._log(rec, None, by=triggered_by, note=f"registered ({code_module} sha256 {digest[:12]})")
        return rec

    def set_state(self, view: str, version: int, state: str, *, by: str, note: str | None = None,
                  expected: set[str] | frozenset[str] | None = None, **fields: Any) -> VersionRecord:
        """Change the state of a view version (compare-and-set, idempotent).

        Args:
            view: View name.
            version: Version number.
            state: Target state (one of :data:`STATES`).
            by: Who triggers the change (``cli:<user>``, ``airflow:<dag_run_id>``).
            note: Free text stored with the change (on a state change, None clears the previous note).
            expected: If given, the current state must be one of these (unless it already is ``state``).
            **fields: Other columns to set in the same commit: ``end_offsets``/``start_offsets`` (dict or
                JSON), ``delete_after``/``deleted_at`` (aware datetime or None), ``app_id``, ``starting``,
                ``table_path``.

        Returns:
            The row after the change (unchanged if it already had ``state`` and the given fields).

        Raises:
            StateConflict: The current state is not in ``expected``.
            IllegalTransition: The lifecycle does not allow the change.
            RegistryError: Unknown version, state or field.
        """
        _check_key(view, version)
        if state not in STATES:
            raise RegistryError(f"unknown state {state!r} (states: {', '.join(STATES)})")
        if not by:
            raise RegistryError("by is required (e.g. cli:<user> or airflow:<dag_run_id>)")
        if expected is not None:
            bad = set(expected) - set(STATES)
            if bad:
                raise RegistryError(f"unknown expected state(s) {', '.join(sorted(bad))}")
        changes = _normalize_fields(fields)

        def attempt() -> tuple[VersionRecord, VersionRecord | None]:
            current = self.get(view, version)
            if current is None:
                raise RegistryError(f"{view_ref(view, version)} is not registered")
            if current.state == state:
                delta = {k: v for k, v in changes.items() if getattr(current, k) != v}
                if note is not None and note != current.note:
                    delta["note"] = note
                if not delta:
                    return current, None  # idempotent repeat
            else:
                if expected is not None and current.state not in expected:
                    raise StateConflict(
                        f"{view_ref(view, version)} is {current.state}, expected {' or '.join(sorted(expected))}"
                    )
                allowed = TRANSITIONS[current.state]
                if state not in allowed:
                    raise IllegalTransition(
                        f"{view_ref(view, version)}: cannot go from {current.state} to {state} "
                        f"(allowed: {', '.join(sorted(allowed))})"
                    )
                if state == "serving" and current.deleted_at is not None:
                    raise RegistryError(f"{view_ref(view, version)}: its table was deleted at "
                                        f"{current.deleted_at.isoformat()}; it cannot serve again")
                delta = dict(changes)
                delta["note"] = note
            new = dataclasses.replace(current, **delta, state=state, updated_at=utcnow(), state_changed_by=by,
                                      revision=current.revision + 1)
            commit_row(self.versions_uri, _VERSION_COLUMNS, dataclasses.asdict(new), key_match=_KEY_MATCH,
                       expected_revision=current.revision, storage_options=self.storage_options)
            return new, current

        new, old = _retrying(attempt, f"set {view_ref(view, version)} to {state}")
        if old is not None:
            self._log(new, old.state, by=by, note=note)
        return new

    # -------------------------------------------------------------------------------- internals
    def _log(self, rec: VersionRecord, from_state: str | None, *, by: str, note: str | None) -> None:
        row = {"view": rec.view, "version": rec.version, "from_state": from_state, "to_state": rec.state,
               "by": by, "at": rec.updated_at, "note": note}
        data = arrow_rows(_EVENT_COLUMNS, [row])

        def append() -> None:  # blind append: never conflicts with other appends, retried if it does
            from deltalake import write_deltalake

            write_deltalake(self.events_uri, data, mode="append", storage_options=self.storage_options)

        _retrying(append, f"audit log of {rec.ref} (state already committed)")


_KEY_MATCH = 't."view" = s."view" AND t."version" = s."version"'


def _check_key(view: str, version: int) -> None:
    problem = check_version_key(view, version)
    if problem:
        raise RegistryError(problem)


def _normalize_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(fields) - _UPDATABLE
    if unknown:
        raise RegistryError(f"cannot set field(s) {', '.join(sorted(unknown))} "
                            f"(settable: {', '.join(sorted(_UPDATABLE))})")
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name in {"start_offsets", "end_offsets"}:
            out[name] = _json_text(name, value)
        elif name in {"delete_after", "deleted_at"}:
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise RegistryError(f"{name} must be a timezone-aware datetime or None, got {value!r}")
            out[name] = value.astimezone(UTC) if value is not None else None
        else:
            if not isinstance(value, str) or not value:
                raise RegistryError(f"{name} must be a non-empty string, got {value!r}")
            out[name] = value
    return out

"""Replays: build a new view version from the retained log, check it, and switch readers to it atomically.

This module is the one code path behind ``kappa replay`` / ``promote`` / ``rollback`` / ``verify`` (CLI) and the
``kappa_replay`` / ``kappa_rollback`` DAGs: both only parse their inputs into a :class:`ReplayRequest` and call
these functions, so a replay behaves the same whoever triggers it. Every step is idempotent (a retried step
changes nothing), and readers keep resolving the serving alias to the old, complete version until
:func:`promote` switches it in one Delta commit.

The flow::

    preflight  the view's stream topic still retains the requested start on every partition (else: replay from
               the events_raw archive); estimate records, bytes and ETA; refuse a version that already runs
    launch     register the version (state building, resolved start offsets) and start its job via the runner
    progress   processed offsets from the job's checkpoint vs. the log end (live) or the end timestamp (bounded)
    caught_up  live: lag small; bounded: the job finished and processed everything before the end -> caught_up
    verify     read the new table at its latest Delta version, find the micro-batch it holds (Delta txn of the
               version's appId), re-run the version's own transform over exactly those micro-batches
               (kappa.recompute) and, where one exists, the plain-Python oracle; require equality and the
               version's expectations within their limits -> verified (or failed, serving untouched); write the
               diff report against the serving version (kappa.diffreport)
    promote    switch the alias (kappa.serving), stop the old version's job, refresh the Spark SQL catalog views
    watch      for a while after the switch, roll back when the new version breaks (kappa.watch)
    rollback   alias back to a kept version, restart its job, stop the other one
    retire     delete the tables of retired versions whose keep period passed

Example:
    >>> from kappa.config import Settings  # doctest: +SKIP
    >>> from kappa import replay  # doctest: +SKIP
    >>> s = Settings.from_env(); runner = replay.runner_from_env(s)  # doctest: +SKIP
    >>> req = replay.ReplayRequest(view="campaign_window_counts", version=2, triggered_by="cli:alice")  # doctest: +SKIP
    >>> pre = replay.preflight(req, s, runner); print(pre.summary())  # doctest: +SKIP
    >>> replay.launch(req, s, runner, pre)  # doctest: +SKIP
    >>> while not replay.caught_up("campaign_window_counts", 2, s, runner, by="cli:alice"): ...  # doctest: +SKIP
    >>> replay.verify("campaign_window_counts", 2, s, "strict", by="cli:alice").passed  # doctest: +SKIP
    True
    >>> replay.promote("campaign_window_counts", 2, s, runner, by="cli:alice")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from kappa.checkpoint import checkpoint_batches, last_commit, offsets_of, read_text, run_info, run_progress
from kappa.deltars import is_local_uri, local_path
from kappa.errors import one_line
from kappa.lineage import batches_from_history
from kappa.registry import Registry, RegistryError, VersionRecord, code_hash

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.runners.base import Runner
    from kappa.serving import DeletionResult, SwitchResult

__all__ = [
    "DEFAULT_MAX_LAG",
    "MIN_MEASURED_RECORDS",
    "THROUGHPUT_HISTORY",
    "END_MODES",
    "START_MODES",
    "VERIFY_MODES",
    "Preflight",
    "Progress",
    "ReplayError",
    "ReplayRequest",
    "Verification",
    "VersionBusy",
    "adopt_serving",
    "catalog_sql_path",
    "CatchUp",
    "caught_up",
    "checkpoint_batches",
    "committed_offsets",
    "expectations_check",
    "launch",
    "parse_end",
    "parse_start",
    "preflight",
    "progress",
    "promote",
    "retire_expired",
    "rollback",
    "run_app_id",
    "runner_from_env",
    "spark_catalog",
    "stream_topic",
    "verify",
    "write_catalog_sql",
]

log = logging.getLogger("kappa.replay")

StartMode = Literal["earliest", "timestamp", "offsets"]
EndMode = Literal["live", "timestamp"]
VerifyMode = Literal["strict", "none"]

START_MODES: tuple[str, ...] = ("earliest", "timestamp", "offsets")
END_MODES: tuple[str, ...] = ("live", "timestamp")
VERIFY_MODES: tuple[str, ...] = ("strict", "none")

#: The preflight's ETA uses the throughput of the last this many replays...
THROUGHPUT_HISTORY = 3
#: ... of at least this many records (a tiny replay measures its start-up, not its rate).
MIN_MEASURED_RECORDS = 10_000
#: A live replay counts as caught up once at most this many records are left behind the log end.
DEFAULT_MAX_LAG = 2_000
#: Records sampled to estimate the average record size.
_SAMPLE_RECORDS = 200
#: Registry states of a version whose replay is past launching.
_BUSY_STATES = frozenset({"caught_up", "verified", "serving"})
_VIEW_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


# ------------------------------------------------------------------------------------------------ errors
class ReplayError(ValueError):
    """A replay step was refused or failed; the message is one line (CLI error, Airflow task failure)."""


class VersionBusy(ReplayError):
    """The requested version already runs or is past building; nothing new is started.

    Attributes:
        record: Its registry row (None if only the runner knows it).
    """

    def __init__(self, message: str, record: VersionRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


# ------------------------------------------------------------------------------------------------ request
@dataclass(frozen=True, kw_only=True)
class ReplayRequest:
    """What to replay and how, as given by the CLI or the DAG's Params.

    Attributes:
        view: View name (``kappa/platform.yaml``).
        version: Version to build (declared under ``versions`` of the view).
        start: ``earliest`` (log start), ``timestamp`` (first offsets at ``start_timestamp_ms``) or ``offsets``.
        start_timestamp_ms: Start time (epoch ms) for ``start="timestamp"``.
        start_offsets: For ``start="offsets"``: ``{"<partition>": offset}`` or Spark's
            ``{"<topic>": {"<partition>": offset}}`` (dict or JSON text), every partition of the topic.
        end: ``live`` (keep running; caught up = small lag) or ``timestamp`` (bounded: records with a Kafka
            timestamp before ``end_timestamp_ms``, then the job stops).
        end_timestamp_ms: End time (epoch ms) for ``end="timestamp"``.
        verify: ``strict`` (equality with a recompute of its own transform, and with the plain-Python oracle where
            one exists) or ``none``.
        auto_promote: Switch the serving alias once verified.
        keep_hours: How long the replaced version's table is kept for rollback.
        triggered_by: Who asks (``cli:<user>``, ``airflow:<dag>:<run id>``); recorded in the registry.
        max_offsets_per_trigger: Micro-batch size bound of the replay job (None: Spark's default, unbounded).
        max_lag: A live replay is caught up once at most this many records are left behind the log end.
        metrics_port: Prometheus port of the job (None: the runner's choice, a stable port per version locally).
        watch_minutes: After an automatic promotion, watch the new version this long and roll back when it breaks
            (:mod:`kappa.watch`; 0: no watch).
        watch_max_quarantine_rate: The watch's limit on the share of records quarantined since the switch.
        watch_max_lag: The watch's limit on the records the new version lags behind (for several checks).
    """

    view: str
    version: int
    start: StartMode = "earliest"
    start_timestamp_ms: int | None = None
    start_offsets: Mapping[str, Any] | str | None = None
    end: EndMode = "live"
    end_timestamp_ms: int | None = None
    verify: VerifyMode = "strict"
    auto_promote: bool = False
    keep_hours: float = 24.0
    triggered_by: str = ""
    max_offsets_per_trigger: int | None = None
    max_lag: int = DEFAULT_MAX_LAG
    metrics_port: int | None = None
    watch_minutes: float = 10.0
    watch_max_quarantine_rate: float = 0.05
    watch_max_lag: int = 50_000

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return f"{self.view}@v{self.version}"

    @property
    def bounded(self) -> bool:
        """True for a bounded replay (``end="timestamp"``)."""
        return self.end == "timestamp"

    def validate(self) -> ReplayRequest:
        """Check every field; returns ``self``.

        Raises:
            ReplayError: The first problem, as one line naming the parameter.
        """
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.view, str) or not _VIEW_NAME.match(self.view):
            raise ReplayError(f"view {self.view!r}: expected a view name of kappa/platform.yaml (lower_snake_case)")
        if not integer(self.version) or self.version < 1:
            raise ReplayError(f"version {self.version!r}: expected an integer >= 1")
        if self.start not in START_MODES:
            raise ReplayError(f"start {self.start!r}: expected one of {', '.join(START_MODES)}")
        if self.start == "timestamp":
            if not integer(self.start_timestamp_ms) or self.start_timestamp_ms < 0:
                raise ReplayError("start=timestamp needs start_timestamp_ms (epoch milliseconds >= 0)")
        elif self.start_timestamp_ms is not None:
            raise ReplayError(f"start_timestamp_ms is only used with start=timestamp (start is {self.start})")
        if self.start == "offsets":
            if self.start_offsets in (None, "", {}):
                raise ReplayError('start=offsets needs start_offsets, e.g. {"0": 1200, "1": 1180}')
            _parse_offsets(self.start_offsets, None)
        elif self.start_offsets not in (None, "", {}):
            raise ReplayError(f"start_offsets is only used with start=offsets (start is {self.start})")
        if self.end not in END_MODES:
            raise ReplayError(f"end {self.end!r}: expected one of {', '.join(END_MODES)}")
        if self.end == "timestamp":
            if not integer(self.end_timestamp_ms) or self.end_timestamp_ms < 0:
                raise ReplayError("end=timestamp needs end_timestamp_ms (epoch milliseconds >= 0)")
            if self.start == "timestamp" and self.end_timestamp_ms <= self.start_timestamp_ms:  # type: ignore[operator]
                raise ReplayError(f"end_timestamp_ms {self.end_timestamp_ms} is not after start_timestamp_ms "
                                  f"{self.start_timestamp_ms}")
        elif self.end_timestamp_ms is not None:
            raise ReplayError(f"end_timestamp_ms is only used with end=timestamp (end is {self.end})")
        if self.verify not in VERIFY_MODES:
            raise ReplayError(f"verify {self.verify!r}: expected one of {', '.join(VERIFY_MODES)}")
        if not isinstance(self.auto_promote, bool):
            raise ReplayError(f"auto_promote {self.auto_promote!r}: expected true or false")
        if isinstance(self.keep_hours, bool) or not isinstance(self.keep_hours, (int, float)) or self.keep_hours < 0:
            raise ReplayError(f"keep_hours {self.keep_hours!r}: expected a number >= 0")
        if self.max_offsets_per_trigger is not None and (
                not integer(self.max_offsets_per_trigger) or self.max_offsets_per_trigger < 1):
            raise ReplayError(f"max_offsets_per_trigger {self.max_offsets_per_trigger!r}: expected an integer >= 1")
        if not integer(self.max_lag) or self.max_lag < 0:
            raise ReplayError(f"max_lag {self.max_lag!r}: expected an integer >= 0 (records)")
        if self.metrics_port is not None and (not integer(self.metrics_port) or not 0 <= self.metrics_port < 65536):
            raise ReplayError(f"metrics_port {self.metrics_port!r}: expected a TCP port")
        number = (int, float)
        if isinstance(self.watch_minutes, bool) or not isinstance(self.watch_minutes, number) or self.watch_minutes < 0:
            raise ReplayError(f"watch_minutes {self.watch_minutes!r}: expected a number >= 0 (0: no watch)")
        if (isinstance(self.watch_max_quarantine_rate, bool) or not isinstance(self.watch_max_quarantine_rate, number)
                or not 0 <= self.watch_max_quarantine_rate <= 1):
            raise ReplayError(f"watch_max_quarantine_rate {self.watch_max_quarantine_rate!r}: expected a share "
                              "within [0, 1]")
        if not integer(self.watch_max_lag) or self.watch_max_lag < 0:
            raise ReplayError(f"watch_max_lag {self.watch_max_lag!r}: expected an integer >= 0 (records)")
        if not isinstance(self.triggered_by, str) or not self.triggered_by.strip():
            raise ReplayError("triggered_by is required (e.g. cli:<user> or airflow:<dag>:<run id>)")
        return self

    def watch_policy(self, poll_seconds: float | None = None) -> Any:
        """The :class:`kappa.watch.WatchPolicy` of this request (poll every ``KAPPA_WATCH_POLL_SECONDS``, 15)."""
        from kappa.watch import WatchPolicy

        poll = poll_seconds or float(os.environ.get("KAPPA_WATCH_POLL_SECONDS", "15"))
        return WatchPolicy(minutes=float(self.watch_minutes), poll_seconds=poll, max_lag=self.watch_max_lag,
                           max_quarantine_rate=float(self.watch_max_quarantine_rate))

    @classmethod
    def from_params(cls, params: Mapping[str, Any], *, triggered_by: str) -> ReplayRequest:
        """Build and validate a request from the ``kappa_replay`` DAG's Params (unknown keys are ignored).

        Raises:
            ReplayError: A parameter is missing or invalid.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"triggered_by"}
        values = {k: v for k, v in params.items() if k in names and v is not None}
        if "view" not in values or "version" not in values:
            raise ReplayError("params view and version are required")
        try:
            req = cls(**values, triggered_by=triggered_by)
        except TypeError as exc:
            raise ReplayError(f"invalid replay parameters: {one_line(exc)}") from None
        return req.validate()


def parse_start(text: str) -> dict[str, Any]:
    """CLI ``--start``: ``earliest`` | ``ts:<epoch ms>`` | JSON offsets -> :class:`ReplayRequest` fields."""
    value = (text or "").strip()
    if value == "earliest":
        return {"start": "earliest"}
    if value.startswith("ts:"):
        if not value[3:].isdigit():
            raise ReplayError(f"--start {text!r}: expected ts:<epoch milliseconds>")
        return {"start": "timestamp", "start_timestamp_ms": int(value[3:])}
    if value.startswith("{"):
        _parse_offsets(value, None)
        return {"start": "offsets", "start_offsets": value}
    raise ReplayError(f"--start {text!r}: expected earliest, ts:<epoch ms> or JSON offsets")


def parse_end(text: str) -> dict[str, Any]:
    """CLI ``--end``: ``live`` | ``ts:<epoch ms>`` -> :class:`ReplayRequest` fields."""
    value = (text or "").strip()
    if value == "live":
        return {"end": "live"}
    if value.startswith("ts:") and value[3:].isdigit():
        return {"end": "timestamp", "end_timestamp_ms": int(value[3:])}
    raise ReplayError(f"--end {text!r}: expected live or ts:<epoch ms>")


def _parse_offsets(value: Mapping[str, Any] | str | None, topics: tuple[str, ...] | None) -> dict[int, int]:
    """``{"p": o}`` or ``{"topic": {"p": o}}`` (dict or JSON) -> ``{p: o}``; checks the topic name if given."""
    if value is None or value == "":
        return {}
    data: Any = value
    if isinstance(value, str):
        try:
            data = json.loads(value)
        except ValueError as exc:
            raise ReplayError(f"start_offsets is not valid JSON: {exc}") from None
    if not isinstance(data, Mapping) or not data:
        raise ReplayError('start_offsets must be a JSON object like {"0": 1200} or {"<topic>": {"0": 1200}}')
    if all(isinstance(v, Mapping) for v in data.values()):
        if len(data) != 1:
            raise ReplayError(f"start_offsets names {len(data)} topics; a view streams from one")
        (named, data), = data.items()
        if topics is not None and named not in topics:
            raise ReplayError(f"start_offsets are for topic {named!r}, but the view streams from {topics[-1]!r}")
    out: dict[int, int] = {}
    for p, o in data.items():
        try:
            part, off = int(p), int(o)
        except (TypeError, ValueError):
            raise ReplayError(f"start_offsets: partition {p!r} -> {o!r} is not an integer pair") from None
        if part < 0 or off < 0 or isinstance(o, bool):
            raise ReplayError(f"start_offsets: partition {p} -> {o}: partitions and offsets are >= 0")
        out[part] = off
    return out


def _spark_offsets(topic: str, offsets: Mapping[int, int]) -> str:
    """Spark's JSON form ``{"topic": {"0": 12, ...}}`` (also what the registry stores)."""
    return json.dumps({topic: {str(p): int(o) for p, o in sorted(offsets.items())}}, sort_keys=True)


def _offsets_from_json(text: str | None) -> dict[int, int]:
    """Registry / Spark JSON offsets (single topic) -> ``{p: o}`` (empty when absent)."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    if isinstance(data, Mapping) and data and all(isinstance(v, Mapping) for v in data.values()):
        data = next(iter(data.values()))
    if not isinstance(data, Mapping):
        return {}
    try:
        return {int(p): int(o) for p, o in data.items()}
    except (TypeError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------ plumbing
def runner_from_env(settings: Settings) -> Runner:
    """The job runner chosen by ``KAPPA_RUNNER``: ``local`` (default, processes) or ``kubernetes``."""
    kind = os.environ.get("KAPPA_RUNNER", "local").strip().lower() or "local"
    if kind == "local":
        from kappa.runners.local import LocalRunner

        return LocalRunner(settings)
    if kind == "kubernetes":
        from kappa.runners.kubernetes import KubernetesRunner

        return KubernetesRunner.from_env()  # type: ignore[return-value]
    raise ReplayError(f"KAPPA_RUNNER={kind!r}: expected local or kubernetes")


def _catalog() -> Any:
    from kappa.catalog import load_catalog

    return load_catalog()


def _module(view: str, version: int) -> str:
    """Module of a declared view version, or a one-line ReplayError naming what is declared."""
    views = _catalog().views
    if view not in views:
        raise ReplayError(f"unknown view {view!r}; declared views: {', '.join(sorted(views))}")
    spec = views[view]
    if version not in spec.versions:
        raise ReplayError(f"{view} has no version {version} in kappa/platform.yaml "
                          f"(declared: {', '.join(map(str, sorted(spec.versions)))})")
    return spec.versions[version]


@functools.lru_cache(maxsize=64)
def stream_topic(view: str, version: int) -> str:
    """The declared topic a view version streams from (its ``ViewDefinition.stream_topic``)."""
    from kappa.view import load_view

    return load_view(_module(view, version)).stream_topic


def _topic(settings: Settings, view: str, version: int) -> str:
    """Physical Kafka topic of the version's stream (``KAPPA_TOPIC_PREFIX`` applied)."""
    return settings.topic(stream_topic(view, version))


def _paths(settings: Settings, view: str, version: int) -> Any:
    from kappa.job import ViewPaths

    return ViewPaths(settings.lake_uri, view, version)


def _registry(settings: Settings) -> Registry:
    return Registry(settings.lake_uri)


def _alias(settings: Settings) -> Any:
    from kappa.serving import ServingAlias

    return ServingAlias(settings.lake_uri)


def _batch_boundaries(settings: Settings, view: str, version: int, table: Any, app_id: str, topic: str,
                      upto: int) -> list[Any]:
    """Every batch boundary of the run up to ``upto``: from the Delta commits (:mod:`kappa.lineage`, complete
    for the table's history; batches of a bulk catch-up are commits of the run's staging table), else from the
    checkpoint (only its last ``minBatchesToRetain`` batches)."""
    history = batches_from_history(_run_commits(settings, view, version, table), app_id, upto=upto)
    if [b.batch_id for b in history] == list(range(upto + 1)):
        return history
    checkpoint = checkpoint_batches(f"{_paths(settings, view, version).checkpoint}/main", topic, upto=upto)
    merged = {b.batch_id: b for b in checkpoint}
    merged.update({b.batch_id: b for b in history})
    return [merged[b] for b in sorted(merged)]


def _run_commits(settings: Settings, view: str, version: int, table: Any) -> list[dict[str, Any]]:
    """Commit infos of the version's table and of its staging table (bulk catch-up), any order."""
    from deltalake import DeltaTable

    commits = list(table.history())
    staging = _paths(settings, view, version).staging
    if DeltaTable.is_deltatable(staging):
        commits += DeltaTable(staging).history()
    return commits


def expectations_check(settings: Settings, view: str, version: int, *, upto: int | None = None) -> Any:
    """The version's expectation counts over its run (from the Delta commits' lineage) against the declared
    limits, as a :class:`kappa.recompute.Check` named ``expectations`` (None: the version declares none)."""
    from deltalake import DeltaTable

    from kappa.lineage import expectations_from_history
    from kappa.recompute import Check
    from kappa.view import load_view

    definition = load_view(_module(view, version))
    if not definition.expectations:
        return None
    table_path = _paths(settings, view, version).table
    rows, violations = 0, {}
    if DeltaTable.is_deltatable(table_path):
        table = DeltaTable(table_path)
        app_id = run_app_id(settings, view, version) or ""
        rows, violations = expectations_from_history(_run_commits(settings, view, version, table), app_id, upto=upto)
    broken, parts = [], []
    for rule in definition.expectations:
        n = violations.get(rule.name, 0)
        rate = n / rows if rows else 0.0
        limit = 0.0 if rule.on_violation == "fail" else rule.max_violation_rate
        text = f"{rule.name} ({rule.on_violation}) {n:,} of {rows:,} rows ({rate:.1%}"
        text += f", max {limit:.1%})" if limit is not None else ")"
        parts.append(text)
        if limit is not None and rate > limit:
            broken.append(text)
    message = ("expectations over their limit: " + "; ".join(broken)) if broken else \
        ("expectations: " + "; ".join(parts))
    return Check(name="expectations", passed=not broken, rows=rows, message=message,
                 details={"rows": rows, "violations": violations,
                          "limits": {r.name: (0.0 if r.on_violation == "fail" else r.max_violation_rate)
                                     for r in definition.expectations}})


def committed_offsets(settings: Settings, view: str, version: int, topic: str) -> tuple[dict[int, int], int | None]:
    """End offsets of the last *committed* micro-batch of the view version's main query (and its id)."""
    return last_commit(f"{_paths(settings, view, version).checkpoint}/main", topic)


def _run_info(settings: Settings, view: str, version: int) -> dict[str, Any]:
    return run_info(_paths(settings, view, version).checkpoint)


def _table_run_id(table: str) -> str | None:
    """``kappa.runId`` property the job stamped on its Delta table (None if no table yet)."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(table):
        return None
    return DeltaTable(table).metadata().configuration.get("kappa.runId") or None


def run_app_id(settings: Settings, view: str, version: int) -> str | None:
    """Delta appId of the version's run: from the table's run id, else the checkpoint's run.json."""
    run = _table_run_id(_paths(settings, view, version).table) or _run_info(settings, view, version).get("run_id")
    return f"kappa:{view}@v{version}:{run}" if run else None


def _ensure_run_id(settings: Settings, view: str, version: int, record: VersionRecord | None) -> str:
    """The run id the version's job will use; for local lakes written to run.json before the job starts.

    The job reads ``run.json`` from its checkpoint when it exists, so the registry row can carry the exact Delta
    appId from the start. On object-store lakes the job picks its own id; :func:`progress` records it later.
    """
    known = _table_run_id(_paths(settings, view, version).table) or _run_info(settings, view, version).get("run_id")
    if known:
        return str(known)
    if record is not None and not record.app_id.endswith(":pending"):
        run_id = record.app_id.rsplit(":", 1)[-1]
    else:
        run_id = uuid.uuid4().hex[:12]
    paths = _paths(settings, view, version)
    if paths.is_local:
        run_file = paths.local("run.json")
        run_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = run_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"run_id": run_id, "view": view, "version": version, "created": time.time(),
                                   "created_by": "kappa.replay"}, indent=2))
        os.replace(tmp, run_file)
        return run_id
    return "pending"


# ------------------------------------------------------------------------------------------------ preflight
@dataclass(frozen=True, kw_only=True)
class Preflight:
    """What :func:`preflight` found; JSON-friendly (:meth:`to_dict`) so a DAG can pass it between tasks.

    Attributes:
        request: The validated request.
        module: Module implementing the version.
        topic: Stream topic of the version.
        start_offsets: Resolved start offset per partition (the registry's record when resuming).
        log_start: Earliest retained offset per partition.
        log_end: Log end offset per partition, at preflight time.
        target_offsets: Where the replay is complete: the log end (live) or the first offsets at the end
            timestamp (bounded).
        records: Records to replay (``target - start``; live logs keep growing).
        avg_record_bytes: Average key + value size of a sample of the records.
        bytes_estimate: ``records * avg_record_bytes``.
        throughput: Records/s this platform replayed at (earlier replays), None when not measured yet.
        throughput_source: Where it comes from, or why it is unknown.
        eta_seconds: ``records / throughput`` (None: unknown until the replay's first batches give a rate).
        existing_state: Registry state of the version if it was registered already (resume), else None.
        job_state: Runner status of its job.
    """

    request: ReplayRequest
    module: str
    topic: str
    start_offsets: dict[int, int]
    log_start: dict[int, int]
    log_end: dict[int, int]
    target_offsets: dict[int, int]
    records: int
    avg_record_bytes: float
    bytes_estimate: int
    throughput: float | None
    throughput_source: str
    eta_seconds: float | None
    existing_state: str | None = None
    job_state: str = "stopped"

    @property
    def starting(self) -> str:
        """The job's start position: Spark JSON offsets ``{"topic": {"0": o, ...}}``."""
        return _spark_offsets(self.topic, self.start_offsets)

    def summary(self) -> str:
        """One human line: what will be replayed, how big, how long."""
        what = (f"{self.request.ref}: replay {self.records:,} records (~{_human_bytes(self.bytes_estimate)}) of "
                f"{self.topic} from {_short_offsets(self.start_offsets)}")
        end = (f" until ts {self.request.end_timestamp_ms}" if self.request.bounded else " then follow live")
        if self.throughput is None or self.eta_seconds is None:
            eta = f"; ETA unknown until its first micro-batches ({self.throughput_source})"
        else:
            eta = (f"; ETA ~{_human_seconds(self.eta_seconds)} at {self.throughput:,.0f} rec/s "
                   f"({self.throughput_source})")
        resume = f"; resuming ({self.existing_state}, job {self.job_state})" if self.existing_state else ""
        return what + end + eta + resume

    def plan(self) -> list[str]:
        """The steps a replay of this request would take, one line each (what ``--dry-run`` prints)."""
        req = self.request
        if self.existing_state:
            steps = [f"follow {req.ref}, already {self.existing_state} (job {self.job_state}); register nothing"]
        else:
            batches = (f" in micro-batches of at most {req.max_offsets_per_trigger:,} records"
                       if req.max_offsets_per_trigger else "")
            steps = [f"register {req.ref} as building in the registry (code {self.module}, start "
                     f"{_short_offsets(self.start_offsets)})",
                     f"start its job from those offsets{batches}, writing a table of its own"]
        steps.append(f"wait until it processed every record before ts {req.end_timestamp_ms} and stopped"
                     if req.bounded else f"wait until it lags at most {req.max_lag:,} records behind the log end "
                     "(or no more than the serving version)")
        steps.append("verify: strict - the table must equal the plain-Python oracle over the offsets it holds"
                     if req.verify == "strict" else "verify: none - accept the table as it is")
        steps.append(f"promote: switch readers to {req.ref} in one Delta commit, keep the replaced version "
                     f"{req.keep_hours:g} h" if req.auto_promote else
                     f"do not promote (later: kappa promote {req.view} --version {req.version})")
        return steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (int keys become strings)."""
        out = dataclasses.asdict(self)
        out["request"] = dataclasses.asdict(self.request)
        for name in ("start_offsets", "log_start", "log_end", "target_offsets"):
            out[name] = {str(p): o for p, o in getattr(self, name).items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Preflight:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        values["request"] = ReplayRequest(**values["request"])
        for name in ("start_offsets", "log_start", "log_end", "target_offsets"):
            values[name] = {int(p): int(o) for p, o in values[name].items()}
        return cls(**values)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _human_seconds(s: float | None) -> str:
    if s is None or s != s or s == float("inf"):
        return "unknown"
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _short_offsets(offsets: Mapping[int, int]) -> str:
    return "{" + ", ".join(f"{p}:{o}" for p, o in sorted(offsets.items())) + "}"


def _describe_start(req: ReplayRequest) -> str:
    if req.start == "timestamp":
        return f"ts:{req.start_timestamp_ms}"
    return "offsets" if req.start == "offsets" else "earliest"


def preflight(req: ReplayRequest, settings: Settings, runner: Runner, *, resume: bool = False,
              check_start: bool = True) -> Preflight:
    """Check that a replay can start and estimate its size and duration; changes nothing.

    Args:
        req: The request (validated here).
        settings: Platform settings (Kafka, lake).
        runner: Job runner (asked whether the version already runs).
        resume: Follow an existing run of the version instead of refusing it (DAG reruns). A version that
            already serves is still reported via :class:`VersionBusy`.
        check_start: When resuming, refuse a request whose start differs from the one the version was launched
            with (False: follow the run whatever its start, e.g. ``kappa replay`` without ``--start``).

    Raises:
        ReplayError: Invalid request, unknown view/version, version registered with other code, retired
            version, a start the topic's retention no longer covers (one line naming every partition's gap), or
            a start other than the one the version is already building from.
        VersionBusy: The version already runs or is past building (without ``resume``), or already serves.
    """
    from kappa.topics import TopicError, offsets_for_timestamp, partition_offsets

    req.validate()
    module = _module(req.view, req.version)
    declared = stream_topic(req.view, req.version)
    topic = settings.topic(declared)
    registry = _registry(settings)
    existing = registry.get(req.view, req.version)
    job = runner.status(req.view, req.version)
    if existing is not None:
        current_hash = code_hash(module)
        if existing.code_hash != current_hash:
            raise ReplayError(f"{req.ref} was registered with other code (sha256 {existing.code_hash[:12]}, now "
                              f"{current_hash[:12]}); a version's table belongs to its code: create version "
                              f"{req.version + 1}")
        if existing.state == "retired":
            raise ReplayError(f"{req.ref} is retired; serve it again with `kappa rollback {req.view} --to "
                              f"{req.version}` instead of replaying it")
        if existing.state == "serving":
            raise VersionBusy(f"{req.ref} already serves; nothing to replay", existing)
    if existing is None and job.state == "running":
        raise VersionBusy(f"{req.ref} already runs ({job.detail}) but is not registered (started by hand?); its "
                          "start is unknown, so it cannot be verified - stop it with `kappa view stop "
                          f"{req.view} --version {req.version}` and replay again")
    busy = job.state == "running" or (existing is not None and existing.state in _BUSY_STATES)
    if busy and not resume:
        state = existing.state if existing is not None else "unregistered"
        raise VersionBusy(f"{req.ref} is already {state} (job {job.state}: {job.detail}); refusing to start it "
                          "again - see `kappa status`, or stop it with `kappa view stop "
                          f"{req.view} --version {req.version}`", existing)

    try:
        bounds = partition_offsets(settings, topic)
    except TopicError as exc:
        raise ReplayError(f"{req.ref}: {one_line(exc)}") from None
    log_start = {p: lo for p, (lo, _hi) in bounds.items()}
    log_end = {p: hi for p, (_lo, hi) in bounds.items()}

    def requested() -> dict[int, int]:
        if req.start == "earliest":
            return dict(log_start)
        if req.start == "timestamp":
            return offsets_for_timestamp(settings, topic, int(req.start_timestamp_ms or 0))
        asked = _parse_offsets(req.start_offsets, (declared, topic))
        missing = sorted(set(log_end) - set(asked))
        unknown = sorted(set(asked) - set(log_end))
        if missing or unknown:
            raise ReplayError(f"start_offsets must name every partition of {topic} "
                              f"({', '.join(map(str, sorted(log_end)))}); missing {missing or '-'}, "
                              f"unknown {unknown or '-'}")
        beyond = {p: o for p, o in asked.items() if o > log_end[p]}
        if beyond:
            raise ReplayError(f"start_offsets beyond the log end of {topic}: " + ", ".join(
                f"partition {p} -> {o} (end {log_end[p]})" for p, o in sorted(beyond.items())))
        return asked

    resumed = _offsets_from_json(existing.start_offsets) if existing is not None else {}
    if resumed:
        start = resumed
        if check_start:  # one version, one start: a different one is refused, not silently ignored
            asked = requested()
            # "earliest" still matches a run that started at the log start retention has since moved past
            same = (all(resumed.get(p, 0) <= o for p, o in asked.items()) if req.start == "earliest"
                    else all(resumed.get(p, 0) == o for p, o in asked.items()))
            if not same:
                raise ReplayError(
                    f"{req.ref} is already {existing.state} from {_short_offsets(resumed)}; the requested start "
                    f"({_describe_start(req)}) is {_short_offsets(asked)} - one version has one start: follow it "
                    f"without --start, or replay the new start into version {req.version + 1}")
        # what must still be readable is what the job has not processed yet
        processed, _batch = committed_offsets(settings, req.view, req.version, topic)
        needed = {p: max(o, processed.get(p, o)) for p, o in start.items()}
    else:
        start = requested()
        needed = start
    gaps = {p: (o, log_start[p]) for p, o in needed.items() if p in log_start and o < log_start[p]}
    if gaps:
        paths = _paths(settings, "events_raw", 1)
        detail = "; ".join(f"partition {p} starts at {low} (requested {o}: {low - o:,} records gone)"
                           for p, (o, low) in sorted(gaps.items()))
        raise ReplayError(f"{topic} no longer retains the start of {req.ref}: {detail}. Replay from the events_raw "
                          f"archive ({paths.table}) instead, or start inside retention (earliest / ts:<ms>)")

    if req.bounded:
        at_end = offsets_for_timestamp(settings, topic, int(req.end_timestamp_ms or 0))
        target = {p: max(start.get(p, 0), at_end.get(p, log_end[p])) for p in log_end}
    else:
        target = dict(log_end)
    records = sum(max(0, target[p] - start.get(p, 0)) for p in target)
    avg = _sample_record_bytes(settings, topic, start, target) if records else 0.0
    rate, source = _measured_throughput(registry)
    return Preflight(
        request=req, module=module, topic=topic, start_offsets=dict(sorted(start.items())), log_start=log_start,
        log_end=log_end, target_offsets=target, records=records, avg_record_bytes=avg,
        bytes_estimate=int(records * avg), throughput=rate, throughput_source=source,
        eta_seconds=None if rate is None else records / rate,
        existing_state=existing.state if existing is not None else None, job_state=job.state,
    )


def _sample_record_bytes(settings: Settings, topic: str, start: Mapping[int, int],
                         end: Mapping[int, int], *, limit: int = _SAMPLE_RECORDS, timeout: float = 5.0) -> float:
    """Average key + value size of up to ``limit`` records from the start of the range."""
    from confluent_kafka import Consumer, TopicPartition

    parts = [p for p in end if end[p] > start.get(p, 0)]
    if not parts:
        return 0.0
    consumer = Consumer(settings.kafka_client_config({
        "group.id": f"kappa-preflight-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "enable.partition.eof": False, "auto.offset.reset": "earliest"}))
    sizes: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, p, start.get(p, 0)) for p in parts])
        deadline = time.monotonic() + timeout
        while len(sizes) < limit and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=limit - len(sizes), timeout=0.5):
                if msg.error() is None:
                    sizes.append(len(msg.key() or b"") + len(msg.value() or b""))
    finally:
        consumer.close()
    return sum(sizes) / len(sizes) if sizes else 0.0


def _measured_throughput(registry: Registry) -> tuple[float | None, str]:
    """Records/s this platform replayed at: all records over all seconds (registration -> caught_up, start-up
    included) of the last :data:`THROUGHPUT_HISTORY` replays of at least :data:`MIN_MEASURED_RECORDS` records.
    (None, why) when there is no such replay: the ETA is then unknown until the replay's own batches give a rate -
    never a made-up figure."""
    try:
        events = registry.events()
        records = {(r.view, r.version): r for r in registry.list()}
    except Exception as exc:  # noqa: BLE001 - an unreadable registry only costs the estimate
        log.warning("cannot read replay history for the ETA: %s", one_line(exc))
        return None, f"replay history unreadable: {one_line(exc)}"
    registered: dict[tuple[str, int], datetime] = {}
    runs: list[tuple[datetime, int, float, str]] = []
    for e in events:
        key = (e.view, e.version)
        if e.from_state is None:
            registered[key] = e.at
        elif e.to_state == "caught_up" and e.from_state == "building" and key in registered:
            rec = records.get(key)
            if rec is None:
                continue
            start, end = _offsets_from_json(rec.start_offsets), _offsets_from_json(rec.end_offsets)
            done = sum(max(0, end.get(p, o) - o) for p, o in start.items())
            seconds = (e.at - registered.pop(key)).total_seconds()
            if done >= MIN_MEASURED_RECORDS and seconds > 0:
                runs.append((e.at, done, seconds, rec.ref))
    if not runs:
        return None, f"no replay of >= {MIN_MEASURED_RECORDS:,} records measured here yet"
    last = sorted(runs)[-THROUGHPUT_HISTORY:]
    rate = sum(r[1] for r in last) / sum(r[2] for r in last)
    refs = ", ".join(r[3] for r in last)
    return rate, f"measured here: {len(last)} replay{'s' if len(last) > 1 else ''} ({refs}), start-up included"


# ------------------------------------------------------------------------------------------------ launch
def adopt_serving(view: str, settings: Settings, *, by: str, exclude: int | None = None) -> VersionRecord | None:
    """Track the version that serves by default (no alias yet) in the registry, so a promote can retire it.

    Before the first switch a view resolves to its catalog ``default_version``, which ``kappa up`` runs without
    registering. When that version has a table, it is registered (code of the catalog module), walked to
    ``serving`` with notes saying it was adopted without verification, and the alias is pointed at it
    explicitly. Idempotent; returns None when there is nothing to adopt.
    """
    alias = _alias(settings)
    registry = alias.registry
    if alias.alias(view) is not None or registry.serving(view) is not None:
        return None
    default = _catalog().views[view].default_version
    if default == exclude or registry.get(view, default) is not None:
        return None  # the default version is being managed through the registry already
    paths = _paths(settings, view, default)
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(paths.table):
        return None
    info = _run_info(settings, view, default)
    starting = info.get("starting") or {}
    if isinstance(starting, Mapping):
        starting = starting.get("startingOffsets") or (
            f"ts:{starting['startingTimestamp']}" if starting.get("startingTimestamp") else "earliest")
    topic = _topic(settings, view, default)
    start_offsets = info.get("start_offsets")
    rec = registry.register(
        view, default, code_module=_module(view, default), table_path=paths.table,
        app_id=run_app_id(settings, view, default) or f"kappa:{view}@v{default}:pending", starting=str(starting),
        triggered_by=by, start_offsets=_spark_offsets(topic, {int(p): int(o) for p, o in start_offsets.items()})
        if start_offsets else None)
    note = "adopted: served as default_version before the registry tracked it (not re-verified)"
    for state in ("caught_up", "verified"):
        if rec.state in {"building", "caught_up"}:  # a concurrent adopter may be ahead: same steps, no-ops
            rec = registry.set_state(view, default, state, by=by, note=note)
    if rec.state == "verified":
        alias.promote(view, default, by=by)
    return registry.get(view, default)


def launch(req: ReplayRequest, settings: Settings, runner: Runner, pre: Preflight) -> VersionRecord:
    """Register the version (state ``building``) and start its job; idempotent.

    Re-registering the same code is a no-op, a job that already runs is left alone, a ``failed`` version is
    moved back to ``building`` and its job restarted (it resumes from its checkpoint). The version serving by
    default is adopted first (:func:`adopt_serving`).

    Raises:
        ReplayError: The registry refused (other code, retired version...) or the runner failed.
    """
    from kappa.runners.base import JobSpec

    req.validate()
    if pre.request.view != req.view or pre.request.version != req.version:
        raise ReplayError(f"preflight was for {pre.request.ref}, not {req.ref}")
    registry = _registry(settings)
    paths = _paths(settings, req.view, req.version)
    try:
        adopt_serving(req.view, settings, by=req.triggered_by, exclude=req.version)
        existing = registry.get(req.view, req.version)
        run_id = _ensure_run_id(settings, req.view, req.version, existing)
        rec = registry.register(
            req.view, req.version, code_module=pre.module, table_path=paths.table,
            app_id=f"kappa:{req.ref}:{run_id}", starting=pre.starting, triggered_by=req.triggered_by,
            start_offsets=pre.starting)
        if rec.state == "retired":
            raise ReplayError(f"{req.ref} is retired; use `kappa rollback {req.view} --to {req.version}`")
        if rec.state == "failed":
            rec = registry.set_state(req.view, req.version, "building", by=req.triggered_by, expected={"failed"},
                                     note=f"relaunched after failure: {rec.note or '?'}")
    except RegistryError as exc:
        raise ReplayError(one_line(exc)) from None
    status = runner.status(req.view, req.version)
    if status.state != "running" and not (status.state == "finished" and req.bounded):
        spec = JobSpec(req.view, req.version, starting=rec.starting, end_timestamp_ms=req.end_timestamp_ms,
                       max_offsets_per_trigger=req.max_offsets_per_trigger,
                       metrics_port=req.metrics_port)
        try:
            status = runner.start(spec)
        except Exception as exc:  # noqa: BLE001 - runner errors (process, Kubernetes API) become one line
            raise ReplayError(f"{req.ref}: starting the job failed: {one_line(exc)}") from None
        log.info("%s: job %s (%s) %s", req.ref, status.state, status.detail, status.metrics_url or "")
    return rec


# ------------------------------------------------------------------------------------------------ progress
@dataclass(frozen=True, kw_only=True)
class Progress:
    """How far a version's job got (a sample; two samples give a rate).

    Attributes:
        view: View name.
        version: Version.
        topic: Stream topic.
        start_offsets: Where the run started.
        processed_offsets: End offsets of the last committed micro-batch (start offsets if none yet).
        target_offsets: The run's fixed target (:mod:`kappa.checkpoint`): the log end when the run started
            (live) or the offsets at the end timestamp (bounded).
        batch_id: Last committed micro-batch (None: none yet).
        done: Records processed since the start, up to the target.
        total: Records from the start to the target.
        ratio: ``done / total`` (1.0 when there is nothing to do); never goes down for one run.
        lag: Records between the processed offsets and the log end (live) or the end timestamp (bounded).
        rate: Records/s between the previous sample and this one; when no micro-batch completed in between, the
            average since the version was registered (None when nothing was processed yet).
        eta_seconds: ``lag / rate`` (None when unknown).
        sampled_at: Time of the sample (UTC).
        job_state: Runner status of the job (``running``, ``finished``...), if asked.
        log_end: The log end now (live) or the offsets at the end timestamp (bounded); ``lag`` is measured to it.
    """

    view: str
    version: int
    topic: str
    start_offsets: dict[int, int]
    processed_offsets: dict[int, int]
    target_offsets: dict[int, int]
    batch_id: int | None
    done: int
    total: int
    ratio: float
    lag: int
    rate: float | None
    eta_seconds: float | None
    sampled_at: datetime
    job_state: str | None = None
    log_end: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.log_end:  # a sample built by hand: the target is the log end
            object.__setattr__(self, "log_end", dict(self.target_offsets))

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return f"{self.view}@v{self.version}"

    @property
    def eta_text(self) -> str:
        """The ETA for humans (``42 s``, ``3.5 min``, ``unknown``)."""
        return _human_seconds(self.eta_seconds)

    def summary(self) -> str:
        """One human line."""
        rate = f", {self.rate:,.0f} rec/s" if self.rate is not None else ""
        return (f"{self.ref}: {self.ratio:.1%} ({self.done:,}/{self.total:,} records), lag {self.lag:,}{rate}, "
                f"ETA {_human_seconds(self.eta_seconds)}, batch {self.batch_id if self.batch_id is not None else '-'}")

    def metrics_text(self) -> str:
        """The sample as Prometheus exposition lines (logged by the DAG; the job exports its own gauges)."""
        labels = f'{{view="{self.view}",version="{self.version}"}}'
        lines = [f"kappa_replay_progress_ratio{labels} {self.ratio:.6f}",
                 f"kappa_replay_lag_records{labels} {self.lag}",
                 f"kappa_replay_processed_records{labels} {self.done}"]
        if self.rate is not None:
            lines.append(f"kappa_replay_rate_records_per_second{labels} {self.rate:.3f}")
        if self.eta_seconds is not None:
            lines.append(f"kappa_replay_eta_seconds{labels} {self.eta_seconds:.1f}")
        return "\n".join(lines)


def progress(view: str, version: int, settings: Settings, *, end_timestamp_ms: int | None = None,
             previous: Progress | None = None, record: bool = False, by: str = "kappa:progress") -> Progress:
    """Sample a version's progress from its checkpoint and the log.

    ``ratio`` is :func:`kappa.checkpoint.run_progress` against the run's fixed target (``run.json``; the log end
    now until the job has recorded it), the same number the job exports as ``kappa_replay_progress_ratio``; it
    never goes down. ``lag`` is what remains to the log end (live) or to the end timestamp (bounded).

    Args:
        view: View name.
        version: Version.
        settings: Platform settings.
        end_timestamp_ms: Bounded replays: the end timestamp (target = first offsets at it). None: live.
        previous: An earlier sample for the rate/ETA; default: the registry row's ``end_offsets`` and
            ``updated_at`` (the sample last recorded).
        record: Store this sample in the registry row (``end_offsets`` + a note with ratio, lag and ETA) while
            the version is ``building`` or ``caught_up`` -- how progress is exported without a pushgateway.
        by: Who records it.
    """
    from kappa.topics import offsets_for_timestamp, partition_offsets

    topic = _topic(settings, view, version)
    registry = _registry(settings)
    rec = registry.get(view, version)
    bounds = partition_offsets(settings, topic)
    run = _run_info(settings, view, version)
    start = _offsets_from_json(rec.start_offsets) if rec is not None else {}
    if not start:
        start = offsets_of(run.get("start_offsets")) or {p: lo for p, (lo, _hi) in bounds.items()}
    if end_timestamp_ms is not None:
        at_end = offsets_for_timestamp(settings, topic, end_timestamp_ms)
        log_end = {p: max(start.get(p, 0), at_end.get(p, hi)) for p, (_lo, hi) in bounds.items()}
    else:
        log_end = {p: hi for p, (_lo, hi) in bounds.items()}
    target = offsets_of(run.get("target_offsets")) or dict(log_end)
    processed, batch = committed_offsets(settings, view, version, topic)
    processed = {p: processed.get(p, start.get(p, 0)) for p in log_end}
    counted = run_progress(start, target, processed)
    lag = sum(max(0, log_end[p] - processed[p]) for p in log_end)
    now = datetime.now(UTC)

    def consumed(offsets: Mapping[int, int]) -> int:  # records read since the start (for the rate)
        return sum(max(0, offsets.get(p, start.get(p, 0)) - start.get(p, 0)) for p in log_end)

    prev_consumed: int | None = None
    prev_at: datetime | None = None
    if previous is not None:
        prev_consumed, prev_at = consumed(previous.processed_offsets), previous.sampled_at
    elif rec is not None and rec.end_offsets and rec.state in {"building", "caught_up"}:
        prev_consumed, prev_at = consumed(_offsets_from_json(rec.end_offsets)), rec.updated_at
    rate = eta = None
    if prev_consumed is not None and prev_at is not None and (now - prev_at).total_seconds() > 0.5:
        rate = max(0.0, (consumed(processed) - prev_consumed) / (now - prev_at).total_seconds())
    if not rate and consumed(processed) > 0 and rec is not None and (now - rec.created_at).total_seconds() > 0:
        # no micro-batch since the previous sample (batches are discrete): the average since registration
        rate = consumed(processed) / (now - rec.created_at).total_seconds()
    if lag == 0:
        eta = 0.0
    elif rate:
        eta = lag / rate
    sample = Progress(view=view, version=version, topic=topic, start_offsets=start, processed_offsets=processed,
                      target_offsets=target, batch_id=batch, done=counted.done, total=counted.total,
                      ratio=counted.ratio, lag=lag, rate=rate, eta_seconds=eta, sampled_at=now, log_end=log_end)
    if record and rec is not None and rec.state in {"building", "caught_up"}:
        fields: dict[str, Any] = {"end_offsets": _spark_offsets(topic, processed)}
        app_id = run_app_id(settings, view, version)
        if app_id and app_id != rec.app_id:
            fields["app_id"] = app_id
        if _offsets_from_json(rec.end_offsets) != processed or "app_id" in fields:
            try:
                registry.set_state(view, version, rec.state, by=by, note=sample.summary(), **fields)
            except RegistryError as exc:  # a concurrent state change: the sample is simply not recorded
                log.warning("progress of %s not recorded: %s", sample.ref, one_line(exc))
    return sample


@dataclass(frozen=True)
class CatchUp:
    """Whether a version has caught up, and why (one line, recorded in the registry and shown to operators).

    It is truthy when caught up, so ``if caught_up(...)`` reads naturally.
    """

    done: bool
    reason: str

    def __bool__(self) -> bool:
        return self.done


def caught_up(view: str, version: int, settings: Settings, runner: Runner, *, by: str,
              end_timestamp_ms: int | None = None, max_lag: int = DEFAULT_MAX_LAG,
              sample: Progress | None = None) -> CatchUp:
    """Whether the version's job has caught up (with the reason); when it has, the registry row moves to
    ``caught_up`` with the reason in its note.

    Live (``end_timestamp_ms`` None): the job runs, committed at least one batch and lags at most ``max_lag``
    records behind the log end. When the version serving now lags more than ``max_lag`` itself (a loaded
    machine), the new one has caught up once it lags no more than the serving one - and the reason says so,
    with both lags: it is then as current as what readers see, not within ``max_lag``. Bounded: the job
    finished and processed everything before the end timestamp.

    Raises:
        ReplayError: The job failed or stopped before catching up (the registry row is marked ``failed``).
    """
    status = runner.status(view, version)
    p = sample or progress(view, version, settings, end_timestamp_ms=end_timestamp_ms, record=True, by=by)
    registry = _registry(settings)
    rec = registry.get(view, version)
    ref = f"{view}@v{version}"
    if end_timestamp_ms is not None:
        reached = all(p.processed_offsets.get(part, 0) >= off for part, off in p.log_end.items())
        done = status.state == "finished" and reached
        reason = (f"finished: every record before ts {end_timestamp_ms} processed" if done else
                  f"bounded run {status.state}, {p.lag:,} records before ts {end_timestamp_ms} left")
    elif status.state != "running" or p.batch_id is None:
        done, reason = False, ("no micro-batch committed yet" if status.state == "running" else
                               f"job {status.state}")
    elif p.lag <= max_lag:
        done, reason = True, f"lag {p.lag:,} records <= max_lag {max_lag:,}"
    else:
        serving = _serving_lag(view, version, settings)
        if serving is not None and p.lag <= serving[1]:
            done, reason = True, (f"lag {p.lag:,} records > max_lag {max_lag:,}, but the serving version "
                                  f"v{serving[0]} lags {serving[1]:,} itself: {ref} is as current as what readers "
                                  "see now")
        else:
            behind = f" (the serving version v{serving[0]} lags {serving[1]:,})" if serving is not None else ""
            done, reason = False, f"lag {p.lag:,} records > max_lag {max_lag:,}{behind}"
    stopped = status.state == "failed" or (status.state in {"stopped", "finished"} and not done)
    if stopped:
        reason = f"{ref}: job no longer running ({status.state}: {status.detail}) before catching up; {p.summary()}"
        if rec is not None and rec.state in {"building", "caught_up"}:
            registry.set_state(view, version, "failed", by=by, note=reason[:500])
        raise ReplayError(reason)
    if done and rec is not None and rec.state in {"building", "caught_up"}:
        registry.set_state(view, version, "caught_up", by=by, expected={"building", "caught_up"},
                           end_offsets=_spark_offsets(p.topic, p.processed_offsets),
                           note=f"caught up: {reason}; {p.summary()}"[:500])
    return CatchUp(done, reason)


def _serving_lag(view: str, version: int, settings: Settings) -> tuple[int, int] | None:
    """(version, records it lags behind the log end) of the version serving ``view`` now; None if no other
    version serves, it has committed nothing yet, or its lag cannot be read."""
    try:
        serving = _registry(settings).serving(view)
        if serving is None or serving.version == version:
            return None
        sample = progress(view, serving.version, settings)
        return (serving.version, sample.lag) if sample.batch_id is not None else None
    except Exception as exc:  # noqa: BLE001 - only the comparison is lost; max_lag still applies
        log.warning("%s: cannot sample the serving version's lag: %s", view, one_line(exc))
        return None


# ------------------------------------------------------------------------------------------------ verify
@dataclass(frozen=True, kw_only=True)
class Verification:
    """Outcome of :func:`verify`.

    Attributes:
        view: View name.
        version: Version verified.
        mode: ``strict`` or ``none``.
        passed: Every check passed (always True for ``none``).
        delta_version: Delta version of the table that was checked.
        batch_id: Micro-batch that Delta version holds (txnVersion of the version's appId).
        start_offsets: Start of the checked offset range.
        end_offsets: End (exclusive) of the checked offset range (that batch's end offsets).
        rows: Rows in the table at ``delta_version``.
        expected_rows: Rows the recompute produced.
        missing: Keys expected and absent from the table (the largest count of the checks).
        extra: Keys in the table and not expected (idem).
        different: Keys present in both with different values (idem).
        duplicates: Keys present more than once in the table.
        examples: Up to 5 differences per check, ``"<check>: <key>: ..."``.
        first_difference: The first differing key of the first failed check.
        recompute: The recompute of the version's own transform (:mod:`kappa.recompute`), as a dict.
        oracle: The plain-Python oracle's check (:mod:`kappa.oracle`) when one exists for the version, else None.
        expectations: Violations per expectation over the run and their limits (:func:`expectations_check`),
            None for a version without expectations.
        compared_with: Version serving when verified (None if none, or this version itself).
        only_new: Keys only in this version's table (vs. ``compared_with``).
        only_old: Keys only in the serving version's table.
        changed: Keys in both with different values in the columns both tables have.
        report: The diff report against the serving version (:class:`kappa.diffreport.DiffReport`, with the paths
            of its JSON and PNG files), None when no other version serves.
        message: One human line.
    """

    view: str
    version: int
    mode: str
    passed: bool
    delta_version: int | None = None
    batch_id: int | None = None
    start_offsets: dict[int, int] = field(default_factory=dict)
    end_offsets: dict[int, int] = field(default_factory=dict)
    rows: int = 0
    expected_rows: int = 0
    missing: int = 0
    extra: int = 0
    different: int = 0
    duplicates: int = 0
    examples: tuple[str, ...] = ()
    first_difference: str | None = None
    recompute: dict[str, Any] | None = None
    oracle: dict[str, Any] | None = None
    expectations: dict[str, Any] | None = None
    compared_with: int | None = None
    only_new: int = 0
    only_old: int = 0
    changed: int = 0
    report: dict[str, Any] | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        out = dataclasses.asdict(self)
        out["start_offsets"] = {str(p): o for p, o in self.start_offsets.items()}
        out["end_offsets"] = {str(p): o for p, o in self.end_offsets.items()}
        out["examples"] = list(self.examples)
        return out


def _table_rows(table: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """All rows of a delta-rs table snapshot as dicts (arro3, no pyarrow)."""
    data = table.scan().read_all()
    names = list(data.column_names)
    columns = [data.column(i).to_pylist() for i in range(len(names))]
    return names, [dict(zip(names, values)) for values in zip(*columns)]


def _report_dir(settings: Settings, view: str, version: int) -> Path:
    """Where a version's reports go: ``views/<view>/v<N>/reports`` on a local lake, else under ``$KAPPA_HOME``."""
    paths = _paths(settings, view, version)
    if paths.is_local:
        return Path(local_path(paths.root)) / "reports"
    return Path(settings.home) / "reports" / view / f"v{version}"


def _diff_against_serving(spark: Any, view: str, version: int, settings: Settings, keys: tuple[str, ...],
                          delta_version: int) -> Any:
    """The diff report against the serving version (:mod:`kappa.diffreport`), or None when none serves (or this
    version does)."""
    from deltalake import DeltaTable

    from kappa.diffreport import diff_report

    try:
        target = _alias(settings).target(view)
    except RegistryError:
        return None
    if target.version == version or not DeltaTable.is_deltatable(target.table_path):
        return None
    return diff_report(spark, view=view, version=version, table=_paths(settings, view, version).table,
                       delta_version=delta_version, serving_version=target.version,
                       serving_table=target.table_path, keys=keys, out_dir=_report_dir(settings, view, version))


def _oracle_check(spec: Any, settings: Settings, *, start: Mapping[int, int], end: Mapping[int, int],
                  batches: list[Any], end_timestamp_ms: int | None, rows: list[dict[str, Any]]) -> Any:
    """The plain-Python oracle's recomputation of ``[start, end)`` against the table's ``rows``."""
    from kappa import oracle
    from kappa.recompute import Check

    def validated(records: list[Any], name: str) -> list[Any]:
        fmt = oracle.TOPIC_FORMATS.get(name)
        if fmt is None:
            raise ReplayError(f"the oracle has no record format for topic {name!r} (kappa.oracle.TOPIC_FORMATS)")
        return oracle.validate_records(records, fmt.subject, key_field=fmt.key_field, tombstones=fmt.tombstones)

    topic = settings.topic(spec.stream_topic)
    records = oracle.read_log(settings, topic, start=start or None, end=end)
    if end_timestamp_ms is not None:
        records = [r for r in records if r.timestamp_ms < end_timestamp_ms]
    lookups = {name: validated(oracle.read_log(settings, settings.topic(declared)), declared)
               for name, declared in spec.lookups.items()}
    expected = spec.compute(oracle.OracleInput(events=validated(records, spec.stream_topic), lookups=lookups,
                                               batches=batches if spec.uses_batches else None))
    actual: dict[tuple, tuple] = {}
    duplicates = 0
    for row in rows:
        key, value = spec.adapt(row)
        duplicates += key in actual
        actual[key] = value
    missing = expected.keys() - actual.keys()
    extra = actual.keys() - expected.keys()
    different = [k for k in expected.keys() & actual.keys() if expected[k] != actual[k]]
    found = sorted([(k, f"{k}: missing from the table, oracle={expected[k]}") for k in missing]
                   + [(k, f"{k}: in the table only, table={actual[k]}") for k in extra]
                   + [(k, f"{k}: table={actual[k]} oracle={expected[k]}") for k in different], key=lambda x: str(x[0]))
    examples = tuple(text for _k, text in found[:5])
    passed = not (missing or extra or different or duplicates)
    message = (f"{len(rows):,} rows equal the oracle" if passed else
               f"differs from the oracle: {len(missing)} missing, {len(extra)} extra, {len(different)} different, "
               f"{duplicates} duplicated keys; first differing key {examples[0] if examples else '-'}")
    return Check(name="oracle", passed=passed, rows=len(rows), expected_rows=len(expected), missing=len(missing),
                 extra=len(extra), different=len(different), duplicates=duplicates,
                 first_difference=examples[0] if examples else None, examples=examples, message=message)


def verify(view: str, version: int, settings: Settings, mode: str = "strict", *, by: str,
           end_timestamp_ms: int | None = None) -> Verification:
    """Check a caught-up version; ``verified`` or ``failed`` in the registry.

    ``strict``: open the version's table at its latest Delta version, find the micro-batch it holds (the Delta
    txn of the version's appId) and every batch boundary of the run before it (end offsets, watermark, lookup
    offsets: :mod:`kappa.lineage`, the checkpoint's offset log as a fallback), then

    * **recompute** (every version): Spark re-runs the version's own transform over exactly those micro-batches
      of the log and the view's write semantics over its output (:mod:`kappa.recompute`); the table must hold
      the same keys with the same values, no duplicated key, and the quarantine every invalid record once;
    * **oracle** (versions with an entry in :data:`kappa.oracle.ORACLES`): the independent plain-Python
      recomputation of the same range must equal the table too.

    ``none``: no check, the registry note says so. The serving alias is never touched; a failure marks the
    version ``failed`` with the reason (the first differing key). A serving or failed version is re-checked
    read-only (its state stays). Also reports how the table differs from the
    version currently serving (keys only in the new one, only in the old one, changed values).

    Raises:
        ReplayError: Unknown/unregistered version, not caught up yet, or nothing processed yet.
    """
    from deltalake import DeltaTable

    from kappa import oracle
    from kappa.recompute import recompute, spark_session
    from kappa.view import load_view

    if mode not in VERIFY_MODES:
        raise ReplayError(f"verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    definition = load_view(_module(view, version))
    ref = f"{view}@v{version}"
    registry = _registry(settings)
    rec = registry.get(view, version)
    if rec is None:
        raise ReplayError(f"{ref} is not registered; replay it first (`kappa replay {view} --version {version}`)")
    if rec.state in {"building", "retired"}:
        raise ReplayError(f"{ref} is {rec.state}; only a caught-up version can be verified")
    record_state = rec.state in {"caught_up", "verified"}

    if mode == "none":
        result = Verification(view=view, version=version, mode="none", passed=True,
                              message=f"{ref}: not verified (verify=none), accepted as is")
        if record_state:
            registry.set_state(view, version, "verified", by=by, expected={"caught_up", "verified"},
                               note=result.message)
        return result

    paths = _paths(settings, view, version)
    if not DeltaTable.is_deltatable(paths.table):
        raise ReplayError(f"{ref}: no Delta table at {paths.table} yet")
    table = DeltaTable(paths.table)
    delta_version = table.version()
    run_id = table.metadata().configuration.get("kappa.runId")
    app_id = f"kappa:{ref}:{run_id}" if run_id else rec.app_id
    batch = table.transaction_version(app_id)
    if batch is None:
        raise ReplayError(f"{ref}: Delta version {delta_version} of {paths.table} has no commit of {app_id}; "
                          "nothing processed yet")
    topic = settings.topic(definition.stream_topic)
    batches = _batch_boundaries(settings, view, version, table, app_id, topic, batch)
    if not batches or batches[-1].batch_id != batch:
        raise ReplayError(f"{ref}: neither the Delta history nor the checkpoint has the offsets of batch {batch} "
                          f"(Delta version {delta_version})")
    end = dict(batches[-1].end_offsets)
    start = _offsets_from_json(rec.start_offsets) or {
        int(p): int(o) for p, o in (_run_info(settings, view, version).get("start_offsets") or {}).items()}

    spec = oracle.ORACLES.get((view, version))
    if spec is not None and spec.uses_batches and [b.batch_id for b in batches] != list(range(batch + 1)):
        raise ReplayError(f"{ref}: only batches {batches[0].batch_id}..{batch} have known boundaries (Delta "
                          "history and checkpoint both purged older ones); a strict check of an event-time "
                          "view needs every batch from 0 - verify=none, or replay again")
    with spark_session(settings) as spark:
        checks = [recompute(definition, settings, table_path=paths.table, delta_version=delta_version,
                            batches=batches, start=start, end_timestamp_ms=end_timestamp_ms,
                            quarantine_path=paths.quarantine, spark=spark)]
        report = _diff_against_serving(spark, view, version, settings, definition.keys, delta_version)
    expectations = expectations_check(settings, view, version, upto=batch)
    if expectations is not None:
        checks.append(expectations)
    _names, rows = _table_rows(table)
    if spec is not None:
        checks.append(_oracle_check(spec, settings, start=start, end=end, batches=batches,
                                    end_timestamp_ms=end_timestamp_ms, rows=rows))
    passed = all(c.passed for c in checks)
    failed = [c for c in checks if not c.passed]
    versus = (f"; vs serving v{report.serving_version}: {report.added} keys only here, {report.removed} only "
              f"there, {report.changed} changed (diff report {report.json_path})" if report is not None else "")
    where = f"Delta version {delta_version} = batch {batch}, offsets {_short_offsets(start)}..{_short_offsets(end)}"
    names = " and the ".join(c.name for c in checks if c.name != "expectations")
    quality = f"; {expectations.message}" if expectations is not None else ""
    if passed:
        message = f"{ref}: {len(rows):,} rows equal the {names} ({where}){quality}{versus}"
    else:
        message = f"{ref}: " + "; ".join(f.message for f in failed) + f" ({where}){versus}"
    by_name = {c.name: c for c in checks}
    result = Verification(
        view=view, version=version, mode="strict", passed=passed, delta_version=delta_version, batch_id=batch,
        start_offsets=start, end_offsets=end, rows=len(rows), expected_rows=checks[0].expected_rows,
        missing=max(c.missing for c in checks), extra=max(c.extra for c in checks),
        different=max(c.different for c in checks), duplicates=max(c.duplicates for c in checks),
        examples=tuple(f"{c.name}: {e}" for c in checks for e in c.examples),
        first_difference=failed[0].first_difference if failed else None,
        recompute=by_name["recompute"].to_dict(), oracle=by_name["oracle"].to_dict() if "oracle" in by_name else None,
        expectations=expectations.to_dict() if expectations is not None else None,
        compared_with=report.serving_version if report else None, only_new=report.added if report else 0,
        only_old=report.removed if report else 0, changed=report.changed if report else 0,
        report=report.to_dict() if report else None, message=message)
    if record_state:
        fields: dict[str, Any] = {"end_offsets": _spark_offsets(topic, end)}
        if app_id != rec.app_id:
            fields["app_id"] = app_id
        if passed:
            registry.set_state(view, version, "verified", by=by, expected={"caught_up", "verified"},
                               note=message[:1000], **fields)
        else:
            registry.set_state(view, version, "failed", by=by, note=message[:1000], **fields)
    return result


# ------------------------------------------------------------------------------------------------ switch
def catalog_sql_path(settings: Settings) -> str:
    """``<lake>/_registry/catalog.sql``: the Spark SQL views over the serving aliases."""
    return f"{settings.lake_uri.rstrip('/')}/_registry/catalog.sql"


def _catalog_statements(settings: Settings, database: str) -> list[str]:
    from deltalake import DeltaTable

    alias = _alias(settings)
    statements = [f"CREATE DATABASE IF NOT EXISTS {database}"]
    for view in _catalog().views:
        if DeltaTable.is_deltatable(alias.resolve(view)):
            statements.append(alias.spark_view_sql(view, database=database))
    return statements


def write_catalog_sql(settings: Settings, *, database: str = "analytics") -> str:
    """Write one ``CREATE OR REPLACE VIEW <database>.<view>`` per view whose serving table exists.

    The file (:func:`catalog_sql_path`) is replaced atomically, so a reader never executes half of it.
    Returns its path (local lakes; on object stores the statements are only built by :func:`spark_catalog`).
    """
    statements = _catalog_statements(settings, database)
    path = catalog_sql_path(settings)
    if not is_local_uri(path):
        return path
    target = Path(local_path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    header = f"-- generated by kappa.replay at {datetime.now(UTC).isoformat(timespec='seconds')}: serving aliases\n"
    tmp.write_text(header + "".join(f"{s};\n" for s in statements))
    os.replace(tmp, target)
    return path


def spark_catalog(spark: Any, settings: Settings | None = None, *, refresh: bool = True,
                  database: str = "analytics") -> list[str]:
    """Create ``<database>.<view>`` Spark SQL views for every serving alias (the Spark reader path).

    Executes ``<lake>/_registry/catalog.sql`` (rewritten first with ``refresh``, the default, so it follows the
    current aliases). Returns the view names created.
    """
    if settings is None:
        from kappa.config import Settings

        settings = Settings.from_env()
    path = catalog_sql_path(settings)
    if refresh or (read_text(path) is None and is_local_uri(path)):
        write_catalog_sql(settings, database=database)
    text = read_text(path) if is_local_uri(path) else None
    if text is not None:
        body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
        statements = [s.strip() for s in re.split(r";\s*(?:\n|$)", body) if s.strip()]
    else:
        statements = _catalog_statements(settings, database)
    created = []
    for statement in statements:
        spark.sql(statement)
        m = re.match(r"CREATE OR REPLACE VIEW (\S+)", statement)
        if m:
            created.append(m.group(1))
    return created


def _stop(runner: Runner, view: str, version: int) -> None:
    try:
        status = runner.status(view, version)
        if status.state == "running":
            runner.stop(view, version)
            log.info("%s@v%s: job stopped", view, version)
    except Exception as exc:  # noqa: BLE001 - the switch already happened; report, do not undo it
        raise ReplayError(f"{view}@v{version}: the alias switched, but stopping the old job failed "
                          f"({one_line(exc)}); stop it with `kappa view stop {view} --version {version}`") from None


def promote(view: str, version: int, settings: Settings, runner: Runner, *, by: str,
            keep_hours: float = 24.0) -> SwitchResult:
    """Switch the view's serving alias to a verified version, stop the old version's job; idempotent.

    The switch is :func:`kappa.serving.ServingAlias.promote` (one Delta commit readers see atomically; the
    replaced version becomes ``retired`` with its table kept ``keep_hours`` for rollback). Then the replaced
    version's job is stopped and ``<lake>/_registry/catalog.sql`` is rewritten. Promoting the version that
    already serves changes nothing.

    A version whose expectations broke their declared limits is refused (also one accepted with
    ``verify=none``).

    Raises:
        ReplayError: Not verified, expectations over their limits, table missing, a concurrent switch won, or
            stopping the old job failed.
    """
    _module(view, version)
    current = _registry(settings).get(view, version)
    if current is None or current.state != "serving":
        quality = expectations_check(settings, view, version)
        if quality is not None and not quality.passed:
            raise ReplayError(f"{view}@v{version} cannot be promoted: {quality.message}")
    try:
        adopt_serving(view, settings, by=by, exclude=version)
        result = _alias(settings).promote(view, version, by=by, keep=timedelta(hours=keep_hours))
    except RegistryError as exc:
        raise ReplayError(one_line(exc)) from None
    if result.previous_version is not None and result.previous_version != version:
        _stop(runner, view, result.previous_version)
    write_catalog_sql(settings)
    return result


def rollback(view: str, to_version: int | None, settings: Settings, runner: Runner, *, by: str,
             keep_hours: float = 24.0) -> SwitchResult:
    """Point the alias back to a kept version, restart its job, stop the replaced one; idempotent.

    Args:
        view: View name.
        to_version: Version to serve again (a ``retired`` one whose table is kept); None = the version served
            before the last switch. Automation should pass it: repeating a bare rollback would undo it.
        settings: Platform settings.
        runner: Job runner.
        by: Who asks.
        keep_hours: How long the replaced version's table is kept.

    Raises:
        ReplayError: Nothing to roll back to, or the target's table is gone.
    """
    from kappa.runners.base import JobSpec

    try:
        result = _alias(settings).rollback(view, to_version, by=by, keep=timedelta(hours=keep_hours))
    except RegistryError as exc:
        raise ReplayError(one_line(exc)) from None
    rec = _registry(settings).get(view, result.version)
    if runner.status(view, result.version).state != "running":
        try:
            runner.start(JobSpec(view, result.version, starting=rec.starting if rec else "latest"))
        except Exception as exc:  # noqa: BLE001
            raise ReplayError(f"{view}@v{result.version} serves again, but starting its job failed "
                              f"({one_line(exc)}); start it with `kappa view start {view} --version "
                              f"{result.version}`") from None
    if result.previous_version is not None and result.previous_version != result.version:
        _stop(runner, view, result.previous_version)
    write_catalog_sql(settings)
    return result


def retire_expired(settings: Settings, runner: Runner, *, by: str,
                   now: datetime | None = None) -> list[DeletionResult]:
    """Stop the jobs of retired versions past their keep period and delete their tables and checkpoints."""
    alias = _alias(settings)
    for rec in alias.expired(now):
        _stop(runner, rec.view, rec.version)
    try:
        return alias.delete_expired(now, by=by)
    except RegistryError as exc:
        raise ReplayError(one_line(exc)) from None

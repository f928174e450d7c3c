"""What a replay is asked to do: the request (CLI options, DAG Params), its validation and the offsets it names.

Errors a user can cause are a :class:`ReplayError` (a ``ValueError``) with a one-line message: the CLI prints it,
the DAG fails the task at once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from kappa.config import DEFAULT_KEEP_HOURS
from kappa.errors import KappaError, one_line
from kappa.identity import VIEW_NAME, view_ref

if TYPE_CHECKING:  # pragma: no cover
    from kappa.control.registry import VersionRecord

__all__ = ["DEFAULT_MAX_LAG", "END_MODES", "SOURCE_MODES", "START_MODES", "UPGRADE_MODES", "VERIFY_MODES", "ReplayError",
           "ReplayRequest",
           "VersionBusy", "offsets_from_json", "parse_end", "parse_offsets", "parse_start", "spark_offsets"]

StartMode = Literal["earliest", "timestamp", "offsets"]
EndMode = Literal["live", "timestamp"]
VerifyMode = Literal["strict", "none"]

START_MODES: tuple[str, ...] = ("earliest", "timestamp", "offsets")
END_MODES: tuple[str, ...] = ("live", "timestamp")
VERIFY_MODES: tuple[str, ...] = ("strict", "none")
#: How a version starts (:attr:`kappa.runtime.view.ViewDefinition.upgrade`; the request may override it).
UPGRADE_MODES: tuple[str, ...] = ("replay", "continue")
#: Where a replay reads the records below the log's end (:mod:`kappa.runtime.archive`): ``auto`` - the topic's
#: archive when the log no longer holds them, or when the archive serves at least
#: :data:`kappa.control.replay.planning.ARCHIVE_FASTER_RECORDS` of them (measured faster than the log there); ``log``
#: - never the archive; ``archive`` - the archive as far as it reaches from the start, on every partition.
SOURCE_MODES: tuple[str, ...] = ("auto", "log", "archive")
#: A live replay counts as caught up once at most this many records are left behind the log end.
DEFAULT_MAX_LAG = 2_000


class ReplayError(KappaError, ValueError):
    """A replay step was refused or failed; the message is one line (CLI error, Airflow task failure)."""


class VersionBusy(ReplayError):
    """The requested version already runs or is past building; nothing new is started.

    Attributes:
        record: Its registry row (None if only the runner knows it).
    """

    def __init__(self, message: str, record: VersionRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


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
        upgrade: ``replay`` (rebuild from ``start``), ``continue`` (seed the table with the serving version's rows
            and start where it had got: only records to come see the new logic) or None: the mode the version
            declares (:attr:`kappa.runtime.view.ViewDefinition.upgrade`). ``continue`` takes no ``start``.
        verify: ``strict`` (equality with a recompute of its own transform, and with the plain-Python oracle where
            one exists) or ``none``.
        auto_promote: Switch the serving alias once verified.
        keep_hours: How long the replaced version's table is kept for rollback.
        triggered_by: Who asks (``cli:<user>``, ``airflow:<dag>:<run id>``); recorded in the registry.
        max_offsets_per_trigger: Micro-batch size bound of the replay job (None: Spark's default, unbounded).
        max_lag: A live replay is caught up once at most this many records are left behind the log end.
        metrics_port: Prometheus port of the job (None: the runner's choice, a stable port per version locally).
        watch_minutes: After an automatic promotion, watch the new version this long and roll back when it breaks
            (:mod:`kappa.control.replay.watch`; 0: no watch).
        watch_max_quarantine_rate: The watch's limit on the share of records quarantined since the switch.
        watch_max_lag: The watch's limit on the records the new version lags behind (for several checks).
        cascade: Also build the views over this one against the new version - each dependant's declared version
            that reads what the new version publishes, from earliest - verify them all and switch readers to the
            whole chain in one alias commit (:mod:`kappa.control.replay.cascade`).
        source: Where the replay reads its history: one of :data:`SOURCE_MODES`.
    """

    view: str
    version: int
    start: StartMode = "earliest"
    start_timestamp_ms: int | None = None
    start_offsets: Mapping[str, Any] | str | None = None
    end: EndMode = "live"
    end_timestamp_ms: int | None = None
    upgrade: Literal["replay", "continue"] | None = None
    verify: VerifyMode = "strict"
    auto_promote: bool = False
    keep_hours: float = DEFAULT_KEEP_HOURS
    triggered_by: str = ""
    max_offsets_per_trigger: int | None = None
    max_lag: int = DEFAULT_MAX_LAG
    metrics_port: int | None = None
    watch_minutes: float = 10.0
    watch_max_quarantine_rate: float = 0.05
    watch_max_lag: int = 50_000
    cascade: bool = False
    source: Literal["auto", "log", "archive"] = "auto"

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return view_ref(self.view, self.version)

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

        if not isinstance(self.view, str) or not VIEW_NAME.match(self.view):
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
            parse_offsets(self.start_offsets, None)
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
        if self.upgrade is not None and self.upgrade not in UPGRADE_MODES:
            raise ReplayError(f"upgrade {self.upgrade!r}: expected one of {', '.join(UPGRADE_MODES)}")
        if self.upgrade == "continue" and (self.start != "earliest" or self.end != "live"):
            raise ReplayError("upgrade=continue starts where the serving version got and follows the log: "
                              f"start={self.start} / end={self.end} do not apply (use upgrade=replay)")
        if self.source not in SOURCE_MODES:
            raise ReplayError(f"source {self.source!r}: expected one of {', '.join(SOURCE_MODES)}")
        if self.source == "archive" and self.upgrade == "continue":
            raise ReplayError("upgrade=continue reads only what the serving version has not: source=archive does not "
                              "apply (use upgrade=replay)")
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
        if not isinstance(self.cascade, bool):
            raise ReplayError(f"cascade {self.cascade!r}: expected true or false")
        if self.cascade and self.bounded:
            raise ReplayError("cascade builds live versions (the views over this one follow what it publishes): "
                              "end=timestamp does not apply")
        if not isinstance(self.triggered_by, str) or not self.triggered_by.strip():
            raise ReplayError("triggered_by is required (e.g. cli:<user> or airflow:<dag>:<run id>)")
        return self

    def watch_policy(self, poll_seconds: float | None = None) -> Any:
        """The :class:`kappa.control.replay.watch.WatchPolicy` of this request (poll every ``poll_seconds``,
        default ``KAPPA_WATCH_POLL_SECONDS``, 15)."""
        from kappa.config import Settings
        from kappa.control.replay.watch import WatchPolicy

        poll = poll_seconds or Settings.from_env().watch_poll_seconds
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
        parse_offsets(value, None)
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


def parse_offsets(value: Mapping[str, Any] | str | None, topics: tuple[str, ...] | None) -> dict[int, int]:
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


def spark_offsets(topic: str, offsets: Mapping[int, int]) -> str:
    """Spark's JSON form ``{"topic": {"0": 12, ...}}`` (also what the registry stores)."""
    return json.dumps({topic: {str(p): int(o) for p, o in sorted(offsets.items())}}, sort_keys=True)


def offsets_from_json(text: str | None) -> dict[int, int]:
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

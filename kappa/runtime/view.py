"""What a view version is: a pure transform plus the declarations the plumbing needs.

A view version lives in ``jobs/<view>/v<N>.py`` and exposes ``VIEW = ViewDefinition(...)``. The transform is
a pure function from input DataFrames to the output DataFrame; it never reads Kafka or writes Delta itself.
The same plumbing runs every view: one streaming query (``kappa.runtime.job``, plan in ``kappa.runtime.plan``) reads Kafka ->
decode/quarantine -> transform -> idempotent Delta write keyed by ``(app_id, batch_id)`` (``kappa.runtime.batch``,
``kappa.runtime.sink``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Mapping

from kappa.identity import view_ref
from kappa.runtime.lookups import Lookup
from kappa.runtime.parsing import RecordFormat

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import Column, DataFrame

__all__ = ["UPGRADE_MODES", "Expectation", "ViewDefinition", "Finality", "Publish", "continue_refusal",
           "declared_view", "load_view", "tumbling_window_end"]

WriteMode = Literal["append", "merge", "upsert_delete"]
UpgradeMode = Literal["replay", "continue"]
#: How a new version of a view starts (:attr:`ViewDefinition.upgrade`).
UPGRADE_MODES: tuple[str, ...] = ("replay", "continue")
OnViolation = Literal["warn", "drop", "fail"]
_EXPECTATION_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Expectation:
    """A data-quality rule over the rows a view version writes (its transform's output).

    Attributes:
        name: ``lower_snake_case``; the label of its metrics and the reason of the rows it quarantines.
        condition: Spark SQL boolean expression over an output row that holds for a good row (NULL counts as a
            violation), e.g. ``"view_count >= 0"``.
        on_violation: ``warn`` - count the rows and write them; ``drop`` - keep them out of the table and put them
            in the quarantine (reason ``expectation <name>: <condition>``, the row as JSON in ``raw_value``);
            ``fail`` - stop the job before the micro-batch is written, with the rule and an offending row.
        max_violation_rate: The version cannot be verified nor promoted once more than this fraction of its
            checked rows violated the rule (``None``: no limit; a ``fail`` rule allows none).

    Counts per rule go to the metrics (``kappa_expectation_violations_total``), to each Delta commit's lineage
    (so the totals of a run are exact across restarts), to the verification result and the registry's audit log.
    """

    name: str
    condition: str
    on_violation: OnViolation = "warn"
    max_violation_rate: float | None = None

    def __post_init__(self) -> None:
        if not _EXPECTATION_NAME.match(self.name):
            raise ValueError(f"expectation name {self.name!r}: use lower_snake_case")
        if self.on_violation not in ("warn", "drop", "fail"):
            raise ValueError(f"expectation {self.name}: on_violation {self.on_violation!r}: use warn, drop or fail")
        if not self.condition.strip():
            raise ValueError(f"expectation {self.name}: empty condition")
        if self.max_violation_rate is not None and not 0.0 <= self.max_violation_rate <= 1.0:
            raise ValueError(f"expectation {self.name}: max_violation_rate must be within [0, 1]")

    @property
    def reason(self) -> str:
        """Quarantine reason of a row this rule dropped."""
        return f"expectation {self.name}: {self.condition}"

    def violated(self) -> "Column":
        """True for a row that breaks the rule (NULL counts as broken)."""
        from pyspark.sql import functions as F

        return ~F.coalesce(F.expr(self.condition).cast("boolean"), F.lit(False))


@dataclass(frozen=True)
class Finality:
    """How a windowed view marks rows whose window the watermark has passed.

    After committing micro-batch ``k``, a row is final when ``window_end <= max(event_max_column through batch
    k - 1) - delay``: the watermark Spark filters batch ``k + 1``'s late rows with, so a final row never changes
    again (:mod:`kappa.runtime.sink`). ``window_end_column`` must be a function of the view's keys (a tumbling
    or sliding window keyed by its start).
    """

    window_end_column: str
    event_max_column: str
    delay_seconds: int
    flag_column: str = "is_final"


@dataclass(frozen=True)
class Publish:
    """Rows of a view version's table published to a Kafka topic, for views over this view (Samza's pattern;
    :mod:`kappa.runtime.publish`).

    Attributes:
        topic: A topic ``platform.yaml`` declares (compacted, one partition), written by this version only; a view
            version over this one reads it as its ``stream_topic``. One topic per publishing version: a replay
            of the view publishes into its own topic while the serving version keeps publishing into its.
        key: Columns of the Kafka key (``a|b``, compaction keeps the latest row per key).
        where: DuckDB SQL over a row: which rows are published (e.g. ``is_final``: a window once the watermark
            passed it, after which it never changes - so a copy published again after a crash is identical).
        order_by: Columns the rows of one publish are sorted by (event time: the reader's watermark relies on it).
    """

    topic: str
    key: tuple[str, ...]
    where: str | None = None
    order_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError(f"publish to {self.topic}: key columns are required (compaction keeps one per key)")


@dataclass(frozen=True)
class ViewDefinition:
    """One version of one view.

    Attributes:
        name: view name (matches ``kappa/platform.yaml``).
        version: version number; each version has its own table, checkpoint and Delta appId.
        description: one line for ``kappa status`` and the docs.
        stream_topic: the Kafka topic read as a stream.
        stream_format: how records of ``stream_topic`` are decoded and validated.
        transform: pure function ``(stream, lookups) -> DataFrame``; ``stream`` has only valid records.
        lookups: static inputs read from compacted topics: the keyword the transform receives each under ->
            its :class:`kappa.runtime.lookups.Lookup` (topic, format, columns). The transform gets each decoded as the
            latest value per key (tombstones removed), cached and re-read only when the topic moved; the job, the
            recompute and the oracle all read this declaration.
        output_mode: Spark output mode of the transform (``append`` for stateless or closed windows,
            ``update`` for windows that change until final).
        write: how a batch lands in Delta: ``append`` (idempotent append), ``merge`` (upsert by ``keys``),
            ``upsert_delete`` (KTable: latest value per key in the batch, tombstone deletes).
        keys: merge keys for ``merge``/``upsert_delete``.
        order_column: for ``upsert_delete``, the column deciding which record of a key is the latest.
        finality: windowed views mark rows final once the watermark passes them.
        latency_column: event-time column of the output used for the end-to-end latency histogram.
        partition_by: Delta partition columns (none given: :attr:`table_partitions` decides).
        stateful: the transform keeps state in the checkpoint (watermarked windows, sessions), so it runs inside
            the streaming plan; the bad records of the same micro-batch travel beside its output
            (:mod:`kappa.runtime.plan`), still one query and one read of the topic.
        late_bound: for a watermarked view, ``() -> Column`` over the valid input rows: the event-time point
            after which the watermark drops the row (e.g. the end of its tumbling window), NULL for rows the
            view does not aggregate. Rows whose bound the previous batch's watermark passed are kept in the
            quarantine with reason ``late`` (:mod:`kappa.runtime.late`; Spark still drops them from the view). ``None``:
            dropped rows are only counted (``kappa_late_rows_dropped_total``).
        expectations: data-quality rules over the output rows (:class:`Expectation`).
        upgrade: how this version starts when it replaces the serving one (Flink's upgrade modes): ``replay``
            (default) - rebuilt from the log (earliest, an offset or a timestamp) into an empty table;
            ``continue`` - only the logic of records to come changes: the table is seeded with the serving
            version's rows at one of its Delta versions and the job starts at the offsets that version had
            reached (no replay of the history). Refused for stateful versions and where the serving version
            differs in topic, write mode or keys (:func:`continue_refusal`); the operator can ask for either
            mode per replay.
        publish: rows of the table this version publishes to a Kafka topic for views over it
            (:class:`Publish`); ``None``: none.
        trigger_seconds: how often its live micro-batches run (``None``: the job's default, 2 s) - a view whose
            readers need no second-fresh rows (hourly totals) spares the driver the fixed cost of a batch.
        keep_invalid: the transform receives every record, invalid ones too (with their raw key and value bytes
            and the reason in ``error``), and nothing goes to the quarantine - a topic's archive
            (:mod:`kappa.runtime.archive`). Stateless views only.
    """

    name: str
    version: int
    description: str
    stream_topic: str
    stream_format: RecordFormat
    transform: Callable[..., "DataFrame"]
    output_mode: Literal["append", "update"] = "append"
    write: WriteMode = "append"
    keys: tuple[str, ...] = ()
    order_column: str | None = None
    lookups: Mapping[str, Lookup] = field(default_factory=dict)
    finality: Finality | None = None
    latency_column: str | None = None
    partition_by: tuple[str, ...] = ()
    stateful: bool = False
    late_bound: Callable[[], "Column"] | None = None
    expectations: tuple[Expectation, ...] = ()
    upgrade: UpgradeMode = "replay"
    publish: Publish | None = None
    trigger_seconds: float | None = None
    keep_invalid: bool = False

    def __post_init__(self) -> None:
        if self.keep_invalid and self.stateful:
            raise ValueError(f"{self.ref}: keep_invalid is for stateless views (a topic's archive)")
        if self.upgrade not in UPGRADE_MODES:
            raise ValueError(f"{self.ref}: upgrade {self.upgrade!r}: use {' or '.join(UPGRADE_MODES)}")
        if self.upgrade == "continue" and (self.stateful or self.write == "upsert_delete"):
            raise ValueError(f"{self.ref}: upgrade 'continue' - {continue_refusal(self, None)}")
        for name, lookup in self.lookups.items():
            if not isinstance(lookup, Lookup):
                raise TypeError(f"{self.ref}: lookup {name!r} must be a kappa.runtime.lookups.Lookup (topic, format, "
                                f"columns), not {type(lookup).__name__}")
        names = [e.name for e in self.expectations]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.ref}: expectation names must be unique ({', '.join(names)})")

    @property
    def ref(self) -> str:
        """``name@vN``, the view version's identity in logs, metrics and Delta appIds."""
        return view_ref(self.name, self.version)

    @property
    def table_partitions(self) -> tuple[str, ...]:
        """The Delta partition columns of the version's table: ``partition_by``; else, for a windowed view that
        merges, its finality flag. Every micro-batch rewrites the files holding the windows it updates or closes;
        apart from the final rows those are the few files of the open windows, and a window's row is written to
        the final partition once, when it closes (a table of one partition would rewrite every row it ever held
        at every micro-batch: its size on disk grew with the square of time)."""
        if self.partition_by:
            return self.partition_by
        if self.finality is not None and self.write == "merge":
            return (self.finality.flag_column,)
        return ()

    @property
    def watermark(self) -> tuple[str, int] | None:
        """``(output event-time column, delay seconds)``: the table is complete for event time up to
        ``max(column) - delay``. A windowed view's finality rule; a stateful view without one writes a row once
        it is closed (sessions), so its latency column with no delay; None for views without event time."""
        if self.finality is not None:
            return self.finality.event_max_column, self.finality.delay_seconds
        if self.stateful and self.latency_column:
            return self.latency_column, 0
        return None


def continue_refusal(new: ViewDefinition, serving: ViewDefinition | None) -> str | None:
    """Why ``new`` cannot continue from ``serving``'s position with a table seeded from ``serving``'s rows (None:
    it can). A stateful version keeps windows or sessions in its checkpoint: a new checkpoint would start them
    empty and count wrong; a KTable (``upsert_delete``) continued from a copy would need the deletes of its
    range checked against the copy, which verification cannot do; a different topic, write mode or keys makes
    the seeded rows another table's."""
    if new.stateful:
        return (f"{new.ref} is stateful (its windows/sessions live in the checkpoint and would start empty): "
                "replay it from the log")
    if new.write == "upsert_delete":
        return f"{new.ref} upserts and deletes by key (a KTable): replay it from the log"
    if serving is None:
        return None
    if serving.stateful:
        return f"{serving.ref} is stateful: its rows come from state {new.ref} does not have; replay it"
    for what, a, b in (("stream topic", new.stream_topic, serving.stream_topic),
                       ("write mode", new.write, serving.write), ("keys", new.keys, serving.keys)):
        if a != b:
            return f"{new.ref} has another {what} than {serving.ref} ({a} vs {b}): replay it"
    return None


def tumbling_window_end(column: str, seconds: int) -> "Column":
    """End of the ``seconds``-long tumbling event-time window ``column`` falls in (Spark's ``window().end``), as
    plain arithmetic for a ``late_bound``: ``window()`` outside an aggregation also filters out rows whose time
    is NULL."""
    from pyspark.sql import functions as F

    micros = seconds * 1_000_000
    ts = F.unix_micros(F.col(column))
    return F.timestamp_micros(ts - F.pmod(ts, F.lit(micros)) + F.lit(micros))


def load_view(module: str) -> ViewDefinition:
    """Import ``module`` (e.g. ``jobs.user_sessions.v1``) and return its ``VIEW``."""
    mod = importlib.import_module(module)
    view = getattr(mod, "VIEW", None)
    if not isinstance(view, ViewDefinition):
        raise TypeError(f"{module} does not define VIEW = ViewDefinition(...)")
    return view


def declared_view(name: str, version: int | None = None) -> ViewDefinition:
    """The definition of a view version ``kappa/platform.yaml`` (or ``KAPPA_PLATFORM``) declares (default: the
    view's default version); :class:`kappa.catalog.UnknownView` names what it declares otherwise."""
    from kappa.catalog import load_catalog

    return load_view(load_catalog().module_of(name, version or None))

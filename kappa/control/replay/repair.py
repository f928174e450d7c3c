"""Partial-range replay ("repair"): recompute the windows of one event-time range of the serving version from
the log, verify them, and swap exactly those windows into the serving table in one Delta commit.

For the day a range went wrong - bad input for an hour, fixed by re-producing the corrected records (which then
arrive after the watermark and are dropped by the live job): instead of a new version replayed from the start,
only the windows that start in ``[start, end)`` are rebuilt::

    log (whole retained topic) ─ decode, valid records with event time >= start ─> the serving version's own
      transform as a batch job (every record counts, the watermark drops nothing), lookups as they are now
      ─> the rows whose window starts in [start, end), finality from the log's event-time maximum
      ─> staging table <version>/repairs/<id> ─> verified against the plain-Python oracle (no micro-batches:
      every record counts) ─> ONE MERGE into the serving table: update matched windows, insert new ones, delete
      the range's windows the recompute no longer has (NOT MATCHED BY SOURCE inside the range only)

Readers see the old range or the new one, never a mix: the swap is one Delta commit
(:func:`kappa.runtime.repairs.swap`). On a local lake this driver commits it beside the live job; on an object
store it hands it to the live job, which commits it in its own JVM between its own commits (delta-spark excludes
concurrent commits only inside one JVM there) and answers; with the job stopped the request waits for its next
start (:mod:`kappa.runtime.repairs`). Refused in one line, before
anything is written: a view without event-time windows (``finality`` and a ``window_start`` key), a reversed or
zero-length range, a range without data (no window of the table and no record of the log starts in it: nothing
to swap, so no empty commit), and a range whose windows are not all final yet (the live job could still change them - wait until the watermark passed).
What it changes is recorded in the commit (``userMetadata``: ``{"kappa": {"repair": ...}}``) and reported
(windows added, changed, removed), and ``kappa watch`` shows it as the changes of one commit.

A repaired range holds what a replay with every record on time would give, so a later strict re-verification
of the version (which re-runs its recorded micro-batches) reports those windows as differing; the repair's own
check is the proof for them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kappa.control.replay.request import ReplayError
from kappa.control.replay.version import ViewVersion, alias_of
from kappa.runtime.repairs import WINDOW_START, SwapError, SwapRequest, request_uri, result_uri, swap

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings

__all__ = ["Repair", "WINDOW_START", "repair_range"]

log = logging.getLogger("kappa.control.replay")

#: How long ``kappa repair`` waits for the live job to commit a handed-off swap (object-store lakes).
HAND_OFF_WAIT_SECONDS = 300.0


@dataclass(frozen=True)
class Repair:
    """What :func:`repair_range` did.

    Attributes:
        view, version: The serving version repaired.
        start_ms, end_ms: The range: windows starting in ``[start_ms, end_ms)``.
        windows: Windows the recompute has in the range.
        added, changed, removed: Windows inserted, updated (some value differs), deleted by the swap.
        verified: The staged windows equal the oracle (None: the view has no oracle).
        swapped: The swap was committed (False: a dry run, or a failed check).
        delta_version: The serving table's Delta version holding the swap.
        staging: The staging table.
        message: One human line.
        waiting: The swap was handed to the live job, which has not committed it yet (its request, see
            :mod:`kappa.runtime.repairs`, is applied when the job next runs).
    """

    view: str
    version: int
    start_ms: int
    end_ms: int
    windows: int
    added: int
    changed: int
    removed: int
    verified: bool | None
    swapped: bool
    delta_version: int | None
    staging: str
    message: str
    waiting: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


def repair_range(view: str, settings: Settings, *, start_ms: int, end_ms: int, by: str, dry_run: bool = False,
                 spark: Any = None, wait_seconds: float = HAND_OFF_WAIT_SECONDS) -> Repair:
    """Rebuild the serving version's windows that start in ``[start_ms, end_ms)`` and swap them in atomically.

    ``wait_seconds``: on an object-store lake, how long to wait for the live job to commit the swap it was handed.

    Raises:
        ReplayError: Refused (see the module docstring) - nothing was written.
    """
    from pyspark.sql import functions as F

    from kappa.runtime.rerun import session_for
    from kappa.verify.oracle import epoch_ms

    if not by:
        raise ReplayError("by is required (e.g. cli:<user>)")
    if end_ms <= start_ms:
        raise ReplayError(f"repair range [{start_ms}, {end_ms}) is empty: --to must be after --from")
    target = alias_of(settings).target(view)
    vv = ViewVersion.resolve(view, target.version, settings)
    definition = vv.definition
    fin = definition.finality
    if fin is None or WINDOW_START not in definition.keys:
        raise ReplayError(f"{vv.ref} has no event-time windows (finality and a {WINDOW_START} key) to repair a "
                          "range of; replay a new version instead")
    session, own = session_for(settings, spark)
    try:
        serving = session.read.format("delta").load(target.table_path)
        in_range = (F.col(WINDOW_START) >= F.timestamp_millis(F.lit(start_ms))) & (
            F.col(WINDOW_START) < F.timestamp_millis(F.lit(end_ms)))
        event_max = serving.agg(F.max(fin.event_max_column)).collect()[0][0]
        watermark = None if event_max is None else epoch_ms(event_max) - fin.delay_seconds * 1000
        open_now = serving.where(in_range & ~F.col(fin.flag_column)).count()

        def not_final(last_end: int | None) -> ReplayError:
            why = (f"{open_now} open windows in the table" if last_end is None else
                   f"the last recomputed window ends {_iso(last_end)} UTC")
            return ReplayError(
                f"{vv.ref}: the range {_iso(start_ms)}..{_iso(end_ms)} UTC is not final yet ({why}; the version's "
                f"watermark is at {_iso(watermark) if watermark is not None else '-'} UTC): the live job may still "
                "change it - repair once the watermark passed it")

        if open_now:  # refused from the table alone, before reading the log
            raise not_final(None)
        staged = _recompute_range(session, settings, vv, start_ms, in_range)
        latest_end, recomputed = staged.agg(F.max(fin.window_end_column), F.count(F.lit(1))).collect()[0]
        if not recomputed and not serving.where(in_range).count():
            first, last = serving.agg(F.min(WINDOW_START), F.max(WINDOW_START)).collect()[0]
            held = (f"its windows start between {_iso(epoch_ms(first))} and {_iso(epoch_ms(last))} UTC"
                    if first is not None else "its table has no windows yet")
            raise ReplayError(f"{vv.ref}: nothing to repair in {_iso(start_ms)}..{_iso(end_ms)} UTC - the log has "
                              f"no record of a window starting there and the table no window there ({held}); "
                              "nothing was written")
        last_end = epoch_ms(latest_end)
        if last_end is not None and (watermark is None or last_end > watermark):
            raise not_final(last_end)
        repair_id = f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
        staging = f"{vv.paths.root.rstrip('/')}/repairs/{repair_id}"
        staged.write.format("delta").mode("overwrite").save(staging)
        staged = session.read.format("delta").load(staging)
        rows = [r.asDict() for r in staged.collect()]
        before = [r.asDict() for r in serving.where(in_range).collect()]
        keys = definition.keys

        def key(row: dict[str, Any]) -> tuple:
            return tuple(row[k] for k in keys)

        old = {key(r): r for r in before}
        new = {key(r): r for r in rows}
        added, removed = len(new.keys() - old.keys()), len(old.keys() - new.keys())
        changed = sum(1 for k in new.keys() & old.keys() if new[k] != old[k])
        verified, why = _verify(vv, settings, rows, start_ms, end_ms)
        summary = (f"{vv.ref} windows {_iso(start_ms)}..{_iso(end_ms)} UTC: {len(rows)} recomputed, {added} added, "
                   f"{changed} changed, {removed} removed")
        if verified is False:
            return Repair(view=view, version=vv.version, start_ms=start_ms, end_ms=end_ms, windows=len(rows),
                          added=added, changed=changed, removed=removed, verified=False, swapped=False,
                          delta_version=None, staging=staging,
                          message=f"{summary}; NOT swapped: the staged windows differ from the oracle ({why})")
        if dry_run:
            return Repair(view=view, version=vv.version, start_ms=start_ms, end_ms=end_ms, windows=len(rows),
                          added=added, changed=changed, removed=removed, verified=verified, swapped=False,
                          delta_version=None, staging=staging, message=f"{summary}; dry run: not swapped")
        meta = json.dumps({"kappa": {"repair": {"id": repair_id, "by": by, "start_ms": start_ms, "end_ms": end_ms,
                                                "added": added, "changed": changed, "removed": removed}}})
        request = SwapRequest(id=repair_id, staging=staging, keys=tuple(keys), start_ms=start_ms, end_ms=end_ms,
                              meta=meta, by=by, requested_at=time.time())
        if vv.paths.is_local:
            try:
                delta_version: int | None = swap(session, target.table_path, request)
            except SwapError as exc:
                raise ReplayError(str(exc)) from None
    finally:
        if own:
            from kappa.runtime.spark import stop_spark

            stop_spark(session)
    how = "" if vv.paths.is_local else f", committed by {vv.ref}'s live job"
    if not vv.paths.is_local:
        delta_version = _hand_off(vv, request, wait_seconds)
        if delta_version is None:
            message = (f"{summary}; verified and handed to {vv.ref}'s live job, which has not committed it within "
                       f"{wait_seconds:.0f} s (is it running? `{settings.cli} status`): it commits the swap when it "
                       f"next runs (request {request_uri(vv.paths.root, repair_id)})")
            log.info("repair by %s: %s", by, message)
            return Repair(view=view, version=vv.version, start_ms=start_ms, end_ms=end_ms, windows=len(rows),
                          added=added, changed=changed, removed=removed, verified=verified, swapped=False,
                          delta_version=None, staging=staging, message=message, waiting=True)
    message = f"{summary}; swapped in Delta version {delta_version}{how}" + (
        " (equal to the oracle)" if verified else " (no oracle for this version: not cross-checked)")
    log.info("repair by %s: %s", by, message)
    return Repair(view=view, version=vv.version, start_ms=start_ms, end_ms=end_ms, windows=len(rows), added=added,
                  changed=changed, removed=removed, verified=verified, swapped=True, delta_version=delta_version,
                  staging=staging, message=message)


def _hand_off(vv: ViewVersion, request: SwapRequest, wait_seconds: float) -> int | None:
    """Hand the swap to the serving version's live job (object-store lakes) and wait up to ``wait_seconds`` for
    its answer: the Delta version that holds the swap, or None while it waits for the job.

    Raises:
        ReplayError: the job answered that it could not commit it.
    """
    from kappa.runtime.checkpoint import read_text, write_text

    write_text(request_uri(vv.paths.root, request.id), request.to_json())
    answer = result_uri(vv.paths.root, request.id)
    deadline = time.monotonic() + wait_seconds
    while True:
        text = read_text(answer)
        if text is not None:
            result = json.loads(text)
            if "error" in result:
                raise ReplayError(f"{vv.ref}: its live job could not commit repair {request.id}: {result['error']}")
            return int(result["delta_version"])
        if time.monotonic() >= deadline:
            return None
        time.sleep(1.0)


def _recompute_range(spark: Any, settings: Settings, vv: ViewVersion, start_ms: int, in_range: Any) -> Any:
    """The serving version's own transform as one batch job over every valid record with event time >= start
    (a window starting in the range holds no earlier one), its windows in the range, finality from the whole
    output's event-time maximum (:func:`kappa.runtime.rerun.apply_writes`)."""
    from pyspark.sql import functions as F

    from kappa.log.topics import partition_offsets
    from kappa.runtime.lookups import lookup_frame
    from kappa.runtime.parsing import valid_rows
    from kappa.runtime.rerun import BATCH, apply_writes, read_range

    definition = vv.definition
    end = {p: hi for p, (_lo, hi) in partition_offsets(settings, vv.topic).items()}
    events = valid_rows(read_range(spark, settings, definition, vv.topic, {}, end)).where(
        F.col("event_ts") >= F.timestamp_millis(F.lit(start_ms)))
    lookups = {name: F.broadcast(lookup_frame(spark, settings, lookup, None))
               for name, lookup in definition.lookups.items()}
    output = definition.transform(events, **lookups).withColumn(BATCH, F.lit(0))
    return apply_writes(definition, output).where(in_range)


def _verify(vv: ViewVersion, settings: Settings, rows: list[dict[str, Any]], start_ms: int,
            end_ms: int) -> tuple[bool | None, str]:
    """The staged windows against the version's plain-Python oracle over the whole log, every record counted
    (no micro-batches: nothing is late in a batch recompute). (None, why) without an oracle."""
    from kappa.verify import oracle

    spec = oracle.oracle_for(vv.name, vv.version)
    if spec is None:
        return None, "no oracle"
    definition = vv.definition

    def validated(topic: str, fmt: Any) -> list[Any]:
        return oracle.validate_records(oracle.read_log(settings, settings.topic(topic)), fmt.subject,
                                       key_field=fmt.key_field, tombstones=fmt.tombstones)

    events = validated(definition.stream_topic, definition.stream_format)
    lookups = {name: validated(lookup.topic, lookup.format) for name, lookup in definition.lookups.items()}
    position = list(spec.keys).index(WINDOW_START)
    expected = {k: v for k, v in spec.compute(oracle.OracleInput(events=events, lookups=lookups)).items()
                if start_ms <= k[position] < end_ms}
    actual = dict(spec.adapt(r) for r in rows)
    if len(actual) != len(rows):
        return False, "a window is staged twice"
    wrong = sorted((k for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k)), key=str)
    if wrong:
        k = wrong[0]
        return False, (f"{len(wrong)} windows differ, first {k}: staged={actual.get(k)} oracle={expected.get(k)}")
    return True, ""


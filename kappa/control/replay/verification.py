"""Verification: is the new version's table exactly what its log range must give, within its expectations,
and what changes for readers if it replaces the serving one.

The checks (:mod:`kappa.verify.recompute`, the plain-Python oracles of :mod:`kappa.verify.oracle`, the expectations)
and the diff report (:mod:`kappa.verify.diffreport`) are described in ``docs/replay.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kappa.errors import one_line
from kappa.identity import view_ref
from kappa.control.registry import RegistryError
from kappa.control.replay.planning import _short_offsets, eta_range
from kappa.control.replay.request import VERIFY_MODES, ReplayError, offsets_from_json, spark_offsets
from kappa.control.replay.version import ViewVersion, alias_of, registry_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.runtime.view import ViewDefinition

__all__ = ["Verification", "expectations_check", "seed_rows", "table_rows", "verify"]

log = logging.getLogger("kappa.control.replay")


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
        rows: Rows in the table at ``delta_version`` (counted by the recompute or the oracle; 0 when neither ran).
        expected_rows: Rows the recompute produced.
        missing: Keys expected and absent from the table (the largest count of the checks).
        extra: Keys in the table and not expected (idem).
        different: Keys present in both with different values (idem).
        duplicates: Keys present more than once in the table.
        examples: Up to 5 differences per check, ``"<check>: <key>: ..."``.
        first_difference: The first differing key of the first failed check.
        recompute: The recompute of the version's own transform (:mod:`kappa.verify.recompute`), as a dict.
        oracle: The plain-Python oracle's check (:mod:`kappa.verify.oracle`) when one exists for the version, else None.
        expectations: Violations per expectation over the run and their limits (:func:`expectations_check`),
            None for a version without expectations.
        compared_with: Version serving when verified (None if none, or this version itself).
        only_new: Keys only in this version's table (vs. ``compared_with``).
        only_old: Keys only in the serving version's table.
        changed: Keys in both with different values in the columns both tables have.
        report: The diff report against the serving version (:class:`kappa.verify.diffreport.DiffReport`, with the paths
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


def table_rows(table: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """All rows of a delta-rs table snapshot as dicts (arro3, no pyarrow)."""
    data = table.scan().read_all()
    names = list(data.column_names)
    columns = [data.column(i).to_pylist() for i in range(len(names))]
    return names, [dict(zip(names, values)) for values in zip(*columns)]


def _diff_against_serving(spark: Any, vv: ViewVersion, delta_version: int) -> Any:
    """The diff report against the serving version (:mod:`kappa.verify.diffreport`), or None when none serves (or this
    version does)."""
    from deltalake import DeltaTable

    from kappa.verify.diffreport import diff_report

    try:
        target = alias_of(vv.settings).target(vv.name)
    except RegistryError:
        return None
    if target.version == vv.version or not DeltaTable.is_deltatable(target.table_path):
        return None
    return diff_report(spark, view=vv.name, version=vv.version, table=vv.paths.table, delta_version=delta_version,
                       serving_version=target.version, serving_table=target.table_path, keys=vv.definition.keys,
                       out_dir=vv.report_dir())


def _oracle_check(spec: Any, definition: ViewDefinition, settings: Settings, *, start: Mapping[int, int],
                  end: Mapping[int, int], batches: list[Any], end_timestamp_ms: int | None,
                  rows: list[dict[str, Any]], base: list[dict[str, Any]] | None = None) -> Any:
    """The plain-Python oracle's recomputation of ``[start, end)`` against the table's ``rows``. The records are
    read and validated with jsonschema in Python (not Spark's decoding); which schema, key field and lookups is
    what the view version declares. ``base``: the rows a continued version was seeded with; the range's result
    lands on top of them (an append adds keys, a merge replaces them)."""
    from kappa.verify import oracle
    from kappa.verify.compare import Check

    def validated(records: list[Any], fmt: Any) -> list[Any]:
        return oracle.validate_records(records, fmt.subject, key_field=fmt.key_field, tombstones=fmt.tombstones)

    records = oracle.read_log(settings, settings.topic(definition.stream_topic), start=start or None, end=end)
    if end_timestamp_ms is not None:
        records = [r for r in records if r.timestamp_ms < end_timestamp_ms]
    lookups = {name: validated(oracle.read_log(settings, settings.topic(lookup.topic)), lookup.format)
               for name, lookup in definition.lookups.items()}
    expected = dict(spec.adapt(row) for row in base or ())
    expected.update(spec.compute(oracle.OracleInput(events=validated(records, definition.stream_format),
                                                    lookups=lookups, batches=batches if spec.uses_batches else None)))
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


def seed_rows(seed: Mapping[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    """The rows a continued version's table was seeded with (:mod:`kappa.control.replay.upgrade`), read from the
    serving version's table at the seed's Delta version, in ``columns`` (NULL where it had no such column)."""
    from deltalake import DeltaTable

    from kappa.runtime.deltars import rs_uri

    _names, rows = table_rows(DeltaTable(rs_uri(seed["table"]), version=int(seed["delta_version"])))
    return [{name: row.get(name) for name in columns} for row in rows]


def expectations_check(settings: Settings, view: str, version: int, *, upto: int | None = None) -> Any:
    """The version's expectation counts over its run (from the Delta commits' lineage) against the declared
    limits, as a :class:`kappa.verify.compare.Check` named ``expectations`` (None: the version declares none)."""
    return _expectations(ViewVersion.resolve(view, version, settings), upto=upto)


def _expectations(vv: ViewVersion, *, upto: int | None = None) -> Any:
    from deltalake import DeltaTable

    from kappa.runtime.lineage import expectations_from_history
    from kappa.verify.compare import Check

    definition = vv.definition
    if not definition.expectations:
        return None
    rows, violations = 0, {}
    if DeltaTable.is_deltatable(vv.paths.table):
        table = DeltaTable(vv.paths.table)
        rows, violations = expectations_from_history(vv.run_commits(table), vv.app_id() or "", upto=upto)
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


def verify(view: str, version: int, settings: Settings, mode: str = "strict", *, by: str,
           end_timestamp_ms: int | None = None, on_wait: Callable[[str], None] | None = None,
           on_start: Callable[[str], None] | None = None) -> Verification:
    """Check a caught-up version; ``verified`` or ``failed`` in the registry.

    Before a strict check starts, ``on_start`` (default: the log) gets one line with its size (recorded
    micro-batches, records) and, when verifications were measured here, its ETA (:func:`measured_verification`).

    One strict verification per version at a time (a lake on a local or mounted file system): a second request
    waits for the one running (``on_wait`` gets one line saying whose, since when; default: the log) and takes
    its result when the table has not moved since - two recomputes of one version never share the machine.
    On an object-store lake there is no lock and each request runs its own check.

    ``strict``: open the version's table at its latest Delta version, find the micro-batch it holds (the Delta
    txn of the version's appId) and every batch boundary of the run before it (end offsets, watermark, lookup
    offsets: :mod:`kappa.runtime.lineage`, the checkpoint's offset log as a fallback), then

    * **recompute** (every version): Spark re-runs the version's own transform over exactly those micro-batches
      of the log and the view's write semantics over its output (:mod:`kappa.verify.recompute`); the table must hold
      the same keys with the same values, no duplicated key, and the quarantine every invalid record once;
    * **oracle** (versions with an oracle next to the view, ``ORACLES`` of ``jobs/<view>/oracle.py``): the
      independent plain-Python recomputation of the same range must equal the table too.

    ``none``: no check, the registry note says so. The serving alias is never touched; a failure marks the
    version ``failed`` with the reason (the first differing key). A serving or failed version is re-checked
    read-only (its state stays); so is the catalog's default version serving without a registry row (as ``kappa up``
    and the chart run it): it is adopted first (:func:`kappa.control.replay.launching.adopt_serving`). Also reports
    how the table differs from the
    version currently serving (keys only in the new one, only in the old one, changed values).

    Raises:
        ReplayError: Unknown/unregistered version, not caught up yet, or nothing processed yet.
    """
    if mode != "strict":
        return _verify(view, version, settings, mode, by=by, end_timestamp_ms=end_timestamp_ms)
    paths = ViewVersion.resolve(view, version, settings).paths
    with _one_at_a_time(paths, f"{view}@v{version}", by, on_wait or log.info) as earlier:
        if earlier is not None:
            return earlier
        result = _verify(view, version, settings, mode, by=by, end_timestamp_ms=end_timestamp_ms,
                         on_start=on_start or log.info)
        _keep_result(paths, result, by)
        return result


#: Where a version's verification lock and last result live (its version folder, next to table and checkpoint).
_LOCK, _LAST = "verify.lock", "verify-last.json"


def _local_dir(root: str) -> Path | None:
    """The version folder on a local / mounted file system (None for an object store: no lock there)."""
    if "://" in root and not root.startswith("file:"):
        return None
    return Path(root.removeprefix("file://").removeprefix("file:"))


@contextlib.contextmanager
def _one_at_a_time(paths: Any, ref: str, by: str, on_wait: Callable[[str], None]) -> Iterator[Verification | None]:
    """Hold the version's verification lock; yields the result of a verification that ran while this one waited
    (its table unchanged since), else None - then the caller verifies."""
    import fcntl
    import os

    folder = _local_dir(paths.root)
    try:
        if folder is None:
            raise OSError("an object store has no lock")
        folder.mkdir(parents=True, exist_ok=True)
        fh = open(folder / _LOCK, "a+")  # noqa: SIM115 - closed below, after the caller's block
    except OSError as exc:  # no lock to take here: this request verifies on its own
        log.debug("%s: verifying without the one-at-a-time lock: %s", ref, exc)
        yield None
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            waited_from = datetime.now(UTC)
            on_wait(f"{ref}: a verification is already running ({holder}); waiting for its result instead of "
                    "recomputing the same version beside it")
            fcntl.flock(fh, fcntl.LOCK_EX)
            earlier = _result_since(folder, paths, waited_from)
            if earlier is not None:
                yield earlier
                return
        fh.seek(0)
        fh.truncate()
        fh.write(f"by {by}, pid {os.getpid()}, since {datetime.now(UTC):%H:%M:%S} UTC")
        fh.flush()
        try:
            yield None
        finally:
            fh.seek(0)
            fh.truncate()


def _keep_result(paths: Any, result: Verification, by: str) -> None:
    """The result for a request that waited (:func:`_one_at_a_time`), with when and by whom."""
    folder = _local_dir(paths.root)
    if folder is not None:
        (folder / _LAST).write_text(json.dumps({"finished_at": datetime.now(UTC).isoformat(), "by": by,
                                                "result": result.to_dict()}, default=str))


def _result_since(folder: Path, paths: Any, since: datetime) -> Verification | None:
    """The result kept by a verification that finished after ``since``, if the table is still at the Delta
    version it checked."""
    from deltalake import DeltaTable

    try:
        kept = json.loads((folder / _LAST).read_text())
        finished = datetime.fromisoformat(kept["finished_at"])
        data = kept["result"]
        current = DeltaTable(paths.table).version()
    except Exception:  # noqa: BLE001 - nothing usable kept: verify here
        return None
    if finished < since or data.get("delta_version") != current:
        return None
    data["start_offsets"] = {int(p): o for p, o in data["start_offsets"].items()}
    data["end_offsets"] = {int(p): o for p, o in data["end_offsets"].items()}
    data["examples"] = tuple(data["examples"])
    data["message"] = f"{data['message']} (the verification by {kept['by']} that ran while this request waited)"
    return Verification(**data)


def measured_verification(registry: Any, view: str) -> tuple[float | None, str]:
    """Records/s of the last :data:`~kappa.control.replay.planning.THROUGHPUT_HISTORY` strict verifications of
    ``view`` (any version) here of at least :data:`~kappa.control.replay.planning.MIN_MEASURED_RECORDS` records:
    all records over all seconds, as each ``verified`` note recorded them (``N records checked in S s``). Only
    the same view's: what a check costs per record depends on the view (its state, its oracle). (None, why)
    when there is none."""
    from kappa.control.replay.planning import MIN_MEASURED_RECORDS, recent_rate

    try:
        events = registry.events(view)
    except Exception as exc:  # noqa: BLE001 - an unreadable registry only costs the estimate
        return None, f"verification history unreadable: {one_line(exc)}"
    runs = []
    for e in events:
        found = _CHECKED.search(e.note or "") if e.to_state == "verified" else None
        records = int(found["records"].replace(",", "")) if found else 0
        if found and found["staged"]:  # a check that read only part of its records measures another rate
            continue
        if records >= MIN_MEASURED_RECORDS and float(found["seconds"]) > 0:
            runs.append((e.at, records, float(found["seconds"]), view_ref(e.view, e.version)))
    if not runs:
        return None, f"no verification of {view} with >= {MIN_MEASURED_RECORDS:,} records measured here yet"
    rate, refs = recent_rate(runs)
    return rate, f"the last {len(refs)} here: {', '.join(refs)}"


#: How a ``verified`` note records the check's size and time (read back by :func:`measured_verification`).
_CHECKED = re.compile(r"(?P<records>[\d,]+) records checked in (?P<seconds>[\d.]+) s"
                      r"(?P<staged>, [\d,]+ of them staged by an earlier check)?")


def _verify(view: str, version: int, settings: Settings, mode: str, *, by: str,
            end_timestamp_ms: int | None, on_start: Callable[[str], None] = log.info) -> Verification:
    """:func:`verify` itself."""
    from deltalake import DeltaTable

    from kappa.verify import oracle
    from kappa.runtime.rerun import spark_session
    from kappa.verify.recompute import recompute
    from kappa.verify.stagecache import staged_records

    if mode not in VERIFY_MODES:
        raise ReplayError(f"verify mode {mode!r}: expected one of {', '.join(VERIFY_MODES)}")
    vv = ViewVersion.resolve(view, version, settings)
    definition = vv.definition
    ref = vv.ref
    registry = registry_of(settings)
    rec = registry.get(view, version)
    if rec is None:  # the version serving by default (`kappa up`, the chart) is tracked once it is checked
        from kappa.control.replay.launching import adopt_serving

        from kappa.catalog import load_catalog

        rec = adopt_serving(view, settings, by=by) if version == load_catalog().views[view].default_version else None
    if rec is None:
        raise ReplayError(f"{ref} is not registered; replay it first (`{settings.cli} replay {view} --version "
                          f"{version}`)")
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

    paths = vv.paths
    if not DeltaTable.is_deltatable(paths.table):
        raise ReplayError(f"{ref}: no Delta table at {paths.table} yet")
    table = DeltaTable(paths.table)
    delta_version = table.version()
    app_id = vv.app_id() or rec.app_id
    batch = table.transaction_version(app_id)
    if batch is None:
        raise ReplayError(f"{ref}: Delta version {delta_version} of {paths.table} has no commit of {app_id}; "
                          "nothing processed yet")
    topic = vv.topic
    batches = vv.batch_boundaries(table, app_id, batch)
    if not batches or batches[-1].batch_id != batch:
        raise ReplayError(f"{ref}: neither the Delta history nor the checkpoint has the offsets of batch {batch} "
                          f"(Delta version {delta_version})")
    end = dict(batches[-1].end_offsets)
    start = offsets_from_json(rec.start_offsets) or {
        int(p): int(o) for p, o in (vv.run_info().get("start_offsets") or {}).items()}

    spec = oracle.oracle_for(view, version)
    if spec is not None and spec.uses_batches and [b.batch_id for b in batches] != list(range(batch + 1)):
        raise ReplayError(f"{ref}: only batches {batches[0].batch_id}..{batch} have known boundaries (Delta "
                          "history and checkpoint both purged older ones); a strict check of an event-time "
                          "view needs every batch from 0 - verify=none, or replay again")
    seed = vv.run_info().get("seed")  # a continued version: its range lands on the serving version's rows
    base = (seed["table"], int(seed["delta_version"])) if seed else None
    records = sum(max(0, o - start.get(p, o)) for p, o in end.items())
    run = f"{table.metadata().id}:{app_id}"  # the recorded run: what an earlier check staged of it is reused
    staged = min(records, staged_records(settings, definition, run))
    rate, source = measured_verification(registry, view)
    new = f" for the {records - staged:,} not staged by an earlier check" if staged else ""
    on_start(f"verifying {ref}: {len(batches):,} recorded micro-batches, {records:,} records"
             + (f"; ETA {eta_range((records - staged) / rate)}{new} (at {rate:,.0f} records/s, all of a check: "
                f"reading, re-run, comparisons; {source})"
                if rate else f"; ETA unknown ({source}): the re-run logs its progress and its time left"))
    began = time.monotonic()
    with spark_session(settings) as spark:
        checks = [recompute(definition, settings, table_path=paths.table, delta_version=delta_version,
                            batches=batches, start=start, end_timestamp_ms=end_timestamp_ms,
                            quarantine_path=paths.quarantine, spark=spark, base=base, run=run)]
        log.info("verifying %s: comparing its table with the serving version's (the diff report)", ref)
        report = _diff_against_serving(spark, vv, delta_version)
    expectations = _expectations(vv, upto=batch)
    if expectations is not None:
        checks.append(expectations)
    n_rows = checks[0].rows  # the recompute counted the table at this Delta version
    if spec is not None:  # only the plain-Python oracle needs the rows in Python
        log.info("verifying %s: the plain-Python oracle over the %s records of the log (the independent count)",
                 ref, f"{records:,}")
        names, rows = table_rows(table)
        n_rows = len(rows)
        checks.append(_oracle_check(spec, definition, settings, start=start, end=end, batches=batches,
                                    end_timestamp_ms=end_timestamp_ms, rows=rows,
                                    base=seed_rows(seed, names) if seed else None))
    passed = all(c.passed for c in checks)
    failed = [c for c in checks if not c.passed]
    versus = (f"; vs serving v{report.serving_version}: {report.added} keys only here, {report.removed} only "
              f"there, {report.changed} changed (diff report {report.json_path})" if report is not None else "")
    reused = int(((checks[0].details or {}).get("staged_before") or {}).get("records") or 0)
    where = (f"Delta version {delta_version} = batch {batch}, offsets {_short_offsets(start)}..{_short_offsets(end)}"
             f"; {records:,} records checked in {time.monotonic() - began:.1f} s"
             + (f", {reused:,} of them staged by an earlier check" if reused else ""))
    if seed:
        where += f", on v{seed.get('from_version')}'s rows at its Delta version {seed['delta_version']}"
    names = " and the ".join(c.name for c in checks if c.name != "expectations")
    quality = f"; {expectations.message}" if expectations is not None else ""
    if passed:
        message = f"{ref}: {n_rows:,} rows equal the {names} ({where}){quality}{versus}"
    else:
        message = f"{ref}: " + "; ".join(f.message for f in failed) + f" ({where}){versus}"
    by_name = {c.name: c for c in checks}
    result = Verification(
        view=view, version=version, mode="strict", passed=passed, delta_version=delta_version, batch_id=batch,
        start_offsets=start, end_offsets=end, rows=n_rows, expected_rows=checks[0].expected_rows,
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
        fields: dict[str, Any] = {"end_offsets": spark_offsets(topic, end)}
        if app_id != rec.app_id:
            fields["app_id"] = app_id
        if passed:
            registry.set_state(view, version, "verified", by=by, expected={"caught_up", "verified"},
                               note=message[:1000], **fields)
        else:
            registry.set_state(view, version, "failed", by=by, note=message[:1000], **fields)
    return result

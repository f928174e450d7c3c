"""Preflight: can this replay start, from which exact offsets, how big is it and how long will it take.

Changes nothing (also the whole of a dry run).
"""

from __future__ import annotations

import logging
import time
import uuid
import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping

from kappa.errors import one_line
from kappa.runtime.checkpoint import offsets_of, run_info
from kappa.runtime.inflight import READ_SPLIT_RECORDS
from kappa.identity import ViewPaths
from kappa.control.registry import Registry, code_hash
from kappa.control.replay.request import (ReplayError, ReplayRequest, VersionBusy, offsets_from_json, parse_offsets,
                                  spark_offsets)
from kappa.control.replay.upgrade import continue_point, upgrade_mode
from kappa.control.replay.version import ViewVersion, new_version, registry_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.control.runners.base import Runner

__all__ = ["MIN_MEASURED_RECORDS", "THROUGHPUT_HISTORY", "Preflight", "measured_throughput", "preflight"]

log = logging.getLogger("kappa.control.replay")

#: The preflight's ETA uses the throughput of the last this many replays...
THROUGHPUT_HISTORY = 3
#: ... of at least this many records (a tiny replay measures its start-up, not its rate).
MIN_MEASURED_RECORDS = 10_000
#: Records sampled to estimate the average record size.
_SAMPLE_RECORDS = 200
#: Registry states of a version whose replay is past launching.
_BUSY_STATES = frozenset({"caught_up", "verified", "serving"})


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
        throughput: Records/s this platform replayed at from the log (earlier replays), None when not measured yet.
        throughput_source: Where it comes from, or why it is unknown.
        eta_seconds: ``records / throughput`` - with an archive part, its records at ``archive_throughput`` plus
            the log's at ``throughput`` (None: a rate it needs is unknown until the replay's first batches give one).
        existing_state: Registry state of the version if it was registered already (resume), else None.
        job_state: Runner status of its job.
        seed: ``upgrade=continue``: the serving version's table and Delta version the new table is seeded with,
            and the end offsets it holds (= ``start_offsets``) (:func:`kappa.control.replay.upgrade.continue_point`);
            None for a replay.
        same_start: Resuming with an explicit start: how it resolved to the offsets the run started from (a
            start is the same only when its offsets are), else None.
        archive: The part of the range the log no longer holds, read from the topic's archive: its view and table,
            the start and, per partition, the handover offset where the log takes over
            (:func:`_archive_part`); None when the log holds it all.
        archive_throughput: With an archive part: records/s of earlier replays that read the archive
            (:func:`measured_throughput` with ``source="archive"``), None when not measured yet.
        archive_throughput_source: Where it comes from, or why it is unknown.
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
    seed: dict[str, Any] | None = None
    same_start: str | None = None
    archive: dict[str, Any] | None = None
    archive_throughput: float | None = None
    archive_throughput_source: str = ""

    @property
    def archived_records(self) -> int:
        """Records the replay reads from the archive (0 when the log holds its whole range)."""
        return 0 if self.archive is None else _archived(self.archive)

    @property
    def starting(self) -> str:
        """The job's start position: Spark JSON offsets ``{"topic": {"0": o, ...}}``."""
        return spark_offsets(self.topic, self.start_offsets)

    def summary(self) -> str:
        """One human line: what will be replayed, how big, how long."""
        what = (f"{self.request.ref}: replay {self.records:,} records (~{_human_bytes(self.bytes_estimate)}) of "
                f"{self.topic} from {_short_offsets(self.start_offsets)}")
        if self.seed is not None:
            what += (f" (upgrade=continue: seeded with v{self.seed['from_version']}'s rows at Delta version "
                     f"{self.seed['delta_version']})")
        if self.archive is not None:
            what += f" ({self.archived_records:,} of them from the archive {self.archive['view']}, the rest from the log)"
        end = (f" until ts {self.request.end_timestamp_ms}" if self.request.bounded else " then follow live")
        bound = self.request.max_offsets_per_trigger
        if self.archive is not None:
            eta = self._parts_eta()
        elif self.throughput is None or self.eta_seconds is None:
            if bound and bound < self.records:  # the follow's rate comes from the first bounded micro-batches
                eta = (f"; ETA unknown until its first micro-batches of at most {bound:,} records "
                       f"({self.throughput_source})")
            elif self.records > READ_SPLIT_RECORDS:  # one big micro-batch: its read tasks show how far it got
                eta = (f"; ETA unknown before it starts ({self.throughput_source}): it reads these records in one "
                       "micro-batch, whose read tasks show progress and an ETA while it runs; its rate gives later "
                       "replays an ETA")
            else:  # one small micro-batch reads them all: there is no rate to show before it commits
                eta = (f"; ETA unknown ({self.throughput_source}): it reads these records in one micro-batch, so "
                       "progress shows when that commits; its rate gives later replays an ETA")
        else:
            eta = (f"; ETA ~{_human_seconds(self.eta_seconds)} at {self.throughput:,.0f} rec/s "
                   f"({self.throughput_source})")
        resume = (f"; resuming ({self.existing_state}, job {self.job_state}"
                  + (f"; {self.same_start}" if self.same_start else "") + "): this follows that run, no second "
                  "job" if self.existing_state else "")
        return what + end + eta + resume

    def _parts_eta(self) -> str:
        """``; ETA ...`` of a replay with an archive part: each part's records at its own measured rate."""
        archived = self.archived_records
        parts = [(archived, "the archive", self.archive_throughput, self.archive_throughput_source)]
        if self.records > archived:
            parts.append((self.records - archived, "the log", self.throughput, self.throughput_source))
        said = [f"{n:,} from {where} " + (f"~{_human_seconds(n / rate)} at {rate:,.0f} rec/s ({why})" if rate
                                          else f"unknown ({why})") for n, where, rate, why in parts]
        head = "ETA unknown" if self.eta_seconds is None else f"ETA ~{_human_seconds(self.eta_seconds)}"
        return f"; {head}: " + " + ".join(said)

    def plan(self) -> list[str]:
        """The steps a replay of this request would take, one line each (what ``--dry-run`` prints)."""
        req = self.request
        if self.existing_state:
            steps = [f"follow {req.ref}, already {self.existing_state} (job {self.job_state}); register nothing"]
        else:
            batches = (f" in micro-batches of at most {req.max_offsets_per_trigger:,} records"
                       if req.max_offsets_per_trigger else "")
            steps = [f"register {req.ref} as building in the registry (code {self.module}, start "
                     f"{_short_offsets(self.start_offsets)})"]
            if self.seed is not None:
                steps.append(f"seed its table with the rows of v{self.seed['from_version']} at Delta version "
                             f"{self.seed['delta_version']} of {self.seed['table']} (upgrade=continue: they hold "
                             "every record before the start)")
            if self.archive is not None:
                handover = {int(p): int(o) for p, o in self.archive["handover"].items()}
                steps.append(f"read {self.archived_records:,} records up to {_short_offsets(handover)} from the archive "
                             f"{self.archive['view']} ({self.archive['table']}) in one micro-batch, then switch its "
                             "checkpoint to the log at those offsets")
                steps.append(f"read the rest from the log{batches}, writing a table of its own")
            else:
                steps.append(f"start its job from those offsets{batches}, writing a table of its own")
        steps.append(f"wait until it processed every record before ts {req.end_timestamp_ms} and stopped"
                     if req.bounded else f"wait until it lags at most {req.max_lag:,} records behind the log end "
                     "(or no more than the serving version)")
        base = " on top of the seeded rows" if self.seed is not None else ""
        if req.verify == "strict":
            from kappa.verify.oracle import oracle_for

            also = " and to the plain-Python oracle" if oracle_for(req.view, req.version) is not None else ""
            steps.append("verify: strict - the table must be equal to a re-run of its own transform over the "
                         f"micro-batches it recorded{also}, over the offsets it holds{base}")
        else:
            steps.append("verify: none - accept the table as it is")
        from kappa.config import Settings

        cli = Settings.from_env().cli
        steps.append(f"promote: switch readers to {req.ref} in one Delta commit, keep the replaced version "
                     f"{req.keep_hours:g} h" if req.auto_promote else
                     f"do not promote (later: `{cli} promote {req.view} --version {req.version}`)")
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


def eta_range(seconds: float, *, load: float | None = None, cores: int | None = None) -> str:
    """An ETA measured on this machine (``~45 s``), widened when the machine is busier than it has cores: a
    CPU-bound check gets about cores / load of what it would alone, so up to ``seconds x load / cores`` (``~45 s
    to 2.1 min: the machine is busy now, load 4.3 on 2 cores``). The measurement it comes from may itself have run
    on a busy machine: the range only widens, it never shrinks."""
    import os

    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    if load <= cores * 1.1:
        return f"~{_human_seconds(seconds)}"
    return (f"~{_human_seconds(seconds)} to {_human_seconds(seconds * load / cores)}: the machine is busy now, load "
            f"{load:.1f} on {cores} cores")


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
    from kappa.log.topics import TopicError, offsets_for_timestamp, partition_offsets

    req.validate()
    vv = ViewVersion.resolve(req.view, req.version, settings)
    module, declared, topic = vv.module, vv.stream_topic, vv.topic
    registry = registry_of(settings)
    existing = registry.get(req.view, req.version)
    job = runner.status(req.view, req.version)
    if existing is not None:
        current_hash = code_hash(module)
        if existing.code_hash != current_hash:
            raise ReplayError(f"{req.ref} was registered with other code (sha256 {existing.code_hash[:12]}, now "
                              f"{current_hash[:12]}); a version's table belongs to its code: replay the new code "
                              f"as {new_version(req.view)}")
        if existing.state == "retired" and existing.deleted_at is not None:
            raise ReplayError(f"{req.ref} was retired and its table deleted at {existing.deleted_at:%Y-%m-%d %H:%M} "
                              f"UTC; it can never serve again: replay its logic as {new_version(req.view)}")
        if existing.state == "retired":
            raise ReplayError(f"{req.ref} is retired; serve it again with `{settings.cli} rollback {req.view} --to "
                              f"{req.version}` instead of replaying it")
        if existing.state == "serving":
            raise VersionBusy(f"{req.ref} already serves; nothing to replay", existing)
    if existing is None and job.state == "running":
        raise VersionBusy(f"{req.ref} already runs ({job.detail}) but is not registered (started by hand?); its "
                          f"start is unknown, so it cannot be verified - stop it with `{settings.cli} view stop "
                          f"{req.view} --version {req.version}` and replay again")
    busy = job.state == "running" or (existing is not None and existing.state in _BUSY_STATES)
    if busy and not resume:
        state = existing.state if existing is not None else "unregistered"
        raise VersionBusy(f"{req.ref} is already {state} (job {job.state}: {job.detail}); refusing to start it "
                          f"again - see `{settings.cli} status`, or stop it with `{settings.cli} view stop "
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
        asked = parse_offsets(req.start_offsets, (declared, topic))
        missing = sorted(set(log_end) - set(asked))
        unknown = sorted(set(asked) - set(log_end))
        if missing or unknown:
            def named(parts: list[int], one: str, many: str) -> str:
                return (f"partition {parts[0]} {one}" if len(parts) == 1
                        else f"partitions {', '.join(map(str, parts))} {many}")

            wrong = ([named(missing, "is missing", "are missing")] if missing else []) + \
                ([named(unknown, "does not exist", "do not exist")] if unknown else [])
            raise ReplayError(f"start_offsets must name every partition of {topic} "
                              f"({', '.join(map(str, sorted(log_end)))}): {'; '.join(wrong)}")
        beyond = {p: o for p, o in asked.items() if o > log_end[p]}
        if beyond:
            raise ReplayError(f"start_offsets beyond the log end of {topic}: " + ", ".join(
                f"partition {p} -> {o} (end {log_end[p]})" for p, o in sorted(beyond.items())))
        return asked

    resumed = offsets_from_json(existing.start_offsets) if existing is not None else {}
    seed = vv.run_info().get("seed") if resumed else None
    if not resumed and upgrade_mode(req, vv) == "continue":
        seed = continue_point(vv, settings)  # the start is where the serving version got
    elif resumed and req.upgrade is not None and (seed is not None) != (req.upgrade == "continue"):
        raise ReplayError(f"{req.ref} is already {existing.state} in upgrade mode "
                          f"{'continue' if seed is not None else 'replay'}; one version has one start")
    same_start = None
    if resumed:
        start = resumed
        if check_start and seed is None:  # one version, one start: a different one is refused, not silently ignored
            asked = requested()
            # "earliest" still matches a run that started at the log start retention has since moved past
            same = (all(resumed.get(p, 0) <= o for p, o in asked.items()) if req.start == "earliest"
                    else all(resumed.get(p, 0) == o for p, o in asked.items()))
            if same:
                same_start = (f"the requested start ({_describe_start(req)}) is {_short_offsets(asked)}, the same "
                              "records it runs from")
            if not same:
                raise ReplayError(
                    f"{req.ref} is already {existing.state} from {_short_offsets(resumed)}; the requested start "
                    f"({_describe_start(req)}) is {_short_offsets(asked)} - one version has one start: follow it "
                    f"without --start, or replay the new start into {new_version(req.view)}")
        # what must still be readable is what the job has not processed yet
        processed, _batch = vv.committed_offsets()
        needed = {p: max(o, processed.get(p, o)) for p, o in start.items()}
    else:
        start = offsets_of(seed["end_offsets"]) if seed is not None else requested()
        needed = start
    if req.bounded:
        at_end = offsets_for_timestamp(settings, topic, int(req.end_timestamp_ms or 0))
        target = {p: max(start.get(p, 0), at_end.get(p, log_end[p])) for p in log_end}
    else:
        target = dict(log_end)
    gaps = {p: (o, log_start[p]) for p, o in needed.items() if p in log_start and o < log_start[p]}
    if seed is not None and req.source == "archive":
        raise ReplayError(f"{req.ref} continues where the serving version got (upgrade=continue): it reads no "
                          "history, so source=archive does not apply")
    from_archive = None
    if gaps or (req.source == "archive" and not resumed):  # a run under way keeps the sources it started with
        from_archive = _archive_part(settings, req, declared, topic, needed, log_start, target, gaps)
    elif req.source == "auto" and seed is None and not resumed:
        from_archive = _archive_if_faster(settings, declared, needed, log_start, target)
    records = sum(max(0, target[p] - start.get(p, 0)) for p in target)
    avg = _sample_record_bytes(settings, topic, start, target) if records else 0.0
    rate, source = measured_throughput(registry)
    eta = None if rate is None else records / rate
    archive_rate, archive_source = None, ""
    if from_archive is not None:  # each part at its own rate: the archive's is several times the log's
        archive_rate, archive_source = measured_throughput(registry, source="archive")
        archived = min(records, _archived(from_archive))
        eta = (None if archive_rate is None or (rate is None and records > archived)
               else archived / archive_rate + (records - archived) / rate if records > archived
               else archived / archive_rate)
    return Preflight(
        request=req, module=module, topic=topic, start_offsets=dict(sorted(start.items())), log_start=log_start,
        log_end=log_end, target_offsets=target, records=records, avg_record_bytes=avg,
        bytes_estimate=int(records * avg), throughput=rate, throughput_source=source, eta_seconds=eta,
        existing_state=existing.state if existing is not None else None, job_state=job.state, seed=seed,
        same_start=same_start, archive=from_archive, archive_throughput=archive_rate,
        archive_throughput_source=archive_source,
    )


def _archive_part(settings: Settings, req: ReplayRequest, declared_topic: str, topic: str,
                  start: Mapping[int, int], log_start: Mapping[int, int], target: Mapping[int, int],
                  gaps: Mapping[int, tuple[int, int]]) -> dict[str, Any]:
    """The part of the replay read from the topic's archive: ``{"view", "table", "start", "handover"}``
    (:mod:`kappa.runtime.archive`) - what the log no longer holds (``gaps``), or with ``source=archive`` as much
    as the archive holds from the start.

    Raises:
        ReplayError: ``source=log`` and the log lost the start, no view archives the topic, or its archive misses
            part of the range (named).
    """
    from kappa.runtime.archive import ArchiveError, archive_of, plan_handover

    detail = "; ".join(f"partition {p} starts at {low} (requested {o}: {low - o:,} records gone)"
                       for p, (o, low) in sorted(gaps.items()))
    found = archive_of(settings, declared_topic)
    why = f"{topic} no longer retains the start of {req.ref}: {detail}" if gaps else \
        f"{req.ref} was asked to read its history from the archive (source=archive)"
    if req.source == "log":
        raise ReplayError(f"{why}, and source=log does not read the archive"
                          + (f" ({found[0]} holds {declared_topic}: source=auto reads what it holds)" if found else "")
                          + "; start inside retention (earliest / ts:<ms>)")
    if found is None:
        raise ReplayError(f"{why}, and no view archives {declared_topic} (platform.yaml: `archives: "
                          f"{declared_topic}`)" + ("; start inside retention (earliest / ts:<ms>)" if gaps else ""))
    try:
        handover = plan_handover(found[1], start, log_start, target, prefer_archive=req.source == "archive")
    except ArchiveError as exc:
        lead = f"{topic} no longer retains the start of {req.ref} ({detail})" if gaps else why
        raise ReplayError(f"{lead} and {exc}") from None
    return _archive_plan(found, start, handover)


#: ``source=auto`` reads history the log still holds from the archive when the archive serves at least this many
#: of its records: ``make bench`` (i) measured the archive replay faster than the log replay of the same range from
#: 1M records on (1M: 6.7 s against 11.1 s; docs/performance.md); smaller ranges were not measured side by side, and
#: there both are mostly fixed cost (5.4 s and 6.5 s).
ARCHIVE_FASTER_RECORDS = 1_000_000


def _archive_if_faster(settings: Settings, declared_topic: str, start: Mapping[int, int],
                       log_start: Mapping[int, int], target: Mapping[int, int]) -> dict[str, Any] | None:
    """``source=auto`` with the log holding the whole range: the archive's part (as :func:`_archive_part`) when it
    serves at least :data:`ARCHIVE_FASTER_RECORDS` records exactly once, else None (the log)."""
    from kappa.runtime.archive import ArchiveError, archive_of, plan_handover

    found = archive_of(settings, declared_topic)
    if found is None or sum(max(0, target[p] - start.get(p, 0)) for p in target) < ARCHIVE_FASTER_RECORDS:
        return None
    try:
        handover = plan_handover(found[1], start, log_start, target, prefer_archive=True)
    except ArchiveError as exc:  # the archive cannot serve it exactly: the log can
        log.info("the archive %s is not used: %s", found[0], one_line(exc))
        return None
    plan = _archive_plan(found, start, handover)
    return plan if _archived(plan) >= ARCHIVE_FASTER_RECORDS else None


def _archive_plan(found: tuple[str, str], start: Mapping[int, int], handover: Mapping[int, int]) -> dict[str, Any]:
    """The ``archive`` of a run's plan (run.json): the archive view and table, the start and handover offsets."""
    return {"view": found[0], "table": found[1], "start": {str(p): int(o) for p, o in sorted(start.items())},
            "handover": {str(p): int(o) for p, o in sorted(handover.items())}}


def _archived(plan: Mapping[str, Any]) -> int:
    """Records an archive plan reads from the archive."""
    return sum(int(h) - int(plan["start"].get(p, 0)) for p, h in plan["handover"].items())


def _sample_record_bytes(settings: Settings, topic: str, start: Mapping[int, int],
                         end: Mapping[int, int], *, limit: int = _SAMPLE_RECORDS, timeout: float = 5.0) -> float:
    """Average key + value size of up to ``limit`` records from the start of the range."""
    from confluent_kafka import Consumer, TopicPartition

    parts = [p for p in end if end[p] > start.get(p, 0)]
    if not parts:
        return 0.0
    # a range shorter than the sample is read to its end (or its partitions' log ends: a compacted topic holds
    # fewer records than offsets), not until the deadline
    wanted = min(limit, sum(end[p] - start.get(p, 0) for p in parts))
    consumer = Consumer(settings.kafka_client_config({
        "group.id": f"kappa-preflight-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "enable.partition.eof": True, "auto.offset.reset": "earliest"}))
    sizes: list[int] = []
    done: set[int] = set()
    try:
        consumer.assign([TopicPartition(topic, p, start.get(p, 0)) for p in parts])
        deadline = time.monotonic() + timeout
        while len(sizes) < wanted and len(done) < len(parts) and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=wanted - len(sizes), timeout=0.1):
                if msg.error() is not None:
                    if msg.error().code() == msg.error()._PARTITION_EOF:
                        done.add(msg.partition())
                elif msg.partition() not in done:
                    if msg.offset() >= end[msg.partition()]:
                        done.add(msg.partition())
                    else:
                        sizes.append(len(msg.key() or b"") + len(msg.value() or b""))
    finally:
        consumer.close()
    return sum(sizes) / len(sizes) if sizes else 0.0


def measured_throughput(registry: Registry, source: str = "log") -> tuple[float | None, str]:
    """Records/s this platform replayed at: all records over all seconds (registration -> the run reached its
    target, start-up included) of the last :data:`THROUGHPUT_HISTORY` replays of at least
    :data:`MIN_MEASURED_RECORDS` records that read from ``source``: ``log`` (runs without an archive part) or
    ``archive`` (runs whose history came from the topic's archive - ``archive`` in run.json - several times faster). The job records when its committed batches first reached the run's
    target (``target_reached_at`` in run.json, with the run's start and target offsets); a run without it counts
    to its ``caught_up`` event and the offsets recorded then - later than the replay itself when nothing sampled
    it for a while (a detached replay). (None, why) when there is no such replay: the ETA is then unknown until
    the replay's own batches give a rate - never a made-up figure."""
    try:
        events = registry.events()
        records = {(r.view, r.version): r for r in registry.list()}
    except Exception as exc:  # noqa: BLE001 - an unreadable registry only costs the estimate
        log.warning("cannot read replay history for the ETA: %s", one_line(exc))
        return None, f"replay history unreadable: {one_line(exc)}"
    registered: dict[tuple[str, int], datetime] = {}
    caught: list[tuple[Any, Any, datetime]] = []  # (caught_up event, registry row, registered at), oldest first
    for e in events:
        key = (e.view, e.version)
        if e.from_state is None:
            registered[key] = e.at
        elif e.to_state == "caught_up" and e.from_state == "building" and key in registered:
            if (rec := records.get(key)) is not None:
                caught.append((e, rec, registered.pop(key)))
    runs: list[tuple[datetime, int, float, str]] = []
    for e, rec, began in reversed(caught):  # the newest first: run.json is read only until enough count
        start, end = offsets_from_json(rec.start_offsets), offsets_from_json(rec.end_offsets)
        finished = e.at
        info = run_info(ViewPaths(registry.lake_uri, e.view, e.version).checkpoint)
        if bool(info.get("archive")) != (source == "archive"):
            continue
        if info.get("target_reached_at") and info.get("start_offsets") and info.get("target_offsets"):
            start, end = offsets_of(info["start_offsets"]), offsets_of(info["target_offsets"])
            finished = datetime.fromisoformat(info["target_reached_at"])
        done = sum(max(0, end.get(p, o) - o) for p, o in start.items())
        seconds = (finished - began).total_seconds()
        if done >= MIN_MEASURED_RECORDS and seconds > 0:
            runs.append((e.at, done, seconds, rec.ref))
            if len(runs) == THROUGHPUT_HISTORY:
                break
    of = " from the archive" if source == "archive" else ""
    if not runs:
        return None, f"no replay{of} of >= {MIN_MEASURED_RECORDS:,} records measured here yet"
    rate, refs = recent_rate(runs)
    return rate, (f"measured here: {len(refs)} replay{'s' if len(refs) > 1 else ''}{of} ({', '.join(refs)}), "
                  "start-up included")


def recent_rate(runs: list[tuple[datetime, int, float, str]]) -> tuple[float, list[str]]:
    """Records/s of the newest :data:`THROUGHPUT_HISTORY` of ``runs`` (at, records, seconds, ref): all their
    records over all their seconds; and their refs, oldest first."""
    last = sorted(runs)[-THROUGHPUT_HISTORY:]
    return sum(r[1] for r in last) / sum(r[2] for r in last), [r[3] for r in last]

"""Progress and catch-up: how far a version's job got, and whether it is ready to be verified."""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Callable, Mapping

from kappa.runtime.checkpoint import offsets_of, run_progress
from kappa.errors import one_line
from kappa.identity import view_ref
from kappa.control.leases import release
from kappa.control.registry import RegistryError
from kappa.control.replay.planning import _human_seconds
from kappa.control.replay.request import DEFAULT_MAX_LAG, ReplayError, offsets_from_json, spark_offsets
from kappa.control.replay.version import ViewVersion, registry_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.control.runners.base import Runner

__all__ = ["CatchUp", "Progress", "caught_up", "follow", "progress", "with_reading"]

log = logging.getLogger("kappa.control.replay")


@dataclass(frozen=True, kw_only=True)
class Progress:
    """How far a version's job got (a sample; two samples give a rate).

    Attributes:
        view: View name.
        version: Version.
        topic: Stream topic.
        start_offsets: Where the run started.
        processed_offsets: End offsets of the last committed micro-batch (start offsets if none yet).
        target_offsets: The run's fixed target (:mod:`kappa.runtime.checkpoint`): the log end when the run started
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
        reading: Records the micro-batch running now has read so far, as its job reports them
            (``kappa_batch_records_read``, :mod:`kappa.runtime.inflight`); 0 when none runs long or it is unknown.
            Not in ``done`` (that is what committed); :func:`follow` shows it and takes the job's ETA with it.
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
    reading: int = 0

    def __post_init__(self) -> None:
        if not self.log_end:  # a sample built by hand: the target is the log end
            object.__setattr__(self, "log_end", dict(self.target_offsets))

    @property
    def ref(self) -> str:
        """``<view>@v<N>``."""
        return view_ref(self.view, self.version)

    @property
    def eta_text(self) -> str:
        """The ETA for humans (``42 s``, ``3.5 min``, ``unknown``)."""
        return _human_seconds(self.eta_seconds)

    def summary(self) -> str:
        """One human line."""
        rate = f", {self.rate:,.0f} rec/s" if self.rate is not None else ""
        reading = f", ~{self.reading:,} more read by the running micro-batch" if self.reading else ""
        return (f"{self.ref}: {self.ratio:.1%} ({self.done:,}/{self.total:,} records{reading}), lag {self.lag:,}{rate}, "
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

    ``ratio`` is :func:`kappa.runtime.checkpoint.run_progress` against the run's fixed target (``run.json``; the log end
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
    return _sample(ViewVersion.resolve(view, version, settings), end_timestamp_ms=end_timestamp_ms,
                   previous=previous, record=record, by=by)


def _sample(vv: ViewVersion, *, end_timestamp_ms: int | None, previous: Progress | None, record: bool,
            by: str) -> Progress:
    from kappa.log.topics import offsets_for_timestamp, partition_offsets

    settings, view, version, topic = vv.settings, vv.name, vv.version, vv.topic
    registry = registry_of(settings)
    rec = registry.get(view, version)
    bounds = partition_offsets(settings, topic)
    run = vv.run_info()
    start = offsets_from_json(rec.start_offsets) if rec is not None else {}
    if not start:
        start = offsets_of(run.get("start_offsets")) or {p: lo for p, (lo, _hi) in bounds.items()}
    if end_timestamp_ms is not None:
        at_end = offsets_for_timestamp(settings, topic, end_timestamp_ms)
        log_end = {p: max(start.get(p, 0), at_end.get(p, hi)) for p, (_lo, hi) in bounds.items()}
    else:
        log_end = {p: hi for p, (_lo, hi) in bounds.items()}
    target = offsets_of(run.get("target_offsets")) or dict(log_end)
    processed, batch = vv.committed_offsets()
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
        prev_consumed, prev_at = consumed(offsets_from_json(rec.end_offsets)), rec.updated_at
    rate = eta = None
    if prev_consumed is not None and prev_at is not None and (now - prev_at).total_seconds() > 0.5:
        rate = max(0.0, (consumed(processed) - prev_consumed) / (now - prev_at).total_seconds())
    if not rate and consumed(processed) > 0 and rec is not None and (now - rec.created_at).total_seconds() > 0:
        # no micro-batch since the previous sample (batches are discrete): the average since registration
        rate = consumed(processed) / (now - rec.created_at).total_seconds()
    if lag == 0 or counted.ratio >= 1.0:  # the run's target reached: what remains is the live stream's own lag
        eta = 0.0
    elif rate:
        eta = lag / rate
    sample = Progress(view=view, version=version, topic=topic, start_offsets=start, processed_offsets=processed,
                      target_offsets=target, batch_id=batch, done=counted.done, total=counted.total,
                      ratio=counted.ratio, lag=lag, rate=rate, eta_seconds=eta, sampled_at=now, log_end=log_end)
    if record and rec is not None and rec.state in {"building", "caught_up"}:
        fields: dict[str, Any] = {"end_offsets": spark_offsets(topic, processed)}
        app_id = vv.app_id()
        if app_id and app_id != rec.app_id:
            fields["app_id"] = app_id
        if offsets_from_json(rec.end_offsets) != processed or "app_id" in fields:
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
    records behind the log end; a stateful version that read everything must also have applied the watermark
    its last batch raised (Spark's no-data batch), else the windows it closes are not in the table yet. When the
    version serving now lags more than ``max_lag`` itself (a loaded machine), the new one has caught up once it
    lags no more than the serving one - and the reason says so, with both lags: it is then as current as what
    readers see, not within ``max_lag``. Bounded: the job finished and processed everything before the end
    timestamp.

    Raises:
        ReplayError: The job failed or stopped before catching up (the registry row is marked ``failed``; a
            failed job's driver is stopped - in a cluster, a crash-looping Deployment is not left restarting).
    """
    vv = ViewVersion.resolve(view, version, settings)
    status = runner.status(view, version)
    p = sample or _sample(vv, end_timestamp_ms=end_timestamp_ms, previous=None, record=True, by=by)
    registry = registry_of(settings)
    rec = registry.get(view, version)
    ref = vv.ref
    if end_timestamp_ms is not None:
        reached = all(p.processed_offsets.get(part, 0) >= off for part, off in p.log_end.items())
        done = status.state == "finished" and reached
        reason = (f"finished: every record before ts {end_timestamp_ms} processed" if done else
                  f"bounded run {status.state}, {p.lag:,} records before ts {end_timestamp_ms} left")
    elif status.state != "running" or p.batch_id is None:
        done, reason = False, ("no micro-batch committed yet" if status.state == "running" else
                               f"job {status.state}")
    elif p.lag == 0 and (owed := _owed_output(vv)):
        done, reason = False, owed
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
        if status.state == "failed":  # a crash-looping driver: stopped, not left restarting (its table stays)
            try:
                runner.stop(view, version)
                reason += "; its driver is stopped"
            except Exception as exc:  # noqa: BLE001 - the replay fails all the same; say what is left running
                reason += f"; its driver could not be stopped ({one_line(exc)}): stop it with the runner"
        if rec is not None and rec.state in {"building", "caught_up"}:
            registry.set_state(view, version, "failed", by=by, note=reason[:500])
        release(settings, view, version, by=by, note=f"replay failed: {status.state}")
        raise ReplayError(reason)
    if done and rec is not None and rec.state in {"building", "caught_up"}:
        registry.set_state(view, version, "caught_up", by=by, expected={"building", "caught_up"},
                           end_offsets=spark_offsets(p.topic, p.processed_offsets),
                           note=f"caught up: {reason}; {p.summary()}"[:500])
    if done:  # every record it had to replay is read: the topic's own retention is enough again
        release(settings, view, version, by=by, note=f"caught up: {reason}")
    return CatchUp(done, reason)


def follow(req: Any, settings: Settings, runner: Runner, *, timeout: float = 0.0, poll: float = 2.0,
           record_every: float = 10.0, on_sample: Callable[[Progress], None] | None = None) -> CatchUp:
    """Follow a launched replay until it has caught up: sample its :func:`progress` every ``poll`` s (the
    registry records a sample every ``record_every`` s, not every poll; the rate and ETA come from the last ten),
    hand each sample to ``on_sample`` (a progress bar) and return the positive :func:`caught_up` verdict.

    Raises:
        ReplayError: not caught up after ``timeout`` s (0: no limit); the job keeps running.
    """
    samples: deque = deque(maxlen=10)
    deadline = time.monotonic() + timeout if timeout else None
    last_record: float | None = None
    while True:
        record = last_record is None or time.monotonic() - last_record >= record_every
        sample = progress(req.view, req.version, settings, end_timestamp_ms=req.end_timestamp_ms,
                          previous=samples[0] if samples else None, record=record, by=req.triggered_by)
        if record:
            last_record = time.monotonic()
        samples.append(sample)
        if runner is not None:  # what the job's running micro-batch has read (its /metrics)
            sample = with_reading(sample, runner.status(req.view, req.version).metrics_url)
        if on_sample is not None:
            on_sample(sample)
        caught = caught_up(req.view, req.version, settings, runner, by=req.triggered_by,
                           end_timestamp_ms=req.end_timestamp_ms, max_lag=req.max_lag, sample=sample)
        if caught:
            return caught
        if deadline is not None and time.monotonic() > deadline:
            raise ReplayError(f"{req.ref} not caught up after {timeout:.0f}s ({sample.summary()}); the job keeps "
                              f"running - follow it again with `{settings.cli} replay {req.view} --version "
                              f"{req.version}` (it verifies it once caught up)")
        time.sleep(poll)


def metric_samples(url: str, *, timeout: float) -> list[Any]:
    """Every sample of a job's ``/metrics`` page (``prometheus_client`` samples: name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def with_reading(sample: Progress, metrics_url: str | None) -> Progress:
    """``sample`` with what the job's running micro-batch has read (its ``/metrics``), and the job's ETA from
    its read rate while it runs: a replay that reads its range in one micro-batch shows progress before it
    commits. Unchanged when the job exports nothing (no metrics, unreachable, no long batch)."""
    if not metrics_url or sample.eta_seconds == 0.0:
        return sample
    try:
        values = {s.name: float(s.value) for s in metric_samples(metrics_url, timeout=2)
                  if s.name in ("kappa_batch_records_read", "kappa_replay_eta_seconds")}
    except Exception as exc:  # noqa: BLE001 - an estimate: the checkpoint's progress stands without it
        log.debug("%s: no in-batch progress from %s: %s", sample.ref, metrics_url, one_line(exc))
        return sample
    read = int(values.get("kappa_batch_records_read") or 0)
    if read <= 0:
        return sample
    read = min(read, max(0, sample.total - sample.done))
    eta = values.get("kappa_replay_eta_seconds")
    return replace(sample, reading=read, ratio=min(0.999, (sample.done + read) / sample.total) if sample.total else 1.0,
                   eta_seconds=eta if eta is not None and 0 < eta < math.inf else sample.eta_seconds)


def _owed_output(vv: ViewVersion) -> str | None:
    """Why a stateful version that read everything is not current yet: its engine still owes the no-data batch
    that applies the watermark its last batch raised (the windows it closes are not in the table yet); None
    when nothing is owed."""
    pending = vv.pending_watermark()
    if pending is None or not vv.definition.stateful:
        return None
    return (f"every record read, but the watermark its last batch raised ({_utc(pending[0])} -> {_utc(pending[1])}) "
            "is not applied yet: the no-data batch that emits the windows it closes has not run")


def _utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S") if ms else "none"


def _serving_lag(view: str, version: int, settings: Settings) -> tuple[int, int] | None:
    """(version, records it lags behind the log end) of the version serving ``view`` now; None if no other
    version serves, it has committed nothing yet, or its lag cannot be read."""
    try:
        serving = registry_of(settings).serving(view)
        if serving is None or serving.version == version:
            return None
        sample = progress(view, serving.version, settings)
        return (serving.version, sample.lag) if sample.batch_id is not None else None
    except Exception as exc:  # noqa: BLE001 - only the comparison is lost; max_lag still applies
        log.warning("%s: cannot sample the serving version's lag: %s", view, one_line(exc))
        return None

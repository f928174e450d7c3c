"""The watch window after a switch: roll back automatically when the new serving version breaks.

Verification proves a version right over the log it has seen; the first minutes of serving show how it behaves on
what comes next. For ``minutes`` after a promotion the watch polls the new version every ``poll_seconds``:

* its job runs (the runner's status: a failed or stopped driver breaks the version at once);
* its own metrics endpoint (what a Prometheus alert would read): the share of records read during the window
  that went to the quarantine (``kappa_quarantined_records_total`` / ``kappa_input_rows_total``), the share of
  checked rows breaking each declared expectation against its ``max_violation_rate``
  (``kappa_expectation_violations_total`` / ``kappa_expectation_rows_checked_total``), and its lag
  (``kappa_partition_lag_records``, summed); a lag over ``max_lag`` breaks it after ``strikes`` polls in a row, so
  one slow batch does not;
* when its metrics cannot be had - the runner names no endpoint, or the endpoint does not answer from where the
  watch runs (in the cluster, Airflow's pod; the view drivers' NetworkPolicy may admit only Prometheus) - its
  checkpoint instead, read without Spark (:func:`kappa.control.replay.following.progress`): the records between the
  offsets its last committed micro-batch reached and the log end now. That lag over ``max_lag``, or a checkpoint
  that cannot be read either, breaks it after ``strikes`` polls in a row; the quarantine share and the expectations
  are not judged then, and the result says so (``metrics=False``, its reason). A job that is down is judged by the
  runner's status in both cases;

and when it breaks, rolls back to the version that served before (:func:`kappa.control.replay.switch.rollback`: alias back,
its job restarted from its checkpoint, the new one stopped) and records why in the registry's audit log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from kappa.errors import one_line
from kappa.identity import view_ref

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.control.runners.base import Runner

__all__ = ["WatchPolicy", "WatchResult", "watch"]

log = logging.getLogger("kappa.control.replay.watch")


@dataclass(frozen=True, kw_only=True)
class WatchPolicy:
    """How long and how strictly a freshly promoted version is watched.

    Attributes:
        minutes: Length of the window (0: no watch).
        poll_seconds: Time between two checks.
        max_lag: Records behind the log end tolerated (for ``strikes`` polls in a row).
        max_quarantine_rate: Share of the window's records sent to the quarantine that breaks the version.
        min_records: Rates are judged only once the window read at least this many records.
        strikes: Consecutive bad polls (lag, neither metrics nor checkpoint readable) before a rollback.
    """

    minutes: float = 10.0
    poll_seconds: float = 15.0
    max_lag: int = 50_000
    max_quarantine_rate: float = 0.05
    min_records: int = 200
    strikes: int = 3

    def __post_init__(self) -> None:
        if self.minutes < 0 or self.poll_seconds <= 0 or self.max_lag < 0 or self.strikes < 1:
            raise ValueError("watch: minutes >= 0, poll_seconds > 0, max_lag >= 0 and strikes >= 1")
        if not 0.0 <= self.max_quarantine_rate <= 1.0:
            raise ValueError("watch: max_quarantine_rate must be within [0, 1]")


@dataclass(frozen=True, kw_only=True)
class WatchResult:
    """Outcome of :func:`watch`.

    ``metrics``: whether the job's metrics were read at every check; False when some or all checks judged the
    checkpoint instead (the reason then says why the metrics were not available and what was not judged).
    """

    view: str
    version: int
    healthy: bool
    reason: str
    rolled_back_to: int | None = None
    polls: int = 0
    seconds: float = 0.0
    records: int = 0
    quarantined: int = 0
    metrics: bool = True

    @property
    def message(self) -> str:
        ref = view_ref(self.view, self.version)
        if self.healthy:
            return f"{ref} stayed healthy for {self.seconds:.0f} s ({self.polls} checks): {self.reason}"
        back = f"; rolled back to v{self.rolled_back_to}" if self.rolled_back_to is not None else ""
        return f"{ref} broke {self.seconds:.0f} s after the switch: {self.reason}{back}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "message": self.message}


def _scrape(url: str) -> dict[str, float]:
    """The samples of a /metrics page this watch reads, summed over their other labels."""
    from kappa.control.replay.following import metric_samples

    out: dict[str, float] = {}
    for sample in metric_samples(url, timeout=10):
        name = sample.name
        if name == "kappa_expectation_violations_total":
            name = f"{name}:{sample.labels.get('expectation', '')}"
        elif name not in ("kappa_input_rows_total", "kappa_quarantined_records_total",
                          "kappa_expectation_rows_checked_total", "kappa_partition_lag_records"):
            continue
        out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def watch(view: str, version: int, settings: "Settings", runner: "Runner", *, previous_version: int | None,
          policy: WatchPolicy, by: str, sleep: Callable[[float], None] = time.sleep,
          cascade: bool = False) -> WatchResult:
    """Watch ``view@v<version>`` (just promoted, replacing ``previous_version``) for ``policy.minutes``; roll back
    to ``previous_version`` when it breaks (see the module doc). Without a previous version nothing can be rolled
    back to: a break is only reported. ``cascade``: the views over it were switched with it (a cascading replay)
    and the rollback switches them back with it."""
    from kappa.control.replay.switch import rollback
    from kappa.control.replay.version import ViewVersion, registry_of

    vv = ViewVersion.resolve(view, version, settings)
    limits = {e.name: e.max_violation_rate for e in vv.definition.expectations if e.max_violation_rate is not None}
    started = time.monotonic()
    deadline = started + policy.minutes * 60
    baseline: dict[str, float] | None = None
    last: dict[str, float] = {}
    checkpoint = _CheckpointWindow(view, version, settings)
    unavailable = ""  # why the metrics could not be read, at the last check that could not
    polls = strikes = 0
    reason = ""
    while True:
        polls += 1
        status = runner.status(view, version)
        if status.state != "running":
            reason = f"its job is {status.state}" + (f" ({status.detail})" if status.detail else "")
            break
        bad = None
        sample = None
        if not status.metrics_url:
            unavailable = "the job publishes no metrics URL"
        else:
            try:
                sample = _scrape(status.metrics_url)
            except Exception as exc:  # noqa: BLE001 - a NetworkPolicy, a driver restarting: the checkpoint tells
                unavailable = f"{status.metrics_url} does not answer here ({one_line(exc)})"
        if sample is not None:
            last = sample
            if baseline is None:
                baseline = sample
            reason = _judge(sample, baseline, policy, limits)
            if reason.startswith("!"):
                reason = reason[1:]
                break
            lag = sample.get("kappa_partition_lag_records", 0.0)
            if lag > policy.max_lag:
                bad = f"it lags {lag:,.0f} records behind the log (max {policy.max_lag:,})"
        else:
            bad = checkpoint.check(policy)
            if bad is not None:
                bad = f"its metrics are not available ({unavailable}) and {bad}"
        if bad is not None:
            strikes += 1
            log.warning("%s@v%s: %s (%s of %s checks in a row)", view, version, bad, strikes, policy.strikes)
            if strikes >= policy.strikes:
                reason = f"{bad}, {strikes} checks in a row"
                break
        else:
            strikes = 0
        if time.monotonic() >= deadline:
            records, quarantined = _window(last, baseline)
            summary = f"{records:,} records read, {quarantined:,} quarantined"
            if checkpoint.polls and baseline is None:  # no check could read the metrics
                records, summary = checkpoint.records, checkpoint.summary(unavailable)
            elif checkpoint.polls:  # some could
                summary = (f"{summary} (its metrics, {polls - checkpoint.polls} of {polls} checks); the other "
                           f"checks: {checkpoint.summary(unavailable)}")
            return WatchResult(view=view, version=version, healthy=True, polls=polls,
                               seconds=time.monotonic() - started, records=records, quarantined=quarantined,
                               reason=summary, metrics=not checkpoint.polls)
        sleep(policy.poll_seconds)
    records, quarantined = _window(last, baseline)
    if checkpoint.polls and baseline is None:
        records = checkpoint.records
    seconds = time.monotonic() - started
    log.warning("%s@v%s broke %.0f s after the switch: %s", view, version, seconds, reason)
    rolled = None
    if previous_version is not None and previous_version != version:
        rollback(view, previous_version, settings, runner, by=by, cascade=cascade)
        rolled = previous_version
        registry_of(settings).set_state(  # the audit line saying why
            view, version, "retired", by=by, expected={"retired"},
            note=f"rolled back to v{previous_version} automatically: {reason}"[:1000])
    return WatchResult(view=view, version=version, healthy=False, reason=reason, rolled_back_to=rolled, polls=polls,
                       seconds=seconds, records=records, quarantined=quarantined, metrics=not checkpoint.polls)


class _CheckpointWindow:
    """The watch's judgement when the job's metrics cannot be had: its checkpoint's last committed offsets
    against the log end (:func:`kappa.control.replay.following.progress`, no Spark), over the window."""

    def __init__(self, view: str, version: int, settings: "Settings") -> None:
        self.view, self.version, self.settings = view, version, settings
        self.polls = 0
        self.first: dict[int, int] | None = None
        self.processed: dict[int, int] = {}
        self.batch: int | None = None
        self.lag: int | None = None

    @property
    def records(self) -> int:
        """Records its committed micro-batches read since the first check that read the checkpoint."""
        first = self.first or {}
        return sum(max(0, end - first.get(p, end)) for p, end in self.processed.items())

    def check(self, policy: WatchPolicy) -> str | None:
        """None when the checkpoint is within the policy, else why not (one strike)."""
        from kappa.control.replay.following import progress

        self.polls += 1
        try:
            sample = progress(self.view, self.version, self.settings)
        except Exception as exc:  # noqa: BLE001 - the lake or the broker unreachable for a moment
            return f"its checkpoint cannot be read ({one_line(exc)})"
        if sample.batch_id is None:
            return "its checkpoint holds no committed micro-batch"
        if self.first is None:
            self.first = dict(sample.processed_offsets)
        self.processed, self.batch, self.lag = dict(sample.processed_offsets), sample.batch_id, sample.lag
        if sample.lag > policy.max_lag:
            return (f"its checkpoint lags {sample.lag:,} records behind the log (batch {sample.batch_id}, "
                    f"max {policy.max_lag:,})")
        return None

    def summary(self, unavailable: str) -> str:
        return (f"metrics not available ({unavailable}): judged on its checkpoint, {self.records:,} records "
                f"committed since the switch, lag {self.lag if self.lag is not None else '?'} "
                f"(batch {self.batch if self.batch is not None else '-'}); quarantine share and expectations "
                f"not judged")


def _window(sample: dict[str, float], baseline: dict[str, float] | None) -> tuple[int, int]:
    base = baseline or {}
    return (int(sample.get("kappa_input_rows_total", 0.0) - base.get("kappa_input_rows_total", 0.0)),
            int(sample.get("kappa_quarantined_records_total", 0.0) - base.get("kappa_quarantined_records_total", 0.0)))


def _judge(sample: dict[str, float], baseline: dict[str, float], policy: WatchPolicy,
           limits: dict[str, float]) -> str:
    """``"!<reason>"`` when the window's rates break the policy or a declared limit, else a summary."""
    records, quarantined = _window(sample, baseline)
    if records >= policy.min_records and quarantined / records > policy.max_quarantine_rate:
        return (f"!{quarantined:,} of the {records:,} records read since the switch went to the quarantine "
                f"({quarantined / records:.1%} > {policy.max_quarantine_rate:.1%})")
    checked = (sample.get("kappa_expectation_rows_checked_total", 0.0)
               - baseline.get("kappa_expectation_rows_checked_total", 0.0))
    for name, limit in limits.items():
        key = f"kappa_expectation_violations_total:{name}"
        violated = sample.get(key, 0.0) - baseline.get(key, 0.0)
        if checked >= policy.min_records and violated / checked > limit:
            return (f"!expectation {name} broke on {violated:,.0f} of {checked:,.0f} rows since the switch "
                    f"({violated / checked:.1%} > {limit:.1%})")
    return f"{records:,} records read, {quarantined:,} quarantined"

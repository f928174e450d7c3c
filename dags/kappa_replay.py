"""
### kappa_replay — rebuild a view version from the retained log, verify it, switch readers to it

When a view's business logic changes, its new version (`jobs/<view>/v<N>.py`, declared in `kappa/platform.yaml`)
is replayed over the retained Kafka log into its **own** table, next to the version readers use. Readers keep
resolving the serving alias to the old, complete version until the new one is proven equal to an independent
recomputation; then one Delta commit switches the alias.

Every task is one call into `kappa.control.replay` — the same code as `kappa replay VIEW --version N` — and is
idempotent: retrying a task, or triggering the DAG again for the same version, changes nothing already done.

| task | what it does |
|---|---|
| `preflight` | with `cascade`: which dependants get built (a dependant declaring no version over the new one fails the run here, in one line); the view's topic still retains the start on every partition (else: replay from the `events_raw` archive); estimates records, bytes and ETA; a version that already serves skips the whole run |
| `launch` | registers the version (`building`, resolved start offsets) and starts its job (no-op if it runs); with `cascade` the same for each dependant, from the earliest offset of the topic the new version publishes |
| `wait_caught_up` | sensor in reschedule mode, logs progress % (the job's `kappa_replay_progress_ratio`), lag, ETA and why it is (not yet) caught up - the same line in its XCom `kappa_progress`, which `kappa airflow trigger --wait` prints; live: lag <= `max_lag` (or no more than the serving version's own lag - said so), bounded: job finished |
| `wait_chain` | with `cascade` only (else done at once): the new version has published what it held when it caught up, and every dependant built against it has read all of it |
| `verify` | `strict`: the table equals a recompute of the version's own transform over the exact micro-batches it holds (and the plain-Python oracle, for versions that have one); else the version is `failed` (first differing key in the log) and serving is untouched |
| `promote_requested` → `promote` | only with `auto_promote`: atomic alias switch, old version `retired` (kept `keep_hours`), its job stopped; with `cascade` the whole chain switches in one alias commit |
| `watch` | for `watch_minutes` after the switch: the new version's job runs, the share of records it quarantines stays within `watch_max_quarantine_rate`, its expectations within their limits, its lag within `watch_max_lag` (when its metrics cannot be reached from Airflow's pod: its checkpoint's lag behind the log, said so in the result); when it breaks, rolls back to the replaced version (its job restarted) and fails with the reason, also written to the registry's audit log |

Params: `view`, `version` (required), `start` (`earliest` \\| `timestamp` + `start_timestamp_ms` \\| `offsets` +
`start_offsets` JSON), `end` (`live` \\| `timestamp` + `end_timestamp_ms`), `upgrade` (`replay` \\| `continue`;
default: what the version declares), `verify` (`strict` \\| `none`),
`source` (`auto` \\| `log` \\| `archive`: where history is read, see docs/replay.md),
`auto_promote`, `keep_hours`, `max_offsets_per_trigger`, `max_lag` (live: caught up at this lag), `watch_minutes`
(default 10; 0: no watch), `watch_max_quarantine_rate` (0.05), `watch_max_lag` (50,000), `cascade` (also rebuild
the views over this one against it, verify all, promote the chain together; a watch rollback switches the chain
back), `dry_run` (preflight + the plan of steps in its log; every later task skipped, nothing changed).

    airflow dags trigger kappa_replay --conf '{"view": "campaign_window_counts", "version": 2, "auto_promote": true}'

A task that fails records why, in one line, in its XCom `kappa_failure` (`kappa airflow trigger --wait` prints it).

One run at a time (`max_active_runs=1`: a replay is a whole extra Spark driver). The sensor's poke interval and
timeout come from `KAPPA_REPLAY_POKE_SECONDS` (default 60) and
`KAPPA_REPLAY_TIMEOUT_SECONDS` (default 86400); the runner from `KAPPA_RUNNER` (`local` | `kubernetes`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from airflow.sdk import Param, PokeReturnValue, dag, task

from kappa.catalog import platform_file
from kappa.config import DEFAULT_KEEP_HOURS, Settings
from kappa.errors import one_line
from kappa.front.airflow_tasks import progress_from_logs, record_progress, records_failure

log = logging.getLogger(__name__)

DAG_ID = Path(__file__).stem
#: Views declared in kappa/platform.yaml (a local file, read with yaml only: no network, no Spark).
VIEWS: list[str] = sorted((yaml.safe_load(platform_file().read_text(encoding="utf-8")) or {}).get("views") or {})
#: How often the wait sensor checks the replay, and when it gives up (KAPPA_REPLAY_POKE_SECONDS / _TIMEOUT_SECONDS).
POKE_SECONDS = Settings.from_env().replay_poke_seconds or 60.0
WAIT_TIMEOUT_SECONDS = Settings.from_env().replay_timeout_seconds


@contextmanager
def _one_line_failures() -> Iterator[None]:
    """A request the platform refuses (ValueError: ReplayError, RegistryError...) fails the task at once, in one
    line and without retries; anything else (Kafka unreachable...) is raised as is and retried."""
    try:
        yield
    except ValueError as exc:
        raise AirflowFailException(one_line(exc)) from None


def _request(params: dict[str, Any], run_id: str | None) -> Any:
    from kappa.control.replay import ReplayRequest

    return ReplayRequest.from_params(params, triggered_by=f"airflow:{DAG_ID}:{run_id}")


def _chain(req: Any) -> list[tuple[str, int]]:
    """The dependants a cascade builds (none without ``cascade``; kappa.control.replay.cascade)."""
    if not req.cascade:
        return []
    from kappa.control.replay.cascade import chain

    return chain(req.view, req.version)


def _platform() -> tuple[Any, Any]:
    from kappa.control.runners import runner_for

    settings = Settings.from_env()
    return settings, runner_for(settings)


@dag(
    dag_id=DAG_ID,
    doc_md=__doc__,
    schedule=None,  # triggered by operators only
    is_paused_upon_creation=False,  # so a trigger from the UI runs at once (nothing is scheduled)
    catchup=False,
    max_active_runs=1,
    tags=["kappa", "replay"],
    default_args={"retries": 2, "retry_delay": timedelta(seconds=30)},
    params={
        "view": Param(type="string", enum=VIEWS, title="View",
                      description="View of kappa/platform.yaml to rebuild."),
        "version": Param(type="integer", minimum=1, title="Version",
                         description="Version to replay (declared under the view's versions)."),
        "start": Param("earliest", type="string", enum=["earliest", "timestamp", "offsets"], title="Start",
                       description="earliest: log start; timestamp: start_timestamp_ms; offsets: start_offsets."),
        "start_timestamp_ms": Param(None, type=["null", "integer"], minimum=0, title="Start timestamp (ms)",
                                    description="Epoch milliseconds, with start=timestamp."),
        "start_offsets": Param(None, type=["null", "string"], title="Start offsets",
                               description='JSON, with start=offsets: {"0": 1200, "1": 1180, ...} (every partition).'),
        "end": Param("live", type="string", enum=["live", "timestamp"], title="End",
                     description="live: keep following the log; timestamp: stop at end_timestamp_ms (bounded)."),
        "end_timestamp_ms": Param(None, type=["null", "integer"], minimum=0, title="End timestamp (ms)",
                                  description="Epoch milliseconds, with end=timestamp."),
        "upgrade": Param(None, type=["null", "string"], enum=[None, "replay", "continue"], title="Upgrade mode",
                         description="replay: rebuild from start; continue: seed with the serving version's rows "
                                     "and start where it got (stateless versions only; takes no start/end); "
                                     "empty: what the version declares."),
        "verify": Param("strict", type="string", enum=["strict", "none"], title="Verification",
                        description="strict: must equal a recompute of its own transform (and the oracle, if any); "
                                    "none: accept as is."),
        "auto_promote": Param(False, type="boolean", title="Promote when verified",
                              description="Switch the serving alias once verified."),
        "keep_hours": Param(DEFAULT_KEEP_HOURS, type="number", minimum=0, title="Keep old version (hours)",
                            description="How long the replaced version's table is kept for rollback."),
        "max_offsets_per_trigger": Param(None, type=["null", "integer"], minimum=1, title="Max offsets per batch",
                                         description="Bound the replay's micro-batch size (empty: unbounded)."),
        "max_lag": Param(2000, type="integer", minimum=0, title="Caught up at lag",
                         description="A live replay is caught up once at most this many records lag behind."),
        "watch_minutes": Param(10, type="number", minimum=0, title="Watch after the switch (minutes)",
                               description="Roll back automatically if the new version breaks within this window "
                                           "(0: no watch)."),
        "watch_max_quarantine_rate": Param(0.05, type="number", minimum=0, maximum=1,
                                           title="Watch: max quarantined share",
                                           description="Share of the records read since the switch that may go "
                                                       "to the quarantine."),
        "watch_max_lag": Param(50000, type="integer", minimum=0, title="Watch: max lag",
                               description="Records the new version may lag behind (for several checks in a row)."),
        "source": Param("auto", type="string", enum=["auto", "log", "archive"], title="History source",
                        description="auto: the topic's archive for what the log no longer holds, or where it serves "
                                    "1M+ records (faster than the log there); log: never the archive; archive: as "
                                    "far as it reaches from the start."),
        "cascade": Param(False, type="boolean", title="Cascade to the views over it",
                         description="Also rebuild the views over this one against the new version (their declared "
                                     "versions over it), verify them all and promote the chain in one alias commit."),
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Preflight and the plan of steps only (logged); every later task is skipped "
                                     "and nothing changes."),
    },
)
def kappa_replay() -> None:
    @task
    @records_failure
    def preflight(params: dict[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
        """Retention covers the start, size and ETA estimate; skip everything if the version already serves."""
        from kappa.control import replay

        with _one_line_failures():
            req = _request(params or {}, run_id)
            settings, runner = _platform()
            try:
                pre = replay.preflight(req, settings, runner, resume=True)
            except replay.VersionBusy as exc:
                if exc.record is not None and exc.record.state == "serving":  # done before: nothing to do
                    raise AirflowSkipException(str(exc)) from None
                raise
            chain = _chain(req)
        log.info("%s", pre.summary())
        for i, step in enumerate(pre.plan(), 1):
            log.info("plan %s. %s", i, step)
        for view, version in chain:
            log.info("cascade: build %s@v%s over %s, verify it, switch with it", view, version, req.ref)
        return pre.to_dict()

    @task
    @records_failure
    def launch(pre: dict[str, Any], params: dict[str, Any] | None = None,
               run_id: str | None = None) -> dict[str, Any]:
        """Register the version (building) and start its job; a job that already runs is left alone."""
        from kappa.control import replay

        if (params or {}).get("dry_run"):
            raise AirflowSkipException("dry run: preflight and plan only (see the preflight log); nothing changed")

        with _one_line_failures():
            req = _request(params or {}, run_id)
            settings, runner = _platform()
            rec = replay.launch(req, settings, runner, replay.Preflight.from_dict(pre))
            if req.cascade:
                from kappa.control.replay.cascade import launch_chain

                for dep in launch_chain(req, settings, runner):
                    log.info("cascade: %s: %s, app id %s", dep.ref, dep.state, dep.app_id)
        log.info("%s: %s, app id %s, starting %s", rec.ref, rec.state, rec.app_id, rec.starting)
        return rec.to_dict()

    @task.sensor(poke_interval=POKE_SECONDS, timeout=WAIT_TIMEOUT_SECONDS, mode="reschedule")
    @records_failure
    def wait_caught_up(launched: dict[str, Any], params: dict[str, Any] | None = None,
                       run_id: str | None = None) -> PokeReturnValue:
        """Sample progress (recorded in the registry), log it, done once the replay has caught up."""
        from kappa.control import replay

        with _one_line_failures():
            req = _request(params or {}, run_id)
            settings, runner = _platform()
            sample = replay.progress(req.view, req.version, settings, end_timestamp_ms=req.end_timestamp_ms,
                                     record=True, by=req.triggered_by)
            sample = replay.with_reading(sample, runner.status(req.view, req.version).metrics_url)
            log.info("%s", sample.summary())
            log.info("metrics:\n%s", sample.metrics_text())
            caught = replay.caught_up(req.view, req.version, settings, runner, by=req.triggered_by,
                                      end_timestamp_ms=req.end_timestamp_ms, max_lag=req.max_lag, sample=sample)
            published = None
            if caught.done and req.cascade:  # what the views over it must have read: the table as it is now
                from kappa.control.replay.cascade import table_version

                published = table_version(replay.ViewVersion.resolve(req.view, req.version, settings))
        log.info("%s: %s", "caught up" if caught else "not caught up yet", caught.reason)
        record_progress(f"{sample.summary()}; {'caught up' if caught else 'not caught up yet'}: {caught.reason}")
        return PokeReturnValue(is_done=caught.done, xcom_value={
            "summary": sample.summary(), "batch_id": sample.batch_id, "ratio": sample.ratio, "lag": sample.lag,
            "caught_up": caught.reason, "published": published})

    @task.sensor(poke_interval=POKE_SECONDS, timeout=WAIT_TIMEOUT_SECONDS, mode="reschedule")
    @records_failure
    def wait_chain(caught: dict[str, Any], params: dict[str, Any] | None = None,
                   run_id: str | None = None) -> PokeReturnValue:
        """With cascade: the views built over the new version have read what it published (else done at once)."""
        with _one_line_failures():
            req = _request(params or {}, run_id)
            if not req.cascade:
                return PokeReturnValue(is_done=True, xcom_value=caught)
            from kappa.control.replay.cascade import chain_caught_up

            settings, runner = _platform()
            done = chain_caught_up(req, settings, runner, published=caught["published"])
        log.info("%s: %s", "the chain caught up" if done else "not yet", done.reason)
        record_progress(f"{'the chain caught up' if done else 'the chain: not yet'}: {done.reason}")
        return PokeReturnValue(is_done=done.done, xcom_value={**caught, "chain": done.reason})

    @task
    @records_failure
    def verify(caught: dict[str, Any], params: dict[str, Any] | None = None,
               run_id: str | None = None) -> dict[str, Any]:
        """Strict equality with a recompute of the version's own transform over the exact micro-batches the table
        holds, and with the plain-Python oracle when one exists (or verify=none)."""
        from kappa.control import replay

        with _one_line_failures(), progress_from_logs("kappa.control.replay", "kappa.verify.recompute",
                                                      "kappa.runtime.rerun"):
            req = _request(params or {}, run_id)
            settings, _runner = _platform()
            results = [replay.verify(view, version, settings, req.verify, by=req.triggered_by,
                                     end_timestamp_ms=req.end_timestamp_ms)
                       for view, version in [(req.view, req.version), *_chain(req)]]
        for result in results:
            log.info("%s", result.message)
            for example in result.examples:
                log.info("  %s", example)
            if result.report:  # what changes for readers: judge the logic change before promoting (also in XCom)
                from kappa.verify.diffreport import DiffReport

                report = DiffReport(**result.report)
                log.info("%s", report.summary())
                for line in report.lines():
                    log.info("  %s", line)
        failed = [r.message for r in results if not r.passed]
        if failed:
            raise AirflowFailException("; ".join(failed))
        return results[0].to_dict()

    @task.short_circuit
    @records_failure
    def promote_requested(verification: dict[str, Any], params: dict[str, Any] | None = None) -> bool:
        """Continue to promote only with auto_promote (otherwise `kappa promote` does it later)."""
        return bool((params or {}).get("auto_promote"))

    @task
    @records_failure
    def promote(verification: dict[str, Any], params: dict[str, Any] | None = None,
                run_id: str | None = None) -> dict[str, Any]:
        """Atomic alias switch (idempotent), old version retired and its job stopped."""
        from kappa.control import replay

        with _one_line_failures():
            req = _request(params or {}, run_id)
            settings, runner = _platform()
            results = replay.promote_chain([(req.view, req.version), *_chain(req)], settings, runner,
                                           by=req.triggered_by, keep_hours=req.keep_hours)
        for result in results:
            log.info("%s", result.message)
        result = results[0]
        return {"view": result.view, "version": result.version, "previous_version": result.previous_version,
                "changed": result.changed, "message": "; ".join(r.message for r in results)}

    @task
    @records_failure
    def watch(switched: dict[str, Any], params: dict[str, Any] | None = None,
              run_id: str | None = None) -> dict[str, Any]:
        """Watch window after the switch; roll back to the replaced version when the new one breaks."""
        from kappa.control.replay.watch import watch as watch_version

        with _one_line_failures():
            req = _request(params or {}, run_id)
            settings, runner = _platform()
            policy = req.watch_policy()
        previous = switched.get("previous_version")
        if policy.minutes == 0 or previous in (None, req.version):
            why = "watch_minutes is 0" if policy.minutes == 0 else "no earlier version to roll back to"
            log.info("no watch: %s", why)
            return {"healthy": True, "watched": False, "reason": why}
        result = watch_version(req.view, req.version, settings, runner, previous_version=previous, policy=policy,
                               by=req.triggered_by, cascade=req.cascade)
        log.info("%s", result.message)
        if not result.healthy:
            raise AirflowFailException(result.message)
        return {**result.to_dict(), "watched": True}

    checked = verify(wait_chain(wait_caught_up(launch(preflight()))))
    gate = promote_requested(checked)
    switched = promote(checked)
    gate >> switched
    watch(switched)


kappa_replay()

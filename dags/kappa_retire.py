"""
### kappa_retire — delete the view versions past their keep period; keep the registry and Airflow small

Every hour, on the hour (the first run at the next full hour after Airflow starts, not at its start; a run due while
Airflow's API server is still starting waits at least 3 minutes for it): each `retired` version whose `delete_after`
has passed (set by the promote or rollback that replaced it, `keep_hours`, default 7 days) and that the serving
alias does not point to has its job stopped, is marked `deleted_at` in the registry (from then on it can never serve
again) and its folder — table and checkpoint — is removed. One call into `kappa.control.replay.retire_expired`, the
same code as `kappa retire`. Beside it, the replays' retention leases that expired (their driver stopped showing
life) end, and the topics converge: the declared retention comes back where no lease holds (`kappa.control.leases`,
the same as `kappa topics ensure`). The control plane's tables in the lake (the registry, the serving alias, the
leases) are compacted, VACUUMed and checkpointed (`kappa.runtime.upkeep.keep_registry`). Airflow's own history older
than `airflow_history_days` (30) leaves its metadata database - runs, task instances, XComs, log rows, jobs
(`airflow db clean`, no archive tables) - so the database stays the size of a month; the platform's own record of
every replay, promotion and rollback is the registry's events table in the lake, which this keeps.

Safe to run at any time and as often as wanted: a version is only ever deleted once, a crash between marking and
removing is finished by the next run, and a rollback that made a version serve again keeps it.
`dry_run` only lists what would be deleted. A version the run could not delete (a lake on an object store:
remove its folder with the store's tools or a lifecycle rule) fails the run, naming it.

    airflow dags trigger kappa_retire --conf '{"dry_run": true}'
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk import CronTriggerTimetable, Param, dag, task

from kappa.errors import one_line
from kappa.front.airflow_tasks import records_failure

log = logging.getLogger(__name__)

DAG_ID = Path(__file__).stem


@dag(
    dag_id=DAG_ID,
    doc_md=__doc__,
    schedule=CronTriggerTimetable("0 * * * *", timezone="UTC", run_immediately=timedelta(0)),
    is_paused_upon_creation=False,
    catchup=False,
    max_active_runs=1,
    tags=["kappa", "replay"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=1)},
    params={
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Only list the versions past their keep period (and what Airflow would clean)."),
        "airflow_history_days": Param(30, type="integer", minimum=1, title="Airflow history (days)",
                                      description="Airflow's runs, task instances, XComs and log rows older than "
                                                  "this leave its metadata database."),
    },
)
def kappa_retire() -> None:
    @task
    @records_failure
    def retire_expired(params: dict[str, Any] | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        """Stop, mark and delete every retired version past its keep period; the outcome per version."""
        from kappa.control import replay
        from kappa.config import Settings
        from kappa.control.runners import runner_for

        settings = Settings.from_env()
        if (params or {}).get("dry_run"):
            due = replay.alias_of(settings).expired()
            for rec in due:
                log.info("%s: kept until %s UTC, would be deleted (%s)", rec.ref,
                         f"{rec.delete_after:%Y-%m-%d %H:%M}", rec.table_path)
            if not due:
                log.info("nothing to retire: no retired version is past its keep period")
            return [{"view": r.view, "version": r.version, "table_path": r.table_path, "deleted": False,
                     "message": "dry run"} for r in due]
        try:
            results = replay.retire_expired(settings, runner_for(settings),
                                            by=f"airflow:{DAG_ID}:{run_id}")
        except ValueError as exc:  # refused by the platform: one line
            raise AirflowFailException(one_line(exc)) from None
        for result in results:
            log.info("%s", result.message)
        if not results:
            log.info("nothing to retire: no retired version is past its keep period")
        kept = [r.message for r in results if not r.deleted]
        if kept:
            raise AirflowFailException(f"{len(kept)} expired version(s) not deleted: {'; '.join(kept)}")
        return [{"view": r.view, "version": r.version, "table_path": r.table_path, "deleted": r.deleted,
                 "message": r.message} for r in results]

    @task
    @records_failure
    def end_expired_leases(params: dict[str, Any] | None = None) -> list[str]:
        """End the retention leases whose replay stopped showing life (or left ``building``) and converge the
        topics: the declared retention comes back where no lease holds (kappa.control.leases)."""
        from kappa.config import Settings
        from kappa.control.leases import active_leases, converge_topics, leases

        settings = Settings.from_env()
        if not leases(settings):
            log.info("no replay ever took a retention lease: nothing to converge")
            return []
        if (params or {}).get("dry_run"):
            held = active_leases(settings, end_expired=False)
            log.info("leases holding: %s", ", ".join(lease.ref for lease in held) or "none")
            return [lease.ref for lease in held]
        changes = converge_topics(settings)
        for change in changes:
            log.info("topic %s", change)
        held = [lease.ref for lease in active_leases(settings)]
        log.info("leases holding: %s", ", ".join(held) or "none")
        return held

    @task
    @records_failure
    def clean_airflow_history(params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``airflow db clean`` of what is older than ``airflow_history_days``: a CLI of its own, the task
        itself never touches the metadata database."""
        import os
        import subprocess
        import sys
        import time
        from datetime import UTC, datetime

        from kappa.config import Settings

        params = params or {}
        days = int(params.get("airflow_history_days") or 30)
        before = (datetime.now(UTC) - timedelta(days=days)).replace(microsecond=0)
        command = [sys.executable, "-m", "airflow", "db", "clean", "--clean-before-timestamp", before.isoformat(),
                   "--skip-archive", "--yes", "--error-on-cleanup-failure"]
        if params.get("dry_run"):
            command.append("--dry-run")
        # Airflow 3 hides the metadata database from a task: its URL in the task's environment is a placeholder
        # (airflow-db-not-allowed:///). The CLI gets the real one: KAPPA_AIRFLOW_DB_CONN where the URL comes
        # from the environment only (the chart), else Airflow's own configuration (the local stack's airflow.cfg)
        env = {key: value for key, value in os.environ.items()
               if not (key.endswith("__SQL_ALCHEMY_CONN") and value.startswith("airflow-db-not-allowed"))}
        conn = Settings.from_env().airflow_db_conn
        if conn:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = conn
        for attempt in range(3):  # a SQLite database (the local stack's) is locked while the scheduler writes
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
            lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            if done.returncode == 0 or "database is locked" not in done.stdout + done.stderr or attempt == 2:
                break
            time.sleep(10)
        for line in lines[-40:]:
            log.info("airflow db clean: %s", line)
        if done.returncode != 0:
            raise AirflowFailException(f"airflow db clean failed (exit {done.returncode}): "
                                       f"{lines[-1] if lines else 'no output'}")
        return {"before": before.isoformat(), "dry_run": bool(params.get("dry_run"))}

    @task
    @records_failure
    def keep_registry(params: dict[str, Any] | None = None) -> dict[str, str]:
        """Compact, VACUUM and checkpoint the control plane's tables in the lake (kappa.runtime.upkeep)."""
        from kappa.config import Settings
        from kappa.runtime.upkeep import keep_registry as keep

        if (params or {}).get("dry_run"):
            return {}
        done = {name: kept.line() for name, kept in keep(Settings.from_env().lake_uri).items()}
        for name, line in done.items():
            log.info("_registry/%s: %s; checkpointed", name, line)
        return done

    retire_expired()
    end_expired_leases()
    clean_airflow_history()
    keep_registry()


kappa_retire()

"""
### kappa_rollback — serve a kept earlier version of a view again

Points the view's serving alias back to `to_version` (a `retired` version whose table is still kept, see
`keep_hours` of the replay that replaced it), restarts that version's job so it catches up with the log, and
stops the job of the version it replaces. One call into `kappa.control.replay.rollback` — the same code as
`kappa rollback VIEW --to N`. The switch is one Delta commit: readers see the old pointer or the new one.

`to_version` is required: a rollback relative to "the previous version" would undo itself when retried.
Running the DAG again with the same parameters is a no-op. `cascade`: the views over this one (views of views)
switch back with it, to their kept versions over `to_version`, in the same alias commit.

    airflow dags trigger kappa_rollback --conf '{"view": "campaign_window_counts", "to_version": 1}'
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk import Param, dag, task

from kappa.catalog import platform_file
from kappa.config import DEFAULT_KEEP_HOURS
from kappa.errors import one_line
from kappa.front.airflow_tasks import records_failure

log = logging.getLogger(__name__)

DAG_ID = Path(__file__).stem
#: Views declared in kappa/platform.yaml (a local file, read with yaml only: no network, no Spark).
VIEWS: list[str] = sorted((yaml.safe_load(platform_file().read_text(encoding="utf-8")) or {}).get("views") or {})


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
        "view": Param(type="string", enum=VIEWS, title="View", description="View of kappa/platform.yaml."),
        "to_version": Param(type="integer", minimum=1, title="Version to serve again",
                            description="A retired version whose table is still kept."),
        "keep_hours": Param(DEFAULT_KEEP_HOURS, type="number", minimum=0, title="Keep replaced version (hours)",
                            description="How long the replaced version's table is kept."),
        "cascade": Param(False, type="boolean", title="Cascade to the views over it",
                         description="Also switch the views over it back to their kept versions over to_version, "
                                     "in the same alias commit."),
    },
)
def kappa_rollback() -> None:
    @task
    @records_failure
    def rollback(params: dict[str, Any] | None = None, run_id: str | None = None) -> dict[str, Any]:
        """Alias back to ``to_version``, its job restarted, the replaced version's job stopped."""
        from kappa.control import replay
        from kappa.config import Settings
        from kappa.control.runners import runner_for

        params = params or {}
        try:
            settings = Settings.from_env()
            result = replay.rollback(params["view"], int(params["to_version"]), settings,
                                     runner_for(settings), by=f"airflow:{DAG_ID}:{run_id}",
                                     keep_hours=float(params.get("keep_hours", DEFAULT_KEEP_HOURS)),
                                     cascade=bool(params.get("cascade", False)))
        except ValueError as exc:  # refused by the platform: fail at once, one line, no retries
            raise AirflowFailException(one_line(exc)) from None
        log.info("%s", result.message)
        return {"view": result.view, "version": result.version, "previous_version": result.previous_version,
                "changed": result.changed, "message": result.message}

    rollback()


kappa_rollback()

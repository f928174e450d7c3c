"""Replays: build a new view version from the retained log, check it, and switch readers to it atomically.

This package is the one code path behind ``kappa replay`` / ``promote`` / ``rollback`` / ``verify`` / ``retire``
(CLI) and the ``kappa_replay`` / ``kappa_rollback`` / ``kappa_retire`` DAGs: both only parse their inputs into a :class:`ReplayRequest` and call
these functions, so a replay behaves the same whoever triggers it. Every step is idempotent (a retried step
changes nothing), and readers keep resolving the serving alias to the old, complete version until
:func:`promote` switches it in one Delta commit.

The flow::

    preflight  the view's stream topic still retains the requested start on every partition, else the topic's
               archive holds what it no longer does (handover offsets; a gap is refused, named); estimate records,
               bytes and ETA; refuse a version that already runs
    launch     register the version (state building, resolved start offsets) and start its job via the runner
    progress   processed offsets from the job's checkpoint vs. the log end (live) or the end timestamp (bounded);
               follow: progress until caught up
    caught_up  live: lag small; bounded: the job finished and processed everything before the end -> caught_up
    verify     read the new table at its latest Delta version, find the micro-batch it holds (Delta txn of the
               version's appId), re-run the version's own transform over exactly those micro-batches
               (kappa.verify.recompute) and, where one exists, the plain-Python oracle; require equality and the
               version's expectations within their limits -> verified (or failed, serving untouched); write the
               diff report against the serving version (kappa.verify.diffreport)
    promote    switch the alias (kappa.control.serving), stop the old version's job, refresh the Spark SQL catalog views
    watch      for a while after the switch, roll back when the new version breaks (kappa.control.replay.watch)
    rollback   alias back to a kept version, restart its job, stop the other one
    retire     delete the tables of retired versions whose keep period passed

Example:
    >>> from kappa.config import Settings  # doctest: +SKIP
    >>> from kappa.control import replay  # doctest: +SKIP
    >>> from kappa.control.runners import runner_for  # doctest: +SKIP
    >>> s = Settings.from_env(); runner = runner_for(s)  # doctest: +SKIP
    >>> req = replay.ReplayRequest(view="campaign_window_counts", version=2, triggered_by="cli:alice")  # doctest: +SKIP
    >>> pre = replay.preflight(req, s, runner); print(pre.summary())  # doctest: +SKIP
    >>> replay.launch(req, s, runner, pre)  # doctest: +SKIP
    >>> while not replay.caught_up("campaign_window_counts", 2, s, runner, by="cli:alice"): ...  # doctest: +SKIP
    >>> replay.verify("campaign_window_counts", 2, s, "strict", by="cli:alice").passed  # doctest: +SKIP
    True
    >>> replay.promote("campaign_window_counts", 2, s, runner, by="cli:alice")  # doctest: +SKIP

Each step has its own module, and :class:`ViewVersion` resolves a ``(view, version)`` once into everything the
steps need (module, topic, paths, run identity):

=====================  =================================================================================
``request``            :class:`ReplayRequest` (CLI options / DAG Params), validation, offsets parsing
``version``            :class:`ViewVersion`, registry and alias handles
``planning``           :func:`preflight`, :class:`Preflight` (also the whole of a dry run)
``upgrade``            upgrade modes: :func:`continue_point` (seed and start of a ``continue`` version)
``repair``             partial-range replay: :func:`~kappa.control.replay.repair.repair_range`
``launching``          :func:`launch`, :func:`adopt_serving`
``following``          :func:`progress`, :func:`caught_up`; :func:`with_reading`: what a running micro-batch
                       has read
``verification``       :func:`verify`, :class:`Verification`, :func:`expectations_check`
``switch``             :func:`promote`, :func:`promote_chain`, :func:`rollback`, :func:`retire_expired`, the Spark
                       SQL catalog
``cascade``            views of views: the dependency graph, cascading replays
                       (:func:`~kappa.control.replay.cascade.chain`)
``watch``              the watch window after a switch, automatic rollback
=====================  =================================================================================
"""

from __future__ import annotations

from kappa.runtime.checkpoint import checkpoint_batches
from kappa.control.replay.launching import adopt_serving, launch
from kappa.control.replay.planning import MIN_MEASURED_RECORDS, THROUGHPUT_HISTORY, Preflight, measured_throughput, preflight
from kappa.control.replay.following import CatchUp, Progress, caught_up, follow, progress, with_reading
from kappa.control.replay.request import (DEFAULT_MAX_LAG, END_MODES, START_MODES, VERIFY_MODES, ReplayError, ReplayRequest,
                                  VersionBusy, offsets_from_json, parse_end, parse_start, spark_offsets)
from kappa.control.replay.upgrade import continue_point, upgrade_mode
from kappa.control.replay.switch import (catalog_sql_path, promote, promote_chain, retire_expired, rollback,
                                        spark_catalog, write_catalog_sql)
from kappa.control.replay.verification import Verification, expectations_check, table_rows, verify
from kappa.control.replay.version import (ViewVersion, alias_of, committed_offsets, module_of, registry_of, run_app_id,
                                  stream_topic)

__all__ = [
    "DEFAULT_MAX_LAG", "END_MODES", "MIN_MEASURED_RECORDS", "START_MODES", "THROUGHPUT_HISTORY", "VERIFY_MODES",
    "CatchUp", "Preflight", "Progress", "ReplayError", "ReplayRequest", "Verification", "VersionBusy", "ViewVersion",
    "adopt_serving", "alias_of", "catalog_sql_path", "caught_up", "checkpoint_batches", "committed_offsets",
    "continue_point", "upgrade_mode",
    "expectations_check", "follow", "launch", "measured_throughput", "module_of", "offsets_from_json", "parse_end",
    "parse_start", "preflight", "progress", "promote", "promote_chain",
    "registry_of", "retire_expired", "rollback", "run_app_id",
    "spark_catalog", "spark_offsets", "stream_topic", "table_rows", "verify",
    "with_reading", "write_catalog_sql",
]

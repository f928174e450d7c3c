"""Launch: register the version (state ``building``), take its retention lease and start its job; adopt the
version serving by default."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Mapping

from kappa.errors import one_line
from kappa.identity import app_id
from kappa.control.leases import release, take
from kappa.control.registry import RegistryError, VersionRecord
from kappa.control.replay.planning import Preflight
from kappa.control.replay.request import ReplayError, ReplayRequest, spark_offsets
from kappa.control.replay.version import ViewVersion, alias_of, registry_of

if TYPE_CHECKING:  # pragma: no cover
    from kappa.config import Settings
    from kappa.control.runners.base import Runner

__all__ = ["adopt_serving", "launch"]

log = logging.getLogger("kappa.control.replay")


def adopt_serving(view: str, settings: Settings, *, by: str, exclude: int | None = None) -> VersionRecord | None:
    """Track the version that serves by default (no alias yet) in the registry, so a promote can retire it.

    Before the first switch a view resolves to its catalog ``default_version``, which ``kappa up`` runs without
    registering. When that version has a table, it is registered (code of the catalog module), walked to
    ``serving`` with notes saying it was adopted without verification, and the alias is pointed at it
    explicitly. Idempotent; returns None when there is nothing to adopt.
    """
    alias = alias_of(settings)
    registry = alias.registry
    if alias.alias(view) is not None or registry.serving(view) is not None:
        return None
    from deltalake import DeltaTable

    from kappa.catalog import load_catalog

    default = load_catalog().views[view].default_version
    if default == exclude or registry.get(view, default) is not None:
        return None  # the default version is being managed through the registry already
    vv = ViewVersion.resolve(view, default, settings)
    if not DeltaTable.is_deltatable(vv.paths.table):
        return None
    info = vv.run_info()
    starting = info.get("starting") or {}
    if isinstance(starting, Mapping):
        starting = starting.get("startingOffsets") or (
            f"ts:{starting['startingTimestamp']}" if starting.get("startingTimestamp") else "earliest")
    start_offsets = info.get("start_offsets")
    rec = registry.register(
        view, default, code_module=vv.module, table_path=vv.paths.table,
        app_id=vv.app_id() or app_id(vv.name, vv.version, "pending"), starting=str(starting), triggered_by=by,
        start_offsets=spark_offsets(vv.topic, {int(p): int(o) for p, o in start_offsets.items()})
        if start_offsets else None)
    note = "adopted: served as default_version before the registry tracked it (not re-verified)"
    for state in ("caught_up", "verified"):
        if rec.state in {"building", "caught_up"}:  # a concurrent adopter may be ahead: same steps, no-ops
            rec = registry.set_state(view, default, state, by=by, note=note)
    if rec.state == "verified":
        alias.promote(view, default, by=by)
    return registry.get(view, default)


def launch(req: ReplayRequest, settings: Settings, runner: Runner, pre: Preflight) -> VersionRecord:
    """Register the version (state ``building``) and start its job; idempotent.

    Re-registering the same code is a no-op, a job that already runs is left alone, a ``failed`` version is
    moved back to ``building`` and its job restarted (it resumes from its checkpoint). The version serving by
    default is adopted first (:func:`adopt_serving`).

    Raises:
        ReplayError: The registry refused (other code, retired version...) or the runner failed.
    """
    from kappa.runtime.driver import JobSpec

    req.validate()
    if pre.request.view != req.view or pre.request.version != req.version:
        raise ReplayError(f"preflight was for {pre.request.ref}, not {req.ref}")
    vv = ViewVersion.resolve(req.view, req.version, settings)
    registry = registry_of(settings)
    try:
        adopt_serving(req.view, settings, by=req.triggered_by, exclude=req.version)
        existing = registry.get(req.view, req.version)
        if pre.archive is not None and existing is None:
            _archive_still_holds(settings, vv, req, pre)
        run_id = vv.ensure_run_id(existing, seed=pre.seed, archive=pre.archive)
        rec = registry.register(
            req.view, req.version, code_module=vv.module, table_path=vv.paths.table,
            app_id=app_id(req.view, req.version, run_id), starting=pre.starting, triggered_by=req.triggered_by,
            start_offsets=pre.starting)
        if rec.state == "retired":
            raise ReplayError(f"{req.ref} is retired; use `{settings.cli} rollback {req.view} --to {req.version}`")
        if rec.state == "failed":
            rec = registry.set_state(req.view, req.version, "building", by=req.triggered_by, expected={"failed"},
                                     note=f"relaunched after failure: {rec.note or '?'}")
    except RegistryError as exc:
        raise ReplayError(one_line(exc)) from None
    if rec.state == "building":  # the log it is about to read stays until it has read it (kappa.control.leases)
        # (the archive's records too: its keeper deletes nothing of a topic a lease holds)
        try:
            take(settings, vv.topic, req.view, req.version, by=req.triggered_by)
        except Exception as exc:  # noqa: BLE001 - Kafka / lake errors become one line
            raise ReplayError(f"{req.ref}: taking the retention lease on {vv.topic} failed: {one_line(exc)}") from None
    status = runner.status(req.view, req.version)
    if status.state != "running" and not (status.state == "finished" and req.bounded):
        spec = JobSpec(req.view, req.version, starting=rec.starting, end_timestamp_ms=req.end_timestamp_ms,
                       max_offsets_per_trigger=req.max_offsets_per_trigger,
                       metrics_port=req.metrics_port)
        try:
            status = runner.start(spec)
        except Exception as exc:  # noqa: BLE001 - runner errors (process, Kubernetes API) become one line
            raise ReplayError(f"{req.ref}: starting the job failed: {one_line(exc)}") from None
        log.info("%s: job %s (%s) %s", req.ref, status.state, status.detail, status.metrics_url or "")
    return rec


def _archive_still_holds(settings: "Settings", vv: ViewVersion, req: ReplayRequest, pre: Preflight) -> None:
    """A new run with an archive part: take the topic's lease (from now on the archive's keeper deletes nothing
    of it), then check that the archive still holds what preflight planned to read from it - its retention may
    have removed records between the two.

    Raises:
        ReplayError: A record of ``[start, handover)`` is gone (the lease released again; nothing registered).
    """
    from kappa.runtime.archive import ArchiveError, coverage

    plan = pre.archive or {}
    start = {int(p): int(o) for p, o in plan["start"].items()}
    wanted = {int(p): (start.get(int(p), 0), int(h)) for p, h in plan["handover"].items()
              if int(h) > start.get(int(p), 0)}
    try:
        take(settings, vv.topic, req.view, req.version, by=req.triggered_by)
    except Exception as exc:  # noqa: BLE001 - Kafka / lake errors become one line
        raise ReplayError(f"{req.ref}: taking the retention lease on {vv.topic} failed: {one_line(exc)}") from None
    try:
        held = coverage(plan["table"], wanted)
        gone = [f"partition {p} [{lo}, {hi})" for p, (lo, hi) in sorted(wanted.items())
                if p not in held or not held[p].contiguous or (held[p].low, held[p].high) != (lo, hi)]
        problem = f"no longer holds {', '.join(gone)}" if gone else None
    except ArchiveError as exc:
        problem = one_line(exc)
    if problem:
        release(settings, req.view, req.version, by=req.triggered_by, note="the archive changed after preflight")
        raise ReplayError(f"{req.ref}: the archive {plan['view']} {problem} - its retention removed records after "
                          "preflight planned the replay; nothing was started: replay again (preflight plans from "
                          "what the log and the archive hold now)")
